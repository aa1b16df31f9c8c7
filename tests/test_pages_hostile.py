"""The HTML pages (``gpuslo report`` with its chargeback and what-if sections, ``gpuslo job
--html``) with hostile names in every field that reaches them, and the numbers at their edges.

The oracle for the markup: the page of a fleet whose names are all hostile (tests/hostile.py)
parses (html.parser) to the same elements and attributes as the page of the same fleet with
plain names; each name reads back, as text, as what the reader must see (its controls and
bidirectional overrides shown as escapes, derived here, not by the code under test); and no
control character or bidirectional override is left anywhere in the page. (Its own module:
chDB holds one data directory per process.)"""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from gpuslo.core.display import amount, pct
from gpuslo.dashboards.pagetext import esc
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.config import RulesConfig
from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch, NodeHeartbeat, SchedulerEvent
from tests import helpers as h
from tests.helpers import T0
from tests.hostile import corpus, few_names

# what a page must never hold raw: C0 controls but tab and newline, DEL, C1, and the
# bidirectional marks, embeddings, overrides and isolates (Unicode's Bidi_Control property)
BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
UNSAFE = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\t\n"} | set(BIDI)


class Parsed(HTMLParser):
    """The elements (tag, attribute names), the attribute values and the text of a page."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, ...]] = []
        self.values: list[str] = []
        self.text: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, *sorted(k for k, _ in attrs)))
        self.values += [v or "" for _, v in attrs]

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag: str) -> None:
        self.tags.append(("/" + tag,))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _escape_of(c: str) -> str:
    return {"\t": "\\t", "\n": "\\n", "\r": "\\r"}.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    )


def expected(name: str) -> str:
    """``name`` as the reader must see it (the oracle, independent of gpuslo.core.display)."""
    return "".join(_escape_of(c) if c in UNSAFE else c for c in name)


@pytest.mark.parametrize("name", corpus())
def test_every_hostile_name_is_one_text_node_and_one_attribute_value(name: str) -> None:
    p = Parsed(f'<td title="{esc(name)}">{esc(name)}</td>')
    assert p.tags == [("td", "title"), ("/td",)]
    assert p.values == [expected(name)] and "".join(p.text) == expected(name)
    assert not UNSAFE & set(esc(name))


def test_no_page_escapes_on_its_own() -> None:
    """Every page module goes through pagetext.esc (a value escaped with html.escape alone kept
    its U+202E and its controls)."""
    pages = Path(__file__).parents[1] / "dashboards"
    for f in pages.glob("*.py"):
        if f.name != "pagetext.py":
            assert "html.escape" not in f.read_text() and "import html\n" not in f.read_text(), f.name


def _parse_pct(text: str) -> tuple[str, float, int]:
    m = re.fullmatch(r"([<>] )?(-?\d+(?:\.(\d+))?) %", text)
    assert m, text
    return (m.group(1) or "").strip(), float(m.group(2)), len(m.group(3) or "")


EDGES = sorted(
    {0.0, 1.0, 0.5, -2.5, 2.0}
    | {s * 10.0**-k for k in range(1, 13) for s in (1, -1)}
    | {1 + s * 10.0**-k for k in range(1, 13) for s in (1, -1)}
    | {0.99995, 0.999949, 0.9995, 0.00005, 0.00049}
)


@pytest.mark.parametrize("places", [0, 1, 2])
@pytest.mark.parametrize("x", EDGES)
def test_a_percentage_never_claims_a_bound_it_does_not_reach(x: float, places: int) -> None:
    """0.99995 was "100.0 %" (an SLI short of a 99.99 % objective read as perfect), 1e-6 "0.0 %"
    and -1e-6 "-0.0 %": the shown number is within half its last place of 100·x, never 0 or 100
    unless x is, and a bound where the places run out."""
    text = pct(x, places)
    sign, v, used = _parse_pct(text)
    assert used >= places and not text.startswith("-0 ") and not re.match(r"-0(\.0+)? %", text)
    if sign == "<":
        assert 100 * x < v and v - 100 * x <= 10.0**-used
    elif sign == ">":
        assert 100 * x > v and 100 * x - v <= 10.0**-used
    else:
        assert abs(v - 100 * x) <= 0.5 * 10.0**-used + 1e-9
        assert (v in (0.0, 100.0)) == (x in (0.0, 1.0)), text


@pytest.mark.parametrize("x", [None, math.nan, math.inf, -math.inf])
def test_no_number_is_a_dash(x: float | None) -> None:
    assert pct(x) == "–" and pct(x, none="-") == "-"


@pytest.mark.parametrize("grouping", [False, True])
@pytest.mark.parametrize("places", [1, 2])
@pytest.mark.parametrize("x", sorted({*EDGES, 1234.56, -98765.4321, 0.04, 0.05, 0.049}))
def test_an_amount_is_never_shown_as_zero_unless_it_is(x: float, places: int, grouping: bool) -> None:
    """0.04 GPU-hours of idle was "0.0" (read as none): an amount is within half its last place
    of x, 0 only when x is, and a bound ("< 0.0001") where the places run out; never "-0.0"."""
    text = amount(x, places, grouping=grouping)
    assert not re.match(r"[<>]? ?-0(\.0+)?$", text), text
    m = re.fullmatch(r"([<>] )?(-?[\d,]+(?:\.(\d+))?)", text)
    assert m, text
    v, used = float(m.group(2).replace(",", "")), len(m.group(3) or "")
    assert ("," in text) == (grouping and abs(x) >= 1000)
    if m.group(1) == "< ":
        assert 0 < x < v and v <= 10.0**-used
    elif m.group(1) == "> ":
        assert v < x < 0 and -v <= 10.0**-used
    else:
        assert used >= places and abs(v - x) <= 0.5 * 10.0**-used + 1e-9
        assert (v == 0.0) == (x == 0.0), text
    assert amount(None) == "–" and amount(math.nan, none="-") == "-"


# ---------------------------------------------------------------------------- the pages


def _fleet(names: list[str], cluster: str) -> list[object]:
    """Two hours of a fleet: one node per name (pool, model, job, user, account, queue, job name
    all that name), its GPU idle and held; a request per name that waited 20 minutes (a
    starvation incident) then started; and an SLO's latency."""
    msgs: list[object] = []
    for i, n in enumerate(names):
        for k in range(12):
            t = T0 + 600 * k
            alloc = Allocation(scheduler="slurm", id=n, name=n, user=n, account=n, queue=n, share=1.0)
            g = GpuSample(index=0, uuid=f"GPU-{i}", model=n, fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.01 * (i % 3)},
                          allocations=(alloc,))  # fmt: skip
            env = {**h.env(f"src-{i}", t, cluster)}
            msgs.append(GpuSampleBatch(**env, node=n, pool=n, interval_s=600.0, gpus=(g,)))
            msgs.append(NodeHeartbeat(**h.env(f"src-{i}", t, cluster), node=n, pool=n, interval_s=600.0,
                                      schedulable=True, state="idle", gpus=1))  # fmt: skip
        for ev, t in (("submit", T0 + 60 * i), ("start", T0 + 60 * i + 1200 + i)):
            msgs.append(SchedulerEvent(**h.env("collector", t, cluster), scheduler="slurm", event=ev, request_id=n,
                                       name=n, queue=n, pool="", gpus_per_node=1.0, nodes=1, user=n, account=n))  # fmt: skip
    for k in range(120):
        d = h.latency(T0 + 60 * k, 90, 10 if k % 10 else 400, service=names[0])
        msgs.append(d.model_copy(update={"cluster": cluster}))
    return msgs


CURRENCY = "</h3><b>\u2066"
SLO_NAMES = ['"><script>alert(1)</script>', "\u202eevil", "a\x00b\x1b[2J", "x</style><svg onload=alert(1)>"]


def _config(names: list[str], slo_names: list[str], currency: str) -> RulesConfig:
    slos = [{"name": s, "service": names[0], "threshold_ms": 5.0, "min_requests": 1} for s in slo_names]
    return RulesConfig.model_validate(
        {"slos": slos, "chargeback": {"currency": currency, "per_gpu_hour": {names[0]: 2}}}
    )


def _pages(
    store: ChdbStore, names: list[str], cluster: str, slo_names: list[str], currency: str
) -> list[str]:
    from gpuslo.dashboards import jobpage, report
    from gpuslo.ingest.writer import write
    from gpuslo.rules import jobreport

    write(store, _fleet(names, cluster))  # type: ignore[arg-type]
    cfg = _config(names, slo_names, currency)
    out = [report.render(store, cfg, T0, T0 + 7200, c) for c in ("", cluster)]
    for n in names[:3]:
        ref = jobreport.resolve(store, n, cluster)
        out.append(jobpage.render(jobreport.report(store, cfg, ref, T0, T0 + 7200)))
    return out


@pytest.mark.integration  # slow: several reports over one store
def test_hostile_names_change_no_element_of_the_pages(tmp_path: Path) -> None:
    from gpuslo.rules.tables import SCHEMA

    hostile = few_names()
    plain = [f"name{i}" for i in range(len(hostile))]
    cluster = '"><img src=x onerror=alert(1)>\u202e'
    pages = {}
    for kind, names, cl, slos, cur in (
        ("plain", plain, "cluster", [f"slo{i}" for i in range(len(SLO_NAMES))], "EUR"),
        ("hostile", hostile, cluster, SLO_NAMES, CURRENCY),
    ):
        s = ChdbStore(tmp_path / kind)
        try:
            s.migrate(SCHEMA)
            pages[kind] = _pages(s, names, cl, slos, cur)
        finally:
            s.close()
    for good, bad in zip(pages["plain"], pages["hostile"], strict=True):
        p, q = Parsed(good), Parsed(bad)
        assert p.tags == q.tags  # no element or attribute injected, none lost
        assert not UNSAFE & set(bad), sorted(UNSAFE & set(bad))
    _all_clusters, report_one, *jobs = (Parsed(x) for x in pages["hostile"])
    text = "".join(report_one.text)
    assert f"cluster {expected(cluster)} · generated" in text  # the reversal ends with the name
    for n in hostile:  # every account has its chargeback row
        assert expected(n) in text, n
    for s in SLO_NAMES:
        assert f"SLO {expected(s)}" in text
    assert f"cost {expected(CURRENCY)}" in text
    for n, page in zip(hostile[:3], jobs, strict=False):
        jt = "".join(page.text)
        assert f"gpuslo job report: {expected(n)}" in jt and f"{expected(n)} / {expected(n)}" in jt


@pytest.mark.integration  # chDB and Chromium
def test_long_names_keep_the_pages_in_the_window(tmp_path: Path) -> None:
    """Names of 256 characters without a space (the longest the wire takes) made the report
    7,180 px wide and the job page 3,669 px in a 1,300 px window (cards, table cells and the
    subtitle grew to the name); laid out by Chromium, each page is now no wider than the window.
    (The width is read by a script added to a copy of the page: the page itself has none.)"""
    import subprocess

    from gpuslo.rules.tables import SCHEMA
    from tests.test_report import FLAGS, chromium

    names = ["n" * 256, "x" * 200 + "/" + "y" * 55, "short"]
    s = ChdbStore(tmp_path / "store")
    try:
        s.migrate(SCHEMA)
        _all, report_page, job_page, *_ = _pages(s, names, "c" * 256, ["s" * 256], "E" * 256)
    finally:
        s.close()
    probe = "<script>document.body.dataset.width = document.documentElement.scrollWidth</script></body>"
    for name, page in (("report", report_page), ("job", job_page)):
        f = tmp_path / f"{name}.html"
        f.write_text(page.replace("</body>", probe), encoding="utf-8")
        dom = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={tmp_path / 'chrome'}", "--window-size=1300,1600",
                              "--dump-dom", f.as_uri()], capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
        width = re.search(r'data-width="(\d+)"', dom)
        assert width and int(width.group(1)) <= 1300, (name, width and width.group(1))

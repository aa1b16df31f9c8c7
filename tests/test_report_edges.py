"""The HTML report where the window has no numbers to show: no GPU capacity, no requests of an
SLO, an SLO the engine refused, a service that went silent. Each card and chart says so (and
why) rather than a 0 that reads as a measurement or an empty frame. (Its own module: chDB
holds one data directory per process.)"""

from __future__ import annotations

from datetime import UTC, datetime
from html.parser import HTMLParser

import pytest

from gpuslo.dashboards.report import render
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.config import RulesConfig, Slo
from tests import helpers as h
from tests.helpers import T0

pytestmark = pytest.mark.integration  # chDB, a report each


class Page(HTMLParser):
    """The cards (title → (value, detail)) and, per chart, its texts."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.cards: dict[str, tuple[str, str]] = {}
        self.charts: list[list[str]] = []
        self._card: list[str] | None = None
        self._in: str | None = None
        self._svg = False
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        cls = dict(attrs).get("class")
        if cls == "card":
            self._card = []
        elif self._card is not None and cls in ("k", "v", "d"):
            self._in = cls
        if tag == "svg":
            self._svg = True
            self.charts.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._svg = False
        if tag == "div" and self._in:
            self._in = None
            if self._card is not None and len(self._card) == 3:
                k, v, d = self._card
                self.cards[k] = (v, d)
                self._card = None

    def handle_data(self, data: str) -> None:
        if self._in and self._card is not None:
            self._card.append(data)
        if self._svg:
            self.charts[-1].append(data)


def _t(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")


CHARTS = ("utilization", "idle", "incidents")  # then one per SLO


def test_a_window_without_data_says_no_data(store: ChdbStore) -> None:
    """An empty store: the CUR and idle cards read "0.0" idle GPU-hours and "0.0 GPU-h capacity",
    the charts were empty frames, the what-if table a row of zeros per policy."""
    cfg = RulesConfig(slos=(Slo(name="lat", service="svc", threshold_ms=5.0),))
    page = render(store, cfg, T0, T0 + 3600)
    p = Page(page)
    for k in ("Allocation CUR", "Active CUR", "Idle GPU-hours", "SLO lat"):
        assert p.cards[k][0] == "no data", (k, p.cards[k])
    assert "no GPU capacity" in p.cards["Idle GPU-hours"][1] and "no requests" in p.cards["SLO lat"][1]
    assert len(p.charts) == len(CHARTS) + 1
    for name, texts in zip([*CHARTS, "slo"], p.charts, strict=True):
        # the incidents chart has its zeros: nothing opened is what is known
        assert ("no data" in texts) == (name != "incidents"), name
    assert "nothing to replay" in page and "<td>recorded</td>" not in page


def test_a_window_with_data_shows_its_numbers_and_says_what_it_lacks(store: ChdbStore) -> None:
    """Two hours of one GPU held half the time and never active; the service's requests only in
    the first half hour; one SLO whose threshold is not a bucket bound (the engine refuses it:
    the card showed "–" with no reason, where the terminal says why)."""
    msgs: list[object] = []
    for k in range(12):
        t = T0 + 600 * k
        held = (("j1", 1.0),) if k % 2 else ()
        msgs.append(h.batch("n1", t, [h.gpu(0, 0.0, held)], interval_s=600.0))
        msgs.append(h.heartbeat("n1", t, True, interval_s=600.0, gpus=1))
    msgs += [h.latency(T0 + 60 * k, 90, 10) for k in range(1, 31)]  # ts in (T0, T0 + 1800]
    msgs += [h.latency(T0 + 60 * k, 3, 7, service="low") for k in range(1, 121)]  # an SLI of 30 %
    write(store, msgs)  # type: ignore[arg-type]
    cfg = RulesConfig(
        slos=(
            Slo(name="ok", service="svc", threshold_ms=5.0),
            Slo(name="off", service="svc", threshold_ms=3.0),
            Slo(name="low", service="low", threshold_ms=5.0),
        )
    )
    p = Page(render(store, cfg, T0, T0 + 7200))
    assert p.cards["Allocation CUR"][0] == "50.0 %" and p.cards["Active CUR"][0] == "0.0 %"
    assert p.cards["Idle GPU-hours"][0] == "2.0"
    value, detail = p.cards["SLO ok"]
    assert value == "90.0 %" and f"no latency data since {_t(T0 + 1800)}" in detail
    value, detail = p.cards["SLO off"]
    assert value == "not evaluated" and "threshold_ms 3 is not a bucket bound" in detail
    assert all("no data" not in texts for texts in p.charts)
    off, low = p.charts[-2:]
    assert "not evaluated (see its card)" in off  # the refused SLO's chart draws nothing
    assert p.cards["SLO low"][0] == "30.0 %"
    # its axis reaches the 99 % objective (fitted to 30 %, it ended at 40 %, the objective on it)
    assert "100.0%" in low and "40.0%" not in low


def test_an_slo_whose_service_never_sent_a_row_says_so_on_the_page_and_in_the_terminal(
    store: ChdbStore,
) -> None:
    """A misspelt service (``svcc``) while the agents report: the engine judges it not evaluable
    (``never_seen``, the ticket asking whether the names match), but the report's card said "no
    requests in the window" (a quiet service's words) and the terminal summary said nothing of
    it, nor of a service whose rows stopped. Both say the ticket's reason now."""
    from gpuslo.app.text import summary as text_summary
    from gpuslo.rules.evaluate import summary

    msgs: list[object] = [h.heartbeat("n1", T0 + 600 * k, True, interval_s=600.0, gpus=1) for k in range(12)]
    msgs += [h.latency(T0 + 60 * k, 90, 10) for k in range(1, 31)]  # svc: rows stop at T0 + 1800
    write(store, msgs)  # type: ignore[arg-type]
    cfg = RulesConfig(slos=(Slo(name="typo", service="svcc", threshold_ms=5.0),
                            Slo(name="ok", service="svc", threshold_ms=5.0)))  # fmt: skip
    value, detail = Page(render(store, cfg, T0, T0 + 7200)).cards["SLO typo"]
    assert value == "no data" and "no requests" not in detail
    assert "no latency histogram of service 'svcc' ever" in detail and "service (or cluster) name" in detail
    text = text_summary(summary(store, cfg, T0, T0 + 7200))
    lines = [x for x in text.splitlines() if "not evaluable" in x]
    assert lines == [
        "SLO typo: not evaluable: no latency histogram of service 'svcc' ever, while the cluster's agents have been "
        "reporting: is the SLO's service (or cluster) name the one the service sends, and is it instrumented?",
        f"SLO ok: not evaluable: no latency histogram of service 'svc' since {_t(T0 + 1800)}:00 UTC (90 min): "
        "its scrape, its agent or the service is down",
    ]

"""An SLO of a service whose latency deltas come less often than its shortest burn window (an agent
scraping a latency page every 10 min, a batchy exporter): a delta covers ``(ts - interval_s, ts]``.
The SLO was said not evaluable 5 min (no_data_s) after each row and evaluable again at the next
(the GpusloSLONotEvaluable ticket flapped every interval), and a 5 m short window held a whole
10-minute delta half the time and nothing the other half (the 1h/5m page fired and resolved with
every row once the ticket stopped hiding it). Now a row stands for its service until twice its
interval has passed (rules.config.row_hold_s), and a window pair whose short window is shorter
than that is not judged (its alert kept as it was, and a ticket says why). Swept over the wire's
intervals (1 s to a day) and over evaluation times across an interval, raw rows and rollups.
Its own module: the function-scoped chDB store (one data directory per process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup
from gpuslo.rules.alerts import Notifier
from gpuslo.rules.config import RulesConfig, Slo, row_hold_s
from gpuslo.rules.delivery import Outcome
from gpuslo.rules.evaluate import slo_status
from gpuslo.rules.receivers import Receiver
from gpuslo.rules.service import RulesService
from gpuslo.wire.models import MAX_INTERVAL_S
from tests import helpers as h
from tests.helpers import T0

# interval_s -> after how long without a row the SLO (default windows: 5 m shortest) is not
# evaluable, and which window pairs are not judged: written out, not computed with the code's
# formula (twice the interval, up to a whole minute, never under the 5 m of no_data_s)
EDGES: dict[float, tuple[int, tuple[str, ...]]] = {
    1.0: (300, ()),  # the wire's finest
    10.0: (300, ()),  # the ordinary agent tick: as before
    60.0: (300, ()),
    150.0: (300, ()),  # twice it is the window itself: as before
    151.0: (360, ("1h/5m",)),  # 302 s, a whole minute up
    299.0: (600, ("1h/5m",)),  # just under the window
    300.0: (600, ("1h/5m",)),  # equal to it
    301.0: (660, ("1h/5m",)),  # just over it
    600.0: (1200, ("1h/5m",)),  # a multiple of it
    900.0: (1800, ("1h/5m",)),  # 30 m short window is twice it: judged
    901.0: (1860, ("1h/5m", "6h/30m")),
    3600.0: (7200, ("1h/5m", "6h/30m")),  # an hour: the 2 h window is twice it
    float(MAX_INTERVAL_S): (2 * MAX_INTERVAL_S, ("1h/5m", "6h/30m", "1d/2h", "3d/6h")),  # the wire's longest
}


@pytest.mark.parametrize(("iv", "expected"), EDGES.items(), ids=[f"{k:g}s" for k in EDGES])
def test_the_bound_and_the_judged_windows_follow_the_rows_interval(
    iv: float, expected: tuple[int, tuple[str, ...]]
) -> None:
    slo = Slo(name="s", service="svc", threshold_ms=5.0)
    bound, unjudged = expected
    assert slo.stale_bound_s(iv) == bound
    assert tuple(f"{w.long}/{w.short}" for w in slo.unjudged_windows(iv)) == unjudged
    assert slo.stale_bound_s(None) == 300 and slo.unjudged_windows(None) == ()
    # a no_data_s of its own is the floor; the row's interval can only make it longer
    own = Slo(name="s", service="svc", threshold_ms=5.0, no_data_s=60)
    assert own.stale_bound_s(iv) == (bound if bound > 300 else {1.0: 60, 10.0: 60, 60.0: 120, 150.0: 300}[iv])
    assert row_hold_s(iv) % 60 == 0


# the rows' intervals swept in the store: each one's rows for the last 3 hours (at least 3 rows)
SWEPT = (1.0, 60.0, 299.0, 300.0, 301.0, 600.0, 900.0, 3600.0)


def _rows(iv: float, end: float) -> list[float]:
    n = max(3, int(3 * 3600 // iv))
    return [end - iv * k for k in range(n)][::-1]


@pytest.mark.parametrize("iv", SWEPT, ids=[f"{k:g}s" for k in SWEPT])
def test_a_row_is_late_only_once_its_next_one_is_overdue(store: ChdbStore, iv: float) -> None:
    """Evaluation times swept across one interval between two rows (the next one not yet there,
    as the rules service sees it): never not evaluable; after the last row, not evaluable from
    exactly the bound on. Raw rows and rollups alike."""
    end = T0 + 4 * 86400  # a whole minute: rows on whole minutes and seconds after
    times = _rows(iv, end)
    write(store, [h.latency(t, good=50, bad=0, interval_s=iv) for t in times])
    rollup.refresh(store)
    slo = Slo(name="s", service="svc", threshold_ms=5.0, min_requests=1, period_d=7)
    bound, unjudged = EDGES[iv]
    prev = times[-2]  # evaluated as if the last row had not come yet: between prev and end
    every = max(1, int(iv) // 12)
    tos = sorted({*(prev + x for x in range(0, int(iv), every)),
                  *(60 * k for k in range(int(prev // 60) + 1, int(end // 60), max(1, every // 60)))})  # fmt: skip
    for to in tos:
        for source in (False, True):
            if source and to % 60:
                continue  # the rollups evaluate whole minutes (rollup.usable)
            st = slo_status(store, slo, to - 3600, to, rollup=source)
            assert st.no_data_since is None, (iv, to - prev, source)
            assert st.data_interval_s == pytest.approx(iv, rel=1e-6), (iv, source)
            assert st.no_data_after_s == bound, (iv, source)
            assert st.unjudged_windows == unjudged
    # the rows stop: not evaluable exactly from the bound on (whole-minute evaluation times)
    for after in sorted({bound - 120, bound - 60, bound, bound + 60, 2 * bound}):
        for source in (False, True):
            to = end + after
            st = slo_status(store, slo, to - 3600, to, rollup=source)
            assert (st.no_data_since is not None) == (after >= bound), (iv, after, source)
            assert st.last_data_at == end, (iv, after, source)


def _service(
    store: ChdbStore, tmp_path: Path, posted: list[str], now: list[float], source: str
) -> RulesService:
    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.extend(json.loads(body)["text"].splitlines())
        return Outcome("sent", 200, "")

    n = Notifier(tmp_path / f"o-{source}", [Receiver.parse("webhook", "http://hooks/x")], post=post)
    slo = Slo(name="chat-p99", service="svc", threshold_ms=5.0, min_requests=10, period_d=7)
    return RulesService(RulesConfig(slos=(slo,)), lambda: store, window_s=3600, source=source, notifier=n,
                        resend_s=86400, flush_s=5.0, clock=lambda: now[0])  # fmt: skip


@pytest.mark.parametrize("source", ("raw", "rollup"))
@pytest.mark.parametrize(
    "iv",
    [pytest.param(600.0, id="600s"), *(pytest.param(x, id=f"{x:g}s", marks=pytest.mark.integration)
                                       for x in (60.0, 300.0, 900.0, 3600.0))],
)  # fmt: skip
def test_rounds_across_an_interval_neither_fire_nor_resolve_anything_new(
    store: ChdbStore, tmp_path: Path, iv: float, source: str
) -> None:
    """A service burning its budget (every request slow), its deltas every ``iv``: rules rounds
    across one of its intervals (every minute, every 5 min for an hour's). After the first round
    nothing new fires and nothing resolves (before: the ticket, then the 1h/5m page, went on and
    off with every row). Every window pair that can be judged fires; the others never fire, and a
    ticket says which and why."""
    times = _rows(iv, T0 + 4 * 86400)
    write(store, [h.latency(t, good=0, bad=max(20, int(iv)), interval_s=iv) for t in times])
    rollup.refresh(store)
    unjudged = EDGES[iv][1]
    posted: list[str] = []
    start = times[-2]  # the round at the previous row, then across to the last one and past it
    step = 60 * max(1, round(iv / 720))
    now = [start]
    svc = _service(store, tmp_path, posted, now, source)
    try:
        first = svc.round()
        assert first["alerting"]["resolved"] == 0, first["alerting"]
        for k in range(1, int(iv // step) + 2):
            now[0] = start + step * k
            out = svc.round()
            assert (out["alerting"]["new"], out["alerting"]["resolved"]) == (0, 0), (k, out["alerting"])
            assert out["slos"][0]["no_data_since"] is None, k
            assert tuple(out["slos"][0]["unjudged_windows"]) == unjudged, k
        firing = [dict(v["labels"]) for v in svc.engine.state.firing().values()]  # type: ignore[union-attr]
        fired = {x["window"] for x in firing if x["alertname"] == "GpusloSLOBurn"}
        assert fired == {"1h/5m", "6h/30m", "1d/2h", "3d/6h"} - set(unjudged), fired
        tickets = [p for p in posted if p.startswith("FIRING [ticket] GpusloSLONotEvaluable")]
        if unjudged:
            (ticket,) = tickets
            assert f"every {iv:g} s" in ticket and f"burn windows {', '.join(unjudged)} not judged" in ticket
        else:
            assert not tickets
        assert not [p for p in posted if p.startswith("RESOLVED")]
    finally:
        svc.notifier.close()  # type: ignore[union-attr]


def test_a_page_fired_on_frequent_rows_is_kept_when_the_rows_become_seldom(
    store: ChdbStore, tmp_path: Path
) -> None:
    """Rows every minute burning (the 1h/5m page fires), then the agent is set to scrape every
    10 min: the page can no longer be judged, and stays as it was rather than resolving half of
    each interval; when the rows come every minute again it is judged again."""
    switch = T0 + 7200
    write(store, [h.latency(T0 + 60 * k, good=0, bad=100) for k in range(1, 121)])  # until switch
    write(store, [h.latency(switch + 600 * k, good=0, bad=1000, interval_s=600.0) for k in range(1, 7)])
    posted: list[str] = []
    now = [switch]
    svc = _service(store, tmp_path, posted, now, "raw")
    try:
        svc.round()
        assert [p for p in posted if p.startswith("FIRING [page] GpusloSLOBurn") and "over 5m" in p]
        for k in (1, 4, 5, 9, 10, 11, 15, 19, 20, 21, 30, 45, 60):  # the first seldom row at 10
            now[0] = switch + 60 * k
            out = svc.round()
            assert out["alerting"]["resolved"] == 0, (k, out["alerting"])
            assert out["slos"][0]["unjudged_windows"] == (["1h/5m"] if k >= 10 else []), k
        firing = svc.engine.state.firing()  # type: ignore[union-attr]
        assert {dict(v["labels"]).get("window") for v in firing.values()} >= {"1h/5m", "6h/30m"}
        # every minute again, no longer burning: all judged, the page resolves
        write(store, [h.latency(now[0] + 60 * k, good=100, bad=0) for k in range(1, 121)])
        now[0] += 120 * 60
        out = svc.round()
        assert out["slos"][0]["unjudged_windows"] == []
        assert [p for p in posted if p.startswith("RESOLVED [page] GpusloSLOBurn") and "over 5m" in p]
        assert [p for p in posted if p.startswith("RESOLVED [ticket] GpusloSLONotEvaluable")]
    finally:
        svc.notifier.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("source", (False, True), ids=("raw", "rollup"))
def test_each_source_stands_on_its_own(store: ChdbStore, source: bool) -> None:
    """Two agents send the service's deltas, one every 10 s (3 s before each 10 s mark), one every
    10 min (on the minute: at those minutes the service's latest row): judged by the one every
    10 s at every minute (by the latest row alone, the 1h/5m pair came and went with each
    10-minute row). When the 10 s one stops, the 10-minute one still stands for the service (the
    1h/5m pair then not judged) until twice its interval has passed."""
    end = T0 + 4 * 86400
    fast = [end - 2 * 3600 + 10 * k - 3 for k in range(1, 2 * 360 + 1)]  # the last at end - 3
    slow = [end - 2 * 3600 + 600 * k for k in range(0, 13)]  # the last at end
    write(
        store,
        [h.latency(t, good=10, bad=0, interval_s=10.0).model_copy(update={"source": "a"}) for t in fast],
    )
    write(
        store,
        [h.latency(t, good=600, bad=0, interval_s=600.0).model_copy(update={"source": "b"}) for t in slow],
    )
    rollup.refresh(store)
    slo = Slo(name="s", service="svc", threshold_ms=5.0, min_requests=1, period_d=7)
    for to in range(int(end - 3600), int(end) + 1, 60):  # every minute, six of them a 10-minute row's
        st = slo_status(store, slo, to - 3600, to, rollup=source)
        assert (st.no_data_since, st.unjudged_windows, st.data_interval_s) == (None, (), 10.0), to - end
    # after the fast source's last row (end - 3): it stands 300 s, the slow one's (end) 1200 s
    for after, expected in (
        (240, (False, (), 10.0)),
        (300, (False, ("1h/5m",), 600.0)),
        (1140, (False, ("1h/5m",), 600.0)),
        (1200, (True, ("1h/5m",), 600.0)),
        (2400, (True, ("1h/5m",), 600.0)),
    ):
        to = end + after
        st = slo_status(store, slo, to - 3600, to, rollup=source)
        assert (st.no_data_since is not None, st.unjudged_windows, st.data_interval_s) == expected, after


def test_the_terminal_and_the_report_say_which_windows_are_not_judged(store: ChdbStore) -> None:
    """The ticket's reason for the window pairs not judged is said in the terminal summary and on
    the report's SLO card too; an SLO not evaluable as a whole says only that (its reason first)."""
    from gpuslo.app.text import summary as text_summary
    from gpuslo.dashboards.report import render
    from gpuslo.rules.evaluate import summary
    from gpuslo.rules.model import why_windows_unjudged

    end = T0 + 7200
    write(store, [h.latency(end - 600 * k, good=590, bad=10, interval_s=600.0) for k in range(12)])
    cfg = RulesConfig(slos=(Slo(name="batchy", service="svc", threshold_ms=5.0),))
    s = summary(store, cfg, end - 3600, end)
    why = why_windows_unjudged(s.slos[0])
    assert why.startswith(
        "burn windows 1h/5m not judged: service 'svc' sends a latency histogram every 600 s"
    )
    assert "under 20 min" in why
    assert f"SLO batchy: {why}" in text_summary(s).splitlines()
    assert why in render(store, cfg, end - 3600, end).replace("&#x27;", "'")
    # the rows stopped: not evaluable as a whole, which says so instead
    late = summary(store, cfg, end + 1200 - 3600, end + 1200)
    assert late.slos[0].no_data_since == end and why_windows_unjudged(late.slos[0]) == ""


@pytest.mark.parametrize("claimed", (600.0, 10_000.0, float(MAX_INTERVAL_S)), ids=("600s", "10000s", "max"))
@pytest.mark.parametrize("source", (False, True), ids=("raw", "rollup"))
def test_a_row_stands_no_longer_than_its_source_sends_them(
    store: ChdbStore, source: bool, claimed: float
) -> None:
    """A sender every 10 s whose rows say a far longer interval_s (a unit error, milliseconds for
    seconds; or a hostile sender): its next row is due in 10 s, whatever a row claims. It was
    judged by the claim: every window pair shorter than twice it unjudged for as long as it sent
    (all four, the pages silenced, for the wire's longest), and still evaluable 2 days after its
    last row. Rows every 10 min saying 600 s, their latest replayed (two rows of one key before
    the merge), are still judged as every 10 min: the gap to the previous row is between times."""
    end = T0 + 4 * 86400
    write(store, [h.latency(end - 10 * k, good=10, bad=0, interval_s=claimed) for k in range(360)][::-1])
    rollup.refresh(store)
    slo = Slo(name="s", service="svc", threshold_ms=5.0, min_requests=1, period_d=7)
    for after, stale in ((0, False), (240, False), (300, True), (3 * 3600, True)):
        st = slo_status(store, slo, end + after - 3600, end + after, rollup=source)
        got = (st.no_data_since is not None, st.unjudged_windows, st.no_data_after_s, st.data_interval_s)
        assert got == (stale, (), 300, 10.0), (claimed, after)
    other = Slo(name="o", service="other", threshold_ms=5.0, min_requests=1, period_d=7)
    seldom = [
        h.latency(end - 600 * k, good=10, bad=0, service="other", interval_s=600.0)
        for k in (5, 4, 3, 2, 1, 0)
    ]
    write(store, seldom)
    write(store, seldom[-1:])  # the latest again, a second part: a replay
    rollup.refresh(store)
    for after, stale in ((0, False), (300, False), (1140, False), (1200, True)):
        st = slo_status(store, other, end + after - 3600, end + after, rollup=source)
        got = (st.no_data_since is not None, st.unjudged_windows, st.no_data_after_s, st.data_interval_s)
        assert got == (stale, ("1h/5m",), 1200, 600.0), after

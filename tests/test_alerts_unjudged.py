"""An SLO the engine cannot evaluate (its threshold no longer a bucket bound: the service was
redeployed with other buckets) leaves its firing burn alerts as they were and raises a ticket
naming why; before, its page resolved, as if the budget had stopped burning. Its own module: the
function-scoped chDB store (one data directory per process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.alerts import Notifier
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.rules.delivery import Outcome
from gpuslo.rules.receivers import Receiver
from gpuslo.rules.service import RulesService
from tests import helpers as h
from tests.helpers import T0


def _service(store: ChdbStore, tmp_path: Path, posted: list[str], now: list[float]) -> RulesService:
    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.extend(json.loads(body)["text"].splitlines())
        return Outcome("sent", 200, "")

    n = Notifier(tmp_path / "o", [Receiver.parse("webhook", "http://hooks/x")], post=post)
    slo = Slo(name="chat-p99", service="svc", threshold_ms=5.0, min_requests=10, period_d=7)
    cfg = RulesConfig(slos=(slo,))
    return RulesService(cfg, lambda: store, window_s=3600, source="raw", notifier=n, resend_s=60,
                        flush_s=5.0, clock=lambda: now[0])  # fmt: skip


def test_an_slo_not_evaluable_keeps_its_page_and_says_why(store: ChdbStore, tmp_path: Path) -> None:
    # two hours of every request slow (burn 100x): the 1h/5m page fires at the end
    write(store, [h.latency(T0 + 60 * k, good=0, bad=100) for k in range(120)])
    posted: list[str] = []
    now = [T0 + 7200.0]
    svc = _service(store, tmp_path, posted, now)
    try:
        first = svc.round()
        fired = {(a["severity"], a["long_window"]) for a in first["slo_alerts"] if a["ended"] is None}
        assert ("page", "1h") in fired, first["slo_alerts"]
        assert first["alerting"]["new"] >= 1 and first["alerting"]["resolved"] == 0
        pages = [p for p in posted if p.startswith("FIRING [page] GpusloSLOBurn")]
        assert pages
        # the service redeployed with buckets without 5 ms: its rows say nothing of the threshold
        write(store, [h.latency(T0 + 7200 + 60 * k, good=0, bad=100, bounds=(1.0, 2.5, 7.5, 10.0))
                      for k in range(3)])  # fmt: skip
        now[0] = T0 + 7200 + 240
        second = svc.round()
        (status,) = second["slos"]
        assert "not a bucket bound" in status["error"]
        assert second["alerting"]["resolved"] == 0, second["alerting"]  # the page stays
        ticket = [p for p in posted if p.startswith("FIRING [ticket] GpusloSLONotEvaluable")]
        assert len(ticket) == 1 and "not a bucket bound" in ticket[0]
        assert not [p for p in posted if p.startswith("RESOLVED")]
        firing: dict[str, Any] = svc.engine.state.firing()  # type: ignore[union-attr]
        assert {dict(v["labels"])["alertname"] for v in firing.values()} >= {
            "GpusloSLOBurn",
            "GpusloSLONotEvaluable",
        }
    finally:
        svc.notifier.close()  # type: ignore[union-attr]  # (the fixture closes the store)


def test_an_slo_whose_histograms_stopped_keeps_its_page_and_says_so(store: ChdbStore, tmp_path: Path) -> None:
    """The service (or its scrape, or the agent) died while its budget burned: its rows stop. The
    page resolved once its short window held no row, as if the burn had stopped. From the moment
    the shortest window (5 m) holds none of its rows a ticket says since when nothing came, and
    the page stays."""
    write(store, [h.latency(T0 + 60 * k, good=0, bad=100) for k in range(120)])  # until T0 + 7140
    posted: list[str] = []
    now = [T0 + 7200.0]
    svc = _service(store, tmp_path, posted, now)
    try:
        first = svc.round()
        assert first["slos"][0]["last_data_at"] == T0 + 7140 and first["slos"][0]["no_data_since"] is None
        assert [p for p in posted if p.startswith("FIRING [page] GpusloSLOBurn")]
        assert not [p for p in posted if "NotEvaluable" in p]
        now[0] = T0 + 7140 + 240  # 4 min without rows: the 5 m window still holds some
        second = svc.round()
        assert second["alerting"]["new"] == 0 and second["slos"][0]["no_data_since"] is None
        now[0] = T0 + 7140 + 3 * 3600  # three hours on: every burn window is empty
        third = svc.round()
        assert third["slos"][0]["no_data_since"] == T0 + 7140
        assert third["alerting"]["resolved"] == 0, third["alerting"]
        (ticket,) = [p for p in posted if p.startswith("FIRING [ticket] GpusloSLONotEvaluable")]
        assert "no latency histogram of service 'svc' since" in ticket and "(180 min)" in ticket
        assert not [p for p in posted if p.startswith("RESOLVED")]
        # the rows come back, burning no more: the ticket resolves, and the page with its windows
        write(store, [h.latency(now[0] + 60 * k, good=100, bad=0) for k in range(1, 70)])
        now[0] += 70 * 60
        fourth = svc.round()
        assert fourth["slos"][0]["no_data_since"] is None
        assert fourth["alerting"]["resolved"] >= 2, fourth["alerting"]
    finally:
        svc.notifier.close()  # type: ignore[union-attr]  # (the fixture closes the store)


def test_the_no_data_bound_is_the_shortest_window() -> None:
    """``no_data_s`` defaults to the shortest short window and may not exceed it (a page would
    resolve for want of rows first); the engine says no data exactly when that window is empty."""
    import pytest

    slo = Slo(name="s", service="svc", threshold_ms=5.0)
    assert slo.stale_after_s == 300 == min(w.short_s for w in slo.windows)
    assert Slo(name="s", service="svc", threshold_ms=5.0, no_data_s=120).stale_after_s == 120
    with pytest.raises(ValueError, match="no_data_s 301 is longer than the shortest burn window"):
        Slo(name="s", service="svc", threshold_ms=5.0, no_data_s=301)


def test_no_data_is_said_exactly_when_the_shortest_window_is_empty(store: ChdbStore) -> None:
    from gpuslo.rules.evaluate import slo_status

    write(store, [h.latency(T0 + 60 * k, good=10, bad=0) for k in range(10)])  # the last at T0 + 540
    slo = Slo(name="s", service="svc", threshold_ms=5.0, min_requests=1)
    for to, stale in ((T0 + 540 + 299, False), (T0 + 540 + 300, True), (T0 + 540, False)):
        st = slo_status(store, slo, to - 600, to)
        assert st.last_data_at == T0 + 540 and (st.no_data_since is not None) == stale, to - T0
    assert (
        slo_status(store, Slo(name="x", service="other", threshold_ms=5.0), T0, T0 + 600).last_data_at is None
    )
    from gpuslo.rules import rollup

    rollup.refresh(store)  # over the rollups: the end of the last row's minute, T0 + 540 itself
    assert slo_status(store, slo, T0 + 300, T0 + 900, rollup=True).last_data_at == T0 + 540


def test_a_service_silent_past_its_slo_period_is_still_not_evaluable(
    store: ChdbStore, tmp_path: Path
) -> None:
    """The rows stopped while the page fired, and stay stopped past the SLO's period (7 d here):
    the period then holds none of them, and the page and the ticket resolved, as if the burn had
    stopped and the service were back. Since when is the service's last row, however old."""
    write(store, [h.latency(T0 + 60 * k, good=0, bad=100) for k in range(120)])  # until T0 + 7140
    posted: list[str] = []
    now = [T0 + 7200.0]
    svc = _service(store, tmp_path, posted, now)
    try:
        svc.round()
        assert [p for p in posted if p.startswith("FIRING [page] GpusloSLOBurn")]
        for days in (1, 6.9, 7.1, 30):  # the last row leaves the 7-day period between 6.9 and 7.1 d
            now[0] = T0 + 7140 + days * 86400
            out = svc.round()
            (status,) = out["slos"]
            assert status["no_data_since"] == T0 + 7140, (days, status)
            assert status["last_data_at"] == T0 + 7140, (days, status)
            assert out["alerting"]["resolved"] == 0, (days, out["alerting"])
        assert not [p for p in posted if p.startswith("RESOLVED")]
        firing: dict[str, Any] = svc.engine.state.firing()  # type: ignore[union-attr]
        assert {dict(v["labels"])["alertname"] for v in firing.values()} >= {
            "GpusloSLOBurn",
            "GpusloSLONotEvaluable",
        }
        # a service never seen is no evidence of a stop: no ticket for it (as before)
        from gpuslo.rules.evaluate import slo_status

        never = slo_status(store, Slo(name="x", service="other", threshold_ms=5.0), now[0] - 600, now[0])
        assert never.last_data_at is None and never.no_data_since is None
    finally:
        svc.notifier.close()  # type: ignore[union-attr]  # (the fixture closes the store)


def test_no_data_over_the_rollups_is_said_when_their_window_empties(store: ChdbStore, tmp_path: Path) -> None:
    """Over the per-minute rollups a row's time is the end of its minute (``minute_end``, which
    the windows read): no data was said 60 s after the shortest window held none of them, and in
    that minute the page resolved on an empty window, the very thing no data is said to prevent.
    Raw and rollups agree on when the rows stopped, and the page stays at every second after."""
    write(store, [h.latency(T0 + 60 * k, good=0, bad=100) for k in range(120)])  # until T0 + 7140
    posted: list[str] = []
    now = [T0 + 7200.0]
    svc = _service(store, tmp_path, posted, now)
    svc.source = "rollup"
    try:
        svc.round()
        assert [p for p in posted if p.startswith("FIRING [page] GpusloSLOBurn")]
        for after in range(240, 420, 10):  # the 5 m window empties at T0 + 7140 + 300
            now[0] = T0 + 7140 + after
            out = svc.round()
            (status,) = out["slos"]
            assert status["last_data_at"] == T0 + 7140, (after, status)
            assert (status["no_data_since"] is not None) == (after >= 300), (after, status)
            assert out["alerting"]["resolved"] == 0, (after, out["alerting"])
        assert not [p for p in posted if p.startswith("RESOLVED")]
    finally:
        svc.notifier.close()  # type: ignore[union-attr]  # (the fixture closes the store)


def test_an_slo_whose_service_never_sent_a_row_is_not_evaluable_once_the_agents_report(
    store: ChdbStore, tmp_path: Path
) -> None:
    """A misspelt service (or cluster) name, or a service never instrumented: its SLO never saw a
    row and raised nothing, so it looked met forever. Once the cluster's agents have reported
    (heartbeats) for the SLO's no_data_s, it is not evaluable and says why; before any agent
    reported, an empty store is no evidence. Swept across the bound, per cluster, raw and rollups."""
    from gpuslo.rules import rollup
    from gpuslo.rules.evaluate import slo_status

    write(store, [h.heartbeat("n1", T0 + 10 * k, True) for k in range(180)])  # c1, T0 .. T0 + 1790
    rollup.refresh(store)
    typo = Slo(name="chat-p99", service="chatt", threshold_ms=5.0, min_requests=1, period_d=7)
    for after in range(290, 311, 5):  # the no_data_s (300 s) after the first heartbeat
        for source in (False, True):
            st = slo_status(store, typo, T0 + after - 600, T0 + after, rollup=source)
            assert st.last_data_at is None and st.no_data_since is None
            assert st.never_seen == (after >= 300), (after, source)
    at = T0 + 1800
    for cluster, seen in (("", True), ("c1", True), ("c2", False)):
        st = slo_status(store, typo.model_copy(update={"cluster": cluster}), at - 600, at)
        assert st.never_seen == seen, cluster
    # agents silent for longer than the SLO's period: nothing to judge it against
    assert not slo_status(store, typo, T0 + 8 * 86400 - 600, T0 + 8 * 86400).never_seen

    posted: list[str] = []
    now = [at]

    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.extend(json.loads(body)["text"].splitlines())
        return Outcome("sent", 200, "")

    n = Notifier(tmp_path / "o", [Receiver.parse("webhook", "http://hooks/x")], post=post)
    svc = RulesService(RulesConfig(slos=(typo,)), lambda: store, window_s=3600, source="raw", notifier=n,
                       resend_s=60, flush_s=5.0, clock=lambda: now[0])  # fmt: skip
    try:
        out = svc.round()
        assert out["slos"][0]["never_seen"] is True
        (ticket,) = [p for p in posted if p.startswith("FIRING [ticket] GpusloSLONotEvaluable")]
        assert "'chatt' ever" in ticket and "service (or cluster) name" in ticket
        # the service's first row: judged again, the ticket resolves
        write(
            store,
            [h.latency(at - 60 + 10 * k, good=10, bad=0, service="chatt", interval_s=10.0) for k in range(6)],
        )
        now[0] = at + 60
        out = svc.round()
        assert out["slos"][0]["never_seen"] is False and out["slos"][0]["last_data_at"] is not None
        assert [p for p in posted if p.startswith("RESOLVED [ticket] GpusloSLONotEvaluable")]
    finally:
        n.close()

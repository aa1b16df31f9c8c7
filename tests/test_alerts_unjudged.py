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

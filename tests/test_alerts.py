"""Alert lifecycle persisted in the store, delivered to a real Alertmanager."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ingest.store import ChdbStore
from rules.alerts import Alert, AlertState, Engine, Notifier, alerts_from_summary
from tests.servers.alertmanager import Alertmanager

PAGE = Alert({"alertname": "GpusloSLOBurn", "severity": "page", "slo": "chat-p99", "service": "chat", "window": "1h/5m"},
             {"summary": "burning 20x", "burn_long": "20.000"})  # fmt: skip
TICKET = Alert({"alertname": "GpusloStarvation", "severity": "ticket", "cluster": "c", "queue": "gpu", "request": "42",
                "cause": "capacity"}, {"summary": "8 GPUs pending 30 min"})  # fmt: skip


def names(am: Alertmanager) -> set[str]:
    return {a["labels"]["alertname"] + "/" + a["labels"].get("severity", "") for a in am.alerts()
            if a["status"]["state"] == "active"}  # fmt: skip


def wait_for(cond: object, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


@pytest.mark.integration
def test_fire_restart_resolve_and_outage_on_real_alertmanager(store: ChdbStore, tmp_path: Path) -> None:
    am = Alertmanager(tmp_path / "am")
    am.start()
    try:
        outbox = tmp_path / "outbox.jsonl"
        eng = Engine(AlertState(store), Notifier(outbox, alertmanager=am.url), resend_s=60)
        t = time.time() - 300  # evaluation times in the past: Alertmanager honours endsAt literally
        assert eng.step([PAGE], t) == {"new": 1, "resent": 0, "resolved": 0, "undelivered": 0}
        wait_for(lambda: names(am) == {"GpusloSLOBurn/page"})
        (got,) = am.alerts()
        assert got["labels"] == PAGE.labels and got["annotations"] == PAGE.annotations
        # a restarted engine (new objects, same store): no second page within the resend interval
        eng2 = Engine(AlertState(store), Notifier(outbox, alertmanager=am.url), resend_s=60)
        assert eng2.step([PAGE], t + 10) == {"new": 0, "resent": 0, "resolved": 0, "undelivered": 0}
        assert eng2.notifier.sent == 0
        # while firing it is re-sent every resend interval, with the original start
        assert eng2.step([PAGE], t + 70)["resent"] == 1
        # resolve: Alertmanager gets endsAt and drops it from the active alerts
        assert eng2.step([], t + 80)["resolved"] == 1
        wait_for(lambda: names(am) == set())
        # Alertmanager down: the notification waits in the outbox, then arrives
        am.stop()
        r = eng2.step([TICKET], time.time())
        assert r["new"] == 1 and r["undelivered"] == 1 and eng2.notifier.failures == 1
        assert json.loads(outbox.read_text().splitlines()[0])["payload"][0]["labels"]["request"] == "42"
        am.start()
        assert eng2.notifier.deliver(now=time.monotonic() + 3600) == 0
        wait_for(lambda: names(am) == {"GpusloStarvation/ticket"})
    finally:
        am.stop()


def test_webhook_is_slack_compatible(store: ChdbStore, tmp_path: Path) -> None:
    posted: list[tuple[str, dict[str, str]]] = []

    def post(url: str, body: bytes, timeout_s: float) -> int:
        posted.append((url, json.loads(body)))
        return 200

    eng = Engine(AlertState(store), Notifier(tmp_path / "o.jsonl", webhook="http://hooks/x", post=post))
    eng.step([PAGE], 1_790_000_000.0)
    eng.step([], 1_790_000_100.0)
    assert [p[0] for p in posted] == ["http://hooks/x", "http://hooks/x"]
    assert posted[0][1]["text"].startswith("FIRING [page] GpusloSLOBurn chat-p99")
    assert posted[1][1]["text"].startswith("RESOLVED [page]")


def test_alerts_from_summary() -> None:
    s = {
        "slos": [{"slo": "chat-p99", "budget_remaining": 0.5}],
        "slo_alerts": [
            {"slo": "chat-p99", "service": "chat", "severity": "page", "long_window": "1h", "short_window": "5m",
             "factor": 14.4, "started": 1.0, "ended": None, "peak_burn_long": 20.0, "peak_burn_short": 30.0},
            {"slo": "chat-p99", "service": "chat", "severity": "ticket", "long_window": "1d", "short_window": "2h",
             "factor": 3, "started": 1.0, "ended": 5.0, "peak_burn_long": 4.0, "peak_burn_short": 5.0},
        ],
        "starvation_incidents": [
            {"cluster": "c", "queue": "gpu", "request_id": "7", "cause": "fragmentation", "closed": None, "gpus": 8.0,
             "user": "alice", "account": "nlp", "wait_s": 1800.0},
            {"cluster": "c", "queue": "gpu", "request_id": "8", "cause": "policy", "closed": 9.0, "gpus": 1.0,
             "user": "bob", "account": "nlp", "wait_s": 700.0},
        ],
    }  # fmt: skip
    alerts = alerts_from_summary(s)
    assert [(a.labels["alertname"], a.labels["severity"]) for a in alerts] == [
        ("GpusloSLOBurn", "page"), ("GpusloStarvation", "ticket")]  # fmt: skip
    assert alerts[0].labels["window"] == "1h/5m" and alerts[0].annotations["budget_remaining"] == "0.5000"
    assert "alice pending 30 min in gpu (fragmentation)" in alerts[1].annotations["summary"]


@pytest.mark.integration
def test_rules_run_pages_alertmanager_from_a_burning_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Simulated fleet whose latency degrades for the last 90 minutes, evaluated now."""
    from agent.sim.fleet import SimConfig
    from gpuslo.cli import main
    from gpuslo.embedded import run_demo
    from rules.config import example

    now = time.time()
    sim = SimConfig(nodes=2, hours=2.0, start_ts=float(int(now // 60) * 60 - 7200), degrade_hours=(0.5, 2.5))
    run_demo(sim, example(), tmp_path / "demo")
    am = Alertmanager(tmp_path / "am")
    am.start()
    try:
        rc = main(["rules", "run", "--once", "--store", str(tmp_path / "demo" / "store"), "--window-s", "7200",
                   "--alertmanager", am.url, "--outbox", str(tmp_path / "outbox.jsonl")])  # fmt: skip
        assert rc == 0
        out = json.loads(capsys.readouterr().out.splitlines()[-1])
        # the demo recorded them as firing without receivers: this engine sends them at once
        assert out["alerting"]["new"] + out["alerting"]["resent"] >= 1 and out["alerting"]["undelivered"] == 0
        wait_for(lambda: "GpusloSLOBurn/page" in names(am))
        page = next(a for a in am.alerts() if a["labels"].get("severity") == "page")
        assert page["labels"]["slo"] == "llm-chat-p99" and float(page["annotations"]["burn_long"]) > 14.4
    finally:
        am.stop()

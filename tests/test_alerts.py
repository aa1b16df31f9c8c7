"""Alert lifecycle persisted in the store, delivered to a real Alertmanager."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.alerts import Alert, AlertState, Engine, Notifier, alerts_from_summary
from gpuslo.rules.delivery import Policy
from gpuslo.rules.model import Incident, SloAlert, SloStatus, Summary, Window
from gpuslo.rules.receivers import Outcome, Receiver
from tests.servers import receivers as rx
from tests.servers.alertmanager import Alertmanager

FAST = Policy(deadline_s=2.0, backoff_initial_s=0.2, backoff_max_s=0.5)

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
def test_fire_restart_resolve_and_outage_on_real_alertmanager(
    store: ChdbStore, tmp_path: Path, make_alertmanager: Callable[..., Alertmanager]
) -> None:
    am = make_alertmanager(tmp_path / "am")
    am.start()
    try:
        outbox = tmp_path / "outbox"
        am_r = Receiver.parse("alertmanager", am.url)
        n1 = Notifier(outbox, [am_r], policy=FAST)
        eng = Engine(AlertState(store), n1, resend_s=60)
        # evaluation times in the past, Alertmanager honouring endsAt literally: the resolve's
        # (t + 80) is past, a firing notification's (4 re-sends, 240 s, ahead) is not
        t = time.time() - 100
        r = eng.step([PAGE], t)
        assert (r["new"], r["resent"], r["resolved"], r["queued"]) == (1, 0, 0, 1)
        wait_for(lambda: names(am) == {"GpusloSLOBurn/page"})
        (got,) = am.alerts()
        assert got["labels"] == PAGE.labels and got["annotations"] == PAGE.annotations
        n1.close()
        # a restarted engine (new objects, same store): no second page within the resend interval
        n2 = Notifier(outbox, [am_r], policy=FAST)
        eng2 = Engine(AlertState(store), n2, resend_s=60)
        r = eng2.step([PAGE], t + 10)
        assert (r["new"], r["resent"], r["resolved"], r["queued"]) == (0, 0, 0, 0)
        assert r["receivers"][am_r.name]["sent"] == 0
        # while firing it is re-sent every resend interval, with the original start
        assert eng2.step([PAGE], t + 70)["resent"] == 1
        # resolve: Alertmanager gets endsAt and drops it from the active alerts
        assert eng2.step([], t + 80)["resolved"] == 1
        wait_for(lambda: names(am) == set())
        # Alertmanager down: the notification waits in the outbox, retried, then arrives
        am.stop()
        r = eng2.step([TICKET], time.time())
        assert r["new"] == 1 and r["queued"] == 1
        wait_for(lambda: int(n2.stats()[am_r.name]["retries"]) >= 1)
        assert n2.stats()[am_r.name]["pending"] == 1
        pending = (outbox / f"{am_r.name}.jsonl").read_text().splitlines()
        assert json.loads(pending[-1])["payload"][0]["labels"]["request"] == "42"
        am.start()
        wait_for(lambda: names(am) == {"GpusloStarvation/ticket"})
        wait_for(lambda: n2.stats()[am_r.name]["pending"] == 0)
        n2.close()
    finally:
        am.stop()


def test_webhook_is_slack_compatible(store: ChdbStore, tmp_path: Path) -> None:
    posted: list[tuple[str, dict[str, str]]] = []

    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.append((r.url, json.loads(body)))
        return Outcome("sent", 200, "")

    n = Notifier(tmp_path / "o", [Receiver.parse("webhook", "http://hooks/x")], post=post)
    eng = Engine(AlertState(store), n)
    eng.step([PAGE], 1_790_000_000.0)
    eng.step([], 1_790_000_100.0)
    wait_for(lambda: len(posted) == 2)
    n.close()
    assert [p[0] for p in posted] == ["http://hooks/x", "http://hooks/x"]
    assert posted[0][1]["text"].startswith("FIRING [page] GpusloSLOBurn chat-p99")
    assert posted[1][1]["text"].startswith("RESOLVED [page]")


def test_alerts_from_summary() -> None:
    page = SloAlert("chat-p99", "chat", "page", "1h", "5m", 14.4, 1.0, None, 20.0, 30.0)
    resolved = SloAlert("chat-p99", "chat", "ticket", "1d", "2h", 3, 1.0, 5.0, 4.0, 5.0)
    status = SloStatus("chat-p99", "chat", 0.99, 5.0, 100, 90, 0.9, 10.0, 0.5, 7.0, alerts=(page, resolved))
    open_ = Incident(
        "7", "c", "slurm", "gpu", "alice", "nlp", 8.0, 1, 0.0, None, None, 1800.0, 0.0, "fragmentation", None
    )
    closed = Incident(
        "8", "c", "slurm", "gpu", "bob", "nlp", 1.0, 1, 0.0, 9.0, "start", 700.0, 0.0, "policy", "Priority"
    )
    s = Summary(
        window=Window(from_=0.0, to=10.0, cluster=None, over="raw rows"), capacity_gpu_hours=1.0,
        cur_allocation=None, cur_active=None, cur_target=0.8, idle_allocated_gpu_hours=0.0,
        idle_unallocated_gpu_hours=0.0, idle_pct_of_capacity=None, pools=(), starvation_incidents=(open_, closed),
        starvation_by_cause={"capacity": 0, "fragmentation": 1, "policy": 1}, slo_alerts=(page, resolved),
        slo_minutes={}, slo_held_back=(), top_idle=(), fair_share=(), slos=(status,),
    )  # fmt: skip
    alerts = alerts_from_summary(s)
    assert [(a.labels["alertname"], a.labels["severity"]) for a in alerts] == [
        ("GpusloSLOBurn", "page"), ("GpusloStarvation", "ticket")]  # fmt: skip
    assert alerts[0].labels["window"] == "1h/5m" and alerts[0].annotations["budget_remaining"] == "0.5000"
    assert "alice pending 30 min in gpu (fragmentation)" in alerts[1].annotations["summary"]


@pytest.mark.integration
def test_rules_run_pages_alertmanager_from_a_burning_fleet(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    make_alertmanager: Callable[..., Alertmanager],
) -> None:
    """Simulated fleet whose latency degrades for the last 90 minutes, evaluated now."""
    from gpuslo.agent.sim.fleet import SimConfig
    from gpuslo.app.cli import main
    from gpuslo.app.embedded import run_demo
    from gpuslo.rules.config import example

    now = time.time()
    sim = SimConfig(nodes=2, hours=2.0, start_ts=float(int(now // 60) * 60 - 7200), degrade_hours=(0.5, 2.5))
    run_demo(sim, example(), tmp_path / "demo")
    am = make_alertmanager(tmp_path / "am")
    am.start()
    hook = rx.Receiver(status=503)  # a webhook that is down at first
    url_file = tmp_path / "hook.url"
    url_file.write_text(f"http://dave:w3bh00k-pw@127.0.0.1:{hook.port}/services/T1/B1/t0k3nt0k3n\n")
    url_file.chmod(0o600)
    monkeypatch.setenv("GPUSLO_ALERTMANAGER_URL", am.url)  # Alertmanager from the environment
    args = ["rules", "run", "--once", "--store", str(tmp_path / "demo" / "store"), "--window-s", "7200",
            "--webhook-url-file", str(url_file), "--outbox", str(tmp_path / "outbox"), "--delivery-deadline-s", "2"]  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING):
            assert main(args) == 0
        out = json.loads(capsys.readouterr().out.splitlines()[-1])
        # the demo recorded them as firing without receivers: this engine sends them at once
        assert out["alerting"]["new"] + out["alerting"]["resent"] >= 1
        by_kind = {v["receiver"]: v for v in out["alerting"]["receivers"].values()}
        am_stats, hook_stats = (
            by_kind[f"http://127.0.0.1:{am.port}"],
            by_kind[f"http://127.0.0.1:{hook.port}"],
        )
        assert am_stats["pending"] == 0 and am_stats["sent"] == 1
        assert hook_stats["pending"] == 1 and hook_stats["retries"] >= 1 and hook_stats["last_status"] == 503
        wait_for(lambda: "GpusloSLOBurn/page" in names(am))
        page = next(a for a in am.alerts() if a["labels"].get("severity") == "page")
        assert page["labels"]["slo"] == "llm-chat-p99" and float(page["annotations"]["burn_long"]) > 14.4
        first = hook.posts()[0]
        assert first.headers["authorization"] == "Basic ZGF2ZTp3M2JoMDBrLXB3"  # base64 of dave:w3bh00k-pw
        # restarted with the webhook back: the pending notification goes exactly once, the engine
        # does not page again (within --resend-s), and a third run sends nothing
        hook.status = 200
        before = len(hook.posts())
        with caplog.at_level(logging.WARNING):
            assert main(args) == 0
            assert main(args) == 0
        assert [p.body for p in hook.posts()[before:]] == [first.body]
        assert "w3bh00k-pw" not in caplog.text and "t0k3nt0k3n" not in caplog.text
        assert "503" in caplog.text  # the failure was reported, by receiver name
    finally:
        hook.close()
        am.stop()


# ---------------------------------------------------------------- transitions are never lost
def _hook_notifier(tmp_path: Path, posted: list[str]) -> tuple[Notifier, Path]:
    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.append(json.loads(body)["text"].split(" ")[0])
        return Outcome("sent", 200, "")

    r = Receiver.parse("webhook", "http://hooks/x")
    n = Notifier(tmp_path / "o", [r], post=post)
    from gpuslo.rules.alerts import outbox_file

    return n, outbox_file(tmp_path / "o", r)


def test_a_transition_no_outbox_took_is_queued_again_at_the_next_step(
    store: ChdbStore, tmp_path: Path
) -> None:
    """A full disk (the outbox a link to /dev/full) at a page and at its resolve: the state stays
    as it was, so the next step queues the same transition once the outbox takes it. (Before, the
    state was written first: the page waited for the re-send, the resolve was lost for good.)"""
    posted: list[str] = []
    n, f = _hook_notifier(tmp_path, posted)
    eng = Engine(AlertState(store), n, resend_s=3600)
    t = 1_790_000_000.0
    saved = tmp_path / "saved"
    f.rename(saved)
    f.symlink_to("/dev/full")
    try:
        r = eng.step([PAGE], t)
        assert (r["new"], r["queued"], r["unqueued"]) == (1, 0, 1) and eng.state.firing() == {}
        f.unlink()
        saved.rename(f)
        r = eng.step([PAGE], t + 60)  # the disk has room again: the page goes now, not in an hour
        assert (r["new"], r["queued"], r["unqueued"]) == (1, 1, 0)
        assert float(next(iter(eng.state.firing().values()))["started"]) == t + 60
        f.rename(saved)
        f.symlink_to("/dev/full")
        r = eng.step([], t + 120)  # resolved while the disk is full: kept firing in the state
        assert (r["resolved"], r["unqueued"]) == (1, 1) and len(eng.state.firing()) == 1
        f.unlink()
        saved.rename(f)
        r = eng.step([], t + 180)
        assert (r["resolved"], r["queued"]) == (1, 1) and eng.state.firing() == {}
        wait_for(lambda: posted == ["FIRING", "RESOLVED"])
    finally:
        n.close()


def test_a_crash_between_the_outbox_and_the_state_sends_again_never_forgets(
    store: ChdbStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine dies after queueing a resolve and before writing its state: the restarted
    engine queues the resolve again (at least once), and then it is recorded."""
    posted: list[str] = []
    n, _ = _hook_notifier(tmp_path, posted)
    t = 1_790_000_000.0
    Engine(AlertState(store), n, resend_s=3600).step([PAGE], t)
    wait_for(lambda: posted == ["FIRING"])

    def die(self: AlertState, rows: object) -> None:
        raise SystemExit("killed between the outbox and the state")

    monkeypatch.setattr(AlertState, "write", die)
    with pytest.raises(SystemExit):
        Engine(AlertState(store), n, resend_s=3600).step([], t + 60)
    monkeypatch.undo()
    n.close()
    n2, _ = _hook_notifier(tmp_path, posted)  # restarted: the outbox sends what it holds, the engine again
    try:
        r = Engine(AlertState(store), n2, resend_s=3600).step([], t + 120)
        assert r["resolved"] == 1 and AlertState(store).firing() == {}
        wait_for(lambda: posted == ["FIRING", "RESOLVED", "RESOLVED"])
    finally:
        n2.close()


def _am_notifier(
    tmp_path: Path, bodies: list[list[dict[str, str]]] | None = None
) -> tuple[Notifier, list[list[dict[str, str]]]]:
    """A notifier to one Alertmanager whose every POST is kept (``bodies``) and answered 200."""
    kept: list[list[dict[str, str]]] = [] if bodies is None else bodies

    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        kept.append(json.loads(body))
        return Outcome("sent", 200, "")

    return Notifier(tmp_path / "o", [Receiver.parse("alertmanager", "http://am:9093")], post=post), kept


def test_a_firing_notification_holds_alertmanager_for_four_resends_and_a_resolve_never_ends_before_it_starts(
    store: ChdbStore, tmp_path: Path
) -> None:
    n, bodies = _am_notifier(tmp_path)
    try:
        eng = Engine(AlertState(store), n, resend_s=60, every_s=300)  # re-sent each step: 300 s apart
        t = 1_790_000_000.0
        slow = Alert({"alertname": "GpusloIdleHolder", "job": "7"}, {}, resend_s=14_400)  # the notices' 4 h
        eng.step([PAGE, slow], t)
        eng.step([], t - 3600)  # the clock stepped back an hour: the resolve still ends after its start
        wait_for(lambda: len(bodies) == 2)
        (fired, resolved) = bodies
        ends = {a["labels"]["alertname"]: a["endsAt"] for a in fired}
        assert ends == {"GpusloSLOBurn": "2026-09-21T14:33:20Z", "GpusloIdleHolder": "2026-09-22T06:13:20Z"}
        assert {a["startsAt"] for a in fired} == {a["endsAt"] for a in resolved} == {"2026-09-21T14:13:20Z"}
    finally:
        n.close()


@pytest.mark.integration
def test_alertmanager_keeps_a_notice_firing_past_its_resolve_timeout(
    store: ChdbStore, tmp_path: Path, make_alertmanager: Callable[..., Alertmanager]
) -> None:
    """A notice re-sent every 4 h against Alertmanager's resolve_timeout (2 s here, 5 min by
    default): without an endsAt, Alertmanager resolved it after the timeout, told its owner
    "resolved", and held nothing until the next re-send."""
    am = make_alertmanager(tmp_path / "am", "global:\n  resolve_timeout: 2s\nroute:\n  receiver: none\n"
                                            "receivers:\n  - name: none\n")  # fmt: skip
    am.start()
    try:
        n = Notifier(tmp_path / "o", [Receiver.parse("alertmanager", am.url)], policy=FAST)
        eng = Engine(AlertState(store), n, resend_s=60)
        notice = Alert(
            {"alertname": "GpusloIdleHolder", "severity": "ticket", "job": "7"}, {}, resend_s=14_400
        )
        eng.step([notice], time.time() - 1)
        wait_for(lambda: names(am) == {"GpusloIdleHolder/ticket"})
        time.sleep(4)  # twice the resolve_timeout
        assert names(am) == {"GpusloIdleHolder/ticket"}
        n.close()
    finally:
        am.stop()


def test_one_receivers_outbox_failing_does_not_resend_to_the_others_at_every_step(
    store: ChdbStore, tmp_path: Path
) -> None:
    """Two receivers, one outbox unwritable for good: the other gets the page once (the state is
    written), not again at every step; the failing one's loss is counted."""
    posted: list[str] = []
    bad_r = Receiver.parse("webhook", "http://hooks/y")

    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.append(r.url)
        return Outcome("sent", 200, "")

    from gpuslo.rules.alerts import outbox_file

    n = Notifier(tmp_path / "o", [Receiver.parse("webhook", "http://hooks/x"), bad_r], post=post)
    try:
        bad = outbox_file(tmp_path / "o", bad_r)
        bad.unlink()
        bad.symlink_to("/dev/full")
        eng = Engine(AlertState(store), n, resend_s=3600)
        t = 1_790_000_000.0
        for k in range(4):
            eng.step([PAGE], t + 60 * k)
        wait_for(lambda: posted == ["http://hooks/x"])
        time.sleep(0.5)
        assert posted == ["http://hooks/x"] and n.stats()[bad_r.name]["dropped"] == 1
    finally:
        n.close()


def test_a_firing_notification_is_held_past_the_runs_it_does_not_know(
    store: ChdbStore, tmp_path: Path
) -> None:
    """``rules run --once`` from a scheduler (a new engine each run, the cadence unknown): a
    notification holds Alertmanager an hour at least, and four times the gap since the alert's
    last send where that is longer (a run every 5 min, then one two hours later), so it never
    resolves between two runs (it did: 4 × 60 s, then fired again at the next run, a flap each
    run). A slow round in a loop likewise."""
    bodies: list[list[dict[str, str]]] = []
    t = 1_790_000_000.0
    holds = []
    for k, at in enumerate((t, t + 300, t + 600, t + 600 + 7200)):  # each run its own engine
        n, _ = _am_notifier(tmp_path, bodies)
        try:
            Engine(AlertState(store), n, resend_s=60).step([PAGE], at)
            wait_for(lambda k=k: len(bodies) == k + 1)  # type: ignore[misc]
        finally:
            n.close()
        end = datetime.fromisoformat(bodies[-1][0]["endsAt"].replace("Z", "+00:00")).timestamp()
        holds.append(end - at)
    assert holds == [3600.0, 3600.0, 3600.0, 4 * 7200.0]
    # a loop every 60 s whose round took 500 s: held 4 × 500 s, past the next round
    n, _ = _am_notifier(tmp_path, bodies)
    try:
        eng = Engine(AlertState(store), n, resend_s=60, every_s=60)
        eng.step([TICKET], t + 1000)
        eng.step([TICKET], t + 1500)
        wait_for(lambda: len(bodies) == 6)
    finally:
        n.close()
    end = datetime.fromisoformat(bodies[-1][0]["endsAt"].replace("Z", "+00:00")).timestamp()
    assert end - (t + 1500) == 2000.0


def test_a_step_no_receiver_took_whole_is_queued_again(
    store: ChdbStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty alerts to one webhook: several messages (3,500 characters each); the disk takes the
    first and not the next: the step is not recorded, so the next queues all of it again (it
    was recorded, and the alerts of the lost messages never went, nor their resolve)."""
    from gpuslo.rules.delivery import ReceiverQueue

    posted: list[str] = []
    n, _ = _hook_notifier(tmp_path, posted)
    many = [Alert({**PAGE.labels, "slo": f"slo-{i}"}, {"summary": "x" * 150}) for i in range(40)]
    real = ReceiverQueue.put
    calls = [0]

    def nearly_full(self: ReceiverQueue, payload: object) -> bool:
        calls[0] += 1
        return calls[0] == 1 and real(self, payload)

    try:
        eng = Engine(AlertState(store), n, resend_s=3600)
        monkeypatch.setattr(ReceiverQueue, "put", nearly_full)
        r = eng.step(many, 1_790_000_000.0)
        assert r["queued"] == 1 and r["unqueued"] >= 1 and not r["recorded"] and eng.state.firing() == {}
        monkeypatch.setattr(ReceiverQueue, "put", real)
        r = eng.step(many, 1_790_000_060.0)
        assert r["recorded"] and r["new"] == 40 and len(eng.state.firing()) == 40
    finally:
        n.close()


def test_a_clock_set_back_neither_ends_a_firing_alert_before_it_starts_nor_loses_its_state(
    store: ChdbStore, tmp_path: Path
) -> None:
    """The clock set back 10 min between two steps: the re-sent notification's endsAt is after
    its startsAt (Alertmanager refused it: "start time must be before end time"), and its state
    row, written at an older time, still replaces the newer one (the greater version wins)."""
    n, bodies = _am_notifier(tmp_path)
    try:
        eng = Engine(AlertState(store), n, resend_s=120, every_s=60)
        t = 1_790_000_000.0
        eng.step([PAGE], t)
        r = eng.step([PAGE], t - 600)  # behind the last send: sent again
        assert r["resent"] == 1
        assert float(next(iter(eng.state.firing().values()))["last_sent"]) == t - 600
        assert eng.step([PAGE], t - 540)["resent"] == 0  # 60 s after it: within resend_s
        eng.step([], t - 480)
        assert eng.state.firing() == {}
        wait_for(lambda: len(bodies) == 3)
        for body in bodies:  # Alertmanager refuses an end before the start; equal is a resolve at once
            for a in body:
                assert a["endsAt"] >= a["startsAt"], a
        assert bodies[1][0]["endsAt"] > bodies[1][0]["startsAt"]  # the re-sent, firing one
    finally:
        n.close()


def test_the_state_version_grows_at_every_write_whatever_the_clock(store: ChdbStore, tmp_path: Path) -> None:
    """Fired and resolved 50 times by an engine whose clock stands still, then set back an hour:
    each step's rows replace the last (the column keeps milliseconds, cut: + 1 ms in floating
    point tied with the newest, and a tie is settled by the order of insertion alone)."""
    n = Notifier(tmp_path / "o")  # no receiver: every transition recorded, nothing sent
    eng = Engine(AlertState(store), n)
    t = 1_790_000_000.001
    seen = []
    for k in range(50):
        now = t if k < 25 else t - 3600
        eng.step([PAGE] if k % 2 == 0 else [], now)
        assert (len(eng.state.firing()) == 1) == (k % 2 == 0), k
        seen.append(eng.state.latest())
    assert all(b > a for a, b in itertools.pairwise(seen)), seen[:5]

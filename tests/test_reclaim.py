"""The idle-reclaim loop on the embedded store: which holders are noticed (each case worked out
by hand from the definitions in docs/alerting.md), the notice's labels and numbers, and every
decision of the action against a recording actor (the real scancel and API server are in
tests/test_reclaim_slurm.py and tests/test_reclaim_k8s.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.actions import ActionLog, Outcome, Reclaimer
from gpuslo.rules.config import ConfigError, RulesConfig, parse
from gpuslo.rules.reclaim import IdleHolder, idle_holders, notice
from gpuslo.rules.reclaim_round import reclaim_round
from tests import helpers as h
from tests.helpers import T0
from tests.reclaim_fleet import ACTIVE, IDLE, Holder, batches

B = T0 - 2 * 86400.0
NOW = B + 3600.0


def _cfg(**action: Any) -> RulesConfig:
    return parse({"reclaim": {"enabled": True, "idle_after_s": 1800, "queue_idle_after_s": {"debug": 4000},
                              "report_url": "https://grafana.example/d/job?var-job={job}&c={cluster}",
                              "action": {"grace_s": 600, **action} if action else {}}})  # fmt: skip


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_who_is_idle_beyond_the_threshold(store: ChdbStore) -> None:
    holders = [
        # 101: 2 GPUs, busy for 20 min, then idle for 40 min: idle since B+1200, 2400 s, 2 x 2400 s = 1.3333 GPU-h
        Holder("101", (0, 1), lambda t: ACTIVE if t < B + 1200 else IDLE),
        # 102: idle but one busy sample at B+3000 (covers [3000, 3010)): idle 590 s < 1800
        Holder("102", (2,), lambda t: ACTIVE if t == B + 3000 else IDLE),
        # 103: idle all hour in queue debug, whose threshold is 4000 s: 3600 < 4000
        Holder("103", (3,), lambda t: IDLE, queue="debug"),
        # 104: idle, but its samples stop at B+3000 (the job ended): not fresh at NOW
        Holder("104", (4,), lambda t: IDLE, until=B + 3000),
        # 106: idle, but the agent missed [B+1800, B+1860): the run breaks, idle since B+1860, 1740 s < 1800
        Holder("106", (6,), lambda t: IDLE),
        # 107: no activity field at all: unknown is never idle
        Holder("107", (7,), lambda t: None),
        # 105: idle all hour, but the scheduler says it ended at B+3590
        Holder("105", (5,), lambda t: IDLE),
    ]
    gap = batches(
        "n2", [Holder("106", (0,), lambda t: IDLE)], B, NOW, skip=lambda t: B + 1800 <= t < B + 1860
    )
    others = batches("n1", [x for x in holders if x.id != "106"], B, NOW)
    write(store, [*others, *gap, h.sched("start", "105", B), h.sched("end", "105", B + 3590)])  # type: ignore[list-item]
    found = idle_holders(store, _cfg(), NOW)
    assert [x.id for x in found] == ["101"]
    x = found[0]
    assert (x.idle_since, x.idle_for_s, x.gpus, x.held_since) == (B + 1200, 2400.0, 2.0, B)
    assert x.idle_gpu_hours == pytest.approx(2 * 2400 / 3600) and not x.clipped
    a = notice(_cfg(), x)
    assert a.labels == {"alertname": "GpusloIdleHolder", "severity": "ticket", "cluster": "c1", "scheduler": "slurm",
                        "queue": "gpu", "user": "alice", "account": "research", "job": "101"}  # fmt: skip
    assert a.annotations["idle_gpu_hours"] == "1.3333"
    assert a.annotations["report"] == "https://grafana.example/d/job?var-job=101&c=c1"
    assert a.resend_s == 4 * 3600.0
    # the rules behind the ingest (evaluated 5 min after the newest sample): judged on what arrived,
    # the same holder, idle until its last sample's end
    (late,) = idle_holders(store, _cfg(), NOW + 300)
    assert (late.id, late.idle_for_s, late.data_end) == ("101", 2400.0, NOW)
    # one more busy sample at NOW-10 on one of its GPUs: active again, no notice
    write(store, batches("n1", [Holder("101", (1,), lambda t: ACTIVE)], NOW - 10, NOW))
    assert idle_holders(store, _cfg(), NOW) == []


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="enabled"):
        parse({"reclaim": {"action": {"mode": "on"}}})
    for hostile in ("https://x/{user}", "https://x/{job.__class__}", "https://x/{job!r}", "https://x/{job:>99}",
                    "https://x/{0}", "https://x/{}", "https://x/{job", "https://x/}"):  # fmt: skip
        with pytest.raises(ConfigError, match="report_url"):
            parse({"reclaim": {"report_url": hostile}})
    ok = parse({"reclaim": {"report_url": "https://x/{{literal}}/{job}?c={cluster}&s={scheduler}"}})
    assert (
        ok.reclaim.report_url.format(job="1", cluster="c", scheduler="s") == "https://x/{literal}/1?c=c&s=s"
    )
    with pytest.raises(ConfigError, match="allow_queues"):
        parse({"reclaim": {"action": {"allow_queues": [""]}}})
    with pytest.raises(ConfigError):
        parse({"reclaim": {"idle_after_s": 0}})
    assert RulesConfig().reclaim.action.mode == "off" and not RulesConfig().reclaim.enabled


class Recording:
    def __init__(self, *results: Outcome) -> None:
        self.calls: list[tuple[str, str]] = []
        self.results = list(results)

    def act(self, action: str, x: IdleHolder) -> Outcome:
        self.calls.append((action, x.id))
        return self.results.pop(0) if self.results else Outcome(True, "ok")


def _holder(queue: str = "gpu", idle_since: float = B, held_since: float = B) -> IdleHolder:
    return IdleHolder("c1", "slurm", "7", "job-7", "alice", "research", queue, 1.0, idle_since, NOW - idle_since,
                      held_since, 1800.0, data_end=NOW)  # fmt: skip


def _outcomes(store: ChdbStore) -> list[tuple[str, str]]:
    return [(r["outcome"], r["mode"]) for r in store.query("SELECT outcome, mode FROM reclaim_actions ORDER BY at, "
                                                           "outcome = 'started' DESC")]  # fmt: skip


def _told(cfg: RulesConfig, log: ActionLog, *holders: IdleHolder, at: float = NOW - 600) -> None:
    """Their notices went to the receivers at ``at`` (the grace period, 600 s, before NOW)."""
    Reclaimer(cfg, log, {}).noticed(list(holders) or [_holder()], at)


def _decisions(store: ChdbStore) -> list[tuple[str, str]]:
    return [o for o in _outcomes(store) if o[0] != "noticed"]


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_action_decisions(store: ChdbStore) -> None:
    log = ActionLog(store)
    # off: nothing, nothing recorded
    rec = Recording()
    assert Reclaimer(_cfg(), log, {"slurm": rec}).step([_holder()], NOW) == []
    # within the grace period (idle 1800 + 600 needed, 2000 s idle): nothing yet
    on = _cfg(mode="on", allow_queues=["gpu"])
    assert Reclaimer(on, log, {"slurm": rec}).step([_holder(idle_since=NOW - 2000)], NOW) == []
    # not on the allow-list: refused once, however many rounds
    other = _holder(queue="other")
    for t in (NOW, NOW + 60):
        Reclaimer(on, log, {"slurm": rec}).step([other], t)
    # held its GPU less than the grace period (started 300 s ago, though idle samples say longer)
    Reclaimer(on, log, {"slurm": rec}).step([_holder(held_since=NOW - 300)], NOW)
    # samples older than max_sample_age_s (300 s): no action on stale data
    Reclaimer(on, log, {"slurm": rec}).step([_holder()], NOW + 301)
    assert rec.calls == []
    assert _outcomes(store) == [("refused", "on")] * 3
    store.execute("TRUNCATE TABLE reclaim_actions")
    # dry-run: recorded once, nothing done
    dry = _cfg(mode="dry-run", allow_queues=["gpu"])
    _told(dry, log)
    for t in (NOW, NOW + 60):
        Reclaimer(dry, log, {"slurm": rec}).step([_holder()], t)
    assert rec.calls == [] and _decisions(store) == [("would", "dry-run")]
    store.execute("TRUNCATE TABLE reclaim_actions")
    # on: two failures, then success; then never again, also after a restart (a new Reclaimer)
    rec = Recording(Outcome(False, "boom 1"), Outcome(False, "boom 2"))
    _told(on, log)
    for k in range(5):
        Reclaimer(on, log, {"slurm": rec}).step([_holder()], NOW + 60 * k)
    assert rec.calls == [("cancel", "7")] * 3
    assert [o for o, _ in _decisions(store)] == ["started", "failed", "started", "failed", "started", "done"]
    store.execute("TRUNCATE TABLE reclaim_actions")
    # always failing: max_attempts (3) calls, then one gave_up
    rec = Recording(*[Outcome(False, "no")] * 10)
    _told(on, log)
    for k in range(6):
        Reclaimer(on, log, {"slurm": rec}).step([_holder()], NOW + 60 * k)
    assert len(rec.calls) == 3
    assert [o for o, _ in _decisions(store)][-2:] == ["failed", "gave_up"]
    store.execute("TRUNCATE TABLE reclaim_actions")
    # a crash between `started` and the call's result: the call is made again at the next start
    _told(on, log)
    log.write([Reclaimer(on, log, {})._row(_holder(), NOW, "started", "cancel 7", 1)])
    rec = Recording(Outcome(True, "already ended (scancel: ... already completing or completed)"))
    Reclaimer(on, log, {"slurm": rec}).step([_holder()], NOW + 60)
    Reclaimer(on, log, {"slurm": rec}).step([_holder()], NOW + 120)
    assert rec.calls == [("cancel", "7")]
    # a call that stops the engine every time (killed mid-call: `started`, no outcome): each is
    # an attempt, so max_attempts (3) of them give up, not one more call at every restart
    store.execute("TRUNCATE TABLE reclaim_actions")
    _told(on, log)

    class Killed(BaseException):  # not an Exception: nothing in the engine catches it, as a kill
        pass

    class Killing:
        calls = 0

        def act(self, action: str, h: Any) -> Outcome:
            self.calls += 1
            raise Killed  # as if the process died: _contained records nothing, the step ends

    killing = Killing()
    for k in range(6):
        with contextlib.suppress(Killed):
            Reclaimer(on, log, {"slurm": killing}).step([_holder()], NOW + 60 * k)
    assert killing.calls == 3
    assert [o for o, _ in _decisions(store)] == ["started", "started", "started", "gave_up"]
    (gave_up,) = store.query("SELECT reason FROM reclaim_actions WHERE outcome = 'gave_up'")
    assert "3 failed attempt(s), 3 of them with no outcome" in gave_up["reason"]
    # a holder with no actor for its scheduler: a failure, recorded, not raised
    store.execute("TRUNCATE TABLE reclaim_actions")
    _told(on, log)
    Reclaimer(on, log, {}).step([_holder()], NOW)
    assert [o for o, _ in _decisions(store)] == ["failed"]
    # no notice went to its owner (no receiver, an outbox not written): refused once, never acted on
    store.execute("TRUNCATE TABLE reclaim_actions")
    rec = Recording()
    for k in range(3):
        Reclaimer(on, log, {"slurm": rec}).step([_holder()], NOW + 60 * k)
    assert rec.calls == [] and _outcomes(store) == [("refused", "on")]
    assert (
        "no notice of this idle run has gone to its owner"
        in store.query("SELECT reason FROM reclaim_actions")[0]["reason"]
    )


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_the_service_round_notices_and_a_failing_judgement_keeps_the_notices(
    store: ChdbStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuslo.rules import reclaim_round as rr
    from gpuslo.rules.alerts import Notifier
    from gpuslo.rules.receivers import Outcome as Sent
    from gpuslo.rules.receivers import Receiver
    from gpuslo.rules.service import RulesService

    write(store, batches("n1", [Holder("101", (0,), lambda t: IDLE)], NOW - 3600, NOW))
    cfg = _cfg(mode="on", allow_queues=["gpu"])
    rec = Recording()
    hook = Receiver.parse("webhook", "http://hooks/x")
    notifier = Notifier(tmp_path / "ob", [hook], post=lambda r, b, t: Sent("sent", 200, ""))
    svc = RulesService(cfg, lambda: store, source="raw", notifier=notifier, actors={"slurm": rec},
                       clock=lambda: NOW)  # fmt: skip
    s = svc.round()
    # idle an hour already at its first round (an outage, the loop just enabled): its owner is
    # told now, and nothing is done before the grace period (600 s) from now has passed
    assert [n["labels"]["job"] for n in s["reclaim"]["notices"]] == ["101"]
    assert s["reclaim"]["actions"] == [] and rec.calls == [] and s["alerting"]["new"] == 1
    write(store, batches("n1", [Holder("101", (0,), lambda t: IDLE)], NOW, NOW + 600))
    svc.clock = lambda: NOW + 540
    assert svc.round()["reclaim"]["actions"] == [] and rec.calls == []
    svc.clock = lambda: NOW + 600
    s = svc.round()
    assert [a["outcome"] for a in s["reclaim"]["actions"]] == ["started", "done"] and rec.calls == [
        ("cancel", "101")
    ]
    # the judgement fails (a bug met by its data): reported, the notice neither resolved nor re-sent
    monkeypatch.setattr(rr, "idle_holders", lambda *a, **k: 1 / 0)
    s = svc.round()
    assert s["reclaim"] == {"error": "ZeroDivisionError: division by zero"}
    assert (s["alerting"]["new"], s["alerting"]["resolved"]) == (0, 0)
    svc.store = None  # the fixture closes the store
    notifier.close()


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_without_a_receiver_no_notice_goes_and_nothing_is_done(store: ChdbStore, tmp_path: Path) -> None:
    """The action on, no alert receiver: its owner is never told, so the holder is never acted
    on (was: cancelled at the first round, with no notice at all)."""
    from gpuslo.rules.alerts import Notifier
    from gpuslo.rules.service import RulesService

    write(store, batches("n1", [Holder("101", (0,), lambda t: IDLE)], NOW - 3600, NOW + 3600))
    rec = Recording()
    for notifier in (None, Notifier(tmp_path / "ob")):
        svc = RulesService(_cfg(mode="on", allow_queues=["gpu"]), lambda: store, source="raw", notifier=notifier,
                           actors={"slurm": rec}, clock=lambda: NOW)  # fmt: skip
        for t in (NOW, NOW + 1800, NOW + 3600):
            svc.clock = lambda t=t: t  # type: ignore[misc]
            svc.round()
        svc.store = None
    assert rec.calls == [] and _outcomes(store) == [("refused", "on")]


def test_kubernetes_faults_are_recorded_failures(tmp_path: Path) -> None:
    """The Kubernetes actor against what a real API server connection can do wrong, without one:
    nothing listening, a token file gone, a non-JSON answer; each a failure with its reason."""
    from gpuslo.rules.actions import KubeActor, KubeCredentials, default_actors, http_request
    from tests.servers.ports import free_port

    h = IdleHolder(
        "c1", "k8s", "team-a/p", "team-a/p", "", "team-a", "team-a", 1.0, B, 3600.0, B, 60.0, uid="uid-1"
    )
    down = KubeCredentials(f"https://127.0.0.1:{free_port()}", token="t")
    out = KubeActor(http_request(down, 2.0)).act("delete", h)
    assert not out.ok and "Connection refused" in out.reason
    gone = KubeCredentials("https://127.0.0.1:1", token_file=str(tmp_path / "missing-token"))
    out = KubeActor(http_request(gone, 2.0)).act("delete", h)
    assert not out.ok and "missing-token" in out.reason

    def garbage(method: str, path: str, body: Any, ct: str) -> Any:
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    assert not KubeActor(garbage).act("suspend", h).ok
    from dataclasses import replace

    assert not KubeActor(garbage).act("delete", replace(h, name="no-namespace")).ok
    cfg = parse({"reclaim": {"enabled": True, "action": {"mode": "on", "kube_server": "https://k:6443",
                                                         "kube_token_file": str(tmp_path / "nope")}}})  # fmt: skip
    assert set(default_actors(cfg)) == {"slurm", "k8s"}  # built; the file is read at each call
    with pytest.raises(ConfigError, match="kube_token_file"):
        parse({"reclaim": {"action": {"kube_server": "https://k:6443"}}})


def test_an_unquoted_on_or_off_mode_is_the_word_it_was_written_as() -> None:
    """PyYAML reads ``mode: on`` as true (YAML 1.1): the error said "should be 'off', 'dry-run'
    or 'on'" of the very word written."""
    from gpuslo.core.yamlfile import parse_text

    def load(text: str) -> RulesConfig:
        return parse(parse_text(text, "<t>", ConfigError))

    for word, mode in (("on", "on"), ("off", "off"), ("'on'", "on"), ("dry-run", "dry-run")):
        for enabled in ("true", "yes", "on", "True"):  # a boolean field takes the words still
            text = f"reclaim:\n  enabled: {enabled}\n  action:\n    mode: {word}\n    allow_queues: [gpu]\n"
            assert load(text).reclaim.action.mode == mode and load(text).reclaim.enabled
    for word in ("yes", "true", "TRUE", "y", "yes please"):  # never taken for `on`
        with pytest.raises(ConfigError, match="mode"):
            load(f"reclaim:\n  enabled: true\n  action:\n    mode: {word}\n")
    with pytest.raises(ConfigError, match="mode"):
        parse({"reclaim": {"enabled": True, "action": {"mode": True}}})  # JSON's true, likewise


@pytest.mark.parametrize(("data", "field"), [({"eval_step_s": 6 * 10**26}, "eval_step_s"),
                                             ({"eval_step_s": 86_460}, "eval_step_s"),
                                             ({"slos": [{"name": "s", "service": "x", "threshold_ms": 5, "min_requests": 10**23}]},
                                              "min_requests")])  # fmt: skip
def test_config_numbers_past_any_use_are_refused(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse(data)


@pytest.mark.parametrize("server", ["http://k:6443", "file:///tmp/fake", "k:6443", "https://", "https://u:p@k:6443",
                                    "https://k:6443/?x=1", "https://k:6443#f", "https://k:notaport", "https://[::1",
                                    "ftp://k"])  # fmt: skip
def test_a_kube_server_that_is_not_https_is_a_config_error(server: str, tmp_path: Path) -> None:
    """The bearer token goes to https only (http sent it in clear; file:// made a delete
    "succeed" by reading a file, recorded done, never retried)."""
    with pytest.raises(ConfigError, match="is not an https://HOST"):
        parse({"reclaim": {"enabled": True, "action": {"mode": "on", "kube_server": server,
                                                       "kube_token_file": str(tmp_path / "t")}}})  # fmt: skip
    for good in (
        "https://k:6443",
        "https://10.0.0.1",
        "https://[::1]:6443",
        "https://rancher.example/k8s/clusters/c-1",
    ):
        parse({"reclaim": {"enabled": True, "action": {"mode": "on", "kube_server": good,
                                                       "kube_token_file": str(tmp_path / "t")}}})  # fmt: skip


@pytest.mark.integration  # a chDB store: over 0.7 s
@pytest.mark.parametrize("interval_s", [1.0, 10.0, 60.0, 300.0])
def test_the_idle_run_at_every_sampling_interval(store: ChdbStore, interval_s: float) -> None:
    # one GPU busy until B+1200, idle until NOW: idle since B+1200 at any of these intervals
    # (1200 and 3600 are multiples of each), 2400 s, 1 GPU
    busy_then_idle = Holder("9", (0,), lambda t: ACTIVE if t < B + 1200 else IDLE)
    write(store, batches("n1", [busy_then_idle], B, NOW, interval_s=interval_s, ngpus=1))
    (x,) = idle_holders(store, _cfg(), NOW)
    assert (x.id, x.idle_since, x.idle_for_s, x.gpus) == ("9", B + 1200, 2400.0, 1.0)


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_a_shared_gpu_is_as_busy_as_its_busiest_holder(store: ChdbStore) -> None:
    """Activity is the GPU's: two holders of halves of one GPU are idle together or not at all."""
    from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch

    def shared(t: float, act: float) -> GpuSampleBatch:
        allocs = tuple(Allocation(scheduler="slurm", id=j, user=u, account="a", queue="gpu", share=0.5)
                       for j, u in (("21", "alice"), ("22", "bob")))  # fmt: skip
        g = GpuSample(
            index=0, uuid="GPU-s", fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": act}, allocations=allocs
        )
        return GpuSampleBatch(source="n9", boot_id="b", seq=int(t), cluster="c1", ts=t, node="n9", pool="p",
                              interval_s=60.0, gpus=(g,))  # fmt: skip

    # idle for 3600 s, but busy (alice's work) for the last minute: neither is idle
    write(store, [shared(B + 60 * k, IDLE if k < 59 else ACTIVE) for k in range(60)])
    assert idle_holders(store, _cfg(), NOW) == []
    # the next half hour idle: both, each holding half a GPU: 0.5 x 1800 s = 0.25 GPU-hours
    write(store, [shared(NOW + 60 * k, IDLE) for k in range(30)])
    found = idle_holders(store, _cfg(), NOW + 1800)
    assert [(x.id, x.gpus, x.idle_for_s) for x in found] == [("21", 0.5, 1800.0), ("22", 0.5, 1800.0)]
    assert found[0].idle_gpu_hours == pytest.approx(0.25)


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_a_measured_shared_gpu_finds_its_idle_holder(store: ChdbStore) -> None:
    """The agent measured the split (docs/metrics.md): alice's processes did all the work on a
    busy GPU (activity 0.8), bob's nothing. On paper: bob's activity on his half is
    0.8 x 0 / 0.5 = 0, idle the whole hour; alice's 0.8 x 1 / 0.5 = 1.6, never idle."""
    from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch

    def shared(t: float) -> GpuSampleBatch:
        allocs = tuple(Allocation(scheduler="slurm", id=j, user=u, account="a", queue="gpu", share=0.5,
                                  activity_share=a, share_source="measured")
                       for j, u, a in (("21", "alice", 1.0), ("22", "bob", 0.0)))  # fmt: skip
        g = GpuSample(
            index=0, uuid="GPU-s", fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.8}, allocations=allocs
        )
        return GpuSampleBatch(source="n9", boot_id="b", seq=int(t), cluster="c1", ts=t, node="n9", pool="p",
                              interval_s=60.0, gpus=(g,))  # fmt: skip

    write(store, [shared(B + 60 * k) for k in range(60)])
    found = idle_holders(store, _cfg(), NOW)
    assert [(x.id, x.user, x.gpus, x.idle_since, x.idle_for_s) for x in found] == [
        ("22", "bob", 0.5, B, 3600.0)
    ]


def test_the_notice_says_what_will_be_done_only_when_it_will() -> None:
    x = _holder()
    assert (
        "cancelled once idle 0.7 h" in notice(_cfg(mode="on", allow_queues=["gpu"]), x).annotations["summary"]
    )
    for cfg in (_cfg(mode="dry-run", allow_queues=["gpu"]), _cfg(mode="on", allow_queues=["other"]), _cfg()):
        assert "will be" not in notice(cfg, x).annotations["summary"]


@pytest.mark.parametrize("job", ["101", "team-a/train-0", "x'; rm -rf ~ #", "$(id)"])
def test_without_a_report_url_the_notice_names_the_command_quoted_for_a_shell(job: str) -> None:
    """A job id or pod name comes from whoever submitted the job: pasted from a notice into a shell
    it must stay one argument (shlex round-trip), with the cluster that tells same-named jobs apart."""
    import shlex

    from gpuslo.rules.reclaim import IdleHolder, report_link

    holder = IdleHolder(cluster="c 1", scheduler="slurm", id=job, name="n", user="u", account="a", queue="q",
                        gpus=1.0, idle_since=0.0, idle_for_s=7200.0, held_since=0.0, threshold_s=3600.0)  # fmt: skip
    assert shlex.split(report_link(RulesConfig(), holder)) == ["gpuslo", "job", job, "--cluster", "c 1"]


class MemoryLog(ActionLog):
    """The action log's rows in memory, read back as ActionLog.history orders them (by time,
    `started` first), so a test of the decisions needs no store."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def history(self, holders: Any) -> dict[tuple[str, str], list[dict[str, Any]]]:
        out: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in sorted(self.rows, key=lambda r: (r["at"], r["outcome"] != "started")):
            out.setdefault((r["cluster"], r["holder_id"]), []).append(r)
        return out

    def write(self, rows: Any) -> None:
        self.rows += rows


def test_an_actor_that_raises_is_a_failed_attempt_counted_to_max_attempts() -> None:
    """An actor raising (an answer of a shape it did not expect) left a `started` row with no
    outcome: retried every round for ever, and the round's other holders skipped."""

    class Raising:
        calls = 0

        def act(self, action: str, x: IdleHolder) -> Outcome:
            Raising.calls += 1
            raise AttributeError("'list' object has no attribute 'get'")

    log = MemoryLog()
    on = _cfg(mode="on", allow_queues=["gpu"])
    _told(on, log)
    for k in range(6):
        Reclaimer(on, log, {"slurm": Raising()}).step([_holder()], NOW + 60 * k)
    assert Raising.calls == 3  # max_attempts
    assert [r["outcome"] for r in log.rows] == ["noticed", *["started", "failed"] * 3, "gave_up"]
    assert "AttributeError: 'list' object has no attribute 'get'" in log.rows[2]["reason"]


@pytest.mark.parametrize(
    "answers",
    [
        [[1, 2]],
        [None],
        [{"metadata": "x"}],
        [{"metadata": {"uid": "u"}}, {"items": [1, None, "x"]}],
        [{"metadata": {"uid": "u"}}, {"items": "abc"}],
        [{"metadata": {"uid": "u", "ownerReferences": [None, 3]}}, {"items": []}],
        [
            {"metadata": {"uid": "u"}},
            {"items": [{"metadata": {"ownerReferences": [{"uid": "u"}]}}]},
        ],  # no name
    ],
)
def test_kubernetes_answers_of_any_shape_are_failures_not_tracebacks(answers: list[Any]) -> None:
    from gpuslo.rules.actions import KubeActor

    calls: list[tuple[str, str]] = []

    def req(method: str, path: str, body: Any, ct: str) -> Any:
        calls.append((method, path))
        return answers.pop(0) if answers else {}

    h = IdleHolder(
        "c1", "k8s", "team-a/p", "team-a/p", "", "team-a", "team-a", 1.0, B, 3600.0, B, 60.0, uid="u"
    )
    out = KubeActor(req).act("suspend", h)
    assert not out.ok and out.reason == "no Kueue workload owns pod team-a/p (or its Job)"
    assert all(m == "GET" for m, _ in calls)


@pytest.mark.parametrize(
    "name",
    ["team-a/..", "team-a/.", "team-a/p/../../../api/v1/namespaces/other/pods/x", "../x", "team-a/p?dryRun=All",
     "team-a/p#x", "Team-A/p", "team-a/P", "team-a/p%2F..", "team-a/" + "p" * 254, "a" * 64 + "/p", "team-a/",
     "/p", "team-a/p\n", "team-a/p\u202e"],
)  # fmt: skip
def test_a_pod_name_outside_kubernetes_rules_never_reaches_the_api(name: str) -> None:
    """The name comes from the data: 'ns/..' reached the namespace's path (DELETE of
    /api/v1/namespaces/ns/pods/.. is the namespace once the path is cleaned)."""
    from gpuslo.rules.actions import KubeActor

    calls: list[str] = []

    def req(method: str, path: str, body: Any, ct: str) -> Any:
        calls.append(path)
        return {}

    h = IdleHolder("c1", "k8s", name, name, "", "team-a", "team-a", 1.0, B, 3600.0, B, 60.0, uid="uid-1")
    for action in ("delete", "suspend"):
        out = KubeActor(req).act(action, h)
        assert not out.ok and out.reason == f"not a namespace/name pod: {name!r}"
    assert calls == []
    ok = IdleHolder(
        "c1",
        "k8s",
        "team-a/p-1.x",
        "team-a/p-1.x",
        "",
        "team-a",
        "team-a",
        1.0,
        B,
        3600.0,
        B,
        60.0,
        uid="uid-1",
    )
    assert KubeActor(req).act("delete", ok).ok and calls == ["/api/v1/namespaces/team-a/pods/p-1.x"]


@pytest.mark.parametrize("job", ["\u00b2", "\u0661\u0662\u0663", "1_\u00b2", "--help", "-1", "1; rm -rf /", "0",
                                 "01", "1\n2", " 1", "1_", "_1", "1_2_3", "9" * 21, ""])  # fmt: skip
def test_a_slurm_job_id_that_is_not_ascii_digits_runs_nothing(job: str) -> None:
    """str.isdigit() took '²' and Arabic-Indic digits: scancel was run on them."""
    import subprocess

    from gpuslo.rules.actions import SlurmActor

    ran: list[list[str]] = []

    def run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        ran.append(argv)
        if argv[0] != "squeue":
            return subprocess.CompletedProcess(argv, 0, "", "")
        j = argv[3]  # squeue -h -j J -o '%A %i %T' as slurmctld answers it (an array's task: its own id)
        return subprocess.CompletedProcess(argv, 0, f"{'12' if '_' in j else j} {j} RUNNING\n", "")

    from dataclasses import replace

    out = SlurmActor(run).act("cancel", replace(_holder(), id=job))
    assert not out.ok and out.reason == f"not a Slurm job id: {job!r}" and ran == []
    for good in ("7", "7_3"):
        assert SlurmActor(run).act("cancel", replace(_holder(), id=good)).ok
    assert ["scancel", "--verbose", "7_3"] in ran


class _Slow:
    """An actor whose every call takes ``cost_s`` on the round's clock (a scancel that waits for
    its timeout), succeeding or failing as told."""

    def __init__(self, clock: list[float], cost_s: float, ok: bool = True) -> None:
        self.clock, self.cost_s, self.ok = clock, cost_s, ok
        self.calls: list[str] = []

    def act(self, action: str, x: IdleHolder) -> Outcome:
        self.calls.append(x.job)
        self.clock[0] += self.cost_s
        return Outcome(self.ok, "ok" if self.ok else "timed out")


def _jobs(n: int) -> list[IdleHolder]:
    return [IdleHolder("c1", "slurm", str(j), f"job-{j}", "alice", "research", "gpu", 1.0, B, NOW - B, B, 1800.0,
                       data_end=NOW) for j in range(n)]  # fmt: skip


@pytest.mark.parametrize(
    ("round_s", "cost_s", "calls"), [(120, 50, 3), (120, 40, 3), (120, 39, 4), (100, 200, 1)]
)
def test_a_round_starts_its_calls_within_round_s_and_the_rest_wait(
    round_s: float, cost_s: float, calls: int
) -> None:
    """Calls start while the round's time is not spent: at 0, c, 2c ... < round_s, i.e.
    ceil(round_s / c) calls (worked out by hand per case); the others are not recorded at all
    and are decided at the next rounds, until every holder was called once."""
    clock = [0.0]
    actor = _Slow(clock, cost_s)
    log = MemoryLog()
    on = _cfg(mode="on", allow_queues=["gpu"], round_s=round_s)
    r = Reclaimer(on, log, {"slurm": actor}, clock=lambda: clock[0])
    _told(on, log, *_jobs(6))
    rows = r.step(_jobs(6), NOW)
    assert len(actor.calls) == calls
    assert [x["outcome"] for x in rows] == ["started", "done"] * calls
    rounds = 1
    while len(actor.calls) < 6:
        r.step(_jobs(6), NOW + 60 * rounds)
        rounds += 1
        assert rounds < 10
    assert sorted(actor.calls, key=int) == [str(j) for j in range(6)]  # each once, none twice
    r.step(_jobs(6), NOW + 60 * rounds)
    assert len(actor.calls) == 6


def test_slow_failing_calls_do_not_keep_the_other_holders_waiting() -> None:
    """Every call fails after 100 s with a 120 s round: two calls a round. The holders never
    called go first, so all six are tried in three rounds, not the same two for ever."""
    clock = [0.0]
    actor = _Slow(clock, 100, ok=False)
    log = MemoryLog()
    on = _cfg(mode="on", allow_queues=["gpu"], round_s=120)
    r = Reclaimer(on, log, {"slurm": actor}, clock=lambda: clock[0])
    _told(on, log, *_jobs(6))
    for k in range(3):
        r.step(_jobs(6), NOW + 60 * k)
    assert sorted(actor.calls, key=int) == [str(j) for j in range(6)]


def test_refusals_are_still_recorded_when_the_round_time_is_spent() -> None:
    clock = [0.0]
    actor = _Slow(clock, 500)
    log = MemoryLog()
    on = _cfg(mode="on", allow_queues=["gpu"], round_s=120)
    other = IdleHolder("c1", "slurm", "99", "job-99", "bob", "research", "other", 1.0, B, NOW - B, B, 1800.0,
                       data_end=NOW)  # fmt: skip
    _told(on, log, *_jobs(2), other)
    Reclaimer(on, log, {"slurm": actor}, clock=lambda: clock[0]).step([*_jobs(2), other], NOW)
    assert len(actor.calls) == 1
    assert sorted(r["outcome"] for r in log.rows if r["outcome"] != "noticed") == [
        "done",
        "refused",
        "started",
    ]


# ------------------------------------------------ a holder's log, however long ago it started
def _rounds(store: ChdbStore, cfg: RulesConfig, actor: Recording, times: range) -> list[str]:
    """Service-like rounds (judge, the notices taken as sent, decide) at ``times``."""
    out: list[str] = []
    for t in times:
        _, j = reclaim_round(store, cfg, {"slurm": actor}, float(t))
        out += [a["outcome"] for a in (j or {}).get("actions", [])]
    return out


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_a_requeued_job_is_acted_on_once_however_long_ago_it_started(store: ChdbStore) -> None:
    """Job 7 started once (Slurm's collector reports one start per job id), idle: requeued. It
    runs again under its id, busy, then idle again past the look-back (1800 + 600 + 600 s):
    its start, older than the samples read back, still bounds its log, whose `done` holds
    (was: its start not found, the log cut at its first sample read back, a second requeue)."""
    cfg = parse({"reclaim": {"enabled": True, "idle_after_s": 1800,
                             "action": {"mode": "on", "slurm": "requeue", "grace_s": 600, "allow_queues": ["gpu"]}}})  # fmt: skip
    write(
        store,
        [h.sched("start", "7", B, queue="gpu"), *batches("n1", [Holder("7", (0,), lambda t: IDLE)], B, NOW)],
    )
    rec = Recording()
    assert _rounds(store, cfg, rec, range(int(NOW - 600), int(NOW + 1), 600)) == ["started", "done"]
    # requeued: pending 300 s, then runs under id 7 again: busy 300 s, then idle for an hour
    write(store, batches("n1", [Holder("7", (0,), lambda t: ACTIVE if t < NOW + 600 else IDLE)], NOW + 300,
                         NOW + 6000))  # fmt: skip
    assert _rounds(store, cfg, rec, range(int(NOW + 60), int(NOW + 6000), 300)) == []
    assert rec.calls == [("requeue", "7")]


@pytest.mark.integration  # a chDB store: over 0.7 s
@pytest.mark.parametrize("started", [True, False])
def test_a_holder_given_up_on_stays_given_up_for_hours(store: ChdbStore, started: bool) -> None:
    """Every call fails: max_attempts (3) calls, one gave_up, then nothing for three hours of
    one-minute rounds, with its start reported (hours before the look-back) or none at all (was:
    12 calls and 4 gave_up, the log cut at a first sample that moves with the look-back)."""
    cfg = parse({"reclaim": {"enabled": True, "idle_after_s": 1800,
                             "action": {"mode": "on", "grace_s": 600, "allow_queues": ["gpu"]}}})  # fmt: skip
    end = NOW + 4 * 3600
    write(store, [*([h.sched("start", "7", B, queue="gpu")] if started else []),
                  *batches("n1", [Holder("7", (0,), lambda t: IDLE)], B, end)])  # fmt: skip
    rec = Recording(*[Outcome(False, "Access/permission denied")] * 20)
    outcomes = _rounds(store, cfg, rec, range(int(NOW), int(end - 600), 60))
    assert len(rec.calls) == 3 and outcomes.count("gave_up") == 1, outcomes


@pytest.mark.integration  # a chDB store: over 0.7 s
@pytest.mark.parametrize("sent", [True, False])
def test_a_notice_of_an_earlier_idle_run_never_counts_for_the_next(store: ChdbStore, sent: bool) -> None:
    """Job 7 idle, noticed at B+1800; its owner comes back (busy B+2300..B+2600), then it idles
    again while the rules engine is away; back at B+6000 the new run began before the samples
    read back. The earlier notice does not count: the job is told now (or, its notice not
    queued, refused) and acted on grace_s later at the earliest (it was cancelled at once, with
    nothing said of the new idle run, even when no notice could be queued)."""
    cfg = parse({"reclaim": {"enabled": True, "idle_after_s": 1800,
                             "action": {"mode": "on", "grace_s": 600, "allow_queues": ["gpu"]}}})  # fmt: skip
    busy = (B + 2300, B + 2600)
    write(store, [h.sched("start", "7", B, queue="gpu"),
                  *batches("n1", [Holder("7", (0,), lambda t: ACTIVE if busy[0] <= t < busy[1] else IDLE)], B,
                           B + 7000)])  # fmt: skip
    rec = Recording()
    assert _rounds(store, cfg, rec, range(int(B + 1800), int(B + 2101), 300)) == []  # noticed; within grace
    _, j = reclaim_round(store, cfg, {"slurm": rec}, B + 6000, sent=sent)
    (x,) = idle_holders(store, cfg, B + 6000)
    assert x.clipped and rec.calls == []
    assert [a["outcome"] for a in (j or {})["actions"]] == ([] if sent else ["refused"])
    if sent:
        assert _rounds(store, cfg, rec, range(int(B + 6300), int(B + 6301))) == []  # told 300 s ago
        assert _rounds(store, cfg, rec, range(int(B + 6600), int(B + 6601))) == ["started", "done"]


def test_a_notice_to_another_owner_does_not_count() -> None:
    """The holder's notice went under one account; its labels now name another (the owner it is
    told to has changed): the earlier notice does not count, the new one is waited for."""
    from dataclasses import replace

    log = MemoryLog()
    on = _cfg(mode="on", allow_queues=["gpu"])
    _told(on, log)  # to alice / research, 600 s ago
    moved = replace(_holder(), account="vision", user="bob")
    rec = Recording()
    assert [r["outcome"] for r in Reclaimer(on, log, {"slurm": rec}).step([moved], NOW)] == ["refused"]
    _told(on, log, moved, at=NOW)  # bob is told now
    assert Reclaimer(on, log, {"slurm": rec}).step([moved], NOW + 300) == [] and rec.calls == []
    Reclaimer(on, log, {"slurm": rec}).step([replace(moved, data_end=NOW + 600)], NOW + 600)
    assert rec.calls == [("cancel", "7")]


@pytest.mark.integration  # a chDB store: over 0.7 s
def test_a_holder_whose_nodes_disagree_is_named_by_the_one_that_knows(store: ChdbStore) -> None:
    """A two-node job; one node's agent knows its owner, the other's does not (empty user): the
    notice names the owner (any() picked the empty one: no `user` label to route on)."""
    write(store, [h.sched("start", "7", B, queue="gpu")])
    for node, user in (("n1", "alice"), ("n2", ""), ("n3", "")):
        write(store, batches(node, [Holder("7", (0, 1), lambda t: IDLE, user=user)], B, NOW))
    cfg = parse({"reclaim": {"enabled": True, "idle_after_s": 1800}})
    (x,) = idle_holders(store, cfg, NOW)
    assert x.user == "alice" and notice(cfg, x).labels["user"] == "alice"


@pytest.mark.integration  # a chDB store: over 0.7 s
@pytest.mark.parametrize(("first", "then"), [(60.0, 10.0), (10.0, 60.0)])
def test_a_sampling_rate_that_changes_without_a_hole_keeps_the_idle_run(
    store: ChdbStore, first: float, then: float
) -> None:
    # One GPU of job 201 idle all hour: sampled every `first` s over [B, B+1800), then every `then` s
    # to NOW, back to back. One run (the gap bound is twice the interval of the sample before:
    # docs/metrics.md): idle since B, 3600 s. A hole after the first half of `first` + 1 s past the
    # end of its last sample breaks it: idle since the first sample after the hole (the second
    # part then runs on to NOW+1800, so that the run after the hole is past the threshold).
    def samples(start: float, end: float, iv: float) -> list[Any]:
        n = int((end - start) / iv)
        return [
            h.batch("n1", start + k * iv, [h.gpu(0, 0.0, (("201", 1.0),))], interval_s=iv) for k in range(n)
        ]

    write(store, samples(B, B + 1800, first) + samples(B + 1800, NOW, then))
    (x,) = idle_holders(store, _cfg(), NOW)
    assert (x.id, x.idle_since, x.idle_for_s) == ("201", B, 3600.0)
    store.execute("TRUNCATE TABLE gpu_samples")
    after = B + 1800 + first + 1
    write(store, samples(B, B + 1800, first) + samples(after, NOW + 1800, then))
    (x,) = idle_holders(store, _cfg(), NOW + 1800)
    last_end = after + int((NOW + 1800 - after) / then) * then
    assert (x.id, x.idle_since, x.idle_for_s) == ("201", after, last_end - after)

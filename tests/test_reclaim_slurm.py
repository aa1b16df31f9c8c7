"""The idle-reclaim loop on a real slurmctld + slurmd: the jobs run there, the agent's Slurm
attribution (``SlurmAttribution``) and event collector read them, and the GPU is simulated:
each GPU's activity is the function of time the test gives its job (tests/reclaim_fleet.py),
written to the store as the node agent would send it. The rules are evaluated at a chosen
``now`` after the job's real start (the samples run up to it), and the action calls the real
``scancel`` / ``scontrol requeue``."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslo.agent.slurm import SlurmAttribution, SlurmEventCollector
from gpuslo.core.proc import Children
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.actions import SlurmActor
from gpuslo.rules.config import RulesConfig, parse
from gpuslo.rules.reclaim_round import reclaim_round
from gpuslo.wire import GpuSample, GpuSampleBatch, SchedulerEvent
from tests.reclaim_fleet import ACTIVE, IDLE
from tests.servers.slurm import SlurmCluster, available

pytestmark = pytest.mark.integration

CLUSTER = "gpuslo"
_run = Children().run  # Slurm's real commands, as the actor runs them
Activity = Callable[[float], float]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if not available():
        pytest.fail("Slurm is not installed (scripts/test.sh installs slurm-wlm and munge)")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def on_slurm(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    yield slurm
    ids = slurm.run("squeue", "-h", "-o", "%i").split()
    if ids:
        slurm.run("scancel", *ids)
    _wait(lambda: not slurm.run("squeue", "-h", "-o", "%i").strip(), "the queue to empty")


def _wait(ok: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _state(slurm: SlurmCluster, job: str) -> str:
    out = slurm.run("scontrol", "show", "job", job)
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else ""


def _agent(store: ChdbStore, slurm: SlurmCluster, state: Path, start: float, end: float,
           activity: dict[str, Activity], interval_s: float = 10.0) -> dict[str, float]:  # fmt: skip
    """The node agent from ``start`` to ``end``: the real attribution of each GPU (read once:
    the jobs do not move), the simulated activity of its job, and the collector's events; the
    jobs' start times as the collector sent them."""
    attr = SlurmAttribution(slurm.node)
    attr.refresh()
    events = [
        m for m in SlurmEventCollector(CLUSTER, state).collect(time.time()) if isinstance(m, SchedulerEvent)
    ]
    msgs: list[object] = list(events)
    seq = 0
    t = start
    while t < end:
        gpus = []
        for g in range(slurm.gpus):
            held = attr(g, "")
            act = activity.get(held[0].id, lambda t: IDLE)(t) if held else IDLE
            gpus.append(GpuSample(index=g, uuid=f"GPU-{g}", fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": act},
                                  allocations=held))  # fmt: skip
        seq += 1
        msgs.append(GpuSampleBatch(source=slurm.node, boot_id="b", seq=seq, cluster=CLUSTER, ts=t, node=slurm.node,
                                   pool="gpu", interval_s=interval_s, gpus=tuple(gpus)))  # fmt: skip
        t += interval_s
    write(store, msgs)  # type: ignore[arg-type]
    return {e.request_id: e.ts for e in events if e.event == "start"}


def _cfg(mode: str = "on", allow: tuple[str, ...] = ("gpu",), action: str = "cancel") -> RulesConfig:
    return parse({"reclaim": {"enabled": True, "idle_after_s": 60, "action": {
        "mode": mode, "grace_s": 60, "allow_queues": list(allow), "slurm": action}}})  # fmt: skip


class Counting:
    """The real scancel / scontrol, counted."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        if argv[0] != "squeue":
            self.calls.append(argv)
        return _run(argv, timeout_s)


def _log(store: ChdbStore) -> list[tuple[str, str, str]]:
    rows = store.query(
        "SELECT job, outcome, reason FROM reclaim_actions WHERE outcome != 'noticed' "
        "ORDER BY at, outcome = 'started' DESC, job"
    )
    return [(r["job"], r["outcome"], r["reason"]) for r in rows]


def test_an_idle_job_is_noticed_then_cancelled_and_an_active_one_never(
    on_slurm: SlurmCluster, store: ChdbStore, tmp_path: Path
) -> None:
    slurm = on_slurm
    idle, busy = slurm.sbatch(1, "idle-a"), slurm.sbatch(2, "busy-b")
    _wait(lambda: _state(slurm, idle) == _state(slurm, busy) == "RUNNING", "both jobs to run")
    t0 = time.time()
    # idle: busy for its first 20 s, then idle. busy: active all along.
    act = {idle: lambda t: ACTIVE if t < t0 + 20 else IDLE, busy: lambda t: ACTIVE}
    started = _agent(store, slurm, tmp_path / "col.json", t0, t0 + 100, act)
    assert set(started) == {idle, busy}
    run = Counting()
    actors = {"slurm": SlurmActor(run=run)}
    # at t0 + 100: idle since t0 + 20 for 80 s >= 60: a notice (it goes now); 80 < 60 + 60: no action yet
    notices, out = reclaim_round(store, _cfg(), actors, t0 + 100)
    assert [(a.labels["job"], a.labels["queue"], a.labels["user"], a.labels["account"]) for a in notices] == [
        (idle, "gpu", "root", "research")
    ]
    assert float(notices[0].annotations["idle_gpu_hours"]) == pytest.approx(80 / 3600, abs=1e-4)
    assert notices[0].annotations["report"] == f"gpuslo job {idle} --cluster {CLUSTER}"
    assert out is not None and out["actions"] == [] and run.calls == []
    # at t0 + 150: idle 130 s >= 120, but told only 50 s ago (< grace_s): not yet
    _agent(store, slurm, tmp_path / "col.json", t0 + 100, t0 + 150, act)
    assert reclaim_round(store, _cfg(), actors, t0 + 150)[1]["actions"] == []  # type: ignore[index]
    # at t0 + 160: told 60 s ago: scancel, for real
    _agent(store, slurm, tmp_path / "col.json", t0 + 150, t0 + 160, act)
    _, out = reclaim_round(store, _cfg(), actors, t0 + 160)
    assert run.calls == [["scancel", "--verbose", idle]]
    assert [(j, o) for j, o, _ in _log(store)] == [(idle, "started"), (idle, "done")]
    assert _log(store)[1][2].startswith(
        f"scancel --verbose {idle}: RUNNING -> "
    )  # the state before and after
    _wait(lambda: _state(slurm, idle) in ("CANCELLED", ""), f"job {idle} cancelled")
    assert _state(slurm, busy) == "RUNNING"
    # a restarted engine at t0 + 170, the samples still saying idle (the agent lags): no second scancel
    _agent(store, slurm, tmp_path / "col.json", t0 + 160, t0 + 170, act)
    reclaim_round(store, _cfg(), {"slurm": SlurmActor(run=run)}, t0 + 170)
    assert run.calls == [["scancel", "--verbose", idle]]
    # the collector reports the end: the notice resolves (no longer among the notices)
    _agent(store, slurm, tmp_path / "col2.json", t0 + 170, t0 + 180, act)
    notices, _ = reclaim_round(store, _cfg(), actors, t0 + 180)
    assert [a.labels["job"] for a in notices] == []


def test_not_allowed_queue_and_dry_run_touch_nothing(
    on_slurm: SlurmCluster, store: ChdbStore, tmp_path: Path
) -> None:
    slurm = on_slurm
    a, b = slurm.sbatch(1, "idle-c"), slurm.sbatch(1, "idle-d")
    _wait(lambda: _state(slurm, a) == _state(slurm, b) == "RUNNING", "both jobs to run")
    t0 = time.time()
    _agent(store, slurm, tmp_path / "col.json", t0, t0 + 200, {})  # both idle all along
    run = Counting()
    actors = {"slurm": SlurmActor(run=run)}
    reclaim_round(store, _cfg(allow=("other",)), actors, t0 + 200)
    reclaim_round(store, _cfg(allow=("other",)), actors, t0 + 200 + 60)  # refused once, not every round
    assert run.calls == []
    assert sorted(o for _, o, _ in _log(store)) == ["refused", "refused"]
    assert all("'gpu' is not on reclaim.action.allow_queues" in r for _, _, r in _log(store))
    store.execute("TRUNCATE TABLE reclaim_actions")
    assert reclaim_round(store, _cfg(mode="dry-run"), actors, t0 + 200)[1]["actions"] == []  # type: ignore[index]
    _, out = reclaim_round(store, _cfg(mode="dry-run"), actors, t0 + 260)  # told 60 s ago
    assert out is not None and sorted((x["job"], x["outcome"]) for x in out["actions"]) == [
        (a, "would"),
        (b, "would"),
    ]
    assert {r for _, _, r in _log(store)} == {f"would cancel {a} (dry-run)", f"would cancel {b} (dry-run)"}
    assert run.calls == []
    assert _state(slurm, a) == _state(slurm, b) == "RUNNING"


def test_a_recent_job_is_never_cancelled_and_requeue_works(
    on_slurm: SlurmCluster, store: ChdbStore, tmp_path: Path
) -> None:
    slurm = on_slurm
    j = slurm.sbatch(1, "recent-e")
    _wait(lambda: _state(slurm, j) == "RUNNING", "the job to run")
    now = time.time()
    # idle samples attributed to it from 500 s before now (an agent mapping a reused GPU late, a
    # clock off): idle 500 s, but the scheduler started it a few seconds ago: held < grace (60 s)
    started = _agent(store, slurm, tmp_path / "col.json", now - 500, now, {})
    assert now - started[j] < 60
    run = Counting()
    reclaim_round(store, _cfg(), {"slurm": SlurmActor(run=run)}, now)
    assert run.calls == []
    assert [o for _, o, _ in _log(store)] == ["refused"] and "less than the grace period" in _log(store)[0][2]
    assert _state(slurm, j) == "RUNNING"
    # later: held long enough; the requeue action, for real
    later = started[j] + 200
    _agent(store, slurm, tmp_path / "col.json", now, later, {})
    # Slurm's times are seconds: the requeue after the second it started in
    _wait(lambda: time.time() >= started[j] + 1, "its run's first second to pass")
    reclaim_round(store, _cfg(action="requeue"), {"slurm": SlurmActor(run=run)}, later)
    assert run.calls == [["scontrol", "requeue", j]]
    assert [o for _, o, _ in _log(store)][-2:] == ["started", "done"]
    assert "Restarts=1" in slurm.run("scontrol", "show", "job", j)
    # it runs again under its id (Slurm holds a requeued job ~2 min: released at once here), the
    # collector sending its first run's end (a preempt) and its second as request J#2; idle
    # again: noticed again (was: the preempt ended the job for ever), but not requeued twice
    _wait(lambda: _state(slurm, j) == "PENDING", "the requeued job to wait")
    slurm.run("scontrol", "update", f"JobId={j}", "StartTime=now")
    _wait(lambda: _state(slurm, j) == "RUNNING", "the requeued job to run again")
    again = _agent(store, slurm, tmp_path / "col.json", later + 100, later + 500, {})  # (a hole: a new run)
    assert list(again) == [f"{j}#2"]
    for t in (later + 300, later + 390):
        notices, _ = reclaim_round(store, _cfg(action="requeue"), {"slurm": SlurmActor(run=run)}, t)
        assert [a.labels["job"] for a in notices] == [j]
    assert run.calls == [["scontrol", "requeue", j]] and _state(slurm, j) == "RUNNING"


def test_scancel_failures_are_recorded_not_raised(on_slurm: SlurmCluster) -> None:
    # a job id Slurm does not know: its own answer, classified as already ended
    out = SlurmActor().act("cancel", _with_id("999999"))
    assert out.ok and out.reason == "already ended (squeue lists no job 999999)", out
    # scancel itself on an unknown id (squeue's answer taken away): its verbose error is read
    ran = []

    def no_squeue(argv: list[str], t: float) -> subprocess.CompletedProcess[str]:
        ran.append(argv[0])
        listed = "999999 999999 RUNNING\n"  # squeue -o '%A %i %T'
        return subprocess.CompletedProcess(argv, 0, listed, "") if argv[0] == "squeue" else _run(argv, t)

    out = SlurmActor(run=no_squeue).act("cancel", _with_id("999999"))
    assert ran == ["squeue", "scancel"] and out.ok and "Invalid job id specified" in out.reason, out
    # a job cancelled by its owner meanwhile (squeue still lists it, CANCELLED): neither a second
    # scancel nor a requeue (which Slurm would accept, queueing the cancelled job again)
    j = slurm_cancelled(on_slurm)
    for action in ("cancel", "requeue"):
        ran.clear()
        out = SlurmActor(run=lambda argv, t: (ran.append(argv[0]), _run(argv, t))[1]).act(action, _with_id(j))
        assert ran == ["squeue"] and out.ok and out.reason.startswith("already ended"), out
    assert "Restarts=0" in on_slurm.run("scontrol", "show", "job", j)
    # the command missing
    out = SlurmActor(run=lambda argv, t: _run(["/nonexistent/" + argv[0], *argv[1:]], t)).act(
        "cancel", _with_id("1")
    )
    assert not out.ok and "No such file" in out.reason
    # not a job id at all: nothing is run
    assert not SlurmActor(run=lambda a, t: pytest.fail("ran")).act("cancel", _with_id("1; rm -rf /")).ok


def _array(slurm: SlurmCluster, tasks: str) -> dict[str, str]:
    """A job array of one-GPU tasks, all running: {task name (%i): its job id (%A)}."""
    out = slurm.run("sbatch", "--parsable", "-A", "research", "-J", "arr", "--gres=gpu:1", "-N", "1",
                    f"--array={tasks}", f"--output={slurm.dir}/log/slurm-%A_%a.out", "--wrap", "sleep 600")  # fmt: skip
    array = out.strip().split(";")[0]

    def listed() -> dict[str, tuple[str, str]]:
        rows = [x.split() for x in slurm.run("squeue", "-h", "-j", array, "-o", "%A %i %T").splitlines() if x]
        return {i: (a, st) for a, i, st in rows}

    _wait(
        lambda: len(listed()) > 1 and all(st == "RUNNING" for _, st in listed().values()), "the tasks to run"
    )
    return {i: a for i, (a, _) in listed().items()}


def _last(tasks: dict[str, str]) -> tuple[str, str]:
    """(the task with the array's job id, its sibling's job id) of a two-task array."""
    (last,) = [i for i, a in tasks.items() if i.split("_")[0] == a]
    (sibling,) = [a for i, a in tasks.items() if i != last]
    return last, sibling


@pytest.mark.parametrize("action", ["cancel", "requeue"])
def test_an_array_task_is_acted_on_alone(on_slurm: SlurmCluster, action: str) -> None:
    """The last task of an array started has the array's job id (slurmctld: 1_0 is job 2, 1_1
    job 1). Idle, it alone is cancelled or requeued, by its task name (`scancel 1` is the whole
    array), and its sibling runs on. Was: squeue -j 1 listed both tasks, 'RUNNING RUNNING' read
    as not running: recorded done, nothing done."""
    tasks = _array(on_slurm, "0-1")
    last, sibling = _last(tasks)
    out = SlurmActor().act(action, _with_id(tasks[last]))
    verb = ["scancel", "--verbose"] if action == "cancel" else ["scontrol", "requeue"]
    assert out.ok and out.reason.startswith(" ".join([*verb, last]) + ": RUNNING -> "), out
    assert _state(on_slurm, sibling) == "RUNNING" and _state(on_slurm, last) != "RUNNING"


@pytest.mark.parametrize("action", ["cancel", "requeue"])
def test_an_array_task_its_owner_ended_leaves_its_sibling_alone(on_slurm: SlurmCluster, action: str) -> None:
    """The task with the array's id ended by its owner before the action (decided on samples a
    round behind): already ended, no call. Was: squeue -j 1 listed the sibling alone, RUNNING,
    and `scancel 1` cancelled the sibling, a job never judged idle."""
    tasks = _array(on_slurm, "0-1")
    last, sibling = _last(tasks)
    on_slurm.run("scancel", last)  # its owner
    _wait(lambda: _state(on_slurm, last) in ("CANCELLED", ""), "its owner's cancel")
    ran: list[list[str]] = []
    out = SlurmActor(run=lambda argv, t: (ran.append(argv), _run(argv, t))[1]).act(
        action, _with_id(tasks[last])
    )
    assert out.ok and out.reason.startswith("already ended"), out
    assert [a[0] for a in ran] == ["squeue"] and _state(on_slurm, sibling) == "RUNNING"


def slurm_cancelled(slurm: SlurmCluster) -> str:
    j = slurm.sbatch(1, "owner-cancels")
    _wait(lambda: _state(slurm, j) == "RUNNING", "the job to run")
    slurm.run("scancel", j)
    _wait(lambda: _state(slurm, j) == "CANCELLED", "the job cancelled")
    return j


def _with_id(job: str):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from tests.test_reclaim import _holder

    return replace(_holder(), id=job)

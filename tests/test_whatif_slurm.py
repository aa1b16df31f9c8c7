"""What-if checked against a real scheduler (issue 17 item 3; docs/whatif.md, "Checked
against real Slurm", explains the queues, the tolerance and where the engine and Slurm differ).

Two queues of jobs with known run times run at the same time on four real Slurm clusters
(slurmctld + one slurmd per node, 3 simulated nodes × 4 GPUs each, ``SETUPS``): the first queue
under ``sched/builtin`` (strict priority order) and under ``sched/backfill``; the second under
``sched/backfill`` as it comes (a planned start for every pending job) and with
``bf_job_part_count_reserve=1`` (for the head only: EASY). The project's own Slurm collector
and node sources record each run into its own chDB store, as the agents would send it. Then
``gpuslo whatif`` replays each run under ``fifo+gang`` and ``backfill+gang``: the builtin run's
``backfill`` must be what the real backfill scheduler did, its ``fifo`` the builtin run itself;
``backfill`` replayed on a back-fill run is that run again, except on Slurm's default
reservations (the difference is checked and documented).

The queue (priority = submit order, all submitted at once; ``u`` = 3 s):

======  =====  ===========  ====  =======================================================
job     nodes  GPUs/node    run   role
======  =====  ===========  ====  =======================================================
j1      2      4            12 s  takes nodes 1-2
j2      3      4             6 s  head-of-line blocker: needs all 12 GPUs, waits for j1
j3      1      4             3 s  fits on node 3 and ends before j1: back-filled at once
j4      1      2            18 s  fits when j3 ends but would delay j2: never back-filled
j5      1      2             3 s  fits when j3 ends and ends before j1: back-filled then
======  =====  ===========  ====  =======================================================

Schedules by hand (start, seconds after the first submit; zero scheduler latency; ``HAND``
also holds the second queue's):
fifo: j1 0, j2 12, j3 18, j4 18, j5 18. backfill: j1 0, j3 0, j5 3, j2 12, j4 18.

Time limits (``--time``, in minutes: Slurm keeps no seconds) are the run times scaled by
60/u (4, 2, 1, 6, 1 min), so every decision the real back-fill makes from its estimates is the
one the engine makes from the recorded run times (the margins are whole units).

Tolerance (derived, see docs/whatif.md): the engine starts a job the instant it may; Slurm
starts it at the next pass of its scheduler (the main loop runs at least every
``sched_interval`` = 1 s, the back-fill loop every ``bf_interval`` = 1 s), and writes times
truncated to whole seconds. Each scheduling step of a job's chain (its own start, and every
start it waited behind) may therefore lag by ``INTERVAL_S`` + 1 s; comparing one run's
prediction with the other run adds 1 s per step more (the run time the engine took from the
builtin run and the one the job had in the backfill run are each within 1 s of the truth),
plus any difference of the submit offsets between the two runs (an input difference,
measured). Any other decision moves a job by more than its tolerance (by hand: j3 by 18 s,
j5 by 15 s, j2 by 9 s if j4 were back-filled; r4 by 15 s).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.slurm import SlurmAttribution, SlurmCli, SlurmEventCollector, SlurmNodeSource
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSample, GpuSampleBatch, Message, SchedulerEvent
from tests.servers.slurm import SlurmCluster, available

pytestmark = pytest.mark.integration

CLUSTER = "gpuslo"
NODES, GPUS = 3, 4
CAPACITY = NODES * GPUS
INTERVAL_S = 1  # sched_interval and bf_interval alike
PARAMS = f"bf_interval={INTERVAL_S},bf_resolution=1,sched_interval={INTERVAL_S}"
TICK_S = 1.0  # the agents' sampling interval


@dataclass(frozen=True)
class Job:
    name: str
    nodes: int
    gpus_per_node: int
    run_s: int
    limit_min: int  # run_s scaled by 60 / u

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


QUEUE = (Job("j1", 2, 4, 12, 4), Job("j2", 3, 4, 6, 2), Job("j3", 1, 4, 3, 1), Job("j4", 1, 2, 18, 6),
         Job("j5", 1, 2, 3, 1))  # fmt: skip
# the second queue: a long job that would not delay the head (it fits on the node the head's
# reservation leaves) but would delay the job behind it
RESERVE_QUEUE = (Job("r1", 2, 4, 9, 3), Job("r2", 2, 4, 3, 1), Job("r3", 3, 4, 3, 1), Job("r4", 1, 4, 15, 5))
BY_NAME = {j.name: j for j in QUEUE + RESERVE_QUEUE}

# (start after the first submit, scheduling steps on its chain), computed by hand above
HAND: dict[str, dict[str, tuple[int, int]]] = {
    "fifo": {"j1": (0, 1), "j2": (12, 2), "j3": (18, 3), "j4": (18, 3), "j5": (18, 3)},
    "backfill": {"j1": (0, 1), "j3": (0, 1), "j5": (3, 2), "j2": (12, 2), "j4": (18, 3)},
    # Slurm's default back-fill: every pending job keeps its planned start
    "reserve-all": {"r1": (0, 1), "r2": (9, 2), "r3": (12, 3), "r4": (15, 4)},
    # EASY: only the head's
    "easy": {"r1": (0, 1), "r4": (0, 1), "r2": (9, 2), "r3": (15, 2)},
}


@dataclass(frozen=True)
class Setup:
    """One real cluster of the run: its scheduler, its parameters, its queue, and the hand
    schedule it must follow."""

    name: str
    scheduler: str
    params: str
    queue: tuple[Job, ...]
    hand: str


SETUPS = (
    Setup("builtin", "sched/builtin", PARAMS, QUEUE, "fifo"),
    Setup("backfill", "sched/backfill", PARAMS, QUEUE, "backfill"),
    Setup("reserve-all", "sched/backfill", PARAMS, RESERVE_QUEUE, "reserve-all"),
    Setup("reserve-head", "sched/backfill", f"{PARAMS},bf_job_part_count_reserve=1", RESERVE_QUEUE, "easy"),
)
SAME_RUN_STEP_S = INTERVAL_S + 1  # scheduler pass + time truncation
CROSS_RUN_STEP_S = INTERVAL_S + 2  # + the run time taken from the other run
# the window ends after every job of every run: each job's hand end plus the most the real
# scheduler may lag behind it, plus one tick
HORIZON_S = (
    max(s + BY_NAME[j].run_s + n * CROSS_RUN_STEP_S for h in HAND.values() for j, (s, n) in h.items()) + 1
)


@dataclass(frozen=True)
class Truth:
    """One job as Slurm itself reports it (``scontrol show job -o``), epoch seconds."""

    job_id: str
    submit: float
    start: float
    end: float
    nodes: tuple[str, ...]


class Recorder:
    """The agents of one cluster for the run: the cluster-level event collector, each node's
    heartbeat and its GPU batch with the real attribution, every ``TICK_S``. One ``squeue`` and
    one ``sinfo`` per tick serve them all (each command's answer is kept for the tick)."""

    def __init__(self, cluster: SlurmCluster, queue: tuple[Job, ...]) -> None:
        self.cluster = cluster
        self.queue = queue
        self._answers: dict[tuple[str, ...], str] = {}
        cli = SlurmCli(run=self._run)
        self.collector = SlurmEventCollector(CLUSTER, cluster.dir / "collector.json", cli)
        self.beats = [SlurmNodeSource(n, CLUSTER, TICK_S, GPUS, cli) for n in cluster.nodes]
        self.attr = {n: SlurmAttribution(n, cli) for n in cluster.nodes}
        self.msgs: list[Message] = []
        self.ids: dict[str, str] = {}  # job name → Slurm job id
        self.ticks: list[float] = []

    def _run(self, argv: Sequence[str]) -> str:
        key = tuple(argv)
        if key not in self._answers:
            self._answers[key] = self.cluster.run(*argv)
        return self._answers[key]

    def tick(self, at: float) -> None:
        """One tick of the agents, stamped with the tick's time on the agents' grid (the
        commands run just after it): capacity is then back to back, as a steady agent's."""
        self._answers.clear()
        self.ticks.append(at)
        self.msgs += self.collector.collect(at)
        for beat in self.beats:
            self.msgs += beat.collect(at)
        for node, attr in self.attr.items():
            attr.refresh()
            gpus = tuple(GpuSample(index=g, uuid=f"GPU-{node}-{g}", model="H100", allocations=attr(g, ""))
                         for g in range(GPUS))  # fmt: skip
            self.msgs.append(GpuSampleBatch(source=f"{node}-gpus", boot_id="run", seq=len(self.ticks),
                                            cluster=CLUSTER, ts=at, node=node, pool="gpu", interval_s=TICK_S,
                                            gpus=gpus))  # fmt: skip

    def submit(self) -> None:
        for j in self.queue:
            self.ids[j.name] = self.cluster.sbatch(j.gpus_per_node, j.name, nodes=j.nodes, wrap=f"sleep {j.run_s}",
                                                   time_min=j.limit_min)  # fmt: skip

    def events(self, kind: str) -> dict[str, SchedulerEvent]:
        """The queue's events of that kind by job id (the probe's, before the window, left out)."""
        ids = set(self.ids.values())
        return {e.request_id: e for e in self.msgs
                if isinstance(e, SchedulerEvent) and e.event == kind and e.request_id in ids}  # fmt: skip

    def done(self) -> bool:
        return set(self.ids.values()) <= set(self.events("end"))


def _epoch(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()  # slurmctld's local time


def _truth(cluster: SlurmCluster, job_id: str) -> Truth:
    """Read independently of the collector: ``scontrol``'s text, hostlists expanded by Slurm."""
    line = cluster.run("scontrol", "show", "job", "-o", job_id)
    f = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))
    assert f["JobState"] == "COMPLETED", line
    hosts = tuple(cluster.run("scontrol", "show", "hostnames", f["NodeList"]).split())
    return Truth(job_id, _epoch(f["SubmitTime"]), _epoch(f["StartTime"]), _epoch(f["EndTime"]), hosts)


@dataclass
class Run:
    scheduler: str
    store: Path
    t0: float  # the first submit
    frm: float
    to: float
    truth: dict[str, Truth] = field(default_factory=dict)  # by job name
    events: dict[str, dict[str, SchedulerEvent]] = field(default_factory=dict)  # kind → job id → event

    def offset(self, name: str, what: str = "start") -> float:
        t = self.truth[name]
        return float(getattr(t, what)) - self.t0


def _record(recs: list[Recorder], deadline_s: float) -> tuple[float, float]:
    """Tick until every job of every cluster ended and the window has passed: the window
    (the same for both runs) opens at the first whole second of capacity and closes
    ``HORIZON_S`` after the later run's first submit."""
    deadline = time.monotonic() + deadline_s
    at = math.ceil(time.time())
    for _ in range(2):  # two ticks before anything is submitted: the window opens on capacity
        at = _tick_at(recs, at)
    for r in recs:
        r.submit()
    while True:
        at = _tick_at(recs, at)
        firsts = [min((e.ts for e in r.events("submit").values()), default=math.inf) for r in recs]
        frm, to = recs[0].ticks[0], max(firsts) + HORIZON_S
        if all(r.done() for r in recs) and at >= to:  # the last tick covers [at - TICK_S, at]
            return frm, to
        if time.monotonic() > deadline:
            states = {r.cluster.scheduler: r.cluster.run("squeue", "-h", "-o", "%j %T %r") for r in recs}
            raise AssertionError(f"the queue did not finish within {deadline_s} s: {states}")


def _tick_at(recs: list[Recorder], at: float) -> float:
    """One tick of every recorder at ``at`` (the sampling period of an agent, not a wait for
    anything: a late tick runs at once); the next tick's time."""
    time.sleep(max(0.0, at - time.time()))
    for r in recs:
        r.tick(at)
    return at + TICK_S


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """Every setup's queue at once, after a probe job on each cluster (before the window: a
    fresh slurmctld may start its first job a few seconds late); each run's store written and
    closed (one chDB data directory per process at a time: ``gpuslo whatif`` opens it in a
    subprocess)."""
    if not available():
        pytest.fail("Slurm is not installed (scripts/test.sh installs slurm-wlm and munge)")
    base = tmp_path_factory.mktemp("whatif-slurm")
    clusters = [SlurmCluster(base / s.name, gpus=GPUS, nodes=NODES, scheduler=s.scheduler, scheduler_parameters=s.params)
                for s in SETUPS]  # fmt: skip
    try:
        for c in clusters:
            c.start()
        probes = [(c, c.probe()) for c in clusters]
        deadline = time.monotonic() + 60
        while not all(c.probed(j) for c, j in probes):
            assert time.monotonic() < deadline, "the probe jobs did not run"
            time.sleep(0.3)
        recs = [Recorder(c, s.queue) for c, s in zip(clusters, SETUPS, strict=True)]
        frm, to = _record(recs, deadline_s=HORIZON_S + 60)
        out: dict[str, Run] = {}
        for r, setup in zip(recs, SETUPS, strict=True):
            t0 = min(e.ts for e in r.events("submit").values())
            run = Run(setup.name, base / f"store-{setup.name}", t0, frm, to)
            run.truth = {j: _truth(r.cluster, i) for j, i in r.ids.items()}
            run.events = {k: r.events(k) for k in ("submit", "start", "end")}
            store = ChdbStore(run.store)
            try:
                store.migrate(SCHEMA)
                write(store, r.msgs)
            finally:
                store.close()
            out[setup.name] = run
        yield out
    finally:
        for c in clusters:
            c.stop()


# A Slurm job's nodes are allocated all at once: the engine's +gang (without it, a multi-node
# request's parts are placed as nodes free up, which Slurm never does: docs/whatif.md)
FIFO, BACKFILL = "fifo+gang", "backfill+gang"


_ANSWERS: dict[Path, dict[str, Any]] = {}


def _whatif(run: Run) -> dict[str, Any]:
    """``gpuslo whatif --json`` over the run's window with both policies (asked once per run)."""
    if run.store not in _ANSWERS:
        argv = [sys.executable, "-m", "gpuslo", "whatif", "--store", str(run.store), "--from", str(int(run.frm)),
                "--to", str(int(run.to)), "--policy", FIFO, "--policy", BACKFILL, "--json"]  # fmt: skip
        r = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, check=False, env=dict(os.environ)
        )
        assert r.returncode == 0, r.stderr
        _ANSWERS[run.store] = json.loads(r.stdout)
    return _ANSWERS[run.store]


def _policy(result: dict[str, Any], name: str) -> dict[str, Any]:
    (p,) = [p for p in result["policies"] if p["policy"] == name or p["policy"].startswith(f"{name}:")]
    return p


def _starts(run: Run, policy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The policy's predicted starts by job name (the run's job ids mapped back)."""
    names = {t.job_id: n for n, t in run.truth.items()}
    got = {names[s["request_id"]]: s for s in policy["starts"] if s["request_id"] in names}
    assert set(got) == set(run.truth), policy["starts"]
    return got


def _cur(run: Run, starts: dict[str, float], runs_s: dict[str, float]) -> float:
    """Allocation CUR by docs/metrics.md: allocated GPU-seconds in the window over capacity,
    the 12 GPUs all through the window (the agents sent samples back to back across it)."""
    frm, to = run.frm, run.to
    alloc = sum(BY_NAME[j].gpus * max(0.0, min(to, s + runs_s[j]) - max(frm, s)) for j, s in starts.items())
    return alloc / (CAPACITY * (to - frm))


def _recorded_cur(run: Run) -> float:
    return _cur(
        run, {j: t.start for j, t in run.truth.items()}, {j: t.end - t.start for j, t in run.truth.items()}
    )


def _nearest_rank(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[max(0, math.ceil(q * len(v)) - 1)]


# --- the real schedulers themselves ------------------------------------------------------


def test_the_collector_recorded_what_slurm_did(runs: dict[str, Run]) -> None:
    """Submit, start and end as the collector sent them are Slurm's own (scontrol), to the
    second, and the start carries the nodes Slurm chose."""
    for run in runs.values():
        for name, t in run.truth.items():
            assert run.events["submit"][t.job_id].ts == t.submit, (run.scheduler, name)
            assert run.events["start"][t.job_id].ts == t.start, (run.scheduler, name)
            assert run.events["end"][t.job_id].ts == t.end, (run.scheduler, name)
            assert sorted(run.events["start"][t.job_id].assigned_nodes) == sorted(t.nodes)
            ev = run.events["submit"][t.job_id]
            assert (ev.gpus_per_node, ev.nodes) == (BY_NAME[name].gpus_per_node, BY_NAME[name].nodes)


@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
def test_real_slurm_follows_the_hand_schedule(runs: dict[str, Run], setup: Setup) -> None:
    """Each real scheduler did what the schedule computed by hand says, each start within its
    chain's steps × (interval + 2 s) after it, never before (a recorded run time is never
    under ``sleep N``: the hand schedule leaves out the job's launch and the truncation to whole
    seconds; every submit is at or after the first)."""
    run = runs[setup.name]
    for name, (start, steps) in HAND[setup.hand].items():
        lag = run.offset(name) - start
        assert 0 <= lag <= steps * CROSS_RUN_STEP_S, (setup.name, name, run.offset(name), start)
        assert run.truth[name].end - run.truth[name].start >= BY_NAME[name].run_s
    t, nodes = run.truth, set(_all_nodes(run))
    if setup.name == "builtin":  # strict order: nothing passed j2
        assert all(t[j].start >= t["j2"].end for j in ("j3", "j4", "j5"))
    elif setup.name == "backfill":  # back-fill went around the blocker, and never delayed it
        assert t["j3"].start < t["j1"].end and t["j5"].start < t["j1"].end
        assert t["j3"].end <= t["j5"].start and t["j5"].end <= t["j2"].start
        assert t["j4"].start >= t["j2"].end
        assert set(t["j3"].nodes) == set(t["j5"].nodes) == nodes - set(t["j1"].nodes)
    elif setup.name == "reserve-all":  # r4 would delay r3 (not the head r2): it waits
        assert t["r2"].start >= t["r1"].end and t["r3"].start >= t["r2"].end and t["r4"].start >= t["r3"].end
    else:  # reserve-head: r4 goes on the node r2's reservation leaves, r3 waits for it
        assert t["r4"].start < t["r1"].end and set(t["r4"].nodes) == nodes - set(t["r1"].nodes) - set(
            t["r2"].nodes
        )
        assert t["r3"].start >= t["r4"].end


def _all_nodes(run: Run) -> list[str]:
    return sorted({n for t in run.truth.values() for n in t.nodes})


# --- what-if against them ---------------------------------------------------------------


def test_whatif_reads_the_record_as_slurm_wrote_it(runs: dict[str, Run]) -> None:
    """The replay's input is the record: its recorded starts are scontrol's, its capacity the
    12 GPUs over the window, its recorded CUR and wait percentiles those of scontrol's times."""
    for run in runs.values():
        rec = _whatif(run)["recorded"]
        starts = _starts(run, rec)
        assert {j: (s["start"], s["wait_s"], sorted(s["nodes"])) for j, s in starts.items()} == {
            j: (t.start, t.start - t.submit, sorted(t.nodes)) for j, t in run.truth.items()
        }
        assert rec["capacity_gpu_hours"] * 3600 == pytest.approx(CAPACITY * (run.to - run.frm), abs=1e-6)
        assert rec["cur_allocation"] == pytest.approx(_recorded_cur(run), abs=1e-9)
        waits = [t.start - t.submit for t in run.truth.values()]
        for q in (0.5, 0.95, 0.99):
            assert rec[f"wait_p{round(q * 100)}_s"] == _nearest_rank(waits, q)


def _predicts(src: Run, real: Run, policy: str, hand: str) -> dict[str, dict[str, Any]]:
    """``policy`` replayed over ``src`` against what ``real`` did: every start and wait (after
    each run's first submit) within the job's steps × (interval + 2 s) plus the runs'
    submit-offset difference; the wait percentiles within the largest of those (nearest-rank
    percentiles move no more than the values); the CUR over the same window within the run
    times' disagreement (≤ 2 s a job: each run's within 1 s of the truth). The predicted starts."""
    pred = _policy(_whatif(src), policy)
    starts = _starts(src, pred)
    dsub = max(abs(src.offset(j, "submit") - real.offset(j, "submit")) for j in src.truth)
    tol = {j: n * CROSS_RUN_STEP_S + dsub for j, (_, n) in HAND[hand].items()}
    for j in src.truth:
        assert abs((starts[j]["start"] - src.t0) - real.offset(j)) <= tol[j], (j, starts[j], real.truth[j])
        real_wait = real.truth[j].start - real.truth[j].submit
        assert abs(starts[j]["wait_s"] - real_wait) <= tol[j], (j, starts[j], real_wait)
    rec = _whatif(real)["recorded"]
    for q in ("wait_p50_s", "wait_p95_s", "wait_p99_s"):
        assert abs(pred[q] - rec[q]) <= max(tol.values()), q
    cur_tol = sum(BY_NAME[j].gpus * 2 for j in src.truth) / (CAPACITY * (src.to - src.frm))
    assert abs(pred["cur_allocation"] - rec["cur_allocation"]) <= cur_tol
    assert abs(pred["cur_allocation"] - _recorded_cur(real)) <= cur_tol
    return starts


def _identity(run: Run, policy: str, hand: str) -> None:
    """``policy`` replayed over the run it produced gives back its starts, each within its
    chain's steps × (interval + 1 s) and never later than Slurm (the engine has no scheduler
    latency); its waits and percentiles likewise; its CUR exactly the recorded one (the same
    run times, the window holding every job)."""
    result = _whatif(run)
    pred = _policy(result, policy)
    starts = _starts(run, pred)
    tol = {j: n * SAME_RUN_STEP_S for j, (_, n) in HAND[hand].items()}
    for j, t in run.truth.items():
        assert 0 <= t.start - starts[j]["start"] <= tol[j], (j, starts[j], t)
        assert 0 <= (t.start - t.submit) - starts[j]["wait_s"] <= tol[j]
    rec = result["recorded"]
    for q in ("wait_p50_s", "wait_p95_s", "wait_p99_s"):
        assert 0 <= rec[q] - pred[q] <= max(tol.values()), q
    assert pred["cur_allocation"] == pytest.approx(rec["cur_allocation"], abs=1e-9)
    assert pred["cur_allocation"] == pytest.approx(_recorded_cur(run), abs=1e-9)


def test_whatif_backfill_from_the_builtin_run_is_what_real_backfill_did(runs: dict[str, Run]) -> None:
    """``whatif --policy backfill+gang`` over the builtin run predicts the backfill run (see
    ``_predicts``); the back-filled j3 on the node j1 left free, j2 on all three."""
    b = runs["builtin"]
    starts = _predicts(b, runs["backfill"], BACKFILL, "backfill")
    assert len(starts["j3"]["nodes"]) == 1 and not set(starts["j3"]["nodes"]) & set(starts["j1"]["nodes"])
    assert sorted(starts["j2"]["nodes"]) == _all_nodes(b)


def test_whatif_fifo_from_the_builtin_run_is_the_builtin_run(runs: dict[str, Run]) -> None:
    """Identity: the builtin run replayed under ``fifo+gang`` (strict order, no skipping,
    which sched/builtin is)."""
    _identity(runs["builtin"], FIFO, "fifo")


def test_whatif_backfill_from_the_backfill_run_is_the_backfill_run(runs: dict[str, Run]) -> None:
    """Identity on the other run: its own policy replayed (the queue does not tell EASY from
    Slurm's reservations for every pending job)."""
    _identity(runs["backfill"], BACKFILL, "backfill")


def test_whatif_backfill_is_slurm_reserving_for_the_head_only(runs: dict[str, Run]) -> None:
    """EASY back-fill is Slurm's back-fill with ``bf_job_part_count_reserve=1`` (a planned
    start for the head of the partition only): the replay of the default back-fill's run
    predicts that run, and gives back its own."""
    _predicts(runs["reserve-all"], runs["reserve-head"], BACKFILL, "easy")
    _identity(runs["reserve-head"], BACKFILL, "easy")


def test_slurm_default_backfill_protects_every_pending_job_where_easy_does_not(runs: dict[str, Run]) -> None:
    """Where the engine and Slurm differ, by design: Slurm's default back-fill keeps a planned
    start for every pending job, EASY for the head only. r4 fits on the node the head's
    reservation leaves: EASY starts it at once and so delays r3 until r4 ends; real Slurm kept
    r4 waiting until r3 had run. The replay of Slurm's own run is the EASY schedule (each start
    within its steps × (interval + 2 s) of the hand one: the recorded run times hold the
    launch), not what Slurm did."""
    run = runs["reserve-all"]
    starts = _starts(run, _policy(_whatif(run), BACKFILL))
    for j, (hand, n) in HAND["easy"].items():
        assert 0 <= starts[j]["start"] - run.t0 - hand <= n * CROSS_RUN_STEP_S, (j, starts[j])
    assert starts["r4"]["start"] < run.truth["r1"].end <= run.truth["r3"].end <= run.truth["r4"].start

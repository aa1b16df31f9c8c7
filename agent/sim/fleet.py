"""A simulated GPU fleet with a small scheduler of its own, and its own ground truth.

Event-driven, continuous time, deterministic from a seed. Jobs arrive, ask for
``nodes × gpus_per_node`` GPUs (fractional shares below one GPU too), queue when GPUs
are short, run, sometimes sit idle on their GPUs, sometimes get cancelled while
pending. One node is drained for a while, one GPU falls off the bus.

The scheduler places jobs first-fit in priority (submit) order; a per-user GPU limit
holds some jobs back (Slurm's ``QOSMaxGRESPerUser``), and a job that has waited longer
than ``reserve_after_s`` blocks everything behind it (Slurm's ``Priority``) until it
starts. So starvation happens for all three causes of the metric definitions.

Ground truth (:class:`Truth`) is integrated exactly between events from the fleet's
own state, independently of what the agents sample and emit.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gpuslo.wire.models import HealthKind, SchedulerEventType

JobState = Literal["pending", "running", "done", "cancelled", "failed"]


def yesterday_utc(now: float | None = None) -> float:
    """Midnight UTC a day before ``now``: a recent start that stays inside data retention."""
    t = time.time() if now is None else now
    return float(int(t // 86400) * 86400 - 86400)


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 4
    gpus_per_node: int = 8
    hours: float = 12.0
    interval_s: float = 10.0
    seed: int = 1
    cluster: str = "sim"
    pool: str = "gpu"
    start_ts: float = field(default_factory=yesterday_utc)
    jobs_per_hour: float | None = None  # default: about 95 % offered load
    starvation_threshold_s: float = 600.0
    idle_threshold: float = 0.05
    user_gpu_limit: float = 16.0
    reserve_after_s: float = 1800.0
    drain_node: int | None = -1  # index (negative from the end); None: no drain
    drain_hours: tuple[float, float] = (4.0, 7.0)
    xid_at_hour: float | None = 9.0
    service: str = "llm-chat"
    requests_per_s: float = 40.0
    degrade_hours: tuple[float, float] = (6.0, 8.0)
    bounds_ms: tuple[float, ...] = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)

    @property
    def end_ts(self) -> float:
        return self.start_ts + self.hours * 3600.0


# the power model of every simulated GPU (an H100 SXM: about 70 W idle, 700 W at full load)
IDLE_POWER_W = 70.0
MAX_POWER_W = 700.0


def power_w(activity: float) -> float:
    return IDLE_POWER_W + (MAX_POWER_W - IDLE_POWER_W) * activity


USERS = (("alice", "vision"), ("bob", "nlp"), ("carol", "nlp"), ("dave", "research"), ("erin", "research"))
# (weight, nodes, gpus_per_node)
SHAPES = ((30, 1, 1.0), (15, 1, 2.0), (15, 1, 4.0), (14, 1, 8.0), (8, 2, 4.0), (6, 2, 8.0), (12, 1, 0.5))


@dataclass(slots=True)
class Job:
    id: str
    user: str
    account: str
    submit: float
    nodes: int
    gpn: float
    duration: float
    idle: bool  # sits on its GPUs doing nothing
    setup_s: float  # idle phase before it computes
    level: float  # activity once computing
    patience: float | None  # cancels itself if still pending after this long
    state: JobState = "pending"
    start: float | None = None
    end: float | None = None
    reason: str = ""
    placement: list[tuple[int, int, float]] = field(default_factory=list)
    mem_mib: float = 0.0  # framebuffer its working set takes on each of its GPUs while computing

    @property
    def gpus(self) -> float:
        return self.nodes * self.gpn

    def activity(self, now: float) -> float:
        if self.idle or self.start is None or now < self.start + self.setup_s:
            return 0.0
        return self.level


@dataclass(slots=True)
class Incident:
    request_id: str
    queue: str
    opened: float
    closed: float | None
    cause: str


@dataclass(slots=True)
class Truth:
    """What really happened, accumulated by the simulator itself (GPU-seconds)."""

    capacity_s: float = 0.0
    allocated_s: float = 0.0
    active_s: float = 0.0
    idle_allocated_s: float = 0.0
    idle_unallocated_s: float = 0.0
    incidents: list[Incident] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)  # submit→start of started jobs
    latency_ticks: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    # per (node, GPU): the [from, to) stretches it was at or above the idle threshold (the reclaim truth)
    active_spans: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict)
    # energy (joules), split as rules/energy.py splits it: a holder its share wherever it holds
    # it; allocated-idle and unallocated of capacity GPUs; the unheld rest of GPUs outside capacity
    energy_j: float = 0.0
    energy_held_j: float = 0.0
    energy_allocated_idle_j: float = 0.0
    energy_unallocated_j: float = 0.0
    energy_outside_capacity_j: float = 0.0
    energy_by_job_j: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SchedEvent:
    ts: float
    event: SchedulerEventType
    job: Job
    reason: str = ""
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HealthRecord:
    ts: float
    node: int
    gpu: int
    event: HealthKind
    code: int
    fatal: bool
    message: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Free capacity at a sampling tick, the input of the starvation cause."""

    free_total: float
    node_whole_free: tuple[int, ...]
    node_max_frac_free: tuple[float, ...]


def classify(request_nodes: int, gpn: float, snap: Snapshot) -> str:
    """Starvation cause from the capacity snapshot, exactly as in shared/design.md."""
    if snap.free_total + 1e-9 < request_nodes * gpn:
        return "capacity"
    if gpn >= 1:
        fit = sum(1 for w in snap.node_whole_free if w >= gpn)
    else:
        fit = sum(1 for f in snap.node_max_frac_free if f + 1e-9 >= gpn)
    return "fragmentation" if fit < request_nodes else "policy"


class Fleet:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        n, g = cfg.nodes, cfg.gpus_per_node
        self.node_names = tuple(f"gpu-node-{i:02d}" for i in range(n))
        self.uuids = tuple(
            tuple(f"GPU-{cfg.seed:04x}{i:04x}-{j:04x}-4000-8000-{(i * g + j):012x}" for j in range(g))
            for i in range(n)
        )
        self.gpu_jobs: list[list[list[tuple[Job, float]]]] = [[[] for _ in range(g)] for _ in range(n)]
        self.healthy = [[True] * g for _ in range(n)]
        self.energy_j = [[0.0] * g for _ in range(n)]  # each GPU's energy counter (a healthy GPU draws power)
        self.schedulable = [True] * n
        self.node_state_reason = [""] * n
        self.pending: list[Job] = []
        self.jobs: dict[str, Job] = {}
        self.now = cfg.start_ts
        self.truth = Truth()
        self.sched_outbox: list[SchedEvent] = []
        self.health_outbox: list[HealthRecord] = []
        self.snapshot = self._snapshot()
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self._job_seq = 1000
        self._open: dict[str, Incident] = {}
        self._plan()

    # ---------------------------------------------------------------- planning
    def _push(self, t: float, kind: str, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _plan(self) -> None:
        c, rng = self.cfg, self.rng
        total_gpus = c.nodes * c.gpus_per_node
        rate = c.jobs_per_hour if c.jobs_per_hour is not None else 5.2 * total_gpus / 32.0
        t = c.start_ts
        # a burst at the start so the fleet is busy from the first hour
        for _ in range(max(1, total_gpus // 4)):
            self._push(c.start_ts + float(rng.uniform(0, 600)), "arrive", self._new_job())
        while True:
            t += float(rng.exponential(3600.0 / rate))
            if t >= c.end_ts:
                break
            self._push(t, "arrive", self._new_job())
        if c.drain_node is not None and c.nodes > 1:
            idx = c.drain_node % c.nodes
            self._push(c.start_ts + c.drain_hours[0] * 3600, "drain", idx)
            self._push(c.start_ts + c.drain_hours[1] * 3600, "resume", idx)
        if c.xid_at_hour is not None:
            self._push(c.start_ts + c.xid_at_hour * 3600, "xid", (0, min(3, c.gpus_per_node - 1)))

    def _new_job(self) -> Job:
        rng = self.rng
        self._job_seq += 1
        weights = np.array([s[0] for s in SHAPES], dtype=float)
        _, nodes, gpn = SHAPES[int(rng.choice(len(SHAPES), p=weights / weights.sum()))]
        if nodes > self.cfg.nodes:
            nodes = self.cfg.nodes
        gpn = min(gpn, float(self.cfg.gpus_per_node))
        user, account = USERS[int(rng.integers(len(USERS)))]
        duration = float(np.clip(rng.lognormal(math.log(3600.0), 0.8), 300.0, 6 * 3600.0))
        patience = float(rng.uniform(180.0, 5400.0)) if rng.random() < 0.25 else None
        return Job(
            mem_mib=self._footprint_mib(),
            id=str(self._job_seq),
            user=user,
            account=account,
            submit=0.0,  # set on arrival
            nodes=nodes,
            gpn=gpn,
            duration=duration,
            idle=bool(rng.random() < 0.12),
            setup_s=float(rng.uniform(0.0, 900.0)),
            level=float(rng.uniform(0.3, 0.95)),
            patience=patience,
        )

    def _footprint_mib(self) -> float:
        """A job's framebuffer working set per GPU: small (1-9 GiB: notebooks, inference, small
        models), medium (10-35 GiB) or large (36-76 GiB). Drawn from a generator of its own, seeded by
        the run's seed and the job's number, so the rest of the run draws what it always drew."""
        side = np.random.default_rng([self.cfg.seed, self._job_seq])
        lo, hi = ((1.0, 9.0), (10.0, 35.0), (36.0, 76.0))[int(side.choice(3, p=[0.4, 0.4, 0.2]))]
        return float(side.uniform(lo, hi)) * 1024.0

    # ---------------------------------------------------------------- running
    def advance_to(self, t: float) -> None:
        """Process every event strictly before ``t``; then the state is the state at ``t``
        and the capacity snapshot is taken (a sampling tick)."""
        while self._heap and self._heap[0][0] < t:
            et, _, kind, payload = heapq.heappop(self._heap)
            self._integrate(et)
            self._handle(et, kind, payload)
        self._integrate(t)
        self.snapshot = self._snapshot()

    def finish(self) -> None:
        """Integrate to the end of the run and close the books."""
        self.advance_to(self.cfg.end_ts)

    def _integrate(self, t: float) -> None:
        dt = t - self.now
        if dt <= 0:
            return
        thr = self.cfg.idle_threshold
        tr = self.truth
        for n, gpus in enumerate(self.gpu_jobs):  # drained or not: a holder's GPUs are busy or idle
            for g, holders in enumerate(gpus):
                if holders and sum(s * j.activity(self.now) for j, s in holders) >= thr:
                    spans = tr.active_spans.setdefault((n, g), [])
                    if spans and spans[-1][1] == self.now:
                        spans[-1][1] = t
                    else:
                        spans.append([self.now, t])
        for n in range(self.cfg.nodes):
            for g, holders in enumerate(self.gpu_jobs[n]):
                if not self.healthy[n][g]:
                    continue
                share = min(1.0, sum(s for _, s in holders))
                act = min(1.0, sum(s * j.activity(self.now) for j, s in holders))
                self._integrate_energy(n, g, dt, share, act, holders)
                if not self.schedulable[n]:
                    continue
                tr.capacity_s += dt
                tr.allocated_s += dt * share
                tr.active_s += dt * act
                if act < thr:
                    tr.idle_allocated_s += dt * share
                    tr.idle_unallocated_s += dt * (1.0 - share)
        self.now = t

    def _integrate_energy(
        self, n: int, g: int, dt: float, share: float, act: float, holders: list[tuple[Job, float]]
    ) -> None:
        tr = self.truth
        e = power_w(act) * dt
        self.energy_j[n][g] += e
        tr.energy_j += e
        tr.energy_held_j += e * share
        for j, s in holders:
            tr.energy_by_job_j[j.id] = tr.energy_by_job_j.get(j.id, 0.0) + e * s
        if self.schedulable[n]:
            tr.energy_unallocated_j += e * (1.0 - share)
            if act < self.cfg.idle_threshold:
                tr.energy_allocated_idle_j += e * share
        else:
            tr.energy_outside_capacity_j += e * (1.0 - share)

    def _handle(self, t: float, kind: str, payload: object) -> None:
        if kind == "arrive":
            assert isinstance(payload, Job)
            job = payload
            job.submit = t
            self.jobs[job.id] = job
            self.pending.append(job)
            self.sched_outbox.append(SchedEvent(t, "submit", job))
            self._push(t + self.cfg.starvation_threshold_s, "threshold", job)
            if job.patience is not None:
                self._push(t + job.patience, "patience", job)
            self._schedule(t)
        elif kind == "phase":
            pass  # activity changes; integration already accounts for it
        elif kind == "finish":
            assert isinstance(payload, Job)
            if payload.state == "running":
                self._release(payload, t, "done", "COMPLETED")
                self._schedule(t)
        elif kind == "patience":
            assert isinstance(payload, Job)
            if payload.state == "pending":
                payload.state = "cancelled"
                payload.end = t
                self.pending.remove(payload)
                self.sched_outbox.append(SchedEvent(t, "cancel", payload, "CANCELLED"))
                self._close_incident(payload, t)
                self._schedule(t)
        elif kind == "threshold":
            assert isinstance(payload, Job)
            if payload.state == "pending":
                inc = Incident(
                    payload.id, self.cfg.pool, t, None, classify(payload.nodes, payload.gpn, self.snapshot)
                )
                self._open[payload.id] = inc
                self.truth.incidents.append(inc)
        elif kind in ("drain", "resume"):
            assert isinstance(payload, int)
            self.schedulable[payload] = kind == "resume"
            self.node_state_reason[payload] = "maintenance" if kind == "drain" else ""
            self._schedule(t)
        elif kind == "xid":
            assert isinstance(payload, tuple)
            n, g = payload
            self.healthy[n][g] = False
            self.health_outbox.append(HealthRecord(t, n, g, "xid", 79, True, "GPU has fallen off the bus"))
            for job, _ in list(self.gpu_jobs[n][g]):
                self._release(job, t, "failed", "NODE_FAIL")
            self._schedule(t)

    def _release(self, job: Job, t: float, state: JobState, reason: str) -> None:
        for n, g, _ in job.placement:
            self.gpu_jobs[n][g] = [(j, s) for j, s in self.gpu_jobs[n][g] if j is not job]
        job.state = state
        job.end = t
        self.sched_outbox.append(SchedEvent(t, "end", job, reason))

    def _close_incident(self, job: Job, t: float) -> None:
        inc = self._open.pop(job.id, None)
        if inc is not None:
            inc.closed = t

    # ---------------------------------------------------------------- scheduling
    def _free(self, n: int, g: int) -> float:
        if not (self.healthy[n][g] and self.schedulable[n]):
            return 0.0
        return 1.0 - sum(s for _, s in self.gpu_jobs[n][g])

    def _place(self, job: Job) -> list[tuple[int, int, float]] | None:
        out: list[tuple[int, int, float]] = []
        nodes_used = 0
        for n in range(self.cfg.nodes):
            if not self.schedulable[n]:
                continue
            if job.gpn >= 1:
                whole = [g for g in range(self.cfg.gpus_per_node) if self._free(n, g) >= 1.0 - 1e-9]
                if len(whole) >= job.gpn:
                    out += [(n, g, 1.0) for g in whole[: int(job.gpn)]]
                    nodes_used += 1
            else:
                # pack fractional requests onto partly used GPUs first
                cands = [g for g in range(self.cfg.gpus_per_node) if self._free(n, g) + 1e-9 >= job.gpn]
                if cands:
                    g = min(cands, key=lambda g: (self._free(n, g), g))
                    out.append((n, g, job.gpn))
                    nodes_used += 1
            if nodes_used == job.nodes:
                return out
        return None

    def _user_gpus(self, user: str) -> float:
        return sum(j.gpus for j in self.jobs.values() if j.state == "running" and j.user == user)

    def _schedule(self, t: float) -> None:
        blocked = False
        for job in list(self.pending):
            if blocked:
                self._set_reason(job, t, "Priority")
                continue
            if self._user_gpus(job.user) + job.gpus > self.cfg.user_gpu_limit:
                self._set_reason(job, t, "QOSMaxGRESPerUser")
                continue
            placement = self._place(job)
            if placement is None:
                self._set_reason(job, t, "Resources")
                if t - job.submit >= self.cfg.reserve_after_s:
                    blocked = True  # reserve for the starving top job
                continue
            self._start(job, t, placement)

    def _set_reason(self, job: Job, t: float, reason: str) -> None:
        if job.reason != reason:
            job.reason = reason
            self.sched_outbox.append(SchedEvent(t, "pending_reason", job, reason))

    def _start(self, job: Job, t: float, placement: list[tuple[int, int, float]]) -> None:
        self.pending.remove(job)
        job.state = "running"
        job.start = t
        job.placement = placement
        for n, g, share in placement:
            self.gpu_jobs[n][g].append((job, share))
        nodes = tuple(dict.fromkeys(self.node_names[n] for n, _, _ in placement))
        self.sched_outbox.append(SchedEvent(t, "start", job, nodes=nodes))
        self.truth.waits_s.append(t - job.submit)
        self._close_incident(job, t)
        self._push(t + job.duration, "finish", job)
        if not job.idle and job.setup_s > 0:
            self._push(t + job.setup_s, "phase", job)

    # ---------------------------------------------------------------- observing
    def _snapshot(self) -> Snapshot:
        whole: list[int] = []
        frac: list[float] = []
        total = 0.0
        for n in range(self.cfg.nodes):
            frees = [self._free(n, g) for g in range(self.cfg.gpus_per_node)] if self.schedulable[n] else []
            total += sum(frees)
            whole.append(sum(1 for f in frees if f >= 1.0 - 1e-9))
            frac.append(max(frees, default=0.0))
        return Snapshot(total, tuple(whole), tuple(frac))

    def gpu_activity(self, n: int, g: int) -> float:
        return min(1.0, sum(s * j.activity(self.now) for j, s in self.gpu_jobs[n][g]))

    def take_sched_events(self) -> list[SchedEvent]:
        out, self.sched_outbox = self.sched_outbox, []
        return out

    def take_health_events(self) -> list[HealthRecord]:
        out, self.health_outbox = self.health_outbox, []
        return out

"""Versioned models of every message that crosses Kafka (and the JSON-lines replay files).

Every message is one JSON object with an envelope:

``v``        wire version (only 1 exists; anything else is rejected, never guessed)
``kind``     which model the rest of the object follows
``source``   the agent or collector that produced it (node name for node agents)
``boot_id``  changes each time that producer restarts
``seq``      per (source, boot_id) sequence number, so consumers can drop duplicates

Times are Unix epoch seconds (float, UTC). Units are in the field names.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuslo.wire import bounds as B
from gpuslo.wire.fields import BY_NAME

WIRE_VERSION = 1

# 2000-01-01 .. 2106-01-01: anything outside is a unit error (ms instead of s) or garbage, and
# the store's DateTime columns end in 2106 (gpuslo/wire/bounds.py).
_TS_MIN = B.TS_MIN
_TS_MAX = B.TS_MAX

#: The longest name or label the wire carries (a source, a node, a service, a reason)
NAME_MAX = 256
Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX)]
Label = Annotated[str, Field(max_length=NAME_MAX)]
Ts = Annotated[float, Field(ge=_TS_MIN, le=_TS_MAX, allow_inf_nan=False)]
#: The longest span one message may cover (``interval_s``): a sample at ``ts`` stands for
#: ``[ts, ts + interval_s)``. The rules look back this far before a window for the samples
#: that overlap its start (rules/sql.py imports it: one bound, never two).
MAX_INTERVAL_S = 86_400
# positive, and positive in the Float32 column it lands in (bounds.FLOAT32_MIN_POSITIVE)
Interval = Annotated[float, Field(ge=B.FLOAT32_MIN_POSITIVE, le=MAX_INTERVAL_S, allow_inf_nan=False)]
Share = Annotated[float, Field(ge=B.FLOAT32_MIN_POSITIVE, le=1, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
#: how an Allocation's activity_share was found (Allocation's docstring)
SHARE_SOURCES = ("", "sole", "equal", "processes", "measured")
ShareSource = Literal["", "sole", "equal", "processes", "measured"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Envelope(_Model):
    v: Literal[1] = 1  # WIRE_VERSION
    source: Name
    boot_id: Name
    seq: Annotated[int, Field(ge=0, le=B.UINT64_MAX)]
    cluster: Name
    ts: Ts

    @field_validator("v", mode="before")
    @classmethod
    def _an_integer(cls, v: object) -> object:
        # a Literal matches by equality, and true == 1.0 == 1: the version is the integer alone
        if type(v) is not int:
            raise ValueError(f"the wire version is an integer, not {v!r}")
        return v


class Allocation(_Model):
    """Who holds (a share of) one GPU: a Slurm job or a Kubernetes pod.

    ``share`` is the fraction of the GPU (or of the MIG instance the row stands for) held:
    1 for a whole GPU, less for a time-sliced or MPS replica or a fractional scheduler's
    ``gpu_milli``/1000. It is what the scheduler handed out, never a measurement: several
    holders of one GPU split it equally (allocation CUR counts what was handed out).

    ``activity_share`` is the part of the row's activity that is this holder's, measured from
    its processes (NVML per-process SM utilization, mapped to holders through their cgroups;
    agent/procsplit.py): over the holders of a row, Σ activity_share = Σ share, so a holder
    whose processes did all the work has all of it and an idle holder 0. ``fb_share`` is the
    same split of the framebuffer its processes use. Unset (None): not measured, read as
    ``share``. ``share_source`` says how the split was made: ``sole`` (one holder),
    ``equal`` (several, nothing measured: activity_share is share), ``processes`` (only the
    running-process lists: holders without a process get 0, the others split their shares),
    ``measured`` (per-process utilization); ``""``: the producer did not say (older agents,
    the dcgm-exporter scrape).
    """

    scheduler: Literal["slurm", "k8s"]
    id: Name  # Slurm job id / pod UID
    name: Label = ""  # job name / namespace/pod
    user: Label = ""
    account: Label = ""  # Slurm account / Kubernetes namespace owner label
    queue: Label = ""  # Slurm partition / Kubernetes namespace
    share: Share = 1.0
    activity_share: Fraction | None = None
    fb_share: Fraction | None = None
    share_source: ShareSource = ""


class MigInstance(_Model):
    """A MIG instance of the physical GPU ``index`` (NVIDIA Multi-Instance GPU)."""

    gi: Annotated[int, Field(ge=0, le=255)]  # GPU instance id
    ci: Annotated[int, Field(ge=0, le=255)] = 0  # compute instance id
    profile: Label = ""  # e.g. 1g.10gb, 3g.40gb


class GpuSample(_Model):
    """One GPU, or one MIG instance of it (``mig`` set; ``uuid`` is the instance's MIG-…).

    ``fraction`` is the part of the physical GPU this row stands for in capacity: 1 for a whole
    GPU; for a MIG instance its GPU slices over the GPU's; on the row of a GPU in MIG mode
    (``mig`` unset: device-level fields such as power and temperature) the part no instance
    holds, 0 when fully partitioned. The fractions of one GPU's rows add up to 1.
    """

    index: Annotated[int, Field(ge=0, le=1023)]
    uuid: Name
    model: Label = ""
    healthy: bool = True
    fields: dict[str, float] = Field(default_factory=dict)
    allocations: Annotated[tuple[Allocation, ...], Field(max_length=B.MAX_ALLOCATIONS)] = ()
    fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 1.0
    mig: MigInstance | None = None

    @field_validator("fields")
    @classmethod
    def _known_and_plausible(cls, v: dict[str, float]) -> dict[str, float]:
        # hot path (every GPU of every message): one dict lookup and one range check per value
        for name, value in v.items():
            f = BY_NAME.get(name)
            if f is None or not f.plausible(value):
                if f is None:
                    raise ValueError(f"unknown field {name!r} (not in the DCGM field catalogue)")
                raise ValueError(f"{name}={value!r} outside plausible range [{f.lo:g}, {f.hi:g}] {f.unit}")
        return v

    @model_validator(mode="after")
    def _shares_fit(self) -> GpuSample:
        if self.mig is not None and self.fraction < B.FLOAT32_MIN_POSITIVE:  # 0 in the store's Float32
            raise ValueError(
                f"MIG instance {self.mig.gi} of GPU {self.index} has fraction {self.fraction:g}, not > 0"
            )
        if len(self.allocations) > 1:  # one holder's share is already <= 1
            total = sum(a.share for a in self.allocations)
            if total > 1.0 + 1e-6:
                raise ValueError(f"allocations on GPU {self.index} hold {total:g} > 1 GPU")
            for what in ("activity_share", "fb_share"):  # measured splits of one GPU's whole
                part = sum(s if (s := getattr(a, what)) is not None else a.share for a in self.allocations)
                if part > 1.0 + 1e-6:
                    raise ValueError(
                        f"allocations on GPU {self.index} have {what}s adding up to {part:g} > 1"
                    )
        return self


class GpuSampleBatch(_Envelope):
    """One node, one tick: every GPU, every field, and who owns each GPU."""

    kind: Literal["gpu_samples"] = "gpu_samples"
    node: Name
    pool: Label = ""  # Slurm partition / Kubernetes node pool the node serves
    interval_s: Interval
    gpus: Annotated[tuple[GpuSample, ...], Field(max_length=B.MAX_GPU_ROWS)]

    @model_validator(mode="after")
    def _one_row_per_gpu(self) -> GpuSampleBatch:
        # cheap in the common case (one set of a few ints per message)
        keys = {(g.index, -1, -1) if g.mig is None else (g.index, g.mig.gi, g.mig.ci) for g in self.gpus}
        if len(keys) < len(self.gpus):
            seen: set[tuple[int, int, int]] = set()
            for g in self.gpus:
                k = (g.index, -1, -1) if g.mig is None else (g.index, g.mig.gi, g.mig.ci)
                if k in seen:
                    what = "" if g.mig is None else f" MIG gi {k[1]} ci {k[2]}"
                    raise ValueError(f"GPU {g.index}{what} appears more than once")
                seen.add(k)
        if len({g.index for g in self.gpus}) < len(self.gpus):  # a GPU in several rows (MIG)
            parts: dict[int, float] = {}
            for g in self.gpus:
                parts[g.index] = parts.get(g.index, 0.0) + g.fraction
            for index, total in parts.items():
                if total > 1.0 + 1e-6:  # capacity no GPU has
                    raise ValueError(
                        f"the rows of GPU {index} stand for {total:g} > 1 GPU (fractions add up to 1)"
                    )
        return self


class NodeHeartbeat(_Envelope):
    """The node is alive; and whether the scheduler may place work on it."""

    kind: Literal["heartbeat"] = "heartbeat"
    node: Name
    pool: Label = ""
    interval_s: Interval
    schedulable: bool
    state: Label = ""  # scheduler's words: idle, mixed, allocated, drain, drained, down, cordoned
    reason: Label = ""
    gpus: Annotated[int, Field(ge=0, le=1024)]


SchedulerEventType = Literal["submit", "start", "end", "cancel", "preempt", "pending_reason"]


StarvationCause = Literal["capacity", "fragmentation", "policy"]


class SchedulerEvent(_Envelope):
    """A GPU request's life: a Slurm job, a Kubernetes pod or a Kueue Workload.

    ``gpus_per_node`` × ``nodes`` is the shape the scheduler must place; ``pool`` (when
    set) restricts the nodes that may host it (a Slurm partition / node pool).

    ``cause`` (on ``pending_reason``, optional) is the starvation cause the scheduler's own
    reason implies, where the scheduler knows more than the free devices tell (Kueue: its
    quota; a pod asking through DRA ResourceClaims: its claims against the devices free in the
    ResourceSlices); the rules engine prefers it to its own judgement, except that ``capacity`` from
    the cluster's free devices still wins. ``cluster_queue`` is the queue above ``queue``
    (Kueue: the ClusterQueue a LocalQueue feeds). Both are left out of the bytes when unset,
    so messages without them are what they always were.
    """

    kind: Literal["sched_event"] = "sched_event"
    scheduler: Literal["slurm", "k8s", "kueue"]
    event: SchedulerEventType
    request_id: Name
    name: Label = ""
    user: Label = ""
    account: Label = ""
    queue: Label = ""  # Slurm partition / Kubernetes namespace
    pool: Label = ""
    gpus_per_node: Annotated[float, Field(ge=0, le=1024, allow_inf_nan=False)] = 0
    nodes: Annotated[int, Field(ge=1, le=100_000)] = 1
    reason: Label = ""  # pending reason (Resources, Priority, Unschedulable...) or end state
    assigned_nodes: Annotated[tuple[Name, ...], Field(max_length=B.MAX_ASSIGNED_NODES)] = ()
    cause: StarvationCause | None = None
    cluster_queue: Label | None = None


class LatencyDelta(_Envelope):
    """Requests of one inference service observed during (ts - interval_s, ts].

    ``bounds_ms`` are the finite, strictly increasing upper bounds (Prometheus ``le``);
    ``counts`` has one more entry than ``bounds_ms`` (the +Inf bucket) and holds the
    non-cumulative number of requests per bucket in this interval.
    """

    kind: Literal["latency"] = "latency"
    service: Name
    interval_s: Interval
    bounds_ms: Annotated[tuple[float, ...], Field(max_length=B.MAX_BUCKETS)]
    counts: Annotated[
        tuple[Annotated[int, Field(ge=0, le=B.MAX_COUNT)], ...], Field(max_length=B.MAX_BUCKETS + 1)
    ]
    sum_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0

    @model_validator(mode="after")
    def _buckets(self) -> LatencyDelta:
        b = self.bounds_ms
        if not b:
            raise ValueError("bounds_ms is empty")
        if any(not math.isfinite(x) or x <= 0 for x in b):
            raise ValueError("bounds_ms must be finite and > 0 (+Inf is implicit)")
        if any(b2 <= b1 for b1, b2 in itertools.pairwise(b)):
            raise ValueError("bounds_ms must be strictly increasing")
        if len(self.counts) != len(b) + 1:
            raise ValueError(
                f"counts has {len(self.counts)} entries, expected len(bounds_ms)+1 = {len(b) + 1}"
            )
        return self


HealthKind = Literal["xid", "ecc_dbe", "ecc_sbe", "gpu_lost", "recovered"]


class HealthEvent(_Envelope):
    """XID / ECC / lost-GPU events. ``fatal`` removes the GPU from capacity until ``recovered``."""

    kind: Literal["health"] = "health"
    node: Name
    gpu: Annotated[int, Field(ge=0, le=1023)]
    uuid: Label = ""
    event: HealthKind
    code: Annotated[int, Field(ge=0, le=B.UINT32_MAX)] = 0  # XID number
    fatal: bool = False
    message: Annotated[str, Field(max_length=4096)] = ""


Message = Annotated[
    GpuSampleBatch | NodeHeartbeat | SchedulerEvent | LatencyDelta | HealthEvent,
    Field(discriminator="kind"),
]

KINDS: tuple[str, ...] = ("gpu_samples", "heartbeat", "sched_event", "latency", "health")

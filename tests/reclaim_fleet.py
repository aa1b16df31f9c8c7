"""GPU samples for the idle-reclaim tests, written as a node agent would send them. The GPU is
simulated and its activity is explicit: a holder's GPU reports
``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` = ``activity(t)`` (the value the ingest stores as the sample's
``activity``), ``None`` for a GPU that reports no activity field at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch

ACTIVE = 0.6  # a busy GPU's graphics-engine activity
IDLE = 0.0


@dataclass(frozen=True)
class Holder:
    id: str
    gpus: tuple[int, ...]
    activity: Callable[[float], float | None]  # t (epoch s) -> the GPU's activity
    queue: str = "gpu"
    user: str = "alice"
    account: str = "research"
    scheduler: str = "slurm"
    name: str = ""
    until: float = float("inf")  # no samples attributed at or after this time


_seq = iter(range(10**9))


def batches(node: str, holders: Sequence[Holder], start: float, end: float, interval_s: float = 10.0,
            cluster: str = "c1", skip: Callable[[float], bool] = lambda t: False, ngpus: int = 8,
            ) -> list[GpuSampleBatch]:  # fmt: skip
    """One batch per ``interval_s`` in [start, end) (none where ``skip(t)``: the agent down)."""
    out = []
    t = start
    while t < end:
        if not skip(t):
            gpus = []
            for g in range(ngpus):
                h = next((x for x in holders if g in x.gpus and t < x.until), None)
                act = h.activity(t) if h else IDLE
                alloc = () if h is None else (Allocation(
                    scheduler=h.scheduler, id=h.id, name=h.name or f"job-{h.id}", user=h.user,  # type: ignore[arg-type]
                    account=h.account, queue=h.queue),)  # fmt: skip
                fields = {} if act is None else {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": act}
                gpus.append(GpuSample(index=g, uuid=f"GPU-{node}-{g}", fields=fields, allocations=alloc))
            out.append(GpuSampleBatch(source=node, boot_id="b", seq=next(_seq), cluster=cluster, ts=t, node=node,
                                      pool="p", interval_s=interval_s, gpus=tuple(gpus)))  # fmt: skip
        t += interval_s
    return out

"""A shared GPU's activity split among its holders by what their processes did.

Time-slicing and MPS give several pods (or jobs) one GPU; the scheduler's ``share`` says what
each holds (equal parts), not what each used. For a row with several holders this module
sets each holder's ``activity_share`` (and ``fb_share``) from NVML's per-process figures
(agent/nvml_procs.py), each process placed on its holder through its cgroup
(agent/cgroup.py), and says how in ``share_source`` (gpuslo.wire.Allocation):

- ``measured``: per-process SM utilization; a holder's part of the holders' total
  ``S = Σ share`` is ``S × (Σ smUtil of its processes) / (Σ smUtil of all holders' processes)``;
  a holder without a process, or whose processes ran no kernel, gets 0.
- ``processes``: no utilization figure (MIG instances, a driver without it, or no process ran
  a kernel) but the process lists say some holders have a process and others none: those
  without get 0, the others split ``S`` in proportion to their shares.
- ``equal``: nothing to tell the holders apart (no process list, no holder with a process, or
  every holder has one and there is no utilization): ``activity_share`` stays unset (= share).
- ``sole``: one holder; nothing to split.

``fb_share`` is ``S × (its processes' framebuffer) / (all holders' processes' framebuffer)``
when the driver gives memory figures, else unset.

Processes that belong to no holder of the row (the host's, a system daemon, a pod that sees
the GPU without holding it) take no part in the split: their work is not any holder's, and
the GPU's activity already counts it. They are counted (``unmapped``).

Before any split the holders are made to fit the wire (:func:`fit`): what an attribution says
of one GPU (a scheduler's bookkeeping, a mapping file, the kubelet) may name more holders than
a row carries, or shares adding up to more than the GPU. One such GPU must
not cost the node its tick (the batch would be refused whole), nor be sent as if nobody held it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuslo.agent.cgroup import CgroupHolder, PodDirectory, ProcCgroups
from gpuslo.agent.nvml_procs import ProcView
from gpuslo.wire import Allocation
from gpuslo.wire.bounds import MAX_ALLOCATIONS

#: pid → the holder's (scheduler, Allocation.id), None for no holder
HolderOf = Callable[[int], tuple[str, str] | None]


@dataclass
class SplitStats:
    measured: int = 0  # rows split by utilization
    by_processes: int = 0  # rows split by the process lists
    equal: int = 0  # shared rows left at the equal split
    unmapped: int = 0  # processes on a shared row that belong to none of its holders
    # rows whose holders did not fit the wire as the attribution named them (:func:`fit`)
    oversubscribed: int = 0  # holders' shares adding up to more than the GPU: scaled to it
    cut: int = 0  # holders past the wire's bound of a row's holders (MAX_ALLOCATIONS), left out


def fit(allocs: tuple[Allocation, ...], stats: SplitStats | None = None) -> tuple[Allocation, ...]:
    """The holders of one row as the wire takes them: past ``MAX_ALLOCATIONS`` holders the
    largest shares are kept (the attribution's order among equals); shares adding up to more
    than 1 (two jobs given the same GPU, a job naming one GPU twice, an over-committed
    scheduler) are scaled down in proportion, so the GPU counts once and each holder keeps its
    part (a holder named twice stays two entries, as :func:`split` takes them). Each is counted
    in ``stats``, once per row. A row changed here loses any measured split it came with
    (:func:`split` makes those after this)."""
    stats = stats if stats is not None else SplitStats()
    if len(allocs) <= 1:
        return allocs
    out = list(allocs)
    if len(out) > MAX_ALLOCATIONS:
        stats.cut += 1
        keep = sorted(range(len(out)), key=lambda i: -out[i].share)[:MAX_ALLOCATIONS]
        out = [out[i] for i in sorted(keep)]
    total = sum(a.share for a in out)
    if total > 1.0 + 1e-6:
        stats.oversubscribed += 1
        out = [a.model_copy(update={"share": a.share / total, "activity_share": None, "fb_share": None})
               for a in out]  # fmt: skip
        over = sum(a.share for a in out) - 1.0
        if over > 0:  # floating-point: take the excess off the largest share
            k = max(range(len(out)), key=lambda i: out[i].share)
            out[k] = out[k].model_copy(update={"share": out[k].share - over})
    elif len(out) < len(allocs):
        out = [a.model_copy(update={"activity_share": None, "fb_share": None}) for a in out]
    return tuple(out)


def split(allocs: tuple[Allocation, ...], view: ProcView | None, holder_of: HolderOf,
          stats: SplitStats | None = None) -> tuple[Allocation, ...]:  # fmt: skip
    """``allocs`` with their activity and framebuffer split (module docstring)."""
    stats = stats if stats is not None else SplitStats()
    allocs = fit(allocs, stats)
    if len(allocs) <= 1:
        return tuple(a.model_copy(update={"share_source": "sole"}) for a in allocs)
    if view is None:
        stats.equal += 1
        return _mark(allocs, "equal")
    # a holder named twice on a row (a job listed twice in a mapping file) is one holder: its
    # processes' figures go to its entries in proportion to their shares
    index: dict[tuple[str, str], list[int]] = {}
    for i, a in enumerate(allocs):
        index.setdefault((a.scheduler, a.id), []).append(i)
    sm = [0.0] * len(allocs)
    fb = [0.0] * len(allocs)
    has = [False] * len(allocs)
    for pid in view.fb_bytes.keys() | (view.sm or {}).keys():
        entries = index.get(h, []) if (h := holder_of(pid)) is not None else []
        if not entries:
            stats.unmapped += 1
            continue
        held = sum(allocs[i].share for i in entries)
        for i in entries:
            has[i] = True
            fb[i] += view.fb_bytes.get(pid, 0) * allocs[i].share / held
            sm[i] += (view.sm or {}).get(pid, 0.0) * allocs[i].share / held
    total = sum(a.share for a in allocs)
    fb_parts = _parts(total, fb) if sum(fb) > 0 else None
    if view.sm is not None and sum(sm) > 0:
        stats.measured += 1
        return _with(allocs, "measured", _parts(total, sm), fb_parts)
    if any(has) and not all(has):
        stats.by_processes += 1
        weights = [a.share if h else 0.0 for a, h in zip(allocs, has, strict=True)]
        return _with(allocs, "processes", _parts(total, weights), fb_parts)
    stats.equal += 1
    return _with(allocs, "equal", None, fb_parts)


def _parts(total: float, weights: list[float]) -> list[float]:
    """``total`` in proportion to ``weights`` (Σ weights > 0); each part within [0, 1] and
    the parts' sum never above ``total`` by rounding."""
    w = sum(weights)
    parts = [min(1.0, max(0.0, total * x / w)) for x in weights]
    over = sum(parts) - total
    if over > 0:  # floating-point: take the excess off the largest part
        k = max(range(len(parts)), key=parts.__getitem__)
        parts[k] = max(0.0, parts[k] - over)
    return parts


def _at(parts: list[float] | None, i: int) -> float | None:
    return None if parts is None else parts[i]


def _mark(allocs: tuple[Allocation, ...], source: str) -> tuple[Allocation, ...]:
    return tuple(a.model_copy(update={"share_source": source}) for a in allocs)


def _with(allocs: tuple[Allocation, ...], source: str, act: list[float] | None,
          fb: list[float] | None) -> tuple[Allocation, ...]:  # fmt: skip
    # model_copy does not validate: the values are in range by construction (_parts)
    return tuple(
        a.model_copy(update={"share_source": source, "activity_share": _at(act, i), "fb_share": _at(fb, i)})
        for i, a in enumerate(allocs)
    )


class CgroupHolders:
    """pid → holder through the process's cgroup: a Slurm job by its id, a pod by its UID
    turned into the ``namespace/name`` PodResources attribution uses (:class:`PodDirectory`)."""

    def __init__(self, cgroups: ProcCgroups, pods: PodDirectory | None = None) -> None:
        self.cgroups = cgroups
        self.pods = pods

    def new_tick(self) -> None:
        self.cgroups.new_tick()
        if self.pods is not None:
            self.pods.new_tick()

    def __call__(self, pid: int) -> tuple[str, str] | None:
        h: CgroupHolder | None = self.cgroups(pid)
        if h is None:
            return None
        if h.scheduler == "slurm":
            return ("slurm", h.key)
        name = self.pods(h.key) if self.pods is not None else None
        return None if name is None else ("k8s", name)

"""Where Slurm's and dcgm-exporter's names of a node's GPU devices land among the rows the GPU
source sends: Slurm's gres index (``IDX`` in ``scontrol show job -d`` and in ``squeue --json``'s
``gres_detail``) and dcgm-exporter's HPC job mapping file names (``GPU`` or ``GPU.GI``).

What the sources say (facts checked against them, not copied):

- Slurm (doc/html/gres.shtml, "MIG Management"; src/plugins/gpu/nvml/gpu_nvml.c): with
  ``AutoDetect=nvml`` each MIG device of a GPU in MIG mode is a gres record of its own, typed by
  its "MIG Profile" (the GPU's device name, lower-cased with ``_`` for spaces and cut at the first
  ``-``, then ``_<profile>``, e.g. ``nvidia_a100_3g.20gb``); a configured Type must be a
  (case-insensitive) substring of that string, and types are matched longest first
  (src/plugins/gres/gpu/gres_gpu.c, ``_sort_gpu_by_type_name``). The records are ordered by
  device file: the parent ``/dev/nvidiaN``, then the GI's and CI's ``nvidia-caps`` minors, which
  grow with GPU, GI and CI (``/proc/driver/nvidia-caps/mig-minors``).
- Slurm 22.05, measured on the real slurmctld/slurmd (tests/test_slurm.py): the node's gres
  bitmap, whose positions are the IDX, groups the records by type in the order of the node's
  ``Gres=`` (``gpu:1g.10gb:3,gpu:h100:2`` puts the three 1g.10gb at IDX 0-2, the H100s at 3-4),
  each type's records in device order.
- dcgm-exporter (internal/pkg/transformation/hpc.go, since #602, April 2026; its README, "File
  Conventions"): a mapping file is named by the GPU index, or for a MIG instance
  ``<GPU index>.<GPU instance id>``; only names matching ``^\\d+(\\.\\d+)?$`` are read; a MIG
  row looks up ``GPU.GI`` only, a GPU's own rows ``GPU`` only; each line is a job id.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gpuslo.agent.base import Device

# the wire's bounds (GpuSample.index, MigInstance.gi): a name past them names no row we send
MAX_GPU_INDEX = 1023
MAX_GI = 255
# no node has more GPU gres than this (MIG: 7 per GPU on the wire's 1024 GPUs); an IDX past it
# is refused rather than expanded (a hostile ``IDX:0-99999999999`` must not build a huge list),
# and a node's layout holds no position past it (``gpu:3g.20gb:999999999999`` neither)
MAX_IDX = 8192

_MAPPING_NAME = re.compile(r"([0-9]+)(?:\.([0-9]+))?")  # [0-9]: ASCII only, as Go's \d
_NODE_GPU = re.compile(r"(?:^|,)gpu(?::([^:,()]+))?:([0-9]+)")
_PROFILE = re.compile(r"[0-9]+(?:c\.[0-9]+)?g\.[0-9]+gb", re.IGNORECASE)


def parse_mapping_name(name: str) -> tuple[int, int | None]:
    """A mapping file's name → (GPU index, GPU instance id or None for the whole GPU).

    Raises ValueError with the reason for any other name (``0.x``, ``-1.2``, ``1.2.3``, digits
    that are not ASCII, an index past the wire's bounds)."""
    m = _MAPPING_NAME.fullmatch(name)
    if m is None:
        raise ValueError("not <GPU index> or <GPU index>.<GPU instance id>")
    if any(len(x) > 4 for x in m.groups() if x is not None):
        raise ValueError(f"past the bounds (GPU index <= {MAX_GPU_INDEX}, GPU instance id <= {MAX_GI})")
    gpu, gi = int(m.group(1)), None if m.group(2) is None else int(m.group(2))
    if gpu > MAX_GPU_INDEX or (gi is not None and gi > MAX_GI):
        raise ValueError(f"past the bounds (GPU index <= {MAX_GPU_INDEX}, GPU instance id <= {MAX_GI})")
    return gpu, gi


def parse_node_gres(text: str) -> list[tuple[str, int]]:
    """A node's ``gres`` (``gpu:h100:2(S:0-1),gpu:1g.10gb:3,mps:100``) → its GPU entries in
    order, as (type, count); an untyped ``gpu:4`` has type ``""``. A count past the positions an
    IDX can name (``MAX_IDX``) is cut to them: the entries after it hold no IDX a job can name,
    and the layout stays as small as the node could be (``sinfo`` text is outside input)."""
    return [(m.group(1) or "", _count(m.group(2))) for m in _NODE_GPU.finditer(text)]


def _count(digits: str) -> int:
    """A gres count, at most ``MAX_IDX + 1`` (digits past any int's bound included)."""
    value = digits.lstrip("0")  # (leading zeros count toward int()'s 4,300-digit bound, not the value)
    return MAX_IDX + 1 if len(value) > len(str(MAX_IDX + 1)) else min(int(value or "0"), MAX_IDX + 1)


def slurm_type(d: Device) -> str:
    """The type string Slurm's AutoDetect=nvml gives the device (see the module's notes)."""
    name = d.model.strip().lower().replace(" ", "_")
    return name if d.gi is None else f"{name.split('-', 1)[0]}_{d.profile.lower()}"


def _slurm_devices(devices: Sequence[Device], node_gres: Sequence[tuple[str, int]]) -> list[Device] | None:
    """The devices Slurm schedules, in device order (GPU, GI, CI): MIG instances one by one when
    the node's gres are MIG devices (a type naming a profile, or as many records as instances),
    else None (Slurm schedules whole GPUs: its IDX is the GPU index)."""
    migs = {d.index for d in devices if d.gi is not None}
    if not migs:
        return None
    expanded = [d for d in devices if (d.gi is not None) == (d.index in migs)]
    total = sum(n for _, n in node_gres)
    if not any(_PROFILE.search(t) for t, _ in node_gres) and total != len(expanded):
        return None
    return sorted(
        expanded, key=lambda d: (d.index, -1 if d.gi is None else d.gi, -1 if d.ci is None else d.ci)
    )


def idx_order(devices: Sequence[Device], node_gres: Sequence[tuple[str, int]]) -> list[Device | None] | None:
    """Slurm's IDX → device on this node (None at an IDX whose device NVML does not show), or
    None when Slurm schedules whole GPUs (IDX = GPU index, as without MIG).

    Types are matched as Slurm matches them (gres_gpu.c, ``_normalize_sys_gres_types``): each
    device, longest Slurm type first, takes the first entry with a count left whose type is a
    substring of its own, longest entry first (an untyped entry takes any); the IDX then lay
    the entries out in the node's ``Gres=`` order, each entry's devices in device order."""
    pool = _slurm_devices(devices, node_gres)
    if pool is None:
        return None
    left = [n for _, n in node_gres]
    entries = sorted(range(len(node_gres)), key=lambda p: (-len(node_gres[p][0]), node_gres[p][0]))
    claimed: dict[int, list[Device]] = {p: [] for p in entries}
    for d in sorted(pool, key=lambda d: (-len(slurm_type(d)), slurm_type(d), pool.index(d))):
        own = slurm_type(d)
        pos = next((p for p in entries if left[p] and node_gres[p][0].lower() in own), None)
        if pos is not None:
            left[pos] -= 1
            claimed[pos].append(d)
    out: list[Device | None] = []
    for pos, (_, n) in enumerate(node_gres):
        got = sorted(claimed[pos], key=pool.index)
        out += [*got, *[None] * (n - len(got))]  # n <= MAX_IDX + 1 (parse_node_gres)
        if len(out) > MAX_IDX:  # no IDX names a position past it (parse_idx refuses them)
            return out[: MAX_IDX + 1]
    return out

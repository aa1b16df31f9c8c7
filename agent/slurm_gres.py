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

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from gpuslo.agent.base import Device
from gpuslo.agent.hostlist import expand_hostlist

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


# gres.conf: what the agent reads of it (a node's is a few lines; a larger one is refused unread)
MAX_GRES_CONF_BYTES = 1 << 20
_NVIDIA_FILE = re.compile(r"nvidia([0-9]{1,7})", re.ASCII)
# a key=value as Slurm's own parser reads one (src/common/parse_config.c, KEY_VALUE_REGEX; the
# real slurmd 22.05 numbers ``Name = gpu File="/dev/nvidia2"`` as ``File=/dev/nvidia2``):
# spaces around ``=``, a value quoted (the quotes not part of it) or up to the next space
_KEY_VALUE = re.compile(r'\s*([A-Za-z0-9_.]+)\s*=\s*(?:"([^"]*)"|(\S+))(?:\s+|$)', re.ASCII)


def _pairs(line: str) -> list[tuple[str, str]] | None:
    """A logical line's (key, value) pairs in order; None when some of it is none."""
    out, pos = [], 0
    while pos < len(line):
        m = _KEY_VALUE.match(line, pos)
        if m is None:
            return None
        out.append((m.group(1), m.group(3) if m.group(2) is None else m.group(2)))
        pos = m.end()
    return out


@dataclass(frozen=True)
class GresConf:
    """This node's GPU gres as its gres.conf configures them.

    ``files``: (type, device file) per GPU gres record, in the order slurmd numbers them
    without AutoDetect (src/plugins/gres/common/gres_common.c, ``common_node_config_load``: the
    bitmap index is the record's place, each ``File=`` hostlist expanded in its order, so
    ``File=/dev/nvidia[2-3]`` then ``File=/dev/nvidia0`` are IDX 0, 1, 2 for minors 2, 3, 0).
    ``autodetect``: AutoDetect (nvml, rsmi, ...) is on for the node: slurmd then orders the GPUs
    it matched by their ``Links`` (src/plugins/gres/gpu/gres_gpu.c, ``_merge_system_gres_conf``:
    NVML's enumeration, by PCI bus id), the configured-only files after them by name.
    ``problems``: what makes the order unknowable (an ``Include``, ``MultipleFiles``, a line it
    cannot read): the mapping is then refused, not guessed."""

    files: tuple[tuple[str, str], ...] = ()
    autodetect: bool = False
    problems: tuple[str, ...] = ()


def _lines(text: str) -> list[str]:
    """gres.conf's logical lines: comments (``#`` to the end) cut, ``\\`` continuations joined."""
    out, held = [], ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if line.endswith("\\"):
            held += line[:-1] + " "
            continue
        out.append(held + line)
        held = ""
    return [x.strip() for x in [*out, held] if x.strip()]


def parse_gres_conf(text: str, node: str) -> GresConf:
    """The GPU gres ``text`` (a gres.conf) configures on ``node`` (see :class:`GresConf`):
    lines whose ``NodeName=`` hostlist names it or that name no node; keys case-insensitive,
    as Slurm reads them."""
    files: list[tuple[str, str]] = []
    problems: list[str] = []
    # AutoDetect on a line of no node applies to every node; one on a line naming this node
    # trumps it, wherever it stands (gres.conf(5): ``NodeName=tux3 AutoDetect=off`` unsets a
    # global AutoDetect=nvml for tux3: its GPUs are then numbered in File= order)
    autodetect: dict[bool, bool] = {}  # named this node → on
    for line in _lines(text):
        if line.split(None, 1)[0].lower() == "include":
            problems.append(f"{line[:80]!r}: an included file is not read")
            continue
        pairs = _pairs(line)
        if pairs is None or any(
            c.isspace() for _, v in pairs for c in v
        ):  # (a quoted list: its split unknown)
            problems.append(f"line {line[:80]!r} unreadable")
            continue
        kv = {k.lower(): v for k, v in pairs}
        if "nodename" in kv:
            try:
                if node not in expand_hostlist(kv["nodename"]):
                    continue
            except ValueError as exc:
                problems.append(str(exc))
                continue
        if "autodetect" in kv:
            autodetect[("nodename" in kv)] = kv["autodetect"].lower() not in ("off", "")
        if kv.get("name", "").lower() != "gpu":
            continue
        if "multiplefiles" in kv:
            problems.append(f"{line[:80]!r}: MultipleFiles (one GPU, several files) is not mapped")
            continue
        if "file" not in kv:
            continue  # without a file a GPU is dropped, or matched by AutoDetect (in NVML's order)
        try:
            named = expand_hostlist(kv["file"])
        except ValueError as exc:
            problems.append(str(exc))
            continue
        files += [(kv.get("type", ""), f) for f in named]
    on = autodetect.get(True, autodetect.get(False, False))
    if len(files) > MAX_IDX + 1:  # (a hostile File=/dev/nvidia[0-99999]: no node has so many)
        return GresConf(
            (), on, (*problems, f"{len(files)} GPU files, more than the {MAX_IDX + 1} a node holds")
        )
    return GresConf(tuple(files), on, tuple(problems))


# NVIDIA's character devices (Linux's devices.txt): /dev/nvidiaN is 195:N; 195:254 and 195:255
# are nvidia-modeset and nvidiactl, no GPU
NVIDIA_MAJOR, _NVIDIA_NOT_GPU = 195, 254


def minor_of(path: str) -> int | None:
    """The NVIDIA minor number a gres.conf ``File=`` names: a character device's of NVIDIA's
    major, else (no such file here, as in a container, or a stand-in) the N of a name
    ``nvidiaN``; None for anything else (``/dev/nvidia-caps/nvidia-capN``, whose minor is a
    capability's, ``/dev/dri/card0``, ``/dev/nvidiactl``)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        st = None
    if st is not None and stat.S_ISCHR(st.st_mode):
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        return minor if major == NVIDIA_MAJOR and minor < _NVIDIA_NOT_GPU else None
    m = _NVIDIA_FILE.fullmatch(os.path.basename(path))
    return int(m.group(1)) if m else None


def _natural(text: str) -> list[object]:
    """Slurm's ``strnatcmp`` order: digit runs compared as numbers (``nvidia2`` < ``nvidia10``)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"([0-9]+)", text) if p]


def idx_gpus(
    conf: GresConf, devices: Sequence[Device], node_gres: Sequence[tuple[str, int]] = ()
) -> tuple[list[int | None], list[str]]:
    """Slurm's IDX → the NVML index of the GPU it names on this node (None: a file naming no GPU
    NVML shows, or no GPU at all), and what could not be placed. IDX follow gres.conf's records
    (:class:`GresConf`); where they have several types, type by type in the node's ``Gres=``
    order (``node_gres``), as many of each as it counts; with AutoDetect the GPUs NVML shows
    come first, in NVML's order."""
    by_minor = {d.minor: d.index for d in devices if d.gi is None and d.minor is not None}
    said: list[str] = []
    records = list(conf.files)
    if conf.autodetect:
        records.sort(
            key=lambda r: (0, by_minor[m]) if (m := minor_of(r[1])) in by_minor else (1, _natural(r[1]))
        )
    if len({t.lower() for t, _ in records}) > 1:
        # slurmd takes, for each type of the node's Gres= in its order, that many of gres.conf's
        # records of the type in their order (src/common/gres.c, _merge_config, _merge_gres2)
        # (_match_type: the type matched without case; an untyped entry takes any record)
        typed: list[tuple[str, str]] = []
        left = list(records)
        for want, count in node_gres:
            mine = [r for r in left if not want or r[0].lower() == want.lower()][:count]
            typed += mine
            left = [r for r in left if r not in mine]
        if left:
            said.append(
                f"gres.conf records {[f for _, f in left][:5]} hold no place in the node's Gres= {list(node_gres)}"
            )
        records = typed
    out: list[int | None] = []
    for _, f in records[: MAX_IDX + 1]:
        m = minor_of(f)
        if m is None:
            said.append(f"gres.conf File={f[:100]} is no /dev/nvidiaN: its IDX names no GPU")
        elif m not in by_minor:
            said.append(f"gres.conf File={f[:100]} (minor {m}) is no GPU NVML shows")
        out.append(by_minor.get(m) if m is not None else None)
    return out, said

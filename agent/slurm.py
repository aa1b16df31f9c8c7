"""Slurm: per-node GPU→job attribution, node schedulable state, and the cluster-level
scheduler-event collector, from Slurm's own JSON interfaces (``squeue --json``,
``sinfo --json``; OpenAPI v0.0.38 on Slurm 22.05) or dcgm-exporter's HPC job mapping
directory.

Slurm trouble (a command missing, timing out, failing, printing non-JSON) is logged once
per kind and counted; the tick goes on with what is known.
"""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuslo.agent.base import Device, Sequencer, Source
from gpuslo.agent.hostlist import expand_hostlist
from gpuslo.agent.inflight import InFlight
from gpuslo.agent.pool import NodePool, join_partitions
from gpuslo.agent.slurm_gres import (
    MAX_GRES_CONF_BYTES,
    MAX_IDX,
    idx_gpus,
    idx_order,
    parse_gres_conf,
    parse_mapping_name,
    parse_node_gres,
)
from gpuslo.core.fileio import UNREADABLE_STATE, NotARegularFile, read_regular, replace_file, state_records
from gpuslo.core.mig import gpu_fraction
from gpuslo.core.proc import Children, Stopped
from gpuslo.wire import Allocation, Message, NodeHeartbeat, SchedulerEvent
from gpuslo.wire.bounds import MAX_ALLOCATIONS, MAX_ASSIGNED_NODES, MAX_GPU_ROWS, TS_MAX, TS_MIN
from gpuslo.wire.models import NAME_MAX

log = logging.getLogger(__name__)

Run = Callable[[Sequence[str]], str]

# ``gres:gpu``, ``gres:gpu:h100`` (no count: one, as squeue writes ``--gres=gpu`` and
# ``--gres=gpu:h100``), ``gres/gpu:8``, ``gres/gpu:a100:2``, ``gres/gpu=2``
_TRES_GPU = re.compile(r"gres[:/]gpu((?:[:=][^,]*)?)(?=,|$)")
_NOT_SCHEDULABLE = {"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING", "MAINT", "REBOOT_REQUESTED",
                    "REBOOT_ISSUED", "POWERED_DOWN", "POWERING_DOWN", "FUTURE", "INVALID", "NOT_RESPONDING"}  # fmt: skip
_ENDED = {
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "CANCELLED",
    "PREEMPTED",
}


# the GPUs a job may ask for per node: a node's GPU rows (SchedulerEvent.gpus_per_node's bound)
MAX_GPUS_PER_NODE = MAX_GPU_ROWS
# an HPC job mapping file's first MAX_ALLOCATIONS job ids (of 256 characters at most) are used,
# 16 KiB; one over this size is refused unread
MAX_MAPPING_BYTES = 1 << 20


def parse_idx(gres_detail: str, problems: list[str] | None = None) -> list[int]:
    """The node's GPU positions a job's ``gres_detail`` names: ``gpu:2(IDX:0-1)``,
    ``gpu:a100:3(IDX:0,2-3)``, ``gpu:1g.10gb:1(IDX:4),gpu:h100:1(IDX:0)`` (IDX past
    ``MAX_IDX``, reversed ranges and unreadable parts are left out, logged).

    Slurm writes one ``name[:type]:count(IDX:bitmap)`` entry per gres the job holds on the
    node, whatever the gres (src/common/gres.c, recorded on 22.05): ``--gres=gpu:1,nic:1``
    gives ``gpu:1(IDX:1),nic:1(IDX:0)``, where ``IDX:0`` is the node's first NIC, not a GPU.
    Only the GPU's gres count: ``gpu``, and the gres that share a GPU (``shard``, ``mps``).
    A shard's IDX is the position of the GPU it is on (a node with shards on its GPUs 2-3 only
    gives ``shard:1(IDX:2)``); an MPS IDX is the position of the node's MPS record (MPS on GPUs
    2-3 only gave ``mps:50(IDX:0)``), which is its GPU's where every GPU has MPS, as Slurm's
    examples configure it, and is read so (nothing the agent is told says which GPUs have
    MPS). A ``(CNT:n)`` entry names no device; a GPU gres entry in any
    other form (Slurm 23.02+ writes a shared gres as ``shard:2(1/4,0/4)``, not read yet) is a
    problem. Problems are appended to ``problems`` (logged when it is None)."""
    said: list[str] = [] if problems is None else problems
    out: list[int] = []
    for entry in _gres_entries(gres_detail):
        m = _GRES_ENTRY.fullmatch(entry)
        if m is None:
            name = re.split(r"[:(]", entry, maxsplit=1)[0]
            if name in GPU_GRES and "(" in entry and not _CNT_ENTRY.search(entry):
                said.append(f"gres entry {entry[:80]!r} unreadable; left out")
            continue
        if m.group(1) not in GPU_GRES:
            continue
        for part in m.group(2).split(","):
            a, dash, b = part.partition("-")
            if not _IDX_NUMBER.fullmatch(a) or not (_IDX_NUMBER.fullmatch(b) or not dash):
                if part:
                    said.append(f"IDX part {part[:50]!r} unreadable; left out")
                continue
            lo, hi = int(a), int(b or a)
            if hi > MAX_IDX or hi < lo:
                said.append(f"IDX {part} out of range; left out")
                continue
            out += range(lo, hi + 1)
    if problems is None:
        for why in said:
            log.warning("gres %r: %s", gres_detail[:200], why)
    return out


#: the gres whose IDX are positions of the node's GPUs (parse_idx)
GPU_GRES = frozenset({"gpu", "shard", "mps"})
_GRES_ENTRY = re.compile(r"([^:(]*)(?::[^(]*)?\(IDX:([^()]*)\)", re.ASCII)
_IDX_NUMBER = re.compile(r"[0-9]{1,5}", re.ASCII)
_CNT_ENTRY = re.compile(r"\(CNT:[0-9]+\)$", re.ASCII)


def _gres_entries(text: str) -> list[str]:
    """``text`` cut at its commas outside parentheses (an IDX bitmap has commas of its own)."""
    out, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth <= 0:
            out.append(text[start:k])
            start, depth = k + 1, 0
    return [*out, text[start:]]


# Slurm's name of one array task (``123_4``) or one heterogeneous job component (``123+1``), with
# gpuslo's attempt suffix (``123_4#2``): squeue --json, the job's cgroup (``job_<id>``) and
# SLURM_JOB_ID name each by its own job id (JobIDRaw), as the agent records it; these do not
SLURM_ALIAS = re.compile(r"([0-9]{1,10})([_+])([0-9]{1,10})(#[0-9]{1,5})?", re.ASCII)
_JOB_ID_LINE = re.compile(r"JobId=([0-9]{1,10})\b", re.ASCII)


def raw_job_id(text: str, cli: SlurmCli | None = None) -> tuple[str, str]:
    """(the id the agent recorded the job by, a note for the user) for an id as a user gives it.
    Slurm's ``123_4`` or ``123+1`` is asked of ``scontrol show job`` (while slurmctld holds the
    job) then ``sacct`` (after, with accounting): their ``JobId``/``JobIDRaw``, the attempt
    suffix kept; any other id is given back as it is, without a note. ValueError (saying how to
    find the job's own id) when neither answers."""
    m = SLURM_ALIAS.fullmatch(text)
    if m is None:
        return text, ""
    alias, what = (
        f"{m.group(1)}{m.group(2)}{m.group(3)}",
        "an array task" if m.group(2) == "_" else "a het job component",
    )
    cli = cli or SlurmCli()
    raw = None
    shown = cli.text("scontrol", "show", "job", "-o", alias)
    if shown and (found := _JOB_ID_LINE.search(shown)):
        raw = found.group(1)
    if raw is None:
        acct = cli.text("sacct", "-X", "-n", "-P", "-o", "JobIDRaw", "-j", alias)
        lines = [x.strip() for x in (acct or "").splitlines() if x.strip()]
        if lines and re.fullmatch(r"[0-9]{1,10}", lines[0], re.ASCII):
            raw = lines[0]
    if raw is None:
        raise ValueError(
            f"{text!r} is Slurm's name of {what}, and neither scontrol nor sacct could give its own job id "
            f"here; gpuslo records a job by its own id: give that (sacct -X -n -o JobIDRaw -j {alias})"
        )
    return raw + (m.group(4) or ""), f"{alias} is job {raw}"


class Malformed(ValueError):
    """A job ``squeue --json`` describes in a shape this module cannot read (the reason says
    which part): that job is skipped and counted, the others go on."""


# Slurm 23.02+ (OpenAPI v0.0.39+) writes numbers that may be unset or infinite as objects
_NUMBER_KEYS = {"set", "infinite", "number"}
# Slurm's base job states; the rest of a 23.02+ state list are flags (COMPLETING, REQUEUED...)
_BASE_STATES = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", *_ENDED}
_HELD = ("RUNNING", "COMPLETING", "SUSPENDED")  # states in which a job holds its GPUs
# states of a requeued job whose submit_time is its requeue's (back in the queue, or run or ended since)
_REQUEUE_SETTLED = frozenset({"PENDING", *_HELD, *_ENDED})
_LOGGED_MAX = 1000  # distinct things logged once each; past it, counted only


def _number(v: Any, what: str) -> float | None:
    """A number as Slurm writes it: plain (22.05), or ``{"set": true, "infinite": false,
    "number": N}`` (23.02+); None when unset or infinite; :class:`Malformed` otherwise."""
    if isinstance(v, dict) and v.keys() <= _NUMBER_KEYS:
        if v.get("set") is False or v.get("infinite") is True:
            return None
        v = v.get("number")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise Malformed(f"{what} {str(v)[:50]!r} is no number")
    return float(v)


def _time(v: Any, what: str, estimate: bool = False) -> float:
    """A Slurm time in Unix seconds; 0 when unknown (Slurm's 0, unset or infinite). An
    ``estimate`` (a start or end that has not happened yet) past the wire's 2106 is unknown too:
    slurmctld 22.05 writes a requeued job's end as its expected start + 2^32 - 1 s (year 2163),
    which made every requeued job unreadable."""
    t = _number(v, what)
    if not t:
        return 0.0
    if estimate and t > TS_MAX:
        return 0.0
    if not TS_MIN <= t <= TS_MAX:  # a unit error (ms) or garbage: no time the wire carries
        raise Malformed(f"{what} {t:g} is no time in seconds between 2000 and 2106")
    return t


def _text(v: Any, what: str) -> str:
    """A string of the job as the wire carries it (at most 256 characters, UTF-8)."""
    if v is None:
        return ""
    if isinstance(v, int | float) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str):
        raise Malformed(f"{what} is a {type(v).__name__}, not a string")
    text: str = v[:256]
    try:
        text.encode()
    except UnicodeEncodeError:
        raise Malformed(f"{what} {text[:50]!r} is not UTF-8 text") from None
    return text


def job_id(job: dict[str, Any]) -> str:
    """The job's own id, as squeue --json writes it: an array task's and a het job component's
    are ids of their own (measured on 22.05: task ``1_0`` is job 4, ``2+1`` job 3), which the
    job's cgroup and SLURM_JOB_ID name too; ``gpuslo job 1_0`` asks Slurm for it
    (:func:`raw_job_id`)."""
    v = job.get("job_id")
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise Malformed("job_id is missing" if v is None else f"job_id is a {type(v).__name__}")
    text = str(v)
    if not text or len(text) > 256:
        raise Malformed(f"job_id {text[:50]!r} is {'empty' if not text else 'longer than 256 characters'}")
    return _text(text, "job_id")


def job_state(v: Any) -> str:
    """The state: ``"RUNNING"`` (22.05) or a list of the base state and its flags (23.02+:
    ``["RUNNING"]``, ``["COMPLETED", "COMPLETING"]``), read as 22.05 reads it (COMPLETING
    when flagged so, else the base state)."""
    if isinstance(v, list):
        names = [str(x).upper() for x in v if isinstance(x, str)]
        if "COMPLETING" in names:
            return "COMPLETING"
        return next((x for x in names if x in _BASE_STATES), names[0] if names else "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise Malformed(f"job_state is a {type(v).__name__}, not a string or a list")
    return v.upper()


def gpus_per_node(job: dict[str, Any]) -> float:
    """The GPUs per node of the job's shape (:func:`gpu_shape`); 0 without GPUs."""
    return gpu_shape(job)[0]


def gpu_shape(job: dict[str, Any]) -> tuple[float, int]:
    """The job's GPU shape (GPUs per node, nodes holding them), from whichever of Slurm's four
    ways of asking it used (slurmctld 22.05's ``squeue --json``, recorded):

    - ``--gres=gpu:G`` / ``--gpus-per-node=G`` (``tres_per_node``: ``gres/gpu:8``,
      ``gres/gpu:a100:2``; ``gres:gpu`` and ``gres:gpu:h100`` one each): G on each of the job's
      ``node_count`` nodes;
    - ``--gpus=N`` (``tres_per_job``) and ``--gpus-per-task=T`` (``tres_per_task``, N = T ×
      ``tasks``): N spread evenly over the ``node_count`` nodes (N/k each, a fraction when k does
      not divide N: the total stays N, and a node must have ⌈N/k⌉ whole GPUs free to host its
      part), or one on each of N nodes when N < k;
    - ``--gpus-per-socket=S`` (``tres_per_socket``): S × ``sockets_per_node`` (1 when unset) on
      each node.

    ``tres_per_node`` wins when several are set (Slurm fills ``tres_per_job`` too for
    ``--gpus=N --gres=gpu:G``). ``(0, k)`` without GPUs (its wait is no starvation);
    :class:`Malformed` for a count past what a node holds. (A job asking ``--gpus=N`` was read
    as asking none.)"""
    k = node_count(job)
    per_node, each = _tres_gpus(job, "tres_per_node")
    if per_node:
        return per_node * each, k
    total, each = _tres_gpus(job, "tres_per_job")
    if not total:
        per_task, each = _tres_gpus(job, "tres_per_task")
        if per_task:
            total = per_task * _count(job, "tasks")
    if total:
        if total < k:
            return each, total
        if total > MAX_GPUS_PER_NODE * k:
            raise Malformed(f"{total} GPUs over {k} node(s): more than a node holds")
        return total * each / k, k
    per_socket, each = _tres_gpus(job, "tres_per_socket")
    if per_socket:
        sockets = _count(job, "sockets_per_node")
        g = per_socket * sockets
        if g > MAX_GPUS_PER_NODE:
            raise Malformed(f"{per_socket} GPUs per socket on {sockets} sockets: more than a node holds")
        return g * each, k
    return 0.0, k


def _count(job: dict[str, Any], key: str) -> int:
    """A count of the job's (``tasks``, ``sockets_per_node``): 1 when unset or 0;
    :class:`Malformed` for a number that is no count."""
    n = _number(job.get(key), key)
    if n is not None and (n != int(n) or n < 0):
        raise Malformed(f"{key} {n:g} is no count")
    return max(1, int(n or 1))


# a TRES string is read whole up to this many characters (a job's GPU request may follow its
# other TRES); the wire's 256 apply to the text fields it carries, not to this
MAX_TRES_CHARS = 4096


def _tres_gpus(job: dict[str, Any], key: str) -> tuple[int, float]:
    """The GPU devices the job's ``key`` TRES string asks (0 without one), and the part of a GPU
    each is: 1, or for a MIG profile as the gres type (``gres/gpu:1g.10gb:2``, Slurm's
    ``AutoDetect=nvml`` names) its compute slices over its GPU's (:mod:`gpuslo.core.mig`; a MIG
    device was read as a whole GPU, so the starvation snapshot, which counts a free 1g.10gb
    instance as 1/7, read a shortfall); :class:`Malformed` past what a node holds
    (``tres_per_node``, ``tres_per_task``, ``tres_per_socket``) or what five digits write
    (``tres_per_job``)."""
    v = job.get(key)
    if v is None:
        return 0, 1.0
    if not isinstance(v, str):
        raise Malformed(f"{key} is a {type(v).__name__}, not a string")
    if len(v) > MAX_TRES_CHARS:
        raise Malformed(f"{key} is {len(v)} characters long, more than {MAX_TRES_CHARS}")
    m = _TRES_GPU.search(v)
    if m is None:
        return 0, 1.0
    parts = [p for p in re.split(r"[:=]", m.group(1)) if p]
    if len(parts) == 1 and _NUMBERISH.fullmatch(parts[0]) and not _COUNT.fullmatch(parts[0]):
        raise Malformed(f"{key} {m.group(0)[:50]!r}: no GPU count")  # -1, 1.5, 1e20: a number, not a type
    typed = parts[0] if parts and not (parts[0].isascii() and parts[0].isdigit()) else ""
    each = (gpu_fraction(typed) or 1.0) if typed else 1.0  # a type NVIDIA's MIG table lacks: a GPU
    if not parts or (len(parts) == 1 and typed):
        return 1, each  # no count (a type alone, a MIG profile such as 3g.40gb): one, as Slurm reads it
    bound = 10**5 - 1 if key == "tres_per_job" else MAX_GPUS_PER_NODE
    if len(parts) > 2 or not _COUNT.fullmatch(parts[-1]) or int(parts[-1]) > bound:
        raise Malformed(f"{key} {m.group(0)[:50]!r}: no GPU count a node holds")
    return int(parts[-1]), each


_COUNT = re.compile(r"[0-9]{1,5}", re.ASCII)
_NUMBERISH = re.compile(r"[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?", re.ASCII)


def node_count(job: dict[str, Any]) -> int:
    """The job's node count (at least 1); :class:`Malformed` past what the wire carries."""
    n = _number(job.get("node_count"), "node_count")
    if n is None or n < 1:
        return 1
    if n != int(n) or n > MAX_ASSIGNED_NODES:
        raise Malformed(f"node_count {n:g} is no count of nodes (1..{MAX_ASSIGNED_NODES})")
    return int(n)


def job_hosts(job: dict[str, Any]) -> list[str]:
    """The job's nodes in allocation order (the order of ``gres_detail``): Slurm 22.05's
    ``job_resources.allocated_nodes``, else the hostlist ``nodes`` (23.02+)."""
    res = job.get("job_resources") or {}  # none yet: squeue writes an empty object (or list)
    if not isinstance(res, dict):
        raise Malformed(f"job_resources is a {type(res).__name__}, not an object")
    alloc = res.get("allocated_nodes") or []
    if not isinstance(alloc, list):
        raise Malformed(f"job_resources.allocated_nodes is a {type(alloc).__name__}, not a list")
    hosts = []
    for n in alloc:
        if not isinstance(n, dict):
            raise Malformed(f"an allocated node is a {type(n).__name__}, not an object")
        hosts.append(_text(n.get("nodename"), "nodename"))
    if hosts:
        return hosts
    try:
        return expand_hostlist(_text(job.get("nodes"), "nodes"))
    except ValueError as exc:
        raise Malformed(str(exc)) from None


class Answers:
    """The node agent's ``squeue --json`` and ``sinfo --json`` answers, each asked of slurmctld at
    most once per ``period_s`` and shared by the commands' users on the node (the attribution, the
    heartbeat). Slurm 22.05's ``--json`` ignores every filter (``-w NODE``, ``--states``: checked
    on slurmctld 22.05), so each agent's every ask is the whole cluster's job or node list: on a
    large cluster, every node asking every tick is slurmctld's load. 0: asked every time. A
    failed ask is not kept: the next one asks again. Users must not change the lists (shared)."""

    def __init__(self, period_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(period_s) and period_s >= 0):
            raise ValueError(f"the period of Slurm's answers must be finite and >= 0, not {period_s!r}")
        self.period_s = period_s
        self._clock = clock
        self._kept: dict[tuple[str, ...], tuple[float, list[Any]]] = {}
        self._locks: dict[tuple[str, ...], threading.Lock] = {}
        self._lock = threading.Lock()
        self.asked = 0  # asks of slurmctld (the rest answered from what was kept)

    def get(self, argv: tuple[str, ...], ask: Callable[[], list[Any] | None]) -> list[Any] | None:
        """The kept answer to ``argv`` while younger than the period, else ``ask()``'s (a user
        asking while another does waits for that ask and takes its answer)."""
        with self._lock:
            one = self._locks.setdefault(argv, threading.Lock())
        with one:  # two users asking at once: one ask, one answer
            kept = self._kept.get(argv)
            now = self._clock()
            # (an answer from the future, an injected clock set back, is not kept on: it read as
            # younger than the period until the clock came back past it)
            if kept is not None and 0 <= now - kept[0] < self.period_s:
                return kept[1]
            self.asked += 1
            answer = ask()
            if answer is not None:
                self._kept[argv] = (now, answer)
            return answer


class SlurmCli:
    """Runs Slurm's commands. ``SLURM_CONF`` and the rest come from the environment.
    ``answers``: where ``squeue``/``sinfo`` answers are kept and shared (:class:`Answers`).
    ``children``: the run's child processes (:class:`~gpuslo.core.proc.Children`): a command is
    killed, its whole process group, at ``timeout_s`` and when the run ends (a command on a
    thread of its own was left running at the agent's exit); none given, one of its own, closed
    at the interpreter's exit."""

    def __init__(
        self, run: Run | None = None, timeout_s: float = 15.0, answers: Answers | None = None,
        children: Children | None = None,
    ) -> None:  # fmt: skip
        self.timeout_s = timeout_s
        self.children = children if children is not None else Children()
        self._run = run or self._subprocess
        self.failures = 0
        self._logged: set[str] = set()
        self.answers = answers

    def _subprocess(self, argv: Sequence[str]) -> str:
        # a job name that is not UTF-8 must not make the whole answer unreadable: replaced
        return self.children.run(argv, self.timeout_s, check=True).stdout

    def text(self, *argv: str) -> str | None:
        """The command's output; None when it failed (logged once per command and kind, counted)."""
        try:
            return self._run(argv)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            self._failed(argv, exc)
            return None

    def _failed(self, argv: Sequence[str], exc: Exception) -> None:
        if isinstance(exc, Stopped):  # the run ended: no answer is wanted any more
            return
        self.failures += 1
        key = f"{argv[0]} {type(exc).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            detail = getattr(exc, "stderr", "") or exc
            log.warning("%s failed: %s (logged once; counted)", " ".join(argv), str(detail).strip()[:300])

    def json(self, *argv: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self._run(argv))
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            self._failed(argv, exc)
            return None
        if not isinstance(data, dict):
            self._refused(argv, f"the answer is a {type(data).__name__}, not an object")
            return None
        errors = data.get("errors") or []
        if errors:
            # Slurm 22.05 exits 0 when slurmctld cannot be reached (refused, or silent past its
            # MessageTimeout), its failure in errors beside an empty list (tests/data/slurm): read
            # as an answer, every job had left the queue
            self.failures += 1
            key = f"{argv[0]} reported"
            if key not in self._logged:
                self._logged.add(key)
                log.warning("%s reported %s; taken as a failure (logged once; counted)", " ".join(argv),
                            json.dumps(errors)[:300])  # fmt: skip
            return None
        return data

    def _refused(self, argv: Sequence[str], why: str) -> None:
        self.failures += 1
        key = f"{argv[0]} shape"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s: %s (logged once; counted)", " ".join(argv), why)

    def _list(self, argv: Sequence[str], key: str) -> list[Any] | None:
        """The answer's list ``key`` (its items unchecked: each reader skips and counts what it
        cannot read); None, counted as a failure, when the command failed or the key is no list."""
        d = self.json(*argv)
        if d is None:
            return None
        items = d.get(key) or []
        if not isinstance(items, list):
            self._refused(argv, f"{key} is a {type(items).__name__}, not a list")
            return None
        return items

    def jobs(self) -> list[Any] | None:
        return self._kept(("squeue", "--json"), "jobs")

    def nodes(self) -> list[Any] | None:
        return self._kept(("sinfo", "--json"), "nodes")

    def _kept(self, argv: tuple[str, ...], key: str) -> list[Any] | None:
        if self.answers is None:
            return self._list(argv, key)
        return self.answers.get(argv, lambda: self._list(argv, key))


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        e = exc.errors(include_url=False)[0]
        return f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}"
    return str(exc)


def _allocation(job: dict[str, Any]) -> Allocation:
    return Allocation(
        scheduler="slurm",
        id=job_id(job),
        name=_text(job.get("name"), "name"),
        user=_text(job.get("user_name"), "user_name"),
        account=_text(job.get("account"), "account"),
        queue=_text(job.get("partition"), "partition"),
        share=1.0,
    )


def _held_idx(job: Any, node: str, problems: list[str]) -> tuple[Allocation, list[int]] | None:
    """The job as the holder of gres IDX on ``node`` (each IDX once), or None when it holds
    nothing there; :class:`Malformed` for a job it cannot read; what of its ``gres_detail``
    cannot be read is appended to ``problems``."""
    if not isinstance(job, dict):
        raise Malformed(f"the job is a {type(job).__name__}, not an object")
    if job_state(job.get("job_state")) not in _HELD:
        return None
    hosts = job_hosts(job)
    if node not in hosts:
        return None
    details = job.get("gres_detail") or []
    if not isinstance(details, list):  # a string would be read character by character
        raise Malformed(f"gres_detail is a {type(details).__name__}, not a list")
    idx: list[int] = []
    for i, host in enumerate(hosts):
        if host == node and i < len(details):
            if not isinstance(details[i], str):
                raise Malformed(f"gres_detail[{i}] is a {type(details[i]).__name__}, not a string")
            idx += parse_idx(details[i], problems)
    return _allocation(job), list(dict.fromkeys(idx))  # IDX:0,0 holds GPU 0 once


class SlurmAttribution:
    """GPU index (or MIG instance) → the Slurm job holding it on ``node`` (a
    :class:`~gpuslo.agent.base.LayoutAttribution`: the GPU source binds its rows, then calls
    ``refresh()`` each tick).

    From ``squeue --json``: each running job's ``gres_detail[i]`` (``gpu:2(IDX:0-1)``) for the
    i-th node of ``job_resources.allocated_nodes``. On a node with MIG instances the IDX are
    placed on rows as Slurm orders them (:func:`~gpuslo.agent.slurm_gres.idx_order`, from the
    node's ``gres`` in ``sinfo --json``), and a job holding a MIG device is attributed to that
    instance's row only. Or, with ``mapping_dir``, from dcgm-exporter's HPC job mapping: one
    file per GPU index (``0``) or MIG instance (``0.1``: GPU 0, GPU instance 1) whose lines are
    job ids.

    Without MIG, an IDX is the place of a GPU record among the node's gres.conf records, not
    the NVML index (:func:`~gpuslo.agent.slurm_gres.idx_gpus`): with ``gres_conf`` (the node's
    gres.conf) each IDX is placed through its ``File=``'s minor number on the GPU NVML gives
    that minor, and an IDX naming no GPU NVML shows is refused and counted. Where gres.conf
    cannot be read or its order cannot be known (an ``Include``, ``MultipleFiles``), the last
    mapping is kept, or before any, IDX is read as the NVML index: said, and counted in
    ``unmapped`` each refresh. Without ``gres_conf``, IDX is read as the NVML index (what Slurm
    does with ``AutoDetect=nvml`` and no ``File=``)."""

    def __init__(self, node: str, cli: SlurmCli | None = None, mapping_dir: Path | None = None,
                 gres_conf: Path | None = None, wait_s: float | None = None,
                 stop: threading.Event | None = None) -> None:  # fmt: skip
        self.node = node
        self.cli = cli or SlurmCli()
        self.wait_s = wait_s
        # with wait_s, squeue and sinfo run off the tick (agent.inflight): a slurmctld slow to
        # answer held every tick the commands' 15 s timeout; the last mapping stands meanwhile
        # (the first answer waited for whole: there is no last one)
        self._squeue: InFlight[list[Any] | None] | None = None
        self._sinfo: InFlight[list[Any] | None] | None = None
        if wait_s is not None:
            self._squeue = InFlight(
                f"squeue --json (node {node}'s jobs)", wait_s, "gpuslo-squeue", first_whole=True, stop=stop
            )
            self._sinfo = InFlight(
                f"sinfo --json (node {node}'s gres)", wait_s, "gpuslo-sinfo", first_whole=True, stop=stop
            )
        self.mapping_dir = mapping_dir
        self.gres_conf = gres_conf
        self._gpu_at: list[int | None] | None = None  # IDX → NVML index from gres.conf; None: IDX = index
        self._gpu_at_learnt = False
        # refreshes whose IDX were read as NVML indices unverified (gres.conf unreadable or its
        # order unknowable, before any mapping was learnt)
        self.unmapped = 0
        self._by_gpu: dict[int, tuple[Allocation, ...]] = {}
        self._by_uuid: dict[str, tuple[Allocation, ...]] = {}  # MIG instance rows
        self._devices: list[Device] = []
        self._mig_rows: set[str] = set()
        self._gpu_indices: set[int] = set()
        self._order: list[Device | None] | None = None  # Slurm's IDX → device; None: IDX = GPU index
        self._learnt = False  # the order was learnt from one sinfo answer at least
        self._nodes_asked = False  # sinfo asked in this refresh (once a refresh, by _nodes)
        self._late = False  # a Slurm command of this refresh had not answered within wait_s
        self._deadline = 0.0  # (time.monotonic) the end of this refresh's wait_s
        # refreshes that kept the last mapping or order: squeue or sinfo had not answered within
        # wait_s (one a refresh, however many of its commands were late)
        self.slow = 0
        self._nodes_now: list[Any] | None = None
        self._logged: set[str] = set()
        # squeue jobs it cannot read, gres indices and mapping files that name no row, holders
        # past a row's bound (each kind logged once)
        self.skipped = 0

    def _take(self, call: InFlight[list[Any] | None], fn: Callable[[], list[Any] | None]) -> list[Any] | None:
        """The answer of ``call`` (None while it has not come), waited for what is left of the
        refresh's ``wait_s``: the refresh waits ``wait_s`` in all (once one call is late, the
        others are looked at, not waited for), and counts once in :attr:`slow`, however many
        commands it asks."""
        came, answer = call.take(fn, max(0.0, self._deadline - time.monotonic()))
        self._late = self._late or not came
        return answer if came else None

    def refresh(self) -> None:
        self._late = False
        self._deadline = time.monotonic() + (self.wait_s or 0.0)
        try:
            self._refresh()
        finally:
            self.slow += self._late

    def bind(self, devices: Sequence[Device]) -> None:
        self._devices = list(devices)
        self._gpu_indices = {d.index for d in devices if d.gi is None}
        self._mig_rows = {d.uuid for d in devices if d.gi is not None}

    def _skip(self, key: str, msg: str, *args: object, n: int = 1) -> None:
        self.skipped += n
        if key not in self._logged and len(self._logged) < _LOGGED_MAX:
            self._logged.add(key)
            text = msg % args
            log.warning("%s (logged once; counted)", text)

    def _refresh(self) -> None:
        if self.mapping_dir is not None:
            self._by_gpu, self._by_uuid = self._from_mapping_dir(self.mapping_dir)
            return
        self._nodes_asked = False
        if any(d.gi is not None for d in self._devices) and not self._learn_order():
            return  # the node's gres unknown: keep the last mapping rather than misplace jobs
        if self.gres_conf is not None and self._order is None:
            self._learn_gpus(self.gres_conf)
        # None: failed, or not answered yet; the last known mapping stands rather than GPUs as free
        jobs = self.cli.jobs() if self._squeue is None else self._take(self._squeue, self.cli.jobs)
        if jobs is None:
            return
        by_gpu: dict[int, list[Allocation]] = {}
        by_uuid: dict[str, list[Allocation]] = {}
        for job in jobs:
            try:
                problems: list[str] = []
                held = _held_idx(job, self.node, problems)
            except (Malformed, ValidationError) as exc:  # that job only: the others are placed
                jid = str(job.get("job_id"))[:50] if isinstance(job, dict) and job.get("job_id") else "?"
                why = _reason(exc)
                self._skip(f"job {jid} {why if jid == '?' else ''}", "squeue job %s skipped: %s", jid, why)
                continue
            for why in problems:  # the job's readable IDX are still placed
                self._skip(
                    f"gres {why}", "squeue job %s on %s: %s", held[0].id if held else "?", self.node, why
                )
            if held is not None:
                for g in held[1]:
                    self._place(g, held[0], by_gpu, by_uuid)
        self._by_gpu = {g: self._row(f"GPU {g}", a) for g, a in by_gpu.items()}
        self._by_uuid = {u: self._row(u, a) for u, a in by_uuid.items()}

    def _row(self, row: str, held: list[Allocation]) -> tuple[Allocation, ...]:
        """One row's holders as the wire carries them: each job once, at most
        ``MAX_ALLOCATIONS`` (the first kept, the rest counted), sharing the row equally (two
        jobs naming one IDX: over-subscribed, or a stale squeue; never more than one GPU)."""
        first: dict[str, Allocation] = {}
        for a in held:
            first.setdefault(a.id, a)
        jobs = list(first.values())
        if len(jobs) > MAX_ALLOCATIONS:
            self._skip(f"many {row}", "%d jobs hold %s on %s, more than the %d a row carries; the first "
                       "%d kept, the rest counted", len(jobs), row, self.node, MAX_ALLOCATIONS, MAX_ALLOCATIONS,
                       n=len(jobs) - MAX_ALLOCATIONS)  # fmt: skip
            jobs = jobs[:MAX_ALLOCATIONS]
        if len(jobs) == 1:
            return tuple(jobs)
        return tuple(a.model_copy(update={"share": 1.0 / len(jobs)}) for a in jobs)

    def _learn_order(self) -> bool:
        """Slurm's IDX order on this node, from its ``gres`` in ``sinfo --json``; False when
        sinfo failed or has not answered yet (the last order is kept) or does not list the node."""
        nodes = self._nodes()
        if nodes is None:
            return self._learnt
        me = next((n for n in nodes if isinstance(n, dict) and n.get("name") == self.node), None)
        if me is None:
            self._skip("sinfo-node", "node %s is not in sinfo: its MIG gres cannot be placed", self.node)
            return False
        self._order = idx_order(self._devices, parse_node_gres(str(me.get("gres") or "")))
        self._learnt = True
        return True

    def _nodes(self) -> list[Any] | None:
        """This refresh's ``sinfo --json`` nodes, asked at most once a refresh, off the tick with
        ``wait_s`` (every Slurm command the attribution runs goes through here or ``_squeue``);
        None when sinfo failed or has not answered yet."""
        if not self._nodes_asked:
            self._nodes_asked = True
            self._nodes_now = (
                self.cli.nodes() if self._sinfo is None else self._take(self._sinfo, self.cli.nodes)
            )
        return self._nodes_now

    def _learn_gpus(self, path: Path) -> None:
        """IDX → NVML index from the node's gres.conf (:func:`~gpuslo.agent.slurm_gres.idx_gpus`);
        what cannot be read keeps the last mapping (before any: IDX = index, said and counted)."""
        try:
            conf = parse_gres_conf(read_regular(path, MAX_GRES_CONF_BYTES).decode(), self.node)
            problems = list(conf.problems)
        except (OSError, UnicodeDecodeError) as exc:
            conf, problems = None, [f"unreadable: {exc}"]
        if conf is not None and not problems and not conf.files and not conf.autodetect:
            problems = [f"configures no GPU with a File= on {self.node}"]
        if conf is None or problems:
            for why in problems:
                self._skip(f"gres.conf {why}", "gres.conf %s: %s; %s", path, why, "the last IDX mapping kept"
                           if self._gpu_at_learnt else "gres IDX read as NVML indices, unverified")  # fmt: skip
            if not self._gpu_at_learnt:
                self.unmapped += 1
            return
        if not conf.files:  # AutoDetect alone: every GPU NVML shows, in NVML's order
            self._gpu_at, self._gpu_at_learnt = None, True
            return
        node_gres: list[tuple[str, int]] = []
        if len({t.lower() for t, _ in conf.files}) > 1:  # typed: slurmctld groups them by the node's Gres=
            nodes = self._nodes()  # off the tick as the MIG order's: on it, a slow slurmctld held every tick
            me = next((n for n in nodes or [] if isinstance(n, dict) and n.get("name") == self.node), None)
            if me is None:  # sinfo failed, late, or without the node: the last mapping kept
                if not self._gpu_at_learnt:
                    self.unmapped += 1
                return
            node_gres = parse_node_gres(str(me.get("gres") or ""))
        gpu_at, said = idx_gpus(conf, self._devices, node_gres)
        for why in said:
            self._skip(f"gres.conf {why}", "gres.conf %s on %s: %s", path, self.node, why)
        self._gpu_at, self._gpu_at_learnt = gpu_at, True

    def _place(self, idx: int, a: Allocation, by_gpu: dict[int, list[Allocation]],
               by_uuid: dict[str, list[Allocation]]) -> None:  # fmt: skip
        if self._order is None and self._gpu_at is not None:
            g = self._gpu_at[idx] if 0 <= idx < len(self._gpu_at) else None
            if g is None:
                self._skip(f"idx {idx}", "job %s holds gres IDX %d, which names no GPU NVML shows on %s (gres.conf "
                           "%s)", a.id, idx, self.node, self.gres_conf)  # fmt: skip
                return
            by_gpu.setdefault(g, []).append(a)
            return
        if self._order is None:
            if self._devices and idx not in self._gpu_indices:  # a gres.conf with more GPUs than NVML shows
                self._skip(f"idx {idx}", "job %s holds gres IDX %d, which is no GPU NVML shows on %s",
                           a.id, idx, self.node)  # fmt: skip
                return
            by_gpu.setdefault(idx, []).append(a)
            return
        d = self._order[idx] if 0 <= idx < len(self._order) else None
        if d is None:
            self._skip(f"idx {idx}", "job %s holds gres IDX %d, which is no GPU or MIG instance NVML shows on %s",
                       a.id, idx, self.node)  # fmt: skip
        elif d.gi is None:
            by_gpu.setdefault(d.index, []).append(a)
        else:
            by_uuid.setdefault(d.uuid, []).append(a)

    def _from_mapping_dir(
        self, d: Path
    ) -> tuple[dict[int, tuple[Allocation, ...]], dict[str, tuple[Allocation, ...]]]:
        by_gpu: dict[int, tuple[Allocation, ...]] = {}
        by_uuid: dict[str, tuple[Allocation, ...]] = {}
        try:
            entries = list(d.iterdir())
        except OSError as exc:
            log.warning("HPC job mapping dir %s: %s", d, exc)
            return by_gpu, by_uuid
        mig_gpus = {x.index for x in self._devices if x.gi is not None}
        for p in entries:
            try:
                gpu, gi = parse_mapping_name(p.name)
            except ValueError as exc:
                self._skip(f"name {p.name}", "HPC job mapping file %r skipped: %s", p.name[:80], exc)
                continue
            try:  # a FIFO by a GPU's name would block the tick, a link to /dev/zero fill memory
                text = read_regular(p, MAX_MAPPING_BYTES).decode()
            except (OSError, UnicodeDecodeError) as exc:
                if isinstance(exc, NotARegularFile) and p.is_dir():
                    continue
                self._skip(f"read {p.name}", "HPC job mapping file %r unreadable: %s", p.name, exc)
                continue
            ids = list(dict.fromkeys(line.strip()[:256] for line in text.splitlines() if line.strip()))
            if not ids:
                continue
            if len(ids) > MAX_ALLOCATIONS:  # a row carries so many holders, or the batch is refused
                self._skip(f"many {p.name}", "HPC job mapping file %r lists %d jobs, more than the %d a GPU row "
                           "carries; the first %d kept, the rest counted", p.name, len(ids), MAX_ALLOCATIONS,
                           MAX_ALLOCATIONS, n=len(ids) - MAX_ALLOCATIONS)  # fmt: skip
                ids = ids[:MAX_ALLOCATIONS]  # as squeue's jobs are (see _row): the same rule either way
            held = tuple(Allocation(scheduler="slurm", id=i, share=1.0 / len(ids)) for i in ids)
            if gi is None:
                if gpu in mig_gpus:
                    self._skip(f"whole {gpu}", "HPC job mapping file %r names GPU %d, which is in MIG mode: its "
                               "instances are named %d.<GPU instance id>; not attributed", p.name, gpu, gpu)  # fmt: skip
                by_gpu[gpu] = held
                continue
            rows = [x for x in self._devices if x.index == gpu and x.gi == gi]
            if not rows:
                self._skip(
                    f"name {p.name}", "HPC job mapping file %r names no MIG instance on this node", p.name
                )
            for x in rows:  # the compute instances of one GPU instance share its file
                by_uuid[x.uuid] = held
        return by_gpu, by_uuid

    def __call__(self, index: int, uuid: str) -> tuple[Allocation, ...]:
        if uuid in self._mig_rows:
            return self._by_uuid.get(uuid, ())
        return self._by_gpu.get(index, ())


class SlurmNodeSource(Source):
    """This node's heartbeat with its scheduler state (drained, down → not schedulable), and
    the learner of its pool (its partitions): one ``sinfo --json`` per tick serves both,
    asked by whichever needs it first in the tick (the heartbeat, or a GPU source reading
    the pool)."""

    name = "slurm-node"

    def __init__(self, node: str, cluster: str, interval_s: float, gpus: int, cli: SlurmCli | None = None,
                 boot_id: str | None = None, pool: NodePool | None = None,
                 wait_s: float | None = None, stop: threading.Event | None = None) -> None:  # fmt: skip
        self.node, self.cluster, self.interval_s, self.gpus = node, cluster, interval_s, gpus
        self.pool = pool or NodePool()
        self.pool.attach(self.learn_pool)
        self.cli = cli or SlurmCli()
        # with wait_s, sinfo runs off the tick (agent.inflight): a late answer leaves the last
        # one standing (the node's state as last known), an answer that failed sends no heartbeat
        self._inflight: InFlight[list[Any] | None] | None = (
            None
            if wait_s is None
            else InFlight(
                f"sinfo --json (node {node}'s state)", wait_s, "gpuslo-sinfo", first_whole=True, stop=stop
            )
        )
        self.seq = Sequencer(node, boot_id or uuidlib.uuid4().hex[:12])
        self._asked: float | None = None  # the tick of the last sinfo
        self._me: dict[str, Any] | None = None  # this node in that answer (None: no answer)
        self._missing = False  # the last answer did not list this node (said once)

    def sinfo(self, now: float) -> dict[str, Any] | None:
        """This node as ``sinfo --json`` had it for the tick at ``now`` (asked once per tick);
        None when sinfo failed or does not list the node."""
        if now != self._asked:
            self._asked = now
            self._me = self._ask()
        return self._me

    @property
    def slow(self) -> int:
        """Ticks whose sinfo had not answered within wait_s (the last answer stood)."""
        return 0 if self._inflight is None else self._inflight.slow

    def _ask(self) -> dict[str, Any] | None:
        if self._inflight is None:
            nodes = self.cli.nodes()
        else:
            came, nodes = self._inflight.take(self.cli.nodes)
            if not came:
                return self._me  # the last answer stands
        if nodes is None:
            return None
        me = next((n for n in nodes if isinstance(n, dict) and n.get("name") == self.node), None)
        if me is None and not self._missing:  # said once while it lasts, not at every tick
            log.warning("node %s is not in sinfo: no heartbeat is sent until it is (is --node the name "
                        "Slurm knows it by?)", self.node)  # fmt: skip
        self._missing = me is None
        return me

    def learn_pool(self, now: float) -> None:
        """The pool's learner: this node's partitions in the tick's sinfo (kept without one)."""
        me = self.sinfo(now)
        if me is not None:
            parts = me.get("partitions")
            self.pool.learn(join_partitions(parts if isinstance(parts, list) else []), "sinfo")

    def collect(self, now: float) -> list[Message]:
        me = self.sinfo(now)
        if me is None:
            return []
        pool = self.pool.at(now)  # learnt from this tick's sinfo, whoever asked first
        flags = {str(f).upper() for f in me.get("state_flags") or []}
        state = str(me.get("state") or "").upper()
        schedulable = state not in _NOT_SCHEDULABLE and not (flags & _NOT_SCHEDULABLE)
        label = "+".join([state.lower(), *sorted(f.lower() for f in flags)])
        return [NodeHeartbeat(source=self.seq.source, boot_id=self.seq.boot_id, seq=self.seq.next(), cluster=self.cluster,
                              ts=now, node=self.node, pool=pool, interval_s=self.interval_s,
                              schedulable=schedulable, state=label[:256], reason=str(me.get("reason") or "")[:256],
                              gpus=self.gpus)]  # fmt: skip


@dataclass
class _Seen:
    emitted: list[str] = field(default_factory=list)  # event names already sent
    reason: str = ""
    started: bool = False
    last_seen: float = 0.0
    # the job as last seen, so that one that leaves the queue unobserved still ends with its
    # name, owner and size
    job: dict[str, Any] = field(default_factory=dict)
    # the job's run being followed: 1 + Slurm's restart_cnt (a requeued job waits again, as a new
    # request ``ID#2``, ``#3``...; Kueue's evicted Workloads are named alike)
    attempt: int = 1


_KEEP = (
    "name",
    "user_name",
    "account",
    "partition",
    "node_count",
    "tasks",
    "sockets_per_node",
    "tres_per_node",
    "tres_per_job",
    "tres_per_task",
    "tres_per_socket",
)


def request_id(jid: str, attempt: int) -> str:
    """The request a job's ``attempt`` is: the job id for its first run, ``ID#N`` for the wait
    after its (N-1)th requeue."""
    return jid if attempt <= 1 else f"{jid}#{attempt}"


def restarts(job: dict[str, Any]) -> int:
    """How often Slurm requeued the job (``restart_cnt``; 0 when unset); :class:`Malformed` for
    no count."""
    n = _number(job.get("restart_cnt"), "restart_cnt")
    if n is None:
        return 0
    if n != int(n) or not 0 <= n <= MAX_RESTARTS:
        raise Malformed(f"restart_cnt {n:g} is no count of requeues (0..{MAX_RESTARTS})")
    return int(n)


# Slurm's restart_cnt is a uint16
MAX_RESTARTS = 65_535
# a job id whose every request (``ID#65536`` at most) the wire's request_id holds: Slurm writes
# ten digits and an array or het suffix; a longer one is refused at its first sighting (it was
# followed until its first requeue, whose events the wire refused: its run never ended)
MAX_JOB_ID_CHARS = NAME_MAX - len(request_id("", MAX_RESTARTS + 1))


def _who(job: dict[str, Any], attempt: int = 1) -> dict[str, Any]:
    """The fields of a job's events that say who and what it is (from the job, or from its
    ``_KEEP`` fields kept in the state file), for its ``attempt``; :class:`Malformed` for one the
    wire cannot carry."""
    part = _text(job.get("partition"), "partition")
    gpus, nodes = gpu_shape(job)
    return dict(request_id=request_id(job_id(job), attempt), name=_text(job.get("name"), "name"), user=_text(job.get("user_name"),
                "user_name"), account=_text(job.get("account"), "account"), queue=part, pool=part,
                gpus_per_node=gpus, nodes=nodes)  # fmt: skip


@dataclass(frozen=True)
class _Job:
    """What the collector reads from one job of ``squeue --json``."""

    raw: dict[str, Any]
    who: dict[str, Any]
    state: str
    submit: float  # Unix seconds; 0: unknown (the latest requeue's time once requeued)
    start: float
    end: float
    reason: str
    attempt: int  # 1 + restart_cnt
    id: str  # the job id (its requests: :func:`request_id`)


def _read_job(job: Any) -> _Job:
    """One job of ``squeue --json`` (Slurm 22.05's plain numbers and state, or 23.02+'s number
    objects and state lists); :class:`Malformed` names what is wrong."""
    if not isinstance(job, dict):
        raise Malformed(f"the job is a {type(job).__name__}, not an object")
    attempt, state, jid = 1 + restarts(job), job_state(job.get("job_state")), job_id(job)
    if len(jid) > MAX_JOB_ID_CHARS:  # its first run's events would go, and a requeue's never
        raise Malformed(f"job_id {jid[:50]!r}... is {len(jid)} characters, more than the {MAX_JOB_ID_CHARS} whose "
                        f"requests ({request_id('ID', MAX_RESTARTS + 1)}) the wire carries")  # fmt: skip
    ran, ended = state in _HELD or state in _ENDED, state in _ENDED  # else its start and end are estimates
    return _Job(raw=job, who=_who(job, attempt), state=state, attempt=attempt, id=jid,
                submit=_time(job.get("submit_time"), "submit_time"),
                start=_time(job.get("start_time"), "start_time", estimate=not ran),
                end=_time(job.get("end_time"), "end_time", estimate=not ended),
                reason=_text(job.get("state_reason"), "state_reason"))  # fmt: skip


class SlurmEventCollector(Source):
    """Cluster-level (one per cluster): polls ``squeue --json`` and turns job states into
    submit / pending_reason / start / end / cancel / preempt events at Slurm's own times.

    What was emitted is kept in ``state_file`` (replaced atomically), so a restarted
    collector does not send an event twice; and should it, the event's natural key
    (cluster, request, event, time) makes the store keep one.

    A job it cannot read (a value of a type or range Slurm does not write, or the wire cannot
    carry) is skipped and counted (``skipped``; logged once per job), its record and every
    other job's events untouched: a job's events are marked sent only with the events
    returned, so the job is read again at the next tick."""

    name = "slurm-events"

    def __init__(self, cluster: str, state_file: Path, cli: SlurmCli | None = None, source: str = "slurm-collector",
                 boot_id: str | None = None) -> None:  # fmt: skip
        self.cluster = cluster
        self.cli = cli or SlurmCli()
        self.state_file = state_file
        self.seq = Sequencer(source, boot_id or uuidlib.uuid4().hex[:12])
        self.skipped = 0  # job sightings (or a gone job's end) that could not be read or sent
        self.save_failures = 0  # ticks whose state file could not be written (their events still sent)
        self._logged: set[str] = set()
        self.jobs: dict[str, _Seen] = self._load()

    def _load(self) -> dict[str, _Seen]:
        try:
            raw = json.loads(self.state_file.read_text())
            return state_records(raw, _Seen)
        except FileNotFoundError:
            return {}
        except UNREADABLE_STATE as exc:  # its own file never stops it
            log.warning("slurm collector state %s unreadable (%s); starting afresh", self.state_file, exc)
            return {}

    def _save(self) -> None:
        try:
            replace_file(self.state_file, json.dumps({k: v.__dict__ for k, v in self.jobs.items()}).encode())
        except OSError as exc:  # full disk: the tick's events still go (the store keeps one of a resend)
            self.save_failures += 1
            if self.save_failures == 1:
                log.warning("slurm collector state %s not written: %s (further failures counted)",
                            self.state_file, exc)  # fmt: skip

    def counts(self) -> dict[str, float]:
        """Counters for the agent's ``/metrics``: job sightings skipped, state files not written,
        squeue calls that failed (no event that tick, no job ended)."""
        return {
            "gpuslo_slurm_skipped_jobs": self.skipped,
            "gpuslo_slurm_state_save_failures": self.save_failures,
            "gpuslo_slurm_command_failures": self.cli.failures,
        }

    def _skip(self, jid: str, exc: Exception) -> None:
        self.skipped += 1
        if jid not in self._logged and len(self._logged) < _LOGGED_MAX:
            self._logged.add(jid)
            log.warning("squeue job %s skipped: %s (logged once per job; counted)", jid, _reason(exc))

    def _event(self, who: dict[str, Any], event: str, ts: float, reason: str = "",
               hosts: Sequence[str] = ()) -> SchedulerEvent:  # fmt: skip
        return SchedulerEvent(
            source=self.seq.source, boot_id=self.seq.boot_id, seq=self.seq.next(), cluster=self.cluster,
            ts=ts, scheduler="slurm", event=event, reason=reason[:256],  # type: ignore[arg-type]
            assigned_nodes=tuple(h for h in hosts if h), **who,
        )  # fmt: skip

    def collect(self, now: float) -> list[Message]:
        jobs = self.cli.jobs()
        if jobs is None:
            return []
        out: list[Message] = []
        present = set()
        for raw in jobs:
            try:
                job = _read_job(raw)
            except Malformed as exc:
                jid = "?"
                if isinstance(raw, dict):
                    try:
                        jid = job_id(raw)
                        present.add(jid)  # still queued: its record (and end) kept
                    except Malformed:
                        pass
                self._skip(jid, exc)
                continue
            present.add(job.id)
            old = self.jobs.get(job.id) or _Seen()
            seen = _Seen(emitted=list(old.emitted), reason=old.reason, started=old.started, last_seen=now,
                         job={k: job.raw[k] for k in _KEEP if k in job.raw}, attempt=old.attempt)  # fmt: skip
            try:
                events = self._follow(job, seen, now)
            except (Malformed, ValidationError) as exc:  # nothing of it sent: nothing marked sent
                self._skip(job.id, exc)
                continue
            self.jobs[job.id] = seen
            out += events
        for jid, seen in list(self.jobs.items()):
            if jid not in present:
                done = any(e in seen.emitted for e in ("end", "cancel", "preempt"))
                # left squeue unobserved (collector down past MinJobAge); nothing to end where nothing
                # was sent (seen only in a requeue's passage)
                if not done and seen.emitted:
                    # ended, cancelled or never seen running: we cannot tell, so "end" at its last sighting
                    try:
                        who = _who({**seen.job, "job_id": jid}, seen.attempt)
                        out.append(self._event(who, "end", seen.last_seen, "UNOBSERVED"))
                    except (Malformed, ValidationError) as exc:  # a record it cannot send: forgotten
                        self._skip(jid, exc)
                    else:
                        log.info(
                            "job %s left the queue unobserved; recording its end at its last sighting", jid
                        )
                del self.jobs[jid]
        self._save()
        return out

    def _requeued(self, job: _Job, seen: _Seen, now: float) -> list[Message]:
        """Slurm requeued the job (node failure, preemption with ``PreemptMode=REQUEUE``, ``scontrol
        requeue``): the run followed so far ends at the requeue (Slurm's new ``submit_time``), as a
        ``preempt`` if it was seen running, else an ``end`` (it may have run unseen, or failed to
        launch), both with reason ``REQUEUED``; the wait after it is a new request (``ID#N``),
        submitted then. A job first seen after requeues starts at its current attempt."""
        out: list[Message] = []
        if seen.emitted and not any(e in seen.emitted for e in ("end", "cancel", "preempt")):
            kind = "preempt" if seen.started else "end"
            out.append(self._event(_who(job.raw, seen.attempt), kind, job.submit or now, "REQUEUED"))
        seen.attempt, seen.emitted, seen.reason, seen.started = job.attempt, [], "", False
        return out

    def _follow(self, job: _Job, seen: _Seen, now: float) -> list[Message]:
        """The job's events since ``seen`` (which it updates)."""
        out: list[Message] = []
        state = job.state
        if job.attempt > seen.attempt:
            if state not in _REQUEUE_SETTLED or state == "COMPLETING":
                # requeued but not back in the queue yet (its last run cleaning up, REQUEUE_HOLD,
                # SPECIAL_EXIT): Slurm writes the requeue's time as submit_time when it is. (A job
                # first seen completing its second run cannot be told from this, and is not sent.)
                return out
            out += self._requeued(job, seen, now)
        # the attempt followed (a restart_cnt that fell, which Slurm never writes, changes nothing)
        who = (
            job.who
            if job.attempt == seen.attempt
            else {**job.who, "request_id": request_id(job.id, seen.attempt)}
        )
        if "submit" not in seen.emitted:
            out.append(self._event(who, "submit", job.submit or now))
            seen.emitted.append("submit")
        if state == "PENDING":
            if job.reason != seen.reason:
                out.append(self._event(who, "pending_reason", now, job.reason))
                seen.reason = job.reason
            return out
        start, end = job.start, job.end
        ran = state in _HELD or (state in _ENDED and start > 0 and end > start)
        if ran and "start" not in seen.emitted:
            hosts = job_hosts(job.raw)
            out.append(self._event(who, "start", start or now, hosts=hosts[:MAX_ASSIGNED_NODES]))
            seen.emitted.append("start")
            seen.started = True
        if state in _ENDED and not any(e in seen.emitted for e in ("end", "cancel", "preempt")):
            if state == "CANCELLED" and not seen.started:
                kind = "cancel"
            elif state == "PREEMPTED":
                kind = "preempt"
            else:
                kind = "end"
            out.append(self._event(who, kind, end or now, state))
            seen.emitted.append(kind)
        return out

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
import re
import subprocess
import uuid as uuidlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslo.agent.base import Device, Sequencer, Source
from gpuslo.agent.pool import NodePool, join_partitions
from gpuslo.agent.slurm_gres import idx_order, parse_mapping_name, parse_node_gres
from gpuslo.core.fileio import UNREADABLE_STATE, replace_file, state_records
from gpuslo.wire import Allocation, Message, NodeHeartbeat, SchedulerEvent
from gpuslo.wire.bounds import MAX_ALLOCATIONS

log = logging.getLogger(__name__)

Run = Callable[[Sequence[str]], str]

_IDX = re.compile(r"IDX:([0-9,\-]+)")
_TRES_GPU = re.compile(r"gres[:/]gpu(?::[^:,]+)?[:=](\d+)")
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


# no node has more GPU gres than this (MIG: 7 per GPU on the wire's 1024 GPUs); an IDX past it
# is refused rather than expanded (a hostile ``IDX:0-99999999999`` must not build a huge list)
MAX_IDX = 8192


def parse_idx(gres_detail: str) -> list[int]:
    """``gpu:2(IDX:0-1)``, ``gpu:a100:3(IDX:0,2-3)``, ``gpu:1g.10gb:1(IDX:4),gpu:h100:1(IDX:0)``
    → gres indices (IDX past ``MAX_IDX``, reversed ranges and unreadable parts are left out,
    logged)."""
    out: list[int] = []
    parts = [part for m in _IDX.finditer(gres_detail) for part in m.group(1).split(",")]
    for part in parts:  # every type's (IDX:...): gpu:1g.10gb:1(IDX:4),gpu:h100:1(IDX:0)
        a, dash, b = part.partition("-")
        if not a.isdigit() or not (b.isdigit() or not dash) or len(a) > 5 or len(b) > 5:
            if part:
                log.warning("gres %r: IDX part %r unreadable; left out", gres_detail[:200], part[:50])
            continue
        lo, hi = int(a), int(b or a)
        if hi > MAX_IDX or hi < lo:
            log.warning("gres %r: IDX %s out of range; left out", gres_detail[:200], part)
            continue
        out += range(lo, hi + 1)
    return out


def gpus_per_node(job: dict[str, Any]) -> float:
    m = _TRES_GPU.search(str(job.get("tres_per_node") or ""))
    return float(m.group(1)) if m else 0.0


def expand_hostlist(text: str) -> list[str]:
    """``node[01-03,07],gpu9`` → names (Slurm's hostlist syntax, one bracket level)."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", text):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            out.append(prefix)
            continue
        for r in ranges.split(","):
            if "-" in r:
                a, b = r.split("-", 1)
                out += [f"{prefix}{i:0{len(a)}d}" for i in range(int(a), int(b) + 1)]
            else:
                out.append(prefix + r)
    return [x for x in out if x]


class SlurmCli:
    """Runs Slurm's commands. ``SLURM_CONF`` and the rest come from the environment."""

    def __init__(self, run: Run | None = None, timeout_s: float = 15.0) -> None:
        self.timeout_s = timeout_s
        self._run = run or self._subprocess
        self.failures = 0
        self._logged: set[str] = set()

    def _subprocess(self, argv: Sequence[str]) -> str:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=self.timeout_s, check=True
        ).stdout

    def json(self, *argv: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self._run(argv))
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            self.failures += 1
            key = f"{argv[0]} {type(exc).__name__}"
            if key not in self._logged:
                self._logged.add(key)
                detail = getattr(exc, "stderr", "") or exc
                log.warning("%s failed: %s (logged once; counted)", " ".join(argv), str(detail).strip()[:300])
            return None
        if not isinstance(data, dict):
            return None
        for err in data.get("errors") or []:
            log.warning("%s reported: %s", argv[0], err)
        return data

    def jobs(self) -> list[dict[str, Any]] | None:
        d = self.json("squeue", "--json")
        return None if d is None else list(d.get("jobs") or [])

    def nodes(self) -> list[dict[str, Any]] | None:
        d = self.json("sinfo", "--json")
        return None if d is None else list(d.get("nodes") or [])


def _allocation(job: dict[str, Any]) -> Allocation:
    return Allocation(
        scheduler="slurm",
        id=str(job["job_id"]),
        name=str(job.get("name") or "")[:256],
        user=str(job.get("user_name") or "")[:256],
        account=str(job.get("account") or "")[:256],
        queue=str(job.get("partition") or "")[:256],
        share=1.0,
    )


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
    job ids. Without MIG, IDX is the GPU index, as it always was."""

    def __init__(self, node: str, cli: SlurmCli | None = None, mapping_dir: Path | None = None) -> None:
        self.node = node
        self.cli = cli or SlurmCli()
        self.mapping_dir = mapping_dir
        self._by_gpu: dict[int, tuple[Allocation, ...]] = {}
        self._by_uuid: dict[str, tuple[Allocation, ...]] = {}  # MIG instance rows
        self._devices: list[Device] = []
        self._mig_rows: set[str] = set()
        self._order: list[Device | None] | None = None  # Slurm's IDX → device; None: IDX = GPU index
        self._learnt = False  # the order was learnt from one sinfo answer at least
        self._logged: set[str] = set()
        self.skipped = 0  # mapping files and gres indices that name no row (each kind logged once)

    def bind(self, devices: Sequence[Device]) -> None:
        self._devices = list(devices)
        self._mig_rows = {d.uuid for d in devices if d.gi is not None}

    def _skip(self, key: str, msg: str, *args: object) -> None:
        self.skipped += 1
        if key not in self._logged:
            self._logged.add(key)
            text = msg % args
            log.warning("%s (logged once; counted)", text)

    def refresh(self) -> None:
        if self.mapping_dir is not None:
            self._by_gpu, self._by_uuid = self._from_mapping_dir(self.mapping_dir)
            return
        if any(d.gi is not None for d in self._devices) and not self._learn_order():
            return  # the node's gres unknown: keep the last mapping rather than misplace jobs
        jobs = self.cli.jobs()
        if jobs is None:
            return  # keep the last known mapping rather than report GPUs as free
        by_gpu: dict[int, list[Allocation]] = {}
        by_uuid: dict[str, list[Allocation]] = {}
        for job in jobs:
            if job.get("job_state") not in ("RUNNING", "COMPLETING", "SUSPENDED"):
                continue
            hosts = [n.get("nodename") for n in (job.get("job_resources") or {}).get("allocated_nodes") or []]
            if not hosts:
                hosts = expand_hostlist(str(job.get("nodes") or ""))
            details = job.get("gres_detail") or []
            for i, host in enumerate(hosts):
                if host == self.node and i < len(details):
                    for g in parse_idx(str(details[i])):
                        self._place(g, _allocation(job), by_gpu, by_uuid)
        self._by_gpu = {g: tuple(a) for g, a in by_gpu.items()}
        self._by_uuid = {u: tuple(a) for u, a in by_uuid.items()}

    def _learn_order(self) -> bool:
        """Slurm's IDX order on this node, from its ``gres`` in ``sinfo --json``; False when
        sinfo failed (the last order is kept) or does not list the node."""
        nodes = self.cli.nodes()
        if nodes is None:
            return self._learnt
        me = next((n for n in nodes if n.get("name") == self.node), None)
        if me is None:
            self._skip("sinfo-node", "node %s is not in sinfo: its MIG gres cannot be placed", self.node)
            return False
        self._order = idx_order(self._devices, parse_node_gres(str(me.get("gres") or "")))
        self._learnt = True
        return True

    def _place(self, idx: int, a: Allocation, by_gpu: dict[int, list[Allocation]],
               by_uuid: dict[str, list[Allocation]]) -> None:  # fmt: skip
        if self._order is None:
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
            try:
                ids = [line.strip() for line in p.read_text().splitlines() if line.strip()]
            except IsADirectoryError:
                continue
            except (OSError, UnicodeDecodeError) as exc:
                self._skip(f"read {p.name}", "HPC job mapping file %r unreadable: %s", p.name, exc)
                continue
            if not ids:
                continue
            if len(ids) > MAX_ALLOCATIONS:  # a row carries so many holders, or the batch is refused
                self._skip(f"many {p.name}", "HPC job mapping file %r lists %d jobs, more than the %d a GPU row "
                           "carries; skipped", p.name, len(ids), MAX_ALLOCATIONS)  # fmt: skip
                continue
            held = tuple(Allocation(scheduler="slurm", id=i[:256], share=1.0 / len(ids)) for i in ids)
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
                 boot_id: str | None = None, pool: NodePool | None = None) -> None:  # fmt: skip
        self.node, self.cluster, self.interval_s, self.gpus = node, cluster, interval_s, gpus
        self.pool = pool or NodePool()
        self.pool.attach(self.learn_pool)
        self.cli = cli or SlurmCli()
        self.seq = Sequencer(node, boot_id or uuidlib.uuid4().hex[:12])
        self._asked: float | None = None  # the tick of the last sinfo
        self._me: dict[str, Any] | None = None  # this node in that answer (None: no answer)

    def sinfo(self, now: float) -> dict[str, Any] | None:
        """This node as ``sinfo --json`` had it for the tick at ``now`` (asked once per tick);
        None when sinfo failed or does not list the node."""
        if now != self._asked:
            self._asked = now
            self._me = self._ask()
        return self._me

    def _ask(self) -> dict[str, Any] | None:
        nodes = self.cli.nodes()
        if nodes is None:
            return None
        me = next((n for n in nodes if n.get("name") == self.node), None)
        if me is None:
            log.warning("node %s is not in sinfo", self.node)
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


_KEEP = ("name", "user_name", "account", "partition", "node_count", "tres_per_node")


class SlurmEventCollector(Source):
    """Cluster-level (one per cluster): polls ``squeue --json`` and turns job states into
    submit / pending_reason / start / end / cancel / preempt events at Slurm's own times.

    What was emitted is kept in ``state_file`` (replaced atomically), so a restarted
    collector does not send an event twice; and should it, the event's natural key
    (cluster, request, event, time) makes the store keep one."""

    name = "slurm-events"

    def __init__(self, cluster: str, state_file: Path, cli: SlurmCli | None = None, source: str = "slurm-collector",
                 boot_id: str | None = None) -> None:  # fmt: skip
        self.cluster = cluster
        self.cli = cli or SlurmCli()
        self.state_file = state_file
        self.seq = Sequencer(source, boot_id or uuidlib.uuid4().hex[:12])
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
        replace_file(self.state_file, json.dumps({k: v.__dict__ for k, v in self.jobs.items()}).encode())

    def _event(self, job: dict[str, Any], event: str, ts: float, reason: str = "") -> SchedulerEvent:
        hosts = [n.get("nodename") for n in (job.get("job_resources") or {}).get("allocated_nodes") or []]
        return SchedulerEvent(
            source=self.seq.source, boot_id=self.seq.boot_id, seq=self.seq.next(), cluster=self.cluster,
            ts=ts, scheduler="slurm", event=event, request_id=str(job["job_id"]),  # type: ignore[arg-type]
            name=str(job.get("name") or "")[:256], user=str(job.get("user_name") or "")[:256],
            account=str(job.get("account") or "")[:256], queue=str(job.get("partition") or "")[:256],
            pool=str(job.get("partition") or "")[:256], gpus_per_node=gpus_per_node(job),
            nodes=max(1, int(job.get("node_count") or 1)), reason=reason[:256],
            assigned_nodes=tuple(str(h) for h in hosts if h) if event == "start" else (),
        )  # fmt: skip

    def collect(self, now: float) -> list[Message]:
        jobs = self.cli.jobs()
        if jobs is None:
            return []
        out: list[Message] = []
        present = set()
        for job in jobs:
            jid = str(job["job_id"])
            present.add(jid)
            seen = self.jobs.setdefault(jid, _Seen())
            seen.last_seen = now
            seen.job = {k: job[k] for k in _KEEP if k in job}
            state = str(job.get("job_state") or "")
            submit = float(job.get("submit_time") or now)
            start = float(job.get("start_time") or 0)
            end = float(job.get("end_time") or 0)
            if "submit" not in seen.emitted:
                out.append(self._event(job, "submit", submit))
                seen.emitted.append("submit")
            if state == "PENDING":
                reason = str(job.get("state_reason") or "")
                if reason != seen.reason:
                    out.append(self._event(job, "pending_reason", now, reason))
                    seen.reason = reason
                continue
            ran = state in ("RUNNING", "COMPLETING", "SUSPENDED") or (
                state in _ENDED and start > 0 and end > start
            )
            if ran and "start" not in seen.emitted:
                out.append(self._event(job, "start", start or now))
                seen.emitted.append("start")
                seen.started = True
            if state in _ENDED and not any(e in seen.emitted for e in ("end", "cancel", "preempt")):
                if state == "CANCELLED" and not seen.started:
                    kind = "cancel"
                elif state == "PREEMPTED":
                    kind = "preempt"
                else:
                    kind = "end"
                out.append(self._event(job, kind, end or now, state))
                seen.emitted.append(kind)
        for jid, seen in list(self.jobs.items()):
            if jid not in present:
                done = any(e in seen.emitted for e in ("end", "cancel", "preempt"))
                if not done:  # left squeue unobserved (collector down past MinJobAge)
                    log.info("job %s left the queue unobserved; recording its end at its last sighting", jid)
                    # ended, cancelled or never seen running: we cannot tell, so "end" at its last sighting
                    out.append(self._event({"job_id": jid, **seen.job}, "end", seen.last_seen, "UNOBSERVED"))
                del self.jobs[jid]
        self._save()
        return out

"""Decoded messages → one columnar insert per table."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuslo.wire import (
    FIELDS,
    GpuSampleBatch,
    HealthEvent,
    LatencyDelta,
    Message,
    NodeHeartbeat,
    SchedulerEvent,
    activity,
)
from ingest.store import Store

Columns = dict[str, list[Any]]


@dataclass(frozen=True, slots=True)
class Raw:
    """One message as received: its bytes and where it came from."""

    origin: str  # "topic/partition/offset", "file:line", "bus:topic:n"
    value: bytes
    topic: str = ""
    partition: int = -1
    offset: int = -1


_FIELD_NAMES = tuple(f.name for f in FIELDS)


def _env(c: Columns, m: Message) -> None:
    c["source"].append(m.source)
    c["boot_id"].append(m.boot_id)
    c["seq"].append(m.seq)


def to_columns(msgs: Iterable[Message]) -> dict[str, Columns]:
    """Group messages by table, as columns. Pure: no I/O, easy to test."""
    out: dict[str, Columns] = defaultdict(lambda: defaultdict(list))
    for m in msgs:
        if isinstance(m, GpuSampleBatch):
            c = out["gpu_samples"]
            for g in m.gpus:
                c["cluster"].append(m.cluster)
                c["node"].append(m.node)
                c["pool"].append(m.pool)
                c["gpu"].append(g.index)
                c["uuid"].append(g.uuid)
                c["model"].append(g.model)
                c["ts"].append(m.ts)
                c["interval_s"].append(m.interval_s)
                c["healthy"].append(1 if g.healthy else 0)
                c["activity"].append(activity(g.fields))
                a = g.allocations
                c["alloc_share"].append(min(1.0, sum(x.share for x in a)))
                c["alloc_schedulers"].append([x.scheduler for x in a])
                c["alloc_ids"].append([x.id for x in a])
                c["alloc_names"].append([x.name for x in a])
                c["alloc_users"].append([x.user for x in a])
                c["alloc_accounts"].append([x.account for x in a])
                c["alloc_queues"].append([x.queue for x in a])
                c["alloc_shares"].append([x.share for x in a])
                f = g.fields
                for name in _FIELD_NAMES:
                    c[name].append(f.get(name))
                _env(c, m)
        elif isinstance(m, NodeHeartbeat):
            c = out["node_heartbeats"]
            for k in ("cluster", "node", "pool", "ts", "interval_s", "state", "reason", "gpus"):
                c[k].append(getattr(m, k))
            c["schedulable"].append(1 if m.schedulable else 0)
            _env(c, m)
        elif isinstance(m, SchedulerEvent):
            c = out["sched_events"]
            for k in (
                "cluster",
                "scheduler",
                "event",
                "request_id",
                "ts",
                "name",
                "user",
                "account",
                "queue",
                "pool",
                "gpus_per_node",
                "nodes",
                "reason",
            ):
                c[k].append(getattr(m, k))
            c["assigned_nodes"].append(list(m.assigned_nodes))
            _env(c, m)
        elif isinstance(m, LatencyDelta):
            c = out["latency"]
            for k in ("cluster", "service", "ts", "interval_s", "sum_ms"):
                c[k].append(getattr(m, k))
            c["bounds_ms"].append(list(m.bounds_ms))
            c["counts"].append(list(m.counts))
            c["total"].append(sum(m.counts))
            _env(c, m)
        elif isinstance(m, HealthEvent):
            c = out["health_events"]
            for k in ("cluster", "node", "gpu", "uuid", "ts", "event", "code", "message"):
                c[k].append(getattr(m, k))
            c["fatal"].append(1 if m.fatal else 0)
            _env(c, m)
    return {t: dict(c) for t, c in out.items()}


def write(store: Store, msgs: Iterable[Message]) -> dict[str, int]:
    """One insert per table; returns rows written per table."""
    return {table: store.insert(table, cols) for table, cols in to_columns(msgs).items()}


def dead_letter(store: Store, items: Iterable[tuple[float, Raw, str]]) -> int:
    """(received_at, raw message, reason) rows into ``dead_letters``."""
    cols: Columns = {
        k: [] for k in ("received_at", "origin", "topic", "partition", "offset", "reason", "raw")
    }
    for received, raw, reason in items:
        cols["received_at"].append(received)
        cols["origin"].append(raw.origin)
        cols["topic"].append(raw.topic)
        cols["partition"].append(raw.partition)
        cols["offset"].append(raw.offset)
        cols["reason"].append(reason)
        cols["raw"].append(raw.value)
    return store.insert("dead_letters", cols)

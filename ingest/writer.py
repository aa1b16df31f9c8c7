"""Decoded messages → one columnar insert per table."""

from __future__ import annotations

import functools
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from gpuslo.ingest.schema import column_types
from gpuslo.ingest.store import Store, arrow_type
from gpuslo.wire import (
    FIELDS,
    Allocation,
    GpuSampleBatch,
    HealthEvent,
    LatencyDelta,
    Message,
    NodeHeartbeat,
    SchedulerEvent,
    activity,
)

Columns = dict[str, list[Any]]


@dataclass(frozen=True, slots=True)
class Raw:
    """One message as received: its bytes and where it came from."""

    origin: str  # "topic/partition/offset", "file:line", "bus:topic:n"
    value: bytes
    topic: str = ""
    partition: int = -1
    offset: int = -1
    refused: str = ""  # set by the reader when it refuses the message itself (e.g. too long)
    # the digest of the message's JSON (gpuslo.wire.pack.digest); 0: of ``value``. A batch of a
    # pack carries its own (the pack's bytes are not its JSON's)
    digest: int = 0


_FIELD_NAMES = tuple(f.name for f in FIELDS)


def _env(c: Columns, m: Message) -> None:
    c["source"].append(m.source)
    c["boot_id"].append(m.boot_id)
    c["seq"].append(m.seq)


_GPU_COLS = ("cluster", "node", "pool", "gpu", "uuid", "model", "ts", "interval_s", "healthy", "activity",
             "source", "boot_id", "seq", "alloc_share", "gpu_fraction", "mig_gi", "mig_ci", "mig_profile")  # fmt: skip
_ALLOC_COLS = ("alloc_schedulers", "alloc_ids", "alloc_names", "alloc_users", "alloc_accounts", "alloc_queues",
               "alloc_shares", "alloc_act_shares", "alloc_fb_shares", "alloc_share_sources")  # fmt: skip
_FIELD_SCHEMA = pa.schema([(name, pa.float64()) for name in _FIELD_NAMES])


def _alloc_row(x: Allocation) -> tuple[Any, ...]:
    """One holder's elements of the _ALLOC_COLS arrays (an unmeasured split is its share)."""
    act = x.share if x.activity_share is None else x.activity_share
    fb = x.share if x.fb_share is None else x.fb_share
    return (x.scheduler, x.id, x.name, x.user, x.account, x.queue, x.share, act, fb, x.share_source)


def _gpu_rows(batches: list[GpuSampleBatch]) -> Columns:
    """The hot path of the ingest: one row per GPU. Plain columns by hand, the catalogue
    fields through Arrow (one C++ pass over the dicts instead of 33 appends per row)."""
    cols: Columns = {k: [] for k in _GPU_COLS + _ALLOC_COLS}
    (cluster, node, pool, gpu, uuid, model, ts, interval, healthy, act, source, boot, seq, share, frac, gi, ci,
     profile) = (cols[k] for k in _GPU_COLS)  # fmt: skip
    allocs = [cols[k] for k in _ALLOC_COLS]
    fields: list[dict[str, float]] = []
    empty: list[Any] = []
    for m in batches:
        for g in m.gpus:
            cluster.append(m.cluster)
            node.append(m.node)
            pool.append(m.pool)
            gpu.append(g.index)
            uuid.append(g.uuid)
            model.append(g.model)
            ts.append(m.ts)
            interval.append(m.interval_s)
            healthy.append(1 if g.healthy else 0)
            act.append(activity(g.fields))
            source.append(m.source)
            boot.append(m.boot_id)
            seq.append(m.seq)
            frac.append(g.fraction)
            mig = g.mig
            gi.append(-1 if mig is None else mig.gi)
            ci.append(-1 if mig is None else mig.ci)
            profile.append("" if mig is None else mig.profile)
            a = g.allocations
            if a:
                share.append(min(1.0, sum(x.share for x in a)))
                per_attr = zip(
                    *[_alloc_row(x) for x in a],
                    strict=True,
                )
                for col, values in zip(allocs, per_attr, strict=True):
                    col.append(values)
            else:
                share.append(0.0)
                for col in allocs:
                    col.append(empty)
            fields.append(g.fields)
    table = pa.Table.from_pylist(fields, schema=_FIELD_SCHEMA)
    for name in _FIELD_NAMES:
        cols[name] = table.column(name)
    return cols


def to_columns(msgs: Iterable[Message]) -> dict[str, Columns]:
    """Group messages by table, as columns. Pure: no I/O, easy to test."""
    out: dict[str, Columns] = defaultdict(lambda: defaultdict(list))
    gpu_batches: list[GpuSampleBatch] = []
    for m in msgs:
        if isinstance(m, GpuSampleBatch):
            gpu_batches.append(m)
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
            c["cause"].append(m.cause or "")
            c["cluster_queue"].append(m.cluster_queue or "")
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
    result = {t: dict(c) for t, c in out.items()}
    if gpu_batches:
        result["gpu_samples"] = _gpu_rows(gpu_batches)
    return result


@functools.cache
def _arrow_types(table: str) -> dict[str, Any]:
    return {k: arrow_type(v) for k, v in column_types(table).items()}


def typed(table: str, columns: Mapping[str, Any]) -> dict[str, Any]:
    """The columns as Arrow arrays of the store's column types (from ingest/schema.py).
    A value the type cannot hold raises here, while the batch is prepared, never in the
    insert; the pipeline isolates the message that carries it."""
    types = _arrow_types(table)
    out: dict[str, Any] = {}
    for name, values in columns.items():
        t = types[name]
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            out[name] = values if values.type == t else values.cast(t)
        else:
            out[name] = pa.array(values, type=t)
    return out


def write(store: Store, msgs: Iterable[Message]) -> dict[str, int]:
    """One insert per table, their rollups' marks flushed after; returns rows written per table."""
    written = {table: store.insert(table, cols) for table, cols in to_columns(msgs).items()}
    store.flush_marks()
    return written


def raw_hash(value: bytes) -> int:
    """A stable 64-bit digest of a message's bytes (part of the dead letters' key)."""
    return int.from_bytes(hashlib.blake2b(value, digest_size=8).digest(), "little")


def dead_letter(store: Store, items: Iterable[tuple[float, Raw, str]]) -> int:
    """(received_at, raw message, reason) rows into ``dead_letters``."""
    cols: Columns = {
        k: [] for k in ("received_at", "origin", "topic", "partition", "offset", "reason", "raw", "raw_hash")
    }
    for received, raw, reason in items:
        cols["received_at"].append(received)
        cols["origin"].append(raw.origin)
        cols["topic"].append(raw.topic)
        cols["partition"].append(raw.partition)
        cols["offset"].append(raw.offset)
        cols["reason"].append(reason)
        cols["raw"].append(raw.value)
        cols["raw_hash"].append(raw_hash(raw.value))
    return store.insert("dead_letters", cols)

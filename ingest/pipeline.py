"""Decode, check and write a stream of raw messages; bad ones become dead letters.

Used by the embedded bus consumer and by ``gpuslo ingest --file``; the Kafka consumer
reuses it with (topic, partition, offset) as the origin of each message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from gpuslo.wire import Message, WireError, decode
from ingest import fastpath
from ingest.schema import DEFAULT_TTL_DAYS
from ingest.store import Store, StoreError
from ingest.writer import Raw, dead_letter, to_columns

log = logging.getLogger(__name__)


@dataclass
class IngestReport:
    received: int = 0
    duplicates: int = 0  # same (source, boot_id, seq) twice in one call: dropped
    written: dict[str, int] = field(default_factory=dict)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (origin, reason)
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (origin, what); still written
    dead_lettered: int = 0
    vectorised: int = 0  # messages decoded by the vectorised path (ingest/fastpath.py)

    def merge(self, other: IngestReport) -> None:
        self.received += other.received
        self.vectorised += other.vectorised
        self.duplicates += other.duplicates
        for t, n in other.written.items():
            self.written[t] = self.written.get(t, 0) + n
        self.rejected += other.rejected
        self.dead_lettered += other.dead_lettered
        self.warnings += other.warnings

    @property
    def accepted(self) -> int:
        return self.received - len(self.rejected) - self.duplicates


def _stream_key(m: Message) -> tuple[str, ...]:
    sub = getattr(m, "node", None) or getattr(m, "service", None) or ""
    return (m.kind, m.source, m.boot_id, sub)


def _concat(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two column sets of one table (Arrow columns first, Arrow or lists second) as one."""
    out: dict[str, Any] = {}
    for name, x in a.items():
        y = b[name]
        if not isinstance(y, (pa.Array, pa.ChunkedArray)):
            y = pa.array(y, type=x.type)
        elif y.type != x.type:
            y = y.cast(x.type)
        chunks = [*(x.chunks if isinstance(x, pa.ChunkedArray) else [x])]
        chunks += y.chunks if isinstance(y, pa.ChunkedArray) else [y]
        out[name] = pa.chunked_array(chunks, type=x.type)
    return out


@dataclass
class Prepared:
    """A batch decoded and turned into the store's columns, not yet written."""

    columns: dict[str, Any]
    dead: list[tuple[float, Raw, str]]
    report: IngestReport


class Ingestor:
    """Stateful across calls: remembers the last timestamp of every stream to report
    out-of-order messages (they are written all the same; ClickHouse does not care)."""

    def __init__(
        self,
        store: Store,
        retention_days: int = DEFAULT_TTL_DAYS,
        clock: Callable[[], float] = time.time,
        fast_path: bool = True,
    ) -> None:
        self.store = store
        self.fast_path = fast_path
        self.retention_days = retention_days
        self.clock = clock
        self._last: dict[tuple[str, ...], tuple[float, str]] = {}

    def ingest(self, items: Iterable[Raw]) -> IngestReport:
        """One insert per table for the whole call; raises the store's error if a write
        fails (nothing is acknowledged then; the caller retries the same items)."""
        return self.write(self.prepare(items))

    def prepare(self, items: Iterable[Raw]) -> Prepared:
        """Decode, check and build the columns: everything but I/O (safe to run while
        another thread writes the previous batch). GPU sample batches in the agent's encoding
        take the vectorised path (:mod:`ingest.fastpath`); everything else, and whatever that
        path is unsure of, goes through the models, which explain rejections."""
        items = list(items)
        rep = IngestReport()
        good: list[Message] = []
        keep: list[int] = []  # fast-path messages kept, as indices into ``fast.positions``
        dead: list[tuple[float, Raw, str]] = []
        seen: set[tuple[str, str, int]] = set()
        now = self.clock()
        oldest = now - self.retention_days * 86400.0
        fast: fastpath.Decoded | None = None
        fast_at: dict[int, int] = {}
        if self.fast_path:
            cand = [i for i, it in enumerate(items) if fastpath.candidate(it.value)]
            if cand:
                fast, _ = fastpath.decode([items[i].value for i in cand])
                fast_at = {cand[p]: k for k, p in enumerate(fast.positions)}
                rep.vectorised = len(fast.positions)
        for pos, item in enumerate(items):
            rep.received += 1
            origin = item.origin
            k = fast_at.get(pos)
            m: Message | None = None
            if fast is not None and k is not None:
                ts, ident = fast.ts[k], (fast.source[k], fast.boot_id[k], fast.seq[k])
                key: tuple[str, ...] = ("gpu_samples", fast.source[k], fast.boot_id[k], fast.node[k])
            else:
                try:
                    m = decode(item.value)
                except WireError as exc:
                    rep.rejected.append((origin, exc.reason))
                    dead.append((now, item, exc.reason))
                    continue
                ts, ident, key = m.ts, (m.source, m.boot_id, m.seq), _stream_key(m)
            if ts < oldest:
                reason = (
                    f"ts {ts:.3f} is older than the store's retention ({self.retention_days} days); "
                    "the table TTL would drop it"
                )
                rep.rejected.append((origin, reason))
                dead.append((now, item, reason))
                continue
            if ident in seen:
                rep.duplicates += 1
                continue
            seen.add(ident)
            prev = self._last.get(key)
            if prev is not None and ts < prev[0]:
                rep.warnings.append(
                    (
                        origin,
                        f"out-of-order: ts {ts:.3f} is {prev[0] - ts:.3f} s before {prev[1]} of the same stream",
                    )
                )
            else:
                self._last[key] = (ts, origin)
            if m is not None:
                good.append(m)
            elif k is not None:
                keep.append(k)
        tables: dict[str, Any] = to_columns(good) if good else {}
        if fast is not None and keep:
            cols = fastpath.columns(fast, keep)
            slow = tables.get("gpu_samples")
            tables["gpu_samples"] = cols if slow is None else _concat(cols, slow)
        columns = {t: self.store.prepare_columns(t, c) for t, c in tables.items()}
        return Prepared(columns, dead, rep)

    def write(self, p: Prepared) -> IngestReport:
        """The prepared batch into the store: one insert per table, then the dead letters."""
        rep = replace(
            p.report, written={}, rejected=list(p.report.rejected), warnings=list(p.report.warnings)
        )
        for table, cols in p.columns.items():
            rep.written[table] = self.store.insert(table, cols)
        if p.dead:
            dead_letter(self.store, p.dead)
            log.warning(
                "dead-lettered %d of %d messages; first: %s: %s", len(p.dead), rep.received, *rep.rejected[0]
            )
        rep.dead_lettered = len(p.dead)
        return rep

    def ingest_isolating(self, items: list[Raw]) -> IngestReport:
        """Write message by message; a message the store refuses becomes a dead letter
        with the store's reason. If even that fails, it is logged with its origin and
        counted in ``rejected`` (never dropped silently)."""
        total = IngestReport()
        for item in items:
            try:
                total.merge(self.ingest([item]))
            except StoreError as exc:
                if exc.retriable:
                    raise
                reason = f"store refused it: {str(exc).splitlines()[0][:500]}"
                total.received += 1
                total.rejected.append((item.origin, reason))
                try:
                    dead_letter(self.store, [(self.clock(), item, reason)])
                    total.dead_lettered += 1
                except StoreError as exc2:
                    log.error(
                        "LOST %s: the store refused it (%s) and its dead letter (%s)",
                        item.origin,
                        reason,
                        exc2,
                    )
        return total

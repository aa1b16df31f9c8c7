"""Decode, check and write a stream of raw messages; bad ones become dead letters.

Used by the embedded bus consumer and by ``gpuslo ingest --file``; the Kafka consumer
reuses it with (topic, partition, offset) as the origin of each message.

Every message ends in exactly one of: written, a replay of a message already written
(dropped and counted), or a dead letter with its reason. A failure while a batch is turned
into columns (a value its column cannot hold) is isolated to the message that carries it,
the way a refused insert is (:meth:`Ingestor.ingest_isolating`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuslo.ingest import fastpath, packed
from gpuslo.ingest.cluster import distributed_over, on_cluster
from gpuslo.ingest.schema import (
    DEAD_LETTERS_UPGRADE,
    DEFAULT_TTL_DAYS,
    MAX_PARTITIONS_PER_INSERT,
    RAW_TABLES,
    Schema,
    expires_at,
    ttl_days_of,
)
from gpuslo.ingest.store import Failure, Store, StoreError
from gpuslo.ingest.writer import Raw, dead_letter, to_columns, typed
from gpuslo.wire import Message, WireError, decode
from gpuslo.wire.pack import digest as content_digest
from gpuslo.wire.pack import is_pack

log = logging.getLogger(__name__)

#: Rejections and warnings an :class:`IngestReport` keeps (the rest are counted; every
#: rejected message is in the ``dead_letters`` table).
REPORT_KEEP = 1000
#: How many message ids (source, boot_id, seq) the ingest remembers to tell a replay from a
#: conflicting message (about 190 B each: 250,000 take about 48 MB).
DEDUP_WINDOW = 250_000


@dataclass
class IngestReport:
    received: int = 0
    duplicates: int = 0  # replays (same id, same bytes) of a message already taken: dropped
    written: dict[str, int] = field(default_factory=dict)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (origin, reason): the first ``keep``
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (origin, what); still written
    dead_lettered: int = 0
    vectorised: int = 0  # messages decoded by the vectorised path (ingest/fastpath.py)
    n_rejected: int = 0  # every rejection, kept in ``rejected`` or not
    n_warnings: int = 0
    keep: int = REPORT_KEEP

    def reject(self, origin: str, reason: str) -> None:
        self.n_rejected += 1
        if len(self.rejected) < self.keep:
            self.rejected.append((origin, reason))

    def warn(self, origin: str, what: str) -> None:
        self.n_warnings += 1
        if len(self.warnings) < self.keep:
            self.warnings.append((origin, what))

    def merge(self, other: IngestReport) -> None:
        self.received += other.received
        self.vectorised += other.vectorised
        self.duplicates += other.duplicates
        for t, n in other.written.items():
            self.written[t] = self.written.get(t, 0) + n
        self.rejected += other.rejected[: max(0, self.keep - len(self.rejected))]
        self.warnings += other.warnings[: max(0, self.keep - len(self.warnings))]
        self.n_rejected += other.n_rejected
        self.n_warnings += other.n_warnings
        self.dead_lettered += other.dead_lettered

    @property
    def accepted(self) -> int:
        return self.received - self.n_rejected - self.duplicates


def _stream_key(m: Message) -> tuple[str, ...]:
    sub = getattr(m, "node", None) or getattr(m, "service", None) or ""
    return (m.kind, m.source, m.boot_id, sub)


def _create_query(store: Store, table: str) -> str | None:
    rows = store.query(
        "SELECT create_table_query AS q FROM system.tables "
        "WHERE database = currentDatabase() AND name = {t:String}",
        {"t": table},
    )
    return str(rows[0]["q"]) if rows else None


def _ttl_table(store: Store) -> tuple[str | None, str | None]:
    """The ``CREATE`` text of the table whose TTL is the store's retention, and the cluster
    when the store is one (``gpuslo schema --cluster``: ``gpu_samples`` is then ``Distributed``
    and the TTL is its local tables')."""
    q = _create_query(store, "gpu_samples")
    over = None if q is None else distributed_over(q)
    if over is None:
        return q, None
    local = _create_query(store, over[1])
    if local is None:  # its retention unknown: setting one would be a guess, and may drop rows
        raise StoreError(
            f"gpu_samples is Distributed over {over[1]} of cluster {over[0]!r}, which this server lacks: "
            "connect to a server of the cluster's shards (gpuslo schema --cluster makes the tables there)",
            Failure.FATAL,
        )
    return local, over[0]


def retention_days(store: Store) -> int:
    """The store's retention: the TTL of its raw tables (``gpuslo ingest --retention-days``)."""
    q, _ = _ttl_table(store)
    got = None if q is None else ttl_days_of(q)
    if got is None:
        log.warning("cannot read the store's retention; assuming %d days", DEFAULT_TTL_DAYS)
        return DEFAULT_TTL_DAYS
    return got[0]


def upgrade(store: Store, retention: int | None = None, *, schema: Schema) -> int:
    """After ``migrate(schema)``: bring a store made by an earlier version up to the current keys
    (the raw tables' ``Date`` TTL, dead letters keyed by their bytes too), set its retention
    when ``retention`` is given, and return the retention in force."""
    q, cluster = _ttl_table(store)
    got = None if q is None else ttl_days_of(q)
    days = retention if retention is not None else (got[0] if got else DEFAULT_TTL_DAYS)
    if got is None or got != (days, True):
        if got is not None and not got[1]:
            log.warning("upgrading the store's TTL to the Date form (retention %d days)", days)
        for stmt in schema.retention_statements(days):
            store.execute(stmt if cluster is None else on_cluster(stmt, cluster))
    dl = _create_query(store, "dead_letters")
    if dl is not None and "raw_hash" not in dl:
        log.warning("upgrading dead_letters: keyed by origin and a hash of the bytes")
        store.execute(DEAD_LETTERS_UPGRADE)
    return days


@dataclass
class Prepared:
    """A batch decoded and turned into the store's columns, not yet written."""

    columns: dict[str, Any]
    dead: list[tuple[float, Raw, str]]
    report: IngestReport


class _Ids:
    """The last ``size`` message ids taken, each with the digest of its JSON bytes
    (:func:`gpuslo.wire.pack.digest`: the same for a batch sent as JSON and in a pack) and a
    hash of its origin (about 190 B an id)."""

    _M = 2**64 - 1

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[int, int] = OrderedDict()

    def lookup(self, ident: tuple[str, str, int], digest: int, origin: str) -> str:
        """What an id is: "new"; "again" (this very message, same origin: a retry or an
        isolation pass); "replay" (the same bytes from elsewhere); "conflict" (a different
        message under an id already taken)."""
        got = self._d.get(hash(ident))
        if got is None:
            return "new"
        if got & self._M == hash(origin) & self._M:
            return "again"
        return "replay" if got >> 64 == digest & self._M else "conflict"

    def put(self, ident: tuple[str, str, int], digest: int, origin: str) -> None:
        self._d[hash(ident)] = (digest & self._M) << 64 | (hash(origin) & self._M)
        if len(self._d) > self.size:
            self._d.popitem(last=False)

    def forget(self, ident: tuple[str, str, int], origin: str) -> None:
        key = hash(ident)
        got = self._d.get(key)
        if got is not None and got & self._M == hash(origin) & self._M:
            del self._d[key]


@dataclass
class _Taken:
    """The messages of a batch that passed the checks, before their columns are built."""

    models: list[tuple[int, Message]] = field(default_factory=list)  # (position, message)
    fast: list[tuple[int, int]] = field(default_factory=list)  # (position, index into fast.positions)
    idents: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # position -> id


class Ingestor:
    """Stateful across calls: remembers the last timestamp of every stream to report
    out-of-order messages (they are written all the same; ClickHouse does not care), and
    the ids of the last :data:`DEDUP_WINDOW` messages, to drop replays and dead-letter a
    different message that reuses an id, whatever the batch boundaries."""

    def __init__(
        self,
        store: Store,
        retention_days: int = DEFAULT_TTL_DAYS,
        clock: Callable[[], float] = time.time,
        fast_path: bool = True,
        dedup_window: int = DEDUP_WINDOW,
        report_keep: int = REPORT_KEEP,
    ) -> None:
        self.store = store
        self.fast_path = fast_path
        self.retention_days = retention_days
        self.clock = clock
        self.report_keep = report_keep
        self._last: dict[tuple[str, ...], tuple[float, str]] = {}
        self._ids = _Ids(dedup_window)

    def ingest(self, items: Iterable[Raw]) -> IngestReport:
        """One insert per table (and partition group) for the whole call; raises the store's
        error if a write fails (nothing is acknowledged then; the caller retries the same
        items, or isolates them with :meth:`ingest_isolating`)."""
        return self.write(self.prepare(items))

    def prepare(self, items: Iterable[Raw]) -> Prepared:
        """Decode, check and build the columns: everything but I/O (safe to run while
        another thread writes the previous batch). GPU sample batches in the agent's encoding
        take the vectorised path (:mod:`ingest.fastpath`); everything else, and whatever that
        path is unsure of, goes through the models, which explain rejections."""
        items, unpacked = self._unpack(list(items))
        rep = IngestReport(keep=self.report_keep)
        dead: list[tuple[float, Raw, str]] = []
        now = self.clock()
        fast, fast_at = self._fast_decode(items, rep)
        if unpacked.decoded is not None:
            fast, fast_at = _merge(fast, fast_at, unpacked.decoded, unpacked.at)
            rep.vectorised += len(unpacked.at)

        def refuse(item: Raw, reason: str) -> None:
            if not item.value and item.origin in unpacked.json:  # a batch of a pack: keep its JSON
                item = replace(item, value=packed.as_json(*unpacked.json[item.origin]))
            rep.reject(item.origin, reason)
            dead.append((now, item, reason))

        taken = _Taken()
        for pos, item in enumerate(items):
            rep.received += 1
            if item.refused:
                refuse(item, item.refused)
                continue
            k = fast_at.get(pos)
            if fast is not None and k is not None:
                m: Message | None = None
                ts, ident = fast.ts[k], (fast.source[k], fast.boot_id[k], fast.seq[k])
                key: tuple[str, ...] = ("gpu_samples", fast.source[k], fast.boot_id[k], fast.node[k])
            else:
                m = self._decode(item, refuse)
                if m is None:
                    continue
                ts, ident, key = m.ts, (m.source, m.boot_id, m.seq), _stream_key(m)
            if not self._admit(item, ts, ident, now, refuse, rep):
                continue
            self._order(key, ts, item.origin, rep)
            taken.idents[pos] = ident
            if m is not None:
                taken.models.append((pos, m))
            elif k is not None:
                taken.fast.append((pos, k))
        columns = self._build(taken, fast, items, refuse)
        return Prepared(columns, dead, rep)

    def _unpack(self, items: list[Raw]) -> tuple[list[Raw], _Unpacked]:
        """``items`` with each pack (:mod:`gpuslo.wire.pack`) replaced by its batches, each an item
        of its own (origin ``ORIGIN#K``, the pack's ``K``-th batch, its digest the pack's): the
        batches that pass the fast path's checks are taken from the pack's columns (their item
        has no bytes; its JSON is made only if it is refused, for its dead letter), the others
        carry their JSON for the models to decide. A pack that is not well formed stays one
        item, refused with the reason."""
        out = _Unpacked()
        if not any(is_pack(it.value) for it in items if not it.refused):
            return items, out
        seq: list[Raw | int] = []  # each item as it is, or the index of its pack in ``units``
        units: list[tuple[Raw, packed.Unpacked]] = []
        for item in items:
            if item.refused or not is_pack(item.value):
                seq.append(item)
                continue
            try:
                u = packed.unpack(item.value)
            except packed.PackError as exc:
                seq.append(replace(item, refused=f"invalid pack: {exc.reason}"))
                continue
            except Exception as exc:  # a fault of the decoder is this message's, never the batch's
                seq.append(replace(item, refused=f"pack cannot be decoded: {type(exc).__name__}: {exc}"))
                continue
            seq.append(len(units))
            units.append((item, u))
        if not units:
            return [x for x in seq if isinstance(x, Raw)], out
        # one pass of the checks over every pack of the call (their cost is per call, not per row)
        table = pa.concat_tables([u.table for _, u in units]) if len(units) > 1 else units[0][1].table
        ok = self._checks(table, [u.table for _, u in units])
        good = table.filter(pa.array(ok)) if not ok.all() else table
        good_at = (np.cumsum(ok) - 1).tolist()
        ok_l = ok.tolist()
        expanded: list[Raw] = []
        base = 0
        for x in seq:
            if isinstance(x, Raw):
                expanded.append(x)
                continue
            item, u = units[x]
            for k in range(u.table.num_rows):
                origin, d = f"{item.origin}#{k}", u.digest[k]
                if ok_l[base + k]:
                    g = good_at[base + k]
                    out.at[len(expanded)] = g
                    out.json[origin] = (good, g)
                    expanded.append(Raw(origin, b"", item.topic, item.partition, item.offset, "", d))
                else:
                    value = packed.as_json(u.table, k)
                    expanded.append(Raw(origin, value, item.topic, item.partition, item.offset, "", d))
            base += u.table.num_rows
        if good.num_rows:
            out.decoded = fastpath.decoded(sorted(out.at, key=out.at.__getitem__), good)
        return expanded, out

    def _checks(self, table: pa.Table, parts: list[pa.Table]) -> np.ndarray[Any, Any]:
        """Per batch of the packs' ``table`` (``parts`` concatenated): does it take the fast path?
        A fault of the checks is isolated to its pack, whose batches the models decide."""
        if not self.fast_path:
            return np.zeros(table.num_rows, bool)
        try:
            return fastpath._valid(table)
        except Exception:
            log.exception("the fast path's checks failed on a call's packs; checking them pack by pack")
        out = []
        for t in parts:
            try:
                out.append(fastpath._valid(t))
            except Exception:
                out.append(np.zeros(t.num_rows, bool))
        return np.concatenate(out)

    def _fast_decode(
        self, items: list[Raw], rep: IngestReport
    ) -> tuple[fastpath.Decoded | None, dict[int, int]]:
        """The vectorised decoding of the candidates among ``items``, and each decoded item's
        index into it (by the item's position); none if the decoder fails (the models decide)."""
        if not self.fast_path:
            return None, {}
        cand = [i for i, it in enumerate(items) if not it.refused and fastpath.candidate(it.value)]
        if not cand:
            return None, {}
        try:
            fast, _ = fastpath.decode([items[i].value for i in cand])
        except Exception:  # the models decide for every message then
            log.exception("the vectorised decoder failed on a batch; decoding it with the models")
            return None, {}
        rep.vectorised = len(fast.positions)
        return fast, {cand[p]: k for k, p in enumerate(fast.positions)}

    @staticmethod
    def _decode(item: Raw, refuse: Callable[[Raw, str], None]) -> Message | None:
        """The message, or None when it is refused (a decoder fault is this message's, never the batch's)."""
        try:
            return decode(item.value)
        except WireError as exc:
            refuse(item, exc.reason)
        except Exception as exc:
            refuse(item, f"cannot be decoded: {type(exc).__name__}: {str(exc)[:300]}")
        return None

    def _admit(
        self, item: Raw, ts: float, ident: tuple[str, str, int], now: float,
        refuse: Callable[[Raw, str], None], rep: IngestReport,
    ) -> bool:  # fmt: skip
        """Whether the message is written: not past retention, not a replay, not a different
        message under an id already taken (then it is remembered)."""
        if expires_at(ts, self.retention_days) <= now:
            refuse(item, self._too_old(ts))
            return False
        digest = item.digest or content_digest(item.value)
        seen = self._ids.lookup(ident, digest, item.origin)
        if seen == "replay":
            rep.duplicates += 1
            return False
        if seen == "conflict":
            refuse(
                item,
                f"conflicting message: id (source {ident[0]!r}, boot_id {ident[1]!r}, seq {ident[2]}) "
                "was already taken by a different message; seq must be unique per (source, boot_id)",
            )
            return False
        self._ids.put(ident, digest, item.origin)
        return True

    def _too_old(self, ts: float) -> str:
        at = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return (
            f"ts {ts:.3f} ({at}) is older than the store's retention ({self.retention_days} days); "
            "the table TTL would drop it (to backfill older data, raise the store's retention: "
            "gpuslo ingest --retention-days N)"
        )

    def _order(self, key: tuple[str, ...], ts: float, origin: str, rep: IngestReport) -> None:
        prev = self._last.get(key)
        if prev is not None and ts < prev[0]:
            rep.warn(
                origin,
                f"out-of-order: ts {ts:.3f} is {prev[0] - ts:.3f} s before {prev[1]} of the same stream",
            )
        else:
            self._last[key] = (ts, origin)

    def _build(
        self,
        taken: _Taken,
        fast: fastpath.Decoded | None,
        items: list[Raw],
        refuse: Callable[[Raw, str], None],
    ) -> dict[str, Any]:
        """The typed columns of the taken messages. Whatever fails here (a value its column
        cannot hold) is found message by message and dead-lettered; the rest is built again."""
        try:
            return self._columns([m for _, m in taken.models], fast, [k for _, k in taken.fast])
        except Exception as exc:
            log.warning("building the columns of a batch failed (%s); isolating the message(s)", exc)
        bad: set[int] = set()
        for pos, m in taken.models:
            bad |= self._fails(pos, [m], None, [], items, refuse)
        for pos, k in taken.fast:
            bad |= self._fails(pos, [], fast, [k], items, refuse)
        for pos in bad:
            self._ids.forget(taken.idents[pos], items[pos].origin)
        return self._columns(
            [m for pos, m in taken.models if pos not in bad],
            fast,
            [k for pos, k in taken.fast if pos not in bad],
        )

    def _fails(
        self,
        pos: int,
        good: list[Message],
        fast: fastpath.Decoded | None,
        keep: list[int],
        items: list[Raw],
        refuse: Callable[[Raw, str], None],
    ) -> set[int]:
        try:
            self._columns(good, fast, keep)
        except Exception as exc:
            refuse(items[pos], f"cannot be stored: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            return {pos}
        return set()

    def _columns(self, good: list[Message], fast: fastpath.Decoded | None, keep: list[int]) -> dict[str, Any]:
        tables = {t: typed(t, c) for t, c in to_columns(good).items()} if good else {}
        if fast is not None and keep:
            cols = typed("gpu_samples", fastpath.columns(fast, keep))
            slow = tables.get("gpu_samples")
            tables["gpu_samples"] = cols if slow is None else _concat(cols, slow)
        return {t: self.store.prepare_columns(t, c) for t, c in tables.items()}

    def write(self, p: Prepared) -> IngestReport:
        """The prepared batch into the store: the inserts of each table (one per group of at
        most MAX_PARTITIONS_PER_INSERT days), then the dead letters."""
        rep = replace(
            p.report, written={}, rejected=list(p.report.rejected), warnings=list(p.report.warnings)
        )
        for table, cols in p.columns.items():
            rep.written[table] = sum(self.store.insert(table, part) for part in by_partition(table, cols))
        if p.dead:
            dead_letter(self.store, p.dead)
            log.warning(
                "dead-lettered %d of %d messages; first: %s: %s",
                len(p.dead),
                rep.received,
                p.dead[0][1].origin,
                p.dead[0][2],
            )
        rep.dead_lettered = len(p.dead)
        return rep

    def ingest_or_isolate(self, items: list[Raw]) -> IngestReport:
        """:meth:`ingest`, and when the store refuses the batch, :meth:`ingest_isolating` (only
        what the store refuses is dead-lettered); a transient or fatal failure is raised."""
        try:
            return self.ingest(items)
        except StoreError as exc:
            if exc.failure is not Failure.REFUSED:
                raise
            return self.ingest_isolating(items)

    @staticmethod
    def _batches_of(item: Raw) -> list[Raw]:
        """A pack as its batches, each its JSON under its own origin and the pack's digest for it
        (so the store's refusal of one is that batch's alone); any other item as it is."""
        if item.refused or not is_pack(item.value):
            return [item]
        try:
            u = packed.unpack(item.value)
        except Exception:  # refused whole, with the reason, when ingested as it is
            return [item]
        return [
            replace(item, origin=f"{item.origin}#{k}", value=packed.as_json(u.table, k), digest=u.digest[k])
            for k in range(u.table.num_rows)
        ]

    def ingest_isolating(self, items: list[Raw]) -> IngestReport:
        """Write message by message; a message the store refuses (``REFUSED``) becomes a dead
        letter with the store's reason. Any other failure, and a dead letter that cannot be
        written, is raised: that message is neither written nor dead-lettered, so its offset
        must not be committed (``TRANSIENT``: the caller retries; otherwise it stops)."""
        total = IngestReport(keep=self.report_keep)
        for item in (one for it in items for one in self._batches_of(it)):
            try:
                total.merge(self.ingest([item]))
            except StoreError as exc:
                if exc.failure is not Failure.REFUSED:
                    raise
                reason = f"store refused it: {str(exc).splitlines()[0][:500]}"
                try:
                    dead_letter(self.store, [(self.clock(), item, reason)])
                except StoreError as exc2:
                    raise StoreError(
                        f"cannot dead-letter {item.origin} (the store refused it: {reason}): {exc2}",
                        Failure.TRANSIENT if exc2.retriable else Failure.FATAL,
                        exc2.code,
                    ) from exc2
                total.received += 1
                total.reject(item.origin, reason)
                total.dead_lettered += 1
        return total


@dataclass
class _Unpacked:
    """The batches of a call's packs that take the fast path: their decoding, each one's index
    into it by its item's position, and where each one's row is (by origin: its JSON is made
    only for a dead letter)."""

    decoded: fastpath.Decoded | None = None
    at: dict[int, int] = field(default_factory=dict)
    json: dict[str, tuple[pa.Table, int]] = field(default_factory=dict)


def _merge(
    a: fastpath.Decoded | None, a_at: dict[int, int], b: fastpath.Decoded, b_at: dict[int, int]
) -> tuple[fastpath.Decoded, dict[int, int]]:
    """Two decodings as one (``b``'s indices after ``a``'s)."""
    if a is None or not a.positions:
        return b, b_at
    n = len(a.positions)
    return fastpath.Decoded(
        a.positions + b.positions,
        a.source + b.source,
        a.boot_id + b.boot_id,
        a.seq + b.seq,
        a.ts + b.ts,
        a.node + b.node,
        pa.concat_tables([a.table, b.table]),
    ), {**a_at, **{pos: n + k for pos, k in b_at.items()}}


def _concat(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two typed column sets of one table as one."""
    out: dict[str, Any] = {}
    for name, x in a.items():
        y = b[name]
        chunks = [*(x.chunks if isinstance(x, pa.ChunkedArray) else [x])]
        chunks += y.chunks if isinstance(y, pa.ChunkedArray) else [y]
        out[name] = pa.chunked_array(chunks, type=x.type)
    return out


def by_partition(table: str, cols: Any) -> Iterator[Any]:
    """The batch in parts of at most MAX_PARTITIONS_PER_INSERT partitions (days: the raw
    tables are partitioned by ``toDate(ts)``), so that a file or a Kafka batch spanning any
    number of days lands (ClickHouse refuses an insert block touching more than 100)."""
    if table not in RAW_TABLES:
        yield cols
        return
    ts = cols["ts"] if isinstance(cols, pa.Table) else cols.get("ts")
    if ts is None:
        yield cols
        return
    t = np.asarray(ts.to_numpy() if isinstance(ts, pa.ChunkedArray | pa.Array) else ts, dtype=np.float64)
    days = np.floor(t / 86400).astype(np.int64)
    uniq = np.unique(days)
    if len(uniq) <= MAX_PARTITIONS_PER_INSERT:
        yield cols
        return
    group = np.searchsorted(uniq, days) // MAX_PARTITIONS_PER_INSERT
    for g in range(int(group.max()) + 1):
        idx = pa.array(np.flatnonzero(group == g))
        yield cols.take(idx) if isinstance(cols, pa.Table) else {k: _take(v, idx) for k, v in cols.items()}


def _take(values: Any, idx: Any) -> Any:
    if isinstance(values, pa.ChunkedArray | pa.Array):
        return pc.take(values, idx)
    return [values[i] for i in idx.to_pylist()]

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
import os
import threading
import time
from bisect import bisect_right
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
    MSG_KEY_EXPR,
    MSG_KEY_STALE,
    MSG_KEY_TABLES,
    RAW_TABLES,
    Schema,
    expires_at,
    msg_key_copy,
    msg_key_rekey,
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
    (the raw tables' ``Date`` TTL, dead letters keyed by their bytes too, health events by their
    ids), set its retention when ``retention`` is given, and return the retention in force."""
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
    for table in MSG_KEY_TABLES:
        _upgrade_msg_key(store, table)
    return days


def _upgrade_msg_key(store: Store, table: str) -> None:
    """Key ``table`` by its messages' ids too (``msg_key``), where a store made before lacks it
    or an upgrade stopped before its rows were all under their key."""
    rows = store.query(
        "SELECT t.engine AS engine, t.sorting_key AS sorting_key, c.default_expression AS d "
        "FROM system.tables AS t LEFT JOIN (SELECT table, default_expression FROM system.columns "
        "WHERE database = currentDatabase() AND table = {t:String} AND name = 'msg_key') AS c ON c.table = t.name "
        "WHERE t.database = currentDatabase() AND t.name = {t:String} SETTINGS join_use_nulls = 1",
        {"t": table},
    )
    if not rows:
        return
    merge_tree = str(rows[0]["engine"]).endswith("MergeTree")
    keyed = rows[0]["d"] == MSG_KEY_EXPR
    if keyed and (
        not merge_tree or not store.query(f"SELECT 1 AS x FROM {table} WHERE {MSG_KEY_STALE} LIMIT 1")
    ):
        return
    if not merge_tree:  # a cluster's Distributed table
        log.warning(
            "%s is keyed without msg_key: two of its messages of one tick replace one another; "
            "make its local tables anew from gpuslo schema --cluster (docs/deployment.md)",
            table,
        )
        return
    log.warning("upgrading %s: keyed by its messages' ids too (msg_key)", table)
    if not keyed:
        for stmt in msg_key_rekey(table, str(rows[0]["sorting_key"])):
            store.execute(stmt)
    parts = store.query(  # (after the default: a partition a writer opens from now has keys)
        "SELECT DISTINCT partition_id AS p FROM system.parts "
        "WHERE database = currentDatabase() AND table = {t:String} AND active ORDER BY p",
        {"t": table},
    )
    for stmt in msg_key_copy(table, [str(r["p"]) for r in parts]):
        store.execute(stmt)


@dataclass
class Prepared:
    """A batch decoded and turned into the store's columns, not yet written."""

    columns: dict[str, Any]
    dead: list[tuple[float, Raw, str]]
    report: IngestReport
    # per table, its inserts as the store staged them (Store.stage: Native bytes for chDB),
    # made with the columns so that the writer's thread only sends them
    staged: dict[str, list[Any]] = field(default_factory=dict)


_M = 2**64 - 1
# a message's seq is its sender's to choose: it is mixed in through a bijection of 64-bit
# integers (so one stream's ids never share a key) that is salted per process (so no sender
# can pick a seq whose key is another stream's id, even where Python's hash is not salted:
# PYTHONHASHSEED set). SplitMix64's finaliser; every step is invertible.
_SALT = int.from_bytes(os.urandom(8), "little")
_S1, _S2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# odd, so multiplying by it is a bijection: the batches of one pack never share an origin key
_MIX_ORIGIN = 0xC2B2AE3D27D4EB4F


def _mix(x: int) -> int:
    z = (x + _SALT) & _M
    z = ((z ^ (z >> 30)) * _S1) & _M
    z = ((z ^ (z >> 27)) * _S2) & _M
    return z ^ (z >> 31)


def _mix_array(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """:func:`_mix` of each value (uint64 arithmetic wraps as ``& 2**64-1`` does)."""
    z = np.asarray(x).astype(np.uint64) + np.uint64(_SALT)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_S1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_S2)
    return np.asarray(z ^ (z >> np.uint64(31)))


def ident_key(source: str, boot_id: str, seq: int) -> int:
    """The 64-bit key of a message id: the hash of its stream with its ``seq`` mixed in, so
    that a run of one stream's ids is keyed in one array operation (:func:`ident_keys`)."""
    return (hash((source, boot_id)) & _M) ^ _mix(seq & _M)


def ident_keys(stream_hash: np.ndarray[Any, Any], seq: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """:func:`ident_key` of many ids: per id its stream's ``hash((source, boot_id)) & 2**64-1``
    and its ``seq`` (int64: two's complement is ``& 2**64-1``)."""
    return np.asarray(np.asarray(stream_hash, np.uint64) ^ _mix_array(seq))


def origin_key(origin: str) -> int:
    """The 64-bit key of an origin. A pack's batch ``ORIGIN#K`` is keyed by its pack's origin
    with ``K`` mixed in (:func:`origin_keys`: a pack's batches in one array operation); any
    other origin by its hash. A function of the string alone, so every path agrees."""
    base, sep, k = origin.rpartition("#")
    if sep and 0 < len(k) <= 18 and k.isascii() and k.isdigit() and (k == "0" or k[0] != "0"):
        return (hash(base) ^ (int(k) + 1) * _MIX_ORIGIN) & _M
    return hash(origin) & _M


def origin_keys(base: str, ks: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """:func:`origin_key` of ``f"{base}#{k}"`` for every ``k`` of ``ks`` (0 <= k < 10**18)."""
    return np.uint64(hash(base) & _M) ^ (
        (np.asarray(ks).astype(np.uint64) + np.uint64(1)) * np.uint64(_MIX_ORIGIN)
    )


class _Ids:
    """The last ``size`` message ids taken (:func:`ident_key`), each with the digest of its
    JSON bytes (:func:`gpuslo.wire.pack.digest`: the same for a batch sent as JSON and in a
    pack) and the key of its origin (:func:`origin_key`); about 190 B an id."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[int, int] = OrderedDict()

    def lookup(self, ident: tuple[str, str, int], digest: int, origin: str) -> str:
        """What an id is: "new"; "again" (this very message, same origin: a retry or an
        isolation pass); "replay" (the same bytes from elsewhere); "conflict" (a different
        message under an id already taken)."""
        got = self._d.get(ident_key(*ident))
        if got is None:
            return "new"
        if got & _M == origin_key(origin):
            return "again"
        return "replay" if got >> 64 == digest & _M else "conflict"

    def put(self, ident: tuple[str, str, int], digest: int, origin: str) -> None:
        self._d[ident_key(*ident)] = (digest & _M) << 64 | origin_key(origin)
        if len(self._d) > self.size:
            self._d.popitem(last=False)

    def put_all(self, keys: list[int], digests: list[int], origins: list[int]) -> None:
        """:meth:`put` of many new ids at once, by their keys (:func:`ident_key`,
        :func:`origin_key`)."""
        self._d.update(
            zip(keys, [(d & _M) << 64 | o for d, o in zip(digests, origins, strict=True)], strict=True)
        )
        for _ in range(len(self._d) - self.size):
            self._d.popitem(last=False)

    def forget(self, ident: tuple[str, str, int], origin: str) -> None:
        key = ident_key(*ident)
        got = self._d.get(key)
        if got is not None and got & _M == origin_key(origin):
            del self._d[key]


@dataclass
class _Taken:
    """The messages of a batch that passed the checks, before their columns are built."""

    models: list[tuple[int, Message]] = field(default_factory=list)  # (position, message)
    fast_pos: list[int] = field(default_factory=list)  # positions of the vectorised ones taken
    fast_k: list[int] = field(default_factory=list)  # and their indices into the decoding


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
        # the ids and stream ends are shared by every call: the Kafka consumer prepares the next
        # batch while its writer thread may be isolating a refused one (which prepares too)
        self._state = threading.Lock()

    def ingest(self, items: Iterable[Raw]) -> IngestReport:
        """One insert per table (and partition group) for the whole call; raises the store's
        error if a write fails (nothing is acknowledged then; the caller retries the same
        items, or isolates them with :meth:`ingest_isolating`)."""
        return self.write(self.prepare(items))

    def prepare(self, items: Iterable[Raw]) -> Prepared:
        """Decode, check and build the columns: everything but I/O (safe to run while
        another thread writes the previous batch). GPU sample batches in the agent's encoding
        take the vectorised path (:mod:`ingest.fastpath`); everything else, and whatever that
        path is unsure of, goes through the models, which explain rejections. A run of
        vectorised batches (a pack's) is admitted at once when none of it is an exception
        (past retention, an id seen before, a stream out of order); otherwise batch by batch."""
        slots, unpacked = self._unpack(list(items))
        rep = IngestReport(keep=self.report_keep)
        dead: list[tuple[float, Raw, str]] = []
        now = self.clock()
        fast, at = self._fast_decode(slots, rep)
        if unpacked.decoded is not None:
            n = 0 if fast is None else len(fast.positions)
            fast = unpacked.decoded if fast is None else _merge(fast, unpacked.decoded)
            for b in unpacked.blocks:
                at[b.pos : b.pos + len(b.ks)] = np.arange(n + b.row, n + b.row + len(b.ks))
            rep.vectorised += len(unpacked.decoded.positions)

        def refuse(item: Raw, reason: str) -> None:
            if not item.value:  # a batch of a pack: keep its JSON
                got = unpacked.row_of(item.origin)
                if got is not None:
                    item = replace(item, value=packed.as_json(*got))
            rep.reject(item.origin, reason)
            dead.append((now, item, reason))

        with self._state:
            taken = _Taken()
            rep.received += len(slots)
            runs = _runs(at)
            pos = 0
            while pos < len(slots):
                run = runs.get(pos)
                if run is None:
                    self._take_one(pos, slots, unpacked, fast, -1, now, refuse, rep, taken)
                    pos += 1
                    continue
                length, k0 = run
                if fast is None or not self._take_run(pos, length, k0, slots, unpacked, fast, now, taken):
                    for i in range(length):
                        self._take_one(pos + i, slots, unpacked, fast, k0 + i, now, refuse, rep, taken)
                pos += length
            columns = self._build(taken, fast, slots, unpacked, refuse)
        staged = {t: [self.store.stage(t, part) for part in by_partition(t, c)] for t, c in columns.items()}
        return Prepared(columns, dead, rep, staged)

    def _take_one(
        self, pos: int, slots: list[Raw | None], unpacked: _Unpacked, fast: fastpath.Decoded | None, k: int,
        now: float, refuse: Callable[[Raw, str], None], rep: IngestReport, taken: _Taken,
    ) -> None:  # fmt: skip
        """One message through the checks: the vectorised decoding's row ``k``, or (-1) the models'."""
        item = unpacked.item(slots, pos)
        if item.refused:
            refuse(item, item.refused)
            return
        if k >= 0 and fast is not None:
            m: Message | None = None
            e = fast.env
            ts, ident = e.ts[k], (e.source[k], e.boot_id[k], e.seq[k])
            key: tuple[str, ...] = ("gpu_samples", e.source[k], e.boot_id[k], e.node[k])
        else:
            m = self._decode(item, refuse)
            if m is None:
                return
            ts, ident, key = m.ts, (m.source, m.boot_id, m.seq), _stream_key(m)
        if not self._admit(item, ts, ident, now, refuse, rep):
            return
        self._order(key, ts, item.origin, rep)
        if m is not None:
            taken.models.append((pos, m))
        else:
            taken.fast_pos.append(pos)
            taken.fast_k.append(k)

    def _take_run(
        self, p0: int, n: int, k0: int, slots: list[Raw | None], unpacked: _Unpacked,
        fast: fastpath.Decoded, now: float, taken: _Taken,
    ) -> bool:  # fmt: skip
        """The vectorised rows ``k0..k0+n`` (at positions ``p0..p0+n``) taken at once, when the
        batch-by-batch checks would find nothing to say of any of them: none past retention,
        every id new and distinct, each stream's timestamps in order after its last. False:
        nothing was done (the caller takes them one by one)."""
        k1 = k0 + n
        ts = fast.ts_array[k0:k1]
        if ((ts // 86400 + self.retention_days) * 86400.0 <= now).any():  # expires_at, vectorised
            return False
        (src, src_v), (boot, boot_v), (node, node_v) = (fast.codes(c) for c in ("source", "boot_id", "node"))
        pairs, pair_of = np.unique(src[k0:k1] * len(boot_v) + boot[k0:k1], return_inverse=True)
        names = [(src_v[p // len(boot_v)], boot_v[p % len(boot_v)]) for p in pairs.tolist()]
        stream_hash = np.array([hash(sb) & _M for sb in names], dtype=np.uint64)
        keys = ident_keys(stream_hash[pair_of], fast.seq_array[k0:k1]).tolist()
        d = self._ids._d
        if len(set(keys)) != n or not d.keys().isdisjoint(keys):
            return False
        codes, sid = np.unique(pair_of.astype(np.int64) * len(node_v) + node[k0:k1], return_inverse=True)
        if len(codes) == 1:
            if n > 1 and (np.diff(ts) < 0).any():
                return False
            first, last = [0], [n - 1]
        else:
            order = np.argsort(sid, kind="stable")
            same = sid[order][1:] == sid[order][:-1]
            if (same & (np.diff(ts[order]) < 0)).any():
                return False
            first = order[np.r_[True, ~same]].tolist()
            last = order[np.r_[~same, True]].tolist()
        skeys = [("gpu_samples", *names[c // len(node_v)], node_v[c % len(node_v)]) for c in codes.tolist()]
        for key, i in zip(skeys, first, strict=True):
            prev = self._last.get(key)
            if prev is not None and ts[i] < prev[0]:
                return False
        origins, digests = unpacked.span_keys(slots, p0, p0 + n)
        self._ids.put_all(keys, digests, origins)
        for key, i in zip(skeys, last, strict=True):
            self._last[key] = (float(ts[i]), unpacked.origin_at(slots, p0 + i))
        taken.fast_pos.extend(range(p0, p0 + n))
        taken.fast_k.extend(range(k0, k1))
        return True

    def _unpack(self, items: list[Raw]) -> tuple[list[Raw | None], _Unpacked]:
        """``items`` with each pack (:mod:`gpuslo.wire.pack`) replaced by its batches, each an item
        of its own (origin ``ORIGIN#K``, the pack's ``K``-th batch, its digest the pack's): the
        batches that pass the fast path's checks are taken from the pack's columns (their slot
        is None, their item made only when one is asked for, with no bytes; its JSON is made
        only if it is refused, for its dead letter), the others carry their JSON for the models
        to decide. A pack that is not well formed stays one item, refused with the reason."""
        out = _Unpacked()
        at = [i for i, it in enumerate(items) if not it.refused and is_pack(it.value)]
        if not at:
            return list(items), out
        many = packed.unpack_many([items[i].value for i in at])
        seq: list[Raw | int] = list(items)  # each item as it is, or the index of its pack in ``units``
        units: list[tuple[Raw, int, int]] = []  # (pack, its first row in ``table``, its rows)
        row = 0
        for i, got in zip(at, many.outcome, strict=True):
            item = items[i]
            if isinstance(got, packed.PackError):
                seq[i] = replace(item, refused=f"invalid pack: {got.reason}")
            elif isinstance(got, Exception):  # a fault of the decoder is this message's, never the batch's
                seq[i] = replace(item, refused=f"pack cannot be decoded: {type(got).__name__}: {got}")
            else:
                seq[i] = len(units)
                units.append((item, row, got))
                row += got
        if not units:
            return [x for x in seq if isinstance(x, Raw)], out
        # one pass of the checks over every pack of the call (their cost is per call, not per row)
        table = many.table
        ok = self._checks(table, [table.slice(r, n) for _, r, n in units])
        out.good = table.filter(pa.array(ok)) if not ok.all() else table
        ok_l = ok.tolist()
        slots: list[Raw | None] = []
        row = 0
        for x in seq:
            if isinstance(x, Raw):
                slots.append(x)
                continue
            item, base, n = units[x]
            digests = many.digest[base : base + n]
            if all(ok_l[base : base + n]):
                out.add(len(slots), item, range(n), digests, row)
                slots.extend([None] * n)
                row += n
            else:
                for k in range(n):
                    if ok_l[base + k]:
                        out.add(len(slots), item, range(k, k + 1), digests[k : k + 1], row)
                        slots.append(None)
                        row += 1
                    else:
                        value = packed.as_json(table, base + k)
                        o = f"{item.origin}#{k}"
                        slots.append(Raw(o, value, item.topic, item.partition, item.offset, "", digests[k]))
        if row:
            positions: list[int] = []
            for b in out.blocks:
                positions.extend(range(b.pos, b.pos + len(b.ks)))
            out.decoded = fastpath.decoded(positions, out.good)
        return slots, out

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
        self, items: list[Raw | None], rep: IngestReport
    ) -> tuple[fastpath.Decoded | None, np.ndarray[Any, Any]]:
        """The vectorised decoding of the candidates among ``items`` (a None slot is a pack's
        batch, decoded already), and per position the index into it of the item decoded
        there (-1: not decoded; the models decide)."""
        at = np.full(len(items), -1, dtype=np.int64)
        if not self.fast_path:
            return None, at
        cand = [
            i
            for i, it in enumerate(items)
            if it is not None and not it.refused and fastpath.candidate(it.value)
        ]
        if not cand:
            return None, at
        try:
            fast, _ = fastpath.decode([items[i].value for i in cand])  # type: ignore[union-attr]
        except Exception:  # the models decide for every message then
            log.exception("the vectorised decoder failed on a batch; decoding it with the models")
            return None, at
        rep.vectorised = len(fast.positions)
        if fast.positions:
            at[np.asarray(cand)[np.asarray(fast.positions)]] = np.arange(len(fast.positions))
        return fast, at

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
        slots: list[Raw | None],
        unpacked: _Unpacked,
        refuse: Callable[[Raw, str], None],
    ) -> dict[str, Any]:
        """The typed columns of the taken messages. Whatever fails here (a value its column
        cannot hold) is found message by message and dead-lettered; the rest is built again."""
        try:
            return self._columns([m for _, m in taken.models], fast, taken.fast_k)
        except Exception as exc:
            log.warning("building the columns of a batch failed (%s); isolating the message(s)", exc)
        bad: set[int] = set()
        for pos, m in taken.models:
            if self._fails(unpacked.item(slots, pos), [m], None, [], refuse):
                bad.add(pos)
                self._ids.forget((m.source, m.boot_id, m.seq), unpacked.item(slots, pos).origin)
        for pos, k in zip(taken.fast_pos, taken.fast_k, strict=True):
            if fast is not None and self._fails(unpacked.item(slots, pos), [], fast, [k], refuse):
                bad.add(pos)
                ident = (fast.env.source[k], fast.env.boot_id[k], fast.env.seq[k])
                self._ids.forget(ident, unpacked.item(slots, pos).origin)
        return self._columns(
            [m for pos, m in taken.models if pos not in bad],
            fast,
            [k for pos, k in zip(taken.fast_pos, taken.fast_k, strict=True) if pos not in bad],
        )

    def _fails(
        self,
        item: Raw,
        good: list[Message],
        fast: fastpath.Decoded | None,
        keep: list[int],
        refuse: Callable[[Raw, str], None],
    ) -> bool:
        try:
            self._columns(good, fast, keep)
        except Exception as exc:
            refuse(item, f"cannot be stored: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            return True
        return False

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
            parts = p.staged.get(table) or by_partition(table, cols)
            rep.written[table] = sum(self.store.insert(table, part) for part in parts)
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


@dataclass(slots=True)
class _Block:
    """Consecutive batches of one pack that take the fast path: from slot ``pos``, the pack's
    batches ``ks``, their digests, and their rows in the good table from ``row``."""

    pos: int
    item: Raw
    ks: range
    digests: list[int]
    row: int


@dataclass
class _Unpacked:
    """The batches of a call's packs that take the fast path: their decoding (of the good
    table, their rows in slot order) and the blocks they came in; a batch's item is made
    only when it is asked for, and its JSON only for a dead letter."""

    decoded: fastpath.Decoded | None = None
    good: pa.Table | None = None
    blocks: list[_Block] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    _rows: dict[str, int] | None = None

    def add(self, pos: int, item: Raw, ks: range, digests: list[int], row: int) -> None:
        b = self.blocks[-1] if self.blocks else None
        if b is not None and b.item is item and b.pos + len(b.ks) == pos and b.ks.stop == ks.start:
            b.ks = range(b.ks.start, ks.stop)
            b.digests = b.digests + digests
            return
        self.blocks.append(_Block(pos, item, ks, list(digests), row))
        self.starts.append(pos)

    def _block(self, pos: int) -> _Block:
        return self.blocks[bisect_right(self.starts, pos) - 1]

    def item(self, slots: list[Raw | None], pos: int) -> Raw:
        """The item at ``pos``; a pack's batch is made (and kept) when first asked for."""
        got = slots[pos]
        if got is None:
            b = self._block(pos)
            i = pos - b.pos
            it = b.item
            got = slots[pos] = Raw(
                f"{it.origin}#{b.ks[i]}", b"", it.topic, it.partition, it.offset, "", b.digests[i]
            )
        return got

    def origin_at(self, slots: list[Raw | None], pos: int) -> str:
        """The origin of the item at ``pos``, without making a pack's batch's item."""
        got = slots[pos]
        if got is not None:
            return got.origin
        b = self._block(pos)
        return f"{b.item.origin}#{b.ks[pos - b.pos]}"

    def span_keys(self, slots: list[Raw | None], p0: int, p1: int) -> tuple[list[int], list[int]]:
        """The keys of the origins (:func:`origin_key`) and the digests of the items at
        ``p0..p1``, without making the packs' items: a pack's batches in one array operation."""
        okeys: list[int] = []
        digests: list[int] = []
        p = p0
        while p < p1:
            got = slots[p]
            if got is not None:
                okeys.append(origin_key(got.origin))
                digests.append(got.digest or content_digest(got.value))
                p += 1
                continue
            b = self._block(p)
            i0, i1 = p - b.pos, min(len(b.ks), p1 - b.pos)
            okeys += origin_keys(b.item.origin, np.asarray(b.ks[i0:i1])).tolist()
            digests += b.digests[i0:i1]
            p += i1 - i0
        return okeys, digests

    def row_of(self, origin: str) -> tuple[pa.Table, int] | None:
        """Where a pack's batch (by its origin) is in the good table, for its JSON."""
        if self.good is None:
            return None
        if self._rows is None:
            self._rows = {}
            for b in self.blocks:
                for i, k in enumerate(b.ks):
                    self._rows[f"{b.item.origin}#{k}"] = b.row + i
        row = self._rows.get(origin)
        return None if row is None else (self.good, row)


def _runs(at: np.ndarray[Any, Any]) -> dict[int, tuple[int, int]]:
    """The runs of vectorised rows in ``at`` (per position, its row or -1): consecutive
    positions with consecutive rows, as first position -> (length, first row)."""
    pos = np.flatnonzero(at >= 0)
    if not len(pos):
        return {}
    k = at[pos]
    cut = np.flatnonzero((np.diff(pos) != 1) | (np.diff(k) != 1)) + 1
    first = np.r_[0, cut]
    length = np.diff(np.r_[first, len(pos)])
    return dict(zip(pos[first].tolist(), zip(length.tolist(), k[first].tolist(), strict=True), strict=True))


def _merge(a: fastpath.Decoded, b: fastpath.Decoded) -> fastpath.Decoded:
    """Two decodings as one (``b``'s rows after ``a``'s)."""
    if not a.positions:
        return b
    return fastpath.Decoded(a.positions + b.positions, pa.concat_tables([a.table, b.table]))


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

"""Stores: the small interface the ingest, the rules and the dashboards speak to.

``insert(table, columns)`` takes one columnar batch; ``query(sql, params)`` returns rows
as dicts. SQL uses ClickHouse's native ``{name:Type}`` query parameters, so the same text
runs on chDB (embedded) and on a ClickHouse server.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuslo.ingest import arrow_values
from gpuslo.ingest.failures import Failure as Failure
from gpuslo.ingest.failures import StoreError as StoreError
from gpuslo.ingest.failures import classify_code, code_in_text
from gpuslo.ingest.native import Unsupported
from gpuslo.ingest.native import encode as native_encode
from gpuslo.ingest.schema import (
    COLUMN_UPGRADES,
    FORMER_PART_SETTINGS,
    GPU_SAMPLES_PART_SETTING,
    GPU_SAMPLES_PART_UPGRADE,
    Schema,
)
from gpuslo.ingest.sqltext import param_text as param_text  # re-exported: the stores' one parameter form
from gpuslo.ingest.sqltext import quote

log = logging.getLogger(__name__)

Row = dict[str, Any]


_SCALARS = {
    "String": pa.string(),
    "UInt8": pa.uint8(),
    "UInt16": pa.uint16(),
    "UInt32": pa.uint32(),
    "UInt64": pa.uint64(),
    "Int16": pa.int16(),
    "Int32": pa.int32(),
    "Int64": pa.int64(),
    "Float32": pa.float32(),
    "Float64": pa.float64(),
}


def arrow_type(ch: str) -> Any:
    """The Arrow type we hand chDB for a ClickHouse column type (times go in as epoch seconds)."""
    for wrapper in ("Nullable(", "LowCardinality("):
        if ch.startswith(wrapper):
            return arrow_type(ch[len(wrapper) : -1])
    if ch.startswith("Array("):
        return pa.list_(arrow_type(ch[len("Array(") : -1]))
    if ch.startswith("Map("):
        key, value = ch[len("Map(") : -1].split(", ", 1)
        return pa.map_(arrow_type(key), arrow_type(value))
    if ch.startswith("DateTime"):
        return pa.float64()
    t = _SCALARS.get(ch)
    if t is None:
        raise StoreError(f"no Arrow mapping for ClickHouse type {ch}", Failure.FATAL)
    return t


def _arrow_for(t: Any, values: Sequence[Any]) -> Any:
    """Raw bytes (dead letters) go in as binary: they need not be UTF-8."""
    if t == pa.string() and any(isinstance(v, bytes) for v in values):
        return pa.binary()
    return t


def _column(values: Any, t: Any) -> Any:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):  # already columnar
        return values if t is None or values.type == t else values.cast(t)
    return pa.array(values, type=_arrow_for(t, values))


class Store(ABC):
    @abstractmethod
    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None: ...

    @abstractmethod
    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        """Insert one columnar batch; returns the row count. Atomic per partition (ClickHouse
        writes one part per partition; the embedded store inserts a batch spanning days a day
        at a time): a batch retried after a failure may write a partition again, which the
        ingest's tables collapse (ReplacingMergeTree, read with FINAL)."""

    @abstractmethod
    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        """The rows as dicts. A ``String`` value is a ``str`` where it is UTF-8, else its bytes
        as stored (clickhouse-driver's meaning; a dead letter's raw message is any bytes), at
        any depth."""

    def query_columns(
        self, sql: str, params: Mapping[str, Any] | None = None, names: Sequence[str] | None = None
    ) -> dict[str, list[Any]]:
        """The result as columns (name -> values in row order), for results too big to take a
        dict per row (a month's starvation incidents); ``names``: only those of its columns (the
        others are not converted). Default: from :meth:`query` (no rows: no columns; a caller
        reads a missing column as empty)."""
        rows = self.query(sql, params)
        keys = list(rows[0]) if rows else []
        return {k: [r[k] for r in rows] for k in keys if names is None or k in names}

    def prepare_columns(self, table: str, columns: Mapping[str, Sequence[Any]]) -> Any:
        """Convert a batch to what ``insert`` sends, ahead of time (default: as it is)."""
        return columns

    def stage(self, table: str, prepared: Any) -> Any:
        """A prepared batch (:meth:`prepare_columns`) made ready to send, ahead of time and off
        the writer's thread: what ``insert`` takes in its place (default: as it is). Never
        raises: whatever cannot be staged is sent as it is, and ``insert`` decides it."""
        return prepared

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def interrupt(self) -> None:  # noqa: B027 - optional hook
        """From another thread: make an operation waiting on the store (a server that stopped
        answering) fail now as TRANSIENT, so that a stopping service is not held by it. What was
        being written counts as unwritten. Default: nothing (an in-process store does not wait)."""

    #: Whether the store holds the rollups' marks of what it was given in memory until
    #: :meth:`flush_marks` (the embedded store: ``ChdbStore.buffer_marks``); the ingest then
    #: commits a batch's offsets only after a flush.
    buffers_marks = False

    def flush_marks(self) -> None:  # noqa: B027 - optional hook
        """Make durable the rollups' marks the store holds in memory (default: it holds none:
        the views write them with the rows). Raises :class:`StoreError` where it cannot: they
        are kept, and the next flush tries again."""

    def migrate(self, schema: Schema) -> None:
        """Create what ``schema`` declares that the store lacks (every statement is idempotent).
        The caller names the schema: a store that serves the rules needs theirs too
        (``gpuslo.rules.tables.SCHEMA``). An ``ALTER`` runs only where it changes something
        (a column missing, the part setting not yet the table's): every process runs this at its
        start, and chDB rewrites a table's metadata file at each ``ALTER``, even one that changes
        nothing; on a full disk it wrote it empty, and the store never opened again (found by the
        session-30 attack: a rules service restarted after a refresh on a full disk)."""
        tables = {
            str(r["name"]): (str(r["engine"]), str(r["engine_full"]))
            for r in self.query(
                "SELECT name, engine, engine_full FROM system.tables WHERE database = currentDatabase()"
            )
        }
        creates = schema.create()
        missing = [s for s in creates if (m := _CREATED.match(s)) and m.group(1) not in tables]
        alters = self._upgrades(tables)
        if missing or alters:
            self.schema_changes([*missing, *alters])
        for stmt in creates:
            self.execute(stmt)
        for stmt in alters:
            self.execute(stmt)

    def _upgrades(self, tables: Mapping[str, tuple[str, str]]) -> list[str]:
        """The ``ALTER``s a store made before needs (none for a table this migration creates):
        columns added since (every process that opens the store, the rules' too, may read them
        before the ingest's upgrade has run), and the part-format setting unless the table names
        one of an operator's (part_setting_is_ours; a Distributed gpu_samples is not altered)."""
        have: dict[str, set[str]] = {}
        for r in self.query(
            "SELECT table, name FROM system.columns WHERE database = currentDatabase() "
            f"AND table IN ({', '.join(quote(t) for t in COLUMN_UPGRADES)})"
        ):
            have.setdefault(str(r["table"]), set()).add(str(r["name"]))
        out = [
            stmt
            for table, stmt in COLUMN_UPGRADES.items()
            if table in have and set(_ADDED.findall(stmt)) - have[table]
        ]
        engine, engine_full = tables.get("gpu_samples", ("", ""))
        if (
            engine.endswith("MergeTree")
            and part_setting_is_ours(engine_full)
            and GPU_SAMPLES_PART_SETTING not in engine_full
        ):
            out.append(GPU_SAMPLES_PART_UPGRADE)
        return out

    def schema_changes(self, statements: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Called before ``migrate`` changes the schema (``statements``: what it will run that
        creates or alters something): a store that cannot take them safely raises here."""


_CREATED = re.compile(r"\s*CREATE (?:TABLE|MATERIALIZED VIEW|VIEW) IF NOT EXISTS `?(\w+)`?")
_ADDED = re.compile(r"ADD COLUMN IF NOT EXISTS (\w+)")
_ALTER = re.compile(r"\s*ALTER\s+TABLE\b", re.IGNORECASE)
#: The free disk below which the embedded store refuses a schema change (a metadata file is a few
#: KiB; a disk this near full is full by the time the ingest's next part lands).
SCHEMA_CHANGE_FREE_BYTES = 16 * 1024 * 1024


#: The MergeTree settings that choose a part's format: a table naming any of them (other than a
#: former gpuslo value alone) carries an operator's choice.
PART_FORMAT_SETTINGS = frozenset(
    ("min_bytes_for_wide_part", "min_rows_for_wide_part", "min_level_for_wide_part")
)


def part_setting_is_ours(engine_full: str) -> bool:
    """Whether a ``gpu_samples`` table (``system.tables.engine_full``) names no part format of an
    operator's: none at all, or exactly a former gpuslo default (``FORMER_PART_SETTINGS``) and
    nothing else of the kind. Its settings close the text: ``... SETTINGS a = 1, b = 2`` (the
    last ``SETTINGS``: a TTL's string may hold the word too; a MergeTree's always shows its
    ``index_granularity``). Where in doubt, the table keeps what it has."""
    _, found, settings = engine_full.rpartition(" SETTINGS ")
    pieces = [p.strip() for p in settings.split(",")] if found else []
    named = [p for p in pieces if p.partition("=")[0].strip() in PART_FORMAT_SETTINGS]
    return not named or (len(named) == 1 and named[0] in FORMER_PART_SETTINGS)


# ReplacingMergeTree merges every insert block on arrival by default (optimize_on_insert):
# rows of one key in one block collapse before the part is written. That merge was most of
# the store's insert time (a twin table written from memory: 31,000-78,000 GPU rows/s with
# it, 214,000-349,000 without; bench ingest measures it every run). Every read that needs
# one row per key says FINAL (or reads duplicate-insensitively: max, argMax, DISTINCT),
# because a key's rows from different batches are only collapsed by a background merge
# anyway; FINAL collapses rows of one block the same way (the last of equal versions
# wins, as the insert-time merge chose). ClickHouse has had the setting since 21.1.
# One thread per insert (max_threads = 1): an ingest process is a consumer thread decoding the
# next batch beside one writer thread inserting this one, and it scales out as more processes in
# the consumer group. Spreading one insert over more threads cost more than it gave here: the
# same 8 inserts of 40,000 GPU rows took 0.379 s against 0.418 s alone, 0.433 s against 0.462 s
# beside a thread decoding (medians of 12 alternated rounds, 2 cores, chDB 4.4).
INSERT_SETTINGS = "optimize_on_insert = 0, max_threads = 1"

# Below this many rows a batch goes in as Arrow IPC stream bytes through chDB's streaming
# insert, from this many on through the Python() table function over the Arrow table.
# Measured on the same rows, interleaved (bench/insert_paths.py, loaded 2 cores), medians:
# 800-row batches 20,925 vs 13,690 GPU rows/s (Python() costs some 20 ms more per call);
# 40,000-row batches 58,906 vs 85,154 (serialising 68 columns costs more than that call).
# Through file() instead (chDB 4.4: see ChdbStore.stream_raises) small batches still go in
# faster as IPC bytes: 800-row batches 36,166 vs 32,285 GPU rows/s (session 18, loaded machine).
STREAM_BELOW_ROWS = 20_000

# A Native block names each column's type as it travels (times as Float64: ingest.native);
# the engine converts it to the column's, as the Arrow paths do. Explicit, whatever a chDB's
# default (the setting exists since ClickHouse 23.x; chDB 2.1 has no streaming insert at all).
NATIVE_SETTINGS = ", input_format_native_allow_types_conversion = 1"


def file_insert_sql(
    table: str, names: Sequence[str], path: str, settings: str = INSERT_SETTINGS, fmt: str = "ArrowStream"
) -> str:
    """The insert of a file in ``fmt`` (``ArrowStream``: the store's path on a chDB without
    ``send_insert``; any encoded batch where the streaming insert would lose the engine's error)."""
    cols = ", ".join(f"`{c}`" for c in names)
    return f"INSERT INTO {table} ({cols}) SETTINGS {settings} SELECT * FROM file({quote(path)}, {quote(fmt)})"


_TO_DATE = re.compile(r"toDate\((\w+)\)")
# a statement that may change a table's columns, engine or partition key: the store's answers
# about its tables (column types, day column) are asked again after one
_DDL = re.compile(r"\s*(CREATE|DROP|RENAME|EXCHANGE|ALTER|ATTACH|DETACH|REPLACE)\b", re.IGNORECASE)
# statements that only read: every other one may write parts, and is checked (ChdbStore._check_writes)
_READS = re.compile(r"\s*(SELECT|WITH|SHOW|DESCRIBE|DESC|EXISTS|EXPLAIN)\b", re.IGNORECASE)
# chDB counts a write into a part's file that failed (EFBIG, ENOSPC midway, EIO) and still ends
# the INSERT, merge or OPTIMIZE as done: the part is active in memory, its files short or empty,
# and the next start detaches it as broken, its rows gone (chDB 4.4, ClickHouse 26.9)
_WRITE_FAILURES = (
    "SELECT toUInt64(sum(value)) FROM system.events WHERE event = 'WriteBufferFromFileDescriptorWriteFailed'"
)


def by_day(batch: pa.Table, column: str | None) -> list[pa.Table]:
    """``batch`` as one table per UTC day of ``column`` (epoch seconds), in day order, where it
    holds more than one day (else as it is). chDB's insert of a batch that spans partitions
    costs about three times the insert of the same rows in one (the insert's block squashing,
    measured on chDB 4 / ClickHouse 26: 160,000 GPU rows over two days 0.67-0.74 s, over one
    0.19-0.21 s); a backlog's batch spans days. One copy of the rows (a stable sort by day),
    then zero-copy slices."""
    if column is None or column not in batch.column_names or batch.num_rows < 2:
        return [batch]
    ts = batch.column(column)
    if not pa.types.is_floating(ts.type) or ts.null_count or pc.any(pc.is_nan(ts)).as_py():
        return [batch]  # the insert says what is wrong with it, as it would have
    day = pc.floor(pc.divide(ts, 86400.0))
    lo, hi = pc.min_max(day).values()
    if lo.as_py() == hi.as_py():
        return [batch]
    order = pc.sort_indices(day)  # stable: a day keeps its rows' order
    days = pc.take(day, order).to_numpy()
    rows = batch.take(order)
    cuts = [0, *(np.flatnonzero(np.diff(days)) + 1).tolist(), len(days)]
    return [rows.slice(a, b - a) for a, b in itertools.pairwise(cuts)]


def _tmpfs() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # None: the system's temp dir


# file() reads an open descriptor's file through this (Linux): a spilled batch's file is unlinked
# as soon as it is written, so nothing is left behind whatever ends the process
_FD_DIR = "/proc/self/fd"


class Spill:
    """Encoded bytes in a file on tmpfs (where there is one) that ``file()`` reads. On Linux
    the file is unlinked at once and read through ``/proc/self/fd/N`` (chDB runs in this
    process): it goes when its descriptor closes, with this object or with the process,
    however that ends. Elsewhere the named file is removed with this object. Raises OSError
    (a full or read-only temporary directory)."""

    def __init__(self, data: bytes, fmt: str) -> None:
        fd, path = tempfile.mkstemp(prefix="gpuslo-insert-", suffix=f".{fmt.lower()}", dir=_tmpfs())
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(data)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        self._done: Callable[[], Any]
        if os.path.isdir(_FD_DIR):
            _unlink(path)
            self.path = f"{_FD_DIR}/{fd}"
            self._done = weakref.finalize(self, os.close, fd)
        else:
            os.close(fd)
            self.path = path
            self._done = weakref.finalize(self, _unlink, path)
        self.fmt = fmt

    def close(self) -> None:
        self._done()


class _NoSpill(StoreError):
    """No file for encoded bytes (:class:`Spill`: a full, missing or read-only temporary
    directory): transient to a caller of ``insert_encoded``; the store's own insert of an Arrow
    batch takes it through ``Python()`` instead, in memory."""


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):  # gone already
        os.unlink(path)


def arrow_stream(batch: pa.Table) -> bytes:
    """The Arrow IPC stream format of ``batch`` (ClickHouse's ``ArrowStream``)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_table(batch)
    return bytes(sink.getvalue().to_pybytes())


@dataclass(frozen=True)
class Staged:
    """A batch made ready for chDB ahead of the insert (:meth:`ChdbStore.stage`): its parts
    (one per day, ``by_day``), each with its ``Native`` bytes (None: sent another way)."""

    batch: pa.Table
    parts: tuple[tuple[pa.Table, bytes | None], ...]

    @property
    def num_rows(self) -> int:
        return int(self.batch.num_rows)

    @property
    def column_names(self) -> list[str]:
        return list(self.batch.column_names)

    def column(self, name: str) -> Any:
        """The batch's column (read as the table's: a store that wraps ``insert`` may look)."""
        return self.batch.column(name)


#: The rollups' marks, and (in the embedded store) the MergeTree behind their Buffer.
MARKS = "rollup_dirty"
MARKS_STORE = "rollup_dirty_store"


# flushed by flush_marks (the ingest before it commits, the file ingest and the demo after each
# batch, the store as it closes), and by an insert that takes it past 1,000,000 marks or 128 MiB
# (a bigger insert goes straight through); never by chDB's background thread on a timer (its
# times are a year): a read of a Buffer takes the MergeTree's parts when it starts and the
# Buffer's rows after, so a flush between the two hid the flushed marks from it (found by the
# session-23 attack). Every statement of the store holds its lock: no flush runs inside a read.
def marks_buffer(into: str) -> str:
    """The engine of the marks' Buffer in front of the MergeTree ``into``."""
    return (
        f"Buffer(currentDatabase(), {into}, 1, {_YEAR_S}, {_YEAR_S}, 1000000, 1000000, 134217728, 134217728)"
    )


_YEAR_S = 365 * 86400


class ChdbStore(Store):
    """Embedded ClickHouse (chDB) with its data in ``path``. chDB holds the directory
    exclusively: one process per data directory.

    Where chDB's streaming insert (``send_insert``) raises the engine's errors
    (:meth:`stream_raises`), a batch goes in through it as ClickHouse ``Native`` bytes
    (:mod:`ingest.native`, encoded from the Arrow table by the thread that stages it). chDB
    4.4's does not (it reports a refused batch as written), so there a batch goes in as Arrow:
    a large one (``STREAM_BELOW_ROWS``) through the ``Python()`` table function, a small one
    (or one the encoder does not write) as IPC stream bytes, in a temporary file on tmpfs read
    by ``file()`` (:class:`Spill`) where the streaming insert would drop its errors. On a chDB
    without a streaming insert (2.1, ClickHouse 24.8) every batch goes in as IPC stream bytes
    through ``file()``. ``bench ingest`` measures
    these and the other ways chDB takes a batch (Parquet, RowBinary bytes) on the same rows
    in every run.
    """

    def __init__(self, path: str | Path) -> None:
        from chdb import session  # imported here: only the embedded mode needs it

        make_session: Any = session.Session  # chDB ships no type hints

        self.path = Path(path)
        try:
            str(self.path).encode("utf-8")
        except UnicodeEncodeError:  # chDB takes its path as UTF-8 text only
            raise StoreError(
                f"cannot open embedded store at {str(self.path).encode('utf-8', 'backslashreplace').decode()}: "
                "its path is not UTF-8, and chDB opens UTF-8 paths only (name the directory in UTF-8)",
                Failure.FATAL,
            ) from None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission, a read-only or full disk
            raise StoreError(
                f"cannot create embedded store at {self.path}: {exc.strerror}", Failure.FATAL
            ) from None
        try:
            self._sess: Any = make_session(str(self.path))
        except Exception as exc:
            raise StoreError(
                f"cannot open embedded store at {self.path}: {exc} "
                "(is another gpuslo process using this directory?)",
                Failure.FATAL,
            ) from exc
        self._lock = threading.Lock()
        self._types: dict[str, dict[str, Any]] = {}
        self._ch_types: dict[str, dict[str, str]] = {}
        self._day_columns: dict[str, str | None] = {}
        self._said: set[tuple[str, str]] = set()  # (table, why) of what is logged once
        self._stream_raises: bool | None = None  # asked once (stream_raises)
        self._write_failures = self._count_write_failures()  # chDB's count, as last looked at

    def migrate(self, schema: Schema) -> None:
        super().migrate(schema)
        self.buffer_marks()

    def schema_changes(self, statements: Sequence[str]) -> None:
        """Refuse a schema change on a disk with less than ``SCHEMA_CHANGE_FREE_BYTES`` free: chDB
        writes a table's metadata file empty when the disk fills under it, and the store then
        never opens again (``Cannot parse definition from metadata file``)."""
        try:
            st = os.statvfs(self.path)
        except OSError:  # not known: the change is tried, as before
            return
        free = st.f_bavail * st.f_frsize
        if free < SCHEMA_CHANGE_FREE_BYTES:
            first = " ".join(statements[0].split()[:6]) if statements else ""
            raise StoreError(
                f"the disk of the embedded store at {self.path} has {free} bytes free: its schema is not "
                f"changed ({len(statements)} statement(s), first: {first} ...), as chDB would write the "
                "table's metadata empty and the store would not open again; free the disk first",
                Failure.FATAL,
            )

    def buffer_marks(self) -> None:
        """Put the rollups' marks (``rollup_dirty``, written by the views on the raw tables with
        every insert) behind a ``Buffer`` in memory, flushed to their MergeTree (``MARKS_STORE``)
        by :meth:`flush_marks`: the ingest flushes before it commits, once for many batches
        under a backlog. The part each insert's marks made cost as much as a sixth of the
        insert (``bench ingest``). Reads of ``rollup_dirty`` see both. Nothing of chDB's outlives
        its process, so the marks a crash loses are those of batches never committed, which
        are read and marked again. A store made before is converted (its marks kept), step
        by step so that one stopped midway converts on its next start (a mark copied twice
        only re-rolls its minute again). No-op without the rules' tables. A ClickHouse server
        keeps its views writing straight to the MergeTree: its buffer would not die with the
        ingest that counts on it."""
        engines = {
            r["name"]: r["engine"]
            for r in self.query(
                "SELECT name, engine FROM system.tables WHERE database = currentDatabase() "
                "AND name IN ({marks:String}, {store:String})",
                {"marks": MARKS, "store": MARKS_STORE},
            )
        }
        if MARKS in engines and not engines[MARKS].endswith("MergeTree") and engines[MARKS] != "Buffer":
            # an operator's own table (its marks would not be copied by parts): the views keep
            # writing it, the ingest commits as they write
            self._say_once(
                logging.WARNING,
                MARKS,
                "engine",
                "%s is a %s, not a MergeTree: its marks are not buffered",
                engines[MARKS],
            )
        elif engines.get(MARKS) != "Buffer" and MARKS in engines:
            self.execute(f"CREATE TABLE IF NOT EXISTS {MARKS_STORE} AS {MARKS}")
            views = [
                r["q"]
                for r in self.query(
                    "SELECT create_table_query AS q FROM system.tables "
                    "WHERE database = currentDatabase() AND engine = 'MaterializedView'"
                )
                if re.search(rf" TO (?:\w+\.)?`?{MARKS}`? ", r["q"])
            ]
            for q in views:
                name = re.match(r"CREATE MATERIALIZED VIEW (\S+)", q)
                if name:
                    self.execute(f"DROP VIEW IF EXISTS {name.group(1)}")
            parts = self.query(
                "SELECT DISTINCT partition_id AS p FROM system.parts "
                "WHERE database = currentDatabase() AND table = {marks:String} AND active",
                {"marks": MARKS},
            )
            for part in parts:
                self.execute(f"ALTER TABLE {MARKS_STORE} ATTACH PARTITION ID {quote(part['p'])} FROM {MARKS}")
            self.execute(f"DROP TABLE {MARKS}")
            self.execute(f"CREATE TABLE {MARKS} AS {MARKS_STORE} ENGINE = {marks_buffer(MARKS_STORE)}")
            for q in views:
                self.execute(q)
            engines[MARKS] = "Buffer"
        self.buffers_marks = engines.get(MARKS) == "Buffer"

    def flush_marks(self) -> None:
        if self.buffers_marks:
            self.execute(f"OPTIMIZE TABLE {MARKS}")  # a Buffer's: flushed, or an error and kept

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        if _ALTER.match(sql):  # (a retention set, a re-key: the same metadata rewrite as migrate's)
            self.schema_changes([sql])
        try:
            self._run(sql, "CSV", params)
        finally:
            if _DDL.match(sql):  # a table made, dropped or altered: ask about it again
                self._types.clear()
                self._ch_types.clear()
                self._day_columns.clear()

    def prepare_columns(self, table: str, columns: Mapping[str, Sequence[Any]]) -> Any:
        """An Arrow table with the store's column types (raw bytes as binary)."""
        if isinstance(columns, pa.Table):
            return columns
        types = self._arrow_types(table)
        try:
            return pa.table({c: _column(v, types.get(c)) for c, v in columns.items()})
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise StoreError(f"cannot build a columnar batch for {table}: {exc}") from exc

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        if isinstance(columns, Staged):
            for part, data in columns.parts:
                self._insert_part(table, part, data)
            return columns.num_rows
        if not isinstance(columns, pa.Table) and not columns:
            return 0
        batch = self.prepare_columns(table, columns)
        n = batch.num_rows
        if n == 0:
            return 0
        for part in by_day(batch, self._day_column(table)):
            self._insert_part(table, part, self.native(table, part))
        return int(n)

    def stage(self, table: str, prepared: Any) -> Any:
        """The batch split by day (``by_day``) and each part encoded as ``Native`` where the
        store sends Native (:meth:`native`): the work of an insert that needs no lock, done by
        the caller's thread (the ingest's consumer, while the writer inserts the batch before).
        Elsewhere the batch as it is."""
        if not isinstance(prepared, pa.Table) or prepared.num_rows == 0 or not self._sends_native():
            return prepared
        try:
            parts = by_day(prepared, self._day_column(table))
        except StoreError:  # the store is down: the insert asks again, and says so
            return prepared
        return Staged(prepared, tuple((part, self.native(table, part)) for part in parts))

    def _sends_native(self) -> bool:
        """Native goes in through chDB's streaming insert, in memory, and only where that
        insert raises the engine's errors (:meth:`stream_raises`). Through ``file()`` instead
        (chDB 4.4) it lost to ``Python()`` end to end: the same ingest with each in turn, 3
        pack runs each, 0.71-0.82 s against 0.62-0.70 s for 320,000 GPU rows (the encoding and
        the file's write, 0.15-0.2 s of the consumer thread's CPU, made that thread the
        bottleneck; the insert itself was no faster through the file)."""
        return self.insert_native and self.streaming and self.stream_raises()

    def native(self, table: str, batch: pa.Table) -> bytes | None:
        """``batch`` as ``Native`` bytes for ``table``, or None where it goes in another way:
        the store does not send Native (:meth:`_sends_native`: this chDB has no streaming
        insert, or one that drops the engine's errors, or the store is set not to,
        ``insert_native``), or the batch holds what the encoder does not write (logged once
        per table and reason)."""
        if batch.num_rows == 0 or not self._sends_native():
            return None
        try:
            return native_encode(batch, self._column_types(table))
        except Unsupported as exc:
            self._say_once(logging.INFO, table, str(exc), "inserting %s as Arrow, not Native: %s", exc)
            return None
        except StoreError:  # the store is down: the insert asks again, and says so
            return None
        except Exception as exc:  # what the encoder did not foresee: the Arrow way decides the batch
            why = f"{type(exc).__name__}: {exc}"
            self._say_once(
                logging.WARNING, table, why, "inserting %s as Arrow, not Native (the encoder failed): %s", why
            )
            return None

    def _say_once(self, level: int, table: str, why: str, msg: str, detail: Any) -> None:
        """``msg % (table, detail)`` logged the first time ``(table, why)`` happens."""
        if (table, why) not in self._said:
            self._said.add((table, why))
            log.log(level, msg, table, detail)

    def _insert_part(self, table: str, part: pa.Table, native: bytes | None) -> None:
        if not self.streaming:
            self.insert_file(table, part)
        elif native is not None:
            self.insert_encoded(table, part.column_names, "Native", native)
        elif part.num_rows < self.stream_below_rows:
            try:
                self.insert_encoded(table, part.column_names, "ArrowStream", arrow_stream(part))
            except _NoSpill as exc:  # no room for the file (a small or full /dev/shm): in memory
                self._say_once(
                    logging.WARNING, table, "spill", "inserting %s through Python(), not a file: %s", exc
                )
                self.insert_python(table, part)
        else:
            self.insert_python(table, part)

    def _day_column(self, table: str) -> str | None:
        """The column whose UTC day partitions ``table`` (``PARTITION BY toDate(col)``) where a
        batch may go in one insert per day (``by_day``): a ReplacingMergeTree, whose rows a retry
        of a batch half written writes again without doubling them. None: one insert."""
        try:  # one read: another thread's DDL may clear the answers meanwhile
            return self._day_columns[table]
        except KeyError:
            pass
        rows = self._run(
            "SELECT engine, partition_key FROM system.tables "
            f"WHERE database = currentDatabase() AND name = {quote(table)}",
            "ArrowTable",
            None,
        ).to_pylist()
        if not rows:  # no such table (yet): no answer to keep
            return None
        col = None
        if rows[0]["engine"].startswith("Replacing"):
            m = _TO_DATE.fullmatch(rows[0]["partition_key"])
            col = m.group(1) if m else None
        self._day_columns[table] = col
        return col

    # what the benchmark varies: the settings of every insert, the size that picks the path
    # between the two Arrow ways, whether Native bytes are sent
    insert_settings = INSERT_SETTINGS
    stream_below_rows = STREAM_BELOW_ROWS
    insert_native = True

    @property
    def streaming(self) -> bool:
        """Whether this chDB takes encoded bytes (``send_insert``: chDB 4 has it, 2.1 not)."""
        return hasattr(self._sess, "send_insert")

    def insert_file(self, table: str, batch: pa.Table) -> None:
        """The Arrow table as IPC stream bytes in a private temporary file (:class:`Spill`),
        read by ``file()``: the path of a chDB without a streaming insert, whose ``Python()``
        cannot take Arrow lists (chDB 2.1: "CAST AS Array can only be performed between
        same-dimensional Array"). A full or read-only temporary directory: transient."""
        self._insert_bytes_file(
            table, batch.column_names, "ArrowStream", arrow_stream(batch), self.insert_settings
        )

    def insert_python(self, table: str, batch: pa.Table) -> None:
        """The Arrow table through chDB's ``Python()`` table function."""
        cols = ", ".join(f"`{c}`" for c in batch.column_names)
        # chDB's Python() table function resolves the name ``batch`` in this frame.
        self._run(f"INSERT INTO {table} ({cols}) SETTINGS {self.insert_settings} SELECT * FROM Python(batch)",
                  "CSV", None)  # fmt: skip

    def insert_encoded(self, table: str, names: Sequence[str], fmt: str, data: bytes) -> int:
        """One batch already encoded in a ClickHouse input format (``ArrowStream``,
        ``Parquet``, ``Native``, ``RowBinary``...): through chDB's streaming insert where it
        raises the engine's errors (:meth:`stream_raises`), else in a temporary file read by
        ``file()``; returns the rows written as chDB counts them. A chDB without
        ``send_insert`` is a fatal store error (it has no ``Native`` path either)."""
        send = getattr(self._sess, "send_insert", None)
        if send is None:
            raise StoreError("this chDB has no streaming insert (send_insert)", Failure.FATAL)
        cols = ", ".join(f"`{c}`" for c in names)
        settings = self.insert_settings + (NATIVE_SETTINGS if fmt == "Native" else "")
        if not self.stream_raises():
            return self._insert_bytes_file(table, names, fmt, data, settings)
        with self._lock:
            try:
                with send(f"INSERT INTO {table} ({cols}) SETTINGS {settings}", fmt) as ins:
                    ins.append(data)
                    rows = int(ins.finish().rows_written)
            except Exception as exc:
                self._check_writes(f"INSERT INTO {table} FORMAT {fmt}", failed=exc)
                code = code_in_text(str(exc))
                # the engine read past the end of bytes handed to it in memory: the bytes are
                # short (an encoder's bug), not a connection lost (what the code means elsewhere)
                failure = Failure.REFUSED if code == 32 else classify_code(code)
                raise StoreError(f"{exc}\n-- inserting {fmt} into {table}", failure, code) from exc
            self._check_writes(f"INSERT INTO {table} FORMAT {fmt}")
            return rows

    def stream_raises(self) -> bool:
        """Whether this chDB's streaming insert raises what the engine raises once it has read
        the bytes: a constraint, too many parts or partitions for one insert, a full disk, a
        materialized view's failure. chDB 4.4's does not (its insert worker drops the exception
        that ends the query): ``finish()`` reports the rows written where none is, and the
        ingest would commit a batch never stored. Asked once, of a temporary table with a
        constraint the probe row breaks; where it cannot be told, not (asked again next time)."""
        if self._stream_raises is not None:
            return self._stream_raises
        probe = "gpuslo_stream_probe"
        with self._lock:
            if self._stream_raises is not None:  # another thread asked while this one waited
                return self._stream_raises
            try:
                self._sess.query(
                    f"CREATE TEMPORARY TABLE IF NOT EXISTS {probe} (a UInt8, CONSTRAINT one CHECK a = 0) "
                    "ENGINE = Memory",
                    "CSV",
                )
            except Exception:  # the store is down: the insert's own query says so
                return False
            try:
                with self._sess.send_insert(f"INSERT INTO {probe} (a)", "CSV") as ins:
                    ins.append(b"1\n")
                    ins.finish()
                raises = False
            except Exception as exc:  # only the constraint's own error shows it raises (469)
                raises = code_in_text(str(exc)) == 469
            finally:
                try:
                    self._sess.query(f"DROP TEMPORARY TABLE IF EXISTS {probe}", "CSV")
                except Exception:
                    log.debug("could not drop %s", probe, exc_info=True)
            self._stream_raises = raises  # under the lock: a thread waiting on it reads the answer
        if not raises:  # expected of the chDB pinned (4.4): said once per store, not warned of
            log.info(
                "this chDB's streaming insert does not raise the engine's errors: batches go in through file()"
            )
        return raises

    def _insert_bytes_file(
        self, table: str, names: Sequence[str], fmt: str, data: bytes, settings: str
    ) -> int:
        """Encoded bytes in a private temporary file (:class:`Spill`) read by ``file()``: an
        insert whose every error the query raises (see :meth:`stream_raises`)."""
        try:
            spill = Spill(data, fmt)
        except OSError as exc:  # a full or read-only temporary directory: retry later
            raise _NoSpill(f"cannot stage a batch for {table}: {exc}", Failure.TRANSIENT) from exc
        try:
            res = self._run(file_insert_sql(table, names, spill.path, settings, fmt), "CSV", None)
        finally:
            spill.close()
        rows = getattr(res, "rows_written", 0)
        return int(rows() if callable(rows) else rows)

    def _arrow_types(self, table: str) -> dict[str, Any]:
        types = self._types.get(table)
        if types is None:
            types = {name: arrow_type(t) for name, t in self._column_types(table).items()}
            self._types[table] = types
        return types

    def _column_types(self, table: str) -> dict[str, str]:
        """The ClickHouse type of each of ``table``'s columns (asked once, until a DDL)."""
        types = self._ch_types.get(table)
        if types is None:
            rows = self._run(
                f"SELECT name, type FROM system.columns WHERE database = currentDatabase() AND table = {quote(table)}",
                "ArrowTable",
                None,
            ).to_pylist()
            if not rows:
                raise StoreError(f"no table {table!r} in the store (run migrate first)", Failure.FATAL)
            types = {r["name"]: r["type"] for r in rows}
            self._ch_types[table] = types
        return types

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        return arrow_values.rows(self._run(sql, "ArrowTable", params))

    def query_columns(
        self, sql: str, params: Mapping[str, Any] | None = None, names: Sequence[str] | None = None
    ) -> dict[str, list[Any]]:
        t = self._run(sql, "ArrowTable", params)
        if names is not None:
            t = t.select([n for n in t.column_names if n in names])
        return arrow_values.columns(t)

    def _run(self, sql: str, fmt: str, params: Mapping[str, Any] | None) -> Any:
        with self._lock:
            try:
                if params:
                    res = self._sess.query(sql, fmt, params={k: param_text(v) for k, v in params.items()})
                else:
                    res = self._sess.query(sql, fmt)
            except Exception as exc:  # chDB raises text: the server's code is in it
                self._check_writes(sql, failed=exc)
                code = code_in_text(str(exc))
                raise StoreError(f"{exc}\n-- in query:\n{sql[:2000]}", classify_code(code), code) from exc
            if not _READS.match(sql):
                self._check_writes(sql)
            return res

    def _count_write_failures(self) -> int:
        """chDB's count of failed writes into files (in this process, since it started); -1
        where it cannot be read (the next check reads it again)."""
        try:
            return int(str(self._sess.query(_WRITE_FAILURES, "CSV")).strip() or 0)
        except Exception:
            return -1

    def _check_writes(self, what: str, failed: BaseException | None = None) -> None:
        """After a statement that may write parts, or any that failed (under the lock): a failed
        write into a file since the last look (this statement's, or a background merge's, which
        nothing else reports) is a fatal store error. chDB ends such a statement as done, with the
        broken part active in this process only; ended now, with nothing committed after it, the
        next start detaches the part and the ingest reads the batch again (its offsets were never
        committed). A statement that failed is no exception: its own error cannot tell a merge's
        failed write from its own, and either says the disk is failing."""
        before, now = self._write_failures, self._count_write_failures()
        if now < 0:  # not readable now: the last count read stays the one to compare with
            return
        self._write_failures = now
        if before >= 0 and now > before:
            also = (
                f" (the statement failed too: {str(failed).splitlines()[0][:300]})"
                if failed is not None
                else ""
            )
            raise StoreError(
                f"the embedded store failed {now - before} write(s) into its files (a full disk, a file size "
                f"limit, an I/O error) and chDB reported what it wrote done: it is not on disk{also}. "
                f"Stopping: the next start drops the broken part and reads again what was not committed "
                f"(free the disk at {self.path} first)\n-- in query:\n{what[:500]}",
                Failure.FATAL,
            ) from failed

    def close(self) -> None:
        try:
            self.flush_marks()  # chDB flushes its Buffers as it shuts down too; an error is said here
        except StoreError as exc:
            log.warning("closing the embedded store with its marks unflushed: %s", str(exc).splitlines()[0])
        with self._lock:
            self._sess.close()

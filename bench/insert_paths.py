"""The ways chDB takes a batch, measured on the same rows in the same run.

Every path inserts the same prepared chunks (the writer's own batches, as the store's Arrow
tables) into a twin of ``gpu_samples``; the repeats are interleaved (path 1, 2, ... then again)
so that a burst of load on a shared machine falls on all of them. What each path times:

  native              the Arrow table encoded as ClickHouse Native bytes by ``ingest.native``
                      (timed) + the store's encoded insert (``insert_encoded``): the store's
                      path where chDB's streaming insert raises the engine's errors
  python_arrow        ``Python()`` over the Arrow table (the store's path for a large batch on
                      chDB 4.4, whose streaming insert drops them)
  store_views         the store's own insert (``ChdbStore.insert``, whichever path it takes) into
                      a twin that also carries the store's materialized views on ``gpu_samples``
                      (each into a twin of its target): the insert the store makes, views included
  python_arrow_merge  the same with ClickHouse's default, the insert-time merge (the store before)
  arrow_stream        the Arrow table serialised to IPC stream bytes (timed) + the encoded insert
                      (the store's path for a small such batch)
  file_arrow_stream   the IPC stream bytes in a temporary file on tmpfs, read by ``file()`` (the
                      store's path on a chDB without ``send_insert``: 2.1, ClickHouse 24.8)
  parquet             the Arrow table written as uncompressed Parquet (timed) + the encoded insert
  native_chdb,        bytes made by chDB itself from the stored rows (not timed) + the encoded insert:
  row_binary          the input cost alone, a lower bound (native_chdb against native: what the
                      Python encoding costs)

The encoded insert (``ChdbStore.insert_encoded``) is chDB's streaming insert where it raises the
engine's errors, else (chDB 4.4, whose streaming insert reports a refused batch as written) the
same bytes in a temporary file on tmpfs read by ``file()``: the file's write is timed with it.

After each path the twin holds exactly the rows sent and the same content (a digest of every
column but the insert time), or the figure is an error: a fast path that stores other rows is
no path.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gpuslo.ingest.native import encode as native_encode
from gpuslo.ingest.store import INSERT_SETTINGS, MARKS, MARKS_STORE, ChdbStore, arrow_stream, marks_buffer

TWIN = "gpu_samples_twin"
TWIN_VIEWS = "gpu_samples_twin_views"  # with twins of the store's views on gpu_samples
MEMORY = "gpu_samples_mem"
MERGE_ON_INSERT = "optimize_on_insert = 1"


def parquet(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, compression="none")
    return bytes(sink.getvalue().to_pybytes())


@dataclass(frozen=True)
class PathResult:
    name: str
    seconds: tuple[float, ...]  # one per repeat
    note: str = ""

    def rates(self, rows: int) -> list[float]:
        return sorted(rows / s for s in self.seconds)

    def best(self, rows: int) -> float:
        return self.rates(rows)[-1]

    def median(self, rows: int) -> float:
        return statistics.median(self.rates(rows))


class InsertPaths:
    """The paths over one store; ``chunks`` are the store's prepared Arrow tables."""

    def __init__(self, store: ChdbStore, chunks: list[pa.Table]) -> None:
        self.store = store
        self.chunks = chunks
        self.rows = sum(c.num_rows for c in chunks)
        self.names = chunks[0].column_names
        store.execute(f"CREATE TABLE IF NOT EXISTS {TWIN} AS gpu_samples")
        self._made = [TWIN, *self._twin_views()]
        self.streaming = store.streaming
        self._path_fns: dict[str, tuple[Callable[[pa.Table, int], None], str]] | None = None
        self._seconds: dict[str, list[float]] = {}  # per path, one per round
        self._expected: tuple[int, int] | None = None  # the first path's digest

    def _twin_views(self) -> list[str]:
        """A twin of gpu_samples with a twin of each materialized view the store has on it,
        each writing into a twin of its target table; the names made (views first)."""
        st = self.store
        st.execute(f"CREATE TABLE IF NOT EXISTS {TWIN_VIEWS} AS gpu_samples")
        made: list[str] = []
        views = st.query(
            "SELECT dependencies_table AS v FROM system.tables WHERE database = currentDatabase() AND name = 'gpu_samples'"
        )
        for view in views[0]["v"] if views else []:
            (row,) = st.query(
                "SELECT as_select AS q, create_table_query AS ddl FROM system.tables "
                "WHERE database = currentDatabase() AND name = {v:String}",
                {"v": view},
            )
            to = re.search(r" TO (?:\w+\.)?(\w+)", row["ddl"])
            if to is None:
                raise ValueError(f"view {view} has no TO table: {row['ddl'][:200]}")
            target, twin_view = f"{to.group(1)}_twin", f"{view}_twin"
            select = re.sub(r"\b(?:\w+\.)?gpu_samples\b", TWIN_VIEWS, row["q"])
            if to.group(1) == MARKS and st.buffers_marks:  # the marks' Buffer, over a twin of its MergeTree
                st.execute(f"CREATE TABLE IF NOT EXISTS {target}_store AS {MARKS_STORE}")
                st.execute(
                    f"CREATE TABLE IF NOT EXISTS {target} AS {target}_store ENGINE = {marks_buffer(target + '_store')}"
                )
            st.execute(f"CREATE TABLE IF NOT EXISTS {target} AS {to.group(1)}")
            st.execute(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {twin_view} TO {target} AS {select}")
            made += [twin_view, target]
            if to.group(1) == MARKS and st.buffers_marks:
                made.append(f"{target}_store")  # after its Buffer: dropped in this order
        return [*made, TWIN_VIEWS]

    def table_of(self, path: str) -> str:
        """The table a path inserts into."""
        return TWIN_VIEWS if path.endswith("_views") else TWIN

    def _encoded_by_chdb(self, fmt: str) -> list[bytes]:
        """Each chunk in ``fmt`` with the table's own types, made by chDB (via a Memory twin)."""
        st = self.store
        st.execute(f"CREATE TABLE IF NOT EXISTS {MEMORY} AS gpu_samples ENGINE = Memory")
        cols = ", ".join(f"`{c}`" for c in self.names)
        out = []
        for c in self.chunks:
            st.execute(f"TRUNCATE TABLE {MEMORY}")
            st.insert(MEMORY, c)
            out.append(bytes(st._run(f"SELECT {cols} FROM {MEMORY}", fmt, None).bytes()))
        return out

    def _paths(self) -> dict[str, tuple[Callable[[pa.Table, int], None], str]]:
        st = self.store

        def python(settings: str, into: str = TWIN) -> Callable[[pa.Table, int], None]:
            def go(t: pa.Table, _i: int) -> None:
                st.insert_settings = settings
                try:
                    st.insert_python(into, t)
                finally:
                    st.insert_settings = INSERT_SETTINGS

            return go

        def native(t: pa.Table, _i: int) -> None:
            st.insert_encoded(TWIN, t.column_names, "Native", native_encode(t, st._column_types(TWIN)))

        def store_views(t: pa.Table, _i: int) -> None:
            st.insert(TWIN_VIEWS, t)

        paths: dict[str, tuple[Callable[[pa.Table, int], None], str]] = {}
        if self.streaming:
            paths["native"] = (native, "Native bytes made in the clock, encoded insert")
        paths |= {
            "store_views": (store_views, "the store's insert, its views included"),
            "python_arrow": (python(INSERT_SETTINGS), "Python() table function"),
            "python_arrow_merge": (python(MERGE_ON_INSERT), "the store before: Python(), insert-time merge"),
        }
        paths["file_arrow_stream"] = (
            lambda t, _i: st.insert_file(TWIN, t),
            "IPC bytes in a tmpfs file, file()",
        )
        if not self.streaming:
            return paths

        def send(fmt: str, encode: Callable[[pa.Table, int], bytes]) -> Callable[[pa.Table, int], None]:
            def go(t: pa.Table, i: int) -> None:
                st.insert_encoded(TWIN, self.names, fmt, encode(t, i))

            return go

        native_chdb = self._encoded_by_chdb("Native")
        row_binary = self._encoded_by_chdb("RowBinary")
        paths["arrow_stream"] = (
            send("ArrowStream", lambda t, _i: arrow_stream(t)),
            "IPC bytes made in the clock, encoded insert",
        )
        paths["parquet"] = (send("Parquet", lambda t, _i: parquet(t)), "Parquet bytes made in the clock")
        paths["native_chdb"] = (
            send("Native", lambda _t, i: native_chdb[i]),
            "bytes made by chDB before the clock",
        )
        paths["row_binary"] = (
            send("RowBinary", lambda _t, i: row_binary[i]),
            "bytes made by chDB before the clock",
        )
        return paths

    def digest(self, table: str = TWIN) -> tuple[int, int]:
        cols = ", ".join(f"`{c}`" for c in self.names)
        r = self.store.query(
            f"SELECT count() AS n, sum(cityHash64(toString(tuple({cols})))) AS h FROM {table}"
        )[0]
        return int(r["n"]), int(r["h"])

    def measure(self, repeat: int, progress: Callable[[], None] = lambda: None) -> list[PathResult]:
        """Each path ``repeat`` times, interleaved; raises ValueError if a path stores other rows."""
        for _ in range(repeat):
            self.round(progress)
        return self.results()

    def round(self, progress: Callable[[], None] = lambda: None) -> None:
        """Every path once, one after another (a caller may put its own runs between rounds, so
        that a burst of load falls on both); raises ValueError if a path stores other rows."""
        paths = self._round_paths()
        for name, (go, _note) in paths.items():
            self.store.execute(f"TRUNCATE TABLE {self.table_of(name)}")
            t0 = time.perf_counter()
            for i, c in enumerate(self.chunks):
                go(c, i)
                progress()
            self._seconds.setdefault(name, []).append(time.perf_counter() - t0)
            got = self.digest(self.table_of(name))
            self._expected = self._expected or got
            if got != self._expected or got[0] != self.rows:
                raise ValueError(
                    f"path {name} stored {got[0]} rows (digest {got[1]}), expected {self.rows} "
                    f"(digest {self._expected[1]})"
                )

    def _round_paths(self) -> dict[str, tuple[Callable[[pa.Table, int], None], str]]:
        if self._path_fns is None:  # the chDB-made bytes once, before the first round
            self._path_fns = self._paths()
        return self._path_fns

    def results(self) -> list[PathResult]:
        """Each path's seconds of every round; the twins are dropped (no more rounds)."""
        for name in [*self._made, MEMORY]:
            self.store.execute(f"DROP TABLE IF EXISTS {name}")
        paths = self._round_paths()
        return [PathResult(k, tuple(v), paths[k][1]) for k, v in self._seconds.items()]


#: paths a batch cannot take in production (bytes made by chDB before the clock), or not into
#: the bare twin (the views' path is the store's insert as it is, reported beside it)
NOT_RAW = ("native_chdb", "row_binary", "store_views")


def fastest(results: list[PathResult], rows: int) -> PathResult:
    """The path with the best median of those a batch can take in production, into the bare
    twin."""
    usable = [r for r in results if r.name not in NOT_RAW]
    return max(usable, key=lambda r: r.median(rows))


def table(results: list[PathResult], rows: int) -> list[str]:
    lines = [f"{'insert path':20s} {'best rows/s':>12s} {'median':>12s}  what is timed"]
    for r in results:
        lines.append(f"{r.name:20s} {r.best(rows):12,.0f} {r.median(rows):12,.0f}  {r.note}")
    return lines


def as_json(results: list[PathResult], rows: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        out[f"raw_{r.name}_best_rows_per_s"] = round(r.best(rows))
        out[f"raw_{r.name}_median_rows_per_s"] = round(r.median(rows))
    return out

"""The Native encoder (ingest/native.py) stores exactly what the Arrow path stores, for every
column type of every table the store holds, at the edges of each type; what it does not
write falls back to the Arrow path, never to a wrong row."""

from __future__ import annotations

import errno
import math
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from gpuslo.ingest import native
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.store import ChdbStore, Spill, Staged, StoreError, arrow_stream, arrow_type
from gpuslo.ingest.writer import Raw, to_columns, typed
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSample, encode
from tests import helpers as h
from tests.helpers import T0

# every length class of a LEB128 length (1, 2 and 3 bytes, each side of the boundary), UTF-8
# of 2 and 4 bytes, and what breaks a text format: quotes, backslash, NUL, newlines
STRINGS = [
    "", "a", "x" * 127, "y" * 128, "é" * 64, "z" * 16383, "w" * 16384, "q" * 70000,
    "quote'\"\\\n\r\t\x00end", "ü∑𝄞", "gpu-0",
]  # fmt: skip
_INT = {
    "UInt8": (0, 2**8 - 1), "UInt16": (0, 2**16 - 1), "UInt32": (0, 2**32 - 1), "UInt64": (0, 2**64 - 1),
    "Int8": (-(2**7), 2**7 - 1), "Int16": (-(2**15), 2**15 - 1), "Int32": (-(2**31), 2**31 - 1),
    "Int64": (-(2**63), 2**63 - 1),
}  # fmt: skip
_FLOAT = {
    "Float32": [0.0, -0.0, 1.5, -2.25, 3.4028234663852886e38, 1.401298464324817e-45, math.inf, -math.inf],
    "Float64": [0.0, -0.0, 1.5, -2.25, 1.7976931348623157e308, 5e-324, math.inf, -math.inf, math.nan],
}
# epoch seconds inside every DateTime64's range, ms and sub-ms fractions (rounding), before 1970
_TIMES64 = [T0, T0 + 0.001, T0 + 0.0005, T0 + 0.0015, T0 - 0.999, 0.0, -86400.25, 1.5, 7258118399.999]
_TIMES = [0.0, T0, T0 + 0.9, 4294967295.0]  # DateTime: 1970 .. 2106, whole seconds stored


def _values(ch: str, n: int, rnd: random.Random) -> list[Any]:
    """``n`` values a column of type ``ch`` holds, its edges first."""
    if ch.startswith("Nullable("):
        inner = _values(ch[9:-1], n, rnd)
        return [None if k % 3 == 1 else v for k, v in enumerate(inner)]
    if ch.startswith("LowCardinality("):
        return _values(ch[15:-1], n, rnd)
    if ch.startswith("Array("):
        inner = ch[6:-1]
        return [_values(inner, k % 4, rnd) for k in range(n)]  # empty ones included
    if ch.startswith("DateTime64"):
        edge = _TIMES64
    elif ch.startswith("DateTime"):
        edge = _TIMES
    elif ch in _INT:
        lo, hi = _INT[ch]
        edge = [lo, hi, 0, 1, *(rnd.randint(lo, hi) for _ in range(3))]
    elif ch in _FLOAT:
        edge = [*_FLOAT[ch], rnd.uniform(-1e6, 1e6)]
    elif ch == "String":
        edge = STRINGS
    else:
        raise KeyError(ch)
    return [edge[k % len(edge)] for k in range(n)]


def _types(store: ChdbStore, table: str) -> dict[str, str]:
    return {r["name"]: r["type"] for r in store.query(
        "SELECT name, type FROM system.columns WHERE database = currentDatabase() AND table = {t:String} "
        "AND default_kind NOT IN ('MATERIALIZED', 'ALIAS')", {"t": table})}  # fmt: skip


def _tables(store: ChdbStore) -> list[str]:
    return [r["name"] for r in store.query(
        "SELECT name FROM system.tables WHERE database = currentDatabase() AND engine LIKE '%MergeTree' "
        "ORDER BY name")]  # fmt: skip


def _batch(types: dict[str, str], n: int, seed: int = 7) -> pa.Table:
    rnd = random.Random(seed)
    return pa.table({c: pa.array(_values(t, n, rnd), arrow_type(t)) for c, t in types.items()})


def _encodable(ch: str) -> bool:
    return not re.search(r"Map\(|Decimal|Nullable\((String|LowCardinality)", ch)


def _stored(store: ChdbStore, table: str, cols: list[str]) -> list[str]:
    listed = ", ".join(f"`{c}`" for c in cols)
    return [r["r"] for r in store.query(f"SELECT toString(tuple({listed})) AS r FROM {table} ORDER BY r")]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path_factory.mktemp("native") / "store")
    s.migrate(SCHEMA)
    if not s.streaming:
        pytest.skip("this chDB has no streaming insert: the store never sends Native")
    yield s
    s.close()


def _twins(store: ChdbStore, table: str) -> tuple[str, str]:
    a, b = f"{table}_native", f"{table}_arrow"
    for t in (a, b):
        store.execute(f"DROP TABLE IF EXISTS {t}")
        store.execute(f"CREATE TABLE {t} AS {table} ENGINE = Memory")
    return a, b


def test_every_table_of_the_store_is_covered(store: ChdbStore) -> None:
    """The tables below are what the store holds: a table added later is checked too (or this
    fails), and every column type it has is one the generator knows."""
    tables = _tables(store)
    assert {
        "gpu_samples",
        "node_heartbeats",
        "sched_events",
        "latency",
        "health_events",
        "dead_letters",
    } <= set(tables)
    for t in tables:
        for c, ch in _types(store, t).items():
            if _encodable(ch):
                assert _values(ch, 3, random.Random(0)), (t, c, ch)


@pytest.mark.parametrize("rows", [1, 2, 37, 1000])
def test_each_table_through_native_stores_what_arrow_stores(store: ChdbStore, rows: int) -> None:
    """Every table of the store, every column it takes that the encoder writes, the edge values
    of each type (strings of every LEB128 length class, NaN, infinities, -0.0, the ends of
    every integer, sub-millisecond times, empty and nested arrays, nulls): inserted as Native
    and as Arrow IPC into twins, the twins hold the same rows, value for value."""
    checked = 0
    for table in _tables(store):
        types = {c: t for c, t in _types(store, table).items() if _encodable(t)}
        if not types:
            continue
        batch = _batch(types, rows)
        data = native.encode(batch, types)
        a, b = _twins(store, table)
        store.insert_encoded(a, batch.column_names, "Native", data)
        store.insert_encoded(b, batch.column_names, "ArrowStream", arrow_stream(batch))
        got, want = _stored(store, a, list(types)), _stored(store, b, list(types))
        assert len(want) == rows and got == want, table
        checked += 1
    assert checked >= 8


def test_slices_and_chunks_are_encoded_as_their_rows(store: ChdbStore) -> None:
    """A table that is a slice of another (offsets not from 0, validity bits not from bit 0)
    or whose columns are in several chunks stores exactly its own rows."""
    types = {c: t for c, t in _types(store, "gpu_samples").items() if _encodable(t)}
    whole = _batch(types, 50, seed=3)
    for batch in (
        whole.slice(7, 30),
        whole.slice(13, 1),
        pa.concat_tables([whole.slice(0, 9), whole.slice(20, 11)]),
    ):
        a, b = _twins(store, "gpu_samples")
        store.insert_encoded(a, batch.column_names, "Native", native.encode(batch, types))
        store.insert_encoded(b, batch.column_names, "ArrowStream", arrow_stream(batch))
        assert _stored(store, a, list(types)) == _stored(store, b, list(types))
        assert len(_stored(store, a, list(types))) == batch.num_rows


def test_a_varint_is_leb128() -> None:
    for n, want in [(0, b"\x00"), (127, b"\x7f"), (128, b"\x80\x01"), (16383, b"\xff\x7f"), (16384, b"\x80\x80\x01"),
                    (2**64 - 1, b"\xff" * 9 + b"\x01")]:  # fmt: skip
        assert native.varuint(n) == want


@pytest.mark.parametrize(
    ("ch", "arr", "why"),
    [
        ("Map(String, String)", pa.array([[("a", "b")]], pa.map_(pa.string(), pa.string())), "column type"),
        ("UInt16", pa.array([1, None], pa.uint16()), "a null"),
        ("String", pa.array(["a", None]), "a null"),
        ("LowCardinality(String)", pa.array(["a", None]), "a null"),
        ("Array(String)", pa.array([["a"], None], pa.list_(pa.string())), "a null"),
        ("UInt16", pa.array([1, 2], pa.uint32()), "uint32 values"),
        ("Float32", pa.array([1.0], pa.float64()), "double values"),
        ("String", pa.array([1, 2], pa.int64()), "int64 values"),
        ("Decimal(10, 2)", pa.array([1], pa.int64()), "column type"),
    ],
)
def test_what_it_does_not_write_is_refused_by_name(ch: str, arr: pa.Array, why: str) -> None:
    with pytest.raises(native.Unsupported, match=re.escape(why)):
        native.encode(pa.table({"c": arr}), {"c": ch})
    with pytest.raises(native.Unsupported, match="no column"):
        native.encode(pa.table({"c": arr}), {"other": ch})


def test_the_store_sends_native_and_falls_back_to_arrow_for_the_rest(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the streaming insert raises the engine's errors, a batch the encoder writes goes
    in as Native; one with a null where the column is not Nullable goes in as Arrow (which
    stores the column's default, as it always did) and the reason is logged once; both store
    what the Arrow path stores."""
    monkeypatch.setattr(store, "_stream_raises", True)  # a chDB whose streaming insert raises its errors
    sent: list[str] = []
    real = store.insert_encoded

    def spy(table: str, names: Any, fmt: str, data: bytes) -> int:
        sent.append(fmt)
        return real(table, names, fmt, data)

    monkeypatch.setattr(store, "insert_encoded", spy)
    a, b = _twins(store, "node_heartbeats")
    cols = {"cluster": ["c", "c"], "node": ["n1", "n2"], "pool": ["", ""], "ts": [T0, T0 + 1],
            "interval_s": [10.0, 10.0], "schedulable": [1, 0], "state": ["idle", "down"], "reason": ["", "x"],
            "gpus": [8, 8], "source": ["slurm", "slurm"], "boot_id": ["b", "b"], "seq": [1, 2]}  # fmt: skip
    assert store.insert(a, cols) == 2 and sent == ["Native"]
    holed = store.prepare_columns(a, cols).set_column(8, "gpus", pa.array([8, None], pa.uint16()))
    with caplog.at_level("INFO", logger="gpuslo.ingest.store"):
        for _ in range(2):
            store.insert(b, holed)
    assert sent[1:] == ["ArrowStream", "ArrowStream"]
    assert sum("not Native" in r.message for r in caplog.records) == 1
    assert store.native(b, holed) is None
    rows = store.query(f"SELECT node, gpus FROM {b} ORDER BY node, gpus")
    assert [(r["node"], r["gpus"]) for r in rows] == [("n1", 8), ("n1", 8), ("n2", 0), ("n2", 0)]


def test_a_store_set_not_to_or_a_chdb_without_streaming_sends_no_native(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Native only through a streaming insert that raises the engine's errors (chDB 4.4's does
    not: there the store sends none), only where the store is set to, only on a chDB that has
    a streaming insert at all."""
    t = store.prepare_columns("node_heartbeats", {"cluster": ["c"], "node": ["n"], "ts": [T0]})
    monkeypatch.setattr(store, "_stream_raises", False)
    assert store.native("node_heartbeats", t) is None and store.stage("node_heartbeats", t) is t
    monkeypatch.setattr(store, "_stream_raises", True)  # a chDB whose streaming insert raises its errors
    assert store.native("node_heartbeats", t) is not None
    monkeypatch.setattr(store, "insert_native", False)
    assert store.native("node_heartbeats", t) is None
    monkeypatch.setattr(store, "insert_native", True)
    monkeypatch.setattr(ChdbStore, "streaming", property(lambda self: False))
    assert store.native("node_heartbeats", t) is None and store.stage("node_heartbeats", t) is t


def test_the_consumer_thread_stages_and_the_writer_sends_those_bytes(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ingestor.prepare encodes (the consumer's thread, beside the previous insert); write sends
    the staged bytes as they are, one insert a day, and nothing is encoded again."""
    monkeypatch.setattr(store, "_stream_raises", True)  # a chDB whose streaming insert raises its errors
    gpu = [GpuSample(index=0, uuid="GPU-0", fields={"DCGM_FI_DEV_GPU_UTIL": 1.0})]
    msgs = [h.batch(f"n{k}", T0 - (k % 2) * 86400 + k, gpu) for k in range(6)]
    items = [Raw(f"f:{k}", encode(m), offset=k) for k, m in enumerate(msgs)]
    ing = Ingestor(store, clock=lambda: T0 + 60)
    p = ing.prepare(items)
    (staged,) = p.staged["gpu_samples"]
    assert isinstance(staged, Staged) and len(staged.parts) == 2 and all(d for _, d in staged.parts)
    monkeypatch.setattr(store, "native", lambda *a: pytest.fail("encoded again in the writer"))
    before = store.query("SELECT count() AS n FROM gpu_samples")[0]["n"]
    assert ing.write(p).written["gpu_samples"] == 6
    assert store.query("SELECT count() AS n FROM gpu_samples")[0]["n"] == before + 6


def test_staging_never_raises_and_the_insert_says_what_is_wrong(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table gone between the batch's preparation and its staging: staging leaves the part
    unencoded, the insert raises the store's error (as before staging existed), never a
    traceback from the encoder."""
    monkeypatch.setattr(store, "_stream_raises", True)  # a chDB whose streaming insert raises its errors
    store.execute("CREATE TABLE gone (a UInt8, ts DateTime64(3, 'UTC')) ENGINE = MergeTree ORDER BY a")
    batch = pa.table({"a": pa.array([1], pa.uint8()), "ts": [T0]})
    assert store.native("gone", batch) is not None
    store.execute("DROP TABLE gone")
    staged = store.stage("gone", batch)
    assert isinstance(staged, Staged) and staged.parts[0][1] is None
    with pytest.raises(StoreError, match="gone"):
        store.insert("gone", staged)


def test_the_gpu_samples_of_the_writer_go_in_as_native(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The columns the ingest builds for gpu_samples (typed by the store's types) are all
    encodable: where the store sends Native, the hot path never falls back."""
    monkeypatch.setattr(store, "_stream_raises", True)  # a chDB whose streaming insert raises its errors
    gpu = [GpuSample(index=i, uuid=f"GPU-{i}", fields={"DCGM_FI_DEV_GPU_UTIL": 1.0 * i}) for i in range(4)]
    cols = typed("gpu_samples", to_columns([h.batch("n", T0, gpu)])["gpu_samples"])
    assert store.native("gpu_samples", store.prepare_columns("gpu_samples", cols)) is not None


@pytest.mark.parametrize(
    ("ch", "arr"),
    [
        ("UInt16", pa.array(["1", "2"])),  # not a number type: its width is not asked
        ("UInt16", pa.array([{"a": 1}])),
        ("Nullable(Float64)", pa.nulls(2)),  # Arrow's null type: no buffers at all
        ("LowCardinality(String)", pa.array([[1], [2]])),  # not text: never dictionary-encoded
        ("Array(UInt8)", pa.array([["1"]])),
        ("Array(LowCardinality(String))", pa.array([[1.5]])),
    ],
)
def test_an_arrow_type_it_does_not_write_is_refused_never_a_crash(ch: str, arr: pa.Array) -> None:
    with pytest.raises(native.Unsupported, match="values for a"):
        native.encode(pa.table({"c": arr}), {"c": ch})


def test_a_batch_the_encoder_cannot_take_goes_in_as_arrow_from_stage_and_insert(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table handed to the store as it is (prepare_columns keeps a pa.Table): its column of
    Arrow's null type or of strings for a number column is staged and inserted the Arrow way,
    which stores what it always did, never a TypeError out of the consumer's thread."""
    monkeypatch.setattr(store, "_stream_raises", True)  # a chDB whose streaming insert raises its errors
    a, b = _twins(store, "rule_results")
    batch = pa.table(
        {"rule": ["r", "r"], "label": ["x", "y"], "window_s": ["60", "120"], "value": pa.nulls(2)}
    )
    staged = store.stage(a, batch)
    assert isinstance(staged, Staged) and staged.parts[0][1] is None
    assert store.insert(a, staged) == 2
    store.insert_encoded(b, batch.column_names, "ArrowStream", arrow_stream(batch))
    cols = ["rule", "label", "window_s", "value"]
    assert _stored(store, a, cols) == _stored(store, b, cols) == ["('r','x',60,NULL)", "('r','y',120,NULL)"]


def test_a_batch_of_no_rows_is_a_block_clickhouse_reads(store: ChdbStore) -> None:
    """ClickHouse reads nothing of a column when a block has no rows, not even the key version
    a LowCardinality column writes first: writing it made the next bytes a type name."""
    types = {c: t for c, t in _types(store, "gpu_samples").items() if _encodable(t)}
    a, _ = _twins(store, "gpu_samples")
    empty = _batch(types, 0)
    store.insert_encoded(a, empty.column_names, "Native", native.encode(empty, types))
    assert _stored(store, a, list(types)) == []


@pytest.mark.parametrize("way", ["native_bytes", "arrow_stream_bytes", "store_small", "store_python"])
def test_an_error_the_engine_raises_after_reading_the_batch_is_a_store_error(
    store: ChdbStore, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A constraint (as too many parts, a full disk, a failing materialized view) fails the
    insert after the bytes are read. chDB 4.4's streaming insert drops that error (finish()
    reports the rows written, none is): the store must raise it, whichever way the batch goes
    in (encoded bytes of either format, the store's own choice for a small batch and through
    Python()), or the ingest commits a batch it never stored."""
    store.execute("DROP TABLE IF EXISTS checked")
    store.execute(
        "CREATE TABLE checked (node String, ts DateTime64(3, 'UTC'), CONSTRAINT no_bad CHECK node != 'bad') "
        "ENGINE = MergeTree ORDER BY node"
    )
    batch = store.prepare_columns("checked", {"node": ["ok", "bad"], "ts": [T0, T0]})
    types = {"node": "String", "ts": "DateTime64(3, 'UTC')"}
    if way == "store_python":
        monkeypatch.setattr(store, "stream_below_rows", 0)
    with pytest.raises(StoreError, match="no_bad") as e:
        if way == "native_bytes":
            store.insert_encoded("checked", batch.column_names, "Native", native.encode(batch, types))
        elif way == "arrow_stream_bytes":
            store.insert_encoded("checked", batch.column_names, "ArrowStream", arrow_stream(batch))
        else:
            store.insert("checked", batch)
    assert e.value.code == 469 and not e.value.retriable and not e.value.fatal
    assert store.query("SELECT count() AS n FROM checked")[0]["n"] == 0


def test_a_message_the_engine_refuses_is_the_only_dead_letter(store: ChdbStore) -> None:
    """The engine itself refuses one message of a batch over two days (a constraint on the
    table): ingest_or_isolate writes the others and dead-letters only that one."""
    gpu = [GpuSample(index=0, uuid="GPU-0", fields={"DCGM_FI_DEV_GPU_UTIL": 1.0})]
    nodes = ["a", "bad", "c", "d"]
    items = [
        Raw(f"iso:{k}", encode(h.batch(n, T0 + (k % 2) * 86400 + k, gpu)), offset=k)
        for k, n in enumerate(nodes)
    ]
    store.execute("ALTER TABLE gpu_samples ADD CONSTRAINT no_bad_node CHECK node != 'bad'")
    try:
        rep = Ingestor(store, clock=lambda: T0 + 86400).ingest_or_isolate(items)
    finally:
        store.execute("ALTER TABLE gpu_samples DROP CONSTRAINT no_bad_node")
    assert (rep.accepted, rep.dead_lettered) == (3, 1)
    got = {
        r["node"]
        for r in store.query("SELECT node FROM gpu_samples FINAL WHERE node IN ('a', 'bad', 'c', 'd')")
    }
    assert got == {"a", "c", "d"}
    dead = store.query("SELECT origin, reason FROM dead_letters FINAL WHERE origin LIKE 'iso:%'")
    assert [d["origin"] for d in dead] == ["iso:1"] and "no_bad_node" in dead[0]["reason"]


def _spill_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("gpuslo-insert-*")} if Path("/dev/shm").is_dir() else set()


def test_on_a_chdb_whose_stream_drops_errors_bytes_go_through_an_unlinked_file(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chDB 4.4: the probe finds its streaming insert drops the engine's errors; the store then
    sends no Native (Python() for a large batch), and encoded bytes (a small batch) go through
    a tmpfs file unlinked at once and read through /proc/self/fd: no file is ever left behind,
    and the descriptor is closed once the insert is done."""
    if store.stream_raises():
        pytest.skip("this chDB's streaming insert raises its errors: nothing goes through a file")
    made: list[Spill] = []
    real_init = Spill.__init__

    def spying(self: Spill, data: bytes, fmt: str) -> None:
        real_init(self, data, fmt)
        made.append(self)

    monkeypatch.setattr(Spill, "__init__", spying)
    types = {c: t for c, t in _types(store, "gpu_samples").items() if _encodable(t)}
    batch = _batch(types, 40)
    before = _spill_files()
    a, b = _twins(store, "gpu_samples")
    assert store.stage(a, batch) is batch and store.native(a, batch) is None
    assert store.insert(a, batch) == 40  # a small batch: IPC bytes through the file
    (spill,) = made
    assert spill.fmt == "ArrowStream" and spill.path.startswith("/proc/self/fd/")
    with pytest.raises(OSError):
        os.fstat(int(spill.path.rsplit("/", 1)[1]))  # closed after the insert
    assert _spill_files() == before
    pythons: list[int] = []
    monkeypatch.setattr(store, "stream_below_rows", 10)
    real_python = store.insert_python
    monkeypatch.setattr(store, "insert_python", lambda t, x: (pythons.append(x.num_rows), real_python(t, x)))
    assert store.insert(b, batch) == 40 and pythons == [40] and len(made) == 1
    assert _stored(store, a, list(types)) == _stored(store, b, list(types))


def _full(*_a: Any, **_k: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def _small_batch_twins(store: ChdbStore) -> tuple[dict[str, str], pa.Table, tuple[str, str]]:
    """gpu_samples' encodable types, a 5-row batch of them, and two empty twins (skips where the
    streaming insert raises: nothing goes through a file there)."""
    if store.stream_raises():
        pytest.skip("this chDB's streaming insert raises its errors: nothing goes through a file")
    types = {c: t for c, t in _types(store, "gpu_samples").items() if _encodable(t)}
    return types, _batch(types, 5), _twins(store, "gpu_samples")


def test_a_full_tmpfs_is_a_transient_store_error(store: ChdbStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """No room for the file the encoded bytes go through: a transient StoreError to a caller of
    insert_encoded, and the next insert, with room again, lands."""
    _, batch, (a, _b) = _small_batch_twins(store)
    monkeypatch.setattr(tempfile, "mkstemp", _full)
    with pytest.raises(StoreError, match="No space left") as e:
        store.insert_encoded(a, batch.column_names, "ArrowStream", arrow_stream(batch))
    assert e.value.retriable
    monkeypatch.undo()
    assert store.insert_encoded(a, batch.column_names, "ArrowStream", arrow_stream(batch)) == 5


def test_a_small_batch_with_no_room_for_its_file_goes_in_through_python(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tmpfs too small for a batch's file (Docker's default /dev/shm is 64 MiB, a batch of
    dead letters up to batch_bytes, 64 MiB, of raw messages) never clears: a transient error
    there retried the batch forever. The store's own insert takes it through Python() instead,
    in memory, which raises the engine's errors as the file does; the ingest stores the batch."""
    types, batch, (a, b) = _small_batch_twins(store)

    pythons: list[int] = []
    real_python = store.insert_python

    def python(t: str, x: pa.Table) -> None:
        pythons.append(x.num_rows)
        real_python(t, x)

    monkeypatch.setattr(store, "insert_python", python)
    monkeypatch.setattr(tempfile, "mkstemp", _full)
    assert store.insert(a, batch) == 5 and pythons == [5]
    junk = [Raw(f"shm:{k}", b"\xff not json " + bytes(range(256)) * 40, offset=k) for k in range(3)]
    rep = Ingestor(store, clock=time.time).ingest_or_isolate(junk)
    assert rep.dead_lettered == 3 and pythons == [5, 3]
    stored = store.query("SELECT count() AS n FROM dead_letters FINAL WHERE origin LIKE 'shm:%'")
    assert stored[0]["n"] == 3
    monkeypatch.undo()
    store.insert(b, batch)
    assert _stored(store, a, list(types)) == _stored(store, b, list(types))
    store.execute("DROP TABLE IF EXISTS checked_py")
    store.execute("CREATE TABLE checked_py (node String, CONSTRAINT no_bad CHECK node != 'bad') "
                  "ENGINE = MergeTree ORDER BY node")  # fmt: skip
    monkeypatch.setattr(tempfile, "mkstemp", _full)
    with pytest.raises(StoreError, match="no_bad") as e:  # the engine's refusal, not the tmpfs's
        store.insert("checked_py", {"node": ["ok", "bad"]})
    assert e.value.code == 469 and store.query("SELECT count() AS n FROM checked_py")[0]["n"] == 0


def test_the_probe_runs_once_whatever_the_threads_that_ask(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads that ask while the probe runs wait for its answer, and do not probe again."""
    real = store._sess
    creates: list[str] = []

    class Slow:
        def query(self, sql: str, *a: Any, **k: Any) -> Any:
            if sql.startswith("CREATE TEMPORARY TABLE"):
                creates.append(sql)
                time.sleep(0.2)  # the others arrive while the lock is held
            return real.query(sql, *a, **k)

        def send_insert(self, *a: Any) -> Any:
            return real.send_insert(*a)

    monkeypatch.setattr(store, "_sess", Slow())
    monkeypatch.setattr(store, "_stream_raises", None)
    answers: list[bool] = []
    threads = [threading.Thread(target=lambda: answers.append(store.stream_raises())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(creates) == 1 and len(set(answers)) == 1 and len(answers) == 4


def test_short_bytes_through_the_streaming_insert_are_refused_not_transient(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes cut short read past their end (ATTEMPT_TO_READ_AFTER_EOF, 32): transient where it
    is a connection lost, but these bytes are in memory: the data (an encoder's bug) is refused,
    and the ingest isolates the message, never retries the batch forever."""
    monkeypatch.setattr(store, "_stream_raises", True)  # a chDB whose streaming insert raises its errors
    a, _ = _twins(store, "node_heartbeats")
    t = store.prepare_columns(
        a, {"cluster": ["c"] * 50, "node": [f"n{k}" for k in range(50)], "ts": [T0] * 50}
    )
    data = native.encode(t, store._column_types(a))
    with pytest.raises(StoreError) as e:  # a block, then a column count whose varint never ends
        store.insert_encoded(a, t.column_names, "Native", data + b"\x80")
    assert e.value.code == 32 and not e.value.retriable and not e.value.fatal
    assert store.query(f"SELECT count() AS n FROM {a}")[0]["n"] == 0

"""The embedded store holds the rollups' marks in a Buffer until the ingest flushes them
(``ChdbStore.buffer_marks``): made on a new store, converted on an old one with its marks kept
(also when a conversion stopped midway), read through by the refresh before any flush, and a
flush that fails keeps them for the next."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslo.ingest.store import MARKS_STORE, ChdbStore, Store, StoreError
from gpuslo.rules.rollup import refresh
from gpuslo.rules.tables import SCHEMA

T0 = 1796428800  # a whole minute
ROW = "INSERT INTO gpu_samples (cluster, node, gpu, uuid, ts, interval_s, activity) VALUES "


def _engines(st: ChdbStore) -> dict[str, str]:
    rows = st.query(
        "SELECT name, engine FROM system.tables WHERE database = currentDatabase() AND name LIKE '%dirty%'"
    )
    return {r["name"]: r["engine"] for r in rows}


def _count(st: ChdbStore, table: str) -> int:
    return int(st.query(f"SELECT count() AS n FROM {table}")[0]["n"])


def _views_write_buffer(st: ChdbStore) -> None:
    assert _engines(st) == {
        "rollup_dirty": "Buffer",
        MARKS_STORE: "MergeTree",
        "gpu_samples_dirty_mv": "MaterializedView",
        "node_heartbeats_dirty_mv": "MaterializedView",
        "latency_dirty_mv": "MaterializedView",
    }
    assert st.buffers_marks


def test_a_new_store_buffers_its_marks_until_flushed(tmp_path: Path) -> None:
    st = ChdbStore(tmp_path / "s")
    st.migrate(SCHEMA)
    _views_write_buffer(st)
    st.execute(ROW + f"('c', 'n1', 0, 'u', {T0}, 10, 0.5), ('c', 'n1', 1, 'v', {T0 + 50}, 10, 0.5)")
    assert _count(st, "rollup_dirty") == 2 and _count(st, MARKS_STORE) == 0  # [T0, T0+20), [T0+50, T0+70)
    st.flush_marks()
    assert _count(st, MARKS_STORE) == 2 and _count(st, "rollup_dirty") == 2
    st.migrate(SCHEMA)  # again: nothing changes
    _views_write_buffer(st)
    assert _count(st, "rollup_dirty") == 2


def test_the_refresh_reads_marks_not_yet_flushed(tmp_path: Path) -> None:
    st = ChdbStore(tmp_path / "s")
    st.migrate(SCHEMA)
    st.execute(ROW + f"('c', 'n1', 0, 'u', {T0}, 10, 0.5)")
    assert _count(st, MARKS_STORE) == 0
    rep = refresh(st)
    assert rep.node_minutes == 1
    assert _count(st, "gpu_rollup_1m FINAL") == 1


def test_an_old_store_is_converted_with_its_marks(tmp_path: Path) -> None:
    st = ChdbStore(tmp_path / "s")
    Store.migrate(st, SCHEMA)  # as a store was made before: the views write the MergeTree
    assert _engines(st)["rollup_dirty"] == "MergeTree"
    st.execute(ROW + f"('c', 'n1', 0, 'u', {T0}, 10, 0.5), ('c', 'n2', 0, 'w', {T0 + 3600}, 10, 0.5)")
    before = st.query("SELECT kind, cluster, key, minute FROM rollup_dirty ORDER BY key")
    st.migrate(SCHEMA)
    _views_write_buffer(st)
    assert st.query(f"SELECT kind, cluster, key, minute FROM {MARKS_STORE} ORDER BY key") == before
    st.execute(ROW + f"('c', 'n3', 0, 'x', {T0}, 10, 0.5)")  # the views write the Buffer now
    assert _count(st, "rollup_dirty") == 3 and _count(st, MARKS_STORE) == 2
    st.close()  # flushed at close
    again = ChdbStore(tmp_path / "s")
    again.migrate(SCHEMA)
    _views_write_buffer(again)
    assert _count(again, MARKS_STORE) == 3


def test_a_conversion_stopped_midway_converts_on_the_next_start(tmp_path: Path) -> None:
    """Stopped after the views were dropped and the marks copied, before the MergeTree was
    replaced: the next start makes the views again (the schema) and converts; a mark copied
    twice is only a minute re-rolled twice."""
    st = ChdbStore(tmp_path / "s")
    Store.migrate(st, SCHEMA)
    st.execute(ROW + f"('c', 'n1', 0, 'u', {T0}, 10, 0.5)")
    st.execute(f"CREATE TABLE {MARKS_STORE} AS rollup_dirty")
    for v in ("gpu_samples_dirty_mv", "node_heartbeats_dirty_mv", "latency_dirty_mv"):
        st.execute(f"DROP VIEW {v}")
    st.execute(f"INSERT INTO {MARKS_STORE} SELECT * FROM rollup_dirty")
    st.migrate(SCHEMA)
    _views_write_buffer(st)
    assert st.query(f"SELECT DISTINCT key FROM {MARKS_STORE}") == [{"key": "n1"}]
    assert _count(st, MARKS_STORE) == 2


def test_a_failed_flush_keeps_the_marks_for_the_next(tmp_path: Path) -> None:
    st = ChdbStore(tmp_path / "s")
    st.migrate(SCHEMA)
    st.execute(f"ALTER TABLE {MARKS_STORE} ADD CONSTRAINT refuse CHECK key != 'bad'")
    st.execute(ROW + f"('c', 'bad', 0, 'u', {T0}, 10, 0.5)")
    with pytest.raises(StoreError):
        st.flush_marks()
    assert _count(st, "rollup_dirty") == 1 and _count(st, MARKS_STORE) == 0
    st.execute(f"ALTER TABLE {MARKS_STORE} DROP CONSTRAINT refuse")
    st.flush_marks()
    assert _count(st, MARKS_STORE) == 1


def test_chdb_never_flushes_the_marks_behind_a_read(tmp_path: Path) -> None:
    """A read of a Buffer takes the MergeTree's parts as it starts and the Buffer's rows after:
    a flush by chDB's own timer in between hid the flushed marks from it (the session-23
    attack: 1,500 of 2,700 read). Only the store's statements flush, each under its lock, so
    marks held past the former timer (5 s) are still held, and every read sees them all."""
    import time

    st = ChdbStore(tmp_path / "s")
    st.migrate(SCHEMA)
    st.execute(ROW + ", ".join(f"('c', 'n{i}', 0, 'u', {T0}, 10, 0.5)" for i in range(300)))
    time.sleep(6.5)
    assert _count(st, MARKS_STORE) == 0 and _count(st, "rollup_dirty") == 300
    st.flush_marks()
    assert _count(st, MARKS_STORE) == 300


def test_an_operators_marks_table_of_another_engine_is_left_as_it_is(tmp_path: Path) -> None:
    """Its marks would not be copied part by part: it keeps them, and the views keep writing it
    (the ingest then commits as they write)."""
    st = ChdbStore(tmp_path / "s")
    st.execute(
        "CREATE TABLE rollup_dirty (kind LowCardinality(String), cluster LowCardinality(String), "
        "key LowCardinality(String), minute DateTime('UTC'), at DateTime64(3, 'UTC')) ENGINE = Log"
    )
    st.migrate(SCHEMA)
    st.execute(ROW + f"('c', 'n1', 0, 'u', {T0}, 10, 0.5)")
    st.migrate(SCHEMA)
    assert not st.buffers_marks and _engines(st)["rollup_dirty"] == "Log" and MARKS_STORE not in _engines(st)
    assert _count(st, "rollup_dirty") == 1

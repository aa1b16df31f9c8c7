from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuslo.ingest.schema import SCHEMA_FILE, TABLES
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules import tables as rules_tables
from gpuslo.rules.tables import SCHEMA


def test_checked_in_ddl_is_the_rendered_ddl() -> None:
    """Golden file: regenerate with `gpuslo schema > ingest/schema.sql`."""
    assert SCHEMA_FILE.read_text() == SCHEMA.render()


def test_ddl_creates_every_table_and_is_idempotent(store: ChdbStore) -> None:
    store.migrate(SCHEMA)  # a second time: IF NOT EXISTS
    names = {
        r["name"] for r in store.query("SELECT name FROM system.tables WHERE database = currentDatabase()")
    }
    assert set(TABLES) | set(rules_tables.TABLES) <= names


def test_ddl_habits_for_clickhouse_24_8() -> None:
    created: set[str] = set()
    for stmt in SCHEMA.create():
        view = re.search(r"CREATE MATERIALIZED VIEW IF NOT EXISTS (\w+) TO (\w+) AS", stmt)
        if view:  # a view writes into a table made before it
            assert view.group(2) in created, view.group(1)
            continue
        table = re.search(r"CREATE TABLE IF NOT EXISTS (\w+)", stmt)
        assert table, stmt
        created.add(table.group(1))
        assert "ORDER BY" in stmt
        if table.group(1) in ("rollup_state", "alert_state"):  # one row per name, per alert
            continue
        assert "PARTITION BY toDate(" in stmt or "PARTITION BY toYYYYMM(" in stmt, table.group(1)
        assert re.search(r"\nTTL \w+\(?\w+\)? \+ INTERVAL \d+ DAY", stmt), table.group(1)
    assert set(TABLES) | set(rules_tables.TABLES) == created
    # low-cardinality labels are LowCardinality; the dedup key of samples is the natural key
    ddl = SCHEMA.render()
    for col in ("cluster", "node", "pool", "model"):
        assert re.search(rf"\n    {col} LowCardinality\(String\)", ddl), col
    assert "ORDER BY (cluster, node, gpu, mig_gi, mig_ci, ts)" in ddl


def _part_types(store: ChdbStore, table: str = "gpu_samples") -> set[str]:
    return {
        r["t"]
        for r in store.query(
            f"SELECT part_type AS t FROM system.parts WHERE database = currentDatabase() AND table = '{table}' AND active"
        )
    }


def test_an_insert_writes_one_compact_part_and_an_old_store_is_upgraded(tmp_path: Path) -> None:
    """gpu_samples' parts are Compact up to 32 MiB of rows (one data file, not two per column
    stream: some 200 files per insert, which cost a third of an insert's CPU in the kernel). A
    store made before the setting gets it from ``migrate``, and so does one carrying a former
    gpuslo value (256 MiB, which made the merges Compact); one that names its own keeps it."""
    from gpuslo.ingest.schema import FORMER_PART_SETTINGS, GPU_SAMPLES_PART_SETTING
    from gpuslo.ingest.writer import to_columns
    from tests.helpers import T0
    from tests.test_fastpath import _batch

    # 28,000 rows, some 16 MB: Wide by ClickHouse's default (10 MB), Compact by the schema's
    rows = to_columns([_batch(i, T0 + 10 * i) for i in range(4000)])["gpu_samples"]
    (former,) = FORMER_PART_SETTINGS
    own, own_rows = "min_bytes_for_wide_part = 0", "min_rows_for_wide_part = 100"
    both = f"{former}, min_rows_for_wide_part = 0"
    for made, setting, want, kept in (
        ("now", None, "Compact", GPU_SAMPLES_PART_SETTING),  # the schema as it is
        ("before", "", "Compact", GPU_SAMPLES_PART_SETTING),  # made without the setting: migrate adds it
        ("former", former, "Compact", GPU_SAMPLES_PART_SETTING),  # gpuslo's former value: today's
        ("tuned", own, "Wide", own),  # the operator's own: kept
        ("tuned-rows", own_rows, "Wide", own_rows),  # the other form: kept (found by the attack)
        ("tuned-both", both, "Compact", both),  # the former value beside an operator's own: all kept
    ):
        store = ChdbStore(tmp_path / made)
        try:
            if setting is not None:
                ddl = next(
                    s for s in SCHEMA.create() if s.startswith("CREATE TABLE IF NOT EXISTS gpu_samples\n")
                )
                ddl = ddl.replace(
                    f"\nSETTINGS {GPU_SAMPLES_PART_SETTING}", f"\nSETTINGS {setting}" if setting else ""
                )
                assert ddl.count("_for_wide_part") == setting.count("_for_wide_part"), ddl
                store.execute(ddl)
            store.migrate(SCHEMA)
            store.migrate(SCHEMA)  # idempotent
            store.insert("gpu_samples", rows)
            assert _part_types(store) == {want}, made
            (full,) = store.query("SELECT engine_full AS e FROM system.tables WHERE name = 'gpu_samples'")
            named = {
                x.strip() for x in full["e"].partition(" SETTINGS ")[2].split(",") if "_for_wide_part" in x
            }
            assert named == {x.strip() for x in kept.split(",")}, (made, full)
        finally:
            store.close()


def test_a_merged_part_is_wide(tmp_path: Path) -> None:
    """Parts past 32 MiB, a merge's among them, are Wide: a merge writing its part Compact took
    four times the CPU (``python -m bench parts``). Three inserts of some 16 MB each are Compact
    parts; merged into one part of some 48 MB, Wide, with every row still there."""
    from gpuslo.ingest.writer import to_columns
    from tests.helpers import T0
    from tests.test_fastpath import _batch

    store = ChdbStore(tmp_path / "s")
    try:
        store.migrate(SCHEMA)
        for k in range(3):  # distinct rows, one day: one partition, nothing collapses in the merge
            batches = [_batch(i, T0 + 2 * i) for i in range(4000 * k, 4000 * (k + 1))]
            store.insert("gpu_samples", to_columns(batches)["gpu_samples"])
        assert _part_types(store) == {"Compact"}
        store.execute("OPTIMIZE TABLE gpu_samples FINAL")
        (part,) = store.query(
            "SELECT part_type AS t, rows AS n, data_uncompressed_bytes AS b FROM system.parts "
            "WHERE database = currentDatabase() AND table = 'gpu_samples' AND active"
        )
        assert part["t"] == "Wide" and part["n"] == 3 * 28_000 and part["b"] > 32 << 20, part
    finally:
        store.close()


@pytest.mark.parametrize(
    ("settings", "ours"),
    [
        ("index_granularity = 8192", True),  # none named: the schema's is added
        ("min_bytes_for_wide_part = 268435456, index_granularity = 8192", True),  # the former value
        ("index_granularity = 8192, min_bytes_for_wide_part = 268435456", True),  # in any place
        # a setting of JSON columns whose name ends alike is not a part format (found by the attack)
        ("min_bytes_for_wide_part = 268435456, object_shared_data_buckets_for_wide_part = 16", True),
        ("min_bytes_for_wide_part = 268435456, min_level_for_wide_part = 0", False),  # the operator's level
        ("min_bytes_for_wide_part = 0, index_granularity = 8192", False),
        ("index_granularity = 8192, min_rows_for_wide_part = 100", False),
        ("min_bytes_for_wide_part = 33554432", False),  # today's: nothing to do
        ("min_bytes_for_wide_part = '268435456'", False),  # written otherwise: the operator's
    ],
)
def test_which_part_settings_are_gpuslos(settings: str, ours: bool) -> None:
    from gpuslo.ingest.store import part_setting_is_ours

    head = "ReplacingMergeTree(ingested_at) PARTITION BY toDate(ts) ORDER BY (cluster, node, ts)"
    assert part_setting_is_ours(f"{head} SETTINGS {settings}") is ours
    # a TTL's string holding the word SETTINGS is not the table's settings (found by the attack)
    ttl = f"{head} TTL toDate(ts) + toIntervalDay(400) DELETE WHERE node != ' SETTINGS min_bytes_for_wide_part = 0'"
    assert part_setting_is_ours(f"{ttl} SETTINGS {settings}") is ours

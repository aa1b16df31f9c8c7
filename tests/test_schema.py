from __future__ import annotations

import re

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

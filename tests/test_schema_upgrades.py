"""A store made before a column joined an ingest table gets that column, with the type and the
default a new store has, from ``Store.migrate``: every column of a ``CREATE TABLE`` in
ingest/schema.py is either one the first stores already had (:data:`BASELINE`, frozen) or one
an upgrade statement adds (``COLUMN_UPGRADES``, ``DEAD_LETTERS_UPGRADE``).

The slip this catches: a column added to the ``CREATE TABLE`` (and to the writer, and to
``schema.sql``) but not to its table's upgrade. Every test that builds a store builds a new one,
so all of them pass, while every store already in use refuses each insert of that table with
``NO_SUCH_COLUMN_IN_TABLE`` after the upgrade of the software. Or the upgrade adds it with another
type or default than the ``CREATE`` (``String`` for ``LowCardinality(String)``): old and new
stores then differ, silently.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gpuslo.ingest.schema import (
    COLUMN_UPGRADES,
    DEAD_LETTERS_UPGRADE,
    INGEST_SCHEMA,
    MSG_KEY_TABLES,
    TABLES,
)
from gpuslo.ingest.store import ChdbStore, Store

#: The columns of each ingest table in the first stores (2026-11-29), before any column was added
#: to a store in use. Frozen: a column joins a table through its table's upgrade statement, never
#: here (a new *table* is created whole by ``migrate`` and is listed here whole).
BASELINE: dict[str, tuple[str, ...]] = {
    "gpu_samples": ("cluster", "node", "pool", "gpu", "mig_gi", "mig_ci", "mig_profile", "gpu_fraction", "uuid",
                    "model", "ts", "interval_s", "healthy", "activity", "alloc_share", "alloc_schedulers",
                    "alloc_ids", "alloc_names", "alloc_users", "alloc_accounts", "alloc_queues", "alloc_shares",
                    "source", "boot_id", "seq", "ingested_at"),
    "node_heartbeats": ("cluster", "node", "pool", "ts", "interval_s", "schedulable", "state", "reason", "gpus",
                        "source", "boot_id", "seq", "ingested_at"),
    "sched_events": ("cluster", "scheduler", "event", "request_id", "ts", "name", "user", "account", "queue",
                     "pool", "gpus_per_node", "nodes", "reason", "assigned_nodes", "source", "boot_id", "seq",
                     "ingested_at"),
    "latency": ("cluster", "service", "ts", "interval_s", "bounds_ms", "counts", "total", "sum_ms", "source",
                "boot_id", "seq", "ingested_at"),
    "health_events": ("cluster", "node", "gpu", "uuid", "ts", "event", "code", "fatal", "message", "source",
                      "boot_id", "seq", "ingested_at"),
    "dead_letters": ("received_at", "origin", "topic", "partition", "offset", "reason", "raw"),
}  # fmt: skip


def create_specs(table: str) -> dict[str, str]:
    """Column -> its whole spec (type, and default where any) in ``table``'s ``CREATE TABLE``."""
    for stmt in INGEST_SCHEMA.create():
        m = re.match(rf"CREATE TABLE IF NOT EXISTS {table}\s*\((.*)\)\s*ENGINE", stmt, re.S)
        if m:
            return dict(line.strip().split(" ", 1) for line in m.group(1).split(",\n"))
    raise KeyError(table)


def added_specs(stmt: str) -> dict[str, str]:
    """Column -> spec of each ``ADD COLUMN IF NOT EXISTS`` of an ``ALTER TABLE``."""
    return dict(re.findall(r"ADD COLUMN IF NOT EXISTS (\w+) (.+?)(?=, ADD COLUMN |, MODIFY |$)", stmt))


def upgrades_of(table: str) -> dict[str, str]:
    out = added_specs(COLUMN_UPGRADES.get(table, ""))
    if table == "dead_letters":  # with its new key (pipeline.upgrade)
        out |= added_specs(DEAD_LETTERS_UPGRADE)
    return out


def test_the_baseline_names_every_ingest_table() -> None:
    assert set(BASELINE) == set(TABLES)
    assert set(COLUMN_UPGRADES) <= set(TABLES)
    for table, stmt in COLUMN_UPGRADES.items():
        assert stmt.startswith(f"ALTER TABLE {table} "), table


@pytest.mark.parametrize("table", TABLES)
def test_every_column_a_store_made_before_lacks_is_added_by_an_upgrade(table: str) -> None:
    have = create_specs(table)
    added = upgrades_of(table)
    rekeyed = {"msg_key"} if table in MSG_KEY_TABLES else set()  # added by the re-keying (test_msg_key.py)
    missing = set(have) - set(BASELINE[table]) - set(added) - rekeyed
    assert not missing, (
        f"{table}: {sorted(missing)} in its CREATE TABLE but in no upgrade: a store made before gets no such "
        f"column and refuses every insert of {table}; add it to the table's statement in COLUMN_UPGRADES "
        "(ingest/schema.py), with the CREATE's type and default"
    )
    assert not set(added) - set(have), (
        f"{table}: an upgrade adds {sorted(set(added) - set(have))}, not created"
    )
    assert set(BASELINE[table]) <= set(have), (
        f"{table}: a baseline column is gone: {set(BASELINE[table]) - set(have)}"
    )


@pytest.mark.parametrize("table", sorted(COLUMN_UPGRADES))
def test_an_upgrade_adds_each_column_as_the_create_makes_it(table: str) -> None:
    have = create_specs(table)
    for name, spec in upgrades_of(table).items():
        assert spec == have[name], (
            f"{table}.{name}: the upgrade adds {spec!r}, CREATE TABLE makes {have[name]!r}"
        )


def _columns(store: Store, tables: tuple[str, ...]) -> list[dict[str, Any]]:
    return store.query(
        "SELECT table, name, type, default_kind, default_expression FROM system.columns "
        "WHERE database = currentDatabase() AND has({t:Array(String)}, table) ORDER BY table, name",
        {"t": list(tables)},
    )


@pytest.mark.integration  # chDB, two stores (over 0.7 s)
def test_a_store_of_the_baseline_columns_migrates_to_the_columns_of_a_new_one(tmp_path: Path) -> None:
    """The whole store's migrate (the rules' tables too) on ingest tables holding only their
    baseline columns gives, column by column, the names, types and defaults of a new store."""
    from gpuslo.rules.tables import SCHEMA

    tables = tuple(sorted(TABLES))
    new = ChdbStore(tmp_path / "new")
    try:
        new.migrate(SCHEMA)
        want = _columns(new, tables)
    finally:
        new.close()
    old = ChdbStore(tmp_path / "old")
    try:
        for stmt in INGEST_SCHEMA.create():
            m = re.match(r"CREATE TABLE IF NOT EXISTS (\w+)", stmt)
            if m:
                # msg_key and raw_hash are keys: the ingest's own upgrade re-keys a table made
                # without them (test_msg_key.py, test_ingest_edges.py)
                keep = (*BASELINE[m.group(1)], "msg_key", "raw_hash")
                lines = stmt.split("\n")
                stmt = "\n".join(
                    ln for ln in lines if not re.match(r"    \w+ ", ln) or ln.split()[0] in keep
                ).replace(",\n)", "\n)")
            old.execute(stmt)
        assert {r["name"] for r in _columns(old, ("sched_events",))} == set(BASELINE["sched_events"])
        old.migrate(SCHEMA)
        got = _columns(old, tables)
    finally:
        old.close()
    assert got == want

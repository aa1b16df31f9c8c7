"""Each package owns the tables it writes (issue 13 item 2): the ingest declares its own
(ingest/schema.py), the rules theirs (rules/tables.py: rollups, rule_results, alert_state), the
store's schema composes them, and ``gpuslo schema`` prints every table the code writes. The list
of written tables is derived from the code itself, not typed here."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from gpuslo.app.cli import EXIT_OK, main
from gpuslo.ingest import schema as ingest_schema
from gpuslo.ingest.writer import to_columns
from gpuslo.rules import tables as rules_tables
from tests.corpus import base_messages
from tests.helpers import T0

ROOT = Path(__file__).resolve().parent.parent
# the store side: the agent, core and wire never import a store (the layer contract)
PACKAGES = ("ingest", "rules", "dashboards", "gpuslo/app")
_CREATE = re.compile(r"CREATE TABLE IF NOT EXISTS\s+`?(\w+)")
_INSERT = re.compile(r"INSERT INTO\s+`?(\w+)")


_STORE_INSERT = re.compile(r"\.insert\(\s*\"(\w+)\"")  # store.insert("table", ...)


@functools.cache
def _code() -> tuple[tuple[Path, str], ...]:
    """Every module of the packages: (path, its text)."""
    return tuple((p, p.read_text()) for d in PACKAGES for p in sorted((ROOT / d).rglob("*.py")))


def _written_by_code() -> set[str]:
    # the ingest: the tables its writer fills from one message of every kind, and its dead letters
    written = set(to_columns(base_messages(T0)))
    for _, text in _code():  # store.insert("table", ...) and INSERT INTO table in any query text
        written |= set(_STORE_INSERT.findall(text)) | set(_INSERT.findall(text))
    return written


def test_gpuslo_schema_prints_every_table_the_code_writes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == EXIT_OK
    printed = set(_CREATE.findall(capsys.readouterr().out))
    written = _written_by_code()
    # the derivation sees each way the code writes: the writer, store.insert, INSERT INTO
    assert {"gpu_samples", "node_heartbeats", "dead_letters", "rule_results", "alert_state"} <= written
    assert {
        "gpu_rollup_1m",
        "owner_rollup_1m",
        "latency_rollup_1m",
        "gpu_rollup_1h",
        "owner_rollup_1h",
        "rollup_state",
        "rollup_dirty",
    } <= written
    assert written - printed == set()
    assert "alert_state" in printed


def test_tables_are_created_only_where_they_are_declared() -> None:
    """No package creates a table on the side (as ``AlertState.__init__`` once did): every
    ``CREATE TABLE`` of the code is in ingest/schema.py or rules/tables.py."""
    owners = {ROOT / "ingest/schema.py", ROOT / "rules/tables.py"}
    elsewhere = [
        f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
        for p, text in _code()
        if p not in owners
        for m in _CREATE.finditer(text)
    ]
    # (the server store's CREATE DATABASE is a database, not a table)
    assert elsewhere == []


def test_each_package_declares_its_own_tables() -> None:
    ingest = set(_CREATE.findall(ingest_schema.INGEST_SCHEMA.render()))
    rules = set(_CREATE.findall(";".join(rules_tables.RULES_TABLES.create(ingest_schema.DEFAULT_TTL_DAYS))))
    assert ingest == set(ingest_schema.TABLES)
    assert rules == set(rules_tables.TABLES)
    assert {"alert_state", "rule_results", "gpu_rollup_1m"} <= rules and not ingest & rules
    # the store's schema: the ingest's tables first (the rules' views read them), then the rules'
    assert rules_tables.SCHEMA.parts == (ingest_schema.INGEST_TABLES, rules_tables.RULES_TABLES)


def test_the_ingest_never_imports_the_rules() -> None:
    for p in sorted((ROOT / "ingest").rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.ImportFrom) and n.module:
                assert not n.module.startswith(("gpuslo.rules", "gpuslo.dashboards")), (p, n.module)
            if isinstance(n, ast.Import):
                assert not any(a.name.startswith(("gpuslo.rules", "gpuslo.dashboards")) for a in n.names), p

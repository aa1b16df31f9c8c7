"""``gpuslo schema --cluster NAME``: the cluster DDL, checked with the ClickHouse engine as far
as one can go without a cluster (no Keeper, no remote_servers here): every statement parsed
(ClickHouse 26.x and 24.8), each local table created without its replication, each
Distributed table taken by the engine up to the lookup of its cluster, and the views run on
the local tables to show that each mark lands on the shard its own table's key picks."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuslo.app.cli import main
from gpuslo.ingest import cluster as cl
from gpuslo.ingest.failures import Failure
from gpuslo.ingest.pipeline import retention_days, upgrade
from gpuslo.ingest.schema import RAW_TABLES, SCHEMA_FILE
from gpuslo.ingest.store import ChdbStore, StoreError
from gpuslo.rules.tables import SCHEMA
from tests.helpers import T0

ROOT = Path(__file__).resolve().parents[1]
PY24 = ROOT / ".venv-ch24" / "bin" / "python"
GOLDEN = SCHEMA_FILE.with_name("schema_cluster.sql")
ON = " ON CLUSTER 'gpuslo'"

# The sharding keys, written down from the tables' ORDER BY (docs/deployment.md): a node's rows
# by (cluster, node), a service's by (cluster, service), the rest by their ORDER BY before time.
EXPECTED_KEYS = {
    "gpu_samples": ("cluster", "node"),
    "node_heartbeats": ("cluster", "node"),
    "health_events": ("cluster", "node"),
    "sched_events": ("cluster", "scheduler", "request_id"),
    "latency": ("cluster", "service"),
    "dead_letters": ("origin", "raw_hash"),
    "rollup_dirty": ("cluster", "key"),
    "gpu_rollup_1m": ("cluster", "node"),
    "owner_rollup_1m": ("cluster", "node"),
    "latency_rollup_1m": ("cluster", "service"),
    "gpu_rollup_1h": ("cluster", "node"),
    "owner_rollup_1h": ("cluster", "node"),
    # a cluster's minute is one row, built from all its nodes' candidates (read across shards)
    "capacity_steps_1m": ("cluster",),
    "rollup_state": ("name",),
    "rule_results": ("rule", "window_s", "cluster", "pool", "label"),
    "alert_state": ("fingerprint",),
    "reclaim_actions": ("cluster", "holder_id"),
}


def _unreplicated(stmt: str) -> str:
    """A local table's statement as one server can run it: no ON CLUSTER, no Keeper path."""
    stmt = stmt.replace(ON, "")
    return re.sub(r"ENGINE = Replicated(\w*MergeTree)\('[^']*', '[^']*'(?:, )?", r"ENGINE = \1(", stmt)


def _local_schema(store: ChdbStore) -> None:
    for stmt in cl.statements(SCHEMA, "gpuslo"):
        if "ENGINE = Distributed(" not in stmt:
            store.execute(_unreplicated(stmt))


def _columns(store: ChdbStore, table: str) -> list[tuple[Any, ...]]:
    rows = store.query(
        "SELECT name, type, default_kind, default_expression FROM system.columns "
        "WHERE database = currentDatabase() AND table = {t:String} ORDER BY position",
        {"t": table},
    )
    return [tuple(r.values()) for r in rows]


def test_checked_in_cluster_ddl_is_the_rendered_ddl() -> None:
    """Golden file: regenerate with `gpuslo schema --cluster gpuslo > ingest/schema_cluster.sql`."""
    assert GOLDEN.read_text() == cl.render(SCHEMA, "gpuslo")


def test_cli_prints_the_cluster_ddl(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--cluster", "gpuslo"]) == 0
    assert capsys.readouterr().out == GOLDEN.read_text()


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a'b",
        "a b",
        "x;DROP TABLE t",
        "{shard}",
        "c\n",
        "c\x00",
        "-c",
        "1c",
        ".c",
        "x" * 129,
        "ä",
        "c`",
        'c"',
        "c\\",
    ],
)
def test_hostile_cluster_names_exit_2_with_a_reason(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", f"--cluster={name}"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "--cluster" in out.err and "cluster name" in out.err


@pytest.mark.parametrize("name", ["c", "_c", "prod-eu.1", "x" * 128])
def test_cluster_names_remote_servers_allows_are_quoted_everywhere(name: str) -> None:
    ddl = cl.render(SCHEMA, name)
    assert ddl.count(f"ON CLUSTER '{name}'") == len(cl.statements(SCHEMA, name))
    assert ddl.count(f"Distributed('{name}', ") == len(EXPECTED_KEYS)


def test_every_table_has_its_local_and_distributed_pair() -> None:
    """Each single-node table has its Replicated* local table and a Distributed one of its own
    name over it, sharded by cityHash64 of the expected key; each view reads and writes local tables."""
    stmts = cl.statements(SCHEMA, "gpuslo")
    single = [re.match(r"CREATE (TABLE|MATERIALIZED VIEW) IF NOT EXISTS (\w+)", s) for s in SCHEMA.create()]
    tables = [m[2] for m in single if m and m[1] == "TABLE"]
    assert set(tables) == set(EXPECTED_KEYS)
    for t in tables:
        local = [s for s in stmts if s.startswith(f"CREATE TABLE IF NOT EXISTS {t}_local{ON}\n")]
        dist = [s for s in stmts if s.startswith(f"CREATE TABLE IF NOT EXISTS {t}{ON}\n")]
        assert len(local) == 1 and len(dist) == 1, t
        assert re.search(
            r"ENGINE = Replicated\w*MergeTree\('/clickhouse/tables/\{shard\}/\{database\}/\{table\}', '\{replica\}'",
            local[0],
        )
        key = ", ".join(EXPECTED_KEYS[t])
        assert dist[0].endswith(
            f"ENGINE = Distributed('gpuslo', currentDatabase(), '{t}_local', cityHash64({key}))"
        )
        assert "TTL" not in dist[0] and "ORDER BY" not in dist[0]
    views = [s for s in stmts if s.startswith("CREATE MATERIALIZED VIEW")]
    assert len(views) == sum(1 for m in single if m and m[1] != "TABLE") == 3
    for v in views:
        assert re.search(r" TO rollup_dirty_local AS\n", v)
        assert re.search(r"\nFROM (gpu_samples|node_heartbeats|latency)_local\Z", v), v


def test_sharding_keys_are_made_of_the_dedup_key() -> None:
    """Every version of a row has the same ORDER BY (a ReplacingMergeTree's dedup key): a key
    made of its columns sends them all to one shard, where FINAL sees them together."""
    for t in cl.tables(SCHEMA):
        assert t.shard_key == EXPECTED_KEYS[t.name]
        if t.replacing:
            assert set(t.shard_key) <= set(t.order_by), t.name
        assert not any(t.columns[c].startswith("DateTime") for c in t.shard_key), t.name


def test_a_key_outside_the_dedup_key_is_refused() -> None:
    stmt = next(s for s in SCHEMA.create() if s.startswith("CREATE TABLE IF NOT EXISTS gpu_samples\n"))
    with pytest.raises(ValueError, match="not made of its ORDER BY"):
        cl.table_of(stmt, {"gpu_samples": ("cluster", "uuid")})
    with pytest.raises(ValueError, match="not columns of it"):
        cl.table_of(stmt, {"gpu_samples": ("cluster", "nope")})
    dirty = next(s for s in SCHEMA.create() if s.startswith("CREATE TABLE IF NOT EXISTS rollup_dirty\n"))
    with pytest.raises(ValueError, match="no sharding key"):
        cl.table_of(dirty, {})  # ORDER BY at: nothing before the time column


@pytest.mark.integration  # over 0.7 s
def test_local_and_distributed_tables_have_the_single_node_columns(tmp_path: Path) -> None:
    """With the engine: the single-node table, its local table (created without replication) and
    its Distributed table (its column list, on an engine one server can create) have the same
    columns, types and defaults, in order."""
    store = ChdbStore(tmp_path / "s")  # one chDB store per process at a time
    try:
        store.migrate(SCHEMA)
        want = {t: _columns(store, t) for t in EXPECTED_KEYS}
        for stmt in reversed(SCHEMA.create()):
            kind, name = re.findall(r"CREATE (TABLE|MATERIALIZED VIEW) IF NOT EXISTS (\w+)", stmt)[0]
            store.execute(f"DROP {'TABLE' if kind == 'TABLE' else 'VIEW'} {name}")
        _local_schema(store)
        for stmt in cl.statements(SCHEMA, "gpuslo"):
            if "ENGINE = Distributed(" in stmt:
                store.execute(
                    re.sub(r"ENGINE = Distributed\(.*\)\Z", "ENGINE = Memory", stmt.replace(ON, ""))
                )
        for t, cols in want.items():
            assert cols, t
            assert _columns(store, f"{t}_local") == cols, t
            assert _columns(store, t) == cols, t
    finally:
        store.close()


def test_the_engine_takes_each_distributed_table_up_to_its_cluster(tmp_path: Path) -> None:
    """ClickHouse checks a Distributed table's arguments and its sharding key against its columns
    before it looks up the cluster: the only error left is the cluster no server here has. A
    Replicated table stops at the {shard} macro (its ORDER BY and TTL are checked unreplicated above)."""
    store = ChdbStore(tmp_path / "s")
    try:
        _local_schema(store)
        for stmt in cl.statements(SCHEMA, "gpuslo"):
            if "ENGINE = Distributed(" in stmt:
                with pytest.raises(Exception, match=r"Requested cluster 'gpuslo' not found"):
                    store.execute(stmt.replace(ON, ""))
            elif "ENGINE = Replicated" in stmt:
                with pytest.raises(Exception, match=r"No macro '?shard'? in config"):
                    store.execute(stmt.replace(ON, "").replace("_local\n", "_r\n", 1))
    finally:
        store.close()


def test_every_statement_parses_on_the_current_engine(store: ChdbStore) -> None:
    for stmt in cl.statements(SCHEMA, "gpuslo"):
        ast = store.query("EXPLAIN AST " + stmt)
        assert ast, stmt[:80]
    with pytest.raises(Exception, match="Syntax error"):  # the check can fail
        store.query("EXPLAIN AST " + cl.statements(SCHEMA, "gpuslo")[0].replace("\n)\nENGINE", "\nENGINE"))


@pytest.mark.skipif(not PY24.exists(), reason="no .venv-ch24 (scripts/test.sh makes it)")
@pytest.mark.integration  # over 0.7 s
def test_every_statement_parses_on_clickhouse_24_8() -> None:
    """On 24.8 too: every statement parsed; then, as on the current engine, each local table and
    view created without replication and each Distributed table taken up to its cluster lookup."""
    stmts = cl.statements(SCHEMA, "gpuslo")
    steps = [{"sql": "EXPLAIN AST " + s} for s in stmts]
    steps.append(
        {"sql": "EXPLAIN AST CREATE TABLE t ON CLUSTER 'c' (a String) ENGINE = Distributed('c', db, t, (a"}
    )
    created = [{"sql": _unreplicated(s)} for s in stmts if "ENGINE = Distributed(" not in s]
    dist = [{"sql": s.replace(ON, "")} for s in stmts if "ENGINE = Distributed(" in s]
    r = subprocess.run([str(PY24), str(ROOT / "tests/compat/run_sql.py")], input=json.dumps(steps + created + dist),
                       capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout)
    assert results[0]["version"].startswith("24.8."), results[0]
    parsed, results = results[1 : len(steps) + 1], results[len(steps) + 1 :]
    for step, res in zip(steps[:-1], parsed[:-1], strict=True):
        assert "error" not in res, f"{res['error']}\n-- in:\n{step['sql'][:600]}"
        assert res["rows"], step["sql"][:80]
    assert "Syntax error" in parsed[-1]["error"]  # the check can fail
    for step, res in zip(created, results[: len(created)], strict=True):
        assert "error" not in res, f"{res['error']}\n-- in:\n{step['sql'][:600]}"
    for step, res in zip(dist, results[len(created) :], strict=True):
        assert "Requested cluster 'gpuslo' not found" in res.get("error", ""), (res, step["sql"][:80])


NODES = [f"n{i}" for i in range(40)] + ["n'q", "n\\b", "ноды"]
_PAIRS = "FROM (SELECT arrayJoin(['c1', 'c2']) AS c) AS cs CROSS JOIN (SELECT arrayJoin({ns:Array(String)}) AS n) AS ns"


def _insert_rows(store: ChdbStore) -> None:
    """Each of 2 x 43 nodes (services): a sample, a heartbeat, a latency row, in one block per table."""
    p = {"ns": NODES, "t": T0}
    store.execute(
        "INSERT INTO gpu_samples_local (cluster, node, pool, gpu, ts, interval_s, healthy, alloc_share) "
        f"SELECT c, n, 'p', 0, toDateTime64({{t:Float64}} + 0.5, 3, 'UTC'), 70, 1, 0 {_PAIRS}",
        p,
    )
    store.execute(
        "INSERT INTO node_heartbeats_local (cluster, node, pool, ts, interval_s, schedulable, gpus) "
        f"SELECT c, n, 'p', toDateTime64({{t:Float64}} + 30, 3, 'UTC'), 60, 1, 8 {_PAIRS}",
        p,
    )
    store.execute(
        "INSERT INTO latency_local (cluster, service, source, ts, interval_s, total) "
        f"SELECT c, concat('svc-', n), 'a', toDateTime64({{t:Float64}} + 10, 3, 'UTC'), 10, 1 {_PAIRS}",
        p,
    )


@pytest.mark.integration  # over 0.7 s
def test_views_mark_the_shard_their_rows_are_on(tmp_path: Path) -> None:
    """A view runs on the shard its source row was routed to and writes the local marks there:
    the marks' own sharding key must pick the same shard, i.e. hash the same as the row's."""
    keys = {t.name: t for t in cl.tables(SCHEMA)}
    store = ChdbStore(tmp_path / "s")
    try:
        _local_schema(store)
        _insert_rows(store)
        for kind, source, source_key in (("gpu", "gpu_samples", "node"), ("heartbeat", "node_heartbeats", "node"),
                                         ("latency", "latency", "service")):  # fmt: skip
            per_row = store.query(
                f"SELECT DISTINCT cluster, {source_key} AS k, {cl.shard_expr(keys[source])} AS h FROM {source}_local"
            )
            marks = store.query(
                f"SELECT DISTINCT cluster, key AS k, {cl.shard_expr(keys['rollup_dirty'])} AS h "
                "FROM rollup_dirty_local WHERE kind = {kind:String}",
                {"kind": kind},
            )
            assert len(per_row) == 2 * len(NODES), kind
            got = sorted((r["cluster"], r["k"], r["h"]) for r in marks)
            assert got == sorted((r["cluster"], r["k"], r["h"]) for r in per_row), kind
    finally:
        store.close()


def test_a_rollup_and_its_rows_share_a_shard() -> None:
    """The rollups are recomputed from their node's (service's) rows and read with them:
    the same key columns, so the same shard."""
    keys = {t.name: t.shard_key for t in cl.tables(SCHEMA)}
    for rollup, raw in (("gpu_rollup_1m", "gpu_samples"), ("owner_rollup_1m", "gpu_samples"),
                        ("latency_rollup_1m", "latency"), ("node_heartbeats", "gpu_samples"),
                        ("gpu_rollup_1h", "gpu_samples"), ("owner_rollup_1h", "gpu_samples")):  # fmt: skip
        assert keys[rollup] == keys[raw], rollup


def test_retention_alters_go_to_every_shards_local_tables() -> None:
    for stmt in SCHEMA.retention_statements(900):
        got = cl.on_cluster(stmt, "gpuslo")
        name = stmt.split()[2]
        assert got.startswith(f"ALTER TABLE {name}_local ON CLUSTER 'gpuslo' MODIFY TTL"), got
    with pytest.raises(ValueError):
        cl.on_cluster("DROP TABLE x", "gpuslo")
    with pytest.raises(ValueError):
        cl.on_cluster(SCHEMA.retention_statements(900)[0], "a'b")


def test_the_cluster_and_local_table_are_read_back_from_a_distributed_create() -> None:
    dist = next(
        s
        for s in cl.statements(SCHEMA, "prod-eu.1")
        if s.startswith("CREATE TABLE IF NOT EXISTS gpu_samples ")
    )
    assert cl.distributed_over(dist) == ("prod-eu.1", "gpu_samples_local")
    # as a server keeps it (the database evaluated)
    kept = "CREATE TABLE db.gpu_samples (`a` String) ENGINE = Distributed('c', 'db', 'gpu_samples_local', cityHash64(a))"
    assert cl.distributed_over(kept) == ("c", "gpu_samples_local")
    assert cl.distributed_over(next(iter(SCHEMA.create()))) is None


class _ClusterStore:
    """A store whose gpu_samples is Distributed: system.tables as a server answers it, the
    statements it is given recorded (what the ingest runs on a cluster at start)."""

    def __init__(self, ttl_days: int, local: bool = True) -> None:
        self.has_local = local
        self.local = (
            "CREATE TABLE db.gpu_samples_local (`ts` DateTime64(3, 'UTC')) ENGINE = ReplicatedReplacingMergeTree"
            f"('/clickhouse/tables/{{shard}}/db/gpu_samples_local', '{{replica}}') ORDER BY ts "
            f"TTL toDate(ts) + toIntervalDay({ttl_days})"
        )
        self.executed: list[str] = []

    def query(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        t = (params or {}).get("t")
        if t == "gpu_samples":
            return [{"q": "CREATE TABLE db.gpu_samples (`ts` DateTime64(3, 'UTC')) ENGINE = Distributed"
                          "('gpuslo', 'db', 'gpu_samples_local', cityHash64(cluster, node))"}]  # fmt: skip
        if t == "gpu_samples_local" and self.has_local:
            return [{"q": self.local}]
        return []

    def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        self.executed.append(sql)


def test_the_ingest_reads_and_sets_a_clusters_retention_on_its_local_tables() -> None:
    s = _ClusterStore(30)
    assert retention_days(s) == 30  # type: ignore[arg-type]
    assert upgrade(s, None, schema=SCHEMA) == 30  # type: ignore[arg-type]
    assert s.executed == []  # in force: nothing to alter (a Distributed table takes no TTL)
    assert upgrade(s, 45, schema=SCHEMA) == 45  # type: ignore[arg-type]
    assert s.executed == [
        f"ALTER TABLE {t}_local ON CLUSTER 'gpuslo' MODIFY TTL toDate(ts) + INTERVAL 45 DAY"
        for t in RAW_TABLES
    ]


# ---------------------------------------------------------------- the queries over Distributed tables
# What a query needs on a cluster is read from its syntax tree (ClickHouse's own parser):
# - a JOIN with a store table directly on its left is sent to the shards with its right side
#   (refused by the default distributed_product_mode, and a RIGHT/FULL one would repeat unmatched
#   rows once per shard): there must be none, every join is between subqueries;
# - an IN subquery inside a query read from a store table directly runs on the shards: each must be
#   in the list below, which docs/deployment.md explains (distributed_product_mode = global).
SHARD_IN_SUBQUERIES = {
    "rollup.HEARTBEAT_MARKS",  # (cluster, node) IN marks, over gpu_samples and node_heartbeats
    "rollup.LATENCY_REFRESH",  # (cluster, service, minute) IN marks, over latency
    "rollup.GPU_MINUTE_TOMBSTONES",  # (cluster, node, minute) IN marks, over gpu_rollup_1m
    "rollup.OWNER_MINUTE_TOMBSTONES",  # the same, over owner_rollup_1m
    "rollup.LATENCY_MINUTE_TOMBSTONES",  # (cluster, service, minute) IN marks, over latency_rollup_1m
    "rollup.GPU_HOUR_TOMBSTONES",  # (cluster, node, hour) IN marks, over gpu_rollup_1h
    "rollup.GPU_HOUR_REFRESH",  # the same, over gpu_rollup_1m
    "rollup.OWNER_HOUR_TOMBSTONES",  # over owner_rollup_1h
    "rollup.OWNER_HOUR_REFRESH",  # over owner_rollup_1m
    "sql.STARVATION_ROLLUP",  # minute IN (incidents' minutes), over capacity_steps_1m
    "sql.STARVATION_MINUTE_SWEEP",  # minute IN (incidents' minutes), over gpu_rollup_1m
    "rollup.STEPS_REFRESH",  # (cluster, minute) IN marks, over gpu_rollup_1m
    "rollup.STEPS_BACKFILL",  # (cluster, minute) IN the minute tier's, over gpu_rollup_1m
    "sql.NODE_SNAP_ROLLUP",  # the same fragment (STARVATION_ROLLUP's snapshot)
}
_MODULES = ("sql", "rollup", "energy", "chargeback", "reclaim", "evaluate", "alerts", "actions", "measures")


@dataclass
class _Node:
    label: str
    children: list[_Node]


def _tree(text: str) -> _Node:
    root = _Node("", [])
    stack: list[tuple[int, _Node]] = [(-1, root)]
    for line in text.splitlines():
        depth = len(line) - len(line.lstrip(" "))
        node = _Node(line.strip(), [])
        while stack[-1][0] >= depth:
            stack.pop()
        stack[-1][1].children.append(node)
        stack.append((depth, node))
    return root


def _walk(n: _Node) -> Iterator[_Node]:
    yield n
    for c in n.children:
        yield from _walk(c)


def _direct_table(tables_in_select: _Node, store_tables: set[str]) -> str | None:
    """The store table a FROM reads directly (not through a subquery), if any."""
    first = tables_in_select.children[0]
    for expr in first.children:
        if expr.label.startswith("TableExpression") and expr.children:
            words = expr.children[0].label.split()
            if words[0] == "TableIdentifier" and words[1] in store_tables:
                return words[1]
    return None


def _in_subqueries(n: _Node) -> Iterator[_Node]:
    """IN subqueries in a query's expressions (not inside its nested queries)."""
    ins = ("Function in ", "Function notIn ", "Function globalIn", "Function globalNotIn")
    for c in n.children:
        if c.label.startswith(ins) and any(
            a.label.startswith("Subquery") for e in c.children for a in e.children
        ):
            yield c
        if not c.label.startswith(("Subquery", "SelectWithUnionQuery", "TablesInSelectQuery")):
            yield from _in_subqueries(c)


def _queries() -> dict[str, str]:
    import importlib

    from gpuslo.dashboards.generate import VIEWS
    from gpuslo.dashboards.overview import panel_queries
    from gpuslo.rules.config import example
    from tests.grafana import expand

    out: dict[str, str] = {}
    for mod in _MODULES:
        for k, v in vars(importlib.import_module(f"gpuslo.rules.{mod}")).items():
            if (
                isinstance(v, str)
                and re.match(r"\s*\(?\s*(SELECT|WITH|INSERT)\b", v)
                and k.isupper()
                and k[0] != "_"
            ):
                out[f"{mod}.{k}"] = v
    from gpuslo.rules.evaluate import slo_steps_query

    for slo in example().slos:  # built per SLO, over raw rows and over the rollups
        out[f"evaluate.slo_steps_query {slo.name}"] = slo_steps_query(slo)
        out[f"evaluate.slo_steps_query {slo.name} rollup"] = slo_steps_query(slo, rollup=True)
    for title, (q, _fmt) in panel_queries(example()).items():
        out[f"panel fleet-overview: {title}"] = expand(q, T0, T0 + 3600)
    for _name, (_title, uid, specs, _vars) in VIEWS.items():
        for spec in specs(example()):
            out[f"panel {uid}: {spec.title}"] = expand(spec.sql, T0, T0 + 3600)
    return out


@pytest.mark.integration  # over 0.7 s
def test_rule_and_panel_queries_are_right_over_distributed_tables(store: ChdbStore) -> None:
    store_tables = {t.name for t in cl.tables(SCHEMA)}
    queries = _queries()
    assert len(queries) > 60 and "sql.STARVATION" in queries and any(q.startswith("panel ") for q in queries)
    assert any(q.startswith("evaluate.slo_steps_query") for q in queries)
    direct_joins: list[str] = []
    shard_ins: set[str] = set()
    for name, q in queries.items():
        if "{" in re.sub(r"\{\w+:[^{}]+\}", "", q):  # a fragment with slots left for a later fill
            continue
        text = "\n".join(
            r["explain"] for r in store.query("EXPLAIN AST " + re.sub(r"\{\w+:[^{}]+\}", "0", q))
        )
        for n in _walk(_tree(text)):
            if n.label.startswith("TablesInSelectQuery ") and len(n.children) > 1:
                joined = any(c.label.startswith("TableJoin") for e in n.children[1:] for c in e.children)
                if joined and _direct_table(n, store_tables):
                    direct_joins.append(name)
            if n.label.startswith("SelectQuery"):
                tis = [c for c in n.children if c.label.startswith("TablesInSelectQuery")]
                if tis and _direct_table(tis[0], store_tables) and any(True for _ in _in_subqueries(n)):
                    shard_ins.add(name.split(":")[0] if name.startswith("panel") else name)
    assert direct_joins == []
    assert shard_ins == SHARD_IN_SUBQUERIES


def test_a_server_without_the_local_tables_is_refused_not_given_a_retention() -> None:
    """Connected to a server that has the Distributed table but not its local one, the store's
    retention cannot be read: guessing one (400 days) and altering the cluster to it could drop rows."""
    s = _ClusterStore(800, local=False)
    for call in (lambda: upgrade(s, None, schema=SCHEMA), lambda: upgrade(s, 30, schema=SCHEMA)):  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="Distributed over gpu_samples_local of cluster 'gpuslo'") as e:
            call()
        assert e.value.failure is Failure.FATAL
    assert s.executed == []


def test_the_single_node_schema_is_a_no_op_on_a_cluster() -> None:
    """Every process migrates the store to the single-node schema at start (CREATE ... IF NOT
    EXISTS): on a cluster each of its tables and views exists already, under the same name, so
    nothing is created beside the cluster's (a view on a Distributed table would mark twice)."""
    made = lambda stmts: {re.findall(r"IF NOT EXISTS (\w+)", s)[0] for s in stmts}  # noqa: E731
    assert made(SCHEMA.create()) <= made(cl.statements(SCHEMA, "gpuslo"))

"""A store's schema on a ClickHouse cluster (``gpuslo schema --cluster NAME``).

Every table of the single-node schema (:class:`gpuslo.ingest.schema.Schema`) becomes a pair:

- ``<table>_local``: the table as it is, on every shard, its engine made ``Replicated*``
  (``ReplacingMergeTree(v)`` -> ``ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/
  {database}/{table}', '{replica}', v)``), its replicas kept in step through Keeper;
- ``<table>``: a ``Distributed`` table over them with the same columns, so the ingest, the rules
  and the panels keep their table names and read and write the whole cluster.

The sharding key of a table is ``cityHash64`` of its identity columns: by default the leading
columns of its ``ORDER BY`` up to the first time column (for a ``ReplacingMergeTree`` the ORDER
BY is the dedup key, so every version of a row lands on one shard and ``FINAL``, which each
shard applies to its own rows, stays exact); a package overrides it where rows must share a
shard with another table's (``Tables.shard_keys``: a node's samples, heartbeats and rollups all
by ``(cluster, node)``). Materialized views are made on the local tables of every shard: they
see the inserts of their shard only and write to their target's local table there, which is
the shard the target's own key picks (tests/test_cluster.py checks this with the engine).

Nothing here can run on a cluster in this project: the statements are checked by ClickHouse's
parser (tests/test_cluster.py, on ClickHouse 26.x and 24.8); docs/deployment.md says how to
deploy them and which settings the queries need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuslo.ingest.schema import DEFAULT_TTL_DAYS, Schema

LOCAL = "_local"
#: The Keeper path of a local table's replicas (server macros ``{shard}``, ``{replica}``; the
#: server expands ``{database}`` and ``{table}`` itself).
ZK_PATH = "/clickhouse/tables/{shard}/{database}/{table}"
REPLICA = "{replica}"
#: A cluster name as ``remote_servers`` can declare it (an XML element name), quoted where used.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}\Z")

_TABLE = re.compile(
    r"CREATE TABLE IF NOT EXISTS (?P<name>\w+)\n\((?P<cols>.*)\n\)\n"
    r"ENGINE = (?P<kind>\w*)MergeTree(?:\((?P<args>[^)]*)\))?\n(?P<rest>.*)\Z",
    re.S,
)
_VIEW = re.compile(
    r"CREATE MATERIALIZED VIEW IF NOT EXISTS (?P<name>\w+) TO (?P<to>\w+) AS\n(?P<select>.*)\Z", re.S
)
_ORDER_BY = re.compile(r"^ORDER BY (?:\((?P<many>[^)]*)\)|(?P<one>\w+))$", re.M)
_ALTER = re.compile(r"ALTER TABLE (?P<name>\w+) ")


def check_cluster_name(name: str) -> str:
    """``name`` if it can name a cluster; ValueError saying why not."""
    if not _NAME.match(name):
        raise ValueError(
            f"cluster name {name!r}: must be 1-128 of letters, digits, '_', '.', '-', "
            "starting with a letter or '_' (a remote_servers element name)"
        )
    return name


@dataclass(frozen=True)
class Table:
    """One table of the single-node schema, as the cluster schema sees it."""

    name: str
    columns: dict[str, str]  # name -> type
    order_by: tuple[str, ...]
    replacing: bool
    shard_key: tuple[str, ...]


def _columns(block: str) -> dict[str, str]:
    cols: dict[str, str] = {}
    for line in block.split(",\n"):
        name, typ = line.strip().split(" ", 1)
        cols[name] = re.split(r" (?:DEFAULT|MATERIALIZED|ALIAS) ", typ)[0]
    return cols


def _identity(order_by: tuple[str, ...], columns: dict[str, str]) -> tuple[str, ...]:
    """The leading ORDER BY columns before the first time column."""
    out: list[str] = []
    for c in order_by:
        if columns.get(c, "").startswith("DateTime"):
            break
        out.append(c)
    return tuple(out)


def table_of(stmt: str, overrides: dict[str, tuple[str, ...]]) -> Table | None:
    """The table a ``CREATE TABLE`` statement makes, with its sharding key (None: not a table)."""
    m = _TABLE.match(stmt)
    return None if m is None else _table(m, overrides)


def _table(m: re.Match[str], overrides: dict[str, tuple[str, ...]]) -> Table:
    cols = _columns(m["cols"])
    ob = _ORDER_BY.search(m["rest"])
    if ob is None:
        raise ValueError(f"table {m['name']}: no ORDER BY")
    order_by = tuple(c.strip() for c in (ob["many"] or ob["one"]).split(","))
    replacing = m["kind"] == "Replacing"
    key = overrides.get(m["name"]) or _identity(order_by, cols)
    if not key:
        raise ValueError(f"table {m['name']}: no sharding key (its ORDER BY starts with a time column)")
    unknown = [c for c in key if c not in cols]
    if unknown:
        raise ValueError(f"table {m['name']}: sharding key columns {unknown} are not columns of it")
    if replacing and not set(key) <= set(order_by):
        # a column outside the dedup key could send two versions of one row to two shards
        raise ValueError(f"table {m['name']}: sharding key {key} is not made of its ORDER BY {order_by}")
    return Table(m["name"], cols, order_by, replacing, key)


def shard_expr(table: Table) -> str:
    return f"cityHash64({', '.join(table.shard_key)})"


def _local_create(m: re.Match[str], cluster: str) -> str:
    args = ", ".join(a for a in (f"'{ZK_PATH}'", f"'{REPLICA}'", (m["args"] or "").strip()) if a)
    return (
        f"CREATE TABLE IF NOT EXISTS {m['name']}{LOCAL} ON CLUSTER '{cluster}'\n({m['cols']}\n)\n"
        f"ENGINE = Replicated{m['kind']}MergeTree({args})\n{m['rest']}"
    )


def _distributed_create(m: re.Match[str], table: Table, cluster: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {table.name} ON CLUSTER '{cluster}'\n({m['cols']}\n)\n"
        f"ENGINE = Distributed('{cluster}', currentDatabase(), '{table.name}{LOCAL}', {shard_expr(table)})"
    )


def _view(stmt: str, cluster: str, local: set[str]) -> str:
    m = _VIEW.match(stmt)
    if m is None:
        raise ValueError(f"cannot render on a cluster: {stmt.splitlines()[0]}")
    if m["to"] not in local:
        raise ValueError(f"view {m['name']}: its target {m['to']} is not made before it")
    select = re.sub(
        r"\bFROM (\w+)\b", lambda f: f"FROM {f[1]}{LOCAL}" if f[1] in local else f[0], m["select"]
    )
    return f"CREATE MATERIALIZED VIEW IF NOT EXISTS {m['name']} ON CLUSTER '{cluster}' TO {m['to']}{LOCAL} AS\n{select}"


def tables(schema: Schema, ttl_days: int = DEFAULT_TTL_DAYS) -> list[Table]:
    """Every table of ``schema``, with its sharding key."""
    keys = schema.shard_keys()
    return [t for stmt in schema.create(ttl_days) if (t := table_of(stmt, keys)) is not None]


def statements(schema: Schema, cluster: str, ttl_days: int = DEFAULT_TTL_DAYS) -> list[str]:
    """The ``ON CLUSTER`` DDL of ``schema``: each table's local and distributed pair, in the
    single-node order, and its views on the local tables."""
    check_cluster_name(cluster)
    keys = schema.shard_keys()
    out: list[str] = []
    local: set[str] = set()
    for stmt in schema.create(ttl_days):
        m = _TABLE.match(stmt)
        if m is None:
            out.append(_view(stmt, cluster, local))
            continue
        table = _table(m, keys)
        out += [_local_create(m, cluster), _distributed_create(m, table, cluster)]
        local.add(table.name)
    return out


def render(schema: Schema, cluster: str, ttl_days: int = DEFAULT_TTL_DAYS) -> str:
    """The DDL text (``gpuslo schema --cluster NAME``)."""
    return ";\n\n".join(statements(schema, cluster, ttl_days)) + ";\n"


def on_cluster(alter: str, cluster: str) -> str:
    """A single-node ``ALTER TABLE t ...`` (a retention change) for the local tables of every
    shard: the TTL lives on ``t_local``; a ``Distributed`` table has none."""
    check_cluster_name(cluster)
    m = _ALTER.match(alter)
    if m is None:
        raise ValueError(f"not an ALTER TABLE: {alter[:60]}")
    return f"ALTER TABLE {m['name']}{LOCAL} ON CLUSTER '{cluster}' {alter[m.end() :]}"


_DISTRIBUTED = re.compile(r"ENGINE = Distributed\('?(?P<cluster>[\w.-]+)'?, *[^,]+, *'?(?P<local>\w+)'?")


def distributed_over(create_query: str) -> tuple[str, str] | None:
    """(cluster, local table) of a ``Distributed`` table from its ``CREATE`` text
    (``system.tables.create_table_query``); None for any other table."""
    m = _DISTRIBUTED.search(create_query)
    return None if m is None else (m["cluster"], m["local"])

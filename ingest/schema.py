"""ClickHouse schema: the tables the ingest owns.

The DDL is rendered from the wire field catalogue (one nullable column per
``DCGM_FI_*`` field) and checked in as ``schema.sql``; a test keeps the two equal.
It is valid on ClickHouse server 24.8+ and on chDB.

Idempotency: every table is a ``ReplacingMergeTree`` whose ORDER BY is the natural
key of a message row, so a replayed message (a Kafka batch re-read after a crash between
insert and offset commit, a file ingested twice, a spool re-sent after an agent crash)
replaces itself instead of doubling; the rule and panel queries read with ``FINAL`` so
they are exact before merges happen. Dead letters are keyed by their origin
(``topic/partition/offset`` or ``file:line``) and a hash of their bytes: a re-read Kafka
batch or a re-ingested file replaces its own dead letters, while two streams that share an
origin (two ``stdin`` runs, a file name reused for other content) keep every rejected line.

Retention: the raw tables' TTL is ``toDate(ts) + INTERVAL n DAY`` (``Date`` arithmetic: a
``DateTime`` sum overflows after 2106, and ClickHouse before 25.7 takes no ``DateTime64``
TTL). ``n`` is a property of the store (``gpuslo ingest --retention-days``), read back by
the ingest so that it refuses, with a reason, exactly the rows the TTL would drop.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from gpuslo.wire import FIELDS
from gpuslo.wire.bounds import DATE_MAX_DAYS, TS_MAX

SCHEMA_FILE = Path(__file__).with_name("schema.sql")
DEFAULT_TTL_DAYS = 400
#: The longest retention a ``Date`` TTL can express for the latest time the wire accepts.
MAX_TTL_DAYS = DATE_MAX_DAYS - int(TS_MAX // 86400) - 1
#: ClickHouse's default ``max_partitions_per_insert_block``; the ingest splits inserts below it.
MAX_PARTITIONS_PER_INSERT = 100


def _ttl(column: str, days: int) -> str:
    return f"TTL toDate({column}) + INTERVAL {int(days)} DAY"


def expires_at(ts: float, ttl_days: int) -> float:
    """When the raw tables' TTL drops a row of time ``ts`` (the same arithmetic as the DDL)."""
    return (ts // 86400 + ttl_days) * 86400.0


_TS = "DateTime64(3, 'UTC')"
_ENVELOPE = """    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)"""


def render(ttl_days: int = DEFAULT_TTL_DAYS) -> str:
    field_cols = ",\n".join(f"    {f.name} Nullable(Float64)" for f in FIELDS)
    if not 1 <= ttl_days <= MAX_TTL_DAYS:
        raise ValueError(f"retention must be 1..{MAX_TTL_DAYS} days, not {ttl_days}")
    ttl = _ttl("ts", ttl_days)
    tables = [
        f"""CREATE TABLE IF NOT EXISTS gpu_samples
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    pool LowCardinality(String),
    gpu UInt16,
    mig_gi Int16 DEFAULT -1,
    mig_ci Int16 DEFAULT -1,
    mig_profile LowCardinality(String),
    gpu_fraction Float32 DEFAULT 1,
    uuid String,
    model LowCardinality(String),
    ts {_TS},
    interval_s Float32,
    healthy UInt8,
    activity Nullable(Float32),
    alloc_share Float32,
    alloc_schedulers Array(LowCardinality(String)),
    alloc_ids Array(String),
    alloc_names Array(String),
    alloc_users Array(LowCardinality(String)),
    alloc_accounts Array(LowCardinality(String)),
    alloc_queues Array(LowCardinality(String)),
    alloc_shares Array(Float32),
{field_cols},
{_ENVELOPE}
)
ENGINE = ReplacingMergeTree(ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, gpu, mig_gi, mig_ci, ts)
{ttl}""",
        f"""CREATE TABLE IF NOT EXISTS node_heartbeats
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    pool LowCardinality(String),
    ts {_TS},
    interval_s Float32,
    schedulable UInt8,
    state LowCardinality(String),
    reason String,
    gpus UInt16,
{_ENVELOPE}
)
ENGINE = ReplacingMergeTree(ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, ts)
{ttl}""",
        f"""CREATE TABLE IF NOT EXISTS sched_events
(
    cluster LowCardinality(String),
    scheduler LowCardinality(String),
    event LowCardinality(String),
    request_id String,
    ts {_TS},
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    pool LowCardinality(String),
    gpus_per_node Float32,
    nodes UInt32,
    reason LowCardinality(String),
    assigned_nodes Array(String),
    cause LowCardinality(String) DEFAULT '',
    cluster_queue LowCardinality(String) DEFAULT '',
{_ENVELOPE}
)
ENGINE = ReplacingMergeTree(ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, scheduler, request_id, event, ts)
{ttl}""",
        f"""CREATE TABLE IF NOT EXISTS latency
(
    cluster LowCardinality(String),
    service LowCardinality(String),
    ts {_TS},
    interval_s Float32,
    bounds_ms Array(Float64),
    counts Array(UInt64),
    total UInt64,
    sum_ms Float64,
{_ENVELOPE}
)
ENGINE = ReplacingMergeTree(ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, service, source, ts)
{ttl}""",
        f"""CREATE TABLE IF NOT EXISTS health_events
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    gpu UInt16,
    uuid String,
    ts {_TS},
    event LowCardinality(String),
    code UInt32,
    fatal UInt8,
    message String,
{_ENVELOPE}
)
ENGINE = ReplacingMergeTree(ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, gpu, ts, event)
{ttl}""",
        f"""CREATE TABLE IF NOT EXISTS dead_letters
(
    received_at {_TS},
    origin String,
    topic LowCardinality(String),
    partition Int32,
    offset Int64,
    reason String,
    raw String,
    raw_hash UInt64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(received_at)
ORDER BY (origin, raw_hash)
TTL toDateTime(received_at) + INTERVAL 90 DAY""",
    ]
    return ";\n\n".join(tables + _rollups(ttl_days)) + ";\n"


#: The idle thresholds the rollups keep idle seconds for (``idle_*_s[i]`` is for the i-th);
#: a rules config whose ``idle_threshold`` is not among them is evaluated over raw rows.
ROLLUP_IDLE_THRESHOLDS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
ROLLUP_TTL_DAYS = 800


def _rollups(raw_ttl_days: int) -> list[str]:
    """Per-minute rollups (rules/rollup.py fills them) and the materialized views that mark
    which minutes need (re)computing.

    Why not aggregate straight from materialized views: an MV sees every insert, replays
    included, so a Kafka batch re-read after a crash would count twice in a summing rollup.
    Here the MVs only record *which* (node, minute) and (service, minute) received rows; the
    refresh recomputes those minutes from the deduplicated raw rows (``FINAL``) into
    ``ReplacingMergeTree`` rollups keyed by the minute, so replays, late rows and repeated
    refreshes all converge to the same numbers. Rollups outlive the raw rows (their own TTL).
    """
    ttl_days = max(ROLLUP_TTL_DAYS, raw_ttl_days)
    n = len(ROLLUP_IDLE_THRESHOLDS)
    return [
        """CREATE TABLE IF NOT EXISTS rollup_dirty
(
    kind LowCardinality(String),
    cluster LowCardinality(String),
    key LowCardinality(String),
    minute DateTime('UTC'),
    at DateTime64(3, 'UTC')
)
ENGINE = MergeTree
PARTITION BY toDate(at)
ORDER BY at
TTL toDateTime(at) + INTERVAL 14 DAY""",
        # a sample at ts covers [ts, ts + interval_s) and stands for its node's free GPUs for
        # 2 x interval_s (the starvation snapshot): every minute of that is marked
        """CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_samples_dirty_mv TO rollup_dirty AS
SELECT DISTINCT 'gpu' AS kind, cluster, node AS key,
    toDateTime(arrayJoin(range(toUInt32(intDiv(toInt64(toFloat64(ts)), 60) * 60),
                               toUInt32(ceil(toFloat64(ts) + 2 * interval_s)), 60)), 'UTC') AS minute,
    now64(3) AS at
FROM gpu_samples""",
        # a heartbeat's state holds until the node's next one: the refresh finds the minutes
        # it reaches (rules/rollup.py HEARTBEAT_MARKS)
        """CREATE MATERIALIZED VIEW IF NOT EXISTS node_heartbeats_dirty_mv TO rollup_dirty AS
SELECT DISTINCT 'heartbeat' AS kind, cluster, node AS key, toStartOfMinute(ts) AS minute, now64(3) AS at
FROM node_heartbeats""",
        """CREATE MATERIALIZED VIEW IF NOT EXISTS latency_dirty_mv TO rollup_dirty AS
SELECT DISTINCT 'latency' AS kind, cluster, service AS key,
    toDateTime(toInt64(ceil(toFloat64(ts) / 60) * 60), 'UTC') AS minute, now64(3) AS at
FROM latency""",
        f"""CREATE TABLE IF NOT EXISTS gpu_rollup_1m
(
    cluster LowCardinality(String),
    pool LowCardinality(String),
    node LowCardinality(String),
    minute DateTime('UTC'),
    samples UInt32,
    capacity_s Float64,
    allocated_s Float64,
    active_s Float64,
    idle_allocated_s Array(Float64),
    idle_unallocated_s Array(Float64),
    snap_ts Array({_TS}),
    snap_interval_s Array(Float32),
    snap_free Array(Float64),
    snap_whole_free Array(UInt32),
    snap_frac_free Array(Float64),
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(minute)
ORDER BY (cluster, node, minute)
{_ttl("minute", ttl_days)}
COMMENT 'per node per minute, idle_*_s[i] for the i-th of {n} thresholds {list(ROLLUP_IDLE_THRESHOLDS)}, snap_* per sample time'""",
        f"""CREATE TABLE IF NOT EXISTS owner_rollup_1m
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    minute DateTime('UTC'),
    id String,
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    allocated_s Float64,
    idle_s Array(Float64),
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(minute)
ORDER BY (cluster, node, minute, id)
{_ttl("minute", ttl_days)}""",
        f"""CREATE TABLE IF NOT EXISTS latency_rollup_1m
(
    cluster LowCardinality(String),
    service LowCardinality(String),
    minute_end DateTime('UTC'),
    bounds_hash UInt64,
    bounds_ms Array(Float64),
    counts Array(UInt64),
    total UInt64,
    sum_ms Float64,
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(minute_end)
ORDER BY (cluster, service, minute_end, bounds_hash)
{_ttl("minute_end", ttl_days)}""",
        """CREATE TABLE IF NOT EXISTS rollup_state
(
    name LowCardinality(String),
    watermark DateTime64(3, 'UTC'),
    updated DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(updated)
ORDER BY name""",
        f"""CREATE TABLE IF NOT EXISTS rule_results
(
    evaluated_at DateTime('UTC'),
    window_s UInt32,
    rule LowCardinality(String),
    cluster LowCardinality(String),
    pool LowCardinality(String),
    label String,
    value Nullable(Float64)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(evaluated_at)
ORDER BY (rule, window_s, cluster, pool, label, evaluated_at)
{_ttl("evaluated_at", ttl_days)}""",
    ]


def statements(ddl: str | None = None) -> list[str]:
    text = render() if ddl is None else ddl
    return [s.strip() for s in text.split(";") if s.strip()]


def retention_statements(ttl_days: int) -> list[str]:
    """Set the retention of an existing store (the raw tables' TTL; the rollups keep theirs
    unless the raw rows would outlive them)."""
    render(ttl_days)  # validates the range
    out = [f"ALTER TABLE {t} MODIFY {_ttl('ts', ttl_days)}" for t in RAW_TABLES]
    if ttl_days > ROLLUP_TTL_DAYS:
        for t, col in (("gpu_rollup_1m", "minute"), ("owner_rollup_1m", "minute"),
                       ("latency_rollup_1m", "minute_end"), ("rule_results", "evaluated_at")):  # fmt: skip
            out.append(f"ALTER TABLE {t} MODIFY {_ttl(col, ttl_days)}")
    return out


_TTL_DAYS = re.compile(r"TTL (toDate|toDateTime)\(ts\) \+ (?:INTERVAL (\d+) DAY|toIntervalDay\((\d+)\))")


def ttl_days_of(create_query: str) -> tuple[int, bool] | None:
    """The retention of a raw table from its ``CREATE`` text (``system.tables``), and whether
    its TTL is the current ``Date`` form (stores made before it have ``toDateTime(ts)``, which
    overflows after 2106)."""
    m = _TTL_DAYS.search(create_query)
    return None if m is None else (int(m.group(2) or m.group(3)), m.group(1) == "toDate")


#: Stores made before dead letters were keyed by their bytes too (a column without a default:
#: ClickHouse lets a new column join the sorting key only then; the ingest fills it).
DEAD_LETTERS_UPGRADE = (
    "ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS raw_hash UInt64, MODIFY ORDER BY (origin, raw_hash)"
)


#: Stores made before scheduler events carried a cause and a parent queue (Kueue): the columns
#: join with their defaults, so the rows already there read as they did (run by every
#: ``Store.migrate``; a no-op where they exist).
SCHED_EVENTS_UPGRADE = (
    "ALTER TABLE sched_events ADD COLUMN IF NOT EXISTS cause LowCardinality(String) DEFAULT '', "
    "ADD COLUMN IF NOT EXISTS cluster_queue LowCardinality(String) DEFAULT ''"
)


@functools.cache
def column_types(table: str) -> dict[str, str]:
    """Column name -> ClickHouse type of one table, from the rendered DDL."""
    for stmt in statements():
        m = re.match(rf"CREATE TABLE IF NOT EXISTS {table}\s*\((.*)\)\s*ENGINE", stmt, re.S)
        if m:
            cols: dict[str, str] = {}
            for line in m.group(1).split(",\n"):
                name, typ = line.strip().split(" ", 1)
                cols[name] = re.split(r" (?:DEFAULT|MATERIALIZED) ", typ)[0]
            return cols
    raise KeyError(table)


RAW_TABLES = ("gpu_samples", "node_heartbeats", "sched_events", "latency", "health_events")
TABLES = (*RAW_TABLES, "dead_letters")
ROLLUP_TABLES = (
    "rollup_dirty",
    "gpu_rollup_1m",
    "owner_rollup_1m",
    "latency_rollup_1m",
    "rollup_state",
    "rule_results",
)

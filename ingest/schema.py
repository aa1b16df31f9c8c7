"""ClickHouse schema: the tables the ingest owns.

The DDL is rendered from the wire field catalogue (one nullable column per
``DCGM_FI_*`` field) and checked in as ``schema.sql``; a test keeps the two equal.
It is valid on ClickHouse server 24.8+ and on chDB.

Idempotency: every table is a ``ReplacingMergeTree`` whose ORDER BY is the natural
key of a message row, so a replayed message (a Kafka batch re-read after a crash between
insert and offset commit, a file ingested twice, a spool re-sent after an agent crash)
replaces itself instead of doubling; the rule and panel queries read with ``FINAL`` so
they are exact before merges happen. Dead letters are keyed by their origin
(``topic/partition/offset`` or ``file:line``).
"""

from __future__ import annotations

from pathlib import Path

from gpuslo.wire import FIELDS

SCHEMA_FILE = Path(__file__).with_name("schema.sql")
DEFAULT_TTL_DAYS = 400

_TS = "DateTime64(3, 'UTC')"
_ENVELOPE = """    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)"""


def render(ttl_days: int = DEFAULT_TTL_DAYS) -> str:
    field_cols = ",\n".join(f"    {f.name} Nullable(Float64)" for f in FIELDS)
    ttl = f"TTL toDateTime(ts) + INTERVAL {int(ttl_days)} DAY"
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
    raw String
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(received_at)
ORDER BY origin
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
        """CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_samples_dirty_mv TO rollup_dirty AS
SELECT DISTINCT 'gpu' AS kind, cluster, node AS key, toStartOfMinute(ts) AS minute, now64(3) AS at
FROM gpu_samples""",
        """CREATE MATERIALIZED VIEW IF NOT EXISTS node_heartbeats_dirty_mv TO rollup_dirty AS
SELECT DISTINCT 'gpu' AS kind, cluster, node AS key,
    arrayJoin([toStartOfMinute(ts), toStartOfMinute(ts) + 60]) AS minute, now64(3) AS at
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
TTL minute + INTERVAL {ttl_days} DAY
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
TTL minute + INTERVAL {ttl_days} DAY""",
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
TTL minute_end + INTERVAL {ttl_days} DAY""",
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
TTL evaluated_at + INTERVAL {ttl_days} DAY""",
    ]


def statements(ddl: str | None = None) -> list[str]:
    text = render() if ddl is None else ddl
    return [s.strip() for s in text.split(";") if s.strip()]


TABLES = ("gpu_samples", "node_heartbeats", "sched_events", "latency", "health_events", "dead_letters")
ROLLUP_TABLES = (
    "rollup_dirty",
    "gpu_rollup_1m",
    "owner_rollup_1m",
    "latency_rollup_1m",
    "rollup_state",
    "rule_results",
)

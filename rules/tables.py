"""The tables the rules write: the per-minute rollups (``rules/rollup.py`` fills them) and
the views that mark which minutes need (re)computing, the refresh's watermark, the rule
results and the alert state. They are declared here, by the package that writes them; the
ingest declares its own (``ingest/schema.py``), and :data:`SCHEMA`, the store's whole
schema, composes the two (``gpuslo schema`` prints it, every store is migrated to it).

Why not aggregate straight from materialized views: an MV sees every insert, replays
included, so a Kafka batch re-read after a crash would count twice in a summing rollup.
Here the MVs only record *which* (node, minute) and (service, minute) received rows; the
refresh recomputes those minutes from the deduplicated raw rows (``FINAL``) into
``ReplacingMergeTree`` rollups keyed by the minute, so replays, late rows and repeated
refreshes all converge to the same numbers. Rollups outlive the raw rows (their own TTL).
"""

from __future__ import annotations

from gpuslo.ingest.schema import INGEST_TABLES, TS, Schema, Tables, ttl_clause

#: The idle thresholds the rollups keep idle seconds for (``idle_*_s[i]`` is for the i-th);
#: a rules config whose ``idle_threshold`` is not among them is evaluated over raw rows.
ROLLUP_IDLE_THRESHOLDS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
ROLLUP_TTL_DAYS = 800


#: how long a mark is kept (by its time): a refresh whose last one is older re-marks from the raw rows
MARKS_TTL_DAYS = 14

#: What the views on the raw tables mark, per raw table: the (kind, cluster, key, minute) its rows
#: need re-rolled, at ``at`` (an SQL expression: their insert's time). A refresh whose marks may
#: have expired re-marks the rows ingested since its last one with the same selects
#: (rules/rollup.py REMARKS).
MARKED_TABLES = ("gpu_samples", "node_heartbeats", "latency")


def mark_select(table: str, at: str) -> str:
    """The select of ``table``'s marks (``table`` one of :data:`MARKED_TABLES`), each at ``at``."""
    if table == "gpu_samples":
        # a sample at ts covers [ts, ts + interval_s) and stands for its node's free GPUs for
        # 2 x interval_s (the starvation snapshot): every minute of that is marked
        return f"""SELECT DISTINCT 'gpu' AS kind, cluster, node AS key,
    toDateTime(arrayJoin(range(toUInt32(intDiv(toInt64(toFloat64(ts)), 60) * 60),
                               toUInt32(ceil(toFloat64(ts) + 2 * interval_s)), 60)), 'UTC') AS minute,
    {at} AS at
FROM gpu_samples"""
    if table == "node_heartbeats":
        # a heartbeat's state holds until the node's next one: the refresh finds the minutes
        # it reaches (rules/rollup.py HEARTBEAT_MARKS)
        return f"""SELECT DISTINCT 'heartbeat' AS kind, cluster, node AS key, toStartOfMinute(ts) AS minute, {at} AS at
FROM node_heartbeats"""
    if table == "latency":
        return f"""SELECT DISTINCT 'latency' AS kind, cluster, service AS key,
    toDateTime(toInt64(ceil(toFloat64(ts) / 60) * 60), 'UTC') AS minute, {at} AS at
FROM latency"""
    raise KeyError(table)


_VIEWS = {
    "gpu_samples": "gpu_samples_dirty_mv",
    "node_heartbeats": "node_heartbeats_dirty_mv",
    "latency": "latency_dirty_mv",
}


def _dirty_marks() -> list[str]:
    """The table of marked minutes, and the views on the ingest's tables that fill it."""
    return [
        f"""CREATE TABLE IF NOT EXISTS rollup_dirty
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
TTL toDateTime(at) + INTERVAL {MARKS_TTL_DAYS} DAY""",
        *(
            f"CREATE MATERIALIZED VIEW IF NOT EXISTS {view} TO rollup_dirty AS\n"
            + mark_select(table, "now64(3)")
            for table, view in _VIEWS.items()
        ),
    ]


def _gpu_rollup(ttl_days: int) -> str:
    n = len(ROLLUP_IDLE_THRESHOLDS)
    return f"""CREATE TABLE IF NOT EXISTS gpu_rollup_1m
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
    snap_ts Array({TS}),
    snap_interval_s Array(Float32),
    snap_free Array(Float64),
    snap_whole_free Array(UInt32),
    snap_frac_free Array(Float64),
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(minute)
ORDER BY (cluster, node, minute)
{ttl_clause("minute", ttl_days)}
COMMENT 'per node per minute, idle_*_s[i] for the i-th of {n} thresholds {list(ROLLUP_IDLE_THRESHOLDS)}, snap_* per sample time'"""


def _owner_rollup(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS owner_rollup_1m
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
{ttl_clause("minute", ttl_days)}"""


def _latency_rollup(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS latency_rollup_1m
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
{ttl_clause("minute_end", ttl_days)}"""


# The hourly tier (rules/rollup.py HOUR_REFRESH): the sums of the minute tier's rows per node and
# hour, one row per pool (a node's minutes may name different pools) or per holder with its labels
# (an id's minutes may carry different ones), so every sum over them is the sum over the minutes.
# A re-rolled hour gets its rows anew, then a tombstone (``dropped``, zero sums) for each row it
# has at a lower version (the new rows win over it): a key no minute carries any more reads as
# gone under FINAL, and no reader finds a re-rolled hour without its rows (rules/rollup.py).
def _gpu_rollup_1h(ttl_days: int) -> str:
    n = len(ROLLUP_IDLE_THRESHOLDS)
    return f"""CREATE TABLE IF NOT EXISTS gpu_rollup_1h
(
    cluster LowCardinality(String),
    pool LowCardinality(String),
    node LowCardinality(String),
    hour DateTime('UTC'),
    samples UInt32,
    capacity_s Float64,
    allocated_s Float64,
    active_s Float64,
    idle_allocated_s Array(Float64),
    idle_unallocated_s Array(Float64),
    version UInt64,
    dropped UInt8
)
ENGINE = ReplacingMergeTree(version, dropped)
PARTITION BY toYYYYMM(hour)
ORDER BY (cluster, node, hour, pool)
{ttl_clause("hour", ttl_days)}
COMMENT 'per node, hour and pool: sums of gpu_rollup_1m, idle_*_s[i] for the i-th of {n} thresholds {list(ROLLUP_IDLE_THRESHOLDS)}'"""


def _owner_rollup_1h(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS owner_rollup_1h
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    hour DateTime('UTC'),
    id String,
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    allocated_s Float64,
    idle_s Array(Float64),
    version UInt64,
    dropped UInt8
)
ENGINE = ReplacingMergeTree(version, dropped)
PARTITION BY toYYYYMM(hour)
ORDER BY (cluster, node, hour, id, name, user, account, queue)
{ttl_clause("hour", ttl_days)}"""


# The starvation tier (rules/rollup.py STEPS_REFRESH): per cluster and minute, the capacity
# snapshot of every opening the minute may hold, as step functions: for each stream of the
# snapshot's sweep (rules/sql.py: ``every`` 0 a node's pool string, 1 the whole cluster) the
# times (``step_at``, ascending; the first at or after the minute's start stands for the state
# the minute begins in) where its state changes inside the minute, and after each its free
# GPUs (exact Decimal) and its nodes per free shape. A stream is kept wherever a node of its
# pool was seen in the minute, even with no step. One row per (cluster, minute): a re-rolled
# minute's row replaces the old one whole.
def _capacity_steps_1m(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS capacity_steps_1m
(
    cluster LowCardinality(String),
    minute DateTime('UTC'),
    every Array(UInt8),
    pool_key Array(String),
    step_at Array(Array(Float64)),
    step_free Array(Array(Decimal128(20))),
    step_shapes Array(Array(Array(Float64))),
    step_nodes Array(Array(Array(Int64))),
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(minute)
ORDER BY (cluster, minute)
{ttl_clause("minute", ttl_days)}
COMMENT 'per cluster and minute: the starvation snapshot streams (every, pool_key) as step functions'"""


_ROLLUP_STATE = """CREATE TABLE IF NOT EXISTS rollup_state
(
    name LowCardinality(String),
    watermark DateTime64(3, 'UTC'),
    updated DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(updated)
ORDER BY name"""


def _rule_results(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS rule_results
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
{ttl_clause("evaluated_at", ttl_days)}"""


# one row per alert (its fingerprint): the state of each firing or resolved alert
ALERT_STATE = """CREATE TABLE IF NOT EXISTS alert_state
(
    fingerprint String,
    alertname LowCardinality(String),
    labels Map(String, String),
    annotations Map(String, String),
    state LowCardinality(String),
    started_at DateTime64(3, 'UTC'),
    ended_at Nullable(DateTime64(3, 'UTC')),
    last_sent_at DateTime64(3, 'UTC'),
    updated_at DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY fingerprint"""


# the idle-reclaim loop's decisions (rules/actions.py): one row per dry-run decision, refusal,
# attempt (started, then done or failed) and give-up; an append-only log, read back as its state
def _reclaim_actions(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS reclaim_actions
(
    at DateTime64(3, 'UTC'),
    cluster LowCardinality(String),
    scheduler LowCardinality(String),
    job String,
    holder_id String,
    queue LowCardinality(String),
    user LowCardinality(String),
    account LowCardinality(String),
    action LowCardinality(String),
    mode LowCardinality(String),
    outcome LowCardinality(String),
    reason String,
    attempt UInt16,
    held_since DateTime64(3, 'UTC'),
    idle_since DateTime64(3, 'UTC'),
    idle_gpu_hours Float64
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(at)
ORDER BY (cluster, holder_id, at)
{ttl_clause("at", ttl_days)}"""


# the tables with a retention of their own (at least the raw rows'), and their time column
_KEPT = (("gpu_rollup_1m", "minute"), ("owner_rollup_1m", "minute"), ("latency_rollup_1m", "minute_end"),
         ("gpu_rollup_1h", "hour"), ("owner_rollup_1h", "hour"), ("capacity_steps_1m", "minute"),
         ("rule_results", "evaluated_at"), ("reclaim_actions", "at"))  # fmt: skip


def _tables(raw_ttl_days: int) -> list[str]:
    ttl_days = max(ROLLUP_TTL_DAYS, raw_ttl_days)
    return [
        *_dirty_marks(),
        _gpu_rollup(ttl_days),
        _owner_rollup(ttl_days),
        _latency_rollup(ttl_days),
        _gpu_rollup_1h(ttl_days),
        _owner_rollup_1h(ttl_days),
        _capacity_steps_1m(ttl_days),
        _ROLLUP_STATE,
        _rule_results(ttl_days),
        ALERT_STATE,
        _reclaim_actions(ttl_days),
    ]


def _retention(raw_ttl_days: int) -> list[str]:
    """The rollups and results keep their retention unless the raw rows would outlive them."""
    if raw_ttl_days <= ROLLUP_TTL_DAYS:
        return []
    return [f"ALTER TABLE {t} MODIFY {ttl_clause(col, raw_ttl_days)}" for t, col in _KEPT]


#: The rules' tables. On a cluster the marks of a node (a service) share the shard of its rows,
#: where the views on that shard's tables write them (``key`` is the node or the service).
RULES_TABLES = Tables(create=_tables, retention=_retention, shard_keys={"rollup_dirty": ("cluster", "key")})

#: The store's whole schema: the ingest's tables, then the rules' (their views read the ingest's).
SCHEMA = Schema((INGEST_TABLES, RULES_TABLES))

ROLLUP_TABLES = ("rollup_dirty", "gpu_rollup_1m", "owner_rollup_1m", "latency_rollup_1m", "gpu_rollup_1h",
                 "owner_rollup_1h", "capacity_steps_1m", "rollup_state")  # fmt: skip
TABLES = (*ROLLUP_TABLES, "rule_results", "alert_state", "reclaim_actions")

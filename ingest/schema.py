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
ORDER BY (cluster, node, gpu, ts)
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
    return ";\n\n".join(tables) + ";\n"


def statements(ddl: str | None = None) -> list[str]:
    text = render() if ddl is None else ddl
    return [s.strip() for s in text.split(";") if s.strip()]


TABLES = ("gpu_samples", "node_heartbeats", "sched_events", "latency", "health_events", "dead_letters")

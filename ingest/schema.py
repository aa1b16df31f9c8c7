"""ClickHouse schema: the tables the ingest owns, and the composition of a store's schema
from the tables of each package that writes to it (:class:`Schema`; the rules declare theirs
in ``rules/tables.py``, and ``gpuslo.rules.tables.SCHEMA`` is the store's whole schema).

The DDL is rendered from the wire field catalogue (one nullable column per
``DCGM_FI_*`` field); the whole store's is checked in as ``schema.sql``; a test keeps the two equal.
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuslo.ingest.sqltext import quote
from gpuslo.wire import FIELDS
from gpuslo.wire.bounds import DATE_MAX_DAYS, TS_MAX

SCHEMA_FILE = Path(__file__).with_name("schema.sql")
DEFAULT_TTL_DAYS = 400
#: The longest retention a ``Date`` TTL can express for the latest time the wire accepts.
MAX_TTL_DAYS = DATE_MAX_DAYS - int(TS_MAX // 86400) - 1
#: ClickHouse's default ``max_partitions_per_insert_block``; the ingest splits inserts below it.
MAX_PARTITIONS_PER_INSERT = 100


def ttl_clause(column: str, days: int) -> str:
    return f"TTL toDate({column}) + INTERVAL {int(days)} DAY"


def expires_at(ts: float, ttl_days: int) -> float:
    """When the raw tables' TTL drops a row of time ``ts`` (the same arithmetic as the DDL)."""
    return (ts // 86400 + ttl_days) * 86400.0


TS = "DateTime64(3, 'UTC')"
_ENVELOPE = """    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)"""

#: A message's id as a key column. A health event is an occurrence, not a state a later message
#: corrects, and one tick may carry several of one GPU (the agent drains a node's XIDs each tick
#: and stamps them with its time): ``health_events`` ends its ``ORDER BY`` with it, so each
#: message is a row of its own and a replay of one (same source, boot_id, seq) replaces it.
MSG_KEY_EXPR = "cityHash64(source, boot_id, seq)"
_MSG_KEY = f"    msg_key UInt64 DEFAULT {MSG_KEY_EXPR}"


#: An insert's part is written Compact (one data file) up to this many uncompressed bytes, and
#: every part past it, a merge's included, Wide (two files per column stream: some 200 for
#: gpu_samples' nullable columns). Two costs set it:
#: - an insert's part Wide: ClickHouse's default, 10 MB, made each 40,000-row insert create some
#:   200 files, and on ext4 a fifth of the insert's CPU samples (``perf``) were the kernel choosing
#:   inodes among those the merges had just deleted (eight such inserts: Wide 0.67-1.13 s,
#:   Compact 0.45-0.51 s, session 17);
#: - a merge's part Compact: writing the merged part Compact cost four times the CPU of writing it
#:   Wide (``python -m bench parts``: the background merges of the same 640,000 rows inserted
#:   36,000 at a time took 2.1-2.3 s of CPU up to 256 MiB, 0.5-0.6 s at 32 MiB; the inserts
#:   themselves took the same time).
#: 32 MiB keeps the ingest's default batch Compact (5,000 node batches of 8 GPUs, ~590 bytes a
#: row: 23.5 MB) and makes any merge of two such parts Wide. A bigger batch (the agents' packs up
#: to ``batch_bytes``) is written Wide, at no cost measured (180,000-row inserts). ClickHouse has
#: had Compact parts since 20.3.
GPU_SAMPLES_PART_SETTING = "min_bytes_for_wide_part = 33554432"
#: gpuslo's former values of the setting (sessions 17-19: Compact up to 256 MiB, which made the
#: merges Compact): a store carrying one gets today's at its next ``Store.migrate``.
FORMER_PART_SETTINGS = ("min_bytes_for_wide_part = 268435456",)
#: A store made before the setting gets it at its next ``Store.migrate``, and so does one carrying a
#: former gpuslo value alone (``store.part_setting_is_ours``: one naming a part format of its own
#: keeps it); the parts already written keep their format until merged.
GPU_SAMPLES_PART_UPGRADE = f"ALTER TABLE gpu_samples MODIFY SETTING {GPU_SAMPLES_PART_SETTING}"


def _field_columns() -> str:
    return ",\n".join(f"    {f.name} Nullable(Float64)" for f in FIELDS)


#: The holders' measured split of a shared GPU (gpuslo.wire.Allocation: activity_share,
#: fb_share, share_source), one element per holder as alloc_ids. Rows written before these
#: columns existed (and holders not measured) read as the scheduler's share and "".
_ALLOC_SPLIT = (
    ("alloc_act_shares", "Array(Float32) DEFAULT alloc_shares"),
    ("alloc_fb_shares", "Array(Float32) DEFAULT alloc_shares"),
    ("alloc_share_sources", "Array(LowCardinality(String)) DEFAULT arrayMap(x -> '', alloc_ids)"),
)
_ALLOC_SPLIT_COLUMNS = ",\n".join(f"    {name} {typ}" for name, typ in _ALLOC_SPLIT)


def _gpu_samples(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS gpu_samples
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
    ts {TS},
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
{_ALLOC_SPLIT_COLUMNS},
{_field_columns()},
{_ENVELOPE}
)
ENGINE = ReplacingMergeTree(ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, gpu, mig_gi, mig_ci, ts)
{ttl_clause("ts", ttl_days)}
SETTINGS {GPU_SAMPLES_PART_SETTING}"""


def _node_heartbeats(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS node_heartbeats
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    pool LowCardinality(String),
    ts {TS},
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
{ttl_clause("ts", ttl_days)}"""


def _sched_events(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS sched_events
(
    cluster LowCardinality(String),
    scheduler LowCardinality(String),
    event LowCardinality(String),
    request_id String,
    ts {TS},
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
{ttl_clause("ts", ttl_days)}"""


def _latency(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS latency
(
    cluster LowCardinality(String),
    service LowCardinality(String),
    ts {TS},
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
{ttl_clause("ts", ttl_days)}"""


def _health_events(ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS health_events
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    gpu UInt16,
    uuid String,
    ts {TS},
    event LowCardinality(String),
    code UInt32,
    fatal UInt8,
    message String,
{_ENVELOPE},
{_MSG_KEY}
)
ENGINE = ReplacingMergeTree(ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, gpu, ts, event, msg_key)
{ttl_clause("ts", ttl_days)}"""


def _dead_letters(ttl_days: int) -> str:  # (a TTL of its own)
    return f"""CREATE TABLE IF NOT EXISTS dead_letters
(
    received_at {TS},
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
TTL toDateTime(received_at) + INTERVAL 90 DAY"""


def _tables(ttl_days: int) -> list[str]:
    """The ingest's tables: the raw rows of each message kind (TTL ``ttl_days``) and the dead letters."""
    return [
        make(ttl_days)
        for make in (_gpu_samples, _node_heartbeats, _sched_events, _latency, _health_events, _dead_letters)
    ]


def _retention(ttl_days: int) -> list[str]:
    return [f"ALTER TABLE {t} MODIFY {ttl_clause('ts', ttl_days)}" for t in RAW_TABLES]


@dataclass(frozen=True)
class Tables:
    """The tables one package owns (it writes them): their ``CREATE`` statements for a store of
    retention ``ttl_days``, in order, and the ``ALTER`` statements that set that retention on an
    existing store."""

    create: Callable[[int], list[str]]
    retention: Callable[[int], list[str]]
    #: Sharding keys on a cluster (gpuslo.ingest.cluster) where a table's identity columns (its
    #: ORDER BY before the first time column) are not the key: rows that queries or views
    #: join must share a shard.
    shard_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


#: The ingest's tables. A node's rows (samples, heartbeats, health events) share a shard, as do
#: a service's latency rows and a request's scheduler events, whatever their other key columns.
INGEST_TABLES = Tables(
    create=_tables,
    retention=_retention,
    shard_keys={
        "gpu_samples": ("cluster", "node"),
        "health_events": ("cluster", "node"),
        "sched_events": ("cluster", "scheduler", "request_id"),
        "latency": ("cluster", "service"),
    },
)


@dataclass(frozen=True)
class Schema:
    """A store's schema: the tables of each package that writes to it, in dependency order (a
    package's views may read an earlier package's tables). The ingest declares its own; the
    layer above it composes them with its own (``gpuslo.rules.tables.SCHEMA``)."""

    parts: tuple[Tables, ...]

    def render(self, ttl_days: int = DEFAULT_TTL_DAYS) -> str:
        """The DDL text (``gpuslo schema``)."""
        return ";\n\n".join(self.create(ttl_days)) + ";\n"

    def create(self, ttl_days: int = DEFAULT_TTL_DAYS) -> list[str]:
        """Every ``CREATE`` statement, in order."""
        _check_retention(ttl_days)
        return [stmt for part in self.parts for stmt in part.create(ttl_days)]

    def shard_keys(self) -> dict[str, tuple[str, ...]]:
        """The sharding keys the packages declare (the other tables take their identity columns)."""
        return {t: k for part in self.parts for t, k in part.shard_keys.items()}

    def retention_statements(self, ttl_days: int) -> list[str]:
        """Set the retention of an existing store (the raw tables' TTL; tables with a TTL of
        their own keep it unless the raw rows would outlive them)."""
        _check_retention(ttl_days)
        return [stmt for part in self.parts for stmt in part.retention(ttl_days)]


def _check_retention(ttl_days: int) -> None:
    if not 1 <= ttl_days <= MAX_TTL_DAYS:
        raise ValueError(f"retention must be 1..{MAX_TTL_DAYS} days, not {ttl_days}")


#: A store holding the ingest's tables only.
INGEST_SCHEMA = Schema((INGEST_TABLES,))


def statements(ddl: str) -> list[str]:
    """The statements of a DDL text."""
    return [s.strip() for s in ddl.split(";") if s.strip()]


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


#: The tables keyed by their messages' ids too (``msg_key``).
MSG_KEY_TABLES = ("health_events",)


def msg_key_upgrade(table: str, sorting_key: str, partitions: Iterable[str]) -> list[str]:
    """The statements that bring a ``table`` of :data:`MSG_KEY_TABLES` made before ``msg_key``
    (``sorting_key``: its key, as ``system.tables`` has it; ``partitions``: the ids of its
    partitions, as ``system.parts`` has them after the first) to the current key:
    :func:`msg_key_rekey`, then :func:`msg_key_copy`."""
    return [*msg_key_rekey(table, sorting_key), *msg_key_copy(table, partitions)]


def msg_key_rekey(table: str, sorting_key: str) -> list[str]:
    """``msg_key`` joins the key of ``table``, then takes its default. ClickHouse lets a new
    column join the sorting key only without a default (every row then holds 0, which keeps each
    part sorted); the default is set at once after, so that a row written meanwhile by a writer
    that names no ``msg_key`` (an ingest of an earlier version still running) has its key, and
    the rows written before keep 0 until :func:`msg_key_copy`."""
    out = []
    if "msg_key" not in [k.strip() for k in sorting_key.split(",")]:
        out.append(
            f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS msg_key UInt64, MODIFY ORDER BY ({sorting_key}, msg_key)"
        )
    return [*out, f"ALTER TABLE {table} MODIFY COLUMN msg_key UInt64 DEFAULT {MSG_KEY_EXPR}"]


#: The rows of a table of :data:`MSG_KEY_TABLES` not (yet) under their key.
MSG_KEY_STALE = f"msg_key != {MSG_KEY_EXPR}"


def msg_key_copy(table: str, partitions: Iterable[str]) -> list[str]:
    """The rows of ``table`` without their key (:data:`MSG_KEY_STALE`) written again with it,
    one partition (of ``partitions``, read after :func:`msg_key_rekey`) per ``INSERT`` (a
    store's days are up to its retention, over the :data:`MAX_PARTITIONS_PER_INSERT` one insert
    may write), then deleted. Every step may run again (a copy of a row under its key replaces
    the first copy), so an upgrade stopped midway is finished by the next one. Rows that had
    replaced one another under the old key and not been merged yet come back apart."""
    return [
        # (the filter in a subquery: beside the REPLACE, msg_key would name the new value)
        *(
            f"INSERT INTO {table} SELECT * REPLACE ({MSG_KEY_EXPR} AS msg_key) "
            f"FROM (SELECT * FROM {table} WHERE _partition_id = {quote(p)} AND {MSG_KEY_STALE})"
            for p in partitions
        ),
        f"ALTER TABLE {table} DELETE WHERE {MSG_KEY_STALE} SETTINGS mutations_sync = 2",
    ]


#: Stores made before scheduler events carried a cause and a parent queue (Kueue): the columns
#: join with their defaults, so the rows already there read as they did (run by every
#: ``Store.migrate``; a no-op where they exist).
SCHED_EVENTS_UPGRADE = (
    "ALTER TABLE sched_events ADD COLUMN IF NOT EXISTS cause LowCardinality(String) DEFAULT '', "
    "ADD COLUMN IF NOT EXISTS cluster_queue LowCardinality(String) DEFAULT ''"
)


#: Stores made before a catalogue field joined (``gpuslo/wire/fields.py``): every field's column
#: is added where it is missing, NULL in the rows already there (as a field an older agent did
#: not send). Generated from the catalogue, so a new field can never be left out; run by every
#: ``Store.migrate``, a no-op on a current store. Stores made before the measured split of
#: shared GPUs get its columns with their defaults (the scheduler's shares), so the rows there
#: read as they did.
GPU_SAMPLES_UPGRADE = "ALTER TABLE gpu_samples " + ", ".join(
    [f"ADD COLUMN IF NOT EXISTS {f.name} Nullable(Float64)" for f in FIELDS]
    + [f"ADD COLUMN IF NOT EXISTS {name} {typ}" for name, typ in _ALLOC_SPLIT]
)

#: Every column added to an ingest table since stores were first made, by table: the one list
#: ``Store.migrate`` runs (``Store._upgrades``: a table's statement where a column it adds is
#: missing). A column added to a ``CREATE TABLE`` above goes into its table's statement here, with
#: the same type and default; tests/test_schema_upgrades.py fails on a column a store made before
#: would lack, or would get with another type.
COLUMN_UPGRADES: Mapping[str, str] = {
    "sched_events": SCHED_EVENTS_UPGRADE,
    "gpu_samples": GPU_SAMPLES_UPGRADE,
}


@functools.cache
def column_types(table: str) -> dict[str, str]:
    """Column name -> ClickHouse type of one table, from the rendered DDL."""
    for stmt in INGEST_SCHEMA.create():
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

"""Per-minute rollups: what makes a 7-day or 30-day evaluation cost the same whether the raw
rows are still kept or not.

ClickHouse materialized views on the raw tables record which (node, minute) and
(service, minute) need recomputing (``rollup_dirty``, see rules/tables.py for why they do not
aggregate themselves): a sample marks every minute of ``[ts, ts + 2 x interval_s)``, a heartbeat
its own minute, which :func:`refresh` turns into the minutes of every sample whose state it sets
(up to the node's next heartbeat, however far). :func:`refresh` recomputes exactly those minutes
from the deduplicated raw rows into ``gpu_rollup_1m`` (per node: capacity, allocated, active and
idle GPU-seconds, each sample split over the minutes it covers; and the starvation snapshot
candidates), ``owner_rollup_1m`` (per holder) and ``latency_rollup_1m`` (per service: bucket
counts), then from those the starvation tier ``capacity_steps_1m`` (per cluster and minute: the
snapshot sweep's streams as step functions) and the hourly tier. It is idempotent: replays, late rows and repeated refreshes converge to the same rows.

Exactness over rollups, against the raw definitions (docs/metrics.md), at every
sampling interval the wire accepts (1 s .. MAX_INTERVAL_S):
- CUR, idle, top idle, fair share: the same numbers for windows on whole minutes.
- SLO burn: the same numbers whenever the evaluation step is a multiple of 60 s.
- Starvation: the same incidents and causes. A minute's row keeps the free-GPU figures of the
  samples starting in it and of the node's latest sample before it while that is younger than
  2 x its interval; the snapshot of an opening is the latest of its minute's candidates at or
  before it, which is the latest sample at or before it over raw rows.
Not kept exact: a node whose interval changes, when a late sample with a shorter interval lands
between an older long one and a minute that older one still stands for (that minute keeps the
older snapshot until it is re-rolled), and a node changing pools inside one minute (the minute
goes to the pool of its latest sample).
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

from gpuslo.ingest.sqltext import array, fill, quote
from gpuslo.ingest.store import Store
from gpuslo.rules import measures as m
from gpuslo.rules.sql import CAPACITY_SAMPLES, JOIN_SETTINGS, LATENCY_HELD, NODE_SNAP_RAW, OWNER_HELD
from gpuslo.rules.tables import MARKED_TABLES, MARKS_TTL_DAYS, ROLLUP_IDLE_THRESHOLDS, mark_select

_IDLE_T = "activity < t"  # the idle test at each of the rollups' thresholds t
_THRESHOLDS = array([float(t) for t in ROLLUP_IDLE_THRESHOLDS])
# each refresh also re-takes the marks of this many seconds before the last one's cut: an insert
# that was still being written when that refresh read the marks (its marks carry the time the
# insert began) is taken now; re-computing a minute twice changes nothing
OVERLAP_S = 120.0

# The marks are kept MARKS_TTL_DAYS (by their time): a refresh whose last one is older than that
# (the rules service down for weeks, or first started on a store ingesting for longer) finds the
# marks of the rows ingested before then gone, and those minutes were never rolled (the rollups
# said nothing of them, silently, and `auto` read them). It re-marks those rows first, from the
# raw rows' ingested_at (the store's clock, as the marks' time), with the views' own selects.
MARKS_KEPT_S = (MARKS_TTL_DAYS - 1) * 86400.0  # (a day less: TTL merges are not on the second)
_INGESTED_SKEW_S = 3600.0  # the clocks of a cluster's servers, which set ingested_at
REMARKS = tuple(
    "INSERT INTO rollup_dirty\n"
    + mark_select(table, "toDateTime64({at:Float64}, 3, 'UTC')")
    + "\nWHERE ingested_at > toDateTime64({since:Float64}, 3, 'UTC')"
    " AND ingested_at <= toDateTime64({until:Float64}, 3, 'UTC')"
    for table in MARKED_TABLES
)

_DIRTY = """
    SELECT DISTINCT cluster, key, minute FROM rollup_dirty
    WHERE kind = {kind} AND at > toDateTime64({wm:Float64}, 3, 'UTC') AND at <= toDateTime64({cut:Float64}, 3, 'UTC')
"""


# of them, the minutes in the statement's span [from, to): a refresh re-rolls its gpu marks span
# by span (REFRESH_CHUNK_ROWS), each statement writing the minutes of its span only
_IN_SPAN = """      AND minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')
"""


def _dirty(kind: str, in_span: bool = False) -> str:
    """SQL: the marked (cluster, key, minute) of one kind between the watermark and the cut
    (``in_span``: of those, the minutes in ``[from, to)``)."""
    return fill(_DIRTY + (_IN_SPAN if in_span else ""), kind=quote(kind))


def minutes_of(ts: str, span_s: str) -> str:
    """SQL: the minutes (UInt32 epoch seconds) that ``[ts, ts + span_s)`` overlaps."""
    return (
        f"range(toUInt32(intDiv(toInt64(toFloat64({ts})), 60) * 60), "
        f"toUInt32(ceil(toFloat64({ts}) + {span_s})), 60)"
    )


# A heartbeat changes the state of its node's samples from its minute until the node's next
# heartbeat (however far away): mark every minute those samples (and their snapshots, valid
# for 2 x the interval) reach, with the heartbeat mark's own time so the same refresh takes them.
# A marked minute m reaches [m, first heartbeat at or after m + 60); a later marked minute's
# range ends no earlier, so a sample's range is the one of the latest marked minute at or
# before it (an ASOF join, not a product of samples and marks).
HEARTBEAT_MARKS = f"""
INSERT INTO rollup_dirty
SELECT DISTINCT 'gpu' AS kind, s.cluster AS cluster, s.node AS key,
    toDateTime(arrayJoin({minutes_of("s.ts", "2 * s.interval_s")}), 'UTC') AS minute, r.marked_at AS at
FROM
(
    SELECT cluster, node, toFloat64(ts) AS t, ts, interval_s FROM gpu_samples
    WHERE ts >= toDateTime64({{lo:Float64}}, 3, 'UTC')
      AND (cluster, node) IN (SELECT cluster, key FROM ({_dirty("heartbeat")}))
) AS s
ASOF INNER JOIN
(
    SELECT m.cluster AS cluster, m.key AS node, toFloat64(m.minute) AS lo,
        if(n.ts IS NULL, inf, toFloat64(n.ts)) AS hi, m.marked_at AS marked_at
    FROM
    (
        SELECT cluster, key, minute, toDateTime64(minute + 60, 3, 'UTC') AS next_minute, max(at) AS marked_at
        FROM rollup_dirty
        WHERE kind = 'heartbeat' AND at > toDateTime64({{wm:Float64}}, 3, 'UTC')
          AND at <= toDateTime64({{cut:Float64}}, 3, 'UTC')
        GROUP BY cluster, key, minute
    ) AS m
    ASOF LEFT JOIN
    (
        SELECT cluster, node, ts FROM node_heartbeats
        WHERE ts >= toDateTime64({{lo:Float64}} + 60, 3, 'UTC')
          AND (cluster, node) IN (SELECT cluster, key FROM ({_dirty("heartbeat")}))
    ) AS n
    ON m.cluster = n.cluster AND m.key = n.node AND m.next_minute <= n.ts
) AS r ON s.cluster = r.cluster AND s.node = r.node AND s.t >= r.lo
WHERE s.t < r.hi
{JOIN_SETTINGS}
"""

# A sample of CAPACITY_SAMPLES split over the minutes it covers (rules.rawcover splits the raw
# rows the same way): the ARRAY JOIN giving each ``minute``, and the sample's capacity
# GPU-seconds inside that minute.
PIECE_MINUTES = f"ARRAY JOIN arrayMap(x -> toDateTime(x, 'UTC'), {minutes_of('ts', 'interval_s')}) AS minute"
PIECE_CAP_S = (
    "greatest(0., least(toFloat64(ts) + interval_s, toFloat64(minute) + 60) - greatest(toFloat64(ts), "
    "toFloat64(minute))) * cap_w"
)
# Each sample split over the minutes it covers: ``cap_s`` is its capacity GPU-seconds inside
# the minute; ``first`` says the sample starts in it (where it is counted in ``samples``).
_PIECES = f"""
SELECT * EXCEPT (cap_s), minute, toUInt32(minute) = intDiv(toInt64(toFloat64(ts)), 60) * 60 AS first,
    {PIECE_CAP_S} AS cap_s
FROM ({CAPACITY_SAMPLES})
{PIECE_MINUTES}
WHERE (cluster, node, minute) IN ({_dirty("gpu", in_span=True)})
"""

_SNAP = "Tuple(Float64, Float32, Float64, UInt64, Float64)"  # t, interval_s, free, whole_free, frac_free
_ZEROS = f"arrayWithConstant({len(ROLLUP_IDLE_THRESHOLDS)}, 0.)"

# Per node and minute: the sums of the pieces, and the starvation snapshot candidates for an
# opening inside the minute: the samples that start in it, and the node's latest sample before
# it (however old) while it is younger than 2 x its interval; an opening's snapshot is the
# latest candidate at or before it, exactly as over raw rows. A minute with no piece and no
# candidate has no row.
GPU_REFRESH = f"""
INSERT INTO gpu_rollup_1m
SELECT cluster, pool, node, minute, samples, capacity_s, allocated_s, active_s, idle_allocated_s, idle_unallocated_s,
    arrayMap(x -> toDateTime64(x.1, 3, 'UTC'), snaps) AS snap_ts,
    arrayMap(x -> x.2, snaps) AS snap_interval_s,
    arrayMap(x -> x.3, snaps) AS snap_free,
    arrayMap(x -> toUInt32(x.4), snaps) AS snap_whole_free,
    arrayMap(x -> x.5, snaps) AS snap_frac_free,
    {{version:UInt64}} AS version
FROM
(
SELECT cluster, if(countIf(src = 0) > 0, anyIf(pool, src = 0), any(pool)) AS pool, node, minute,
    sum(n) AS samples, sum(cap) AS capacity_s, sum(alloc) AS allocated_s, sum(act) AS active_s,
    sumForEach(idle_a) AS idle_allocated_s, sumForEach(idle_u) AS idle_unallocated_s,
    arraySort(x -> x.1, arrayFlatten(groupArray(snaps))) AS snaps
FROM
(
    SELECT 0 AS src, cluster, argMax(pool, ts) AS pool, node, minute,
        toUInt64(countIf(first)) AS n, sum({m.FLEET_TERMS["capacity_s"]}) AS cap,
        sum({m.FLEET_TERMS["allocated_s"]}) AS alloc, sum({m.FLEET_TERMS["active_s"]}) AS act,
        sumForEach(arrayMap(t -> {m.term(m.FLEET_TERMS, "idle_allocated_s", _IDLE_T)}, {_THRESHOLDS})) AS idle_a,
        sumForEach(arrayMap(t -> {m.term(m.FLEET_TERMS, "idle_unallocated_s", _IDLE_T)}, {_THRESHOLDS})) AS idle_u,
        CAST([], 'Array({_SNAP})') AS snaps
    FROM ({_PIECES})
    GROUP BY cluster, node, minute
    UNION ALL
    SELECT 1 AS src, cluster, any(pool) AS pool, node, toDateTime(intDiv(toInt64(t), 60) * 60, 'UTC') AS minute,
        toUInt64(0) AS n, 0. AS cap, 0. AS alloc, 0. AS act, {_ZEROS} AS idle_a, {_ZEROS} AS idle_u,
        CAST(groupArray((t, interval_s, free, whole_free, frac_free)), 'Array({_SNAP})') AS snaps
    FROM {NODE_SNAP_RAW} AS ns
    WHERE (cluster, node, minute) IN ({_dirty("gpu", in_span=True)})
    GROUP BY cluster, node, minute
    UNION ALL
    SELECT 2 AS src, d.cluster AS cluster, c.pool AS pool, d.key AS node, d.minute AS minute,
        toUInt64(0) AS n, 0. AS cap, 0. AS alloc, 0. AS act, {_ZEROS} AS idle_a, {_ZEROS} AS idle_u,
        CAST([(c.t, c.interval_s, c.free, c.whole_free, c.frac_free)], 'Array({_SNAP})') AS snaps
    FROM (SELECT *, toFloat64(minute) AS m FROM ({_dirty("gpu", in_span=True)})) AS d
    ASOF INNER JOIN {NODE_SNAP_RAW} AS c
    ON d.cluster = c.cluster AND d.key = c.node AND d.m > c.t
    WHERE d.m - c.t < 2 * c.interval_s
)
GROUP BY cluster, node, minute
)
{JOIN_SETTINGS}
"""

OWNER_REFRESH = f"""
INSERT INTO owner_rollup_1m
SELECT cluster, node, minute, alloc_id AS id, any(alloc_name) AS name, any(alloc_user) AS user,
    any(alloc_account) AS account, any(alloc_queue) AS queue,
    sum({m.OWNER_TERMS["allocated_s"]}) AS allocated_s,
    sumForEach(arrayMap(t -> {m.term(m.OWNER_TERMS, "idle_s", _IDLE_T)}, {_THRESHOLDS})) AS idle_s,
    {{version:UInt64}} AS version
FROM ({_PIECES})
ARRAY JOIN alloc_ids AS alloc_id, alloc_names AS alloc_name, alloc_users AS alloc_user,
    alloc_accounts AS alloc_account, alloc_queues AS alloc_queue, alloc_shares AS share,
    alloc_act_shares AS act_share
WHERE cap_s > 0
GROUP BY cluster, node, minute, alloc_id
{JOIN_SETTINGS}
"""

# A re-rolled minute's rows that its raw rows no longer give (a sample replaced under its natural
# key by one with another holder, a shorter interval or other latency bounds: ReplacingMergeTree's
# latest ingest wins) are not rewritten by the statements above, which write only what the raw rows
# give now. Each statement is therefore followed by one writing, at this refresh's version, a
# tombstone for every row of its marked minutes that it did not rewrite (FINAL still holds an
# older version): zero sums under the same key, which the readers skip (an owner row with nothing
# allocated, a latency row with no bounds; a node-minute of zeros adds nothing). Written after the
# rows, so a reader never finds a re-rolled minute without them.
GPU_MINUTE_TOMBSTONES = f"""
INSERT INTO gpu_rollup_1m
SELECT cluster, pool, node, minute, toUInt32(0) AS samples, 0. AS capacity_s, 0. AS allocated_s, 0. AS active_s,
    {_ZEROS} AS idle_allocated_s, {_ZEROS} AS idle_unallocated_s, [] AS snap_ts, [] AS snap_interval_s,
    [] AS snap_free, [] AS snap_whole_free, [] AS snap_frac_free, {{version:UInt64}} AS version
FROM
(
    -- (in a subquery: the outer aliases would shadow the columns its WHERE tests)
    SELECT cluster, pool, node, minute FROM gpu_rollup_1m FINAL
    WHERE minute >= toDateTime({{from:Float64}}, 'UTC') AND minute < toDateTime({{to:Float64}}, 'UTC')
      AND version < {{version:UInt64}} AND (cluster, node, minute) IN ({_dirty("gpu", in_span=True)})
)
"""
OWNER_MINUTE_TOMBSTONES = f"""
INSERT INTO owner_rollup_1m
SELECT cluster, node, minute, id, name, user, account, queue, 0. AS allocated_s, {_ZEROS} AS idle_s,
    {{version:UInt64}} AS version
FROM
(
    SELECT cluster, node, minute, id, name, user, account, queue FROM owner_rollup_1m FINAL
    WHERE minute >= toDateTime({{from:Float64}}, 'UTC') AND minute < toDateTime({{to:Float64}}, 'UTC')
      AND version < {{version:UInt64}} AND {OWNER_HELD} AND (cluster, node, minute) IN ({_dirty("gpu", in_span=True)})
)
"""
LATENCY_MINUTE_TOMBSTONES = f"""
INSERT INTO latency_rollup_1m
SELECT cluster, service, minute_end, bounds_hash, [] AS bounds_ms, [] AS counts, toUInt64(0) AS total, 0. AS sum_ms,
    {{version:UInt64}} AS version
FROM
(
    SELECT cluster, service, minute_end, bounds_hash FROM latency_rollup_1m FINAL
    WHERE minute_end >= toDateTime({{from:Float64}}, 'UTC') AND minute_end <= toDateTime({{to:Float64}}, 'UTC')
      AND version < {{version:UInt64}} AND {LATENCY_HELD}
      AND (cluster, service, minute_end) IN ({_dirty("latency")})
)
"""

# A sample replaced under its natural key (same node, GPU and ts) by one with a shorter interval
# marks only the minutes the new one reaches, yet the minutes the old one reached (its pieces, and
# 2 x its interval of snapshot) hold it until re-rolled. The minute tier keeps the old one's time
# and interval (snap_ts, snap_interval_s of the samples starting in a minute): every minute those
# reach, from a marked minute's current row, is marked too, with the mark's time; only those not
# marked already (the views marked the rest: a refresh that replaced nothing writes no mark). Span
# by span (``refresh_spans`` of the marks before it): its join holds one span's rows, not the backlog's.
REPLACED_MARKS = f"""
INSERT INTO rollup_dirty
SELECT kind, cluster, key, minute, at FROM
(
SELECT DISTINCT 'gpu' AS kind, r.cluster AS cluster, r.node AS key,
    toDateTime(arrayJoin({minutes_of("r.t", "2 * r.iv")}), 'UTC') AS minute, d.marked_at AS at
FROM
(
    SELECT cluster, key, minute, max(at) AS marked_at FROM rollup_dirty
    WHERE kind = 'gpu' AND at > toDateTime64({{wm:Float64}}, 3, 'UTC') AND at <= toDateTime64({{cut:Float64}}, 3, 'UTC')
      AND minute >= toDateTime({{from:Float64}}, 'UTC') AND minute < toDateTime({{to:Float64}}, 'UTC')
    GROUP BY cluster, key, minute
) AS d
INNER JOIN
(
    SELECT cluster, node, minute, toFloat64(t) AS t, iv FROM gpu_rollup_1m FINAL
    ARRAY JOIN snap_ts AS t, snap_interval_s AS iv
    WHERE minute >= toDateTime({{from:Float64}}, 'UTC') AND minute < toDateTime({{to:Float64}}, 'UTC')
      AND t >= minute
) AS r ON d.cluster = r.cluster AND d.key = r.node AND d.minute = r.minute
)
WHERE (cluster, key, minute) NOT IN ({_dirty("gpu")})
"""

LATENCY_REFRESH = f"""
INSERT INTO latency_rollup_1m
SELECT cluster, service, minute_end, cityHash64(b) AS bounds_hash, b AS bounds_ms, c AS counts, n AS total,
    sm AS sum_ms, {{version:UInt64}} AS version
FROM
(
    SELECT cluster, service, toDateTime(toInt64(ceil(toFloat64(ts) / 60) * 60), 'UTC') AS minute_end,
        bounds_ms AS b, sumForEach(counts) AS c, sum(total) AS n, sum(sum_ms) AS sm
    FROM latency FINAL
    WHERE ts > toDateTime64({{from:Float64}} - 60, 3, 'UTC') AND ts <= toDateTime64({{to:Float64}}, 3, 'UTC')
      AND (cluster, service, toDateTime(toInt64(ceil(toFloat64(ts) / 60) * 60), 'UTC')) IN ({_dirty("latency")})
    GROUP BY cluster, service, minute_end, b
)
"""


# ---------------------------------------------------------------------------- the starvation tier
# Per (cluster, minute), the snapshot streams of the starvation sweep (rules/sql.py _STARVATION)
# as step functions, from the minute tier's candidates (GPU_REFRESH's snap_*): a node's latest
# row at or before a time stands for it until the node's next row or until it is 2 x its interval
# old (of rows at one time, the greatest (pool, free, shape) stands); each node's changes of
# state give +/- deltas in the stream of its pool (every = 0) and of the whole cluster (every = 1),
# summed per time and run up (free GPUs as Decimal128(20): exact in any order). Each candidate
# also puts a zero change at the minute's start in its pool's stream, so a seen pool has a stream
# and every stream a step there. Changes before the minute count at its start, those at or after
# its end not at all; runs of equal states are one step. ``{minutes}``: the (cluster, minute)
# to rebuild, each whole (a minute with no candidate gets an empty row). A minute's row reads every
# node of its cluster, on every shard of a cluster deployment: the statement runs on the node that
# takes it (parallel_distributed_insert_select = 0), never per shard over the shard's nodes alone.
_STEP_CANDIDATES = """
    SELECT cluster, toFloat64(minute) AS m, node, pool, toFloat64(t) AS t, interval_s, free,
        if(whole_free >= 1, 2 + toFloat64(whole_free), frac_free + 1e-9) AS shape
    FROM gpu_rollup_1m FINAL
    ARRAY JOIN snap_ts AS t, snap_interval_s AS interval_s, snap_free AS free, snap_whole_free AS whole_free,
        snap_frac_free AS frac_free
    WHERE minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')
      AND (cluster, minute) IN ({minutes})"""

_STEPS = """
INSERT INTO capacity_steps_1m
WITH
node_states AS
(
    -- each node's states in order: (at, standing, pool, free, shape); the last row of each time
    -- is set at its time and unset 2 x its interval later unless the next time comes first
    SELECT cluster, m, r,
        arrayFlatten(arrayMap(j -> if(j < n AND r[j].1 + 2 * r[j].5 >= r[j + 1].1,
                                      [(r[j].1, 1, r[j].2, r[j].3, r[j].4)],
                                      [(r[j].1, 1, r[j].2, r[j].3, r[j].4), (r[j].1 + 2 * r[j].5, 0, r[j].2, r[j].3, r[j].4)]),
                              arrayFilter(j -> j = n OR r[j + 1].1 > r[j].1, arrayEnumerate(r)))) AS st
    FROM
    (
        SELECT cluster, m, arraySort(groupArray((t, pool, free, shape, interval_s))) AS r, length(r) AS n
        FROM ({candidates})
        GROUP BY cluster, node, m
    )
),
deltas AS
(
    -- (pool, at, free, shape, nodes): + the new state, - the one it follows
    SELECT cluster, m, d.1 AS pool, greatest(d.2, m) AS at, d.3 AS d_free, d.4 AS shape, d.5 AS d_nodes
    FROM node_states
    ARRAY JOIN arrayConcat(
        arrayMap(x -> (x.2, m, toDecimal128(0, 20), 0., toInt64(0)), r),
        arrayFlatten(arrayMap(k -> arrayConcat(
            if(st[k].2 = 1, [(st[k].3, st[k].1, toDecimal128(st[k].4, 20), st[k].5, toInt64(1))], []),
            if(k > 1 AND st[k - 1].2 = 1,
               [(st[k - 1].3, st[k].1, -toDecimal128(st[k - 1].4, 20), st[k - 1].5, toInt64(-1))], [])),
            arrayEnumerate(st)))) AS d
    WHERE d.2 < m + 60
),
stream_deltas AS
(
    SELECT cluster, m, key.1 AS every, key.2 AS pool_key, at, sum(d_free) AS df, sumMap([shape], [d_nodes]) AS dn
    FROM deltas
    ARRAY JOIN [(toUInt8(0), pool), (toUInt8(1), '')] AS key
    GROUP BY cluster, m, every, pool_key, at
),
streams AS
(
    SELECT cluster, m, every, pool_key,
        arraySort(x -> x.1, groupArray((at, free, arrayFilter((sh, n) -> n != 0, shapes.1, shapes.2),
                                        arrayFilter(n -> n != 0, shapes.2)))) AS s0,
        arrayFilter((x, i) -> i = 1 OR (x.2, x.3, x.4) != (s0[i - 1].2, s0[i - 1].3, s0[i - 1].4),
                    s0, arrayEnumerate(s0)) AS s
    FROM
    (
        SELECT cluster, m, every, pool_key, at, sum(df) OVER w AS free, sumMap(dn.1, dn.2) OVER w AS shapes
        FROM stream_deltas
        WINDOW w AS (PARTITION BY cluster, m, every, pool_key ORDER BY at
                     ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
    )
    GROUP BY cluster, m, every, pool_key
),
per_minute AS
(
    SELECT cluster, m, arraySort(x -> (x.1, x.2), groupArray((every, pool_key, s))) AS g
    FROM streams
    GROUP BY cluster, m
)
SELECT d.cluster AS cluster, d.minute AS minute,
    arrayMap(x -> x.1, p.g) AS every, arrayMap(x -> x.2, p.g) AS pool_key,
    arrayMap(x -> arrayMap(y -> y.1, x.3), p.g) AS step_at,
    arrayMap(x -> arrayMap(y -> y.2, x.3), p.g) AS step_free,
    arrayMap(x -> arrayMap(y -> y.3, x.3), p.g) AS step_shapes,
    arrayMap(x -> arrayMap(y -> y.4, x.3), p.g) AS step_nodes,
    {version:UInt64} AS version
FROM (SELECT DISTINCT cluster, minute, toFloat64(minute) AS m FROM ({minutes})) AS d
LEFT JOIN per_minute AS p ON d.cluster = p.cluster AND d.m = p.m
WHERE d.minute >= toDateTime({from:Float64}, 'UTC') AND d.minute < toDateTime({to:Float64}, 'UTC')
SETTINGS join_use_nulls = 0, parallel_distributed_insert_select = 0
"""
_DIRTY_CLUSTER_MINUTES = fill("SELECT DISTINCT cluster, minute FROM ({d})", d=_dirty("gpu"))
_ALL_CLUSTER_MINUTES = (
    "SELECT DISTINCT cluster, minute FROM gpu_rollup_1m "
    "WHERE minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')"
)
# the (cluster, minute)s whose gpu_rollup_1m rows this refresh rewrote, each rebuilt whole
STEPS_REFRESH = fill(
    _STEPS, candidates=fill(_STEP_CANDIDATES, minutes=_DIRTY_CLUSTER_MINUTES), minutes=_DIRTY_CLUSTER_MINUTES
)
# every (cluster, minute) of the minute tier in [from, to) (a store made before the tier)
STEPS_BACKFILL = fill(
    _STEPS, candidates=fill(_STEP_CANDIDATES, minutes=_ALL_CLUSTER_MINUTES), minutes=_ALL_CLUSTER_MINUTES
)
STEPS_STATE = "capacity_steps_1m"  # its row in rollup_state: the starvation tier is built
STEPS_BACKFILL_CHUNK_S = 86400.0  # the backfill's statements, a day of minutes each


def steps_built(store: Store) -> bool:
    """Whether the starvation tier holds every minute of the minute tier (its backfill has run)."""
    rows = store.query(f"SELECT count() AS n FROM rollup_state FINAL WHERE name = {quote(STEPS_STATE)}")
    return int(rows[0]["n"]) > 0


def backfill_steps(store: Store, version: int | None = None) -> None:
    """Build the starvation tier from all of the minute tier, a day of minutes per statement,
    then mark it built (only then does the engine read it): a store made before the tier."""
    cut = float(store.query("SELECT toFloat64(now64(3)) AS t")[0]["t"])
    base: dict[str, Any] = {
        "version": next_version(store, cut) if version is None else version,
        "cluster": "",
    }
    span = store.query(
        "SELECT toFloat64(min(minute)) AS lo, toFloat64(max(minute)) AS hi, count() AS n FROM gpu_rollup_1m"
    )[0]
    if int(span["n"]):
        lo = float(span["lo"]) // STEPS_BACKFILL_CHUNK_S * STEPS_BACKFILL_CHUNK_S
        while lo <= float(span["hi"]):
            store.execute(STEPS_BACKFILL, {**base, "from": lo, "to": lo + STEPS_BACKFILL_CHUNK_S})
            lo += STEPS_BACKFILL_CHUNK_S
    store.execute(
        "INSERT INTO rollup_state SELECT {name:String}, toDateTime64({cut:Float64}, 3, 'UTC'), now64(3)",
        {"name": STEPS_STATE, "cut": cut},
    )


# ---------------------------------------------------------------------------- the hourly tier
# The node-hours of the gpu marks this refresh takes: every minute it re-rolled lies in one.
_DIRTY_HOURS = fill("SELECT DISTINCT cluster, key, toStartOfHour(minute) FROM ({d})", d=_dirty("gpu"))
_HOUR_SCOPE = "hour >= toDateTime({from:Float64}, 'UTC') AND hour < toDateTime({to:Float64}, 'UTC')"
_MINUTE_SCOPE = "minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')"


def _hour_sql(
    table: str, keys: str, cols: str, sums: str, zeros: str, where_dirty: str | None
) -> tuple[str, str]:
    """(tombstones, rows) of the re-rolled hours of one hourly table: their sums of the minute
    tier at ``{version} + 1``, and a tombstone at ``{version}`` for every row those hours have
    (written after the sums: it loses to them); a key no minute carries any more stays a
    tombstone and FINAL drops it. ``where_dirty``:
    the (cluster, node, hour) to re-roll (None: every hour of the minute tier)."""
    hourly = f"{table}_1h"
    dirty = "" if where_dirty is None else f" AND (cluster, node, toStartOfHour(minute)) IN ({where_dirty})"
    tomb = f"""
SELECT {keys}, {zeros}, {{version:UInt64}} AS version, 1 AS dropped
FROM {hourly} FINAL
WHERE {_HOUR_SCOPE} AND (cluster, node, hour) IN ({where_dirty})
"""
    rows = f"""
SELECT {keys}, {sums}, {{version:UInt64}} + 1 AS version, 0 AS dropped
FROM
(
    SELECT {cols}, toStartOfHour(minute) AS hour FROM {table}_1m FINAL
    WHERE {_MINUTE_SCOPE}{dirty}
)
GROUP BY {keys}
"""
    return tomb, rows


_GPU_KEYS = "cluster, pool, node, hour"
_GPU_COLS = "cluster, pool, node, minute, samples, capacity_s, allocated_s, active_s, idle_allocated_s, idle_unallocated_s"
_GPU_SUMS = (
    "sum(samples) AS samples, sum(capacity_s) AS capacity_s, sum(allocated_s) AS allocated_s, "
    "sum(active_s) AS active_s, sumForEach(idle_allocated_s) AS idle_allocated_s, "
    "sumForEach(idle_unallocated_s) AS idle_unallocated_s"
)
_GPU_ZEROS = f"toUInt32(0) AS samples, 0. AS capacity_s, 0. AS allocated_s, 0. AS active_s, {_ZEROS} AS idle_allocated_s, {_ZEROS} AS idle_unallocated_s"
_OWNER_KEYS = "cluster, node, hour, id, name, user, account, queue"
_OWNER_COLS = "cluster, node, minute, id, name, user, account, queue, allocated_s, idle_s"
_OWNER_SUMS = "sum(allocated_s) AS allocated_s, sumForEach(idle_s) AS idle_s"
_OWNER_ZEROS = f"0. AS allocated_s, {_ZEROS} AS idle_s"

_GPU_TOMB, _GPU_ROWS = _hour_sql("gpu_rollup", _GPU_KEYS, _GPU_COLS, _GPU_SUMS, _GPU_ZEROS, _DIRTY_HOURS)
_OWNER_TOMB, _OWNER_ROWS = _hour_sql(
    "owner_rollup", _OWNER_KEYS, _OWNER_COLS, _OWNER_SUMS, _OWNER_ZEROS, _DIRTY_HOURS
)
GPU_HOUR_TOMBSTONES = "INSERT INTO gpu_rollup_1h" + _GPU_TOMB
GPU_HOUR_REFRESH = "INSERT INTO gpu_rollup_1h" + _GPU_ROWS
OWNER_HOUR_TOMBSTONES = "INSERT INTO owner_rollup_1h" + _OWNER_TOMB
OWNER_HOUR_REFRESH = "INSERT INTO owner_rollup_1h" + _OWNER_ROWS
HOUR_STATEMENTS = (GPU_HOUR_REFRESH, GPU_HOUR_TOMBSTONES, OWNER_HOUR_REFRESH, OWNER_HOUR_TOMBSTONES)
# The backfill of the hourly tier from a store's whole minute tier (a store made before the
# hourly tier: its first refresh builds it, then marks it built, and only then does the engine
# read it). Every hour the minute tier holds, as the incremental refresh would write it.
GPU_HOUR_BACKFILL = (
    "INSERT INTO gpu_rollup_1h"
    + _hour_sql("gpu_rollup", _GPU_KEYS, _GPU_COLS, _GPU_SUMS, _GPU_ZEROS, None)[1]
)
OWNER_HOUR_BACKFILL = (
    "INSERT INTO owner_rollup_1h"
    + _hour_sql("owner_rollup", _OWNER_KEYS, _OWNER_COLS, _OWNER_SUMS, _OWNER_ZEROS, None)[1]
)
HOURLY_STATE = "rollup_1h"  # its row in rollup_state: the hourly tier is built (backfilled)


def hourly_built(store: Store) -> bool:
    """Whether the hourly tier holds every hour of the minute tier (its backfill has run)."""
    rows = store.query(f"SELECT count() AS n FROM rollup_state FINAL WHERE name = {quote(HOURLY_STATE)}")
    return int(rows[0]["n"]) > 0


def _refresh_hours(store: Store, base: dict[str, Any], gpu: dict[str, Any] | None) -> None:
    """Re-roll the node-hours of this refresh's gpu marks from the (just refreshed) minute
    tier; on a store whose hourly tier was never built, build it from all of the minute tier."""
    if not hourly_built(store):
        p = {**base, "from": 0.0, "to": 4294967295.0}
        store.execute(GPU_HOUR_BACKFILL, p)
        store.execute(OWNER_HOUR_BACKFILL, p)
        store.execute(
            "INSERT INTO rollup_state SELECT {name:String}, toDateTime64({cut:Float64}, 3, 'UTC'), now64(3)",
            {"name": HOURLY_STATE, "cut": base["cut"]},
        )
        return
    if gpu:
        # the hours of the dirty minutes, whole: [first hour, end of the last hour)
        p = {**base, "from": float(gpu["lo"]) // 3600 * 3600, "to": (float(gpu["hi"]) // 3600 + 1) * 3600}
        # the sums first (at {version} + 1), then the tombstones (at {version}: they lose to those
        # sums and hide only the keys no minute carries any more): a reader between two of these
        # statements, or after a refresh killed between them, never finds a re-rolled hour missing
        for q in HOUR_STATEMENTS:
            store.execute(q, p)


# ---------------------------------------------------------------------------- the refresh
#: A refresh re-rolls its gpu marks span by span, each span of consecutive marked minutes reading
#: at most about this many GPU sample rows (a minute is never split; the look-back before a span
#: is not counted): its memory is bounded whatever the backlog (a rules service back after an
#: hour's outage of a 50,000-node fleet, the first refresh of a loaded store), not proportional to it.
REFRESH_CHUNK_ROWS = 2_000_000
#: the sample rows a marked node-minute is taken to hold at most (8 GPUs sampled every second: 480)
#: when deciding, without counting them, that a refresh's marks fit one span (the steady state)
ROWS_PER_MARK = 1_000

_ROWS_PER_MINUTE = """
SELECT toFloat64(toStartOfMinute(ts)) AS m, count() AS n FROM gpu_samples
WHERE ts >= toDateTime64({from:Float64}, 3, 'UTC') AND ts < toDateTime64({to:Float64}, 3, 'UTC')
GROUP BY m ORDER BY m"""
_DIRTY_MINUTES = fill("SELECT DISTINCT toFloat64(minute) AS m FROM ({d}) ORDER BY m", d=_dirty("gpu"))


def refresh_spans(
    store: Store, base: dict[str, Any], gpu: dict[str, Any], chunk_rows: int = REFRESH_CHUNK_ROWS
) -> list[tuple[float, float]]:
    """The [from, to) spans in which a refresh re-rolls its gpu marks (``gpu``: their count, first
    and last minute), in order: consecutive marked minutes while the GPU sample rows from the
    span's first minute to the end of its last (the unmarked minutes between included: the
    statement reads them) stay within ``chunk_rows``. Rows are counted without ``FINAL`` (an
    upper bound: replays are counted too)."""
    lo, hi = float(gpu["lo"]), float(gpu["hi"]) + 60
    if int(gpu["n"]) * ROWS_PER_MARK <= chunk_rows:
        return [(lo, hi)]
    per = store.query(_ROWS_PER_MINUTE, {"from": lo, "to": hi})
    keys = [float(r["m"]) for r in per]
    cum = [0, *itertools.accumulate(int(r["n"]) for r in per)]

    def rows(a: float, b: float) -> int:  # the sample rows of the minutes in [a, b)
        return cum[bisect.bisect_left(keys, b)] - cum[bisect.bisect_left(keys, a)]

    minutes = [float(r["m"]) for r in store.query(_DIRTY_MINUTES, base)]
    if not minutes:  # (the marks went between the two reads: their TTL) nothing is left to re-roll
        return []
    out: list[tuple[float, float]] = []
    start = last = minutes[0]
    for minute in minutes[1:]:
        if rows(start, minute + 60) > chunk_rows:
            out.append((start, last + 60))
            start = minute
        last = minute
    out.append((start, last + 60))
    return out


@dataclass
class RefreshReport:
    node_minutes: int
    service_minutes: int
    seconds: float
    watermark: float


#: its row in rollup_state: the highest version a refresh has written (as DateTime64(3) ms)
VERSION_STATE = "rollup_version"
_VERSIONED = ("gpu_rollup_1m", "owner_rollup_1m", "latency_rollup_1m", "capacity_steps_1m", "gpu_rollup_1h",
              "owner_rollup_1h")  # fmt: skip


def next_version(store: Store, cut: float) -> int:
    """The version of a refresh's rows (the hourly tier's sums take it + 1), recorded before
    any of them is written: the store's clock at the cut in ms, and above every version written
    before. Not the rules host's clock: a refresh on a host whose clock was ahead (another rules
    host, a clock stepped back) wrote versions its successors' must beat, or FINAL keeps the
    older rows over the minutes they re-rolled (late rows lost, silently). A refresh killed
    after recording it leaves it recorded. A store without the record (made before it) takes
    the highest version of its rollup tables once."""
    rows = store.query(
        "SELECT count() AS n, toInt64(max(toUnixTimestamp64Milli(watermark))) AS v FROM rollup_state "
        "WHERE name = {name:String}",
        {"name": VERSION_STATE},
    )
    if int(rows[0]["n"]):
        last = int(rows[0]["v"])
    else:
        have = store.query(
            "SELECT name FROM system.tables WHERE database = currentDatabase() AND name IN {names:Array(String)}",
            {"names": list(_VERSIONED)},
        )  # (a store older than a tier has not got its table)
        union = " UNION ALL ".join(f"SELECT max(version) AS v FROM {r['name']}" for r in have)
        last = int(store.query(f"SELECT toInt64(max(v)) AS v FROM ({union})")[0]["v"]) if have else 0
    version = max(int(cut * 1000), last + 1)
    # (updated: the version too, so the row of the highest is the one a merge keeps)
    store.execute(
        "INSERT INTO rollup_state SELECT {name:String}, fromUnixTimestamp64Milli(toInt64({v:UInt64}), 'UTC') AS w, w",
        {"name": VERSION_STATE, "v": version + 1},
    )
    return version


def watermark(store: Store) -> float:
    rows = store.query("SELECT toFloat64(watermark) AS w FROM rollup_state FINAL WHERE name = 'rollup'")
    return float(rows[0]["w"]) if rows else 0.0


def _marks(store: Store, wm: float, cut: float) -> dict[str, dict[str, Any]]:
    rows = store.query(
        "SELECT kind, count() AS n, toFloat64(min(minute)) AS lo, toFloat64(max(minute)) AS hi FROM "
        "(SELECT DISTINCT kind, cluster, key, minute FROM rollup_dirty "
        " WHERE at > toDateTime64({wm:Float64}, 3, 'UTC') AND at <= toDateTime64({cut:Float64}, 3, 'UTC')) "
        "GROUP BY kind",
        {"wm": wm, "cut": cut},
    )
    return {m["kind"]: m for m in rows}


def refresh(
    store: Store, overlap_s: float = OVERLAP_S, chunk_rows: int = REFRESH_CHUNK_ROWS
) -> RefreshReport:
    """Recompute every minute marked since the last refresh (and in the ``overlap_s`` before
    it), span by span (:func:`refresh_spans`, ``chunk_rows``). The marks' times come from the
    store's clock, and so does the cut: a refresh running on another host with a skewed clock
    neither skips nor repeats marks."""
    t0 = time.perf_counter()
    last = watermark(store)
    wm = last - overlap_s if last else 0.0
    cut = float(store.query("SELECT toFloat64(now64(3)) AS t")[0]["t"])
    version = next_version(store, cut)
    base: dict[str, Any] = {"wm": wm, "cut": cut, "version": version, "cluster": ""}
    if wm < cut - MARKS_KEPT_S:  # the marks of what was ingested up to then may be gone: re-marked
        # at a time inside (wm, cut], before the next refresh's look-back (taken once)
        at = cut - overlap_s - 0.001
        span = {"since": wm - _INGESTED_SKEW_S if wm else 0.0, "until": cut - MARKS_KEPT_S + _INGESTED_SKEW_S}
        for q in REMARKS:
            store.execute(q, {**span, "at": at})
    by = _marks(store, wm, cut)
    # first turn heartbeat marks into the minutes of the samples whose state they set
    if hb := by.get("heartbeat"):
        store.execute(HEARTBEAT_MARKS, {**base, "lo": float(hb["lo"])})
        by = _marks(store, wm, cut)
    if gm := by.get("gpu"):  # then mark what replaced samples reached
        for frm, to in refresh_spans(store, base, gm, chunk_rows):
            store.execute(REPLACED_MARKS, {**base, "from": frm, "to": to})
        by = _marks(store, wm, cut)
    gpu, lat = by.get("gpu"), by.get("latency")
    steps = steps_built(store)
    for frm, to in refresh_spans(store, base, gpu, chunk_rows) if gpu else ():
        # the span's marked minutes, each whole (a sample's pieces in minutes past the span are
        # not its statement's), then their starvation steps (from the minute tier just written)
        p = {**base, "from": frm, "to": to}
        store.execute(GPU_REFRESH, p)
        store.execute(GPU_MINUTE_TOMBSTONES, p)
        store.execute(OWNER_REFRESH, p)
        store.execute(OWNER_MINUTE_TOMBSTONES, p)
        if steps:
            store.execute(STEPS_REFRESH, p)
    if lat:
        store.execute(LATENCY_REFRESH, {**base, "from": float(lat["lo"]), "to": float(lat["hi"])})
        store.execute(LATENCY_MINUTE_TOMBSTONES, {**base, "from": float(lat["lo"]), "to": float(lat["hi"])})
    if not steps:  # a store made before the starvation tier: built from all of the minute tier
        backfill_steps(store, version)
    _refresh_hours(store, base, gpu)
    store.execute(
        "INSERT INTO rollup_state SELECT 'rollup', toDateTime64({cut:Float64}, 3, 'UTC'), now64(3)",
        {"cut": cut},
    )
    return RefreshReport(
        int(gpu["n"]) if gpu else 0, int(lat["n"]) if lat else 0, time.perf_counter() - t0, cut
    )


def usable(idle_threshold: float, frm: float, to: float, step_s: int, min_idle_s: float = 0.0) -> str | None:
    """Why a window cannot be evaluated over the rollups (None: it can)."""
    if min_idle_s > 0:
        return "min_idle_s needs runs of samples across minutes, which the per-minute rollups do not keep"
    if idle_threshold not in ROLLUP_IDLE_THRESHOLDS:
        return f"idle_threshold {idle_threshold} is not one the rollups keep {ROLLUP_IDLE_THRESHOLDS}"
    if frm % 60 or to % 60:
        return "the window does not start and end on whole minutes"
    if step_s % 60:
        return f"eval_step_s {step_s} is not a multiple of 60"
    return None


def hour_split(frm: float, to: float) -> tuple[float, float]:
    """(h0, h1): the whole hours [h0, h1) of a window on whole minutes, read from the hourly
    tier, its minutes [frm, h0) and [h1, to) from the minute tier; (to, to) when it holds none."""
    h0, h1 = math.ceil(frm / 3600) * 3600.0, math.floor(to / 3600) * 3600.0
    return (h0, h1) if h0 < h1 else (float(to), float(to))


def threshold_index(idle_threshold: float) -> int:
    """1-based, for ClickHouse arrays."""
    return ROLLUP_IDLE_THRESHOLDS.index(idle_threshold) + 1

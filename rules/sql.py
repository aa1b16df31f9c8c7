"""The rule queries, in ClickHouse SQL. One definition each; the same text runs on chDB
and on a ClickHouse server, and the dashboards reuse the per-sample capacity view.

All windows are half-open ``[from, to)`` in epoch seconds. A GPU sample taken at ``ts``
stands for ``[ts, ts + interval_s)`` and is clipped to the window, so any window gives
GPU-seconds exactly, aligned with the sampling or not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gpuslo.ingest.sqltext import fill, literal
from gpuslo.rules import measures as m
from gpuslo.wire import MAX_INTERVAL_S

__all__ = ["MAX_INTERVAL_S"]  # the wire's bound on interval_s: how far the rules look back

_CLUSTER = "({cluster:String} = '' OR cluster = {cluster:String})"


def heartbeat_join(lo: str) -> str:
    """Joined to samples ``s`` read from ``lo`` (SQL, epoch seconds) to ``{to}``: each node's
    latest heartbeat at or before the sample (``h``), which says whether the scheduler may place
    work there. A heartbeat's state holds until a newer one, however old: the heartbeats from
    ``lo`` on, plus each node's latest one before ``lo`` (exports send state only on change).
    The older part reads no FINAL: ``argMax`` by (ts, ingested_at) is the row the table keeps.

    Only the heartbeats of nodes that one of those heartbeats says are not schedulable are
    joined: for every other node each heartbeat it has says schedulable, as no heartbeat does
    (``ifNull(h.schedulable, 1)``), so the answer is the same, and the join's table holds the
    few drained nodes instead of the fleet (the probe of a node not in it is a miss).

    ``h.schedulable`` is Nullable: a miss reads NULL under either ``join_use_nulls`` (with 0, a
    miss takes its column's default, NULL for a Nullable one, 0 for a UInt8 one), so a query
    that nests this join without ``JOIN_SETTINGS`` still counts every node the filter left out
    (and every node with no heartbeat) as schedulable, not as drained."""
    return f"""ASOF LEFT JOIN
(
    SELECT cluster, node, ts, toNullable(schedulable) AS schedulable FROM ({_heartbeats(lo)}) AS hb
    WHERE (cluster, node) IN (SELECT cluster, node FROM ({_heartbeats(lo)}) AS hb WHERE NOT schedulable)
) AS h
ON s.cluster = h.cluster AND s.node = h.node AND s.ts >= h.ts"""


def _heartbeats(lo: str) -> str:
    return f"""
    SELECT cluster, node, ts, schedulable FROM node_heartbeats FINAL
    WHERE ts >= toDateTime64({lo}, 3, 'UTC') AND ts < toDateTime64({{to:Float64}}, 3, 'UTC')
      AND {_CLUSTER}
    UNION ALL
    SELECT cluster, node, max(ts) AS latest, argMax(schedulable, (ts, ingested_at)) AS state
    FROM node_heartbeats
    WHERE ts < toDateTime64({lo}, 3, 'UTC') AND {_CLUSTER}
    GROUP BY cluster, node
"""


def longest_before(back_s: int) -> str:
    """SQL: the longest interval of the samples in ``[from - back_s, from)`` (0 if none). A
    scalar subquery reading two columns; its value bounds the look-back of the main read, and
    ClickHouse prunes partitions and granules with it, so a window looks back only as far as
    its own data needs (10 s for 10 s sampling), never more than the wire allows."""
    return (
        f"(SELECT ifNull(max(interval_s), 0) FROM gpu_samples "
        f"WHERE ts >= toDateTime64({{from:Float64}} - {back_s}, 3, 'UTC') "
        f"AND ts < toDateTime64({{from:Float64}}, 3, 'UTC') AND {_CLUSTER})"
    )


# The samples CAPACITY_SAMPLES reads: those overlapping [from, to), found as far back before
# ``from`` as the longest interval there (at most MAX_INTERVAL_S, the wire's bound).
_LOOKBACK = f"{{from:Float64}} - {longest_before(MAX_INTERVAL_S)}"
_SAMPLES_WINDOW = f"""WHERE ts >= toDateTime64({_LOOKBACK}, 3, 'UTC')
      AND ts < toDateTime64({{to:Float64}}, 3, 'UTC')
      AND toFloat64(ts) + interval_s > {{from:Float64}}"""

# Samples joined to their state; the dashboards reuse it.
HEARTBEAT_JOIN = heartbeat_join(_LOOKBACK)

# One row per GPU sample overlapping [from, to): ``cap_w``, the part of each of its seconds that
# counts as capacity (healthy, and the node schedulable per its latest heartbeat at or before
# the sample, however old; a node that never sent one counts as schedulable; a MIG instance or
# a GPU in MIG mode counts its fraction), and ``cap_s``, its capacity GPU-seconds inside the window.
_CAPACITY_SAMPLES = f"""
SELECT
    s.cluster AS cluster, s.node AS node, s.pool AS pool, s.gpu AS gpu, s.mig_gi AS mig_gi, s.mig_ci AS mig_ci,
    s.model AS model, s.ts AS ts,
    s.interval_s AS interval_s, s.gpu_fraction AS gpu_fraction, s.alloc_share AS alloc_share, s.activity AS activity,
    s.alloc_ids AS alloc_ids, s.alloc_names AS alloc_names, s.alloc_users AS alloc_users,
    s.alloc_accounts AS alloc_accounts, s.alloc_queues AS alloc_queues, s.alloc_shares AS alloc_shares,
    s.alloc_act_shares AS alloc_act_shares,
    (s.healthy AND ifNull(h.schedulable, 1)) * s.gpu_fraction AS cap_w,
    greatest(0., least(toFloat64(s.ts) + s.interval_s, {{to:Float64}}) - greatest(toFloat64(s.ts), {{from:Float64}}))
        * cap_w AS cap_s
FROM
(
    SELECT * FROM gpu_samples FINAL
    {{samples_window}}
      AND {_CLUSTER}
) AS s
{HEARTBEAT_JOIN}
"""
CAPACITY_SAMPLES = fill(_CAPACITY_SAMPLES, samples_window=_SAMPLES_WINDOW)

JOIN_SETTINGS = "SETTINGS join_use_nulls = 1"

# CUR and idle per cluster and pool (Slurm partition / node pool); sums over pools
# give the cluster (GPU-seconds add up: a node serves one pool here).
# (``{sums}``: the terms with an idle test; ``{samples}``: CAPACITY_SAMPLES or IDLE_RUNS)
_UTILIZATION = f"""
SELECT
    cluster,
    pool,
    {{sums}}
FROM ({{samples}})
WHERE cap_s > 0
GROUP BY cluster, pool
ORDER BY cluster, pool
{JOIN_SETTINGS}
"""
UTILIZATION = fill(_UTILIZATION, sums=m.sums(m.FLEET_TERMS), samples=CAPACITY_SAMPLES)


# The rules' label matchers (rules.config.Match) as ``{match_<label>:Array(String)}`` parameters;
# an empty list matches everything. The holder side (top idle, fair share) is narrowed in SQL, before
# any LIMIT, by the holder's cluster, queue and account (pool narrows the capacity numbers only).
def matched(column: str, label: str) -> str:
    """SQL: ``column`` is one of the values the matcher ``label`` allows (all when it lists none)."""
    p = f"{{match_{label}:Array(String)}}"
    return f"(empty({p}) OR has({p}, {column}))"


def holder_matched(cluster: str, queue: str, account: str) -> str:
    return f"{matched(cluster, 'cluster')} AND {matched(queue, 'queue')} AND {matched(account, 'account')}"


def request_matched(cluster: str, queue: str, account: str, scheduler: str) -> str:
    """SQL: a request the matchers select; its queue as rules.config.Match.request_ok reads it (a
    Kueue request's ``namespace/LocalQueue``, or its namespace)."""
    p = "{match_queue:Array(String)}"
    by_queue = f"(empty({p}) OR has({p}, {queue}) OR ({scheduler} = 'kueue' AND has({p}, {account})))"
    return f"{matched(cluster, 'cluster')} AND {by_queue} AND {matched(account, 'account')}"


# Allocated and allocated-idle GPU-seconds per holder (job / pod), with its user,
# account and queue (partition / namespace): the "who wastes GPUs" view, the largest idle first.
# (``{where}``: the rows that count: all with capacity, or only the matched holders' too)
_OWNER_SUMS = ("allocated_s", "idle_s")
_WHOLE_FLEET = "cap_s > 0"  # the dashboards'
_MATCHED_HOLDERS = (
    f"cap_s > 0 AND {holder_matched('cluster', 'alloc_queue', 'alloc_account')}"  # the engine's
)
_IDLE_BY_OWNER = f"""
SELECT
    cluster, alloc_id AS id, any(alloc_name) AS name, any(alloc_user) AS user,
    any(alloc_account) AS account, any(alloc_queue) AS queue,
    {{sums}}
FROM ({{samples}})
ARRAY JOIN alloc_ids AS alloc_id, alloc_names AS alloc_name, alloc_users AS alloc_user,
    alloc_accounts AS alloc_account, alloc_queues AS alloc_queue, alloc_shares AS share,
    alloc_act_shares AS act_share
WHERE {{where}}
GROUP BY cluster, alloc_id
ORDER BY idle_s DESC, id
LIMIT {{limit:UInt32}}
{JOIN_SETTINGS}
"""
_OWNER_TOTALS = m.sums(m.OWNER_TERMS, names=_OWNER_SUMS)
IDLE_BY_OWNER = fill(_IDLE_BY_OWNER, sums=_OWNER_TOTALS, samples=CAPACITY_SAMPLES, where=_WHOLE_FLEET)
IDLE_BY_OWNER_MATCHED = fill(
    _IDLE_BY_OWNER, sums=_OWNER_TOTALS, samples=CAPACITY_SAMPLES, where=_MATCHED_HOLDERS
)

# Fair share per account: its share of the allocated GPU-seconds in [from, to) against its
# share of the GPUs requested by the submissions in that window. (``{allocated}``: the
# allocated GPU-seconds per account, from the samples or the rollup; ``{requested}``: more
# conditions on the submissions; ``{settings}``: the query's SETTINGS clause, or none where it
# is nested in another query.) The shares are of the accounts listed: of the matched ones when
# both sides are matched.
_FAIR_SHARE = """
SELECT
    if(a.account IS NULL, r.account, a.account) AS account,
    ifNull(a.gpu_s, 0) AS allocated_s,
    ifNull(a.gpu_s, 0) / nullIf(sum(ifNull(a.gpu_s, 0)) OVER (), 0) AS share_allocated,
    ifNull(r.gpus, 0) AS gpus_requested,
    ifNull(r.gpus, 0) / nullIf(sum(ifNull(r.gpus, 0)) OVER (), 0) AS share_requested
FROM
(
{allocated}
) AS a
FULL OUTER JOIN
(
    SELECT account, sum(gpus_per_node * nodes) AS gpus FROM sched_events FINAL
    WHERE event = 'submit'
      AND ts >= toDateTime64({from:Float64}, 3, 'UTC') AND ts < toDateTime64({to:Float64}, 3, 'UTC')
      AND ({cluster:String} = '' OR cluster = {cluster:String}){requested}
    GROUP BY account
) AS r ON a.account = r.account
ORDER BY allocated_s DESC, account
{settings}
"""
_ALLOCATED_BY_ACCOUNT = f"""    SELECT account, sum({m.OWNER_TERMS["allocated_s"]}) AS gpu_s
    FROM ({CAPACITY_SAMPLES}) ARRAY JOIN alloc_accounts AS account, alloc_shares AS share, alloc_act_shares AS act_share
    WHERE cap_s > 0
    GROUP BY account"""
FAIR_SHARE = fill(_FAIR_SHARE, allocated=_ALLOCATED_BY_ACCOUNT, requested="", settings=JOIN_SETTINGS)
# without its SETTINGS clause, to nest in another query (a panel's)
FAIR_SHARE_NESTED = fill(_FAIR_SHARE, allocated=_ALLOCATED_BY_ACCOUNT, requested="", settings="")
# the engine's: the matched holders' allocations and the matched submissions
_ALLOCATED_MATCHED = f"""    SELECT account, sum({m.OWNER_TERMS["allocated_s"]}) AS gpu_s
    FROM ({CAPACITY_SAMPLES}) ARRAY JOIN alloc_accounts AS account, alloc_queues AS queue, alloc_shares AS share,
        alloc_act_shares AS act_share
    WHERE cap_s > 0 AND {holder_matched("cluster", "queue", "account")}
    GROUP BY account"""
_REQUESTED_MATCHED = f"\n      AND {request_matched('cluster', 'queue', 'account', 'scheduler')}"
FAIR_SHARE_MATCHED = fill(
    _FAIR_SHARE, allocated=_ALLOCATED_MATCHED, requested=_REQUESTED_MATCHED, settings=JOIN_SETTINGS
)

# Shares, GPU fractions and requests are stored as Float32 (about 7 significant digits), so a
# request for exactly what is free may read more than it: 0.4 of a GPU whose holder has 0.6 is
# 0.40000001 against 0.39999998 free, 30 pods of 0.1 are 3.0000000447 against 3 free. Free and
# requested GPUs are therefore equal within FREE_TOLERANCE per GPU requested (at least 1): far
# above Float32's rounding, far below any share a scheduler hands out. The tolerance never
# exceeds FREE_TOLERANCE_MAX (a request of 1,000,000 GPUs with 999,999 free was 'enough' within
# 10^-6 x 10^6, and the wire takes 100,000 nodes x 1,024) nor half the request (a request of
# 10^-7 GPU was 'enough' and fitted a node with nothing free): Float32 is off by at most 2^-24 of
# a value, under 0.006 GPU for the largest fractional request (100,000 pods under one GPU each;
# whole GPUs per node are exact). One test of each kind, used by every starvation query (over
# raw rows, the minute tier's sweep and the tier).
FREE_TOLERANCE = 1e-6
FREE_TOLERANCE_MAX = 0.01


def _tolerance(requested: str) -> str:
    """SQL: how far below ``requested`` GPUs may read and still be as many."""
    return f"least({FREE_TOLERANCE!r} * greatest(1, {requested}), {FREE_TOLERANCE_MAX!r}, {requested} / 2)"


def enough_free(free: str, requested: str) -> str:
    """SQL: ``free`` GPUs are at least ``requested`` (within :func:`_tolerance`)."""
    return f"({free} + {_tolerance(requested)} >= {requested})"


def fits_shape(shape: str, gpus_per_node: str) -> str:
    """SQL: a node of free ``shape`` (2 + its whole free GPUs, else the largest free part of one
    GPU) may host ``gpus_per_node``: as many whole GPUs, or for a fractional request that much of
    one GPU (within :func:`_tolerance`)."""
    g = f"toFloat64({gpus_per_node})"
    return f"({shape} + {_tolerance(g)} >= if({g} >= 1, 2 + {g}, {g}))"


# Starvation incidents opened in [from, to), with the cause from the capacity snapshot
# (the latest GPU samples of each node at or before the opening time). Slots: ``{snapshot}``,
# the CTEs that end in ``snap`` (per incident: free GPUs, fitting nodes, whether any node was
# seen), by default ``_SNAP_SWEEP`` below, whose own slots are ``{node_snap}``, the snapshot
# rows from the samples or the rollup, and ``{snap_minute}`` and ``{open_minute}``, the
# key that pairs a snapshot row with an opening (over the rollups: the opening's minute, whose
# candidates alone may stand for it; over raw rows a constant); ``{settings}`` as in FAIR_SHARE.
#
# The snapshot is a sweep, not a product of openings and nodes (which grew with nodes x
# requests): each node's row stands for it from its time until the node's next row or until it
# is 2 x its interval old, whichever comes first; a run of rows of one node with the same pool
# and free figures, each standing until the next, is one span. A span adds its free GPUs at its
# start and takes them away at its end, in the stream of its pool (and of the whole cluster, for
# requests naming no pool); an opening, put in the stream of each pool its request may use, reads
# the running sums there: the free GPUs, and the nodes per free shape (whole GPUs, else the
# largest part of one). One pass over the snapshot rows, one sort of the spans and openings:
# cost (rows + openings x matched pools x shapes) x log. Free GPUs are summed as Decimal128(20),
# exact whatever the order and with no residue of the subtractions (a float running sum would
# drift and flip "free < requested" at equality).
_STARVATION = fill(
    """
WITH
requests AS
(
    SELECT
        cluster, scheduler, request_id,
        argMinIf(queue, ts, event = 'submit') AS queue,
        argMinIf(pool, ts, event = 'submit') AS pool,
        argMinIf(user, ts, event = 'submit') AS user,
        argMinIf(account, ts, event = 'submit') AS account,
        argMinIf(gpus_per_node, ts, event = 'submit') AS gpus_per_node,
        argMinIf(nodes, ts, event = 'submit') AS nodes,
        minIf(toFloat64(ts), event = 'submit') AS submitted,
        if(countIf(event IN ('start', 'cancel', 'end')) > 0,
           minIf(toFloat64(ts), event IN ('start', 'cancel', 'end')), inf) AS left_queue,
        argMinIf(event, ts, event IN ('start', 'cancel', 'end')) AS how,
        -- the scheduler's own words while it waited: (time, cause it implies, reason)
        arraySort(x -> x.1, groupArrayIf((toFloat64(ts), cause, reason), event = 'pending_reason')) AS said,
        -- the queue's own threshold; a Kueue request's (queue namespace/LocalQueue) else its
        -- namespace's (Starvation.threshold_for)
        multiIf(has({thr_queues:Array(String)}, queue),
                {thr_values:Array(Float64)}[indexOf({thr_queues:Array(String)}, queue)],
                scheduler = 'kueue' AND has({thr_queues:Array(String)}, account),
                {thr_values:Array(Float64)}[indexOf({thr_queues:Array(String)}, account)],
                {thr_default:Float64}) AS threshold_s
    FROM sched_events FINAL
    WHERE ts >= toDateTime64({from:Float64} - {thr_max:Float64}, 3, 'UTC')
      AND ts < toDateTime64({to:Float64}, 3, 'UTC')
      AND ({cluster:String} = '' OR cluster = {cluster:String})
    GROUP BY cluster, scheduler, request_id
    HAVING countIf(event = 'submit') > 0 AND gpus_per_node > 0
),
incidents AS
(
    SELECT *, submitted + threshold_s AS opened
    FROM requests
    WHERE left_queue > submitted + threshold_s
      AND submitted + threshold_s >= {from:Float64} AND submitted + threshold_s < {to:Float64}
),
{snapshot}
SELECT
    i.cluster AS cluster, i.scheduler AS scheduler, i.request_id AS request_id, i.queue AS queue,
    i.pool AS pool, i.user AS user, i.account AS account, i.gpus_per_node AS gpus_per_node,
    i.nodes AS nodes, i.submitted AS submitted, i.opened AS opened,
    if(i.left_queue < {to:Float64}, i.left_queue, NULL) AS closed,
    if(i.left_queue < {to:Float64}, i.how, '') AS closed_by,
    ifNull(s.free, 0) AS free_gpus,
    ifNull(s.fitting, 0) AS fitting_nodes,
    arrayLast(x -> x.1 <= i.opened, i.said) AS said_at_open,
    said_at_open.3 AS reason,
    -- a cause the scheduler gave (Kueue: its quota) stands, except that the cluster's free
    -- devices, when any node was seen, still say capacity
    multiIf(said_at_open.2 = 'capacity', 'capacity',
            said_at_open.2 != '' AND NOT ifNull(s.seen, 0), said_at_open.2,
            NOT {enough}, 'capacity',
            said_at_open.2 != '', said_at_open.2,
            fitting_nodes < i.nodes, 'fragmentation',
            'policy') AS cause
FROM incidents AS i
LEFT JOIN snap AS s ON i.cluster = s.cluster AND i.scheduler = s.scheduler AND i.request_id = s.request_id
ORDER BY opened, request_id
{settings}
""",
    keep=("snapshot", "settings"),
    enough=enough_free("ifNull(s.free, 0)", "i.nodes * i.gpus_per_node"),
)

# The snapshot as a sweep (see above): CTEs ending in ``snap`` (cluster, scheduler, request_id,
# free, fitting, seen), one row per incident that any snapshot row reached. Slots as above.
_SNAP_SWEEP = fill(
    """node_snap AS
{node_snap},
snap_rows AS
(
    -- the free shape a request's per-node test reads, as one number: 2 + the whole free GPUs,
    -- else the largest free part of one GPU + 1e-9 (at most 1 + 1e-9); the pool as a plain
    -- String (a LowCardinality one in the tuples grouped per node below made that step 2-3x slower)
    SELECT cluster, {snap_minute} AS minute, node, CAST(pool, 'String') AS pool, t, interval_s, free,
        if(whole_free >= 1, 2 + toFloat64(whole_free), frac_free + 1e-9) AS shape
    FROM node_snap
),
snap_events AS
(
    -- the events of each node's spans: (time, free GPUs, nodes of the shape: +1 / -1); a row
    -- stands until the node's next (a later one, however stale, hides it) or 2 x its interval;
    -- of rows at one time (pools at once) the greatest (pool, free, shape) stands, the others span
    -- nothing and are kept (with no event) as a sign that their pool was seen
    SELECT cluster, minute, 0 AS kind, e.1 AS pool, e.2 AS shape, e.3 AS at, e.4 AS d_free, e.5 AS d_nodes,
        toFloat32(0) AS gpus_per_node, '' AS scheduler, '' AS request_id
    FROM
    (
        -- each node's rows in order: r[j] = (t, pool, free, shape, interval_s)
        SELECT cluster, minute, arraySort(groupArray((t, pool, free, shape, interval_s))) AS r, length(r) AS n
        FROM snap_rows
        GROUP BY cluster, node, minute
    )
    ARRAY JOIN arrayFlatten(arrayMap(j -> arrayMap(ev -> (r[j].2, r[j].4, ev.1, ev.2, ev.3),
        if(j < n AND r[j + 1].1 = r[j].1, [(r[j].1, toDecimal128(0, 20), toInt64(0))],  -- spans nothing
           arrayConcat(
               -- a span starts unless the previous row stands until this one with the same figures
               if(j > 1 AND r[j - 1].1 < r[j].1 AND r[j - 1].1 + 2 * r[j - 1].5 >= r[j].1
                      AND (r[j - 1].2, r[j - 1].4, r[j - 1].3) = (r[j].2, r[j].4, r[j].3),
                  [], [(r[j].1, toDecimal128(r[j].3, 20), toInt64(1))]),
               -- and ends unless the next row (standing itself) carries it on
               if(j < n AND (j + 1 = n OR r[j + 2].1 > r[j + 1].1) AND r[j].1 + 2 * r[j].5 >= r[j + 1].1
                      AND (r[j + 1].2, r[j + 1].4, r[j + 1].3) = (r[j].2, r[j].4, r[j].3),
                  [], [(if(j < n, least(r[j + 1].1, r[j].1 + 2 * r[j].5), r[j].1 + 2 * r[j].5),
                        -toDecimal128(r[j].3, 20), toInt64(-1))])))),
        arrayEnumerate(r))) AS e
),
snap_stream AS
(
    -- the openings among the events; seen: every pool a node was seen in, in the cluster
    SELECT *, groupUniqArrayIf(pool, kind = 0) OVER (PARTITION BY cluster) AS seen
    FROM
    (
        SELECT * FROM snap_events
        UNION ALL
        SELECT cluster, {open_minute} AS minute, 1 AS kind, pool, 0. AS shape, opened AS at,
            toDecimal128(0, 20) AS d_free, toInt64(0) AS d_nodes, gpus_per_node, scheduler, request_id
        FROM incidents AS i
    )
),
snap_keyed AS
(
    -- each event in the stream of its pool (every = 0) and of the whole cluster (every = 1); each
    -- opening in those of the pools its request may use: a node serving several partitions
    -- reports them ','-joined (Slurm forbids ',' in a name), and a request may name several
    -- (sbatch -p a,b): it may run there when they share one. A request no seen pool matches has
    -- no snapshot (every = 2: a stream of its own)
    SELECT * EXCEPT (seen, pool), notEmpty(matched) AS was_seen, key.1 AS every, key.2 AS pool_key
    FROM
    (
        SELECT *, if(kind = 0, [], if(pool = '', seen,
                                      arrayFilter(p -> hasAny(splitByChar(',', p), splitByChar(',', pool)), seen))) AS matched
        FROM snap_stream
    )
    ARRAY JOIN if(kind = 0, [(0, pool), (1, '')],
                  if(empty(matched), [(2, '')], if(pool = '', [(1, '')], arrayMap(p -> (0, p), matched)))) AS key
),
snap AS
(
    SELECT cluster, scheduler, request_id, toFloat64(toString(sum(free_then))) AS free,  -- (toString: a
        -- direct Decimal128 -> Float64 cast rounds 380 to 380.00000000000006; the text is read exactly)
        -- the nodes that may host the request: whole GPUs per node, or a part of one GPU
        toUInt64(sum(arraySum(arrayMap((sh, n) -> if({fits_sweep}, n, 0), shapes_then.1, shapes_then.2)))) AS fitting,
        max(was_seen) AS seen
    FROM
    (
        SELECT *, sum(d_free) OVER w AS free_then, sumMap([shape], [d_nodes]) OVER w AS shapes_then
        FROM snap_keyed
        WINDOW w AS (PARTITION BY cluster, minute, every, pool_key ORDER BY at, kind
                     ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
    )
    WHERE kind = 1
    GROUP BY cluster, scheduler, request_id
)""",
    keep=("node_snap", "snap_minute", "open_minute"),
    fits_sweep=fits_shape("sh", "gpus_per_node"),
)

# Live pending age per queue at ``to``: requests submitted but not yet started/left. A Kueue
# request also names its ClusterQueue (the latest its events carry; empty for other schedulers).
PENDING_AGE = """
SELECT cluster, queue, cluster_queue, count() AS pending, max({to:Float64} - submitted) AS max_age_s
FROM
(
    SELECT cluster, request_id, argMinIf(queue, ts, event = 'submit') AS queue,
        argMaxIf(cluster_queue, ts, cluster_queue != '') AS cluster_queue,
        minIf(toFloat64(ts), event = 'submit') AS submitted,
        countIf(event IN ('start', 'cancel', 'end')) AS gone
    FROM sched_events FINAL
    WHERE ts < toDateTime64({to:Float64}, 3, 'UTC')
      AND ({cluster:String} = '' OR cluster = {cluster:String})
    GROUP BY cluster, request_id
    HAVING countIf(event = 'submit') > 0 AND gone = 0
)
GROUP BY cluster, queue, cluster_queue
ORDER BY cluster, queue, cluster_queue
"""

# Per evaluation time t (a multiple of the step in (from, to]), the good and total
# request counts of each burn window (t - W, t]. A latency delta at ``ts`` covers
# (ts - interval, ts] and is counted at the first bin end at or after ``ts``; the bins are
# ``{bin}`` seconds, the greatest divisor of the step and of every window (slo_steps), so that
# each window's start is a bin's end whatever the step (bins of the step itself gave a 5 m
# window 4 m at a 120 s step, and a window shorter than the step a negative frame: an error).
# ``{windows}`` is filled with one pair of columns per distinct window length (slo_steps).
_SLO_STEPS = """
WITH per_step AS
(
    SELECT toInt64(ceil(toFloat64(ts) / {bin}) * {bin}) AS t,
        sum(total) AS total,
        sum({good}) AS good
    FROM {latency}
    WHERE service = {service:String}
      AND ({cluster:String} = '' OR cluster = {cluster:String})
      AND ts > toDateTime64({from:Float64} - {lookback:Float64}, 3, 'UTC')
      AND ts <= toDateTime64({to:Float64}, 3, 'UTC')
    GROUP BY t
),
grid AS
(
    -- the steps from the first one whose windows hold a delta to the last one whose windows do:
    -- a step before or after those burns nothing (a window of --from 0 to now is 29 million
    -- steps at 60 s, of which only these can say anything); never before the epoch (as UInt64,
    -- a --from less than the lookback wrapped around and made no step at all: no alert)
    SELECT toInt64(arrayJoin(range(
        toUInt64(greatest(0., greatest(ceil(({from:Float64} - {lookback:Float64}) / {bin}) * {bin},
                                       toFloat64((SELECT min(t) FROM per_step))))),
        toUInt64(greatest(0., least(floor({to:Float64} / {step:UInt32}) * {step:UInt32},
                                    ceil((toFloat64((SELECT max(t) FROM per_step)) + {lookback:Float64})
                                         / {step:UInt32}) * {step:UInt32})))
            + 1,
        {bin}))) AS t
)
SELECT * FROM
(
    SELECT g.t AS t{windows}
    FROM grid AS g LEFT JOIN per_step AS p ON g.t = p.t
)
WHERE t > {from:Float64} AND t % {step:UInt32} = 0
ORDER BY t
SETTINGS join_use_nulls = 0
"""

SLO_WINDOW_COLUMNS = """,
        sum(p.total) OVER (ORDER BY g.t RANGE BETWEEN {back} PRECEDING AND CURRENT ROW) AS total_{w},
        sum(p.good) OVER (ORDER BY g.t RANGE BETWEEN {back} PRECEDING AND CURRENT ROW) AS good_{w}"""

# Buckets over a window: SLI, and the histogram for the p99 estimate.
_SLO_WINDOW_TOTALS = """
SELECT
    sum(total) AS total,
    sum({good}) AS good,
    countIf(NOT has(bounds_ms, {threshold:Float64})) AS mismatched,
    anyIf(bounds_ms, NOT has(bounds_ms, {threshold:Float64})) AS mismatched_bounds,
    uniqExact(bounds_ms) AS bound_sets,
    any(bounds_ms) AS bucket_bounds,
    sumForEach(counts) AS bucket_counts,
    count() AS rows,
    max(toFloat64(ts)) AS last
FROM {latency}
WHERE service = {service:String}
  AND ({cluster:String} = '' OR cluster = {cluster:String})
  AND ts > toDateTime64({from:Float64}, 3, 'UTC')
  AND ts <= toDateTime64({to:Float64}, 3, 'UTC')
"""
_LATENCY_RAW = "latency FINAL"
SLO_WINDOW_TOTALS = fill(_SLO_WINDOW_TOTALS, good=m.GOOD, latency=_LATENCY_RAW)

# The service's latest histogram row up to ``to``, however old (asked only when the SLO period
# holds none: since when it has been silent); over the raw rows without FINAL (a row replaced by
# another of the same key has its time: neither the latest nor the existence needs the merge)
_SLO_LAST_ROW = """
SELECT count() AS rows, max(toFloat64(ts)) AS last
FROM {latency}
WHERE service = {service:String}
  AND ({cluster:String} = '' OR cluster = {cluster:String})
  AND ts <= toDateTime64({to:Float64}, 3, 'UTC')
"""
SLO_LAST_ROW = fill(_SLO_LAST_ROW, latency="latency")

# Each source's latest row of the service at or before ``to`` within ``{reach:Float64}`` seconds
# (no older row can still stand for it: rules.config.row_hold_s of the wire's longest interval,
# or no_data_s), with the interval it stands by: that row's interval_s (of rows at that time, the
# longest), or the time since the source's previous row when shorter (its next row is due then,
# whatever a row claims: a sender every 10 s that says interval_s 86400, a unit error or a hostile
# one, had every window pair of the service unjudged for as long as it sent). Over the raw rows
# over rollups too (the rollups sum a minute's rows of every source and interval); none where
# they are no longer kept. Without FINAL (as SLO_LAST_ROW): a row replaced under its key has its
# time (its times taken once each, the gap to the previous row never 0), and of the two the longer
# interval is taken, which stands the longer.
SLO_SOURCES = """
SELECT cluster, source, last,
       if(length(latest_two) = 2, least(claimed_s, latest_two[2] - latest_two[1]), claimed_s) AS interval_s
FROM (
    SELECT cluster, source, max(toFloat64(ts)) AS last,
           argMax(toFloat64(interval_s), (ts, interval_s)) AS claimed_s,
           groupArraySortedDistinct(2)(-toFloat64(ts)) AS latest_two
    FROM latency
    WHERE service = {service:String}
      AND ({cluster:String} = '' OR cluster = {cluster:String})
      AND ts > toDateTime64({to:Float64} - {reach:Float64}, 3, 'UTC')
      AND ts <= toDateTime64({to:Float64}, 3, 'UTC')
    GROUP BY cluster, source
)
"""

# Whether any scheduler event of the cluster ('' every cluster) came at or before ``to``: with
# none, no collector has reported, and no starvation incident is no data, not none.
SCHED_SEEN = """
SELECT count() AS rows
FROM (
    SELECT 1 FROM sched_events
    WHERE ({cluster:String} = '' OR cluster = {cluster:String}) AND ts < toDateTime64({to:Float64}, 3, 'UTC')
    LIMIT 1
)
"""

# Whether any agent of the cluster ('' every cluster) sent a heartbeat in (from, to]: an SLO
# whose service never sent a histogram row is not evaluable once the agents that would carry
# them have been reporting for its no_data_s (a misspelt service or cluster, or a service never
# instrumented); before any agent reported, the empty store says nothing of the service. One row
# is enough: the scan stops at the first.
AGENTS_REPORTED = """
SELECT count() AS rows
FROM (
    SELECT 1 FROM node_heartbeats
    WHERE ({cluster:String} = '' OR cluster = {cluster:String})
      AND ts > toDateTime64({from:Float64}, 3, 'UTC') AND ts <= toDateTime64({to:Float64}, 3, 'UTC')
    LIMIT 1
)
"""


# The capacity snapshot of STARVATION: per node and sample time, the free GPUs (a fraction
# of a GPU counts), the whole free GPUs and the largest free fraction of one GPU. A sample
# stands for the node until it is 2 x its interval old, so the snapshot of an opening at
# ``from`` may lie up to 2 x MAX_INTERVAL_S before it; a later sample, however stale, hides
# an older one (the latest at or before the opening is the one that counts).
SNAP_LOOKBACK_S = 2 * MAX_INTERVAL_S
# (older samples cannot stand for an opening at or after ``from``, nor hide one that can)
_SNAP_FROM = f"{{from:Float64}} - 2 * {longest_before(SNAP_LOOKBACK_S)}"
NODE_SNAP_RAW = f"""(
    -- a node's GPUs at one time are one batch with one heartbeat state: summed first, then the
    -- state joined to the node's row (not to each GPU's): not schedulable, nothing is free
    SELECT s.cluster AS cluster, s.node AS node, s.pool AS pool, s.t AS t, s.interval_s AS interval_s,
        if(ifNull(h.schedulable, 1), s.free, 0) AS free,
        if(ifNull(h.schedulable, 1), s.whole_free, 0) AS whole_free,
        if(ifNull(h.schedulable, 1), s.frac_free, 0) AS frac_free
    FROM
    (
        SELECT cluster, node, pool, ts, toFloat64(ts) AS t, max(interval_s) AS interval_s,
            sum(if(usable, (1 - alloc_share) * gpu_fraction, 0)) AS free,
            countIf(usable AND alloc_share = 0 AND gpu_fraction = 1) AS whole_free,
            max(if(usable, (1 - alloc_share) * gpu_fraction, 0)) AS frac_free
        FROM
        (
            SELECT cluster, node, pool, ts, interval_s, alloc_share, gpu_fraction,
                healthy AND gpu_fraction > 0 AS usable
            FROM gpu_samples FINAL
            WHERE ts >= toDateTime64({_SNAP_FROM}, 3, 'UTC')
              AND ts < toDateTime64({{to:Float64}}, 3, 'UTC')
              AND {_CLUSTER}
        )
        GROUP BY cluster, node, pool, ts
    ) AS s
    {heartbeat_join(_SNAP_FROM)}
)"""

# over raw rows every snapshot row may stand for any opening: one key for all
_STARVATION_RAW = fill(
    _STARVATION,
    keep=("settings",),
    snapshot=fill(_SNAP_SWEEP, node_snap=NODE_SNAP_RAW, snap_minute="0.", open_minute="0."),
)
STARVATION = fill(_STARVATION_RAW, settings=JOIN_SETTINGS)
# without its SETTINGS clause, to nest in another query (a panel's)
STARVATION_NESTED = fill(_STARVATION_RAW, settings="")

# ---------------------------------------------------------------------------- over rollups
#: the minute tier's owner rows that hold something, and its latency rows that hold a histogram: a
#: re-rolled minute's key its raw rows no longer give is left as a tombstone of zeros
#: (rules/rollup.py OWNER_MINUTE_TOMBSTONES, LATENCY_MINUTE_TOMBSTONES), which every reader skips
OWNER_HELD = "allocated_s > 0"
LATENCY_HELD = "notEmpty(bounds_ms)"

# The same rules over the per-minute rollups (rules/rollup.py); ``{ti:UInt8}`` is the
# 1-based index of the idle threshold among the rollups' thresholds.
_ROLLUP_WINDOW = """minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')
      AND ({cluster:String} = '' OR cluster = {cluster:String})"""

UTILIZATION_ROLLUP = f"""
SELECT cluster, pool, sum(capacity_s) AS capacity_s, sum(allocated_s) AS allocated_s, sum(active_s) AS active_s,
    sum(idle_allocated_s[{{ti:UInt8}}]) AS idle_allocated_s, sum(idle_unallocated_s[{{ti:UInt8}}]) AS idle_unallocated_s
FROM gpu_rollup_1m FINAL
WHERE {_ROLLUP_WINDOW}
GROUP BY cluster, pool
HAVING capacity_s > 0
ORDER BY cluster, pool
"""

IDLE_BY_OWNER_ROLLUP = f"""
SELECT cluster, id, any(name) AS name, any(user) AS user, any(account) AS account, any(queue) AS queue,
    sum(allocated_s) AS allocated_s, sum(idle_s[{{ti:UInt8}}]) AS idle_s
FROM
(
    SELECT * FROM owner_rollup_1m FINAL
    WHERE {_ROLLUP_WINDOW} AND {OWNER_HELD}
      AND {holder_matched("cluster", "queue", "account")}
)
GROUP BY cluster, id
ORDER BY idle_s DESC, id
LIMIT {{limit:UInt32}}
"""

FAIR_SHARE_ROLLUP = fill(
    _FAIR_SHARE,
    allocated=f"""    SELECT account, sum(allocated_s) AS gpu_s FROM owner_rollup_1m FINAL
    WHERE {_ROLLUP_WINDOW} AND {OWNER_HELD}
      AND {holder_matched("cluster", "queue", "account")}
    GROUP BY account""",
    requested=_REQUESTED_MATCHED,
    settings=JOIN_SETTINGS,
)

# ---------------------------------------------------------------------------- over both tiers
# A window on whole minutes as [from, h0) and [h1, to) over the minute tier plus [h0, h1) over
# the hourly tier (gpu_rollup_1h, owner_rollup_1h: the minute tier's sums per hour), h0 the
# first whole hour at or after ``from`` and h1 the last at or before ``to``; h0 = h1 = to when
# the window holds no whole hour (rules.rollup.hour_split). Each minute is read once, from one
# tier, and an hour's row is the sum of its minutes' rows: the sums are the minute tier's.
_MINUTE_EDGES = """((minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({h0:Float64}, 'UTC'))
          OR (minute >= toDateTime({h1:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')))
      AND ({cluster:String} = '' OR cluster = {cluster:String})"""
_WHOLE_HOURS = """hour >= toDateTime({h0:Float64}, 'UTC') AND hour < toDateTime({h1:Float64}, 'UTC')
      AND ({cluster:String} = '' OR cluster = {cluster:String})"""


def _tiers(table: str, cols: str, where: str = "") -> str:
    """The rows of ``table``'s minute tier at the window's edges and of its hourly tier inside."""
    return f"""
    SELECT {cols} FROM {table}_1m FINAL WHERE {_MINUTE_EDGES}{where}
    UNION ALL
    SELECT {cols} FROM {table}_1h FINAL WHERE {_WHOLE_HOURS}{where}"""


_GPU_TIER_COLS = (
    "cluster, pool, capacity_s, allocated_s, active_s, idle_allocated_s[{ti:UInt8}] AS idle_a, "
    "idle_unallocated_s[{ti:UInt8}] AS idle_u"
)
UTILIZATION_TIERED = f"""
SELECT cluster, pool, sum(capacity_s) AS capacity_s, sum(allocated_s) AS allocated_s, sum(active_s) AS active_s,
    sum(idle_a) AS idle_allocated_s, sum(idle_u) AS idle_unallocated_s
FROM ({_tiers("gpu_rollup", _GPU_TIER_COLS)}
)
GROUP BY cluster, pool
HAVING capacity_s > 0
ORDER BY cluster, pool
"""

_OWNER_TIER_COLS = "cluster, id, name, user, account, queue, allocated_s, idle_s[{ti:UInt8}] AS idle_t"
_OWNER_TIER_MATCHED = f"\n      AND {OWNER_HELD} AND {holder_matched('cluster', 'queue', 'account')}"
IDLE_BY_OWNER_TIERED = f"""
SELECT cluster, id, any(name) AS name, any(user) AS user, any(account) AS account, any(queue) AS queue,
    sum(allocated_s) AS allocated_s, sum(idle_t) AS idle_s
FROM ({_tiers("owner_rollup", _OWNER_TIER_COLS, _OWNER_TIER_MATCHED)}
)
GROUP BY cluster, id
ORDER BY idle_s DESC, id
LIMIT {{limit:UInt32}}
"""

FAIR_SHARE_TIERED = fill(
    _FAIR_SHARE,
    allocated=f"""    SELECT account, sum(allocated_s) AS gpu_s FROM ({_tiers("owner_rollup", "account, allocated_s", _OWNER_TIER_MATCHED)}
    )
    GROUP BY account""",
    requested=_REQUESTED_MATCHED,
    settings=JOIN_SETTINGS,
)

# The snapshot candidates of each opening's minute (rules/rollup.py GPU_REFRESH: the samples
# starting in it and the node's latest one before it), matched to openings by that minute.
NODE_SNAP_ROLLUP = """
(
    SELECT cluster, node, pool, toFloat64(minute) AS minute, toFloat64(t) AS t, interval_s, free, whole_free,
        frac_free
    FROM gpu_rollup_1m FINAL
    ARRAY JOIN snap_ts AS t, snap_interval_s AS interval_s, snap_free AS free, snap_whole_free AS whole_free,
        snap_frac_free AS frac_free
    WHERE minute IN (SELECT DISTINCT toDateTime(floor(opened / 60) * 60, 'UTC') FROM incidents)
      AND ({cluster:String} = '' OR cluster = {cluster:String})
)"""

# The sweep over the minute tier's candidates at query time (a store whose starvation tier is
# not built yet: rules.rollup.steps_built).
STARVATION_MINUTE_SWEEP = fill(
    _STARVATION,
    snapshot=fill(
        _SNAP_SWEEP, node_snap=NODE_SNAP_ROLLUP, snap_minute="minute", open_minute="floor(i.opened / 60) * 60"
    ),
    settings=JOIN_SETTINGS,
)

# The snapshot from the starvation tier (capacity_steps_1m, rules/rollup.py STEPS_REFRESH): the
# sweep's streams of each opening's minute, computed at refresh time as step functions. An
# opening reads, in each stream its request may use (as the sweep keys them: the seen pools it
# matches, every = 0, or the whole cluster, every = 1, for a request naming no pool; none when
# no seen pool matches), the last step at or before it (a change at the opening's own time
# counts, as the sweep orders events before openings), and sums them over those streams: a
# node has one pool string at a time, so the streams are disjoint. ``seen``: the pools of the
# candidates of the openings' minutes, per cluster, as the sweep sees them.
_SNAP_STEPS = fill(
    """steps_minute AS
(
    SELECT cluster, toFloat64(minute) AS minute, arrayZip(every, pool_key) AS keys, step_at, step_free,
        step_shapes, step_nodes
    FROM capacity_steps_1m FINAL
    WHERE minute IN (SELECT DISTINCT toDateTime(floor(opened / 60) * 60, 'UTC') FROM incidents)
      AND ({cluster:String} = '' OR cluster = {cluster:String})
),
steps_seen AS
(
    SELECT cluster, groupUniqArrayArray(arrayMap(k -> k.2, arrayFilter(k -> k.1 = 0, keys))) AS seen
    FROM steps_minute
    GROUP BY cluster
),
steps_keyed AS
(
    SELECT i.cluster AS cluster, i.scheduler AS scheduler, i.request_id AS request_id, i.opened AS opened,
        i.gpus_per_node AS gpus_per_node, floor(i.opened / 60) * 60 AS minute,
        if(i.pool = '', c.seen,
           arrayFilter(p -> hasAny(splitByChar(',', p), splitByChar(',', i.pool)), c.seen)) AS matched,
        notEmpty(matched) AS was_seen,
        if(empty(matched), [], if(i.pool = '', [(toUInt8(1), '')], arrayMap(p -> (toUInt8(0), p), matched))) AS keys
    FROM incidents AS i
    LEFT JOIN steps_seen AS c ON i.cluster = c.cluster
),
snap AS
(
    SELECT cluster, scheduler, request_id, toFloat64(toString(sum(free_then))) AS free,  -- (toString: as
        -- in the sweep, the Decimal read exactly)
        toUInt64(sum(fit_then)) AS fitting, max(was_seen) AS seen
    FROM
    (
        SELECT k.cluster AS cluster, k.scheduler AS scheduler, k.request_id AS request_id, k.was_seen AS was_seen,
            indexOf(s.keys, k.key) AS ix, arrayCount(x -> x <= k.opened, s.step_at[ix]) AS j,
            if(j = 0, toDecimal128(0, 20), s.step_free[ix][j]) AS free_then,
            -- the nodes that may host the request: whole GPUs per node, or a part of one GPU
            if(j = 0, 0, arraySum(arrayMap((sh, n) -> if({fits_steps}, n, 0),
                                            s.step_shapes[ix][j], s.step_nodes[ix][j]))) AS fit_then
        FROM (SELECT * EXCEPT (keys, matched), key FROM steps_keyed ARRAY JOIN keys AS key) AS k
        LEFT JOIN steps_minute AS s ON k.cluster = s.cluster AND k.minute = s.minute
    )
    GROUP BY cluster, scheduler, request_id
)""",
    fits_steps=fits_shape("sh", "k.gpus_per_node"),
)

STARVATION_ROLLUP = fill(_STARVATION, snapshot=_SNAP_STEPS, settings=JOIN_SETTINGS)

#: The setting of ClickHouse's materialized CTEs (a CTE ``AS MATERIALIZED`` computed once per
#: query, not once per reference); a server that lists it in ``system.settings`` takes them.
MATERIALIZED_CTE = "enable_materialized_cte"
#: A materialized CTE read twice, as the starvation queries set it: an engine that lists the
#: setting may still refuse a query's change of it (an experimental setting where the server's
#: ``allow_feature_tier`` allows only beta or production ones, a profile's constraint).
MATERIALIZED_CTE_TRIAL = f"""WITH x AS MATERIALIZED (SELECT 1 AS n)
SELECT count() AS n FROM x AS a CROSS JOIN x AS b
SETTINGS {MATERIALIZED_CTE} = 1"""
_INCIDENTS_CTE = "\nincidents AS\n("


def materialized(q: str) -> str:
    """A starvation query (:data:`STARVATION`, :data:`STARVATION_MINUTE_SWEEP`,
    :data:`STARVATION_ROLLUP`) with its ``incidents`` computed once: the snapshot and the final
    select read it up to three times, each of them otherwise aggregating the window's scheduler
    events again (a month of a big fleet's queue: about a third of the query). The same rows."""
    if q.count(_INCIDENTS_CTE) != 1 or not q.rstrip().endswith(JOIN_SETTINGS):
        raise ValueError("not a starvation query with its settings")
    head = q.replace(_INCIDENTS_CTE, "\nincidents AS MATERIALIZED\n(")
    return head.rstrip() + f", {MATERIALIZED_CTE} = 1\n"


# latency rows as the rollup holds them: a minute's deltas summed, at the minute's end
_LATENCY_ROLLUP = (
    "(SELECT cluster, service, minute_end AS ts, bounds_ms, counts, total FROM latency_rollup_1m FINAL "
    f"WHERE {LATENCY_HELD}) AS latency"
)

SLO_WINDOW_TOTALS_ROLLUP = fill(_SLO_WINDOW_TOTALS, good=m.GOOD, latency=_LATENCY_ROLLUP)
SLO_LAST_ROW_ROLLUP = fill(_SLO_LAST_ROW, latency=_LATENCY_ROLLUP)


def slo_steps(lengths: list[int], step_s: int, rollup: bool = False) -> str:
    """SLO_STEPS with one good/total column pair per window length (seconds), over the raw
    latency deltas or the rollup."""
    b = window_bin_s(step_s, lengths)
    cols = "".join(fill(SLO_WINDOW_COLUMNS, back=literal(int(w) - b), w=literal(int(w))) for w in lengths)
    latency = _LATENCY_ROLLUP if rollup else _LATENCY_RAW
    return fill(_SLO_STEPS, good=m.GOOD, latency=latency, windows=cols, bin=literal(b))


def window_bin_s(step_s: int, lengths: Iterable[int]) -> int:
    """The bins latency deltas are summed in for burn windows evaluated every ``step_s``: the
    greatest common divisor of the step and the window lengths, so that every window (t - W, t]
    at every step t is whole bins, never a bin cut by its start."""
    return math.gcd(int(step_s), *(int(w) for w in lengths))


# ---------------------------------------------------------------------------- minimum idle duration
# With ``min_idle_s`` > 0, a sample is idle only inside a run of consecutive idle samples of one
# GPU (or MIG instance) lasting at least that long. Runs are found on samples from
# twice ``min_idle_s`` plus twice the longest interval before the window to twice ``min_idle_s``
# after it, so a run crossing an edge is judged whole: a sample may start up to twice the interval
# of the one before it after that one's start, so a run's samples may cover as little as half its
# time (those of ``min_idle_s`` past the window, as little as half of ``min_idle_s``). Before the
# window the first sample left out may itself reach up to twice its interval (a day at most)
# towards it: the samples after it cover then as little as half of what is left, so twice
# ``min_idle_s`` is looked back past twice the longest interval of the samples there (a scalar
# read of two columns, as ``longest_before``: 20 s for 10 s sampling, never more than the wire's
# two days). A run still going on at evaluation time is judged by what has arrived.
_LONGEST_RUN_BACK = (
    f"(SELECT ifNull(max(interval_s), 0) FROM gpu_samples "
    f"WHERE ts >= toDateTime64({{from:Float64}} - 2 * {{min_idle:Float64}} - {2 * MAX_INTERVAL_S}, 3, 'UTC') "
    f"AND ts < toDateTime64({{from:Float64}}, 3, 'UTC') AND {_CLUSTER})"
)
_PADDED = fill(
    _CAPACITY_SAMPLES,
    samples_window=f"WHERE ts >= toDateTime64({{from:Float64}} - 2 * {{min_idle:Float64}} - 2 * {_LONGEST_RUN_BACK}, 3, 'UTC')\n"
    "      AND ts < toDateTime64({to:Float64} + 2 * {min_idle:Float64}, 3, 'UTC')",
)
_SERIES = "PARTITION BY cluster, node, gpu, mig_gi, mig_ci ORDER BY ts"

IDLE_RUNS = f"""
SELECT *, is_idle AND sum(interval_s) OVER (PARTITION BY cluster, node, gpu, mig_gi, mig_ci, run) >= {{min_idle:Float64}}
    AS idle_ok
FROM
(
    SELECT *, sum(brk) OVER ({_SERIES} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS run
    FROM
    (
        SELECT *, ifNull(activity < {{idle:Float64}}, 0) AS is_idle,
            if(row_number() OVER ({_SERIES}) = 1
               OR is_idle != lagInFrame(is_idle, 1) OVER ({_SERIES} ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
               OR toFloat64(ts) - lagInFrame(toFloat64(ts), 1) OVER ({_SERIES} ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
                  > 2 * lagInFrame(interval_s, 1) OVER ({_SERIES} ROWS BETWEEN 1 PRECEDING AND CURRENT ROW), 1, 0) AS brk
        FROM ({_PADDED})
    )
)
"""

# The rule queries whose idle test honours ``{min_idle:Float64}``: over IDLE_RUNS, idle_ok.
UTILIZATION_MIN_IDLE = fill(_UTILIZATION, sums=m.sums(m.FLEET_TERMS, "idle_ok"), samples=IDLE_RUNS)
_OWNER_RUN_TOTALS = m.sums(m.OWNER_TERMS, "idle_ok", names=_OWNER_SUMS)
IDLE_BY_OWNER_MIN_IDLE = fill(_IDLE_BY_OWNER, sums=_OWNER_RUN_TOTALS, samples=IDLE_RUNS, where=_WHOLE_FLEET)
IDLE_BY_OWNER_MATCHED_MIN_IDLE = fill(
    _IDLE_BY_OWNER, sums=_OWNER_RUN_TOTALS, samples=IDLE_RUNS, where=_MATCHED_HOLDERS
)

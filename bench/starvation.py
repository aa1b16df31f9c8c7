"""The starvation rule at scale: its capacity snapshot against nodes x pending requests.

A synthetic fleet is written straight into chDB by SQL (not timed): N nodes of 8 GPUs in 8
partitions (every 16th node serves two, 'pA,pB'), sampled every 60 s for one hour, each GPU
allocated or free by a hash (a few half-shared, a few unhealthy, every 25th node drained), and
N requests that never start, submitted so that each opens (waits past the default 10-minute
threshold) inside the hour: 0.5 to 8 GPUs per node on 1 to 4 nodes, naming a partition, two, or
none. Then, timed, each in its own process (so that its peak RSS is the query's, and a run that
would not end is stopped at the size's timeout): the starvation rule over raw rows for the hour;
the rule as the rules service runs it (``source: auto``): over the starvation tier
(``capacity_steps_1m``), after one rollup refresh of the whole hour (timed too: the work the tier
moves to refresh time, which the service does a minute at a time as data arrives); and, at the
sizes it can do, the rule as it was before (the snapshot as a product of openings and nodes), the
baseline. Every answer must be the same rows as over raw rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.child import peak_rss_mb, run_child
from gpuslo.ingest.sqltext import fill
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules import rollup, sql
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.tables import SCHEMA

START = 1_795_824_000.0  # a midnight UTC
HOUR_S = 3600.0
INTERVAL_S = 60
GPUS_PER_NODE = 8
POOLS = 8
DEFAULT_SIZES = (1000, 10000, 50000)
OLD_SIZES = (1000, 2000)  # where the old SQL ends in reasonable time (issue 16: 4.5 s at 2,000)

# The rule as it was before issue 16, kept as the baseline: each opening joined to every node of
# its pool (a product of openings and nodes), then each pair's snapshot found by ASOF.
OLD_STARVATION_TEMPLATE = """
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
        if(has({thr_queues:Array(String)}, queue),
           {thr_values:Array(Float64)}[indexOf({thr_queues:Array(String)}, queue)],
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
node_snap AS
{node_snap},
incident_nodes AS
(
    -- the nodes that were in the request's pool at some time (a pruning only), each once: the
    -- pool that counts is the one of the node's snapshot sample (below), so a node that changed
    -- pool is in the pool it was in at the opening, and never counted twice
    SELECT DISTINCT i.cluster AS cluster, i.request_id AS request_id, i.opened AS opened,
        i.pool AS wanted, n.node AS node, floor(i.opened / 60) * 60 AS opened_minute
    FROM incidents AS i
    INNER JOIN (SELECT DISTINCT cluster, node, pool FROM node_snap) AS n ON i.cluster = n.cluster
    WHERE i.pool = '' OR hasAny(splitByChar(',', n.pool), splitByChar(',', i.pool))
),
snap AS
(
    SELECT cluster, request_id, sum(if(ok, free, 0)) AS free,
        groupArray((if(ok, whole_free, 0), if(ok, frac_free, 0))) AS per_node
    FROM
    (
        SELECT x.cluster AS cluster, x.request_id AS request_id, ns.free AS free,
            ns.whole_free AS whole_free, ns.frac_free AS frac_free,
            -- the sample still stands for its node, and the node is in the request's pool then:
            -- a node serving several partitions reports them ','-joined (Slurm forbids ',' in a
            -- name), and a request may name several (sbatch -p a,b): it may host it when they
            -- share one
            x.opened - ns.t < 2 * ns.interval_s
                AND (x.wanted = '' OR hasAny(splitByChar(',', ifNull(ns.pool, '')), splitByChar(',', x.wanted))) AS ok
        FROM incident_nodes AS x
        ASOF LEFT JOIN node_snap AS ns
        ON x.cluster = ns.cluster AND x.node = ns.node{snap_key} AND x.opened >= ns.t
    )
    GROUP BY cluster, request_id
)
SELECT
    i.cluster AS cluster, i.scheduler AS scheduler, i.request_id AS request_id, i.queue AS queue,
    i.pool AS pool, i.user AS user, i.account AS account, i.gpus_per_node AS gpus_per_node,
    i.nodes AS nodes, i.submitted AS submitted, i.opened AS opened,
    if(i.left_queue < {to:Float64}, i.left_queue, NULL) AS closed,
    if(i.left_queue < {to:Float64}, i.how, '') AS closed_by,
    ifNull(s.free, 0) AS free_gpus,
    arrayCount(p -> {fits}, ifNull(s.per_node, [])) AS fitting_nodes,
    arrayLast(x -> x.1 <= i.opened, i.said) AS said_at_open,
    said_at_open.3 AS reason,
    -- a cause the scheduler gave (Kueue: its quota) stands, except that the cluster's free
    -- devices, when any node was seen, still say capacity
    multiIf(said_at_open.2 = 'capacity', 'capacity',
            said_at_open.2 != '' AND s.free IS NULL, said_at_open.2,
            NOT {enough}, 'capacity',
            said_at_open.2 != '', said_at_open.2,
            fitting_nodes < i.nodes, 'fragmentation',
            'policy') AS cause
FROM incidents AS i
LEFT JOIN snap AS s ON i.cluster = s.cluster AND i.request_id = s.request_id
ORDER BY opened, request_id
{settings}
"""


# the rule's own tests of free against requested (sql.enough_free, and sql.fits_shape over a
# node's shape as the sweep makes it: 2 + its whole free GPUs, else the largest free part of one
# GPU), so that the old query and the new differ in their cost only
_FITS = sql.fits_shape("if(p.1 >= 1, 2 + toFloat64(p.1), p.2 + 1e-9)", "i.gpus_per_node")
_ENOUGH = sql.enough_free("ifNull(s.free, 0)", "i.nodes * i.gpus_per_node")
OLD_STARVATION = fill(
    OLD_STARVATION_TEMPLATE,
    node_snap=sql.NODE_SNAP_RAW,
    snap_key="",
    settings=sql.JOIN_SETTINGS,
    fits=_FITS,
    enough=_ENOUGH,
)
OLD_STARVATION_ROLLUP = fill(
    OLD_STARVATION_TEMPLATE,
    node_snap=sql.NODE_SNAP_ROLLUP,
    snap_key=" AND x.opened_minute = ns.minute",
    settings=sql.JOIN_SETTINGS,
    fits=_FITS,
    enough=_ENOUGH,
)

_POOL = f"if(n % 16 = 5, concat('p', toString(n % {POOLS}), ',p', toString((n + 1) % {POOLS})), concat('p', toString(n % {POOLS})))"


def _gpu_samples(store: ChdbStore, p: dict[str, Any]) -> None:
    """8 GPUs per node every 60 s for the hour: allocated by a hash of (node, GPU, 10-minute
    block), one in 16 of those half-shared, one GPU in 50 unhealthy."""
    store.execute(
        f"""
        INSERT INTO gpu_samples (cluster, node, pool, gpu, uuid, model, ts, interval_s, healthy, activity,
            alloc_share, source, boot_id, seq)
        SELECT 'bench', concat('node-', toString(n)), {_POOL}, g, concat('GPU-', toString(n), '-', toString(g)),
            'H100', toDateTime64({{start:Float64}} + k * {INTERVAL_S}, 3, 'UTC'), {INTERVAL_S},
            cityHash64(n, g, {{seed:UInt64}}) % 50 != 0, 0.5, share, concat('node-', toString(n)), 'b', k
        FROM
        (
            SELECT intDiv(number, {GPUS_PER_NODE} * {{nodes:UInt32}}) AS k,
                intDiv(number, {GPUS_PER_NODE}) % {{nodes:UInt32}} AS n, number % {GPUS_PER_NODE} AS g,
                cityHash64(n, g, intDiv(k * {INTERVAL_S}, 600), {{seed:UInt64}}) % 16 AS h,
                multiIf(h < 9, toFloat32(1), h = 9, toFloat32(0.5), toFloat32(0)) AS share
            FROM numbers({{ticks:UInt64}} * {{nodes:UInt32}} * {GPUS_PER_NODE})
        )
        """,
        p,
    )


def _heartbeats(store: ChdbStore, p: dict[str, Any]) -> None:
    """One heartbeat per node a day before the hour (state is sent on change): every 25th drained."""
    store.execute(
        f"""
        INSERT INTO node_heartbeats (cluster, node, pool, ts, interval_s, schedulable, state, reason, gpus,
            source, boot_id, seq)
        SELECT 'bench', concat('node-', toString(n)), {_POOL}, toDateTime64({{start:Float64}} - 86400, 3, 'UTC'),
            {INTERVAL_S}, n % 25 != 0, '', '', {GPUS_PER_NODE}, concat('node-', toString(n)), 'b', 1
        FROM (SELECT number AS n FROM numbers({{nodes:UInt32}}))
        """,
        p,
    )


def _requests(store: ChdbStore, p: dict[str, Any]) -> None:
    """N requests that never start, each opening inside the hour."""
    store.execute(
        f"""
        INSERT INTO sched_events (cluster, scheduler, event, request_id, ts, name, user, account, queue, pool,
            gpus_per_node, nodes, reason, assigned_nodes, source, boot_id, seq)
        SELECT 'bench', 'slurm', 'submit', concat('r-', toString(number)),
            toDateTime64({{start:Float64}} - 600 + (h % 3600000) / 1000, 3, 'UTC'), 'job',
            concat('u', toString(h % 20)), concat('acct', toString(h % 5)), 'gpu',
            multiIf(h % 10 = 0, '', h % 10 = 1,
                    concat('p', toString(intDiv(h, 10) % {POOLS}), ',p', toString(intDiv(h, 100) % {POOLS})),
                    concat('p', toString(intDiv(h, 10) % {POOLS}))),
            [0.5, 1, 2, 4, 8][intDiv(h, 1000) % 5 + 1], 1 + intDiv(h, 7) % 4, '', [], 'collector', 'b', number
        FROM (SELECT number, cityHash64(number, {{seed:UInt64}}) AS h FROM numbers({{requests:UInt32}}))
        """,
        p,
    )


def populate(store: ChdbStore, nodes: int, requests: int, seed: int = 0) -> dict[str, int]:
    """The fleet of N nodes and its pending requests over [START, START + 1 h)."""
    p = {
        "start": START,
        "nodes": nodes,
        "requests": requests,
        "ticks": int(HOUR_S // INTERVAL_S),
        "seed": seed,
    }
    _gpu_samples(store, p)
    _heartbeats(store, p)
    _requests(store, p)
    return {
        t: int(store.query(f"SELECT count() AS n FROM {t}")[0]["n"]) for t in ("gpu_samples", "sched_events")
    }


def params(frm: float = START, to: float = START + HOUR_S) -> dict[str, Any]:
    """The rule's parameters for [frm, to) with the default config (as rules.evaluate.starvation)."""
    st = RulesConfig().starvation
    return {"from": frm, "to": to, "cluster": "", "thr_queues": [], "thr_values": [],
            "thr_default": st.threshold_s, "thr_max": st.threshold_s}  # fmt: skip


# ----------------------------------------------------------------------------- one run per process
def _rss_mb() -> float:
    """This process's resident set now (Linux /proc), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# The rule's first step alone: the snapshot rows read from the samples (gpu_samples FINAL over the
# hour, the heartbeat ASOF join, the sums per node and time), without the sweep that follows.
SNAPSHOT_READ = fill(
    "SELECT count() AS n FROM {node_snap} AS node_snap {settings}",
    node_snap=sql.NODE_SNAP_RAW,
    settings=sql.JOIN_SETTINGS,
)


def _snapshot_read(store: ChdbStore) -> int:
    """Time SNAPSHOT_READ once: where the rule's time goes (the read against the sweep)."""
    t0 = time.perf_counter()
    rows = store.query(SNAPSHOT_READ, params())
    secs = time.perf_counter() - t0
    print(json.dumps({"seconds": secs, "peak_rss_mb": peak_rss_mb(), "snapshot_rows": int(rows[0]["n"])}))
    return 0


def _refresh(store: ChdbStore) -> int:
    """One rollup refresh of every minute the fleet marked (the minute tiers, the starvation
    tier, the hourly tier), timed."""
    t0 = time.perf_counter()
    rep = rollup.refresh(store)
    secs = time.perf_counter() - t0
    print(json.dumps({"seconds": secs, "peak_rss_mb": peak_rss_mb(), "node_minutes": rep.node_minutes}))
    return 0


def _child(a: argparse.Namespace) -> int:
    """--generate N: write the fleet into --store; --query new|old: time the rule once over it."""
    store = ChdbStore(a.store)
    try:
        if a.generate:
            store.migrate(SCHEMA)  # its views mark the minutes the rollup refresh reads
            t0 = time.perf_counter()
            counts = populate(store, a.generate, a.generate, a.seed)
            print(json.dumps({"generate_s": time.perf_counter() - t0, **counts}))
            return 0
        if a.refresh:
            return _refresh(store)
        if a.query == "snapshot":
            return _snapshot_read(store)
        if a.query == "tier" and not rollup.steps_built(store):
            print("the starvation tier is not built: refresh the rollups first", file=sys.stderr)
            return 1
        q = {"old": OLD_STARVATION, "tier": sql.STARVATION_ROLLUP}.get(a.query, sql.STARVATION)
        before = _rss_mb()
        t0 = time.perf_counter()
        rows = store.query(q, params())
        secs = time.perf_counter() - t0
        causes: dict[str, int] = {}
        for r in rows:
            causes[r["cause"]] = causes.get(r["cause"], 0) + 1
        answer = sorted(
            (
                r["request_id"],
                round(r["opened"], 3),
                r["cause"],
                round(r["free_gpus"], 6),
                int(r["fitting_nodes"]),
            )
            for r in rows
        )
        print(json.dumps({"seconds": secs, "peak_rss_mb": peak_rss_mb(), "rss_before_mb": before,
                          "incidents": len(rows), "causes": causes, "answer": answer}))  # fmt: skip
        return 0
    finally:
        store.close()


def _run(args: list[str], timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    return run_child("bench.starvation", args, timeout_s)


def _exponent(fig: dict[str, Any], key: str, a: int, b: int) -> float | None:
    """log(y_b / y_a) / log(b / a): 1 is linear, 2 quadratic."""
    ya, yb = fig.get(f"{key}_{a}"), fig.get(f"{key}_{b}")
    if not ya or not yb:
        return None
    return round(math.log(yb / ya) / math.log(b / a), 2)


def _size(n: int, a: argparse.Namespace, fig: dict[str, Any], work: Path) -> None:
    """Generate the fleet of size n, time the rule (and the old one where it can run)."""
    store = str(work / f"store-{n}")
    gen, why = _run(["--store", store, "--generate", str(n), "--seed", str(a.seed)], a.timeout_s)
    if gen is None:
        print(f"N = {n:,}: fleet not written ({why})")
        fig[f"error_{n}"] = f"generate: {why}"
        return
    print(f"N = {n:,} nodes x {n:,} requests: {gen['gpu_samples']:,} GPU sample rows, "
          f"{gen['sched_events']:,} scheduler events (written in {gen['generate_s']:.1f} s)")  # fmt: skip
    fig[f"generate_s_{n}"] = round(gen["generate_s"], 2)
    new, why = _run(["--store", store, "--query", "new"], a.timeout_s)
    if new is None:
        print(f"  starvation rule: {why}")
        fig[f"error_{n}"] = f"new: {why}"
    else:
        fig[f"seconds_{n}"] = round(new["seconds"], 3)
        fig[f"peak_rss_mb_{n}"] = round(new["peak_rss_mb"], 1)
        fig[f"incidents_{n}"] = new["incidents"]
        print(f"  starvation rule: {new['seconds']:.2f} s, peak RSS {new['peak_rss_mb']:.0f} MB "
              f"({new['rss_before_mb']:.0f} MB before the query); {new['incidents']:,} incidents "
              f"{new['causes']}")  # fmt: skip
    if a.split:
        snap, why = _run(["--store", store, "--query", "snapshot"], a.timeout_s)
        if snap is None:
            print(f"  its snapshot read alone: {why}")
        else:
            fig[f"snapshot_read_seconds_{n}"] = round(snap["seconds"], 3)
            fig[f"snapshot_rows_{n}"] = snap["snapshot_rows"]
            print(f"  its snapshot read alone (gpu_samples FINAL, heartbeats, sums per node and time): "
                  f"{snap['seconds']:.2f} s for {snap['snapshot_rows']:,} rows")  # fmt: skip
    if n in a.old_sizes:
        old, why = _run(["--store", store, "--query", "old"], a.old_timeout_s)
        if old is None:
            print(f"  the rule before (baseline): {why}")
            fig[f"old_seconds_{n}"] = None
            fig[f"old_note_{n}"] = why
        else:
            fig[f"old_seconds_{n}"] = round(old["seconds"], 3)
            fig[f"old_peak_rss_mb_{n}"] = round(old["peak_rss_mb"], 1)
            same = new is not None and new["answer"] == old["answer"]
            fig[f"same_answers_{n}"] = same
            ratio = f", new/old {new['seconds'] / old['seconds']:.4f}" if new else ""
            print(f"  the rule before (baseline): {old['seconds']:.2f} s, peak RSS {old['peak_rss_mb']:.0f} MB"
                  f"{ratio}; the same answers: {same}")  # fmt: skip
            if new:
                fig[f"ratio_new_vs_old_{n}"] = round(new["seconds"] / old["seconds"], 4)
    if not a.no_tier:
        _tier(n, a, fig, store, new)
    shutil.rmtree(store, ignore_errors=True)


def _tier(n: int, a: argparse.Namespace, fig: dict[str, Any], store: str, raw: dict[str, Any] | None) -> None:
    """The rule as the rules service runs it: one refresh of the rollups over the whole fleet's
    marks, then the rule over the starvation tier; its answers against the raw rows'."""
    ref, why = _run(["--store", store, "--refresh"], a.refresh_timeout_s)
    if ref is None:
        print(f"  rollup refresh: {why}")
        fig[f"error_tier_{n}"] = f"refresh: {why}"
        return
    data_minutes = (
        ref["node_minutes"] / n
    )  # the minutes of data a node has (the hour, and its samples' reach)
    fig[f"refresh_s_{n}"] = round(ref["seconds"], 2)
    fig[f"refresh_node_minutes_{n}"] = ref["node_minutes"]
    fig[f"refresh_s_per_data_minute_{n}"] = round(ref["seconds"] / data_minutes, 3)
    fig[f"refresh_peak_rss_mb_{n}"] = round(ref["peak_rss_mb"], 1)
    print(f"  rollup refresh of the whole hour (every tier, the starvation tier included): {ref['seconds']:.1f} s "
          f"for {ref['node_minutes']:,} node-minutes, {ref['seconds'] / data_minutes:.2f} s per minute of the "
          f"fleet's data (the service refreshes a minute at a time), peak RSS {ref['peak_rss_mb']:.0f} MB")  # fmt: skip
    tier, why = _run(["--store", store, "--query", "tier"], a.timeout_s)
    if tier is None:
        print(f"  starvation rule over the tier: {why}")
        fig[f"error_tier_{n}"] = f"tier: {why}"
        return
    same = raw is not None and tier["answer"] == raw["answer"]
    fig[f"tier_seconds_{n}"] = round(tier["seconds"], 3)
    fig[f"tier_peak_rss_mb_{n}"] = round(tier["peak_rss_mb"], 1)
    fig[f"tier_same_answers_{n}"] = same
    ratio = ""
    if raw is not None:
        fig[f"ratio_tier_vs_raw_{n}"] = round(tier["seconds"] / raw["seconds"], 4)
        ratio = f", tier/raw {tier['seconds'] / raw['seconds']:.4f}"
    print(f"  starvation rule over the tier (as the rules service runs it): {tier['seconds']:.2f} s, peak RSS "
          f"{tier['peak_rss_mb']:.0f} MB{ratio}; the same answers as over raw rows: {same}")  # fmt: skip


def _goal(fig: dict[str, Any], n: int = 50000) -> None:
    """Issue 16's goal at 50,000 x 50,000: under 10 s and 2 GB, over raw rows and over the tier."""
    for what, pre in (("over raw rows", ""), ("over the tier", "tier_")):
        secs, rss = fig.get(f"{pre}seconds_{n}"), fig.get(f"{pre}peak_rss_mb_{n}")
        if secs is None or rss is None:
            continue
        met = secs < 10 and rss < 2048
        fig[f"{pre}goal_met_{n}"] = met
        print(f"goal at {n:,} x {n:,} (under 10 s and 2 GB) {what}: {secs:.2f} s, {rss:.0f} MB: "
              f"{'met' if met else 'NOT met'}")  # fmt: skip


def _measure(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    fig: dict[str, Any] = {"bench": "starvation", "gpus_per_node": GPUS_PER_NODE, "interval_s": INTERVAL_S,
                           "window_s": HOUR_S, "sizes": a.sizes, "cpus": os.cpu_count(),
                           "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}  # fmt: skip
    for n in a.sizes:
        _size(n, a, fig, work)
    sizes = sorted(a.sizes)
    for x, y in itertools.pairwise(sizes):
        for key in ("seconds", "peak_rss_mb", "tier_seconds", "tier_peak_rss_mb"):
            fig[f"exponent_{key}_{x}_{y}"] = _exponent(fig, key, x, y)
    _goal(fig)
    fig["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return fig


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench starvation")
    ap.add_argument(
        "--sizes", type=_sizes, default=list(DEFAULT_SIZES), help="nodes = pending requests, comma-separated"
    )
    ap.add_argument(
        "--old-sizes", type=_sizes, default=list(OLD_SIZES), help="sizes at which to run the old SQL too"
    )
    ap.add_argument(
        "--timeout-s", type=float, default=240.0, help="bound on each generation and each run of the rule"
    )
    ap.add_argument("--old-timeout-s", type=float, default=60.0, help="bound on each run of the old SQL")
    ap.add_argument(
        "--refresh-timeout-s", type=float, default=900.0, help="bound on each size's rollup refresh"
    )
    ap.add_argument(
        "--no-tier", action="store_true", help="do not refresh the rollups nor time the rule over the tier"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--split", action="store_true", help="also time the snapshot read alone (where the time goes)"
    )
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--generate", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--query", choices=("new", "old", "snapshot", "tier"), help=argparse.SUPPRESS)
    ap.add_argument("--refresh", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.store:
        return _child(a)
    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-starvation-"))
    try:
        fig = _measure(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

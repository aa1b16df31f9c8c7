"""Whether the raw GPU samples still cover a window: the answers that need them (a bill, the
MIG advice, a job's report: each sample's GPU model, holders, peaks) refuse a window whose raw
rows are gone (past the store's retention, or deleted) while the minute rollups, which outlive
them, still hold its capacity, rather than answer over what is left as if it were the whole
(docs/operations.md#retention).

The check compares, per node, the capacity GPU-seconds of the window's whole minutes in
``gpu_rollup_1m`` with the raw rows' in the same minutes (each sample split over the minutes it
covers, rules.sql CAPACITY_SAMPLES: the very pieces the rollups sum): with every raw row there the
two are equal, node by node. Per node and over whole minutes only: the raw rows of the partial
minutes at the window's edges (up to two minutes of every GPU of the cluster) hid a node's, or a
GPU's, rows gone for hours when the clusters' totals were compared. The minutes a refresh has yet
to re-roll (marked since the last one: a late heartbeat draining a node, a sample replaced as
unhealthy) are not compared: their rollups hold what the raw rows said before, and a window all of
whose raw rows were there was refused as gone. Before the rollups are refreshed there is nothing
to compare, and a window of no whole minute is not compared (the rollups have no minute of it alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gpuslo.ingest.store import Store
from gpuslo.rules import rollup, sql


class RawRowsGone(ValueError):
    """The minute rollups hold capacity in the window that its raw rows no longer have."""


# the (node, minute)s whose rollups a refresh has yet to bring up to date: the gpu marks newer
# than the last refresh's cut (one written while it ran, before its cut, is not seen), and from a
# node's earliest newer heartbeat mark on (a heartbeat sets its node's state up to its next one)
_PENDING = """
SELECT cluster, key AS node, minute FROM rollup_dirty
WHERE kind = 'gpu' AND at > toDateTime64({wm:Float64}, 3, 'UTC')
  AND minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')
  AND ({cluster:String} = '' OR cluster = {cluster:String})
"""
_HEARTBEAT_PENDING = """
SELECT cluster, key AS node, toFloat64(min(minute)) AS since FROM rollup_dirty
WHERE kind = 'heartbeat' AND at > toDateTime64({wm:Float64}, 3, 'UTC')
  AND minute < toDateTime({to:Float64}, 'UTC')
  AND ({cluster:String} = '' OR cluster = {cluster:String})
GROUP BY cluster, key
"""


def _compared(rows: str) -> str:
    """SQL: ``rows`` (cluster, node, minute, capacity_s) of the whole minutes ``[from, to)`` that
    no pending mark reaches, summed per node."""
    return f"""
SELECT p.cluster AS cluster, p.node AS node, sum(p.capacity_s) AS capacity_s
FROM ({rows}) AS p
LEFT JOIN ({_HEARTBEAT_PENDING}) AS hb ON p.cluster = hb.cluster AND p.node = hb.node
WHERE (p.cluster, p.node, p.minute) NOT IN ({_PENDING})
  AND toFloat64(p.minute) < ifNull(hb.since, inf)
GROUP BY cluster, node
ORDER BY cluster, node
{sql.JOIN_SETTINGS}
"""


# the capacity per node the minute rollups hold in the window's whole minutes
_ROLLUP_CAPACITY = _compared("""
SELECT cluster, node, minute, capacity_s FROM gpu_rollup_1m FINAL
WHERE minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')
  AND ({cluster:String} = '' OR cluster = {cluster:String})
""")
# the capacity per node the raw rows give in the same minutes: each sample split over the minutes
# it covers, as the rollups split it (rules.rollup's pieces)
_RAW_PIECES = f"""
SELECT cluster, node, minute, {rollup.PIECE_CAP_S} AS capacity_s
FROM ({sql.CAPACITY_SAMPLES})
{rollup.PIECE_MINUTES}
WHERE minute >= toDateTime({{from:Float64}}, 'UTC') AND minute < toDateTime({{to:Float64}}, 'UTC')
"""
_RAW_CAPACITY = _compared(_RAW_PIECES)


def check(
    store: Store, frm: float, to: float, cluster: str, need: str, keep: Callable[[str], bool] = lambda c: True,
    gone: type[RawRowsGone] = RawRowsGone,
) -> None:  # fmt: skip
    """Raise ``gone`` (a :class:`RawRowsGone`) where, on a node of a cluster ``keep`` takes, the
    minute rollups hold more capacity in ``[frm, to)``'s whole minutes than its raw rows give (the
    minutes a refresh has yet to re-roll left out). ``need``: what the answer needs the raw rows
    for, said in the refusal."""
    lo, hi = math.ceil(frm / 60) * 60.0, math.floor(to / 60) * 60.0
    if lo >= hi:
        return
    p = {"from": lo, "to": hi, "cluster": cluster, "wm": rollup.watermark(store)}
    rolled = {
        (str(r["cluster"]), str(r["node"])): float(r["capacity_s"] or 0)
        for r in store.query(_ROLLUP_CAPACITY, p)
        if keep(str(r["cluster"]))
    }
    if not any(rolled.values()):
        return
    have = {
        (str(r["cluster"]), str(r["node"])): float(r["capacity_s"] or 0)
        for r in store.query(_RAW_CAPACITY, p)
    }
    short = [k for k, x in rolled.items() if x > have.get(k, 0.0) * (1 + 1e-9) + 1e-3]
    if not short:
        return
    c = short[0][0]
    nodes = [n for k, n in short if k == c]
    h = sum(have.get(k, 0.0) for k in rolled if k[0] == c)
    x = sum(v for k, v in rolled.items() if k[0] == c)
    raise gone(
        f"the raw GPU samples of part of the window are gone from the store in cluster {c!r} (node"
        f"{'s' if len(nodes) > 1 else ''} {', '.join(map(repr, nodes[:5]))}{' ...' if len(nodes) > 5 else ''}; "
        f"past its retention, or deleted): they give {h / 3600:.6f} GPU-h of capacity, the minute rollups "
        f"that outlive them {x / 3600:.6f}; {need}: choose a window the raw rows still cover"
    )

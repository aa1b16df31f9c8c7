"""Whether the raw GPU samples still cover a window: the answers that need them (a bill, the
MIG advice, a job's report: each sample's GPU model, holders, peaks) refuse a window whose raw
rows are gone (past the store's retention, or deleted) while the minute rollups, which outlive
them, still hold its capacity, rather than answer over what is left as if it were the whole
(docs/operations.md#retention).

The check compares, per cluster, the capacity GPU-seconds of the window's whole minutes in
``gpu_rollup_1m`` with the raw rows' over the whole window (rules.sql CAPACITY_SAMPLES, the same
term the rollups sum): with every raw row there, the rollups' whole minutes are part of the
window, never more. Before the rollups are refreshed there is nothing to compare, and a window
of no whole minute is not compared (the rollups have no minute of it alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from gpuslo.ingest.store import Store
from gpuslo.rules import sql


class RawRowsGone(ValueError):
    """The minute rollups hold capacity in the window that its raw rows no longer have."""


# the capacity per cluster the minute rollups hold in the window's whole minutes
_ROLLUP_CAPACITY = """
SELECT cluster, sum(capacity_s) AS capacity_s FROM gpu_rollup_1m FINAL
WHERE minute >= toDateTime({from:Float64}, 'UTC') AND minute < toDateTime({to:Float64}, 'UTC')
  AND ({cluster:String} = '' OR cluster = {cluster:String})
GROUP BY cluster
HAVING capacity_s > 0
ORDER BY cluster
"""
# the capacity per cluster the raw rows give over the window (the rollups' own term)
RAW_CAPACITY = f"""
SELECT cluster, sum(cap_s) AS capacity_s FROM ({sql.CAPACITY_SAMPLES})
GROUP BY cluster
{sql.JOIN_SETTINGS}
"""


def raw_capacity(store: Store, frm: float, to: float, cluster: str = "") -> dict[str, float]:
    """The raw rows' capacity GPU-seconds in ``[frm, to)`` per cluster (every one, or ``cluster``)."""
    rows = store.query(RAW_CAPACITY, {"from": float(frm), "to": float(to), "cluster": cluster})
    return {str(r["cluster"]): float(r["capacity_s"] or 0) for r in rows}


def check(
    store: Store, frm: float, to: float, cluster: str, need: str,
    raw: Mapping[str, float] | None = None, keep: Callable[[str], bool] = lambda c: True,
    gone: type[RawRowsGone] = RawRowsGone,
) -> None:  # fmt: skip
    """Raise ``gone`` (a :class:`RawRowsGone`) where, in a cluster ``keep`` takes, the minute
    rollups hold more capacity in ``[frm, to)``'s whole minutes than its raw rows give. ``raw``:
    the raw rows' capacity per cluster where the caller has it already (else queried); ``need``:
    what the answer needs the raw rows for, said in the refusal."""
    lo, hi = math.ceil(frm / 60) * 60.0, math.floor(to / 60) * 60.0
    if lo >= hi:
        return
    rolled = [
        (str(r["cluster"]), float(r["capacity_s"] or 0))
        for r in store.query(_ROLLUP_CAPACITY, {"from": lo, "to": hi, "cluster": cluster})
    ]
    rolled = [(c, x) for c, x in rolled if keep(c)]
    if not rolled:
        return
    have = raw_capacity(store, frm, to, cluster) if raw is None else raw
    for c, x in rolled:
        h = have.get(c, 0.0)
        if x > h * (1 + 1e-9) + 1e-3:
            raise gone(
                f"the raw GPU samples of part of the window are gone from the store in cluster {c!r} "
                f"(past its retention, or deleted): they give {h / 3600:.6f} GPU-h of capacity, the "
                f"minute rollups that outlive them {x / 3600:.6f}; {need}: choose a window the raw "
                "rows still cover"
            )

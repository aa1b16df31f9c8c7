"""Evaluate the four numbers for a window, on any store."""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import numpy as np

from gpuslo.ingest.store import Failure, Store, StoreError
from gpuslo.rules import sql
from gpuslo.rules.config import BurnWindow, Match, RulesConfig, Slo, row_hold_s
from gpuslo.rules.model import (
    CAUSES,
    Cause,
    FairShare,
    IdleHolder,
    Incident,
    PoolSummary,
    SeverityMinutes,
    SloAlert,
    SloHeldBack,
    SloStatus,
    Summary,
    Window,
)
from gpuslo.rules.rollup import hour_split, hourly_built, steps_built, threshold_index, usable
from gpuslo.wire import MAX_INTERVAL_S

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuSeconds:
    """The capacity, allocated, active and idle GPU-seconds of some part of the fleet."""

    capacity_s: float
    allocated_s: float
    active_s: float
    idle_allocated_s: float
    idle_unallocated_s: float

    @property
    def cur_allocation(self) -> float | None:
        return self.allocated_s / self.capacity_s if self.capacity_s > 0 else None

    @property
    def cur_active(self) -> float | None:
        return self.active_s / self.capacity_s if self.capacity_s > 0 else None

    def __add__(self, o: GpuSeconds) -> GpuSeconds:
        return GpuSeconds(
            self.capacity_s + o.capacity_s,
            self.allocated_s + o.allocated_s,
            self.active_s + o.active_s,
            self.idle_allocated_s + o.idle_allocated_s,
            self.idle_unallocated_s + o.idle_unallocated_s,
        )


NONE = GpuSeconds(0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class Utilization(GpuSeconds):
    """One (cluster, pool) group. ``pool`` is the pool the nodes sent; ``''`` is the group of
    nodes that name none, a group like any other (never a total: see :func:`cluster_totals`)."""

    cluster: str = ""
    pool: str = ""


def cluster_totals(groups: Sequence[Utilization]) -> dict[str, GpuSeconds]:
    """Per cluster, the sum of its groups (GPU-seconds add up: a node serves one pool here)."""
    out: dict[str, GpuSeconds] = {}
    for u in groups:
        out[u.cluster] = out.get(u.cluster, NONE) + u
    return dict(sorted(out.items()))


def _p(frm: float, to: float, cluster: str, **kw: Any) -> dict[str, Any]:
    return {"from": float(frm), "to": float(to), "cluster": cluster, **kw}


def _split(frm: float, to: float) -> dict[str, float]:
    h0, h1 = hour_split(frm, to)
    return {"h0": h0, "h1": h1}


def utilization(
    store: Store, frm: float, to: float, idle_threshold: float, cluster: str = "", rollup: bool = False,
    min_idle_s: float = 0.0, hourly: bool = False,
) -> list[Utilization]:  # fmt: skip
    """One row per (cluster, pool) group; :func:`cluster_totals` sums them per cluster. Over the
    rollups, ``hourly``: the whole hours from the hourly tier (built: :func:`rollup.hourly_built`)."""
    if rollup and hourly:
        p = _p(frm, to, cluster, ti=threshold_index(idle_threshold), **_split(frm, to))
        rows = store.query(sql.UTILIZATION_TIERED, p)
    elif rollup:
        rows = store.query(sql.UTILIZATION_ROLLUP, _p(frm, to, cluster, ti=threshold_index(idle_threshold)))
    elif min_idle_s > 0:
        rows = store.query(
            sql.UTILIZATION_MIN_IDLE, _p(frm, to, cluster, idle=idle_threshold, min_idle=min_idle_s)
        )
    else:
        rows = store.query(sql.UTILIZATION, _p(frm, to, cluster, idle=idle_threshold))
    return [
        Utilization(
            capacity_s=float(r["capacity_s"] or 0),
            allocated_s=float(r["allocated_s"] or 0),
            active_s=float(r["active_s"] or 0),
            idle_allocated_s=float(r["idle_allocated_s"] or 0),
            idle_unallocated_s=float(r["idle_unallocated_s"] or 0),
            cluster=str(r["cluster"]),
            pool=str(r["pool"]),
        )
        for r in rows
    ]


ALL = Match()  # matches everything


def _matched(match: Match) -> dict[str, list[str]]:
    """The holder-side matchers as the ``{match_<label>:Array(String)}`` parameters of rules.sql."""
    return {
        "match_cluster": list(match.cluster),
        "match_queue": list(match.queue),
        "match_account": list(match.account),
    }


def idle_by_owner(
    store: Store, frm: float, to: float, idle_threshold: float, cluster: str = "", limit: int = 10,
    rollup: bool = False, min_idle_s: float = 0.0, match: Match = ALL, hourly: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """The ``limit`` holders with the most allocated-idle GPU-seconds among those ``match``
    allows (narrowed before the limit: a filtered view is never short of matching holders)."""
    p = _p(frm, to, cluster, limit=limit, **_matched(match))
    if rollup and hourly:
        q = sql.IDLE_BY_OWNER_TIERED
        return store.query(q, {**p, **_split(frm, to), "ti": threshold_index(idle_threshold)})
    if rollup:
        return store.query(sql.IDLE_BY_OWNER_ROLLUP, {**p, "ti": threshold_index(idle_threshold)})
    if min_idle_s > 0:
        return store.query(
            sql.IDLE_BY_OWNER_MATCHED_MIN_IDLE, {**p, "idle": idle_threshold, "min_idle": min_idle_s}
        )
    return store.query(sql.IDLE_BY_OWNER_MATCHED, {**p, "idle": idle_threshold})


def fair_share(
    store: Store, frm: float, to: float, cluster: str = "", rollup: bool = False, match: Match = ALL,
    hourly: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per account: share of allocated GPU-hours vs share of GPUs requested in the window. Both
    sides count only what ``match`` allows (holders and submissions by cluster, queue and
    account), so the shares are of the matched set and add up to 1 over the rows."""
    if rollup and hourly:
        return store.query(sql.FAIR_SHARE_TIERED, _p(frm, to, cluster, **_matched(match), **_split(frm, to)))
    q = sql.FAIR_SHARE_ROLLUP if rollup else sql.FAIR_SHARE_MATCHED
    return store.query(q, _p(frm, to, cluster, **_matched(match)))


def starvation(
    store: Store, frm: float, to: float, cfg: RulesConfig, cluster: str = "", rollup: bool = False,
    sweep: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Starvation incidents of [frm, to). Over the rollups: the starvation tier once built, else
    the sweep over the minute tier's candidates (``sweep``: that sweep in any case, the
    benchmark's baseline)."""
    return store.query(*_starvation_query(store, frm, to, cfg, cluster, rollup, sweep))


def _starvation_query(
    store: Store, frm: float, to: float, cfg: RulesConfig, cluster: str, rollup: bool, sweep: bool = False
) -> tuple[str, dict[str, Any]]:
    """The SQL and parameters of :func:`starvation`."""
    st = cfg.starvation
    queues = sorted(st.queue_threshold_s)
    params = _p(
        frm,
        to,
        cluster,
        thr_queues=queues,
        thr_values=[st.queue_threshold_s[q] for q in queues],
        thr_default=st.threshold_s,
        thr_max=max([st.threshold_s, *st.queue_threshold_s.values()]),
    )
    if not rollup:
        q = sql.STARVATION
    else:  # over rollups: the starvation tier once built, else the sweep over the minute tier's candidates
        q = sql.STARVATION_ROLLUP if not sweep and steps_built(store) else sql.STARVATION_MINUTE_SWEEP
    return (sql.materialized(q) if materialized_ctes(store) else q), params


_MATERIALIZED: weakref.WeakKeyDictionary[Store, bool] = weakref.WeakKeyDictionary()


def materialized_ctes(store: Store) -> bool:
    """Whether the store's engine computes a CTE ``AS MATERIALIZED`` once (chDB 4, ClickHouse
    26; not chDB 2.1 or older servers, nor an engine refusing a query's change of the setting,
    which read the plain query): asked once per store."""
    try:
        got = _MATERIALIZED.get(store)
    except TypeError:  # a store no weak dictionary can key (unhashable: a dataclass's eq): asked each time
        return _probe_materialized(store)
    if got is None:
        got = _MATERIALIZED[store] = _probe_materialized(store)
    return got


def _probe_materialized(store: Store) -> bool:
    """:func:`materialized_ctes`' question, asked: the setting listed, and a query may set it."""
    rows = store.query("SELECT count() AS n FROM system.settings WHERE name = {s:String}",
                       {"s": sql.MATERIALIZED_CTE})  # fmt: skip
    if int(rows[0]["n"]) == 0:
        return False
    try:
        store.query(sql.MATERIALIZED_CTE_TRIAL)
    except StoreError as exc:
        if exc.failure is Failure.TRANSIENT:  # not cached: asked again next time
            raise
        return False
    return True


_INCIDENT_COLUMNS = ("request_id", "cluster", "scheduler", "queue", "user", "account", "gpus_per_node", "nodes",
                     "opened", "closed", "closed_by", "submitted", "free_gpus", "cause", "reason")  # fmt: skip


def _gpus(per_node: float, nodes: int) -> float:
    """A request's GPUs, ``per_node`` × ``nodes`` (:func:`whole_gpus`)."""
    return whole_gpus(per_node * nodes)


def whole_gpus(total: float) -> float:
    """A request's GPUs as the store's 32-bit ``gpus_per_node`` × ``nodes`` give them: the whole
    number they are within Float32's rounding (a Slurm ``--gpus=10 -N 3`` is 10/3 per node,
    stored as 3.3333333, whose product is 9.99999976), else ``total`` (a fractional share)."""
    whole = round(total)
    return float(whole) if abs(total - whole) <= FLOAT32_EPS * max(1.0, abs(total)) else total


# Float32's relative rounding, 2^-23 (a column of shares and requests per node is 32-bit)
FLOAT32_EPS = 2.0**-23


def incidents(
    store: Store, frm: float, to: float, cfg: RulesConfig, cluster: str = "", rollup: bool = False
) -> list[Incident]:
    """The summary's incidents of [frm, to): :func:`starvation`'s rows that ``cfg.match`` keeps, as
    :func:`_incident` makes them, built from the query's columns (a month of a big fleet's queue
    is 100,000 rows: no dict per row, the match decided once per distinct value)."""
    m = cfg.match
    c = store.query_columns(*_starvation_query(store, frm, to, cfg, cluster, rollup), names=_INCIDENT_COLUMNS)
    rid, cl, sch, queue, user, acct, gpn, nodes, opened, closed, closed_by, submitted, free, cause, reason = (
        c.get(k, []) for k in _INCIDENT_COLUMNS
    )
    n = len(rid)
    if any(len(col) != n for col in (cl, sch, queue, user, acct, gpn, nodes, opened, closed, closed_by,
                                      submitted, free, cause, reason)):  # fmt: skip
        raise ValueError(f"the starvation query's columns differ in length (request_id: {n})")
    out = list(map(
        Incident, rid, cl, sch, queue, user, acct, [_gpus(g, k) for g, k in zip(gpn, nodes, strict=True)], nodes, opened, closed,
        [x or None for x in closed_by],
        [_round((x if x is not None else to) - s, 3) for x, s in zip(closed, submitted, strict=True)],
        [_round(f, 3) for f in free], cause, [x or None for x in reason],
    ))  # fmt: skip
    if not (m.cluster or m.queue or m.account):
        return out
    oc = {v: m.ok("cluster", v) for v in set(cl)}
    oq = {v: m.request_ok(*v) for v in set(zip(queue, sch, acct, strict=True))}
    oa = {v: m.ok("account", v) for v in set(acct)}
    return [i for i in out if oc[i.cluster] and oq[i.queue, i.scheduler, i.account] and oa[i.account]]


def pending_age(store: Store, to: float, cluster: str = "") -> list[dict[str, Any]]:
    return store.query(sql.PENDING_AGE, {"to": float(to), "cluster": cluster})


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """Prometheus' estimate: linear interpolation inside the bucket holding the rank."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    cum = 0
    for i, c in enumerate(counts):
        if cum + c >= rank and c > 0:
            if i >= len(bounds):  # +Inf bucket: the highest finite bound is all we know
                return float(bounds[-1])
            lo = 0.0 if i == 0 else bounds[i - 1]
            return lo + (bounds[i] - lo) * (rank - cum) / c
        cum += c
    return float(bounds[-1])


def _burn(good: float, total: float, objective: float) -> float:
    return (1.0 - good / total) / (1.0 - objective) if total > 0 else 0.0


def slo_status(
    store: Store, slo: Slo, frm: float, to: float, step_s: int = 60, rollup: bool = False
) -> SloStatus:
    base = {"service": slo.service, "cluster": slo.cluster, "threshold": float(slo.threshold_ms)}
    totals = sql.SLO_WINDOW_TOTALS_ROLLUP if rollup else sql.SLO_WINDOW_TOTALS
    win = store.query(totals, {**base, "from": float(frm), "to": float(to)})[0]
    period = store.query(totals, {**base, "from": float(to - slo.period_d * 86400), "to": float(to)})[0]
    # every row the numbers read must have the threshold as a bound: the period's, and the burn
    # windows' of the window's first steps, which reach further back when the window is longer
    # than the period less the longest burn window (a --from a day before a 1-day period's start)
    lookback = max(max(w.long_s, w.short_s) for w in slo.windows)
    read_from = min(float(frm) - lookback, float(to - slo.period_d * 86400))
    checked = period
    if read_from < float(to - slo.period_d * 86400):
        checked = store.query(totals, {**base, "from": read_from, "to": float(to)})[0]
    status = SloStatus(
        slo=slo.name,
        service=slo.service,
        objective=slo.objective,
        threshold_ms=slo.threshold_ms,
        total=int(win["total"] or 0),
        good=int(win["good"] or 0),
        sli=None,
        burn=None,
        budget_remaining=None,
        p99_ms=None,
    )
    # when the service's rows stopped: the latest in the period, else the latest before it (a
    # service silent longer than its period was evaluable again, its page and ticket resolved);
    # over the rollups a row's time is the end of its minute (``minute_end``), which the burn
    # windows read too (one more minute said no data a minute after the window emptied)
    seen = period
    if not int(period["rows"] or 0):
        last_row = sql.SLO_LAST_ROW_ROLLUP if rollup else sql.SLO_LAST_ROW
        seen = store.query(last_row, {**base, "to": float(to - slo.period_d * 86400)})[0]
    if int(seen["rows"] or 0):
        last = float(seen["last"])
        # at stale_after_s (the shortest window) that window, (to - W, to], holds none of its rows;
        # a row of a longer interval stands until twice its interval has passed (its next one
        # missed): a row of 10 min was late 5 min after it came (the ticket fired, and resolved at
        # the next row). Each source's latest row stands on its own (one pod's agent scraping every
        # 10 s, another's every 10 min: the service is judged on the one every 10 s)
        iv, stale = _standing(store, slo, base, float(to), last, rollup)
        # said as the end of its minute whatever the source, so raw rows and rollups say the same
        # (from a whole-minute ``to``, as the rules run evaluates, they also judge alike: to - W
        # is a whole minute, at or past a time exactly when at or past the end of its minute)
        shown = math.ceil(last / 60.0) * 60.0
        unjudged = tuple(f"{w.long}/{w.short}" for w in slo.unjudged_windows(iv))
        status = replace(status, last_data_at=shown, no_data_since=shown if stale else None,
                         data_interval_s=iv, no_data_after_s=slo.stale_bound_s(iv),
                         unjudged_windows=unjudged)  # fmt: skip
    else:  # never a row: a misspelt name, or a service never instrumented, once agents report
        since = float(to - slo.period_d * 86400)
        heard = store.query(sql.AGENTS_REPORTED, {"cluster": slo.cluster, "from": since,
                                                  "to": float(to) - slo.stale_after_s})[0]  # fmt: skip
        status = replace(status, never_seen=bool(int(heard["rows"] or 0)), no_data_after_s=slo.stale_after_s)
    if int(checked["mismatched"] or 0):
        return replace(
            status,
            good=0,
            error=(
                f"threshold_ms {slo.threshold_ms:g} is not a bucket bound in {checked['mismatched']} histogram "
                f"rows of service {slo.service!r} (bounds without it: {checked['mismatched_bounds']}); SLO not evaluated"
            ),
        )
    if status.total:
        status = replace(
            status,
            sli=status.good / status.total,
            burn=_burn(status.good, status.total, slo.objective),
        )
        if int(win["bound_sets"]) == 1:
            status = replace(
                status, p99_ms=histogram_quantile(0.99, win["bucket_bounds"], win["bucket_counts"])
            )
    ptotal = int(period["total"] or 0)
    if ptotal:
        bad = ptotal - int(period["good"] or 0)
        status = replace(status, budget_remaining=1.0 - bad / (ptotal * (1.0 - slo.objective)))
    # the steps as columns (43,200 rows a window pair over 30 days: no dict per row)
    q, params = _slo_steps_query(slo, frm, to, step_s, rollup)
    pairs = _pairs_of(slo, _arrays(store.query_columns(q, params)))
    alerts, held = evaluate_steps(slo, (), step_s, pairs)
    return replace(
        status,
        alerts=tuple(alerts),
        held_back=tuple(held),
        minutes=MappingProxyType(minutes_by_severity(slo, (), step_s, pairs)),
    )


def _standing(
    store: Store, slo: Slo, base: dict[str, Any], to: float, last: float, rollup: bool
) -> tuple[float | None, bool]:
    """The interval the SLO is judged by at ``to`` (None: not known) and whether it is not
    evaluable for want of rows (``last``: the service's latest row). Of the service's sources
    whose latest row still stands for it (younger than :meth:`Slo.stale_bound_s` of its interval),
    the shortest bound's interval; with none standing, no data, and the latest row's interval.
    Over the rollups a row's time is the end of its minute, as their rows say it. Where the raw
    rows are no longer kept, ``no_data_s`` alone, from ``last``."""
    reach = float(max(slo.stale_after_s, row_hold_s(MAX_INTERVAL_S)) + 60)
    rows = store.query(sql.SLO_SOURCES, {**base, "to": to, "reach": reach})
    if not rows:
        return None, to - last >= slo.stale_after_s
    sources = [(math.ceil(float(r["last"]) / 60.0) * 60.0 if rollup else float(r["last"]), float(r["interval_s"]))
               for r in rows]  # fmt: skip
    standing = [(slo.stale_bound_s(iv), iv) for t, iv in sources if to - t < slo.stale_bound_s(iv)]
    if standing:
        return min(standing)[1], False
    return max(sources)[1], True


def slo_steps_query(slo: Slo, step_s: int = 60, rollup: bool = False) -> str:
    """SQL of :func:`slo_steps`: one good/total column pair per distinct window length."""
    lengths = sorted({w.long_s for w in slo.windows} | {w.short_s for w in slo.windows})
    return sql.slo_steps(lengths, step_s, rollup)


def slo_steps(
    store: Store, slo: Slo, frm: float, to: float, step_s: int = 60, rollup: bool = False
) -> list[dict[str, Any]]:
    """Good/total per burn window at every evaluation time in (from, to]."""
    return store.query(*_slo_steps_query(slo, frm, to, step_s, rollup))


def _slo_steps_query(
    slo: Slo, frm: float, to: float, step_s: int, rollup: bool
) -> tuple[str, dict[str, Any]]:
    """The SQL and parameters of :func:`slo_steps`."""
    lengths = sorted({w.long_s for w in slo.windows} | {w.short_s for w in slo.windows})
    q = slo_steps_query(slo, step_s, rollup)
    params = {
        "service": slo.service,
        "cluster": slo.cluster,
        "threshold": float(slo.threshold_ms),
        "from": float(frm),
        "to": float(to),
        "step": step_s,
        "lookback": float(max(lengths)),
    }
    return q, params


class _Steps(NamedTuple):
    """One window pair's steps as arrays (43,200 per pair over 30 days at 60 s): each step's time,
    whether both windows burn faster than the factor, the short window's requests, the burns."""

    t: np.ndarray[Any, Any]
    burning: np.ndarray[Any, Any]
    short_total: np.ndarray[Any, Any]
    bl: np.ndarray[Any, Any]
    bs: np.ndarray[Any, Any]


def _columns(steps: Sequence[dict[str, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    """The steps' columns as float arrays (a missing count is 0), each built once."""
    keys = list(steps[0]) if steps else []
    return _arrays({k: [r[k] for r in steps] for k in keys})


def _arrays(cols: dict[str, list[Any]]) -> dict[str, np.ndarray[Any, Any]]:
    """Step columns as float arrays (a missing count, NULL, is 0)."""
    return {k: np.array([0.0 if x is None else x for x in v], dtype=np.float64) for k, v in cols.items()}


def _burns(good: np.ndarray[Any, Any], total: np.ndarray[Any, Any], budget: float) -> np.ndarray[Any, Any]:
    """:func:`_burn` per step: the same float operations in the same order, so the same values."""
    ratio = np.divide(good, total, out=np.zeros_like(total), where=total > 0)
    out: np.ndarray[Any, Any] = np.where(total > 0, (1.0 - ratio) / budget, 0.0)
    return out


def _window_steps(slo: Slo, w: BurnWindow, cols: dict[str, np.ndarray[Any, Any]]) -> _Steps:
    """Each step's burn over the long and the short window (:func:`_burn`, over arrays)."""
    budget = 1.0 - slo.objective
    none = np.zeros(0)
    lw, sw = w.long_s, w.short_s
    short_total = cols.get(f"total_{sw}", none)
    gl, tl, gs = cols.get(f"good_{lw}", none), cols.get(f"total_{lw}", none), cols.get(f"good_{sw}", none)
    bl, bs = _burns(gl, tl, budget), _burns(gs, short_total, budget)
    burning = _above(slo, w, gl, tl, bl) & _above(slo, w, gs, short_total, bs)
    return _Steps(cols.get("t", none), burning, short_total, bl, bs)


# a burn this close to the factor (relative) is compared exactly (_above), and closer still
# where floating point loses more: its bound of the burn's rounding error (_near_factor)
_NEAR_FACTOR = 1e-9
_EPS = float(np.finfo(np.float64).eps)


def _near_factor(factor: float, budget: float) -> float:
    """How close to ``factor`` (relative) a burn computed in floating point over an error
    budget of ``budget`` may lie and yet be on the other side of it: besides a few roundings,
    1 − objective and 1 − good/total each lose their digits to cancellation, an error relative
    to themselves of about eps / (1 − objective) and eps / (factor × (1 − objective)) at a burn
    of the factor (at an objective of 0.999999999 some 2.5e-8: a burn of exactly 14.4 read as
    14.40000037747584, a page). Four times that bound, and never less than :data:`_NEAR_FACTOR`."""
    return _NEAR_FACTOR + 4 * _EPS * (4 + (1 + 1 / factor) / budget)


def _above(
    slo: Slo,
    w: BurnWindow,
    good: np.ndarray[Any, Any],
    total: np.ndarray[Any, Any],
    burns: np.ndarray[Any, Any],
) -> np.ndarray[Any, Any]:
    """Whether each step's burn is above the window's factor: ``burns > factor``, except where
    the burn is within floating-point error of it, where the counts are compared with the
    factor exactly (the objective and ``budget_percent`` as the decimals they were written as):
    bad / total > budget_percent / 100 × period / long × (1 − objective). In floating point a
    burn of exactly the factor was above it about one time in six (49 slow of 5,000 requests at
    99 % is a burn of 0.98, the 7 d ticket's factor, and read 0.9800000000000022: a ticket)."""
    factor = w.factor
    out: np.ndarray[Any, Any] = burns > factor
    band = _near_factor(factor, 1.0 - slo.objective) * factor
    near = np.flatnonzero((total > 0) & (np.abs(burns - factor) <= band))
    if near.size:
        limit = (
            Fraction(repr(w.budget_percent))
            * w.period_s
            / (100 * w.long_s)
            * (1 - Fraction(repr(slo.objective)))
        )
        for i in near.tolist():
            n = int(total[i])
            out[i] = Fraction(n - int(good[i]), n) > limit
    return out


_Pairs = dict[tuple[int, int, float], _Steps]


def _pair_steps(slo: Slo, steps: Sequence[dict[str, Any]]) -> _Pairs:
    """The steps of each of the SLO's window pairs, computed once for the alerts and the minutes."""
    return _pairs_of(slo, _columns(steps))


def _pairs_of(slo: Slo, cols: dict[str, np.ndarray[Any, Any]]) -> _Pairs:
    out: _Pairs = {}
    for w in slo.windows:
        key = (w.long_s, w.short_s, w.factor)
        if key not in out:
            out[key] = _window_steps(slo, w, cols)
    return out


def _runs(flags: Sequence[bool] | np.ndarray[Any, Any]) -> list[tuple[int, int]]:
    """[i, j) index ranges of consecutive true flags."""
    edges = np.diff(np.concatenate(([0], np.asarray(flags, dtype=np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def alerts_from_steps(slo: Slo, steps: Sequence[dict[str, Any]], step_s: int = 60) -> list[SloAlert]:
    """Multi-window multi-burn-rate: fire while both windows burn faster than the factor
    and the short window saw at least ``min_requests`` requests."""
    return evaluate_steps(slo, steps, step_s)[0]


def evaluate_steps(
    slo: Slo, steps: Sequence[dict[str, Any]], step_s: int = 60, pairs: _Pairs | None = None
) -> tuple[list[SloAlert], list[SloHeldBack]]:
    """The alerts, and the intervals the traffic guard held a burn condition back. Each step
    stands for the ``step_s`` before it: an alert firing for n steps fired n * step_s seconds."""
    alerts: list[SloAlert] = []
    held: list[SloHeldBack] = []
    pairs = _pair_steps(slo, steps) if pairs is None else pairs
    for w in slo.windows:
        st = pairs[(w.long_s, w.short_s, w.factor)]
        n = len(st.t)
        enough = st.short_total >= slo.min_requests
        for i, j in _runs(st.burning & enough):
            cur = {"started": float(st.t[i]), "bl": float(st.bl[i:j].max()), "bs": float(st.bs[i:j].max())}
            ended = float(st.t[j]) if j < n else None
            alerts.append(
                _alert(slo, w.severity, w.long, w.short, w.factor, cur, ended, (j - i) * step_s / 60)
            )
        for i, j in _runs(st.burning & ~enough):
            held.append(SloHeldBack(slo.name, slo.service, w.severity, w.long, w.short, w.factor, float(st.t[i]),
                                    float(st.t[j]) if j < n else None, (j - i) * step_s / 60, slo.min_requests,
                                    int(st.short_total[i:j].max())))  # fmt: skip
    alerts.sort(key=lambda a: (a.started, a.severity, a.long_window))
    held.sort(key=lambda a: (a.started, a.severity, a.long_window))
    return alerts, held


def minutes_by_severity(
    slo: Slo, steps: Sequence[dict[str, Any]], step_s: int = 60, pairs: _Pairs | None = None
) -> dict[str, SeverityMinutes]:
    """Per severity: the minutes in which any of its window pairs fired, and those in which one
    was held back by the traffic guard while none fired (each minute counted once)."""
    out: dict[str, SeverityMinutes] = {}
    by_pair = _pair_steps(slo, steps) if pairs is None else pairs
    for sev in sorted({w.severity for w in slo.windows}):
        pairs_of = [by_pair[(w.long_s, w.short_s, w.factor)] for w in slo.windows if w.severity == sev]
        # a step fires when one of the severity's pairs burns with enough requests; it is held
        # back when one burns and none fires
        n = len(pairs_of[0].t)  # every pair has a step per evaluation time
        burning = np.array([p.burning for p in pairs_of], dtype=bool).reshape(len(pairs_of), n)
        enough = np.array([p.short_total >= slo.min_requests for p in pairs_of], dtype=bool).reshape(
            burning.shape
        )
        fires = (burning & enough).any(axis=0)
        firing, held = int(fires.sum()), int((burning.any(axis=0) & ~fires).sum())
        out[sev] = SeverityMinutes(firing_minutes=firing * step_s / 60, held_back_minutes=held * step_s / 60)
    return out


def _alert(
    slo: Slo, sev: str, lw: str, sw: str, f: float, cur: dict[str, Any], ended: float | None, minutes: float
) -> SloAlert:
    return SloAlert(
        slo.name, slo.service, sev, lw, sw, f, cur["started"], ended, cur["bl"], cur["bs"], minutes
    )


def slo_alerts(
    store: Store, slo: Slo, frm: float, to: float, step_s: int = 60, rollup: bool = False
) -> list[SloAlert]:
    return alerts_from_steps(slo, slo_steps(store, slo, frm, to, step_s, rollup), step_s)


def _hours(s: float) -> float:
    return s / 3600.0


def _round(x: float | None, nd: int = 6) -> float | None:
    return None if x is None or math.isnan(x) else round(x, nd)


Source = Literal["raw", "rollup", "auto"]


def summary(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str = "", source: Source = "raw",
    hourly: bool = True, failed: dict[str, PartFailure] | None = None,
    traced: set[str] | None = None,
) -> Summary:  # fmt: skip
    """The four numbers for [from, to) (their JSON: :func:`gpuslo.rules.model.to_json`, as
    ``demo --json`` / ``rules eval --json`` print it).

    ``source``: the raw rows, the rollups (rules/rollup.py; refresh them first), or ``auto``: the
    rollups when the window and the config allow it (:func:`rollup.usable`). Over the rollups,
    the whole hours of the window come from the hourly tier once it is built (``hourly=False``:
    the minute tier alone, the same numbers); the starvation snapshots (the minutes of the
    openings) and the SLO's per-minute steps always come from the minute tier.

    ``failed``: given (the rules service's rounds), a part of the evaluation that fails (the
    utilization, the starvation incidents, one SLO, the idle holders, the fair share) is left
    out, its failure recorded there under the part's name (``slo:NAME`` for an SLO) and in the
    summary's ``errors``, and the other parts still evaluated: one query's failure (a memory
    limit met by one SLO's steps, a bug met by its data) never silences every other rule. A
    failed SLO is not evaluable (its ``error`` says why). What :func:`run_part` raises is
    raised (a fatal store error, a store that does not answer at all); without ``failed``
    every error is."""
    why_not = usable(cfg.idle_threshold, frm, to, cfg.eval_step_s, cfg.min_idle_s)
    if source == "rollup" and why_not:
        raise ValueError(f"cannot evaluate over the rollups: {why_not}")
    ru = source == "rollup" or (source == "auto" and why_not is None)
    hr = ru and hourly and hourly_built(store)
    m = cfg.match
    errors: dict[str, PartFailure] = {}

    def part(name: str, empty: Any, run: Callable[[], Any]) -> Any:
        return run_part(store, None if failed is None else errors, name, empty, run, traced)

    used = part("utilization", [], lambda: utilization(store, frm, to, cfg.idle_threshold, cluster, ru,
                                                         cfg.min_idle_s, hr))  # fmt: skip
    groups = [u for u in used if m.ok("cluster", u.cluster) and m.ok("pool", u.pool)]
    opened = part("starvation", [], lambda: incidents(store, frm, to, cfg, cluster, ru))

    def status(s: Slo) -> SloStatus:
        got = part(f"slo:{s.name}", None, lambda: slo_status(store, s, frm, to, cfg.eval_step_s, ru))
        return got if got is not None else _failed_slo(s, errors[f"slo:{s.name}"].error)

    slos = tuple(status(s) for s in cfg.slos)
    holders = part("top_idle", [], lambda: idle_by_owner(store, frm, to, cfg.idle_threshold, cluster, 10, ru,
                                                         cfg.min_idle_s, m, hr))  # fmt: skip
    shares = part("fair_share", [], lambda: fair_share(store, frm, to, cluster, ru, m, hr))
    window = Window(from_=frm, to=to, cluster=cluster or None, over="rollups" if ru else "raw rows")
    seen = part("scheduler_events_seen", True, lambda: bool(
        int(store.query(sql.SCHED_SEEN, {"cluster": cluster, "to": float(to)})[0]["rows"] or 0)
    ))  # fmt: skip
    out = _summary(
        window, cfg, groups, opened, slos, [_holder(r) for r in holders], [_share(r) for r in shares], seen,
    )  # fmt: skip
    if not errors:
        return out
    if failed is not None:  # (always: a part fails into errors only where failed was given)
        failed.update(errors)
    if "utilization" in errors:  # not measured: no data (None), never a fleet of 0 GPU-hours
        out = replace(out, capacity_gpu_hours=None, cur_allocation=None, cur_active=None,
                      idle_allocated_gpu_hours=None, idle_unallocated_gpu_hours=None,
                      idle_pct_of_capacity=None)  # fmt: skip
    return replace(out, errors=MappingProxyType({k: v.error for k, v in errors.items()}))


@dataclass(frozen=True, slots=True)
class PartFailure:
    """A part of a rules round that failed and was left out (:func:`run_part`)."""

    error: str  # its kind and first line, as the round's summary reports it
    transient: bool  # a transient store error: the round's connection is reopened after it


def run_part(
    store: Store, failed: dict[str, PartFailure] | None, name: str, empty: Any, run: Callable[[], Any],
    traced: set[str] | None = None,
) -> Any:  # fmt: skip
    """``run()``; where it fails and ``failed`` is given, the failure recorded there under
    ``name``, logged (a bug's traceback once per part and kind, with ``traced``), and ``empty``
    returned, so that the rest of the round goes on. Raised instead: any failure without
    ``failed``, a fatal store error (the deployment), and a transient one where the store does
    not answer a trivial query either (the connection or the server is gone: the whole round
    fails and the store is reopened, as before)."""
    if failed is None:
        return run()
    try:
        return run()
    except StoreError as exc:
        if exc.fatal or (exc.retriable and not _answers(store)):
            raise
        failure = PartFailure(f"StoreError: {_line(exc.reason)}", exc.retriable)
        log.warning("rules round: %s failed: %s (the rest of the round goes on)", name, failure.error)
    except Exception as exc:  # a bug met by this part's data: the other parts still run
        failure = PartFailure(f"{type(exc).__name__}: {_line(str(exc))}", False)
        kind = f"{name} {type(exc).__name__}"
        log.warning("rules round: %s failed: %s (the rest of the round goes on)", name, failure.error,
                    exc_info=traced is None or kind not in traced)  # fmt: skip
        if traced is not None:
            traced.add(kind)
    failed[name] = failure
    return empty


def _answers(store: Store) -> bool:
    try:
        store.query("SELECT 1 AS one")
    except StoreError:
        return False
    return True


def _line(text: str) -> str:
    return (text.splitlines() or [""])[0][:900]


def _failed_slo(slo: Slo, error: str) -> SloStatus:
    """The status of an SLO whose evaluation failed: not evaluable, saying why."""
    return SloStatus(slo=slo.name, service=slo.service, objective=slo.objective, threshold_ms=slo.threshold_ms,
                     total=0, good=0, sli=None, burn=None, budget_remaining=None, p99_ms=None,
                     error=f"its evaluation failed: {error}")  # fmt: skip


def _summary(
    window: Window, cfg: RulesConfig, groups: Sequence[Utilization], incidents: Sequence[Incident],
    slos: tuple[SloStatus, ...], top_idle: Sequence[IdleHolder], shares: Sequence[FairShare],
    scheduler_events_seen: bool = True,
) -> Summary:  # fmt: skip
    # the fleet: every matched group once (nodes without a pool included); listed per pool: the named ones
    fleet = sum(groups, NONE)
    cap, ia, iu = fleet.capacity_s, fleet.idle_allocated_s, fleet.idle_unallocated_s
    by_cause: dict[Cause, int] = dict.fromkeys(CAUSES, 0)
    for i in incidents:
        by_cause[i.cause] += 1
    return Summary(
        window=window,
        capacity_gpu_hours=_round(_hours(cap), 4),
        cur_allocation=_round(fleet.allocated_s / cap) if cap else None,
        cur_active=_round(fleet.active_s / cap) if cap else None,
        cur_target=cfg.cur_target,
        idle_allocated_gpu_hours=_round(_hours(ia), 4),
        idle_unallocated_gpu_hours=_round(_hours(iu), 4),
        idle_pct_of_capacity=_round(100.0 * (ia + iu) / cap, 3) if cap else None,
        pools=tuple(_pool(u) for u in groups if u.pool != ""),
        starvation_incidents=tuple(incidents),
        starvation_by_cause=MappingProxyType(by_cause),
        slo_alerts=tuple(a for s in slos for a in s.alerts),
        # per SLO and severity: minutes firing, and minutes a burn was held back by min_requests
        slo_minutes=MappingProxyType({s.slo: s.minutes for s in slos}),
        slo_held_back=tuple(a for s in slos for a in s.held_back),
        top_idle=tuple(top_idle),
        fair_share=tuple(shares),
        slos=slos,
        scheduler_events_seen=scheduler_events_seen or bool(incidents),
    )


def _pool(u: Utilization) -> PoolSummary:
    return PoolSummary(
        cluster=u.cluster,
        pool=u.pool,
        capacity_gpu_hours=_round(_hours(u.capacity_s), 4),
        cur_allocation=_round(u.cur_allocation),
        cur_active=_round(u.cur_active),
        idle_allocated_gpu_hours=_round(_hours(u.idle_allocated_s), 4),
        idle_unallocated_gpu_hours=_round(_hours(u.idle_unallocated_s), 4),
    )


def _incident(i: dict[str, Any], to: float) -> Incident:
    """One row of :func:`starvation` as the summary lists it."""
    return Incident(
        request_id=i["request_id"],
        cluster=i["cluster"],
        scheduler=i["scheduler"],
        queue=i["queue"],
        user=i["user"],
        account=i["account"],
        gpus=_gpus(i["gpus_per_node"], i["nodes"]),
        nodes=i["nodes"],
        opened=i["opened"],
        closed=i["closed"],
        closed_by=i["closed_by"] or None,
        wait_s=_round((i["closed"] if i["closed"] is not None else to) - i["submitted"], 3),
        free_gpus_at_open=_round(i["free_gpus"], 3),
        cause=i["cause"],
        reason=i["reason"] or None,
    )


def _holder(r: dict[str, Any]) -> IdleHolder:
    """One row of :func:`idle_by_owner`, its GPU-seconds in GPU-hours."""
    return IdleHolder(
        cluster=r["cluster"],
        id=r["id"],
        name=r["name"],
        user=r["user"],
        account=r["account"],
        queue=r["queue"],
        allocated_gpu_hours=_round(_hours(r["allocated_s"]), 4),
        idle_gpu_hours=_round(_hours(r["idle_s"]), 4),
    )


def _share(r: dict[str, Any]) -> FairShare:
    """One row of :func:`fair_share`."""
    return FairShare(
        account=r["account"],
        allocated_gpu_hours=_round(_hours(r["allocated_s"]), 4),
        share_allocated=_round(r["share_allocated"]),
        gpus_requested=r["gpus_requested"],
        share_requested=_round(r["share_requested"]),
    )

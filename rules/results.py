"""Evaluation results as rows of ``rule_results`` (one per rule, window, label set and
evaluation time), for dashboards and for anyone who wants the history of the numbers.

Re-evaluating the same time replaces its rows (the table is a ReplacingMergeTree on
(rule, window_s, cluster, pool, label, evaluated_at)); read it with FINAL.
"""

from __future__ import annotations

from typing import Any

from gpuslo.ingest.store import Store
from gpuslo.rules.model import PoolSummary, Summary

Row = tuple[str, str, str, str, float | None]


def _util(cluster: str, pool: str, u: Summary | PoolSummary) -> list[Row]:
    """The utilization numbers of the fleet or of one pool."""
    return [
        ("capacity_gpu_hours", cluster, pool, "", u.capacity_gpu_hours),
        ("cur_allocation", cluster, pool, "", u.cur_allocation),
        ("cur_active", cluster, pool, "", u.cur_active),
        ("idle_allocated_gpu_hours", cluster, pool, "", u.idle_allocated_gpu_hours),
        ("idle_unallocated_gpu_hours", cluster, pool, "", u.idle_unallocated_gpu_hours),
    ]


def rows(s: Summary, evaluated_at: float, window_s: float) -> list[Row]:
    """(rule, cluster, pool, label, value) for one summary."""
    fleet = s.window.cluster or ""
    out = _util(fleet, "", s)
    for p in s.pools:
        out += _util(p.cluster, p.pool, p)
    # no scheduler event yet, or the incidents' evaluation failed (``s.errors``): no data (None),
    # not 0 incidents (a dashboard read a round whose incidents' query failed as none open)
    seen = s.scheduler_events_seen and not ({"starvation", "scheduler_events_seen"} & s.errors.keys())
    for cause, n in s.starvation_by_cause.items():
        out.append(("starvation_incidents", fleet, "", f"cause={cause}", float(n) if seen else None))
    open_now = sum(1 for i in s.starvation_incidents if i.closed is None)
    out.append(("starvation_open", fleet, "", "", float(open_now) if seen else None))
    for slo in s.slos:
        label = f"slo={slo.slo}"
        out += [
            ("slo_sli", fleet, "", label, slo.sli),
            ("slo_burn", fleet, "", label, slo.burn),
            ("slo_budget_remaining", fleet, "", label, slo.budget_remaining),
            ("slo_p99_ms", fleet, "", label, slo.p99_ms),
        ]
    firing: dict[str, int] = {}
    for a in s.slo_alerts:
        if a.ended is None:
            key = f"slo={a.slo},severity={a.severity}"
            firing[key] = firing.get(key, 0) + 1
    for key, n in sorted(firing.items()):
        out.append(("slo_alerts_firing", fleet, "", key, float(n)))
    # minutes of the window each severity fired, and was held back by the traffic guard
    for name, per_sev in sorted(s.slo_minutes.items()):
        for sev, m in sorted(per_sev.items()):
            key = f"slo={name},severity={sev}"
            out.append(("slo_firing_minutes", fleet, "", key, float(m.firing_minutes)))
            out.append(("slo_held_back_minutes", fleet, "", key, float(m.held_back_minutes)))
    return out


def write(store: Store, s: Summary, evaluated_at: float, window_s: float) -> int:
    rs = rows(s, evaluated_at, window_s)
    cols: dict[str, list[Any]] = {
        "evaluated_at": [float(int(evaluated_at))] * len(rs),
        "window_s": [int(window_s)] * len(rs),
        "rule": [r[0] for r in rs],
        "cluster": [r[1] for r in rs],
        "pool": [r[2] for r in rs],
        "label": [r[3] for r in rs],
        "value": [None if r[4] is None else float(r[4]) for r in rs],
    }
    return store.insert("rule_results", cols)

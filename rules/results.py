"""Evaluation results as rows of ``rule_results`` (one per rule, window, label set and
evaluation time), for dashboards and for anyone who wants the history of the numbers.

Re-evaluating the same time replaces its rows (the table is a ReplacingMergeTree on
(rule, window_s, cluster, pool, label, evaluated_at)); read it with FINAL.
"""

from __future__ import annotations

from typing import Any

from gpuslo.ingest.store import Store

_UTIL = (
    "capacity_gpu_hours",
    "cur_allocation",
    "cur_active",
    "idle_allocated_gpu_hours",
    "idle_unallocated_gpu_hours",
)


def rows(
    s: dict[str, Any], evaluated_at: float, window_s: float
) -> list[tuple[str, str, str, str, float | None]]:
    """(rule, cluster, pool, label, value) for one summary."""
    out: list[tuple[str, str, str, str, float | None]] = []
    fleet = s["window"].get("cluster") or ""
    for k in _UTIL:
        out.append((k, fleet, "", "", s.get(k)))
    for p in s.get("pools", []):
        for k in _UTIL:
            out.append((k, p["cluster"], p["pool"], "", p.get(k)))
    for cause, n in s.get("starvation_by_cause", {}).items():
        out.append(("starvation_incidents", fleet, "", f"cause={cause}", float(n)))
    open_now = sum(1 for i in s.get("starvation_incidents", []) if i.get("closed") is None)
    out.append(("starvation_open", fleet, "", "", float(open_now)))
    for slo in s.get("slos", []):
        label = f"slo={slo['slo']}"
        for k in ("sli", "burn", "budget_remaining", "p99_ms"):
            out.append((f"slo_{k}", fleet, "", label, slo.get(k)))
    firing: dict[str, int] = {}
    for a in s.get("slo_alerts", []):
        if a.get("ended") is None:
            key = f"slo={a['slo']},severity={a['severity']}"
            firing[key] = firing.get(key, 0) + 1
    for key, n in sorted(firing.items()):
        out.append(("slo_alerts_firing", fleet, "", key, float(n)))
    # minutes of the window each severity fired, and was held back by the traffic guard
    for name, per_sev in sorted(s.get("slo_minutes", {}).items()):
        for sev, m in sorted(per_sev.items()):
            key = f"slo={name},severity={sev}"
            out.append(("slo_firing_minutes", fleet, "", key, float(m["firing_minutes"])))
            out.append(("slo_held_back_minutes", fleet, "", key, float(m["held_back_minutes"])))
    return out


def write(store: Store, s: dict[str, Any], evaluated_at: float, window_s: float) -> int:
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

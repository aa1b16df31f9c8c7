"""The simulator's own account of a run, under the keys of ``gpuslo demo --json``.

Nothing here reads what the agents emitted or the store: CUR and idle come from the
fleet's exact integration, incidents from its scheduler, SLO alerts from the request
counts the latency model drew, evaluated by a plain loop over the ticks.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuslo.agent.sim.fleet import Fleet


@dataclass(frozen=True, slots=True)
class WindowPair:
    severity: str
    long_label: str
    short_label: str
    long_s: int
    short_s: int
    factor: float


def slo_alerts(
    fleet: Fleet,
    threshold_ms: float,
    objective: float,
    windows: Sequence[WindowPair],
    min_requests: int,
    step_s: int = 60,
) -> list[dict[str, Any]]:
    cfg = fleet.cfg
    ticks = sorted(fleet.truth.latency_ticks)
    good_idx = [i for i, b in enumerate(cfg.bounds_ms) if b <= threshold_ms]
    ts = [t for t, _ in ticks]
    cum_total = [0]
    cum_good = [0]
    for _, counts in ticks:
        cum_total.append(cum_total[-1] + sum(counts))
        cum_good.append(cum_good[-1] + sum(counts[i] for i in good_idx))

    def window(t: float, w: int) -> tuple[int, int]:  # requests with ts in (t - w, t]
        lo = bisect.bisect_right(ts, t - w)
        hi = bisect.bisect_right(ts, t)
        return cum_good[hi] - cum_good[lo], cum_total[hi] - cum_total[lo]

    def burn(g: int, n: int) -> float:
        return (1 - g / n) / (1 - objective) if n else 0.0

    out: list[dict[str, Any]] = []
    first = int(cfg.start_ts // step_s + 1) * step_s
    times = range(first, int(cfg.end_ts) + 1, step_s)
    for w in windows:
        start: float | None = None
        for t in times:
            gl, nl = window(t, w.long_s)
            gs, ns = window(t, w.short_s)
            firing = burn(gl, nl) > w.factor and burn(gs, ns) > w.factor and ns >= min_requests
            if firing and start is None:
                start = t
            elif not firing and start is not None:
                out.append(_alert(w, start, t))
                start = None
        if start is not None:
            out.append(_alert(w, start, None))
    out.sort(key=lambda a: (a["started"], a["severity"], a["long_window"]))
    return out


def _alert(w: WindowPair, started: float, ended: float | None) -> dict[str, Any]:
    return {
        "severity": w.severity,
        "long_window": w.long_label,
        "short_window": w.short_label,
        "started": float(started),
        "ended": None if ended is None else float(ended),
    }


def summary(fleet: Fleet, slo_alerts_: list[dict[str, Any]]) -> dict[str, Any]:
    tr = fleet.truth
    cap = tr.capacity_s
    return {
        "capacity_gpu_hours": round(cap / 3600.0, 4),
        "cur_allocation": round(tr.allocated_s / cap, 6) if cap else None,
        "cur_active": round(tr.active_s / cap, 6) if cap else None,
        "idle_allocated_gpu_hours": round(tr.idle_allocated_s / 3600.0, 4),
        "idle_unallocated_gpu_hours": round(tr.idle_unallocated_s / 3600.0, 4),
        "starvation_incidents": [
            {"request_id": i.request_id, "opened": i.opened, "closed": i.closed, "cause": i.cause}
            for i in tr.incidents
        ],
        "slo_alerts": slo_alerts_,
        "jobs": len(fleet.jobs),
        "energy": energy(fleet),
    }


def _kwh(j: float) -> float:
    return round(j / 3.6e6, 6)


def energy(fleet: Fleet) -> dict[str, Any]:
    """The fleet's energy as the simulator integrated it (kWh), split as rules/energy.py splits
    it, and per account and user (each job's share of its GPUs' energy)."""
    tr = fleet.truth
    by: dict[str, dict[str, float]] = {"account": {}, "user": {}}
    for job_id, j in tr.energy_by_job_j.items():
        job = fleet.jobs[job_id]
        by["account"][job.account] = by["account"].get(job.account, 0.0) + j
        by["user"][job.user] = by["user"].get(job.user, 0.0) + j
    return {
        "energy_kwh": _kwh(tr.energy_j),
        "held_kwh": _kwh(tr.energy_held_j),
        "allocated_idle_kwh": _kwh(tr.energy_allocated_idle_j),
        "unallocated_kwh": _kwh(tr.energy_unallocated_j),
        "outside_capacity_kwh": _kwh(tr.energy_outside_capacity_j),
        "by_account_kwh": {k: _kwh(v) for k, v in sorted(by["account"].items())},
        "by_user_kwh": {k: _kwh(v) for k, v in sorted(by["user"].items())},
    }


def idle_holders(
    fleet: Fleet, threshold_for: Callable[[str], float], times: Sequence[float]
) -> dict[str, Any]:
    """At each of ``times``: the jobs running then, each with how long all its GPUs had been
    idle (since its start, or since the latest moment any of them was busy: a GPU shared with
    a busy job is busy), and those idle at least their queue's threshold: the holders the
    reclaim loop must notice at that time."""
    spans = fleet.truth.active_spans
    out = []
    for t in times:
        running: dict[str, float] = {}
        for j in fleet.jobs.values():
            if j.start is None or j.start > t or (j.end is not None and j.end <= t):
                continue
            busy = [min(b, t) for n, g, _ in j.placement for a, b in spans.get((n, g), []) if a < t]
            running[j.id] = round(t - max([j.start, *busy]), 3)
        idle = sorted(k for k, v in running.items() if v >= threshold_for(fleet.cfg.pool))
        gpus = {k: fleet.jobs[k].gpus for k in sorted(running)}
        out.append(
            {"at": float(t), "idle_holders": idle, "idle_s": dict(sorted(running.items())), "gpus": gpus}
        )
    return {"reclaim_rounds": out}

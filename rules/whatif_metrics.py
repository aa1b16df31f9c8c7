"""The numbers of a replay, one definition for the recorded schedule and for every policy
(docs/whatif.md): so a difference between them is never a difference of definitions.

- capacity: GPU-seconds of the nodes' spans inside the window;
- allocated: per node, at each moment, min(GPUs held, GPUs there) (allocation outside capacity
  does not count, docs/metrics.md), integrated over the window; its part per account is the
  held GPUs' share of it;
- allocation CUR = allocated / capacity; unallocated idle = capacity - allocated (nobody holds
  those GPUs: a replay knows no activity, and a GPU nobody holds is idle);
- waits of the requests submitted in the window: start - submit; a request not started by the
  window's end counts as waiting until then (a lower bound), so a policy that leaves more
  requests waiting cannot look better for it; one that left the queue without starting
  (cancelled while pending) until it left; percentiles by nearest rank;
- starvation incidents: those the replay opened in the window, by cause.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from gpuslo.rules.whatif_config import FairShare
from gpuslo.rules.whatif_model import Capacity, Outcome, Replay

CAUSES = ("capacity", "fragmentation", "policy")
PERCENTILES = (0.5, 0.95, 0.99)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least ``p`` of the values at or below it."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(p * len(v)) - 1)]


def capacity_s(cap: Capacity) -> float:
    return sum(max(0.0, min(b, cap.to) - max(a, cap.frm)) * g for n in cap.nodes for a, b, g in n.spans)


def allocated_s(rep: Replay) -> tuple[float, dict[str, float]]:
    """Allocated GPU-seconds in the window, in all and per account."""
    frm, to = rep.frm, rep.to
    events: dict[str, list[tuple[float, int, float, str]]] = defaultdict(list)
    for n in rep.capacity.nodes:
        for a, b, g in n.spans:
            a, b = max(a, frm), min(b, to)
            if b > a:
                events[n.name] += [(a, 0, g, ""), (b, 0, -g, "")]
    for o in rep.outcomes:
        g, acct = o.request.gpus_per_node, o.request.account
        for node, a, b in o.holdings:
            a, b = max(a, frm), min(b, to)
            if b > a and node in events:
                events[node] += [(a, 1, g, acct), (b, 1, -g, acct)]
    total = 0.0
    per: dict[str, float] = defaultdict(float)
    for evs in events.values():
        evs.sort(key=lambda e: e[0])
        cap = held = 0.0
        by: dict[str, float] = defaultdict(float)
        last = frm
        for t, kind, d, acct in evs:
            if t > last and held > 1e-12 and cap > 1e-12:
                alloc = min(held, cap) * (t - last)
                total += alloc
                for who, h in by.items():
                    if h > 1e-12:
                        per[who] += alloc * h / held
            last = t
            if kind == 0:
                cap += d
            else:
                held += d
                by[acct] += d
    return total, dict(per)


def _waited_until(o: Outcome, to: float) -> float:
    if o.start is not None:
        return o.start
    w = o.request.withdrawn
    return w if w is not None and w < to else to


def _waits(outcomes: list[Outcome], to: float) -> list[float]:
    return [_waited_until(o, to) - o.request.submit for o in outcomes]


def _pcts(values: list[float]) -> dict[str, float | None]:
    return {f"wait_p{round(p * 100)}_s": percentile(values, p) for p in PERCENTILES}


def summarise(rep: Replay, fairshare: FairShare) -> dict[str, Any]:
    frm, to = rep.frm, rep.to
    cap = capacity_s(rep.capacity)
    alloc, per_account = allocated_s(rep)
    submitted = [o for o in rep.outcomes if frm <= o.request.submit < to]
    waits = _waits(submitted, to)
    by_queue: dict[str, list[Outcome]] = defaultdict(list)
    for o in submitted:
        by_queue[o.request.queue].append(o)
    causes = dict.fromkeys(CAUSES, 0)
    for inc in rep.incidents:
        causes[inc.cause] = causes.get(inc.cause, 0) + 1
    return {
        "policy": rep.policy.name,
        "capacity_gpu_hours": cap / 3600,
        "allocated_gpu_hours": alloc / 3600,
        "cur_allocation": alloc / cap if cap > 0 else None,
        "idle_unallocated_gpu_hours": max(0.0, cap - alloc) / 3600,
        "requests": len(submitted),
        "started": sum(1 for o in submitted if o.start is not None),
        "not_started": sum(1 for o in submitted if o.start is None),
        "never_fit": len(rep.never_fit),
        **_pcts(waits),
        "queues": {
            q: {"requests": len(os_), **_pcts(_waits(os_, to))} for q, os_ in sorted(by_queue.items())
        },
        "starvation_incidents": len(rep.incidents),
        "starvation_by_cause": causes,
        "accounts": _accounts(rep, per_account, alloc, fairshare),
        "starts": [_start(o) for o in rep.outcomes],
    }


def _accounts(rep: Replay, per: dict[str, float], alloc: float, fs: FairShare) -> list[dict[str, Any]]:
    frm, to = rep.frm, rep.to
    requested: dict[str, float] = defaultdict(float)
    for o in rep.outcomes:
        if frm <= o.request.submit < to:
            requested[o.request.account] += o.request.gpus_per_node * o.request.nodes
    names = sorted(set(per) | set(requested) | {o.request.account for o in rep.outcomes})
    shares = {a: fs.shares.get(a, fs.default_share) for a in names}
    total_share = sum(shares.values()) or 1.0
    total_req = sum(requested.values())
    return [
        {
            "account": a,
            "gpu_hours": per.get(a, 0.0) / 3600,
            "share": per.get(a, 0.0) / alloc if alloc > 0 else None,
            "fair_share": shares[a] / total_share,
            "share_requested": requested.get(a, 0.0) / total_req if total_req > 0 else None,
        }
        for a in names
    ]


def _start(o: Outcome) -> dict[str, Any]:
    return {
        "request_id": o.request.request_id,
        "scheduler": o.request.scheduler,
        "submit": o.request.submit,
        "start": o.start,
        "wait_s": o.wait_s,
        "nodes": list(o.nodes),
        "carried": o.carried,
    }

"""What if: replay the recorded queue under another scheduling policy or more GPUs
(docs/whatif.md). ``load`` reads a window's requests and capacity from the store once;
``replay`` simulates one policy over them (pure Python, deterministic); ``compare`` gives the
recorded schedule and each policy's, measured by one code path (rules/whatif_metrics.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuslo.ingest.store import Store
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.whatif_engine import simulate
from gpuslo.rules.whatif_load import load_capacity, load_requests
from gpuslo.rules.whatif_metrics import summarise
from gpuslo.rules.whatif_model import (
    RECORDED,
    Capacity,
    Incident,
    Node,
    Outcome,
    Policy,
    PolicyError,
    Replay,
    Request,
    parse_policy,
)

__all__ = [
    "RECORDED",
    "Capacity",
    "Incident",
    "Node",
    "Outcome",
    "Policy",
    "PolicyError",
    "Replay",
    "Request",
    "Window",
    "brief",
    "compare",
    "load",
    "parse_policy",
    "replay",
]


@dataclass(frozen=True, slots=True)
class Window:
    requests: tuple[Request, ...]
    capacity: Capacity
    cluster: str


def load(store: Store, frm: float, to: float, cluster: str = "", config: RulesConfig | None = None) -> Window:
    """The requests submitted before ``to`` still pending or running at ``frm`` or submitted in
    ``[frm, to)``, and every node's capacity over the window. One cluster: without ``cluster``
    the window must hold one (a replay places requests on their own cluster's nodes)."""
    cfg = config or RulesConfig()
    cap = load_capacity(store, frm, to, cluster)
    reqs = load_requests(store, frm, to, cluster, cfg.whatif.lookback_s)
    clusters = sorted({r.cluster for r in reqs})
    if not cluster and len(clusters) > 1:
        raise PolicyError(
            f"the window holds requests of {len(clusters)} clusters ({', '.join(repr(c) for c in clusters[:5])}): name one with --cluster"
        )
    return Window(tuple(reqs), cap, cluster or (clusters[0] if clusters else ""))


def replay(
    requests: Sequence[Request], capacity: Capacity, policy: Policy, config: RulesConfig | None = None
) -> Replay:
    """``policy`` over ``requests`` on ``capacity`` (``RECORDED``: the recorded starts)."""
    cfg = config or RulesConfig()
    return simulate(requests, capacity, policy, cfg.whatif, cfg.starvation.threshold_for)


def compare(
    window: Window,
    policies: Sequence[Policy],
    config: RulesConfig | None = None,
    added: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The recorded schedule and each policy's, side by side (the ``--json`` object)."""
    cfg = config or RulesConfig()
    cap = window.capacity
    rec = replay(window.requests, cap, RECORDED, cfg)
    out: dict[str, Any] = {
        "from": cap.frm,
        "to": cap.to,
        "cluster": window.cluster,
        "nodes": len(cap.nodes),
        "recorded": summarise(rec, cfg.whatif.fairshare),
        "policies": [],
        "skipped_no_gpus": len(rec.skipped),
    }
    if added:
        out["added"] = added
        a_cap = cap.with_added(
            int(added["gpus"]), int(added["gpus_per_node"]), str(added.get("gpu_model", ""))
        )
    else:
        a_cap = cap
    for p in policies:
        out["policies"].append(summarise(replay(window.requests, a_cap, p, cfg), cfg.whatif.fairshare))
    return out


BRIEF_KEYS = ("cur_allocation", "idle_unallocated_gpu_hours", "wait_p50_s", "wait_p95_s", "wait_p99_s",
              "starvation_incidents", "starvation_by_cause", "requests", "started", "capacity_gpu_hours")  # fmt: skip


def brief(entry: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """An entry of :func:`compare` without its per-request and per-account detail (the what-if
    table of the demo and the report)."""
    return {"policy": name or entry["policy"], **{k: entry[k] for k in BRIEF_KEYS}}

"""``gpuslo whatif``: the recorded queue of a window replayed under other scheduling policies or
with more GPUs, side by side with what was recorded (rules/whatif.py, docs/whatif.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from gpuslo.app.argtypes import name_arg
from gpuslo.core.display import pct

EXIT_OK, EXIT_ERROR = 0, 2
# multi-node requests come from Slurm (a pod is one node), which allocates a job's nodes at once
DEFAULT_POLICIES = ("fifo+gang", "backfill+gang", "fairshare+gang")
MAX_ADD_GPUS = 100_000
MAX_ADD_NODES = 10_000  # --add-gpus / --gpus-per-node: a replay of a fleet far beyond this is not a what-if


def _hours(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return pct(x, none="-")


def _dur(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 120:
        return f"{x:.0f} s"
    if x < 7200:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.1f} h"


_ROWS: tuple[tuple[str, Any], ...] = (
    ("Allocation CUR", lambda e: _pct(e["cur_allocation"])),
    ("Capacity GPU-hours", lambda e: _hours(e["capacity_gpu_hours"])),
    ("Idle GPU-hours, unallocated", lambda e: _hours(e["idle_unallocated_gpu_hours"])),
    ("Requests submitted / started", lambda e: f"{e['requests']} / {e['started']}"),
    (
        "  started, run never recorded",
        lambda e: f"{e['assumed_run_requests']} ({_hours(e['assumed_run_gpu_hours'])} GPU-h)",
    ),
    ("Wait p50", lambda e: _dur(e["wait_p50_s"])),
    ("Wait p95", lambda e: _dur(e["wait_p95_s"])),
    ("Wait p99", lambda e: _dur(e["wait_p99_s"])),
    ("Starvation incidents", lambda e: str(e["starvation_incidents"])),
    ("  cause: capacity", lambda e: str(e["starvation_by_cause"].get("capacity", 0))),
    ("  cause: fragmentation", lambda e: str(e["starvation_by_cause"].get("fragmentation", 0))),
    ("  cause: policy", lambda e: str(e["starvation_by_cause"].get("policy", 0))),
)


def table(res: dict[str, Any]) -> str:
    """Recorded and each policy side by side; then the wait p99 per queue and the accounts'
    GPU-hour shares against their fair shares."""
    from gpuslo.app.text import cell
    from gpuslo.app.text import table as text_table

    entries = [res["recorded"], *res["policies"]]
    header = ["metric", *(e["policy"] for e in entries)]
    rows = [[label, *(f(e) for e in entries)] for label, f in _ROWS]
    queues = sorted({q for e in entries for q in e["queues"]})
    for q in queues:
        rows.append(
            [
                f"Wait p99, queue {q or '(none)'}",
                *(_dur(e["queues"].get(q, {}).get("wait_p99_s")) for e in entries),
            ]
        )
    accounts = sorted({a["account"] for e in entries for a in e["accounts"]})
    for a in accounts:
        cells = []
        for e in entries:
            row = next((x for x in e["accounts"] if x["account"] == a), None)
            cells.append("-" if row is None else f"{_pct(row['share'])} (fair {_pct(row['fair_share'])})")
        rows.append([f"GPU-hour share, account {a or '(none)'}", *cells])
    added = res.get("added")
    out = [text_table(rows, header)]
    if added:
        out.append(
            f"policies with {added['gpus']} more GPUs ({cell(added['gpu_model']) or 'model unnamed'}, "
            f"{added['gpus_per_node']} per node); the recorded column is the fleet as it was"
        )
    return "\n".join(out)


def _policies(texts: list[str]) -> list[Any]:
    from gpuslo.rules.whatif import parse_policy

    return [parse_policy(t) for t in texts or list(DEFAULT_POLICIES)]


def _added(a: argparse.Namespace) -> dict[str, Any] | None:
    from gpuslo.rules.whatif import PolicyError

    given = [a.add_gpus is not None, a.gpus_per_node is not None]
    if not any(given) and not a.gpu_model:
        return None
    # each value given is checked first: "-1" alone was told it needs --gpus-per-node
    if a.add_gpus is not None and not 1 <= a.add_gpus <= MAX_ADD_GPUS:
        raise PolicyError(f"--add-gpus must be in 1..{MAX_ADD_GPUS}")
    if a.gpus_per_node is not None and not 1 <= a.gpus_per_node <= 1024:
        raise PolicyError("--gpus-per-node must be in 1..1024 (a heartbeat's bound)")
    if not all(given):
        raise PolicyError("--add-gpus and --gpus-per-node go together (and --gpu-model names them)")
    if -(-a.add_gpus // a.gpus_per_node) > MAX_ADD_NODES:
        raise PolicyError(f"--add-gpus / --gpus-per-node would add more than {MAX_ADD_NODES} nodes")
    return {"gpus": a.add_gpus, "gpus_per_node": a.gpus_per_node, "gpu_model": a.gpu_model or ""}


def _json_safe(x: Any) -> Any:
    """``x`` with every NaN and infinity, at any depth (dicts, lists, tuples), as ``None``: JSON
    has no token for them (json.dumps would write NaN, which no JSON parser takes)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def cmd_whatif(a: argparse.Namespace) -> int:
    from gpuslo.app.cli import _on_window
    from gpuslo.app.text import terminal_safe
    from gpuslo.rules.whatif import PolicyError, compare, load

    try:
        policies = _policies(a.policy)
        added = _added(a)
    except PolicyError as exc:
        print(f"gpuslo whatif: {exc}", file=sys.stderr)
        return EXIT_ERROR

    def run(store: Any, cfg: Any) -> Any:
        return compare(load(store, a.frm, a.to, a.cluster, cfg), policies, cfg, added)

    rc, res = _on_window(a, "whatif", run)  # a PolicyError is a ValueError: one line, exit 2
    if rc != EXIT_OK:
        return int(rc)
    print(json.dumps(_json_safe(res), sort_keys=True) if a.json else terminal_safe(table(res)))
    return EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    from gpuslo.app.cli import _add_window_args

    p = sub.add_parser(
        "whatif",
        parents=[common],
        help="replay a window's queue under other scheduling policies or with more GPUs",
        description="Policies: fifo, first-fit, backfill, fairshare; +gang makes multi-node requests "
        "all-or-nothing; :pack (default), :spread or :first (name order) picks the nodes. E.g. --policy backfill+gang:spread. "
        "Default: fifo+gang, backfill+gang, fairshare+gang. docs/whatif.md has the exact rules.",
    )
    _add_window_args(p)
    p.add_argument("--policy", action="append", metavar="P", help="a policy to replay (repeatable)")
    p.add_argument("--add-gpus", type=int, metavar="N", help="replay the policies with N more GPUs")
    p.add_argument("--gpu-model", type=name_arg, metavar="M", help="the added GPUs' model (a label)")
    p.add_argument("--gpus-per-node", type=int, metavar="K", help="GPUs per added node")
    p.add_argument("--json", action="store_true", help="one JSON object: recorded and policies")
    p.set_defaults(func=cmd_whatif)


# ---------------------------------------------------------------------------- the demo's what-if
# the simulated fleet's own scheduler (agent/sim/fleet.py): first-fit in submit order, all of a
# job's nodes at once, nodes in index (name) order, with its per-user limit and reserve-after
FLEET_POLICY = "first-fit+gang:first"
DEMO_POLICIES = (
    FLEET_POLICY,
    "backfill+gang:first",
    "fairshare+gang:first",
)  # the fleet's node order: only the order differs
DEMO_ADD_GPUS = 8


def fleet_config(rules: Any, user_gpu_limit: float, reserve_after_s: float) -> Any:
    """The rules config with the simulated fleet's scheduler limits in ``whatif:`` (where the
    config sets none): its per-user GPU limit and its reserve-after (agent/sim/fleet.py)."""
    wi = rules.whatif
    limits = (
        wi.limits
        if wi.limits.user_gpus is not None
        else wi.limits.model_copy(update={"user_gpus": user_gpu_limit})
    )
    ff = wi.first_fit
    if ff.reserve_after_s is None:
        ff = ff.model_copy(update={"reserve_after_s": reserve_after_s})
    return rules.model_copy(update={"whatif": wi.model_copy(update={"limits": limits, "first_fit": ff})})


def demo_whatif(store: Any, frm: float, to: float, gpus_per_node: int, cfg: Any) -> dict[str, Any]:
    """The demo's what-if over its window: recorded, the fleet's own policy, back-fill, fair
    share, and the fleet's own policy with 8 more GPUs (``recorded`` and ``policies``, the
    ``gpuslo whatif --json`` keys, without the per-request starts)."""
    from gpuslo.rules.whatif import brief, compare, load, parse_policy

    w = load(store, frm, to, "", cfg)
    res = compare(w, [parse_policy(p) for p in DEMO_POLICIES], cfg)
    added = {"gpus": DEMO_ADD_GPUS, "gpus_per_node": gpus_per_node, "gpu_model": ""}
    more = compare(w, [parse_policy(FLEET_POLICY)], cfg, added)["policies"][0]
    pols = [brief(e, e["policy"]) for e in res["policies"]]
    pols.append({**brief(more, f"{more['policy']} +{DEMO_ADD_GPUS} GPUs"), "added": added})
    out: dict[str, Any] = _json_safe(
        {"from": frm, "to": to, "recorded": brief(res["recorded"], "recorded"), "policies": pols}
    )
    return out


def brief_rows(d: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The short what-if table: one row per entry (recorded first)."""
    header = ["what if", "CUR", "unalloc idle GPU-h", "wait p50", "wait p99", "starvation"]
    rows = []
    for e in [d["recorded"], *d["policies"]]:
        c = e["starvation_by_cause"]
        rows.append([
            e["policy"], _pct(e["cur_allocation"]), _hours(e["idle_unallocated_gpu_hours"]), _dur(e["wait_p50_s"]),
            _dur(e["wait_p99_s"]),
            f"{e['starvation_incidents']} ({c.get('capacity', 0)}/{c.get('fragmentation', 0)}/{c.get('policy', 0)})",
        ])  # fmt: skip
    return header, rows


def demo_text(d: dict[str, Any] | None) -> str:
    from gpuslo.app.text import table as text_table

    if not d:
        return "what if: not computed"
    header, rows = brief_rows(d)
    return "\n".join([
        f"What if (the recorded queue replayed; {FLEET_POLICY} is the fleet's own scheduler; "
        "starvation: capacity/fragmentation/policy; docs/whatif.md):",
        text_table(rows, header),
    ])  # fmt: skip

"""The what-if section of the HTML report (dashboards/report.py): the recorded queue of the
report's last 30 days (capped by its range) replayed under the default policies, side by side
with what was recorded (rules/whatif.py, docs/whatif.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from gpuslo.dashboards.pagetext import esc, pct
from gpuslo.ingest.store import Store, StoreError
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.whatif import PolicyError, brief, compare, load, parse_policy

log = logging.getLogger(__name__)

WINDOW_S = 30 * 86_400.0
# the CLI's default policies (gpuslo/app/whatif.py DEFAULT_POLICIES)
POLICIES = ("fifo+gang", "backfill+gang", "fairshare+gang")


def window(frm: float, to: float) -> tuple[float, float]:
    """The last 30 days of ``[frm, to)``, or all of it when shorter."""
    return max(frm, to - WINDOW_S), to


def compute(
    store: Store,
    cfg: RulesConfig,
    frm: float,
    to: float,
    cluster: str = "",
    policies: Sequence[str] = POLICIES,
) -> dict[str, Any]:
    """``recorded`` and ``policies`` (brief entries) over the window."""
    w = load(store, frm, to, cluster, cfg)
    res = compare(w, [parse_policy(p) for p in policies], cfg)
    return {
        "from": frm,
        "to": to,
        "recorded": brief(res["recorded"]),
        "policies": [brief(e) for e in res["policies"]],
    }


def _pct(x: float | None) -> str:
    return pct(x)


def _h(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def _min(x: float | None) -> str:
    return "–" if x is None else f"{x / 60:.1f}"


def _row(e: dict[str, Any]) -> str:
    c = e["starvation_by_cause"]
    cells = [
        _pct(e["cur_allocation"]),
        _h(e["idle_unallocated_gpu_hours"]),
        _min(e["wait_p50_s"]),
        _min(e["wait_p99_s"]),
        f"{e['starvation_incidents']} ({c.get('capacity', 0)} / {c.get('fragmentation', 0)} / {c.get('policy', 0)})",
    ]
    return f"<tr><td>{esc(e['policy'])}</td>" + "".join(f"<td>{esc(x)}</td>" for x in cells) + "</tr>"


def _t(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")


def section(
    store: Store,
    cfg: RulesConfig,
    frm: float,
    to: float,
    cluster: str = "",
    whatif: dict[str, Any] | None = None,
) -> str:
    """The section's HTML; ``whatif``: the entries when the caller has them already (the demo).
    A window the replay refuses (several clusters and none named) or a store failure gives one
    line saying why, not a broken report."""
    a, b = window(frm, to)
    if whatif is None:
        try:
            whatif = compute(store, cfg, a, b, cluster)
        except (PolicyError, StoreError) as exc:
            log.warning("report: what-if section left out: %s", exc)
            return f"<h2>What if</h2><p>Not computed: {esc(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}</p>"
    else:
        a, b = float(whatif["from"]), float(whatif["to"])
    head = f"<h2>What if: the recorded queue replayed, {_t(a)} → {_t(b)} UTC</h2>"
    rec = whatif["recorded"]
    if rec.get("requests") == 0 and not rec.get("capacity_gpu_hours", 1):  # a row of zeros read as a fleet
        return head + "<p>No GPU requests and no GPU capacity recorded in the window: nothing to replay.</p>"
    rows = "".join(_row(e) for e in [rec, *whatif["policies"]])
    return head + (
        "<p>Each policy replays the requests submitted in the window with the run times they had, on the "
        "recorded capacity (docs/whatif.md: what the replay assumes).</p>"
        "<table><tr><th>policy</th><th>allocation CUR</th><th>unallocated idle GPU-h</th><th>wait p50 (min)</th>"
        "<th>wait p99 (min)</th><th>starvation (capacity / fragmentation / policy)</th></tr>"
        f"{rows}</table>"
    )

"""Readable text for the terminal: the summary table of ``demo`` and ``rules eval``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def ts(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), line]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(x.rstrip() for x in out)


def held_back(s: dict[str, Any]) -> list[str]:
    """The burn conditions the traffic guard (min_requests) kept from alerting, and for how long."""
    held = s.get("slo_held_back", [])
    if not held:
        return []
    total = sum(h["minutes"] for h in held)
    out = ["", f"Held back by the traffic guard ({len(held)} intervals, {total:.0f} min; no alert fired):"]
    out.append(
        table(
            [
                [
                    h["slo"],
                    h["severity"],
                    f"{h['long_window']} & {h['short_window']}",
                    ts(h["started"]),
                    ts(h["ended"]) if h["ended"] else "ongoing",
                    _num(h["minutes"], 0),
                    f"{h['max_short_requests']} < {h['min_requests']}",
                ]
                for h in held
            ],
            ["slo", "severity", "windows", "from", "to", "minutes", "requests (short window) < min_requests"],
        )
    )
    return out


def summary(s: dict[str, Any]) -> str:
    gt = s.get("ground_truth")
    w = s["window"]
    parts = [
        f"gpuslo summary  {ts(w['from'])} → {ts(w['to'])} UTC  ({_num(s['capacity_gpu_hours'])} GPU-hours of capacity)",
        "",
    ]
    header = ["metric", "value", "target"] + (["simulator truth"] if gt else [])
    parts.append(table(_number_rows(s, gt) + _slo_rows(s, gt), header))
    parts.append("")
    parts += _alert_lines(s, gt)
    parts += held_back(s)
    for slo in s.get("slos", []):
        if slo["error"]:
            parts.append(f"SLO {slo['slo']}: {slo['error']}")
    return "\n".join(parts)


def _number_rows(s: dict[str, Any], gt: dict[str, Any] | None) -> list[list[str]]:
    """CUR, idle time and starvation incidents, beside the simulator's truth when there is one."""

    def row(name: str, key: str, fmt: Any, target: str = "") -> list[str]:
        r = [name, fmt(s.get(key)), target]
        if gt:
            r.append(fmt(gt.get(key)))
        return r

    rows = [
        row("Allocation CUR", "cur_allocation", _pct, f">= {_pct(s['cur_target'])}"),
        row("Active CUR", "cur_active", _pct),
        row("Idle GPU-hours, allocated (waste users can fix)", "idle_allocated_gpu_hours", _num),
        row("Idle GPU-hours, unallocated", "idle_unallocated_gpu_hours", _num),
    ]
    inc = s["starvation_incidents"]
    r = ["Starvation incidents", str(len(inc)), ""]
    if gt:
        r.append(str(len(gt["starvation_incidents"])))
    rows.append(r)
    for cause in ("capacity", "fragmentation", "policy"):
        r = [f"  cause: {cause}", str(sum(1 for i in inc if i["cause"] == cause)), ""]
        if gt:
            r.append(str(sum(1 for i in gt["starvation_incidents"] if i["cause"] == cause)))
        rows.append(r)
    return rows


def _slo_rows(s: dict[str, Any], gt: dict[str, Any] | None) -> list[list[str]]:
    rows = []
    for slo in s.get("slos", []):
        rows.append(
            [
                f"SLO {slo['slo']}: SLI (p99 <= {slo['threshold_ms']:g} ms)",
                "error: see below" if slo["error"] else _pct(slo["sli"]),
                f">= {_pct(slo['objective'])}",
            ]
            + ([""] if gt else [])
        )
        rows.append(
            ["  p99 latency (interpolated)", _num(slo["p99_ms"], 2) + " ms", ""] + ([""] if gt else [])
        )
        rows.append(
            [f"  error budget left ({slo['slo']})", _pct(slo["budget_remaining"]), ""] + ([""] if gt else [])
        )
    return rows


def _alert_lines(s: dict[str, Any], gt: dict[str, Any] | None) -> list[str]:
    """The SLO alerts that fired, and the minutes each severity fired."""
    parts = []
    alerts = s["slo_alerts"]
    if alerts:
        truth = f"; simulator truth: {len(gt['slo_alerts'])}" if gt else ""
        parts.append(f"SLO alerts that fired ({len(alerts)}{truth}):")
        parts.append(
            table(
                [
                    [
                        a["slo"],
                        a["severity"],
                        f"{a['long_window']} & {a['short_window']}",
                        f"> {a['factor']:g}",
                        ts(a["started"]),
                        ts(a["ended"]) if a["ended"] else "firing",
                        _num(a.get("firing_minutes"), 0),
                        _num(a["peak_burn_long"]),
                    ]
                    for a in alerts
                ],
                ["slo", "severity", "windows", "burn", "fired", "resolved", "minutes", "peak burn (long)"],
            )
        )
    else:
        parts.append("SLO alerts that fired: none")
    for name, per_sev in s.get("slo_minutes", {}).items():
        counts = ", ".join(f"{sev} {m['firing_minutes']:.0f}" for sev, m in per_sev.items())
        parts.append(f"Minutes firing per severity ({name}): {counts}")
    return parts

"""Readable text for the terminal: the summary table of ``demo`` and ``rules eval``."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from gpuslo.core.display import amount, pct, visible
from gpuslo.rules.model import CAUSES, SloHeldBack, Summary, why_not_evaluable, why_windows_unjudged


def terminal_safe(text: str) -> str:
    """``text`` for a terminal: every control character (ESC, BEL, CSI ...) and bidirectional
    override escaped as ``\\xNN`` / ``\\uNNNN`` (gpuslo.core.display.visible, as on the HTML
    pages). Names in the reports come from the data (a Slurm job name is its user's to choose):
    ``sbatch -J $'\\e]0;...\\a'`` would otherwise retitle, clear or recolour the terminal of
    whoever reads the report, and U+202E reverse what follows."""
    return visible(text)


def ts(t: float | None, seconds: bool = False) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def _pct(x: float | None) -> str:
    return pct(x, none="-")


def _num(x: float | None, nd: int = 1) -> str:
    return amount(x, nd, none="-")


def width(text: str) -> int:
    """Columns ``text`` takes on a terminal: wide (East Asian) characters two, combining marks
    and zero-width characters none."""
    n = 0
    for ch in text:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        n += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return n


def table(rows: list[list[str]], header: list[str]) -> str:
    """Columns padded to their widest cell. Each cell is made terminal-safe first and padded by
    the columns it takes on screen, so an escaped control or a wide character in a name (both
    come from the data) keeps the columns after it aligned; the text is one line per row (a
    newline or tab in a cell is escaped too)."""
    cells = [[cell(c) for c in r] for r in [header, *rows]]
    widths = [max(width(r[i]) for r in cells) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(c + " " * (w - width(c)) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(x.rstrip() for x in [out[0], line, *out[1:]])


def cell(value: object) -> str:
    """``value`` as one line of a terminal: :func:`terminal_safe`, a newline or tab escaped too
    (a name from the data in a line of text cannot start a line of its own)."""
    text = terminal_safe(str(value))
    return text.replace("\n", "\\n").replace("\t", "\\t")


def held_back(held: tuple[SloHeldBack, ...]) -> list[str]:
    """The burn conditions the traffic guard (min_requests) kept from alerting, and for how long."""
    if not held:
        return []
    total = sum(h.minutes for h in held)
    out = ["", f"Held back by the traffic guard ({len(held)} intervals, {total:.0f} min; no alert fired):"]
    out.append(
        table(
            [
                [
                    h.slo,
                    h.severity,
                    f"{h.long_window} & {h.short_window}",
                    ts(h.started),
                    ts(h.ended) if h.ended else "ongoing",
                    _num(h.minutes, 0),
                    f"{h.max_short_requests} < {h.min_requests}",
                ]
                for h in held
            ],
            ["slo", "severity", "windows", "from", "to", "minutes", "requests (short window) < min_requests"],
        )
    )
    return out


def summary(s: Summary, truth: Mapping[str, Any] | None = None) -> str:
    """The summary table; ``truth``: the simulator's own numbers (agent.sim.truth), side by side."""
    w = s.window
    parts = [
        f"gpuslo summary  {ts(w.from_)} → {ts(w.to)} UTC  ({_num(s.capacity_gpu_hours)} GPU-hours of capacity)",
        "",
    ]
    header = ["metric", "value", "target"] + (["simulator truth"] if truth else [])
    parts.append(table(_number_rows(s, truth) + _slo_rows(s, bool(truth)), header))
    parts.append("")
    parts += _alert_lines(s, truth)
    parts += held_back(s.slo_held_back)
    parts += [f"SLO {slo.slo}: {slo.error}" for slo in s.slos if slo.error]
    # no data (stopped, or never sent while the agents report): the ticket's reason, said here too
    parts += [f"SLO {slo.slo}: not evaluable: {why}" for slo in s.slos
              if not slo.error and (why := why_not_evaluable(slo, w.to))]  # fmt: skip
    parts += [f"SLO {slo.slo}: {why}" for slo in s.slos if (why := why_windows_unjudged(slo))]
    return "\n".join(parts)


def _number_rows(s: Summary, truth: Mapping[str, Any] | None) -> list[list[str]]:
    """CUR, idle time and starvation incidents, beside the simulator's truth when there is one."""

    def row(
        name: str, value: float | None, key: str, fmt: Callable[[float | None], str], target: str = ""
    ) -> list[str]:
        return [name, fmt(value), target] + ([fmt(truth.get(key))] if truth else [])

    rows = [
        row("Allocation CUR", s.cur_allocation, "cur_allocation", _pct, f">= {_pct(s.cur_target)}"),
        row("Active CUR", s.cur_active, "cur_active", _pct),
        row("Idle GPU-hours, allocated (waste users can fix)", s.idle_allocated_gpu_hours, "idle_allocated_gpu_hours", _num),
        row("Idle GPU-hours, unallocated", s.idle_unallocated_gpu_hours, "idle_unallocated_gpu_hours", _num),
    ]  # fmt: skip
    inc = s.starvation_incidents
    true_inc = truth["starvation_incidents"] if truth else []
    found = str(len(inc)) if s.scheduler_events_seen else "no data"
    why = "" if s.scheduler_events_seen else "no scheduler event: is a Slurm/Kubernetes collector running?"
    rows.append(["Starvation incidents", found, why] + ([str(len(true_inc))] if truth else []))
    for cause in CAUSES:
        r = [f"  cause: {cause}", str(sum(1 for i in inc if i.cause == cause)), ""]
        if truth:
            r.append(str(sum(1 for i in true_inc if i["cause"] == cause)))
        rows.append(r)
    return rows


def _slo_rows(s: Summary, with_truth: bool) -> list[list[str]]:
    pad = [""] if with_truth else []
    rows = []
    for slo in s.slos:
        rows.append(
            [
                f"SLO {slo.slo}: SLI (p99 <= {slo.threshold_ms:g} ms)",
                "error: see below" if slo.error else _pct(slo.sli),
                f">= {_pct(slo.objective)}",
                *pad,
            ]
        )
        rows.append(["  p99 latency (interpolated)", _num(slo.p99_ms, 2) + " ms", "", *pad])
        rows.append([f"  error budget left ({slo.slo})", _pct(slo.budget_remaining), "", *pad])
    return rows


def _alert_lines(s: Summary, truth: Mapping[str, Any] | None) -> list[str]:
    """The SLO alerts that fired, and the minutes each severity fired."""
    minutes = [
        f"Minutes firing per severity ({name}): "
        + ", ".join(f"{sev} {m.firing_minutes:.0f}" for sev, m in per_sev.items())
        for name, per_sev in s.slo_minutes.items()
    ]
    return _fired(s, truth) + minutes


def _fired(s: Summary, truth: Mapping[str, Any] | None) -> list[str]:
    alerts = s.slo_alerts
    if not alerts:
        return ["SLO alerts that fired: none"]
    of_truth = f"; simulator truth: {len(truth['slo_alerts'])}" if truth else ""
    return [
        f"SLO alerts that fired ({len(alerts)}{of_truth}):",
        table(
            [
                [
                    a.slo,
                    a.severity,
                    f"{a.long_window} & {a.short_window}",
                    f"> {a.factor:g}",
                    ts(a.started),
                    ts(a.ended) if a.ended else "firing",
                    _num(a.firing_minutes, 0),
                    _num(a.peak_burn_long),
                ]
                for a in alerts
            ],
            ["slo", "severity", "windows", "burn", "fired", "resolved", "minutes", "peak burn (long)"],
        ),
    ]


def reclaim(r: Mapping[str, Any] | None, truth: Mapping[str, Any] | None = None) -> str:
    """The idle-reclaim notices the rounds would have sent (each job at its first notice; the
    simulator's count of idle jobs beside), and the action's (dry-run) decisions."""
    if r is None:
        return "Idle-reclaim notices: the loop is off (reclaim.enabled)"
    first: dict[str, tuple[float, Mapping[str, Any]]] = {}
    for rnd in r.get("rounds") or [{"at": None, "notices": r["notices"]}]:
        for n in rnd.get("notices", []):
            first.setdefault(n["labels"]["job"], (rnd["at"], n))
    rounds = (truth or {}).get("reclaim_rounds") or []
    true_idle = {j for x in rounds for j in x["idle_holders"]}
    of_truth = f"; simulator truth: {len(true_idle)}" if rounds else ""
    if not first:
        return f"Idle-reclaim notices that would be sent: none{of_truth}"
    rows = [[job, ts(at) if at is not None else "", n["labels"].get("user", ""), n["labels"].get("account", ""),
             n["labels"].get("queue", ""), n["annotations"]["gpus"], _num(int(n["annotations"]["idle_for_s"]) / 60, 0),
             n["annotations"]["idle_gpu_hours"], n["annotations"]["report"]]
            for job, (at, n) in sorted(first.items())]  # fmt: skip
    lines = [
        f"Idle-reclaim notices that would be sent ({len(first)} jobs{of_truth}; each at its first notice):",
        table(
            rows, ["job", "noticed", "user", "account", "queue", "GPUs", "idle min", "idle GPU-h", "report"]
        ),
    ]
    lines += [f"  {a['outcome']}: {a['job']} ({a['queue']}): {a['reason']}" for a in r["actions"]]
    return "\n".join(lines)

"""``gpuslo report``: one self-contained HTML page (inline SVG charts, no scripts, no
network) with the four numbers and their trends for a time range, from any store. For
people without Grafana, and for weekly e-mails."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from gpuslo.core.display import amount, visible
from gpuslo.dashboards.chargeback_page import section as chargeback_section
from gpuslo.dashboards.pagetext import esc, pct
from gpuslo.dashboards.whatif_page import section as whatif_section
from gpuslo.ingest.store import Store
from gpuslo.rules import measures as m
from gpuslo.rules import sql
from gpuslo.rules.chargeback import Bill
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.rules.evaluate import summary
from gpuslo.rules.model import CAUSES, Summary, why_not_evaluable, why_windows_unjudged

W, H, PAD = 560, 200, 48
NO_DATA = "no data"  # a card or chart of a window with nothing to show
COLORS = ("#2f6fdf", "#e8743b", "#19a979", "#945ecf", "#d64e9b", "#5e6e82")


# the style of every gpuslo HTML page (this report, the per-job page: dashboards/jobpage.py)
PAGE_CSS = """\
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2330;background:#fff}
h1{font-size:20px;margin:0 0 4px} .sub{color:#5e6e82;margin-bottom:16px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:16px}
.card{border:1px solid #dde3ea;border-radius:8px;padding:10px 14px;min-width:170px;max-width:100%}
.card,.sub,figcaption,h1,h2,h3,p,li,.n{overflow-wrap:anywhere}
.k{color:#5e6e82;font-size:12px} .v{font-size:24px;font-weight:600} .d{color:#5e6e82;font-size:12px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}
figure{margin:0;border:1px solid #dde3ea;border-radius:8px;padding:6px}
figcaption{font-weight:600;font-size:13px;margin:2px 4px}
svg .grid{stroke:#eef1f5} svg .target{stroke:#d64e4e;stroke-dasharray:5 4}
svg text{font-size:11px;fill:#5e6e82} svg .ylab{text-anchor:end} svg .end{text-anchor:end}
svg .nodata{font-size:14px;text-anchor:middle}
table{border-collapse:collapse;margin:8px 0 16px} td,th{border-bottom:1px solid #eef1f5;padding:4px 10px;text-align:left}"""


def _t(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")


def _bucket_s(frm: float, to: float, points: int = 48) -> int:
    raw = max(60.0, (to - frm) / points)
    return int(math.ceil(raw / 60.0) * 60)


def trends_sql(cfg: RulesConfig) -> str:
    """The fleet sums (rules.measures) per bucket ``[from + k * bucket, from + (k + 1) * bucket)``:
    samples split at the bucket edges, idle as the engine counts it (``min_idle_s`` included)."""
    src, is_idle = (sql.IDLE_RUNS, "idle_ok") if cfg.min_idle_s > 0 else (sql.CAPACITY_SAMPLES, m.IDLE_TEST)
    split = m.split_by_bucket(src, "{bucket:UInt32}", origin="{from:Float64}")
    return (
        f"SELECT toInt64(round((bucket - {{from:Float64}}) / {{bucket:UInt32}})) AS b, {m.sums(m.FLEET_TERMS, is_idle)} "
        f"FROM ({split}) GROUP BY b ORDER BY b {sql.JOIN_SETTINGS}"
    )


# per bucket (from + k * bucket, from + (k + 1) * bucket]: the engine's latency windows
SLI_TRENDS = f"""
SELECT toInt64(ceil((toFloat64(ts) - {{from:Float64}}) / {{bucket:UInt32}})) - 1 AS b, sum(total) AS n,
    sum({m.GOOD}) AS good
FROM latency FINAL
WHERE service = {{service:String}} AND ({{cluster:String}} = '' OR cluster = {{cluster:String}})
  AND ts > toDateTime64({{from:Float64}}, 3, 'UTC') AND ts <= toDateTime64({{to:Float64}}, 3, 'UTC')
GROUP BY b ORDER BY b
"""


def trends(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str, bucket: int
) -> list[dict[str, Any]]:
    """Per bucket index ``b``: capacity, allocated, active and idle GPU-seconds."""
    params = {"from": float(frm), "to": float(to), "cluster": cluster, "bucket": bucket,
              "idle": cfg.idle_threshold, "min_idle": float(cfg.min_idle_s)}  # fmt: skip
    return store.query(trends_sql(cfg), params)


def sli_trends(
    store: Store, slo: Slo, frm: float, to: float, cluster: str, bucket: int
) -> list[dict[str, Any]]:
    """Per bucket index ``b``: requests ``n`` and good requests."""
    params = {"from": float(frm), "to": float(to), "cluster": cluster, "bucket": bucket,
              "service": slo.service, "threshold": float(slo.threshold_ms)}  # fmt: skip
    return store.query(SLI_TRENDS, params)


def nice_top(v: float) -> float:
    """The smallest of 1, 2, 4, 5, 8 × 10^k above ``v``: gridlines at a quarter of it stay round."""
    if v <= 0:
        return 1.0
    e = 10.0 ** math.floor(math.log10(v * 1.05))
    return next(f * e for f in (1, 2, 4, 5, 8, 10) if f * e >= v * 1.05)


def _label_value(label: str) -> float:
    return float(label.rstrip("%").replace(",", "")) / (100 if label.endswith("%") else 1)


def tick_labels(top: float, y_fmt: str) -> list[str]:
    """The five gridline labels of an axis from 0 to ``top``, in ``y_fmt`` with as many more
    decimals (up to 8) as they need to be distinct and each within 0.5 % of the axis of its
    line: at "{:.0f}" a 2 GiB axis read 0, 0, 1, 2, 2 and a 9.5 GiB one had "10" at its top."""
    ticks = [top * i / 4 for i in range(5)]
    fmt = y_fmt
    for _ in range(9):
        labels = [fmt.format(y) for y in ticks]
        if len(set(labels)) == len(labels) and all(
            abs(_label_value(x) - y) <= 0.005 * top for x, y in zip(labels, ticks, strict=True)
        ):
            break
        fmt = re.sub(r"\.(\d+)", lambda m: f".{int(m.group(1)) + 1}", fmt, count=1)
    return labels


LEGEND_CHARS = 18  # what fits the 130 px of a legend entry at 11 px


def _legend(name: str) -> str:
    """A legend entry's text, its whole name as its tooltip: a name longer than the entry's room
    is cut in the middle with "…" (it ran over the next entries and off the chart; the middle,
    as names differ at their ends: a node's GPU index, a MIG instance)."""
    shown = visible(name)
    if len(shown) > LEGEND_CHARS:
        head = (LEGEND_CHARS - 1) // 2
        short = f"{shown[:head]}…{shown[len(shown) - (LEGEND_CHARS - 1 - head) :]}"
    else:
        short = shown
    return f"{esc(short)}<title>{esc(shown)}</title>"


def _runs(pts: Sequence[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    """The points in runs without a gap (a ``None`` y ends one)."""
    out: list[list[tuple[float, float]]] = [[]]
    for x, y in pts:
        if y is None:
            if out[-1]:
                out.append([])
        else:
            out[-1].append((x, y))
    return [r for r in out if r]


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float | None]]], x0: float, x1: float,
               y_max: float | None = None, y_fmt: str = "{:.0f}", target: float | None = None,
               empty: str = NO_DATA) -> str:  # fmt: skip
    """An SVG line chart; x in seconds, one line per series, broken where a point's y is ``None``
    (no data there: a line across it drew values nobody measured), optional dashed target;
    ``empty`` written across it when no series has a point."""
    ys = [y for pts in series.values() for _, y in pts if y is not None]
    # an axis of its own reaches the target too: a target above it was drawn on the top line
    top = (
        y_max
        if y_max is not None
        else nice_top(max([*ys, *([] if target is None else [target])], default=0.0))
    )
    iw, ih = W - 2 * PAD, H - 2 * PAD

    def px(x: float) -> float:
        return PAD + (min(max(x, x0), x1) - x0) / max(1e-9, x1 - x0) * iw

    def py(y: float) -> float:
        return PAD + ih - min(max(y, 0.0), top) / top * ih

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" role="img" '
             f'aria-label="{esc(title)}">', f'<title>{esc(title)}</title>']  # fmt: skip
    for i, label in enumerate(tick_labels(top, y_fmt)):
        y = top * i / 4
        parts.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{py(y):.1f}" y2="{py(y):.1f}" class="grid"/>')
        parts.append(f'<text x="{PAD - 4}" y="{py(y) + 4:.1f}" class="ylab">{esc(label)}</text>')
    parts.append(f'<text x="{PAD}" y="{H - 8}" class="xlab">{_t(x0)}</text>')
    parts.append(f'<text x="{W - PAD}" y="{H - 8}" class="xlab end">{_t(x1)}</text>')
    if target is not None:
        parts.append(
            f'<line x1="{PAD}" x2="{W - PAD}" y1="{py(target):.1f}" y2="{py(target):.1f}" class="target"/>'
        )
    if not ys:  # an empty chart is not a flat one: say why there is no line
        parts.append(f'<text x="{W / 2:.0f}" y="{H / 2:.0f}" class="nodata">{esc(empty)}</text>')
    for k, (name, pts) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        for run in _runs(pts):
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            parts.append(
                f'<polyline class="series" fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>'
            )
        parts.append(f'<rect x="{PAD + 130 * k}" y="6" width="10" height="10" fill="{color}"/>'
                     f'<text x="{PAD + 14 + 130 * k}" y="15" class="legend">{_legend(name)}</text>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def render(
    store: Store,
    cfg: RulesConfig,
    frm: float,
    to: float,
    cluster: str = "",
    bill: Bill | None = None,
    whatif: dict[str, Any] | None = None,
) -> str:
    """The page; ``bill``: the chargeback of ``[frm, to)`` when the caller has it already;
    ``whatif``: the what-if entries likewise (dashboards/whatif_page.py)."""
    s = summary(store, cfg, frm, to, cluster)
    bucket = _bucket_s(frm, to)
    charts = [
        *_utilization_charts(store, cfg, frm, to, cluster, bucket),
        _incident_chart(s, frm, to, bucket),
        *_slo_charts(store, cfg, frm, to, cluster, bucket, {st.slo: st.error for st in s.slos}),
    ]
    titles = [
        "Cluster utilization rate (dashed: target)",
        f"Idle GPU-hours per {bucket // 60} min",
        "Starvation incidents opened, by cause",
        *[f"{slo.name}: share of requests ≤ {slo.threshold_ms:g} ms (dashed: objective)" for slo in cfg.slos],
    ]
    figures = "".join(
        f"<figure><figcaption>{esc(t)}</figcaption>{c}</figure>" for t, c in zip(titles, charts, strict=True)
    )
    bills = chargeback_section(store, cfg, frm, to, cluster, bill)
    bills += whatif_section(store, cfg, frm, to, cluster, whatif)
    return _page(
        frm, to, cluster, _cards(s), figures, _alert_rows(s), _held_rows(s), _incident_rows(s), bills
    )


def _utilization_charts(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str, bucket: int
) -> list[str]:
    rows = trends(store, cfg, frm, to, cluster, bucket)
    mid = [(frm + (r["b"] + 0.5) * bucket, r) for r in rows]
    cur = {
        "allocation": [(x, r["allocated_s"] / r["capacity_s"]) for x, r in mid if r["capacity_s"]],
        "active": [(x, r["active_s"] / r["capacity_s"]) for x, r in mid if r["capacity_s"]],
    }
    idle = {
        "allocated-idle": [(x, r["idle_allocated_s"] / 3600) for x, r in mid],
        "unallocated": [(x, r["idle_unallocated_s"] / 3600) for x, r in mid],
    }
    return [
        line_chart("Cluster utilization rate", cur, frm, to, 1.0, "{:.0%}", target=cfg.cur_target),
        line_chart(f"Idle GPU-hours per {bucket // 60} min", idle, frm, to, None, "{:g}"),
    ]


def _incident_chart(s: Summary, frm: float, to: float, bucket: int) -> str:
    nb = math.ceil((to - frm) / bucket)
    counts: dict[str, list[int]] = {c: [0] * nb for c in CAUSES}
    for i in s.starvation_incidents:
        counts[i.cause][min(nb - 1, int((i.opened - frm) // bucket))] += 1
    pts: dict[str, list[tuple[float, float]]] = {
        c: [(frm + (k + 0.5) * bucket, float(v)) for k, v in enumerate(counts[c])] for c in CAUSES
    }
    return line_chart("Starvation incidents opened, by cause", pts, frm, to, None, "{:g}")


def _slo_charts(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str, bucket: int, errors: dict[str, str]
) -> list[str]:
    """Each SLO's SLI per bucket; none for an SLO the engine refused (``errors``: its threshold
    is not a bucket bound of its histograms, so "good" would count a different threshold); on an
    axis from 0 to 100 % whatever the SLI (an axis fitted to an SLI of 30 % drew the 99 %
    objective on its top line, labelled 40 %)."""
    charts = []
    for slo in cfg.slos:
        refused = bool(errors.get(slo.name))
        r2 = [] if refused else sli_trends(store, slo, frm, to, cluster, bucket)
        pts = [(frm + (r["b"] + 0.5) * bucket, r["good"] / r["n"]) for r in r2 if r["n"]]
        charts.append(line_chart(f"{slo.name}: share of requests ≤ {slo.threshold_ms:g} ms", {"SLI": pts}, frm, to,
                                 1.0, "{:.1%}", target=slo.objective,
                                 empty="not evaluated (see its card)" if refused else NO_DATA))  # fmt: skip
    return charts


def _pct(v: float | None) -> str:
    return pct(v)


def _num(v: float | None) -> str:
    return amount(v, grouping=True)


def _cards(s: Summary) -> str:
    """The numbers; where the window has none (no GPU capacity, no requests of an SLO, an SLO
    the engine refused) the card says so and why, never a 0 that reads as a measurement."""
    if s.capacity_gpu_hours:
        idle = (s.idle_allocated_gpu_hours or 0) + (s.idle_unallocated_gpu_hours or 0)
        kpis = [
            ("Allocation CUR", _pct(s.cur_allocation), f"target {_pct(s.cur_target)}"),
            ("Active CUR", _pct(s.cur_active), f"{_num(s.capacity_gpu_hours)} GPU-h capacity"),
            ("Idle GPU-hours", _num(idle), f"{_num(s.idle_allocated_gpu_hours)} allocated-idle"),
        ]
    else:
        why = "no GPU capacity in the window (no GPU samples, or every GPU drained or unhealthy)"
        kpis = [
            ("Allocation CUR", NO_DATA, f"target {_pct(s.cur_target)}; {why}"),
            ("Active CUR", NO_DATA, why),
            ("Idle GPU-hours", NO_DATA, why),
        ]
    if s.scheduler_events_seen:
        kpis.append(("Starvation incidents", str(len(s.starvation_incidents)),
                     ", ".join(f"{k} {v}" for k, v in s.starvation_by_cause.items())))  # fmt: skip
    else:
        kpis.append(("Starvation incidents", NO_DATA,
                     "no scheduler event from this cluster: no Slurm, Kubernetes or Kueue collector has reported"))  # fmt: skip
    for st in s.slos:
        if st.error:
            value, detail = "not evaluated", st.error
        elif st.never_seen:  # not "no requests": no row ever, and the reason the ticket gives
            value, detail = NO_DATA, why_not_evaluable(st, s.window.to)
        else:
            value = NO_DATA if st.sli is None else _pct(st.sli)
            detail = ("no requests in the window; " if st.sli is None else "") + (
                f"p99 {_num(st.p99_ms)} ms, budget left {_pct(st.budget_remaining)}"
            )
            if st.no_data_since is not None:
                detail += f"; no latency data since {_t(st.no_data_since)}"
            elif why := why_windows_unjudged(st):
                detail += f"; {why}"
        kpis.append((f"SLO {st.slo}", value, detail))
    return "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div>'
        f'<div class="d">{esc(d)}</div></div>'
        for k, v, d in kpis
    )


_NONE_ROW = '<tr><td colspan="7">none</td></tr>'


def _alert_rows(s: Summary) -> str:
    return (
        "".join(
            f'<tr><td class="n">{esc(a.slo)}</td>'
            f"<td>{esc(a.severity)}</td><td>{esc(a.long_window)} &amp; {esc(a.short_window)}</td>"
            f"<td>{_t(a.started)}</td><td>{_t(a.ended) if a.ended else 'firing'}</td><td>{a.firing_minutes:.0f}</td><td>{a.peak_burn_long:.1f}</td></tr>"
            for a in s.slo_alerts
        )
        or _NONE_ROW
    )


def _held_rows(s: Summary) -> str:
    return (
        "".join(
            f'<tr><td class="n">{esc(h.slo)}</td>'
            f"<td>{esc(h.severity)}</td><td>{esc(h.long_window)} &amp; {esc(h.short_window)}</td>"
            f"<td>{_t(h.started)}</td><td>{_t(h.ended) if h.ended else 'ongoing'}</td><td>{h.minutes:.0f}</td>"
            f"<td>{h.max_short_requests} &lt; {h.min_requests}</td></tr>"
            for h in s.slo_held_back
        )
        or _NONE_ROW
    )


def _incident_rows(s: Summary) -> str:
    """The 20 longest-waiting incidents."""
    return (
        "".join(
            f'<tr><td class="n">{esc(i.request_id)}</td><td class="n">{esc(i.queue)}</td><td class="n">{esc(i.user)}</td>'
            f"<td>{i.gpus:g}</td><td>{esc(i.cause)}</td><td>{_t(i.opened)}</td><td>{(i.wait_s or 0) / 60:.0f}</td></tr>"
            for i in sorted(s.starvation_incidents, key=lambda i: -(i.wait_s or 0))[:20]
        )
        or _NONE_ROW
    )


def _page(
    frm: float,
    to: float,
    cluster: str,
    cards: str,
    figures: str,
    alerts: str,
    held: str,
    incidents: str,
    chargeback: str = "",
) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpuslo report {_t(frm)} – {_t(to)}</title>
<style>
{PAGE_CSS}
</style></head><body>
<h1>gpuslo report</h1>
<div class="sub">{_t(frm)} → {_t(to)} UTC{" · cluster " + esc(cluster) if cluster else ""} · generated {_t(datetime.now(UTC).timestamp())}</div>
<div class="cards">{cards}</div>
<div class="charts">{figures}</div>
<h2>SLO alerts</h2><table><tr><th>SLO</th><th>severity</th><th>windows</th><th>fired</th><th>resolved</th><th>minutes</th><th>peak burn</th></tr>{alerts}</table>
<h2>Held back by the traffic guard (burn above the factor, too few requests to alert)</h2><table><tr><th>SLO</th><th>severity</th><th>windows</th><th>from</th><th>to</th><th>minutes</th><th>requests in the short window</th></tr>{held}</table>
<h2>Longest starvation incidents</h2><table><tr><th>request</th><th>queue</th><th>user</th><th>GPUs</th><th>cause</th><th>opened</th><th>wait (min)</th></tr>{incidents}</table>
{chargeback}
</body></html>
"""

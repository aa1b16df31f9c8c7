"""The chargeback section of the HTML report (dashboards/report.py): one bill per calendar
month (UTC) of the report's range, each clipped to the range, per account, money to the cent
(rules/chargeback.py)."""

from __future__ import annotations

import html
from datetime import UTC, datetime

from gpuslo.ingest.store import Store
from gpuslo.rules.chargeback import Bill, compute
from gpuslo.rules.config import RulesConfig


def months(frm: float, to: float) -> list[tuple[float, float]]:
    """The calendar months (UTC) overlapping ``[frm, to)``, each clipped to it."""
    out: list[tuple[float, float]] = []
    d = datetime.fromtimestamp(frm, UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    while d.timestamp() < to:
        nxt = d.replace(year=d.year + 1, month=1) if d.month == 12 else d.replace(month=d.month + 1)
        out.append((max(frm, d.timestamp()), min(to, nxt.timestamp())))
        d = nxt
    return out


def _table(label: str, bill: Bill) -> str:
    cur = html.escape(bill.currency)
    rows = "".join(
        f"<tr><td>{html.escape(r['account'] or '(none)')}</td><td>{r['gpu_hours_used']:.2f}</td>"
        f"<td>{r['gpu_hours_allocated_idle']:.2f}</td><td>{r['gpu_hours_unallocated_share']:.2f}</td>"
        f"<td>{r['energy_kwh']:.2f}</td><td>{r['cost']}</td></tr>"
        for r in bill.rows("account")
    )
    t = bill.totals
    rows += (
        f"<tr><th>total</th><th>{t['gpu_hours_used']:.2f}</th><th>{t['gpu_hours_allocated_idle']:.2f}</th>"
        f"<th>{t['gpu_hours_unallocated_share']:.2f}</th><th>{t['energy_kwh']:.2f}</th><th>{t['cost']}</th></tr>"
    )
    unpriced = "".join(
        f"<p>Unpriced: {u['gpu_hours']:.2f} GPU-h of {html.escape(u['model'] or '(no model)')} "
        f"in {html.escape(u['cluster'])}</p>"
        for u in bill.unpriced
    )
    return (
        f"<h3>{html.escape(label)}</h3><table><tr><th>account</th><th>used GPU-h</th><th>allocated-idle GPU-h</th>"
        f"<th>unallocated share GPU-h</th><th>kWh</th><th>cost {cur}</th></tr>{rows}</table>"
        f'<p class="d">capacity {t["gpu_hours_capacity"]:.2f} GPU-h priced {t["capacity_cost"]} {cur}; '
        f"not charged {t['uncharged_cost']} {cur}; unallocated: {html.escape(bill.unallocated_mode)}; "
        f"CO2 {bill.energy['co2_kg']:.2f} kg</p>{unpriced}"
    )


def section(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str = "", bill: Bill | None = None
) -> str:
    """The report's chargeback section; empty without a price sheet. ``bill``: that of
    ``[frm, to)``, used when the range lies inside one month."""
    if cfg.chargeback is None:
        return ""
    spans = months(frm, to)
    parts: list[str] = []
    for a, b in spans:
        label = datetime.fromtimestamp(a, UTC).strftime("%B %Y")
        if len(spans) > 1:
            label += f" ({datetime.fromtimestamp(a, UTC):%Y-%m-%d %H:%M} → {datetime.fromtimestamp(b, UTC):%Y-%m-%d %H:%M})"
        one = bill if bill is not None and len(spans) == 1 else compute(store, cfg, a, b, cluster)
        parts.append(_table(label, one))
    return "<h2>Chargeback per month</h2>" + "".join(parts)

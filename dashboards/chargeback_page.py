"""The chargeback section of the HTML report (dashboards/report.py): one bill per calendar
month (UTC) of the report's range, each clipped to the range, per account, money to the cent
(rules/chargeback.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from gpuslo.dashboards.pagetext import esc
from gpuslo.ingest.store import Store
from gpuslo.rules.chargeback import Bill, RawRowsGone, compute
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.energy import co2_words
from gpuslo.wire.models import MAX_INTERVAL_S


def months(frm: float, to: float) -> list[tuple[float, float]]:
    """The calendar months (UTC) overlapping ``[frm, to)``, each clipped to it."""
    out: list[tuple[float, float]] = []
    d = datetime.fromtimestamp(frm, UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    while d.timestamp() < to:
        nxt = d.replace(year=d.year + 1, month=1) if d.month == 12 else d.replace(month=d.month + 1)
        out.append((max(frm, d.timestamp()), min(to, nxt.timestamp())))
        d = nxt
    return out


PLACES = 2  # GPU-hours and kWh on the page; the rows are shared out at it, so they add up


def _table(label: str, bill: Bill) -> str:
    cur = esc(bill.currency)
    rows = "".join(
        f'<tr><td class="n">{esc(r["account"] or "(none)")}</td><td>{r["gpu_hours_used"]:.2f}</td>'
        f"<td>{r['gpu_hours_allocated_idle']:.2f}</td><td>{r['gpu_hours_unallocated_share']:.2f}</td>"
        f"<td>{r['energy_kwh']:.2f}</td><td>{esc(r['cost'])}</td></tr>"
        for r in bill.rows("account", PLACES)
    )
    t = bill.totals_at(PLACES)
    rows += (
        f"<tr><th>total</th><th>{t['gpu_hours_used']:.2f}</th><th>{t['gpu_hours_allocated_idle']:.2f}</th>"
        f"<th>{t['gpu_hours_unallocated_share']:.2f}</th><th>{t['energy_kwh']:.2f}</th><th>{esc(t['cost'])}</th></tr>"
    )
    unpriced = "".join(
        f"<p>Unpriced: {u['gpu_hours']:.2f} GPU-h of {esc(u['model'] or '(no model)')} "
        f"in {esc(u['cluster'])}</p>"
        for u in bill.unpriced
    )
    return (
        f"<h3>{esc(label)}</h3><table><tr><th>account</th><th>used GPU-h</th><th>allocated-idle GPU-h</th>"
        f'<th>unallocated share GPU-h</th><th>kWh</th><th class="n">cost {cur}</th></tr>{rows}</table>'
        f'<p class="d">capacity {t["gpu_hours_capacity"]:.2f} GPU-h priced {esc(t["capacity_cost"])} {cur}; '
        f"not charged {esc(t['uncharged_cost'])} {cur}; unallocated: {esc(bill.unallocated_mode)}; "
        f"{esc(co2_words(bill.energy, 2))}</p>{unpriced}"
    )


def section(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str = "", bill: Bill | None = None
) -> str:
    """The report's chargeback section; empty without a price sheet. ``bill``: that of
    ``[frm, to)``, used when the range lies inside one month."""
    if cfg.chargeback is None:
        return ""
    lo, hi = _sampled(store, frm, to, cluster)
    every = months(frm, to)
    spans = [(a, b) for a, b in every if b > lo and a < hi]  # a month no sample reaches bills nothing
    if not spans:
        return "<h2>Chargeback per month</h2><p>No GPU samples in the window: nothing to bill.</p>"
    parts: list[str] = []
    for a, b in spans:
        label = datetime.fromtimestamp(a, UTC).strftime("%B %Y")
        if len(every) > 1:
            label += f" ({datetime.fromtimestamp(a, UTC):%Y-%m-%d %H:%M} → {datetime.fromtimestamp(b, UTC):%Y-%m-%d %H:%M})"
        try:
            one = bill if bill is not None and len(every) == 1 else compute(store, cfg, a, b, cluster)
        except RawRowsGone as exc:  # the month is not billed, the others are (and the page is made)
            parts.append(f"<h3>{esc(label)}</h3><p>Not billed: {esc(exc)}.</p>")
            continue
        parts.append(_table(label, one))
    return "<h2>Chargeback per month</h2>" + "".join(parts)


def _sampled(store: Store, frm: float, to: float, cluster: str) -> tuple[float, float]:
    """The span the GPU samples in ``[frm, to)`` cover, from the first one's start to the last
    one's end (raw rows, and the minute rollups beyond their retention): a window from 1970 to
    2106 is 1,632 months, of which only these can bill anything (each month was a bill
    computed). (inf, -inf) for none."""
    lo, hi = float("inf"), float("-inf")
    for q in (
        "SELECT count() AS n, toFloat64(min(ts)) AS lo, max(toFloat64(ts) + interval_s) AS hi FROM gpu_samples "
        "WHERE ts >= toDateTime64({frm:Float64} - {most:Float64}, 3, 'UTC') AND ts < toDateTime64({to:Float64}, 3, 'UTC') "
        "AND ({cluster:String} = '' OR cluster = {cluster:String})",
        "SELECT count() AS n, toFloat64(min(minute)) AS lo, toFloat64(max(minute)) + 60 AS hi FROM gpu_rollup_1m "
        "WHERE minute >= toDateTime(intDiv(toInt64({frm:Float64}), 60) * 60, 'UTC') "
        "AND minute < toDateTime64({to:Float64}, 3, 'UTC') AND ({cluster:String} = '' OR cluster = {cluster:String})",
    ):
        params = {"frm": max(float(MAX_INTERVAL_S), frm), "to": min(to, 4_291_747_199.0), "cluster": cluster,
                  "most": float(MAX_INTERVAL_S)}  # fmt: skip
        r = store.query(q, params)[0]
        if int(r["n"]):
            lo, hi = min(lo, float(r["lo"])), max(hi, float(r["hi"]))
    return lo, hi

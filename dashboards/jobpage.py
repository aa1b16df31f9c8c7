"""``gpuslo job ID --html FILE``: the per-job report as one self-contained HTML page (inline SVG
charts in the style of ``gpuslo report``, no scripts, no network)."""

from __future__ import annotations

from datetime import UTC, datetime

from gpuslo.core.display import amount, hms
from gpuslo.dashboards.pagetext import esc, pct
from gpuslo.dashboards.report import PAGE_CSS, line_chart
from gpuslo.rules.jobreport import JobGpu, JobReport, gib, grid

MAX_SERIES = (
    4  # charts draw at most this many GPUs, as many as their legend has room for (the table lists all)
)


def _t(x: float | None) -> str:
    return "–" if x is None else datetime.fromtimestamp(x, UTC).strftime("%Y-%m-%d %H:%M")


def _pct(x: float | None) -> str:
    return pct(x)


_e = esc


def _label(g: JobGpu) -> str:
    mig = f" {g.mig_profile or 'MIG'} gi{g.mig_gi} ci{g.mig_ci}" if g.mig_gi is not None else ""
    return f"{g.node}/{g.gpu}{mig}"


def labels(gpus: tuple[JobGpu, ...]) -> list[str]:
    """A series name per GPU row, none twice (the charts key their series by it: two MIG
    instances of one profile on one GPU were one name, and one of them was not drawn); a name
    still shared (a GPU replaced under the same index) gets the UUID."""
    names = [_label(g) for g in gpus]
    return [f"{n} {g.uuid}" if names.count(n) > 1 else n for n, g in zip(names, gpus, strict=True)]


def _charts(r: JobReport) -> str:
    gpus = r.gpus[:MAX_SERIES]
    half = r.bucket_s / 2
    rows = list(zip(labels(gpus), gpus, strict=True))
    # every bucket, in time: a bucket without a sample breaks the line (one drawn across an
    # agent's outage, or a requeued job's time on another GPU, showed values nobody measured)
    pts = {n: [(r.from_ + k * r.bucket_s + half, p) for k, p in enumerate(grid(r, g))] for n, g in rows}
    act = {n: [(x, p.activity if p else None) for x, p in ps] for n, ps in pts.items()}
    mem = {n: [(x, p.fb_used_mib / 1024 if p and p.fb_used_mib is not None else None) for x, p in ps]
           for n, ps in pts.items()}  # fmt: skip
    top = max((g.fb_total_mib or 0) / 1024 for g in gpus) if gpus else 0
    more = f" (the first {MAX_SERIES} of {len(r.gpus)} GPUs)" if len(r.gpus) > MAX_SERIES else ""
    charts = [
        (f"GPU activity per GPU{more} (dashed: idle threshold)",
         line_chart("activity", act, r.from_, r.to, 1.0, "{:.0%}", target=r.idle_threshold)),
        (f"Framebuffer used per GPU{more}, GiB", line_chart("memory", mem, r.from_, r.to, top or None, "{:.0f}")),
    ]  # fmt: skip
    return "".join(f"<figure><figcaption>{_e(t)}</figcaption>{c}</figure>" for t, c in charts)


def _cards(r: JobReport) -> str:
    wait = hms(r.wait_s)
    kpis = [
        ("GPUs held", str(len(r.gpus)), f"{amount(r.held_gpu_hours, 2)} GPU-hours"),
        ("GPU utilization", _pct(r.utilization), f"{amount(r.active_gpu_hours, 2)} GPU-hours active"),
        ("Idle share", _pct(r.idle_share), f"{amount(r.idle_gpu_hours, 2)} GPU-hours idle"),
        ("Peak memory", gib(r.peak_fb_mib) if r.peak_fb_mib is not None else "–", "largest on one GPU"),
        ("Wait", wait, f"starved: {r.starvation.cause}" if r.starvation else "did not starve"),
    ]
    if r.energy is not None:
        co2 = f", {r.energy.co2_g / 1000:.2f} kg CO2" if r.energy.co2_g else ""
        kpis.append(("GPU energy", f"{r.energy.kwh:.3f} kWh", f"{r.energy.idle_kwh:.3f} kWh while idle{co2}"))
    a = r.rightsize
    if a is not None:
        kpis.append(("MIG right-sizing", a.profile or "none",
                     f"{a.give_back_gpu_hours:.2f} GPU-h to give back" if a.profile else (a.reason or "")))  # fmt: skip
    return "".join(f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div>'
                   f'<div class="d">{_e(d)}</div></div>' for k, v, d in kpis)  # fmt: skip


def _rows(r: JobReport) -> str:
    def mem(g: JobGpu) -> str:
        return (
            f"{gib(g.peak_fb_mib)} / {gib(g.fb_total_mib)}"
            if g.peak_fb_mib is not None and g.fb_total_mib
            else "–"
        )

    return (
        "".join(
            f'<tr><td class="n">{_e(g.node)}</td><td>{g.gpu}</td><td class="n">{_e(g.mig_profile or "")}</td><td class="n">{_e(g.uuid)}</td>'
            f"<td>{g.share:g}{' (shared)' if g.shared else ''}</td><td>{g.held_gpu_hours:.2f}</td>"
            f"<td>{_pct(g.utilization)}</td><td>{_pct(g.peak_activity)}</td><td>{_pct(g.idle_share)}</td>"
            f"<td>{_e(mem(g))}</td></tr>"
            for g in r.gpus
        )
        or '<tr><td colspan="10">no GPU samples</td></tr>'
    )


def render(r: JobReport) -> str:
    facts = [
        ("Job", r.id + (f" (request {r.request_id})" if r.request_id and r.request_id != r.id else "")),
        ("Name", r.name), ("User / account", f"{r.user} / {r.account}"), ("Queue", r.queue),
        ("Scheduler / cluster", f"{r.scheduler or '–'} / {r.cluster}"), ("Submitted", _t(r.submitted)),
        ("Started", _t(r.started)), ("Ended", f"{_t(r.ended)} {r.end_state or ''}"),
    ]  # fmt: skip
    fact_rows = "".join(f'<tr><th>{_e(k)}</th><td class="n">{_e(v)}</td></tr>' for k, v in facts)
    notes = "".join(f"<li>{_e(n)}</li>" for n in r.notes) or "<li>nothing to point out</li>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpuslo job {_e(r.id)}</title>
<style>
{PAGE_CSS}
</style></head><body>
<h1>gpuslo job report: {_e(r.id)}</h1>
<div class="sub">{_t(r.from_)} → {_t(r.to)} UTC · cluster {_e(r.cluster)} · generated {_t(datetime.now(UTC).timestamp())}</div>
<table>{fact_rows}</table>
<div class="cards">{_cards(r)}</div>
<h2>Notes</h2><ul class="notes">{notes}</ul>
<div class="charts">{_charts(r)}</div>
<h2>GPUs held</h2><table><tr><th>node</th><th>GPU</th><th>MIG</th><th>UUID</th><th>share</th><th>GPU-hours</th><th>utilization</th><th>peak activity</th><th>idle share</th><th>peak memory / total</th></tr>{_rows(r)}</table>
</body></html>
"""

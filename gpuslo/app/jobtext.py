"""Terminal text of ``gpuslo job`` (a jobstats-like efficiency report) and ``gpuslo rightsize``."""

from __future__ import annotations

from typing import Any

from gpuslo.app.text import table, ts
from gpuslo.core.display import hms, pct
from gpuslo.rules.jobreport import JobEnergy, JobGpu, JobReport, gib, grid, held_memory_mib
from gpuslo.rules.rightsize import Rightsizing

SPARK = "▁▂▃▄▅▆▇█"
BAR = 40
RULE = "=" * 80


def sparkline(values: list[float | None], top: float = 1.0) -> str:
    """One character per value, scaled to [0, top]; a gap (no sample) is a space."""
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        else:
            k = 0 if top <= 0 else round(min(max(v / top, 0.0), 1.0) * (len(SPARK) - 1))
            out.append(SPARK[k])
    return "".join(out)


SPARK_WIDTH = 24


def squeeze(values: list[float | None], width: int, mean: bool) -> list[float | None]:
    """``values`` in at most ``width`` groups of consecutive values: each group's mean (or max)."""
    if len(values) <= width:
        return values
    out: list[float | None] = []
    for k in range(width):
        part = [v for v in values[k * len(values) // width : (k + 1) * len(values) // width] if v is not None]
        out.append(None if not part else (sum(part) / len(part) if mean else max(part)))
    return out


def bar(x: float | None) -> str:
    if x is None:
        return f"[{' ' * BAR}]   -"
    n = round(min(max(x, 0.0), 1.0) * BAR)
    return f"[{'|' * n}{' ' * (BAR - n)}] {100 * x:3.0f} %"


def duration(s: float | None) -> str:
    return hms(s, none="-")


def _pct(x: float | None) -> str:
    return pct(x, 0, none="-")


def _gpu_name(g: JobGpu) -> str:
    mig = f" {g.mig_profile or 'MIG'} gi{g.mig_gi}" if g.mig_gi is not None else ""
    return f"{g.node} GPU {g.gpu}{mig}"


def _header(r: JobReport) -> list[str]:
    end = f"{ts(r.ended)} UTC ({r.end_state})" if r.ended is not None else "- (running or pending)"
    run = (r.ended if r.ended is not None else r.to) - r.started if r.started is not None else None
    req = f"{r.gpus_requested:g} requested, " if r.gpus_requested is not None else ""
    nodes = len({g.node for g in r.gpus})
    rows = [
        ("Job", f"{r.id}" + (f" (request {r.request_id})" if r.request_id and r.request_id != r.id else "")),
        ("Name", r.name or "-"),
        ("User/Account", f"{r.user or '-'} / {r.account or '-'}"),
        ("Queue", f"{r.queue or '-'}  ({r.scheduler or 'no scheduler events'}, cluster {r.cluster})"),
        ("GPUs", f"{req}{len(r.gpus)} held on {nodes} node{'s' if nodes != 1 else ''}"),
        ("Submitted", f"{ts(r.submitted)} UTC" if r.submitted is not None else "-"),
        ("Started", f"{ts(r.started)} UTC (waited {duration(r.wait_s)})" if r.started is not None
         else f"- (waiting {duration(r.wait_s)})"),
        ("Ended", end),
        ("Run time", duration(run)),
        ("Report window", f"{ts(r.from_)} → {ts(r.to)} UTC"),
    ]  # fmt: skip
    return [f"{k + ':':<15}{v}" for k, v in rows]


def _overall(r: JobReport) -> list[str]:
    held = [(g.peak_fb_mib, held_memory_mib(g)) for g in r.gpus]
    peak = max((p / h for p, h in held if p is not None and h), default=None)
    runs = f", idle runs of at least {r.min_idle_s:g} s" if r.min_idle_s > 0 else ""
    return [
        f"  GPU utilization      {bar(r.utilization)}",
        f"  GPU memory (peak)    {bar(peak)}",
        f"  Idle share           {bar(r.idle_share)}  ({r.idle_gpu_hours:.2f} of {r.held_gpu_hours:.2f} "
        f"GPU-hours; activity < {100 * r.idle_threshold:g} %{runs})",
        *([_energy_line(r.energy)] if r.energy is not None else []),
    ]


def _energy_line(e: JobEnergy) -> str:
    est = f", {e.estimated_kwh:.3f} estimated from power" if e.estimated_kwh else ""
    co2 = f", {e.co2_g / 1000:.2f} kg CO2" if e.co2_g else ""
    return f"  GPU energy           {e.kwh:.3f} kWh ({e.idle_kwh:.3f} while idle{est}{co2})"


def _per_gpu(r: JobReport) -> list[str]:
    rows = []
    for g in r.gpus:
        pts = grid(r, g)  # in time: a bucket without a sample is a gap (a space), not left out
        act = squeeze([p.activity if p else None for p in pts], SPARK_WIDTH, mean=True)
        mem = squeeze([p.fb_used_mib if p else None for p in pts], SPARK_WIDTH, mean=False)
        mem_s = (
            f"{gib(g.peak_fb_mib)} / {gib(g.fb_total_mib)}"
            if g.peak_fb_mib is not None and g.fb_total_mib
            else "-"
        )
        rows.append([_gpu_name(g), g.uuid, f"{g.share:g}" + (" shared" if g.shared else ""),
                     f"{g.held_gpu_hours:.2f}", _pct(g.utilization), _pct(g.peak_activity), _pct(g.idle_share),
                     mem_s, sparkline(act), sparkline(mem, g.fb_total_mib or max([x or 0 for x in mem], default=1))])  # fmt: skip
    header = ["GPU", "UUID", "share", "GPU-h", "util", "peak", "idle", "peak mem / total",
              "activity over time", "memory over time"]  # fmt: skip
    return table(rows, header).splitlines()


def report(r: JobReport) -> str:
    out = [
        RULE,
        "gpuslo job report".center(80),
        RULE,
        *_header(r),
        "",
        "Overall utilization",
        RULE,
        *_overall(r),
    ]
    if r.gpus:
        out += ["", "Per GPU", RULE, *_per_gpu(r)]
    if r.starvation is not None:
        i = r.starvation
        out += ["", "Starvation", RULE,
                f"  incident opened {ts(i.opened)} UTC"
                + (f" (request {i.request_id}, after a requeue)" if r.request_id and i.request_id != r.request_id else "")
                + f", cause {i.cause}"
                + (f", scheduler reason {i.reason}" if i.reason else "")
                + (f", {i.free_gpus_at_open:g} GPUs free" if i.free_gpus_at_open is not None else "")
                + (f"; closed by {i.closed_by} at {ts(i.closed)} UTC" if i.closed is not None else "; still open")]  # fmt: skip
    a = r.rightsize
    if a is not None:
        what = (f"MIG {a.profile}: {a.give_back_gpu_hours:.2f} of {a.held_gpu_hours:.2f} GPU-hours to give back"
                if a.profile else f"no advice: {a.reason}")  # fmt: skip
        out += ["", "MIG right-sizing", RULE, f"  {what}"]
    out += ["", "Notes", RULE]
    out += [f"  * {n}" for n in r.notes] or ["  * nothing to point out"]
    return "\n".join(out)


def rightsizing(rz: Rightsizing) -> str:
    """Per account and profile, the totals, and why the other jobs got no advice."""
    out = [
        f"MIG right-sizing  {ts(rz.from_)} → {ts(rz.to)} UTC  (memory headroom {100 * rz.headroom:g} %)",
        "",
    ]
    if rz.accounts:
        out.append(table(
            [[a.account, a.profile, str(a.jobs), f"{a.held_gpu_hours:.2f}", f"{a.give_back_gpu_hours:.2f}"]
             for a in rz.accounts],
            ["account", "would fit", "jobs", "GPU-hours held", "GPU-hours to give back"],
        ))  # fmt: skip
        out.append("")
        out += [f"{a.account}: {'these ' + str(a.jobs) + ' jobs' if a.jobs != 1 else 'this job'} would have fit "
                f"{a.profile} slices: {a.give_back_gpu_hours:.2f} GPU-hours to give back" for a in rz.accounts]  # fmt: skip
    else:
        out.append("No job would have fit a smaller MIG slice.")
    out += [
        "",
        f"Total: {rz.jobs_advised} of {len(rz.jobs)} jobs, {rz.give_back_gpu_hours:.2f} GPU-hours to give back.",
    ]
    if rz.no_advice:
        out += ["", "Jobs without advice, by reason:"]
        out += [f"  {n:5d}  {reason}" for reason, n in rz.no_advice]
    return "\n".join(out)


def demo_lines(res: Any, sim: Any) -> list[str]:
    """The demo summary's lines for the per-job report and the right-sizing total: one job's report
    command to try (the one with the most allocated-idle GPU-hours) and the GPU-hours to give back."""
    store = res.store_dir
    out = []
    job = res.summary.top_idle[0].id if res.summary.top_idle else None
    if job is not None:
        out.append(f"job report: gpuslo job {job} --store {store}  (add --html job.html for the page)")
    rz = res.rightsize
    if rz is not None:
        per: dict[str, int] = {}
        for a in rz.accounts:
            per[a.profile] = per.get(a.profile, 0) + a.jobs
        fits = ", ".join(f"{n} × {p}" for p, n in sorted(per.items(), key=lambda x: (-x[1], x[0]))) or "none"
        out.append(f"right-size: {rz.jobs_advised} of {len(rz.jobs)} jobs would have fit a MIG slice ({fits}): "
                   f"{rz.give_back_gpu_hours:.1f} GPU-hours to give back  (gpuslo rightsize --store {store} "
                   f"--from {sim.start_ts:.0f} --to {sim.end_ts:.0f})")  # fmt: skip
    return out

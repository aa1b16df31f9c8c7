"""MIG right-sizing advice: from a job's peak framebuffer and peak activity, the smallest MIG
profile of its GPU model that would have held it, and the GPU-hours it would have given back;
summed per account ("these 40 jobs would have fit 1g.10gb slices: N GPU-hours to give back").

The rule (docs/operations.md, "MIG right-sizing"), one definition, as SQL
(:data:`JOB_ADVICE`), used by ``gpuslo rightsize``, the per-job report and the dashboard panel:

- A job is judged over its GPU samples in the window. A job is an id and its owner (user,
  account, queue): an id the samples name with another owner is another job. Only a job on exactly one GPU or one MIG
  instance at a time gets advice: a CUDA process uses one MIG instance, and MIG instances have no
  peer access to each other, so a multi-GPU job cannot be moved onto slices (its report still
  notes GPUs it left idle). GPUs held at a time: the most whose spans (first sample to the end
  of the last, in the window) overlap at one instant; a requeued job that ran on another GPU each
  run held one (it was refused as multi-GPU, counting every GPU it ever held), one that came back
  to a GPU it had left counts as holding both (conservative).
- Its GPU model is looked up in ``gpuslo/core/mig_profiles.yaml`` (NVIDIA's documented profiles per
  product); a model not listed there, or one whose framebuffer disagrees with the listed size by
  more than 10 % below / 15 % above, gets no advice, with that reason.
- Profile p fits when ``peak FB <= (1 - headroom) x p.memory`` (p.memory: its fraction of memory
  x the model's documented size, decimal GB, in MiB; headroom 10 % by default) and
  ``peak activity / p.compute <= 100 %`` (peak activity: the largest sampled activity as a
  fraction of the whole GPU: a MIG instance's own activity times its fraction; p.compute: its
  fraction of the SMs). Scaling activity by the compute fraction assumes the job's kernels would
  spread over all the SMs it had: conservative, as is using the peak (one sample interval) rather
  than the mean. Activity is stored as a 32-bit float: it may exceed p.compute by 1e-6.
- A slice takes ``f = max(compute fraction, memory fraction)`` of the GPU (a 1g.20gb takes a
  quarter of the memory although 1/7 of the SMs). The advice is the fitting profile with the
  smallest f (then memory, then compute) whose f is below the fraction of a GPU the job held
  (``held GPU-seconds / seconds held``: 1 for a whole GPU, its share on a shared GPU, the
  instance's fraction on MIG). A job already on a MIG instance may so be advised a smaller one.
- On a GPU shared with other holders, activity and memory are the whole GPU's (every holder's):
  an upper bound of the job's own, so the advice stays conservative.
- GPU-hours to give back: ``N = held GPU-hours - f x hours held`` (hours held: the capacity
  seconds of the GPU while the job held it); for a whole GPU that is ``held x (1 - f)``.
  Held GPU-hours are the allocated GPU-hours of docs/metrics.md (capacity x share).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from gpuslo.core import mig
from gpuslo.ingest.sqltext import fill, literal
from gpuslo.ingest.store import Store
from gpuslo.rules import rawcover
from gpuslo.rules.sql import CAPACITY_SAMPLES, JOIN_SETTINGS, MAX_INTERVAL_S

DEFAULT_HEADROOM = 0.10
MIB = 2**20
ACTIVITY_TOLERANCE = 1e-6  # activity is a Float32 column: 1/7 stored is 1/7 + 6.4e-9
FB_RATIO = (0.90, 1.15)  # reported framebuffer / documented size for the name to be believed


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    compute: float  # fraction of the SMs
    memory: float  # fraction of the memory
    memory_mib: float  # memory x the model's documented size

    @property
    def fraction(self) -> float:
        """What the slice takes of the GPU: its share of the resource it takes more of."""
        return max(self.compute, self.memory)


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str
    match: str
    memory_gb: float
    profiles: tuple[Profile, ...]  # smallest first

    @property
    def memory_mib(self) -> float:
        return self.memory_gb * 1e9 / MIB


@cache
def models() -> tuple[GpuModel, ...]:
    """``gpuslo/core/mig_profiles.yaml``, read once: the models in match order, profiles smallest first."""
    out = []
    for e in mig.table().models:
        re.compile(e.match)
        profs = [
            Profile(
                name,
                c / e.compute_slices,
                mm / e.memory_slices,
                mm / e.memory_slices * e.memory_gb * 1e9 / MIB,
            )
            for name, (c, mm) in e.profiles.items()
        ]
        profs.sort(key=lambda p: (p.fraction, p.memory, p.compute))
        out.append(GpuModel(e.name, e.match, e.memory_gb, tuple(profs)))
    return tuple(out)


def model_for(name: str) -> GpuModel | None:
    """The first listed model whose pattern the NVML/DCGM model name matches (as ClickHouse's
    ``match`` finds it: RE2, case-insensitive)."""
    return next((m for m in models() if re.search(m.match, name, re.IGNORECASE)), None)


# ---------------------------------------------------------------------------- the rule as SQL
def _model_index() -> str:
    """SQL: the 1-based index of the job's model in :func:`models` (0: none listed)."""
    arms = ", ".join(f"match(model, {literal('(?i)' + m.match)}), {i}" for i, m in enumerate(models(), 1))
    return f"multiIf(model = '', 0, {arms}, 0)"


def _profiles_array() -> str:
    """SQL: every profile as (model index, name, compute, memory MiB, fraction), smallest first per model."""
    rows = [
        f"(toUInt8({i}), {literal(p.name)}, toFloat64({p.compute!r}), toFloat64({p.memory_mib!r}), toFloat64({p.fraction!r}))"
        for i, m in enumerate(models(), 1)
        for p in m.profiles
    ]
    return "[" + ", ".join(rows) + "]"


def _model_memory() -> str:
    return "[" + ", ".join(f"toFloat64({m.memory_mib!r})" for m in models()) + "]"


def _model_names() -> str:
    return "[" + ", ".join(literal(m.name) for m in models()) + "]"


# Per holder and GPU series (one GPU or MIG instance): held GPU-seconds (capacity x share, the
# allocated seconds of docs/metrics.md) and the capacity seconds held, from the engine's
# capacity view; the peaks, model and profile from the raw rows of the same window.
_SERIES = f"""
SELECT cluster, id, user, account, queue, node, gpu, mig_gi, mig_ci,
    any(name) AS name, max(pool) AS pool,
    sum(cap_s * share) AS held_s,
    sum(if(gpu_fraction > 0, cap_s / gpu_fraction, 0)) AS time_s,
    min(toFloat64(ts)) AS first_t, max(toFloat64(ts) + interval_s) AS last_t
FROM ({CAPACITY_SAMPLES})
ARRAY JOIN alloc_ids AS id, alloc_names AS name, alloc_users AS user, alloc_accounts AS account,
    alloc_queues AS queue, alloc_shares AS share
WHERE toFloat64(ts) + interval_s > {{from:Float64}} AND toFloat64(ts) < {{to:Float64}}
  AND ({{job:String}} = '' OR id = {{job:String}})
GROUP BY cluster, id, user, account, queue, node, gpu, mig_gi, mig_ci
"""
_PEAKS = f"""
SELECT cluster, id, user, account, queue, node, gpu, mig_gi, mig_ci,
    argMax(model, ts) AS model, argMax(mig_profile, ts) AS mig_profile,
    max(DCGM_FI_DEV_FB_USED) AS peak_fb_mib,
    maxIf(DCGM_FI_DEV_FB_TOTAL, mig_gi < 0) AS fb_total_mib,
    max(toFloat64(activity) * if(mig_gi >= 0, toFloat64(gpu_fraction), 1.)) AS peak_activity
FROM gpu_samples FINAL
ARRAY JOIN alloc_ids AS id, alloc_users AS user, alloc_accounts AS account, alloc_queues AS queue
WHERE ts >= toDateTime64({{from:Float64}} - {MAX_INTERVAL_S}, 3, 'UTC') AND ts < toDateTime64({{to:Float64}}, 3, 'UTC')
  AND toFloat64(ts) + interval_s > {{from:Float64}}
  AND ({{cluster:String}} = '' OR cluster = {{cluster:String}})
  AND ({{job:String}} = '' OR has(alloc_ids, {{job:String}}))
  AND ({{job:String}} = '' OR id = {{job:String}})
GROUP BY cluster, id, user, account, queue, node, gpu, mig_gi, mig_ci
"""
# a job is an id and its owner: an id the rows name with another user, account or queue (a
# Slurm job id used again after the controller's state was reset) is another job
_JOBS = f"""
SELECT s.cluster AS cluster, s.id AS id, any(s.name) AS name, s.user AS user,
    s.account AS account, s.queue AS queue, max(s.pool) AS pool,
    count() AS series, sum(s.held_s) AS held_s, sum(s.time_s) AS time_s,
    groupArray((s.first_t, s.last_t)) AS spans,
    arrayMax(arrayMap(x -> arrayCount(y -> y.1 <= x.1 AND x.1 < y.2, spans), spans)) AS gpus,
    any(p.model) AS model, uniqExact(p.model) AS models, any(p.mig_profile) AS mig_profile,
    max(p.peak_fb_mib) AS peak_fb_mib, max(p.fb_total_mib) AS fb_total_mib,
    max(p.peak_activity) AS peak_activity
FROM ({_SERIES}) AS s
LEFT JOIN ({_PEAKS}) AS p
ON s.cluster = p.cluster AND s.id = p.id AND s.user = p.user AND s.account = p.account AND s.queue = p.queue
   AND s.node = p.node AND s.gpu = p.gpu AND s.mig_gi = p.mig_gi AND s.mig_ci = p.mig_ci
GROUP BY s.cluster, s.id, s.user, s.account, s.queue
"""

# One row per job: its figures, the profile (``''``: none) and, without one, the reason.
_ADVICE = """
SELECT * EXCEPT (fb_, act_, spans) FROM (
SELECT *,
    {model_index} AS model_index,
    held_s / nullIf(time_s, 0) AS held_fraction,
    ifNull(peak_fb_mib, inf) AS fb_, ifNull(peak_activity, inf) AS act_,
    arrayFirst(p -> p.1 = model_index AND p.5 + 1e-9 < ifNull(held_fraction, 0)
                    AND fb_ <= (1 - {headroom:Float64}) * p.4 AND act_ <= p.3 + {tol},
               {profiles}) AS fit,
    if(model_index > 0, {names}[model_index], '') AS mig_table,
    if(model_index > 0 AND fb_total_mib IS NOT NULL,
       fb_total_mib / {memory}[model_index], NULL) AS fb_ratio,
    multiIf(gpus > 1, concat('multi-GPU job (', toString(gpus), ' GPUs): one process uses one MIG instance'),
            model = '', 'the samples name no GPU model',
            models > 1, 'its GPU rows name several GPU models',
            model_index = 0, concat('no MIG profiles listed for GPU model ', model),
            fb_ratio IS NOT NULL AND (fb_ratio < {lo} OR fb_ratio > {hi}),
                concat('GPU model ', model, ' reports ', toString(round(fb_total_mib / 1024, 1)),
                       ' GiB, not the ', mig_table, ' the name suggests'),
            peak_fb_mib IS NULL, 'no framebuffer samples (DCGM_FI_DEV_FB_USED)',
            peak_activity IS NULL, 'no activity samples',
            time_s <= 0, 'no capacity seconds held in the window',
            fit.2 = '', 'no smaller MIG profile holds its peak memory and activity',
            '') AS reason,
    if(reason = '', fit.2, '') AS profile,
    if(reason = '', fit.5, NULL) AS slice_fraction,
    if(reason = '', greatest(0., held_s - fit.5 * time_s), 0.) AS give_back_s
FROM ({jobs})
)
"""


def _advice(jobs: str) -> str:
    lo, hi = FB_RATIO
    return fill(
        _ADVICE,
        model_index=_model_index(),
        profiles=_profiles_array(),
        names=_model_names(),
        memory=_model_memory(),
        tol=literal(ACTIVITY_TOLERANCE),
        lo=literal(lo),
        hi=literal(hi),
        jobs=jobs,
    )


JOB_ADVICE = _advice(_JOBS) + JOIN_SETTINGS

# Per account and profile: the jobs advised, their held GPU-hours and the GPU-hours to give back
# (the dashboard panel's query, and the per-account figures).
ACCOUNT_ADVICE = f"""
SELECT account, profile, count() AS jobs, sum(held_s) / 3600 AS held_gpu_hours,
    sum(give_back_s) / 3600 AS give_back_gpu_hours
FROM ({_advice(_JOBS)})
WHERE profile != ''
GROUP BY account, profile
ORDER BY give_back_gpu_hours DESC, account, profile
{JOIN_SETTINGS}
"""


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True)
class JobAdvice:
    """One job's right-sizing: the profile (``None``: no advice, and ``reason`` says why)."""

    cluster: str
    id: str
    name: str
    user: str
    account: str
    queue: str
    gpus: int  # the most GPUs (or MIG instances) it held at one time
    model: str
    mig_profile: str | None  # the instance it ran on, if it ran on MIG
    held_gpu_hours: float
    peak_fb_mib: float | None
    peak_activity: float | None  # fraction of the whole GPU
    profile: str | None
    slice_fraction: float | None
    give_back_gpu_hours: float
    reason: str | None
    pool: str = ""  # the pool of its GPU's node (of a job on several, the greatest name)


@dataclass(frozen=True, slots=True)
class AccountAdvice:
    """These ``jobs`` of ``account`` would have fit ``profile`` slices: ``give_back_gpu_hours`` of
    their ``held_gpu_hours`` to give back."""

    account: str
    profile: str
    jobs: int
    held_gpu_hours: float
    give_back_gpu_hours: float


@dataclass(frozen=True, slots=True)
class Rightsizing:
    """The advice for a window: per job, per account and profile, and the totals."""

    from_: float = field(metadata={"json": "from"})
    to: float
    cluster: str | None
    headroom: float
    jobs_advised: int
    give_back_gpu_hours: float
    accounts: tuple[AccountAdvice, ...]
    jobs: tuple[JobAdvice, ...]  # every job seen, advised or not
    no_advice: tuple[tuple[str, int], ...]  # reason, jobs (the most common first)


def _params(frm: float, to: float, cluster: str, job: str, headroom: float) -> dict[str, Any]:
    if not 0 <= headroom < 1 or math.isnan(headroom):
        raise ValueError(f"headroom {headroom!r} must be in [0, 1)")
    return {"from": float(frm), "to": float(to), "cluster": cluster, "job": job, "headroom": float(headroom)}


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or math.isnan(x) else round(float(x), nd)


def _job(r: dict[str, Any]) -> JobAdvice:
    return JobAdvice(
        cluster=r["cluster"], id=r["id"], name=r["name"], user=r["user"], account=r["account"],
        queue=r["queue"], gpus=int(r["gpus"]), model=r["model"] or "", mig_profile=r["mig_profile"] or None,
        held_gpu_hours=_r(r["held_s"] / 3600) or 0.0, peak_fb_mib=_r(r["peak_fb_mib"], 1),
        peak_activity=_r(r["peak_activity"], 6), profile=r["profile"] or None,
        slice_fraction=_r(r["slice_fraction"], 6), give_back_gpu_hours=_r(r["give_back_s"] / 3600) or 0.0,
        reason=r["reason"] or None, pool=r["pool"],
    )  # fmt: skip


def job_advice(
    store: Store, frm: float, to: float, cluster: str = "", job: str = "", headroom: float = DEFAULT_HEADROOM
) -> list[JobAdvice]:
    """Every job in the window (or the one named ``job``), with its advice."""
    rows = store.query(JOB_ADVICE, _params(frm, to, cluster, job, headroom))
    return sorted(
        (_job(r) for r in rows),
        key=lambda j: (-j.give_back_gpu_hours, j.cluster, j.id, j.account, j.user, j.queue),
    )


def by_account(jobs: list[JobAdvice]) -> tuple[AccountAdvice, ...]:
    """Per account and profile, the advised jobs summed (the most GPU-hours to give back first)."""
    acc: dict[tuple[str, str], list[JobAdvice]] = {}
    for j in jobs:
        if j.profile is not None:
            acc.setdefault((j.account, j.profile), []).append(j)
    out = [
        AccountAdvice(a, p, len(js), round(sum(j.held_gpu_hours for j in js), 4),
                      round(sum(j.give_back_gpu_hours for j in js), 4))
        for (a, p), js in acc.items()
    ]  # fmt: skip
    return tuple(sorted(out, key=lambda x: (-x.give_back_gpu_hours, x.account, x.profile)))


def rightsizing(
    store: Store, frm: float, to: float, cluster: str = "", headroom: float = DEFAULT_HEADROOM
) -> Rightsizing:
    """The advice for [from, to): per job, per account (:func:`advice_by_account`), the totals.
    Refused (:class:`rules.rawcover.RawRowsGone`) where the raw rows of part of the window are gone."""
    rawcover.check(
        store, frm, to, cluster, "the advice needs the raw rows (each job's peak memory and activity)"
    )
    jobs = job_advice(store, frm, to, cluster, "", headroom)
    reasons: dict[str, int] = {}
    for j in jobs:
        if j.reason:
            key = j.reason.split(" (")[0] if j.reason.startswith("multi-GPU") else j.reason
            reasons[key] = reasons.get(key, 0) + 1
    advised = [j for j in jobs if j.profile is not None]
    return Rightsizing(
        from_=frm, to=to, cluster=cluster or None, headroom=headroom, jobs_advised=len(advised),
        give_back_gpu_hours=round(sum(j.give_back_gpu_hours for j in advised), 4), accounts=by_account(jobs),
        jobs=tuple(jobs), no_advice=tuple(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
    )  # fmt: skip


def advice_by_account(
    store: Store, frm: float, to: float, cluster: str = "", headroom: float = DEFAULT_HEADROOM
) -> tuple[AccountAdvice, ...]:
    """Per account and profile: the jobs that would have fit that MIG slice and the GPU-hours they
    would have given back (for the chargeback)."""
    return rightsizing(store, frm, to, cluster, headroom).accounts


# Per account, every job judged: how many would have fit a slice (which ones), their held
# GPU-hours and the GPU-hours to give back (the Workloads dashboard's right-sizing panel).
ACCOUNT_SUMMARY = f"""
SELECT account, count() AS jobs, countIf(profile != '') AS would_fit,
    arrayStringConcat(arraySort(groupUniqArrayIf(profile, profile != '')), ', ') AS profiles,
    round(sum(held_s) / 3600, 2) AS held_gpu_h, round(sum(give_back_s) / 3600, 2) AS give_back_gpu_h
FROM ({_advice(_JOBS)})
GROUP BY account
ORDER BY give_back_gpu_h DESC, account
{JOIN_SETTINGS}
"""

"""The per-job report for a job's owner (``gpuslo job ID``): what Princeton's jobstats shows a
Slurm user, for a Slurm job or a Kubernetes pod, from the same numbers the platform reports.

- The job is found by its id: a Slurm job id, a pod's ``namespace/name`` (or its UID), in the
  scheduler events and in the GPU samples' holders. One id matching several jobs (clusters,
  schedulers, a pod name used again) is an error listing them (:class:`JobLookupError`).
- Its GPUs (node, index, UUID, MIG instance, share) with held, active and idle GPU-hours, from
  the engine's own capacity view (``rules.sql.CAPACITY_SAMPLES``, or ``IDLE_RUNS`` with
  ``min_idle_s``) and its terms (``rules.measures.OWNER_TERMS``): the idle share is the job's
  allocated-idle GPU-hours over its allocated GPU-hours, exactly as ``rules eval`` counts them.
- Activity and memory per GPU over time (the raw samples, per bucket), peaks and means.
- Its wait: submit to start, and the starvation incident of the engine's own query
  (``rules.evaluate.starvation``) with its cause, when it starved.
- The MIG right-sizing advice (``rules.rightsize``) and plain-language notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpuslo.core.display import pct
from gpuslo.ingest.store import Store
from gpuslo.rules import energy as en
from gpuslo.rules import measures as m
from gpuslo.rules import rawcover, sql
from gpuslo.rules import rightsize as rs
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import _incident, starvation, whole_gpus
from gpuslo.rules.model import Incident

MAX_ID_LEN = 256  # the wire's bound on a holder / request id
MIB_PER_GIB = 1024.0
NOTE_MEMORY_SHARE = 0.25  # "memory far below what was held": a peak under a quarter of it
NOTE_IDLE_SHARE = 0.25  # an idle share worth a note


class JobLookupError(ValueError):
    """No job, or several, answer to the id; ``matches`` lists them (several)."""

    def __init__(self, message: str, matches: tuple[JobRef, ...] = ()) -> None:
        super().__init__(message)
        self.matches = matches


@dataclass(frozen=True, slots=True)
class JobRef:
    """One job the id names: its scheduler request (if the events saw it) and its GPU holder id."""

    cluster: str
    scheduler: str  # slurm, k8s; "" when only GPU samples name it
    request_id: str | None
    holder_id: str  # the id its GPU samples carry (Slurm job id; namespace/pod)
    name: str
    user: str
    account: str
    queue: str
    submitted: float | None
    started: float | None
    ended: float | None
    end_event: str | None  # end or cancel
    end_reason: str | None
    gpus_requested: float | None
    first_sample: float | None
    last_sample: float | None
    last_event: float | None
    request_ids: tuple[str, ...] = ()  # every request of the job: its runs' (ID, ID#2, ...)

    def describe(self) -> str:
        from datetime import UTC, datetime

        when = self.submitted if self.submitted is not None else self.first_sample
        at = datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%d %H:%M") if when is not None else "-"
        rid = f" request {self.request_id}" if self.request_id and self.request_id != self.holder_id else ""
        return (f"cluster {self.cluster!r} {self.scheduler or 'samples only'} {self.holder_id!r}{rid} "
                f"(name {self.name!r}, user {self.user!r}, from {at} UTC)")  # fmt: skip


# a Slurm job's requests: its first run's (the job id) and the waits after its requeues (ID#2...),
# and a Kueue Workload's: its UID's and the waits after its evictions (UID#2..., agent/kueue.py),
# one job here (agent/slurm.py request_id), asked by any of them (an id with '#' names the job
# that had that request: not the same id's job in another cluster, and not the job 'ID' for an
# 'ID#x' no request had): submitted at its first submit, ended at its last run's
# end (by run number), none while that run waits or runs (a run requeued before it was seen running
# ends with ``end`` REQUEUED: the latest end of any run read a job queued or running again as ended)
_EVENTS = """
SELECT cluster, scheduler, job_request AS request_id,
    countIf(event = 'submit') AS submits,
    if(submits > 0, argMinIf(name, ts, event = 'submit'), any(name)) AS e_name,
    if(submits > 0, argMinIf(user, ts, event = 'submit'), any(user)) AS e_user,
    if(submits > 0, argMinIf(account, ts, event = 'submit'), any(account)) AS e_account,
    if(submits > 0, argMinIf(queue, ts, event = 'submit'), any(queue)) AS e_queue,
    if(submits > 0, toNullable(minIf(toFloat64(ts), event = 'submit')), NULL) AS submitted,
    if(countIf(event = 'start') > 0, toNullable(minIf(toFloat64(ts), event = 'start')), NULL) AS started,
    if(countIf(event IN ('end', 'cancel')) > 0 AND maxIf(attempt, event IN ('end', 'cancel')) = max(attempt),
        toNullable(argMaxIf(toFloat64(ts), (attempt, ts), event IN ('end', 'cancel'))), NULL) AS ended,
    if(isNull(ended), '', argMaxIf(event, (attempt, ts), event IN ('end', 'cancel'))) AS end_event,
    if(isNull(ended), '', argMaxIf(reason, (attempt, ts), event IN ('end', 'cancel'))) AS end_reason,
    if(submits > 0, toNullable(argMinIf(gpus_per_node * nodes, ts, event = 'submit')), NULL) AS gpus,
    max(toFloat64(ts)) AS last_event, arraySort(groupUniqArray(rid)) AS rids
FROM
(
    SELECT cluster, scheduler, event, ts, name, user, account, queue, reason, gpus_per_node, nodes,
        request_id AS rid,
        if(scheduler IN ('slurm', 'kueue'), splitByChar('#', request_id)[1], request_id) AS job_request,
        if(scheduler IN ('slurm', 'kueue') AND position(request_id, '#') > 0,
            toUInt32OrZero(splitByChar('#', request_id)[2]), 1) AS attempt
    FROM sched_events FINAL
    WHERE (request_id = {job:String} OR (scheduler IN ('k8s', 'kueue') AND name = {job:String})
           OR (scheduler IN ('slurm', 'kueue') AND startsWith(request_id, concat({job:String}, '#')))
           OR (scheduler IN ('slurm', 'kueue') AND position({job:String}, '#') > 0
               AND splitByChar('#', request_id)[1] = splitByChar('#', {job:String})[1]))
      AND ({cluster:String} = '' OR cluster = {cluster:String})
)
GROUP BY cluster, scheduler, job_request
HAVING position({job:String}, '#') = 0 OR countIf(rid = {job:String}) > 0
    OR countIf(scheduler IN ('k8s', 'kueue') AND name = {job:String}) > 0
ORDER BY cluster, scheduler, job_request
"""

# per holder id and owner: an id its samples name with another user, account or queue is another
# job (a Slurm id used again after the controller's state was reset), as rules.rightsize has it
_HOLDERS = """
SELECT cluster, id, any(sched) AS scheduler, any(name) AS name, user, account,
    queue, min(toFloat64(ts)) AS first, max(toFloat64(ts) + interval_s) AS last
FROM gpu_samples
ARRAY JOIN alloc_ids AS id, alloc_schedulers AS sched, alloc_names AS name, alloc_users AS user,
    alloc_accounts AS account, alloc_queues AS queue
WHERE hasAny(alloc_ids, {ids:Array(String)}) AND has({ids:Array(String)}, id)
  AND ({cluster:String} = '' OR cluster = {cluster:String})
  AND ts >= toDateTime64({lo:Float64}, 3, 'UTC') AND ts < toDateTime64({hi:Float64}, 3, 'UTC')
  AND toFloat64(ts) + interval_s > {after:Float64}
GROUP BY cluster, id, user, account, queue
ORDER BY cluster, id, first
"""

_LATEST = """
SELECT greatest(
    (SELECT ifNull(max(toFloat64(ts) + interval_s), 0) FROM gpu_samples WHERE cluster = {cluster:String}),
    (SELECT ifNull(max(toFloat64(ts)), 0) FROM sched_events WHERE cluster = {cluster:String})) AS latest
"""


def command(job_id: str, cluster: str = "") -> str:
    """The shell command that prints this job's report (what a notice about the job links to)."""
    import shlex

    return f"gpuslo job {shlex.quote(job_id)}" + (f" --cluster {shlex.quote(cluster)}" if cluster else "")


def check_id(job_id: str) -> str:
    """A job id as the user gave it, or a clear refusal (empty, or longer than any id the wire takes);
    any other string is looked up as it is (a query parameter: quotes and backslashes are data)."""
    if not job_id:
        raise JobLookupError("the job id is empty: give a Slurm job id or a pod's namespace/name")
    if len(job_id) > MAX_ID_LEN:
        raise JobLookupError(f"the job id is {len(job_id)} characters long; ids are at most {MAX_ID_LEN}")
    return job_id


def _at(t: float | None) -> str:
    from datetime import UTC, datetime

    return "-" if t is None else datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M")


def _requested(x: Any) -> float | None:
    g = _opt(x)
    return None if g is None else whole_gpus(g)


def _opt(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _overlaps(lo: float | None, hi: float | None, frm: float | None, to: float | None) -> bool:
    """Whether a life ``[lo, hi)`` (``None``: unbounded) meets the window ``[frm, to)``, both
    half-open as every window here (a job that ended at ``frm`` is not in it: it was, and the
    same id's job starting then in another cluster made the lookup ambiguous); a life of no
    length (ended as it started) is the instant ``lo``, in the window when ``frm <= lo < to``."""
    a = -math.inf if lo is None else lo
    b = math.inf if hi is None else hi
    return (to is None or a < to) and (frm is None or (b > frm if b > a else a >= frm))


def resolve(
    store: Store, job_id: str, cluster: str = "", frm: float | None = None, to: float | None = None
) -> JobRef:
    """The one job ``job_id`` names (in ``cluster``, alive in [frm, to) when given)."""
    check_id(job_id)
    rows = [
        {**r, **{k: r[f"e_{k}"] for k in ("name", "user", "account", "queue")}}
        for r in store.query(_EVENTS, {"job": job_id, "cluster": cluster})
    ]
    reqs = [r for r in rows if _overlaps(_opt(r["submitted"]) or _opt(r["started"]), _opt(r["ended"]), frm, to)]  # fmt: skip
    holder = {
        (r["cluster"], r["request_id"]): r["request_id"] if r["scheduler"] != "k8s" else r["name"]
        for r in reqs
    }
    ids = sorted({job_id, *holder.values()})
    lo = 0.0 if frm is None else frm - sql.MAX_INTERVAL_S
    hi = 4_291_747_200.0 if to is None else to
    p = {"ids": ids, "cluster": cluster, "lo": lo, "hi": hi, "after": -1.0 if frm is None else frm}
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in store.query(_HOLDERS, p):
        samples.setdefault((row["cluster"], row["id"]), []).append(row)
    refs: list[JobRef] = []
    claimed: set[tuple[str, str]] = set()
    for r in reqs:  # a scheduler's request is one job, whoever its samples name
        hid = holder[(r["cluster"], r["request_id"])]
        owners = samples.get((r["cluster"], hid), [])
        s = None
        if owners:
            s = {
                **owners[0],
                "first": min(o["first"] for o in owners),
                "last": max(o["last"] for o in owners),
            }
        claimed.add((r["cluster"], hid))
        refs.append(_ref(r, hid, s))
    for key, owners in samples.items():  # GPU samples alone: a job per owner
        refs += [_ref(None, o["id"], o) for o in owners if key not in claimed and o["id"] == job_id]
    where = f" in cluster {cluster!r}" if cluster else ""
    if frm is not None and to is not None:
        where += f" between {_at(frm)} and {_at(to)} UTC"
    elif frm is not None:  # one end given: "between 2026-11-30 00:00 and - UTC" it said
        where += f" from {_at(frm)} UTC on"
    elif to is not None:
        where += f" before {_at(to)} UTC"
    if not refs:
        raise JobLookupError(
            f"no job {job_id!r}{where}: no scheduler event and no GPU sample names it (a Slurm job id, "
            "or a pod's namespace/name or UID; --from/--to and --cluster narrow the search)"
        )
    if len(refs) > 1:
        lines = "\n".join(f"  - {x.describe()}" for x in refs)
        raise JobLookupError(
            f"{len(refs)} jobs answer to {job_id!r}{where}; narrow it with --cluster, --from/--to, or give "
            f"the pod's UID:\n{lines}",
            tuple(refs),
        )
    return refs[0]


def _ref(r: dict[str, Any] | None, hid: str, s: dict[str, Any] | None) -> JobRef:
    """A job from its scheduler request ``r`` and/or its samples' holder row ``s`` (one at least)."""
    src: dict[str, Any] = r if r is not None else (s or {})
    return JobRef(
        cluster=src["cluster"], scheduler=str(src["scheduler"]), request_id=r["request_id"] if r else None,
        holder_id=hid, name=src["name"], user=src["user"], account=src["account"], queue=src["queue"],
        submitted=_opt(r["submitted"]) if r else None, started=_opt(r["started"]) if r else None,
        ended=_opt(r["ended"]) if r else None, end_event=(r["end_event"] or None) if r else None,
        end_reason=(r["end_reason"] or None) if r else None, gpus_requested=_requested(r["gpus"]) if r else None,
        first_sample=_opt(s["first"]) if s else None, last_sample=_opt(s["last"]) if s else None,
        last_event=_opt(r["last_event"]) if r else None, request_ids=tuple(r["rids"]) if r else (),
    )  # fmt: skip


# ---------------------------------------------------------------------------- the report
@dataclass(frozen=True, slots=True)
class GpuPoint:
    """One bucket ``[t, t + bucket_s)`` of one GPU: mean activity, largest framebuffer used."""

    t: float
    activity: float | None
    fb_used_mib: float | None


@dataclass(frozen=True, slots=True)
class JobGpu:
    """One GPU (or MIG instance) the job held, and what it did with it."""

    node: str
    gpu: int
    uuid: str
    model: str
    mig_gi: int | None
    mig_ci: int | None
    mig_profile: str | None
    share: float  # the largest share of the GPU (or instance) the job held
    shared: bool  # other holders on it at some time: activity and memory are theirs too
    held_gpu_hours: float
    active_gpu_hours: float
    idle_gpu_hours: float
    idle_share: float | None
    utilization: float | None  # active / held
    peak_activity: float | None
    peak_fb_mib: float | None
    fb_total_mib: float | None
    samples: int
    activity_samples: int
    first_sample: float
    last_sample: float
    series: tuple[GpuPoint, ...]


@dataclass(frozen=True, slots=True)
class JobEnergy:
    """The job's GPU energy in the window, from :func:`gpuslo.rules.energy.holder_energy` (the
    chargeback's figure): its share of each GPU's energy, docs/metrics.md#energy-and-carbon."""

    kwh: float
    idle_kwh: float  # on its allocated-idle GPU-seconds
    estimated_kwh: float  # from POWER_USAGE x time where the energy counter could not say
    co2_g: float  # 0 where the config gives no grid intensity for the cluster


def _energy(store: Store, cfg: RulesConfig, ref: JobRef, lo: float, hi: float) -> JobEnergy:
    rows = en.holder_energy(store, lo, hi, cfg.idle_threshold, ref.cluster, cfg.min_idle_s, cfg.grid_intensity,
                            ids=[ref.holder_id])  # fmt: skip

    def total(f: str) -> float:
        return float(sum(getattr(r, f) for r in rows))

    return JobEnergy(kwh=_r(en.kwh(total("energy_j")), 6) or 0.0, idle_kwh=_r(en.kwh(total("energy_idle_j")), 6) or 0.0,
                     estimated_kwh=_r(en.kwh(total("energy_estimated_j")), 6) or 0.0,
                     co2_g=_r(total("co2_g"), 3) or 0.0)  # fmt: skip


@dataclass(frozen=True, slots=True)
class JobReport:
    """What ``gpuslo job`` prints (text, ``--json`` via :func:`gpuslo.rules.model.to_json`, ``--html``)."""

    cluster: str
    scheduler: str
    id: str
    request_id: str | None
    name: str
    user: str
    account: str
    queue: str
    from_: float = field(metadata={"json": "from"})
    to: float
    bucket_s: int
    submitted: float | None
    started: float | None
    ended: float | None
    end_state: str | None  # the scheduler's final word (COMPLETED, CANCELLED, ...)
    gpus_requested: float | None
    gpus: tuple[JobGpu, ...]
    held_gpu_hours: float
    active_gpu_hours: float
    idle_gpu_hours: float
    idle_share: float | None  # allocated-idle / allocated (docs/metrics.md, with min_idle_s)
    utilization: float | None
    peak_fb_mib: float | None
    wait_s: float | None  # submit to start (to leaving the queue, or to ``to``, if it never started)
    starvation: Incident | None  # the engine's starvation incident of this request, if it starved
    rightsize: rs.JobAdvice | None
    energy: JobEnergy | None  # rules.energy's, of this holder in the window (None: no GPU samples)
    idle_threshold: float
    min_idle_s: float
    notes: tuple[str, ...]


def _gpu_sums(cfg: RulesConfig) -> str:
    src, is_idle = (sql.IDLE_RUNS, "idle_ok") if cfg.min_idle_s > 0 else (sql.CAPACITY_SAMPLES, m.IDLE_TEST)
    return f"""
SELECT node, gpu, mig_gi, mig_ci,
    {m.sums(m.OWNER_TERMS, is_idle)},
    max(share) AS max_share, max(length(alloc_ids)) AS holders
FROM ({src})
ARRAY JOIN alloc_ids AS id, alloc_shares AS share, alloc_act_shares AS act_share
WHERE toFloat64(ts) + interval_s > {{from:Float64}} AND toFloat64(ts) < {{to:Float64}} AND id = {{job:String}}
GROUP BY node, gpu, mig_gi, mig_ci
{sql.JOIN_SETTINGS}
"""


_WINDOW = f"""has(alloc_ids, {{job:String}}) AND cluster = {{cluster:String}}
  AND ts >= toDateTime64({{from:Float64}} - {sql.MAX_INTERVAL_S}, 3, 'UTC') AND ts < toDateTime64({{to:Float64}}, 3, 'UTC')
  AND toFloat64(ts) + interval_s > {{from:Float64}}"""

GPU_DETAILS = f"""
SELECT node, gpu, mig_gi, mig_ci, argMax(uuid, ts) AS uuid, argMax(model, ts) AS model,
    argMax(mig_profile, ts) AS mig_profile, max(DCGM_FI_DEV_FB_USED) AS peak_fb_mib,
    max(DCGM_FI_DEV_FB_TOTAL) AS fb_total_mib, max(activity) AS peak_activity, count() AS samples,
    countIf(activity IS NOT NULL) AS activity_samples, min(toFloat64(ts)) AS first,
    max(toFloat64(ts) + interval_s) AS last
FROM gpu_samples FINAL
WHERE {_WINDOW}
GROUP BY node, gpu, mig_gi, mig_ci
ORDER BY node, gpu, mig_gi, mig_ci
"""

GPU_SERIES = f"""
SELECT node, gpu, mig_gi, mig_ci, toInt64(floor((greatest(toFloat64(ts), {{from:Float64}}) - {{from:Float64}}) / {{bucket:UInt32}})) AS b,
    avg(activity) AS activity, max(DCGM_FI_DEV_FB_USED) AS fb_used_mib
FROM gpu_samples FINAL
WHERE {_WINDOW}
GROUP BY node, gpu, mig_gi, mig_ci, b
ORDER BY node, gpu, mig_gi, mig_ci, b
"""


def grid(r: JobReport, g: JobGpu) -> list[GpuPoint | None]:
    """``g``'s series on the report's every bucket from ``from`` to ``to``: ``None`` where it has
    no sample (its agent down, or the job not on it then), so a gap reads as one, in time."""
    out: list[GpuPoint | None] = [None] * max(1, math.ceil((r.to - r.from_) / r.bucket_s))
    for p in g.series:
        k = round((p.t - r.from_) / r.bucket_s)
        if 0 <= k < len(out):
            out[k] = p
    return out


def bucket_s(frm: float, to: float, points: int = 60) -> int:
    """A bucket of whole seconds giving at most ``points`` buckets (at least 10 s)."""
    return max(10, math.ceil((to - frm) / points))


def window(store: Store, ref: JobRef, frm: float | None, to: float | None) -> tuple[float, float]:
    """The report's window: the given one, else the job's life (start, else submit, else its first
    sample; to its end, else its last sample or event; a job neither seen starting nor on a GPU,
    pending, to the newest data of its cluster; at least 1 s, for a job of no length). A job whose
    GPU samples show it running has started, seen or not: its window went to its cluster's newest
    data (a day for a 10-minute job the events never named, its series one point)."""
    lo = frm
    if lo is None:
        lo = next((x for x in (ref.started, ref.submitted, ref.first_sample) if x is not None), 0.0)
    hi = to
    if hi is None:
        hi = ref.ended
        if hi is None:
            seen = [x for x in (ref.last_sample, ref.last_event) if x is not None]
            latest = float(store.query(_LATEST, {"cluster": ref.cluster})[0]["latest"] or 0)
            pending = ref.started is None and _ran(ref) is None
            hi = max([*seen, latest]) if pending else max(seen, default=latest)
    return lo, hi if to is not None else max(hi, lo + 1.0)  # a window given is kept, under 1 s too


def _r(x: Any, nd: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), nd)


def _gpus(
    store: Store, cfg: RulesConfig, ref: JobRef, frm: float, to: float, bucket: int
) -> tuple[tuple[JobGpu, ...], tuple[float, float, float]]:
    """The job's GPUs, and its held, active and idle GPU-seconds (unrounded)."""
    p = {"from": frm, "to": to, "cluster": ref.cluster, "job": ref.holder_id, "idle": cfg.idle_threshold,
         "min_idle": float(cfg.min_idle_s), "bucket": bucket}  # fmt: skip
    key = ("node", "gpu", "mig_gi", "mig_ci")
    sums = {tuple(r[k] for k in key): r for r in store.query(_gpu_sums(cfg), p)}
    series: dict[tuple[Any, ...], list[GpuPoint]] = {}
    for r in store.query(GPU_SERIES, p):
        series.setdefault(tuple(r[k] for k in key), []).append(
            GpuPoint(frm + r["b"] * bucket, _r(r["activity"], 4), _r(r["fb_used_mib"], 1))
        )
    out = []
    total = [0.0, 0.0, 0.0]
    for d in store.query(GPU_DETAILS, p):
        k = tuple(d[x] for x in key)
        s = sums.get(k, {})
        held, active, idle = (float(s.get(n) or 0.0) for n in ("allocated_s", "active_s", "idle_s"))
        mig = d["mig_gi"] >= 0
        total = [total[0] + held, total[1] + active, total[2] + idle]
        out.append(JobGpu(
            node=d["node"], gpu=int(d["gpu"]), uuid=d["uuid"], model=d["model"], mig_gi=d["mig_gi"] if mig else None,
            mig_ci=d["mig_ci"] if mig else None, mig_profile=(d["mig_profile"] or None) if mig else None,
            share=_r(s.get("max_share"), 6) or 0.0, shared=int(s.get("holders") or 0) > 1,
            held_gpu_hours=_r(held / 3600) or 0.0, active_gpu_hours=_r(active / 3600) or 0.0,
            idle_gpu_hours=_r(idle / 3600) or 0.0, idle_share=_r(idle / held, 6) if held > 0 else None,
            utilization=_r(active / held, 6) if held > 0 else None, peak_activity=_r(d["peak_activity"], 6),
            peak_fb_mib=_r(d["peak_fb_mib"], 1), fb_total_mib=_r(d["fb_total_mib"], 1), samples=int(d["samples"]),
            activity_samples=int(d["activity_samples"]), first_sample=float(d["first"]), last_sample=float(d["last"]),
            series=tuple(series.get(k, ())),
        ))  # fmt: skip
    return tuple(out), (total[0], total[1], total[2])


def _starvation(store: Store, cfg: RulesConfig, ref: JobRef, to: float) -> Incident | None:
    """The engine's incident (rules.evaluate.starvation) of this job's requests, if one starved:
    of a requeued job's runs (``ID``, ``ID#2``...) the one that waited longest. Only its first
    run's was looked for: a job that starved after its requeue read as one that never did."""
    if ref.request_id is None or ref.submitted is None:
        return None
    ids = set(ref.request_ids) or {ref.request_id}
    qto = ref.ended + 1.0 if ref.ended is not None else max(to, ref.submitted + 1.0)
    found = [
        _incident(i, qto)
        for i in starvation(store, ref.submitted, qto, cfg, ref.cluster)
        if i["request_id"] in ids and i["scheduler"] == ref.scheduler
    ]
    return min(found, key=lambda i: (-(i.wait_s or 0.0), i.opened), default=None)


def _ran(ref: JobRef) -> float | None:
    """The job's first GPU sample, from its submit on (samples before it are an earlier job's
    under the same id: a Slurm id used again)."""
    s = ref.first_sample
    return s if s is not None and (ref.submitted is None or s >= ref.submitted) else None


def _wait(ref: JobRef, to: float) -> float | None:
    """Submit to start: to its first GPU sample (from submit on) when no start was seen (it held
    GPUs: it had started), else to its leaving the queue, else to ``to``."""
    if ref.submitted is None:
        return None
    left = next((x for x in (ref.started, _ran(ref), ref.ended) if x is not None), None)
    return _r((left if left is not None else to) - ref.submitted, 3)


def report(
    store: Store, cfg: RulesConfig, ref: JobRef, frm: float | None = None, to: float | None = None,
    headroom: float = rs.DEFAULT_HEADROOM, points: int = 60,
) -> JobReport:  # fmt: skip
    """The report of the job ``ref`` over [frm, to) (default: its life, :func:`window`). Refused
    (:class:`rules.rawcover.RawRowsGone`) where the raw rows of part of that window are gone."""
    lo, hi = window(store, ref, frm, to)
    rawcover.check(store, lo, hi, ref.cluster, "a job's report needs the raw rows (its GPUs' samples)")
    bucket = bucket_s(lo, hi, points)
    gpus, (held_s, active_s, idle_s) = _gpus(store, cfg, ref, lo, hi, bucket)
    held, active, idle = held_s / 3600, active_s / 3600, idle_s / 3600
    advice = rs.job_advice(store, lo, hi, ref.cluster, ref.holder_id, headroom) if gpus else []
    peaks = [g.peak_fb_mib for g in gpus if g.peak_fb_mib is not None]
    rep = JobReport(
        cluster=ref.cluster, scheduler=ref.scheduler, id=ref.holder_id, request_id=ref.request_id, name=ref.name,
        user=ref.user, account=ref.account, queue=ref.queue, from_=lo, to=hi, bucket_s=bucket,
        submitted=ref.submitted, started=ref.started, ended=ref.ended, end_state=ref.end_reason or ref.end_event,
        gpus_requested=ref.gpus_requested, gpus=gpus, held_gpu_hours=round(held, 4), active_gpu_hours=round(active, 4),
        idle_gpu_hours=round(idle, 4), idle_share=_r(idle / held, 6) if held > 0 else None,
        utilization=_r(active / held, 6) if held > 0 else None, peak_fb_mib=max(peaks) if peaks else None,
        wait_s=_wait(ref, hi), starvation=_starvation(store, cfg, ref, hi),
        rightsize=advice[0] if advice else None, energy=_energy(store, cfg, ref, lo, hi) if gpus else None,
        idle_threshold=cfg.idle_threshold, min_idle_s=cfg.min_idle_s,
        notes=(),
    )  # fmt: skip
    from dataclasses import replace

    return replace(rep, notes=notes(rep))


# ---------------------------------------------------------------------------- plain language
def gib(mib: float) -> str:
    return f"{mib / MIB_PER_GIB:.1f} GiB"


def held_memory_mib(g: JobGpu) -> float | None:
    """The framebuffer the job held on ``g``: a MIG instance's own, else the GPU's times its share."""
    if g.fb_total_mib is None:
        return None
    return g.fb_total_mib * (g.share if g.mig_gi is None else 1.0)


def _where(g: JobGpu) -> str:
    mig = f" MIG {g.mig_profile or 'instance'} (gi {g.mig_gi})" if g.mig_gi is not None else ""
    return f"GPU {g.gpu}{mig} on {g.node}"


def _pct(x: float) -> str:
    return pct(x, 0)


def notes(r: JobReport) -> tuple[str, ...]:
    """The plain-language notes, most useful first."""
    out: list[str] = []
    if not r.gpus:
        if r.started is None and r.ended is None:
            out.append("No GPU samples: the job has not started (it is still pending).")
        elif r.started is None:
            out.append("No GPU samples: the job left the queue without starting.")
        else:
            out.append("No GPU samples name this job in the window: its nodes sent none (no agent there?), "
                       "or it ran between two samples.")  # fmt: skip
    unused = [g for g in r.gpus if g.activity_samples and (g.peak_activity or 0.0) < r.idle_threshold]
    if unused and len(unused) == len(r.gpus):
        out.append(f"The job never used its GPU{'s' if len(r.gpus) > 1 else ''}: activity stayed below "
                   f"{_pct(r.idle_threshold)} the whole time ({r.held_gpu_hours:.2f} GPU-hours held).")  # fmt: skip
    elif unused:
        # a job that held one GPU at a time (requeued onto another) needs no fewer: its runs there idled
        one_at_a_time = r.rightsize is not None and r.rightsize.gpus == 1
        fix = ("It held one at a time (a run on each): check why those runs left theirs idle."
               if one_at_a_time else "Request fewer GPUs, or check that the code uses all of them.")  # fmt: skip
        out.append(f"{len(unused)} of its {len(r.gpus)} GPUs showed no activity (below {_pct(r.idle_threshold)} "
                   f"throughout): {', '.join(_where(g) for g in unused)}. {fix}")  # fmt: skip
    if r.idle_share is not None and r.idle_share >= NOTE_IDLE_SHARE and len(unused) < len(r.gpus):
        out.append(f"Its GPUs were idle for {_pct(r.idle_share)} of the GPU time held "
                   f"({r.idle_gpu_hours:.2f} of {r.held_gpu_hours:.2f} GPU-hours).")  # fmt: skip
    low: list[tuple[JobGpu, float]] = []
    for g in r.gpus:
        h = held_memory_mib(g)
        if g.peak_fb_mib is not None and h and g.peak_fb_mib < NOTE_MEMORY_SHARE * h:
            low.append((g, h))
    if len(low) == 1 or (low and len(low) < len(r.gpus)):
        out += [f"Memory far below what was held on {_where(g)}: peak {gib(g.peak_fb_mib or 0)} of {gib(h)}."
                for g, h in low]  # fmt: skip
    elif low:
        g, h = max(low, key=lambda x: x[0].peak_fb_mib or 0)
        out.append(f"Memory far below what was held on all {len(low)} GPUs: peak {gib(g.peak_fb_mib or 0)} of "
                   f"{gib(h)} at most, on {_where(g)}.")  # fmt: skip
    if any(g.shared for g in r.gpus):
        out.append("A GPU was shared with other jobs: its activity and memory figures are the whole GPU's, "
                   "every holder's together.")  # fmt: skip
    a = r.rightsize
    if a is not None and a.profile:
        fb = gib(a.peak_fb_mib) if a.peak_fb_mib is not None else "-"
        act = _pct(a.peak_activity) if a.peak_activity is not None else "-"
        out.append(f"This job would have fitted a MIG {a.profile} slice (peak {fb} of memory, peak activity {act} "
                   f"of the GPU): {a.give_back_gpu_hours:.2f} of its {a.held_gpu_hours:.2f} GPU-hours could "
                   "have gone to others.")  # fmt: skip
    if r.starvation is not None:
        i = r.starvation
        free = f"; {i.free_gpus_at_open:g} GPUs free at the time" if i.free_gpus_at_open is not None else ""
        why = {"capacity": "not enough free GPUs in its pool",
               "fragmentation": "enough free GPUs, but no placement of its per-node shape",
               "policy": "a node could have hosted it, but priority, fair-share, quota or a reservation held it"}  # fmt: skip
        run = (
            f" after its requeue (request {i.request_id})"
            if r.request_id and i.request_id != r.request_id
            else ""
        )
        out.append(f"It starved{run}: waited {(i.wait_s or 0) / 60:.0f} min; cause {i.cause} ({why[i.cause]}{free}"
                   f"{'; the scheduler said ' + i.reason if i.reason else ''}).")  # fmt: skip
    return tuple(out)

"""The idle-reclaim loop, part one: the holders (Slurm jobs, pods) idle without a break for
longer than their queue's threshold, and the notice each one's owner gets.

A holder is idle at ``now`` when every GPU (or MIG instance) it holds has been idle in one
unbroken run up to its latest sample, the run judged as ``min_idle_s`` judges it
(:data:`rules.sql.IDLE_RUNS`): a sample is idle when the holder's activity on what it holds
(:data:`rules.measures.HOLDER_ACTIVITY`: the GPU's, unless the agent measured a shared GPU's
split among its holders, docs/metrics.md) is below the idle threshold (a sample without
activity is not idle: no data never condemns a job), and a run
breaks at an active sample or at a gap longer than twice the sampling interval. So a short
pause resets nothing it should not: it is an idle run too short to count, and one active
sample ends it. The holder's idle run starts at the latest start among its GPUs' runs; it is
``idle_for_s`` long, and ``idle_gpu_hours`` is its GPUs (their shares) × that time.

Its run is read back at most ``reclaim.lookback_s``: a run that began before is
``clipped``, its time and GPU-hours lower bounds (the notice says "at least").

A holder still holds while it is in its node's latest samples (so an ingest lag does not
resolve its notice: it is judged on what has arrived) and the scheduler has not reported its
current request ended (a Slurm job requeued runs again as request ``ID#N``; a pod's request is
its UID, found by the ``namespace/name`` its samples carry); ``data_end`` says how far that goes (the action refuses stale data). Notices are alerts through the one
alert engine (:class:`rules.alerts.Engine`): new → firing, re-sent every ``reclaim.resend_s``,
resolved when the holder is active again or gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from gpuslo.ingest.store import Store
from gpuslo.rules.alerts import Alert
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.measures import HOLDER_ACTIVITY

ALERTNAME = "GpusloIdleHolder"

_SERIES = "PARTITION BY cluster, id, node, gpu, mig_gi, mig_ci"

# one row per holder seen in [now - lookback, now): its GPUs' current runs
IDLE_HOLDERS = f"""
SELECT cluster, id, any(scheduler) AS scheduler, anyIf(name, name != '') AS name, anyIf(user, user != '') AS user,
    anyIf(account, account != '') AS account, anyIf(queue, queue != '') AS queue,
    min(run_idle) AS all_idle, max(since) AS idle_since, max(last_end) AS last_end,
    max(last_ts >= node_latest) AS present, max(node_end) AS data_end, min(first_ts) AS first_seen,
    sum(share_now) AS gpus, max(max_interval) AS max_interval
FROM
(
    SELECT cluster, id, node, gpu, mig_gi, mig_ci,
        any(scheduler) AS scheduler, anyIf(name, name != '') AS name, anyIf(user, user != '') AS user,
        anyIf(account, account != '') AS account, anyIf(queue, queue != '') AS queue, min(is_idle) AS run_idle, min(toFloat64(ts)) AS since,
        max(toFloat64(ts) + interval_s) AS last_end, max(toFloat64(ts)) AS last_ts,
        any(first_ts) AS first_ts, argMax(share * gpu_fraction, ts) AS share_now, max(interval_s) AS max_interval
    FROM
    (
        SELECT *, max(run) OVER ({_SERIES}) AS last_run, min(toFloat64(ts)) OVER ({_SERIES}) AS first_ts
        FROM
        (
            SELECT *, sum(brk) OVER ({_SERIES} ORDER BY ts ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS run
            FROM
            (
                SELECT *, ifNull(holder_activity < {{idle:Float64}}, 0) AS is_idle,
                    if(row_number() OVER ({_SERIES} ORDER BY ts) = 1
                       OR is_idle != lagInFrame(is_idle, 1) OVER ({_SERIES} ORDER BY ts ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
                       OR toFloat64(ts) - lagInFrame(toFloat64(ts), 1) OVER ({_SERIES} ORDER BY ts ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
                          > 2 * lagInFrame(interval_s, 1) OVER ({_SERIES} ORDER BY ts ROWS BETWEEN 1 PRECEDING AND CURRENT ROW), 1, 0) AS brk
                FROM
                (
                    SELECT cluster, node, gpu, mig_gi, mig_ci, ts, interval_s, {HOLDER_ACTIVITY} AS holder_activity,
                        gpu_fraction, id, scheduler, name, user, account, queue, share
                    FROM gpu_samples FINAL
                    ARRAY JOIN alloc_ids AS id, alloc_schedulers AS scheduler, alloc_names AS name,
                        alloc_users AS user, alloc_accounts AS account, alloc_queues AS queue, alloc_shares AS share,
                        alloc_act_shares AS act_share
                    WHERE ts >= toDateTime64({{from:Float64}}, 3, 'UTC') AND ts < toDateTime64({{to:Float64}}, 3, 'UTC')
                      AND ({{cluster:String}} = '' OR cluster = {{cluster:String}})
                )
            )
        )
    )
    WHERE run = last_run
    GROUP BY cluster, id, node, gpu, mig_gi, mig_ci
) AS s
LEFT JOIN
(
    SELECT cluster, node, max(toFloat64(ts)) AS node_latest, argMax(toFloat64(ts) + interval_s, ts) AS node_end
    FROM gpu_samples
    WHERE ts >= toDateTime64({{from:Float64}}, 3, 'UTC') AND ts < toDateTime64({{to:Float64}}, 3, 'UTC')
      AND ({{cluster:String}} = '' OR cluster = {{cluster:String}})
    GROUP BY cluster, node
) AS n ON s.cluster = n.cluster AND s.node = n.node
GROUP BY cluster, id
ORDER BY cluster, id
"""

# the scheduler's word on each holder, per request of it: its latest start, its latest event,
# and whether an end came at or after that start (a schedule's times are whole seconds: a run
# requeued or ended in the second it started has both at one time, which argMax told apart by
# chance); read back as far as the store goes (not the samples' look-back): a start older than
# that is still the start its action log is kept against. A holder's requests
# (:func:`_requests_of`): a Slurm job's are its id and, after each requeue, ``ID#N``
# (agent/slurm.py request_id); a pod's is its UID, found by the ``namespace/name`` its samples
# carry (the node agent knows pods by name: PodResources, dcgm-exporter's labels). No FINAL: a
# replaced row is the same event at the same time (the table's key), which max/count read alike,
# and the name and ID#N matches cannot use the key: FINAL over all of it cost 5 times the query
HOLDER_EVENTS = """
SELECT cluster, scheduler, request_id, anyIf(name, name != '') AS request_name,
    maxIf(toFloat64(ts), event = 'start') AS started, max(toFloat64(ts)) AS last_ts,
    countIf(event IN ('end', 'cancel', 'preempt')) > 0
        AND maxIf(toFloat64(ts), event IN ('end', 'cancel', 'preempt')) >= started AS ended
FROM sched_events
WHERE ts < toDateTime64({to:Float64}, 3, 'UTC')
  AND ({cluster:String} = '' OR cluster = {cluster:String})
  AND ((scheduler = 'slurm' AND (has({ids:Array(String)}, request_id)
                                 OR has({ids:Array(String)}, splitByChar('#', request_id)[1])))
       OR (scheduler = 'k8s' AND (has({ids:Array(String)}, request_id) OR has({ids:Array(String)}, name))))
GROUP BY cluster, scheduler, request_id
"""


@dataclass(frozen=True, slots=True)
class IdleHolder:
    """A holder idle beyond its queue's threshold at ``now``."""

    cluster: str
    scheduler: str
    id: str  # the id its samples carry: a Slurm job id; a pod's namespace/name (the node agent's)
    name: str  # Slurm job name / namespace/name of the pod
    user: str
    account: str
    queue: str
    gpus: float  # the GPUs it holds (shares, MIG fractions)
    idle_since: float
    idle_for_s: float
    held_since: float  # its latest start (the scheduler's, else its first sample in the look-back)
    threshold_s: float
    clipped: bool = False  # its idle run began before the samples read back: idle at least this long
    data_end: float = 0.0  # the end of its nodes' latest samples (what the judgement saw up to)
    # the start its action log counts from (0: none reported): a pod's own start; a Slurm job's
    # first run's, so that a job requeued (by the action or by Slurm) is acted on once
    started: float = 0.0
    uid: str = ""  # a pod's UID (its scheduler events'; "" unknown); a Slurm job's current request

    @property
    def job(self) -> str:
        """What its owner calls it, and what ``gpuslo job`` takes: the Slurm job id, the pod's
        namespace/name."""
        return self.name if self.scheduler == "k8s" and self.name else self.id

    @property
    def pod_uid(self) -> str:
        """The pod's UID ("" unknown, and for a Slurm job): what a delete's precondition names."""
        return self.uid if self.scheduler == "k8s" else ""

    @property
    def idle_gpu_hours(self) -> float:
        return self.gpus * self.idle_for_s / 3600.0


def idle_holders(store: Store, cfg: RulesConfig, now: float, cluster: str = "") -> list[IdleHolder]:
    """The holders idle beyond their queue's threshold at ``now`` (among those the config's
    ``match`` allows)."""
    rc = cfg.reclaim
    frm = now - rc.lookback_s
    rows = store.query(IDLE_HOLDERS, {"from": frm, "to": float(now), "cluster": cluster,
                                      "idle": float(cfg.idle_threshold)})  # fmt: skip
    rows = [r for r in rows if r["all_idle"] and r["present"]]
    m = cfg.match
    rows = [r for r in rows if m.ok("cluster", r["cluster"]) and m.ok("queue", r["queue"])
            and m.ok("account", r["account"])]  # fmt: skip
    events = _events(store, [str(r["id"]) for r in rows], now, cluster)
    out = []
    for r in rows:
        ev = _current(events, str(r["cluster"]), str(r["scheduler"]), str(r["id"]))
        if ev.ended:
            continue
        since = float(r["idle_since"])
        idle_for = min(float(now), float(r["last_end"])) - since
        threshold = rc.threshold_for(str(r["queue"]))
        if idle_for < threshold:
            continue
        out.append(IdleHolder(
            cluster=str(r["cluster"]), scheduler=str(r["scheduler"]), id=str(r["id"]), name=str(r["name"]),
            user=str(r["user"]), account=str(r["account"]), queue=str(r["queue"]), gpus=round(float(r["gpus"]), 6),
            idle_since=since, idle_for_s=idle_for, held_since=ev.held_since or float(r["first_seen"]),
            threshold_s=threshold, clipped=since <= frm + float(r["max_interval"]), data_end=float(r["data_end"]),
            started=ev.log_from, uid=ev.uid,
        ))  # fmt: skip
    return out


@dataclass(frozen=True, slots=True)
class _Said:
    """What the scheduler events say of a holder now."""

    ended: bool = False  # its current request's latest event ended it
    held_since: float = 0.0  # its current request's start (0: none reported)
    log_from: float = 0.0  # IdleHolder.started
    uid: str = ""


def _attempt(request_id: str) -> int:
    """A Slurm request's run: 1 for the job id, N for ``ID#N`` (the wait after a requeue)."""
    n = request_id.partition("#")[2]
    return int(n) if n.isascii() and n.isdigit() and len(n) < 10 else 1


def _requests_of(rows: Sequence[Any], scheduler: str, hid: str) -> list[Any]:
    """The requests of the holder ``hid`` (its samples' id): a Slurm job's id and its ``ID#N``;
    a pod's request named by its UID, or by its ``namespace/name`` (the samples' id)."""
    if scheduler == "slurm":
        return [
            r for r in rows if r["scheduler"] == "slurm" and str(r["request_id"]).partition("#")[0] == hid
        ]
    if scheduler == "k8s":
        by_uid = [r for r in rows if r["scheduler"] == "k8s" and r["request_id"] == hid]
        return by_uid or [r for r in rows if r["scheduler"] == "k8s" and r["request_name"] == hid]
    return []


def _current(events: dict[str, list[Any]], cluster: str, scheduler: str, hid: str) -> _Said:
    """The holder's current request (the latest started; a pending requeue, not started yet, is
    not current: the job holds nothing then), whether it ended, since when it holds, and the
    start its log counts from."""
    reqs = _requests_of(events.get(cluster, []), scheduler, hid)
    if not reqs:  # no event of it: judged by its samples (a pod's id a UID where the samples carry one)
        return _Said(uid=hid if scheduler == "k8s" and "/" not in hid else "")
    cur = max(reqs, key=lambda r: (float(r["started"]), float(r["last_ts"]), _attempt(str(r["request_id"]))))
    started = [r for r in reqs if float(r["started"]) > 0]
    log_from = float(cur["started"])
    if scheduler == "slurm" and started:  # its first run's start (a requeue keeps the job's one log)
        log_from = float(min(started, key=lambda r: _attempt(str(r["request_id"])))["started"])
    return _Said(ended=bool(cur["ended"]), held_since=float(cur["started"]), log_from=log_from,
                 uid=str(cur["request_id"]))  # fmt: skip


def _events(store: Store, ids: Sequence[str], to: float, cluster: str) -> dict[str, list[Any]]:
    """The events' rows of the holders ``ids``, by cluster."""
    if not ids:
        return {}
    out: dict[str, list[Any]] = {}
    for r in store.query(HOLDER_EVENTS, {"to": float(to), "ids": sorted(set(ids)), "cluster": cluster}):
        out.setdefault(str(r["cluster"]), []).append(r)
    return out


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def report_link(cfg: RulesConfig, h: IdleHolder) -> str:
    """The per-job report: the configured URL, else the command that prints it."""
    tpl = cfg.reclaim.report_url
    if tpl:
        return tpl.format(job=quote(h.job, safe=""), cluster=quote(h.cluster, safe=""),
                          scheduler=quote(h.scheduler, safe=""))  # fmt: skip
    from gpuslo.rules.jobreport import command

    return command(h.job, h.cluster)  # quoted for a shell: a pod's name or a job id as given


def notice(cfg: RulesConfig, h: IdleHolder) -> Alert:
    """The alert a holder's owner gets: labels that Alertmanager routes on (``user``,
    ``account``, ``queue``, ``job``, ``cluster``, ``scheduler``), the numbers in annotations."""
    rc = cfg.reclaim
    act = rc.action
    least = "at least " if h.clipped else ""
    what = f"{h.gpus:g} GPU(s) idle for {least}{h.idle_for_s / 3600:.1f} h ({least}{h.idle_gpu_hours:.2f} GPU-hours)"
    plan = ""
    if (
        act.mode == "on" and h.queue in act.allow_queues
    ):  # a dry-run is the operators' trial: owners hear nothing of it
        verb = act.slurm if h.scheduler == "slurm" else act.kubernetes
        plan = f"; it will be {_PAST[verb]} once idle {(h.threshold_s + act.grace_s) / 3600:.1f} h"
    labels = {"alertname": ALERTNAME, "severity": rc.severity, "cluster": h.cluster, "scheduler": h.scheduler,
              "queue": h.queue, "user": h.user, "account": h.account, "job": h.job}  # fmt: skip
    return Alert(
        {k: v for k, v in labels.items() if v},  # an empty label is no label (Prometheus' and Alertmanager's view)
        {"summary": f"job {h.job} of {h.user or h.account or '?'} in {h.queue}: {what}{plan}",
         "idle_gpu_hours": f"{h.idle_gpu_hours:.4f}", "idle_for_s": f"{h.idle_for_s:.0f}", "at_least": "true" if h.clipped else "false", "gpus": f"{h.gpus:g}",
         "idle_since": iso(h.idle_since), "held_since": iso(h.held_since), "job_id": h.pod_uid or h.id, "job_name": h.name,
         "report": report_link(cfg, h)},
        resend_s=rc.resend_s,
    )  # fmt: skip


_PAST = {"cancel": "cancelled", "requeue": "requeued", "delete": "deleted", "suspend": "suspended"}


def notices(cfg: RulesConfig, holders: Sequence[IdleHolder]) -> list[Alert]:
    return [notice(cfg, h) for h in holders] if cfg.reclaim.enabled else []

"""The idle-reclaim loop, part two: the optional action on a holder still idle a grace period
after its notice (Slurm ``scancel`` / ``scontrol requeue``; Kubernetes: delete the pod, or
deactivate its Kueue Workload), and the record of every decision.

Off by default. ``dry-run`` records what it would do and does nothing. ``on`` acts only on
holders whose queue (Slurm partition / namespace) is on ``allow_queues``, never on one that
has held its GPUs for less than ``grace_s``, and only once the holder has been idle for its
queue's threshold plus ``grace_s`` and its owner's notice of this idle run went to the alert
receivers ``grace_s`` before (recorded as ``noticed`` by :meth:`Reclaimer.noticed` once the
engine queued it: a holder found idle long already, after an outage, or whose notice could
not be sent, waits ``grace_s`` from its notice, or is refused while none went). An active
holder is never a candidate: only :func:`rules.reclaim.idle_holders` are.

Every decision is a row of ``reclaim_actions`` (rules/tables.py): ``noticed`` (the notice
of an idle run queued to the receivers), ``would`` (dry-run), ``refused`` (with the reason),
``started`` before a call and ``done`` / ``failed`` after it, ``gave_up`` after
``max_attempts`` failures. A holder's rows count from its start as its scheduler reported it
(a pod's own; a Slurm job's first run's, which its requeues keep: ``IdleHolder.started``),
however old. The log is the state: a restarted engine reads
it and neither acts twice on a holder (``done``, or a ``started`` left by a crash: the call
is repeated, and the scheduler's "already gone" counts as done; the call cut short counts as
a failed attempt) nor forgets its failures. A
failing call (command missing, timeout, non-zero exit, HTTP error) is recorded and retried at
the next rounds, never raised.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from gpuslo.core.http import read_url
from gpuslo.core.proc import Children
from gpuslo.ingest.store import Store
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.reclaim import IdleHolder, iso, notice

log = logging.getLogger(__name__)

# Kubernetes' own name rules (RFC 1123): a namespace is a label, a pod's name a subdomain
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?", re.ASCII)
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*", re.ASCII
)
REASON_MAX = 1000  # characters of a failure's text kept in the log


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool  # done (or already gone); False: failed, to retry
    reason: str


class Actor(Protocol):
    """One scheduler's way of taking a holder's GPUs back."""

    def act(self, action: str, h: IdleHolder) -> Outcome: ...


# ---------------------------------------------------------------------------------- Slurm
Run = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


#: the job states in which a job holds its GPUs (squeue %T); in any other the action has nothing
#: to take back (``scontrol requeue`` of a CANCELLED job exits 0 and queues it again)
_HOLDING = ("RUNNING", "SUSPENDED", "STOPPED", "SIGNALING", "CONFIGURING")
#: what scancel / scontrol answer for a job that already ended: the action's aim is met
_GONE = ("already completing or completed", "invalid job id specified", "job has already finished")


class SlurmActor:
    """``scancel --verbose JOB`` / ``scontrol requeue JOB`` (the commands found on PATH,
    SLURM_CONF from the environment, as for the agent's Slurm sources), with the job's state
    read before and after (``squeue``). Without ``--verbose``, scancel says nothing and exits 0
    whatever happened (Slurm 22.05: an unknown job id included), so its errors are read from
    its verbose output.

    A job array's task has its own job id, except the last one started, whose id is the
    array's (slurmctld 22.05: tasks 1_0..1_3 are jobs 2, 3, 4 and 1). ``squeue -j 1``, ``scancel
    1`` and ``scontrol requeue 1`` mean the whole array: the job is found in squeue's answer by
    its own id (``%A``) and acted on by its task's name (``%i``: ``1_3``), which means that
    task alone.

    ``run``: how a command is run, by default through ``children`` (the run's child processes,
    :class:`~gpuslo.core.proc.Children`: a command is killed, its whole process group, at
    ``timeout_s`` and when the run ends; none given, one of its own)."""

    def __init__(
        self, run: Run | None = None, timeout_s: float = 30.0, children: Children | None = None
    ) -> None:
        self.children = children if children is not None else Children()
        self.run: Run = run or self.children.run
        self.timeout_s = timeout_s

    def act(self, action: str, h: IdleHolder) -> Outcome:
        if not _SLURM_JOB_ID.fullmatch(h.id):
            return Outcome(False, f"not a Slurm job id: {h.id!r}")
        before = self._state(h.id)
        if before.failed:
            return Outcome(False, before.text)
        if not before.state:
            return Outcome(True, f"already ended (squeue lists no job {h.id})")
        if before.state not in _HOLDING:  # ended, completing, or pending again: nothing to take back
            return Outcome(True, f"already ended or not running (squeue: {before.state})")
        job = before.target
        argv = ["scancel", "--verbose", job] if action == "cancel" else ["scontrol", "requeue", job]
        r = self._call(argv)
        if r.failed:
            if any(g in r.text.lower() for g in _GONE):
                return Outcome(True, f"already ended ({r.text})")
            return Outcome(False, r.text)
        after = self._state(job)
        return Outcome(True, f"{' '.join(argv)}: {before.state} -> {after.state or 'gone'}")

    def _state(self, job: str) -> _Listed:
        """The job as squeue lists it: its state, and the id it is acted on by (its array
        task's ``ARRAY_TASK`` for a task of an array); no state when it is not listed (ended).
        ``job`` is a job id (``%A``) or a task's name (``%i``)."""
        r = self._call(["squeue", "-h", "-j", job, "-o", "%A %i %T"])
        if r.failed:
            return _Listed() if "invalid job id" in r.text.lower() else _Listed(True, r.text)
        rows = [line.split() for line in r.lines if line.strip()]
        if any(len(x) != 3 for x in rows):
            return _Listed(
                True, f"squeue -j {job}: an answer not of 'JOBID NAME STATE' lines: {r.text[:200]!r}"
            )
        mine = [x for x in rows if job in (x[0], x[1])]
        if not mine:  # the other tasks of its array are listed, not it: it ended
            return _Listed()
        if len(mine) > 1 or not _SLURM_JOB_ID.fullmatch(mine[0][1]):
            return _Listed(True, f"squeue -j {job}: no one job of that id in {r.text[:200]!r}")
        return _Listed(target=mine[0][1], state=mine[0][2])

    def _call(self, argv: list[str]) -> _Said:
        try:
            r = self.run(argv, self.timeout_s)
        except subprocess.TimeoutExpired:
            return _Said(True, f"{argv[0]} timed out after {self.timeout_s:g} s")
        except subprocess.SubprocessError as exc:  # Stopped: the run ended while it ran
            return _Said(True, str(exc))
        except OSError as exc:
            return _Said(True, f"{argv[0]}: {exc}")
        text = " ".join((r.stdout or "").split() + (r.stderr or "").split())
        if r.returncode != 0 or "error:" in text.lower():
            return _Said(True, f"{' '.join(argv)} exited {r.returncode}: {text or '(no output)'}")
        return _Said(False, text, tuple((r.stdout or "").splitlines()))


@dataclass(frozen=True, slots=True)
class _Said:
    failed: bool
    text: str
    lines: tuple[str, ...] = ()  # its standard output's


@dataclass(frozen=True, slots=True)
class _Listed:
    failed: bool = False
    text: str = ""  # why squeue could not say
    target: str = ""  # the id to act on: the job's, or its array task's ARRAY_TASK
    state: str = ""  # squeue's %T; "" when the job is not listed (ended)


# a job id, or an array task's JOB_TASK; ASCII digits only (str.isdigit() takes '²' and '١٢٣')
_SLURM_JOB_ID = re.compile(r"[1-9][0-9]{0,19}(?:_[0-9]{1,10})?", re.ASCII)


# ----------------------------------------------------------------------------- Kubernetes
class HttpError(Exception):
    def __init__(self, code: int, body: str) -> None:
        super().__init__(f"HTTP {code}: {body[:300]}")
        self.code = code


Request = Callable[[str, str, Any, str], Any]  # (method, path, body, content type) -> JSON


@dataclass(frozen=True)
class KubeCredentials:
    """The API server and its bearer token: given, or read from ``token_file`` at every request
    (a projected ServiceAccount token is rotated by the kubelet)."""

    server: str
    token: str = ""
    ca_file: str = ""
    token_file: str = ""

    @classmethod
    def in_cluster(cls, env: Mapping[str, str] = os.environ,
                   sa_dir: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount")) -> KubeCredentials | None:  # fmt: skip
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (sa_dir / "token").is_file():
            return None
        return cls(f"https://{host}:{port}", ca_file=str(sa_dir / "ca.crt"), token_file=str(sa_dir / "token"))

    def bearer(self) -> str:
        """The token (OSError when its file cannot be read: a failure the actor records)."""
        return self.token or Path(self.token_file).read_text().strip()


def http_request(creds: KubeCredentials, timeout_s: float) -> Request:
    def request(method: str, path: str, body: Any, content_type: str) -> Any:
        ctx = ssl.create_default_context(cafile=creds.ca_file or None)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(creds.server.rstrip("/") + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {creds.bearer()}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:  # read whole within timeout_s (each read's timeout alone let a trickle go on for ever)
            return json.loads(read_url(req, timeout_s, MAX_ANSWER_BYTES, ctx))
        except urllib.error.HTTPError as exc:
            raise HttpError(exc.code, exc.read().decode(errors="replace")) from None

    return request


#: the most of an API server's answer read (a pod, a namespace's Kueue Workloads)
MAX_ANSWER_BYTES = 64 << 20

#: a pod is deleted with its UID as the precondition, never by name alone (a pod that took the
#: name since would be deleted in its place)
NO_POD_UID = ("its pod's UID is unknown (no scheduler event of it: the k8s-events collector, "
              "`gpuslo agent --source k8s-events`, has not reported it): never deleted by name alone")  # fmt: skip

_FORBIDDEN_HINT = " (the reclaim action's RBAC, deploy/kubernetes/reclaim-rbac.yaml, is not applied)"


def kueue_workloads(ns: str) -> str:
    return f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{quote(ns, safe='')}/workloads"


class KubeActor:
    """Delete the pod (with a UID precondition: never another pod that took its name), or
    deactivate the Kueue Workload that admitted it (``spec.active: false``: Kueue evicts the
    workload, stops counting its quota and suspends its Job, which stays in the queue, inactive,
    until set active again)."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def act(self, action: str, h: IdleHolder) -> Outcome:
        ns, _, pod = h.name.partition("/")
        if not _DNS_LABEL.fullmatch(ns) or not _DNS_SUBDOMAIN.fullmatch(pod) or len(pod) > 253:
            # a name from the data: 'ns/..' or 'ns/p/../../x' would reach another object's path
            return Outcome(False, f"not a namespace/name pod: {h.name!r}")
        if action == "delete" and not h.pod_uid:
            return Outcome(False, f"delete {h.name}: {NO_POD_UID}")
        try:
            return (
                self._delete(ns, pod, h.pod_uid) if action == "delete" else self._suspend(ns, pod, h.pod_uid)
            )
        except HttpError as exc:
            if exc.code == 404:
                return Outcome(True, f"already gone ({exc})")
            hint = _FORBIDDEN_HINT if exc.code == 403 else ""
            return Outcome(False, f"{action} {h.name}: {exc}{hint}")
        except (OSError, ValueError) as exc:  # refused, reset, timeout, TLS; a body that is not JSON
            return Outcome(False, f"{action} {h.name}: {type(exc).__name__}: {exc}")

    def _delete(self, ns: str, pod: str, uid: str) -> Outcome:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            self.request(
                "DELETE",
                f"/api/v1/namespaces/{quote(ns, safe='')}/pods/{quote(pod, safe='')}",
                body,
                "application/json",
            )
        except HttpError as exc:
            if exc.code == 409:  # the UID precondition: the pod of that name is another one
                return Outcome(True, f"already gone (the pod {ns}/{pod} now is another one)")
            raise
        return Outcome(True, f"deleted pod {ns}/{pod}")

    def _suspend(self, ns: str, pod: str, uid: str) -> Outcome:
        p = _obj(
            self.request(
                "GET", f"/api/v1/namespaces/{quote(ns, safe='')}/pods/{quote(pod, safe='')}", None, ""
            )
        )
        now_uid = _obj(p.get("metadata")).get("uid")
        if uid and isinstance(now_uid, str) and now_uid and now_uid != uid:  # (Kueue's pods: no UID known)
            return Outcome(True, f"already gone (the pod {ns}/{pod} now is another one)")
        owners = _owner_uids(p) | {_obj(p.get("metadata")).get("uid")}
        owners.discard(None)
        for wl in _list(_obj(self.request("GET", kueue_workloads(ns), None, "")).get("items")):
            name = _obj(_obj(wl).get("metadata")).get("name")
            if isinstance(name, str) and name and _owner_uids(_obj(wl)) & owners:
                self.request("PATCH", kueue_workloads(ns) + "/" + quote(name, safe=""),
                             {"spec": {"active": False}}, "application/merge-patch+json")  # fmt: skip
                return Outcome(True, f"deactivated Kueue workload {ns}/{name}")
        return Outcome(False, f"no Kueue workload owns pod {ns}/{pod} (or its Job)")


# the API server's answers read as JSON of any shape: a proxy's error page, a list, a null
def _obj(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _owner_uids(o: dict[str, Any]) -> set[Any]:
    refs = _list(_obj(o.get("metadata")).get("ownerReferences"))
    return {u for r in refs if isinstance(u := _obj(r).get("uid"), str) and u}


# ---------------------------------------------------------------------------------- the log
ACTION_COLUMNS = ("at", "cluster", "scheduler", "job", "holder_id", "queue", "user", "account", "action", "mode",
                  "outcome", "reason", "attempt", "held_since", "idle_since", "idle_gpu_hours")  # fmt: skip

HISTORY = """
SELECT cluster, holder_id, outcome, reason, mode, toFloat64(at) AS at, attempt
FROM reclaim_actions
WHERE has({ids:Array(String)}, holder_id)
ORDER BY at, outcome = 'started' DESC
"""


class ActionLog:
    def __init__(self, store: Store) -> None:
        self.store = store  # its table: rules/tables.py RECLAIM_ACTIONS

    def history(self, holders: Sequence[IdleHolder]) -> dict[tuple[str, str], list[dict[str, Any]]]:
        out: dict[tuple[str, str], list[dict[str, Any]]] = {}
        if not holders:
            return out
        for r in self.store.query(HISTORY, {"ids": sorted({h.id for h in holders})}):
            out.setdefault((str(r["cluster"]), str(r["holder_id"])), []).append(r)
        return out

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        if rows:
            self.store.insert("reclaim_actions", {k: [r[k] for r in rows] for k in ACTION_COLUMNS})


# ---------------------------------------------------------------------------------- decisions
@dataclass
class Reclaimer:
    """One round of decisions over the idle holders at ``now``; each decision a log row."""

    cfg: RulesConfig
    log: ActionLog
    actors: Mapping[str, Actor]  # by scheduler: "slurm", "k8s"
    clock: Callable[[], float] = field(default=time.monotonic)  # the round's deadline is on it

    def step(self, holders: Sequence[IdleHolder], now: float) -> list[dict[str, Any]]:
        """The round's decisions. Its calls start within ``round_s`` of its start (each may then
        take ``timeout_s``): the holders left when that is spent wait, unrecorded, for the next
        round, which takes the holders with the fewest calls so far first (so slow failing
        calls cannot keep the others waiting round after round)."""
        act = self.cfg.reclaim.action
        if act.mode == "off" or not holders:
            return []
        past = self._past(holders)
        order = sorted(
            range(len(holders)),
            key=lambda i: sum(r["outcome"] == "started" for r in past[(holders[i].cluster, holders[i].id)]),
        )
        deadline = self.clock() + act.round_s
        out: list[dict[str, Any]] = []
        left = 0
        for i in order:
            h = holders[i]
            rows = self._decide(h, past[(h.cluster, h.id)], now, may_call=self.clock() < deadline)
            if rows is None:
                left += 1
            else:
                out += rows
        if left:
            log.warning("reclaim round: %d holder(s) wait for the next round (reclaim.action.round_s %g s "
                        "spent on calls)", left, act.round_s)  # fmt: skip
        return out

    def _past(self, holders: Sequence[IdleHolder]) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """Each holder's rows since its start as its scheduler reported it (``IdleHolder.started``;
        all of them without one: never since a first sample, which moves with the look-back and
        would forget a ``done`` or a ``gave_up``)."""
        hist = self.log.history(holders)
        return {
            (h.cluster, h.id): [
                r
                for r in hist.get((h.cluster, h.id), [])
                if not h.started or float(r["at"]) >= h.started - 1e-3
            ]
            for h in holders
        }

    def noticed(self, holders: Sequence[IdleHolder], now: float) -> list[dict[str, Any]]:
        """Record that the notices of ``holders`` went to the receivers at ``now`` (the caller
        says so once the engine queued them): a ``noticed`` row for each holder whose idle run
        has none yet, from which its grace period counts. Nothing while the action is off."""
        if self.cfg.reclaim.action.mode == "off" or not holders:
            return []
        past = self._past(holders)
        rows = [self._row(h, now, "noticed", f"notice {fp} queued to the alert receivers") for h in holders
                if _noticed_at(h, past[(h.cluster, h.id)], fp := notice(self.cfg, h).fingerprint) is None]  # fmt: skip
        return self._record(rows) if rows else []

    def _row(self, h: IdleHolder, now: float, outcome: str, reason: str, attempt: int = 0) -> dict[str, Any]:
        act = self.cfg.reclaim.action
        return {"at": now, "cluster": h.cluster, "scheduler": h.scheduler, "job": h.job, "holder_id": h.id,
                "queue": h.queue, "user": h.user, "account": h.account, "action": self._action(h), "mode": act.mode,
                "outcome": outcome, "reason": reason[:REASON_MAX], "attempt": attempt, "held_since": h.held_since,
                "idle_since": h.idle_since, "idle_gpu_hours": round(h.idle_gpu_hours, 6)}  # fmt: skip

    def _action(self, h: IdleHolder) -> str:
        act = self.cfg.reclaim.action
        return act.slurm if h.scheduler == "slurm" else act.kubernetes

    def _decide(
        self, h: IdleHolder, past: list[dict[str, Any]], now: float, may_call: bool = True
    ) -> list[dict[str, Any]] | None:
        """The rows of the decision on ``h``; None when it would call its scheduler and
        ``may_call`` is false (the round's time is spent: decided next round)."""
        act = self.cfg.reclaim.action
        if now - h.idle_since < h.threshold_s + act.grace_s:
            return []  # noticed; its grace period still runs
        outcomes = [str(r["outcome"]) for r in past]
        if "done" in outcomes or "gave_up" in outcomes:
            return []  # acted on (or given up) already: never twice
        noticed = _noticed_at(h, past, notice(self.cfg, h).fingerprint)
        refusal = self._refusal(h, now) or (NOT_NOTICED if noticed is None else "")
        if not refusal and noticed is not None and now - noticed < act.grace_s:
            return []  # its owner was told less than grace_s ago (found idle long already: an outage)
        if refusal:
            if any(r["outcome"] == "refused" and r["reason"] == refusal for r in past):
                return []
            return self._record([self._row(h, now, "refused", refusal)])
        if act.mode == "dry-run":
            if "would" in outcomes:
                return []
            verb = self._action(h)
            return self._record([self._row(h, now, "would", f"would {verb} {h.job} (dry-run)")])
        # a call with no outcome (a `started` no `done`/`failed` of its attempt followed: the engine
        # stopped during it) was an attempt too: repeated, never forgotten, and counted, or a call
        # that kills the engine every time (an OOM, a hang its supervisor kills) ran for ever
        finished = {int(r["attempt"]) for r in past if r["outcome"] in ("done", "failed")}
        cut = sum(1 for r in past if r["outcome"] == "started" and int(r["attempt"]) not in finished)
        failures = outcomes.count("failed") + cut
        if failures >= act.max_attempts:
            why = f"{failures} failed attempt(s)" + (
                f", {cut} of them with no outcome (the engine stopped during the call)" if cut else ""
            )
            return self._record([self._row(h, now, "gave_up", why, failures)])
        actor = self.actors.get(h.scheduler)
        if actor is not None and not may_call:
            return None
        if actor is None:
            reason = f"no {h.scheduler} actor configured"
            return self._record([self._row(h, now, "failed", reason, failures + 1)])
        attempt = failures + 1
        started = self._row(h, now, "started", f"{self._action(h)} {h.job}", attempt)
        self.log.write([started])  # before the call: a crash after it repeats the call, never forgets it
        result = _contained(actor, self._action(h), h)
        row = self._row(h, now, "done" if result.ok else "failed", result.reason, attempt)
        if not result.ok:
            log.warning("reclaim %s of %s %s failed (attempt %d of %d): %s", row["action"], h.scheduler,
                        h.job, attempt, act.max_attempts, result.reason)  # fmt: skip
        self.log.write([row])
        return [started, row]

    def _record(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.log.write(rows)
        return rows

    def _refusal(self, h: IdleHolder, now: float) -> str:
        """Why ``h`` is not acted on now ("": it may be). A reason is recorded once per holder
        and reason, so it names the holder's state, never the time since (a count of seconds
        made it a new reason, and a new row, every round)."""
        act = self.cfg.reclaim.action
        if h.queue not in act.allow_queues:
            return f"queue {h.queue!r} is not on reclaim.action.allow_queues"
        if now - h.data_end > act.max_sample_age_s:
            return f"its newest samples are older than reclaim.action.max_sample_age_s ({act.max_sample_age_s:g} s)"
        if now - h.held_since < act.grace_s:
            return (f"holds its GPUs since {iso(h.held_since)}, less than the grace period "
                    f"({act.grace_s:g} s) before now")  # fmt: skip
        if h.scheduler == "k8s" and self._action(h) == "delete" and not h.pod_uid:
            return NO_POD_UID
        return ""


NOT_NOTICED = ("no notice of this idle run has gone to its owner (no alert receiver configured, or its "
               "outbox could not be written): it waits grace_s from the first that goes")  # fmt: skip


def _noticed_at(h: IdleHolder, past: Sequence[dict[str, Any]], fingerprint: str) -> float | None:
    """When the notice of ``h``'s current idle run first went: its earliest ``noticed`` row of
    this notice (``fingerprint``: the owner and queue it names, as now) since the run's first
    sample read back (a run that began before the samples read back is told again; a notice of
    an earlier idle run, before its owner came back, or to an owner it no longer has, never counts)."""
    mark = f"notice {fingerprint} "
    at = [float(r["at"]) for r in past if r["outcome"] == "noticed" and str(r["reason"]).startswith(mark)
          and float(r["at"]) >= h.idle_since - 1e-3]  # fmt: skip
    return min(at) if at else None


def _contained(actor: Actor, action: str, h: IdleHolder) -> Outcome:
    """The actor's outcome; one that raises (an answer of a shape it did not expect, a bug) is a
    failed attempt, counted towards max_attempts: escaping, it left a `started` row with no
    outcome (retried every round for ever) and skipped the round's other holders."""
    try:
        return actor.act(action, h)
    except Exception as exc:
        log.exception("reclaim %s of %s %s: the actor raised", action, h.scheduler, h.job)
        return Outcome(False, f"{action} {h.job}: {type(exc).__name__}: {exc}")


def default_actors(cfg: RulesConfig, children: Children | None = None) -> dict[str, Actor]:
    """Slurm through its commands (run as ``children``, the run's child processes); Kubernetes
    through ``kube_server`` and its token file, else in-cluster (the ServiceAccount's token)
    when the process runs in a pod. No actor without the action on. The token file is read at
    each call: unreadable, the call fails, recorded."""
    act = cfg.reclaim.action
    if act.mode != "on":
        return {}
    out: dict[str, Actor] = {"slurm": SlurmActor(timeout_s=act.timeout_s, children=children)}
    creds = KubeCredentials.in_cluster()
    if act.kube_server:
        creds = KubeCredentials(act.kube_server, ca_file=act.kube_ca_file, token_file=act.kube_token_file)
    if creds is not None:
        out["k8s"] = KubeActor(http_request(creds, act.timeout_s))
    return out

"""Kueue collector: watches Kueue ``Workload`` objects (``kueue.x-k8s.io/v1beta2``, the version
Kueue v0.17 stores) and turns their life into scheduler events.

A Job that Kueue manages stays suspended, with no pod, until Kueue admits its Workload: these
waits are invisible to the pod collector. Per Workload:

- ``submit`` at its ``creationTimestamp``;
- ``pending_reason`` whenever the reason Kueue gives changes: the ``QuotaReserved`` condition
  when it is False (reason ``Pending`` with the flavor assigner's message, ``Inadmissible``,
  ``Waiting``), else the ``Admitted`` condition when quota is reserved but admission checks are
  not satisfied. The event carries Kueue's reason (``reason``: gpuslo's tier, Kueue's condition
  reason and message) and the starvation cause it implies (``cause``, see :data:`TIERS`);
- ``start`` when ``Admitted`` turns True (its ``lastTransitionTime``), with the ClusterQueue of
  ``status.admission``;
- ``end`` (or ``cancel`` when it never started) when ``Finished`` turns True, with its reason
  (Succeeded, Failed, ...), or when the Workload is deleted; ``cancel`` when a waiting Workload is
  deactivated (``spec.active: false``: it leaves the queue);
- ``preempt`` when an admitted Workload loses its admission (Kueue evicts it: ``Evicted`` with
  reason Preempted, PodsReadyTimeout, Deactivated, ...). Kueue puts it back in the queue, so the
  wait that follows is a new request: ``request_id`` ``UID#2`` (``#3`` …) with its own ``submit``
  at the eviction time. An eviction and readmission that happened while nobody watched is found
  from the newer ``Admitted`` transition time.

``queue`` is ``namespace/LocalQueue`` and ``cluster_queue`` the ClusterQueue it feeds (from the
LocalQueue object while pending, from the admission once admitted); ``account`` is the namespace.
GPUs are the pod sets' ``count`` × each pod's ``nvidia.com/gpu`` request: ``nodes`` = pods and
``gpus_per_node`` = GPUs per pod (the mean over pods when pod sets differ). Workloads asking for
no GPU are not followed.

The watch machinery (list, watch from the resourceVersion, relist on 410 Gone and diff, a state
file to resume from) is the pod collector's: :mod:`gpuslo.agent.k8s_watch`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from gpuslo.agent.base import Sequencer, Source
from gpuslo.agent.k8s_watch import (
    Forbidden,
    KubeApi,
    Malformed,
    WatchedState,
    as_dict,
    as_list,
    as_str,
    as_time,
    gpus_requested,
    reason_time,
)
from gpuslo.core.fileio import UNREADABLE_STATE, replace_file, state_records
from gpuslo.wire import Message, SchedulerEvent

log = logging.getLogger(__name__)

#: The versions tried, newest first: v1beta2 is what Kueue v0.15+ stores (v0.17.0 serves both,
#: v1beta1 through its conversion webhook); older Kueue serves v1beta1 only. The fields read here
#: are the same in both.
VERSIONS = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")
GROUP_VERSION = VERSIONS[0]
#: The label Kueue puts on the pod template of a Job it admits (pkg/constants/constants.go
#: ``PodSetLabel``): such pods are counted through their Workload, not a second time as pods.
POD_SET_LABEL = "kueue.x-k8s.io/podset"
#: The label Kueue's pod webhook puts on a pod it manages as a Workload of its own, at its creation
#: (its ``pod`` integration: plain pods and pod groups, and what is served through it, Deployments,
#: StatefulSets, LeaderWorkerSets; pkg/constants ``ManagedByKueueLabelKey``, set in
#: pkg/controller/jobs/pod/pod_webhook.go with the admission scheduling gate). Such a pod carries
#: ``kueue.x-k8s.io/podset`` only from its admission: gated until then, it was followed as a pod
#: from its creation, its wait counted twice (the pod's and its Workload's).
MANAGED_LABEL = "kueue.x-k8s.io/managed"
#: The pods whose GPU request the Workload collector follows: the pod collector leaves them.
KUEUE_POD_LABELS = (POD_SET_LABEL, MANAGED_LABEL)
WORKLOADS = f"/apis/{GROUP_VERSION}/workloads"
#: How long a LocalQueue that could not be read stays unknown before it is asked again (s).
QUEUE_RETRY_S = 60.0


class NotServed(Exception):
    """No Kueue Workload API on this server (Kueue not installed)."""


Cause = Literal["capacity", "fragmentation", "policy"]

#: Kueue's words for why a Workload waits, read from the v0.17.0 source, each with the gpuslo
#: tier it is filed under and the starvation cause it implies.
#:
#: - pkg/scheduler/flavorassigner/flavorassigner.go, ``fitsResourceQuota``: "insufficient quota
#:   for R in flavor F, previously considered podsets requests (…) + current podset request (…)
#:   > maximum capacity (…)" when the request exceeds what the ClusterQueue can ever have
#:   (nominal plus what it may borrow): ``capacity``; "insufficient unused quota for R in flavor
#:   F, N more needed" when others hold the quota: ``policy`` (the rules engine still files it
#:   under ``capacity`` when the cluster's free devices cannot hold it either).
#:   ``findFlavorForPodSetResource``: "resource R unavailable in ClusterQueue" (no quota for it at
#:   all): ``capacity``.
#: - the same file, ``checkFlavorForPodSets``: "flavor F doesn't match node affinity",
#:   "untolerated taint T in flavor F", "flavor F not found"; flavor_assigner_attempts.go: "flavor
#:   F does not provide resource R"; tas_flavorassigner.go: "Flavor … does not support
#:   TopologyAwareScheduling" …: placement on a flavor failed, ``fragmentation``.
#: - pkg/cache/scheduler/tas_flavor_snapshot.go: 'topology "T" allows to fit only N out of M
#:   pod(s)' / "doesn't allow to fit": topology-aware placement failed, ``fragmentation``.
#: - pkg/scheduler/scheduler.go: ". Pending the preemption of N workload(s)" (priority),
#:   "Workload no longer fits after processing another workload", "Workload namespace doesn't
#:   match ClusterQueue selector"; pkg/controller/core/workload_controller.go: reason
#:   ``Inadmissible`` (LocalQueue/ClusterQueue missing, inactive or stopped); reason ``Waiting``
#:   (waitForPodsReady blocks admission); admission checks not yet satisfied (``Admitted`` False
#:   with ``QuotaReserved`` True): ``policy``.
#:
#: Kueue v0.17.0 has no reason constants finer than ``Pending``/``Inadmissible`` (the detail is
#: in the message); the tier names follow the reason tiers Kueue's users ask for.
TIERS: tuple[tuple[str, re.Pattern[str], Cause], ...] = (
    (
        "PendingPreemption",
        re.compile(r"Pending the preemption of|Preempting \d+ workload\(s\) failed"),
        "policy",
    ),
    ("WaitingForQuota", re.compile(r"insufficient unused quota for"), "policy"),
    ("NoLongerFits", re.compile(r"no longer fits after processing another workload"), "policy"),
    # back in the queue after an eviction, QuotaReserved carries the eviction's message
    # (jobframework/reconciler.go); preemption.go ``preemptionMessage``: priority, reclamation or
    # fair sharing took the quota
    ("Evicted", re.compile(r"Preempted to accommodate a workload"), "policy"),
    (
        "TopologyPlacementFailed",
        re.compile(r"topology \S+ (?:allows to fit only|doesn't allow to fit)"),
        "fragmentation",
    ),
    (
        "FlavorPlacementFailed",
        re.compile(
            r"doesn't match node affinity|untolerated taint|flavor \S+ not found|does not provide resource"
            r"|TopologyAwareScheduling|information missing in TAS cache|does not contain the requested level"
        ),
        "fragmentation",
    ),
    ("ExceedsMaxQuota", re.compile(r"insufficient quota for .*?> maximum capacity"), "capacity"),
    ("NoQuotaForResource", re.compile(r"resource \S+ unavailable in ClusterQueue"), "capacity"),
)
#: Condition reasons that are policy whatever the message says.
_REASON_TIERS: dict[str, tuple[str, Cause]] = {
    "Inadmissible": ("Inadmissible", "policy"),
    "Waiting": ("WaitingForPodsReady", "policy"),
}
#: How far a cause is from admission: a pod set is as near as its most hopeful flavor (a flavor
#: that waits for quota others hold beats one that can never hold it); a Workload is as far as
#: its farthest pod set (every pod set must fit).
_RANK: dict[str, int] = {"policy": 0, "fragmentation": 1, "capacity": 2}
_POD_SET = re.compile(r"(?:^|; )couldn't assign flavors to pod set ")


def classify(reason: str, message: str) -> tuple[str, Cause]:
    """gpuslo's tier and the starvation cause of one Kueue pending reason and message."""
    worst: tuple[str, Cause] | None = None
    for part in [p for p in _POD_SET.split(message) if p] or [message]:
        found = [(tier, cause) for tier, pattern, cause in TIERS if pattern.search(part)]
        if not found:
            continue
        best = min(found, key=lambda t: _RANK[t[1]])  # stable: the first listed of equal rank
        if worst is None or _RANK[best[1]] > _RANK[worst[1]]:
            worst = best
    return worst or _REASON_TIERS.get(reason, ("Other", "policy"))


@dataclass(frozen=True)
class Condition:
    status: str
    reason: str
    message: str
    at: float | None


@dataclass(frozen=True)
class Workload:
    """What the collector reads from one Workload object."""

    uid: str
    namespace: str
    name: str
    local_queue: str
    cluster_queue: str  # from status.admission; "" while not admitted
    created: float | None
    deleted: float | None
    active: bool
    gpus_per_node: float
    nodes: int
    conditions: dict[str, Condition]
    evictions: int = 0  # status.schedulingStats.evictions, summed over reasons

    def cond(self, kind: str) -> Condition | None:
        return self.conditions.get(kind)

    def true(self, kind: str) -> bool:
        c = self.conditions.get(kind)
        return c is not None and c.status == "True"


def read(obj: Any) -> Workload:
    """Parse one Workload object; :class:`Malformed` names what is wrong."""
    wl = as_dict(obj, "the object")
    md, spec, status = (as_dict(wl.get(k), k) for k in ("metadata", "spec", "status"))
    uid = as_str(md.get("uid"), "metadata.uid", None)
    if not uid:
        raise Malformed("metadata.uid is missing")
    if len(uid) > 256:  # never cut: two UIDs alike in their first 256 characters would be one request
        raise Malformed(f"metadata.uid is {len(uid)} characters, not a UID")
    conds: dict[str, Condition] = {}
    for i, c in enumerate(as_list(status.get("conditions"), "status.conditions")):
        c = as_dict(c, f"status.conditions[{i}]")
        kind = as_str(c.get("type"), f"status.conditions[{i}].type")
        conds[kind] = Condition(
            as_str(c.get("status"), f"{kind}.status"), as_str(c.get("reason"), f"{kind}.reason"),
            as_str(c.get("message"), f"{kind}.message", 2048), as_time(c.get("lastTransitionTime"), f"{kind}.time"),
        )  # fmt: skip
    pods, gpus = _pod_sets(as_list(spec.get("podSets"), "spec.podSets"))
    admission = as_dict(status.get("admission"), "status.admission")
    active = spec.get("active", True)
    if not isinstance(active, bool):
        raise Malformed(f"spec.active is {active!r}, not a boolean")
    evictions = 0
    stats = as_dict(status.get("schedulingStats"), "status.schedulingStats")
    for i, e in enumerate(as_list(stats.get("evictions"), "status.schedulingStats.evictions")):
        n = as_dict(e, f"status.schedulingStats.evictions[{i}]").get("count", 0)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_PODS:
            raise Malformed(f"status.schedulingStats.evictions[{i}].count is {n!r}, not a count")
        evictions += n
    return Workload(
        uid=uid, namespace=as_str(md.get("namespace"), "metadata.namespace"),
        name=as_str(md.get("name"), "metadata.name"), local_queue=as_str(spec.get("queueName"), "spec.queueName"),
        cluster_queue=as_str(admission.get("clusterQueue"), "status.admission.clusterQueue"),
        created=as_time(md.get("creationTimestamp"), "metadata.creationTimestamp"),
        deleted=as_time(md.get("deletionTimestamp"), "metadata.deletionTimestamp"), active=active,
        gpus_per_node=gpus / pods if pods else 0.0, nodes=max(pods, 1), conditions=conds,
        evictions=min(evictions, MAX_PODS),
    )  # fmt: skip


#: Pods of one Workload (Kubernetes: a PodSet's count is an int32).
MAX_PODS = 2**31 - 1


def _pod_sets(sets: list[Any]) -> tuple[int, float]:
    """(pods that ask for GPUs, GPUs they ask for in all)."""
    pods, gpus = 0, 0.0
    for i, ps in enumerate(sets):
        ps = as_dict(ps, f"spec.podSets[{i}]")
        count = ps.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_PODS:
            raise Malformed(f"spec.podSets[{i}].count is {count!r}, not a pod count")
        template = as_dict(ps.get("template"), f"spec.podSets[{i}].template")
        try:
            per_pod = gpus_requested(template)
        except (TypeError, ValueError, AttributeError) as exc:
            raise Malformed(f"spec.podSets[{i}] GPU request unreadable: {exc}") from None
        if not math.isfinite(per_pod) or per_pod < 0:
            raise Malformed(f"spec.podSets[{i}] asks for {per_pod!r} GPUs per pod")
        if per_pod > 0:
            pods += count
            gpus += per_pod * count
    return pods, gpus


@dataclass
class _Wl:
    """What was emitted for one Workload (kept in the state file)."""

    attempt: int = 1
    emitted: list[str] = field(default_factory=list)
    reason: str = ""
    admitted_at: float | None = None
    queued_at: float | None = None  # when the current attempt's wait began
    reason_at: float | None = None  # the time given to the last pending reason
    namespace: str = ""
    name: str = ""
    local_queue: str = ""
    cluster_queue: str = ""
    gpus_per_node: float = 0.0
    nodes: int = 1

    def rid(self, uid: str) -> str:
        return uid if self.attempt == 1 else f"{uid}#{self.attempt}"

    @property
    def done(self) -> bool:
        return any(e in self.emitted for e in ("end", "cancel", "preempt"))

    @property
    def waiting(self) -> bool:
        return "submit" in self.emitted and "start" not in self.emitted and not self.done


class KueueWorkloadCollector(WatchedState, Source):
    name = "kueue-workloads"

    def __init__(self, cluster: str, api: KubeApi, state_file: Path, source: str = "kueue-collector",
                 boot_id: str | None = None, watch_timeout_s: int = 300, clock: Any = time.time) -> None:  # fmt: skip
        self.cluster = cluster
        self.api = api
        self.state_file = state_file
        self.watch_timeout_s = watch_timeout_s
        self.clock = clock
        self.seq = Sequencer(source, boot_id or uuidlib.uuid4().hex[:12])
        self.wls: dict[str, _Wl] = {}
        self.rv = ""
        self.relists = 0
        self.errors = 0
        self.skipped = 0  # Workload objects that could not be read or described on the wire
        self._queues: dict[tuple[str, str], tuple[str, float]] = {}  # (ns, LQ) -> (ClusterQueue, asked at)
        self.version = ""  # the API version in use, found at the first list
        self._queue: list[Message] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._load()

    # ------------------------------------------------------------------ state
    def _load(self) -> None:
        try:
            raw = json.loads(self.state_file.read_text())
            wls = state_records(raw.get("workloads", {}), _Wl)
            rv, version = raw.get("rv", ""), raw.get("version", "")
            if not isinstance(rv, str):
                raise TypeError(f"resourceVersion {rv!r} is not a string")
            if version not in ("", *VERSIONS):
                raise ValueError(f"API version {version!r} is not one this collector reads")
            self.rv, self.wls, self.version = rv, wls, version
        except FileNotFoundError:
            pass
        except UNREADABLE_STATE as exc:
            log.warning("Kueue collector state %s unreadable (%s); relisting", self.state_file, exc)

    def _save(self) -> None:
        wls = {k: v.__dict__ for k, v in self.wls.items()}
        replace_file(
            self.state_file, json.dumps({"rv": self.rv, "version": self.version, "workloads": wls}).encode()
        )

    # ------------------------------------------------------------------ events
    def _event(self, uid: str, st: _Wl, event: str, when: float | None, reason: str = "",
               cause: str | None = None) -> None:  # fmt: skip
        try:
            msg = SchedulerEvent(
                source=self.seq.source, boot_id=self.seq.boot_id, seq=self.seq.next(), cluster=self.cluster,
                ts=self.clock() if when is None else when, scheduler="kueue", event=event,  # type: ignore[arg-type]
                request_id=st.rid(uid), name=f"{st.namespace}/{st.name}"[:256], account=st.namespace,
                queue=f"{st.namespace}/{st.local_queue}"[:256], cluster_queue=st.cluster_queue or None,
                gpus_per_node=st.gpus_per_node, nodes=st.nodes, reason=reason[:256],
                cause=cause,  # type: ignore[arg-type]
            )  # fmt: skip
        except ValidationError as exc:  # a shape the wire cannot carry: counted, logged, never raised
            self.skipped += 1
            log.warning("Kueue workload %s/%s: %s event not sent: %s", st.namespace, st.name, event,
                        exc.errors(include_url=False)[0]["msg"])  # fmt: skip
            return
        self._queue.append(msg)

    def _emit(self, uid: str, st: _Wl, event: str, when: float | None, reason: str = "",
              cause: str | None = None) -> None:  # fmt: skip
        self._event(uid, st, event, when, reason, cause)
        st.emitted.append(event)  # also when the wire refused it: never retried every round

    def _cluster_queue(self, ns: str, lq: str) -> str:
        key = (ns, lq)
        got = self._queues.get(key)
        now = self.clock()
        if got is None or (not got[0] and now - got[1] > QUEUE_RETRY_S):
            path = f"/apis/{self.version or GROUP_VERSION}/namespaces/{urllib.parse.quote(ns, safe='')}/localqueues/"
            cq: Any = ""
            try:
                spec = self.api.get_object(path + urllib.parse.quote(lq, safe="")).get("spec")
                cq = spec.get("clusterQueue") if isinstance(spec, dict) else ""
            except (OSError, ValueError, Forbidden) as exc:  # missing (Kueue says so too), refused, down
                log.info("LocalQueue %s/%s unknown for now: %s", ns, lq, exc)
            got = self._queues[key] = (cq[:256] if isinstance(cq, str) else "", now)
        return got[0]

    object_name, object_log = "Kueue workload", log

    def _look(self, kind: str, obj: Any) -> None:
        try:
            wl = read(obj)
        except Malformed as exc:
            self.skipped += 1
            md = obj.get("metadata") if isinstance(obj, dict) else None
            where = f"{md.get('namespace')}/{md.get('name')}" if isinstance(md, dict) else "?"
            log.warning("Kueue workload %s skipped: %s", where, exc)
            uid = md.get("uid") if isinstance(md, dict) else None
            if kind == "DELETED" and isinstance(uid, str) and uid in self.wls:
                # one followed before still ends, now, with what was known of it (else its request
                # stays open until a relist, which a resuming watch never makes)
                gone = self.wls.pop(uid)
                if not gone.done and "submit" in gone.emitted:
                    self._emit(uid, gone, "end" if "start" in gone.emitted else "cancel", None, "Deleted")
            return
        st = self.wls.get(wl.uid)
        if st is None:
            if wl.gpus_per_node <= 0 or kind == "DELETED" or wl.true("Finished"):
                return  # no GPUs, or history: nothing waits
            st = self.wls[wl.uid] = _Wl()
            if wl.evictions:  # first seen after evictions (or after losing the state file): the same ids
                st.attempt = 1 + wl.evictions
                ev, rq = wl.cond("Evicted"), wl.cond("Requeued")
                st.queued_at = (ev.at if ev is not None else None) or (rq.at if rq is not None else None)
        self._follow(wl, st, kind)
        if kind == "DELETED" or (st.done and wl.true("Finished")):
            # over for good: forgotten, so that the state file holds what may still happen (Kueue
            # keeps finished Workloads as long as its retention policy says, by default forever)
            del self.wls[wl.uid]

    def _follow(self, wl: Workload, st: _Wl, kind: str) -> None:
        uid = wl.uid
        st.namespace, st.name, st.local_queue = wl.namespace, wl.name, wl.local_queue
        if wl.gpus_per_node > 0:
            st.gpus_per_node, st.nodes = wl.gpus_per_node, wl.nodes
        if wl.cluster_queue:
            st.cluster_queue = wl.cluster_queue
        elif not st.cluster_queue and wl.local_queue:
            st.cluster_queue = self._cluster_queue(wl.namespace, wl.local_queue)
        if kind == "DELETED":
            if not st.done and "submit" in st.emitted:
                self._emit(uid, st, "end" if "start" in st.emitted else "cancel", wl.deleted, "Deleted")
            return
        self._readmitted_unseen(wl, st)
        if st.done:
            if "cancel" in st.emitted and wl.active and not wl.true("Finished"):
                self._next_attempt(st)  # deactivated while waiting, active again: back in the queue
            else:
                return
        if "submit" not in st.emitted:
            if not wl.active or wl.true("Finished"):
                return  # not waiting (already finished when first seen: history, not a wait)
            rq = wl.cond("Requeued")
            when = wl.created if st.attempt == 1 else st.queued_at or (rq.at if rq is not None else None)
            st.queued_at = self.clock() if when is None else when  # 0.0 is a time (refused by the wire)
            self._emit(uid, st, "submit", st.queued_at)
        fin = wl.cond("Finished")
        if fin is not None and fin.status == "True":
            self._emit(uid, st, "end" if "start" in st.emitted else "cancel", fin.at, _why(fin))
            return
        adm = wl.cond("Admitted")
        if adm is not None and adm.status == "True":
            if "start" not in st.emitted:
                st.admitted_at = adm.at
                self._emit(uid, st, "start", adm.at)
            return
        if "start" in st.emitted:  # admitted before, not now: evicted, and back in the queue
            ev = wl.cond("Evicted")
            ev = ev if ev is not None and ev.status == "True" else adm
            at = ev.at if ev is not None and ev.at is not None else self.clock()
            self._emit(uid, st, "preempt", at, "Evicted: " + _why(ev) if ev else "Evicted")
            # deactivated (evicted as Deactivated): it waits again only once active, from then
            self._next_attempt(st, at if wl.active else None)
            if wl.active:
                self._emit(uid, st, "submit", at)
                self._pending(wl, st)
            return
        if not wl.active:  # deactivated while waiting: it left the queue
            self._emit(uid, st, "cancel", None, "Deactivated")
            return
        self._pending(wl, st)

    def _readmitted_unseen(self, wl: Workload, st: _Wl) -> None:
        """Evicted and admitted again while nobody watched: the newer admission says so."""
        adm = wl.cond("Admitted")
        if ("start" not in st.emitted or st.done or adm is None or adm.status != "True"
                or adm.at is None or st.admitted_at is None or adm.at <= st.admitted_at):  # fmt: skip
            return
        ev = wl.cond("Evicted")
        at = ev.at if ev is not None and ev.at is not None and st.admitted_at < ev.at <= adm.at else adm.at
        self._emit(wl.uid, st, "preempt", at, "Evicted (unobserved)" + (": " + _why(ev) if ev else ""))
        self._next_attempt(st, at)
        self._emit(wl.uid, st, "submit", at)

    @staticmethod
    def _next_attempt(st: _Wl, queued_at: float | None = None) -> None:
        """The wait after an eviction (or a reactivation) is a new request."""
        st.attempt += 1
        st.emitted, st.reason, st.admitted_at, st.queued_at, st.reason_at = [], "", None, queued_at, None

    def _pending(self, wl: Workload, st: _Wl) -> None:
        qr, adm = wl.cond("QuotaReserved"), wl.cond("Admitted")
        ev = wl.cond("Evicted")
        if (
            qr is not None
            and qr.status == "False"
            and ev is not None
            and ev.status == "True"
            and (qr.message == ev.message)
        ):  # requeued after an eviction: Kueue repeats the eviction's words
            c, tier = qr, "Evicted"
            cause: Cause = "capacity" if ev.reason == "NodeFailures" else "policy"
        elif qr is not None and qr.status == "False":
            c, (tier, cause) = qr, classify(qr.reason, qr.message)
        elif qr is not None and qr.status == "True" and adm is not None and adm.status == "False":
            c, tier, cause = adm, "AdmissionChecks", "policy"  # quota reserved, checks not satisfied yet
        else:
            return  # not looked at by Kueue yet
        reason = f"{tier}: {_why(c)}"[:256]
        if reason != st.reason:
            # Kueue changed the message, not the condition: said when seen (as the pod collector)
            at = reason_time(c.at, st.reason_at, bool(st.reason), self.clock)
            at = max(at, st.queued_at or at)  # never before the wait it explains (a requeued attempt)
            self._event(wl.uid, st, "pending_reason", at, reason, cause)
            st.reason, st.reason_at = reason, at

    # ------------------------------------------------------------------ list and watch
    def _workloads(self) -> str:
        return f"/apis/{self.version or GROUP_VERSION}/workloads"

    def as_list(self) -> tuple[list[dict[str, Any]], str]:
        """The first list finds the version the server serves (404: not this one)."""
        if self.version:
            return self.api.list_objects(self._workloads())
        for v in VERSIONS:
            try:
                out = self.api.list_objects(f"/apis/{v}/workloads")
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    continue
                raise
            self.version = v
            if v != VERSIONS[0]:
                log.info("Kueue serves %s (no %s): reading Workloads through it", v, VERSIONS[0])
            return out
        raise NotServed(f"no Workload API ({', '.join(VERSIONS)}) on this server: is Kueue installed?")

    def _relist(self) -> None:
        items, rv = self.as_list()
        self.relists += 1
        self._queues.clear()
        seen = set()
        for obj in items:
            md = obj.get("metadata") if isinstance(obj, dict) else None
            if isinstance(md, dict):
                seen.add(md.get("uid"))
            self._observe("ADDED", obj)
        for uid, st in list(self.wls.items()):  # deleted while nobody watched
            if uid not in seen:
                if not st.done and "submit" in st.emitted:
                    kind = "end" if "start" in st.emitted else "cancel"
                    self._event(uid, st, kind, None, "Deleted (unobserved)")
                del self.wls[uid]
        self.rv = rv

    def sync_once(self) -> None:
        """One list-or-watch round (the background thread loops on it)."""
        with self._lock:
            if not self.rv:
                self._relist()
                self._save()
                return
            rv = self.rv
        if not self.version:  # resumed from a state file: find the version first
            with self._lock:
                self.as_list()
        stream = self.api.watch_objects(self._workloads(), rv, self.watch_timeout_s, self._opened)
        self._apply_watch(stream, rv, log, "Kueue workloads: ")

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.sync_once()
                except Forbidden as exc:
                    self.errors += 1
                    log.error("Kubernetes API refused the Kueue collector: %s", exc)
                    self._stop.wait(30)
                except NotServed as exc:
                    self.errors += 1
                    log.error("Kueue collector: %s; asking again in 60 s", exc)
                    self._stop.wait(60)
                except Exception as exc:  # API down, network, Kueue's CRDs not installed: retry
                    self.errors += 1
                    log.warning("Kueue workload watch failed: %s; retrying", exc)
                    self._stop.wait(2)

        self._thread = threading.Thread(target=loop, name="gpuslo-kueue-watch", daemon=True)
        self._thread.start()

    def collect(self, now: float) -> list[Message]:
        with self._lock:
            out, self._queue = self._queue, []
        return out

    def close(self) -> None:
        """Stop the watch thread, ending the watch in progress at once."""
        self._end_watch()

    # ------------------------------------------------------------------ live gauge
    def pending(self, now: float) -> dict[tuple[str, str], tuple[int, float]]:
        """Per (``namespace/LocalQueue``, ClusterQueue): Workloads waiting and the oldest wait (s)."""
        out: dict[tuple[str, str], tuple[int, float]] = {}
        with self._lock:
            for st in self.wls.values():
                if not st.waiting:
                    continue
                key = (f"{st.namespace}/{st.local_queue}", st.cluster_queue)
                n, age = out.get(key, (0, 0.0))
                out[key] = (n + 1, max(age, now - (st.queued_at or now)))
        return out


def _why(c: Condition | None) -> str:
    if c is None:
        return ""
    return f"{c.reason}: {c.message}".strip(": ") if c.message else c.reason


class PendingGauge(Collector):
    """The live pending-age gauge on the agent's ``/metrics``, per LocalQueue and ClusterQueue."""

    def __init__(self, col: KueueWorkloadCollector, clock: Any = time.time) -> None:
        self.col = col
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["local_queue", "cluster_queue"]
        n = GaugeMetricFamily("gpuslo_kueue_pending_workloads", "Kueue workloads (asking for GPUs) "
                              "waiting for admission", labels=labels)  # fmt: skip
        age = GaugeMetricFamily("gpuslo_kueue_pending_age_seconds", "Seconds the longest-waiting Kueue "
                                "workload has waited for admission", labels=labels)  # fmt: skip
        for (lq, cq), (count, oldest) in sorted(self.col.pending(self.clock()).items()):
            n.add_metric([lq, cq], count)
            age.add_metric([lq, cq], max(0.0, oldest))
        yield n
        yield age  # the skipped workloads are a counter, gpuslo_kueue_skipped_workloads_total (the CLI's counts)

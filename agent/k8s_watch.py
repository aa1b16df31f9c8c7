"""Cluster-level Kubernetes collector: watches pods that request GPUs and turns their
life into scheduler events (submit, pending_reason with the scheduler's own Unschedulable
message, start when bound, end, cancel when deleted before it ran).

The API protocol as the API server speaks it: list (``GET /api/v1/pods``) for the state and
a ``resourceVersion``; then watch (``?watch=1&resourceVersion=…&allowWatchBookmarks=true``),
a stream of newline-delimited JSON events (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR). A
410 Gone (an expired resourceVersion after etcd compaction: an HTTP 410 or an ERROR event
whose status code is 410) makes it relist and diff against what it knew, so no event is
lost or doubled. The resourceVersion and what was emitted per pod are kept in a state
file, so a restarted collector resumes where it stopped.

GPUs requested are the pod's ``nvidia.com/gpu`` (and ``nvidia.com/mig-*``) limits, plus, with
a :class:`~gpuslo.agent.dra.DraView`, the GPU-class devices of its ResourceClaims (Dynamic
Resource Allocation); a pending pod that asks for GPUs only through claims carries the
starvation cause its claims' devices imply (``cause`` on ``pending_reason``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuslo.agent.base import Sequencer, Source
from gpuslo.core.fileio import UNREADABLE_STATE, replace_file, state_records
from gpuslo.wire import Message, SchedulerEvent
from gpuslo.wire.models import StarvationCause

if TYPE_CHECKING:
    from gpuslo.agent.dra import Demand, DraView

log = logging.getLogger(__name__)

GPU_RESOURCES = ("nvidia.com/gpu",)
#: the most GPUs one request may carry on the wire (SchedulerEvent.gpus_per_node): more is said as this
MAX_GPUS = 1024.0
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Gone(Exception):
    """The resourceVersion is too old (410): relist."""


class Forbidden(Exception):
    pass


#: What a 401/403 on a path means the service account lacks (the first prefix that matches).
_NEEDS = (
    ("/api/v1/nodes", "the agent needs get on nodes"),
    ("/apis/kueue.x-k8s.io/", "the collector needs get/list/watch on Kueue workloads and localqueues"),
    (
        "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName",
        "the agent with --k8s-resource-slices needs get/list/watch on resourceslices (resource.k8s.io)",
    ),
    (
        "/apis/resource.k8s.io/",
        "the collector needs get/list/watch on resourceslices, resourceclaims and "
        "resourceclaimtemplates (resource.k8s.io)",
    ),
    ("", "the collector needs get/list/watch on pods"),
)


def _needs(path: str) -> str:
    return next(what for prefix, what in _NEEDS if path.startswith(prefix))


def ts(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


_SUFFIX = {"": 1, "m": 10**-3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}  # fmt: skip


_QUANTITY = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)")


def quantity(v: Any) -> float:
    """A Kubernetes resource quantity as the API server writes it (``4``, ``1k``, ``2e3``, ``1Ki``,
    ``500m``); ValueError for anything else. Signs and infinities pass: the caller judges them."""
    m = _QUANTITY.fullmatch(str(v).strip())
    if m is None or m[2] not in _SUFFIX:
        raise ValueError(f"{v!r} is not a resource quantity")
    return float(m[1]) * _SUFFIX[m[2]]


def gpus_requested(pod: dict[str, Any]) -> float:
    total = 0.0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        for kind in ("limits", "requests"):
            vals = res.get(kind) or {}
            n = sum(
                quantity(v) for k, v in vals.items() if k in GPU_RESOURCES or k.startswith("nvidia.com/mig-")
            )
            if n:
                total += n
                break
    return total


class KubeApi:
    def __init__(
        self, server: str, token: str | None = None, ca_file: str | None = None, timeout_s: float = 10.0
    ) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.ctx = ssl.create_default_context(cafile=ca_file) if server.startswith("https") else None

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        return cls(f"https://{host}:{port}", (SA_DIR / "token").read_text().strip(), str(SA_DIR / "ca.crt"))

    def _open(self, path: str, timeout_s: float) -> Any:
        req = urllib.request.Request(self.server + path, headers={"Accept": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.urlopen(req, timeout=timeout_s, context=self.ctx)
        except urllib.error.HTTPError as exc:
            if exc.code == 410:
                raise Gone(path) from None
            if exc.code in (401, 403):
                body = exc.read().decode(errors="replace")[:300]
                needs = _needs(path)
                raise Forbidden(f"{exc.code} on {path}: {body} ({needs})") from None
            raise

    def get_node(self, name: str) -> dict[str, Any]:
        with self._open(f"/api/v1/nodes/{urllib.parse.quote(name, safe='')}", self.timeout_s) as r:
            data = json.load(r)
        if not isinstance(data, dict):
            raise ValueError(f"Node {name}: not a JSON object")
        return data

    def list_pods(self) -> tuple[list[dict[str, Any]], str]:
        return self.list_objects("/api/v1/pods")

    def watch_pods(self, rv: str, timeout_s: int = 300,
                   on_open: Callable[[Any], None] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        return self.watch_objects("/api/v1/pods", rv, timeout_s, on_open)

    def get_object(self, path: str) -> dict[str, Any]:
        with self._open(path, self.timeout_s) as r:
            data = json.load(r)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON object")
        return data

    def list_objects(self, path: str) -> tuple[list[dict[str, Any]], str]:
        """Every object of a collection (``/api/v1/pods``, ``/apis/GROUP/VERSION/PLURAL``) and
        the list's resourceVersion, for a watch to start from."""
        data = self.get_object(path)
        items = data.get("items") or []
        if not isinstance(items, list):
            raise ValueError(f"{path}: items is not a list")
        md = data.get("metadata")
        md = md if isinstance(md, dict) else {}
        return [i for i in items if isinstance(i, dict)], str(md.get("resourceVersion") or "")

    def watch_objects(self, path: str, rv: str, timeout_s: int = 300,
                      on_open: Callable[[Any], None] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        """The watch events from ``rv``; ``on_open`` gets the response (for :func:`interrupt`)."""
        q = urllib.parse.urlencode({"watch": 1, "allowWatchBookmarks": "true", "resourceVersion": rv,
                                    "timeoutSeconds": timeout_s})  # fmt: skip
        sep = "&" if "?" in path else "?"  # a path with its own query (a fieldSelector)
        with self._open(f"{path}{sep}{q}", timeout_s + 10) as r:
            if on_open is not None:
                on_open(r)
            for line in r:
                if not line.strip():
                    continue
                ev = json.loads(line)
                kind, obj = ev.get("type", ""), ev.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                yield kind, obj


def interrupt(response: Any) -> None:
    """End a watch another thread is reading (its read returns): a shutdown of its socket, since
    closing the response would wait for the reader's lock. Anything unexpected is ignored: the
    watch then ends at its own timeout."""
    try:
        sock = response.fp.raw._sock
        sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        pass


@dataclass
class _Pod:
    emitted: list[str] = field(default_factory=list)
    reason: str = ""
    # who it is, so that a pod deleted while nobody watched still ends with its name and size
    namespace: str = ""
    name: str = ""
    gpus: float = 0.0
    cause: str = ""  # the last starvation cause said (DRA pods)


def resource_version(obj: Any, current: str) -> str:
    """The resourceVersion a watch event carries, else the one we had."""
    md = obj.get("metadata") if isinstance(obj, dict) else None
    got = md.get("resourceVersion") if isinstance(md, dict) else None
    return got if isinstance(got, str) and got else current


class WatchedState:
    """What a list/watch collector (pods here, Kueue Workloads in agent/kueue.py) shares: a watch
    stream applied event by event under the lock, the resourceVersion and the state file kept
    with each one, and a relist when the server says 410 Gone."""

    rv: str
    _lock: threading.Lock
    _stop: threading.Event
    _response: Any = None  # of the watch in progress, to interrupt at close

    def _opened(self, response: Any) -> None:
        """``on_open`` of every watch: the response kept so :meth:`_end_watch` can end it."""
        self._response = response
        if self._stop.is_set():  # closed while it was opening
            interrupt(response)

    def _end_watch(self) -> None:
        """Stop, ending the watch in progress at once (not at its timeout, up to 300 s)."""
        self._stop.set()
        if self._response is not None:
            interrupt(self._response)

    def _observe(self, kind: str, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def _relist(self) -> None:
        raise NotImplementedError

    def _save(self) -> None:
        raise NotImplementedError

    def _apply_watch(
        self, stream: Iterator[tuple[str, dict[str, Any]]], rv: str, logger: logging.Logger, what: str
    ) -> None:
        try:
            for kind, obj in stream:
                with self._lock:
                    if kind != "BOOKMARK":
                        self._observe(kind, obj)
                    self.rv = resource_version(obj, self.rv)
                    self._save()
                if self._stop.is_set():
                    return
        except Gone:
            logger.info("%sresourceVersion %s expired (410 Gone); relisting", what, rv)
            with self._lock:
                self._relist()
                self._save()


class K8sPodCollector(WatchedState, Source):
    name = "k8s-pods"

    def __init__(self, cluster: str, api: KubeApi, state_file: Path, source: str = "k8s-collector",
                 boot_id: str | None = None, watch_timeout_s: int = 300,
                 skip_labels: tuple[str, ...] = (), dra: DraView | None = None) -> None:  # fmt: skip
        self.cluster = cluster
        self.dra = dra  # GPUs requested through ResourceClaims (None: device-plugin requests only)
        self._unknown: dict[str, dict[str, Any]] = {}  # pods whose claims could not be read yet
        self._logged_unknown: set[str] = set()
        self._waiting: dict[str, Demand] = {}  # pending pods asking through claims: causes re-judged
        self._judged: Any = None  # the DRA view's version they were judged at
        # pods whose GPU request another collector follows (Kueue's pods, through their Workload)
        self.skip_labels = skip_labels
        self.api = api
        self.state_file = state_file
        self.watch_timeout_s = watch_timeout_s
        self.seq = Sequencer(source, boot_id or uuidlib.uuid4().hex[:12])
        self.pods: dict[str, _Pod] = {}
        self.rv = ""
        self.relists = 0
        self.errors = 0
        self._queue: list[Message] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._load()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ state
    def _load(self) -> None:
        try:
            raw = json.loads(self.state_file.read_text())
            pods = state_records(raw.get("pods", {}), _Pod)
            rv = raw.get("rv", "")
            if not isinstance(rv, str):
                raise TypeError(f"resourceVersion {rv!r} is not a string")
            self.rv, self.pods = rv, pods  # both or neither: a version without its pods would skip events
        except FileNotFoundError:
            pass
        except UNREADABLE_STATE as exc:  # its own file never stops it
            log.warning("k8s collector state %s unreadable (%s); relisting", self.state_file, exc)

    def _save(self) -> None:
        replace_file(
            self.state_file,
            json.dumps({"rv": self.rv, "pods": {k: v.__dict__ for k, v in self.pods.items()}}).encode(),
        )

    # ------------------------------------------------------------------ events
    def _event(self, uid: str, st: _Pod, event: str, when: float | None, reason: str = "", node: str = "",
               cause: StarvationCause | None = None) -> None:  # fmt: skip
        ns = st.namespace
        self._queue.append(SchedulerEvent(
            source=self.seq.source, boot_id=self.seq.boot_id, seq=self.seq.next(), cluster=self.cluster,
            ts=when or time.time(), scheduler="k8s", event=event,  # type: ignore[arg-type]
            request_id=uid, name=f"{ns}/{st.name}"[:256], account=ns[:256], queue=ns[:256],
            gpus_per_node=min(st.gpus, MAX_GPUS), nodes=1, reason=reason[:256], assigned_nodes=(node,) if node else (),
            cause=cause,
        ))  # fmt: skip

    def _gpus(self, kind: str, uid: str, pod: dict[str, Any]) -> tuple[float, Demand | None]:
        """GPUs requested (device plugin + claims) and the claims' demand (None without claims);
        a pod whose claims cannot be read yet is kept to be looked at again (-1 GPUs)."""
        try:
            plain = gpus_requested(pod)
        except (TypeError, ValueError, AttributeError) as exc:  # the API server validates: not from it
            plain = 0.0
            self._once_per_pod(uid, "pod %s: GPU request unreadable (%s); not followed", exc)
        if not math.isfinite(plain) or plain < 0:
            plain = 0.0
        if self.dra is None or not (pod.get("spec") or {}).get("resourceClaims"):
            return plain, None
        from gpuslo.agent.dra import ClaimUnknown

        try:
            demand = self.dra.pod_demand(pod)
        except ClaimUnknown as exc:
            if kind == "DELETED":
                self._unknown.pop(uid, None)
            else:
                self._unknown[uid] = pod
            self._once_per_pod(uid, "pod %s: its GPUs through claims are unknown (%s); looked at again when "
                               "claims change (logged once per pod)", exc)  # fmt: skip
            return -1.0, None
        self._unknown.pop(uid, None)
        return plain + demand.gpus, (demand if demand.per_class and not plain else None)

    def _once_per_pod(self, uid: str, msg: str, exc: Exception) -> None:
        if uid not in self._logged_unknown and len(self._logged_unknown) < 10_000:
            self._logged_unknown.add(uid)
            log.warning(msg, uid, exc)

    def _observe(self, kind: str, pod: dict[str, Any]) -> None:
        md = pod.get("metadata") or {}
        uid = md.get("uid") or f"{md.get('namespace')}/{md.get('name')}"
        if (
            self.skip_labels
            and uid not in self.pods
            and any(k in (md.get("labels") or {}) for k in self.skip_labels)
        ):
            return  # counted by another collector; one followed from before the skip: to its end
        gpus, demand = self._gpus(kind, uid, pod)
        if gpus < 0 and uid in self.pods:
            gpus = self.pods[uid].gpus  # known from before: its size stays
        if gpus <= 0:
            return
        st = self.pods.setdefault(uid, _Pod())
        st.namespace, st.name, st.gpus = md.get("namespace", ""), md.get("name", ""), gpus
        if "submit" not in st.emitted:
            self._event(uid, st, "submit", ts(md.get("creationTimestamp")))
            st.emitted.append("submit")
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        conds = {c.get("type"): c for c in status.get("conditions") or []}
        sched = conds.get("PodScheduled") or {}
        done = any(e in st.emitted for e in ("end", "cancel"))
        if kind == "DELETED" or spec.get("nodeName") or done:
            self._waiting.pop(uid, None)
        if kind == "DELETED":
            if not done:
                kind_ = "end" if "start" in st.emitted else "cancel"
                self._event(uid, st, kind_, ts(md.get("deletionTimestamp")), "Deleted")
                st.emitted.append(kind_)
            return
        if spec.get("nodeName") and "start" not in st.emitted:
            self._event(uid, st, "start", ts(sched.get("lastTransitionTime")), node=spec["nodeName"])
            st.emitted.append("start")
        elif not spec.get("nodeName") and sched.get("status") == "False":
            reason = f"{sched.get('reason', '')}: {sched.get('message', '')}".strip(": ")
            if reason != st.reason:
                cause = self.dra.cause(demand) if self.dra is not None and demand is not None else None
                self._event(
                    uid, st, "pending_reason", ts(sched.get("lastTransitionTime")), reason, cause=cause
                )
                st.reason, st.cause = reason, cause or ""
            if demand is not None:
                self._waiting[uid] = demand
            else:
                self._waiting.pop(uid, None)
        phase = status.get("phase")
        if phase in ("Succeeded", "Failed") and not done:
            ends = [ts((cs.get("state") or {}).get("terminated", {}).get("finishedAt"))
                    for cs in status.get("containerStatuses") or []]  # fmt: skip
            self._event(uid, st, "end", max([e for e in ends if e] or [0.0]) or None, phase)
            st.emitted.append("end")

    def _relist(self) -> None:
        items, rv = self.api.list_pods()
        self.relists += 1
        seen = set()
        for pod in items:
            md = pod.get("metadata") or {}
            seen.add(md.get("uid"))
            self._observe("ADDED", pod)
        self._unknown = {u: p for u, p in self._unknown.items() if u in seen}
        for uid, st in list(self.pods.items()):  # gone while we were not watching
            if uid not in seen:
                if not any(e in st.emitted for e in ("end", "cancel")):
                    kind = "end" if "start" in st.emitted else "cancel"
                    self._event(uid, st, kind, None, "Deleted (unobserved)")
                del self.pods[uid]
        self.rv = rv

    def sync_once(self) -> None:
        """One list-or-watch round (the background thread loops on it)."""
        with self._lock:
            for pod in list(self._unknown.values()):  # claims unreadable last time: again
                self._observe("MODIFIED", pod)
            if not self.rv:
                self._relist()
                self._save()
                return
            rv = self.rv
        self._apply_watch(self.api.watch_pods(rv, self.watch_timeout_s, self._opened), rv, log, "")

    def start(self) -> None:
        if self.dra is not None:
            try:  # a first look, so that the first pending pods are judged against the devices
                self.dra.relist()
            except Exception as exc:  # contained: the watches retry; until then no cause is given
                log.warning("DRA objects not listed yet (%s); their watches retry", exc)

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.sync_once()
                except Forbidden as exc:
                    self.errors += 1
                    log.error("Kubernetes API refused the collector: %s", exc)
                    self._stop.wait(30)
                except Exception as exc:  # API down, network: retry
                    self.errors += 1
                    log.warning("Kubernetes watch failed: %s; retrying", exc)
                    self._stop.wait(2)

        if self.dra is not None:
            self.dra.start()
        self._thread = threading.Thread(target=loop, name="gpuslo-k8s-watch", daemon=True)
        self._thread.start()

    def _rejudge(self, now: float) -> None:
        """When slices or claims changed: pods whose claims could not be read, looked at again;
        pending pods asking through claims: their cause again (the
        scheduler's words stay the same, ``cannot allocate all claims``, while the free devices
        move), a ``pending_reason`` with the same reason and the new cause, so that the cause
        said before an incident opens is the one of its time."""
        if self.dra is None or not (self._waiting or self._unknown):
            return
        version = self.dra.version
        if version == self._judged:
            return
        self._judged = version
        for pod in list(self._unknown.values()):  # a claim they lacked may have come with the change
            self._observe("MODIFIED", pod)
        for uid, demand in list(self._waiting.items()):
            st = self.pods.get(uid)
            if st is None or any(e in st.emitted for e in ("start", "end", "cancel")):
                del self._waiting[uid]
                continue
            cause = self.dra.cause(demand)
            if cause is not None and cause != st.cause:
                self._event(uid, st, "pending_reason", now, st.reason, cause=cause)
                st.cause = cause

    def collect(self, now: float) -> list[Message]:
        with self._lock:
            self._rejudge(now)
            out, self._queue = self._queue, []
        return out

    def close(self) -> None:
        """Stop the watch threads, ending the watches in progress at once."""
        self._end_watch()
        if self.dra is not None:
            self.dra.close()

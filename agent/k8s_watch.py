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

GPUs requested are the pod's ``nvidia.com/gpu`` (and ``nvidia.com/mig-*``, as their part of a GPU) limits, plus, with
a :class:`~gpuslo.agent.dra.DraView`, the GPU-class devices of its ResourceClaims (Dynamic
Resource Allocation); a pending pod that asks for GPUs only through claims carries the
starvation cause its claims' devices imply (``cause`` on ``pending_reason``).
"""

from __future__ import annotations

import http.client
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

from pydantic import ValidationError

from gpuslo.agent.base import Sequencer, Source
from gpuslo.core.backoff import Backoff
from gpuslo.core.fileio import UNREADABLE_STATE, replace_file, state_records
from gpuslo.core.http import open_stream, read_url
from gpuslo.core.mig import gpu_fraction
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


#: RFC 3339 (Go's ``time.RFC3339``, with which the API server reads and writes its times): the zone
#: is never left out.
_RFC3339 = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)", re.ASCII | re.IGNORECASE
)


def ts(text: str | None) -> float | None:
    """An RFC 3339 time as the API server writes it (``2026-12-05T00:00:00Z``; a MicroTime's
    fraction, an offset) in epoch seconds; None for none. ValueError for anything else, a time
    without a zone too: the API server refuses one, and this host's zone is not the cluster's."""
    if not text:
        return None
    if not isinstance(text, str) or not _RFC3339.fullmatch(text):
        raise ValueError(f"{text!r} is not an RFC 3339 time")
    return datetime.fromisoformat(text.upper().replace("Z", "+00:00")).timestamp()


class Malformed(ValueError):
    """A Kubernetes object a collector cannot read (the reason says which part)."""


def as_dict(v: Any, what: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise Malformed(f"{what} is a {type(v).__name__}, not an object")
    return v


def as_list(v: Any, what: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise Malformed(f"{what} is a {type(v).__name__}, not a list")
    return v


def as_str(v: Any, what: str, limit: int | None = 256) -> str:
    """A string field, cut at ``limit`` (None: whole, for a name the wire must refuse if too long)."""
    if v is None:
        return ""
    if not isinstance(v, str):
        raise Malformed(f"{what} is a {type(v).__name__}, not a string")
    return v[:limit]


def as_time(v: Any, what: str) -> float | None:
    text = as_str(v, what)
    try:
        return ts(text)
    except ValueError:
        raise Malformed(f"{what} {v!r} is not an RFC 3339 time") from None


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


MIG_RESOURCE = "nvidia.com/mig-"


def resource_gpus(name: str) -> float:
    """The part of a GPU one unit of the extended resource ``name`` is: 1 for ``nvidia.com/gpu``;
    for ``nvidia.com/mig-PROFILE`` the profile's compute slices over its GPU's (1g.10gb: 1/7,
    as the agent's MIG instance rows count in capacity; :mod:`gpuslo.core.mig`), 1 for a
    profile NVIDIA's table does not list; 0 for any other resource."""
    if name in GPU_RESOURCES:
        return 1.0
    if name.startswith(MIG_RESOURCE):
        f = gpu_fraction(name[len(MIG_RESOURCE) :])
        return 1.0 if f is None else f
    return 0.0


def _container_gpu_resources(c: Any) -> dict[str, float]:
    """A container's GPU resources (those :func:`resource_gpus` counts), by name: its limits, else
    its requests (an extended resource's request is its limit)."""
    res = c.get("resources") or {}
    for kind in ("limits", "requests"):
        vals = {k: quantity(v) for k, v in (res.get(kind) or {}).items() if resource_gpus(k)}
        if any(vals.values()):
            return vals
    return {}


def gpus_requested(pod: dict[str, Any]) -> float:
    """The GPUs a pod asks, as the scheduler counts a pod's request (``PodRequests`` of
    k8s.io/component-helpers, per resource): its containers' sum plus its sidecars' (init
    containers with ``restartPolicy: Always``), or the most one init container needs beside
    the sidecars started before it, whichever is more. A container asks its limits, else its
    requests; a MIG device is its part of a GPU (:func:`resource_gpus`: a pod asking
    ``nvidia.com/mig-1g.10gb: 1`` was one whole GPU, so the starvation snapshot, which counts a
    free 1g.10gb instance as 1/7, read a shortfall). Init containers were left out: a pod whose
    init container asks 4 GPUs beside 1 in its container, which the scheduler places only where
    4 are free, read as asking 1 (a wait for GPUs said ``policy``)."""
    spec = pod.get("spec") or {}
    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for k, v in _container_gpu_resources(c).items():
            total[k] = total.get(k, 0.0) + v
    sidecars: dict[str, float] = {}
    peak: dict[str, float] = {}  # the most any init container needs, with the sidecars before it
    for c in spec.get("initContainers") or []:
        own = _container_gpu_resources(c)
        if c.get("restartPolicy") == "Always":  # a sidecar: runs beside the containers to the end
            for k, v in own.items():
                sidecars[k] = sidecars.get(k, 0.0) + v
                total[k] = total.get(k, 0.0) + v
            need = dict(sidecars)
        else:
            need = {k: own.get(k, 0.0) + sidecars.get(k, 0.0) for k in own.keys() | sidecars.keys()}
        for k, v in need.items():
            peak[k] = max(peak.get(k, 0.0), v)
    for k, v in peak.items():  # (a resource no init container asks keeps its sum, whatever its sign)
        total[k] = max(total.get(k, v), v)
    return sum(v * resource_gpus(k) for k, v in sorted(total.items()))


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

    def _request(self, path: str) -> urllib.request.Request:
        req = urllib.request.Request(self.server + path, headers={"Accept": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return req

    def _refused(self, path: str, exc: urllib.error.HTTPError) -> Exception:
        """What an error answer means here: Gone (410: relist), Forbidden (401/403, with the RBAC
        it lacks), else the HTTPError itself (its body bounded by gpuslo.core.http)."""
        if exc.code == 410:
            return Gone(path)
        if exc.code in (401, 403):
            body = exc.read().decode(errors="replace")[:300]
            return Forbidden(f"{exc.code} on {path}: {body} ({_needs(path)})")
        return exc

    def _get_json(self, path: str, max_bytes: int) -> dict[str, Any]:
        """One GET read whole within ``timeout_s`` (a server that trickles fails it: each read's
        timeout alone let one go on for ever) and at most ``max_bytes`` long, as a JSON object."""
        try:
            body = read_url(self._request(path), self.timeout_s, max_bytes, self.ctx)
        except urllib.error.HTTPError as exc:
            raise self._refused(path, exc) from None
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON object")
        return data

    def get_node(self, name: str) -> dict[str, Any]:
        return self._get_json(f"/api/v1/nodes/{urllib.parse.quote(name, safe='')}", MAX_OBJECT_BYTES)

    def list_pods(self) -> tuple[list[dict[str, Any]], str]:
        return self.list_objects("/api/v1/pods")

    def watch_pods(self, rv: str, timeout_s: int = 300,
                   on_open: Callable[[Any], None] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        return self.watch_objects("/api/v1/pods", rv, timeout_s, on_open)

    def get_object(self, path: str) -> dict[str, Any]:
        return self._get_json(path, MAX_OBJECT_BYTES)

    def list_objects(self, path: str) -> tuple[list[dict[str, Any]], str]:
        """Every object of a collection (``/api/v1/pods``, ``/apis/GROUP/VERSION/PLURAL``) and
        the list's resourceVersion, for a watch to start from. Read in pages of ``LIST_PAGE``
        objects (``limit`` and ``continue``, one consistent snapshot, as client-go's pager reads
        them), each within ``timeout_s`` and ``MAX_PAGE_BYTES``: a big cluster's pods read in
        one answer made it as long, and as slow, as the cluster is big. A 410 on a page (its
        continue token expired) is Gone: the caller lists again. A list that is no snapshot is a
        ValueError: pages at different resourceVersions, a ``continue`` that is no string (read as
        none, the pods of the pages after it were taken for deleted), a token given twice or more
        than ``MAX_LIST_PAGES`` pages (a list that never ends, asked again as fast as answered)."""
        items: list[dict[str, Any]] = []
        token = ""
        given: set[str] = set()
        rv: str | None = None
        sep = "&" if "?" in path else "?"
        while True:
            q = {"limit": LIST_PAGE} | ({"continue": token} if token else {})
            data = self._get_json(f"{path}{sep}{urllib.parse.urlencode(q)}", MAX_PAGE_BYTES)
            page = data.get("items") or []
            if not isinstance(page, list):
                raise ValueError(f"{path}: items is not a list")
            items += [i for i in page if isinstance(i, dict)]
            md = data.get("metadata")
            md = md if isinstance(md, dict) else {}
            at = str(md.get("resourceVersion") or "")
            if rv is None:
                rv = at
            elif at != rv:
                raise ValueError(f"{path}: a page at resourceVersion {at[:40]!r} after one at {rv[:40]!r}: "
                                 "the pages are not one snapshot")  # fmt: skip
            given_next = md.get("continue")
            if given_next is None or given_next == "":
                return items, rv
            if not isinstance(given_next, str):
                raise ValueError(f"{path}: metadata.continue is a {type(given_next).__name__}, not a token")
            token = given_next
            if token in given:
                raise ValueError(f"{path}: the continue token {token[:60]!r} came again: the list never ends")
            given.add(token)
            if len(given) >= MAX_LIST_PAGES:
                raise ValueError(
                    f"{path}: more than {MAX_LIST_PAGES} pages of {LIST_PAGE}: the list never ends"
                )

    def watch_objects(self, path: str, rv: str, timeout_s: int = 300,
                      on_open: Callable[[Any], None] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        """The watch events from ``rv``; ``on_open`` gets the response (for :func:`interrupt`)."""
        q = urllib.parse.urlencode({"watch": 1, "allowWatchBookmarks": "true", "resourceVersion": rv,
                                    "timeoutSeconds": timeout_s})  # fmt: skip
        sep = "&" if "?" in path else "?"  # a path with its own query (a fieldSelector)
        url = f"{path}{sep}{q}"
        try:
            r, deadline = open_stream(self._request(url), timeout_s + 10, timeout_s + WATCH_SLACK_S, self.ctx)
        except urllib.error.HTTPError as exc:
            raise self._refused(url, exc) from None
        with r, deadline:
            if on_open is not None:
                on_open(r)
            while line := r.readline(MAX_WATCH_LINE + 1):  # one line held at a time, never more than this
                if len(line) > MAX_WATCH_LINE and not line.endswith(b"\n"):
                    raise BadWatchLine(f"a watch line is longer than {MAX_WATCH_LINE} bytes: {line[:120]!r}")
                if not line.strip():
                    continue
                kind, obj = watch_event(line)
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                yield kind, obj


#: The longest watch line read (bytes): the API server takes no object over 3 MiB (its request body
#: limit), and its JSON is a few times that at most. A line past it (a proxy, a server gone wrong)
#: is no event: read whole, it grew the process until the memory limit killed it, and the
#: restarted one watched from the same version into the same line.
MAX_WATCH_LINE = 16 << 20
#: The most one object (a GET) or one page of a list is read to: the API server keeps no object
#: over 1.5 MiB (etcd's limit) and a page holds ``LIST_PAGE`` of them, a few times longer as JSON
MAX_OBJECT_BYTES = 16 << 20
LIST_PAGE = 500
#: the most pages of one list read: a million objects, several times any cluster's (Kubernetes is
#: tested to 150,000 pods); a server whose tokens never end is not asked for ever
MAX_LIST_PAGES = 2000
MAX_PAGE_BYTES = 256 << 20
#: a watch asked to end after ``timeoutSeconds`` is shut this long after that if it has not
#: (a server or a proxy that trickles keeps each read under its timeout for ever); the watcher
#: then watches again from the last resourceVersion it saw
WATCH_SLACK_S = 60


class BadWatchLine(ValueError):
    """A line of a watch stream that is not a watch event: what follows it cannot be trusted to
    continue from it (see :meth:`WatchedState._apply_watch`)."""


def watch_event(line: bytes) -> tuple[str, dict[str, Any]]:
    """One line of a watch stream: its ``type`` and ``object``; :class:`BadWatchLine` where it is
    not JSON or not an object with a string ``type`` and an object ``object`` (the API server
    writes neither; a proxy in the way can)."""
    shown = line[:120].decode("utf-8", "replace").strip()
    try:
        ev = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        raise BadWatchLine(f"a watch line is not JSON: {shown!r}") from None
    if (
        not isinstance(ev, dict)
        or not isinstance(ev.get("type"), str)
        or not isinstance(ev.get("object"), dict)
    ):
        raise BadWatchLine(f"a watch line is not an event (a type and an object): {shown!r}")
    return ev["type"], ev["object"]


def interrupt(response: Any) -> None:
    """End a watch another thread is reading (its read returns): a shutdown of its socket, since
    closing the response would wait for the reader's lock. Anything unexpected is ignored: the
    watch then ends at its own timeout."""
    try:
        sock = response.fp.raw._sock
        sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        pass


@dataclass(frozen=True)
class Pod:
    """What the collector reads from one Pod object (beside its GPU request)."""

    uid: str  # metadata.uid, else namespace/name
    namespace: str
    name: str
    labels: frozenset[str]
    created: float | None
    deleted: float | None
    node: str  # spec.nodeName: "" while not bound
    scheduled: str  # the PodScheduled condition: its status ("" without one),
    why: str  # "reason: message",
    scheduled_at: float | None  # and its lastTransitionTime
    phase: str
    finished: float | None  # the latest finishedAt of its terminated containers


def pod_key(obj: Any) -> str | None:
    """The key :func:`read_pod` gives ``obj`` (None where it has none), read without judging the rest."""
    md = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(md, dict):
        return None
    uid = md.get("uid")
    return uid if isinstance(uid, str) and uid else f"{md.get('namespace')}/{md.get('name')}"


def read_pod(obj: Any) -> Pod:
    """Parse one Pod object; :class:`Malformed` names what is wrong. The API server writes
    none of these: a shape that fails here is skipped, never guessed at."""
    pod = as_dict(obj, "the object")
    md, spec, status = (as_dict(pod.get(k), k) for k in ("metadata", "spec", "status"))
    ns, name = as_str(md.get("namespace"), "metadata.namespace"), as_str(md.get("name"), "metadata.name")
    uid = md.get("uid") or pod_key(pod)  # the same key a relist's diff looks for
    if not isinstance(uid, str) or len(uid) > 256:
        shown = f"{len(uid)} characters" if isinstance(uid, str) else f"a {type(uid).__name__}"
        raise Malformed(f"metadata.uid is {shown}, not a UID")
    sched: dict[str, Any] = {}
    for i, c in enumerate(as_list(status.get("conditions"), "status.conditions")):
        c = as_dict(c, f"status.conditions[{i}]")
        if as_str(c.get("type"), f"status.conditions[{i}].type") == "PodScheduled":
            sched = c
    reason = as_str(sched.get("reason"), "PodScheduled.reason")
    why = f"{reason}: {as_str(sched.get('message'), 'PodScheduled.message', 2048)}"
    finished = []
    for i, cs in enumerate(as_list(status.get("containerStatuses"), "status.containerStatuses")):
        state = as_dict(
            as_dict(cs, f"status.containerStatuses[{i}]").get("state"), f"status.containerStatuses[{i}].state"
        )
        term = as_dict(state.get("terminated"), f"status.containerStatuses[{i}].state.terminated")
        at = as_time(term.get("finishedAt"), f"status.containerStatuses[{i}].state.terminated.finishedAt")
        if at is not None:
            finished.append(at)
    return Pod(
        uid=uid, namespace=ns, name=name, labels=frozenset(as_dict(md.get("labels"), "metadata.labels")),
        created=as_time(md.get("creationTimestamp"), "metadata.creationTimestamp"),
        deleted=as_time(md.get("deletionTimestamp"), "metadata.deletionTimestamp"),
        node=as_str(spec.get("nodeName"), "spec.nodeName", None), scheduled=as_str(sched.get("status"), "PodScheduled.status"),
        why=why.strip(": "), scheduled_at=as_time(sched.get("lastTransitionTime"), "PodScheduled.lastTransitionTime"),
        phase=as_str(status.get("phase"), "status.phase"), finished=max(finished, default=None),
    )  # fmt: skip


@dataclass
class _Pod:
    emitted: list[str] = field(default_factory=list)
    reason: str = ""
    # who it is, so that a pod deleted while nobody watched still ends with its name and size
    namespace: str = ""
    name: str = ""
    gpus: float = 0.0
    cause: str = ""  # the last starvation cause said (DRA pods)
    reason_at: float | None = None  # the time given to the last pending reason


#: The store keeps an event's time to the millisecond and one event per request, kind and time:
#: a pending reason said within the same millisecond as the one before it would replace it. Two
#: milliseconds: past the next one however the time is cut to milliseconds (down or to nearest).
REASON_STEP_S = 0.002


def reason_time(at: float | None, last: float | None, said: bool, clock: Callable[[], float]) -> float:
    """The time of a pending reason that follows the one said before (``said``, at ``last``): its
    condition's time ``at`` where that moved on past ``last``, else when it is seen (``clock``:
    the scheduler rewrote its message, not the condition, whose time stays while its status
    does). Never at or before ``last``: at least :data:`REASON_STEP_S` after it, whatever the
    clock says (a clock set back, two messages in one millisecond, the API server's clock ahead
    of this host's), since the store kept one of two reasons of one time, and a reason said
    before the one it follows read as the older. One said with no time kept (a state file from
    before the time was kept) was said at most at the condition's time (as then)."""
    if said and last is None:
        last = at
    if at is None or (last is not None and at <= last):
        at = clock()
    return at if last is None else max(at, last + REASON_STEP_S)


def resource_version(obj: Any, current: str) -> str:
    """The resourceVersion a watch event carries, else the one we had."""
    md = obj.get("metadata") if isinstance(obj, dict) else None
    got = md.get("resourceVersion") if isinstance(md, dict) else None
    return got if isinstance(got, str) and got else current


#: The pause before a relist when a watch from a list's version is answered 410 Gone before any
#: event, again (a server whose watch cache is behind the list it served): doubling up to the
#: most, reset by a watch that brings anything. A first 410 (a version gone stale) relists at once.
GONE_BACKOFF_S = 1.0
GONE_BACKOFF_MAX_S = 60.0

#: What looking at one object may raise that is the API's trouble, not the object's (a claim or a
#: LocalQueue fetched while a pod or a Workload is looked at): the round fails and is retried from
#: the same resourceVersion, so that no event is lost to a passing outage.
API_TROUBLE = (OSError, http.client.HTTPException, Forbidden, Gone)


class WatchedState:
    """What a list/watch collector (pods here, Kueue Workloads in agent/kueue.py) shares: a watch
    stream applied event by event under the lock, the resourceVersion and the state file kept
    with each one, and a relist when the server says 410 Gone."""

    rv: str
    _lock: threading.Lock
    _stop: threading.Event
    _response: Any = None  # of the watch in progress, to interrupt at close
    bad_lines = 0  # watch lines that were not events (each one: a fresh list)
    _gone_backoff: Backoff | None = None  # the pause before a relist after 410s that came at once
    _gone_again = False  # the last watch ended in 410 Gone before any event
    skipped = 0  # objects (or their events) that could not be read or described on the wire

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

    #: what one object is called in the log, and the log (the subclass's module's)
    object_name = "object"
    object_log = logging.getLogger(__name__)

    def _observe(self, kind: str, obj: dict[str, Any]) -> None:
        """One event's object looked at (:meth:`_look`). One that raises anything but
        :data:`API_TROUBLE` (a shape no reader foresaw) is skipped and counted, as a malformed one
        is. Raised, it would stop the round before the resourceVersion passed it, and every round
        after would meet it again: the whole collector stuck on one object."""
        try:
            self._look(kind, obj)
        except API_TROUBLE:
            raise
        except Exception as exc:  # one object: skipped and counted, the others (and the watch) go on
            self.skipped += 1
            md = obj.get("metadata") if isinstance(obj, dict) else None
            where = f"{md.get('namespace')}/{md.get('name')}" if isinstance(md, dict) else "?"
            self.object_log.warning("%s %s skipped: %s: %s", self.object_name, where[:300], type(exc).__name__,
                                    str(exc)[:300])  # fmt: skip

    def _look(self, kind: str, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def _relist(self) -> None:
        raise NotImplementedError

    def _save(self) -> None:
        raise NotImplementedError

    def _apply_watch(
        self, stream: Iterator[tuple[str, dict[str, Any]]], rv: str, logger: logging.Logger, what: str
    ) -> None:
        seen = False  # an event (or a bookmark) came: the version listed was good for a while
        try:
            for kind, obj in stream:
                if not seen:  # this round is no 410 at once: a later one is an ordinary expiry
                    seen, self._gone_again = True, False
                with self._lock:
                    if kind != "BOOKMARK":
                        self._observe(kind, obj)
                    self.rv = resource_version(obj, self.rv)
                    self._save()
                if self._stop.is_set():
                    return
        except Gone:
            if self._gone_backoff is None:
                self._gone_backoff = Backoff(GONE_BACKOFF_S, GONE_BACKOFF_MAX_S)
            if seen or not self._gone_again:  # an expiry (a restart from an old version): at once
                self._gone_backoff.reset()
                self._gone_again = not seen
                logger.info("%sresourceVersion %s expired (410 Gone); relisting", what, rv)
            else:  # the version of the list before expired before anything came: at once would spin
                wait = self._gone_backoff.fail()
                logger.warning("%sresourceVersion %s expired (410 Gone) before any event; relisting in %.0f s",
                               what, rv, wait)  # fmt: skip
                if self._stop.wait(wait):
                    return
            with self._lock:
                self._relist()
                self._save()
        except BadWatchLine as exc:
            # Watching again from the last good version would read the same line again, for ever:
            # the next round lists afresh instead (after the loop's pause), and counts it.
            with self._lock:
                self.bad_lines += 1
                self.rv = ""
                self._save()
            raise BadWatchLine(f"{what}{exc}; listing afresh") from None
        else:  # ended at its timeout, events or none: the version listed was good, as above
            self._gone_again = False


class K8sPodCollector(WatchedState, Source):
    name = "k8s-pods"

    def __init__(self, cluster: str, api: KubeApi, state_file: Path, source: str = "k8s-collector",
                 boot_id: str | None = None, watch_timeout_s: int = 300,
                 skip_labels: tuple[str, ...] = (), dra: DraView | None = None,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.cluster = cluster
        self.clock = clock
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
        self.skipped = 0  # Pod objects or events that could not be read or described on the wire
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
        try:
            msg = SchedulerEvent(
                source=self.seq.source, boot_id=self.seq.boot_id, seq=self.seq.next(), cluster=self.cluster,
                ts=self.clock() if when is None else when, scheduler="k8s", event=event,  # type: ignore[arg-type]
                request_id=uid, name=f"{ns}/{st.name}"[:256], account=ns[:256], queue=ns[:256],
                gpus_per_node=min(st.gpus, MAX_GPUS), nodes=1, reason=reason[:256],
                assigned_nodes=(node,) if node else (), cause=cause,
            )  # fmt: skip
        except ValidationError as exc:  # a shape the wire cannot carry: counted, logged, never raised
            self.skipped += 1
            log.warning("pod %s/%s: %s event not sent: %s", ns, st.name, event,
                        exc.errors(include_url=False)[0]["msg"])  # fmt: skip
            return
        self._queue.append(msg)

    def _gpus(self, kind: str, uid: str, pod: dict[str, Any]) -> tuple[float, Demand | None]:
        """GPUs requested (device plugin + claims) and the claims' demand (None without claims);
        a pod whose claims cannot be read yet is kept to be looked at again (-1 GPUs)."""
        try:
            plain = gpus_requested(pod)
        except (TypeError, ValueError, AttributeError) as exc:  # the API server validates: not from it
            plain = 0.0
            self.skipped += 1
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

    object_name, object_log = "pod", log

    def _look(self, kind: str, pod: dict[str, Any]) -> None:
        try:
            p = read_pod(pod)
        except Malformed as exc:  # one pod: skipped and counted, the others (and the watch) go on
            self.skipped += 1
            md = pod.get("metadata") if isinstance(pod, dict) else None
            where = f"{md.get('namespace')}/{md.get('name')}" if isinstance(md, dict) else "?"
            log.warning("pod %s skipped: %s", where[:300], exc)
            if kind == "DELETED":  # a pod followed before still ends (else its request stays open for ever)
                self._deleted(pod_key(pod), None)
            return
        uid = p.uid
        if self.skip_labels and uid not in self.pods and any(k in p.labels for k in self.skip_labels):
            return  # counted by another collector; one followed from before the skip: to its end
        gpus, demand = self._gpus(kind, uid, pod)
        if gpus <= 0 and uid in self.pods:
            # known from before: its size stays (a pod's requests do not change; one unreadable
            # now, or claims unknown, must not drop a followed pod, whose end would be lost)
            gpus = self.pods[uid].gpus
        if gpus <= 0:
            return
        st = self.pods.setdefault(uid, _Pod())
        st.namespace, st.name, st.gpus = p.namespace, p.name, gpus
        if "submit" not in st.emitted:
            self._event(uid, st, "submit", p.created)
            st.emitted.append("submit")  # also when the wire refused it: never retried every event
        done = any(e in st.emitted for e in ("end", "cancel"))
        if kind == "DELETED" or p.node or done:
            self._waiting.pop(uid, None)
        if kind == "DELETED":
            self._deleted(uid, p.deleted)
            return
        if p.node and "start" not in st.emitted:
            self._event(uid, st, "start", p.scheduled_at, node=p.node)
            st.emitted.append("start")
        elif not p.node and p.scheduled == "False":
            if p.why != st.reason:
                cause = self.dra.cause(demand) if self.dra is not None and demand is not None else None
                # at the condition's time, or when seen where the scheduler changed its message
                # and not the condition: at the condition's unchanged time it would be the store's
                # same event (cluster, request, event, ts) as the reason before, and replace it
                at = reason_time(p.scheduled_at, st.reason_at, bool(st.reason), self.clock)
                self._event(uid, st, "pending_reason", at, p.why, cause=cause)
                st.reason, st.cause, st.reason_at = p.why, cause or "", at
            if demand is not None:
                self._waiting[uid] = demand
            else:
                self._waiting.pop(uid, None)
        if p.phase in ("Succeeded", "Failed") and not done:
            self._event(uid, st, "end", p.finished, p.phase)
            st.emitted.append("end")

    def _deleted(self, uid: str | None, when: float | None) -> None:
        """The pod ``uid`` is gone: its end (``cancel`` if it never started) at ``when`` (None: now)
        unless sent, and it is forgotten, so that the state file holds the pods that may still
        change (it held every GPU pod since the last relist, which a watch that keeps resuming
        never makes)."""
        if uid is None:
            return
        st = self.pods.pop(uid, None)
        self._waiting.pop(uid, None)
        self._unknown.pop(uid, None)
        if st is None or any(e in st.emitted for e in ("end", "cancel")):
            return
        self._event(uid, st, "end" if "start" in st.emitted else "cancel", when, "Deleted")

    def _relist(self) -> None:
        items, rv = self.api.list_pods()
        self.relists += 1
        seen = set()
        for pod in items:
            seen.add(pod_key(pod))  # a malformed pod followed before is still there: not ended
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
                at = reason_time(now, st.reason_at, bool(st.reason), self.clock)
                self._event(uid, st, "pending_reason", at, st.reason, cause=cause)
                st.cause, st.reason_at = cause, at

    def counts(self) -> dict[str, float]:
        """Counters for the agent's ``/metrics``: pods (or their events) skipped as unreadable, and
        watch lines that were not events (each followed by a fresh list), the DRA watches' included."""
        bad = self.bad_lines + (self.dra.bad_lines() if self.dra is not None else 0)
        return {"gpuslo_k8s_skipped_pods": self.skipped, "gpuslo_k8s_watch_bad_lines": bad}

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

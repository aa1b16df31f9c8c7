"""Dynamic Resource Allocation (``resource.k8s.io/v1``, GA in Kubernetes 1.34) as gpuslo reads it.

A DRA driver publishes the devices of a node in ResourceSlices (``spec.driver``, ``spec.pool``,
``spec.nodeName``, ``spec.devices[]`` with ``attributes``); a pod asks for devices through
``spec.resourceClaims`` (a ResourceClaim by name, or a ResourceClaimTemplate the
resourceclaim controller turns into one claim per pod); the scheduler allocates the claim's
devices itself and writes them to ``status.allocation.devices.results`` as (driver, pool,
device).

- On the node, :class:`ResourceSliceIndex` watches this node's ResourceSlices and resolves the
  (driver, pool, device) that the kubelet's PodResources names to the GPU or MIG UUID: the
  NVIDIA DRA driver (``k8s-dra-driver-gpu``, driver ``gpu.nvidia.com``) publishes a string
  attribute ``uuid`` for each GPU and MIG device (``uuid`` or the qualified
  ``gpu.nvidia.com/uuid``: an unqualified attribute name is in the driver's domain).
- In the cluster collector, :class:`DraView` caches slices, claims and templates (list/watch,
  with the 410/relist machinery of :class:`~gpuslo.agent.k8s_watch.WatchedState`): a pod's GPUs
  requested through claims (:meth:`DraView.pod_demand`), and the starvation cause of a pending
  one against the devices the scheduler sees free: devices in ResourceSlices minus devices in
  allocated claims (:meth:`DraView.cause`).

Which devices are GPUs is data (:data:`DEFAULT_GPU_CLASSES`): a DeviceClass name, its driver and
the ``type`` attribute its selector asks for (the NVIDIA driver's classes ``gpu.nvidia.com``:
``type == 'gpu'``, ``mig.nvidia.com``: ``type == 'mig'``). DeviceClass CEL selectors are not
evaluated here; a site's own GPU classes are named with ``--dra-gpu-class NAME=DRIVER[:TYPE]``.
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.error
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from gpuslo.agent.k8s_watch import Forbidden, KubeApi, WatchedState
from gpuslo.core.mig import gpu_fraction

log = logging.getLogger(__name__)

RESOURCE_V1 = "/apis/resource.k8s.io/v1"
#: how long a cache waits before asking again an API server that does not serve resource.k8s.io/v1 (s)
NOT_SERVED_RETRY_S = 300.0
Cause = Literal["capacity", "fragmentation", "policy"]
#: the largest device count a request may carry (``count`` is an int64 in resource.k8s.io/v1)
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class GpuClass:
    """A DeviceClass whose devices are GPUs: its ``driver``, and the device ``type`` attribute
    it selects ('' for any device of the driver)."""

    name: str
    driver: str
    type: str = ""

    def matches(self, driver: str, device: dict[str, Any]) -> bool:
        return driver == self.driver and (not self.type or attribute(device, driver, "type") == self.type)


DEFAULT_GPU_CLASSES = (
    GpuClass("gpu.nvidia.com", "gpu.nvidia.com", "gpu"),
    GpuClass("mig.nvidia.com", "gpu.nvidia.com", "mig"),
)


def parse_gpu_class(text: str) -> GpuClass:
    """``NAME[=DRIVER[:TYPE]]`` (the driver defaults to the name): ValueError when malformed."""
    name, eq, rest = text.partition("=")
    driver, _, kind = (rest if eq else name).partition(":")
    if not name or not driver or any(c.isspace() for c in text):
        raise ValueError(f"{text!r}: expected NAME[=DRIVER[:TYPE]]")
    return GpuClass(name, driver, kind)


def attribute(device: dict[str, Any], driver: str, name: str) -> str | None:
    """A device's string attribute ``name`` (unqualified, or qualified with the driver's domain)."""
    attrs = device.get("attributes")
    if not isinstance(attrs, dict):
        return None
    for key in (name, f"{driver}/{name}"):
        v = attrs.get(key)
        if isinstance(v, dict) and isinstance(v.get("string"), str):
            return str(v["string"])
    return None


def _spec(obj: Any) -> dict[str, Any]:
    s = obj.get("spec") if isinstance(obj, dict) else None
    return s if isinstance(s, dict) else {}


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _dict(obj: Any, key: str) -> dict[str, Any]:
    v = obj.get(key) if isinstance(obj, dict) else None
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class SliceDevice:
    driver: str
    pool: str
    node: str  # '' for a device any node may use (allNodes, a node selector)
    name: str
    device: dict[str, Any]


def slice_devices(slices: Iterable[dict[str, Any]]) -> Iterator[SliceDevice]:
    """The devices of the ResourceSlices, of each pool only the slices of its newest generation
    (older ones are being replaced: the scheduler ignores them too)."""
    newest: dict[tuple[str, str], int] = {}
    parsed = []
    for s in slices:
        spec = _spec(s)
        pool = _dict(spec, "pool")
        g = pool.get("generation")
        gen = g if isinstance(g, int) else 0
        key = (_str(spec.get("driver")), _str(pool.get("name")))
        newest[key] = max(newest.get(key, gen), gen)
        parsed.append((key, gen, spec))
    for (driver, pool_name), gen, spec in parsed:
        if gen != newest[(driver, pool_name)]:
            continue
        for d in _list(spec.get("devices")):
            if isinstance(d, dict) and _str(d.get("name")):
                node = _str(d.get("nodeName")) or _str(spec.get("nodeName"))
                yield SliceDevice(driver, pool_name, node, d["name"], d)


class WatchedObjects(WatchedState):
    """A list/watch cache of one collection (``/apis/resource.k8s.io/v1/resourceslices`` …),
    by ``namespace/name``; no state file: a restart lists again."""

    def __init__(self, api: KubeApi, path: str, what: str, watch_timeout_s: int = 300) -> None:
        self.api, self.path, self.what, self.watch_timeout_s = api, path, what, watch_timeout_s
        self.objects: dict[str, dict[str, Any]] = {}
        self.rv = ""
        self.relists = 0
        self.errors = 0
        self.version = 0  # bumped on every change, for indexes built on the objects
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.not_served = False  # the API server answered 404 (no resource.k8s.io/v1)

    @staticmethod
    def key(obj: dict[str, Any]) -> str:
        md = obj.get("metadata")
        md = md if isinstance(md, dict) else {}
        return f"{_str(md.get('namespace'))}/{_str(md.get('name'))}"

    def _observe(self, kind: str, obj: dict[str, Any]) -> None:
        if not isinstance(obj, dict):
            return
        if kind == "DELETED":
            self.objects.pop(self.key(obj), None)
        else:
            self.objects[self.key(obj)] = obj
        self.version += 1

    def _relist(self) -> None:
        items, rv = self.api.list_objects(self.path)
        self.objects = {self.key(o): o for o in items}
        self.rv = rv
        self.relists += 1
        self.version += 1

    def _save(self) -> None:
        pass

    def sync_once(self) -> None:
        """One list-or-watch round (the background thread loops on it)."""
        with self._lock:
            if not self.rv:
                self._relist()
                return
            rv = self.rv
        stream = self.api.watch_objects(self.path, rv, self.watch_timeout_s, on_open=self._opened)
        self._apply_watch(stream, rv, log, f"{self.what}: ")

    def snapshot(self) -> tuple[int, list[dict[str, Any]]]:
        with self._lock:
            return self.version, list(self.objects.values())

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self.objects.get(key)

    def put(self, obj: dict[str, Any]) -> None:
        """An object fetched by name (not yet seen by the watch)."""
        with self._lock:
            self.objects.setdefault(self.key(obj), obj)
            self.version += 1

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.sync_once()
                except Forbidden as exc:
                    self.errors += 1
                    log.error("Kubernetes API refused the %s watch: %s", self.what, exc)
                    self._stop.wait(30)
                except urllib.error.HTTPError as exc:
                    self.errors += 1
                    self._not_served(exc)
                except Exception as exc:  # API down, network: retry
                    self.errors += 1
                    log.warning("%s watch failed: %s; retrying", self.what, exc)
                    self._stop.wait(2)

        self._thread = threading.Thread(target=loop, name=f"gpuslo-{self.what}", daemon=True)
        self._thread.start()

    def _not_served(self, exc: urllib.error.HTTPError) -> None:
        if exc.code != 404:
            log.warning("%s watch failed: HTTP %s %s; retrying", self.what, exc.code, exc.reason)
            self._stop.wait(2)
            return
        if not self.not_served:
            log.warning("%s: %s is not served by this API server (DRA's resource.k8s.io/v1 needs "
                        "Kubernetes 1.34 or later); asked again every %.0f s (logged once)",
                        self.what, RESOURCE_V1, NOT_SERVED_RETRY_S)  # fmt: skip
        self.not_served = True
        self._stop.wait(NOT_SERVED_RETRY_S)

    def close(self) -> None:
        """Stop the watch thread, ending a watch in progress at once."""
        self._end_watch()


class ResourceSliceIndex(WatchedObjects):
    """This node's ResourceSlices (``fieldSelector=spec.nodeName=NODE``), as a
    :data:`~gpuslo.agent.k8s.Resolver`: (driver, pool, device) → the device's ``uuid``."""

    def __init__(self, api: KubeApi, node: str, watch_timeout_s: int = 300) -> None:
        sel = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
        super().__init__(api, f"{RESOURCE_V1}/resourceslices?{sel}", "ResourceSlices", watch_timeout_s)
        self.node = node
        self._index: dict[tuple[str, str, str], str] = {}
        self._indexed = -1

    def __call__(self, driver: str, pool: str, device: str) -> str | None:
        version, slices = self.snapshot()
        if version != self._indexed:
            index = {}
            for d in slice_devices(slices):
                uuid = attribute(d.device, d.driver, "uuid")
                if uuid:
                    index[(d.driver, d.pool, d.name)] = uuid
            self._index, self._indexed = index, version
        return self._index.get((driver, pool, device))


# a CEL selector asking for one MIG profile, either way round: `…].profile == '1g.10gb'`
_PROFILE_CEL = re.compile(
    r"""\.profile\s*==\s*(['"])([^'"]+)\1|(['"])([^'"]+)\3\s*==\s*device\.attributes\[[^\]]*\]\.profile"""
)


# what makes a selector more than a conjunction: an alternative (``||``), a negation (``!``
# but not ``!=``), a conditional (``? :``); its profile equality need not hold then
_NOT_CONJUNCTION = re.compile(r"\|\||!(?!=)|\?")


def _selected_profile(exact: dict[str, Any]) -> str | None:
    """The MIG profile a request's CEL selectors ask for (lower case): None when they name none
    or several, or when a selector naming one is more than a conjunction (``profile == '1g.10gb'
    || …``, ``!(profile == '1g.10gb')``: the device given need not be of that profile)."""
    names = set()
    for sel in _list(exact.get("selectors")):
        expr = _str(_dict(sel, "cel").get("expression"))
        named = {(m[2] or m[4]).strip().lower() for m in _PROFILE_CEL.finditer(expr)}
        if named and _NOT_CONJUNCTION.search(expr):
            return None
        names |= named
    return names.pop() if len(names) == 1 else None


def _selected_part(exact: dict[str, Any]) -> float | None:
    """The part of a GPU of the MIG profile a request's CEL selectors ask for
    (:func:`_selected_profile`): None where that names none, or one the table does not list."""
    name = _selected_profile(exact)
    return None if name is None else gpu_fraction(name)


def _alternative(request: dict[str, Any], claim: dict[str, Any] | None) -> dict[str, Any] | None:
    """Of a ``firstAvailable`` request, the alternative the claim was allocated for (its results
    name it: ``REQUEST/SUBREQUEST``), else the first (what the scheduler tries first). The first
    alone was read: a claim whose first alternative asks no GPU but was given its GPU one
    counted none."""
    alts = [a for a in _list(request.get("firstAvailable")) if isinstance(a, dict)]
    name = _str(request.get("name"))
    results = _list(_dict(_dict(_dict(claim, "status"), "allocation"), "devices").get("results"))
    given = {_str(res.get("request")).partition("/")[2] for res in results
             if isinstance(res, dict) and name and _str(res.get("request")).startswith(name + "/")}  # fmt: skip
    chosen = [a for a in alts if _str(a.get("name")) in given]
    return chosen[0] if chosen else (alts[0] if alts else None)


def _device_part(device: dict[str, Any], driver: str) -> float:
    """The part of a GPU a published device is: a MIG device (``type`` mig) its profile's, else 1."""
    if attribute(device, driver, "type") != "mig":
        return 1.0
    profile = attribute(device, driver, "profile")
    part = gpu_fraction(profile) if profile else None
    return 1.0 if part is None else part


class _DeviceIndex:
    """(driver, pool, device) -> the published device, built at the first call (once a pod's
    allocated claim asks)."""

    def __init__(self, slices: WatchedObjects) -> None:
        self.slices = slices
        self._index: dict[tuple[str, str, str], dict[str, Any]] | None = None

    def __call__(self) -> dict[tuple[str, str, str], dict[str, Any]]:
        if self._index is None:
            self._index = {
                (d.driver, d.pool, d.name): d.device for d in slice_devices(self.slices.snapshot()[1])
            }
        return self._index


class ClaimUnknown(Exception):
    """A pod's claim (or claim template) that cannot be read yet: its GPUs are unknown."""


@dataclass(frozen=True)
class Demand:
    """A pod's devices per GPU class, through its claims (what the causes compare with free
    devices); ``allocated``: every claim is; ``parts``: the GPUs they are, a MIG device as its
    part of a GPU (:func:`gpuslo.core.mig.gpu_fraction`), None where every device is a whole
    GPU (then the devices' count)."""

    per_class: tuple[tuple[str, float], ...] = ()
    allocated: bool = False
    parts: float | None = None
    # (class, MIG profile, devices) of the requests whose CEL selectors name one profile: the
    # causes count only free devices of that profile for them
    per_profile: tuple[tuple[str, str, float], ...] = ()
    # of per_class and per_profile, the requests of the claims already allocated: their devices
    # are the pod's own (a claim shared with a running pod, or allocated before the binding), not
    # free, and were compared with the free devices as if it needed them again
    given: tuple[tuple[str, float], ...] = ()
    given_profile: tuple[tuple[str, str, float], ...] = ()
    # the nodes of the allocated claims' devices (a device any node may use names none): the pod
    # runs where they are, so what it still needs must be free there
    on_nodes: tuple[str, ...] = ()

    def needs(self) -> tuple[list[tuple[str, float]], list[tuple[str, str, float]]]:
        """What the pod still needs of the free devices: per class, per (class, MIG profile)."""
        given, given_p = dict(self.given), {(c, p): n for c, p, n in self.given_profile}
        per = [(c, n - given.get(c, 0.0)) for c, n in self.per_class]
        profiled = [(c, p, n - given_p.get((c, p), 0.0)) for c, p, n in self.per_profile]
        return [x for x in per if x[1] > 1e-9], [x for x in profiled if x[2] > 1e-9]

    @property
    def gpus(self) -> float:
        return sum(n for _, n in self.per_class) if self.parts is None else self.parts


class DraView:
    """The cluster's DRA state for the pod collector: ResourceSlices, ResourceClaims and
    ResourceClaimTemplates of every namespace, each a :class:`WatchedObjects`."""

    def __init__(self, api: KubeApi, classes: Iterable[GpuClass] = DEFAULT_GPU_CLASSES,
                 watch_timeout_s: int = 300) -> None:  # fmt: skip
        self.api = api
        self.classes = {c.name: c for c in classes}
        self.slices = WatchedObjects(api, f"{RESOURCE_V1}/resourceslices", "ResourceSlices", watch_timeout_s)
        self.claims = WatchedObjects(api, f"{RESOURCE_V1}/resourceclaims", "ResourceClaims", watch_timeout_s)
        self.templates = WatchedObjects(
            api, f"{RESOURCE_V1}/resourceclaimtemplates", "ResourceClaimTemplates", watch_timeout_s
        )
        self.caches = (self.slices, self.claims, self.templates)
        self.fetch_errors = 0

    def start(self) -> None:
        for c in self.caches:
            c.start()

    def close(self) -> None:
        for c in self.caches:
            c.close()

    def relist(self) -> None:
        """List all three now (a test, or a first look before the watches run)."""
        for c in self.caches:
            with c._lock:
                c._relist()

    def bad_lines(self) -> int:
        """Watch lines of the three caches that were not events (each followed by a fresh list)."""
        return sum(c.bad_lines for c in self.caches)

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever slices or claims do (what free devices are computed from)."""
        return self.slices.version, self.claims.version

    @property
    def ready(self) -> bool:
        """Slices and claims have been listed: free devices can be told (before, no cause is)."""
        return bool(self.slices.rv and self.claims.rv)

    # ------------------------------------------------------------------ what a pod asks for
    def _fetch(self, cache: WatchedObjects, plural: str, ns: str, name: str) -> dict[str, Any]:
        got = cache.get(f"{ns}/{name}")
        if got is not None:
            return got
        q = urllib.parse.quote
        path = f"{RESOURCE_V1}/namespaces/{q(ns, safe='')}/{plural}/{q(name, safe='')}"
        try:
            obj = self.api.get_object(path)
        except urllib.error.HTTPError as exc:
            self.fetch_errors += 1
            raise ClaimUnknown(f"{plural} {ns}/{name}: HTTP {exc.code}") from None
        except (Forbidden, OSError, ValueError) as exc:  # ValueError: not JSON
            self.fetch_errors += 1
            raise ClaimUnknown(f"{plural} {ns}/{name}: {exc}") from None
        cache.put(obj)
        return obj

    def pod_demand(self, pod: dict[str, Any]) -> Demand:
        """The GPUs a pod asks for through ``spec.resourceClaims`` (:class:`ClaimUnknown` when a
        claim or template cannot be read). A claim's devices: per request, ``exactly`` with a
        GPU class (``count``, default 1; ``All``: every matching device of the largest node),
        or of ``firstAvailable`` the first alternative (what the scheduler tries first)."""
        ns = _str(_dict(pod, "metadata").get("namespace"))
        status = _dict(pod, "status")
        made = {_str(s.get("name")): _str(s.get("resourceClaimName"))
                for s in _list(status.get("resourceClaimStatuses")) if isinstance(s, dict)}  # fmt: skip
        per: dict[str, float] = {}
        profiled: dict[tuple[str, str], float] = {}
        given_per: dict[str, float] = {}
        given_profiled: dict[tuple[str, str], float] = {}
        on_nodes: set[str] = set()
        node_of: dict[tuple[str, str, str], str] | None = None
        parts = 0.0
        allocated = True
        devices = _DeviceIndex(self.slices)
        for rc in _list(_spec(pod).get("resourceClaims")):
            if not isinstance(rc, dict):
                continue
            claim: dict[str, Any] | None = None
            if _str(rc.get("resourceClaimName")):
                claim = self._fetch(self.claims, "resourceclaims", ns, rc["resourceClaimName"])
                spec = _spec(claim)
            elif _str(rc.get("resourceClaimTemplateName")):
                tpl = self._fetch(
                    self.templates, "resourceclaimtemplates", ns, rc["resourceClaimTemplateName"]
                )
                spec = _spec(_spec(tpl))
                generated = made.get(_str(rc.get("name")))
                claim = self.claims.get(f"{ns}/{generated}") if generated else None
            else:
                continue
            given = bool(_dict(_dict(claim, "status"), "allocation"))
            allocated = allocated and given
            if given:
                if node_of is None:
                    node_of = {
                        (d.driver, d.pool, d.name): d.node for d in slice_devices(self.slices.snapshot()[1])
                    }
                for r in _list(_dict(_dict(_dict(claim, "status"), "allocation"), "devices").get("results")):
                    if isinstance(r, dict):
                        key = (_str(r.get("driver")), _str(r.get("pool")), _str(r.get("device")))
                        if node_of.get(key):
                            on_nodes.add(node_of[key])
            for cls, n, part, profile in self._requests(spec, claim, devices):
                per[cls] = per.get(cls, 0.0) + n
                parts += part
                if profile is not None:
                    profiled[(cls, profile)] = profiled.get((cls, profile), 0.0) + n
                if given:
                    given_per[cls] = given_per.get(cls, 0.0) + n
                    if profile is not None:
                        given_profiled[(cls, profile)] = given_profiled.get((cls, profile), 0.0) + n
        whole = parts == sum(per.values())
        return Demand(tuple(sorted(per.items())), allocated and bool(per), None if whole else parts,
                      tuple(sorted((c, p, n) for (c, p), n in profiled.items())), tuple(sorted(given_per.items())),
                      tuple(sorted((c, p, n) for (c, p), n in given_profiled.items())),
                      tuple(sorted(on_nodes)))  # fmt: skip

    def _requests(self, spec: dict[str, Any], claim: dict[str, Any] | None,
                  devices: _DeviceIndex) -> Iterator[tuple[str, float, float, str | None]]:  # fmt: skip
        """Per GPU-class request: its class, its device count, the GPUs they are, and the MIG
        profile its selectors name (None: none, or a class that is not MIG's or any device's); a
        request with ``adminAccess`` (a monitoring pod's) none: it was counted as a pod asking
        for them."""
        for r in _list(_dict(spec, "devices").get("requests")):
            if not isinstance(r, dict):
                continue
            exact = r.get("exactly")
            if not isinstance(exact, dict):
                exact = _alternative(r, claim)
            if not isinstance(exact, dict) or _str(exact.get("deviceClassName")) not in self.classes:
                continue
            if exact.get("adminAccess") is True:
                continue  # a monitoring pod's access to devices others hold: it takes none, waits for none
            cls = exact["deviceClassName"]
            if exact.get("allocationMode") == "All":
                n = float(max(self._total_per_node(cls).values(), default=0))
            else:
                count = exact.get("count")  # an int64 in the API: one past it (10**400) is no float
                n = float(min(count, MAX_COUNT)) if isinstance(count, int) and count > 0 else 1.0
            c = self.classes[cls]
            profile = _selected_profile(exact) if c.type in ("mig", "") else None
            yield cls, n, self._parts(c, _str(r.get("name")), exact, n, claim, devices), profile

    def _parts(self, cls: GpuClass, request: str, exact: dict[str, Any], n: float,
               claim: dict[str, Any] | None, devices: _DeviceIndex) -> float:  # fmt: skip
        """The GPUs ``n`` devices of one request are: the devices the claim was allocated for it,
        each a MIG device's part of a GPU by its slice's ``profile`` attribute; before that, for a
        MIG class or one of any device of its driver (type ''), the profile its CEL selectors ask
        for (NVIDIA's
        ``device.attributes['gpu.nvidia.com'].profile == '1g.10gb'``); else whole GPUs. A MIG
        device counted whole made a pod waiting for one 1g.10gb slice ask for a whole GPU, where
        a free instance counts 1/7 (the device plugin's ``nvidia.com/mig-…`` requests already
        counted their part)."""
        given = [
            res for res in _list(_dict(_dict(_dict(claim, "status"), "allocation"), "devices").get("results"))
            if isinstance(res, dict) and request
            and (_str(res.get("request")) == request or _str(res.get("request")).startswith(request + "/"))
        ]  # fmt: skip
        if given:
            total = 0.0
            for res in given:
                driver = _str(res.get("driver"))
                dev = devices().get((driver, _str(res.get("pool")), _str(res.get("device"))))
                total += _device_part(dev, driver) if dev is not None else 1.0
            return total
        if cls.type not in ("mig", ""):  # a class of any device of its driver: the selector may ask for MIG
            return n
        part = _selected_part(exact)
        return n if part is None else n * part

    # ------------------------------------------------------------------ free devices
    def _total_per_node(self, cls: str) -> dict[str, int]:
        out: dict[str, int] = {}
        c = self.classes[cls]
        for d in slice_devices(self.slices.snapshot()[1]):
            if c.matches(d.driver, d.device):
                out[d.node] = out.get(d.node, 0) + 1
        return out

    def free(self) -> dict[str, dict[str, int]]:
        """Free devices per GPU class per node ('' for devices any node may use): devices in
        ResourceSlices minus those in allocated claims' ``status.allocation.devices.results``."""
        out: dict[str, dict[str, int]] = {c: {} for c in self.classes}
        for d in self._free_devices():
            for name, c in self.classes.items():
                if c.matches(d.driver, d.device):
                    out[name][d.node] = out[name].get(d.node, 0) + 1
        return out

    def free_profiles(self) -> dict[tuple[str, str], dict[str, int]]:
        """Free devices per (GPU class, MIG profile in lower case) per node, as :meth:`free`."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        for d in self._free_devices():
            profile = (attribute(d.device, d.driver, "profile") or "").strip().lower()
            if not profile:
                continue
            for name, c in self.classes.items():
                if c.matches(d.driver, d.device):
                    per = out.setdefault((name, profile), {})
                    per[d.node] = per.get(d.node, 0) + 1
        return out

    def _free_devices(self) -> Iterator[SliceDevice]:
        """The published devices no allocated claim holds (an admin-access result takes none)."""
        taken: set[tuple[str, str, str]] = set()
        for claim in self.claims.snapshot()[1]:
            for r in _list(_dict(_dict(_dict(claim, "status"), "allocation"), "devices").get("results")):
                if isinstance(r, dict) and r.get("adminAccess") is not True:  # admin access takes nothing
                    taken.add((_str(r.get("driver")), _str(r.get("pool")), _str(r.get("device"))))
        for d in slice_devices(self.slices.snapshot()[1]):
            if (d.driver, d.pool, d.name) not in taken:
                yield d

    def cause(self, demand: Demand) -> Cause | None:
        """Why a pending pod that asks for ``demand`` waits, as the scheduler's devices say:
        ``capacity`` when the free devices of a class (of a MIG profile, for a request whose
        selectors name one) are fewer than it asks for; else
        ``fragmentation`` when no node has them all (a pod's devices are on its node); else
        ``policy``. Only the devices of its claims not allocated yet are compared (an allocated
        claim's are its own already): ``policy`` when every claim is allocated; with one
        allocated on a node's devices, the rest must be free on that node. None when it asks
        for no GPU class device, or before slices and claims were listed."""
        if not demand.per_class or not self.ready:
            return None
        per, profiled = demand.needs()
        if not per:
            return "policy"  # its devices are allocated: what it waits for is not devices
        # what each need may use: a class's free devices; of one MIG profile, that profile's
        by_class, by_profile = self.free(), self.free_profiles() if profiled else {}
        needs = [(by_class[cls], n) for cls, n in per]
        needs += [(by_profile.get((cls, p), {}), n) for cls, p, n in profiled]
        for free, n in needs:
            if sum(free.values()) + 1e-9 < n:
                return "capacity"
        nodes = {node for free, _ in needs for node in free if node}
        if demand.on_nodes:  # its allocated claims' devices are on these: it runs there, or nowhere
            nodes = set(demand.on_nodes) if len(demand.on_nodes) == 1 else set()
            if not nodes:
                return "fragmentation"  # allocated on two nodes: no node has all its devices
        for node in nodes or {""}:
            if all(free.get(node, 0) + (free.get("", 0) if node else 0) + 1e-9 >= n for free, n in needs):
                return "policy"
        return "fragmentation"

"""Kubernetes GPU→pod attribution from the kubelet's PodResources gRPC API
(``v1.PodResourcesLister/List`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``).

The response is decoded here from the protobuf wire format directly (a few small messages
of ``k8s.io/kubelet/pkg/apis/podresources/v1/api.proto``, Kubernetes 1.34; no generated code
to keep in step):

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    PodResources             { string name = 1; string namespace = 2; repeated ContainerResources containers = 3; }
    ContainerResources       { string name = 1; repeated ContainerDevices devices = 2; repeated int64 cpu_ids = 3;
                               repeated ContainerMemory memory = 4; repeated DynamicResource dynamic_resources = 5; }
    ContainerDevices         { string resource_name = 1; repeated string device_ids = 2; ... }
    DynamicResource          { string claim_name = 2; string claim_namespace = 3;
                               repeated ClaimResource claim_resources = 4; }   // 1 was class_name, removed
    ClaimResource            { repeated CDIDevice cdi_devices = 1; string driver_name = 2;
                               string pool_name = 3; string device_name = 4; }

Device plugin: ``nvidia.com/gpu`` device ids are GPU UUIDs, with ``::N`` appended for
time-sliced replicas. MIG devices of the device plugin (``nvidia.com/mig-*`` under its ``mixed``
strategy, ``nvidia.com/gpu`` under ``single``) have MIG UUIDs (``MIG-…``) for ids: they attribute
the pod to that MIG instance's row (counted too, in :attr:`PodResourcesAttribution.mig_devices`;
they were counted only, the instance read as held by nobody).

Dynamic Resource Allocation: a claim resource names a device by (driver, pool, device), as in
the claim's ``status.allocation.devices.results``; the node's ResourceSlices say which GPU or
MIG instance that is (the NVIDIA DRA driver publishes a ``uuid`` attribute for each; see
:class:`~gpuslo.agent.k8s_watch.ResourceSliceIndex`). A device that no slice resolves is
counted in :attr:`PodResourcesAttribution.unresolved` and logged once.

A GPU (or MIG instance) held by several pods, through the device plugin, a claim shared by
several pods, or several claims on one device (time-slicing, MPS), is shared equally among the
pods holding it; several containers of one pod are one holder.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpuslo.agent.inflight import InFlight
from gpuslo.wire import Allocation

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class ProtobufError(ValueError):
    pass


def _varint(b: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(b):
            raise ProtobufError("truncated varint")
        byte = b[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ProtobufError("varint too long")


def fields(b: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message; unknown wire types are an error."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(b, i)
            yield num, v
        elif wt == 2:
            n, i = _varint(b, i)
            if i + n > len(b):
                raise ProtobufError("truncated length-delimited field")
            yield num, b[i : i + n]
            i += n
        elif wt in (1, 5):
            i += 8 if wt == 1 else 4
            if i > len(b):
                raise ProtobufError("truncated fixed-width field")
        else:
            raise ProtobufError(f"unsupported wire type {wt}")


@dataclass(frozen=True)
class PodDevice:
    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str


def _by_field(msg: bytes) -> dict[int, list[bytes]]:
    """The length-delimited fields of a message (strings, sub-messages), by field number."""
    out: dict[int, list[bytes]] = {}
    for num, v in fields(msg):
        if isinstance(v, bytes):
            out.setdefault(num, []).append(v)
    return out


@dataclass(frozen=True)
class ClaimDevice:
    """One device a container holds through a ResourceClaim (PodResources ``dynamic_resources``)."""

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim: str
    driver: str
    pool: str
    device: str


@dataclass(frozen=True)
class PodResourcesList:
    devices: tuple[PodDevice, ...]  # device plugin
    claims: tuple[ClaimDevice, ...]  # Dynamic Resource Allocation


def _text(f: dict[int, list[bytes]], num: int) -> str:
    if num not in f:
        return ""
    try:
        return f[num][-1].decode()
    except UnicodeDecodeError as exc:
        raise ProtobufError(f"field {num} is not UTF-8: {exc}") from None


def parse_list(b: bytes) -> PodResourcesList:
    """The devices of a ``ListPodResourcesResponse``; :class:`ProtobufError` for bytes that are
    not one."""
    devices: list[PodDevice] = []
    claims: list[ClaimDevice] = []
    for pod in _by_field(b).get(1, []):  # ListPodResourcesResponse.pod_resources
        p = _by_field(pod)
        ns, name = _text(p, 2), _text(p, 1)
        for c in p.get(3, []):  # PodResources.containers
            cf = _by_field(c)
            cname = _text(cf, 1)
            for d in cf.get(2, []):  # ContainerResources.devices
                df = _by_field(d)
                devices += [
                    PodDevice(ns, name, cname, _text(df, 1), _text({2: [i]}, 2)) for i in df.get(2, [])
                ]
            for dr in cf.get(5, []):  # ContainerResources.dynamic_resources
                drf = _by_field(dr)
                claim_ns, claim = _text(drf, 3), _text(drf, 2)
                for r in drf.get(4, []):  # DynamicResource.claim_resources
                    rf = _by_field(r)
                    claims.append(ClaimDevice(ns, name, cname, claim_ns, claim, _text(rf, 2), _text(rf, 3),
                                              _text(rf, 4)))  # fmt: skip
    return PodResourcesList(tuple(devices), tuple(claims))


def parse_list_response(b: bytes) -> list[PodDevice]:
    """The device-plugin devices of a ``ListPodResourcesResponse``."""
    return list(parse_list(b).devices)


def grpc_list(socket_path: str, timeout_s: float) -> bytes:
    """One ``List`` call over the kubelet's unix socket; the raw response bytes."""
    import grpc

    with grpc.insecure_channel(f"unix://{socket_path}") as ch:
        call = ch.unary_unary(
            LIST_METHOD, request_serializer=lambda _: b"", response_deserializer=lambda b: b
        )
        resp: bytes = call(None, timeout=timeout_s)
        return resp


#: (driver, pool, device) → the GPU or MIG UUID the node's ResourceSlices give it, or None
Resolver = Callable[[str, str, str], "str | None"]


class PodResourcesAttribution:
    """GPU UUID → the pods holding it (an :class:`~gpuslo.agent.base.Attribution`: the GPU
    source calls ``refresh()`` once per tick, then (index, uuid)).

    ``resolve``: the node's ResourceSlices (DRA devices); without it, claim devices are counted
    as unresolved. ``wait_s``: the longest ``refresh()`` waits for the kubelet (None: the call's
    whole ``timeout_s``); the call goes on meanwhile, one at a time, and its answer is applied at
    the next refresh after it came, the last mapping standing until then (counted in
    :attr:`slow`); the first answer is waited for whole (there is no last mapping: the first
    ticks, and ``agent --once``, sent every GPU as held by no pod). Each answer waited for
    whole, a kubelet that accepted the call and did not answer held every tick of the GPU
    source ``timeout_s`` (5 s): at a 1 s interval four samples of five were never taken, the
    node's capacity read a fifth of what it was."""

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        list_call: Callable[[str, float], bytes] = grpc_list,
        timeout_s: float = 5.0,
        resolve: Resolver | None = None,
        wait_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.socket_path = socket_path
        self._list = list_call
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        # the List call in flight (with wait_s): refreshes that kept the last mapping in its slow
        self._inflight: InFlight[bytes] | None = (
            None
            if wait_s is None
            else InFlight(
                f"kubelet PodResources at {socket_path}",
                wait_s,
                "gpuslo-podresources",
                first_whole=True,
                stop=stop,
            )
        )
        self.resolve = resolve
        self.failures = 0
        self.mig_devices = 0
        self.claim_devices = 0  # DRA devices in the last listing
        self.unresolved = 0  # of them, those no ResourceSlice resolved (each logged once)
        self.unresolved_seen = 0  # distinct (driver, pool, device) ever unresolved (a counter)
        self._by_uuid: dict[str, tuple[Allocation, ...]] = {}
        self._logged = False
        self._logged_unresolved: set[tuple[str, str, str]] = set()

    def _claim_uuid(self, d: ClaimDevice) -> str | None:
        key = (d.driver, d.pool, d.device)
        uuid = self.resolve(*key) if self.resolve else None
        if uuid is None and key not in self._logged_unresolved:
            self.unresolved_seen += 1
            if len(self._logged_unresolved) >= 1024:
                return None  # counted, not logged: the set stays bounded
            self._logged_unresolved.add(key)
            log.warning(
                "DRA device %s/%s/%s of claim %s/%s (pod %s/%s) is in no ResourceSlice of this node "
                "with a uuid attribute%s; not attributed (logged once; counted)",
                d.driver, d.pool, d.device, d.claim_namespace, d.claim, d.namespace, d.pod,
                "" if self.resolve else " (no ResourceSlice watch: give --k8s-resource-slices)",
            )  # fmt: skip
        return uuid

    @property
    def slow(self) -> int:
        """Refreshes that kept the last mapping: the kubelet had not answered within wait_s."""
        return 0 if self._inflight is None else self._inflight.slow

    def _answer(self) -> bytes | None:
        """The kubelet's answer (raises its failure), or None while it has not come within wait_s."""
        if self._inflight is None:
            return self._list(self.socket_path, self.timeout_s)
        came, answer = self._inflight.take(lambda: self._list(self.socket_path, self.timeout_s))
        return answer if came else None

    def refresh(self) -> None:
        try:
            raw = self._answer()
            if raw is None:
                return
            listing = parse_list(raw)
        except Exception as exc:  # socket missing, RPC error, bad bytes: keep the last mapping
            self.failures += 1
            if not self._logged:
                self._logged = True
                log.warning(
                    "kubelet PodResources at %s failed: %s (logged once; counted)", self.socket_path, exc
                )
            return
        holders: dict[str, list[tuple[str, str]]] = {}  # uuid → (namespace, pod), in order

        def hold(uuid: str, ns: str, pod: str) -> None:
            lst = holders.setdefault(uuid, [])
            if (ns, pod) not in lst:  # several containers (or claims) of one pod: one holder
                lst.append((ns, pod))

        mig = 0
        for d in listing.devices:
            is_mig = d.resource.startswith("nvidia.com/mig-") or d.device_id.startswith("MIG-")
            if not is_mig and d.resource != "nvidia.com/gpu":
                continue
            mig += is_mig
            hold(d.device_id.split("::", 1)[0], d.namespace, d.pod)  # time-slicing replica suffix
        unresolved = 0
        for c in listing.claims:
            uuid = self._claim_uuid(c)
            if uuid is None:
                unresolved += 1
            else:
                hold(uuid, c.namespace, c.pod)
        self.mig_devices, self.claim_devices, self.unresolved = mig, len(listing.claims), unresolved
        # a namespace (63) and a pod name (253) may be longer together than a wire label (256): cut,
        # as the cluster collector cuts its names, rather than fail the node's whole mapping
        self._by_uuid = {
            uuid: tuple(
                Allocation(scheduler="k8s", id=f"{ns}/{pod}"[:256], name=f"{ns}/{pod}"[:256], account=ns[:256],
                           queue=ns[:256], share=1.0 / len(hs))
                for ns, pod in hs
            )
            for uuid, hs in holders.items()
        }  # fmt: skip

    def __call__(self, index: int, uuid: str) -> tuple[Allocation, ...]:
        return self._by_uuid.get(uuid, ())

"""Kubernetes GPU→pod attribution from the kubelet's PodResources gRPC API
(``v1.PodResourcesLister/List`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``).

The response is decoded here from the protobuf wire format directly (four small messages;
no generated code to keep in step):

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    PodResources             { string name = 1; string namespace = 2; repeated ContainerResources containers = 3; }
    ContainerResources       { string name = 1; repeated ContainerDevices devices = 2; ... }
    ContainerDevices         { string resource_name = 1; repeated string device_ids = 2; ... }

``nvidia.com/gpu`` device ids are GPU UUIDs, with ``::N`` appended for time-sliced replicas;
a GPU held by several pods is shared equally among them. MIG devices
(``nvidia.com/mig-*``, ``MIG-…`` ids) are counted but not attributed yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
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


def _text(f: dict[int, list[bytes]], num: int) -> str:
    return f[num][-1].decode() if num in f else ""


def parse_list_response(b: bytes) -> list[PodDevice]:
    out: list[PodDevice] = []
    for pod in _by_field(b).get(1, []):  # ListPodResourcesResponse.pod_resources
        p = _by_field(pod)
        for c in p.get(3, []):  # PodResources.containers
            cf = _by_field(c)
            for d in cf.get(2, []):  # ContainerResources.devices
                df = _by_field(d)
                out += [PodDevice(_text(p, 2), _text(p, 1), _text(cf, 1), _text(df, 1), i.decode())
                        for i in df.get(2, [])]  # fmt: skip
    return out


def grpc_list(socket_path: str, timeout_s: float) -> bytes:
    """One ``List`` call over the kubelet's unix socket; the raw response bytes."""
    import grpc

    with grpc.insecure_channel(f"unix://{socket_path}") as ch:
        call = ch.unary_unary(
            LIST_METHOD, request_serializer=lambda _: b"", response_deserializer=lambda b: b
        )
        resp: bytes = call(None, timeout=timeout_s)
        return resp


class PodResourcesAttribution:
    """GPU UUID → the pods holding it (an :class:`~gpuslo.agent.base.Attribution`: the GPU
    source calls ``refresh()`` once per tick, then (index, uuid))."""

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        list_call: Callable[[str, float], bytes] = grpc_list,
        timeout_s: float = 5.0,
    ) -> None:
        self.socket_path = socket_path
        self._list = list_call
        self.timeout_s = timeout_s
        self.failures = 0
        self.mig_devices = 0
        self._by_uuid: dict[str, tuple[Allocation, ...]] = {}
        self._logged = False

    def refresh(self) -> None:
        try:
            devices = parse_list_response(self._list(self.socket_path, self.timeout_s))
        except Exception as exc:  # socket missing, RPC error, bad bytes: keep the last mapping
            self.failures += 1
            if not self._logged:
                self._logged = True
                log.warning(
                    "kubelet PodResources at %s failed: %s (logged once; counted)", self.socket_path, exc
                )
            return
        holders: dict[str, list[PodDevice]] = {}
        mig = 0
        for d in devices:
            if d.resource.startswith("nvidia.com/mig-") or d.device_id.startswith("MIG-"):
                mig += 1
                continue
            if d.resource != "nvidia.com/gpu":
                continue
            uuid = d.device_id.split("::", 1)[0]  # time-slicing replica suffix
            lst = holders.setdefault(uuid, [])
            if not any((h.namespace, h.pod) == (d.namespace, d.pod) for h in lst):
                lst.append(d)
        self.mig_devices = mig
        self._by_uuid = {
            uuid: tuple(
                Allocation(
                    scheduler="k8s",
                    id=f"{h.namespace}/{h.pod}",
                    name=f"{h.namespace}/{h.pod}",
                    account=h.namespace,
                    queue=h.namespace,
                    share=1.0 / len(hs),
                )
                for h in hs
            )
            for uuid, hs in holders.items()
        }

    def __call__(self, index: int, uuid: str) -> tuple[Allocation, ...]:
        return self._by_uuid.get(uuid, ())

"""GPU→pod attribution against a fake kubelet: a real gRPC server on a unix socket serving
``v1.PodResourcesLister/List`` with protobuf bytes built by an independent encoder here."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpuslo.agent.k8s import PodResourcesAttribution, ProtobufError, parse_list_response


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _s(field: int, text: str) -> bytes:
    return _ld(field, text.encode())


def encode(pods: list[tuple[str, str, list[tuple[str, list[tuple[str, list[str]]]]]]]) -> bytes:
    """pods: (namespace, name, [(container, [(resource, [device ids])])])."""
    msg = b""
    for ns, name, containers in pods:
        pod = _s(1, name) + _s(2, ns)
        for cname, devices in containers:
            c = _s(1, cname)
            for res, ids in devices:
                d = (
                    _s(1, res)
                    + b"".join(_s(2, i) for i in ids)
                    + _ld(3, _ld(1, _varint(0 << 3 | 0) + _varint(1)))
                )
                c += _ld(2, d)
            c += _varint(3 << 3 | 0) + _varint(7)  # cpu_ids = [7] (a varint field to skip)
            pod += _ld(3, c)
        msg += _ld(1, pod)
    return msg


class FakeKubelet:
    """Serves only the kubelet's ``/v1.PodResourcesLister/List`` (any other method is
    UNIMPLEMENTED, as on a real kubelet): a client calling another path gets no answer."""

    def __init__(self, sock: Path) -> None:
        self.response = b""
        self.requests: list[bytes] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list, request_deserializer=lambda b: b, response_serializer=lambda b: b
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{sock}")
        self.server.start()

    def _list(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.requests.append(request)  # checked by the test: a raise here would be the client's error
        return self.response


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[tuple[FakeKubelet, Path]]:
    sock = tmp_path / "kubelet.sock"
    k = FakeKubelet(sock)
    yield k, sock
    k.server.stop(0)


def test_list_attributes_gpus_to_pods_with_shares(kubelet: tuple[FakeKubelet, Path]) -> None:
    k, sock = kubelet
    k.response = encode([
        ("team-a", "train-0", [("main", [("nvidia.com/gpu", ["GPU-1111", "GPU-2222"]), ("cpu-thing/x", ["a"])])]),
        ("team-b", "notebook", [("nb", [("nvidia.com/gpu", ["GPU-3333::0"])])]),  # time-sliced replicas
        ("team-c", "notebook", [("nb", [("nvidia.com/gpu", ["GPU-3333::1"])])]),
        ("team-d", "infer", [("srv", [("nvidia.com/mig-1g.10gb", ["MIG-aaaa"])])]),
        ("kube-system", "dns", [("coredns", [])]),
    ])  # fmt: skip
    attr = PodResourcesAttribution(str(sock))
    attr.refresh()
    # one List call, reaching the method the fake registered under the kubelet's own service and
    # method names (another path is UNIMPLEMENTED); ListPodResourcesRequest has no fields
    assert k.requests == [b""]
    assert [(a.id, a.queue, a.share) for a in attr(0, "GPU-1111")] == [("team-a/train-0", "team-a", 1.0)]
    assert [a.id for a in attr(1, "GPU-2222")] == ["team-a/train-0"]
    assert [(a.id, a.share) for a in attr(2, "GPU-3333")] == [
        ("team-b/notebook", 0.5),
        ("team-c/notebook", 0.5),
    ]
    assert attr(3, "GPU-4444") == ()
    assert attr.mig_devices == 1


def test_kubelet_gone_keeps_the_last_mapping_and_counts(kubelet: tuple[FakeKubelet, Path]) -> None:
    k, sock = kubelet
    k.response = encode([("ns", "p", [("c", [("nvidia.com/gpu", ["GPU-1"])])])])
    attr = PodResourcesAttribution(str(sock), timeout_s=1)
    attr.refresh()
    k.server.stop(0)
    attr.refresh()
    assert attr.failures == 1
    assert [a.id for a in attr(0, "GPU-1")] == ["ns/p"]


def test_garbage_bytes_are_an_error_not_a_crash() -> None:
    with pytest.raises(ProtobufError):
        parse_list_response(b"\x0a\xff\xff")
    attr = PodResourcesAttribution("/nonexistent", list_call=lambda s, t: b"\x0a\x05ab")
    attr.refresh()
    assert attr.failures == 1

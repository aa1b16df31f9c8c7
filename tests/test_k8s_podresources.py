"""GPU→pod attribution against a fake kubelet: a real gRPC server on a unix socket serving
``v1.PodResourcesLister/List`` with protobuf bytes built by an independent encoder here, from
the field numbers of k8s.io/kubelet v0.34.4 pkg/apis/podresources/v1/api.proto (device plugin
devices and DRA ``dynamic_resources``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuslo.agent.k8s import (
    ClaimDevice,
    PodDevice,
    PodResourcesAttribution,
    ProtobufError,
    parse_list,
    parse_list_response,
)


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


#: (claim namespace, claim name, [(driver, pool, device, [CDI device names])])
Claim = tuple[str, str, list[tuple[str, str, str, list[str]]]]


def dynamic_resource(claim: Claim) -> bytes:
    """DynamicResource { claim_name = 2; claim_namespace = 3; repeated ClaimResource claim_resources = 4 },
    ClaimResource { repeated CDIDevice cdi_devices = 1; driver_name = 2; pool_name = 3; device_name = 4 },
    CDIDevice { name = 1 }."""
    ns, name, resources = claim
    out = _s(3, ns) + _s(2, name)  # out of field order, as a sender may write them
    for driver, pool, device, cdi in resources:
        r = b"".join(_ld(1, _s(1, c)) for c in cdi) + _s(2, driver) + _s(3, pool) + _s(4, device)
        out += _ld(4, r)
    return out


def encode(pods: list[tuple[str, str, list[Any]]]) -> bytes:
    """pods: (namespace, name, [(container, [(resource, [device ids])][, [Claim]])]); claims go in
    ContainerResources.dynamic_resources (field 5), after packed cpu_ids and memory."""
    msg = b""
    for ns, name, containers in pods:
        pod = _s(1, name) + _s(2, ns)
        for cname, devices, *claims in containers:
            c = _s(1, cname)
            for res, ids in devices:
                d = (
                    _s(1, res)
                    + b"".join(_s(2, i) for i in ids)
                    + _ld(3, _ld(1, _varint(0 << 3 | 0) + _varint(1)))
                )
                c += _ld(2, d)
            c += _varint(3 << 3 | 0) + _varint(7)  # cpu_ids = [7] (a varint field to skip)
            c += _ld(3, _varint(2) + _varint(300))  # cpu_ids packed (proto3's default for repeated int64)
            c += _ld(4, _s(1, "memory") + _varint(2 << 3 | 0) + _varint(1 << 40))  # ContainerMemory
            for claim in claims[0] if claims else []:
                c += _ld(5, dynamic_resource(claim))
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


DRIVER = "gpu.nvidia.com"
#: what this node's ResourceSlices say (the NVIDIA DRA driver's device names and uuid attributes)
SLICES = {
    (DRIVER, "node-a", "gpu-0"): "GPU-aaaa",
    (DRIVER, "node-a", "gpu-1"): "GPU-bbbb",
    (DRIVER, "node-a", "gpu-2-mig-1-0"): "MIG-cccc",
}


def _resolve(driver: str, pool: str, device: str) -> str | None:
    return SLICES.get((driver, pool, device))


def test_dra_claims_join_the_device_plugin_holders_and_share(
    kubelet: tuple[FakeKubelet, Path], caplog: pytest.LogCaptureFixture
) -> None:
    k, sock = kubelet
    shared = ("team-a", "shared-gpu", [(DRIVER, "node-a", "gpu-0", ["k8s.gpu.nvidia.com/claim=x-gpu-0"])])
    k.response = encode([
        # one claim shared by two pods; the first pod's two containers both use it: one holder
        ("team-a", "p1", [("a", [], [shared]), ("b", [], [shared])]),
        ("team-a", "p2", [("main", [], [shared])]),
        # a device-plugin GPU and a DRA claim on another: both attributed, each whole
        ("team-b", "p3", [("main", [("nvidia.com/gpu", ["GPU-dddd"])],
                           [("team-b", "p3-gpu", [(DRIVER, "node-a", "gpu-1", [])])])]),
        # a MIG instance through DRA: attributed to the instance's row (the source asks by MIG UUID)
        ("team-c", "p4", [("main", [], [("team-c", "p4-mig", [(DRIVER, "node-a", "gpu-2-mig-1-0", [])])])]),
        # a device no slice of this node names (another driver, a stale pool)
        ("team-d", "p5", [("main", [], [("team-d", "p5-x", [("other.example.com", "node-a", "dev-0", []),
                                                               (DRIVER, "node-b", "gpu-0", [])])])]),
    ])  # fmt: skip
    attr = PodResourcesAttribution(str(sock), resolve=_resolve)
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.k8s"):
        attr.refresh()
        attr.refresh()  # the same unresolved devices again: counted, not logged again
    assert [(a.id, a.share) for a in attr(0, "GPU-aaaa")] == [("team-a/p1", 0.5), ("team-a/p2", 0.5)]
    assert [(a.id, a.share) for a in attr(1, "GPU-bbbb")] == [("team-b/p3", 1.0)]
    assert [(a.id, a.share) for a in attr(2, "GPU-dddd")] == [("team-b/p3", 1.0)]
    assert [(a.id, a.account) for a in attr(2, "MIG-cccc")] == [("team-c/p4", "team-c")]
    assert attr.claim_devices == 7 and attr.unresolved == 2 and attr.unresolved_seen == 2
    assert attr.failures == 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert "other.example.com/node-a/dev-0 of claim team-d/p5-x (pod team-d/p5)" in warned[0]


def test_a_device_plugin_gpu_and_a_claim_on_one_gpu_split_it() -> None:
    """Time-slicing across the two paths (a claim of another pod on the same GPU): two holders."""
    resp = encode([
        ("ns", "dp", [("c", [("nvidia.com/gpu", ["GPU-aaaa::0"])])]),
        ("ns", "dra", [("c", [], [("ns", "claim", [(DRIVER, "node-a", "gpu-0", [])])])]),
    ])  # fmt: skip
    attr = PodResourcesAttribution("-", list_call=lambda s, t: resp, resolve=_resolve)
    attr.refresh()
    assert [(a.id, a.share) for a in attr(0, "GPU-aaaa")] == [("ns/dp", 0.5), ("ns/dra", 0.5)]


def test_without_a_resolver_claim_devices_are_counted_unresolved(caplog: pytest.LogCaptureFixture) -> None:
    resp = encode([("ns", "p", [("c", [], [("ns", "claim", [(DRIVER, "node-a", "gpu-0", [])])])])])
    attr = PodResourcesAttribution("-", list_call=lambda s, t: resp)
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.k8s"):
        attr.refresh()
    assert attr(0, "GPU-aaaa") == () and attr.unresolved == 1
    assert "give --k8s-resource-slices" in caplog.text


def test_decoder_reads_every_field_of_a_claim_resource() -> None:
    resp = encode([("ns", "p", [("c", [("nvidia.com/gpu", ["GPU-1"])],
                                 [("claim-ns", "claim", [("d", "pool", "dev", ["cdi/a", "cdi/b"])])])])])  # fmt: skip
    got = parse_list(resp)
    assert got.devices == (PodDevice("ns", "p", "c", "nvidia.com/gpu", "GPU-1"),)
    assert got.claims == (ClaimDevice("ns", "p", "c", "claim-ns", "claim", "d", "pool", "dev"),)


def test_every_truncation_of_a_dra_listing_is_an_error_or_a_shorter_listing() -> None:
    """Cut anywhere: a ProtobufError, or (cut between whole fields) fewer or emptier entries; never
    another exception, never a device that was not in the message."""
    resp = encode([
        ("team-a", "p1", [("main", [("nvidia.com/gpu", ["GPU-x"])],
                           [("team-a", "claim", [(DRIVER, "node-a", "gpu-0", ["cdi"])])])]),
        ("team-b", "p2", [("main", [], [("team-b", "c2", [(DRIVER, "node-a", "gpu-1", [])])])]),
    ])  # fmt: skip
    full = parse_list(resp)
    for cut in range(len(resp)):
        try:
            got = parse_list(resp[:cut])
        except ProtobufError:
            continue
        assert len(got.claims) <= len(full.claims) and len(got.devices) <= len(full.devices)
        for c in got.claims:
            assert c.driver in ("", DRIVER) and c.device in ("", "gpu-0", "gpu-1")


@pytest.mark.parametrize(
    "raw, why",
    [
        (
            _ld(1, _ld(3, _ld(5, _ld(4, _varint(2 << 3 | 2) + _varint(5) + b"ab")))),
            "truncated",
        ),  # past the end
        (_ld(1, _ld(3, _ld(5, _ld(4, _ld(2, b"\xff\xfe"))))), "not UTF-8"),  # driver name not UTF-8
        (_ld(1, _ld(3, _ld(5, _varint(1 << 3 | 1) + b"\x00\x00"))), "truncated fixed-width"),  # fixed64 cut
        (_ld(1, _ld(3, _ld(5, _varint(1 << 3 | 3)))), "unsupported wire type 3"),  # a group
        (_ld(1, _ld(3, _ld(5, b"\x80" * 11))), "varint too long"),
    ],
)
def test_hostile_dynamic_resources_are_a_protobuf_error(raw: bytes, why: str) -> None:
    with pytest.raises(ProtobufError, match=why):
        parse_list(raw)
    attr = PodResourcesAttribution("-", list_call=lambda s, t: raw, resolve=_resolve)
    attr.refresh()  # contained: counted, the last mapping kept
    assert attr.failures == 1


def test_the_longest_names_kubernetes_allows_do_not_break_the_mapping() -> None:
    """A namespace of 63 and a pod name of 253 characters (the API's limits) are longer together
    than a wire label: cut to 256, and every other pod of the node still attributed."""
    ns, name = "n" * 63, "p" * 253
    resp = encode([
        (ns, name, [("c", [("nvidia.com/gpu", ["GPU-long"])])]),
        ("ns", "short", [("c", [], [("ns", "claim", [(DRIVER, "node-a", "gpu-0", [])])])]),
    ])  # fmt: skip
    attr = PodResourcesAttribution("-", list_call=lambda s, t: resp, resolve=_resolve)
    attr.refresh()
    assert attr.failures == 0
    assert [a.id for a in attr(0, "GPU-long")] == [f"{ns}/{name}"[:256]]
    assert [a.id for a in attr(1, "GPU-aaaa")] == ["ns/short"]


class GatedKubelet(FakeKubelet):
    """A kubelet that takes the call and answers only once ``gate`` is set (a kubelet busy or
    wedged: the connection accepted, no answer), with what ``response`` is then."""

    def __init__(self, sock: Path) -> None:
        self.gate = threading.Event()
        self.gate.set()
        super().__init__(sock)

    def _list(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.requests.append(request)
        self.gate.wait()
        if self.response == b"garbage":
            return b"\x0a\xff\xff"  # not a ListPodResourcesResponse
        return self.response


@pytest.mark.parametrize("late", ["listing", "garbage", "gone"])
@pytest.mark.parametrize("interval_s", [1.0, 4.0])  # three waits of a tick within the call's 5 s
def test_a_kubelet_slow_to_answer_never_holds_the_tick(late: str, interval_s: float, tmp_path: Path) -> None:
    """The assembled agent's GPU source, at each tick, waited for the kubelet's whole timeout (5 s):
    at a 1 s interval four samples of five were never taken (capacity lost). Now a tick waits a
    share of the interval; the call goes on, one at a time, the last mapping standing (counted as
    slow, not failed) until its answer is applied: a new listing, or garbage or a kubelet gone,
    a failure that keeps the mapping."""
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from gpuslo.wire import GpuSampleBatch
    from tests.fake_nvml import FakeGpu, FakeNvml

    sock = tmp_path / "kubelet.sock"
    k = GatedKubelet(sock)
    try:
        k.response = encode([("ns", "before", [("c", [("nvidia.com/gpu", ["GPU-a"])])])])
        opts = NodeOptions(
            source="nvml", node="n1", cluster="c", interval_s=interval_s, k8s_pod_resources=str(sock)
        )
        agent = node_agent(opts, kube_api=lambda: None, nvml=FakeNvml([FakeGpu("GPU-a")]))
        src, extra = agent.gpu, agent.extra
        assert src is not None and extra is not None

        def holders() -> list[str]:
            (batch,) = [m for m in src.collect(1.8e9) if isinstance(m, GpuSampleBatch)]
            return [a.id for g in batch.gpus for a in g.allocations]

        while holders() != ["ns/before"]:  # a healthy kubelet: read at the tick (or the next)
            pass
        calls = len(k.requests)
        k.gate.clear()
        k.response = (
            b"garbage"
            if late == "garbage"
            else encode([("ns", "after", [("c", [("nvidia.com/gpu", ["GPU-a"])])])])
        )
        for n in range(1, 4):  # the kubelet does not answer: each tick goes on with the last mapping
            assert holders() == ["ns/before"]
            assert extra()["gpuslo_agent_pod_resources_failures"] == 0  # waited for whole: timed out
            assert extra()["gpuslo_agent_pod_resources_slow"] == n
        assert len(k.requests) == calls + 1  # one call in flight, not one more per tick
        if late == "gone":  # the kubelet restarts: the call in flight is cut
            k.server.stop(0).wait()
        k.gate.set()
        want = ["ns/after"] if late == "listing" else ["ns/before"]
        while True:  # until the late answer is applied: the mapping it gives, or a failure
            got, failed = holders(), extra()["gpuslo_agent_pod_resources_failures"]
            if got != ["ns/before"] or failed:
                break
        assert (got, failed) == (want, 0 if late == "listing" else 1)
    finally:
        k.gate.set()
        k.server.stop(0)


class LateKubelet(FakeKubelet):
    """A kubelet that answers each call ``late_s`` after it came (a kubelet starting, or busy)."""

    def __init__(self, sock: Path, late_s: float) -> None:
        self.late_s = late_s
        super().__init__(sock)

    def _list(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.requests.append(request)
        threading.Event().wait(self.late_s)
        return self.response


@pytest.mark.parametrize("interval_s", [1.0, 4.0])
def test_the_kubelets_first_answer_is_waited_for_whole(interval_s: float, tmp_path: Path) -> None:
    """There is no last mapping before the kubelet's first answer: a tick that went on without
    it sent every GPU as held by no pod (unallocated capacity), and ``agent --once`` (two samples,
    the second printed) printed GPUs without their pods whenever the kubelet took longer than
    two of its waits. The first answer is waited for whole, as Slurm's is (the call's 5 s
    timeout bounds it); later ticks wait their share."""
    from gpuslo.agent.assemble import NodeOptions, node_agent, sample_once
    from gpuslo.wire import GpuSampleBatch
    from tests.fake_nvml import FakeGpu, FakeNvml

    sock = tmp_path / "kubelet.sock"
    k = LateKubelet(sock, late_s=interval_s)  # longer than the two waits of --once (half the interval)
    try:
        k.response = encode([("ns", "p", [("c", [("nvidia.com/gpu", ["GPU-a"])])])])
        opts = NodeOptions(source="nvml", node="n1", cluster="c", interval_s=interval_s,
                           k8s_pod_resources=str(sock))  # fmt: skip
        agent = node_agent(opts, kube_api=lambda: None, nvml=FakeNvml([FakeGpu("GPU-a")]))
        assert agent.gpu is not None and agent.extra is not None
        msgs = sample_once(agent.gpu, interval_s, sleep=lambda s: None)
        (batch,) = [m for m in msgs if isinstance(m, GpuSampleBatch)]
        assert [a.id for g in batch.gpus for a in g.allocations] == ["ns/p"]
        assert agent.extra()["gpuslo_agent_pod_resources_slow"] == 1  # the second: a call of its own
    finally:
        k.server.stop(0)


@pytest.mark.parametrize(
    ("devices", "want"),
    [
        ([("nvidia.com/mig-1g.10gb", "MIG-aaaa")], {"MIG-aaaa": [("ns/p0", 1.0)]}),  # mixed strategy
        ([("nvidia.com/gpu", "MIG-aaaa")], {"MIG-aaaa": [("ns/p0", 1.0)]}),  # single strategy: MIG ids
        ([("nvidia.com/mig-3g.40gb", "MIG-bbbb::0"), ("nvidia.com/mig-3g.40gb", "MIG-bbbb::1")],
         {"MIG-bbbb": [("ns/p0", 0.5), ("ns/p1", 0.5)]}),  # time-sliced replicas of one instance
        ([("nvidia.com/mig-1g.10gb", "MIG-aaaa"), ("nvidia.com/gpu", "GPU-b")],
         {"MIG-aaaa": [("ns/p0", 1.0)], "GPU-b": [("ns/p1", 1.0)]}),
        ([("nvidia.com/mig-1g.10gb", "MIG-cccc")], {}),  # an instance this node's NVML does not have
    ],
)  # fmt: skip
def test_a_device_plugin_mig_instance_is_attributed_to_its_row(
    devices: list[tuple[str, str]], want: dict[str, list[tuple[str, float]]]
) -> None:
    """The device plugin's MIG devices (``nvidia.com/mig-*``, or MIG UUIDs under ``nvidia.com/gpu``
    with its single strategy) were counted and dropped: the instance a pod held read as held by
    nobody (its time unallocated, allocation CUR short), though the docs said it was attributed.
    Each pod of the listing holds one device here; rows of the NVML source, as sent."""
    from gpuslo.agent.nvml import NvmlSource
    from gpuslo.wire import GpuSampleBatch
    from tests.fake_nvml import FakeGpu, FakeMig, FakeNvml

    raw = encode([("ns", f"p{i}", [("c", [(res, [dev])])]) for i, (res, dev) in enumerate(devices)])
    attr = PodResourcesAttribution("-", list_call=lambda s, t: raw)
    mig = [FakeMig("MIG-aaaa", gi=1), FakeMig("MIG-bbbb", gi=2, gi_slices=3, ci_slices=3)]
    nvml = FakeNvml([FakeGpu("GPU-a", mig_capable=True, mig=mig), FakeGpu("GPU-b")])
    src = NvmlSource("n1", "c", 10.0, nvml=nvml, attribution=attr)
    (batch,) = [m for m in src.collect(1.8e9) if isinstance(m, GpuSampleBatch)]
    got = {g.uuid: [(a.id, a.share) for a in g.allocations] for g in batch.gpus if g.allocations}
    assert got == want
    assert attr.mig_devices == sum(d.startswith("MIG-") for _, d in devices)

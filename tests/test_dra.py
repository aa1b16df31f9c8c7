"""DRA without a server: what a pod asks for through claims, free devices, causes, the slice
index, and the pod collector with claims, against an in-memory API (the real API server's
behaviour is in tests/test_k8s_dra.py). Objects are written as resource.k8s.io/v1 serves them
(k8s.io/api v0.34.4 resource/v1/types.go)."""

from __future__ import annotations

import logging
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.dra import (
    DEFAULT_GPU_CLASSES,
    ClaimUnknown,
    Demand,
    DraView,
    GpuClass,
    ResourceSliceIndex,
    parse_gpu_class,
)
from gpuslo.agent.k8s_watch import (
    MAX_GPUS,
    BadWatchLine,
    Gone,
    K8sPodCollector,
    KubeApi,
    quantity,
    watch_event,
)
from gpuslo.wire import SchedulerEvent

R = "/apis/resource.k8s.io/v1"
NV = "gpu.nvidia.com"


def device(name: str, kind: str = "gpu", uuid: str | None = None, **extra: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {"type": {"string": kind}}
    if uuid is not None:
        attrs["uuid"] = {"string": uuid}
    return {"name": name, "attributes": attrs, **extra}


def rslice(name: str, node: str | None, devices: list[dict[str, Any]], pool: str = "", gen: int = 1,
           driver: str = NV, **spec: Any) -> dict[str, Any]:  # fmt: skip
    s: dict[str, Any] = {"driver": driver, "pool": {"name": pool or node or name, "generation": gen,
                                                   "resourceSliceCount": 1}, "devices": devices, **spec}  # fmt: skip
    if node:
        s["nodeName"] = node
    return {"metadata": {"name": name}, "spec": s}


def claim(name: str, requests: list[dict[str, Any]], results: list[tuple[str, str]] | None = None,
          ns: str = "ns", admin: bool = False) -> dict[str, Any]:  # fmt: skip
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": requests}},
    }
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": [
            {"request": "r", "driver": NV, "pool": pool, "device": dev, **({"adminAccess": True} if admin else {})}
            for pool, dev in results]}}}  # fmt: skip
    return obj


def exactly(count: int | None = None, cls: str = NV, mode: str | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"deviceClassName": cls}
    if count is not None:
        e["count"] = count
    if mode:
        e["allocationMode"] = mode
    return {"name": "r", "exactly": e}


def pod(name: str, claims: list[dict[str, str]], gpus: int = 0, node: str = "", unsched: str = "",
        uid: str = "") -> dict[str, Any]:  # fmt: skip
    res = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    conds = []
    if unsched:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unsched,
                      "lastTransitionTime": "2026-11-28T10:00:05Z"})  # fmt: skip
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": res}], "resourceClaims": claims}
    if node:
        spec["nodeName"] = node
        conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-28T10:01:00Z"})
    return {"metadata": {"uid": uid or f"uid-{name}", "name": name, "namespace": "ns",
                         "creationTimestamp": "2026-11-28T10:00:00Z"},
            "spec": spec, "status": {"phase": "Pending", "conditions": conds}}  # fmt: skip


class FakeApi(KubeApi):
    """Collections and objects by path; a path in ``fail`` raises what the real client raises."""

    def __init__(self) -> None:
        super().__init__("http://fake.invalid")
        self.lists: dict[str, list[dict[str, Any]]] = {}
        self.watch_events: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.fail: dict[str, Exception] = {}
        self.gets: list[str] = []

    def list_objects(self, path: str) -> tuple[list[dict[str, Any]], str]:
        if path in self.fail:
            raise self.fail[path]
        return list(self.lists.get(path, [])), "10"

    def get_object(self, path: str) -> dict[str, Any]:
        self.gets.append(path)
        if path in self.fail:
            raise self.fail[path]
        plural_path, _, name = path.rpartition("/")
        ns = plural_path.split("/namespaces/")[1].split("/")[0]
        plural = plural_path.rsplit("/", 1)[1]
        for o in self.lists.get(f"{R}/{plural}", []):
            if o["metadata"]["name"] == name and o["metadata"].get("namespace") == ns:
                return o
        raise urllib.error.HTTPError(path, 404, "Not Found", None, None)  # type: ignore[arg-type]

    def watch_objects(self, path: str, rv: str, timeout_s: int = 300,
                      on_open: Any = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        if path in self.fail:
            raise self.fail[path]
        yield from self.watch_events.pop(path, [])


def view_with(slices: list[dict[str, Any]], claims: list[dict[str, Any]] = (),  # type: ignore[assignment]
              templates: list[dict[str, Any]] = (), classes: tuple[GpuClass, ...] = DEFAULT_GPU_CLASSES,  # type: ignore[assignment]
              ) -> tuple[DraView, FakeApi]:  # fmt: skip
    api = FakeApi()
    api.lists[f"{R}/resourceslices"] = list(slices)
    api.lists[f"{R}/resourceclaims"] = list(claims)
    api.lists[f"{R}/resourceclaimtemplates"] = list(templates)
    v = DraView(api, classes)
    v.relist()
    return v, api


TWO_NODES = [rslice("a", "node-a", [device(f"gpu-{i}") for i in range(4)]),
             rslice("b", "node-b", [device(f"gpu-{i}") for i in range(4)])]  # fmt: skip


# ---------------------------------------------------------------------------- what a pod asks for
@pytest.mark.parametrize(
    "requests, want",
    [
        ([exactly(2)], {NV: 2.0}),
        ([exactly()], {NV: 1.0}),  # count defaults to 1 (ExactCount)
        ([exactly(2), exactly(1, "mig.nvidia.com")], {NV: 2.0, "mig.nvidia.com": 1.0}),
        ([exactly(3, "example.com/nic")], {}),  # not a GPU class
        ([exactly(mode="All")], {NV: 4.0}),  # every matching device of the largest node
        ([{"name": "r", "firstAvailable": [exactly(4)["exactly"], exactly(1)["exactly"]]}], {NV: 4.0}),
        (
            [exactly(0), exactly(-3), {"name": "r", "exactly": {"deviceClassName": NV, "count": "2"}}],
            {NV: 3.0},
        ),
        ([None, "x", {"name": "r"}, {"name": "r", "exactly": "x"}, {"name": "r", "firstAvailable": "x"}], {}),
    ],
)
def test_demand_from_a_claim_by_name(requests: list[Any], want: dict[str, float]) -> None:
    v, _ = view_with(TWO_NODES, [claim("c", requests)])
    d = v.pod_demand(pod("p", [{"name": "gpus", "resourceClaimName": "c"}]))
    assert dict(d.per_class) == want and d.gpus == sum(want.values())
    assert d.allocated is False


def test_demand_from_a_template_and_allocation_from_the_generated_claim() -> None:
    tpl = {
        "metadata": {"name": "t", "namespace": "ns"},
        "spec": {"spec": {"devices": {"requests": [exactly(2)]}}},
    }
    made = claim("p-gpus-x7", [exactly(2)], results=[("node-a", "gpu-0"), ("node-a", "gpu-1")])
    v, _ = view_with(TWO_NODES, [made], [tpl])
    p = pod("p", [{"name": "gpus", "resourceClaimTemplateName": "t"}])
    assert v.pod_demand(p) == Demand(((NV, 2.0),), allocated=False)  # no status yet: not known as made
    p["status"]["resourceClaimStatuses"] = [{"name": "gpus", "resourceClaimName": "p-gpus-x7"}]
    assert v.pod_demand(p) == Demand(((NV, 2.0),), allocated=True, given=((NV, 2.0),), on_nodes=("node-a",))


def test_a_claim_not_yet_seen_is_fetched_and_one_that_is_not_there_is_claim_unknown() -> None:
    v, api = view_with(TWO_NODES)
    api.lists[f"{R}/resourceclaims"] = [claim("late", [exactly(3)])]  # made after the list
    assert v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "late"}])).gpus == 3
    assert api.gets == [f"{R}/namespaces/ns/resourceclaims/late"]
    v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "late"}]))
    assert len(api.gets) == 1, "kept once fetched"
    with pytest.raises(ClaimUnknown, match="resourceclaims ns/missing: HTTP 404"):
        v.pod_demand(pod("q", [{"name": "g", "resourceClaimName": "missing"}]))
    api.fail[f"{R}/namespaces/ns/resourceclaimtemplates/t"] = ValueError("not a JSON object")
    with pytest.raises(ClaimUnknown, match="not a JSON object"):
        v.pod_demand(pod("r", [{"name": "g", "resourceClaimTemplateName": "t"}]))
    assert v.fetch_errors == 2


def mig(name: str, profile: str, qualified: bool = False) -> dict[str, Any]:
    """A MIG device as the NVIDIA driver publishes it: ``type`` mig and its ``profile``."""
    pre = f"{NV}/" if qualified else ""
    return {
        "name": name,
        "attributes": {f"{pre}type": {"string": "mig"}, f"{pre}profile": {"string": profile}},
    }


def cel(*exprs: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": e}} for e in exprs]


MIG = "mig.nvidia.com"
MIG_NODE = [rslice("a", "node-a", [device("gpu-0"), mig("gpu-1-mig-0", "1g.10gb"), mig("gpu-1-mig-1", "3g.40gb"),
                                   mig("gpu-1-mig-2", "1g.10gb", qualified=True), mig("gpu-1-mig-3", "9g.1tb")])]  # fmt: skip


@pytest.mark.parametrize(
    "selectors, count, parts",
    [
        (cel("device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"), 2, 2 / 7),  # NVIDIA's own example
        (cel('device.attributes["gpu.nvidia.com"].profile=="3g.40gb"'), 1, 3 / 7),
        (cel("'2g.20gb' == device.attributes['gpu.nvidia.com'].profile"), 1, 2 / 7),  # either way round
        (cel("device.attributes['gpu.nvidia.com'].profile == '1g.10gb+me'"), 1, 1 / 7),
        (
            cel(
                "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'",
                "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'",
            ),
            3,
            3 / 7,
        ),
        # unknown: no profile named, a profile the table does not list, two profiles: whole GPUs
        ([], 2, 2.0),
        (cel("device.attributes['gpu.nvidia.com'].profile == '9g.1tb'"), 1, 1.0),
        (
            cel(
                "device.attributes['gpu.nvidia.com'].profile == '1g.10gb' || "
                "device.attributes['gpu.nvidia.com'].profile == '2g.20gb'"
            ),
            1,
            1.0,
        ),
        ([None, {"cel": "x"}, {"cel": {"expression": 3}}], 1, 1.0),
    ],
)
def test_a_pending_mig_claim_asks_for_its_part_of_a_gpu(
    selectors: list[Any], count: int, parts: float
) -> None:
    """A MIG device counted whole made a pod waiting for one 1g.10gb slice ask for a whole GPU,
    where a free instance of it counts 1/7 (and a device plugin ``nvidia.com/mig-1g.10gb``
    request its part). Before allocation the profile is what the CEL selectors ask for; the
    causes still compare device counts with free devices."""
    req = {"name": "r", "exactly": {"deviceClassName": MIG, "count": count, "selectors": selectors}}
    v, _ = view_with(MIG_NODE, [claim("c", [req])])
    d = v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))
    assert d.per_class == ((MIG, float(count)),)
    assert d.gpus == pytest.approx(parts, abs=1e-12)
    assert d.parts is None if parts == count else d.parts == pytest.approx(parts)


def test_an_allocated_claim_counts_the_devices_it_was_given() -> None:
    """Allocated, each device is its published profile's part (whatever the selectors said): a
    whole GPU 1, a MIG device by its ``profile`` attribute (plain or qualified with the driver),
    one whose profile the table does not list or that no slice publishes (any more) 1; a
    ``firstAvailable`` request's results name its subrequest (``r/sub``)."""

    def alloc(devices: list[str], request: str = "r") -> dict[str, Any]:
        return {"allocation": {"devices": {"results": [
            {"request": request, "driver": NV, "pool": "node-a", "device": dev} for dev in devices]}}}  # fmt: skip

    cases = [
        (["gpu-1-mig-0", "gpu-1-mig-1"], 4 / 7),
        (["gpu-1-mig-2"], 1 / 7),  # qualified attributes
        (["gpu-0"], 1.0),
        (["gpu-1-mig-3"], 1.0),  # profile not in the table
        (["gone"], 1.0),  # no slice publishes it
    ]
    for devices, want in cases:
        req = {"name": "r", "exactly": {"deviceClassName": MIG, "count": len(devices),
                                        "selectors": cel("device.attributes['gpu.nvidia.com'].profile == '7g.80gb'")}}  # fmt: skip
        c = {**claim("c", [req]), "status": alloc(devices)}
        v, _ = view_with(MIG_NODE, [c])
        d = v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))
        assert d.allocated and d.gpus == pytest.approx(want, abs=1e-12), devices
    first = {"name": "r", "firstAvailable": [{"name": "big", "deviceClassName": MIG, "count": 1},
                                             {"name": "small", "deviceClassName": MIG, "count": 1}]}  # fmt: skip
    c = {**claim("c", [first]), "status": alloc(["gpu-1-mig-0"], request="r/small")}
    v, _ = view_with(MIG_NODE, [c])
    assert v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}])).gpus == pytest.approx(1 / 7)
    # two requests, each its own results: a whole GPU and a 3g.40gb
    two = [
        {"name": "whole", "exactly": {"deviceClassName": NV}},
        {"name": "part", "exactly": {"deviceClassName": MIG}},
    ]
    status = {"allocation": {"devices": {"results": [
        {"request": "whole", "driver": NV, "pool": "node-a", "device": "gpu-0"},
        {"request": "part", "driver": NV, "pool": "node-a", "device": "gpu-1-mig-1"}]}}}  # fmt: skip
    v, _ = view_with(MIG_NODE, [{**claim("c", two), "status": status}])
    d = v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))
    assert dict(d.per_class) == {NV: 1.0, MIG: 1.0}
    assert d.gpus == pytest.approx(1 + 3 / 7)


@pytest.mark.parametrize(
    "profile, count, want",
    [
        ("1g.10gb", 2, "policy"),  # node-a has 2 free (one published qualified): fits
        ("1g.10gb", 3, "fragmentation"),  # 3 free in all, at most 2 on one node
        ("1g.10gb", 4, "capacity"),
        ("3g.40gb", 1, "policy"),
        ("3g.40gb", 2, "capacity"),  # one 3g.40gb free, though 6 MIG devices are
        ("4g.40gb", 1, "capacity"),  # none published: it was `policy`, free devices of other profiles counted
        ("2G.20GB", 1, "policy"),  # profiles compared as NVIDIA writes them, in any case
    ],
)
def test_a_pending_mig_claims_cause_counts_free_devices_of_its_profile(
    profile: str, count: int, want: str
) -> None:
    other = rslice("b", "node-b", [mig("gpu-0-mig-0", "1g.10gb"), mig("gpu-0-mig-1", "2g.20gb")])
    req = {"name": "r", "exactly": {"deviceClassName": MIG, "count": count,
                                    "selectors": cel(f"device.attributes['gpu.nvidia.com'].profile == '{profile}'")}}  # fmt: skip
    v, _ = view_with([*MIG_NODE, other], [claim("c", [req])])
    d = v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))
    assert d.per_profile == ((MIG, profile.lower(), float(count)),)
    assert v.cause(d) == want


@pytest.mark.parametrize(
    "expr",
    [
        "device.attributes['gpu.nvidia.com'].profile == '1g.10gb' || device.attributes['gpu.nvidia.com'].type == 'gpu'",
        "!(device.attributes['gpu.nvidia.com'].profile == '1g.10gb')",
        "device.attributes['gpu.nvidia.com'].profile == '1g.10gb' ? false : true",
        "device.attributes['gpu.nvidia.com'].profile != '1g.10gb'",
    ],
)
def test_a_selector_that_does_not_pin_the_profile_is_whole_gpus(expr: str) -> None:
    """A profile equality under ``||``, ``!`` or ``? :`` need not hold for the device given:
    it was read as that profile's part (1/7 for a pod that may get a whole GPU)."""
    req = {"name": "r", "exactly": {"deviceClassName": MIG, "count": 2, "selectors": cel(expr)}}
    v, _ = view_with(MIG_NODE, [claim("c", [req])])
    d = v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))
    assert (d.per_class, d.gpus, d.parts) == (((MIG, 2.0),), 2.0, None)


def test_a_conjunction_with_inequalities_still_pins_the_profile() -> None:
    expr = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb' && device.attributes['gpu.nvidia.com'].index != 3"
    req = {"name": "r", "exactly": {"deviceClassName": MIG, "count": 2, "selectors": cel(expr)}}
    v, _ = view_with(MIG_NODE, [claim("c", [req])])
    assert v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}])).gpus == pytest.approx(2 / 7)


def test_a_class_of_any_device_of_the_driver_reads_the_profile_asked_for() -> None:
    """A site's class of every device of the driver (``--dra-gpu-class NAME=DRIVER``, type ''):
    a request asking it for a 1g.10gb by its selector (only MIG devices have a ``profile``) was
    a whole GPU while pending; allocated, each device given is its part (a whole GPU 1)."""
    anyc = GpuClass("any-nvidia", NV)
    sel = cel("device.attributes['gpu.nvidia.com'].profile == '1g.10gb'")
    req = {"name": "r", "exactly": {"deviceClassName": "any-nvidia", "count": 3, "selectors": sel}}
    v, _ = view_with(MIG_NODE, [claim("c", [req])], classes=(anyc,))
    d = v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))
    assert d.per_class == (("any-nvidia", 3.0),) and d.gpus == pytest.approx(3 / 7)
    given = {**claim("c", [req]), "status": {"allocation": {"devices": {"results": [
        {"request": "r", "driver": NV, "pool": "node-a", "device": dev} for dev in ("gpu-0", "gpu-1-mig-1")]}}}}  # fmt: skip
    v, _ = view_with(MIG_NODE, [given], classes=(anyc,))
    assert v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}])).gpus == pytest.approx(1 + 3 / 7)


@pytest.mark.parametrize("mode", [{"count": 2}, {"allocationMode": "All"}])
@pytest.mark.parametrize("allocated", [False, True])
def test_an_admin_access_request_asks_for_no_gpu(mode: dict[str, Any], allocated: bool) -> None:
    """A request with ``adminAccess`` (a monitoring pod reaching devices others hold) takes no
    device and waits for none (the free devices already left its results out): it made the pod a
    GPU job asking for them (All: every GPU of the largest node), pending or allocated. Beside a
    request that is not, only that one counts."""
    admin = {"name": "mon", "exactly": {"deviceClassName": MIG, "adminAccess": True, **mode}}
    real = {"name": "r", "exactly": {"deviceClassName": MIG, "selectors": cel(
        "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'")}}  # fmt: skip
    results = [{"request": "mon", "driver": NV, "pool": "node-a", "device": d, "adminAccess": True}
               for d in ("gpu-1-mig-0", "gpu-1-mig-1")]  # fmt: skip
    results.append({"request": "r", "driver": NV, "pool": "node-a", "device": "gpu-1-mig-1"})

    def demand(requests: list[dict[str, Any]]) -> Any:
        c = claim("c", requests)
        if allocated:
            c["status"] = {"allocation": {"devices": {"results": results}}}
        v, _ = view_with(MIG_NODE, [c])
        return v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))

    d = demand([admin])
    assert (d.per_class, d.gpus, d.allocated) == ((), 0.0, False)
    d = demand([admin, real])
    assert d.per_class == ((MIG, 1.0),) and d.gpus == pytest.approx(3 / 7) and d.allocated == allocated


def test_a_first_available_request_counts_the_alternative_it_was_given() -> None:
    """The scheduler tries a ``firstAvailable`` request's alternatives in order and names the one
    it allocated in its results (``REQUEST/SUBREQUEST``). Only the first was read: a claim whose
    first alternative is no GPU class (a CPU-only fallback listed first) but was given a GPU counted
    none, and one given its second, smaller alternative counted the first's size."""
    nic = {"name": "nic", "deviceClassName": "example.com/nic"}
    big = {"name": "big", "deviceClassName": NV, "count": 2}
    small = {"name": "small", "deviceClassName": MIG, "selectors": cel(
        "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'")}  # fmt: skip

    def demand(alts: list[dict[str, Any]], given: tuple[str, list[str]] | None) -> Demand:
        c = claim("c", [{"name": "r", "firstAvailable": alts}])
        if given is not None:
            c["status"] = {"allocation": {"devices": {"results": [
                {"request": f"r/{given[0]}", "driver": NV, "pool": "node-a", "device": d} for d in given[1]]}}}  # fmt: skip
        v, _ = view_with(MIG_NODE, [c])
        return v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}]))

    assert demand([nic, big], None).per_class == ()  # pending: the first alternative, no GPU
    d = demand([nic, big], ("big", ["gpu-0", "gpu-x"]))
    assert d.per_class == ((NV, 2.0),) and d.allocated
    d = demand([big, small], ("small", ["gpu-1-mig-0"]))
    assert d.per_class == ((MIG, 1.0),) and d.gpus == pytest.approx(1 / 7)
    assert demand([big, small], None).per_class == ((NV, 2.0),)  # pending: the first it tries
    d = demand([big, small], ("gone", ["gpu-0"]))  # a result naming no alternative: the first
    assert d.per_class == ((NV, 2.0),)


# ---------------------------------------------------------------------------- free devices, causes
def test_free_devices_are_slices_minus_allocated_claims() -> None:
    slices = [
        *TWO_NODES,
        rslice("a-old", "node-a", [device(f"gpu-{i}") for i in range(8)], pool="node-a", gen=0),  # replaced
        rslice("c", "node-c", [device("gpu-0"), device("mig-0", "mig"), device("mig-1", "mig")]),
        rslice("net", None, [device("shared-0")], allNodes=True),  # any node may use it
        rslice("nic", "node-a", [device("nic-0")], driver="example.com"),  # not a GPU driver
    ]
    claims = [
        claim("c1", [exactly(2)], [("node-a", "gpu-0"), ("node-a", "gpu-1")]),
        claim("c2", [exactly(1)], [("node-c", "mig-0")]),
        claim("mon", [exactly(1)], [("node-b", "gpu-0")], admin=True),  # admin access takes nothing
        claim("pending", [exactly(4)]),
    ]
    v, _ = view_with(slices, claims)
    assert v.free() == {
        NV: {"node-a": 2, "node-b": 4, "node-c": 1, "": 1},
        "mig.nvidia.com": {"node-c": 1},
    }


@pytest.mark.parametrize(
    "demand, want",
    [
        ({NV: 5}, "capacity"),  # 2 + 2 free
        ({NV: 3}, "fragmentation"),  # 4 free in all, 2 per node
        ({NV: 2}, "policy"),  # a node has 2
        ({NV: 1, "mig.nvidia.com": 1}, "capacity"),  # no MIG device at all
    ],
)
def test_cause_against_free_devices(demand: dict[str, float], want: str) -> None:
    claims = [claim("c1", [exactly(2)], [("node-a", "gpu-0"), ("node-a", "gpu-1")]),
              claim("c2", [exactly(2)], [("node-b", "gpu-0"), ("node-b", "gpu-1")])]  # fmt: skip
    v, _ = view_with(TWO_NODES, claims)
    assert v.cause(Demand(tuple(sorted(demand.items())))) == want


@pytest.mark.parametrize(
    ("claims", "want"),
    [
        (["shared"], "policy"),  # its one claim is allocated (to a running pod too): no device to wait for
        (["shared", "own1"], "policy"),  # one more GPU: node-b has it
        (["shared", "own3"], "fragmentation"),  # 3 more: 2 + 2 free, 2 per node (it was capacity: 2 + 3 > 4)
        (["shared", "own5"], "capacity"),  # 5 more: 4 free
        (["own1", "own5"], "capacity"),  # nothing allocated: as before
    ],
)
def test_a_pending_pods_allocated_claims_are_not_compared_with_the_free_devices(
    claims: list[str], want: str
) -> None:
    """A pending pod that shares a claim already allocated (a running pod's, or its own allocated
    before the binding) waits for something else than those devices: they are its own, not free.
    Compared with the free devices as a need, it read capacity where every device it needs was
    there (the pod's wait blamed on the fleet's size)."""
    all_claims = [
        claim("shared", [exactly(2)], [("node-a", "gpu-0"), ("node-a", "gpu-1")]),
        claim("other", [exactly(2)], [("node-b", "gpu-0"), ("node-b", "gpu-1")]),
        claim("own1", [exactly(1)]),
        claim("own3", [exactly(3)]),
        claim("own5", [exactly(5)]),
    ]
    v, _ = view_with(TWO_NODES, all_claims)
    assert v.free() == {NV: {"node-a": 2, "node-b": 2}, "mig.nvidia.com": {}}
    d = v.pod_demand(pod("p", [{"name": f"g{i}", "resourceClaimName": c} for i, c in enumerate(claims)]))
    assert d.gpus == sum({"shared": 2, "own1": 1, "own3": 3, "own5": 5}[c] for c in claims)  # asked: all
    assert v.cause(d) == want


@pytest.mark.parametrize("k", [1, 2, 3, 4])  # of node-a's four devices, the shared claim's
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])  # the pod's own claim, not allocated yet
def test_a_pending_pod_with_an_allocated_claim_needs_the_rest_on_that_claims_node(k: int, n: int) -> None:
    """A pod one of whose claims is allocated (node-local devices) runs on that claim's node: what
    it still needs must be free there. Compared with every node's free devices, a pod whose
    allocated claim took node-a's last devices read policy because node-b had its one more GPU
    (the scheduler cannot place it there)."""
    shared = claim("shared", [exactly(k)], [("node-a", f"gpu-{i}") for i in range(k)])
    v, _ = view_with(TWO_NODES, [shared, claim("own", [exactly(n)])])
    assert v.free()[NV] == {"node-a": 4 - k, "node-b": 4} if k < 4 else {"node-b": 4}
    d = v.pod_demand(pod("p", [{"name": "g0", "resourceClaimName": "shared"},
                               {"name": "g1", "resourceClaimName": "own"}]))  # fmt: skip
    want = "capacity" if n > 8 - k else "policy" if n <= 4 - k else "fragmentation"
    assert v.cause(d) == want


def test_devices_any_node_may_use_count_on_every_node() -> None:
    v, _ = view_with(
        [rslice("a", "node-a", [device("gpu-0")]), rslice("n", None, [device("x-0")], allNodes=True)]
    )
    assert v.cause(Demand(((NV, 2.0),))) == "policy"  # node-a's own one and the shared one
    v, _ = view_with([rslice("n", None, [device("x-0"), device("x-1")], allNodes=True)])
    assert v.cause(Demand(((NV, 2.0),))) == "policy"


def test_no_cause_before_the_devices_were_listed_or_without_gpu_classes() -> None:
    api = FakeApi()
    v = DraView(api)
    assert not v.ready and v.cause(Demand(((NV, 1.0),))) is None
    v.relist()
    assert v.ready and v.cause(Demand(((NV, 1.0),))) == "capacity"  # listed: no device
    assert v.cause(Demand()) is None


@pytest.mark.parametrize(
    "text, want",
    [
        ("gpu.nvidia.com", GpuClass("gpu.nvidia.com", "gpu.nvidia.com", "")),
        ("h100=gpu.nvidia.com:gpu", GpuClass("h100", "gpu.nvidia.com", "gpu")),
        ("x=drv", GpuClass("x", "drv", "")),
    ],
)
def test_gpu_class_option(text: str, want: GpuClass) -> None:
    assert parse_gpu_class(text) == want


@pytest.mark.parametrize("text", ["", "=drv", "a b", "x=", "x=:gpu"])
def test_gpu_class_option_refused(text: str) -> None:
    with pytest.raises(ValueError, match="NAME"):
        parse_gpu_class(text)


def test_a_site_class_counts_its_devices() -> None:
    """A class of the site's own (any device of the driver): All counts them."""
    v, _ = view_with(
        TWO_NODES, [claim("c", [exactly(cls="big", mode="All")])], classes=(GpuClass("big", NV),)
    )
    assert v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": "c"}])).gpus == 4


# ---------------------------------------------------------------------------- the node's slice index
def test_slice_index_reads_uuid_attributes_and_follows_the_watch() -> None:
    api = FakeApi()
    path = f"{R}/resourceslices?fieldSelector=spec.nodeName%3Dnode-a"
    qualified = {"name": "gpu-1", "attributes": {f"{NV}/uuid": {"string": "GPU-q"}}}
    api.lists[path] = [rslice("a", "node-a", [device("gpu-0", uuid="GPU-0"), qualified,
                                              {"name": "gpu-2", "attributes": {"uuid": {"int": 7}}},
                                              {"attributes": {"uuid": {"string": "GPU-nameless"}}}, "junk"])]  # fmt: skip
    idx = ResourceSliceIndex(api, "node-a", watch_timeout_s=1)
    idx.sync_once()
    assert idx(NV, "node-a", "gpu-0") == "GPU-0"
    assert idx(NV, "node-a", "gpu-1") == "GPU-q"  # qualified with the driver's domain
    assert idx(NV, "node-a", "gpu-2") is None  # not a string attribute
    assert idx(NV, "other-pool", "gpu-0") is None and idx("other", "node-a", "gpu-0") is None
    api.watch_events[path] = [
        ("MODIFIED", rslice("a", "node-a", [device("gpu-0", uuid="GPU-0"), device("mig-0", "mig", uuid="MIG-1")])),
        ("BOOKMARK", {"metadata": {"resourceVersion": "12"}}),
    ]  # fmt: skip
    idx.sync_once()
    assert idx(NV, "node-a", "mig-0") == "MIG-1" and idx(NV, "node-a", "gpu-1") is None
    assert idx.rv == "12"
    api.watch_events[path] = [("DELETED", {"metadata": {"name": "a"}})]
    idx.sync_once()
    assert idx(NV, "node-a", "gpu-0") is None


def test_slice_index_relists_on_410() -> None:
    api = FakeApi()
    path = f"{R}/resourceslices?fieldSelector=spec.nodeName%3Dn"
    idx = ResourceSliceIndex(api, "n", watch_timeout_s=1)
    idx.sync_once()
    api.lists[path] = [rslice("s", "n", [device("gpu-0", uuid="GPU-0")])]

    def gone(
        path_: str, rv: str, timeout_s: int = 300, on_open: Any = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        raise Gone("too old")
        yield  # pragma: no cover

    api.watch_objects = gone  # type: ignore[method-assign]
    idx.sync_once()
    assert idx.relists == 2 and idx("gpu.nvidia.com", "n", "gpu-0") == "GPU-0"


def test_slice_index_lists_afresh_after_a_line_that_is_not_an_event() -> None:
    api = FakeApi()
    path = f"{R}/resourceslices?fieldSelector=spec.nodeName%3Dn"
    idx = ResourceSliceIndex(api, "n", watch_timeout_s=1)
    idx.sync_once()

    def cut(
        path_: str, rv: str, timeout_s: int = 300, on_open: Any = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        yield watch_event(b'{"type": "ADDED", "object": {"metadata": {"name": "s"')

    api.watch_objects = cut  # type: ignore[method-assign]
    with pytest.raises(BadWatchLine, match=r"ResourceSlices.*not JSON.*listing afresh"):
        idx.sync_once()
    assert idx.bad_lines == 1 and idx.rv == ""
    api.lists[path] = [rslice("s", "n", [device("gpu-0", uuid="GPU-0")])]
    idx.sync_once()  # the next round lists
    assert idx.relists == 2 and idx("gpu.nvidia.com", "n", "gpu-0") == "GPU-0"


# ---------------------------------------------------------------------------- the pod collector
def _collector(v: DraView, api: FakeApi, tmp_path: Path) -> K8sPodCollector:
    return K8sPodCollector("c", api, tmp_path / "state.json", boot_id="b", dra=v)


def _events(c: K8sPodCollector) -> list[SchedulerEvent]:
    # a tick at a real time: a cause judged again is said at the tick's time (at 0 the wire refuses it)
    return [m for m in c.collect(1.8e9) if isinstance(m, SchedulerEvent)]


def test_collector_follows_pods_with_claims_and_gives_the_cause(tmp_path: Path) -> None:
    claims = [claim("held", [exactly(2)], [("node-a", "gpu-0"), ("node-a", "gpu-1")]),
              claim("held-b", [exactly(2)], [("node-b", "gpu-2"), ("node-b", "gpu-3")]),
              claim("big", [exactly(3)]), claim("nic", [exactly(1, "example.com/nic")])]  # fmt: skip
    v, api = view_with(TWO_NODES, claims)
    api.lists["/api/v1/pods"] = [
        pod("running", [{"name": "g", "resourceClaimName": "held"}], node="node-a"),
        pod("waiting", [{"name": "g", "resourceClaimName": "big"}], unsched="0/2 nodes are available: ..."),
        pod(
            "mixed",
            [{"name": "g", "resourceClaimName": "big"}],
            gpus=1,
            unsched="Insufficient nvidia.com/gpu",
        ),
        pod("nic-only", [{"name": "g", "resourceClaimName": "nic"}], unsched="no nic"),
    ]
    c = _collector(v, api, tmp_path)
    c.sync_once()
    ev = {(e.name, e.event): e for e in _events(c)}
    assert {k for k in ev} == {("ns/running", "submit"), ("ns/running", "start"), ("ns/waiting", "submit"),
                               ("ns/waiting", "pending_reason"), ("ns/mixed", "submit"),
                               ("ns/mixed", "pending_reason")}  # fmt: skip
    assert ev[("ns/running", "submit")].gpus_per_node == 2
    assert ev[("ns/waiting", "pending_reason")].gpus_per_node == 3
    assert ev[("ns/waiting", "pending_reason")].cause == "fragmentation"  # 2 + 2 free, no node has 3
    assert ev[("ns/mixed", "submit")].gpus_per_node == 4
    assert ev[("ns/mixed", "pending_reason")].cause is None  # device-plugin GPUs too: the rules judge


def test_collector_looks_again_at_a_pod_whose_claim_was_not_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    v, api = view_with(TWO_NODES)
    api.lists["/api/v1/pods"] = [pod("p", [{"name": "g", "resourceClaimName": "late"}], unsched="waiting")]
    c = _collector(v, api, tmp_path)
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.k8s_watch"):
        c.sync_once()
        c.sync_once()  # still not there: looked at again, not logged again
    assert _events(c) == []
    assert caplog.text.count("its GPUs through claims are unknown") == 1
    api.lists[f"{R}/resourceclaims"] = [claim("late", [exactly(1)])]
    c.sync_once()
    got = [(e.event, e.gpus_per_node, e.cause) for e in _events(c)]
    assert got == [("submit", 1.0, None), ("pending_reason", 1.0, "policy")]
    assert c._unknown == {}


def test_a_followed_pod_keeps_its_size_when_its_claim_goes(tmp_path: Path) -> None:
    v, api = view_with(TWO_NODES, [claim("c", [exactly(2)])])
    p = pod("p", [{"name": "g", "resourceClaimName": "c"}], node="node-a")
    api.lists["/api/v1/pods"] = [p]
    c = _collector(v, api, tmp_path)
    c.sync_once()
    v.claims.objects.clear()
    api.lists[f"{R}/resourceclaims"] = []
    api.watch_events["/api/v1/pods"] = [("DELETED", p)]
    c.sync_once()
    end = [e for e in _events(c) if e.event == "end"]
    assert [(e.name, e.gpus_per_node) for e in end] == [("ns/p", 2.0)]
    assert c._unknown == {}


def test_gpus_beyond_the_wire_bound_are_said_as_the_bound(tmp_path: Path) -> None:
    v, api = view_with(TWO_NODES, [claim("c", [exactly(10**6)])])
    api.lists["/api/v1/pods"] = [pod("p", [{"name": "g", "resourceClaimName": "c"}], gpus=5)]
    c = _collector(v, api, tmp_path)
    c.sync_once()
    assert [e.gpus_per_node for e in _events(c)] == [MAX_GPUS]


@pytest.mark.parametrize(
    "text, want", [("4", 4), ("1k", 1000), ("2e3", 2000), ("1Ki", 1024), ("500m", 0.5), ("-1", -1), (3, 3)]
)
def test_quantity(text: Any, want: float) -> None:
    assert quantity(text) == want


@pytest.mark.parametrize("text", ["", "abc", "nan", "4X", "1..2", "Ki"])
def test_not_a_quantity(text: str) -> None:
    with pytest.raises(ValueError, match="not a resource quantity"):
        quantity(text)


def test_a_pod_with_an_unreadable_gpu_request_is_not_followed_and_the_round_goes_on(tmp_path: Path) -> None:
    v, api = view_with(TWO_NODES)
    bad = pod("bad", [], gpus=1)
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "lots"
    api.lists["/api/v1/pods"] = [bad, pod("good", [], gpus=2, uid="u2")]
    c = _collector(v, api, tmp_path)
    c.sync_once()
    assert [(e.name, e.event) for e in _events(c)] == [("ns/good", "submit")]


HOSTILE_SLICES = [
    {"metadata": {"name": "s1"}, "spec": {"driver": NV, "nodeName": "n", "devices": 5}},
    {"metadata": {"name": "s2"}, "spec": {"driver": NV, "nodeName": 7, "pool": "p",
                                          "devices": [device("gpu-0", uuid="GPU-0")]}},
    {"metadata": {"name": "s3"}, "spec": {"driver": None, "pool": {"name": ["x"], "generation": "9"},
                                          "devices": [None, 3, {"name": 4}]}},
    {"metadata": {"name": "s4"}, "spec": "x"}, {"metadata": "x"}, {},
]  # fmt: skip
HOSTILE_CLAIMS = [
    {"metadata": {"name": "h1", "namespace": "ns"}, "spec": {"devices": {"requests": 3}}},
    {"metadata": {"name": "h2", "namespace": "ns"}, "spec": {"devices": "x"},
     "status": {"allocation": {"devices": {"results": 7}}}},
    {"metadata": {"name": "h3", "namespace": "ns"}, "spec": None, "status": {"allocation": "x"}},
    {"metadata": {"name": "h4", "namespace": "ns"}, "spec": {"devices": {"requests": [
        {"name": "r", "exactly": {"deviceClassName": ["gpu.nvidia.com"], "count": 2}},
        {"name": "r", "firstAvailable": [None, {"deviceClassName": NV, "count": True}]}]}},
     "status": {"allocation": {"devices": {"results": [None, {"driver": 1, "pool": None}]}}}},
]  # fmt: skip


@pytest.mark.parametrize("claim_name", ["h1", "h2", "h3", "h4"])
def test_hostile_objects_are_no_crash(claim_name: str) -> None:
    """Objects the API server would not serve (wrong types everywhere): nothing raises, and nothing
    in them is counted as a device or a GPU request."""
    v, _ = view_with(HOSTILE_SLICES, HOSTILE_CLAIMS)
    assert v.free() == {NV: {"": 1}, "mig.nvidia.com": {}}  # the one well-formed device (its node unreadable)
    d = v.pod_demand(pod("p", [{"name": "g", "resourceClaimName": claim_name}]))
    assert d.gpus in (0, 1)  # h4: firstAvailable's count True is not a count: the default 1
    v.cause(d)
    p = pod("p", [])
    p["spec"]["resourceClaims"] = "x"
    p["status"]["resourceClaimStatuses"] = 5
    assert v.pod_demand(p) == Demand()


def test_an_api_server_without_resource_k8s_io_v1_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Kubernetes before 1.34 answers 404 for resource.k8s.io/v1: one warning, asked again later,
    no cause given, the watch thread ends at close."""
    import time

    import gpuslo.agent.dra as dra_mod

    monkeypatch.setattr(dra_mod, "NOT_SERVED_RETRY_S", 0.0)
    api = FakeApi()
    api.fail[f"{R}/resourceslices"] = urllib.error.HTTPError(
        f"{R}/resourceslices", 404, "Not Found", None, None
    )  # type: ignore[arg-type]
    v = DraView(api)
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.dra"):
        v.slices.start()
        deadline = time.monotonic() + 30
        while v.slices.errors < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        v.close()
        assert v.slices._thread is not None
        v.slices._thread.join(10)
    assert not v.slices._thread.is_alive()
    assert v.slices.not_served and caplog.text.count("is not served by this API server") == 1
    assert v.cause(Demand(((NV, 1.0),))) is None


def test_a_waiting_pods_cause_is_judged_again_when_the_devices_change(tmp_path: Path) -> None:
    """The scheduler's words stay (`cannot allocate all claims`) while devices are freed: the next
    tick says the new cause with the same reason; nothing when nothing changed; none once bound."""
    held = [claim("a", [exactly(2)], [("node-a", "gpu-0"), ("node-a", "gpu-1")]),
            claim("b", [exactly(2)], [("node-b", "gpu-0"), ("node-b", "gpu-1")])]  # fmt: skip
    v, api = view_with(TWO_NODES, [*held, claim("big", [exactly(3)])])
    waiting = pod(
        "w", [{"name": "g", "resourceClaimName": "big"}], unsched="0/2 nodes: cannot allocate all claims"
    )
    api.lists["/api/v1/pods"] = [waiting]
    c = _collector(v, api, tmp_path)
    c.sync_once()
    first = _events(c)
    assert [(e.event, e.cause) for e in first] == [("submit", None), ("pending_reason", "fragmentation")]
    assert _events(c) == [], "nothing changed: nothing said"
    api.watch_events[f"{R}/resourceclaims"] = [("DELETED", held[1])]  # node-b's devices freed
    v.claims.sync_once()
    (again,) = c.collect(1.8e9)
    assert isinstance(again, SchedulerEvent)
    assert (again.event, again.reason, again.cause) == ("pending_reason", first[1].reason, "policy")
    assert again.ts == 1.8e9  # the tick's time
    api.watch_events[f"{R}/resourceclaims"] = [("ADDED", claim("x", [exactly(4)], [("node-b", f"gpu-{i}")
                                                                                  for i in range(4)]))]  # fmt: skip
    v.claims.sync_once()
    assert [e.cause for e in _events(c)] == ["capacity"]
    bound = pod("w", [{"name": "g", "resourceClaimName": "big"}], node="node-a")
    api.watch_events["/api/v1/pods"] = [("MODIFIED", bound)]
    c.sync_once()
    assert [e.event for e in _events(c)] == ["start"]
    api.watch_events[f"{R}/resourceclaims"] = [("DELETED", held[0])]
    v.claims.sync_once()
    assert _events(c) == [] and c._waiting == {}


def test_the_assembled_agent_with_resource_slices(tmp_path: Path) -> None:
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from gpuslo.agent.k8s import PodResourcesAttribution
    from gpuslo.agent.k8s_watch import Forbidden
    from tests.fake_nvml import FakeGpu, FakeNvml

    base = NodeOptions(source="nvml", node="n1", cluster="c", interval_s=10.0, pool="p",
                       k8s_pod_resources=str(tmp_path / "kubelet.sock"), k8s_resource_slices=True)  # fmt: skip
    api = FakeApi()
    path = f"{R}/resourceslices?fieldSelector=spec.nodeName%3Dn1"
    api.lists[path] = [rslice("s", "n1", [device("gpu-0", uuid="GPU-a")])]
    agent = node_agent(base, kube_api=lambda: api, nvml=FakeNvml([FakeGpu("GPU-a")]))
    try:
        attr = agent.gpu.attribution  # type: ignore[union-attr]
        assert isinstance(attr, PodResourcesAttribution) and agent.notes == []
        assert attr.resolve is not None and attr.resolve(NV, "n1", "gpu-0") == "GPU-a"  # listed at once
        assert len(agent.closers) == 1
        assert agent.extra is not None and agent.extra()["gpuslo_agent_dra_devices_unresolved"] == 0
        attr.resolve.bad_lines = 2  # type: ignore[attr-defined]  # what the index's watch counts
        assert agent.extra()["gpuslo_agent_dra_watch_bad_lines"] == 2
    finally:
        for close in agent.closers:
            close()
    api.fail[path] = Forbidden(
        "403 on ...: (the agent with --k8s-resource-slices needs get/list/watch on resourceslices)"
    )
    denied = node_agent(base, kube_api=lambda: api, nvml=FakeNvml([FakeGpu("GPU-a")]))
    for close in denied.closers:
        close()
    assert len(denied.notes) == 1 and "needs get/list/watch on resourceslices" in denied.notes[0]
    outside = node_agent(base, kube_api=lambda: None, nvml=FakeNvml([FakeGpu("GPU-a")]))
    assert outside.notes == ["no API server: DRA claim devices stay unattributed; give --k8s-api"]
    dcgm = node_agent(NodeOptions(**{**base.__dict__, "source": "dcgm"}), kube_api=lambda: api)
    assert dcgm.notes == ["--k8s-resource-slices needs --source nvml with --k8s-pod-resources; ignored"]


def test_a_pod_whose_claim_comes_later_is_followed_at_the_next_tick(tmp_path: Path) -> None:
    """The claim arrives through the claims watch: the pod is looked at again at the next tick,
    not only after the pod watch's round."""
    v, api = view_with(TWO_NODES)
    api.lists["/api/v1/pods"] = [pod("p", [{"name": "g", "resourceClaimName": "late"}], unsched="waiting")]
    c = _collector(v, api, tmp_path)
    c.sync_once()
    assert _events(c) == [] and c._unknown
    asked = len(api.gets)  # 404s
    api.watch_events[f"{R}/resourceclaims"] = [("ADDED", claim("late", [exactly(2)]))]
    v.claims.sync_once()
    assert [(e.event, e.gpus_per_node) for e in _events(c)] == [("submit", 2.0), ("pending_reason", 2.0)]
    assert len(api.gets) == asked, "read from the cache the watch filled, not fetched"
    assert c._unknown == {}


def test_a_count_past_any_float_is_no_wedge_of_the_collector(tmp_path: Path) -> None:
    """A claim whose count is past int64 (10**400: JSON reads it, ``float()`` raises
    OverflowError) is a request past the bound, said as the bound; before, the OverflowError left
    the pod collector's list (and every list after it) before its resourceVersion was kept: no
    pod of the cluster was followed any more."""
    v, api = view_with(TWO_NODES, [claim("c", [exactly(10**400)])])
    api.lists["/api/v1/pods"] = [pod("p", [{"name": "g", "resourceClaimName": "c"}], unsched="x"),
                                 pod("good", [], gpus=2, uid="u2")]  # fmt: skip
    c = _collector(v, api, tmp_path)
    c.sync_once()
    got = [(e.name, e.event, e.gpus_per_node, e.cause) for e in _events(c)]
    assert got == [("ns/p", "submit", MAX_GPUS, None), ("ns/p", "pending_reason", MAX_GPUS, "capacity"),
                   ("ns/good", "submit", 2.0, None)]  # fmt: skip
    assert c.rv == "10"


def test_one_pod_that_raises_is_skipped_and_the_watch_goes_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a pod's looking-at raises (a shape no reader foresaw) skips that pod, counted; the
    list and the watch go on past it (raised, the round ended before the resourceVersion moved,
    and every later round met the same object: the collector stuck for good). The API's own
    trouble (a fetch that fails) still fails the round, to be retried from the same version."""
    v, api = view_with(TWO_NODES, [claim("c", [exactly(1)])])
    real = DraView.pod_demand

    def demand(self: DraView, p: dict[str, Any]) -> Demand:
        if p["metadata"]["name"] == "bad":
            raise TypeError("unforeseen")
        if p["metadata"]["name"] == "down":
            raise ConnectionResetError("API server went away")
        return real(self, p)

    monkeypatch.setattr(DraView, "pod_demand", demand)
    claims = [{"name": "g", "resourceClaimName": "c"}]
    api.lists["/api/v1/pods"] = [pod("bad", claims, unsched="x"), pod("ok", claims, unsched="y", uid="u2")]
    c = _collector(v, api, tmp_path)
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.k8s_watch"):
        c.sync_once()
    assert [(e.name, e.event) for e in _events(c)] == [("ns/ok", "submit"), ("ns/ok", "pending_reason")]
    assert c.rv == "10" and c.skipped == 1 and c.counts()["gpuslo_k8s_skipped_pods"] == 1
    assert "pod ns/bad skipped: TypeError: unforeseen" in caplog.text
    api.watch_events["/api/v1/pods"] = [("ADDED", {**pod("late", claims, unsched="z", uid="u3"),
                                                   "metadata": {**pod("late", claims, uid="u3")["metadata"],
                                                                "resourceVersion": "11"}})]  # fmt: skip
    c.sync_once()
    assert [(e.name, e.event) for e in _events(c)] == [("ns/late", "submit"), ("ns/late", "pending_reason")]
    assert c.rv == "11"
    api.watch_events["/api/v1/pods"] = [("ADDED", pod("down", claims, unsched="z", uid="u4"))]
    with pytest.raises(ConnectionResetError):
        c.sync_once()
    assert c.rv == "11" and c.skipped == 1  # not passed: the next round sees it again

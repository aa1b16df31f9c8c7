"""MIG devices through DRA on the real control plane (kube-apiserver, kube-scheduler 1.34): a node's
ResourceSlice publishes MIG devices as the NVIDIA DRA driver does (``type`` mig, ``profile``),
the driver's ``mig.nvidia.com`` DeviceClass selects them by CEL, and pods' claims ask for one
profile with NVIDIA's selector (``device.attributes['gpu.nvidia.com'].profile == '3g.40gb'``).
The real scheduler evaluates those selectors and allocates; the collector counts each request as
its part of a GPU (a 3g.40gb on an H100: 3/7), before allocation from the selector and after it
from the devices given. Before, every MIG device was a whole GPU."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.dra import DraView
from gpuslo.agent.k8s_watch import K8sPodCollector, KubeApi
from gpuslo.wire import SchedulerEvent
from tests.servers.k8s import ADMIN_TOKEN, KubeControlPlane

pytestmark = pytest.mark.integration

R = "/apis/resource.k8s.io/v1"
DRIVER = "gpu.nvidia.com"
NS = "team-dra-mig"
NODE = "dra-mig-0"
# one H100 split as the driver would publish it: 3g.40gb + 2g.20gb + two 1g.10gb
DEVICES = {
    "gpu-0-mig-0": "3g.40gb",
    "gpu-0-mig-1": "2g.20gb",
    "gpu-0-mig-2": "1g.10gb",
    "gpu-0-mig-3": "1g.10gb",
}


def _sel(profile: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": f"device.attributes['{DRIVER}'].profile == '{profile}'"}}]


@pytest.fixture(scope="module")
def mig(kube: KubeControlPlane) -> KubeControlPlane:
    kube.ensure_namespace(NS)
    kube.create_node(NODE, 0, labels={"gpuslo.test/group": "dra-mig"})
    kube.api("POST", f"{R}/resourceslices", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{NODE}-{DRIVER}"},
        "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": d, "attributes": {
                     "type": {"string": "mig"}, "profile": {"string": p}, "uuid": {"string": f"MIG-{d}"},
                     "productName": {"string": "NVIDIA H100 80GB HBM3"}}} for d, p in DEVICES.items()]},
    })  # fmt: skip
    kube.api("POST", f"{R}/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "mig.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression":
            f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'}}]},
    })  # fmt: skip
    for name, profile, count in (
        ("three-g", "3g.40gb", 1),
        ("one-g-two", "1g.10gb", 2),
        ("four-g", "4g.40gb", 1),
    ):
        kube.api("POST", f"{R}/namespaces/{NS}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
                "deviceClassName": "mig.nvidia.com", "count": count, "selectors": _sel(profile)}}]}}})  # fmt: skip
    return kube


def _pod(kube: KubeControlPlane, name: str, claim: str) -> None:
    spec = {
        "containers": [{"name": "main", "image": "registry.invalid/serve:1", "resources": {"claims": [{"name": "mig"}]}}],
        "resourceClaims": [{"name": "mig", "resourceClaimName": claim}],
        "nodeSelector": {"gpuslo.test/group": "dra-mig"}, "terminationGracePeriodSeconds": 0,
    }  # fmt: skip
    kube.api("POST", f"/api/v1/namespaces/{NS}/pods",
             {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": spec})  # fmt: skip


def test_mig_claims_are_their_part_of_a_gpu_as_the_real_scheduler_allocates_them(
    mig: KubeControlPlane, tmp_path: Path
) -> None:
    kube = mig
    _pod(kube, "big", "three-g")  # 3g.40gb: 3/7
    _pod(kube, "small", "one-g-two")  # two 1g.10gb: 2/7
    _pod(kube, "none", "four-g")  # no 4g.40gb published: waits, 4/7 asked
    bound = {p: kube.wait_pod(NS, p, scheduled=True) for p in ("big", "small")}
    kube.wait_pod(NS, "none", scheduled=False)
    # the scheduler chose by the selectors: each claim holds devices of its profile
    for claim, profile, n in (("three-g", "3g.40gb", 1), ("one-g-two", "1g.10gb", 2)):
        got = kube.api("GET", f"{R}/namespaces/{NS}/resourceclaims/{claim}")
        results = got["status"]["allocation"]["devices"]["results"]
        assert sorted(DEVICES[r["device"]] for r in results) == [profile] * n, results

    api = KubeApi(kube.server, ADMIN_TOKEN, str(kube.ca_file))
    view = DraView(api, watch_timeout_s=1)
    view.relist()
    c = K8sPodCollector("kube-dra-mig", api, tmp_path / "state.json", boot_id=uuid.uuid4().hex[:8],
                        watch_timeout_s=1, dra=view)  # fmt: skip
    events: list[SchedulerEvent] = []
    want = {("big", "start"), ("small", "start"), ("none", "pending_reason")}
    deadline = time.monotonic() + 60
    while not want <= {(e.name.split("/")[-1], e.event) for e in events}:
        assert time.monotonic() < deadline, [(e.name, e.event) for e in events]
        c.sync_once()
        events += [m for m in c.collect(time.time()) if isinstance(m, SchedulerEvent) and m.queue == NS]
    asked = {e.name.split("/")[-1]: e.gpus_per_node for e in events if e.event == "submit"}
    # free now: the 2g.20gb alone; the 4g.40gb no node publishes is capacity (counted by class,
    # the free 2g.20gb made it `policy`)
    (why,) = [e for e in events if e.event == "pending_reason"]
    assert why.cause == "capacity", why
    assert asked == pytest.approx({"big": 3 / 7, "small": 2 / 7, "none": 4 / 7}, abs=1e-6)
    for p in bound:  # allocated: the same from the devices given as from the selectors
        assert view.pod_demand(kube.get_pod(NS, p)).allocated
        assert view.pod_demand(kube.get_pod(NS, p)).gpus == pytest.approx(asked[p], abs=1e-9)

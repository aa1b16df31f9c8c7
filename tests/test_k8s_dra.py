"""Dynamic Resource Allocation on the real control plane: kube-apiserver and kube-scheduler 1.34
(``resource.k8s.io/v1``, served by default), and kube-controller-manager's resourceclaim
controller (it makes a pod's claim from its ResourceClaimTemplate).

The test publishes ResourceSlices for two simulated GPU nodes as the NVIDIA DRA driver would
(driver ``gpu.nvidia.com``, devices ``gpu-N`` with ``type`` and ``uuid`` attributes), the
driver's DeviceClass, and pods with claims (from templates, by name, one claim shared by two
pods); the real scheduler allocates the devices and binds, or leaves pods Unschedulable. Then:

- the collector's events (GPUs requested through claims, the scheduler's reasons) and the
  causes it judges against the free devices (slices minus allocated claims);
- node attribution: a fake kubelet lists the devices the scheduler allocated (from each claim's
  ``status.allocation``, as the kubelet's PodResources would), and the agent resolves them to
  the UUIDs published in the slices, through its ResourceSlice watch on the real API server;
- the starvation incidents and their causes from what the collector and the agents sent.

No kubelet runs: PodResources stays the protocol fake of tests/test_k8s_podresources.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.dra import DraView, ResourceSliceIndex
from gpuslo.agent.k8s import PodResourcesAttribution
from gpuslo.agent.k8s_watch import Forbidden, K8sPodCollector, KubeApi, ts
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import summary
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSample, GpuSampleBatch, SchedulerEvent, encode
from tests.servers.k8s import ADMIN_TOKEN, ROOT, ApiError, KubeControlPlane
from tests.test_k8s_podresources import encode as encode_pod_resources

pytestmark = pytest.mark.integration

CLUSTER = "kube-dra"
R = "/apis/resource.k8s.io/v1"
DRIVER = "gpu.nvidia.com"
NS = "team-dra"
NODES = ("dra-0", "dra-1")
GROUP = {"gpuslo.test/group": "dra"}
PER_NODE = 4


def _uuid(node: str, i: int) -> str:
    return f"GPU-{node}-{i}"


def _slice(node: str, devices: int, generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                 "devices": [{"name": f"gpu-{i}", "attributes": {
                     "type": {"string": "gpu"}, "uuid": {"string": _uuid(node, i)},
                     "productName": {"string": "NVIDIA H200"}}} for i in range(devices)]},
    }  # fmt: skip


def _claim_spec(count: int) -> dict[str, Any]:
    return {
        "devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": count}}]}
    }


def _pod(kube: KubeControlPlane, name: str, claims: list[dict[str, str]], selector: dict[str, str]) -> None:
    spec = {
        "containers": [{"name": "main", "image": "registry.invalid/train:1",
                        "resources": {"claims": [{"name": c["name"]} for c in claims]}}],
        "resourceClaims": claims, "nodeSelector": selector, "terminationGracePeriodSeconds": 0,
    }  # fmt: skip
    kube.api("POST", f"/api/v1/namespaces/{NS}/pods",
             {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": spec})  # fmt: skip


def _template(name: str, count: int) -> dict[str, str]:
    return {"name": "gpus", "resourceClaimTemplateName": name}


@pytest.fixture(scope="module")
def dra(kube: KubeControlPlane) -> KubeControlPlane:
    """The DRA objects of this module on the session's control plane, and the claim controller."""
    groups = kube.api("GET", R)
    assert {r["name"] for r in groups["resources"]} >= {"resourceslices", "resourceclaims",
                                                        "resourceclaimtemplates", "deviceclasses"}  # fmt: skip
    kube.start_controller_manager("resourceclaim-controller")
    kube.ensure_namespace(NS)
    for n in NODES:
        kube.create_node(n, 0, labels=GROUP)  # no device-plugin GPUs: only DRA devices
        kube.api("POST", f"{R}/resourceslices", _slice(n, PER_NODE))
    kube.api("POST", f"{R}/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression":
            f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'}}]},
    })  # fmt: skip
    for name, count in (("two", 2), ("three", 3), ("four", 4), ("one", 1)):
        kube.api("POST", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NS}, "spec": {"spec": _claim_spec(count)}})  # fmt: skip
    for name, count in (("direct-2", 2), ("shared-1", 1)):
        kube.api("POST", f"{R}/namespaces/{NS}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NS}, "spec": _claim_spec(count)})  # fmt: skip
    return kube


def _sync_until(
    c: K8sPodCollector, want: set[tuple[str, str]], timeout_s: float = 60.0
) -> list[SchedulerEvent]:
    events: list[SchedulerEvent] = []
    deadline = time.monotonic() + timeout_s
    while True:
        c.sync_once()
        events += [m for m in c.collect(time.time()) if isinstance(m, SchedulerEvent) and m.queue == NS]
        if want <= {(e.name.split("/")[-1], e.event) for e in events}:
            return events
        if time.monotonic() > deadline:
            raise TimeoutError(f"collector events so far: {[(e.name, e.event) for e in events]}")


def _claims_of(kube: KubeControlPlane, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims the pod holds: by name, or the one the controller made from its template."""
    made = {s["name"]: s.get("resourceClaimName") for s in pod["status"].get("resourceClaimStatuses") or []}
    out = []
    for rc in pod["spec"]["resourceClaims"]:
        name = rc.get("resourceClaimName") or made[rc["name"]]
        out.append(kube.api("GET", f"{R}/namespaces/{NS}/resourceclaims/{name}"))
    return out


def test_claims_allocated_by_the_real_scheduler_events_causes_and_attribution(
    dra: KubeControlPlane, tmp_path: Path
) -> None:
    kube = dra
    on = {n: {"kubernetes.io/hostname": n} for n in NODES}
    _pod(kube, "t1", [_template("two", 2)], on["dra-0"])  # from a template: 2 of dra-0's 4
    _pod(kube, "c1", [{"name": "gpus", "resourceClaimName": "direct-2"}], on["dra-1"])  # by name
    _pod(kube, "s1", [{"name": "gpus", "resourceClaimName": "shared-1"}], on["dra-1"])  # one claim,
    _pod(kube, "s2", [{"name": "gpus", "resourceClaimName": "shared-1"}], on["dra-1"])  # two pods
    bound = {p: kube.wait_pod(NS, p, scheduled=True) for p in ("t1", "c1", "s1", "s2")}
    assert {p: b["spec"]["nodeName"] for p, b in bound.items()} == {
        "t1": "dra-0", "c1": "dra-1", "s1": "dra-1", "s2": "dra-1"
    }  # fmt: skip
    # free now, as the scheduler sees it: dra-0 2, dra-1 1; 3 in all
    _pod(kube, "frag", [_template("three", 3)], GROUP)  # 3 free, but no node has 3
    _pod(kube, "cap", [_template("four", 4)], GROUP)  # more than all free devices
    _pod(kube, "pol", [_template("one", 1)], {"gpuslo.test/group": "nowhere"})  # devices free; a selector
    pending = {p: kube.wait_pod(NS, p, scheduled=False) for p in ("frag", "cap", "pol")}

    api = KubeApi(kube.server, ADMIN_TOKEN, str(kube.ca_file))
    view = DraView(api, watch_timeout_s=1)
    view.relist()
    c = K8sPodCollector(CLUSTER, api, tmp_path / "state.json", boot_id=uuid.uuid4().hex[:8], watch_timeout_s=1,
                        dra=view)  # fmt: skip
    want = {(p, "start") for p in bound} | {(p, "pending_reason") for p in pending}
    events = _sync_until(c, want)
    by = {(e.name.split("/")[-1], e.event): e for e in events}
    assert len(by) == len(events), "an event was emitted twice"
    assert {p: by[(p, "submit")].gpus_per_node for p in (*bound, *pending)} == {
        "t1": 2, "c1": 2, "s1": 1, "s2": 1, "frag": 3, "cap": 4, "pol": 1
    }  # fmt: skip
    for p, pod in bound.items():
        assert by[(p, "start")].assigned_nodes == (pod["spec"]["nodeName"],)
    for p, pod in pending.items():
        sched = next(x for x in pod["status"]["conditions"] if x["type"] == "PodScheduled")
        assert by[(p, "pending_reason")].reason == f"Unschedulable: {sched['message']}"[:256]
    assert {p: by[(p, "pending_reason")].cause for p in pending} == {
        "frag": "fragmentation", "cap": "capacity", "pol": "policy"
    }  # fmt: skip

    # node attribution: what PodResources would list on each node (the claims' allocated devices),
    # resolved through that node's ResourceSlices on the API server
    samples, expected, held = [], {}, {}
    for seq, node in enumerate(NODES):
        listing = []
        for p, pod in bound.items():
            if pod["spec"]["nodeName"] != node:
                continue
            claims = [(cl["metadata"]["namespace"], cl["metadata"]["name"],
                       [(r["driver"], r["pool"], r["device"], []) for r in cl["status"]["allocation"]["devices"]["results"]])
                      for cl in _claims_of(kube, kube.get_pod(NS, p))]  # fmt: skip
            listing.append((NS, p, [("main", [], claims)]))
            for _, _, res in claims:
                for drv, pool, dev, _ in res:
                    assert (drv, pool) == (DRIVER, node)
                    held.setdefault(_uuid(node, int(dev.removeprefix("gpu-"))), []).append(f"{NS}/{p}")
        index = ResourceSliceIndex(api, node, watch_timeout_s=1)
        index.sync_once()  # list, with fieldSelector spec.nodeName
        raw = encode_pod_resources(listing)
        attr = PodResourcesAttribution("-", list_call=lambda s, t, raw=raw: raw, resolve=index)
        attr.refresh()
        assert attr.unresolved == 0
        gpus = []
        for i in range(PER_NODE):
            allocs = attr(i, _uuid(node, i))
            expected[_uuid(node, i)] = sorted(a.id for a in allocs)
            gpus.append(GpuSample(index=i, uuid=_uuid(node, i), allocations=allocs,
                                  fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.5 if allocs else 0.0}))  # fmt: skip
            assert sum(a.share for a in allocs) in ((1.0,) if allocs else (0,))
        samples.append(GpuSampleBatch(source=node, boot_id="b", seq=seq, cluster=CLUSTER, ts=time.time(),
                                      node=node, pool="", interval_s=10.0, gpus=tuple(gpus)))  # fmt: skip
    assert {u: sorted(h) for u, h in held.items()} == {u: h for u, h in expected.items() if h}
    assert sorted(len(h) for h in held.values()) == [1, 1, 1, 1, 2]  # t1 2, c1 2, the shared one twice

    # the starvation rule on what the collector and the agents sent
    threshold = 2.0
    newest = max(ts(p["metadata"]["creationTimestamp"]) or 0.0 for p in pending.values())
    time.sleep(max(0.0, newest + threshold + 1.5 - time.time()))
    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest(Raw(f"k8s/{i}", encode(m)) for i, m in enumerate([*samples, *events]))
        assert not rep.rejected, rep.rejected
        cfg = RulesConfig.model_validate(
            {"starvation": {"threshold_s": 600, "queue_threshold_s": {NS: threshold}}}
        )
        s = summary(store, cfg, time.time() - 120, time.time() + 1, cluster=CLUSTER)
    finally:
        store.close()
    incidents = {i.request_id: i for i in s.starvation_incidents}
    uid = {p: pod["metadata"]["uid"] for p, pod in pending.items()}
    assert set(incidents) == set(uid.values()), s.starvation_incidents
    assert {p: incidents[u].cause for p, u in uid.items()} == {
        "frag": "fragmentation", "cap": "capacity", "pol": "policy"
    }  # fmt: skip
    assert {incidents[u].free_gpus_at_open for u in uid.values()} == {3.0}


def test_slice_watch_sees_a_new_device_and_a_new_generation(dra: KubeControlPlane) -> None:
    """The node's ResourceSlice watch (fieldSelector spec.nodeName through list and watch): a device
    the driver adds is resolved after the watch event; another node's slice is not seen."""
    kube = dra
    api = KubeApi(kube.server, ADMIN_TOKEN, str(kube.ca_file))
    kube.create_node("dra-2", 0, labels={"gpuslo.test/group": "dra-watch"})
    kube.create_node("dra-3", 0, labels={"gpuslo.test/group": "dra-watch"})
    kube.api("POST", f"{R}/resourceslices", _slice("dra-2", 1))
    index = ResourceSliceIndex(api, "dra-2", watch_timeout_s=1)
    index.sync_once()
    assert index(DRIVER, "dra-2", "gpu-0") == _uuid("dra-2", 0)
    assert index(DRIVER, "dra-2", "gpu-1") is None
    cur = kube.api("GET", f"{R}/resourceslices/dra-2-{DRIVER}")
    kube.api("PUT", f"{R}/resourceslices/dra-2-{DRIVER}", {**_slice("dra-2", 2, generation=2),
                                                           "metadata": cur["metadata"]})  # fmt: skip
    kube.api("POST", f"{R}/resourceslices", _slice("dra-3", 2))
    deadline = time.monotonic() + 30
    while index(DRIVER, "dra-2", "gpu-1") is None:
        assert time.monotonic() < deadline, index.objects
        index.sync_once()  # a watch round from the listed resourceVersion
    assert index(DRIVER, "dra-2", "gpu-1") == _uuid("dra-2", 1)
    assert index(DRIVER, "dra-3", "gpu-0") is None  # another node's slice
    assert set(index.objects) == {f"/dra-2-{DRIVER}"} and index.relists == 1


def _apply_roles(kube: KubeControlPlane, manifest: str) -> None:
    import yaml

    kube.ensure_namespace("gpuslo")
    for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / manifest).read_text()):
        if d and d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            try:
                kube.apply(d)
            except ApiError as exc:  # made by another test of the session already
                if exc.code != 409:
                    raise


def test_assembled_agent_attributes_dra_devices_with_the_shipped_role(
    dra: KubeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`node_agent` as the CLI builds it for --source nvml --k8s-pod-resources --k8s-resource-slices,
    on fake NVML (a GPU and a MIG instance) and a fake kubelet; the ResourceSlice watch runs on the
    real API server with the token of the shipped agent role."""
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from tests.fake_nvml import FakeGpu, FakeMig, FakeNvml
    from tests.test_k8s_podresources import FakeKubelet

    kube, node = dra, "dra-agent"
    _apply_roles(kube, "agent-daemonset.yaml")
    kube.create_node(node, 0, labels={"gpuslo.test/group": "dra-agent"})
    sl = _slice(node, 1)
    sl["spec"]["devices"].append({"name": "gpu-1-mig-1g18gb-0", "attributes": {
        "type": {"string": "mig"}, "uuid": {"string": "MIG-dra-agent-1-0"}}})  # fmt: skip
    kube.api("POST", f"{R}/resourceslices", sl)
    sock = tmp_path / "kubelet.sock"
    kubelet = FakeKubelet(sock)
    kubelet.response = encode_pod_resources([
        (NS, "w1", [("main", [], [(NS, "w1-gpus", [(DRIVER, node, "gpu-0", [f"k8s.{DRIVER}/claim=w1"])])])]),
        (NS, "m1", [("main", [], [(NS, "m1-mig", [(DRIVER, node, "gpu-1-mig-1g18gb-0", [])])])]),
        (NS, "x1", [("main", [], [(NS, "x1-gpus", [(DRIVER, "another-node", "gpu-0", [])])])]),
    ])  # fmt: skip
    gpus = [
        FakeGpu(_uuid(node, 0)),
        FakeGpu(_uuid(node, 1), mig_capable=True, mig=[FakeMig("MIG-dra-agent-1-0", gi=1)]),
    ]
    api = KubeApi(kube.server, kube.service_account_token("gpuslo", "gpuslo-agent"), str(kube.ca_file))
    opts = NodeOptions(source="nvml", node=node, cluster=CLUSTER, interval_s=10.0, pool="p",
                       k8s_pod_resources=str(sock), k8s_resource_slices=True)  # fmt: skip
    agent = node_agent(opts, kube_api=lambda: api, nvml=FakeNvml(gpus))
    try:
        src = agent.gpu
        assert src is not None and agent.notes == []
        index = src.attribution.resolve  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while index(DRIVER, node, "gpu-0") is None:
            assert time.monotonic() < deadline and index.errors == 0, index.errors
            time.sleep(0.1)
        with caplog.at_level(logging.WARNING, logger="gpuslo.agent.k8s"):
            (batch,) = [m for m in src.collect(time.time()) if isinstance(m, GpuSampleBatch)]
        rows = {(g.index, g.uuid): [a.id for a in g.allocations] for g in batch.gpus}
        assert rows[(0, _uuid(node, 0))] == [f"{NS}/w1"]
        assert rows[(1, "MIG-dra-agent-1-0")] == [f"{NS}/m1"]
        assert rows[(1, _uuid(node, 1))] == []
        assert agent.extra is not None and agent.extra()["gpuslo_agent_dra_devices_unresolved"] == 1
        assert f"{DRIVER}/another-node/gpu-0 of claim {NS}/x1-gpus" in caplog.text
    finally:
        for close in agent.closers:
            close()
        kubelet.server.stop(0)
    index._thread.join(10)  # close ends the watch in progress (else it would run its 300 s)
    assert not index._thread.is_alive()

    # the same watch with a token whose role lacks resourceslices: refused, and said what it needs
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "no-slices", "namespace": "gpuslo"},
        }
    )
    denied = ResourceSliceIndex(KubeApi(kube.server, kube.service_account_token("gpuslo", "no-slices"),
                                        str(kube.ca_file)), node)  # fmt: skip
    with pytest.raises(Forbidden, match="needs get/list/watch on resourceslices") as exc:
        denied.sync_once()
    assert 'cannot list resource \\"resourceslices\\"' in str(exc.value)


def test_cli_collector_counts_claims_with_the_shipped_role(dra: KubeControlPlane, tmp_path: Path) -> None:
    """`gpuslo agent --source k8s-events` as an operator runs it, with the shipped collector role:
    its DRA view (on by default) lists slices, claims and templates; a pod asking for more devices
    than exist is followed with its GPUs and the cause capacity."""
    import subprocess
    import sys

    from gpuslo.wire import decode

    kube, ns = dra, "team-dra-cli"
    _apply_roles(kube, "collector.yaml")
    kube.ensure_namespace(ns)
    kube.api("POST", f"{R}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "many", "namespace": ns}, "spec": {"spec": _claim_spec(16)}})  # fmt: skip
    kube.api("POST", f"/api/v1/namespaces/{ns}/pods", {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "cli-dra", "namespace": ns}, "spec": {
                 "containers": [{"name": "main", "image": "registry.invalid/x:1", "resources": {"claims": [{"name": "g"}]}}],
                 "resourceClaims": [{"name": "g", "resourceClaimTemplateName": "many"}]}})  # fmt: skip
    kube.wait_pod(ns, "cli-dra", scheduled=False)
    (tmp_path / "token").write_text(kube.service_account_token("gpuslo", "gpuslo-collector"))
    out = tmp_path / "events.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "gpuslo", "agent", "--source", "k8s-events", "--cluster", CLUSTER,
         "--k8s-api", kube.server, "--k8s-token-file", str(tmp_path / "token"), "--k8s-ca-file", str(kube.ca_file),
         "--state-file", str(tmp_path / "state.json"), "--interval-s", "1", "--ticks", "3", "--out", str(out),
         "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused" not in r.stderr and "Forbidden" not in r.stderr, r.stderr[-3000:]
    events = [decode(line) for line in out.read_bytes().splitlines()]
    mine = {e.event: e for e in events if isinstance(e, SchedulerEvent) and e.queue == ns}
    assert set(mine) == {"submit", "pending_reason"}
    assert mine["submit"].gpus_per_node == 16
    assert mine["pending_reason"].cause == "capacity"


def test_closing_the_collector_ends_its_watches_at_once(dra: KubeControlPlane, tmp_path: Path) -> None:
    """Watches of 300 s on the real API server (pods, slices, claims, templates): close() ends them
    all, so the collector's threads stop, not at the watches' timeout."""
    api = KubeApi(dra.server, ADMIN_TOKEN, str(dra.ca_file))
    view = DraView(api)
    c = K8sPodCollector(CLUSTER, api, tmp_path / "state.json", boot_id="b", dra=view)
    c.start()
    deadline = time.monotonic() + 30
    while not (c.rv and all(x._response is not None for x in view.caches) and c._response is not None):
        assert time.monotonic() < deadline, "the watches did not open"
        time.sleep(0.05)
    c.close()
    for t in [c._thread, *(x._thread for x in view.caches)]:
        assert t is not None
        t.join(10)
        assert not t.is_alive()

"""The Kubernetes collector against a real control plane: etcd, kube-apiserver and
kube-scheduler (built by provision/k8s.sh), simulated GPU nodes (Node objects with
``nvidia.com/gpu`` capacity). The real scheduler binds pods or leaves them Unschedulable
with its own reasons; the collector's events must say what the API server says.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslo.agent.k8s_watch import Forbidden, K8sPodCollector, KubeApi, ts
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import summary
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch, SchedulerEvent, encode
from tests.pod_requests import SHAPES, pod_spec
from tests.servers.k8s import ADMIN_TOKEN, KubeControlPlane

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "kube-test"


def _collector(kube: KubeControlPlane, state: Path, token: str = ADMIN_TOKEN) -> K8sPodCollector:
    api = KubeApi(kube.server, token, str(kube.ca_file))
    return K8sPodCollector(CLUSTER, api, state, boot_id=uuid.uuid4().hex[:8], watch_timeout_s=2)


def _sync_until(c: K8sPodCollector, done: Any, timeout_s: float = 60.0) -> list[SchedulerEvent]:
    """Run the collector's list/watch rounds here (no thread) until ``done(events)``."""
    events: list[SchedulerEvent] = []
    deadline = time.monotonic() + timeout_s
    while True:
        c.sync_once()
        events += [m for m in c.collect(time.time()) if isinstance(m, SchedulerEvent)]
        if done(events):
            return events
        if time.monotonic() > deadline:
            raise TimeoutError(f"collector events so far: {[(e.name, e.event) for e in events]}")


def _have(*wanted: tuple[str, str]) -> Any:
    """Names are unique across the namespaces these tests use."""
    return lambda evs: set(wanted) <= {(e.name.split("/")[-1], e.event) for e in evs}


def _node_batches(kube: KubeControlPlane, nodes: list[str], ns: str, at: float) -> list[GpuSampleBatch]:
    """What the node agents would send at ``at``: 8 GPUs per node, attributed to the pods the
    scheduler bound there (the kubelet's PodResources would hand out device ids; here GPUs are
    given out in order)."""
    pods = kube.api("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
    out = []
    for seq, node in enumerate(nodes):
        holders: list[Allocation | None] = []
        for p in pods:
            if p["spec"].get("nodeName") == node:
                n = int(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
                md = p["metadata"]
                holders += [Allocation(scheduler="k8s", id=md["uid"], name=f"{ns}/{md['name']}", account=ns,
                                       queue=ns)] * n  # fmt: skip
        holders += [None] * (8 - len(holders))
        gpus = tuple(
            GpuSample(index=i, uuid=f"GPU-{node}-{i}", fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.5 if h else 0.0},
                      allocations=(h,) if h else ())
            for i, h in enumerate(holders)
        )  # fmt: skip
        out.append(GpuSampleBatch(source=node, boot_id="b", seq=seq, cluster=CLUSTER, ts=at, node=node,
                                  pool="", interval_s=10.0, gpus=gpus))  # fmt: skip
    return out


def test_events_match_the_api_and_starvation_causes(kube: KubeControlPlane, tmp_path: Path) -> None:
    ns, group = "team-frag", {"gpuslo.test/group": "frag"}
    kube.ensure_namespace(ns)
    nodes = ["frag-0", "frag-1"]
    for n in nodes:
        kube.create_node(n, 8, labels=group)
    c = _collector(kube, tmp_path / "state.json")
    kube.create_pod(ns, "a", 4, {"kubernetes.io/hostname": "frag-0"})
    kube.create_pod(ns, "b", 4, {"kubernetes.io/hostname": "frag-1"})
    bound = [kube.wait_pod(ns, p, scheduled=True) for p in ("a", "b")]
    assert sorted(p["spec"]["nodeName"] for p in bound) == nodes  # 4 free GPUs on each node
    snapshot_at = time.time()
    samples = _node_batches(kube, nodes, ns, snapshot_at)
    kube.create_pod(ns, "c", 6, group)  # 8 free in all, but no node has 6: fragmentation
    kube.create_pod(ns, "d", 12, group)  # more than all free GPUs: capacity
    pending = {p: kube.wait_pod(ns, p, scheduled=False) for p in ("c", "d")}

    events = _sync_until(
        c, _have(("a", "start"), ("b", "start"), ("c", "pending_reason"), ("d", "pending_reason"))
    )
    by = {(e.name, e.event): e for e in events}
    assert len(by) == len(events), "an event was emitted twice"
    for p in bound:
        md, name = p["metadata"], f"{ns}/{p['metadata']['name']}"
        sched = next(x for x in p["status"]["conditions"] if x["type"] == "PodScheduled")
        assert by[(name, "submit")].ts == ts(md["creationTimestamp"])
        assert by[(name, "submit")].request_id == md["uid"]
        assert by[(name, "start")].assigned_nodes == (p["spec"]["nodeName"],)
        assert by[(name, "start")].ts == ts(sched["lastTransitionTime"])
        assert by[(name, "start")].gpus_per_node == 4
    for name, p in pending.items():
        sched = next(x for x in p["status"]["conditions"] if x["type"] == "PodScheduled")
        ev = by[(f"{ns}/{name}", "pending_reason")]
        assert ev.reason == f"Unschedulable: {sched['message']}"[:256]
        assert "Insufficient nvidia.com/gpu" in ev.reason  # the scheduler's own words
        assert (f"{ns}/{name}", "start") not in by

    # the starvation rule on what the collector and the node agents sent
    threshold = 2.0
    time.sleep(max(0.0, ts(pending["d"]["metadata"]["creationTimestamp"]) + threshold + 1.5 - time.time()))  # type: ignore[operator]
    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest(Raw(f"k8s/{i}", encode(m)) for i, m in enumerate([*samples, *events]))
        assert not rep.rejected, rep.rejected
        cfg = RulesConfig.model_validate(
            {"starvation": {"threshold_s": 600, "queue_threshold_s": {ns: threshold}}}
        )
        s = summary(store, cfg, snapshot_at - 60, time.time() + 1, cluster=CLUSTER)
    finally:
        store.close()
    incidents = {i.request_id: i for i in s.starvation_incidents}
    uid = {n: p["metadata"]["uid"] for n, p in pending.items()}
    assert set(incidents) == set(uid.values()), s.starvation_incidents
    assert incidents[uid["c"]].cause == "fragmentation"
    assert incidents[uid["d"]].cause == "capacity"
    assert incidents[uid["c"]].free_gpus_at_open == 8.0
    assert all(i.closed is None for i in incidents.values())


def test_lists_are_read_in_the_real_servers_pages(
    kube: KubeControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list is read in pages (``limit``, the API server's ``continue`` tokens, one snapshot):
    paged an object at a time, the same objects and resourceVersion as read in one answer."""
    from gpuslo.agent import k8s_watch

    ns = "team-pages"
    kube.ensure_namespace(ns)
    for i in range(5):  # no GPUs: no collector of the other tests follows them
        kube.create_pod(ns, f"pg-{i}", 0, {"gpuslo.test/none": "x"})
    try:
        api = KubeApi(kube.server, ADMIN_TOKEN, str(kube.ca_file))
        path = f"/api/v1/namespaces/{ns}/pods"
        whole, rv = api.list_objects(path)
        monkeypatch.setattr(k8s_watch, "LIST_PAGE", 1)
        paged, paged_rv = api.list_objects(path)
    finally:
        for i in range(5):
            kube.delete_pod(ns, f"pg-{i}")
    names = [o["metadata"]["name"] for o in paged]
    assert names == [o["metadata"]["name"] for o in whole] and sorted(names) == [f"pg-{i}" for i in range(5)]
    assert paged_rv and rv and int(paged_rv) >= int(rv)


def test_restart_resumes_and_compaction_gives_a_real_410(
    kube: KubeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ns, group = "team-restart", {"gpuslo.test/group": "restart"}
    kube.ensure_namespace(ns)
    kube.create_node("restart-0", 8, labels=group)
    state = tmp_path / "state.json"
    all_events: list[SchedulerEvent] = []

    c1 = _collector(kube, state)
    kube.create_pod(ns, "p1", 2, group)
    kube.create_pod(ns, "p2", 16, group)
    all_events += _sync_until(c1, _have(("p1", "start"), ("p2", "pending_reason")))
    c1.close()

    # while no collector runs: one new pod bound, one pending pod deleted, one finished
    kube.create_pod(ns, "p3", 1, group)
    kube.wait_pod(ns, "p3", scheduled=True)
    kube.delete_pod(ns, "p2")
    kube.finish_pod(ns, "p1")
    c2 = _collector(kube, state)
    assert c2.rv, "the state file holds the resourceVersion"
    all_events += _sync_until(c2, _have(("p3", "start"), ("p2", "cancel"), ("p1", "end")))
    assert c2.relists == 0, "resumed by watch from the saved resourceVersion, no relist"
    c2.close()

    # stopped again; more changes; then etcd compacts past the saved resourceVersion
    kube.create_pod(ns, "p4", 1, group)
    kube.wait_pod(ns, "p4", scheduled=True)
    kube.delete_pod(ns, "p3")
    saved_rv = int(_collector(kube, state).rv)
    compacted = kube.compact_etcd()
    assert compacted > saved_rv + 1
    c3 = _collector(kube, state)
    with caplog.at_level(logging.INFO, logger="gpuslo.agent.k8s_watch"):
        all_events += _sync_until(c3, _have(("p4", "start"), ("p3", "end")))
    assert c3.relists == 1
    assert "410 Gone" in caplog.text

    mine = [e for e in all_events if e.queue == ns]  # the collector sees every namespace
    seen = [(e.name.split("/")[-1], e.event) for e in mine if e.event != "pending_reason"]
    assert len(seen) == len(set(seen)), f"duplicates: {seen}"
    assert sorted(seen) == sorted([
        ("p1", "submit"), ("p1", "start"), ("p1", "end"), ("p2", "submit"), ("p2", "cancel"),
        ("p3", "submit"), ("p3", "start"), ("p3", "end"), ("p4", "submit"), ("p4", "start"),
    ])  # fmt: skip
    ended = next(e for e in all_events if e.name.endswith("/p1") and e.event == "end")
    assert ended.reason == "Succeeded"
    unobserved = next(e for e in all_events if e.name.endswith("/p3") and e.event == "end")
    assert unobserved.reason == "Deleted (unobserved)"  # found missing by the relist
    assert (unobserved.name, unobserved.queue, unobserved.gpus_per_node) == (f"{ns}/p3", ns, 1.0)


def _manifest(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text()) if d]


def test_shipped_manifests_and_rbac_on_a_real_api_server(kube: KubeControlPlane, tmp_path: Path) -> None:
    kube.ensure_namespace("gpuslo")
    docs = _manifest("agent-daemonset.yaml") + _manifest("collector.yaml")
    for d in docs:
        if d["kind"] == "Namespace":
            continue  # made above
        kube.apply(d)  # strict field validation: the API server accepts every object as written
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuslo-collector")
    sa = next(d for d in _manifest("collector.yaml") if d["kind"] == "ServiceAccount")["metadata"]

    kube.ensure_namespace("team-rbac")
    kube.create_pod("team-rbac", "r1", 1, {"gpuslo.test/group": "none"})
    token = kube.service_account_token(sa["namespace"], sa["name"])
    c = _collector(kube, tmp_path / "state.json", token=token)
    events = _sync_until(c, _have(("r1", "submit")))
    kube.create_pod("team-rbac", "r2", 1, {"gpuslo.test/group": "none"})
    events += _sync_until(c, _have(("r2", "submit")))  # the watch works too
    assert c.errors == 0

    # the same role without "watch", bound to another account: a clear refusal
    limited = {**role, "metadata": {"name": "gpuslo-collector-no-watch"},
               "rules": [{**r, "verbs": [v for v in r["verbs"] if v != "watch"]} for r in role["rules"]]}  # fmt: skip
    kube.apply(limited)
    kube.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "limited", "namespace": "gpuslo"}}
    )
    kube.apply({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "gpuslo-collector-no-watch"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "gpuslo-collector-no-watch"},
        "subjects": [{"kind": "ServiceAccount", "name": "limited", "namespace": "gpuslo"}],
    })  # fmt: skip
    c2 = _collector(kube, tmp_path / "state2.json", token=kube.service_account_token("gpuslo", "limited"))
    c2.sync_once()  # list is allowed
    with pytest.raises(Forbidden) as exc:
        c2.sync_once()  # watch is not
    msg = str(exc.value)
    assert msg.startswith("403 on /api/v1/pods?watch=1")
    assert 'system:serviceaccount:gpuslo:limited\\" cannot watch resource \\"pods\\"' in msg
    assert "needs get/list/watch on pods" in msg


def test_cli_collector_with_the_shipped_role(kube: KubeControlPlane, tmp_path: Path) -> None:
    """`gpuslo agent --source k8s-events` as an operator runs it outside the cluster: API URL,
    a service-account token of the shipped role, the CA; events as JSON lines."""
    import subprocess
    import sys

    from gpuslo.wire import decode

    kube.ensure_namespace("gpuslo")
    for d in _manifest("collector.yaml"):
        if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            try:
                kube.apply(d)
            except Exception as exc:  # made by the manifest test already
                if "409" not in str(exc):
                    raise
    (tmp_path / "token").write_text(kube.service_account_token("gpuslo", "gpuslo-collector"))
    kube.ensure_namespace("team-cli")
    kube.create_pod("team-cli", "cli-1", 3, {"gpuslo.test/group": "none"})
    kube.wait_pod("team-cli", "cli-1", scheduled=False)
    out = tmp_path / "events.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "gpuslo", "agent", "--source", "k8s-events", "--cluster", CLUSTER,
         "--k8s-api", kube.server, "--k8s-token-file", str(tmp_path / "token"), "--k8s-ca-file", str(kube.ca_file),
         "--state-file", str(tmp_path / "state.json"), "--interval-s", "1", "--ticks", "4", "--out", str(out),
         "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    events = [decode(line) for line in out.read_bytes().splitlines()]
    mine = {(e.name, e.event): e for e in events if isinstance(e, SchedulerEvent) and e.queue == "team-cli"}
    assert set(mine) == {("team-cli/cli-1", "submit"), ("team-cli/cli-1", "pending_reason")}
    assert mine[("team-cli/cli-1", "submit")].gpus_per_node == 3
    sched = next(
        c for c in kube.get_pod("team-cli", "cli-1")["status"]["conditions"] if c["type"] == "PodScheduled"
    )
    assert mine[("team-cli/cli-1", "pending_reason")].reason == f"Unschedulable: {sched['message']}"[:256]


def _agent_pools_k8s(
    kube: KubeControlPlane, tmp_path: Path, node: str, token: str, *extra: str
) -> tuple[set[str], str]:
    """`gpuslo agent --source dcgm` on Kubernetes for two ticks, told the API server and a token:
    the pools of its GPU batches, and its stderr."""
    import subprocess
    import sys

    from gpuslo.wire import decode
    from tests.test_scrape import DCGM_TEXT, Endpoint

    ep = Endpoint()
    ep.body = DCGM_TEXT
    (tmp_path / "token").write_text(token)
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.jsonl"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "gpuslo", "agent", "--source", "dcgm", "--dcgm-url", ep.url, "--node", node,
             "--k8s-api", kube.server, "--k8s-token-file", str(tmp_path / "token"), "--k8s-ca-file",
             str(kube.ca_file), "--interval-s", "1", "--ticks", "2", "--out", str(out), "--metrics-port", "0",
             *extra],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
    finally:
        ep.server.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    batches = [m for m in map(decode, out.read_bytes().splitlines()) if isinstance(m, GpuSampleBatch)]
    assert len(batches) == 2 and {b.node for b in batches} == {node}
    return {b.pool for b in batches}, r.stderr


def test_agent_fills_the_pool_from_the_node_label(kube: KubeControlPlane, tmp_path: Path) -> None:
    """A Node object labelled as each provider labels its node pools: the agent, with the token of
    the shipped agent role, stamps that pool on every GPU batch; the first default label wins
    over a later one; --pool-label chooses another; --pool wins; no label (or no right to read
    the Node) leaves the pool empty with one warning, and the agent keeps sampling."""
    kube.ensure_namespace("gpuslo")
    for d in _manifest("agent-daemonset.yaml"):
        if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            try:
                kube.apply(d)
            except Exception as exc:  # made by the manifest test already
                if "409" not in str(exc):
                    raise
    token = kube.service_account_token("gpuslo", "gpuslo-agent")
    cases = {
        "pool-gke": ({"cloud.google.com/gke-nodepool": "a100-pool"}, "a100-pool"),
        "pool-eks": ({"eks.amazonaws.com/nodegroup": "h100-ng"}, "h100-ng"),
        "pool-aks": ({"kubernetes.azure.com/agentpool": "gpunp"}, "gpunp"),
        "pool-aks-old": ({"agentpool": "legacynp"}, "legacynp"),
        "pool-karpenter": ({"karpenter.sh/nodepool": "gpu-spot"}, "gpu-spot"),
        "pool-two": ({"karpenter.sh/nodepool": "later", "eks.amazonaws.com/nodegroup": "first"}, "first"),
        "pool-none": ({"example.com/pool": "custom"}, ""),
    }
    for name, (labels, _) in cases.items():
        kube.create_node(name, 8, labels)
    for name, (_, want) in cases.items():
        pools, err = _agent_pools_k8s(kube, tmp_path, name, token)
        assert pools == {want}, name
        assert ("carries none of the pool labels" in err) == (want == ""), err
    pools, _ = _agent_pools_k8s(kube, tmp_path, "pool-none", token, "--pool-label", "example.com/pool")
    assert pools == {"custom"}
    # --pool wins: the API server would not be asked for the Node, so giving both is refused
    r = subprocess.run([sys.executable, "-m", "gpuslo", "agent", "--source", "dcgm", "--node", "pool-gke",
                        "--k8s-api", kube.server, "--pool", "explicit"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("gpuslo agent: --k8s-api ("), r.stderr
    assert "would be ignored with --pool" in r.stderr and "Traceback" not in r.stderr
    pools, _ = _agent_pools_k8s(kube, tmp_path, "pool-gke", token, "--pool", "")  # '': the Node's, as without
    assert pools == {"a100-pool"}
    # a token without the agent's role: 403, said once, the agent samples on with no pool
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "no-nodes", "namespace": "gpuslo"},
        }
    )
    pools, err = _agent_pools_k8s(
        kube, tmp_path, "pool-gke", kube.service_account_token("gpuslo", "no-nodes")
    )
    assert pools == {""}
    assert (
        err.count("cannot read Node pool-gke for its pool label: Forbidden: 403 on /api/v1/nodes/pool-gke")
        == 1
    )
    assert "the agent needs get on nodes" in err


def test_init_containers_and_sidecars_ask_what_the_scheduler_places(
    kube: KubeControlPlane, tmp_path: Path
) -> None:
    """Each pod shape of tests/pod_requests.py on two nodes of its own: one with as many GPUs as
    the table says the pod asks (the real scheduler binds it there) and one with one fewer (it
    stays Unschedulable for nvidia.com/gpu); the collector's request is that many GPUs. Init
    containers were left out: a pod waiting for 3 GPUs was said to ask 1."""
    ns = "team-init"
    kube.ensure_namespace(ns)
    c = _collector(kube, tmp_path / "state.json")
    made: dict[str, tuple[int, bool]] = {}
    for case, parts, want in SHAPES:
        for fits in (True, False):
            node = f"ic-{case}-{'fit' if fits else 'short'}"
            kube.create_node(node, want - (0 if fits else 1))
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": node, "namespace": ns},
                   "spec": {**pod_spec(parts), "nodeSelector": {"kubernetes.io/hostname": node}}}  # fmt: skip
            kube.api("POST", f"/api/v1/namespaces/{ns}/pods", pod)
            made[node] = (want, fits)
    for name, (_, fits) in made.items():
        p = kube.wait_pod(ns, name, scheduled=fits)
        if not fits:
            why = next(x for x in p["status"]["conditions"] if x["type"] == "PodScheduled")["message"]
            assert "Insufficient nvidia.com/gpu" in why, (name, why)
    events = _sync_until(c, _have(*((n, "start" if f else "pending_reason") for n, (_, f) in made.items())))
    asked = {
        e.name.split("/")[-1]: e.gpus_per_node for e in events if e.event == "submit" and e.account == ns
    }
    assert asked == {n: w for n, (w, _) in made.items()}

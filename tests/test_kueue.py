"""The Kueue collector against the real Kueue controller (v0.17.0, built from the Go module
proxy) on the real control plane, with kube-controller-manager's Job controller creating the
pods once Kueue unsuspends a Job and kube-scheduler binding them to simulated GPU nodes; the
test plays the kubelet (pod phase). Suspended Jobs are submitted beyond the ClusterQueue's GPU
quota; what gpuslo records must be what Kueue did, read back from the Workload objects. The
reason mapping and hostile objects without a server: tests/test_kueue_unit.py."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslo.agent.k8s_watch import KubeApi, ts
from gpuslo.agent.kueue import KueueWorkloadCollector, PendingGauge
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import summary
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch, SchedulerEvent, encode
from tests.servers.k8s import ApiError, KubeControlPlane
from tests.servers.kueue import KueueStack

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "kueue-test"
NS = "team-k"
KQ = "/apis/kueue.x-k8s.io/v1beta2"
QUOTA = 4  # the ClusterQueue's nominal nvidia.com/gpu quota
NODE_GPUS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KueueStack]:
    """Its own control plane (Kueue's webhooks must not meet the other tests' objects)."""
    from tests.servers import k8s, kueue

    try:
        bin_dir = k8s.provision()
        kueue_dir = kueue.provision()
    except RuntimeError as exc:
        if os.environ.get("GPUSLO_REQUIRE_K8S") == "1":
            raise
        pytest.skip(f"no Kubernetes control plane or Kueue here: {exc}")
    for attempt in range(3):
        kube = KubeControlPlane(tmp_path_factory.mktemp("kueue-kube"), bin_dir)
        s = KueueStack(kube, kueue_dir)
        try:
            kube.start()
            s.start()
            break
        except RuntimeError as exc:
            s.stop()
            kube.stop()
            if "address already in use" not in str(exc) or attempt == 2:
                raise
    try:
        yield s
    finally:
        s.stop()
        kube.stop()


# ---------------------------------------------------------------------------- API helpers
def _wait(what: str, get: Any, ok: Any, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = get()
        if ok(got):
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {got}")
        time.sleep(0.3)


def _conds(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _queue(kube: KubeControlPlane, cq: str, lq: str, quota: int) -> None:
    """A ClusterQueue with ``quota`` GPUs of the flavor ``gpu``, fed by LocalQueue ``lq`` in NS."""
    kube.api("POST", f"{KQ}/clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq},
        "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                 "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                     {"name": "gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": quota}]}]}]},
    })  # fmt: skip
    kube.api("POST", f"{KQ}/namespaces/{NS}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": lq, "namespace": NS},
        "spec": {"clusterQueue": cq}})  # fmt: skip
    _wait(f"ClusterQueue {cq} active", lambda: kube.api("GET", f"{KQ}/clusterqueues/{cq}"),
          lambda got: _conds(got).get("Active", {}).get("status") == "True")  # fmt: skip


@pytest.fixture(scope="module")
def queues(stack: KueueStack) -> KueueStack:
    """Two GPU nodes, the flavor, the priority class and the ClusterQueue/LocalQueue pair."""
    kube = stack.kube
    for n in ("gpu-0", "gpu-1"):
        kube.create_node(n, NODE_GPUS)
    kube.ensure_namespace(NS)
    kube.api("POST", f"{KQ}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                               "metadata": {"name": "gpu"}, "spec": {}})  # fmt: skip
    kube.api("POST", f"{KQ}/workloadpriorityclasses", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass", "metadata": {"name": "high"},
        "value": 1000})  # fmt: skip
    _queue(kube, "cq-gpu", "lq", QUOTA)
    return stack


def _job(
    kube: KubeControlPlane, name: str, gpus: int, pods: int = 1, priority: str = "", lq: str = "lq"
) -> str:
    labels = {"kueue.x-k8s.io/queue-name": lq}
    if priority:
        labels["kueue.x-k8s.io/priority-class"] = priority
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"suspend": True, "parallelism": pods, "completions": pods, "template": {"spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "registry.invalid/train:1",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}},
    }  # fmt: skip
    return str(kube.api("POST", f"/apis/batch/v1/namespaces/{NS}/jobs", job)["metadata"]["uid"])


def _workload(kube: KubeControlPlane, job_uid: str) -> dict[str, Any]:
    """The Workload Kueue made for a Job (owned by it)."""

    def get() -> list[dict[str, Any]]:
        items = kube.api("GET", f"{KQ}/namespaces/{NS}/workloads")["items"]
        return [
            w for w in items if any(o["uid"] == job_uid for o in w["metadata"].get("ownerReferences") or [])
        ]

    got: list[dict[str, Any]] = _wait(f"Workload of Job {job_uid}", get, lambda ws: len(ws) == 1)
    return got[0]


def _wl_until(kube: KubeControlPlane, wl: dict[str, Any], ok: Any, what: str) -> dict[str, Any]:
    path = f"{KQ}/namespaces/{NS}/workloads/{wl['metadata']['name']}"
    got: dict[str, Any] = _wait(f"{wl['metadata']['name']} {what}", lambda: kube.api("GET", path), ok)
    return got


def _is(kind: str, status: str = "True") -> Any:
    return lambda w: _conds(w).get(kind, {}).get("status") == status


def _job_pods(kube: KubeControlPlane, job: str) -> list[dict[str, Any]]:
    pods = kube.api("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=job-name%3D{job}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


class Recorder:
    """Runs the collector's list/watch rounds in the test thread, keeping every event."""

    def __init__(self, col: KueueWorkloadCollector) -> None:
        self.col = col
        self.events: list[SchedulerEvent] = []

    def until(self, ok: Any, timeout_s: float = 120.0) -> list[SchedulerEvent]:
        deadline = time.monotonic() + timeout_s
        while True:
            self.col.sync_once()
            self.events += [m for m in self.col.collect(time.time()) if isinstance(m, SchedulerEvent)]
            if ok(self.events):
                return self.events
            if time.monotonic() > deadline:
                raise TimeoutError([(e.request_id, e.name, e.event) for e in self.events])

    def of(self, request_id: str) -> dict[str, SchedulerEvent]:
        evs = [e for e in self.events if e.request_id == request_id and e.event != "pending_reason"]
        by: dict[str, SchedulerEvent] = {e.event: e for e in evs}
        assert len(by) == len(evs), f"an event sent twice: {evs}"
        return by

    def reasons(self, request_id: str) -> list[SchedulerEvent]:
        return [e for e in self.events if e.request_id == request_id and e.event == "pending_reason"]


def _has(*wanted: tuple[str, str]) -> Any:
    return lambda evs: set(wanted) <= {(e.request_id, e.event) for e in evs}


def _collector_token(kube: KubeControlPlane, *manifests: str) -> str:
    """The collector's ServiceAccount with exactly the shipped RBAC of ``manifests`` (the Kueue
    role alone: the Workload collector needs no pod access)."""
    kube.ensure_namespace("gpuslo")
    docs = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "gpuslo-collector", "namespace": "gpuslo"},
        }
    ]
    for m in manifests or ("collector-kueue.yaml",):
        docs += [d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / m).read_text()) if d]
    for doc in docs:
        if doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            try:
                kube.apply(doc)
            except ApiError as exc:
                if exc.code != 409:  # made by an earlier test
                    raise
    return kube.service_account_token("gpuslo", "gpuslo-collector")


def _node_batches(kube: KubeControlPlane, at: float) -> list[GpuSampleBatch]:
    """What the node agents would send: GPUs given out in order to the pods bound on each node."""
    pods = kube.api("GET", f"/api/v1/namespaces/{NS}/pods")["items"]
    out = []
    for seq, node in enumerate(("gpu-0", "gpu-1")):
        holders: list[Allocation | None] = []
        for p in pods:
            if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp"):
                n = int(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
                holders += [Allocation(scheduler="k8s", id=p["metadata"]["uid"], account=NS, queue=NS)] * n
        holders += [None] * (NODE_GPUS - len(holders))
        gpus = tuple(GpuSample(index=i, uuid=f"GPU-{node}-{i}", allocations=(h,) if h else ())
                     for i, h in enumerate(holders))  # fmt: skip
        out.append(GpuSampleBatch(source=node, boot_id="b", seq=seq, cluster=CLUSTER, ts=at, node=node,
                                  interval_s=600.0, gpus=gpus))  # fmt: skip
    return out


# ---------------------------------------------------------------------------- the test
def test_waits_reasons_admissions_and_evictions_are_what_kueue_did(
    queues: KueueStack, tmp_path: Path
) -> None:
    kube = queues.kube
    api = KubeApi(kube.server, _collector_token(kube), str(kube.ca_file))
    rec = Recorder(KueueWorkloadCollector(CLUSTER, api, tmp_path / "kueue.json", boot_id=uuid.uuid4().hex[:8],
                                          watch_timeout_s=2))  # fmt: skip

    # a (2 GPUs) and b (2 pods x 1 GPU) fill the quota of 4; c (2) waits for quota; d (5) can never fit
    wl = {"a": _workload(kube, _job(kube, "a", 2)), "b": _workload(kube, _job(kube, "b", 1, pods=2))}
    for k in ("a", "b"):
        wl[k] = _wl_until(kube, wl[k], _is("Admitted"), "admitted")
    for name, count in (("a", 1), ("b", 2)):  # the Job controller made the pods, the scheduler bound them
        _wait(f"{name}'s pods bound", lambda name=name: _job_pods(kube, name),
              lambda ps, count=count: len(ps) == count and all(p["spec"].get("nodeName") for p in ps))  # fmt: skip
    snapshot_at = time.time()  # what the node agents see before c and d are submitted
    samples = _node_batches(kube, snapshot_at)
    wl["c"] = _workload(kube, _job(kube, "c", 2))
    wl["d"] = _workload(kube, _job(kube, "d", 5))
    for k in ("c", "d"):
        wl[k] = _wl_until(kube, wl[k], _is("QuotaReserved", "False"), "pending")
    uid = {k: w["metadata"]["uid"] for k, w in wl.items()}
    assert all(job["spec"]["suspend"] for job in kube.api("GET", f"/apis/batch/v1/namespaces/{NS}/jobs")["items"]
               if job["metadata"]["name"] in ("c", "d")), "Kueue keeps the waiting Jobs suspended"  # fmt: skip
    rec.until(_has((uid["a"], "start"), (uid["b"], "start"), (uid["c"], "pending_reason"),
                   (uid["d"], "pending_reason")))  # fmt: skip

    # what Kueue said, read from the API, and gpuslo's words for it
    c_msg, d_msg = (_conds(wl[k])["QuotaReserved"] for k in ("c", "d"))
    assert "insufficient unused quota for nvidia.com/gpu in flavor gpu, 2 more needed" in c_msg["message"]
    assert f"> maximum capacity ({QUOTA})" in d_msg["message"]
    (c_why,) = rec.reasons(uid["c"])
    (d_why,) = rec.reasons(uid["d"])
    assert (c_why.reason, c_why.cause) == (f"WaitingForQuota: Pending: {c_msg['message']}"[:256], "policy")
    assert (d_why.reason, d_why.cause) == (f"ExceedsMaxQuota: Pending: {d_msg['message']}"[:256], "capacity")
    assert c_why.ts == ts(c_msg["lastTransitionTime"])
    gauge = {(s.name, s.labels["local_queue"], s.labels["cluster_queue"]): s.value
             for f in PendingGauge(rec.col).collect() for s in f.samples if s.labels}  # fmt: skip
    assert gauge[("gpuslo_kueue_pending_workloads", f"{NS}/lq", "cq-gpu")] == 2  # c and d, as the API says

    # c must have waited past the 1 s threshold before a's end frees its quota (times are seconds)
    time.sleep(max(0.0, ts(wl["c"]["metadata"]["creationTimestamp"]) + 2.5 - time.time()))  # type: ignore[operator]
    (a_pod,) = _wait(
        "a's pod bound", lambda: _job_pods(kube, "a"), lambda ps: ps and ps[0]["spec"].get("nodeName")
    )
    kube.finish_pod(NS, a_pod["metadata"]["name"])  # the kubelet: the container exited 0
    wl["a"] = _wl_until(kube, wl["a"], _is("Finished"), "finished")
    wl["c"] = _wl_until(kube, wl["c"], _is("Admitted"), "admitted once a's quota is back")

    # e (high priority, 2 GPUs) makes Kueue evict a lower-priority Workload to take its quota
    wl["e"] = _workload(kube, _job(kube, "e", 2, priority="high"))
    uid["e"] = wl["e"]["metadata"]["uid"]
    evicted = _wait("an eviction", lambda: [k for k in ("b", "c") if _is("Evicted")(
        kube.api("GET", f"{KQ}/namespaces/{NS}/workloads/{wl[k]['metadata']['name']}"))], bool)  # fmt: skip
    victim = evicted[0]
    wl[victim] = _wl_until(kube, wl[victim], _is("Evicted"), "evicted")
    for p in _job_pods(kube, victim):  # the kubelet confirms the pods' end (when the Job controller left any)
        try:
            kube.api("DELETE", f"/api/v1/namespaces/{NS}/pods/{p['metadata']['name']}?gracePeriodSeconds=0")
        except ApiError as exc:
            if exc.code != 404:
                raise
    wl["e"] = _wl_until(kube, wl["e"], _is("Admitted"), "admitted")
    wl[victim] = _wl_until(kube, wl[victim], _is("QuotaReserved", "False"), "back in the queue")
    # d is given up: deleting its Job deletes its Workload (the garbage collector, as in a cluster)
    kube.api("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/d?propagationPolicy=Background")
    again = f"{uid[victim]}#2"
    rec.until(_has((uid["a"], "end"), (uid["c"], "start"), (uid["e"], "start"), (uid[victim], "preempt"),
                   (again, "pending_reason"), (uid["d"], "cancel")))  # fmt: skip

    # every event is what the Workload objects say Kueue did
    for k, w in wl.items():
        by, c, md = rec.of(uid[k]), _conds(w), w["metadata"]
        assert by["submit"].ts == ts(md["creationTimestamp"]), k
        assert (by["submit"].queue, by["submit"].cluster_queue, by["submit"].account) == (
            f"{NS}/lq",
            "cq-gpu",
            NS,
        )
        assert by["submit"].name == f"{NS}/{md['name']}"
        if k != "d":
            assert "start" in by, k
        if k not in (victim, "d"):
            assert by["start"].ts == ts(c["Admitted"]["lastTransitionTime"]), k
    assert (rec.of(uid["b"])["submit"].gpus_per_node, rec.of(uid["b"])["submit"].nodes) == (1.0, 2)
    assert (rec.of(uid["d"])["submit"].gpus_per_node, rec.of(uid["d"])["submit"].nodes) == (5.0, 1)
    fin = _conds(wl["a"])["Finished"]
    assert rec.of(uid["a"])["end"].ts == ts(fin["lastTransitionTime"])
    assert rec.of(uid["a"])["end"].reason == f"{fin['reason']}: {fin['message']}"[:256]
    assert fin["reason"] == "Succeeded"
    ev = _conds(wl[victim])["Evicted"]
    pre = rec.of(uid[victim])["preempt"]
    assert (pre.ts, pre.reason) == (
        ts(ev["lastTransitionTime"]),
        f"Evicted: {ev['reason']}: {ev['message']}"[:256],
    )
    assert ev["reason"] == "Preempted"
    assert rec.of(again)["submit"].ts == pre.ts, "the wait after the eviction starts at it"
    requeued, *_, again_why = rec.reasons(again)
    assert (requeued.reason, requeued.cause) == (f"Evicted: Pending: {ev['message']}"[:256], "policy")
    assert again_why.cause == "policy" and again_why.reason.startswith("WaitingForQuota: Pending: ")
    assert rec.of(uid["d"])["cancel"].reason == "Deleted"
    assert not rec.col.skipped

    # the starvation rule on what the collector and the node agents sent
    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        msgs: list[Any] = [*samples, *rec.events]
        rep = Ingestor(store).ingest(Raw(f"kq/{i}", encode(m)) for i, m in enumerate(msgs))
        assert not rep.rejected, rep.rejected
        cfg = RulesConfig.model_validate(
            {"starvation": {"threshold_s": 600, "queue_threshold_s": {f"{NS}/lq": 1}}}
        )
        to = time.time() + 1
        s = summary(store, cfg, snapshot_at - 120, to, cluster=CLUSTER)
    finally:
        store.close()
    incidents = {i.request_id: i for i in s.starvation_incidents if i.scheduler == "kueue"}
    # on paper, from the API's times: a wait is an incident when it lasted past submit + 1 s
    waits: dict[str, tuple[float, float]] = {}
    for k in wl:
        by = rec.of(uid[k])
        left = by.get("start") or by.get("cancel")
        waits[uid[k]] = (by["submit"].ts, left.ts if left else to)
    again_by = rec.of(again)
    waits[again] = (again_by["submit"].ts, again_by["start"].ts if "start" in again_by else to)
    assert set(incidents) == {r for r, (sub, left) in waits.items() if left > sub + 1}
    assert incidents[uid["c"]].cause == "policy"  # the quota held it while devices were free
    assert incidents[uid["c"]].reason == c_why.reason
    assert incidents[uid["d"]].cause == "capacity"  # more than the ClusterQueue may ever hold
    assert incidents[uid["d"]].free_gpus_at_open >= 5, "devices were free: only Kueue's quota says capacity"


def test_cli_collector_with_kueue_and_its_gauge(queues: KueueStack, tmp_path: Path) -> None:
    """`gpuslo agent --source k8s-events --kueue` with the shipped roles: Workloads as events,
    Kueue's pods counted once (through their Workload), the pending-age gauge on /metrics."""
    import subprocess
    import sys
    import urllib.request

    from gpuslo.wire import decode
    from tests.servers.ports import free_port

    kube = queues.kube
    _queue(kube, "cq-cli", "lq-cli", 1)
    g = _workload(kube, _job(kube, "g", 1, lq="lq-cli"))
    g = _wl_until(kube, g, _is("Admitted"), "admitted")
    _wait("g's pod bound", lambda: _job_pods(kube, "g"), lambda ps: ps and ps[0]["spec"].get("nodeName"))
    h = _workload(kube, _job(kube, "h", 1, lq="lq-cli"))
    h = _wl_until(kube, h, _is("QuotaReserved", "False"), "pending")
    (tmp_path / "token").write_text(_collector_token(kube, "collector.yaml", "collector-kueue.yaml"))
    port, out = free_port(), tmp_path / "events.jsonl"
    p = subprocess.Popen(
        [sys.executable, "-m", "gpuslo", "agent", "--source", "k8s-events", "--kueue", "--cluster", CLUSTER,
         "--k8s-api", kube.server, "--k8s-token-file", str(tmp_path / "token"), "--k8s-ca-file", str(kube.ca_file),
         "--state-file", str(tmp_path / "state.json"), "--interval-s", "1", "--ticks", "600", "--out", str(out),
         "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    want = f'gpuslo_kueue_pending_workloads{{cluster_queue="cq-cli",local_queue="{NS}/lq-cli"}} 1.0'

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    try:
        text = _wait("the pending gauge", scrape, lambda t: want in t, timeout_s=120)
        _wait("h's events written", lambda: out.read_bytes() if out.exists() else b"",
              lambda b: h["metadata"]["uid"].encode() in b and b.count(b"pending_reason") >= 1)  # fmt: skip
    finally:
        p.terminate()
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    assert 'gpuslo_kueue_pending_age_seconds{cluster_queue="cq-cli"' in text
    events = [
        e for e in (decode(line) for line in out.read_bytes().splitlines()) if isinstance(e, SchedulerEvent)
    ]
    kueue = {(e.request_id, e.event) for e in events if e.scheduler == "kueue"}
    assert {(g["metadata"]["uid"], "submit"), (g["metadata"]["uid"], "start"), (h["metadata"]["uid"], "submit"),
            (h["metadata"]["uid"], "pending_reason")} <= kueue  # fmt: skip
    labelled = [p for p in kube.api("GET", f"/api/v1/namespaces/{NS}/pods")["items"]
                if "kueue.x-k8s.io/podset" in (p["metadata"].get("labels") or {})]  # fmt: skip
    assert labelled, "Kueue labels the pods of the Jobs it admits"
    pod_ids = {e.request_id for e in events if e.scheduler == "k8s"}
    assert not pod_ids & {p["metadata"]["uid"] for p in labelled}, "a Kueue pod counted twice"


def test_v1beta1_through_the_conversion_webhook_reads_the_same(queues: KueueStack, tmp_path: Path) -> None:
    """Older Kueue serves v1beta1 only; on v0.17.0 v1beta1 is converted by Kueue's webhook. Both
    views of the same Workloads give the same events."""
    kube = queues.kube
    _workload(kube, _job(kube, "v", 3))  # at least one Workload, whatever ran before
    token = _collector_token(kube)

    def events(version: str, d: Path) -> list[tuple[Any, ...]]:
        col = KueueWorkloadCollector(CLUSTER, KubeApi(kube.server, token, str(kube.ca_file)), d / "s.json",
                                     watch_timeout_s=1)  # fmt: skip
        col.version = version
        col.sync_once()  # a list
        out = [(e.request_id, e.event, e.ts, e.reason, e.cause, e.queue, e.cluster_queue, e.gpus_per_node, e.nodes)
               for e in col.collect(0) if isinstance(e, SchedulerEvent)]  # fmt: skip
        assert out and not col.skipped
        return sorted(out, key=repr)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert events("kueue.x-k8s.io/v1beta1", tmp_path / "a") == events(
        "kueue.x-k8s.io/v1beta2", tmp_path / "b"
    )


def test_without_the_kueue_role_the_refusal_names_what_is_missing(queues: KueueStack, tmp_path: Path) -> None:
    from gpuslo.agent.k8s_watch import Forbidden

    kube = queues.kube
    kube.ensure_namespace("gpuslo")
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "no-kueue", "namespace": "gpuslo"},
        }
    )
    api = KubeApi(kube.server, kube.service_account_token("gpuslo", "no-kueue"), str(kube.ca_file))
    col = KueueWorkloadCollector(CLUSTER, api, tmp_path / "s.json")
    with pytest.raises(Forbidden, match="needs get/list/watch on Kueue workloads and localqueues"):
        col.sync_once()


def test_reclaim_suspend_deactivates_the_workload_with_the_shipped_rbac(queues: KueueStack) -> None:
    """The idle-reclaim action ``kubernetes: suspend`` (rules/actions.py) as the rules engine's
    ServiceAccount with deploy/kubernetes/reclaim-rbac.yaml bound in the namespace: the pod's
    Workload is found through the pod's Job and set inactive; Kueue evicts it and suspends the Job."""
    from gpuslo.rules.actions import KubeActor, KubeCredentials, http_request
    from gpuslo.rules.reclaim import IdleHolder

    kube = queues.kube
    _queue(kube, "cq-reclaim", "lq-reclaim", 2)
    job_uid = _job(kube, "idle-r", 1, lq="lq-reclaim")
    wl = _wl_until(kube, _workload(kube, job_uid), _is("Admitted"), "admitted")
    (pod,) = _wait("idle-r's pod bound", lambda: _job_pods(kube, "idle-r"),
                   lambda ps: len(ps) == 1 and ps[0]["spec"].get("nodeName"))  # fmt: skip
    kube.ensure_namespace("gpuslo")
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "gpuslo-rules", "namespace": "gpuslo"},
        }
    )
    for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/reclaim-rbac.yaml").read_text()):
        if d["kind"] == "RoleBinding":
            d["metadata"]["namespace"] = NS  # one RoleBinding per namespace on allow_queues
        kube.apply(d)
    token = kube.service_account_token("gpuslo", "gpuslo-rules")
    actor = KubeActor(http_request(KubeCredentials(kube.server, token, str(kube.ca_file)), 10.0))
    md = pod["metadata"]
    h = IdleHolder(CLUSTER, "k8s", md["uid"], f"{NS}/{md['name']}", "", NS, NS, 1.0, 0.0, 1e4, 0.0, 60.0)
    out = actor.act("suspend", h)
    assert out.ok and out.reason == f"deactivated Kueue workload {NS}/{wl['metadata']['name']}", out
    wl = _wl_until(
        kube, wl, lambda w: w["spec"].get("active") is False and _is("Evicted")(w), "deactivated, evicted"
    )
    job = _wait("idle-r suspended", lambda: kube.api("GET", f"/apis/batch/v1/namespaces/{NS}/jobs/idle-r"),
                lambda j: j["spec"].get("suspend") is True)  # fmt: skip
    assert job["metadata"]["uid"] == job_uid
    assert "Deactivat" in _conds(wl)["Evicted"]["reason"], _conds(wl)["Evicted"]


def test_closing_the_collector_ends_its_workload_watch_at_once(queues: KueueStack, tmp_path: Path) -> None:
    """A 300 s watch of Workloads on the real API server: close() ends it, so the thread stops now,
    not at the watch's timeout (an agent stopping would otherwise wait up to 5 minutes)."""
    from tests.servers.k8s import ADMIN_TOKEN

    kube = queues.kube
    col = KueueWorkloadCollector(
        CLUSTER, KubeApi(kube.server, ADMIN_TOKEN, str(kube.ca_file)), tmp_path / "s.json"
    )
    col.start()
    deadline = time.monotonic() + 30
    while not (col.rv and col._response is not None):
        assert time.monotonic() < deadline, "the watch did not open"
        time.sleep(0.05)
    col.close()
    assert col._thread is not None
    col._thread.join(10)
    assert not col._thread.is_alive()

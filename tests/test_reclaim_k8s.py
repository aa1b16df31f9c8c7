"""The idle-reclaim action on a real kube-apiserver with the shipped RBAC: the rules engine's
ServiceAccount without deploy/kubernetes/reclaim-rbac.yaml is refused (403, recorded as a
failure, the pod untouched); with it, the idle pod is deleted, once. The pod runs nowhere (no
kubelet): its GPU is simulated, idle, and its samples are what the node agent sends for it (the
agent's own PodResources attribution over a kubelet's listing: the pod named namespace/name);
its UID comes from the real k8s-events collector's events, as in production."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslo.agent.k8s import PodResourcesAttribution
from gpuslo.agent.k8s_watch import K8sPodCollector, KubeApi
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.actions import KubeActor, KubeCredentials, http_request
from gpuslo.rules.config import RulesConfig, parse
from gpuslo.rules.reclaim_round import reclaim_round
from gpuslo.wire import GpuSample, GpuSampleBatch, SchedulerEvent
from tests.reclaim_fleet import IDLE
from tests.servers.k8s import ADMIN_TOKEN, ApiError, KubeControlPlane
from tests.test_k8s_podresources import encode as podresources

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
NS = "team-a"  # the namespace the shipped RoleBinding names


def _samples(pod: dict[str, Any], start: float, end: float) -> list[GpuSampleBatch]:
    md = pod["metadata"]
    node = pod["spec"]["nodeName"]
    uuid = f"GPU-{node}-0"
    listing = podresources([(md["namespace"], md["name"], [("main", [("nvidia.com/gpu", [uuid])])])])
    attr = PodResourcesAttribution("kubelet.sock", list_call=lambda sock, timeout_s: listing)
    attr.refresh()
    allocs = attr(0, uuid)
    assert [a.id for a in allocs] == [f"{md['namespace']}/{md['name']}"]  # the node agent's id for a pod
    out = []
    for k in range(int((end - start) // 10)):
        g = GpuSample(index=0, uuid=uuid, fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": IDLE}, allocations=allocs)
        out.append(GpuSampleBatch(source=node, boot_id="b", seq=int(start) + k, cluster="kube", ts=start + 10 * k, node=node,
                                  pool="", interval_s=10.0, gpus=(g,)))  # fmt: skip
    return out


def _events(kube: KubeControlPlane, state: Path, name: str) -> list[SchedulerEvent]:
    """The k8s-events collector's events up to the pod's start (its UID, its namespace/name)."""
    c = K8sPodCollector(
        "kube", KubeApi(kube.server, ADMIN_TOKEN, str(kube.ca_file)), state, watch_timeout_s=2
    )
    events: list[SchedulerEvent] = []
    deadline = time.monotonic() + 60
    while not any(e.name == name and e.event == "start" for e in events):
        assert time.monotonic() < deadline, [(e.name, e.event) for e in events]
        c.sync_once()
        events += [m for m in c.collect(time.time()) if isinstance(m, SchedulerEvent)]
    return events


def _cfg() -> RulesConfig:
    return parse({"reclaim": {"enabled": True, "idle_after_s": 60, "action": {
        "mode": "on", "grace_s": 60, "allow_queues": [NS], "kubernetes": "delete"}}})  # fmt: skip


def _log(store: ChdbStore) -> list[tuple[str, str]]:
    rows = store.query("SELECT outcome, reason FROM reclaim_actions WHERE outcome != 'noticed' "
                       "ORDER BY at, outcome = 'started' DESC")  # fmt: skip
    return [(r["outcome"], r["reason"]) for r in rows]


def test_delete_is_refused_without_the_action_rbac_and_done_with_it(
    kube: KubeControlPlane, store: ChdbStore, tmp_path: Path
) -> None:
    kube.ensure_namespace("gpuslo")
    kube.ensure_namespace(NS)
    kube.create_node("reclaim-n1", 8, {"gpuslo.test/group": "reclaim"})
    kube.create_pod(NS, "idle-p", 1, {"gpuslo.test/group": "reclaim"})
    pod = kube.wait_pod(NS, "idle-p", scheduled=True)
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "gpuslo-rules", "namespace": "gpuslo"},
        }
    )
    token = kube.service_account_token("gpuslo", "gpuslo-rules")
    actors = {"k8s": KubeActor(http_request(KubeCredentials(kube.server, token, str(kube.ca_file)), 10.0))}
    events = _events(kube, tmp_path / "k8s-collector.json", f"{NS}/idle-p")
    (start,) = [e.ts for e in events if e.name == f"{NS}/idle-p" and e.event == "start"]
    # idle from its start; the rules evaluated as if 240 s later (the samples run up to then)
    t0 = start + 240
    write(store, [*events, *_samples(pod, start, t0)])  # type: ignore[list-item]

    # the ServiceAccount alone (the action-less install): refused, recorded, nothing raised
    reclaim_round(store, _cfg(), actors, t0 - 60)  # the notice goes: the grace period (60 s) counts from it
    reclaim_round(store, _cfg(), actors, t0)
    (started, failed) = _log(store)
    assert started[0] == "started" and failed[0] == "failed"
    assert "HTTP 403" in failed[1] and 'cannot delete resource \\"pods\\"' in failed[1]
    assert "reclaim-rbac.yaml" in failed[1]
    assert kube.get_pod(NS, "idle-p")["metadata"]["uid"] == pod["metadata"]["uid"]

    # the shipped action RBAC: deleted (the API server accepts it; with no kubelet the pod may
    # linger with a deletionTimestamp, or go at once with its zero grace period), the pod's UID
    # the precondition (was: its samples' id, namespace/name: a 409 recorded as done, the pod kept)
    for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/reclaim-rbac.yaml").read_text()):
        kube.apply(d)
    write(store, _samples(pod, t0, t0 + 10))  # type: ignore[arg-type]
    reclaim_round(store, _cfg(), actors, t0 + 10)
    assert [o for o, _ in _log(store)] == ["started", "failed", "started", "done"]
    assert _log(store)[-1][1] == f"deleted pod {NS}/idle-p"
    try:
        assert kube.get_pod(NS, "idle-p")["metadata"].get("deletionTimestamp")
    except ApiError as exc:
        assert exc.code == 404
    # once: a restarted engine, the samples still saying idle, deletes nothing more
    write(store, _samples(pod, t0 + 10, t0 + 20))  # type: ignore[arg-type]
    assert reclaim_round(store, _cfg(), actors, t0 + 20)[0]  # still noticed (the agent lags)
    assert len(_log(store)) == 4

    # the RoleBinding is per namespace: the same role refuses another namespace (the API server
    # enforces the allow-list as well)
    kube.ensure_namespace("team-b")
    kube.create_pod("team-b", "other-p", 1, {"gpuslo.test/group": "reclaim"})
    other = kube.wait_pod("team-b", "other-p", scheduled=True)
    h = _holder_of(other)
    out = actors["k8s"].act("delete", h)
    assert not out.ok and "HTTP 403" in out.reason
    # a pod of the same name but another UID is never deleted in its place
    kube.create_pod(NS, "idle-p2", 1, {"gpuslo.test/group": "reclaim"})
    p2 = kube.wait_pod(NS, "idle-p2", scheduled=True)
    stale = _holder_of({**p2, "metadata": {**p2["metadata"], "uid": "00000000-0000-0000-0000-000000000000"}})
    out = actors["k8s"].act("delete", stale)
    assert out.ok and "now is another one" in out.reason
    assert kube.get_pod(NS, "idle-p2")["metadata"]["uid"] == p2["metadata"]["uid"]


def _holder_of(pod: dict[str, Any]) -> Any:
    from gpuslo.rules.reclaim import IdleHolder

    md = pod["metadata"]
    name = f"{md['namespace']}/{md['name']}"
    return IdleHolder(
        "kube",
        "k8s",
        name,
        name,
        "",
        md["namespace"],
        md["namespace"],
        1.0,
        0.0,
        1e4,
        0.0,
        60.0,
        uid=md["uid"],
    )

"""The cluster-level Kubernetes collector against a fake API server that speaks the real
list/watch protocol: a PodList with a resourceVersion, then newline-delimited watch events,
and 410 Gone (as an ERROR event in the stream, the way the API server reports an expired
resourceVersion after etcd compaction)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from gpuslo.agent.k8s_watch import Forbidden, K8sPodCollector, KubeApi
from gpuslo.wire import SchedulerEvent, decode, encode


def pod(uid: str, name: str, gpus: int = 1, node: str = "", unsched: str = "", phase: str = "Pending",
        created: str = "2026-11-28T10:00:00Z") -> dict[str, Any]:  # fmt: skip
    conds = []
    if unsched:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unsched,
                      "lastTransitionTime": "2026-11-28T10:00:05Z"})  # fmt: skip
    if node:
        conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-28T10:01:00Z"})
    res = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return {
        "metadata": {"uid": uid, "name": name, "namespace": "team-a", "creationTimestamp": created},
        "spec": {"nodeName": node, "containers": [{"name": "main", "resources": res}]} if node else
                {"containers": [{"name": "main", "resources": res}]},
        "status": {"phase": phase, "conditions": conds},
    }  # fmt: skip


class FakeApiServer:
    def __init__(self) -> None:
        self.rv = 100
        self.pods: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, pod)
        self.compacted = 0  # watches from an older rv get 410
        self.forbid = False
        self.cond = threading.Condition()
        srv = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if srv.forbid:
                    body = json.dumps(
                        {"kind": "Status", "code": 403, "message": 'pods is forbidden: User "x" cannot list'}
                    )
                    self.send_response(403)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body.encode())
                    return
                q = parse_qs(urlparse(self.path).query)
                if "watch" not in q:
                    with srv.cond:
                        body = json.dumps({"kind": "PodList", "metadata": {"resourceVersion": str(srv.rv)},
                                           "items": [srv._stamp(p, r) for r, p in srv.pods.values()]})  # fmt: skip
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body.encode())
                    return
                since = int(q["resourceVersion"][0])
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(obj: dict[str, Any]) -> None:
                    data = (json.dumps(obj) + "\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                if since < srv.compacted:
                    chunk({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                       "message": f"too old resource version: {since} ({srv.compacted})"}})  # fmt: skip
                else:
                    deadline = time.monotonic() + 1.5
                    while time.monotonic() < deadline:
                        with srv.cond:
                            new = [(r, t, p) for r, t, p in srv.log if r > since]
                            if not new:
                                srv.cond.wait(0.1)
                                continue
                        for r, t, p in new:
                            chunk({"type": t, "object": srv._stamp(p, r)})
                            since = r
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def _stamp(p: dict[str, Any], rv: int) -> dict[str, Any]:
        out = json.loads(json.dumps(p))
        out["metadata"]["resourceVersion"] = str(rv)
        return out

    def put(self, p: dict[str, Any], kind: str = "ADDED") -> None:
        with self.cond:
            self.rv += 1
            uid = p["metadata"]["uid"]
            if kind == "DELETED":
                self.pods.pop(uid, None)
                p = {**p, "metadata": {**p["metadata"], "deletionTimestamp": "2026-11-28T11:00:00Z"}}
            else:
                self.pods[uid] = (self.rv, p)  # type: ignore[assignment]
            self.log.append((self.rv, kind, p))
            self.cond.notify_all()

    def compact(self) -> None:
        with self.cond:
            self.compacted = self.rv + 1
            self.log.clear()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    s = FakeApiServer()
    yield s
    s.server.shutdown()


def events(col: K8sPodCollector) -> list[tuple[str, str, str]]:
    out = []
    for m in col.collect(0):
        assert isinstance(m, SchedulerEvent) and decode(encode(m)) == m
        out.append((m.name.split("/")[1], m.event, m.reason))
    return out


MSG = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are available"


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_list_watch_restart_and_410(api: FakeApiServer, tmp_path: Path) -> None:
    api.put(pod("u1", "running", gpus=2, node="gpu-1"))
    api.put(pod("u2", "waiting", gpus=8, unsched=MSG))
    api.put(pod("u3", "cpu-only", gpus=0, node="cpu-1"))
    state = tmp_path / "k8s.json"
    col = K8sPodCollector("prod", KubeApi(api.url), state, watch_timeout_s=1)
    col.sync_once()  # list
    first = events(col)
    assert sorted(first) == sorted([("running", "submit", ""), ("running", "start", ""), ("waiting", "submit", ""),
                                    ("waiting", "pending_reason", f"Unschedulable: {MSG}")])  # fmt: skip
    api.put(pod("u2", "waiting", gpus=8, node="gpu-2"), "MODIFIED")  # bound at last
    api.put(pod("u1", "running", gpus=2, node="gpu-1"), "DELETED")
    col.sync_once()  # watch
    assert events(col) == [("waiting", "start", ""), ("running", "end", "Deleted")]
    # a restarted collector resumes from the saved resourceVersion: nothing twice
    api.put(pod("u4", "late", gpus=1, unsched=MSG))
    again = K8sPodCollector("prod", KubeApi(api.url), state, watch_timeout_s=1)
    again.sync_once()
    assert events(again) == [("late", "submit", ""), ("late", "pending_reason", f"Unschedulable: {MSG}")]
    # etcd compaction: meanwhile u4 starts and u5 is created and cancelled, u6 is created
    api.put(pod("u4", "late", gpus=1, node="gpu-1"), "MODIFIED")
    api.put(pod("u5", "brief", gpus=1, unsched=MSG))
    api.put(pod("u5", "brief", gpus=1, unsched=MSG), "DELETED")
    api.put(pod("u6", "new", gpus=4, unsched=MSG))
    api.compact()
    again.sync_once()  # 410 → relist → diff
    assert again.relists == 1
    assert sorted(events(again)) == sorted([("late", "start", ""), ("new", "submit", ""),
                                           ("new", "pending_reason", f"Unschedulable: {MSG}")])  # fmt: skip
    again.sync_once()  # watching again from the relisted version: quiet
    assert events(again) == []


def test_missing_permission_is_a_clear_error(api: FakeApiServer, tmp_path: Path) -> None:
    api.forbid = True
    col = K8sPodCollector("prod", KubeApi(api.url), tmp_path / "s.json")
    with pytest.raises(Forbidden, match="needs get/list/watch on pods"):
        col.sync_once()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_cli_collector(api: FakeApiServer, tmp_path: Path) -> None:
    from gpuslo.app.cli import main

    api.put(pod("u9", "cli-pod", gpus=2, unsched=MSG))
    out = tmp_path / "events.jsonl"
    rc = main(["agent", "--source", "k8s-events", "--k8s-api", api.url, "--cluster", "prod", "--ticks", "3",
               "--interval-s", "1", "--metrics-port", "0", "--state-file", str(tmp_path / "st.json"), "--out", str(out)])  # fmt: skip
    assert rc == 0
    evs = [decode(line) for line in out.read_bytes().splitlines()]
    assert {(e.name, e.event) for e in evs if isinstance(e, SchedulerEvent)} == {
        ("team-a/cli-pod", "submit"),
        ("team-a/cli-pod", "pending_reason"),
    }

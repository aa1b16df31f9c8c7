"""The cluster-level Kubernetes collector against a fake API server that speaks the real
list/watch protocol: a PodList with a resourceVersion, then newline-delimited watch events,
and 410 Gone (as an ERROR event in the stream, the way the API server reports an expired
resourceVersion after etcd compaction)."""

from __future__ import annotations

import calendar
import http.server
import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from gpuslo.agent.k8s_watch import (
    BadWatchLine,
    Forbidden,
    K8sPodCollector,
    KubeApi,
    gpus_requested,
    ts,
    watch_event,
)
from gpuslo.wire import SchedulerEvent, decode, encode
from tests.pod_requests import SHAPES, pod_spec


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
        self.garbage: dict[int, bytes] = {}  # a raw line written before the event of that rv
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
                            if r in srv.garbage:  # what a proxy in the way might write
                                raw = srv.garbage[r] + b"\n"
                                self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
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


NOT_EVENTS = [
    b"<html><body>502 Bad Gateway</body></html>",  # a proxy's page in the stream
    b'{"type": "MODIFIED", "object": {"metadata": {"uid": "u1"',  # cut short
    b"[1, 2]",  # JSON, not an object
    b'{"object": {}}',  # no type
    b'{"type": 5, "object": {}}',  # a type that is not a string
    b'{"type": "ADDED"}',  # no object
    b'{"type": "ADDED", "object": []}',  # an object that is not one
    b'{"type": "ADDED", "object": null}',
    b"\xff\xfe\x00{",  # not UTF-8
    b"NaN",
]


@pytest.mark.parametrize("line", NOT_EVENTS)
def test_a_watch_line_that_is_not_an_event_is_named(line: bytes) -> None:
    with pytest.raises(BadWatchLine, match="a watch line is not"):
        watch_event(line)
    assert watch_event(b'{"type": "BOOKMARK", "object": {"metadata": {}}}\n') == (
        "BOOKMARK",
        {"metadata": {}},
    )


@pytest.mark.parametrize("line", NOT_EVENTS[:3])
def test_a_line_that_is_not_an_event_is_passed_by_a_fresh_list(
    api: FakeApiServer, tmp_path: Path, line: bytes
) -> None:
    """A line that is not an event before a pod's change: watching again from the last good
    version would read the same line again, for ever (the change behind it never seen). The
    collector counts it and lists afresh instead (the state file too: a restart lists); the list
    brings the change, and the watch goes on from the list's version."""
    api.put(pod("u1", "first", gpus=1, unsched=MSG))
    state = tmp_path / "k8s.json"
    col = K8sPodCollector("prod", KubeApi(api.url), state, watch_timeout_s=1)
    col.sync_once()  # list
    assert [e[1] for e in events(col)] == ["submit", "pending_reason"]
    api.put(pod("u0", "before", gpus=1, unsched=MSG))  # a good event before the bad line
    api.put(pod("u1", "first", gpus=1, node="gpu-1"), "MODIFIED")
    api.garbage[api.rv] = line
    api.put(pod("u2", "second", gpus=2, unsched=MSG))
    with pytest.raises(BadWatchLine, match=r"a watch line is not.*listing afresh"):
        col.sync_once()
    assert col.bad_lines == 1 and col.rv == "" and col.counts()["gpuslo_k8s_watch_bad_lines"] == 1
    assert events(col) == [("before", "submit", ""), ("before", "pending_reason", f"Unschedulable: {MSG}")]
    assert json.loads(state.read_text())["rv"] == ""  # a restart here lists too
    col.sync_once()  # the fresh list: the change behind the line, and what came after it
    assert col.relists == 2
    assert sorted(events(col)) == sorted([("first", "start", ""), ("second", "submit", ""),
                                          ("second", "pending_reason", f"Unschedulable: {MSG}")])  # fmt: skip
    api.put(pod("u2", "second", gpus=2, node="gpu-2"), "MODIFIED")
    col.sync_once()  # watching from the list's version, past the line
    assert events(col) == [("second", "start", "")] and col.bad_lines == 1


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


# ---------------------------------------------------------------- one malformed pod, and the rest
# The API server validates what it stores, so none of these comes from it; an aggregated API, a
# proxy or a bug may still say them. One such pod is skipped and counted: the list completes
# (its resourceVersion taken), the watch moves past it, every other pod is followed.


class ListWatch:
    """A KubeApi as the collector uses it: one list, then the watch events given (in memory)."""

    def __init__(self, items: list[dict[str, Any]], rv: str = "10",
                 stream: list[tuple[str, dict[str, Any]]] = ()) -> None:  # type: ignore[assignment]  # fmt: skip
        self.items, self.rv, self.stream = items, rv, list(stream)
        self.watched_from: list[str] = []

    def list_pods(self) -> tuple[list[dict[str, Any]], str]:
        return self.items, self.rv

    def watch_pods(
        self, rv: str, timeout_s: int = 300, on_open: Any = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        self.watched_from.append(rv)
        out, self.stream = self.stream, []
        return iter(out)


def with_rv(p: dict[str, Any], rv: int) -> dict[str, Any]:
    out = json.loads(json.dumps(p))
    out["metadata"]["resourceVersion"] = str(rv)
    return out


def _set(path: str, value: Any) -> Any:
    """A change to a pod: ``value`` at ``path`` (dotted; a number indexes a list)."""

    def change(p: dict[str, Any]) -> dict[str, Any]:
        keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
        at: Any = p
        for k in keys[:-1]:
            at = at[k]
        at[keys[-1]] = value
        return p

    return change


def _ended(p: dict[str, Any]) -> dict[str, Any]:
    p["status"]["phase"] = "Succeeded"
    p["status"]["containerStatuses"] = [{"name": "main", "state": {"terminated": {
        "exitCode": 0, "finishedAt": "2026-11-28T12:00:00Z"}}}]  # fmt: skip
    return p


def _then(*changes: Any) -> Any:
    def change(p: dict[str, Any]) -> dict[str, Any]:
        for c in changes:
            p = c(p)
        return p

    return change


HOSTILE = {
    "creationTimestamp words": _set("metadata.creationTimestamp", "yesterday"),
    "creationTimestamp epoch int": _set("metadata.creationTimestamp", 1796428800),
    "creationTimestamp no zone": _set("metadata.creationTimestamp", "2026-11-28T10:00:00"),
    "creationTimestamp date only": _set("metadata.creationTimestamp", "2026-11-28"),
    "creationTimestamp list": _set("metadata.creationTimestamp", ["2026-11-28T10:00:00Z"]),
    "creationTimestamp control chars": _set("metadata.creationTimestamp", "2026-11-28T10:00:00Z\x00\n"),
    "creationTimestamp very long": _set("metadata.creationTimestamp", "2026-11-28T10:00:00Z" * 1000),
    "deletionTimestamp garbage": _set("metadata.deletionTimestamp", "garbage"),
    "uid over 256": _set("metadata.uid", "u" * 257),
    "uid int": _set("metadata.uid", 12345),
    "uid list": _set("metadata.uid", ["u"]),
    "name int": _set("metadata.name", 5),
    "namespace object": _set("metadata.namespace", {"a": 1}),
    "labels string": _set("metadata.labels", "app=x"),
    "metadata list": _set("metadata", ["uid"]),
    "metadata string": _set("metadata", "x"),
    "spec string": _set("spec", "x"),
    "status list": _set("status", ["Running"]),
    "nodeName int": _set("spec.nodeName", 7),
    "nodeName list": _set("spec.nodeName", ["gpu-1"]),
    "conditions string": _set("status.conditions", "PodScheduled"),
    "conditions of strings": _set("status.conditions", ["x"]),
    "condition type int": _set("status.conditions", [{"type": 5, "status": "False"}]),
    "PodScheduled time garbage": _set(
        "status.conditions", [{"type": "PodScheduled", "status": "False", "lastTransitionTime": "garbage"}]
    ),
    "PodScheduled message int": _set(
        "status.conditions", [{"type": "PodScheduled", "status": "False", "message": 0}]
    ),
    "phase int": _set("status.phase", 3),
    "containerStatuses string": _then(_ended, _set("status.containerStatuses", "x")),
    "containerStatus string": _then(_ended, _set("status.containerStatuses", ["x"])),
    "state string": _then(_ended, _set("status.containerStatuses.0.state", "terminated")),
    "terminated string": _then(_ended, _set("status.containerStatuses.0.state.terminated", "x")),
    "finishedAt garbage": _then(
        _ended, _set("status.containerStatuses.0.state.terminated.finishedAt", "garbage")
    ),
    "finishedAt int": _then(_ended, _set("status.containerStatuses.0.state.terminated.finishedAt", 0)),
    "finishedAt no zone": _then(
        _ended, _set("status.containerStatuses.0.state.terminated.finishedAt", "2026-11-28T12:00:00")
    ),
}


def names(col: K8sPodCollector) -> set[tuple[str, str]]:
    return {(n, e) for n, e, _ in events(col)}


@pytest.mark.parametrize("change", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_malformed_pod_is_skipped_and_the_list_completes(
    change: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = change(pod("u2", "bad", node="gpu-2"))
    api = ListWatch([pod("u1", "before"), bad, pod("u3", "after", node="gpu-1")])
    col = K8sPodCollector("prod", api, tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()
    assert col.rv == "10"  # the list's version: watching from it next, not listing again
    assert names(col) == {("before", "submit"), ("after", "submit"), ("after", "start")}
    assert col.skipped == 1 and col.counts() == {
        "gpuslo_k8s_skipped_pods": 1,
        "gpuslo_k8s_watch_bad_lines": 0,
    }
    [line] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "skipped" in line.getMessage()
    col.sync_once()
    assert api.watched_from == ["10"]
    # what was saved loads again (a wrong type kept in the state file would lose all of it)
    assert set(K8sPodCollector("prod", api, tmp_path / "s.json").pods) == {"u1", "u3"}  # type: ignore[arg-type]


@pytest.mark.parametrize("change", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_malformed_watch_event_is_skipped_and_the_watch_moves_past_it(change: Any, tmp_path: Path) -> None:
    stream = [("ADDED", with_rv(pod("u1", "before"), 11)), ("MODIFIED", change(with_rv(pod("u2", "bad"), 12))),
              ("ADDED", with_rv(pod("u3", "after", unsched=MSG), 13))]  # fmt: skip
    api = ListWatch([], "10", stream)
    col = K8sPodCollector("prod", api, tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()  # list
    col.sync_once()  # watch
    assert names(col) == {("before", "submit"), ("after", "submit"), ("after", "pending_reason")}
    assert col.skipped == 1
    assert col.rv == "13"
    col.sync_once()  # a reconnect starts after the bad event, not at it
    assert api.watched_from == ["10", "13"]
    assert json.loads((tmp_path / "s.json").read_text())["rv"] == "13"


def test_a_followed_pod_that_turns_malformed_is_not_ended_by_a_relist(tmp_path: Path) -> None:
    api = ListWatch([pod("u1", "waiting", unsched=MSG)])
    col = K8sPodCollector("prod", api, tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()
    events(col)
    api.items = [HOSTILE["creationTimestamp words"](pod("u1", "waiting", unsched=MSG))]
    col.rv = ""  # a relist (after a 410)
    col.sync_once()
    assert events(col) == [] and col.skipped == 1
    assert "u1" in col.pods


def test_a_pod_without_uid_is_not_ended_by_each_relist(tmp_path: Path) -> None:
    p = pod("", "no-uid")
    del p["metadata"]["uid"]
    api = ListWatch([p])
    col = K8sPodCollector("prod", api, tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()
    col.rv = ""
    col.sync_once()
    assert [(m.request_id, m.event) for m in col.collect(0)] == [("team-a/no-uid", "submit")]


def test_an_unreadable_gpu_request_is_counted(tmp_path: Path) -> None:
    bad = pod("u2", "bad")
    bad["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "NaN"}}
    col = K8sPodCollector("prod", ListWatch([bad, pod("u1", "good")]), tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()
    assert names(col) == {("good", "submit")} and col.skipped == 1


EPOCH = "1970-01-01T00:00:00Z"


@pytest.mark.parametrize(
    "change",
    [
        _set("metadata.creationTimestamp", EPOCH),
        _set("metadata.creationTimestamp", "1999-12-31T23:59:59Z"),
        _set("metadata.creationTimestamp", "2200-01-01T00:00:00Z"),
        _set("metadata.name", "n" * 300),
    ],
    ids=["1970", "before 2000", "after 2106", "name 300"],
)
def test_a_time_the_wire_cannot_carry_is_not_replaced_by_now(change: Any, tmp_path: Path) -> None:
    """A time the pod gives is its time: one the wire refuses (before 2000, the epoch itself) drops
    that event, counted, rather than being said as now; the pod's later events still go."""
    api = ListWatch([change(pod("u1", "p", unsched=MSG))])
    col = K8sPodCollector("prod", api, tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()
    got = [(m.event, m.ts) for m in col.collect(0)]
    at = calendar.timegm((2026, 11, 28, 10, 0, 5))
    if "n" * 300 in json.dumps(api.items):  # a name is cut to the wire's 256, never refused
        assert got == [("submit", at - 5), ("pending_reason", at)] and col.skipped == 0
    else:
        assert got == [("pending_reason", at)] and col.skipped == 1


def test_a_finished_at_epoch_is_not_replaced_by_now(tmp_path: Path) -> None:
    p = _ended(pod("u1", "p", node="gpu-1"))
    p["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = EPOCH
    col = K8sPodCollector("prod", ListWatch([p]), tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()
    assert [m.event for m in col.collect(0)] == ["submit", "start"] and col.skipped == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-28T10:00:00Z", calendar.timegm((2026, 11, 28, 10, 0, 0))),
        ("2026-11-28T10:00:00.250000Z", calendar.timegm((2026, 11, 28, 10, 0, 0)) + 0.25),  # MicroTime
        ("2026-11-28T11:30:00+01:30", calendar.timegm((2026, 11, 28, 10, 0, 0))),
        (EPOCH, 0.0),  # a time, not "none"
        ("", None),
        (None, None),
    ],
)
def test_ts_reads_rfc3339(text: str | None, expected: float | None) -> None:
    assert ts(text) == expected


@pytest.mark.parametrize(
    "text", ["2026-11-28T10:00:00", "2026-11-28", "yesterday", "2026-11-28T10:00:00Z\x00", 1796428800]
)
def test_ts_refuses_what_is_not_rfc3339(text: Any) -> None:
    """A time without a zone is not read in this host's zone (nor guessed as UTC): refused."""
    with pytest.raises(ValueError):
        ts(text)


def test_a_watch_line_past_the_bound_is_cut_short_and_passed_by_a_fresh_list(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line longer than any event (a proxy, a server gone wrong, a stream without newlines) is
    read no further than the bound: read whole, it grew the agent past its memory limit (256 Mi
    in the DaemonSet; a 400 MiB line took 838 MiB), and the restarted agent watched from the same
    version into the same line. It is a line that is not an event: counted, and a fresh list."""
    import gpuslo.agent.k8s_watch as k8s_watch

    monkeypatch.setattr(k8s_watch, "MAX_WATCH_LINE", 1 << 16, raising=False)  # small for the test
    api.put(pod("u1", "first", gpus=1, unsched=MSG))
    col = K8sPodCollector("prod", KubeApi(api.url), tmp_path / "k8s.json", watch_timeout_s=1)
    col.sync_once()
    assert [e[1] for e in events(col)] == ["submit", "pending_reason"]
    api.put(pod("u1", "first", gpus=1, node="gpu-1"), "MODIFIED")
    api.garbage[api.rv] = b'{"type": "ADDED", "object": {"x": "' + b"a" * (1 << 20)  # no end, no newline
    with pytest.raises(BadWatchLine, match=r"a watch line is longer than 65536 bytes.*listing afresh"):
        col.sync_once()
    assert col.bad_lines == 1 and col.rv == ""
    col.sync_once()  # the fresh list brings the change behind the line
    assert events(col) == [("first", "start", "")]


class _Waits(threading.Event):
    """A collector's stop event that records each wait's timeout and returns at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return self.is_set()


def test_410_gone_at_once_after_every_list_backs_off_instead_of_spinning(tmp_path: Path) -> None:
    """A server that answers every watch with 410 Gone before any event (its watch cache behind the
    list it served): the collector relisted at once, every time (1,200 full lists a second against
    the API server, from one collector). Such a 410 now waits before the relist, doubling to a
    minute; a watch that brought anything resets the wait, and an ordinary 410 relists at once."""
    from gpuslo.agent.k8s_watch import Gone

    class Api(KubeApi):
        def __init__(self) -> None:
            super().__init__("http://fake.invalid")
            self.lists = 0
            self.then: list[tuple[str, dict[str, Any]]] = []

        def list_objects(self, path: str) -> tuple[list[dict[str, Any]], str]:
            self.lists += 1
            return [], "5"

        def watch_objects(self, path: str, rv: str, timeout_s: int = 300,
                          on_open: Any = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
            out, self.then = self.then, []
            yield from out
            raise Gone("too old resource version")

    api = Api()
    col = K8sPodCollector("prod", api, tmp_path / "k8s.json", watch_timeout_s=1)
    col._stop = stop = _Waits()
    col.sync_once()  # list
    for _ in range(9):
        col.sync_once()
    assert stop.waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]  # the first 410: at once
    assert api.lists == 10
    api.then = [("BOOKMARK", {"metadata": {"resourceVersion": "6"}})]
    col.sync_once()  # something came: an ordinary expiry, relisted at once, and the wait starts over
    col.sync_once()
    col.sync_once()
    assert stop.waits[8:] == [1.0] and api.lists == 13
    stop.set()  # closed while waiting: no relist
    col.sync_once()
    assert api.lists == 13


def test_a_410_after_a_watch_that_ended_well_relists_at_once(tmp_path: Path) -> None:
    """The pause before a relist is for a 410 that came at once right after a relist that followed
    a 410 (a server whose watch cache is behind its lists). A watch that ended at its timeout, after
    events or none, is no such round: the 410 of the next one (a quiet resource whose version was
    compacted meanwhile) relists at once. It waited (1 s, doubling to a minute, over the day's
    ordinary expiries: the wait was reset only by a 410 that came after an event)."""
    from gpuslo.agent.k8s_watch import Gone

    class Api(KubeApi):
        def __init__(self) -> None:
            super().__init__("http://fake.invalid")
            self.lists = 0
            self.rounds: list[tuple[list[tuple[str, dict[str, Any]]], bool]] = []

        def list_objects(self, path: str) -> tuple[list[dict[str, Any]], str]:
            self.lists += 1
            return [], "5"

        def watch_objects(self, path: str, rv: str, timeout_s: int = 300,
                          on_open: Any = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
            events, gone = self.rounds.pop(0)
            yield from events
            if gone:
                raise Gone("too old resource version")

    api = Api()
    col = K8sPodCollector("prod", api, tmp_path / "k8s.json", watch_timeout_s=1)
    col._stop = stop = _Waits()
    col.sync_once()  # list
    bookmark = ("BOOKMARK", {"metadata": {"resourceVersion": "6"}})
    # a 410 at once, then a spell of them (the wait grows), then watches that end at their
    # timeout (one with a bookmark, one with nothing), each followed by an ordinary 410
    api.rounds = [
        ([], True),
        ([], True),
        ([], True),
        ([bookmark], False),
        ([], True),
        ([], False),
        ([], True),
    ]
    for _ in range(3):
        col.sync_once()
    assert stop.waits == [1.0, 2.0]
    for _ in range(4):
        col.sync_once()
    assert stop.waits == [1.0, 2.0] and api.lists == 6  # both later 410s: relisted at once


@pytest.mark.parametrize("new_transition", [None, "2026-11-28T10:00:05Z", "2026-11-28T10:30:00Z"])
def test_a_changed_message_is_its_own_pending_reason(new_transition: str | None, tmp_path: Path) -> None:
    """The scheduler rewrites its Unschedulable message while the condition stays False, and the
    condition's lastTransitionTime with it (the store keys an event by cluster, request, event and
    time: at the old time the new reason would replace the one before, and an incident opened
    between them would read the later words). A changed message is said at the condition's time
    when that moved on, else when it was seen (the clock)."""
    first = pod("u1", "p", unsched=MSG)
    second = pod("u1", "p", unsched="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    cond = second["status"]["conditions"][0]
    if new_transition is None:
        del cond["lastTransitionTime"]
    else:
        cond["lastTransitionTime"] = new_transition
    seen = calendar.timegm((2026, 11, 28, 10, 20, 0))
    api = ListWatch([with_rv(first, 11)], stream=[("MODIFIED", with_rv(second, 12))])
    col = K8sPodCollector("prod", api, tmp_path / "s.json", clock=lambda: seen)  # type: ignore[arg-type]
    col.sync_once()
    col.sync_once()
    said = [(m.ts, m.reason) for m in col.collect(0) if m.event == "pending_reason"]
    at = calendar.timegm((2026, 11, 28, 10, 0, 5))
    later = calendar.timegm((2026, 11, 28, 10, 30, 0)) if new_transition == "2026-11-28T10:30:00Z" else seen
    assert said == [(at, f"Unschedulable: {MSG}"), (later, f"Unschedulable: {cond['message']}")]


T_COND = calendar.timegm((2026, 11, 28, 10, 0, 5))  # the condition's time in pod()


def _stored_ms(t: float) -> tuple[int, int]:
    """The millisecond the store keeps a time at, cut down or to nearest."""
    return int(t * 1000), round(t * 1000)


# (the condition's time of each rewritten message, the clock at each): the scheduler rewrites its
# message three times after the first; every reason must be its own event in the store, in order
_REWRITES = {
    "the condition's time stays, the clock set back": (
        [T_COND] * 3,
        [T_COND + 900, T_COND + 60, T_COND + 60],
    ),
    "the condition's time stays, one clock reading": ([T_COND] * 3, [T_COND + 900] * 3),
    "the API server's clock ahead of this host's": ([T_COND] * 3, [T_COND - 30, T_COND - 29, T_COND - 28]),
    "the condition's time moves back": ([T_COND - 50, T_COND - 100, T_COND - 150], [T_COND - 60] * 3),
    "the condition's time moves on within a millisecond": (
        [T_COND + 0.0004, T_COND + 0.0008, T_COND + 0.0009],
        [T_COND] * 3,
    ),
    "no condition time, the clock set back": ([None] * 3, [T_COND + 20, T_COND + 10, T_COND]),
}


@pytest.mark.parametrize(("conds", "clock"), list(_REWRITES.values()), ids=list(_REWRITES))
@pytest.mark.parametrize("restarted", [False, True], ids=["one run", "state file from before reason_at"])
def test_every_rewritten_reason_is_its_own_event_in_order(
    conds: list[float | None], clock: list[float], restarted: bool, tmp_path: Path
) -> None:
    """A changed message is said after the reason before it, never at its time or before: the
    store keeps one event per request, kind and millisecond (a second reason at the same time
    replaced the first), and an earlier time made the newer reason read as the older. A clock
    set back, two messages seen in one reading, a condition time that moved back and a state
    file written before the time of the last reason was kept (it said the first at the
    condition's time, then the next at that same time) were each one of these."""
    state = tmp_path / "s.json"
    readings = iter([T_COND + 1, *clock])
    api = ListWatch([with_rv(pod("u1", "p", unsched=MSG), 11)])
    col = K8sPodCollector("prod", api, state, clock=lambda: next(readings))  # type: ignore[arg-type]
    col.sync_once()
    said = [m for m in col.collect(0) if isinstance(m, SchedulerEvent) and m.event == "pending_reason"]
    if restarted:
        raw = json.loads(state.read_text())
        for p in raw["pods"].values():
            del p["reason_at"]
        state.write_text(json.dumps(raw))
        col = K8sPodCollector("prod", api, state, clock=lambda: next(readings))  # type: ignore[arg-type]
    for i, at in enumerate(conds):
        p = pod("u1", "p", unsched=f"0/{3 + i} nodes are available: {3 + i} Insufficient nvidia.com/gpu.")
        c = p["status"]["conditions"][0]
        if at is None:
            del c["lastTransitionTime"]
        else:
            c["lastTransitionTime"] = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
        api.stream = [("MODIFIED", with_rv(p, 12 + i)), ("MODIFIED", with_rv(p, 20 + i))]  # and again
        col.sync_once()
        said += [m for m in col.collect(0) if isinstance(m, SchedulerEvent) and m.event == "pending_reason"]
    assert [m.reason.split(": ")[1][:3] for m in said] == ["0/2", "0/3", "0/4", "0/5"]
    for cut in (0, 1):
        kept = [_stored_ms(m.ts)[cut] for m in said]
        assert kept == sorted(set(kept)), f"reasons at {[m.ts for m in said]}"


UNREADABLE_REQUEST = _set("spec.containers.0.resources", {"limits": {"nvidia.com/gpu": "NaN"}})
# the hostile shapes that keep the pod's uid readable (one without it names no pod to end: the next
# relist ends it, as one deleted unwatched)
NAMED = {k: v for k, v in HOSTILE.items() if not k.startswith(("uid ", "metadata "))}


@pytest.mark.parametrize("change", [*NAMED.values(), UNREADABLE_REQUEST], ids=[*NAMED.keys(), "request NaN"])
@pytest.mark.parametrize("started", [False, True])
def test_a_followed_pod_deleted_in_a_shape_it_cannot_read_still_ends(
    change: Any, started: bool, tmp_path: Path
) -> None:
    """A pod followed before whose DELETED event cannot be read (or whose GPU request cannot, now):
    it was skipped and never ended, so its request stayed open (a starvation incident without
    end, a pending-pods table that never drops it) until a relist, which a watch that keeps
    resuming never makes. It ends now, at the time it is seen, with the size it had; other pods'
    events go on."""
    node = "gpu-1" if started else ""
    stream = [("DELETED", change(with_rv(pod("u1", "gone", gpus=3, node=node, unsched="" if started else MSG), 11))),
              ("ADDED", with_rv(pod("u2", "after"), 12))]  # fmt: skip
    api = ListWatch([pod("u1", "gone", gpus=3, node=node, unsched="" if started else MSG)], "10", stream)
    col = K8sPodCollector("prod", api, tmp_path / "s.json", clock=lambda: 1_796_500_000.0)  # type: ignore[arg-type]
    col.sync_once()
    col.collect(0)
    col.sync_once()
    got = [(m.request_id, m.event, m.ts, m.gpus_per_node, m.reason) for m in col.collect(0)
           if isinstance(m, SchedulerEvent)]  # fmt: skip
    ended = [g for g in got if g[0] == "u1"]
    kind = "end" if started else "cancel"
    assert len(ended) == 1 and ended[0][1:2] == (kind,) and ended[0][3:] == (3.0, "Deleted"), got
    assert ("u2", "submit") in [g[:2] for g in got]
    assert "u1" not in col.pods and col.rv == "12"


def test_deleted_pods_are_forgotten(tmp_path: Path) -> None:
    """Every GPU pod ever seen stayed in the collector's memory and state file (rewritten on each
    round) until a relist, which a watch that keeps resuming never makes: 1,000 pods a day made
    the state file grow without end. A deleted pod is forgotten once it has ended."""
    stream: list[tuple[str, dict[str, Any]]] = []
    rv = 11
    for i in range(200):
        p = pod(f"u{i}", f"p{i}", node="gpu-1")
        stream += [("ADDED", with_rv(p, rv)), ("MODIFIED", with_rv(_ended(p), rv + 1)),
                   ("DELETED", with_rv(_ended(p), rv + 2))]  # fmt: skip
        rv += 3
    stream.append(("ADDED", with_rv(pod("live", "live"), rv)))
    col = K8sPodCollector("prod", ListWatch([], "10", stream), tmp_path / "s.json")  # type: ignore[arg-type]
    col.sync_once()
    col.sync_once()
    got = names(col)
    assert {e for _, e in got} == {"submit", "start", "end"} and len(got) == 200 * 3 + 1
    assert set(col.pods) == {"live"}
    assert set(json.loads((tmp_path / "s.json").read_text())["pods"]) == {"live"}


@pytest.mark.parametrize(("limits", "gpus"), [
    ({"nvidia.com/gpu": "2"}, 2.0),
    ({"nvidia.com/mig-1g.10gb": "1"}, 1 / 7),
    ({"nvidia.com/mig-3g.40gb": "2"}, 6 / 7),
    ({"nvidia.com/mig-1g.6gb": "1"}, 1 / 4),  # an A30's, of 4 slices
    ({"nvidia.com/mig-7g.80gb": "1"}, 1.0),
    ({"nvidia.com/mig-1g.10gb+me": "1"}, 1 / 7),  # a media extension is its base profile
    ({"nvidia.com/mig-9g.99gb": "1"}, 1.0),  # not in NVIDIA's table: a GPU, as before
    ({"nvidia.com/gpu": "1", "nvidia.com/mig-2g.20gb": "1"}, 1 + 2 / 7),
    ({"nvidia.com/mig-1g.10gb": "0"}, 0.0),
    ({"example.com/fpga": "3"}, 0.0),
])  # fmt: skip
def test_a_mig_device_asked_is_its_part_of_a_gpu(limits: dict[str, str], gpus: float) -> None:
    """``nvidia.com/mig-PROFILE`` was one GPU a device; the agent's MIG instance rows count their
    compute slices over the GPU's in capacity, and a request must be counted alike."""
    p = {"spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}}
    assert gpus_requested(p) == pytest.approx(gpus, abs=1e-12)


def test_nvidias_mig_table_gives_every_profile_one_part_of_a_gpu() -> None:
    """A profile name two models gave different parts would be left out (a GPU a device): every
    name in the table has one."""
    from gpuslo.core import mig

    names = {n.lower() for m in mig.table().models for n in m.profiles}
    assert set(mig.profile_fractions()) == names and len(names) > 20
    for m in mig.table().models:
        for n, (compute, _) in m.profiles.items():
            assert mig.gpu_fraction(n) == compute / m.compute_slices


# how schedulers spell a profile P: the device plugin's resource (``+`` is no character of a
# resource name: ``1g.10gb+me`` is advertised as ``mig-1g.10gb.me``, Blackwell's ``-me``), Slurm's
# AutoDetect=nvml gres type (the GPU's name first: nvidia_h100_80gb_hbm3_3g.40gb), a site's own
# (a100mig_3g.40gb, A100_1g.10gb), NVIDIA's extensions
SPELLINGS = ("{p}", "{P}", " {p} ", "{p}+me", "{p}.me", "{p}-me", "{p}+gfx", "{p}+me.all",
             "nvidia_h100_80gb_hbm3_{p}", "a100_{p}", "A100_{P}", "a100mig_{p}.me")  # fmt: skip


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_mig_profile_is_read_however_a_scheduler_spells_it(spelling: str) -> None:
    """Each profile of NVIDIA's table in each spelling is its compute slices over its GPU's (from
    the table, not from the reader); only ``P`` and ``P+me`` were read, every other spelling was
    a whole GPU a device (a Slurm site's ``--gres=gpu:a100_1g.5gb:1`` asked 1 GPU, not 1/7)."""
    from gpuslo.agent.slurm import gpu_shape
    from gpuslo.core import mig

    for m in mig.table().models:
        for name, (compute, _) in m.profiles.items():
            want = compute / m.compute_slices
            text = spelling.format(p=name, P=name.upper())
            assert mig.gpu_fraction(text) == pytest.approx(want, abs=1e-12), text
            if re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_.]*[A-Za-z0-9]", text):  # a resource name the API allows
                res = {
                    "spec": {
                        "containers": [
                            {"name": "c", "resources": {"limits": {f"nvidia.com/mig-{text}": "2"}}}
                        ]
                    }
                }
                assert gpus_requested(res) == pytest.approx(2 * want, abs=1e-12), text
            tres = f"gres/gpu:{text.strip()}:3"
            assert gpu_shape({"tres_per_node": tres}) == (pytest.approx(3 * want, abs=1e-12), 1), tres


@pytest.mark.parametrize(("name", "want"), [
    ("1c.3g.40gb", 1 / 7), ("2c.3g.40gb", 2 / 7), ("3c.7g.80gb", 3 / 7), ("1c.2g.12gb", 1 / 4),  # A30's
    ("4c.3g.40gb", None),  # more compute slices than its GPU instance holds
    ("9g.99gb", None), ("1g.15gb", None), ("h100", None), ("a100_80gb", None), ("11g.5gb", None),
    ("x1g.10gb", None), ("", None),
])  # fmt: skip
def test_a_compute_instance_is_its_compute_slices_and_an_unlisted_name_none(
    name: str, want: float | None
) -> None:
    from gpuslo.core import mig

    got = mig.gpu_fraction(name)
    assert got == (None if want is None else pytest.approx(want, abs=1e-12))


@pytest.mark.parametrize(("case", "parts", "want"), SHAPES, ids=[s[0] for s in SHAPES])
def test_a_pods_request_counts_its_init_containers_and_sidecars_as_the_scheduler_does(
    case: str, parts: list[tuple[str, int]], want: int
) -> None:
    """Init containers were left out: a pod whose init container asks 3 GPUs beside 1 in its
    container read as asking 1, while the scheduler places it only where 3 are free (the table is
    checked against the real scheduler in test_k8s_control_plane). A MIG resource alike, as its
    part of a GPU, and each resource on its own (a sidecar's MIG slice is not a GPU's share)."""
    assert gpus_requested({"spec": pod_spec(parts)}) == want
    mig = pod_spec(parts)
    for c in [*mig["containers"], *mig.get("initContainers", [])]:
        if "resources" in c:
            c["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": c["resources"]["limits"]["nvidia.com/gpu"]}
    assert gpus_requested({"spec": mig}) == pytest.approx(want / 7, abs=1e-12)
    both = pod_spec(parts)
    both["containers"].append(
        {"name": "mig", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}}  # beside: added
    )
    assert gpus_requested({"spec": both}) == pytest.approx(want + 3 / 7, abs=1e-12)

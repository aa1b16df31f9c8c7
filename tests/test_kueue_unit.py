"""The Kueue collector without a server: Kueue's reason strings mapped to starvation causes
(the messages recorded from Kueue v0.17.0's own tests, tests/compat/kueue/pending_messages.json),
the Workload life as events, hostile Workload objects, the wire and the store columns, and the
starvation rule's use of the cause a scheduler gives. The real controller: tests/test_kueue.py."""

from __future__ import annotations

import json
import logging
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.k8s_watch import BadWatchLine, Forbidden, Gone, watch_event
from gpuslo.agent.kueue import (
    QUEUE_RETRY_S,
    WORKLOADS,
    KueueWorkloadCollector,
    Malformed,
    NotServed,
    PendingGauge,
    classify,
    read,
)
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import pending_age, summary
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSample, GpuSampleBatch, SchedulerEvent, WireError, decode, encode
from tests.pod_requests import SHAPES, pod_spec

ROOT = Path(__file__).resolve().parent
T0 = 1_780_000_000.0


def iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------- reasons -> causes
#: On paper, from flavorassigner.go / scheduler.go / workload_controller.go (agent/kueue.py):
#: beyond what the ClusterQueue may ever hold -> capacity; quota held by others, priority,
#: inactive queues -> policy; topology or flavor placement -> fragmentation.
EXPECTED = [
    ("ExceedsMaxQuota", "capacity"),
    ("WaitingForQuota", "policy"),
    ("WaitingForQuota", "policy"),
    ("PendingPreemption", "policy"),
    ("NoQuotaForResource", "capacity"),
    ("NoLongerFits", "policy"),
    ("TopologyPlacementFailed", "fragmentation"),
    ("TopologyPlacementFailed", "fragmentation"),
    ("FlavorPlacementFailed", "fragmentation"),
    ("FlavorPlacementFailed", "fragmentation"),
    ("Inadmissible", "policy"),
    ("Inadmissible", "policy"),
]


def test_kueue_reasons_recorded_from_its_tests_map_to_causes() -> None:
    recorded = json.loads((ROOT / "compat" / "kueue" / "pending_messages.json").read_text())
    assert len(recorded) == len(EXPECTED)
    for rec, want in zip(recorded, EXPECTED, strict=True):
        assert classify(rec["reason"], rec["message"]) == want, rec["source"]


@pytest.mark.parametrize(
    ("message", "want"),
    [
        # one pod set, two flavors: the most hopeful flavor decides (spot waits for quota)
        ("couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor a, "
         "previously considered podsets requests (0) + current podset request (8) > maximum capacity (4), "
         "insufficient unused quota for nvidia.com/gpu in flavor spot, 2 more needed", "policy"),
        # two pod sets: every one must fit, the farthest decides
        ("couldn't assign flavors to pod set a: insufficient unused quota for nvidia.com/gpu in flavor f, "
         "1 more needed; couldn't assign flavors to pod set b: insufficient quota for nvidia.com/gpu in "
         "flavor f, previously considered podsets requests (1) + current podset request (9) > maximum "
         "capacity (4)", "capacity"),
        ("couldn't assign flavors to pod set a: flavor f doesn't match node affinity; couldn't assign "
         "flavors to pod set b: insufficient unused quota for cpu in flavor f, 1 more needed", "fragmentation"),
        ("", "policy"),
        ("something Kueue may say one day", "policy"),
    ],
)  # fmt: skip
def test_pod_sets_and_flavors_combine(message: str, want: str) -> None:
    assert classify("Pending", message)[1] == want


# ---------------------------------------------------------------------------- Workloads as Kueue writes them
def cond(kind: str, status: str, at: float, reason: str = "", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": iso(at), "observedGeneration": 1}  # fmt: skip


def workload(name: str = "job-a-1", uid: str = "u-a", gpus: int | str = 2, count: int = 1,
             conditions: tuple[dict[str, Any], ...] = (), cq: str = "", active: bool = True,
             rv: str = "1") -> dict[str, Any]:  # fmt: skip
    status: dict[str, Any] = {"conditions": list(conditions)}
    if cq:
        status["admission"] = {"clusterQueue": cq, "podSetAssignments": [
            {"name": "main", "flavors": {"nvidia.com/gpu": "gpu"}, "count": count}]}  # fmt: skip
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": name, "namespace": "team-a", "uid": uid, "resourceVersion": rv,
                     "creationTimestamp": iso(T0)},
        "spec": {"active": active, "queueName": "lq", "podSets": [{"name": "main", "count": count, "template": {
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {
                "limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}}]}}}]},
        "status": status,
    }  # fmt: skip


WAITING = cond("QuotaReserved", "False", T0 + 1, "Pending",
               "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in "
               "flavor gpu, 2 more needed")  # fmt: skip


def admitted(at: float) -> tuple[dict[str, Any], ...]:
    return (cond("QuotaReserved", "True", at, "QuotaReserved", "Quota reserved in ClusterQueue cq"),
            cond("Admitted", "True", at, "Admitted", "The workload is admitted"))  # fmt: skip


class FakeApi:
    """Lists what it holds; watches replay queued events (then end, as a watch timeout does)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.queues = {("team-a", "lq"): "cq"}
        self.gone = False
        self.served = {"v1beta2", "v1beta1"}
        self.lists: list[str] = []
        self.gets: list[str] = []
        self.refuse_queues = False
        self.bad_line: bytes | None = None

    def _check(self, path: str) -> None:
        if path.split("/")[3] not in self.served:
            raise urllib.error.HTTPError(path, 404, "Not Found", None, None)  # type: ignore[arg-type]

    def list_objects(self, path: str) -> tuple[list[dict[str, Any]], str]:
        self._check(path)
        self.lists.append(path)
        return list(self.items), "100"

    def watch_objects(self, path: str, rv: str, timeout_s: int = 300,
                      on_open: Any = None) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        self._check(path)
        if self.gone:
            self.gone = False
            raise Gone(rv)
        out, self.events = self.events, []
        yield from out
        if self.bad_line is not None:  # a line that is not an event, after the queued ones
            line, self.bad_line = self.bad_line, None
            watch_event(line)

    def get_object(self, path: str) -> dict[str, Any]:
        self._check(path)
        self.gets.append(path)
        if self.refuse_queues:
            raise Forbidden(f"403 on {path}")
        ns, lq = path.split("/namespaces/")[1].split("/localqueues/")
        if (ns, lq) not in self.queues:
            raise urllib.error.HTTPError(path, 404, "Not Found", None, None)  # type: ignore[arg-type]
        return {"spec": {"clusterQueue": self.queues[(ns, lq)]}}


class Clock:
    def __init__(self) -> None:
        self.t = T0 + 500

    def __call__(self) -> float:
        return self.t


def collector(
    tmp_path: Path, api: FakeApi | None = None, clock: Any = None
) -> tuple[KueueWorkloadCollector, FakeApi]:
    api = api or FakeApi()
    c = KueueWorkloadCollector("c1", api, tmp_path / "kueue.json", boot_id="b", clock=clock or Clock())  # type: ignore[arg-type]
    return c, api


def run(c: KueueWorkloadCollector, api: FakeApi, *events: tuple[str, dict[str, Any]]) -> list[SchedulerEvent]:
    api.events = list(events)
    c.sync_once()
    return [m for m in c.collect(0) if isinstance(m, SchedulerEvent)]


def brief(evs: list[SchedulerEvent]) -> list[tuple[str, str, float]]:
    return [(e.request_id, e.event, e.ts) for e in evs]


def test_a_workload_life_waits_admission_and_end(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=(WAITING,))]
    first = run(c, api)  # the first round lists
    assert brief(first) == [("u-a", "submit", T0), ("u-a", "pending_reason", T0 + 1)]
    sub, why = first
    assert (sub.scheduler, sub.queue, sub.cluster_queue, sub.account) == (
        "kueue",
        "team-a/lq",
        "cq",
        "team-a",
    )
    assert (sub.name, sub.gpus_per_node, sub.nodes) == ("team-a/job-a-1", 2.0, 1)
    assert why.cause == "policy" and why.reason.startswith("WaitingForQuota: Pending: couldn't assign")
    same = run(c, api, ("MODIFIED", workload(conditions=(WAITING,), rv="2")))
    assert same == [], "an unchanged reason is not sent again"
    fewer = {**WAITING, "message": WAITING["message"].replace("2 more", "1 more")}  # same transition time
    (moved,) = run(c, api, ("MODIFIED", workload(conditions=(fewer,), rv="2b")))
    assert (moved.ts, moved.reason[-13:]) == (T0 + 500, "1 more needed"), (
        "seen now: the condition did not move"
    )
    fin = cond("Finished", "True", T0 + 90, "Succeeded", "Job finished successfully")
    evs = run(c, api, ("MODIFIED", workload(conditions=admitted(T0 + 30), cq="cq", rv="3")),
              ("MODIFIED", workload(conditions=(*admitted(T0 + 30), fin), cq="cq", rv="4")))  # fmt: skip
    assert brief(evs) == [("u-a", "start", T0 + 30), ("u-a", "end", T0 + 90)]
    assert evs[1].reason == "Succeeded: Job finished successfully"
    assert c.rv == "4"
    assert c.wls == {}, "a finished Workload is forgotten: the state file keeps what may still happen"
    assert run(c, api, ("MODIFIED", workload(conditions=(*admitted(T0 + 30), fin), cq="cq", rv="5"))) == []
    assert run(c, api, ("DELETED", workload(conditions=(*admitted(T0 + 30), fin), cq="cq", rv="6"))) == []
    assert c.wls == {}


def test_eviction_is_a_preempt_and_the_wait_after_it_a_new_request(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=admitted(T0 + 5), cq="cq", count=2, gpus=4)]
    assert [e.event for e in run(c, api)] == ["submit", "start"]
    # as jobframework/reconciler.go leaves it: QuotaReserved False with the eviction's message
    words = ("Preempted to accommodate a workload (UID: u-b, JobUID: j-b) due to prioritization in the "
             "ClusterQueue; preemptor path: /cq; preemptee path: /cq")  # fmt: skip
    evicted = (cond("QuotaReserved", "False", T0 + 60, "Pending", words),
               cond("Admitted", "False", T0 + 60, "NoReservation", "The workload has no reservation"),
               cond("Evicted", "True", T0 + 60, "Preempted", words),
               cond("Preempted", "True", T0 + 60, "InClusterQueue", words))  # fmt: skip
    evs = run(c, api, ("MODIFIED", workload(conditions=evicted, count=2, gpus=4, rv="2")))
    assert brief(evs) == [("u-a", "preempt", T0 + 60), ("u-a#2", "submit", T0 + 60),
                          ("u-a#2", "pending_reason", T0 + 60)]  # fmt: skip
    assert evs[0].reason == f"Evicted: Preempted: {words}"[:256]
    assert (evs[2].reason, evs[2].cause) == (f"Evicted: Pending: {words}"[:256], "policy")
    assert (evs[1].gpus_per_node, evs[1].nodes) == (4.0, 2)
    back = run(
        c, api, ("MODIFIED", workload(conditions=admitted(T0 + 120), cq="cq", count=2, gpus=4, rv="3"))
    )
    assert brief(back) == [("u-a#2", "start", T0 + 120)]


def test_evicted_for_node_failures_waits_for_capacity(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=admitted(T0 + 5), cq="cq")]
    run(c, api)
    words = "Workload was evicted as there was not enough free capacity to admit it"
    evicted = (cond("QuotaReserved", "False", T0 + 60, "Pending", words),
               cond("Evicted", "True", T0 + 60, "NodeFailures", words))  # fmt: skip
    evs = run(c, api, ("MODIFIED", workload(conditions=evicted, rv="2")))
    assert [(e.event, e.cause) for e in evs] == [
        ("preempt", None),
        ("submit", None),
        ("pending_reason", "capacity"),
    ]


def test_eviction_and_readmission_unobserved_are_found_at_restart(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=admitted(T0 + 5), cq="cq")]
    run(c, api)
    c.close()
    # while no collector ran: evicted at +60, admitted again at +80; a relist after 410 Gone
    c2, _ = collector(tmp_path, api)
    assert c2.rv == "100" and c2.wls["u-a"].admitted_at == T0 + 5
    api.items = [workload(conditions=(*admitted(T0 + 80), cond("Evicted", "False", T0 + 60, "Preempted")),
                          cq="cq")]  # fmt: skip
    api.gone = True
    c2.sync_once()  # the watch answers 410: relist
    evs = [m for m in c2.collect(0) if isinstance(m, SchedulerEvent)]
    assert brief(evs) == [
        ("u-a", "preempt", T0 + 60),
        ("u-a#2", "submit", T0 + 60),
        ("u-a#2", "start", T0 + 80),
    ]
    assert evs[0].reason.startswith("Evicted (unobserved)")


def test_a_watch_line_that_is_not_an_event_lists_afresh(tmp_path: Path) -> None:
    """A line that is not an event: the events before it are kept, the version is dropped (the
    state file's too), so the next round lists (not watch again from before the same line)."""
    c, api = collector(tmp_path)
    api.items = [workload(conditions=(WAITING,))]
    run(c, api)
    admitted_wl = workload(conditions=admitted(T0 + 9), cq="cq")
    api.events = [("MODIFIED", admitted_wl)]
    api.bad_line = b"<html>502 Bad Gateway</html>"
    with pytest.raises(BadWatchLine, match=r"Kueue workloads: a watch line is not JSON.*listing afresh"):
        c.sync_once()
    assert c.bad_lines == 1 and c.rv == "" and json.loads(c.state_file.read_text())["rv"] == ""
    assert brief([m for m in c.collect(0) if isinstance(m, SchedulerEvent)]) == [("u-a", "start", T0 + 9)]
    api.items = [admitted_wl]
    lists = len(api.lists)
    c.sync_once()  # a fresh list: nothing twice
    assert len(api.lists) == lists + 1 and c.rv == "100" and c.collect(0) == []


def test_deactivated_while_waiting_cancels_and_reactivation_queues_again(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=(WAITING,))]
    run(c, api)
    evs = run(c, api, ("MODIFIED", workload(conditions=(WAITING,), active=False, rv="2")))
    assert [(e.event, e.reason) for e in evs] == [("cancel", "Deactivated")]
    rq = cond("Requeued", "True", T0 + 200, "Reactivated", "The workload was reactivated")
    evs = run(c, api, ("MODIFIED", workload(conditions=(WAITING, rq), rv="3")))
    assert brief(evs) == [("u-a#2", "submit", T0 + 200), ("u-a#2", "pending_reason", T0 + 200)]


def test_deactivated_while_admitted_waits_again_from_its_reactivation(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=admitted(T0 + 5), cq="cq")]
    run(c, api)
    words = "The workload is deactivated"
    off = (
        cond("QuotaReserved", "False", T0 + 60, "Pending", words),
        cond("Evicted", "True", T0 + 60, "Deactivated", words),
    )
    evs = run(c, api, ("MODIFIED", workload(conditions=off, active=False, rv="2")))
    assert [(e.event, e.reason) for e in evs] == [("preempt", f"Evicted: Deactivated: {words}")]
    assert c.pending(T0 + 100) == {}, "not waiting while deactivated"
    rq = cond("Requeued", "True", T0 + 300, "Reactivated", "The workload was reactivated")
    evs = run(c, api, ("MODIFIED", workload(conditions=(WAITING, rq), rv="3")))
    assert brief(evs) == [("u-a#2", "submit", T0 + 300), ("u-a#2", "pending_reason", T0 + 300)]


def test_deleted_and_vanished_workloads_leave_the_queue_once(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [
        workload(conditions=(WAITING,)),
        workload("job-b", "u-b", conditions=admitted(T0 + 3), cq="cq"),
    ]
    run(c, api)
    gone = workload(conditions=(WAITING,))
    gone["metadata"]["deletionTimestamp"] = iso(T0 + 77)
    evs = run(c, api, ("DELETED", gone))
    assert [(e.request_id, e.event, e.reason, e.ts) for e in evs] == [("u-a", "cancel", "Deleted", T0 + 77)]
    api.items = []
    api.gone = True
    c.sync_once()
    evs = [m for m in c.collect(0) if isinstance(m, SchedulerEvent)]
    assert [(e.request_id, e.event, e.reason) for e in evs] == [("u-b", "end", "Deleted (unobserved)")]
    assert c.wls == {}


def test_a_workload_without_gpus_or_already_finished_is_not_a_wait(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    fin = cond("Finished", "True", T0 + 9, "Succeeded")
    api.items = [workload(gpus=0, conditions=(WAITING,)), workload("old", "u-old", conditions=(fin,))]
    assert run(c, api) == []


def test_missing_local_queue_and_admission_checks(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.queues = {}
    missing = cond("QuotaReserved", "False", T0 + 1, "Inadmissible", "LocalQueue lq doesn't exist")
    api.items = [workload(conditions=(missing,))]
    evs = run(c, api)
    assert evs[0].cluster_queue is None  # not known: left out, not invented
    assert (evs[1].cause, evs[1].reason) == (
        "policy",
        "Inadmissible: Inadmissible: LocalQueue lq doesn't exist",
    )
    checks = (cond("QuotaReserved", "True", T0 + 4, "QuotaReserved"),
              cond("Admitted", "False", T0 + 4, "UnsatisfiedChecks", "The workload has not all checks ready"))  # fmt: skip
    evs = run(c, api, ("MODIFIED", workload(conditions=checks, rv="2")))
    assert [(e.event, e.cause, e.reason) for e in evs] == [
        (
            "pending_reason",
            "policy",
            "AdmissionChecks: UnsatisfiedChecks: The workload has not all checks ready",
        )
    ]


def test_state_survives_a_restart_and_a_torn_file_relists(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=(WAITING,))]
    run(c, api)
    c2, _ = collector(tmp_path, api)
    assert run(c2, api) == [], "nothing is sent twice after a restart"
    (tmp_path / "kueue.json").write_text('{"rv": "100", "workloads": {"u-a": {"attempt": "x", "bogus": 1}')
    with caplog.at_level(logging.WARNING):
        c3, _ = collector(tmp_path, api)
    assert "unreadable" in caplog.text and c3.rv == ""
    assert [e.event for e in run(c3, api)] == ["submit", "pending_reason"]


def test_pending_gauge_per_local_and_cluster_queue(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.items = [workload(conditions=(WAITING,)), workload("b", "u-b", conditions=(WAITING,)),
                 workload("c", "u-c", conditions=admitted(T0 + 2), cq="cq")]  # fmt: skip
    run(c, api)
    fams = {f.name: f for f in PendingGauge(c, clock=lambda: T0 + 42).collect()}
    (n,) = fams["gpuslo_kueue_pending_workloads"].samples
    (age,) = fams["gpuslo_kueue_pending_age_seconds"].samples
    assert (n.labels, n.value) == ({"local_queue": "team-a/lq", "cluster_queue": "cq"}, 2)
    assert age.value == 42.0


# ---------------------------------------------------------------------------- hostile objects
HUGE = 2**31 - 1


@pytest.mark.parametrize(
    ("obj", "what"),
    [
        ("not an object", "not an object"),
        ({"metadata": {"name": "x"}}, "metadata.uid is missing"),
        ({"metadata": ["x"]}, "metadata is a list"),
        ({"metadata": {"uid": 7}}, "metadata.uid is a int"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": "many"}}, "spec.podSets is a str"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": [{"count": -1}]}}, "count is -1"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": [{"count": "2"}]}}, "count is '2'"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": [{"count": True}]}}, "count is True"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": [{"count": 2**31}]}}, "not a pod count"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": [{"count": 1, "template": {"spec": {"containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "lots"}}}]}}}]}}, "GPU request unreadable"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": [{"count": 1, "template": {"spec": {"containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "1e999"}}}]}}}]}}, "GPUs per pod"),
        ({"metadata": {"uid": "u"}, "spec": {"podSets": [{"count": 1, "template": {"spec": {"containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "-2"}}}]}}}]}}, "GPUs per pod"),
        ({"metadata": {"uid": "u"}, "spec": {"active": "yes"}}, "spec.active"),
        ({"metadata": {"uid": "u"}, "status": {"conditions": {"type": "Admitted"}}}, "status.conditions is a dict"),
        ({"metadata": {"uid": "u"}, "status": {"conditions": [None, 3]}}, "status.conditions[1] is a int"),
        ({"metadata": {"uid": "u"}, "status": {"conditions": [{"type": "Admitted", "lastTransitionTime": "soon"}]}},
         "not an RFC 3339 time"),
        ({"metadata": {"uid": "u", "creationTimestamp": 1780000000}}, "creationTimestamp is a int"),
        ({"metadata": {"uid": "u"}, "status": {"admission": "cq"}}, "status.admission is a str"),
        ({"metadata": {"uid": "u" * 257}}, "metadata.uid is 257 characters"),  # never cut into another's
    ],
)  # fmt: skip
def test_hostile_workloads_are_named_errors(obj: Any, what: str) -> None:
    with pytest.raises(Malformed) as exc:
        read(obj)
    assert what in str(exc.value)


def test_hostile_workloads_are_skipped_with_a_log_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c, api = collector(tmp_path)
    too_many_pods = workload(
        "wide", "u-wide", gpus=1, count=HUGE, conditions=(WAITING,)
    )  # > the wire's 100000 nodes
    too_many_gpus = workload("fat", "u-fat", gpus=5000, conditions=(WAITING,))  # > 1024 per node
    ugly = workload('q"\\\x00' + "n" * 600, "u-ugly", conditions=(WAITING,))
    api.items = [{"metadata": {"name": "bad"}}, "garbage", too_many_pods, too_many_gpus, ugly,  # type: ignore[list-item]
                 workload(conditions=(WAITING,))]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.kueue"):
        evs = run(c, api)
    assert sorted({e.request_id for e in evs}) == ["u-a", "u-ugly"]
    assert c.skipped == 2 + 2 * 2  # two unreadable objects; two events each of two shapes the wire refuses
    assert "metadata.uid is missing" in caplog.text and "less than or equal to 100000" in caplog.text
    u = next(e for e in evs if e.request_id == "u-ugly")
    assert len(u.name) == 256 and u.name.startswith('team-a/q"\\\x00')
    for e in evs:
        assert decode(encode(e)) == e  # what is sent is what the ingest accepts
    c.skipped = 0
    assert run(c, api, ("MODIFIED", too_many_pods)) == [] and c.skipped == 0, "not retried every round"


# ---------------------------------------------------------------------------- wire and store
def _event(**kw: Any) -> SchedulerEvent:
    base: dict[str, Any] = dict(source="s", boot_id="b", seq=0, cluster="c1", ts=T0, scheduler="kueue",
                                event="pending_reason", request_id="r", gpus_per_node=2)  # fmt: skip
    return SchedulerEvent(**{**base, **kw})


def test_wire_old_messages_unchanged_and_new_fields_bounded() -> None:
    old = _event(scheduler="slurm")
    raw = encode(old)
    assert b"cause" not in raw and b"cluster_queue" not in raw, "unset: left out of the bytes"
    assert decode(raw) == old
    new = _event(cause="fragmentation", cluster_queue="cq")
    assert decode(encode(new)) == new
    for bad in (b'"cause":"weather"', b'"cluster_queue":"' + b"x" * 257 + b'"', b'"scheduler":"volcano"'):
        msg = (
            raw[:-1] + b"," + bad + b"}"
            if b"scheduler" not in bad
            else raw.replace(b'"scheduler":"slurm"', bad)
        )
        with pytest.raises(WireError):
            decode(msg)


def _gpus(node: str, free: int, held: int, at: float) -> GpuSampleBatch:
    from gpuslo.wire import Allocation

    gpus = tuple(
        GpuSample(index=i, uuid=f"GPU-{node}-{i}", fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0},
                  allocations=(Allocation(scheduler="k8s", id=f"p{i}"),) if i < held else ())
        for i in range(free + held)
    )  # fmt: skip
    return GpuSampleBatch(source=node, boot_id="b", seq=int(at), cluster="c1", ts=at, node=node, interval_s=10.0,
                          gpus=gpus)  # fmt: skip


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    ("said", "free", "want"),
    [
        ("policy", 8, "policy"),  # Kueue's quota holds it back while devices are free
        ("policy", 1, "capacity"),  # the free devices cannot hold it either
        ("fragmentation", 8, "fragmentation"),
        ("capacity", 8, "capacity"),  # beyond the ClusterQueue's quota: capacity whatever is free
        ("policy", None, "policy"),  # no node seen: the scheduler's word
        (None, 8, "policy"),  # no cause given: the engine's own judgement, as before
        (None, 1, "capacity"),
    ],
)
def test_starvation_prefers_the_scheduler_cause_unless_devices_say_capacity(
    tmp_path: Path, said: str | None, free: int | None, want: str
) -> None:
    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        msgs: list[Any] = [
            _event(event="submit", ts=T0, queue="team-a/lq"),
            _event(
                event="pending_reason", ts=T0 + 5, seq=1, cause=said, reason="WaitingForQuota: Pending: x"
            ),
            _event(event="pending_reason", ts=T0 + 50, seq=2, cause="capacity", reason="after the opening"),
        ]
        if free is not None:
            msgs += [_gpus("n0", free, 8 - free, T0 + 25), _gpus("n0", free, 8 - free, T0 + 35)]
        rep = Ingestor(store).ingest(Raw(f"t/{i}", encode(m)) for i, m in enumerate(msgs))
        assert not rep.rejected, rep.rejected
        cfg = RulesConfig.model_validate({"starvation": {"threshold_s": 30}})
        s = summary(store, cfg, T0, T0 + 100, cluster="c1")
    finally:
        store.close()
    (inc,) = s.starvation_incidents
    assert (inc.cause, inc.opened, inc.reason) == (want, T0 + 30, "WaitingForQuota: Pending: x")


def test_a_store_made_before_the_columns_is_upgraded(tmp_path: Path) -> None:
    store = ChdbStore(tmp_path / "store")
    try:
        for stmt in SCHEMA.create():
            if "CREATE TABLE IF NOT EXISTS sched_events" in stmt:
                stmt = stmt.replace("    cause LowCardinality(String) DEFAULT '',\n", "").replace(
                    "    cluster_queue LowCardinality(String) DEFAULT '',\n", ""
                )
            store.execute(stmt)
        store.execute("INSERT INTO sched_events (cluster, scheduler, event, request_id, ts) "
                      "VALUES ('c1', 'slurm', 'submit', 'old', now64(3))")  # fmt: skip
        store.migrate(SCHEMA)  # what every process does when it opens the store (the rules too)
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest([Raw("t/0", encode(_event(cause="policy", cluster_queue="cq")))])
        assert not rep.rejected
        rows = store.query("SELECT request_id, cause, cluster_queue FROM sched_events ORDER BY request_id")
    finally:
        store.close()
    assert rows == [{"request_id": "old", "cause": "", "cluster_queue": ""},
                    {"request_id": "r", "cause": "policy", "cluster_queue": "cq"}]  # fmt: skip


def test_older_kueue_is_read_through_v1beta1_and_no_kueue_is_said(tmp_path: Path) -> None:
    c, api = collector(tmp_path)
    api.served = {"v1beta1"}  # Kueue before v0.15
    api.items = [workload(conditions=(WAITING,))]
    assert [e.event for e in run(c, api)] == ["submit", "pending_reason"]
    assert c.version == "kueue.x-k8s.io/v1beta1" and api.lists[-1] == "/apis/kueue.x-k8s.io/v1beta1/workloads"
    assert api.gets == ["/apis/kueue.x-k8s.io/v1beta1/namespaces/team-a/localqueues/lq"]
    c2, _ = collector(tmp_path, api)  # the state file keeps the version: resumes by watch, no list
    n = len(api.lists)
    run(c2, api)
    assert c2.version == "kueue.x-k8s.io/v1beta1" and len(api.lists) == n
    api.served = set()
    (tmp_path / "fresh").mkdir()
    c3, _ = collector(tmp_path / "fresh", api)
    with pytest.raises(NotServed, match="is Kueue installed"):
        c3.sync_once()
    assert WORKLOADS.startswith("/apis/kueue.x-k8s.io/v1beta2/")


def test_an_unknown_local_queue_is_asked_again_later_and_a_refusal_is_contained(tmp_path: Path) -> None:
    clock = Clock()
    c, api = collector(tmp_path, clock=clock)
    api.queues = {}
    api.items = [workload(conditions=(WAITING,))]
    assert run(c, api)[0].cluster_queue is None
    api.queues = {("team-a", "lq"): "cq"}  # the LocalQueue is made later
    run(c, api, ("MODIFIED", workload(conditions=(WAITING,), rv="2")))
    assert len(api.gets) == 1, "not asked again at every event"
    clock.t += QUEUE_RETRY_S + 1
    run(c, api, ("MODIFIED", workload(conditions=(WAITING,), rv="3")))
    assert len(api.gets) == 2 and c.wls["u-a"].cluster_queue == "cq"
    assert c.pending(clock.t) == {("team-a/lq", "cq"): (1, clock.t - T0)}
    (tmp_path / "fresh").mkdir()
    c2, api2 = collector(tmp_path / "fresh")
    api2.refuse_queues = True  # RBAC without localqueues: the events still flow
    api2.items = [workload(conditions=(WAITING,))]
    assert [e.event for e in run(c2, api2)] == ["submit", "pending_reason"]


def test_first_seen_after_evictions_keeps_the_attempt_ids(tmp_path: Path) -> None:
    """A collector that starts late (or lost its state file) names the wait after the second
    eviction UID#3, from Kueue's own eviction count, as one that saw them would have."""
    c, api = collector(tmp_path)
    w = workload(conditions=(WAITING, cond("Evicted", "True", T0 + 70, "Preempted", "p")))
    w["status"]["schedulingStats"] = {"evictions": [
        {"reason": "Preempted", "underlyingCause": "", "count": 1},
        {"reason": "PodsReadyTimeout", "underlyingCause": "", "count": 1}]}  # fmt: skip
    api.items = [w]
    assert brief(run(c, api)) == [("u-a#3", "submit", T0 + 70), ("u-a#3", "pending_reason", T0 + 70)]
    w["status"]["schedulingStats"]["evictions"][0]["count"] = -4
    with pytest.raises(Malformed, match="not a count"):
        read(w)


def test_the_shipped_kueue_role_only_reads() -> None:
    import yaml

    docs = [
        d
        for d in yaml.safe_load_all((ROOT.parent / "deploy/kubernetes/collector-kueue.yaml").read_text())
        if d
    ]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert role["rules"] == [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads", "localqueues"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpuslo-collector", "namespace": "gpuslo"}
    ]


def test_pods_kueue_admitted_count_once_through_their_workload(tmp_path: Path) -> None:
    from gpuslo.agent.k8s_watch import K8sPodCollector
    from gpuslo.agent.kueue import POD_SET_LABEL

    def pod(name: str, uid: str, labels: dict[str, str], phase: str = "Pending") -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "team-a", "uid": uid, "labels": labels,
                             "creationTimestamp": iso(T0), "resourceVersion": "1"},
                "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
                "status": {"phase": phase}}  # fmt: skip

    class Pods:
        def __init__(self) -> None:
            self.items: list[dict[str, Any]] = []

        def list_pods(self) -> tuple[list[dict[str, Any]], str]:
            return list(self.items), "1"

    api = Pods()
    api.items = [pod("plain", "p1", {}), pod("old-kueue", "p2", {POD_SET_LABEL: "main"})]
    before = K8sPodCollector("c1", api, tmp_path / "pods.json", boot_id="b")  # type: ignore[arg-type]
    before.sync_once()
    assert {m.request_id for m in before.collect(0)} == {"p1", "p2"}  # type: ignore[union-attr]
    # --kueue from now on: a new Kueue pod is the Workload's; the one followed already ends as it would
    api.items = [pod("plain", "p1", {}), pod("old-kueue", "p2", {POD_SET_LABEL: "main"}, "Succeeded"),
                 pod("new-kueue", "p3", {POD_SET_LABEL: "main"})]  # fmt: skip
    after = K8sPodCollector("c1", api, tmp_path / "pods.json", boot_id="b2", skip_labels=(POD_SET_LABEL,))  # type: ignore[arg-type]
    after.rv = ""  # relist
    after.sync_once()
    got = {(m.request_id, m.event) for m in after.collect(0)}  # type: ignore[union-attr]
    assert ("p2", "end") in got and not any(r == "p3" for r, _ in got)


def test_pending_age_names_each_requests_cluster_queue(tmp_path: Path) -> None:
    """The scheduler dashboard's pending table (and the engine's pending_age) keep Kueue's
    ClusterQueue beside the LocalQueue: the latest one a request's events named (the collector
    learns it after the submit), '' for schedulers without one."""
    evs = [
        _event(event="submit", request_id="a", queue="ns/lq", ts=T0),
        _event(event="pending_reason", request_id="a", queue="ns/lq", cluster_queue="cq-1", ts=T0 + 10),
        _event(event="submit", request_id="b", queue="ns/lq", cluster_queue="cq-1", ts=T0 + 40),
        _event(event="submit", request_id="c", queue="ns/lq", ts=T0 + 50),  # its ClusterQueue not known yet
        _event(event="submit", request_id="d", queue="ns/lq", cluster_queue="cq-2", ts=T0 + 60),
        _event(
            event="start", request_id="d", queue="ns/lq", cluster_queue="cq-2", ts=T0 + 70
        ),  # admitted: gone
        _event(event="submit", request_id="s", queue="batch", scheduler="slurm", ts=T0 + 20),
    ]
    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest(
            [Raw(f"t/{i}", encode(e.model_copy(update={"seq": i}))) for i, e in enumerate(evs)]
        )
        assert not rep.rejected
        rows = pending_age(store, T0 + 100)
    finally:
        store.close()
    got = [(r["queue"], r["cluster_queue"], r["pending"], r["max_age_s"]) for r in rows]
    assert got == [("batch", "", 1, pytest.approx(80)), ("ns/lq", "", 1, pytest.approx(50)),
                   ("ns/lq", "cq-1", 2, pytest.approx(100))]  # fmt: skip


@pytest.mark.parametrize("created", [0.0, 946684799.0])
def test_a_workload_created_before_the_wire_is_not_said_to_wait_from_now(
    tmp_path: Path, created: float
) -> None:
    """A creation time of 1970 (0.0) is a time, not "none": the submit the wire refuses (before
    2000) is skipped and counted, never stamped with the collector's clock (a wait of zero)."""
    c, api = collector(tmp_path)
    wl = workload(conditions=(WAITING,))
    wl["metadata"]["creationTimestamp"] = iso(created)
    api.items = [wl]
    evs = run(c, api)
    assert [e.event for e in evs] == ["pending_reason"] and c.skipped == 1


def test_one_workload_that_raises_is_skipped_and_the_watch_goes_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever looking at one Workload raises beyond Malformed (a shape no reader foresaw) skips it,
    counted: raised, it ended the list before the resourceVersion was kept, and every later list
    met it again (no Workload of the cluster followed any more)."""
    import gpuslo.agent.kueue as kueue

    real = kueue.classify

    def classify_(reason: str, message: str) -> Any:
        if "boom" in message:
            raise KeyError("unforeseen")
        return real(reason, message)

    monkeypatch.setattr(kueue, "classify", classify_)
    c, api = collector(tmp_path)
    bad = workload("bad", "u-bad", conditions=(cond("QuotaReserved", "False", T0 + 1, "Pending", "boom"),))
    api.items = [bad, workload(conditions=(WAITING,))]
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.kueue"):
        evs = run(c, api)
    assert {(e.request_id, e.event) for e in evs} >= {("u-a", "submit"), ("u-a", "pending_reason")}
    assert c.rv == "100" and c.skipped == 1
    assert "Kueue workload team-a/bad skipped: KeyError" in caplog.text


@pytest.mark.parametrize(
    "readings", [[T0 + 500] * 3, [T0 + 500, T0 + 400, T0 + 300]], ids=["one reading", "set back"]
)
def test_every_rewritten_kueue_reason_is_its_own_event_in_order(
    readings: list[float], tmp_path: Path
) -> None:
    """Kueue rewrites a waiting Workload's message, the condition's time staying: each new one is
    said when seen, after the one before it by at least a millisecond of the store's, whatever
    the clock says (two in one reading, or a clock set back, made one the other's event)."""
    clock = Clock()
    c, api = collector(tmp_path, clock=clock)
    api.items = [workload(conditions=(WAITING,))]
    said = [e for e in run(c, api) if e.event == "pending_reason"]
    for i, t in enumerate(readings):
        clock.t = t
        waiting = cond(
            "QuotaReserved", "False", T0 + 1, "Pending", f"insufficient quota, {3 + i} more needed"
        )
        said += [e for e in run(c, api, ("MODIFIED", workload(conditions=(waiting,), rv=str(2 + i))))
                 if e.event == "pending_reason"]  # fmt: skip
    assert len(said) == 4
    for cut in (int, round):
        kept = [cut(e.ts * 1000) for e in said]
        assert kept == sorted(set(kept)), [e.ts for e in said]


@pytest.mark.parametrize(
    "spoil",
    [
        lambda w: w["status"].update(conditions={"type": "Admitted"}),
        lambda w: w["metadata"].update(creationTimestamp=1780000000),
        lambda w: w["spec"].update(active="yes"),
        lambda w: w["spec"]["podSets"][0].update(count=2**31),
    ],
    ids=["conditions", "creationTimestamp", "active", "count"],
)
@pytest.mark.parametrize("admitted_first", [False, True])
def test_a_followed_workload_deleted_in_a_shape_it_cannot_read_still_ends(
    tmp_path: Path, spoil: Any, admitted_first: bool
) -> None:
    """Its DELETED event was skipped as unreadable, so a Workload followed before never ended:
    its request stayed open until a relist, which a resuming watch never makes. It ends now (the
    collector's clock) and is forgotten; other Workloads' events go on."""
    c, api = collector(tmp_path)
    conds = admitted(T0 + 3) if admitted_first else (WAITING,)
    api.items = [workload(conditions=conds, cq="cq" if admitted_first else "")]
    run(c, api)
    gone = workload(conditions=conds, cq="cq" if admitted_first else "", rv="7")
    spoil(gone)
    evs = run(c, api, ("DELETED", gone), ("ADDED", workload("job-b", "u-b", conditions=(WAITING,), rv="8")))
    kind = "end" if admitted_first else "cancel"
    assert [(e.request_id, e.event, e.ts, e.gpus_per_node) for e in evs if e.request_id == "u-a"] == [
        ("u-a", kind, T0 + 500, 2.0)
    ]
    assert ("u-b", "submit") in [(e.request_id, e.event) for e in evs]
    assert "u-a" not in c.wls and c.skipped == 1


@pytest.mark.parametrize(("case", "parts", "want"), SHAPES, ids=[s[0] for s in SHAPES])
def test_a_pod_sets_gpus_count_its_init_containers_and_sidecars(
    case: str, parts: list[tuple[str, int]], want: int
) -> None:
    """Kueue reserves quota for a pod set's pods as the scheduler counts them (init containers
    and sidecars included; the table is checked against the real scheduler): a Workload whose
    init container asks 3 GPUs beside 1 read as asking 1 per pod."""
    obj = workload(count=3)
    obj["spec"]["podSets"][0]["template"]["spec"] = pod_spec(parts)
    wl = read(obj)
    assert (wl.nodes, wl.gpus_per_node) == (3, want)


@pytest.mark.integration  # chDB
@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        ({}, {"kueue": 300, "k8s": 300, "slurm": 300}),
        ({"team-a": 60}, {"kueue": 60, "k8s": 60, "slurm": 300}),  # the namespace's, its Workloads' too
        ({"team-a/lq": 90}, {"kueue": 90, "k8s": 300, "slurm": 300}),
        ({"team-a": 60, "team-a/lq": 90}, {"kueue": 90, "k8s": 60, "slurm": 300}),  # the queue's own first
        ({"team-b": 60, "lq": 60}, {"kueue": 300, "k8s": 300, "slurm": 300}),  # another's; a LocalQueue alone
    ],
)
def test_a_namespace_threshold_covers_its_kueue_workloads(
    tmp_path: Path, overrides: dict[str, float], want: dict[str, float]
) -> None:
    """A per-namespace threshold (``queue_threshold_s: {team-a: 60}``) was left out of the waits of
    the namespace's Kueue Workloads, whose queue is ``team-a/lq``: they opened at the default. A
    Slurm job whose account is named like the namespace keeps its partition's (the default here).
    The what-if engine's threshold (Starvation.threshold_for) is the store query's."""
    queue = {"kueue": "team-a/lq", "k8s": "team-a", "slurm": "gpu"}
    msgs = [
        _event(event="submit", ts=T0, seq=i, scheduler=s, request_id=s, queue=queue[s], account="team-a")
        for i, s in enumerate(queue)
    ]
    cfg = RulesConfig.model_validate({"starvation": {"threshold_s": 300, "queue_threshold_s": overrides}})
    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest(Raw(f"t/{i}", encode(m)) for i, m in enumerate(msgs))
        assert not rep.rejected, rep.rejected
        s = summary(store, cfg, T0, T0 + 1000, cluster="c1")
    finally:
        store.close()
    assert {i.request_id: i.opened - T0 for i in s.starvation_incidents} == want
    assert {s: cfg.starvation.threshold_for(queue[s], s, "team-a") for s in queue} == want


@pytest.mark.parametrize(
    ("labels", "followed"),
    [
        ({}, True),  # a pod Kueue does not manage
        ({"kueue.x-k8s.io/podset": "main"}, False),  # a Job's pod, admitted
        ({"kueue.x-k8s.io/managed": "true", "kueue.x-k8s.io/queue-name": "lq"}, False),  # pod integration
        ({"kueue.x-k8s.io/queue-name": "lq"}, True),  # named a queue, yet no webhook took it
    ],
)
def test_a_pod_kueue_manages_as_its_own_workload_waits_once(
    tmp_path: Path, labels: dict[str, str], followed: bool
) -> None:
    """Kueue's pod webhook labels a plain pod it manages ``kueue.x-k8s.io/managed`` and gates it at
    its creation; the podset label comes only at admission. The pod collector beside the Workload
    collector (``--kueue``) followed such a pod from its creation: one wait counted twice."""
    from gpuslo.agent.k8s_watch import K8sPodCollector
    from gpuslo.agent.kueue import KUEUE_POD_LABELS

    gated = {
        "metadata": {"name": "p", "namespace": "team-a", "uid": "p1", "labels": labels,
                     "creationTimestamp": iso(T0), "resourceVersion": "1"},
        "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                 "schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
             "message": "Scheduling is blocked due to non-empty scheduling gates", "lastTransitionTime": iso(T0)}]},
    }  # fmt: skip

    class Pods:
        def list_pods(self) -> tuple[list[dict[str, Any]], str]:
            return [gated], "1"

    c = K8sPodCollector("c1", Pods(), tmp_path / "pods.json", boot_id="b", skip_labels=KUEUE_POD_LABELS)  # type: ignore[arg-type]
    c.sync_once()
    got = {(m.request_id, m.event) for m in c.collect(0)}  # type: ignore[union-attr]
    assert got == ({("p1", "submit"), ("p1", "pending_reason")} if followed else set())

"""The idle-reclaim loop reads a holder's scheduler requests as the collectors write them, not
as its samples name it: a Slurm job requeued runs again as request ``ID#2`` (agent/slurm.py,
its first run ended by a ``preempt``), and a pod's samples name it ``namespace/name`` (the node
agent's PodResources and dcgm-exporter views) while its events name its UID (the k8s-events
collector). Each case is worked out by hand from docs/alerting.md; the real slurmctld and
kube-apiserver are in tests/test_reclaim_slurm.py and tests/test_reclaim_k8s.py."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.actions import NO_POD_UID, KubeActor, Reclaimer
from gpuslo.rules.config import RulesConfig, parse
from gpuslo.rules.reclaim import idle_holders
from gpuslo.rules.reclaim_round import reclaim_round
from gpuslo.wire import SchedulerEvent
from tests import helpers as h
from tests.reclaim_fleet import ACTIVE, IDLE, Holder, batches
from tests.test_reclaim import NOW, MemoryLog, Recording, _holder, _told

pytestmark = pytest.mark.integration  # a chDB store each: over 0.7 s

# idle 1800 s, then a grace period of 600 s after the notice; rounds every 300 s
CFG = {
    "enabled": True,
    "idle_after_s": 1800,
    "action": {"mode": "on", "grace_s": 600, "allow_queues": ["gpu"]},
}


def _cfg(**action: Any) -> RulesConfig:
    return parse({"reclaim": {**CFG, "action": {**CFG["action"], **action}}})


def _requeued(at: float, again: float | None) -> list[Any]:
    """What the Slurm collector sends when Slurm requeues job 7 at ``at`` (it was seen running):
    the run ends as a preempt, the wait after it is request 7#2, which starts at ``again``."""
    out = [h.sched("preempt", "7", at, queue="gpu"), h.sched("submit", "7#2", at, queue="gpu")]
    return out + ([h.sched("start", "7#2", again, queue="gpu")] if again is not None else [])


def _rounds(
    store: ChdbStore, cfg: RulesConfig, actor: Recording, times: range
) -> tuple[list[str], list[float]]:
    """(the decisions, the rounds at which job 7 was noticed) of service-like rounds at ``times``."""
    outcomes: list[str] = []
    noticed: list[float] = []
    for t in times:
        alerts, j = reclaim_round(store, cfg, {"slurm": actor}, float(t))
        outcomes += [a["outcome"] for a in (j or {}).get("actions", [])]
        noticed += [float(t)] * any(a.labels.get("job") == "7" for a in alerts)
    return outcomes, noticed


@pytest.mark.parametrize("acted_before", [False, True])
def test_a_requeued_job_that_runs_again_idle_is_noticed(store: ChdbStore, acted_before: bool) -> None:
    """Job 7 started at NOW-3600; Slurm requeues it at NOW+300 (the action's requeue, or a node
    failure), it runs again from NOW+600 under its id: busy to NOW+900, then idle. Idle 1800 s at
    NOW+2700: noticed from the first round at or after it (NOW+2700). Requeued by the action
    before: no second action (its log counts from its first run's start). Requeued by Slurm (the
    first run busy): the action once, a grace period after the first notice (NOW+3300). Was: the
    first run's preempt ended the job for ever: never noticed again, never acted on."""
    cfg = _cfg(slurm="requeue")
    first = (lambda t: IDLE) if acted_before else (lambda t: ACTIVE)
    write(store, [h.sched("submit", "7", NOW - 3610, queue="gpu"), h.sched("start", "7", NOW - 3600, queue="gpu"),
                  *batches("n1", [Holder("7", (0,), first)], NOW - 3600, NOW + 300)])  # fmt: skip
    rec = Recording()
    before, _ = _rounds(store, cfg, rec, range(int(NOW - 600), int(NOW + 1), 600))
    assert before == (["started", "done"] if acted_before else [])
    write(store, [*_requeued(NOW + 300, NOW + 600),
                  *batches("n1", [Holder("7", (0,), lambda t: ACTIVE if t < NOW + 900 else IDLE)], NOW + 600,
                           NOW + 6000)])  # fmt: skip
    (x,) = idle_holders(store, cfg, NOW + 2700)
    assert (x.id, x.idle_since, x.held_since, x.started, x.uid) == (
        "7",
        NOW + 900,
        NOW + 600,
        NOW - 3600,
        "7#2",
    )
    after, noticed = _rounds(store, cfg, rec, range(int(NOW + 600), int(NOW + 6000), 300))
    assert noticed and noticed[0] == NOW + 2700
    assert after == ([] if acted_before else ["started", "done"])
    assert rec.calls == [("requeue", "7")]


def test_a_requeued_job_waiting_again_holds_nothing(store: ChdbStore) -> None:
    """Requeued at NOW-60, pending since (7#2 not started): samples still naming it (an agent
    behind) do not make it a holder; started again, it is one. Events sent twice (a collector
    restarted without its state: rows the store has not merged yet) read the same."""
    cfg = _cfg()
    write(store, [h.sched("start", "7", NOW - 7200, queue="gpu"), *_requeued(NOW - 60, None),
                  *batches("n1", [Holder("7", (0,), lambda t: IDLE)], NOW - 7200, NOW)])  # fmt: skip
    assert idle_holders(store, cfg, NOW) == []
    write(store, [h.sched("start", "7", NOW - 7200, queue="gpu"), *_requeued(NOW - 60, None)])
    assert idle_holders(store, cfg, NOW) == []
    write(store, [h.sched("start", "7#2", NOW - 30, queue="gpu")] * 2)
    (x,) = idle_holders(store, cfg, NOW)
    assert (x.held_since, x.uid) == (NOW - 30, "7#2")


@pytest.mark.parametrize("kind", ["end", "cancel", "preempt"])
def test_an_end_in_the_second_of_the_start_ends_the_request(store: ChdbStore, kind: str) -> None:
    """A schedule's times are whole seconds: a pod started and ended in one second (or a Slurm
    job requeued in the second it started) has both at one time; the end counts (argMax chose
    between them by chance), and the Slurm job running again is its request 7#2."""
    write(store, [_pod_event("start", "u-1", NOW - 3600), _pod_event(kind, "u-1", NOW - 3600),
                  *_pod_samples(NOW - 3600, NOW)])  # fmt: skip
    assert idle_holders(store, _cfg(), NOW) == []
    write(store, [h.sched("start", "7", NOW - 7200, queue="gpu"), *_requeued(NOW - 7200, NOW - 7100),
                  *batches("n2", [Holder("7", (0,), lambda t: IDLE)], NOW - 7100, NOW)])  # fmt: skip
    assert [(x.id, x.uid, x.held_since) for x in idle_holders(store, _cfg(), NOW)] == [
        ("7", "7#2", NOW - 7100)
    ]


def _pod_event(event: str, uid: str, ts: float, name: str = "gpu/p") -> SchedulerEvent:
    """The k8s-events collector's event of a pod: its UID the request, its namespace/name the name."""
    return SchedulerEvent(**h.env("k8s-collector", ts), scheduler="k8s", event=event, request_id=uid, name=name,  # type: ignore[arg-type]
                          queue="gpu", account="gpu", gpus_per_node=1.0, nodes=1)  # fmt: skip


def _pod_samples(start: float, end: float, name: str = "gpu/p") -> list[Any]:
    """Samples as the node agent sends them for a pod: its id is namespace/name (PodResources)."""
    return batches("n1", [Holder(name, (0,), lambda t: IDLE, scheduler="k8s", name=name, queue="gpu", user="",
                                 account="gpu")], start, end)  # fmt: skip


class Api:
    """The API server's side of a delete, recorded: (method, path, body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def __call__(self, method: str, path: str, body: Any, ct: str) -> Any:
        self.calls.append((method, path, body))
        return {}


def _pod_rounds(store: ChdbStore, api: Api, times: range) -> list[str]:
    out: list[str] = []
    for t in times:
        _, j = reclaim_round(store, _cfg(), {"k8s": KubeActor(api)}, float(t))
        out += [a["outcome"] for a in (j or {}).get("actions", [])]
    return out


def test_a_pod_is_known_by_its_uid_and_deleted_with_it(store: ChdbStore) -> None:
    """Pod gpu/p (UID u-1) started at NOW-3600, idle since. Its delete names u-1 as the
    precondition (was: "gpu/p", the samples' id, which the API server refuses with a 409 that
    was recorded as done: the pod never deleted). Its end, as its events say, ends it as a holder
    (was: its events were looked up by "gpu/p" and never found)."""
    write(store, [_pod_event("submit", "u-1", NOW - 3700), _pod_event("start", "u-1", NOW - 3600),
                  *_pod_samples(NOW - 3600, NOW + 600)])  # fmt: skip
    (x,) = idle_holders(store, _cfg(), NOW)
    assert (x.id, x.job, x.uid, x.held_since, x.started) == ("gpu/p", "gpu/p", "u-1", NOW - 3600, NOW - 3600)
    api = Api()
    assert _pod_rounds(store, api, range(int(NOW), int(NOW + 601), 300)) == ["started", "done"]
    body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": "u-1"}}
    assert api.calls == [("DELETE", "/api/v1/namespaces/gpu/pods/p", body)]
    write(store, [_pod_event("end", "u-1", NOW + 590)])
    assert idle_holders(store, _cfg(), NOW + 600) == []


def test_a_pod_that_took_the_name_is_another_holder(store: ChdbStore) -> None:
    """gpu/p (u-1) deleted by the action; a new pod takes the name (u-2, started NOW+1200),
    idle: it is judged on its own (its start, its own log: u-1's `done` does not count for it)
    and deleted with its own UID."""
    write(store, [_pod_event("start", "u-1", NOW - 3600), *_pod_samples(NOW - 3600, NOW + 600)])
    api = Api()
    assert _pod_rounds(store, api, range(int(NOW), int(NOW + 601), 300)) == ["started", "done"]
    write(store, [_pod_event("end", "u-1", NOW + 650), _pod_event("submit", "u-2", NOW + 1100),
                  _pod_event("start", "u-2", NOW + 1200), *_pod_samples(NOW + 1200, NOW + 5000)])  # fmt: skip
    (x,) = idle_holders(store, _cfg(), NOW + 3000)
    assert (x.uid, x.held_since, x.idle_since) == ("u-2", NOW + 1200, NOW + 1200)
    assert _pod_rounds(store, api, range(int(NOW + 3000), int(NOW + 5000), 300)) == ["started", "done"]
    assert [c[2]["preconditions"]["uid"] for c in api.calls] == ["u-1", "u-2"]


@pytest.mark.parametrize("action", ["delete", "suspend"])
def test_a_pod_whose_uid_is_unknown_is_never_deleted_by_name(store: ChdbStore, action: str) -> None:
    """No event of the pod (no k8s-events collector, or Kueue's pods, followed through their
    Workload): a delete is refused, once, and no call is made (a pod that took the name would be
    deleted in its place). A suspend, which finds the pod's Workload by its owners, still goes."""
    write(store, _pod_samples(NOW - 3600, NOW + 600))
    (x,) = idle_holders(store, _cfg(), NOW)
    assert x.uid == ""
    api = Api()
    out: list[str] = []
    for t in range(int(NOW), int(NOW + 601), 300):
        _, j = reclaim_round(store, _cfg(kubernetes=action), {"k8s": KubeActor(api)}, float(t))
        out += [a["outcome"] for a in (j or {}).get("actions", [])]
        out += [a["reason"] for a in (j or {}).get("actions", []) if a["outcome"] == "refused"]
    if action == "delete":
        assert out == ["refused", NO_POD_UID] and api.calls == []
    else:
        assert out[:1] == ["started"] and [m for m, _, _ in api.calls][:1] == ["GET"]


def test_a_suspend_never_touches_a_pod_that_took_the_name() -> None:
    """The pod of that name now has another UID: already gone, no Workload patched."""
    from dataclasses import replace

    calls: list[str] = []

    def req(method: str, path: str, body: Any, ct: str) -> Any:
        calls.append(method)
        return {"metadata": {"uid": "u-2"}} if path.endswith("/pods/p") else {"items": []}

    x = replace(_holder(), scheduler="k8s", id="gpu/p", name="gpu/p", queue="gpu", uid="u-1")
    out = KubeActor(req).act("suspend", x)
    assert out.ok and "now is another one" in out.reason and calls == ["GET"]


def test_a_refusal_is_recorded_once_while_its_state_holds() -> None:
    """Held its GPUs less than the grace period (its start reported after its idle samples
    began: an agent mapping a reused GPU late, a clock off): one `refused` row over the rounds
    (the reason counted the seconds held, a new reason, and a row, every round)."""
    from dataclasses import replace

    log = MemoryLog()
    on = _cfg()
    recent = replace(_holder(held_since=NOW - 300), data_end=NOW + 240)
    _told(on, log, recent)
    rec = Recording()
    for k in range(5):
        Reclaimer(on, log, {"slurm": rec}).step([recent], NOW + 60 * k)
    refused = [r["reason"] for r in log.rows if r["outcome"] == "refused"]
    assert len(refused) == 1 and "less than the grace period" in refused[0] and rec.calls == []

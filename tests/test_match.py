"""The rules' label matchers (``match``) narrow the holder-side numbers before they are cut to
the top N, and fair share is shared out over the matched set. Every expected value is worked
out by hand in the comments, from the metric definitions, not from the SQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup
from gpuslo.rules.config import RulesConfig, parse
from gpuslo.rules.evaluate import fair_share, idle_by_owner, summary
from gpuslo.rules.model import to_json
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import Allocation, GpuSample
from tests import helpers as h
from tests import hostile
from tests.helpers import T0

# each case in its own window of whole minutes (the rollups can answer them too), one store
HOLDERS = (T0, T0 + 60)
ACCOUNTS = (T0 + 3600, T0 + 3660)
HOSTILE = (T0 + 7200, T0 + 7260)
KUEUE = (T0 + 10800, T0 + 14400)


def _gpu(index: int, holder: str, share: float, account: str, queue: str) -> GpuSample:
    alloc = Allocation(
        scheduler="slurm", id=holder, user=f"u-{holder}", account=account, queue=queue, share=share
    )
    return GpuSample(index=index, uuid=f"GPU-{index}", fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0},
                     allocations=(alloc,))  # fmt: skip


def _150_holders(store: ChdbStore, t: float) -> None:
    # 150 idle GPUs, one holder each, one 60 s sample each:
    #   big-0 .. big-99 on cluster c1, account "other", queue "q", the whole GPU: 60 idle GPU-s each;
    #   small-0 .. small-49 on cluster c2, account "mine", queue "mq", a share (k + 1) / 100 of its
    #   GPU: 60 * (k + 1) / 100 = 0.6 .. 30 idle GPU-s, all below any big one's 60.
    # So the 100 largest holders are the big ones, and none of them is "mine".
    for n in range(10):
        gpus = [_gpu(g, f"big-{10 * n + g}", 1.0, "other", "q") for g in range(10)]
        write(store, [h.batch(f"b{n}", t, gpus, interval_s=60.0, cluster="c1")])
    for n in range(5):
        gpus = [_gpu(g, f"small-{10 * n + g}", (10 * n + g + 1) / 100, "mine", "mq") for g in range(10)]
        write(store, [h.batch(f"s{n}", t, gpus, interval_s=60.0, cluster="c2")])


MATCHES = [{"account": ["mine"]}, {"queue": ["mq"]}, {"cluster": ["c2"]}, {"account": ["mine", "nobody"]}]


@pytest.mark.parametrize("source", ["raw", "rollup"])
@pytest.mark.parametrize("match", MATCHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_a_filtered_top_idle_is_never_short(fleet: ChdbStore, match: dict[str, Any], source: Any) -> None:
    cfg = parse({"match": match})
    s = summary(fleet, cfg, *HOLDERS, source=source)
    # the top 10 of the matching 50: small-49 .. small-40, idle 60 * (k + 1) / 100 s = 30 .. 24.6 s
    want = [(f"small-{k}", round(60 * (k + 1) / 100 / 3600, 4)) for k in range(49, 39, -1)]
    assert [(x.id, x.idle_gpu_hours) for x in s.top_idle] == want
    assert {(x.cluster, x.account, x.queue) for x in s.top_idle} == {("c2", "mine", "mq")}
    # a limit above the number of matching holders lists every one of them, largest first
    rows = idle_by_owner(fleet, *HOLDERS, 0.05, limit=100, rollup=source == "rollup", match=cfg.match)
    assert [r["id"] for r in rows] == [f"small-{k}" for k in range(49, -1, -1)]
    assert [r["idle_s"] for r in rows] == pytest.approx([60 * (k + 1) / 100 for k in range(49, -1, -1)])


def test_without_a_filter_the_top_idle_is_the_largest(fleet: ChdbStore) -> None:
    s = summary(fleet, RulesConfig(), *HOLDERS)
    # ten of the big ones (60 s each, tied: by id), 60 / 3600 = 0.0167 GPU-h
    assert [(x.id, x.idle_gpu_hours) for x in s.top_idle] == [(i, 0.0167) for i in sorted(f"big-{k}" for k in range(100))[:10]]  # fmt: skip
    # JSON keys as before: allocated_s and idle_s (holding GPU-hours)
    assert to_json(s)["top_idle"][0] == {"cluster": "c1", "id": "big-0", "name": "", "user": "u-big-0",
                                         "account": "other", "queue": "q", "allocated_s": 0.0167, "idle_s": 0.0167}  # fmt: skip


# the sequences that break literals, UTF-8, the longest name, quotes, backslash and control
# characters (the whole corpus takes a minute here; tests/test_hostile.py runs all of it through
# the one escaping function, ingest.sqltext, that these parameters take too)
HOSTILE_NAMES = [
    n
    for n in dict.fromkeys([*hostile.SEQUENCES, *hostile.UNICODE, "n" * hostile.MAX_NAME,
                            "'", '"', "\\", "`", "\x00", "\t", "\n", "\r", "\x7f", "a'b", "a\\b"])
    if 1 <= len(n) <= hostile.MAX_NAME
]  # fmt: skip


def _hostile(store: ChdbStore, t: float) -> None:
    gpus = [_gpu(k, f"j{k}", 1.0, n, n) for k, n in enumerate(HOSTILE_NAMES)]
    write(store, [h.batch("n1", t, gpus, interval_s=60.0, cluster="c3")])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    """Every case in its own window of one store, rollups refreshed (chDB: one store at a time)."""
    store = ChdbStore(tmp_path_factory.mktemp("match") / "store")
    try:
        store.migrate(SCHEMA)
        _150_holders(store, HOLDERS[0])
        _accounts(store, ACCOUNTS[0])
        _hostile(store, HOSTILE[0])
        _kueue(store, KUEUE[0])
        rollup.refresh(store)
        yield store
    finally:
        store.close()


def _accounts(store: ChdbStore, t: float) -> None:
    # One 60 s sample: x holds GPU0 half (30 GPU-s) in queue q; y GPU1 a sixth (10 GPU-s) in q;
    # z holds GPU2 whole (60 GPU-s) in queue q2. Submissions in the window: x 1 GPU (q),
    # y 3 GPUs (1 node x 3, q), z 4 GPUs (2 nodes x 2, q2).
    gpus = [_gpu(0, "jx", 0.5, "x", "q"), _gpu(1, "jy", 1 / 6, "y", "q"), _gpu(2, "jz", 1.0, "z", "q2")]
    write(store, [h.batch("n1", t, gpus, interval_s=60.0)])
    ev = [h.sched("submit", "1", t, gpn=1), h.sched("submit", "2", t + 1, gpn=3),
          h.sched("submit", "3", t + 2, gpn=2, nodes=2, queue="q2")]  # fmt: skip
    ev = [e.model_copy(update={"account": a}) for e, a in zip(ev, "xyz", strict=True)]
    write(store, ev)


@pytest.mark.parametrize("source", ["raw", "rollup"])
@pytest.mark.parametrize("match", [{"queue": ["q"]}, {"account": ["x", "y"]}], ids=["queue", "account"])
def test_fair_share_is_over_the_matched_set(fleet: ChdbStore, match: dict[str, Any], source: Any) -> None:
    s = summary(fleet, parse({"match": match}), *ACCOUNTS, source=source)
    # matched: x and y. Allocated 30 + 10 = 40 GPU-s: x 30/40 = 0.75, y 10/40 = 0.25.
    # Requested 1 + 3 = 4 GPUs: x 1/4 = 0.25, y 3/4 = 0.75.
    got = {f.account: (f.allocated_gpu_hours, f.share_allocated, f.gpus_requested, f.share_requested)
           for f in s.fair_share}  # fmt: skip
    assert got == {"x": (round(30 / 3600, 4), 0.75, 1.0, 0.25), "y": (round(10 / 3600, 4), 0.25, 3.0, 0.75)}
    assert sum(f.share_allocated or 0 for f in s.fair_share) == pytest.approx(1.0)
    assert sum(f.share_requested or 0 for f in s.fair_share) == pytest.approx(1.0)


def test_fair_share_of_the_whole_fleet(fleet: ChdbStore) -> None:
    # all three: allocated 100 GPU-s (x 0.3, y 0.1, z 0.6); requested 8 GPUs (x 1/8, y 3/8, z 4/8)
    got = {r["account"]: (r["share_allocated"], r["share_requested"]) for r in fair_share(fleet, *ACCOUNTS)}
    assert got == {
        "x": pytest.approx((0.3, 0.125)),
        "y": pytest.approx((0.1, 0.375)),
        "z": pytest.approx((0.6, 0.5)),
    }


def test_a_matcher_naming_nothing_present_gives_empty_lists(fleet: ChdbStore) -> None:
    s = summary(fleet, parse({"match": {"account": ["nobody"]}}), *ACCOUNTS)
    assert s.top_idle == () and s.fair_share == ()
    assert s.capacity_gpu_hours == round(180 / 3600, 4)  # the account matcher does not narrow capacity


@pytest.mark.integration  # slow (over 0.7 s: 40 names, 3 queries each): the fast tier stays a loop under a minute
def test_hostile_names_select_exactly_their_own_holder(fleet: ChdbStore) -> None:
    # one idle GPU per hostile name, its holder's account and queue; a matcher naming one selects
    # that holder and its fair share alone (share 1 of the matched set)
    ns = HOSTILE_NAMES
    for k, n in enumerate(ns):
        for ru in (False, True):
            rows = idle_by_owner(
                fleet, *HOSTILE, 0.05, limit=1000, rollup=ru, match=parse({"match": {"account": [n]}}).match
            )
            assert [(r["id"], r["account"]) for r in rows] == [(f"j{k}", n)], repr(n)[:80]
        shares = fair_share(fleet, *HOSTILE, match=parse({"match": {"queue": [n]}}).match)
        assert [(r["account"], r["share_allocated"]) for r in shares] == [(n, 1.0)], repr(n)[:80]
    every = idle_by_owner(fleet, *HOSTILE, 0.05, limit=1000, match=parse({"match": {"account": ns}}).match)
    assert len(every) == len(ns)


# requests, each pending from the window's start (an incident opens 600 s later): (id, scheduler, queue, account, GPUs)
REQUESTS = (
    ("wl-a", "kueue", "team-a/lq", "team-a", 1.0),  # a Kueue Workload: its queue namespace/LocalQueue
    ("wl-a2", "kueue", "team-a/lq-big", "team-a", 2.0),
    ("pod-a", "k8s", "team-a", "team-a", 4.0),  # a plain pod: its queue the namespace
    ("wl-b", "kueue", "team-b/lq", "team-b", 8.0),
    ("job-s", "slurm", "gpu", "team-a", 16.0),  # a Slurm job of an account named like the namespace
)
# match.queue -> the requests it selects, by the documented meaning (docs/operations.md): a queue
# listed exactly, or a Kueue request's namespace; a LocalQueue without its namespace, a ClusterQueue's
# name or an account is no request's queue
KUEUE_MATCHES = {
    (): {"wl-a", "wl-a2", "pod-a", "wl-b", "job-s"},
    ("team-a",): {"wl-a", "wl-a2", "pod-a"},
    ("team-a/lq",): {"wl-a"},
    ("team-a/lq", "gpu"): {"wl-a", "job-s"},
    ("team-b/lq", "team-a/lq-big"): {"wl-b", "wl-a2"},
    ("lq",): set(),
    ("cluster-queue-gpu",): set(),
    ("team-a/",): set(),
    ("team-a/lq/",): set(),
    ("TEAM-A/LQ",): set(),
}


def _kueue(store: ChdbStore, t: float) -> None:
    evs = [
        h.sched("submit", rid, t, gpn=gpus, queue=queue).model_copy(
            update={"scheduler": sch, "account": acct, "seq": k}
        )
        for k, (rid, sch, queue, acct, gpus) in enumerate(REQUESTS)
    ]
    write(store, evs)


@pytest.mark.parametrize("queues", list(KUEUE_MATCHES), ids=repr)
def test_a_kueue_request_is_matched_by_its_local_queue_or_its_namespace(
    fleet: ChdbStore, queues: tuple[str, ...]
) -> None:
    """``match.queue: [team-a]`` selected team-a's pods and missed its Kueue Workloads (their
    queue is ``team-a/lq``), while ``starvation.queue_threshold_s`` read a namespace's override for
    them: the incidents and the requested side of fair share now select a Kueue request by its
    ``namespace/LocalQueue`` or its namespace, and nothing else by a namespace."""
    from gpuslo.rules.config import Match
    from gpuslo.rules.evaluate import incidents

    cfg = parse({"match": {"queue": list(queues)}})
    frm, to = KUEUE
    want = KUEUE_MATCHES[queues]
    assert {i.request_id for i in incidents(fleet, frm, to, cfg)} == want
    requested: dict[str, float] = {}
    for rid, sch, queue, acct, gpus in REQUESTS:
        if rid in want:
            requested[acct] = requested.get(acct, 0.0) + gpus
        assert Match(queue=queues).request_ok(queue, sch, acct) == (rid in want)
    got = {r["account"]: r["gpus_requested"] for r in fair_share(fleet, frm, to, match=cfg.match)}
    assert {a: g for a, g in got.items() if g} == requested

"""The starvation tier (capacity_steps_1m, rules/rollup.py STEPS_REFRESH): the snapshot of every
opening read from the step functions the refresh stored gives, column for column, the incidents
of the raw rows (sql.STARVATION) and of the sweep over the minute tier's candidates
(sql.STARVATION_MINUTE_SWEEP), over seeded random fleets: pools joined by ',', requests naming
several pools, an unseen one or none, fractional shares and requests, stale rows standing until
exactly 2 x interval, gaps, a node in two pools at one time, late samples (re-rolled minutes),
every sample of a node re-sent with another pool, openings exactly at samples' times, at minute
edges and just before them; and on a store made before the tier (its first refresh builds it).
The expected values are the raw rows' (the definitions, docs/metrics.md), not the tier's SQL, but
for one difference the minute tier had before the tier (_three says which)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import evaluate, rollup
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSampleBatch
from tests import helpers as h
from tests.helpers import T0

THR = 600.0
M0 = T0 + 3 * 3600  # a minute edge
_clusters = itertools.count()
POOLS = ["a", "b", "a,b", "", "c,a", "b,d"]
ASKED = ["", "a", "b", "a,b", "c", "zz", "d,a"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path_factory.mktemp("tier") / "store")
    s.migrate(SCHEMA)
    try:
        yield s
    finally:
        s.close()


def _cfg() -> RulesConfig:
    cfg = RulesConfig()
    return cfg.model_copy(update={"starvation": cfg.starvation.model_copy(update={"threshold_s": THR})})


def _node(rnd: random.Random, cluster: str, k: int, moves: bool) -> tuple[list[GpuSampleBatch], list[float]]:
    """One node's batches: a fixed interval, a pool that may change, gaps (some exactly 2 x the
    interval: the older row stands until the newer), shares of 0, 1/4, 1/2, 1, an unhealthy GPU,
    at times on and off minute edges, now and then a second batch at one time in another pool."""
    interval = rnd.choice([10.0, 20.0, 30.0, 60.0, 90.0])
    ngpu = rnd.randint(1, 4)
    t = M0 - 300 + rnd.choice([0.0, rnd.randint(0, 59), round(rnd.uniform(0, 60), 3)])
    pool = rnd.choice(POOLS)
    out: list[GpuSampleBatch] = []
    times: list[float] = []
    while t < M0 + 900:
        if moves and rnd.random() < 0.08:
            pool = rnd.choice(POOLS)
        gpus = [
            h.gpu(i, 0.1, (("j", s),) if (s := rnd.choice([0.0, 0.0, 0.25, 0.5, 1.0])) else (),
                  healthy=rnd.random() > 0.05)
            for i in range(ngpu)
        ]  # fmt: skip
        out.append(h.batch(f"n{k}", t, gpus, interval_s=interval, pool=pool, cluster=cluster))
        if moves and rnd.random() < 0.04:
            out.append(
                h.batch(f"n{k}", t, gpus[:1], interval_s=interval, pool=rnd.choice(POOLS), cluster=cluster)
            )
        times.append(t)
        gap = rnd.random()
        t += interval * (1 if gap < 0.8 else 2 if gap < 0.9 else rnd.choice([3, 5]))
    return out, times


def _fleet(seed: int, cluster: str, moves: bool = True) -> tuple[list[Any], list[Any], list[float]]:
    """(batches, scheduler events, opening times) of one seeded fleet."""
    rnd = random.Random(seed)
    batches: list[Any] = []
    times: list[float] = []
    for k in range(rnd.randint(2, 7)):
        b, ts = _node(rnd, cluster, k, moves)
        batches += b
        times += ts
    events: list[Any] = []
    opens: list[float] = []
    for r in range(rnd.randint(10, 30)):
        kind = rnd.random()
        if kind < 0.35:
            opened = rnd.choice(times)  # exactly at a sample's time
        elif kind < 0.6:
            opened = M0 + 60 * rnd.randint(-3, 14)  # at a minute edge
        elif kind < 0.7:
            opened = M0 + 60 * rnd.randint(-3, 14) - 0.001  # just before one
        else:
            opened = M0 + round(rnd.uniform(-200, 880), 3)
        rid = f"r{r}"
        pool = rnd.choice(ASKED)
        gpn = rnd.choice([0.25, 0.5, 1.0, 1.0, 2.0, 3.0])
        events.append(h.sched("submit", rid, opened - THR, gpn=gpn, nodes=rnd.randint(1, 2), pool=pool,
                              cluster=cluster))  # fmt: skip
        if rnd.random() < 0.3:  # the scheduler's own cause, said before the opening
            ev = h.sched("pending_reason", rid, opened - 5, cluster=cluster)
            cause = rnd.choice(["capacity", "policy", "fragmentation"])
            events.append(ev.model_copy(update={"cause": cause, "reason": f"said {cause}"}))
        if rnd.random() < 0.3:
            events.append(h.sched("start", rid, opened + rnd.uniform(1, 300), cluster=cluster))
        opens.append(opened)
    return batches, events, opens


def _params(frm: float, to: float, cluster: str) -> dict[str, Any]:
    return {"from": frm, "to": to, "cluster": cluster}


def _three(
    store: ChdbStore,
    frm: float,
    to: float,
    cluster: str,
    monkeypatch: pytest.MonkeyPatch,
    raw_too: bool = True,
) -> list[Any]:
    """The incidents over the minute tier's sweep and over the tier: equal; and over raw rows
    (``raw_too``); the rows."""
    cfg = _cfg()
    raw = evaluate.starvation(store, frm, to, cfg, cluster, rollup=False)
    assert rollup.steps_built(store)
    tier = evaluate.starvation(store, frm, to, cfg, cluster, rollup=True)
    with monkeypatch.context() as mp:
        mp.setattr(evaluate, "steps_built", lambda _s: False)
        sweep = evaluate.starvation(store, frm, to, cfg, cluster, rollup=True)
    assert tier == sweep
    # the engine computes each query's incidents once (a materialized CTE): the rows of the plain query
    assert evaluate.materialized_ctes(store)
    with monkeypatch.context() as mp:
        mp.setattr(evaluate, "materialized_ctes", lambda _s: False)
        assert evaluate.starvation(store, frm, to, cfg, cluster, rollup=False) == raw
        assert evaluate.starvation(store, frm, to, cfg, cluster, rollup=True) == tier
        mp.setattr(evaluate, "steps_built", lambda _s: False)
        assert evaluate.starvation(store, frm, to, cfg, cluster, rollup=True) == sweep
    if not raw_too:
        return tier
    # over raw rows, "a node of the pool was seen" (which lets a cause the scheduler said stand
    # against no free GPUs) looks at the whole window's rows, over the minute tier (sweep and tier
    # alike) at the openings' minutes': only the cause of an incident with a said cause may differ
    assert [_but_said_cause(r) for r in tier] == [_but_said_cause(r) for r in raw]
    return tier


def _but_said_cause(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "cause" or not r["reason"]}


def _windows(opens: list[float]) -> list[tuple[float, float]]:
    lo, hi = math.floor(min(opens) / 60) * 60 - 60, math.ceil(max(opens) / 60) * 60 + 60
    mid = math.floor((lo + hi) / 120) * 60
    return [(lo, hi), (lo, mid), (mid, hi), (mid, mid + 60)]


@pytest.mark.integration  # a chDB round per seed
@pytest.mark.parametrize("moves", [False, True], ids=["one-pool-per-node", "pools-change"])
@pytest.mark.parametrize("seed", range(8))
def test_tier_equals_raw_rows_and_the_sweep(
    store: ChdbStore, seed: int, moves: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raw rows too where each node keeps one pool: the minute tier's candidates carry their
    minute row's pool (the node's latest sample's; rules/rollup.py), so a node changing pools
    inside a minute, or in two pools at one time, is exact between the sweep and the tier only."""
    cluster = f"t{next(_clusters)}"
    batches, events, opens = _fleet(seed, cluster, moves)
    rnd = random.Random(seed + 1000)
    late = [b for b in batches if rnd.random() < 0.2]  # arrive after a refresh: their minutes re-rolled
    on_time = [b for b in batches if b not in late]
    write(store, on_time + events)
    rollup.refresh(store)
    write(store, late)
    rollup.refresh(store)
    seen: set[str] = set()
    for frm, to in _windows(opens):
        rows = _three(store, frm, to, cluster, monkeypatch, raw_too=not moves)
        seen |= {r["cause"] for r in rows}
    assert opens and seen  # the fleet opened incidents
    # every sample of one node re-sent with another pool: its minutes re-rolled, pools change
    node = batches[0].node
    moved = [b.model_copy(update={"pool": "b" if b.pool != "b" else "a", "seq": b.seq + 10**6})
             for b in batches if b.node == node]  # fmt: skip
    write(store, moved)
    rollup.refresh(store)
    for frm, to in _windows(opens):
        _three(store, frm, to, cluster, monkeypatch, raw_too=not moves)


@pytest.mark.integration
def test_causes_of_every_kind_are_reached(store: ChdbStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the seeds together the differential test meets each cause (else it proves little)."""
    causes: set[str] = set()
    for seed in range(100, 106):
        cluster = f"t{next(_clusters)}"
        batches, events, opens = _fleet(seed, cluster, moves=False)
        write(store, batches + events)
        rollup.refresh(store)
        lo, hi = _windows(opens)[0]
        causes |= {r["cause"] for r in _three(store, lo, hi, cluster, monkeypatch)}
    assert causes == {"capacity", "fragmentation", "policy"}


@pytest.mark.integration
def test_a_store_made_before_the_tier_builds_it_on_its_first_refresh(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Minute tier rolled, then the tier emptied and unmarked (as a store from before it): the
    engine reads the sweep until the next refresh builds the tier (a day at a time), then the tier."""
    cluster = f"t{next(_clusters)}"
    batches, events, opens = _fleet(7, cluster, moves=False)
    write(store, batches + events)
    rollup.refresh(store)
    lo, hi = _windows(opens)[0]
    before = evaluate.starvation(store, lo, hi, _cfg(), cluster, rollup=True)
    assert before
    store.execute("TRUNCATE TABLE capacity_steps_1m")
    store.execute("TRUNCATE TABLE rollup_state")
    assert not rollup.steps_built(store)
    assert evaluate.starvation(store, lo, hi, _cfg(), cluster, rollup=True) == before  # the sweep
    rollup.refresh(store)
    assert rollup.steps_built(store)
    n = store.query("SELECT count() AS n FROM capacity_steps_1m FINAL")[0]["n"]
    assert (
        n
        == store.query("SELECT count() AS n FROM (SELECT DISTINCT cluster, minute FROM gpu_rollup_1m)")[0][
            "n"
        ]
    )
    assert _three(store, lo, hi, cluster, monkeypatch) == before

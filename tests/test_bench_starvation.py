"""The starvation benchmark runs at a tiny size, and the snapshot as a sweep (rules/sql.py) gives
the answers of the snapshot as it was before (a product of openings and nodes, kept in
bench/starvation.py as the baseline): every column of every incident, over raw rows and over the
rollups, on the benchmark's fleet with random seeds, on drawn fleets (those of the property test,
with the scheduler's own causes added) and on hostile ones. No timing here."""

from __future__ import annotations

import itertools
import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import starvation as bench
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup, sql
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import incidents, starvation
from gpuslo.wire import SchedulerEvent
from tests import helpers as h
from tests.helpers import T0
from tests.test_properties import THRESHOLD_S, _messages, fleets, ref_starvation

ROOT = Path(__file__).resolve().parents[1]
_clusters = itertools.count()


@pytest.mark.integration  # runs the benchmark end to end: processes, chDB
def test_bench_starvation_runs_at_a_tiny_size() -> None:
    r = subprocess.run([sys.executable, "-m", "bench", "starvation", "--sizes", "20,40", "--old-sizes", "20,40",
                        "--split"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["bench"] == "starvation"
    for n in (20, 40):
        assert fig[f"seconds_{n}"] > 0 and fig[f"peak_rss_mb_{n}"] > 0
        assert fig[f"incidents_{n}"] == n  # every request opens inside the hour and never starts
        assert fig[f"same_answers_{n}"] is True
        assert fig[f"old_seconds_{n}"] > 0
        # the snapshot read alone: one row per node and sample time (the fleet's samples start
        # at the hour: 60 per node, one pool string each)
        assert fig[f"snapshot_read_seconds_{n}"] > 0
        assert fig[f"snapshot_rows_{n}"] == n * 60
        # the rule over the starvation tier after one refresh of the hour: the raw rows' answers;
        # a sample reaches 2 x its 60 s interval, so the hour's samples mark 61 minutes per node
        assert fig[f"refresh_node_minutes_{n}"] == n * 61
        assert fig[f"refresh_s_{n}"] > 0 and fig[f"tier_seconds_{n}"] > 0 and fig[f"tier_peak_rss_mb_{n}"] > 0
        assert fig[f"tier_same_answers_{n}"] is True
    assert isinstance(fig["exponent_seconds_20_40"], float)
    assert isinstance(fig["exponent_tier_seconds_20_40"], float)


def _rows(store: ChdbStore, q: str, p: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every column of every incident, in a fixed order."""
    return sorted((tuple(sorted(r.items())) for r in store.query(q, p)), key=repr)


def _agree(store: ChdbStore, p: dict[str, Any], rollups: bool) -> list[tuple[Any, ...]]:
    """The new SQL and the old give the same rows (over the rollups too); the rows."""
    new = _rows(store, sql.STARVATION, p)
    assert new == _rows(store, bench.OLD_STARVATION, p)
    if rollups:
        assert _rows(store, sql.STARVATION_ROLLUP, p) == _rows(store, bench.OLD_STARVATION_ROLLUP, p)
    return new


@pytest.mark.parametrize("seed", [1, 2])
def test_sweep_equals_the_product_on_the_benchmark_fleet(store: ChdbStore, seed: int) -> None:
    bench.populate(store, nodes=120, requests=150, seed=seed)
    rollup.refresh(store)
    p = bench.params()
    rows = _agree(store, p, rollups=True)
    causes = {dict(r)["cause"] for r in rows}
    assert len(rows) == 150 and {"fragmentation", "policy"} <= causes  # the fleet exercises the causes
    # a window that ends mid-hour and one that starts late: fewer openings, the same agreement
    _agree(store, bench.params(bench.START + 600, bench.START + 1800), rollups=True)
    # over the rollups the same incidents as over raw rows (the rollups' exactness, issue 11)
    assert _rows(store, sql.STARVATION_ROLLUP, p) == rows


def _p(frm: float, to: float, cluster: str) -> dict[str, Any]:
    return {**bench.params(frm, to), "cluster": cluster}


_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}
CAUSES = st.sampled_from([None, "capacity", "fragmentation", "policy"])


@pytest.mark.integration  # slow: a chDB round per example
@settings(max_examples=15, **_SETTINGS)  # type: ignore[arg-type]
@given(
    fleet=fleets(), said=st.lists(st.tuples(st.integers(0, 2), st.integers(-600, 1200), CAUSES), max_size=3)
)
def test_sweep_equals_the_product_on_drawn_fleets(
    store: ChdbStore, fleet: tuple[list[Any], list[Any]], said: list[tuple[int, int, str | None]]
) -> None:
    """The property test's fleets (pools, intervals from 1 s to the maximum, gaps, heartbeats on
    change, fractional shares, lost GPUs), plus pending reasons with the scheduler's own causes
    before and after the opening; windows on whole minutes around the openings."""
    ns, rs = fleet
    cluster = f"d{next(_clusters)}"
    msgs: list[Any] = _messages(cluster, ns, rs)
    for i, off, cause in said:
        if i < len(rs):
            ev = h.sched("pending_reason", rs[i].rid, rs[i].submit + THRESHOLD_S + off, cluster=cluster)
            msgs.append(replace_event(ev, cause, f"said {cause}"))
    write(store, msgs)
    rollup.refresh(store)
    opens = [r.submit + THRESHOLD_S for r in rs] or [T0]
    frm, to = math.floor(min(opens) / 60) * 60 - 60, math.ceil(max(opens) / 60) * 60 + 60
    rows = _agree(store, _p(frm, to, cluster), rollups=True)
    # and the reference of the definitions (tests/test_properties.py) where no cause was said
    plain = {dict(r)["request_id"]: dict(r) for r in rows if not dict(r)["reason"]}
    ref = ref_starvation(ns, rs, frm, to)
    for rid, r in plain.items():
        assert (r["cause"], round(r["free_gpus"], 5)) == (ref[rid][1], round(ref[rid][2], 5))


def replace_event(ev: SchedulerEvent, cause: str | None, reason: str) -> SchedulerEvent:
    return ev.model_copy(update={"cause": cause, "reason": reason})


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def test_hostile_snapshots_agree(store: ChdbStore) -> None:
    """Hand-computed at the opening T0 + 40: n1 in 'a' (1 whole GPU free of 2); n2 serving
    'a,b' at a 30 s interval, its second sample (T0 + 30: one GPU half taken) standing for it;
    n3 in 'a' whose fresh long-interval sample is hidden by a later one that is stale by then;
    n4 naming no pool with a MIG-like 1/7 free. Requests: 'b,' (an empty name in its list, which
    n4's '' shares), 'z' (no node seen, the scheduler's cause stands), fractional and whole shapes."""
    c = "hostile"
    g = h.gpu
    rest = 1 - _f32(6 / 7)  # n4's free part of its GPU (the share is stored as Float32)
    msgs: list[Any] = [
        h.batch("n1", T0, [g(0), g(1, allocs=(("j1", 1.0),))], pool="a", cluster=c, interval_s=60),
        h.batch("n2", T0, [g(0), g(1)], pool="a,b", cluster=c, interval_s=30),
        h.batch("n2", T0 + 30, [g(0, allocs=(("j2", 0.5),)), g(1)], pool="a,b", cluster=c, interval_s=30),
        h.batch("n3", T0 - 500, [g(0)], pool="a", cluster=c, interval_s=300),
        h.batch("n3", T0 + 20, [g(0)], pool="a", cluster=c, interval_s=5),
        h.batch("n4", T0 + 10, [g(0, allocs=(("j4", 6 / 7),))], pool="", cluster=c, interval_s=60),
    ]
    # (id, pool, GPUs per node, nodes) -> (free GPUs, nodes that fit, cause)
    want = {
        ("r-a", "a", 1.0, 1): (2.5, 2, "policy"),
        ("r-b,", "b,", 1.0, 2): (1.5 + rest, 1, "capacity"),
        ("r-ab", "a,b", 0.5, 3): (2.5, 2, "fragmentation"),
        # n4's 1 - f32(6/7) is f32(1/7) within Float32's rounding (sql.FREE_TOLERANCE): it fits
        ("r-all", "", 1 / 7, 2): (2.5 + rest, 3, "policy"),
        ("r-z", "z", 1.0, 1): (0.0, 0, "policy"),
        ("r-big", "a", 2.0, 1): (2.5, 0, "fragmentation"),
    }
    for rid, pool, gpn, n in want:
        msgs.append(h.sched("submit", rid, T0 + 40 - THRESHOLD_S, gpn=gpn, nodes=n, pool=pool, cluster=c))
    msgs.append(replace_event(h.sched("pending_reason", "r-z", T0 + 10, cluster=c), "policy", "quota"))
    write(store, msgs)
    rollup.refresh(store)
    rows = _agree(store, _p(T0, T0 + 60, c), rollups=True)
    got = {dict(r)["request_id"]: dict(r) for r in rows}
    for (rid, *_), (free, fit, cause) in want.items():
        r = got[rid]
        assert (r["free_gpus"], r["fitting_nodes"], r["cause"]) == (
            pytest.approx(free, abs=1e-12),
            fit,
            cause,
        ), rid


def test_a_per_job_gpu_count_spread_unevenly_needs_its_ceiling_on_each_node(store: ChdbStore) -> None:
    """Slurm's ``--gpus=3 -N 2`` is 1.5 GPUs per node on the wire (agent/slurm.py gpu_shape): the
    total is the 3 GPUs asked, and a node hosts its part with 2 whole GPUs free. 3 free on nodes
    of 2 + 1 is enough in all but fits one node (fragmentation); 2 + 2 fits both (policy)."""
    c = "spread"
    g = h.gpu
    msgs: list[Any] = [
        h.batch("n1", T0, [g(0), g(1), g(2, allocs=(("j", 1.0),))], pool="a", cluster=c, interval_s=60),
        h.batch("n2", T0, [g(0), g(1, allocs=(("j", 1.0),)), g(2, allocs=(("j", 1.0),))], pool="a", cluster=c,
                interval_s=60),
        h.batch("n3", T0, [g(0), g(1)], pool="b", cluster=c, interval_s=60),
        h.batch("n4", T0, [g(0), g(1)], pool="b", cluster=c, interval_s=60),
    ]  # fmt: skip
    for rid, pool in (("r-a", "a"), ("r-b", "b")):
        msgs.append(h.sched("submit", rid, T0 + 40 - THRESHOLD_S, gpn=1.5, nodes=2, pool=pool, cluster=c))
    write(store, msgs)
    rollup.refresh(store)
    got = {dict(r)["request_id"]: dict(r) for r in _agree(store, _p(T0, T0 + 60, c), rollups=True)}
    assert {k: (r["free_gpus"], r["fitting_nodes"], r["cause"]) for k, r in got.items()} == {
        "r-a": (3.0, 1, "fragmentation"),
        "r-b": (4.0, 2, "policy"),
    }
    got_gpus = {i.request_id: i.gpus for i in incidents(store, T0, T0 + 60, RulesConfig(), c)}
    assert got_gpus == {"r-a": 3.0, "r-b": 3.0}


def test_a_mig_request_is_its_part_of_a_gpu(store: ChdbStore) -> None:
    """A pod asking ``nvidia.com/mig-1g.10gb: 1`` was one whole GPU on the wire, and the snapshot
    counts a free 1g.10gb instance as 1/7 (its row's fraction, as the agent sends it): one free
    instance read as a capacity shortfall. Asked as 1/7 (agent/k8s_watch.py gpus_requested), one
    free instance hosts it (policy); two instances asked are more than the one free (capacity)."""
    from gpuslo.agent.k8s_watch import gpus_requested
    from gpuslo.wire import GpuSample, MigInstance

    c = "mig"
    seventh = _f32(1 / 7)
    rows = [GpuSample(index=0, uuid="GPU-0", fraction=0.0)]  # the GPU in MIG mode: all in instances
    for gi in range(7):
        held = (("j", 1.0),) if gi else ()
        rows.append(h.gpu(0, allocs=held).model_copy(update={
            "uuid": f"MIG-{gi}", "mig": MigInstance(gi=gi, profile="1g.10gb"), "fraction": seventh}))  # fmt: skip
    msgs: list[Any] = [h.batch("n1", T0, rows, pool="a", cluster=c, interval_s=60)]
    for rid, n in (("one", 1), ("two", 2)):
        gpn = gpus_requested(
            {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/mig-1g.10gb": str(n)}}}]}}
        )
        assert gpn == pytest.approx(n / 7)
        msgs.append(h.sched("submit", rid, T0 + 40 - THRESHOLD_S, gpn=gpn, nodes=1, pool="a", cluster=c))
    write(store, msgs)
    rollup.refresh(store)
    got = {dict(r)["request_id"]: dict(r) for r in _agree(store, _p(T0, T0 + 60, c), rollups=True)}
    assert {k: r["cause"] for k, r in got.items()} == {"one": "policy", "two": "capacity"}
    assert got["one"]["free_gpus"] == pytest.approx(1 / 7, abs=1e-6)


def test_two_pools_at_one_time_take_the_greatest(store: ChdbStore) -> None:
    """A node whose GPUs report two pools at one sample time (two batches, two snapshot rows at
    one time): over raw rows the row of the greatest pool stands for the node, every time the
    same (the old ASOF took either), and both pools count as seen. The rollups keep one pool per
    node and minute (rules/rollup.py says so): there the answer is one of the two, always the same."""
    c = "tie"
    msgs: list[Any] = [
        h.batch("n1", T0, [h.gpu(0), h.gpu(1)], pool="a", cluster=c, interval_s=60),
        h.batch("n1", T0, [h.gpu(2)], pool="b", cluster=c, interval_s=60),
        h.sched("submit", "ra", T0 + 40 - THRESHOLD_S, gpn=1.0, nodes=1, pool="a", cluster=c),
        h.sched("submit", "rb", T0 + 40 - THRESHOLD_S, gpn=1.0, nodes=1, pool="b", cluster=c),
    ]
    write(store, msgs)
    rollup.refresh(store)
    by = {r["request_id"]: r for r in starvation(store, T0, T0 + 60, RulesConfig(), c)}
    assert (by["ra"]["free_gpus"], by["ra"]["cause"]) == (0.0, "capacity")
    assert (by["rb"]["free_gpus"], by["rb"]["fitting_nodes"], by["rb"]["cause"]) == (1.0, 1, "policy")
    first = starvation(store, T0, T0 + 60, RulesConfig(), c, rollup=True)
    assert all(starvation(store, T0, T0 + 60, RulesConfig(), c, rollup=True) == first for _ in range(3))


def test_a_request_for_almost_no_gpu_counts_only_fresh_nodes(store: ChdbStore) -> None:
    """A request for 1e-10 GPUs per node fits on every node whose snapshot is known (its
    largest free part + 1e-9 is at least that), and on no node whose snapshot is stale or
    missing: the definition (docs/metrics.md, tests/test_properties.py's reference). The old
    product counted every node of the pool there, stale or not (its empty slots read 0 + 1e-9)."""
    c = "tiny"
    msgs: list[Any] = [
        h.batch("fresh", T0 + 35, [h.gpu(0, allocs=(("j", 1.0),))], cluster=c),  # nothing free, but known
        h.batch("stale", T0 + 5, [h.gpu(0)], cluster=c),  # 10 s interval: stale at T0 + 40
        h.sched("submit", "r", T0 + 40 - THRESHOLD_S, gpn=1e-10, nodes=2, cluster=c),
    ]
    write(store, msgs)
    (row,) = starvation(store, T0, T0 + 60, RulesConfig(), c)
    # nothing free is less than 2 x 1e-10 (the tolerance is at most half the request:
    # sql._tolerance): capacity; one node fits of two (a node's shape keeps its 1e-9)
    assert (row["fitting_nodes"], row["free_gpus"], row["cause"]) == (1, 0.0, "capacity")
    (old,) = store.query(bench.OLD_STARVATION, _p(T0, T0 + 60, c))
    assert (old["fitting_nodes"], old["cause"]) == (2, "capacity")  # the difference, and why it is one


def test_one_request_id_in_two_schedulers_has_two_snapshots(store: ChdbStore) -> None:
    """The same request id from two schedulers of one cluster is two incidents, each with the
    snapshot of its own pool (the old product summed both incidents' nodes into each)."""
    c = "twice"
    sub = T0 + 40 - THRESHOLD_S
    msgs: list[Any] = [
        h.batch("n1", T0 + 30, [h.gpu(0), h.gpu(1, allocs=(("j", 1.0),))], pool="a", cluster=c),
        h.batch("n2", T0 + 30, [h.gpu(0), h.gpu(1)], pool="b", cluster=c),
        h.sched("submit", "same", sub, gpn=2.0, nodes=1, pool="a", cluster=c),
        h.sched("submit", "same", sub, gpn=2.0, nodes=1, pool="b", cluster=c).model_copy(
            update={"scheduler": "k8s"}
        ),
    ]
    write(store, msgs)
    for ru in (False, True):
        if ru:
            rollup.refresh(store)
        rows = starvation(store, T0, T0 + 60, RulesConfig(), c, rollup=ru)
        got = {r["scheduler"]: (r["free_gpus"], r["fitting_nodes"], r["cause"]) for r in rows}
        # n1 in 'a': one GPU free of two (fewer than 2: capacity); n2 in 'b': both free (fits: policy)
        assert got == {"slurm": (1.0, 0, "capacity"), "k8s": (2.0, 1, "policy")}, ru

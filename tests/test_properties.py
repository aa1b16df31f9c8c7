"""Property test: on random fleets, the engine over raw rows, the engine over the rollups (after a
refresh) and a plain-Python reference of the definitions in docs/metrics.md give the same capacity,
allocated, active and idle GPU-seconds (per pool and per cluster) and the same starvation
incidents with the same causes.

The fleets mix what broke once: nodes with and without a pool and several pools; sampling
intervals from 1 s to the wire's maximum, mixed within one fleet, with gaps; heartbeats sent only
on a change of state, arbitrarily long before the samples; fractional shares, idle and lost
GPUs; pending requests of any shape; windows that start and end anywhere (the rollups are asked
the same window widened to whole minutes, which is all they answer)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from random import Random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslo.dashboards.overview import panel_queries
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import cluster_totals, starvation, summary, utilization
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import MAX_INTERVAL_S, NodeHeartbeat
from tests import helpers as h
from tests.grafana import expand
from tests.helpers import T0

IDLE = 0.05
THRESHOLD_S = 600.0  # the default starvation threshold
D = 86400.0
BASE = T0 - 8 * D  # samples in [BASE, BASE + 3 d), heartbeats from 5 days before
_clusters = itertools.count()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path_factory.mktemp("props"))
    s.migrate(SCHEMA)
    yield s
    s.close()


# ----------------------------------------------------------------------------- the fleet
@dataclass(frozen=True)
class Gpu:
    share: float
    activity: float
    healthy: bool


@dataclass(frozen=True)
class Sample:
    ts: float
    gpus: tuple[Gpu, ...]


@dataclass(frozen=True)
class Node:
    name: str
    pool: str
    interval: float
    samples: tuple[Sample, ...]
    heartbeats: tuple[tuple[float, bool], ...]  # (ts, schedulable), only on change


@dataclass(frozen=True)
class Request:
    rid: str
    submit: float
    gpus_per_node: float
    nodes: int
    pool: str
    start: float | None


INTERVALS = st.one_of(
    st.sampled_from([1.0, 10.0, 30.0, 60.0, 90.0, 300.0, 3600.0, 7200.0, float(MAX_INTERVAL_S)]),
    st.integers(1, MAX_INTERVAL_S).map(float),
)
GPU = st.builds(
    Gpu,
    share=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    activity=st.sampled_from([0.0, 0.01, 0.04, 0.3, 1.0]),
    healthy=st.sampled_from([True, True, True, False]),
)


@st.composite
def nodes(draw: st.DrawFn, name: str) -> Node:
    interval = draw(INTERVALS)
    n_gpus = draw(st.integers(1, 3))
    t = BASE + draw(st.integers(0, 2 * 86400))
    samples = []
    for _ in range(draw(st.integers(1, 4))):
        samples.append(Sample(t, tuple(draw(st.lists(GPU, min_size=n_gpus, max_size=n_gpus)))))
        # the next sample right after this one, or after a gap (a missed tick, a dead agent)
        t += interval * draw(st.sampled_from([1, 1, 1, 2, 3])) + draw(st.sampled_from([0, 0, 7]))
    changes = draw(st.lists(st.integers(-5 * 86400, 3 * 86400), max_size=3, unique=True))
    state = draw(st.booleans())
    hbs = []
    for off in sorted(changes):
        hbs.append((BASE + off, state))
        state = not state  # sent only when the state changes
    pool = draw(st.sampled_from(["", "", "p", "q"]))
    return Node(name, pool, interval, tuple(samples), tuple(hbs))


@st.composite
def requests(draw: st.DrawFn, i: int) -> Request:
    submit = BASE + draw(st.integers(-600, 3 * 86400))
    wait = draw(st.sampled_from([None, 300.0, 900.0, 5000.0, 100000.0]))
    return Request(
        f"r{i}",
        float(submit),
        draw(st.sampled_from([0.25, 0.5, 1.0, 2.0])),
        draw(st.integers(1, 2)),
        draw(st.sampled_from(["", "p", "q"])),
        None if wait is None else submit + wait,
    )


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Node], list[Request]]:
    ns = [draw(nodes(f"n{i}")) for i in range(draw(st.integers(1, 4)))]
    rs = [draw(requests(i)) for i in range(draw(st.integers(0, 3)))]
    return ns, rs


def _span(ns: list[Node]) -> tuple[float, float]:
    lo = min(s.ts for n in ns for s in n.samples)
    hi = max(s.ts + n.interval for n in ns for s in n.samples)
    return lo, hi


@st.composite
def windows(draw: st.DrawFn, ns: list[Node]) -> tuple[float, float]:
    """A window anywhere near the samples: inside one, across several, at their edges."""
    lo, hi = _span(ns)
    edges = sorted({s.ts for n in ns for s in n.samples} | {s.ts + n.interval for n in ns for s in n.samples})
    a = draw(st.one_of(st.sampled_from(edges), st.floats(lo - 2 * D, hi + 600)))
    b = draw(st.one_of(st.sampled_from(edges), st.floats(lo - 2 * D, hi + 600)))
    a, b = round(min(a, b), 3), round(max(a, b), 3)
    return a, b if b > a else a + 1.0


def _messages(cluster: str, ns: list[Node], rs: list[Request]) -> list[object]:
    msgs: list[object] = []
    for n in ns:
        for s in n.samples:
            gpus = [h.gpu(i, g.activity, (("j" + n.name, g.share),) if g.share else (), healthy=g.healthy)
                    for i, g in enumerate(s.gpus)]  # fmt: skip
            msgs.append(h.batch(n.name, s.ts, gpus, interval_s=n.interval, pool=n.pool, cluster=cluster))
        for t, ok in n.heartbeats:
            msgs.append(h.heartbeat(n.name, t, ok, pool=n.pool, cluster=cluster, gpus=len(n.samples[0].gpus)))
    for r in rs:
        msgs.append(h.sched("submit", r.rid, r.submit, gpn=r.gpus_per_node, nodes=r.nodes, pool=r.pool,
                            cluster=cluster))  # fmt: skip
        if r.start is not None:
            msgs.append(h.sched("start", r.rid, r.start, cluster=cluster))
    return msgs


# ----------------------------------------------------------------------------- the reference
def _schedulable(n: Node, t: float) -> bool:
    """The latest heartbeat at or before t says; a node that never sent one counts as schedulable."""
    state = True
    for ts, ok in n.heartbeats:
        if ts <= t:
            state = ok
    return state


def ref_utilization(ns: list[Node], frm: float, to: float) -> dict[str, dict[str, float]]:
    """Per pool: capacity = GPU-seconds present, healthy and schedulable; allocated = x share;
    active = x activity; idle (activity < threshold) split by share into allocated / unallocated."""
    out: dict[str, dict[str, float]] = {}
    for n in ns:
        for s in n.samples:
            w = max(0.0, min(s.ts + n.interval, to) - max(s.ts, frm))
            if w == 0 or not _schedulable(n, s.ts):
                continue
            acc = out.setdefault(n.pool, dict.fromkeys(("cap", "alloc", "active", "idle_a", "idle_u"), 0.0))
            for g in s.gpus:
                if not g.healthy:
                    continue
                acc["cap"] += w
                acc["alloc"] += w * g.share
                acc["active"] += w * g.activity
                if g.activity < IDLE:
                    acc["idle_a"] += w * g.share
                    acc["idle_u"] += w * (1 - g.share)
    return {p: v for p, v in out.items() if v["cap"] > 0}


def _snapshot(n: Node, t: float) -> tuple[float, int, float] | None:
    """(free, whole free, largest free part of one GPU) from the latest sample at or before t,
    while it is younger than 2 x its interval; None: nothing known."""
    latest = [s for s in n.samples if s.ts <= t]
    if not latest:
        return None
    s = max(latest, key=lambda x: x.ts)
    if t - s.ts >= 2 * n.interval:
        return None
    ok = _schedulable(n, s.ts)
    free = [(1 - g.share) if (ok and g.healthy) else 0.0 for g in s.gpus]
    whole = sum(1 for g in s.gpus if ok and g.healthy and g.share == 0)
    return sum(free), whole, max(free)


def ref_starvation(
    ns: list[Node], rs: list[Request], frm: float, to: float
) -> dict[str, tuple[float, str, float]]:
    """Opened at submit + threshold if still pending; the cause from the free GPUs then."""
    out = {}
    for r in rs:
        opened = r.submit + THRESHOLD_S
        if not (frm <= opened < to) or (r.start is not None and r.start <= opened):
            continue
        snaps = [_snapshot(n, opened) for n in ns if r.pool in ("", n.pool)]
        known = [x for x in snaps if x is not None]
        free = sum(x[0] for x in known)
        fit = sum(
            1
            for x in known
            if (x[1] >= r.gpus_per_node if r.gpus_per_node >= 1 else x[2] + 1e-9 >= r.gpus_per_node)
        )
        need = r.nodes * r.gpus_per_node
        cause = "capacity" if free + 1e-9 < need else "fragmentation" if fit < r.nodes else "policy"
        out[r.rid] = (opened, cause, free)
    return out


# ----------------------------------------------------------------------------- the property
def _engine_util(
    store: ChdbStore, frm: float, to: float, cluster: str, ru: bool
) -> dict[str, dict[str, float]]:
    return {
        u.pool: {"cap": u.capacity_s, "alloc": u.allocated_s, "active": u.active_s,
                 "idle_a": u.idle_allocated_s, "idle_u": u.idle_unallocated_s}
        for u in utilization(store, frm, to, IDLE, cluster, rollup=ru)
        if u.capacity_s > 0
    }  # fmt: skip


def _engine_starvation(
    store: ChdbStore, frm: float, to: float, cluster: str, ru: bool
) -> dict[str, tuple[float, str, float]]:
    rows = starvation(store, frm, to, RulesConfig(), cluster, rollup=ru)
    return _norm({r["request_id"]: (r["opened"], r["cause"], r["free_gpus"]) for r in rows})


def _norm(d: dict[str, tuple[float, str, float]]) -> dict[str, tuple[float, str, float]]:
    return {k: (round(o, 3), c, round(f, 5)) for k, (o, c, f) in d.items()}


def _approx(d: dict[str, dict[str, float]]) -> object:
    return {k: pytest.approx(v, rel=1e-5, abs=1e-3) for k, v in d.items()}


def _check(
    store: ChdbStore, fleet: tuple[list[Node], list[Request]], window: tuple[float, float], late: Random
) -> None:
    ns, rs = fleet
    cluster = f"prop{next(_clusters)}"
    # some of the rows arrive after a refresh (late samples, late heartbeats, replays of a few)
    msgs = _messages(cluster, ns, rs)
    early = [m for m in msgs if late.random() < (0.5 if isinstance(m, NodeHeartbeat) else 0.7)]
    write(store, early)  # type: ignore[arg-type]
    rollup.refresh(store)
    write(store, [m for m in msgs if m not in early] + late.sample(early, min(2, len(early))))  # type: ignore[arg-type]
    rollup.refresh(store, overlap_s=0.0)  # the late rows' own marks only: no second look at the early ones
    frm, to = window
    mfrm, mto = math.floor(frm / 60) * 60, math.ceil(to / 60) * 60
    assert _engine_util(store, frm, to, cluster, False) == _approx(ref_utilization(ns, frm, to))
    ref_m = ref_utilization(ns, mfrm, mto)
    assert _engine_util(store, mfrm, mto, cluster, False) == _approx(ref_m)
    assert _engine_util(store, mfrm, mto, cluster, True) == _approx(ref_m)
    assert _engine_starvation(store, frm, to, cluster, False) == _norm(ref_starvation(ns, rs, frm, to))
    ref_s = _norm(ref_starvation(ns, rs, mfrm, mto))
    for ru in (False, True):
        assert _engine_starvation(store, mfrm, mto, cluster, ru) == ref_s
    # the whole of the samples over the rollups: every late row has been rolled in
    lo, hi = _span(ns)
    wfrm, wto = math.floor(lo / 60) * 60, math.ceil(hi / 60) * 60
    assert _engine_util(store, wfrm, wto, cluster, True) == _approx(ref_utilization(ns, wfrm, wto))
    # the fleet totals: every pool once, nodes without a pool included
    totals = cluster_totals(utilization(store, frm, to, IDLE, cluster))
    cap = sum(v["cap"] for v in ref_utilization(ns, frm, to).values())
    assert sum(t.capacity_s for t in totals.values()) == pytest.approx(cap, rel=1e-5, abs=1e-3)
    s = summary(store, RulesConfig(), mfrm, mto, cluster, source="auto")
    assert s.window.over == "rollups"
    assert s.capacity_gpu_hours == pytest.approx(sum(v["cap"] for v in ref_m.values()) / 3600, abs=1e-4)
    _check_panels(store, ns, rs, mfrm, mto, cluster)


def _check_panels(
    store: ChdbStore, ns: list[Node], rs: list[Request], frm: float, to: float, cluster: str
) -> None:
    """The overview's panels of the four numbers, expanded as Grafana and the plugin expand them
    for a whole-minute range (Grafana's ranges are in ms) and this cluster, against the reference."""
    q = panel_queries(RulesConfig(idle_threshold=IDLE))
    ref = ref_utilization(ns, frm, to)
    tot = {k: sum(v[k] for v in ref.values()) for k in ("cap", "alloc", "active", "idle_a", "idle_u")}

    def one(title: str, col: str) -> float | None:
        rows = store.query(expand(q[title][0], frm, to, cluster=cluster))
        return None if not rows or rows[0][col] is None else float(rows[0][col])

    near = {"rel": 1e-5, "abs": 1e-6}
    if tot["cap"] > 1e-3:
        assert one("Allocation CUR", "cur") == pytest.approx(tot["alloc"] / tot["cap"], **near)
        assert one("Active CUR", "cur") == pytest.approx(tot["active"] / tot["cap"], **near)
    assert (one("Idle GPU-hours, allocated", "gpu_hours") or 0.0) == pytest.approx(
        tot["idle_a"] / 3600, **near
    )
    assert (one("Idle GPU-hours, unallocated", "gpu_hours") or 0.0) == pytest.approx(
        tot["idle_u"] / 3600, **near
    )
    assert one("Starvation incidents", "incidents") == len(ref_starvation(ns, rs, frm, to))


_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@settings(max_examples=4, **_SETTINGS)  # type: ignore[arg-type]  # the fast tier; 50 below
@given(data=st.data())
def test_raw_rollups_and_reference_agree(shared_store: ChdbStore, data: st.DataObject) -> None:
    fleet = data.draw(fleets())
    _check(shared_store, fleet, data.draw(windows(fleet[0])), data.draw(st.randoms(use_true_random=False)))


@pytest.mark.integration
@settings(max_examples=50, **_SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_raw_rollups_and_reference_agree_more(shared_store: ChdbStore, data: st.DataObject) -> None:
    fleet = data.draw(fleets())
    _check(shared_store, fleet, data.draw(windows(fleet[0])), data.draw(st.randoms(use_true_random=False)))

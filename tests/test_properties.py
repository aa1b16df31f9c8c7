"""Property tests: CUR and idle from the SQL equal a straightforward reference computed here,
on random allocation timelines (fractional shares, drains, lost GPUs, any window)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.store import ChdbStore
from ingest.writer import write
from rules.evaluate import utilization
from tests import helpers as h
from tests.helpers import T0

IDLE = 0.05
_clusters = itertools.count()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path_factory.mktemp("props"))
    s.migrate()
    yield s
    s.close()


sample = st.tuples(
    st.sampled_from([0.0, 0.25, 0.5, 1.0]),  # share held
    st.sampled_from([0.0, 0.01, 0.3, 0.9]),  # activity
    st.booleans(),  # healthy
)
timeline = st.lists(st.lists(sample, min_size=2, max_size=2), min_size=1, max_size=12)  # ticks × 2 GPUs
drains = st.lists(st.booleans(), min_size=12, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tl=timeline, sched=drains, a=st.integers(0, 130), b=st.integers(1, 140))
def test_sql_matches_reference(shared_store: ChdbStore, tl: list[list[tuple[float, float, bool]]], sched: list[bool],
                               a: int, b: int) -> None:  # fmt: skip
    cluster = f"prop{next(_clusters)}"
    frm, to = T0 + min(a, b - 1 if b > a else a), T0 + max(b, a + 1)
    msgs: list[object] = []
    ref = {"cap": 0.0, "alloc": 0.0, "active": 0.0, "idle_a": 0.0, "idle_u": 0.0}
    for k, gpus in enumerate(tl):
        ts = T0 + 10 * k
        msgs.append(h.batch("n1", ts, [h.gpu(i, act, (("j", sh),) if sh else (), healthy=ok)
                                       for i, (sh, act, ok) in enumerate(gpus)], cluster=cluster))  # fmt: skip
        msgs.append(h.heartbeat("n1", ts, sched[k], cluster=cluster))
        w = max(0.0, min(ts + 10, to) - max(ts, frm))
        for sh, act, ok in gpus:
            if not (ok and sched[k]) or w == 0:
                continue
            ref["cap"] += w
            ref["alloc"] += w * sh
            ref["active"] += w * act
            if act < IDLE:
                ref["idle_a"] += w * sh
                ref["idle_u"] += w * (1 - sh)
    write(shared_store, msgs)  # type: ignore[arg-type]
    rows = [u for u in utilization(shared_store, frm, to, IDLE, cluster) if u.pool == ""]
    if ref["cap"] == 0:
        assert not rows or rows[0].capacity_s == 0
        return
    (u,) = rows
    got = {"cap": u.capacity_s, "alloc": u.allocated_s, "active": u.active_s, "idle_a": u.idle_allocated_s,
           "idle_u": u.idle_unallocated_s}  # fmt: skip
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-3)

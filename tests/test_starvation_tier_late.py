"""The starvation tier (capacity_steps_1m) under late heartbeats and an interrupted refresh:
a drain (and its end) arriving after the minutes it changes were rolled, re-sent with the
other state, exactly at a sample's time and at a minute edge, must reach the tier through
the heartbeat marks; a refresh that dies between the minute tier and the tier must leave its
marks for the next one. The expected values are the raw rows' (sql.STARVATION, the
definitions), as in tests/test_starvation_tier.py, whose fleets and comparison this reuses."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import evaluate, rollup
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import NodeHeartbeat
from tests import helpers as h
from tests.test_starvation_tier import M0, _cfg, _fleet, _three, _windows

_clusters = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path_factory.mktemp("tier-late") / "store")
    s.migrate(SCHEMA)
    try:
        yield s
    finally:
        s.close()


def _drains(cluster: str, nodes: list[str], times: list[float]) -> list[NodeHeartbeat]:
    """Drains and their ends for each node: at a sample's time, at a minute edge, off both."""
    out: list[NodeHeartbeat] = []
    for k, node in enumerate(nodes):
        on = [times[(3 * k + 5) % len(times)], M0 + 60 * (k + 1), M0 + 137.5 + 31 * k][k % 3]
        out.append(h.heartbeat(node, on, False, cluster=cluster))
        out.append(h.heartbeat(node, on + 120 + 60 * k, True, cluster=cluster))
    return out


@pytest.mark.integration  # a chDB round per seed
@pytest.mark.parametrize("seed", [0, 3, 5])
def test_late_drains_reach_the_tier(store: ChdbStore, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = f"L{next(_clusters)}"
    batches, events, opens = _fleet(seed, cluster, moves=False)
    write(
        store, batches + events + [h.heartbeat(b.node, M0 - 900, True, cluster=cluster) for b in batches[:1]]
    )
    rollup.refresh(store)
    before = [_three(store, frm, to, cluster, monkeypatch) for frm, to in _windows(opens)]
    nodes = sorted({b.node for b in batches})
    times = sorted({b.ts for b in batches})
    write(store, _drains(cluster, nodes, times))  # late: the minutes they change were rolled
    rollup.refresh(store)
    after = [_three(store, frm, to, cluster, monkeypatch) for frm, to in _windows(opens)]
    assert after != before  # the drains changed some incident's free GPUs or cause
    # the first drain re-sent as schedulable: it no longer drains
    first = _drains(cluster, nodes, times)[0]
    write(store, [first.model_copy(update={"schedulable": True, "state": "idle", "seq": 10**7})])
    rollup.refresh(store)
    for frm, to in _windows(opens):
        _three(store, frm, to, cluster, monkeypatch)


@pytest.mark.integration  # three chDB rounds
def test_a_refresh_dying_before_the_tier_leaves_its_marks(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = f"L{next(_clusters)}"
    batches, events, opens = _fleet(7, cluster, moves=False)
    write(store, batches[::2] + events)
    rollup.refresh(store)
    nodes = sorted({b.node for b in batches})
    write(store, batches[1::2] + _drains(cluster, nodes, sorted({b.ts for b in batches})))

    execute = store.execute

    def die(q: str, *a: Any, **k: Any) -> Any:
        if q == rollup.STEPS_REFRESH:
            raise RuntimeError("killed between the minute tier and the starvation tier")
        return execute(q, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(store, "execute", die)
        with pytest.raises(RuntimeError):
            rollup.refresh(store)
    stale = [evaluate.starvation(store, f, t, _cfg(), cluster, rollup=True) for f, t in _windows(opens)]
    rollup.refresh(store)
    after = [_three(store, frm, to, cluster, monkeypatch) for frm, to in _windows(opens)]
    assert after != stale  # the dead refresh left the tier behind; the next one caught it up

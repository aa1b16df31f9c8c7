"""The heartbeat join (rules/sql.py heartbeat_join: only the nodes some heartbeat says are not
schedulable are joined) and the starvation snapshot (NODE_SNAP_RAW: a node's GPUs summed per
(cluster, node, pool, ts) before the join), against states derived here from the definition
(docs/metrics.md): a sample counts when the node's latest heartbeat at or before it, however
old, says schedulable, or when it has none; of re-sent heartbeats at one time the one ingested
last stands. Hostile heartbeats: re-sent with the other state (inside the window and before it),
exactly at a sample's time, a drain only before the window's latest heartbeat, one node name in
two clusters (drained in one), a node in two pools at one time, no heartbeat at all; with and
without the cluster filter, and under either join_use_nulls (the join must not depend on it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpuslo.ingest.sqltext import fill
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import sql
from gpuslo.rules.tables import SCHEMA
from tests import helpers as h
from tests.helpers import T0

M = T0 + 7200.0  # a minute edge
FROM, TO = M + 30, M + 100
# (cluster, node, ts, schedulable, ingested_at offset): re-sent ones differ by ingested_at only
HEARTBEATS = [
    ("ca", "n2", M - 100, 1, 0),
    ("ca", "n2", M + 40, 1, 0),
    ("ca", "n3", M - 500, 0, 0),  # a drain long before: the latest before the window says 1
    ("ca", "n3", M - 200, 1, 0),
    ("ca", "n3", M + 50, 0, 0),  # exactly at a sample's time: that sample is drained
    ("ca", "n3", M + 75, 1, 0),
    ("ca", "n4", M - 50, 1, 0),  # re-sent drained: the later one stands (argMax part)
    ("ca", "n4", M - 50, 0, 5),
    ("ca", "n4", M + 20, 0, 0),  # re-sent schedulable: the later one stands (FINAL part)
    ("ca", "n4", M + 20, 1, 5),
    ("ca", "n5", M + 60, 0, 0),  # a node in two pools at one time, drained from M + 60
    ("cb", "n3", M - 200, 1, 0),  # n3 of another cluster: never drained
    ("cb", "n3", M + 50, 1, 0),
]
# per (cluster, node): [(pool, first GPU index, GPU shares)] of each sample time M + 10 k
NODES: dict[tuple[str, str], list[tuple[str, int, tuple[float, ...]]]] = {
    ("ca", "n1"): [("p", 0, (0.5, 0.0))],
    ("ca", "n2"): [("p", 0, (0.0, 0.0, 1.0))],
    ("ca", "n3"): [("p", 0, (0.5, 0.0))],
    ("ca", "n4"): [("p", 0, (0.25,))],
    ("ca", "n5"): [("a", 0, (0.0,)), ("b", 1, (0.25,))],
    ("cb", "n3"): [("p", 0, (0.0, 0.5))],
}
TIMES = [M + 10 * k for k in range(13)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path_factory.mktemp("hbjoin") / "store")
    s.migrate(SCHEMA)
    msgs: list[Any] = []
    for (cluster, node), batches in NODES.items():
        for t in TIMES:
            for pool, first, shares in batches:
                gpus = [h.gpu(first + i, 0.1, (("j", sh),) if sh else ()) for i, sh in enumerate(shares)]
                msgs.append(h.batch(node, t, gpus, interval_s=10.0, pool=pool, cluster=cluster))
    write(s, msgs)
    for cluster, node, ts, sched, late in HEARTBEATS:
        s.execute(
            "INSERT INTO node_heartbeats (cluster, node, pool, ts, interval_s, schedulable, state, reason, gpus,"
            " source, boot_id, seq, ingested_at) VALUES ({c:String}, {n:String}, 'p',"
            " toDateTime64({ts:Float64}, 3, 'UTC'), 10, {s:UInt8}, '', '', 8, {n:String}, 'b', 1,"
            " toDateTime64({at:Float64}, 3, 'UTC'))",
            {"c": cluster, "n": node, "ts": ts, "s": sched, "at": T0 + 10 * 86400 + late},
        )
    try:
        yield s
    finally:
        s.close()


def _schedulable(cluster: str, node: str, t: float) -> bool:
    """The node's state at ``t``: its latest heartbeat at or before ``t`` (of re-sent ones, the
    one ingested last), schedulable when it has none."""
    before = [(ts, late, s) for c, n, ts, s, late in HEARTBEATS if (c, n) == (cluster, node) and ts <= t]
    return not before or bool(max(before)[2])


def _expected_snap(cluster: str) -> list[tuple[Any, ...]]:
    lo = FROM - 2 * 10  # 2 x the longest interval before ``from``
    out = []
    for (c, node), batches in NODES.items():
        if cluster not in ("", c):
            continue
        for t in TIMES:
            if not lo <= t < TO:
                continue
            for pool, _first, shares in batches:
                ok = _schedulable(c, node, t)
                free = [(1 - sh) if ok else 0.0 for sh in shares]
                whole = sum(1 for sh in shares if ok and sh == 0)
                out.append((c, node, pool, t, round(sum(free), 9), whole, round(max(free), 9)))
    return sorted(out)


def _snap(store: ChdbStore, cluster: str, nulls: int) -> list[tuple[Any, ...]]:
    q = fill(
        "SELECT cluster, node, pool, t, free, whole_free, frac_free FROM {snap} AS ns "
        "SETTINGS join_use_nulls = {nulls}",
        snap=sql.NODE_SNAP_RAW,
        nulls=str(nulls),
    )
    rows = store.query(q, {"from": FROM, "to": TO, "cluster": cluster})
    return sorted(
        (r["cluster"], r["node"], r["pool"], float(r["t"]), round(float(r["free"]), 9), int(r["whole_free"]),
         round(float(r["frac_free"]), 9))
        for r in rows
    )  # fmt: skip


@pytest.mark.parametrize("nulls", [1, 0], ids=["join_use_nulls=1", "join_use_nulls=0"])
@pytest.mark.parametrize("cluster", ["", "ca", "cb"])
def test_snapshot_rows_follow_each_nodes_state(store: ChdbStore, cluster: str, nulls: int) -> None:
    expected = _expected_snap(cluster)
    assert any(f > 0 for *_, f, _w, _x in expected)
    assert cluster == "cb" or any(f == 0 for *_, f, _w, _x in expected)  # a drained node's rows
    assert _snap(store, cluster, nulls) == expected


def _expected_cap(cluster: str) -> list[tuple[Any, ...]]:
    out = []
    for (c, node), batches in NODES.items():
        if cluster not in ("", c):
            continue
        for t in TIMES:
            if not (t + 10 > FROM and t < TO):
                continue
            ok = _schedulable(c, node, t)
            for pool, first, shares in batches:
                out += [(c, node, pool, t, first + i, 1.0 if ok else 0.0) for i in range(len(shares))]
    return sorted(out)


@pytest.mark.parametrize("nulls", [1, 0], ids=["join_use_nulls=1", "join_use_nulls=0"])
@pytest.mark.parametrize("cluster", ["", "ca", "cb"])
def test_capacity_samples_follow_each_nodes_state(store: ChdbStore, cluster: str, nulls: int) -> None:
    q = fill(
        "SELECT cluster, node, pool, toFloat64(ts) AS t, gpu, cap_w FROM ({samples}) "
        "SETTINGS join_use_nulls = {nulls}",
        samples=sql.CAPACITY_SAMPLES,
        nulls=str(nulls),
    )
    rows = store.query(q, {"from": FROM, "to": TO, "cluster": cluster})
    got = sorted(
        (r["cluster"], r["node"], r["pool"], float(r["t"]), int(r["gpu"]), float(r["cap_w"])) for r in rows
    )
    assert got == _expected_cap(cluster)

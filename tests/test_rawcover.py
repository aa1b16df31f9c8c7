"""rules/rawcover.py: the bill, the MIG advice and a job's report refuse a window whose raw rows
are gone while the minute rollups still hold its capacity. Attacked from both sides: a window
whose raw rows are all there is never refused (a change the rollups have yet to take: a late
heartbeat draining a node, a sample replaced as unhealthy), and the rows of one node, or of one
GPU, gone for a few minutes are refused whatever the window's edges. Its own module: the
function-scoped chDB store (one data directory per process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rightsize as rs
from gpuslo.rules import rollup
from gpuslo.rules.chargeback import ChargebackError, compute
from gpuslo.rules.config import parse
from gpuslo.rules.rawcover import RawRowsGone
from gpuslo.wire import Allocation, GpuSample
from tests import helpers as h
from tests.helpers import T0

HOUR = 3600.0
END = T0 + 2 * HOUR
CFG = parse({"chargeback": {"per_gpu_hour": {"M1": 2.0}}})


def _gpu(index: int, held: bool, healthy: bool = True) -> GpuSample:
    return GpuSample(
        index=index, uuid=f"GPU-{index}", model="M1", healthy=healthy,
        fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.2} if healthy else {},
        allocations=(Allocation(scheduler="slurm", id="j", user="u", account="A", queue="q", share=1.0),) if held else (),
    )  # fmt: skip


def _samples(node: str, gpus: int, frm: float, to: float, healthy: bool = True) -> list[Any]:
    return [
        h.batch(node, t, [_gpu(i, node == "n1" and i == 0, healthy) for i in range(gpus)])
        for t in range(int(frm), int(to), 10)
    ]


def _capacity(store: ChdbStore, frm: float, to: float) -> float:
    """The bill's capacity GPU-hours; the advice is asked too (both refuse the same windows)."""
    rs.rightsizing(store, frm, to)
    return float(compute(store, CFG, frm, to).totals["gpu_hours_capacity"])


def _overlap(frm: float, to: float, a: float, b: float) -> float:
    return max(0.0, min(to, b) - max(frm, a))


# a change of the raw rows the rollups take at their next refresh, and the capacity seconds per
# GPU of n1 it takes out of [a, b) (independent of the code: the definition, docs/metrics.md)
LATE: dict[str, tuple[Callable[[ChdbStore], None], float, float]] = {
    # the node was drained from T0 + 1800: its heartbeat came after the refresh
    "late heartbeat drains": (lambda st: write(st, [h.heartbeat("n1", T0 + 1800, False, gpus=2)]), T0 + 1800, END),
    # the samples of ten minutes sent again, as unhealthy (replaced: the newer ingested_at wins)
    "samples replaced unhealthy": (
        lambda st: write(st, _samples("n1", 2, T0 + 1800, T0 + 2400, healthy=False)), T0 + 1800, T0 + 2400,
    ),
}  # fmt: skip
WINDOWS = [
    (T0, END),
    (T0 + 17.5, END - 0.5),
    (T0 + HOUR, END),
    (T0 + 1790.25, T0 + 2430.75),
    (T0 + 60, T0 + 1800),
]


@pytest.mark.integration  # rollup refreshes and many chDB queries per case
@pytest.mark.parametrize("case", list(LATE))
def test_a_change_the_rollups_have_yet_to_take_is_no_refusal_and_rows_gone_still_are(
    store: ChdbStore, case: str
) -> None:
    """A late heartbeat draining a node, or samples replaced as unhealthy, take capacity out of
    the raw rows at once and out of the rollups at their next refresh: in between, every window
    reaching them was refused as if its raw rows were gone ("past its retention, or deleted")
    while all of them were there. They are answered (the raw rows' numbers); rows really gone,
    on another node meanwhile, are still refused, before and after the refresh."""
    write(store, [h.heartbeat(n, T0 - 5, True, gpus=2) for n in ("n1", "n2")])
    write(store, _samples("n1", 2, T0, END) + _samples("n2", 2, T0, END))
    rollup.refresh(store)
    change, a, b = LATE[case]
    change(store)

    def expected(frm: float, to: float) -> float:  # 4 GPUs, less n1's 2 in [a, b)
        return (4 * (to - frm) - 2 * _overlap(frm, to, a, b)) / HOUR

    for frm, to in WINDOWS:
        assert _capacity(store, frm, to) == pytest.approx(expected(frm, to), abs=1e-6), (frm, to)
    # n2's rows of ten minutes deleted (no mark: the rollups keep them): refused, naming n2
    store.execute(
        "DELETE FROM gpu_samples WHERE node = 'n2' AND ts >= toDateTime64({a:Float64}, 3, 'UTC') "
        "AND ts < toDateTime64({b:Float64}, 3, 'UTC')",
        {"a": T0 + 600, "b": T0 + 1200},
    )
    for refreshed in (False, True):
        if refreshed:  # (no look-back: the first refresh's marks, seconds old, would re-roll n2's minutes)
            rollup.refresh(store, overlap_s=0.0)
        for frm, to in WINDOWS:
            if _overlap(frm, to, T0 + 600, T0 + 1200) >= 120:
                with pytest.raises(ChargebackError, match=r"in cluster 'c1' \(node 'n2'"):
                    compute(store, CFG, frm, to)
                with pytest.raises(RawRowsGone, match=r"node 'n2'"):
                    rs.rightsizing(store, frm, to)
            else:
                assert _capacity(store, frm, to) == pytest.approx(expected(frm, to), abs=1e-6), (frm, to)


@pytest.mark.integration  # a rollup refresh and many chDB queries per case
@pytest.mark.parametrize("span_s", [120.0, 600.0, HOUR])
def test_one_gpus_rows_gone_are_refused_whatever_the_windows_edges(store: ChdbStore, span_s: float) -> None:
    """Twenty nodes of four GPUs: the raw rows of the partial minutes at a window's edges (up to
    two minutes of every GPU, here 2.6 GPU-h) hid the rows of one GPU gone for an hour when the
    cluster's totals were compared (the bill of what was left passed off as whole). Compared per
    node over whole minutes, any span of at least two minutes gone is refused, at any edges."""
    nodes = [f"n{k:02d}" for k in range(20)]
    msgs: list[Any] = []
    for n in nodes:
        msgs += [h.batch(n, t, [_gpu(i, False) for i in range(4)]) for t in range(int(T0), int(END), 10)]
    write(store, msgs)
    rollup.refresh(store)
    for frm, to in ((T0, END), (T0 + 0.5, END - 0.5), (T0 + 59.0, END - 59.0)):
        assert _capacity(store, frm, to) == pytest.approx(80 * (to - frm) / HOUR, abs=1e-6)
    store.execute(
        "DELETE FROM gpu_samples WHERE node = 'n07' AND gpu = 3 AND ts >= toDateTime64({a:Float64}, 3, 'UTC') "
        "AND ts < toDateTime64({b:Float64}, 3, 'UTC')",
        {"a": T0 + 1800, "b": T0 + 1800 + span_s},
    )
    for frm, to in ((T0 + 0.5, END - 0.5), (T0 + 59.0, END - 59.0), (T0, END)):
        with pytest.raises(ChargebackError, match="are gone") as bill:
            compute(store, CFG, frm, to)
        with pytest.raises(RawRowsGone, match="are gone") as advice:
            rs.rightsizing(store, frm, to)
        for refused in (bill, advice):  # the node said, and both sides' capacity of its whole minutes
            assert "(node 'n07'; past its retention" in str(refused.value), str(refused.value)

"""Time-series panels split coarse samples at bucket edges exactly as the engine clips them at
a window's: samples of 1,000 s and 3,600 s (longer than the 300 s buckets), a range that starts
and ends inside samples, each bucket compared with the engine over that bucket."""

from __future__ import annotations

import pytest

from gpuslo.dashboards.overview import panel_queries
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import cluster_totals, utilization
from tests import helpers as h
from tests.grafana import INTERVAL_S, expand
from tests.helpers import T0


def tsec(v: object) -> float:
    return float(v.timestamp()) if hasattr(v, "timestamp") else float(v)  # type: ignore[attr-defined, arg-type]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    ("frm", "to"),
    [  # unaligned over many buckets (integration: one engine call per bucket), aligned, inside one bucket
        pytest.param(T0 + 450, T0 + 3 * 3600 + 17, marks=pytest.mark.integration),
        (T0, T0 + 7200),
        (T0 + 299, T0 + 301),
    ],
)
def test_cur_and_idle_per_bucket_equal_the_engine(store: ChdbStore, frm: float, to: float) -> None:
    msgs: list[object] = []
    for k in range(12):  # node a: 1,000 s samples, GPU 0 held and busy every other sample
        msgs.append(h.batch("a", T0 + 1000 * k, [h.gpu(0, 0.9 if k % 2 else 0.0, (("j", 0.5),)), h.gpu(1, 0.0)],
                            interval_s=1000.0))  # fmt: skip
    for k in range(4):  # node b: hourly samples, held whole and idle
        msgs.append(h.batch("b", T0 + 3600 * k, [h.gpu(0, 0.01, (("k", 1.0),))], interval_s=3600.0))
    write(store, msgs)  # type: ignore[arg-type]
    cfg = RulesConfig()
    q = panel_queries(cfg)
    cur = {tsec(r["time"]): r for r in store.query(expand(q["CUR over time"][0], frm, to))}
    idle = {tsec(r["time"]): r for r in store.query(expand(q["Idle GPU-hours over time"][0], frm, to))}
    b, expect = frm // INTERVAL_S * INTERVAL_S, {}
    while b < to:
        (u,) = cluster_totals(utilization(store, max(b, frm), min(b + INTERVAL_S, to), 0.05)).values()
        expect[b] = u
        b += INTERVAL_S
    assert set(cur) == set(idle) == set(expect)
    for b, u in expect.items():
        assert cur[b]["allocation"] == pytest.approx(u.allocated_s / u.capacity_s, rel=1e-9), b
        assert cur[b]["active"] == pytest.approx(u.active_s / u.capacity_s, rel=1e-9), b
        assert idle[b]["allocated_idle"] == pytest.approx(u.idle_allocated_s / 3600, rel=1e-9, abs=1e-12), b
        assert idle[b]["unallocated"] == pytest.approx(u.idle_unallocated_s / 3600, rel=1e-9, abs=1e-12), b
    # the buckets add up to the whole range
    (whole,) = cluster_totals(utilization(store, frm, to, 0.05)).values()
    assert sum(r["allocated_idle"] for r in idle.values()) * 3600 == pytest.approx(
        whole.idle_allocated_s, rel=1e-9
    )

"""The SLO burn panel against the engine's steps (rules.sql.slo_steps) at any evaluation step.
(Apart from tests/test_dashboard_numbers.py, whose module-wide demo store holds chDB's one data
directory of the process: these tests each open a store of their own.)"""

from __future__ import annotations

import math

import pytest

from gpuslo.dashboards import views
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import sql
from gpuslo.rules.config import example
from gpuslo.rules.evaluate import slo_steps
from tests import helpers as h
from tests.grafana import expand
from tests.test_dashboard_numbers import APPROX, spec_sql, tsec


@pytest.mark.parametrize("every_s", [60, 300, 420])  # a delta a minute; sparse traffic
@pytest.mark.parametrize("step", [60, 120, 600])
def test_the_burn_panel_equals_the_engine_at_any_evaluation_step(
    store: ChdbStore, step: int, every_s: int
) -> None:
    """A step that does not divide a window (120 s, 5 m), or is longer than one (600 s), gave
    the panel windows of whole steps (4 m), or a negative frame (an error); with requests not in
    every bin, only the steps whose own last bin had some (a delta every 5 m, steps of 2 m: one
    in five). The panel shows every step the engine has from the first requests to the last."""
    n = 300 * 60 // every_s
    write(store, [h.latency(h.T0 + every_s * i + 0.5 * (i % 3), 10 + i % 7, i % 4) for i in range(1, n)])  # type: ignore[arg-type]
    cfg = example().model_copy(update={"eval_step_s": step})
    slo = cfg.slos[0].model_copy(update={"service": "svc", "threshold_ms": 5.0, "buckets_ms": ()})
    cfg = cfg.model_copy(update={"slos": (slo,)})
    frm, to = h.T0, h.T0 + 6 * 3600
    burn = store.query(expand(spec_sql("slo.json", f"{slo.name}: burn rate per alert window", cfg), frm, to))
    steps = {float(r["t"]): r for r in slo_steps(store, slo, frm, to, step)}
    lengths = sorted({w.long_s for w in slo.windows} | {w.short_s for w in slo.windows})
    assert burn
    b = sql.window_bin_s(step, lengths)
    last = store.query("SELECT max(toFloat64(ts)) AS ts FROM latency")[0]["ts"]
    last_bin = math.ceil(last / b) * b  # the engine's steps go on past it (its windows reach back)
    assert [tsec(r["time"]) for r in burn] == [t for t in sorted(steps) if t <= last_bin]  # every step
    for r in burn:
        e = steps[tsec(r["time"])]
        for w in lengths:
            n, g = float(e[f"total_{w}"] or 0), float(e[f"good_{w}"] or 0)
            want = None if n == 0 else pytest.approx((1 - g / n) / (1 - slo.objective), **APPROX)
            assert r[f"burn_{views._label(w)}"] == want

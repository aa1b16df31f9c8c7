"""The SLO burn-rate panel against the engine at evaluation steps that do not divide the alert
windows. (Apart from tests/test_dashboard_numbers.py, whose module-wide stores hold chDB's one
data directory of the process: these tests each open a store of their own.)"""

from __future__ import annotations

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.config import example
from tests import helpers as h
from tests.grafana import expand
from tests.test_dashboard_numbers import burn_is_the_engines, spec_sql


@pytest.mark.parametrize("step", [60, 120, 600])
def test_the_burn_panel_equals_the_engine_at_any_evaluation_step(store: ChdbStore, step: int) -> None:
    """A step that does not divide a window (120 s, 5 m), or is longer than one (600 s), gave
    the panel windows of whole steps (4 m), or a negative frame (an error)."""
    write(store, [h.latency(h.T0 + 60 * i + 0.5 * (i % 3), 10 + i % 7, i % 4) for i in range(1, 300)])  # type: ignore[arg-type]
    cfg = example().model_copy(update={"eval_step_s": step})
    slo = cfg.slos[0].model_copy(update={"service": "svc", "threshold_ms": 5.0, "buckets_ms": ()})
    cfg = cfg.model_copy(update={"slos": (slo,)})
    frm, to = h.T0, h.T0 + 6 * 3600
    burn = store.query(expand(spec_sql("slo.json", f"{slo.name}: burn rate per alert window", cfg), frm, to))
    burn_is_the_engines(store, burn, slo, frm, to, step)

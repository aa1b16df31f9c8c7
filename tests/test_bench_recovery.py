"""``python -m bench recovery`` on a real broker at a small size (one outage of 1 s per setting):
both settings are measured in the run, every figure is a real wait (the ingest wrote every batch
sent after the outage, the agent's spool emptied), and the ratios are the medians' in the run."""

from __future__ import annotations

import json

import pytest

from bench import recovery
from gpuslo.core import settings

pytestmark = pytest.mark.integration


def test_bench_recovery_measures_both_settings_after_a_real_outage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert recovery.main(["--runs", "1", "--outage-s", "1", "--timeout-s", "90"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "recovery" and out["runs"] == 1 and out["outage_s"] == 1.0
    assert out["gpuslo"]["reconnect_backoff_max_ms"] == [settings.RECONNECT_BACKOFF_MAX_MS]
    assert out["kafka_python_default"]["reconnect_backoff_max_ms"] == [recovery.KAFKA_PYTHON_DEFAULT_MS]
    assert settings.RECONNECT_BACKOFF_MAX_MS == 1000  # put back after the run
    for what in ("ingest", "agent"):
        g, d = out[f"{what}_median_s"], out[f"{what}_median_s_kafka_python_default"]
        assert 0 < g < 90 and 0 < d < 90
        assert out[f"ratio_{what}_vs_kafka_python_default"] == pytest.approx(g / d, rel=0.02)

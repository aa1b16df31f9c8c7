"""``python -m bench recovery`` on a real broker at a small size (one outage of 1 s per setting):
both settings are measured in the run, every figure is a real wait (the ingest wrote every batch
sent after the outage, the agent's spool emptied), and the ratios are the medians' in the run."""

from __future__ import annotations

import json
import time

import pytest

from bench import recovery
from bench.send import node_ticks
from gpuslo.core import settings
from gpuslo.core.settings import Topics
from tests.servers.ports import free_port


@pytest.mark.integration
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


def test_a_broker_not_acknowledging_within_the_bound_is_one_line_not_a_traceback() -> None:
    """``--timeout-s 0.001``: kafka-python's KafkaTimeoutError (metadata not fetched within
    max_block_ms) came out of the run as a traceback; a port that refuses, likewise."""
    msgs = [m for t in node_ticks(1) for m in t]
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        recovery._produce(f"127.0.0.1:{free_port()}", Topics(), msgs, 0.5)
    assert time.monotonic() - t0 < 10
    said = str(e.value.code)
    assert said.startswith("bench recovery: ") and "\n" not in said, said


def test_a_wait_done_past_its_bound_is_an_error_never_a_figure() -> None:
    """A wait that ends only after ``--timeout-s`` (its first check slow, or the ingest's batches
    produced after the bound) gives no figure: 0.05 s was returned for a 0.01 s bound."""

    def slow() -> bool:
        time.sleep(0.05)
        return True

    with pytest.raises(SystemExit, match=r"not done 0\.01 s after"):
        recovery._wait(slow, 0.01, "the ingest")
    with pytest.raises(SystemExit, match="not done 1 s after"):
        recovery._wait(lambda: True, 1.0, "the ingest", t0=time.monotonic() - 2)
    assert 0 <= recovery._wait(lambda: True, 1.0, "the ingest") < 1

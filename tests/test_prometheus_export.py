"""The exported Prometheus rules and gpuslo's own engine, fed the same burn scenario, fire
the same alerts at the same evaluation times (promtool test rules, real Prometheus engine)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.rules.evaluate import _burn, slo_steps
from gpuslo.rules.prometheus import render
from tests import helpers as h
from tests.helpers import T0

SLO = Slo(name="chat-p99", service="chat", objective=0.99, threshold_ms=5, min_requests=100,
          prometheus_metric="chat_request_latency_seconds", prometheus_unit="s")  # fmt: skip
CFG = RulesConfig(slos=(SLO,))
MINUTES = 240


def scenario() -> list[tuple[int, int]]:
    """(good, bad) per minute 1..MINUTES: good, then 25 % bad for an hour, then good."""
    return [(750, 250) if 101 <= i <= 160 else (1000, 0) for i in range(1, MINUTES + 1)]


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    return exe


def test_exported_rules_pass_promtool_check(tmp_path: Path) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text(render(CFG))
    r = subprocess.run([promtool(), "check", "rules", str(p)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 15 rules found" in r.stdout


@pytest.mark.integration
@pytest.mark.parametrize("period_d", [30, 7])
def test_promtool_and_gpuslo_fire_the_same_alerts(store: ChdbStore, tmp_path: Path, period_d: int) -> None:
    """Also for a 7-day SLO, whose factors (13.44, 3.5, 1.4, 0.98) differ from the 30-day ones:
    both engines must use the same ones."""
    slo = Slo.model_validate({**SLO.model_dump(exclude={"windows"}), "period_d": period_d})
    cfg = RulesConfig(slos=(slo,))
    assert [w.factor for w in slo.windows] == ([14.4, 6, 3, 1] if period_d == 30 else [13.44, 3.5, 1.4, 0.98])
    mins = scenario()
    write(store, [h.latency(T0 + 60 * i, g, b, service="chat") for i, (g, b) in enumerate(mins, start=1)])  # type: ignore[arg-type]
    steps = {int((r["t"] - T0) // 60): r for r in slo_steps(store, slo, T0, T0 + 60 * MINUTES)}
    firing: dict[int, list[dict[str, str]]] = {}
    for minute in range(10, MINUTES + 1, 5):
        row = steps[minute]
        alerts = []
        for w in slo.windows:
            bl = _burn(float(row[f"good_{w.long_s}"]), float(row[f"total_{w.long_s}"]), slo.objective)
            bs = _burn(float(row[f"good_{w.short_s}"]), float(row[f"total_{w.short_s}"]), slo.objective)
            assert abs(bl - w.factor) > 1e-6 and abs(bs - w.factor) > 1e-6, "a tie: choose other eval times"
            if bl > w.factor and bs > w.factor and float(row[f"total_{w.short_s}"]) >= slo.min_requests:
                alerts.append(
                    {"severity": w.severity, "window": f"{w.long}/{w.short}", "factor": f"{w.factor:g}"}
                )
        firing[minute] = alerts
    assert any(firing.values()) and not all(firing.values())  # the scenario both fires and resolves

    good_cum = bad_cum = 0
    bucket, count = ["0"], ["0"]
    for g, b in mins:
        good_cum += g
        bad_cum += b
        bucket.append(str(good_cum))
        count.append(str(good_cum + bad_cum))
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": 'chat_request_latency_seconds_bucket{le="0.005"}', "values": " ".join(bucket)},
                {"series": "chat_request_latency_seconds_count", "values": " ".join(count)},
            ],
            "alert_rule_test": [
                {"eval_time": f"{m}m", "alertname": "GpusloSLOBurn", "exp_alerts": [
                    {"exp_labels": {"severity": a["severity"], "slo": "chat-p99", "service": "chat", "window": a["window"]},
                     "exp_annotations": {"summary": f"chat-p99: error budget burning faster than {a['factor']}x over "
                                                    f"{a['window'].split('/')[0]} and {a['window'].split('/')[1]}"}}
                    for a in alerts
                ]}
                for m, alerts in firing.items()
            ],
        }],
    }  # fmt: skip
    (tmp_path / "rules.yaml").write_text(render(cfg))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    r = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]

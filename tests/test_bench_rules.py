"""The rules benchmark runs, and its two evaluations agree (a tiny fleet; no timing here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration  # runs the benchmark end to end
def test_bench_rules_small_fleet_agrees_over_rollups_and_raw() -> None:
    r = subprocess.run([sys.executable, "-m", "bench", "rules", "--gpus", "16", "--days", "0.25"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["bench"] == "rules" and fig["gpu_sample_rows"] == 16 * 2160
    assert fig["same_summary"] is True and fig["same_without_raw"] is True

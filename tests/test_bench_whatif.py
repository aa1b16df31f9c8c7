"""The what-if benchmark runs at a tiny size, every policy and the load from chDB, and its
figures are consistent (no timing here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import whatif as bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration  # runs the benchmark end to end: processes, chDB
def test_bench_whatif_runs_at_a_tiny_size() -> None:
    r = subprocess.run([sys.executable, "-m", "bench", "whatif", "--gpus", "32", "--days", "1", "--requests", "80",
                        "--load", "--sample-s", "900"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["bench"] == "whatif" and fig["nodes"] == 4
    for p in bench.POLICIES:
        k = bench._key(p)
        assert fig[f"seconds_{k}"] > 0 and fig[f"cpu_seconds_{k}"] > 0 and fig[f"peak_rss_mb_{k}"] > 0, k
        assert 0 < fig[f"cur_{k}"] <= 1 and 0 < fig[f"started_{k}"] <= 80, k
    # the recorded schedule is the back-fill+gang one: the same numbers
    assert fig["cur_recorded"] == fig["cur_backfill_gang"]
    assert fig["started_recorded"] == fig["started_backfill_gang"]
    # what was written comes back: every request submitted in the window, every node
    assert fig["seconds_load"] > 0 and fig["load_requests"] == fig["requests_in_window"] > 0
    assert fig["load_spans"] >= fig["nodes"]

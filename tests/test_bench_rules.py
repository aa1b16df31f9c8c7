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
    r = subprocess.run([sys.executable, "-m", "bench", "rules", "--gpus", "16", "--days", "0.25",
                        "--big-gpus", "24", "--big-days", "0.5"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["bench"] == "rules" and fig["gpu_sample_rows"] == 16 * 2160
    assert fig["same_summary"] is True and fig["same_without_raw"] is True and fig["same_summary_1m"] is True
    # the big case: its minute tier (3 nodes x 720 minutes), its hourly tier (3 nodes x 12 hours)
    assert fig["big_gpu_minute_rows"] == 3 * 720 and fig["big_node_hours"] == 3 * 12
    assert fig["big_same_summary"] is True and fig["big_eval_raw_s"] is None
    assert set(fig["big_profile_hourly_s"]) == {
        "utilization",
        "top_idle",
        "fair_share",
        "starvation",
        "slo bench-p99",
    }
    for k in (
        "big_generate_s",
        "big_rollup_build_s",
        "big_eval_hourly_s",
        "big_eval_hourly_first_s",
        "big_eval_minute_s",
        "big_ratio_hourly_vs_minute",
        "eval_rollup_1m_s",
    ):
        assert isinstance(fig[k], float), k


def _rows(store: object, q: str) -> list[tuple[object, ...]]:
    out = []
    for r in store.query(q):  # type: ignore[attr-defined]
        out.append(tuple(round(v, 6) if isinstance(v, float) else
                         [round(x, 6) if isinstance(x, float) else x for x in v] if isinstance(v, list) else v
                         for v in r.values()))  # fmt: skip
    return out


@pytest.mark.integration  # over 0.7 s
def test_the_big_cases_minute_tier_by_sql_is_the_refresh_of_the_raw_fleet(tmp_path: Path) -> None:
    """bench rules writes its big case as the minute tier, straight from the generator's formulas:
    row for row what the refresh computes from the generated raw samples and heartbeats (a fleet
    crossing job blocks and into the drain day: 2 nodes, node 0 drained on day 2, 49 h 10 min)."""
    from bench import rules as br
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules import rollup
    from gpuslo.rules.tables import SCHEMA

    minutes = 49 * 60 + 10
    keep = f"minute < toDateTime({br.START + minutes * 60}, 'UTC')"  # (the refresh has one more: the
    # last sample's snapshot reaches the minute after the fleet)
    got = {}
    for how in ("raw", "sql"):
        s = ChdbStore(tmp_path / how)
        try:
            s.migrate(SCHEMA)
            p = {"start": br.START, "nodes": 2, "ticks": minutes * 6}
            if how == "raw":
                br._gpu_samples(s, p)
                br._heartbeats(s, p)
                rollup.refresh(s)
            else:
                br._gpu_minutes(s, {**p, "minutes": p["ticks"] // 6})
                br._owner_minutes(s, {**p, "minutes": p["ticks"] // 6})
            got[how] = (
                _rows(
                    s, f"SELECT * EXCEPT version FROM gpu_rollup_1m FINAL WHERE {keep} ORDER BY node, minute"
                ),
                _rows(
                    s,
                    f"SELECT * EXCEPT version FROM owner_rollup_1m FINAL WHERE {keep} ORDER BY node, minute, id",
                ),
            )
        finally:
            s.close()
    assert len(got["raw"][0]) == 2 * minutes and len(got["raw"][1]) > 0
    assert got["sql"] == got["raw"]

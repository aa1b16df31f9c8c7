"""The demo's idle-reclaim notices (dry-run) against the simulator's own account of which jobs
were idle (agent/sim/truth.py: from its per-GPU busy stretches, never from the samples or the
store), at each of the demo's hourly rounds, on several seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.embedded import DemoResult, run_demo
from gpuslo.rules.config import example
from tests.helpers import short_sim


def _compare(j: dict[str, Any], interval_s: float, threshold_s: float) -> int:
    """Rules vs truth per round; a job whose true idle time is within two sampling intervals of
    the threshold may fall either way (a sample stands for its whole interval). The number of
    notices compared."""
    rounds, truth = j["reclaim"]["rounds"], j["ground_truth"]["reclaim_rounds"]
    assert [r["at"] for r in rounds] == [t["at"] for t in truth]
    compared = 0
    for got, tr in zip(rounds, truth, strict=True):
        unsure = {k for k, v in tr["idle_s"].items() if abs(v - threshold_s) <= 2 * interval_s}
        assert set(got["jobs"]) - unsure == set(tr["idle_holders"]) - unsure, got["at"]
        compared += len(got["jobs"])
    last = truth[-1]
    for n in j["reclaim"]["notices"]:  # the final round's numbers
        job, a = n["labels"]["job"], n["annotations"]
        true_s = last["idle_s"][job]
        if a["at_least"] == "true":  # its run began before the read-back: a lower bound
            assert float(a["idle_for_s"]) <= true_s + interval_s
        else:
            assert abs(float(a["idle_for_s"]) - true_s) <= interval_s
        assert float(a["gpus"]) == last["gpus"][job]
    return compared


def test_demo_json_carries_the_notices_and_the_truth(short_demo: tuple[SimConfig, DemoResult, Path]) -> None:
    sim, res, _ = short_demo
    j = res.to_json()
    assert set(j["reclaim"]) == {"notices", "actions", "rounds"}
    _compare(j, sim.interval_s, example().reclaim.idle_after_s)


@pytest.mark.integration  # two 2-hour runs of a 4-node fleet
@pytest.mark.parametrize("seed", [1, 2])
def test_notices_match_the_simulator_truth(seed: int, tmp_path: Path) -> None:
    cfg = example()
    cfg = cfg.model_copy(update={"reclaim": cfg.reclaim.model_copy(update={"idle_after_s": 600.0})})
    sim = short_sim(seed=seed, nodes=4, jobs_per_hour=24.0, hours=2.0)
    j = run_demo(sim, cfg, tmp_path / "demo").to_json()
    assert _compare(j, sim.interval_s, 600.0) >= 1  # something to compare
    # dry-run: decisions recorded, each a `would`, for jobs idle 600 + 1800 s
    assert {a["outcome"] for a in j["reclaim"]["actions"]} <= {"would"}
    # the summary's table: one row per job noticed, as many as the rounds noticed
    from gpuslo.app.text import reclaim

    noticed = {x for r in j["reclaim"]["rounds"] for x in r["jobs"]}
    out = reclaim(j["reclaim"], j["ground_truth"]).splitlines()
    assert out[0].startswith(
        f"Idle-reclaim notices that would be sent ({len(noticed)} jobs; simulator truth: "
    )
    assert {line.split()[0] for line in out[3 : 3 + len(noticed)]} == noticed

"""The whole embedded pipeline against the simulator's own ground truth.

The truth is integrated by the simulator from its scheduler state, exactly between
events; the numbers under test went through agents, wire bytes, the ingest, chDB and
the rule SQL. They must agree within 1 % for CUR and idle, exactly for incidents."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.embedded import run_demo
from gpuslo.rules.config import example

SEEDS = [1, 2, 4]
# the fast tier: one 4-hour run with every event of the scenario; the integration tier: the
# 12-hour default scenario for each seed
RUNS = [
    pytest.param(None, id="4h-seed1"),  # the session's short_demo
    *(pytest.param(SimConfig(seed=s), id=f"12h-seed{s}", marks=pytest.mark.integration) for s in SEEDS),
]


@pytest.fixture(scope="module", params=RUNS)
def demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if request.param is None:
        res = request.getfixturevalue("short_demo")[1]
    else:
        res = run_demo(request.param, example(), tmp_path_factory.mktemp("demo"))
    assert res.ingest.rejected == []
    return res.to_json()  # the JSON of demo --json


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize(
    "key", ["cur_allocation", "cur_active", "idle_allocated_gpu_hours", "idle_unallocated_gpu_hours"]
)
def test_cur_and_idle_within_one_percent_of_truth(demo: dict[str, Any], key: str) -> None:
    truth = demo["ground_truth"][key]
    assert truth > 0
    assert rel(demo[key], truth) <= 0.01, (demo[key], truth)


def test_incidents_exactly_as_the_simulator_saw_them(demo: dict[str, Any]) -> None:
    got = {i["request_id"]: i["cause"] for i in demo["starvation_incidents"]}
    want = {i["request_id"]: i["cause"] for i in demo["ground_truth"]["starvation_incidents"]}
    assert len(want) > 0
    assert got == want
    assert Counter(got.values()) == Counter(want.values())
    for i, j in zip(demo["starvation_incidents"], demo["ground_truth"]["starvation_incidents"], strict=True):
        assert i["opened"] == pytest.approx(j["opened"], abs=0.002)  # stored at millisecond precision


def test_slo_alerts_match_the_simulators_own_evaluation(demo: dict[str, Any]) -> None:
    def key(a: dict[str, Any]) -> tuple[Any, ...]:
        return (a["severity"], a["long_window"], a["short_window"], a["started"], a["ended"])

    got = sorted(key(a) for a in demo["slo_alerts"])
    want = sorted(key(a) for a in demo["ground_truth"]["slo_alerts"])
    assert got == want
    assert {a[0] for a in got} == {"page", "ticket"}  # the degradation burns the budget for real


def test_demo_json_has_the_documented_keys(demo: dict[str, Any]) -> None:
    keys = {
        "cur_allocation",
        "cur_active",
        "idle_allocated_gpu_hours",
        "idle_unallocated_gpu_hours",
        "starvation_incidents",
        "slo_alerts",
        "ground_truth",
    }
    assert keys <= demo.keys()
    assert keys - {"ground_truth"} <= demo["ground_truth"].keys()
    assert all("cause" in i for i in demo["starvation_incidents"])
    assert all({"severity", "long_window", "short_window"} <= a.keys() for a in demo["slo_alerts"])


@pytest.mark.integration  # two whole demo runs
def test_demo_run_is_deterministic(tmp_path: Path) -> None:
    cfg = SimConfig(seed=9, hours=1, nodes=2, start_ts=SimConfig().start_ts)
    a = run_demo(cfg, example(), tmp_path / "a").to_json()
    b = run_demo(cfg, example(), tmp_path / "b").to_json()
    assert a == b

"""The pipeline's energy against the simulator's own (agent/sim/fleet.py integrates every GPU's
power exactly between events; the agents only sample), on the embedded demo path.

The bounds are what sampling can miss, derived from the simulator's rules, not fitted: a sample
stands for the holders and the activity it saw for its whole interval, so each change of a
job's state between two ticks (start, end of its setup phase, end) can move at most
interval x MAX_POWER_W x its GPUs of energy between it and the rest; and each GPU's last
sample (and the last healthy one before an XID) is POWER_USAGE x interval, estimated, at most
interval x MAX_POWER_W off."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import MAX_POWER_W, Fleet, SimConfig
from gpuslo.app.embedded import DemoResult, run_demo, sim_config_for
from gpuslo.rules.config import example
from tests.helpers import short_sim

KWH = 3.6e6


def _bounds(sim: SimConfig, jobs: list[Any]) -> tuple[float, dict[str, float]]:
    per_gpu = sim.interval_s * MAX_POWER_W / KWH  # kWh one GPU can be off over one interval
    gpus = sim.nodes * sim.gpus_per_node
    edge = (gpus + 1) * per_gpu  # the last samples, and the one before the XID
    acct: dict[str, float] = {}
    for j in jobs:
        if j.start is not None:
            acct[j.account] = acct.get(j.account, edge) + 3 * per_gpu * j.gpus
    return edge, acct


def check(sim: SimConfig, res: DemoResult, jobs: list[Any]) -> None:
    d = res.to_json()
    got, want = d["energy"]["measured"], d["energy"]["ground_truth"]
    edge, acct = _bounds(sim, jobs)
    everything = edge + sum(acct.values())
    assert want["energy_kwh"] > 0
    assert got["energy_kwh"] == pytest.approx(want["energy_kwh"], abs=edge)
    assert set(got["by_account_kwh"]) == set(want["by_account_kwh"])
    for a, kwh in want["by_account_kwh"].items():
        assert got["by_account_kwh"][a] == pytest.approx(kwh, abs=acct[a]), a
    for k in ("held_kwh", "allocated_idle_kwh", "unallocated_kwh", "outside_capacity_kwh"):
        assert got[k] == pytest.approx(want[k], abs=everything), k
    # the split adds up to the total
    parts = got["held_kwh"] + got["unallocated_kwh"] + got["outside_capacity_kwh"]
    assert parts == pytest.approx(got["energy_kwh"], abs=1e-5)
    # idle power is modelled: an idle GPU draws, and the free capacity's energy is not zero
    assert want["unallocated_kwh"] > 0 and got["unallocated_kwh"] > 0
    # the bill: capacity x the price sheet's H100 price, to the cent; the lines add up
    bill = d["chargeback"]
    price = example().chargeback.per_gpu_hour["NVIDIA H100 80GB HBM3"]  # type: ignore[union-attr]
    cap = Decimal(repr(bill["totals"]["gpu_hours_capacity"]))
    assert Decimal(bill["totals"]["capacity_cost"]) == (cap * price).quantize(Decimal("0.01"))
    assert (
        round(bill["totals"]["gpu_hours_capacity"], 4) == d["capacity_gpu_hours"]
    )  # rules eval shows 4 places
    assert sum(Decimal(a["cost"]) for a in bill["accounts"]) == Decimal(bill["totals"]["cost"])
    assert sum(a["gpu_hours_allocated_idle"] for a in bill["accounts"]) == pytest.approx(
        d["idle_allocated_gpu_hours"], abs=1e-4
    )


def _jobs(sim: SimConfig) -> list[Any]:
    """The run's jobs: the fleet is deterministic from its seed, so a second one has the same."""
    f = Fleet(sim_config_for(example(), sim))
    f.finish()
    return list(f.jobs.values())


def test_short_demo_energy_against_the_simulator(short_demo: tuple[SimConfig, DemoResult, Any]) -> None:
    sim, res, _ = short_demo
    check(sim, res, _jobs(sim))
    d = res.to_json()
    assert d["energy"]["ground_truth"]["outside_capacity_kwh"] > 0  # the drained node drew power
    m = d["energy"]["measured"]
    assert m["co2_kg"] == pytest.approx(m["energy_kwh"] * 0.350, rel=1e-6)  # example.yaml: sim at 350 g/kWh
    assert m["by_account_co2_kg"] == {
        a: pytest.approx(k * 0.350, abs=1e-5) for a, k in m["by_account_kwh"].items()
    }


@pytest.mark.integration  # a demo run per seed
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_energy_against_the_simulator_on_seeds(seed: int, tmp_path: Any) -> None:
    sim = short_sim(seed=seed, nodes=2)
    res = run_demo(sim, example(), tmp_path / "demo")
    check(sim, res, _jobs(sim))


def test_sim_truth_splits_add_up() -> None:
    f = Fleet(short_sim(seed=5, nodes=2, hours=1.0))
    f.finish()
    t = f.truth
    assert t.energy_held_j + t.energy_unallocated_j + t.energy_outside_capacity_j == pytest.approx(t.energy_j)
    assert sum(t.energy_by_job_j.values()) == pytest.approx(t.energy_held_j)


@pytest.mark.integration  # several panel queries on the demo store
def test_chargeback_dashboard_agrees_with_the_bill(short_demo: tuple[SimConfig, DemoResult, Any]) -> None:
    """The chargeback dashboard's per-account GPU-hours and energy are the bill's and
    rules.energy's for the same range (the panels build on the same terms)."""
    from gpuslo.dashboards.generate import VIEWS
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules import energy as en
    from tests.grafana import expand

    sim, res, out = short_demo
    cfg = example()
    specs = {s.title: s.sql for s in VIEWS["chargeback.json"][2](cfg)}
    bill = res.to_json()["chargeback"]
    store = ChdbStore(out / "store")
    try:

        def panel(prefix: str) -> list[dict[str, Any]]:
            (q,) = [v for k, v in specs.items() if k.startswith(prefix)]
            return store.query(expand(q, sim.start_ts, sim.end_ts))

        table = {r["account"]: (r["used_gpu_h"], r["allocated_idle_gpu_h"]) for r in panel("GPU-hours")}
        want = {a["account"]: (a["gpu_hours_used"], a["gpu_hours_allocated_idle"]) for a in bill["accounts"]}
        assert table == {
            k: (pytest.approx(u, abs=1e-3), pytest.approx(i, abs=1e-3)) for k, (u, i) in want.items()
        }
        kwh = {r["account"]: r["kwh"] for r in panel("Energy per account")}
        holders = en.by(en.holder_energy(store, sim.start_ts, sim.end_ts, grid=cfg.grid_intensity), "account")
        assert kwh == {k: pytest.approx(v["energy_j"] / KWH, abs=1e-3) for k, v in holders.items()}
        assert panel("Power drawn per account")
        carbon = {
            r["account"]: (r["kg_co2"], r["kwh_without_intensity"]) for r in panel("Carbon per account")
        }
        assert carbon == {
            k: (pytest.approx(v["co2_g"] / 1000, abs=1e-3) if v["energy_no_intensity_j"] < v["energy_j"] else None,
                pytest.approx(v["energy_no_intensity_j"] / KWH, abs=1e-3))
            for k, v in holders.items()
        }  # fmt: skip
        # with no grid intensity for the cluster, no account's carbon is a zero: none is known
        bare = cfg.model_copy(update={"grid_intensity": None})
        specs = {s.title: s.sql for s in VIEWS["chargeback.json"][2](bare)}
        rows = panel("Carbon per account")
        assert rows and all(r["kg_co2"] is None for r in rows), rows
    finally:
        store.close()

"""Chargeback (rules/chargeback.py, ``gpuslo chargeback``), hand-computed to the cent.

The fleet of most tests: one node, hourly samples (interval 3600 s), the window one hour.
- GPU0, model M1 (2.00 / GPU-h): job a of account A, whole, active 0.5 → A used 1 h.
- GPU1, model M1: job b of account B, share 0.5, idle → B allocated-idle 0.5 h; 0.5 h free.
- GPU2, model M2 (3.00 / GPU-h): free → 1 h unallocated.
Capacity 3 GPU-h, priced 2 x 2.00 + 1 x 3.00 = 7.00.
"""

from __future__ import annotations

import csv
import json
import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from gpuslo.app.cli import main
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.chargeback import _cents, apportion, compute
from gpuslo.rules.config import parse
from gpuslo.rules.evaluate import summary
from gpuslo.wire import Allocation, GpuSample, MigInstance
from tests import helpers as h
from tests.helpers import T0

HOUR = 3600.0
PRICES = {"M1": 2.00, "M2": 3.00}


def g(index: int, model: str, activity: float, allocs: tuple[tuple[str, str, float], ...] = (),
      fraction: float = 1.0, mig: MigInstance | None = None, power: float | None = None) -> GpuSample:  # fmt: skip
    f = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": activity}
    if power is not None:
        f["DCGM_FI_DEV_POWER_USAGE"] = power
    return GpuSample(
        index=index, uuid=f"GPU-{index}-{mig.gi if mig else ''}", model=model, fields=f, fraction=fraction, mig=mig,
        allocations=tuple(Allocation(scheduler="slurm", id=j, user=f"user-{acct}", account=acct, queue=f"q-{acct}",
                                     share=s) for j, acct, s in allocs),
    )  # fmt: skip


def fleet(store: ChdbStore, power: float | None = None) -> None:
    write(store, [h.batch("n1", T0, [
        g(0, "M1", 0.5, (("a", "A", 1.0),), power=power),
        g(1, "M1", 0.0, (("b", "B", 0.5),), power=power),
        g(2, "M2", 0.0, power=power),
    ], interval_s=HOUR)])  # fmt: skip


def cfg(**chargeback: Any) -> Any:
    return parse({"chargeback": {"per_gpu_hour": PRICES, **chargeback}})


def accounts(bill: Any) -> dict[str, tuple[float, float, float, str]]:
    return {r["account"]: (r["gpu_hours_used"], r["gpu_hours_allocated_idle"], r["gpu_hours_unallocated_share"],
                           r["cost"]) for r in bill.rows("account")}  # fmt: skip


@pytest.mark.integration  # over 0.7 s (several chDB queries per mode)
def test_three_ways_to_charge_unallocated_capacity(store: ChdbStore) -> None:
    fleet(store)
    # proportional: the M1 group's free 0.5 h shared by allocated GPU-h, A 1 : B 0.5 → A 1/3 h,
    # B 1/6 h; the M2 GPU held by nobody: nobody to share it with, uncharged (3.00).
    # A: (1 + 1/3) x 2.00 = 2.6667; B: (0.5 + 1/6) x 2.00 = 1.3333; charged 4.00 → cents by
    # largest remainder: 266 + 133 = 399, the cent left to A (remainder .67 > .33): 2.67, 1.33.
    b = compute(store, cfg(), T0, T0 + HOUR)
    assert accounts(b) == {"A": (1.0, 0.0, 0.333333, "2.67"), "B": (0.0, 0.5, 0.166667, "1.33")}
    t = b.totals
    assert (t["capacity_cost"], t["cost"], t["uncharged_cost"]) == ("7.00", "4.00", "3.00")
    assert (t["gpu_hours_capacity"], t["gpu_hours_used"], t["gpu_hours_allocated_idle"]) == (3.0, 1.0, 0.5)
    assert (t["gpu_hours_unallocated"], t["gpu_hours_unallocated_share"]) == (1.5, 0.5)
    # none: each pays what it held: A 1 h x 2.00, B 0.5 h x 2.00; 0.5 x 2 + 1 x 3 = 4.00 uncharged
    b = compute(store, cfg(unallocated="none"), T0, T0 + HOUR)
    assert accounts(b) == {"A": (1.0, 0.0, 0.0, "2.00"), "B": (0.0, 0.5, 0.0, "1.00")}
    assert (b.totals["cost"], b.totals["uncharged_cost"]) == ("3.00", "4.00")
    # an overhead account pays all unallocated capacity: 0.5 x 2.00 + 1 x 3.00 = 4.00; the total
    # is the capacity's price
    b = compute(store, cfg(unallocated={"account": "platform"}), T0, T0 + HOUR)
    assert accounts(b) == {
        "A": (1.0, 0.0, 0.0, "2.00"), "B": (0.0, 0.5, 0.0, "1.00"), "platform": (0.0, 0.0, 1.5, "4.00"),
    }  # fmt: skip
    assert (b.totals["cost"], b.totals["capacity_cost"], b.totals["uncharged_cost"]) == (
        "7.00",
        "7.00",
        "0.00",
    )


@pytest.mark.integration
@pytest.mark.parametrize("min_idle_s", [0.0, 7200.0])
def test_totals_reconcile_with_rules_eval(store: ChdbStore, min_idle_s: float) -> None:
    # min_idle_s 7200: the one-hour idle run of GPU1 is too short to be idle: allocated-idle 0
    fleet(store)
    c = cfg(unallocated={"account": "platform"}).model_copy(update={"min_idle_s": min_idle_s})
    s = summary(store, c, T0, T0 + HOUR)
    t = compute(store, c, T0, T0 + HOUR).totals
    assert t["gpu_hours_allocated_idle"] == (0.5 if min_idle_s == 0 else 0.0)
    assert t["gpu_hours_capacity"] == s.capacity_gpu_hours
    assert t["gpu_hours_allocated_idle"] == s.idle_allocated_gpu_hours
    assert t["gpu_hours_allocated"] == pytest.approx(s.capacity_gpu_hours * (s.cur_allocation or 0), abs=1e-6)


@pytest.mark.integration
def test_energy_priced_per_kwh(store: ChdbStore) -> None:
    # every GPU at 500 W for the hour (POWER_USAGE: estimated): 0.5 kWh each. per_kwh 0.10;
    # account mode: a 0.5 kWh, b 0.5 x 0.5 = 0.25 kWh; platform: 0.25 (GPU1's free half) + 0.5
    # (GPU2) = 0.75 kWh. Energy cost: A 0.05, B 0.025, platform 0.075; total 1.5 kWh = 0.15
    # → cents: A 5, B 2.5, platform 7.5 → floors 5 + 2 + 7 = 14, the cent to the larger
    # remainder: a tie (.5, .5) goes to the first by name: B. B 0.03, platform 0.07.
    fleet(store, power=500.0)
    b = compute(store, cfg(unallocated={"account": "platform"}, per_kwh="0.10"), T0, T0 + HOUR)
    rows = {r["account"]: (r["energy_kwh"], r["cost_energy"], r["cost"]) for r in b.rows("account")}
    assert rows == {
        "A": (0.5, "0.05", "2.05"),
        "B": (0.25, "0.03", "1.03"),
        "platform": (0.75, "0.07", "4.07"),
    }
    assert (b.totals["energy_kwh"], b.totals["cost_energy"], b.totals["cost"]) == (1.5, "0.15", "7.15")
    assert b.energy["estimated_kwh"] == 1.5


def _energy_by_mode(mode: Any, kw: float, groups: dict[tuple[str, str], tuple[float, float]],
                    held: dict[tuple[str, str], dict[str, float]]) -> dict[str, float]:  # fmt: skip
    """Each account's kWh, computed from the seeded rows by docs/metrics.md#cost-chargeback:
    its holders' own, plus its share of each (pool, model) group's unallocated energy by the rule
    of unallocated GPU-hours. ``groups``: (pool, model) -> (GPUs, unheld GPUs) over the hour at
    ``kw`` each; ``held``: (pool, model) -> account -> GPUs held."""
    out: dict[str, float] = {}
    for gk, (_gpus, unheld) in groups.items():
        for a, n in held.get(gk, {}).items():
            out[a] = out.get(a, 0.0) + n * kw
        free = unheld * kw
        if mode == "proportional":
            total = sum(held.get(gk, {}).values())
            for a, n in held.get(gk, {}).items():
                out[a] += free * n / total
        elif isinstance(mode, dict) and free > 0:
            out[mode["account"]] = out.get(mode["account"], 0.0) + free
    return out


@pytest.mark.integration  # over 0.7 s (several chDB queries per mode)
@pytest.mark.parametrize("mode", ["none", "proportional", {"account": "platform"}])
def test_unallocated_energy_is_shared_per_gpu_model_like_the_hours(store: ChdbStore, mode: Any) -> None:
    """The energy of a (pool, model) group's unallocated capacity goes where its GPU-hours go:
    the M2 GPU nobody held was uncharged in GPU-hours but its 0.5 kWh was shared to A and B (by
    their M1 hours, per pool), so with ``proportional`` A paid 1.0 kWh for 0.5 + 1/6 of its
    own and B 0.5 for 0.25 + 1/12. A second pool (M1 held whole by C) sweeps the pool too."""
    fleet(store, power=500.0)
    write(store, [h.batch("n2", T0, [g(0, "M1", 0.3, (("c", "C", 1.0),), power=500.0),
                                     g(1, "M2", 0.0, power=500.0)], interval_s=HOUR, pool="p2")])  # fmt: skip
    groups = {("p", "M1"): (2, 0.5), ("p", "M2"): (1, 1.0), ("p2", "M1"): (1, 0.0), ("p2", "M2"): (1, 1.0)}
    held = {("p", "M1"): {"A": 1.0, "B": 0.5}, ("p2", "M1"): {"C": 1.0}}
    want = _energy_by_mode(mode, 0.5, groups, held)
    b = compute(store, cfg(unallocated=mode, per_kwh="0.10"), T0, T0 + HOUR)
    got = {r["account"]: r["energy_kwh"] for r in b.rows("account")}
    assert got == {a: pytest.approx(k, abs=1e-6) for a, k in want.items()}
    assert b.totals["energy_kwh"] == pytest.approx(sum(want.values()), abs=1e-6)
    # the energy charged is the capacity's share that the GPU-hours charged: per account, its
    # unallocated kWh over its unallocated GPU-hours is the 0.5 kW every GPU drew
    for r in b.rows("account"):
        own = sum(n for gk, acc in held.items() for a, n in acc.items() if a == r["account"]) * 0.5
        assert r["energy_kwh"] - own == pytest.approx(r["gpu_hours_unallocated_share"] * 0.5, abs=1e-6)


@pytest.mark.integration  # over 0.7 s (several chDB queries)
@pytest.mark.parametrize("dim", ["account", "user", "queue"])
def test_an_id_held_by_two_owners_bills_each_the_energy_of_its_own_rows(store: ChdbStore, dim: str) -> None:
    """Job id 7 of one owner, then (the controller's state reset, ids start again) job id 7 of
    another that differs in ``dim``: each line's GPU-hours were its own, but the energy of the id
    went whole to one of them (the holders' energy was grouped by id alone). GPU0 at 360 W
    (POWER_USAGE) for 10 samples of 10 s: 1 Wh a sample, 5 each."""
    owner = {"account": "A", "user": "x", "queue": "q"}

    def sample(k: int) -> Any:
        o = {**owner, dim: owner[dim] + ("2" if k >= 5 else "")}
        a = Allocation(scheduler="slurm", id="7", share=1.0, **o)
        gpu = GpuSample(index=0, uuid="GPU-0", model="M1", allocations=(a,),
                        fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.5, "DCGM_FI_DEV_POWER_USAGE": 360.0})  # fmt: skip
        return h.batch("n1", T0 + 10 * k, [gpu], interval_s=10.0)

    write(store, [sample(k) for k in range(10)])
    b = compute(store, cfg(per_kwh="1"), T0, T0 + 100)
    rows = {r[dim]: (r["gpu_hours_used"], r["energy_kwh"]) for r in b.rows(dim)}
    first, second = owner[dim], owner[dim] + "2"
    assert rows == {
        first: (pytest.approx(50 / 3600, abs=1e-6), 0.005),
        second: (pytest.approx(50 / 3600, abs=1e-6), 0.005),
    }
    assert b.totals["energy_kwh"] == 0.01


CASES = [(a, x) for a in (0.0, 0.04, 0.5, 1.0) for x in (0.0, 0.25, 0.5, 1.0)]  # (GPU activity, X's part)


@pytest.mark.integration
def test_a_measured_split_bills_each_holder_its_own_hours(store: ChdbStore) -> None:
    """On GPU i, two pods hold half each for an hour; X's processes did ``x_part`` of its
    activity, Y's the rest (Allocation.activity_share). A holder is idle when activity x its part
    / its share is under the threshold (0.05): it pays its half hour as allocated-idle, else as
    used. Each line shows its own hours (they were shared out to the fleet's used and idle: X
    was shown the GPU's whole hour used, Y billed 1.00 for no hours), and the lines add up to the
    totals in every dimension."""

    def pod(j: str, part: float) -> Allocation:
        return Allocation(scheduler="k8s", id=j, user=f"u{j}", account=j.upper(), queue=f"q{j}", share=0.5,
                          activity_share=part, share_source="measured")  # fmt: skip

    samples = [
        GpuSample(
            index=i,
            uuid=f"GPU-{i}",
            model="M1",
            fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": a},
            allocations=(pod(f"x{i}", x), pod(f"y{i}", 1.0 - x)),
        )
        for i, (a, x) in enumerate(CASES)
    ]
    write(store, [h.batch("n1", T0, samples, interval_s=HOUR)])
    b = compute(store, cfg(), T0, T0 + HOUR)
    want = {}
    for i, (a, x) in enumerate(CASES):
        for acct, part in ((f"X{i}", x), (f"Y{i}", 1.0 - x)):
            idle = a * part / 0.5 < 0.05
            want[acct] = (0.0 if idle else 0.5, 0.5 if idle else 0.0, 0.0, "1.00")
    assert accounts(b) == want
    t = b.totals
    assert t["gpu_hours_used"] == sum(v[0] for v in want.values())
    assert t["gpu_hours_allocated_idle"] == sum(v[1] for v in want.values())
    assert (t["gpu_hours_allocated"], t["cost"]) == (len(CASES), f"{2 * len(CASES)}.00")
    for dim in ("account", "user", "queue"):
        rows = b.rows(dim)
        for col in ("gpu_hours_used", "gpu_hours_allocated_idle", "gpu_hours_unallocated_share"):
            assert sum(Decimal(repr(r[col])) for r in rows) == Decimal(repr(t[col])), (dim, col)
        assert sum(Decimal(r["cost"]) for r in rows) == Decimal(t["cost"]), dim


@pytest.mark.integration
def test_mig_instance_pays_its_fraction_and_unpriced_models_are_named(
    store: ChdbStore, tmp_path: Path
) -> None:
    # an M1 GPU (2.10 / h) in MIG mode: instance 3/7 held by a → 3/7 x 2.10 = 0.90; the 4/7 free
    # instance goes to the overhead account: 1.20. A model X with no price: 1 GPU-h unpriced.
    write(store, [h.batch("n1", T0, [
        g(0, "M1", 0.0, fraction=0.0),
        g(0, "M1", 0.5, (("a", "A", 1.0),), fraction=3 / 7, mig=MigInstance(gi=1, profile="3g.40gb")),
        g(0, "M1", 0.0, fraction=4 / 7, mig=MigInstance(gi=2, profile="4g.40gb")),
        g(1, "X", 0.0),
    ], interval_s=HOUR)])  # fmt: skip
    c = parse({"chargeback": {"per_gpu_hour": {"M1": "2.10"}, "unallocated": {"account": "ops"}}})
    b = compute(store, c, T0, T0 + HOUR)
    assert {r["account"]: r["cost"] for r in b.rows("account")} == {"A": "0.90", "ops": "1.20"}
    assert b.unpriced == ({"cluster": "c1", "model": "X", "gpu_hours": 1.0},)
    assert b.totals["capacity_cost"] == "2.10"


def test_apportion_adds_up_and_breaks_ties_by_order() -> None:
    assert apportion(100, [1, 1, 1]) == [34, 33, 33]
    # 3.5, 1.75, 1.75 → floors 3, 1, 1 (5), 2 left: to the largest remainders (.75, .75), not to .5
    assert apportion(7, [0.5, 0.25, 0.25]) == [3, 2, 2]
    assert apportion(2, [1, 1, 1]) == [1, 1, 0]  # a tie: to the first ones
    assert apportion(0, [1.0, 2.0]) == [0, 0]
    assert apportion(5, []) == []
    assert apportion(3, [0.0, 0.0]) == [2, 1]
    assert apportion(1, [Decimal("-1e-12"), Decimal(1)]) == [0, 1]
    for total in (0, 1, 99, 12345):
        for w in ([1, 2, 3], [0.1] * 7, [1e-9, 1.0, 1e9]):
            parts = apportion(total, w)
            assert sum(parts) == total and all(p >= 0 for p in parts)


def test_price_sheet_config_errors() -> None:
    from gpuslo.rules.config import ConfigError

    for bad, says in [
        ({"per_gpu_hour": {"M": -1}}, "greater than or equal to 0"),
        ({"per_gpu_hour": {"M": "1.0000001"}}, "decimal places"),
        ({"per_gpu_hour": {"M": "nan"}}, "finite"),
        ({"per_gpu_hour": {"M": "1e26"}}, "less than or equal to 1000000000"),
        ({"default_per_gpu_hour": 1e300}, "less than or equal to 1000000000"),
        ({"per_kwh": "1000000000.000001"}, "less than or equal to 1000000000"),
        ({"unallocated": "everyone"}, "unallocated"),
        ({"unallocated": {"account": ""}}, "account"),
        ({"per_kwh": "x"}, "per_kwh"),
        ({"prices": {}}, "Extra inputs"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse({"chargeback": bad})
        assert says in str(e.value), (bad, str(e.value))
    # the largest price, a century of a million GPUs: the cents are exact (10^9 x 8.766e11 h)
    top = parse({"chargeback": {"per_gpu_hour": {"M": "1000000000"}}}).chargeback
    assert (
        top is not None and _cents(top.per_gpu_hour["M"] * Decimal("876600000000")) == 876600000000 * 10**11
    )


@pytest.mark.integration
def test_cli_json_csv_and_errors(
    store: ChdbStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet(store)
    store.close()
    conf = tmp_path / "rules.yaml"
    conf.write_text(json.dumps({"chargeback": {"per_gpu_hour": PRICES, "currency": "EUR"}}))
    base = ["chargeback", "--store", str(tmp_path / "store"), "--from", str(T0), "--to", str(T0 + HOUR)]
    out_csv = tmp_path / "bill.csv"
    assert main([*base, "--config", str(conf), "--json", "--csv", str(out_csv)]) == 0
    j = json.loads(capsys.readouterr().out)
    assert {"accounts", "totals", "users", "queues", "energy", "unpriced", "currency"} <= set(j)
    for a in j["accounts"]:
        assert {"account", "gpu_hours_used", "gpu_hours_allocated_idle", "gpu_hours_unallocated_share", "cost",
                "energy_kwh"} <= set(a)  # fmt: skip
    assert sum(Decimal(a["cost"]) for a in j["accounts"]) == Decimal(j["totals"]["cost"]) == Decimal("4.00")
    assert [u["user"] for u in j["users"]] == ["user-A", "user-B"]
    assert [q["queue"] for q in j["queues"]] == ["q-A", "q-B"]
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["dimension"], r["name"], r["cost"]) for r in rows] == [
        ("account", "A", "2.67"), ("account", "B", "1.33"), ("user", "user-A", "2.67"), ("user", "user-B", "1.33"),
        ("queue", "q-A", "2.67"), ("queue", "q-B", "1.33"), ("total", "", "4.00"),
    ]  # fmt: skip
    # the text table
    assert main([*base, "--config", str(conf)]) == 0
    assert "chargeback (unallocated: proportional)" in capsys.readouterr().out
    # a config with no price sheet, a bad one, a window backwards, an unwritable CSV: exit 2
    plain = tmp_path / "plain.yaml"
    plain.write_text("idle_threshold: 0.05\n")
    assert main([*base, "--config", str(plain)]) == 2
    assert "no `chargeback:` price sheet" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("chargeback: {per_gpu_hour: {M1: -2}}\n")
    assert main([*base, "--config", str(bad)]) == 2
    assert "chargeback.per_gpu_hour.M1" in capsys.readouterr().err
    assert main([*base[:4], str(T0 + HOUR), "--to", str(T0), "--config", str(conf)]) == 2
    assert main([*base, "--config", str(conf), "--csv", str(tmp_path / "no" / "dir.csv")]) == 2
    assert "cannot write" in capsys.readouterr().err
    # a model without a price: exit 1, named on stderr and in the JSON
    partial = tmp_path / "partial.yaml"
    partial.write_text(json.dumps({"chargeback": {"per_gpu_hour": {"M1": 2}}}))
    assert main([*base, "--config", str(partial), "--json"]) == 1
    io = capsys.readouterr()
    assert json.loads(io.out)["unpriced"] == [{"cluster": "c1", "gpu_hours": 1.0, "model": "M2"}]
    assert "no price for GPU model(s) 'M2'" in io.err


@pytest.mark.integration
def test_the_page_and_the_text_lines_add_up_at_the_places_they_show(store: ChdbStore) -> None:
    """Seven accounts hold a GPU each for 1/7 h (odd ones idle) beside a free GPU shared out to
    them, every GPU at 300 W: each column's lines, as the HTML (2 places) and the text (3 places)
    show them, add up to the total line they show (each line's own value rounded did not: 0.14 x 4
    used under a total of 0.57)."""
    from gpuslo.app.chargeback import table
    from gpuslo.dashboards.chargeback_page import section

    n, dt = 7, HOUR / 7
    gpus = [g(i, "M1", 0.5 if i % 2 == 0 else 0.0, ((f"j{i}", f"A{i}", 1.0),), power=300.0) for i in range(n)]
    write(store, [h.batch("n1", T0, [*gpus, g(n, "M1", 0.0, power=300.0)], interval_s=dt)])
    c = cfg(per_kwh="0.10")
    b = compute(store, c, T0, T0 + HOUR)
    page = section(store, c, T0, T0 + HOUR, "", b)
    lines = [re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", r) for r in re.findall(r"<tr>(.*?)</tr>", page)]
    text = [ln.split() for ln in table(b).splitlines()[2:]]
    for shown, rows in ((lines, [x for x in lines if x and x[0].startswith("A")]),
                        (text, [x for x in text if x[0].startswith("A")])):  # fmt: skip
        (total,) = [x for x in shown if x and x[0] == "total"]
        assert len(rows) == n
        for col in range(1, 6):  # used, allocated-idle, unallocated share, kWh, cost
            assert sum(Decimal(r[col]) for r in rows) == Decimal(total[col]), (col, rows, total)
    # 4 busy of 7: 4/7 h used, 3/7 h allocated-idle
    assert [x[1:3] for x in lines if x and x[0] == "total"] == [["0.57", "0.43"]]
    assert [x[1:3] for x in text if x[0] == "total"] == [["0.571", "0.429"]]


def test_report_months_split_at_calendar_months() -> None:
    from datetime import UTC, datetime

    from gpuslo.dashboards.chargeback_page import months

    def ts(*a: int) -> float:
        return datetime(*a, tzinfo=UTC).timestamp()

    assert months(ts(2026, 1, 15), ts(2026, 1, 20)) == [(ts(2026, 1, 15), ts(2026, 1, 20))]
    assert months(ts(2025, 12, 30), ts(2026, 2, 2)) == [
        (ts(2025, 12, 30), ts(2026, 1, 1)), (ts(2026, 1, 1), ts(2026, 2, 1)), (ts(2026, 2, 1), ts(2026, 2, 2)),
    ]  # fmt: skip
    assert months(ts(2026, 3, 1), ts(2026, 4, 1)) == [(ts(2026, 3, 1), ts(2026, 4, 1))]


@pytest.mark.integration
def test_report_has_the_bill_with_hostile_names_escaped(store: ChdbStore) -> None:
    from gpuslo.dashboards.report import render

    hostile = "<b>x</b>'\\\"&"
    write(store, [h.batch("n1", T0, [g(0, "M1", 0.5, (("a", hostile, 1.0),))], interval_s=HOUR)])
    page = render(store, cfg(), T0, T0 + HOUR)
    assert "<h2>Chargeback per month</h2>" in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    assert "<th>2.00</th>" in page  # the total: 1 GPU-h at 2.00
    assert "Chargeback" not in render(store, parse({}), T0, T0 + HOUR)  # no price sheet, no section


@pytest.mark.parametrize(
    ("name", "cell"),
    [("=HYPERLINK(\"http://x\",\"a\")", "'=HYPERLINK(\"http://x\",\"a\")"), ("+1", "'+1"), ("-2+3", "'-2+3"),
     ("@SUM(A1)", "'@SUM(A1)"), ("\tx", "'\tx"), ("\rx", "'\rx"), ("nlp", "nlp"), ("a=b", "a=b"), ("", "")],
)  # fmt: skip
def test_a_name_that_a_spreadsheet_would_run_as_a_formula_is_written_as_text(
    tmp_path: Path, name: str, cell: str
) -> None:
    """Account, user and queue names come from whoever submitted the job: in the CSV a name that
    starts like a formula is made text (a leading apostrophe); the figures are untouched."""
    from gpuslo.app.chargeback import CSV_COLUMNS, write_csv

    class Bill:
        def __init__(self) -> None:
            self.totals = {c: "1.00" for c in CSV_COLUMNS}

        def rows(self, dim: str) -> list[dict[str, str]]:
            return [{dim: name, **{c: "-1.50" for c in CSV_COLUMNS[2:]}}]

    path = tmp_path / "bill.csv"
    write_csv(Bill(), str(path))
    rows = list(csv.reader(path.open(newline="")))
    assert [r[1] for r in rows[1:4]] == [cell] * 3
    assert all(r[2:] == ["-1.50"] * (len(CSV_COLUMNS) - 2) for r in rows[1:4])


@pytest.mark.integration  # over 0.7 s (chDB queries)
def test_the_bill_carries_the_mig_right_sizing_advice_per_account(store: ChdbStore) -> None:
    # Job r1 (account A) alone on an H100 80GB for one hour: activity 0.1, framebuffer peak 5,000 MiB.
    # The smallest slice that holds it: 1g.10gb (1/7 of the SMs >= 0.1; 1/8 of 80 GB = 10,240 MiB,
    # less the 10 % headroom = 9,216 MiB >= 5,000). It takes max(1/7, 1/8) = 1/7 of the GPU: of its
    # 1 GPU-hour, 6/7 = 0.857143 to give back.
    model = "NVIDIA H100 80GB HBM3"
    fields = {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.1,
        "DCGM_FI_DEV_FB_USED": 5000.0,
        "DCGM_FI_DEV_FB_TOTAL": 81559.0,
    }
    alloc = (Allocation(scheduler="slurm", id="r1", user="u", account="A", queue="q", share=1.0),)
    write(store, [h.batch("n7", T0 + 60 * k, [GpuSample(index=0, uuid="GPU-r", model=model, fields=fields,
                                                        allocations=alloc)], interval_s=60.0)
                  for k in range(60)])  # fmt: skip
    c = parse({"chargeback": {"per_gpu_hour": {model: 4.0}}})
    bill = compute(store, c, T0, T0 + HOUR)
    (a,) = bill.rightsize
    assert (a["account"], a["profile"], a["jobs"]) == ("A", "1g.10gb", 1)
    assert a["held_gpu_hours"] == pytest.approx(1.0, abs=1e-4)
    assert a["give_back_gpu_hours"] == pytest.approx(6 / 7, abs=1e-4)
    assert bill.to_json()["rightsize"] == [a]


@pytest.mark.integration  # over 0.7 s (chDB queries)
@pytest.mark.parametrize(
    ("match", "want"),
    [({}, {"A", "B", "C"}), ({"pool": ["p"]}, {"A", "B"}), ({"pool": [""]}, {"C"}), ({"cluster": ["c2"]}, {"B"}),
     ({"pool": ["p", ""], "cluster": ["c1"]}, {"A", "C"}), ({"cluster": ["c1"], "pool": ["q"]}, set())],
)  # fmt: skip
def test_the_bills_right_sizing_covers_the_part_of_the_fleet_the_bill_does(
    store: ChdbStore, match: dict[str, list[str]], want: set[str]
) -> None:
    """``match.cluster`` and ``match.pool`` narrow the bill's GPU-hours; its right-sizing advice
    listed the jobs of every cluster and pool all the same (a bill of cluster c2 advised accounts
    A and C, of cluster c1). Three jobs, each alone on an H100 that
    a 1g.10gb would hold (as the test above): A in (c1, p), B in (c2, p), C in (c1, no pool)."""
    model = "NVIDIA H100 80GB HBM3"
    fields = {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.1,
        "DCGM_FI_DEV_FB_USED": 5000.0,
        "DCGM_FI_DEV_FB_TOTAL": 81559.0,
    }

    def job(acct: str, node: str, pool: str, cluster: str) -> list[Any]:
        alloc = (Allocation(scheduler="slurm", id=f"r{acct}", user="u", account=acct, queue="q", share=1.0),)
        gpu = GpuSample(index=0, uuid=f"GPU-{acct}", model=model, fields=fields, allocations=alloc)
        return [
            h.batch(node, T0 + 60 * k, [gpu], interval_s=60.0, pool=pool, cluster=cluster) for k in range(60)
        ]

    write(store, job("A", "n1", "p", "c1") + job("B", "n2", "p", "c2") + job("C", "n3", "", "c1"))
    c = parse({"match": match, "chargeback": {"per_gpu_hour": {model: 4.0}}})
    bill = compute(store, c, T0, T0 + HOUR)
    assert {a["account"] for a in bill.rows("account")} == want  # the GPU-hours' part of the fleet
    assert {a["account"] for a in bill.rightsize} == want
    assert all(a["profile"] == "1g.10gb" for a in bill.rightsize)


def test_terminal_safe_escapes_controls_and_bidi_overrides_only() -> None:
    from gpuslo.app.text import terminal_safe

    for raw, shown in [
        ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),  # retitle the terminal
        ("\x1b[2J\x9b31m", "\\x1b[2J\\x9b31m"),  # clear; the C1 CSI
        ("a\x00b\x7fc\x08", "a\\x00b\\x7fc\\x08"),
        ("\u202etxt.exe\u2066\u2069\u200f", "\\u202etxt.exe\\u2066\\u2069\\u200f"),
        ("line\n\tcol é ü 中 – →", "line\n\tcol é ü 中 – →"),  # kept as they are
    ]:
        assert terminal_safe(raw) == shown


@pytest.mark.integration
def test_names_from_the_data_reach_the_terminal_escaped(
    store: ChdbStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An account (and so its user and queue) named with terminal escapes: `chargeback` and
    `job` print them escaped; JSON keeps the name as it is (its own escaping)."""
    evil = "A\x1b]0;pwned\x07\x1b[2J\u202e"
    write(store, [h.batch("n1", T0, [g(0, "M1", 0.5, (("7", evil, 1.0),))], interval_s=HOUR)])
    store.close()
    conf = tmp_path / "rules.yaml"
    conf.write_text(json.dumps({"chargeback": {"per_gpu_hour": PRICES}}))
    base = [
        "--store",
        str(tmp_path / "store"),
        "--from",
        str(T0),
        "--to",
        str(T0 + HOUR),
        "--config",
        str(conf),
    ]
    assert main(["chargeback", *base]) == 0
    out = capsys.readouterr().out
    assert "A\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in out and "\x1b" not in out and "\u202e" not in out
    assert main(["chargeback", *base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accounts"][0]["account"] == evil
    assert main(["job", "7", *base]) == 0
    out = capsys.readouterr().out
    assert "\\x1b]0;pwned" in out and "\x1b" not in out and "\x07" not in out


def _next_month(t: float) -> float:
    """The start of the calendar month after ``t`` (UTC)."""
    from datetime import UTC, datetime

    d = datetime.fromtimestamp(t, UTC)
    y, m = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
    return datetime(y, m, 1, tzinfo=UTC).timestamp()


EDGE = _next_month(T0)  # a sample from half an hour before this month's end to half an hour after


@pytest.mark.integration
@pytest.mark.parametrize(
    ("frm", "to", "bills"),
    [
        (0.0, 4_291_747_200.0, 2),
        (EDGE - HOUR, EDGE + HOUR, 2),
        (EDGE, 4_291_747_200.0, 1),
        (0.0, EDGE - HOUR, 0),
        (EDGE + HOUR, 4_291_747_200.0, 0),
    ],
)
def test_report_bills_only_the_months_its_samples_reach(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch, frm: float, to: float, bills: int
) -> None:
    """A report from 1970 to 2106 is 1,632 calendar months: only those a sample reaches are
    billed (each was a bill computed; such a report ran for minutes), a sample that crosses into
    the next month, or into the window from before it, included."""
    from gpuslo.dashboards import chargeback_page

    write(store, [h.batch("n1", EDGE - HOUR / 2, [g(0, "M1", 0.5, (("a", "u", 1.0),))], interval_s=HOUR)])
    made: list[tuple[float, float]] = []
    real = chargeback_page.compute

    def counted(st: Any, c: Any, a: float, b: float, cluster: str = "") -> Any:
        made.append((a, b))
        return real(st, c, a, b, cluster)

    monkeypatch.setattr(chargeback_page, "compute", counted)
    page = chargeback_page.section(store, cfg(), frm, to)
    assert len(made) == bills and page.count("<h3>") == bills, made
    assert ("nothing to bill" in page) == (bills == 0)


@pytest.mark.integration
@pytest.mark.parametrize("places", [2, 3])
def test_the_total_line_is_the_total_rounded_once(store: ChdbStore, places: int) -> None:
    """A total shown at 2 or 3 places is the total rounded to them, not its 6-place figure
    rounded again: a GPU busy for 90.0015 s is 0.025000416 GPU-h, 0.03 at 2 places (rounded
    twice, 0.025000 then half to even: 0.02), and its line the same."""
    from gpuslo.app.chargeback import table
    from gpuslo.dashboards.chargeback_page import section

    dt = 90.0015  # 0.025000416... h: 0.025000 at 6 places, 0.03 and 0.025 at 2 and 3
    write(store, [h.batch("n1", T0, [g(0, "M1", 0.5, (("j0", "A0", 1.0),))], interval_s=dt)])
    c = cfg()
    b = compute(store, c, T0, T0 + HOUR)
    used = Decimal(repr(dt / HOUR)).quantize(Decimal(1).scaleb(-places))  # rounded once
    if places == 2:
        page = section(store, c, T0, T0 + HOUR, "", b)
        rows = [re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", r) for r in re.findall(r"<tr>(.*?)</tr>", page)]
    else:
        rows = [ln.split() for ln in table(b).splitlines()[2:]]
    got = {x[0]: Decimal(x[1]) for x in rows if x and x[0] in ("A0", "total")}
    assert got == {"A0": used, "total": used}


@pytest.mark.integration  # a rollup refresh and several chDB queries per case
@pytest.mark.parametrize("interval", [60.0, HOUR])
def test_a_window_whose_raw_rows_are_gone_is_refused_not_billed_as_zero(
    store: ChdbStore, tmp_path: Path, capsys: pytest.CaptureFixture[str], interval: float
) -> None:
    """The minute rollups outlive the raw rows (retention): a window whose raw rows were
    dropped was billed 0.00 over what was left, exit 0, as if nobody had used the GPUs (and the
    report billed such a month 0.00 beside its rollups' CUR). Two GPUs (one held) sampled every
    ``interval`` over two hours: with the raw rows all there no window is refused (edges on odd
    seconds, rollups refreshed or not); once the first hour's rows are deleted, every window
    with a whole minute in that hour is refused (exit 2, said why), the others still billed (a
    window of no whole minute is not compared: the rollups have no minute of it alone)."""
    from gpuslo.dashboards.chargeback_page import section
    from gpuslo.rules import rollup
    from gpuslo.rules.chargeback import ChargebackError

    n = int(2 * HOUR / interval)
    write(store, [h.batch("n1", T0 + k * interval, [g(0, "M1", 0.5, (("a", "A", 1.0),)), g(1, "M1", 0.0)],
                          interval_s=interval) for k in range(n)])  # fmt: skip
    c = cfg()

    def capacity(frm: float, to: float) -> float:
        return float(compute(store, c, frm, to).totals["gpu_hours_capacity"])

    windows = [(T0, T0 + 2 * HOUR), (T0 + 17.5, T0 + 59.5), (T0 + 0.25, T0 + 3601.0), (T0 + HOUR, T0 + 2 * HOUR),
               (T0 + HOUR - 30, T0 + HOUR + 90), (T0 + HOUR - 59, T0 + 2 * HOUR)]  # fmt: skip
    for frm, to in windows:  # rollups not refreshed yet: nothing to compare, billed
        assert capacity(frm, to) == pytest.approx(2 * (to - frm) / HOUR, abs=1e-6)
    rollup.refresh(store)
    for frm, to in windows:  # all raw rows there: billed whatever the edges
        assert capacity(frm, to) == pytest.approx(2 * (to - frm) / HOUR, abs=1e-6)
    store.execute("DELETE FROM gpu_samples WHERE ts < toDateTime64({t:Float64}, 3, 'UTC')", {"t": T0 + HOUR})
    for frm, to in windows:
        lo = math.ceil(frm / 60) * 60  # the first whole minute: a window of none is not compared
        if lo + 60 > to:
            continue
        if lo < T0 + HOUR:
            with pytest.raises(ChargebackError, match=r"in cluster 'c1'.*they give [\d.]+ GPU-h.*rollups"):
                compute(store, c, frm, to)
        else:  # (the raw rows gone in a partial minute at its start are not seen: 30 s of one)
            kept = to - max(frm, T0 + HOUR)
            assert capacity(frm, to) == pytest.approx(2 * kept / HOUR, abs=1e-6)
    # the report says why the month is not billed (and is made); the command exits 2
    page = section(store, c, T0, T0 + HOUR)
    assert "Not billed: the raw GPU samples of part of the window are gone" in page
    store.close()
    conf = tmp_path / "rules.yaml"
    conf.write_text(json.dumps({"chargeback": {"per_gpu_hour": PRICES}}))
    argv = ["chargeback", "--store", str(tmp_path / "store"), "--from", str(T0), "--to", str(T0 + 2 * HOUR)]
    assert main([*argv, "--config", str(conf)]) == 2
    io = capsys.readouterr()
    assert "raw GPU samples of part of the window are gone" in io.err and io.out == ""


@pytest.mark.integration
def test_every_account_is_one_whole_line_of_the_text_aligned(store: ChdbStore) -> None:
    """The text bill cut names to 20 characters (two accounts alike in their first 20 were two
    lines of the same name), padded them by characters, not columns (a wide or combining
    character, an escaped control moved the columns after it), and a newline in a name started
    a line of its own: an account could print a ``total`` line of its choosing. Each name here
    is shown whole, escaped, on one line, every number column starting at the same column."""
    from dataclasses import replace

    from gpuslo.app.chargeback import table
    from gpuslo.app.text import width

    forged = "x\ntotal                0.000        0.000        0.000      0.000           0.00"
    names = ["research-team-alpha-1", "research-team-alpha-2", "研究部门深度学习研究部门", "e\u0301cole",
             "tab\there", "\u202eevil", "\x1b[2Jbell\x07", forged, "a" * 250]  # fmt: skip
    write(store, [h.batch("n1", T0, [g(i, "M1", 0.5, ((f"j{i}", n, 1.0),)) for i, n in enumerate(names)],
                          interval_s=HOUR)])  # fmt: skip
    b = compute(store, cfg(), T0, T0 + HOUR)
    b = replace(b, rightsize=({"account": forged, "profile": "1g.10gb\nUNPRICED", "jobs": 1,
                               "give_back_gpu_hours": 0.5, "held_gpu_hours": 1.0},))  # fmt: skip
    text = table(b)
    lines = text.splitlines()
    # the title, the header, its rule, one line per account, the total, capacity, the advice
    assert len(lines) == 3 + len(names) + 1 + 2, text
    assert [ln for ln in lines if ln.startswith("total")] == [lines[3 + len(names)]]
    assert sum(ln.startswith("right-size: x\\ntotal") for ln in lines) == 1
    assert not any(c in text for c in "\x1b\x07\t\u202e")
    rows = lines[3 : 3 + len(names)]
    shown = {ln[: ln.index("  1.000")].rstrip() for ln in rows}  # each name, escaped, whole
    want = {n.replace("\n", "\\n").replace("\t", "\\t").replace("\u202e", "\\u202e")
            .replace("\x1b", "\\x1b").replace("\x07", "\\x07") for n in names}  # fmt: skip
    assert shown == want
    # the used-hours column starts at the same screen column on every line (display width)
    starts = {width(ln[: ln.index("  1.000") + 2]) for ln in rows}
    assert len(starts) == 1, rows
    assert width(lines[1][: lines[1].index("used h")]) in starts


@pytest.mark.integration  # a bill and its page per case
@pytest.mark.parametrize(
    ("grid", "known_kwh", "g_per_kwh"),
    [(None, 0.0, 0.0), ({"clusters": {"other": 300.0}}, 0.0, 0.0), ({"clusters": {"c1": 400.0}}, 1.5, 400.0),
     ({"default_g_per_kwh": 200.0}, 1.5, 200.0), ({"clusters": {"c1": "series"}}, 0.75, 800.0)],
)  # fmt: skip
def test_energy_with_no_grid_intensity_is_never_shown_as_zero_carbon(
    store: ChdbStore, tmp_path: Path, grid: Any, known_kwh: float, g_per_kwh: float
) -> None:
    """The fleet of the module, every GPU at 500 W for two half-hour samples: 1.5 kWh. Where
    the config gives the cluster no grid intensity (none at all, another cluster's only, or a
    series that starts at the second sample) the page said "CO2 0.00 kg" and the demo's line
    "0.000 kg CO2": zero carbon, which docs/metrics.md promises never to say. The carbon shown
    is that of the energy with an intensity; the rest is said as such."""
    from gpuslo.app.chargeback import demo_text
    from gpuslo.dashboards.chargeback_page import section

    for k in range(2):
        write(store, [h.batch("n1", T0 + k * HOUR / 2, [g(0, "M1", 0.5, (("a", "A", 1.0),), power=500.0),
                                                          g(1, "M1", 0.0, (("b", "B", 0.5),), power=500.0),
                                                          g(2, "M2", 0.0, power=500.0)], interval_s=HOUR / 2)])  # fmt: skip
    if grid and grid.get("clusters", {}).get("c1") == "series":
        f = tmp_path / "ci.csv"
        f.write_text(f"start,g_per_kwh\n{T0 + HOUR / 2:.0f},800\n")
        grid = {"clusters": {"c1": {"file": str(f)}}}
    c = parse({"chargeback": {"per_gpu_hour": PRICES}, **({"grid_intensity": grid} if grid else {})})
    b = compute(store, c, T0, T0 + HOUR)
    co2 = known_kwh * g_per_kwh / 1000
    none = 1.5 - known_kwh
    assert b.energy["energy_kwh"] == pytest.approx(1.5, abs=1e-6)
    assert b.energy["no_intensity_kwh"] == pytest.approx(none, abs=1e-6)
    assert b.energy["co2_kg"] == pytest.approx(co2, abs=1e-6)
    page = section(store, c, T0, T0 + HOUR, "", b)
    res = type("Res", (), {"energy": b.energy, "truth": {}, "chargeback": None})()
    for shown, places in ((page, 2), (demo_text(res), 3)):
        if none == 0:
            assert f"{co2:.{places}f} kg CO2" in shown and "intensity" not in shown
        elif known_kwh == 0:
            assert f"CO2 not known: no grid intensity for its {1.5:.{places}f} kWh" in shown
            assert "0.00 kg" not in shown and "0.000 kg" not in shown
        else:
            assert f"{co2:.{places}f} kg CO2, and no grid intensity for {none:.{places}f} kWh more" in shown
    # per account: A's GPU 0.5 kWh, B half of its GPU 0.25 kWh, each half in each sample
    assert b.energy["by_account_no_intensity_kwh"] == {
        "A": pytest.approx(0.5 * none / 1.5, abs=1e-6), "B": pytest.approx(0.25 * none / 1.5, abs=1e-6),
    }  # fmt: skip


@pytest.mark.integration
def test_a_store_whose_files_go_away_mid_command_is_one_clear_error(
    store: ChdbStore, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's table files are removed once it is open (a disk unmounted, a clean-up run
    over it): exit 2 with chDB's reason in one line, no traceback (the reason came with the 30
    lines of SQL of the query that met it)."""
    import shutil

    from gpuslo.rules import chargeback

    fleet(store)
    store.close()
    real = chargeback.compute

    def files_gone(st: Any, c: Any, frm: float, to: float, cluster: str = "") -> Any:
        shutil.rmtree(tmp_path / "store" / "store")  # every table's data parts
        return real(st, c, frm, to, cluster)

    monkeypatch.setattr(chargeback, "compute", files_gone)
    conf = tmp_path / "rules.yaml"
    conf.write_text(json.dumps({"chargeback": {"per_gpu_hour": PRICES}}))
    argv = ["chargeback", "--store", str(tmp_path / "store"), "--from", str(T0), "--to", str(T0 + HOUR)]
    assert main([*argv, "--config", str(conf)]) == 2
    io = capsys.readouterr()
    assert io.out == "" and io.err.startswith("gpuslo chargeback: ") and "Traceback" not in io.err
    assert len(io.err.splitlines()) == 1 and "SELECT" not in io.err, io.err
    assert "No such file or directory" in io.err or "FILE_DOESNT_EXIST" in io.err, io.err


@pytest.mark.integration  # a process per case
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize("json_out", [False, True])
def test_the_bill_to_a_full_disk_is_one_line_not_a_traceback(
    store: ChdbStore, tmp_path: Path, empty: bool, json_out: bool
) -> None:
    """`gpuslo chargeback --json > bill.json` on a full disk (/dev/full): the bill's print was an
    OSError traceback (and a short one, an empty store's text, Python's "Exception ignored" at
    exit); now one line and exit 1, nothing half-said. An empty store's window is no bill at all
    (test_cli: a window with no data is said)."""
    import subprocess
    import sys

    if not empty:
        fleet(store)
    store.close()
    conf = tmp_path / "rules.yaml"
    conf.write_text(json.dumps({"chargeback": {"per_gpu_hour": PRICES}}))
    argv = ["chargeback", "--store", str(tmp_path / "store"), "--from", str(T0), "--to", str(T0 + HOUR),
            "--config", str(conf), *(["--json"] if json_out else [])]  # fmt: skip
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "gpuslo", *argv], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=300, check=False)  # fmt: skip
    if empty:  # nothing to bill: said on stderr, nothing written (it was a bill of 0.00)
        assert p.returncode == 2 and "no data in the window" in p.stderr and "Traceback" not in p.stderr, (
            p.stderr
        )
        return
    assert p.returncode == 1, p.stderr
    assert p.stderr == "gpuslo: cannot write standard output: No space left on device; stopped\n", p.stderr

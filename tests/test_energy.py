"""Energy and carbon per holder (rules/energy.py), hand-computed.

Every expected value is worked out in the comments from the definitions of docs/metrics.md
(energy and carbon), not from the SQL: a sample's power is the counter's delta to the next
consecutive sample over the seconds between them (mJ / 1000 / s = W), else its POWER_USAGE
(estimated); a row's energy is that power x its fraction of the GPU x its seconds in the window."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.config import MAX_SERIES_BYTES, ConfigError, GridIntensity, load_series, parse
from gpuslo.rules.energy import MAX_POWER_W, by, fleet_energy, holder_energy, summary_of
from gpuslo.wire import Allocation, GpuSample, MigInstance
from tests import helpers as h
from tests.helpers import T0

E, P = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_POWER_USAGE"


def gpu(
    index: int = 0, energy_mj: float | None = None, power: float | None = None, activity: float = 0.5,
    allocs: tuple[tuple[str, float], ...] = (), fraction: float = 1.0, mig: MigInstance | None = None,
    account: str = "acct", user: str = "u",
) -> GpuSample:  # fmt: skip
    f = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": activity}
    if energy_mj is not None:
        f[E] = energy_mj
    if power is not None:
        f[P] = power
    return GpuSample(
        index=index, uuid=f"GPU-{index}-{mig.gi if mig else ''}", model="M", fields=f, fraction=fraction, mig=mig,
        allocations=tuple(Allocation(scheduler="slurm", id=j, user=user, account=account, queue="q", share=s)
                          for j, s in allocs),
    )  # fmt: skip


def series(store: ChdbStore, counters: list[float | None], power: float | None = 80.0, dt: float = 10.0,
           allocs: tuple[tuple[str, float], ...] = (("j", 1.0),), times: list[float] | None = None) -> None:  # fmt: skip
    ts = times or [T0 + dt * k for k in range(len(counters))]
    write(store, [h.batch("n1", t, [gpu(0, c, power, allocs=allocs)], interval_s=dt) for t, c in zip(ts, counters, strict=True)])  # type: ignore[arg-type]  # fmt: skip


def one(store: ChdbStore, frm: float, to: float, **kw: object) -> dict[str, float]:
    (g,) = fleet_energy(store, frm, to, **kw)  # type: ignore[arg-type]
    return {k: getattr(g, k) for k in g.__dataclass_fields__ if k not in ("cluster", "pool")}


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_counter_deltas_and_the_last_sample_estimated(store: ChdbStore) -> None:
    # counter (mJ) at T0, +10, +20, +30: 0, 1e6, 3e6, 3.5e6 → 1000 J, 2000 J, 500 J over the
    # first three samples (100, 200, 50 W; POWER_USAGE says 80 W and is not used there). The
    # last sample has no next one: 80 W x 10 s = 800 J, estimated. Total 4300 J, all held by j.
    series(store, [0.0, 1e6, 3e6, 3.5e6])
    r = one(store, T0, T0 + 40)
    assert r["energy_j"] == pytest.approx(4300.0)
    assert r["energy_estimated_j"] == pytest.approx(800.0)
    assert r["energy_held_j"] == pytest.approx(4300.0)
    assert r["energy_unallocated_j"] == 0.0
    # a window inside the samples: [T0+5, T0+25) = 5 s at 100 W + 10 s at 200 W + 5 s at 50 W
    assert one(store, T0 + 5, T0 + 25)["energy_j"] == pytest.approx(500 + 2000 + 250)
    # windows add up, whatever the cut: the next sample past the window end is read
    halves = one(store, T0, T0 + 17)["energy_j"] + one(store, T0 + 17, T0 + 40)["energy_j"]
    assert halves == pytest.approx(4300.0)


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_a_counter_reset_counts_from_the_new_value(store: ChdbStore) -> None:
    # 5e6, 6e6 (+1000 J: 100 W), 2e5 (went down: reset; the energy since it is 200 J: 20 W),
    # 7e5 (+500 J), then the last sample estimated at 80 W x 10 s = 800 J. Total 2500 J.
    series(store, [5e6, 6e6, 2e5, 7e5])
    r = one(store, T0, T0 + 40)
    assert r["energy_j"] == pytest.approx(1000 + 200 + 500 + 800)
    assert r["energy_estimated_j"] == pytest.approx(800.0)


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_a_gap_longer_than_twice_the_interval_is_not_a_delta(store: ChdbStore) -> None:
    # samples at T0, +10, +50 (an agent down for 30 s): the delta T0+10 → T0+50 spans 40 s, more
    # than 2 x 10 s: the sample at T0+10 takes its POWER_USAGE (80 W x 10 s), estimated; the gap
    # itself is no sample's and counts nothing (as no capacity is counted there).
    # T0: (1e6 - 0)/1000 = 1000 J; T0+10: 800 J est.; T0+50: last, 800 J est.
    series(store, [0.0, 1e6, 9e6], times=[T0, T0 + 10, T0 + 50])
    r = one(store, T0, T0 + 60)
    assert r["energy_j"] == pytest.approx(1000 + 800 + 800)
    assert r["energy_estimated_j"] == pytest.approx(1600.0)


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_a_short_agent_restart_keeps_the_counter(store: ChdbStore) -> None:
    # an agent restart: a new boot id and a sample 15 s after the previous one (<= 2 x 10 s):
    # the counter delta still stands (mean power over the 15 s: 1.5e6 mJ / 15 s = 100 W), the
    # sample covers 10 s of it: 1000 J. Then 100 W for the sample at T0+15 from its delta.
    write(store, [h.batch("n1", T0, [gpu(0, 0.0, 80.0, allocs=(("j", 1.0),))])])  # type: ignore[list-item]
    b = h.batch("n1", T0 + 15, [gpu(0, 1.5e6, 80.0, allocs=(("j", 1.0),))])
    b2 = h.batch("n1", T0 + 25, [gpu(0, 2.5e6, 80.0, allocs=(("j", 1.0),))])
    write(store, [b.model_copy(update={"boot_id": "b2", "seq": 0}), b2.model_copy(update={"boot_id": "b2", "seq": 1})])  # fmt: skip
    r = one(store, T0, T0 + 25)
    assert r["energy_j"] == pytest.approx(1000 + 1000)
    assert r["energy_estimated_j"] == 0.0


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_missing_counter_is_estimated_from_power_and_neither_is_unmeasured(store: ChdbStore) -> None:
    # no counter: 80 W x 10 s x 3 samples = 2400 J, all estimated
    series(store, [None, None, None])
    r = one(store, T0, T0 + 30)
    assert r == pytest.approx({**r, "energy_j": 2400.0, "energy_estimated_j": 2400.0, "unmeasured_s": 0.0})


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_no_power_at_all_is_unmeasured(store: ChdbStore) -> None:
    series(store, [None, None], power=None)
    r = one(store, T0, T0 + 20)
    assert (r["energy_j"], r["unmeasured_s"]) == (0.0, pytest.approx(20.0))


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_an_implausible_delta_falls_back_to_power(store: ChdbStore) -> None:
    # a delta of 1e9 mJ in 10 s is 100 kW, above the catalogue's plausible power: not a
    # measurement; POWER_USAGE (80 W) stands for the sample, estimated
    assert MAX_POWER_W < 1e5
    series(store, [0.0, 1e9, 1e9 + 1e6])
    r = one(store, T0, T0 + 20)
    assert r["energy_j"] == pytest.approx(800 + 1000)
    assert r["energy_estimated_j"] == pytest.approx(800.0)


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_shared_gpu_split_by_share_idle_and_unallocated(store: ChdbStore) -> None:
    # one GPU at 100 W (counter +1e6 mJ per 10 s), idle (activity 0.0 < 0.05), held 0.5 by a and
    # 0.25 by b; one 10 s sample measured (plus the next one, outside the window):
    # 1000 J: a 500, b 250, unallocated 250; allocated-idle 750.
    msgs = [
        h.batch("n1", T0 + 10 * k, [gpu(0, 1e6 * k, 100.0, 0.0, (("a", 0.5), ("b", 0.25)))]) for k in range(2)
    ]
    write(store, msgs)  # type: ignore[arg-type]
    r = one(store, T0, T0 + 10)
    assert (r["energy_j"], r["energy_held_j"], r["energy_unallocated_j"], r["energy_allocated_idle_j"]) == (
        pytest.approx(1000.0), pytest.approx(750.0), pytest.approx(250.0), pytest.approx(750.0),
    )  # fmt: skip
    hs = {x.id: (x.energy_j, x.energy_idle_j) for x in holder_energy(store, T0, T0 + 10)}
    assert hs == {"a": pytest.approx((500.0, 500.0)), "b": pytest.approx((250.0, 250.0))}


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_mig_instances_draw_their_fraction_of_the_gpu(store: ChdbStore) -> None:
    # one GPU fully partitioned: its own row (fraction 0) carries the counter, +7e5 mJ per 10 s
    # (70 W); instance 1 (3/7) held by a, instance 2 (4/7) by b. 10 s: 700 J, a 300, b 400; the
    # GPU's own row stands for nothing.
    msgs = []
    for k in range(2):
        msgs.append(h.batch("n1", T0 + 10 * k, [
            gpu(0, 7e5 * k, 70.0, fraction=0.0),
            gpu(0, None, None, allocs=(("a", 1.0),), fraction=3 / 7, mig=MigInstance(gi=1, profile="3g.40gb")),
            gpu(0, None, None, allocs=(("b", 1.0),), fraction=4 / 7, mig=MigInstance(gi=2, profile="4g.40gb")),
        ]))  # fmt: skip
    write(store, msgs)  # type: ignore[arg-type]
    hs = {x.id: x.energy_j for x in holder_energy(store, T0, T0 + 10)}
    assert hs == {"a": pytest.approx(300.0, rel=1e-6), "b": pytest.approx(400.0, rel=1e-6)}
    r = one(store, T0, T0 + 10)
    assert r["energy_j"] == pytest.approx(700.0, rel=1e-6)
    assert r["energy_unallocated_j"] == pytest.approx(0.0, abs=1e-3)


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_node_drained_mid_window(store: ChdbStore) -> None:
    # 2 GPUs at 100 W each (+1e6 mJ per 10 s) over [T0, T0+100), one more sample at T0+100 for
    # the last delta. GPU0 held by j (active 0.8), GPU1 free. Drained from T0+50.
    # Total 2 x 100 W x 100 s = 20000 J; j draws 10000 (a job draws its energy wherever it holds);
    # GPU1: unallocated 5000 J (first 50 s), outside capacity 5000 J (drained half).
    msgs: list[object] = []
    for k in range(11):
        t = T0 + 10 * k
        msgs.append(
            h.batch("n1", t, [gpu(0, 1e6 * k, 100.0, 0.8, (("j", 1.0),)), gpu(1, 1e6 * k, 100.0, 0.0)])
        )
        msgs.append(h.heartbeat("n1", t, schedulable=k < 5))
    write(store, msgs)  # type: ignore[arg-type]
    r = one(store, T0, T0 + 100)
    assert r["energy_j"] == pytest.approx(20000.0)
    assert r["energy_held_j"] == pytest.approx(10000.0)
    assert r["energy_unallocated_j"] == pytest.approx(5000.0)
    assert r["energy_outside_capacity_j"] == pytest.approx(5000.0)
    assert r["energy_allocated_idle_j"] == 0.0
    assert r["energy_estimated_j"] == 0.0


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_carbon_constant_and_series(store: ChdbStore, tmp_path: Path) -> None:
    # 100 W for 40 s, counter-measured over [T0, T0+40) (a 5th sample closes the last delta):
    # 1000 J per sample. Constant 360 g/kWh: 4000 J = 1/900 kWh → 0.4 g.
    series(store, [0.0, 1e6, 2e6, 3e6, 4e6])
    grid = GridIntensity(clusters={"c1": 360.0})
    assert one(store, T0, T0 + 40, grid=grid)["co2_g"] == pytest.approx(0.4)
    # a series: 100 g/kWh from T0+20 on, 900 from T0+30; before T0+20 nothing is known:
    # 2000 J without intensity; 1000 J x 100 + 1000 J x 900 = 1e6 J·g/kWh / 3.6e6 = 0.27778 g
    f = tmp_path / "ci.csv"
    f.write_text(f"start,g_per_kwh\n{T0 + 20:.0f},100\n{T0 + 30:.0f},900\n")
    grid = parse({"grid_intensity": {"clusters": {"c1": {"file": str(f)}}}}).grid_intensity
    r = one(store, T0, T0 + 40, grid=grid)
    assert r["co2_g"] == pytest.approx(1e6 / 3.6e6)
    assert r["energy_no_intensity_j"] == pytest.approx(2000.0)
    # the default covers clusters not listed
    r = one(store, T0, T0 + 40, grid=GridIntensity(default_g_per_kwh=90.0, clusters={"other": 1.0}))
    assert r["co2_g"] == pytest.approx(4000 * 90 / 3.6e6)


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
@pytest.mark.parametrize("listed", ["constant", "series", "other", "none"])
@pytest.mark.parametrize("default", [None, 90.0])
def test_the_default_intensity_is_for_clusters_not_listed(
    store: ChdbStore, tmp_path: Path, listed: str, default: float | None
) -> None:
    """docs/metrics.md: ``default_g_per_kwh`` is for clusters not listed; a listed cluster's
    energy before its series' first row has no intensity (it took the default: 2000 J at 90
    g/kWh were reported as carbon, not as ``no_intensity``). 1000 J per 10 s sample, 4 samples."""
    series(store, [0.0, 1e6, 2e6, 3e6, 4e6])
    f = tmp_path / "ci.csv"
    f.write_text(f"start,g_per_kwh\n{T0 + 20:.0f},100\n")
    c1: dict[str, object] = {"constant": {"c1": 360.0}, "series": {"c1": {"file": str(f)}},
                             "other": {"other": 1.0}, "none": {}}[listed]  # fmt: skip
    grid = parse({"grid_intensity": {"default_g_per_kwh": default, "clusters": c1}}).grid_intensity
    # the intensity of each sample's start (T0, +10, +20, +30), by the definition
    per = {
        "constant": [360.0] * 4,
        "series": [None, None, 100.0, 100.0],
        "other": [default] * 4,
        "none": [default] * 4,
    }[listed]
    r = one(store, T0, T0 + 40, grid=grid)
    assert r["co2_g"] == pytest.approx(sum(1000 * g / 3.6e6 for g in per if g is not None))
    assert r["energy_no_intensity_j"] == pytest.approx(1000.0 * sum(g is None for g in per))
    # per account too: the holder's energy with no intensity is said, beside the carbon of the
    # rest (an account's was 0.0 kg CO2 and nothing else: zero carbon)
    (hold,) = holder_energy(store, T0, T0 + 40, grid=grid)
    assert hold.energy_no_intensity_j == pytest.approx(1000.0 * sum(g is None for g in per))
    s = summary_of(fleet_energy(store, T0, T0 + 40, grid=grid), [hold])
    assert s["by_account_no_intensity_kwh"] == {
        "acct": pytest.approx(sum(g is None for g in per) / 3600, abs=1e-6)
    }


@pytest.mark.integration  # over 0.7 s on the shared machine (several chDB queries)
def test_energy_per_user_and_account(store: ChdbStore) -> None:
    # GPU0: job a (user x, account A) 1000 J; GPU1: job b (user y, account A) 2000 J (200 W)
    msgs = [h.batch("n1", T0 + 10 * k, [gpu(0, 1e6 * k, 1.0, 0.5, (("a", 1.0),), account="A", user="x"),
                                        gpu(1, 2e6 * k, 1.0, 0.5, (("b", 1.0),), account="A", user="y")])
            for k in range(2)]  # fmt: skip
    write(store, msgs)  # type: ignore[arg-type]
    hs = holder_energy(store, T0, T0 + 10)
    assert {k: v["energy_j"] for k, v in by(hs, "account").items()} == {"A": pytest.approx(3000.0)}
    assert {k: v["energy_j"] for k, v in by(hs, "user").items()} == {
        "x": pytest.approx(1000.0), "y": pytest.approx(2000.0),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "line 1 must be the header"),
        ("ts,g\n1,2\n", "line 1 must be the header"),
        ("start,g_per_kwh\n", "no rows after the header"),
        ("start,g_per_kwh\n10,100\n10,200\n", "line 3: start not after"),
        ("start,g_per_kwh\n20,100\n10,200\n", "line 3: start not after"),
        (
            "start,g_per_kwh\n2026-01-01T00:00:00,100\n",
            "line 2: start '2026-01-01T00:00:00' has no time zone",
        ),
        ("start,g_per_kwh\nyesterday,100\n", "line 2: start 'yesterday' is neither"),
        ("start,g_per_kwh\n10,-1\n", "line 2: g_per_kwh '-1' outside"),
        ("start,g_per_kwh\n10,nan\n", "line 2: g_per_kwh 'nan' outside"),
        ("start,g_per_kwh\n10,1e9\n", "outside [0, 5000]"),
        ("start,g_per_kwh\n10,100,3\n", "line 2: 3 columns"),
        ("start,g_per_kwh\n10,abc\n", "line 2: could not convert"),
        ("start,g_per_kwh\ninf,100\n", "is not a time"),
    ],
)
def test_bad_intensity_files_are_refused_with_the_line(tmp_path: Path, text: str, says: str) -> None:
    f = tmp_path / f"ci-{abs(hash(text))}.csv"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse({"grid_intensity": {"clusters": {"c1": {"file": str(f)}}}})
    assert says in str(e.value)
    assert str(f) in str(e.value)


def test_intensity_files_that_are_not_files_or_too_large_are_refused(tmp_path: Path) -> None:
    """A directory, a FIFO with no writer (the open would block the service's start for ever),
    a device (/dev/zero would fill memory), a file over MAX_SERIES_BYTES, a field over csv's
    limit: each one ConfigError naming the file, never a hang or a traceback. A BOM is accepted."""
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    big = tmp_path / "big.csv"
    with big.open("wb") as fh:
        fh.write(b"start,g_per_kwh\n")
        fh.truncate(MAX_SERIES_BYTES + 1)
    wide = tmp_path / "wide.csv"
    wide.write_text("start,g_per_kwh\n10," + "1" * 200_000 + "\n")
    for f, says in [
        (tmp_path, "not a regular file"),
        (fifo, "not a regular file"),
        (Path("/dev/zero"), "not a regular file"),
        (big, f"larger than {MAX_SERIES_BYTES} bytes"),
        (wide, "field larger than field limit"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse({"grid_intensity": {"clusters": {"c1": {"file": str(f)}}}})
        assert f"grid intensity file {f}" in str(e.value) and says in str(e.value), str(e.value)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfstart,g_per_kwh\n10,100\n")
    assert load_series(str(bom)) == ((10.0, 100.0),)


def test_intensity_file_iso_times_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "ok.csv"
    f.write_text(
        "start,g_per_kwh\n2026-01-01T00:00:00Z,100\n2026-01-01T01:00:00+01:00,200\n2026-01-01T02:00:00Z,300\n"
    )
    with pytest.raises(ConfigError, match="line 3: start not after"):  # 01:00+01:00 is 00:00Z
        parse({"grid_intensity": {"clusters": {"c1": {"file": str(f)}}}})
    f.write_text("start,g_per_kwh\n2026-01-01T00:00:00Z,100\n1767229200,200\n")  # 01:00Z as epoch
    g = parse({"grid_intensity": {"clusters": {"c1": {"file": str(f)}}}}).grid_intensity
    assert g is not None and g.points() == [("c1", 1767225600.0, 100.0), ("c1", 1767229200.0, 200.0)]
    with pytest.raises(ConfigError, match="No such file"):
        parse({"grid_intensity": {"clusters": {"c1": {"file": str(tmp_path / "nope.csv")}}}})
    with pytest.raises(ConfigError, match="less than or equal to 5000"):
        parse({"grid_intensity": {"clusters": {"c1": 6000}}})


@pytest.mark.integration
def test_min_idle_s_and_one_holder(store: ChdbStore) -> None:
    # 100 W throughout (+1e6 mJ per 10 s), job j: idle for one sample (T0), active after
    # (T0+10, T0+20), a 4th sample closing the deltas. Without min_idle_s the idle sample's
    # 1000 J is allocated-idle; with min_idle_s 30 a 10 s idle run is not idle: 0.
    acts = [0.0, 0.9, 0.9, 0.9]
    msgs = [
        h.batch("n1", T0 + 10 * k, [gpu(0, 1e6 * k, 100.0, a, (("j", 1.0),))]) for k, a in enumerate(acts)
    ]
    msgs.append(h.batch("n2", T0, [gpu(0, 0.0, 100.0, 0.0, (("other", 1.0),))]))
    write(store, msgs)  # type: ignore[arg-type]
    assert one_node(store, "energy_allocated_idle_j") == pytest.approx(1000.0 + 1000.0)  # j's and other's
    assert one_node(store, "energy_allocated_idle_j", min_idle_s=30.0) == 0.0
    (j,) = holder_energy(store, T0, T0 + 30, ids=["j"])
    assert (j.id, j.energy_j, j.energy_idle_j) == ("j", pytest.approx(3000.0), pytest.approx(1000.0))
    assert holder_energy(store, T0, T0 + 30, ids=["j"], min_idle_s=30.0)[0].energy_idle_j == 0.0
    assert holder_energy(store, T0, T0 + 30, ids=["nobody"]) == []


def one_node(store: ChdbStore, key: str, **kw: float) -> float:
    return sum(getattr(g, key) for g in fleet_energy(store, T0, T0 + 30, **kw))  # type: ignore[arg-type]


@pytest.mark.integration  # one panel query per bucket length
@pytest.mark.parametrize("bucket_s", [15, 30, 45, 60, 90, 300])
def test_the_power_panel_reads_the_watts_drawn_at_every_bucket_length(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch, bucket_s: int
) -> None:
    """The chargeback dashboard's "Power drawn per account (W)": a row's energy went whole to the
    bucket of the sample's start, so with buckets shorter than the samples (Grafana's interval
    on a short range) a GPU drawing 600 W read 1,200 W in every other 30 s bucket (and 900 W in
    the first, the range starting mid-sample). Its energy is now split at the bucket edges, as
    the GPU-seconds panels split their samples. Job j draws 600 W (counter) over 60 s samples
    from T0 to T0+600; the range [T0+15, T0+600): each bucket reads 600 W x its seconds inside
    the range / its length."""
    from gpuslo.dashboards.generate import VIEWS
    from tests import grafana

    write(store, [h.batch("n1", T0 + 60 * k, [gpu(0, 600 * 60 * 1000.0 * k, 600.0, allocs=(("j", 1.0),))],
                          interval_s=60.0) for k in range(11)])  # type: ignore[arg-type]  # fmt: skip
    (q,) = [s.sql for s in VIEWS["chargeback.json"][2](parse({})) if s.title.startswith("Power drawn")]
    monkeypatch.setattr(grafana, "INTERVAL_S", bucket_s)
    frm, to = T0 + 15, T0 + 600
    rows = store.query(grafana.expand(q, frm, to))
    got = {int(r["time"]): r["watts"] for r in rows}  # a DateTime comes back as epoch seconds
    first = int(frm // bucket_s) * bucket_s
    want = {
        b: 600.0 * (min(b + bucket_s, to) - max(b, frm)) / bucket_s for b in range(first, int(to), bucket_s)
    }
    assert got == {b: pytest.approx(w) for b, w in want.items()}
    assert {r["account"] for r in rows} == {"acct"}

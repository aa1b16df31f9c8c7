"""The peers benchmark runs (gpuslo's store next to a real Prometheus fed by promtool), every
compared pair agrees, and the numbers both give are the ones the generator implies on paper
(no timing here)."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.integration,  # runs the benchmark end to end: chDB, promtool, Prometheus
    pytest.mark.skipif(
        not (shutil.which("promtool") and shutil.which("prometheus")), reason="Debian's prometheus package"
    ),
]

# The generator (bench/rules.py, its docstring): one latency row every 10 s of
# [400, 500, 280, 8, 4, 3, 2, 1, 1, 1, 0] over the bounds 1, 2.5, 5, ... ms, and on day 4
# (0-based) in the first 20 minutes of every hour [200, 300, 250, 120, 80, 30, 10, 5, 3, 1, 1].
# The SLO: p99 <= 5 ms, so the first three buckets are good; objective 0.99.
NORMAL = (1200, 1180)  # (total, good)
DEGRADED = (1000, 750)
UTIL = ("capacity_gpu_h", "active_cur", "allocation_cur", "idle_allocated_gpu_h", "idle_unallocated_gpu_h")


def _run(gpus: int, days: float, *extra: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "bench", "peers", "--gpus", str(gpus), "--days", repr(days),
                        "--timeout", "240", *extra], capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    fig: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["bench"] == "peers" and fig["agree"] is True
    return fig


def _slo(end_s: int, window_s: int) -> tuple[float, float]:
    """SLI and burn over the latency rows in (end - window, end], from the generator's counts."""
    total = good = 0
    for n in range(max(0, (end_s - window_s) // 10 + 1), end_s // 10):
        t, g = DEGRADED if (n * 10 // 86400 == 4 and n % 360 < 120) else NORMAL
        total, good = total + t, good + g
    sli = good / total
    return sli, (1 - sli) / (1 - 0.99)


def _check(fig: dict[str, Any], expected: dict[str, float]) -> None:
    for k, want in expected.items():
        got = fig["values"][k]
        # the recording rules' series carry the utilization, not the SLO (its windows are exact
        # over the histogram's own counters)
        sides = ("gpuslo_rollup", "gpuslo_raw", "promql") + (("promql_recorded",) if k in UTIL else ())
        assert set(got) == set(sides), got
        for side in sides:
            assert math.isclose(got[side], want, rel_tol=1e-9), (k, side, got, want)


def _expected_slo(fig: dict[str, Any], end_s: int) -> dict[str, float]:
    out = {}
    for k in fig["values"]:
        if k.startswith("sli_"):
            w = int(k.removeprefix("sli_"))
            out[k], out[f"burn_{w}"] = _slo(end_s, w)
    return out


# the PromQL over the raw series in ranges: 2 h (the default: 2 h + 1 h), none (one query over
# the window), 1 h 15 min (75 + 75 + 30 min, a range that divides nothing)
@pytest.mark.parametrize(("chunk", "ranges"), [((), 2), (("--chunk-h", "0"), 1), (("--chunk-h", "1.25"), 3)])
def test_bench_peers_small_fleet_every_pair_agrees(chunk: tuple[str, ...], ranges: int) -> None:
    fig = _run(8, 0.125, *chunk)  # one node, 3 hours
    assert fig["prom_ranges"] == ranges
    assert fig["gpu_sample_rows"] == 8 * 1080
    # two DCGM gauges per GPU, the node's state, 13 histogram series (11 buckets, count, sum)
    assert fig["prom_samples"] == 2 * 8 * 1080 + 1080 + 13 * 1080
    v = fig["values"]
    # every window of these 3 hours is a normal one; windows longer than the history are left out
    assert sorted(int(k[4:]) for k in v if k.startswith("sli_")) == [300, 1800, 3600, 7200, 10800]
    _check(fig, {"capacity_gpu_h": 8 * 3.0, **_expected_slo(fig, 10800)})
    # an unallocated GPU is always idle (the generator): unallocated idle = capacity x (1 - allocation CUR)
    for side in ("gpuslo_rollup", "gpuslo_raw", "promql", "promql_recorded"):
        cap, cur = v["capacity_gpu_h"][side], v["allocation_cur"][side]
        assert math.isclose(v["idle_unallocated_gpu_h"][side], cap * (1 - cur), rel_tol=1e-9)
    for k in (
        "ratio_bytes_per_sample",
        "ratio_rss",
        "ratio_util_rollup_s",
        "ratio_util_raw_s",
        "ratio_slo_raw_s",
        "ratio_util_rollup_vs_recorded_s",
        "ratio_refresh_vs_rules_backfill_s",
    ):
        assert fig[k] > 0
    # the recording rules were backfilled into blocks of their own, one series per component
    # (five components and the bench's evaluation marker), every evaluation of the 3 hours there
    assert fig["prom_rules_bytes"] > 0 and fig["recording_rules"].count("- record: ") == 6
    assert fig["rule_evaluations"] == {"utilization": 1080, "sloth": 360}
    # the SLO as Sloth's rules record it: every alert window of the 3 hours and the period; the
    # traffic is the same in every row here, so a window's edge (Sloth evaluates every 30 s at
    # an offset, rate() leaves the first sample's increment to its extrapolation) changes nothing
    sloth = fig["sloth"]
    assert sorted(sloth) == ["burn_1800", "burn_300", "burn_3600", "burn_7200", "period_burn", "period_sli"]
    for k, row in sloth.items():
        assert row["rel_diff"] is not None and row["rel_diff"] < 1e-9, (k, row)
    assert fig["promql_cannot"] == [
        "fractional shares",
        "min-duration idle",
        "starvation incidents with cause",
    ]


def test_bench_peers_drained_day_and_degraded_day_agree() -> None:
    """4 days 6 hours: the node is drained on day 2 (not capacity on either side), and the
    window ends 6 hours into the degraded day (the 1 h and longer windows burn)."""
    fig = _run(8, 4.25)
    end_s = int(4.25 * 86400)
    expected = {"capacity_gpu_h": 8 * 3.25 * 24, **_expected_slo(fig, end_s)}
    assert expected["burn_3600"] > 6 > expected["burn_300"]  # the paper values themselves discriminate
    _check(fig, expected)
    # Sloth's period SLI is the mean of its 5-minute error ratios: a degraded 5 minutes (fewer
    # requests, more of them slow) weighs as much as a busy normal one, so its burn comes out
    # above the exact one; each alert window's burn is off only by its edge (at most 30 s of
    # rows at another offset), under 1 % here
    sloth = fig["sloth"]
    assert sloth["period_burn"]["sloth"] > sloth["period_burn"]["gpuslo"] * 1.01
    assert math.isclose(sloth["period_burn"]["gpuslo"], expected[f"burn_{end_s}"], rel_tol=1e-9)
    for k, row in sloth.items():
        if k.startswith("burn_"):
            assert math.isclose(row["sloth"], expected[k], rel_tol=0.01), (k, row)


def test_ranges_cover_the_window_once() -> None:
    """The ranges the PromQL is split into: disjoint, adjacent, the window's length in all, the
    last one shorter (pure: no servers)."""
    from bench.peers import chunks

    frm = 1_795_824_000.0
    for whole in (60, 3600, 7200, 10_800, 86_400 + 60, 7 * 86_400):
        for chunk in (0, 60, 3600, 4500, 7200, 86_400, 8 * 86_400):
            parts = chunks(frm, frm + whole, chunk)
            assert sum(n for _, n in parts) == whole
            assert parts[-1][0] == frm + whole
            for (end0, _), (end1, n1) in itertools.pairwise(parts):
                assert end1 - n1 == end0  # adjacent: each range starts where the last one ended
            if 0 < chunk < whole:
                assert len(parts) == -(-whole // chunk) and all(n == chunk for _, n in parts[:-1])
            else:
                assert parts == [(frm + whole, whole)]


@pytest.mark.parametrize("bad", ["-1", "0.001", "nan", "inf", "9000"])
def test_a_bad_range_length_is_refused_before_anything_starts(bad: str) -> None:
    r = subprocess.run([sys.executable, "-m", "bench", "peers", "--chunk-h", bad], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 2 and "--chunk-h must be" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_component_with_nothing_to_count_is_zero_on_every_side() -> None:
    """One node for one hour, all of its GPUs held (the generator's first 2-hour block): no GPU
    is unallocated, so the free-idle rule records nothing; the sum over the window is 0 there
    as on the other sides, not a missing value."""
    fig = _run(8, 1 / 24)
    v = fig["values"]
    assert v["allocation_cur"]["gpuslo_raw"] == 1.0  # the premise: every GPU held
    assert {side: v["idle_unallocated_gpu_h"][side] for side in v["idle_unallocated_gpu_h"]} == {
        "gpuslo_rollup": 0.0, "gpuslo_raw": 0.0, "promql": 0.0, "promql_recorded": 0.0}  # fmt: skip
    assert fig["missing"] == [] and fig["disagree"] == []


class _Times:
    """A Prometheus that answers a series' sample times (check_evaluations' one call)."""

    def __init__(self, ts: list[float]) -> None:
        self.ts = ts

    def times(self, series: str, at: float, range_s: int) -> list[float]:
        return [t for t in self.ts if at - range_s <= t <= at]


@pytest.mark.parametrize("offset", [0.0, 3.4, 9.5, 9.999])
def test_every_rule_evaluation_is_there_or_the_run_fails(offset: float) -> None:
    """promtool 2.42 leaves out an evaluation in the last second before a 2-hour block boundary
    (seen with a group offset of 9.16-9.82 s): a hole anywhere, a late first or an early last
    evaluation is a failed step, naming the rule."""
    from bench.peers import StepFailed, check_evaluations

    frm, to = 1_795_824_000.0, 1_795_824_000.0 + 3 * 3600
    whole = [frm + offset + 10 * k for k in range(1080 + (offset == 0.0))]
    assert check_evaluations(_Times(whole), "m", 10, frm, to) == len(whole)  # type: ignore[arg-type]
    holed = [t for t in whole if not (frm + 7199 <= t < frm + 7200)]  # the block boundary's
    cases = [holed, whole[1:], whole[:-1], []] if offset >= 9 else [whole[1:], whole[:-1], []]
    for ts in cases:
        with pytest.raises(StepFailed, match=r"recording rule m: .* evaluations every 10 s"):
            check_evaluations(_Times(ts), "m", 10, frm, to)  # type: ignore[arg-type]


def _fake_promtool(tmp_path: Path, rules_part: str) -> str:
    """promtool itself for the raw backfill, ``rules_part`` (sh) for ``create-blocks-from rules``."""
    fake = tmp_path / "promtool"
    real = shutil.which("promtool")
    fake.write_text(f'#!/bin/sh\nif [ "$3" = rules ]; then\n{rules_part}\nfi\nexec {real} "$@"\n')
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize(
    ("rules_part", "said"),
    [
        # exits 0 and writes nothing: no recorded series to compare, one line naming the step
        ("exit 0", "promtool rules backfill (rules.yml): exit 0, but no block in"),
        # its own failure: the error line, not the info lines before it
        ('echo "level=info backfiller=x" >&2; echo "import error: query failed" >&2; exit 1',
         "promtool rules backfill (rules.yml) failed (exit 1): import error: query failed"),
        # an error logged with exit 0
        ('echo "level=error msg=boom" >&2; exit 0', "promtool rules backfill (rules.yml) failed (exit 0): level=error"),
    ],
)  # fmt: skip
def test_a_failed_rules_backfill_fails_the_run_naming_it(tmp_path: Path, rules_part: str, said: str) -> None:
    err = _fails("--promtool", _fake_promtool(tmp_path, rules_part))
    assert said in err and "level=info" not in err, err


def _fails(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "bench", "peers", "--gpus", "8", "--days", "0.125", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not r.stdout.strip().endswith("}"), "no figures from a failed run"
    return r.stderr


def test_bench_peers_a_step_past_its_timeout_fails_naming_it() -> None:
    assert "gpuslo generate: not done within 0.5 s" in _fails("--timeout", "0.5")


def test_bench_peers_a_missing_peer_fails_naming_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-promtool")
    assert f"promtool backfill: cannot run {missing}" in _fails("--promtool", missing)
    # promtool works, the server does not start: its own words come back
    fake = tmp_path / "prometheus"
    fake.write_text("#!/bin/sh\necho 'err=\"opening storage failed\"' >&2\nexit 1\n")
    fake.chmod(0o755)
    assert 'prometheus exited (1): err="opening storage failed"' in _fails("--prometheus", str(fake))


def test_bench_peers_a_process_over_the_memory_bound_is_killed_and_named() -> None:
    assert "gpuslo generate: RSS over 100 MB, killed" in _fails("--max-rss-mb", "100")


HOSTILE = ['node"1', "back\\slash", "new\nline", 'all\\"\n{}=, é', ""]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_label_value_reaches_prometheus_as_it_was(value: str, tmp_path: Path) -> None:
    """The export's label escaping, through the real parser: promtool reads back the value."""
    from bench.peers import label_sql
    from gpuslo.ingest.store import ChdbStore

    store = ChdbStore(tmp_path / "store")
    try:
        esc = store.query(f"SELECT {label_sql('{v:String}')} AS e", {"v": value})[0]["e"]
    finally:
        store.close()
    om = tmp_path / "f.om"
    om.write_text(f'# TYPE m gauge\nm{{a="{esc}"}} 1 1795824000\n# EOF\n')
    tsdb = tmp_path / "tsdb"
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(om), str(tsdb)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    (tsdb / "wal").mkdir()  # dump reads the WAL too; a backfill writes none
    dump = subprocess.run(["promtool", "tsdb", "dump", str(tsdb)], check=True, capture_output=True,
                          text=True, timeout=60).stdout  # fmt: skip
    # the dump quotes as Go's strconv.Quote does: for these characters, as JSON does; an empty
    # value is no label at all to Prometheus (so `hpc_job=""` selects the GPUs nobody holds)
    want = f", a={json.dumps(value, ensure_ascii=False)}" if value else ""
    assert dump.startswith('{__name__="m"' + want + "}"), dump


def test_bench_peers_an_unusable_work_directory_fails_clearly(tmp_path: Path) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("")
    assert "cannot make a work directory in" in _fails("--workdir", str(afile))
    # the store's directory taken by a file: the generate step's own words, on one line
    r = subprocess.run([sys.executable, "-m", "bench", "peers", "_generate", "--gpus", "8", "--days", "0.125",
                        "--store", str(afile)], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr and "cannot create embedded store" in r.stderr, (
        r.stderr
    )

"""``python -m bench parts`` at a small size: both part settings are measured on the same rows,
every row is stored, and each figure's ratio is the schema's over the former's of the same run."""

from __future__ import annotations

import json

import pytest

from bench import parts

pytestmark = pytest.mark.integration


def test_bench_parts_measures_both_settings_on_the_same_rows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--batches", "3000", "--insert-rows", "4000,12000", "--repeat", "1", "--quiet-s", "0.5"]
    assert parts.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "parts" and out["gpu_rows"] == 3000 * 8
    for size in (4000, 12000):
        for name in ("former", "schema"):
            assert out[f"insert_s_{name}_{size}"] > 0
            assert out[f"cpu_s_{name}_{size}"] >= out[f"merge_cpu_s_{name}_{size}"] >= 0
        for k in ("insert_s", "cpu_s"):
            want = out[f"{k}_schema_{size}"] / out[f"{k}_former_{size}"]
            assert out[f"ratio_{k}_schema_vs_former_{size}"] == pytest.approx(want, abs=2e-3)


@pytest.mark.parametrize("flag", [["--insert-rows", "4000,x"], ["--insert-rows", "0"], ["--quiet-s", "nan"]])
def test_bench_parts_refuses_bad_flags_in_one_line(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parts.main(flag)
    assert e.value.code == 2 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--quiet-s", "5", "--stall-s", "2"],  # a quiet time the wait could never see (found by the attack)
        ["--batches", "20000", "--insert-rows", "8"],  # 20,000 inserts a round: beyond any evening
        ["--insert-rows", "4000,4000"],  # the same size twice
    ],
)
def test_bench_parts_refuses_a_run_it_could_not_finish(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parts.main(flags)
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and "Traceback" not in err
        and err.strip().splitlines()[-1].startswith("usage") is False
    )

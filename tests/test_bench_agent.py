"""``python -m bench agent``: the fake NVML's figures always; the real NVML's beside them,
with the fake at the real GPU count as their baseline, where NVML starts; where it does not,
the reason said (``--nvml real``: exit 2)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from bench import agent


def _last_json(out: str) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return got


def _nvml_starts() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_the_fake_is_measured_and_the_real_nvml_is_measured_or_its_absence_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert agent.main(["--ticks", "20"]) == 0
    printed = capsys.readouterr().out
    out = _last_json(printed)
    assert out["bench"] == "agent" and out["gpus"] == agent.FAKE_GPUS and out["ticks"] == 20
    assert out["cpu_s_per_1000_ticks"] > 0 and 10 < out["peak_rss_mb"] < 1000 and out["bytes_per_tick"] > 1000
    assert out["core_share_at_1s_pct"] == pytest.approx(out["cpu_s_per_1000_ticks"] / 10, abs=1e-3)
    if _nvml_starts():  # a machine with a GPU: the real figures and their baseline
        assert out["real_nvml"] == "measured" and out["real_gpus"] >= 1
        assert out["ratio_cpu_real_vs_fake"] == pytest.approx(
            out["real_cpu_s_per_1000_ticks"] / out["fake_same_gpus_cpu_s_per_1000_ticks"], abs=1e-3
        )
    else:
        assert out["real_nvml"].startswith("unavailable: NVML did not start (NVMLError")
        assert "real NVML: not measured (NVML did not start" in printed
        assert not any(k.startswith(("real_gpus", "ratio_")) for k in out)


def test_nvml_real_fails_with_the_reason_where_nvml_does_not_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if _nvml_starts():
        pytest.skip("NVML starts on this machine: --nvml real measures it")
    assert agent.main(["--ticks", "5", "--nvml", "real"]) == 2
    err = capsys.readouterr().err
    assert "--nvml real: not measured (NVML did not start (NVMLError" in err and "Traceback" not in err


def test_nvml_fake_measures_the_fake_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent.main(["--ticks", "5", "--nvml", "fake"]) == 0
    assert _last_json(capsys.readouterr().out)["real_nvml"] == "not asked (--nvml fake)"


def test_the_real_branch_reads_whatever_pynvml_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real measurement is the agent's own source on ``pynvml`` (here a stand-in: two GPUs
    without GPM or NVLink), on the wall clock, and reports what those GPUs support."""
    from tests.fake_nvml import FakeGpu, FakeNvml

    monkeypatch.setitem(
        sys.modules, "pynvml", FakeNvml([FakeGpu("GPU-a", gpm=False), FakeGpu("GPU-b", gpm=False)])
    )
    f = agent.measure("real", 10, gpus=8, gpm_gpus=8, nvlink_gpus=8)  # the fake's shape is not used
    assert f["kind"] == "real" and f["gpus"] == 2 and f["gpm_gpus"] == 0 and f["nvlink_gpus"] == 0
    assert f["ticks"] == 10 and f["cpu_s_per_1000_ticks"] > 0 and f["errors"] == 0


def test_the_baseline_is_the_fake_shaped_as_the_real_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: list[tuple[Any, ...]] = []

    def child(kind: str, ticks: int, gpus: int = agent.FAKE_GPUS, gpm_gpus: int = agent.FAKE_GPUS,
              nvlink_gpus: int = agent.FAKE_GPUS) -> dict[str, Any]:  # fmt: skip
        asked.append((kind, ticks, gpus, gpm_gpus, nvlink_gpus))
        base = {"models": ["m"], "driver": "d", "mig_instances": 0, "unsupported": 0, "errors": 0,
                "ticks": ticks, "wall_s": 1.0, "rss_growth_mb": 0.0, "bytes_per_tick": 100}  # fmt: skip
        if kind == "real":
            return base | {"kind": "real", "gpus": 1, "gpm_gpus": 1, "nvlink_gpus": 0,
                           "cpu_s_per_1000_ticks": 3.0, "peak_rss_mb": 60.0}  # fmt: skip
        return base | {"kind": "fake", "gpus": gpus, "gpm_gpus": gpm_gpus, "nvlink_gpus": nvlink_gpus,
                       "cpu_s_per_1000_ticks": 1.5 if gpus == 1 else 2.9, "peak_rss_mb": 40.0}  # fmt: skip

    monkeypatch.setattr(agent, "_child", child)
    assert agent.main(["--ticks", "7"]) == 0
    assert asked == [("fake", 7, 8, 8, 8), ("real", 7, 8, 8, 8), ("fake", 7, 1, 1, 0)]
    out = _last_json(capsys.readouterr().out)
    assert out["cpu_s_per_1000_ticks"] == 2.9 and out["real_cpu_s_per_1000_ticks"] == 3.0
    assert out["fake_same_gpus_cpu_s_per_1000_ticks"] == 1.5
    assert out["ratio_cpu_real_vs_fake"] == 2.0 and out["ratio_rss_real_vs_fake"] == 1.5


def test_the_device_check_script_runs_every_step_and_says_why_without_a_gpu(tmp_path: Any) -> None:
    """scripts/device-check.sh, the one run a lent GPU machine is given, on this machine: every
    step runs and leaves its file, and each says plainly that NVML did not start (exit 2)."""
    import os
    import subprocess
    from pathlib import Path

    if _nvml_starts():
        pytest.skip("a GPU here: the script measures it")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, TICKS="5",
               WHEELS=str(tmp_path / "no-wheels"), SITE=str(tmp_path / "site"))  # fmt: skip
    done = subprocess.run(["bash", str(root / "scripts/device-check.sh")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "bench-agent.txt",
        "nvidia-smi.txt",
        "once.err",
        "once.json",
    ]
    assert "cannot start NVML" in (out / "once.err").read_text()
    bench = (out / "bench-agent.txt").read_text()
    assert "fake NVML (8 GPUs" in bench and "--nvml real: not measured (NVML did not start" in bench
    assert "Traceback" not in done.stdout + bench + (out / "once.err").read_text()


def test_a_real_nvml_without_gpus_or_failing_is_reported_and_the_fake_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """NVML that starts but sees no GPU (``nvidia-smi``: "No devices were found") is not
    measured; a real measurement that fails in its child (a GPU lost mid-run) is reported so under
    ``auto`` with the fake's figures kept, and is exit 2 under ``real``."""
    from tests.fake_nvml import FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([]))
    assert agent.measure("real", 5, 8, 8, 8) == {
        "kind": "real",
        "unavailable": "NVML (driver 580.95.05) started but sees no GPU",
    }
    real_child = agent.run_child

    def run_child(module: str, args: list[str], timeout_s: float) -> tuple[Any, str]:
        if "real" in args:
            return None, "exit 1: pynvml.NVMLError_GpuIsLost: GPU is lost"
        return real_child(module, args, timeout_s)

    monkeypatch.setattr(agent, "run_child", run_child)
    assert agent.main(["--ticks", "5"]) == 0
    out = _last_json(capsys.readouterr().out)
    assert (
        out["real_nvml"]
        == "unavailable: the measurement failed: exit 1: pynvml.NVMLError_GpuIsLost: GPU is lost"
    )
    assert out["gpus"] == agent.FAKE_GPUS and out["cpu_s_per_1000_ticks"] > 0
    assert agent.main(["--ticks", "5", "--nvml", "real"]) == 2
    assert "GpuIsLost" in capsys.readouterr().err


def test_a_childs_peak_rss_is_its_own_not_its_parents() -> None:
    """``ru_maxrss`` survives ``exec``: a child started by a process that had been bigger read that
    process's peak as its own. Each measurement's figure is the child's own (``VmHWM``)."""
    from bench.child import peak_rss_mb, run_child

    ballast = bytearray(300 * 2**20)  # the parent's peak: 300 MB more than its child will need
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident
    assert peak_rss_mb() > 300
    got, why = run_child("bench", ["agent", "--only", "fake", "--ticks", "3"], 120)
    assert got is not None, why
    assert got["peak_rss_mb"] < 200, got
    del ballast


def test_the_fakes_shape_is_a_childs_alone(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--gpus", "--gpm-gpus=2", "--nvlink-gpus"):
        with pytest.raises(SystemExit) as e:
            agent.main(["--ticks", "5", *flag.split(" "), *([] if "=" in flag else ["3"])])
        assert e.value.code == 2
        assert "shape a child's fake (with --only)" in capsys.readouterr().err

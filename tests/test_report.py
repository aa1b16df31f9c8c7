"""The HTML report, opened in headless Chromium: screenshot taken, no console errors, every
chart drawn."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.sim.fleet import SimConfig
from gpuslo.embedded import run_demo
from rules.config import example

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed (scripts/test.sh installs Debian's chromium)")
    return exe


@pytest.mark.integration
def test_report_renders_in_chromium(tmp_path: Path) -> None:
    res = run_demo(SimConfig(seed=4, hours=6, nodes=2), example(), tmp_path / "demo")
    report = res.report
    text = report.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained
    assert "<script" not in text
    profile = tmp_path / "chrome"
    shot = tmp_path / "report.png"
    r = subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
         "--window-size=1300,1600", f"--screenshot={shot}", report.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.stat().st_size > 50_000  # a page with charts, not a blank one
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == [], console
    dom = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", "--dump-dom", report.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    charts = re.findall(r'<svg class="chart".*?</svg>', dom, flags=re.S)
    assert len(charts) == 3 + len(example().slos)
    for c in charts:  # every chart has at least one drawn series
        points = re.findall(r'<polyline class="series"[^>]*points="([^"]+)"', c)
        assert points and all(len(p.split()) >= 2 for p in points), c[:200]
    assert "Allocation CUR" in dom and "Starvation incidents" in dom


@pytest.mark.parametrize(
    ("v", "top"), [(0.0, 1.0), (3.6, 4.0), (4.0, 5.0), (7.3, 8.0), (0.42, 0.5), (96.0, 200.0)]
)
def test_nice_axis_top(v: float, top: float) -> None:
    from dashboards.report import nice_top

    assert nice_top(v) == pytest.approx(top)

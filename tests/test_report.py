"""The HTML report, opened in headless Chromium: screenshot taken, no console errors, every
chart drawn."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.embedded import run_demo
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.config import example

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
    from gpuslo.dashboards.report import nice_top

    assert nice_top(v) == pytest.approx(top)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_report_trends_equal_the_engine_per_bucket(store: ChdbStore) -> None:
    """The report's CUR, idle and SLI charts: each bucket equals the engine over that bucket,
    with min_idle_s honoured and samples crossing bucket edges (interval 700 s vs 600 s buckets)."""
    from gpuslo.dashboards.report import sli_trends, trends
    from gpuslo.ingest.writer import write
    from gpuslo.rules.config import RulesConfig, Slo
    from gpuslo.rules.evaluate import cluster_totals, utilization
    from gpuslo.rules.sql import SLO_WINDOW_TOTALS
    from tests import helpers as h
    from tests.helpers import T0

    msgs: list[object] = []
    for k in range(12):  # GPU 0 idle for 2 samples (1400 s) then busy; GPU 1 idle 700 s at a time
        msgs.append(h.batch("n1", T0 + 700 * k, [h.gpu(0, 0.0 if k % 4 < 2 else 0.9, (("j", 1.0),)),
                                                  h.gpu(1, 0.0 if k % 2 else 0.5)], interval_s=700.0))  # fmt: skip
        msgs.append(h.latency(T0 + 600 * k + 60 * (k % 3), 10 + k, k))
    write(store, msgs)  # type: ignore[arg-type]
    frm, to, bucket = T0 + 300, T0 + 300 + 600 * 12, 600
    for min_idle in (0.0, 1000.0):
        cfg = RulesConfig(min_idle_s=min_idle)
        rows = {r["b"]: r for r in trends(store, cfg, frm, to, "", bucket)}
        assert sorted(rows) == list(range(12))
        for b, r in rows.items():
            lo, hi = frm + b * bucket, frm + (b + 1) * bucket
            (u,) = cluster_totals(utilization(store, lo, hi, 0.05, min_idle_s=min_idle)).values()
            for k in ("capacity_s", "allocated_s", "active_s", "idle_allocated_s", "idle_unallocated_s"):
                assert r[k] == pytest.approx(getattr(u, k), abs=1e-6), (min_idle, b, k)
        if min_idle:  # the 700 s idle runs of GPU 1 are too short: only GPU 0's 1400 s runs count
            assert sum(r["idle_unallocated_s"] for r in rows.values()) == 0.0
    slo = Slo(name="s", service="svc", threshold_ms=5.0)
    for r in sli_trends(store, slo, frm, to, "", bucket):
        lo = frm + r["b"] * bucket
        e = store.query(SLO_WINDOW_TOTALS, {"service": "svc", "cluster": "", "threshold": 5.0,
                                            "from": lo, "to": lo + bucket})[0]  # fmt: skip
        assert (r["n"], r["good"]) == (e["total"], e["good"]), r

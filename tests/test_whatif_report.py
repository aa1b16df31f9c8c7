"""The what-if section of the HTML report (dashboards/whatif_page.py) and the demo's what-if
(gpuslo/app/whatif.py demo_whatif, ``demo --json`` key ``whatif``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.embedded import DemoResult
from gpuslo.dashboards.whatif_page import WINDOW_S, section, window
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.config import RulesConfig
from tests.helpers import T0
from tests.test_whatif import _recorded_fleet, write

KEYS = (
    "policy",
    "cur_allocation",
    "idle_unallocated_gpu_hours",
    "wait_p50_s",
    "wait_p99_s",
    "starvation_incidents",
)


@pytest.mark.parametrize(
    ("frm", "to", "want"),
    [
        (0.0, 40 * 86400.0, (10 * 86400.0, 40 * 86400.0)),  # the last 30 days
        (0.0, WINDOW_S, (0.0, WINDOW_S)),  # exactly 30 days
        (5.0, 10.0, (5.0, 10.0)),  # shorter: all of it
    ],
)
def test_the_section_covers_the_last_30_days_capped_by_the_range(frm: float, to: float, want: Any) -> None:
    assert window(frm, to) == want


def _entry(name: str) -> dict[str, Any]:
    return {"policy": name, "cur_allocation": 0.5, "idle_unallocated_gpu_hours": 1.25, "wait_p50_s": 60.0,
            "wait_p99_s": None, "starvation_incidents": 3,
            "starvation_by_cause": {"capacity": 1, "fragmentation": 0, "policy": 2}}  # fmt: skip


def test_every_name_in_the_section_is_escaped() -> None:
    d = {
        "from": T0,
        "to": T0 + 3600,
        "recorded": _entry("recorded"),
        "policies": [_entry("<script>x</script>&")],
    }
    page = section(None, RulesConfig(), T0, T0 + 3600, "", d)  # type: ignore[arg-type]  # (given: no store read)
    assert "<script>" not in page
    assert "&lt;script&gt;x&lt;/script&gt;&amp;" in page
    assert "<td>50.0 %</td><td>1.2</td><td>1.0</td><td>–</td><td>3 (1 / 0 / 2)</td>" in page


@pytest.mark.integration  # chDB
def test_the_report_section_on_a_hand_computed_fleet(store: ChdbStore) -> None:
    """tests/test_whatif.py's fleet recorded under fifo+gang: two nodes of 8 GPUs for 1800 s
    (8 GPU-h); R1 8 GPUs × 600 s, R2 16 × 600 s, R3 4 × 300 s: 15,600 GPU-s = 4.33 GPU-h, CUR
    54.2 %, 3.7 GPU-h unallocated whatever the policy (all of it runs in the window). Recorded
    (and fifo+gang): waits 0, 540, 1080 s (p50 9.0 min, p99 18.0 min); R3 still waits at
    T0 + 720 (threshold 600 s) while R2 holds all 16 GPUs: one incident, capacity. Back-fill:
    R3 ends at T0 + 420, before R2's reservation at T0 + 600: it starts at once on n2; waits 0,
    0, 540 s (p50 0.0, p99 9.0 min), no incident; fair share serves with back-fill: the same."""
    cfg = RulesConfig()
    assert cfg.starvation.threshold_for("q") == 600.0
    write(store, _recorded_fleet())
    page = section(store, cfg, T0, T0 + 1800)
    fifo = "<td>54.2 %</td><td>3.7</td><td>9.0</td><td>18.0</td><td>1 (1 / 0 / 0)</td>"
    bf = "<td>54.2 %</td><td>3.7</td><td>0.0</td><td>9.0</td><td>0 (0 / 0 / 0)</td>"
    for name, want in (("recorded", fifo), ("fifo+gang:pack", fifo), ("backfill+gang:pack", bf),
                       ("fairshare+gang:pack", bf)):  # fmt: skip
        assert f"<tr><td>{name}</td>{want}</tr>" in page, page


@pytest.mark.integration  # chDB
def test_a_window_of_two_clusters_without_one_named_says_why(store: ChdbStore) -> None:
    write(store, [*_recorded_fleet("c1"), *_recorded_fleet("c2")])
    page = section(store, RulesConfig(), T0, T0 + 1800)
    assert page.startswith("<h2>What if</h2><p>Not computed:") and "--cluster" in page
    assert "<tr><td>recorded" in section(store, RulesConfig(), T0, T0 + 1800, "c2")


def test_the_demo_json_and_report_carry_the_whatif(short_demo: tuple[SimConfig, DemoResult, Path]) -> None:
    sim, res, out = short_demo
    d = res.to_json()["whatif"]
    assert d == res.whatif and d["from"] == sim.start_ts and d["to"] == sim.end_ts
    names = [e["policy"] for e in d["policies"]]
    assert names == [
        "first-fit+gang:first",
        "backfill+gang:first",
        "fairshare+gang:first",
        "first-fit+gang:first +8 GPUs",
    ]
    for e in [d["recorded"], *d["policies"]]:
        assert all(k in e for k in KEYS)
        assert 0 <= e["cur_allocation"] <= 1
    rec, more = d["recorded"], d["policies"][-1]
    # 8 more GPUs for the whole window: 8 × hours more capacity, on paper
    assert more["capacity_gpu_hours"] == pytest.approx(rec["capacity_gpu_hours"] + 8 * sim.hours, abs=1e-9)
    assert more["added"] == {"gpus": 8, "gpus_per_node": sim.gpus_per_node, "gpu_model": ""}
    # the same requests, the same GPU-hours if all ran: the added GPUs cannot lower the
    # allocated GPU-hours of the same policy below what it ran without them minus what the
    # window cuts off; they do lower its CUR (a bigger denominator) or keep it
    own = d["policies"][0]
    assert more["cur_allocation"] <= own["cur_allocation"] + 1e-9 or more["started"] > own["started"]
    html = (out / "report.html").read_text()
    assert "What if: the recorded queue replayed" in html
    for n in names:
        assert f"<tr><td>{n}</td>" in html

"""The dashboards in a real Grafana (the compose file's image, with the ClickHouse plugin and the
repository's provisioning) over the compose file's ClickHouse server, where a Docker engine
answers; elsewhere skipped with the reason.

The demo's store (the fast tier's ``short_demo``: every panel returns rows on it, see
tests/test_dashboards.py) is copied into the server. Then: every dashboard of
dashboards/generated loads through the HTTP API as provisioned, with its panels; every panel's
query runs through ``/api/ds/query`` (Grafana's frontend steps, ``$__conditionalAll`` and the
variables set to All, done by tests/grafana.py; the plugin's own backend expands its macros) and
returns rows; and the panels of the four numbers (CUR, idle time, starvation incidents, SLO
burn) show what the rules engine computes from the same rows (the expectations of
tests/test_dashboard_numbers.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.embedded import DemoResult
from gpuslo.dashboards import views
from gpuslo.dashboards.clickhouse import DATASOURCE_UID
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.config import RulesConfig, example
from gpuslo.rules.evaluate import slo_steps, starvation
from tests.grafana import ALL, DASHBOARD_VARIABLES, INTERVAL_S, conditional_all, variables
from tests.servers.clickhouse import ClickHouseContainer, copy_store
from tests.servers.grafana_server import GrafanaContainer
from tests.test_dashboard_numbers import fleet_row

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "dashboards/generated"


def near(x: float) -> Any:
    return pytest.approx(x, rel=1e-9, abs=1e-9)  # as tests/test_dashboard_numbers.py's APPROX


@dataclass(frozen=True)
class Stack:
    grafana: GrafanaContainer
    store: ChdbStore  # the rows' source: the engine's expectations are computed on it
    sim: SimConfig
    cfg: RulesConfig


@pytest.fixture(scope="module")
def stack(
    container_backend: object,
    short_demo: tuple[SimConfig, DemoResult, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    sim, _res, out = short_demo
    d = tmp_path_factory.mktemp("grafana-stack")
    ch = ClickHouseContainer(d / "ch")
    g = GrafanaContainer(d / "grafana", clickhouse_port=0)
    src = ChdbStore(out / "store")
    try:
        ch.start()
        copied = copy_store(src, ch, "gpuslo")  # the datasource's database (provisioning)
        assert copied.get("gpu_samples"), copied
        g.clickhouse_port = ch.port
        g.start()
        yield Stack(g, src, sim, example())
    finally:
        g.stop()
        ch.close()
        src.close()


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])  # collapsed rows hold theirs


def frontend(sql: str, **values: str) -> str:
    """What Grafana's frontend and the plugin's frontend do before the query leaves the browser."""
    current = {v: values.get(v, ALL) for v in DASHBOARD_VARIABLES}
    return variables(conditional_all(sql, current), current)


def ds_query(stack: Stack, target: dict[str, Any], **values: str) -> dict[str, Any]:
    """One target through /api/ds/query over the demo's range; the result of refId A."""
    q = {**target, "refId": "A", "rawSql": frontend(target["rawSql"], **values),
         "intervalMs": INTERVAL_S * 1000, "maxDataPoints": 100_000}  # fmt: skip
    body = {
        "queries": [q],
        "from": str(int(stack.sim.start_ts * 1000)),
        "to": str(int(stack.sim.end_ts * 1000)),
    }
    status, res = stack.grafana.api("POST", "/api/ds/query", body)
    assert isinstance(res, dict), (status, res)
    out: dict[str, Any] = res.get("results", {}).get("A", {"error": f"HTTP {status}: {res}"})
    return out


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The frames of a result as rows (column name -> value; times in epoch milliseconds)."""
    out: list[dict[str, Any]] = []
    for frame in result.get("frames", []):
        names = [f["name"] for f in frame["schema"]["fields"]]
        cols = frame["data"]["values"]
        out += [dict(zip(names, vals, strict=True)) for vals in zip(*cols, strict=True)]
    return out


def provisioned(stack: Stack) -> dict[str, dict[str, Any]]:
    """uid -> the dashboard as Grafana serves it."""
    out = {}
    for path in sorted(GENERATED.glob("*.json")):
        uid = json.loads(path.read_text())["uid"]
        status, res = stack.grafana.api("GET", f"/api/dashboards/uid/{uid}")
        assert status == 200, (path.name, status, res)
        out[uid] = res
    return out


def test_every_dashboard_loads_as_provisioned(stack: Stack) -> None:
    status, health = stack.grafana.api("GET", f"/api/datasources/uid/{DATASOURCE_UID}/health")
    assert (status, health.get("status")) == (200, "OK"), health
    status, found = stack.grafana.api("GET", "/api/search?type=dash-db")
    assert status == 200
    files = {json.loads(p.read_text())["uid"]: json.loads(p.read_text()) for p in GENERATED.glob("*.json")}
    assert {d["uid"] for d in found} == set(files)
    for uid, res in provisioned(stack).items():
        assert res["meta"]["provisioned"] is True, uid
        assert [p.get("title") for p in panels(res["dashboard"])] == [
            p.get("title") for p in panels(files[uid])
        ]
    logs = stack.grafana.container.logs(10**6) if stack.grafana.container else ""
    errors = [line for line in logs.splitlines() if "level=error" in line and "provisioning" in line]
    assert not errors, errors[:5]


def test_every_panel_query_runs_through_grafana_and_returns_rows(stack: Stack) -> None:
    failures, ran = [], 0
    for uid, res in provisioned(stack).items():
        for p in panels(res["dashboard"]):
            for t in p.get("targets", []):
                if "rawSql" not in t:
                    continue
                ran += 1
                r = ds_query(stack, t)
                if r.get("error") or r.get("status", 200) != 200:
                    failures.append(f"{uid}: {p['title']}: {r.get('error')}")
                elif not rows(r):
                    failures.append(f"{uid}: {p['title']}: no rows")
    assert ran > 0
    assert not failures, "\n".join(failures)


def panel_target(stack: Stack, title: str) -> dict[str, Any]:
    for res in provisioned(stack).values():
        for p in panels(res["dashboard"]):
            if p.get("title") == title:
                target: dict[str, Any] = p["targets"][0]
                return target
    raise AssertionError(f"no panel {title!r}")


def test_the_four_numbers_through_grafana_equal_the_engine(stack: Stack) -> None:
    store, sim, cfg = stack.store, stack.sim, stack.cfg
    frm, to = sim.start_ts, sim.end_ts
    e = fleet_row(store, frm, to, cfg, "")
    assert e["capacity_s"] > 0

    def one(title: str, col: str) -> float:
        (row,) = rows(ds_query(stack, panel_target(stack, title)))
        return float(row[col])

    assert one("Allocation CUR", "cur") == near(e["allocated_s"] / e["capacity_s"])
    assert one("Active CUR", "cur") == near(e["active_s"] / e["capacity_s"])
    assert one("Idle GPU-hours, allocated", "gpu_hours") == near(e["idle_allocated_s"] / 3600)
    assert one("Idle GPU-hours, unallocated", "gpu_hours") == near(e["idle_unallocated_s"] / 3600)
    assert one("Starvation incidents", "incidents") == len(starvation(store, frm, to, cfg, ""))
    # SLO burn per alert window at every evaluation step
    slo = cfg.slos[0]
    burn = rows(ds_query(stack, panel_target(stack, f"{slo.name}: burn rate per alert window")))
    steps = {float(r["t"]): r for r in slo_steps(store, slo, frm, to, cfg.eval_step_s)}
    lengths = sorted({w.long_s for w in slo.windows} | {w.short_s for w in slo.windows})
    assert burn
    for r in burn:
        step = steps[float(r["time"]) / 1000]
        for w in lengths:
            n, g = float(step[f"total_{w}"] or 0), float(step[f"good_{w}"] or 0)
            assert r[f"burn_{views._label(w)}"] == near((1 - g / n) / (1 - slo.objective))

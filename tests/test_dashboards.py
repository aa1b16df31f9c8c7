"""Every panel query runs on chDB against demo data after the ClickHouse plugin's macros
are expanded the way the plugin expands them (grafana/clickhouse-datasource pkg/macros)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.embedded import DemoResult
from gpuslo.dashboards.generate import VIEWS, render
from gpuslo.dashboards.overview import panel_queries
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.config import example
from tests.grafana import expand


@pytest.fixture(scope="module")
def demo_store(short_demo: tuple[SimConfig, DemoResult, Path]) -> Iterator[tuple[ChdbStore, SimConfig]]:
    cfg, _res, out = short_demo  # with a drain and an XID
    s = ChdbStore(out / "store")
    try:
        yield s, cfg
    finally:
        s.close()


QUERIES = panel_queries(example())
ALL: dict[str, tuple[str, int]] = {f"fleet-overview: {t}": q for t, q in QUERIES.items()}
NOT_PER_CLUSTER: set[str] = set()
for _name, (_title, _uid, _specs, _vars) in VIEWS.items():
    for _s in _specs(example()):
        ALL[f"{_uid}: {_s.title}"] = (_s.sql, _s.format)
        if not _s.per_cluster:
            NOT_PER_CLUSTER.add(f"{_uid}: {_s.title}")


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("title", list(ALL))
def test_every_panel_query_runs_and_returns_data(title: str, demo_store: tuple[ChdbStore, SimConfig]) -> None:
    store, cfg = demo_store
    sql, fmt = ALL[title]
    rows = store.query(expand(sql, cfg.start_ts, cfg.end_ts))
    assert rows, f"panel {title!r} is empty on the demo data"
    if fmt == 0:  # time series: a time column and at least one numeric series
        assert "time" in rows[0]
        assert any(isinstance(v, (int, float)) for k, v in rows[0].items() if k != "time")
    # the cluster variable filters: an unknown cluster yields nothing (or one empty aggregate)
    other = store.query(expand(sql, cfg.start_ts, cfg.end_ts, cluster="no-such-cluster"))
    if title not in NOT_PER_CLUSTER:
        assert all(all(v in (None, 0, 0.0) for v in r.values()) for r in other) or not other
    if "${queue}" in sql:  # the partition / namespace variable filters too
        assert store.query(expand(sql, cfg.start_ts, cfg.end_ts, queue=cfg.pool))
        other = store.query(expand(sql, cfg.start_ts, cfg.end_ts, queue="no-such-queue"))
        assert all(all(v in (None, 0, 0.0) for v in r.values()) for r in other) or not other


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_stat_panels_agree_with_the_rules_engine(demo_store: tuple[ChdbStore, SimConfig]) -> None:
    from gpuslo.rules.evaluate import summary

    store, cfg = demo_store
    s = summary(store, example(), cfg.start_ts, cfg.end_ts)
    cur = store.query(expand(QUERIES["Allocation CUR"][0], cfg.start_ts, cfg.end_ts))[0]["cur"]
    assert cur == pytest.approx(s.cur_allocation, rel=1e-6)
    n = store.query(expand(QUERIES["Starvation incidents"][0], cfg.start_ts, cfg.end_ts))[0]["incidents"]
    assert n == len(s.starvation_incidents)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_idle_panels_honour_the_minimum_idle_duration(demo_store: tuple[ChdbStore, SimConfig]) -> None:
    from gpuslo.rules.evaluate import summary

    store, cfg = demo_store
    rules = example().model_copy(update={"min_idle_s": 600.0})
    q = panel_queries(rules)
    s = summary(store, rules, cfg.start_ts, cfg.end_ts)
    for title, want in (("Idle GPU-hours, allocated", s.idle_allocated_gpu_hours),
                        ("Idle GPU-hours, unallocated", s.idle_unallocated_gpu_hours)):  # fmt: skip
        v = store.query(expand(q[title][0], cfg.start_ts, cfg.end_ts))[0]["gpu_hours"]
        assert v == pytest.approx(want, abs=1e-3), title
    plain = summary(store, example(), cfg.start_ts, cfg.end_ts)
    assert s.idle_allocated_gpu_hours < plain.idle_allocated_gpu_hours  # short idle gaps no longer count
    assert store.query(expand(q["Idle GPU-hours over time"][0], cfg.start_ts, cfg.end_ts))
    from gpuslo.rules.evaluate import idle_by_owner

    top = store.query(expand(q["Top idle jobs and pods"][0], cfg.start_ts, cfg.end_ts))
    eng = idle_by_owner(store, cfg.start_ts, cfg.end_ts, rules.idle_threshold, limit=20, min_idle_s=600.0)
    assert [(r["id"], r["idle_s"]) for r in top] == [
        (r["id"], pytest.approx(r["idle_s"], rel=1e-9)) for r in eng
    ]
    _title, uid, specs, _vars = VIEWS["workloads.json"]
    for spec in specs(rules):  # the idle columns of the workloads dashboard run with it too
        assert store.query(expand(spec.sql, cfg.start_ts, cfg.end_ts)), f"{uid}: {spec.title}"


def test_dashboard_json_uses_the_clickhouse_query_model() -> None:
    rendered = render(example())
    uids = set()
    n_targets = 0
    for text in rendered.values():
        d: dict[str, Any] = json.loads(text)
        assert text == json.dumps(d, sort_keys=True, indent=2) + "\n"  # sorted keys, stable
        uids.add(d["uid"])
        targets = [t for p in d["panels"] for t in p["targets"]]
        n_targets += len(targets)
        for t in targets:
            assert t["datasource"] == {"type": "grafana-clickhouse-datasource", "uid": "gpuslo-clickhouse"}
            assert t["editorType"] == "sql" and t["format"] in (0, 1)
            assert t["queryType"] == ("timeseries" if t["format"] == 0 else "table")
            assert t["rawSql"] in {q for q, _ in ALL.values()}
        assert d["templating"]["list"][0]["name"] == "cluster"
        assert {link["url"] for link in d["links"]} >= {"/d/gpuslo-fleet-overview", "/d/gpuslo-slo"}
    assert n_targets == len(ALL)  # every panel is tested, every tested query is on a panel
    assert uids == {
        "gpuslo-fleet-overview",
        "gpuslo-node-gpu",
        "gpuslo-workloads",
        "gpuslo-scheduler",
        "gpuslo-slo",
        "gpuslo-chargeback",
    }


def test_generate_writes_files(tmp_path: Path) -> None:
    from gpuslo.dashboards.generate import write

    paths = write(example(), tmp_path)
    assert [p.name for p in paths] == [
        "fleet-overview.json",
        "node-gpu.json",
        "workloads.json",
        "scheduler.json",
        "slo.json",
        "chargeback.json",
    ]
    assert json.loads(paths[0].read_text())["title"] == "gpuslo / Fleet overview"

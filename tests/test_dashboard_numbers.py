"""Every panel that shows one of the four numbers against the rules engine, for the same range
and the same filters, on a fleet whose names are hostile (a cluster named like an injection,
a partition ending in a backslash, an SLO service with a quote) next to a second cluster that
must never leak into it. Panels are expanded the way Grafana and the ClickHouse plugin expand
them (tests/grafana.py); the engine is rules/evaluate.py over the raw rows.

Also: no variable value can change a panel's SQL beyond the value itself (hostile values from
tests/hostile.py, the unsafe formats shown injectable for contrast)."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.embedded import run_demo
from gpuslo.dashboards import views
from gpuslo.dashboards.clickhouse import var
from gpuslo.dashboards.generate import VIEWS, render
from gpuslo.dashboards.overview import panel_queries
from gpuslo.ingest.sqltext import quote
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup, sql
from gpuslo.rules.config import RulesConfig, Slo, example
from gpuslo.rules.evaluate import (
    cluster_totals,
    fair_share,
    idle_by_owner,
    pending_age,
    slo_status,
    slo_steps,
    starvation,
    utilization,
)
from tests import helpers as h
from tests.grafana import INTERVAL_S, expand, percentencode, variables
from tests.hostile import SEQUENCES, corpus

CLUSTER = "o'brien\\' = '') OR 1=1 --"
QUEUE = "gpu\\"
SERVICE = "bob's-llm\\"
OTHER = "neighbour"
HOURS = 4
APPROX = {"rel": 1e-9, "abs": 1e-9}


def rules_config() -> RulesConfig:
    ex = example()
    slo = ex.slos[0].model_copy(update={"name": "bob's \\ slo", "service": SERVICE})
    st = ex.starvation.model_copy(update={"queue_threshold_s": {QUEUE: 300.0, "o'q\\": 900.0}})
    return ex.model_copy(update={"slos": (slo,), "starvation": st})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChdbStore, SimConfig, RulesConfig]]:
    out: Path = tmp_path_factory.mktemp("hostile")
    sim = h.short_sim(seed=5, hours=HOURS, nodes=2, cluster=CLUSTER, pool=QUEUE, service=SERVICE)
    cfg = rules_config()
    run_demo(sim, cfg, out)
    s = ChdbStore(out / "store")
    # the neighbour: one node of 2 GPUs sampled every 60 s for 3 h (GPU 0 held by a job of the
    # same queue name), the same service's requests, and a request starving in the same queue
    t0 = sim.start_ts
    msgs: list[object] = []
    for k in range(180):
        t = t0 + 60 * k
        msgs.append(h.batch("nb-1", t, [h.gpu(0, 0.9, (("nb-job", 1.0),), queue=QUEUE), h.gpu(1, 0.0)], 60.0,
                            pool=QUEUE, cluster=OTHER))  # fmt: skip
        msgs.append(h.latency(t + 60, 50, 10, service=SERVICE).model_copy(update={"cluster": OTHER}))
    msgs += [h.sched("submit", "nb-req", t0 + 600, gpn=8.0, queue=QUEUE, cluster=OTHER)]
    write(s, msgs)  # type: ignore[arg-type]
    rollup.refresh(s)  # as `rules run` does after new rows
    try:
        yield s, sim, cfg
    finally:
        s.close()


def run(store: ChdbStore, text: str, sim: SimConfig, **values: str) -> list[dict[str, Any]]:
    return store.query(expand(text, sim.start_ts, sim.end_ts, **values))


def tsec(v: Any) -> float:
    """A panel's time column in epoch seconds (chDB gives DateTime as seconds or as datetime)."""
    return float(v.timestamp()) if hasattr(v, "timestamp") else float(v)


def engine_cluster(values: dict[str, str]) -> str:
    return values.get("cluster", "")


FILTERS = [{"cluster": CLUSTER}, {"cluster": OTHER}, {}]  # {}: "All"


def fleet_row(store: ChdbStore, frm: float, to: float, cfg: RulesConfig, cluster: str) -> dict[str, float]:
    rows = cluster_totals(
        utilization(store, frm, to, cfg.idle_threshold, cluster, min_idle_s=cfg.min_idle_s)
    ).values()
    keys = ("capacity_s", "allocated_s", "active_s", "idle_allocated_s", "idle_unallocated_s")
    return {k: sum(getattr(u, k) for u in rows) for k in keys}


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    ("values", "min_idle_s"),
    [  # the fast tier: the hostile cluster with and without a minimum idle duration, each other
        # filter once; every combination in the integration tier
        pytest.param(FILTERS[0], 0.0, id="hostile-cluster-0.0"),
        pytest.param(FILTERS[0], 600.0, id="hostile-cluster-600.0"),
        pytest.param(FILTERS[1], 0.0, id="neighbour-0.0"),
        pytest.param(FILTERS[2], 600.0, id="all-600.0"),
        pytest.param(FILTERS[1], 600.0, id="neighbour-600.0", marks=pytest.mark.integration),
        pytest.param(FILTERS[2], 0.0, id="all-0.0", marks=pytest.mark.integration),
    ],
)
def test_overview_numbers_equal_the_engine(fleet: tuple[ChdbStore, SimConfig, RulesConfig], values: dict[str, str], min_idle_s: float) -> None:  # fmt: skip
    store, sim, cfg = fleet
    cfg = cfg.model_copy(update={"min_idle_s": min_idle_s})
    frm, to, c = sim.start_ts, sim.end_ts, engine_cluster(values)
    q = panel_queries(cfg)
    e = fleet_row(store, frm, to, cfg, c)
    assert e["capacity_s"] > 0
    assert run(store, q["Allocation CUR"][0], sim, **values)[0]["cur"] == pytest.approx(
        e["allocated_s"] / e["capacity_s"], **APPROX
    )
    assert run(store, q["Active CUR"][0], sim, **values)[0]["cur"] == pytest.approx(
        e["active_s"] / e["capacity_s"], **APPROX
    )
    assert run(store, q["Idle GPU-hours, allocated"][0], sim, **values)[0]["gpu_hours"] == pytest.approx(
        e["idle_allocated_s"] / 3600, **APPROX
    )
    assert run(store, q["Idle GPU-hours, unallocated"][0], sim, **values)[0]["gpu_hours"] == pytest.approx(
        e["idle_unallocated_s"] / 3600, **APPROX)  # fmt: skip
    incidents = starvation(store, frm, to, cfg, c)
    assert run(store, q["Starvation incidents"][0], sim, **values)[0]["incidents"] == len(incidents)
    by_cause = {r["cause"]: r for r in run(store, q["Starvation incidents by cause"][0], sim, **values)}
    expect = Counter(i["cause"] for i in incidents)
    assert {k: r["incidents"] for k, r in by_cause.items()} == dict(expect)
    for cause, r in by_cause.items():
        waits = [
            (i["closed"] if i["closed"] is not None else to) - i["submitted"]
            for i in incidents
            if i["cause"] == cause
        ]
        assert r["mean_wait_min"] == pytest.approx(sum(waits) / len(waits) / 60, abs=0.051)
    top = run(store, q["Top idle jobs and pods"][0], sim, **values)
    eng = idle_by_owner(store, frm, to, cfg.idle_threshold, c, limit=20, min_idle_s=cfg.min_idle_s)
    assert [(r["id"], r["allocated_s"], r["idle_s"]) for r in top] == [
        (r["id"], pytest.approx(r["allocated_s"], **APPROX), pytest.approx(r["idle_s"], **APPROX))
        for r in eng
    ]


def bucket_rows(
    store: ChdbStore, sim: SimConfig, cfg: RulesConfig, cluster: str
) -> dict[float, dict[str, float]]:
    """The engine over each bucket [b, b + interval) of the range (clipped to it)."""
    out = {}
    b0 = sim.start_ts // INTERVAL_S * INTERVAL_S
    b = b0
    while b < sim.end_ts:
        out[b] = fleet_row(store, max(b, sim.start_ts), min(b + INTERVAL_S, sim.end_ts), cfg, cluster)
        b += INTERVAL_S
    return out


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    ("values", "min_idle_s"),
    [  # the fast tier: each filter once, each minimum idle duration once; all four in the integration tier
        pytest.param(FILTERS[0], 600.0, id="hostile-cluster-600.0"),
        pytest.param(FILTERS[2], 0.0, id="all-0.0"),
        pytest.param(FILTERS[0], 0.0, id="hostile-cluster-0.0", marks=pytest.mark.integration),
        pytest.param(FILTERS[2], 600.0, id="all-600.0", marks=pytest.mark.integration),
    ],
)
def test_time_series_equal_the_engine_per_bucket(fleet: tuple[ChdbStore, SimConfig, RulesConfig], values: dict[str, str], min_idle_s: float) -> None:  # fmt: skip
    store, sim, cfg = fleet
    cfg = cfg.model_copy(update={"min_idle_s": min_idle_s})
    expect = {
        b: e for b, e in bucket_rows(store, sim, cfg, engine_cluster(values)).items() if e["capacity_s"] > 0
    }
    q = panel_queries(cfg)
    cur = {tsec(r["time"]): r for r in run(store, q["CUR over time"][0], sim, **values)}
    idle = {tsec(r["time"]): r for r in run(store, q["Idle GPU-hours over time"][0], sim, **values)}
    _t, _u, specs, _v = VIEWS["workloads.json"]
    busy_sql = next(s.sql for s in specs(cfg) if s.title == "GPUs allocated vs busy")
    busy = {tsec(r["time"]): r for r in run(store, busy_sql, sim, **values)}
    assert set(cur) == set(idle) == set(busy) == set(expect)
    for b, e in expect.items():
        assert cur[b]["allocation"] == pytest.approx(e["allocated_s"] / e["capacity_s"], **APPROX), b
        assert cur[b]["active"] == pytest.approx(e["active_s"] / e["capacity_s"], **APPROX), b
        assert idle[b]["allocated_idle"] == pytest.approx(e["idle_allocated_s"] / 3600, **APPROX), b
        assert idle[b]["unallocated"] == pytest.approx(e["idle_unallocated_s"] / 3600, **APPROX), b
        assert busy[b]["allocated_gpus"] == pytest.approx(e["allocated_s"] / INTERVAL_S, **APPROX), b
        assert busy[b]["busy_gpus"] == pytest.approx(e["active_s"] / INTERVAL_S, **APPROX), b


def spec_sql(name: str, title: str, cfg: RulesConfig) -> str:
    _t, _u, specs, _v = VIEWS[name]
    return next(s.sql for s in specs(cfg) if s.title == title)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("values", [
    pytest.param(FILTERS[0], id="hostile-cluster"),
    pytest.param(FILTERS[1], id="neighbour", marks=pytest.mark.integration),
    pytest.param(FILTERS[2], id="all", marks=pytest.mark.integration),
    pytest.param({"cluster": CLUSTER, "queue": QUEUE}, id="cluster-and-queue"),
    pytest.param({"queue": QUEUE}, id="queue"),
])  # fmt: skip
def test_workloads_and_scheduler_equal_the_engine(fleet: tuple[ChdbStore, SimConfig, RulesConfig], values: dict[str, str]) -> None:  # fmt: skip
    store, sim, cfg = fleet
    cfg = cfg.model_copy(update={"min_idle_s": 600.0})  # idle only in runs of 10 min, as the engine counts it
    frm, to, c = sim.start_ts, sim.end_ts, engine_cluster(values)
    owners = [o for o in idle_by_owner(store, frm, to, cfg.idle_threshold, c, limit=10**6, min_idle_s=cfg.min_idle_s)
              if values.get("queue") in (None, o["queue"])]  # fmt: skip
    assert owners
    for col, title in (("user", "Allocated-idle GPU-hours by user"),
                       ("account", "Allocated-idle GPU-hours by account / namespace")):  # fmt: skip
        expect: dict[str, float] = defaultdict(float)
        for o in owners:
            expect[o[col]] += o["idle_s"]
        got = {
            r[col]: r["idle_gpu_h"] for r in run(store, spec_sql("workloads.json", title, cfg), sim, **values)
        }
        assert got == {k: pytest.approx(v / 3600, abs=0.0051) for k, v in expect.items()}, title
    eff = {
        r["id"]: r
        for r in run(store, spec_sql("workloads.json", "Jobs and pods: efficiency", cfg), sim, **values)
    }
    assert len(eff) == min(100, len(owners))
    for o in owners:
        if o["id"] in eff:
            assert eff[o["id"]]["allocated_gpu_h"] == pytest.approx(o["allocated_s"] / 3600, abs=0.0051)
            assert eff[o["id"]]["idle_share"] == pytest.approx(o["idle_s"] / o["allocated_s"], abs=0.00051)
    incidents = [i for i in starvation(store, frm, to, cfg, c) if values.get("queue") in (None, i["queue"])]
    series = Counter(
        (tsec(r["time"]), r["cause"])
        for r in run(
            store, spec_sql("scheduler.json", "Starvation incidents opened, by cause", cfg), sim, **values
        )
        for _ in range(r["incidents"])
    )
    assert series == Counter((i["opened"] // INTERVAL_S * INTERVAL_S, i["cause"]) for i in incidents)
    pending = run(
        store, spec_sql("scheduler.json", "Pending GPU requests now, and their age", cfg), sim, **values
    )
    expect_p = [r for r in pending_age(store, to, c) if values.get("queue") in (None, r["queue"])]
    assert pending == [{**r, "max_age_s": pytest.approx(r["max_age_s"], **APPROX)} for r in expect_p]
    if "queue" not in values:
        fair = run(store, spec_sql("scheduler.json", "Fair share: allocated GPU-hours vs GPUs requested, per account", cfg),
                   sim, **values)  # fmt: skip
        assert [(r["account"], r["allocated_gpu_h"], r["gpus_requested"]) for r in fair] == [
            (r["account"], pytest.approx(r["allocated_s"] / 3600, abs=0.0051), r["gpus_requested"])
            for r in fair_share(store, frm, to, c)
        ]


def window_totals(store: ChdbStore, slo: Slo, frm: float, to: float) -> tuple[int, int]:
    r = store.query(sql.SLO_WINDOW_TOTALS, {"service": slo.service, "cluster": slo.cluster,
                                            "threshold": float(slo.threshold_ms), "from": frm, "to": to})[0]  # fmt: skip
    return int(r["good"] or 0), int(r["total"] or 0)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("values", FILTERS, ids=["hostile-cluster", "neighbour", "all"])
def test_slo_panels_equal_the_engine(
    fleet: tuple[ChdbStore, SimConfig, RulesConfig], values: dict[str, str]
) -> None:
    store, sim, cfg = fleet
    frm, to = sim.start_ts, sim.end_ts
    slo = cfg.slos[0].model_copy(update={"cluster": engine_cluster(values)})
    # SLI and error ratio per bucket (t - interval, t], time = t
    sli = {
        tsec(r["time"]): r["sli"]
        for r in run(store, spec_sql("slo.json", f"{slo.name}: SLI vs objective", cfg), sim, **values)
    }
    err = {tsec(r["time"]): r["error_ratio"]
           for r in run(store, panel_queries(cfg)[f"SLO {slo.name}: error ratio vs budget"][0], sim, **values)}  # fmt: skip
    assert sli and set(sli) == set(err)
    for t, v in sli.items():
        g, n = window_totals(store, slo, max(frm, t - INTERVAL_S), t)
        assert v == pytest.approx(g / n, **APPROX), t
        assert err[t] == pytest.approx(1 - g / n, **APPROX), t
    # burn per alert window at every evaluation step
    burn = run(store, spec_sql("slo.json", f"{slo.name}: burn rate per alert window", cfg), sim, **values)
    burn_is_the_engines(store, burn, slo, frm, to, cfg.eval_step_s)
    # error budget left over the SLO period ending at the range's end
    left = run(
        store, spec_sql("slo.json", f"{slo.name}: error budget left ({slo.period_d} d)", cfg), sim, **values
    )
    st = slo_status(store, slo, frm, to, cfg.eval_step_s)
    assert left[0]["budget_left"] == pytest.approx(st.budget_remaining, **APPROX)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_panels_of_rules_run_results_equal_the_engine(
    fleet: tuple[ChdbStore, SimConfig, RulesConfig],
) -> None:
    from gpuslo.rules.evaluate import summary

    store, sim, cfg = fleet
    cur = run(
        store,
        spec_sql("workloads.json", "Fleet CUR per hour, as `rules run` evaluated it (rule_results)", cfg),
        sim,
    )
    slo = cfg.slos[0]
    res = {tsec(r["time"]): r for r in run(store, spec_sql(
        "slo.json", f"{slo.name}: budget left and burn, as `rules run` evaluated it (rule_results)", cfg), sim)}  # fmt: skip
    minutes = {tsec(r["time"]): r for r in run(store, spec_sql(
        "slo.json", f"{slo.name}: minutes firing, and held back by the traffic guard (min_requests {slo.min_requests}), "
        "as `rules run` evaluated them (rule_results)", cfg), sim)}  # fmt: skip
    assert len(cur) == HOURS
    # the demo wrote them before the neighbour's rows existed: the hostile cluster alone then
    alone = cfg.model_copy(update={"slos": (slo.model_copy(update={"cluster": CLUSTER}),)})
    for r in cur:
        t = tsec(r["time"])
        s = summary(store, alone, t - 3600, t, cluster=CLUSTER)
        assert (r["allocation"], r["active"]) == (pytest.approx(s.cur_allocation, abs=1e-6),
                                                  pytest.approx(s.cur_active, abs=1e-6))  # fmt: skip
        assert res[t]["burn"] == pytest.approx(s.slos[0].burn, **APPROX)
        assert res[t]["budget_left"] == pytest.approx(s.slos[0].budget_remaining, **APPROX)
        for sev, mins in s.slo_minutes[slo.name].items():
            assert minutes[t][f"{sev}_firing"] == mins.firing_minutes, (t, sev)
            assert minutes[t][f"{sev}_held_back"] == mins.held_back_minutes, (t, sev)
    # alerts firing now: what the engine found still firing at the end of the demo's range
    whole = summary(store, alone, sim.start_ts, sim.end_ts, cluster=CLUSTER)
    firing = run(store, spec_sql("slo.json", f"{slo.name}: alerts firing now", cfg), sim)
    # (started_at is when the alert engine first saw it: the demo's end, not the burn's start)
    assert sorted((r["severity"], r["window"]) for r in firing) == sorted(
        (a.severity, f"{a.long_window}/{a.short_window}") for a in whole.slo_alerts if a.ended is None
    )
    assert firing


# ---------------------------------------------------------------------------- hostile variable values
VARIABLE_NAMES = ("cluster", "node", "job", "queue")


def all_panel_sql(cfg: RulesConfig) -> dict[str, str]:
    out = {f"fleet-overview: {t}": q for t, (q, _f) in panel_queries(cfg).items()}
    for _name, (_title, uid, specs, _vars) in VIEWS.items():
        out.update({f"{uid}: {s.title}": s.sql for s in specs(cfg)})
    return out


def test_variables_appear_only_in_the_safe_forms() -> None:
    """Every reference to a dashboard variable in every rendered panel is the percent-encoded
    value inside decodeURLComponent('...') as the condition of $__conditionalAll, with the plain
    reference it reads "All" from, and names a variable the dashboard defines."""
    safe = re.compile(
        r"\$__conditionalAll\(([\w.]+) = decodeURLComponent\('\$\{(\w+):percentencode\}'\), \$(\w+)\)"
    )
    n = 0
    for name, text in render(rules_config()).items():
        d = json.loads(text)
        defined = {v["name"] for v in d["templating"]["list"]}
        bodies = [t["rawSql"] for p in d["panels"] for t in p["targets"]]
        bodies += [v["query"] for v in d["templating"]["list"]]
        for body in bodies:
            for m in safe.finditer(body):
                assert m.group(2) == m.group(3), (name, m.group(0))
                assert m.group(2) in defined, (name, m.group(2))
                n += 1
            rest = safe.sub("", body)
            for v in VARIABLE_NAMES:
                assert not re.search(rf"\$\{{?{v}\b|\[\[{v}", rest), (name, body[:300])
    assert n > 30


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_every_value_survives_the_variable_format_exactly(
    fleet: tuple[ChdbStore, SimConfig, RulesConfig],
) -> None:
    store = fleet[0]
    for v in [*corpus(long=False), "é" * 2000 + "\\"]:
        expr = variables(var("cluster"), {"cluster": v})
        assert set(expr[len("decodeURLComponent('") : -2]) <= set(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~%"
        )
        assert store.query(f"SELECT {expr} AS v")[0]["v"] == v, repr(v)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("fmt", ["", ":raw", ":sqlstring", ":singlequote"])
def test_the_formats_grafana_documents_for_sql_are_injectable(
    fleet: tuple[ChdbStore, SimConfig, RulesConfig], fmt: str
) -> None:
    """Why percentencode: the other formats let a value end the literal (the quote or the
    backslash is left for ClickHouse to read as an escape). The filter below must keep 0 rows;
    with these formats one value or another makes it keep the row."""
    store = fleet[0]
    quoted = fmt in (":sqlstring", ":singlequote")
    text = f"SELECT count() AS n FROM system.one WHERE {'' if quoted else chr(39)}${{cluster{fmt}}}{'' if quoted else chr(39)} = 'prod'"
    leaked = []
    # ends the literal; a backslash before the doubled quote; an escaped backslash before the quote
    for v in ["x' = 'x' OR 'a", "\\'' = '' OR 1=1 --", "\\' = char(92) OR 1=1 --"]:
        try:
            if store.query(variables(text, {"cluster": v}))[0]["n"]:
                leaked.append(v)
        except Exception:
            pass
    assert leaked, f"${{cluster{fmt}}} resisted every value"
    safe = f"SELECT count() AS n FROM system.one WHERE {var('cluster')} = 'prod'"
    assert all(store.query(variables(safe, {"cluster": v}))[0]["n"] == 0 for v in corpus(long=False))


HOSTILE_VALUES = [*SEQUENCES, "\x00", "\n", "\t", "a\rb", "\x7f", "é中😀", "n" * 256]
# the fast tier: a value that ends the literal and starts a comment, one that escapes the quote, a
# macro around a variable, a control character, UTF-8 and the longest name
FEW_HOSTILE_VALUES = [
    "' = '') OR 1=1 --",
    "\\'",
    "$__conditionalAll(1=1, $cluster)",
    "\x00",
    "é中😀",
    "n" * 256,
]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    "hostile",
    [
        pytest.param(FEW_HOSTILE_VALUES, id="one-of-each-kind"),
        # the rest: the fast tier's values run there (both tiers run in CI)
        pytest.param(
            [v for v in HOSTILE_VALUES if v not in FEW_HOSTILE_VALUES],
            id="every-other-value",
            marks=pytest.mark.integration,
        ),
    ],
)
def test_every_panel_filters_with_hostile_values(
    fleet: tuple[ChdbStore, SimConfig, RulesConfig], hostile: list[str]
) -> None:
    """For each panel and each hostile value given to every variable at once: the SQL runs, and
    a value no row has leaves the per-cluster panels empty (or one empty aggregate)."""
    assert set(FEW_HOSTILE_VALUES) <= set(HOSTILE_VALUES)
    store, sim, cfg = fleet
    panels = all_panel_sql(cfg)
    not_per_cluster = {f"{uid}: {s.title}" for _n, (_t, uid, specs, _v) in VIEWS.items() for s in specs(cfg)
                       if not s.per_cluster}  # fmt: skip
    for v in hostile:
        if v == "$__all":  # Grafana's own value of the "All" option (also from ?var-cluster=$__all)
            continue
        values = dict.fromkeys(VARIABLE_NAMES, v)
        for title, text in panels.items():
            rows = run(store, text, sim, **values)
            if title not in not_per_cluster:
                assert all(all(x in (None, 0, 0.0) for x in r.values()) for r in rows), (title, v)


def test_generated_constants_are_escaped() -> None:
    rendered = "".join(render(rules_config()).values())
    for const in (SERVICE, QUEUE, "o'q\\", "bob's \\ slo"):
        # each appears as ingest.sqltext.quote wrote it, JSON-encoded, and never unescaped
        assert quote(const).replace("\\", "\\\\") in rendered, const
    assert percentencode("x") == "x"


def burn_is_the_engines(
    store: Any, burn: list[dict[str, Any]], slo: Any, frm: float, to: float, step: float
) -> None:
    """Each row of the burn-rate panel holds, for every alert window, the engine's burn at its step."""
    steps = {float(r["t"]): r for r in slo_steps(store, slo, frm, to, step)}
    lengths = sorted({w.long_s for w in slo.windows} | {w.short_s for w in slo.windows})
    assert burn
    for r in burn:
        e = steps[tsec(r["time"])]
        for w in lengths:
            n, g = float(e[f"total_{w}"] or 0), float(e[f"good_{w}"] or 0)
            assert r[f"burn_{views._label(w)}"] == pytest.approx((1 - g / n) / (1 - slo.objective), **APPROX)

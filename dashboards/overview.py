"""Fleet overview: the four numbers and where the GPU-hours go."""

from __future__ import annotations

from collections.abc import Callable

from grafanalib.core import (
    Dashboard,
    GridPos,
    Stat,
    Table,
    Template,
    Templating,
    Threshold,
    Time,
    TimeSeries,
)

from gpuslo.dashboards.clickhouse import (
    DATASOURCE_UID,
    FORMAT_TIMESERIES,
    TO_S,
    ClickHouseTarget,
    for_grafana,
    inert,
    var_filter,
)
from gpuslo.dashboards.spec import RawPanel, links
from gpuslo.ingest.sqltext import inline, literal
from gpuslo.rules import measures as m
from gpuslo.rules import sql
from gpuslo.rules.config import RulesConfig, Slo

DS = {"type": "grafana-clickhouse-datasource", "uid": DATASOURCE_UID}


def _consts(cfg: RulesConfig) -> dict[str, str]:
    st = cfg.starvation
    queues = sorted(st.queue_threshold_s)
    return {
        "idle:Float64": literal(float(cfg.idle_threshold)),
        "limit:UInt32": "20",
        "thr_queues:Array(String)": f"CAST({literal(queues)}, 'Array(String)')",
        "thr_values:Array(Float64)": f"CAST({literal([float(st.queue_threshold_s[q]) for q in queues])}, 'Array(Float64)')",
        "thr_default:Float64": literal(float(st.threshold_s)),
        "thr_max:Float64": literal(float(max([st.threshold_s, *st.queue_threshold_s.values()]))),
        "min_idle:Float64": literal(float(cfg.min_idle_s)),
    }


def idle_source(cfg: RulesConfig) -> tuple[str, str]:
    """(per-sample rule SQL, idle test) for the idle numbers: with ``min_idle_s``, idle only
    inside long enough runs, as the rules engine counts it."""
    if cfg.min_idle_s > 0:
        return sql.IDLE_RUNS, "idle_ok"
    return sql.CAPACITY_SAMPLES, m.IDLE_TEST


def fleet_sums(cfg: RulesConfig, by_bucket: bool = False) -> str:
    """The fleet's GPU-seconds (rules.measures.FLEET_TERMS) over the dashboard's range and
    cluster, as Grafana sends it; ``by_bucket``: per ``$__interval_s`` bucket (``bucket``, epoch
    seconds), samples split at the bucket edges as the engine clips them at a window's."""
    src, is_idle = idle_source(cfg)
    if by_bucket:
        src = m.split_by_bucket(src, "$__interval_s")
    group = "bucket, " if by_bucket else ""
    q = f"SELECT {group}{m.sums(m.FLEET_TERMS, is_idle)} FROM ({src}) WHERE cap_s > 0"
    if by_bucket:
        q += " GROUP BY bucket"
    return for_grafana(q, **_consts(cfg))


OWNER_IDLE = "owner_idle"  # owner_rows' idle test (IDLE_RUNS has an ``is_idle`` of its own: not that one)


def owner_rows(cfg: RulesConfig) -> str:
    """One row per sample and holder with its ``share`` (for rules.measures.OWNER_TERMS), and
    the engine's idle test as ``owner_idle``."""
    src, is_idle = idle_source(cfg)
    q = (
        f"SELECT *, id, name, user, account, q, share, act_share, {m.holder_idle(is_idle)} AS {OWNER_IDLE} FROM ({src}) ARRAY JOIN alloc_ids AS id, alloc_names AS name, "
        "alloc_users AS user, alloc_accounts AS account, alloc_queues AS q, alloc_shares AS share, alloc_act_shares AS act_share WHERE cap_s > 0"
    )
    return for_grafana(q, **_consts(cfg))


def starvation_sql(cfg: RulesConfig) -> str:
    return for_grafana(sql.STARVATION_NESTED, **_consts(cfg))


def latency_where(slo: Slo, lookback_s: int = 0) -> str:
    """The engine's latency rows of an SLO: its service, the cluster variable, ts in
    (from - lookback_s, to]."""
    return for_grafana(
        f"service = {literal(slo.service)} AND ({{cluster:String}} = '' OR cluster = {{cluster:String}}) "
        f"AND ts > toDateTime64({{from:Float64}} - {lookback_s}, 3, 'UTC') AND ts <= toDateTime64({{to:Float64}}, 3, 'UTC')"
    )


def good(slo: Slo) -> str:
    return inline(m.GOOD, {"threshold:Float64": literal(float(slo.threshold_ms))})


def panel_queries(cfg: RulesConfig) -> dict[str, tuple[str, int]]:
    """Panel title → (SQL as Grafana sends it, plugin format). Data, so tests can run each."""
    settings = sql.JOIN_SETTINGS
    table = 1
    total, per_bucket = fleet_sums(cfg), fleet_sums(cfg, by_bucket=True)
    idle_by_owner = sql.IDLE_BY_OWNER_MIN_IDLE if cfg.min_idle_s > 0 else sql.IDLE_BY_OWNER
    q: dict[str, tuple[str, int]] = {
        "Allocation CUR": (f"SELECT {m.CUR_ALLOCATION} AS cur FROM ({total}) {settings}", table),
        "Active CUR": (f"SELECT {m.CUR_ACTIVE} AS cur FROM ({total}) {settings}", table),
        "Idle GPU-hours, allocated": (
            f"SELECT idle_allocated_s / 3600 AS gpu_hours FROM ({total}) {settings}",
            table,
        ),
        "Idle GPU-hours, unallocated": (
            f"SELECT idle_unallocated_s / 3600 AS gpu_hours FROM ({total}) {settings}",
            table,
        ),
        "Starvation incidents": (
            f"SELECT count() AS incidents FROM ({starvation_sql(cfg)}) {settings}",
            table,
        ),
        "CUR over time": (
            f"SELECT toDateTime(bucket) AS time, {m.CUR_ALLOCATION} AS allocation, {m.CUR_ACTIVE} AS active "
            f"FROM ({per_bucket}) ORDER BY time {settings}",
            FORMAT_TIMESERIES,
        ),
        "Idle GPU-hours over time": (
            "SELECT toDateTime(bucket) AS time, idle_allocated_s / 3600 AS allocated_idle, "
            f"idle_unallocated_s / 3600 AS unallocated FROM ({per_bucket}) ORDER BY time {settings}",
            FORMAT_TIMESERIES,
        ),
        "Top idle jobs and pods": (for_grafana(idle_by_owner, **_consts(cfg)), table),
        "Activity by node": (
            "SELECT $__timeInterval(ts) AS time, node, avg(activity) AS activity "
            f"FROM ({for_grafana(sql.CAPACITY_SAMPLES)}) WHERE cap_s > 0 GROUP BY time, node ORDER BY time, node "
            f"{settings}",
            FORMAT_TIMESERIES,
        ),
        "GPU health events": (
            "SELECT node, event, code, countIf(fatal = 1) AS fatal, count() AS events, max(ts) AS last "
            f"FROM health_events FINAL WHERE $__timeFilter(ts) AND {var_filter('cluster', 'cluster')} "
            "GROUP BY node, event, code ORDER BY events DESC",
            table,
        ),
        "Starvation incidents by cause": (
            f"SELECT cause, count() AS incidents, round(avg(coalesce(closed, {TO_S}) - submitted) / 60, 1) "
            f"AS mean_wait_min FROM ({starvation_sql(cfg)}) GROUP BY cause ORDER BY incidents DESC {settings}",
            table,
        ),
    }
    for slo in cfg.slos:
        q[f"SLO {slo.name}: error ratio vs budget"] = (
            f"SELECT toDateTime(toInt64(ceil(toFloat64(ts) / $__interval_s) * $__interval_s)) AS time, "
            f"1 - {m.sli(f'sum({good(slo)})', 'sum(total)')} AS error_ratio, {literal(1 - slo.objective)} AS budget "
            f"FROM latency FINAL WHERE {latency_where(slo)} GROUP BY time ORDER BY time",
            FORMAT_TIMESERIES,
        )
    return {k: (inert(text), fmt) for k, (text, fmt) in q.items()}  # as the targets hold it


Targets = Callable[[str], list[ClickHouseTarget]]  # a panel title → its query as a target


def dashboard(cfg: RulesConfig) -> Dashboard:
    q = panel_queries(cfg)

    def target(title: str) -> list[ClickHouseTarget]:
        text, fmt = q[title]
        return [ClickHouseTarget(rawSql=text, format=fmt)]

    panels = [
        *_stat_panels(cfg, target),
        *_trend_panels(target),
        _activity_panel(q["Activity by node"]),
        Table(
            title="GPU health events",
            dataSource=DS,
            targets=target("GPU health events"),
            gridPos=GridPos(h=9, w=12, x=12, y=23),
        ),
        *_slo_panels(cfg, target),
    ]
    return Dashboard(
        title="gpuslo / Fleet overview",
        uid="gpuslo-fleet-overview",
        tags=["gpuslo"],
        timezone="utc",
        refresh="1m",
        time=Time("now-12h", "now"),
        templating=Templating(list=[_cluster_variable()]),
        links=links(),
        panels=panels,
    ).auto_panel_ids()


def _stat_panels(cfg: RulesConfig, target: Targets) -> list[object]:
    """The first row: the four numbers (CUR coloured against its target) and the incidents."""
    target_steps = [
        Threshold("red", 0, 0.0),
        Threshold("orange", 1, round(cfg.cur_target * 0.75, 4)),
        Threshold("green", 2, cfg.cur_target),
    ]
    stats = [
        "Allocation CUR",
        "Active CUR",
        "Idle GPU-hours, allocated",
        "Idle GPU-hours, unallocated",
        "Starvation incidents",
    ]
    return [
        Stat(
            title=title,
            dataSource=DS,
            targets=target(title),
            format="percentunit" if "CUR" in title else "none",
            reduceCalc="lastNotNull",
            thresholds=target_steps if "CUR" in title else "",
            gridPos=GridPos(h=5, w=4 if i < 4 else 8, x=i * 4, y=0),
        )
        for i, title in enumerate(stats)
    ]


def _trend_panels(target: Targets) -> list[object]:
    """CUR and idle over time, the top idle holders and the incidents by cause."""
    return [
        TimeSeries(
            title="CUR over time",
            dataSource=DS,
            targets=target("CUR over time"),
            unit="percentunit",
            valueMin=0,
            valueMax=1,
            gridPos=GridPos(h=9, w=12, x=0, y=5),
        ),
        TimeSeries(
            title="Idle GPU-hours over time",
            dataSource=DS,
            targets=target("Idle GPU-hours over time"),
            stacking={"mode": "normal", "group": "A"},
            drawStyle="bars",
            fillOpacity=80,
            gridPos=GridPos(h=9, w=12, x=12, y=5),
        ),
        Table(
            title="Top idle jobs and pods",
            dataSource=DS,
            targets=target("Top idle jobs and pods"),
            gridPos=GridPos(h=9, w=12, x=0, y=14),
        ),
        Table(
            title="Starvation incidents by cause",
            dataSource=DS,
            targets=target("Starvation incidents by cause"),
            gridPos=GridPos(h=9, w=12, x=12, y=14),
        ),
    ]


def _activity_panel(query: tuple[str, int]) -> RawPanel:
    """A status history: one row per node, colour = activity (a heatmap of the fleet)."""
    text, fmt = query
    return RawPanel(
        {
            "type": "status-history",
            "title": "Activity by node",
            "datasource": DS,
            "targets": [ClickHouseTarget(rawSql=text, format=fmt).to_json_data()],
            "gridPos": {"h": 9, "w": 12, "x": 0, "y": 23},
            "fieldConfig": {
                "defaults": {
                    "unit": "percentunit",
                    "min": 0,
                    "max": 1,
                    "color": {"mode": "continuous-GrYlRd"},
                },
                "overrides": [],
            },
            "options": {
                "showValue": "never",
                "rowHeight": 0.9,
                "colWidth": 0.9,
                "legend": {"showLegend": True},
            },
        }
    )


def _slo_panels(cfg: RulesConfig, target: Targets) -> list[object]:
    return [
        TimeSeries(
            title=f"SLO {slo.name}: error ratio vs budget",
            dataSource=DS,
            targets=target(f"SLO {slo.name}: error ratio vs budget"),
            unit="percentunit",
            gridPos=GridPos(h=8, w=24, x=0, y=32 + 8 * j),
        )
        for j, slo in enumerate(cfg.slos)
    ]


def _cluster_variable() -> Template:
    return Template(
        name="cluster",
        label="Cluster",
        query="SELECT DISTINCT cluster FROM node_heartbeats ORDER BY cluster",
        dataSource=DS,
        includeAll=True,
        allValue="",
        default="",
    )

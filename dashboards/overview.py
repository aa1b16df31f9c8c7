"""Fleet overview: the four numbers and where the GPU-hours go."""

from __future__ import annotations

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

from dashboards.clickhouse import DATASOURCE_UID, FORMAT_TIMESERIES, ClickHouseTarget, for_grafana
from dashboards.spec import RawPanel, links
from rules import sql
from rules.config import RulesConfig

DS = {"type": "grafana-clickhouse-datasource", "uid": DATASOURCE_UID}


def _consts(cfg: RulesConfig) -> dict[str, str]:
    st = cfg.starvation
    queues = sorted(st.queue_threshold_s)
    qs = ", ".join("'" + q.replace("'", "\\'") + "'" for q in queues)
    vs = ", ".join(repr(float(st.queue_threshold_s[q])) for q in queues)
    return {
        "idle:Float64": repr(cfg.idle_threshold),
        "limit:UInt32": "20",
        "thr_queues:Array(String)": f"CAST([{qs}], 'Array(String)')",
        "thr_values:Array(Float64)": f"CAST([{vs}], 'Array(Float64)')",
        "thr_default:Float64": repr(float(st.threshold_s)),
        "thr_max:Float64": repr(float(max([st.threshold_s, *st.queue_threshold_s.values()]))),
        "min_idle:Float64": repr(float(cfg.min_idle_s)),
    }


def idle_source(cfg: RulesConfig) -> tuple[str, str]:
    """(per-sample source, idle test) for the idle panels: with ``min_idle_s``, idle only inside
    long enough runs, as the rules engine counts it."""
    c = _consts(cfg)
    if cfg.min_idle_s > 0:
        return for_grafana(sql.IDLE_RUNS, **c), "idle_ok"
    return for_grafana(sql.CAPACITY_SAMPLES, **c), f"activity < {c['idle:Float64']}"


def panel_queries(cfg: RulesConfig) -> dict[str, tuple[str, int]]:
    """Panel title → (SQL as Grafana sends it, plugin format). Data, so tests can run each."""
    c = _consts(cfg)
    cap = for_grafana(sql.CAPACITY_SAMPLES, **c)
    src, is_idle = idle_source(cfg)
    settings = sql.JOIN_SETTINGS
    table = 1
    q: dict[str, tuple[str, int]] = {
        "Allocation CUR": (
            f"SELECT sum(cap_s * alloc_share) / nullIf(sum(cap_s), 0) AS cur FROM ({cap}) WHERE cap_s > 0 {settings}",
            table,
        ),
        "Active CUR": (
            f"SELECT sum(cap_s * activity) / nullIf(sum(cap_s), 0) AS cur FROM ({cap}) WHERE cap_s > 0 {settings}",
            table,
        ),
        "Idle GPU-hours, allocated": (
            f"SELECT sum(if({is_idle}, cap_s * alloc_share, 0)) / 3600 AS gpu_hours "
            f"FROM ({src}) WHERE cap_s > 0 {settings}",
            table,
        ),
        "Idle GPU-hours, unallocated": (
            f"SELECT sum(if({is_idle}, cap_s * (1 - alloc_share), 0)) / 3600 AS gpu_hours "
            f"FROM ({src}) WHERE cap_s > 0 {settings}",
            table,
        ),
        "Starvation incidents": (
            f"SELECT count() AS incidents FROM ({for_grafana(sql.STARVATION.replace(settings, ''), **c)}) {settings}",
            table,
        ),
        "CUR over time": (
            "SELECT $__timeInterval(ts) AS time, sum(cap_s * alloc_share) / nullIf(sum(cap_s), 0) AS allocation, "
            f"sum(cap_s * activity) / nullIf(sum(cap_s), 0) AS active FROM ({cap}) WHERE cap_s > 0 "
            f"GROUP BY time ORDER BY time {settings}",
            FORMAT_TIMESERIES,
        ),
        "Idle GPU-hours over time": (
            "SELECT $__timeInterval(ts) AS time, "
            f"sum(if({is_idle}, cap_s * alloc_share, 0)) / 3600 AS allocated_idle, "
            f"sum(if({is_idle}, cap_s * (1 - alloc_share), 0)) / 3600 AS unallocated "
            f"FROM ({src}) WHERE cap_s > 0 GROUP BY time ORDER BY time {settings}",
            FORMAT_TIMESERIES,
        ),
        "Top idle jobs and pods": (for_grafana(sql.IDLE_BY_OWNER, **c), table),
        "Activity by node": (
            "SELECT $__timeInterval(ts) AS time, node, avg(activity) AS activity "
            f"FROM ({cap}) WHERE cap_s > 0 GROUP BY time, node ORDER BY time, node {settings}",
            FORMAT_TIMESERIES,
        ),
        "GPU health events": (
            "SELECT node, event, code, countIf(fatal = 1) AS fatal, count() AS events, max(ts) AS last "
            "FROM health_events FINAL WHERE $__timeFilter(ts) AND ('${cluster}' = '' OR cluster = '${cluster}') "
            "GROUP BY node, event, code ORDER BY events DESC",
            table,
        ),
        "Starvation incidents by cause": (
            f"SELECT cause, count() AS incidents, round(avg(coalesce(closed, {{to:Float64}}) - submitted) / 60, 1) "
            f"AS mean_wait_min FROM ({for_grafana(sql.STARVATION.replace(settings, ''), **c)}) "
            f"GROUP BY cause ORDER BY incidents DESC {settings}".replace(
                "{to:Float64}", "(toUnixTimestamp64Milli($__toTime_ms) / 1000)"
            ),
            table,
        ),
    }
    for slo in cfg.slos:
        q[f"SLO {slo.name}: error ratio vs budget"] = (
            "SELECT $__timeInterval(ts) AS time, "
            f"1 - sum(arraySum(arrayMap((c, b) -> if(b <= {float(slo.threshold_ms)!r}, c, 0), "
            "arrayPopBack(counts), bounds_ms))) / nullIf(sum(total), 0) AS error_ratio, "
            f"{1 - slo.objective!r} AS budget FROM latency FINAL "
            f"WHERE service = '{slo.service}' AND $__timeFilter(ts) AND ('${{cluster}}' = '' OR cluster = '${{cluster}}') "
            "GROUP BY time ORDER BY time",
            FORMAT_TIMESERIES,
        )
    return q


def dashboard(cfg: RulesConfig) -> Dashboard:
    q = panel_queries(cfg)

    def target(title: str) -> list[ClickHouseTarget]:
        text, fmt = q[title]
        return [ClickHouseTarget(rawSql=text, format=fmt)]

    target_steps = [
        Threshold("red", 0, 0.0),
        Threshold("orange", 1, round(cfg.cur_target * 0.75, 4)),
        Threshold("green", 2, cfg.cur_target),
    ]
    panels: list[object] = []
    stats = [
        "Allocation CUR",
        "Active CUR",
        "Idle GPU-hours, allocated",
        "Idle GPU-hours, unallocated",
        "Starvation incidents",
    ]
    for i, title in enumerate(stats):
        unit = "percentunit" if "CUR" in title else "none"
        panels.append(
            Stat(
                title=title,
                dataSource=DS,
                targets=target(title),
                format=unit,
                reduceCalc="lastNotNull",
                thresholds=target_steps if "CUR" in title else "",
                gridPos=GridPos(h=5, w=4 if i < 4 else 8, x=i * 4, y=0),
            )
        )
    panels.append(
        TimeSeries(
            title="CUR over time",
            dataSource=DS,
            targets=target("CUR over time"),
            unit="percentunit",
            valueMin=0,
            valueMax=1,
            gridPos=GridPos(h=9, w=12, x=0, y=5),
        )
    )
    panels.append(
        TimeSeries(
            title="Idle GPU-hours over time",
            dataSource=DS,
            targets=target("Idle GPU-hours over time"),
            stacking={"mode": "normal", "group": "A"},
            drawStyle="bars",
            fillOpacity=80,
            gridPos=GridPos(h=9, w=12, x=12, y=5),
        )
    )
    panels.append(
        Table(
            title="Top idle jobs and pods",
            dataSource=DS,
            targets=target("Top idle jobs and pods"),
            gridPos=GridPos(h=9, w=12, x=0, y=14),
        )
    )
    panels.append(
        Table(
            title="Starvation incidents by cause",
            dataSource=DS,
            targets=target("Starvation incidents by cause"),
            gridPos=GridPos(h=9, w=12, x=12, y=14),
        )
    )
    text, fmt = q["Activity by node"]
    panels.append(
        RawPanel(
            {  # status history: one row per node, colour = activity (a heatmap of the fleet)
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
    )
    panels.append(
        Table(
            title="GPU health events",
            dataSource=DS,
            targets=target("GPU health events"),
            gridPos=GridPos(h=9, w=12, x=12, y=23),
        )
    )
    for j, slo in enumerate(cfg.slos):
        title = f"SLO {slo.name}: error ratio vs budget"
        panels.append(
            TimeSeries(
                title=title,
                dataSource=DS,
                targets=target(title),
                unit="percentunit",
                gridPos=GridPos(h=8, w=24, x=0, y=32 + 8 * j),
            )
        )
    cluster_var = Template(
        name="cluster",
        label="Cluster",
        query="SELECT DISTINCT cluster FROM node_heartbeats ORDER BY cluster",
        dataSource=DS,
        includeAll=True,
        allValue="",
        default="",
    )
    return Dashboard(
        title="gpuslo / Fleet overview",
        uid="gpuslo-fleet-overview",
        tags=["gpuslo"],
        timezone="utc",
        refresh="1m",
        time=Time("now-12h", "now"),
        templating=Templating(list=[cluster_var]),
        links=links(),
        panels=panels,
    ).auto_panel_ids()

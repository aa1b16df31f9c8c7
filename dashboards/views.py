"""The drill-down dashboards: node and GPU, workloads, scheduler and starvation, SLOs.
Each is a list of panel specs (data); ``dashboards.spec.build`` lays them out."""

from __future__ import annotations

from gpuslo.dashboards import rightsizing
from gpuslo.dashboards.clickhouse import FROM_S, TO_S, for_grafana, var_filter
from gpuslo.dashboards.overview import OWNER_IDLE, fleet_sums, good, latency_where, owner_rows, starvation_sql
from gpuslo.dashboards.spec import CLUSTER_VAR, PanelSpec, variable
from gpuslo.ingest.sqltext import literal
from gpuslo.rules import measures as m
from gpuslo.rules import sql
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.wire import FIELDS

FILTERS = f"{var_filter('cluster', 'cluster')} AND {var_filter('node', 'node')}"
BUCKET = "toStartOfInterval(toDateTime(ts), INTERVAL $__interval_s second)"

# (title, field, unit): one time series panel per row, one series per GPU
GPU_SERIES = (
    ("GPU utilization", "DCGM_FI_DEV_GPU_UTIL", "percent"),
    ("Graphics engine active (works under MIG)", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "percentunit"),
    ("Power", "DCGM_FI_DEV_POWER_USAGE", "watt"),
    ("GPU temperature", "DCGM_FI_DEV_GPU_TEMP", "celsius"),
    ("Framebuffer used", "DCGM_FI_DEV_FB_USED", "mbytes"),
    ("SM clock", "DCGM_FI_DEV_SM_CLOCK", "rotmhz"),
)


def _label(seconds: int) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % n == 0:
            return f"{seconds // n}{unit}"
    return f"{seconds}s"


def node_gpu(cfg: RulesConfig) -> list[PanelSpec]:
    specs = [
        PanelSpec(
            title,
            "timeseries",
            f"SELECT {BUCKET} AS time, concat(node, '/gpu', toString(gpu)) AS gpu, avg({field}) AS value "
            f"FROM gpu_samples FINAL WHERE $__timeFilter(ts) AND {FILTERS} AND {field} IS NOT NULL "
            "GROUP BY time, gpu ORDER BY time, gpu",
            unit,
        )
        for title, field, unit in GPU_SERIES
    ]
    latest = ", ".join(f"argMax({f.name}, ts) AS {f.name}" for f in FIELDS)
    specs.append(
        PanelSpec(
            "Every sampled field, latest per GPU",
            "table",
            f"SELECT node, gpu, {latest} FROM gpu_samples FINAL WHERE $__timeFilter(ts) AND {FILTERS} "
            "GROUP BY node, gpu ORDER BY node, gpu",
            width=24,
        )
    )
    specs.append(
        PanelSpec(
            "GPUs now: health and holders",
            "table",
            "SELECT node, gpu, uuid, argMax(model, ts) AS model, argMax(healthy, ts) AS healthy, "
            "round(argMax(activity, ts), 3) AS activity, argMax(arrayStringConcat(alloc_ids, ','), ts) AS held_by, "
            "argMax(arrayStringConcat(alloc_users, ','), ts) AS users, max(ts) AS last_sample "
            f"FROM gpu_samples FINAL WHERE $__timeFilter(ts) AND {FILTERS} GROUP BY node, gpu, uuid ORDER BY node, gpu",
            width=24,
        )
    )
    specs.append(
        PanelSpec(
            "Health events (XID, ECC, lost GPUs)",
            "table",
            "SELECT ts, node, gpu, uuid, event, code, fatal, message FROM health_events FINAL "
            f"WHERE $__timeFilter(ts) AND {FILTERS} ORDER BY ts DESC LIMIT 200",
            width=24,
        )
    )
    return specs


def workloads(cfg: RulesConfig) -> list[PanelSpec]:
    owners = f"FROM ({owner_rows(cfg)}) WHERE {var_filter('id', 'job')} AND {var_filter('q', 'queue')}"
    alloc, active = m.OWNER_TERMS["allocated_s"], m.OWNER_TERMS["active_s"]
    idle = m.term(m.OWNER_TERMS, "idle_s", OWNER_IDLE)
    settings = sql.JOIN_SETTINGS
    return [
        PanelSpec(
            "Jobs and pods: efficiency",
            "table",
            "SELECT id, any(name) AS name, any(user) AS user, any(account) AS account, any(q) AS queue, "
            f"round(sum({alloc}) / 3600, 2) AS allocated_gpu_h, round(sum({active}) / 3600, 2) "
            "AS active_gpu_h, round(active_gpu_h / nullIf(allocated_gpu_h, 0), 3) AS efficiency, "
            f"round(sum({idle}) / nullIf(sum({alloc}), 0), 3) AS idle_share "
            f"{owners} GROUP BY id ORDER BY allocated_gpu_h DESC LIMIT 100 {settings}",
            width=24,
            height=10,
        ),
        PanelSpec(
            "Allocated-idle GPU-hours by user",
            "bars",
            f"SELECT user, round(sum({idle}) / 3600, 2) AS idle_gpu_h "
            f"{owners} GROUP BY user ORDER BY idle_gpu_h DESC LIMIT 20 {settings}",
        ),
        PanelSpec(
            "Allocated-idle GPU-hours by account / namespace",
            "bars",
            f"SELECT account, round(sum({idle}) / 3600, 2) AS idle_gpu_h "
            f"{owners} GROUP BY account ORDER BY idle_gpu_h DESC LIMIT 20 {settings}",
        ),
        PanelSpec(
            "GPUs allocated vs busy",
            "timeseries",
            "SELECT toDateTime(bucket) AS time, allocated_s / $__interval_s AS allocated_gpus, "
            f"active_s / $__interval_s AS busy_gpus FROM ({fleet_sums(cfg, by_bucket=True)}) ORDER BY time {settings}",
            width=24,
        ),
        PanelSpec(
            "Fleet CUR per hour, as `rules run` evaluated it (rule_results)",
            "timeseries",
            "SELECT evaluated_at AS time, maxIf(value, rule = 'cur_allocation') AS allocation, "
            "maxIf(value, rule = 'cur_active') AS active FROM rule_results FINAL "
            "WHERE $__timeFilter(evaluated_at) AND window_s = 3600 AND cluster = '' AND pool = '' "
            "GROUP BY time ORDER BY time",
            "percentunit",
            width=24,
            per_cluster=False,
        ),
        *rightsizing.panels(cfg),
    ]


def scheduler(cfg: RulesConfig) -> list[PanelSpec]:
    starv = starvation_sql(cfg)
    queue = var_filter("queue", "queue")
    return [
        PanelSpec(
            "Pending GPU requests now, and their age",
            "table",
            f"SELECT * FROM ({for_grafana(sql.PENDING_AGE)}) WHERE {queue}",
        ),
        PanelSpec(
            "Starvation incidents opened, by cause",
            "timeseries",
            f"SELECT toStartOfInterval(toDateTime(opened), INTERVAL $__interval_s second) AS time, cause, "
            f"count() AS incidents FROM ({starv}) WHERE {queue} "
            f"GROUP BY time, cause ORDER BY time {sql.JOIN_SETTINGS}",
            stacked=True,
        ),
        PanelSpec(
            "Wait before start (GPU requests started in the range)",
            "table",
            "SELECT multiIf(wait_s < 60, '< 1 min', wait_s < 600, '1-10 min', wait_s < 3600, '10-60 min', "
            "wait_s < 21600, '1-6 h', '> 6 h') AS wait, count() AS requests, round(avg(wait_s) / 60, 1) AS mean_min "
            "FROM (SELECT request_id, minIf(toFloat64(ts), event = 'submit') AS s, minIf(toFloat64(ts), event = 'start') "
            "AS st, st - s AS wait_s, countIf(event = 'start') AS started, countIf(event = 'submit') AS submitted "
            f"FROM sched_events FINAL WHERE {var_filter('cluster', 'cluster')} AND "
            f"ts < toDateTime64({TO_S}, 3, 'UTC') GROUP BY request_id "
            f"HAVING started > 0 AND submitted > 0 AND st >= {FROM_S}) "
            "GROUP BY wait ORDER BY min(wait_s)",
        ),
        PanelSpec(
            "Fair share: allocated GPU-hours vs GPUs requested, per account",
            "table",
            "SELECT account, round(allocated_s / 3600, 2) AS allocated_gpu_h, round(share_allocated, 3) AS "
            "share_allocated, gpus_requested, round(share_requested, 3) AS share_requested FROM ("
            + for_grafana(sql.FAIR_SHARE_NESTED)
            + f") {sql.JOIN_SETTINGS}",
            width=24,
        ),
    ]


def slo(cfg: RulesConfig) -> list[PanelSpec]:
    return [spec for s in cfg.slos for spec in _slo_specs(s, cfg.eval_step_s)]


def _slo_specs(s: Slo, step: int) -> list[PanelSpec]:
    """One SLO's panels: SLI, burn per window, alerts, budget, the engine's results, p99."""
    g = good(s)
    where = latency_where(s)
    return [
        PanelSpec(
            f"{s.name}: SLI vs objective",
            "timeseries",
            "SELECT toDateTime(toInt64(ceil(toFloat64(ts) / $__interval_s) * $__interval_s)) AS time, "
            f"{m.sli(f'sum({g})', 'sum(total)')} AS sli, {literal(s.objective)} AS objective "
            f"FROM latency FINAL WHERE {where} GROUP BY time ORDER BY time",
            "percentunit",
        ),
        _burn_spec(s, step),
        PanelSpec(
            f"{s.name}: alerts firing now",
            "table",
            "SELECT labels['severity'] AS severity, labels['window'] AS window, started_at, "
            "annotations['summary'] AS summary FROM alert_state FINAL WHERE state = 'firing' "
            f"AND alertname = 'GpusloSLOBurn' AND labels['slo'] = {literal(s.name)} ORDER BY started_at",
            width=24,
            per_cluster=False,
        ),
        PanelSpec(
            f"{s.name}: error budget left ({s.period_d} d)",
            "stat",
            # over the per-minute rollup: a 30-day budget without reading 30 days of deltas
            f"SELECT {m.budget_remaining(s.objective)} AS budget_left FROM (SELECT sum({g}) AS good, "
            f"sum(total) AS total FROM latency_rollup_1m FINAL WHERE minute_end > $__toTime - INTERVAL "
            f"{s.period_d} DAY AND minute_end <= $__toTime AND service = {literal(s.service)} "
            f"AND {var_filter('cluster', 'cluster')})",
            "percentunit",
            width=6,
        ),
        *_rule_results_specs(s),
        PanelSpec(
            f"{s.name}: p99 latency (bucket upper bound)",
            "timeseries",
            "SELECT time, arrayElement(b, arrayFirstIndex(x -> x >= 0.99 * arraySum(c), arrayCumSum(c))) AS p99_ms "
            f"FROM (SELECT {BUCKET} AS time, any(bounds_ms) AS b, sumForEach(arrayPopBack(counts)) AS c "
            f"FROM latency FINAL WHERE {where} GROUP BY time) ORDER BY time",
            "ms",
            width=18,
        ),
    ]


def _burn_spec(s: Slo, step: int) -> PanelSpec:
    """The burn rate of every window length, at the engine's evaluation steps."""
    lengths = sorted({x.long_s for x in s.windows} | {x.short_s for x in s.windows})
    # the engine's bins (rules.sql.window_bin_s): a delta at ts counts at the first bin end at or
    # after ts, and each window is whole bins; the burns are shown at the engine's steps, every
    # one from the first bin with requests to the last (the bins between them filled, as the
    # engine's grid: only steps whose own last bin had requests were shown)
    b = sql.window_bin_s(step, lengths)
    step_t = f"toDateTime(toInt64(ceil(toFloat64(ts) / {b}) * {b}))"
    at_steps = "" if b == step else f" AND toUnixTimestamp(time) % {step} = 0"
    return PanelSpec(
        f"{s.name}: burn rate per alert window",
        "timeseries",
        "SELECT time, "
        + ", ".join(
            m.burn(
                s.objective,
                f"sum(good) OVER (ORDER BY time RANGE BETWEEN {w - b} PRECEDING AND CURRENT ROW)",
                f"sum(n) OVER (ORDER BY time RANGE BETWEEN {w - b} PRECEDING AND CURRENT ROW)",
            )
            + f" AS burn_{_label(w)}"
            for w in lengths
        )
        + f" FROM (SELECT {step_t} AS time, sum({good(s)}) AS good, sum(total) AS n FROM latency FINAL WHERE "
        + latency_where(s, max(lengths))
        + f" GROUP BY time ORDER BY time WITH FILL STEP {b}) QUALIFY time > toDateTime({FROM_S}){at_steps} ORDER BY time",
        thresholds=tuple(w.factor for w in s.windows),
    )


def _rule_results_specs(s: Slo) -> list[PanelSpec]:
    """Budget, burn and minutes as ``rules run`` wrote them to rule_results."""
    return [
        PanelSpec(
            f"{s.name}: budget left and burn, as `rules run` evaluated it (rule_results)",
            "timeseries",
            "SELECT evaluated_at AS time, maxIf(value, rule = 'slo_budget_remaining') AS budget_left, "
            "maxIf(value, rule = 'slo_burn') AS burn FROM rule_results FINAL "
            f"WHERE $__timeFilter(evaluated_at) AND label = {literal('slo=' + s.name)} GROUP BY time ORDER BY time",
            width=24,
            per_cluster=False,
        ),
        PanelSpec(
            f"{s.name}: minutes firing, and held back by the traffic guard (min_requests {s.min_requests}), "
            "as `rules run` evaluated them (rule_results)",
            "timeseries",
            "SELECT evaluated_at AS time, "
            + ", ".join(
                f"maxIf(value, rule = 'slo_{kind}_minutes' AND label = {literal(f'slo={s.name},severity={sev}')}) "
                f"AS {sev}_{kind}"
                for sev in sorted({w.severity for w in s.windows})
                for kind in ("firing", "held_back")
            )
            + " FROM rule_results FINAL WHERE $__timeFilter(evaluated_at) "
            "AND rule IN ('slo_firing_minutes', 'slo_held_back_minutes') GROUP BY time ORDER BY time",
            width=24,
            per_cluster=False,
        ),
    ]


VARIABLES = {
    "node": ("node", "Node", "SELECT DISTINCT node FROM node_heartbeats ORDER BY node"),
    "queue": ("queue", "Partition / namespace", "SELECT DISTINCT queue FROM sched_events ORDER BY queue"),
    "job": (
        "job",
        "Job / pod",
        "SELECT DISTINCT arrayJoin(alloc_ids) FROM gpu_samples WHERE ts > now() - INTERVAL 1 DAY",
    ),
}


def templating(*names: str) -> list[object]:
    return [variable(*CLUSTER_VAR), *(variable(*VARIABLES[n]) for n in names)]

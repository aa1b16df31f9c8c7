"""The chargeback dashboard: GPU-hours, cost of the GPU-hours held, and energy per account
over the dashboard's range (``gpuslo chargeback`` gives the full bill with the unallocated
share, to the cent). Panel SQL from the rules' own terms (rules.measures) and rules.energy's
rows, with the price sheet and the grid intensity inlined as constants."""

from __future__ import annotations

from gpuslo.dashboards.clickhouse import for_grafana, var_filter
from gpuslo.dashboards.overview import OWNER_IDLE, owner_rows
from gpuslo.dashboards.spec import PanelSpec
from gpuslo.ingest.sqltext import literal
from gpuslo.rules import energy as en
from gpuslo.rules import measures as m
from gpuslo.rules import sql
from gpuslo.rules.config import RulesConfig


def _price(cfg: RulesConfig) -> str:
    """SQL: the price per GPU-hour of the row's ``model`` (0 when the sheet has none)."""
    cb = cfg.chargeback
    sheet = {} if cb is None else cb.per_gpu_hour
    models = sorted(sheet)
    default = float((cb.default_per_gpu_hour if cb else None) or 0)
    return (
        f"transform(toString(model), CAST({literal(models)}, 'Array(String)'), "
        f"CAST({literal([float(sheet[x]) for x in models])}, 'Array(Float64)'), {literal(default)})"
    )


def _energy_consts(cfg: RulesConfig) -> dict[str, str]:
    p = en.intensity_params(cfg.grid_intensity)
    return {
        "idle:Float64": literal(float(cfg.idle_threshold)),
        "min_idle:Float64": literal(float(cfg.min_idle_s)),
        "ci_cluster:Array(String)": f"CAST({literal(p['ci_cluster'])}, 'Array(String)')",
        "ci_start:Array(Float64)": f"CAST({literal(p['ci_start'])}, 'Array(Float64)')",
        "ci_g:Array(Float64)": f"CAST({literal(p['ci_g'])}, 'Array(Float64)')",
        "ci_has_default:UInt8": literal(p["ci_has_default"]),
        "ci_default:Float64": literal(p["ci_default"]),
    }


def energy_rows(cfg: RulesConfig) -> str:
    """rules.energy's per-row energy, one row per holder (``share``), over the dashboard's range."""
    q = en.holder_rows_sql(cfg.min_idle_s > 0)
    return for_grafana(q, **_energy_consts(cfg))


def energy_rows_by_bucket(cfg: RulesConfig) -> str:
    """:func:`energy_rows` split at the ``$__interval_s`` bucket edges (``bucket``, epoch seconds):
    a row's energy in each bucket is its part of the row's seconds there, as the GPU-seconds
    panels split their samples (rules.measures.split_by_bucket)."""
    q = m.split_by_bucket(
        en.holder_rows_sql(cfg.min_idle_s > 0), "$__interval_s", amount="joules",
        start="greatest(t, {from:Float64})", end="greatest(t, {from:Float64}) + secs",
    )  # fmt: skip
    return for_grafana(q, **_energy_consts(cfg))


def chargeback(cfg: RulesConfig) -> list[PanelSpec]:
    owners = f"FROM ({owner_rows(cfg)}) WHERE {var_filter('q', 'queue')}"
    alloc = m.OWNER_TERMS["allocated_s"]
    idle = m.term(m.OWNER_TERMS, "idle_s", OWNER_IDLE)
    nrg = f"FROM ({energy_rows(cfg)}) WHERE {var_filter('alloc_queue', 'queue')}"
    s = sql.JOIN_SETTINGS
    return [
        PanelSpec(
            "GPU-hours and the cost of the GPU-hours held, per account (unallocated share: gpuslo chargeback)",
            "table",
            f"SELECT account, round(sum({alloc} - {idle}) / 3600, 3) AS used_gpu_h, "
            f"round(sum({idle}) / 3600, 3) AS allocated_idle_gpu_h, "
            f"round(sum({alloc} * {_price(cfg)}) / 3600, 2) AS held_cost "
            f"{owners} GROUP BY account ORDER BY held_cost DESC, account {s}",
            width=24,
        ),
        PanelSpec(
            "Energy per account (kWh)",
            "bars",
            f"SELECT alloc_account AS account, round(sum({m.ENERGY_OWNER_TERMS['energy_j']}) / {literal(en.J_PER_KWH)}, 3) "
            f"AS kwh {nrg} GROUP BY account ORDER BY kwh DESC LIMIT 30 {s}",
        ),
        # an account's energy with no grid intensity is no carbon known, not zero carbon: its
        # kg_co2 is empty where none of its energy has one (the bar read 0), and the kWh without
        # one stand beside it (the bill's by_account_no_intensity_kwh)
        PanelSpec(
            "Carbon per account (kg CO2; kWh without grid intensity beside)",
            "bars",
            f"SELECT alloc_account AS account, if(sum({m.ENERGY_OWNER_TERMS['energy_no_intensity_j']}) "
            f">= sum({m.ENERGY_OWNER_TERMS['energy_j']}), NULL, "
            f"round(sum({m.ENERGY_OWNER_TERMS['co2_g']}) / 1000, 3)) AS kg_co2, "
            f"round(sum({m.ENERGY_OWNER_TERMS['energy_no_intensity_j']}) / {literal(en.J_PER_KWH)}, 3) "
            f"AS kwh_without_intensity {nrg} GROUP BY account ORDER BY kg_co2 DESC NULLS LAST, account LIMIT 30 {s}",
        ),
        PanelSpec(
            "Power drawn per account (W)",
            "timeseries",
            "SELECT toDateTime(bucket) AS time, alloc_account AS account, "
            f"sum({m.ENERGY_OWNER_TERMS['energy_j']}) / $__interval_s AS watts "
            f"FROM ({energy_rows_by_bucket(cfg)}) WHERE {var_filter('alloc_queue', 'queue')} GROUP BY time, account "
            f"ORDER BY time, account {s}",
            unit="watt",
            width=24,
        ),
    ]

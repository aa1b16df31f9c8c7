"""GPU energy and carbon per holder (job / pod, user, account, queue) and for the fleet, over a
window ``[from, to)``, from the energy counter (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``, mJ).

The definitions (docs/metrics.md#energy-and-carbon):
- A physical GPU's mean power over its sample at ``ts`` is the counter's delta to the GPU's next
  sample over the seconds between them, when the next sample is consecutive (at most twice the
  interval later: the rule that joins idle runs, rules.sql.IDLE_RUNS). A counter that went
  down was reset (driver reload, GPU reset): the delta is counted from the new value, the
  energy since the reset (what Prometheus' ``increase`` does). A delta implying more than the
  catalogue's plausible power, no next sample, a gap, or no counter: the sample's own
  ``DCGM_FI_DEV_POWER_USAGE`` stands for the interval, flagged ``estimated``. Neither: the
  seconds are ``unmeasured``. So an agent restart costs nothing when it is shorter than the gap
  bound, and across a longer gap only the energy between the samples (no sample stands for it,
  no capacity is counted there either) is left out.
- Each row's energy is that power x its fraction of the physical GPU (a MIG instance's slices;
  power is a device-level field, on the row of the GPU itself) x its seconds in the window.
- A holder draws its ``share`` of a row's energy; the rest of a capacity row is unallocated
  energy; the rest of a row outside capacity (node drained, GPU unhealthy) is reported apart.
  Allocated-idle energy is the holders' energy of capacity rows that are idle (the idle test of
  the rules, ``min_idle_s`` included).
- Carbon: energy x the cluster's grid intensity in force at the sample's start (rules config,
  ``energy.grid_intensity``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from gpuslo.ingest.sqltext import fill, literal
from gpuslo.ingest.store import Store
from gpuslo.rules import measures as m
from gpuslo.rules import sql
from gpuslo.rules.config import GridIntensity
from gpuslo.wire.fields import BY_NAME

COUNTER = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
POWER = "DCGM_FI_DEV_POWER_USAGE"
MAX_POWER_W = BY_NAME[POWER].hi  # a delta implying more is not a measurement
J_PER_KWH = 3.6e6

_CLUSTER = "({cluster:String} = '' OR cluster = {cluster:String})"
_LOOKBACK = f"{{from:Float64}} - {sql.longest_before(sql.MAX_INTERVAL_S)}"
# the next sample of the window's last one lies at most 2 x its interval after ``to``
_LOOKAHEAD = (
    f"{{to:Float64}} + 2 * (SELECT ifNull(max(interval_s), 0) FROM gpu_samples "
    f"WHERE ts >= toDateTime64({{to:Float64}} - {sql.MAX_INTERVAL_S}, 3, 'UTC') "
    f"AND ts < toDateTime64({{to:Float64}}, 3, 'UTC') AND {_CLUSTER})"
)

# Per physical GPU sample (the GPU's own row: mig_gi = -1): its mean power over the sample.
DEVICE_POWER = f"""
SELECT cluster, node, gpu, t AS dev_t, iv AS dev_iv,
    if(counter_ok, delta_mj / 1000 / (t_next - t), p) AS power_w,
    NOT counter_ok AS estimated
FROM
(
    SELECT toString(cluster) AS cluster, toString(node) AS node, gpu, toFloat64(ts) AS t, interval_s AS iv,
        {COUNTER} AS e, {POWER} AS p,
        leadInFrame(toNullable(toFloat64(ts)), 1) OVER w AS t_next,
        leadInFrame({COUNTER}, 1) OVER w AS e_next,
        -- a counter that went down was reset: the energy since the reset is its new value
        if(e_next >= e, e_next - e, e_next) AS delta_mj,
        ifNull(e_next IS NOT NULL AND e IS NOT NULL AND t_next > t AND t_next - t <= 2 * iv
               AND delta_mj / 1000 / (t_next - t) <= {literal(float(MAX_POWER_W))}, 0) AS counter_ok
    FROM gpu_samples FINAL
    WHERE mig_gi = -1 AND mig_ci = -1
      AND ts >= toDateTime64({_LOOKBACK}, 3, 'UTC')
      AND ts < toDateTime64({_LOOKAHEAD}, 3, 'UTC')
      AND {_CLUSTER}
    WINDOW w AS (PARTITION BY cluster, node, gpu ORDER BY ts ROWS BETWEEN CURRENT ROW AND 1 FOLLOWING)
)
"""

# The grid intensity per cluster as a table: (cluster, start, g/kWh), each value in force from
# its start to the next one's (a constant is one point at 0).
_INTENSITY = """
SELECT tupleElement(x, 1) AS cluster, tupleElement(x, 2) AS start, toNullable(tupleElement(x, 3)) AS g
FROM (SELECT arrayJoin(arrayZip({ci_cluster:Array(String)}, {ci_start:Array(Float64)}, {ci_g:Array(Float64)})) AS x)
"""

# One row per sample row of the window (CAPACITY_SAMPLES or IDLE_RUNS) with its energy terms.
_ENERGY_SAMPLES = f"""
SELECT e.*,
    -- a listed cluster has only its own series (none before its first row); the default is for the others
    if(has({{ci_cluster:Array(String)}}, toString(e.cluster)), i.g,
       if({{ci_has_default:UInt8}}, {{ci_default:Float64}}, NULL)) AS intensity
FROM
(
    SELECT c.cluster AS cluster, c.pool AS pool, c.model AS model, c.t AS t, c.cap_w AS cap_w,
        c.gpu_fraction AS gpu_fraction, c.alloc_share AS alloc_share, c.is_idle_row AS is_idle_row,
        c.alloc_ids AS alloc_ids, c.alloc_names AS alloc_names, c.alloc_users AS alloc_users,
        c.alloc_accounts AS alloc_accounts, c.alloc_queues AS alloc_queues, c.alloc_shares AS alloc_shares,
        greatest(0., least(c.t + c.interval_s, {{to:Float64}}) - greatest(c.t, {{from:Float64}})) AS secs,
        -- the GPU's sample that stands for this row (its own, or the GPU's row of a MIG instance)
        if(d.dev_t IS NOT NULL AND c.t - d.dev_t < d.dev_iv, d.power_w, NULL) AS power_w,
        power_w IS NOT NULL AS measured,
        ifNull(d.estimated, 0) AND measured AS estimated,
        if(measured, secs * power_w * c.gpu_fraction, 0) AS joules
    FROM (SELECT *, toString(cluster) AS cl, toString(node) AS nd, toFloat64(ts) AS t, {{is_idle}} AS is_idle_row
          FROM ({{samples}})) AS c
    ASOF LEFT JOIN ({DEVICE_POWER}) AS d
    ON c.cl = d.cluster AND c.nd = d.node AND c.gpu = d.gpu AND c.t >= d.dev_t
    WHERE secs > 0
) AS e
ASOF LEFT JOIN ({_INTENSITY}) AS i ON toString(e.cluster) = i.cluster AND e.t >= i.start
"""


def _samples(min_idle: bool) -> str:
    if min_idle:
        return fill(_ENERGY_SAMPLES, samples=sql.IDLE_RUNS, is_idle="idle_ok")
    return fill(_ENERGY_SAMPLES, samples=sql.CAPACITY_SAMPLES, is_idle=m.IDLE_TEST)


_FLEET = """
SELECT cluster, pool, model, {sums}
FROM ({samples})
GROUP BY cluster, pool, model
ORDER BY cluster, pool, model
{settings}
"""
# per holder and owner: an id the rows name with another user, account or queue (a Slurm job id
# used again after the controller's state was reset, a pod's owner label changed) is one entry
# per owner, so that each owner draws the energy of the rows it held, as its GPU-hours
_HOLDERS = """
SELECT cluster, pool, alloc_id AS id, any(alloc_name) AS name, alloc_user AS user,
    alloc_account AS account, alloc_queue AS queue, {sums}
FROM ({samples})
ARRAY JOIN alloc_ids AS alloc_id, alloc_names AS alloc_name, alloc_users AS alloc_user,
    alloc_accounts AS alloc_account, alloc_queues AS alloc_queue, alloc_shares AS share
WHERE empty({ids:Array(String)}) OR has({ids:Array(String)}, alloc_id)
GROUP BY cluster, pool, alloc_id, alloc_user, alloc_account, alloc_queue
ORDER BY cluster, pool, alloc_id, alloc_user, alloc_account, alloc_queue
{settings}
"""


_HOLDER_ROWS = """
SELECT *, alloc_id, alloc_name, alloc_user, alloc_account, alloc_queue, share
FROM ({samples})
ARRAY JOIN alloc_ids AS alloc_id, alloc_names AS alloc_name, alloc_users AS alloc_user,
    alloc_accounts AS alloc_account, alloc_queues AS alloc_queue, alloc_shares AS share
"""


def holder_rows_sql(min_idle: bool = False) -> str:
    """One row per sample row and holder (``share``, ``alloc_account``, ...) with the energy
    columns ENERGY_OWNER_TERMS sums: what the chargeback dashboard's panels aggregate."""
    return fill(_HOLDER_ROWS, samples=_samples(min_idle))


def _query(template: str, terms: dict[str, str], min_idle: bool) -> str:
    return fill(
        template, sums=m.sums(terms, "is_idle_row"), samples=_samples(min_idle), settings=sql.JOIN_SETTINGS
    )


ENERGY_FLEET = _query(_FLEET, m.ENERGY_FLEET_TERMS, False)
ENERGY_FLEET_MIN_IDLE = _query(_FLEET, m.ENERGY_FLEET_TERMS, True)
ENERGY_BY_HOLDER = _query(_HOLDERS, m.ENERGY_OWNER_TERMS, False)
ENERGY_BY_HOLDER_MIN_IDLE = _query(_HOLDERS, m.ENERGY_OWNER_TERMS, True)


@dataclass(frozen=True, slots=True)
class FleetEnergy:
    """One (cluster, pool, GPU model) group's energy (joules) and carbon (grams CO2) in the
    window (the chargeback shares a group's unallocated energy as it shares its GPU-hours)."""

    cluster: str
    pool: str
    model: str
    energy_j: float
    energy_estimated_j: float
    energy_held_j: float
    energy_allocated_idle_j: float
    energy_unallocated_j: float
    energy_outside_capacity_j: float
    energy_no_intensity_j: float
    co2_g: float
    unmeasured_s: float


@dataclass(frozen=True, slots=True)
class HolderEnergy:
    """One holder's energy (joules) and carbon in the window, in one (cluster, pool), for one
    owner (user, account, queue) of its id."""

    cluster: str
    pool: str
    id: str
    name: str
    user: str
    account: str
    queue: str
    energy_j: float
    energy_idle_j: float
    energy_estimated_j: float
    energy_no_intensity_j: float  # its part with no grid intensity: no carbon counted for it
    co2_g: float


def intensity_params(grid: GridIntensity | None) -> dict[str, Any]:
    """The grid intensity as the queries' ``{ci_*}`` parameters."""
    rows = [] if grid is None else grid.points()
    default = None if grid is None else grid.default_g_per_kwh
    return {
        "ci_cluster": [c for c, _, _ in rows],
        "ci_start": [float(t) for _, t, _ in rows],
        "ci_g": [float(g) for _, _, g in rows],
        "ci_has_default": int(default is not None),
        "ci_default": float(default or 0.0),
    }


def _params(
    frm: float, to: float, cluster: str, idle_threshold: float, min_idle_s: float, grid: GridIntensity | None
) -> dict[str, Any]:
    p: dict[str, Any] = {
        "from": float(frm),
        "to": float(to),
        "cluster": cluster,
        "idle": float(idle_threshold),
    }
    if min_idle_s > 0:
        p["min_idle"] = float(min_idle_s)
    return {**p, **intensity_params(grid)}


def _num(r: dict[str, Any], k: str) -> float:
    return float(r[k] or 0.0)


def fleet_energy(
    store: Store, frm: float, to: float, idle_threshold: float = 0.05, cluster: str = "",
    min_idle_s: float = 0.0, grid: GridIntensity | None = None,
) -> list[FleetEnergy]:  # fmt: skip
    """Per (cluster, pool, GPU model): the fleet's energy in ``[frm, to)``, split as the module says."""
    q = ENERGY_FLEET_MIN_IDLE if min_idle_s > 0 else ENERGY_FLEET
    rows = store.query(q, _params(frm, to, cluster, idle_threshold, min_idle_s, grid))
    names = [f.name for f in fields(FleetEnergy)][3:]
    return [
        FleetEnergy(str(r["cluster"]), str(r["pool"]), str(r["model"]), *(_num(r, n) for n in names))
        for r in rows
    ]


def holder_energy(
    store: Store, frm: float, to: float, idle_threshold: float = 0.05, cluster: str = "",
    min_idle_s: float = 0.0, grid: GridIntensity | None = None, ids: Sequence[str] = (),
) -> list[HolderEnergy]:  # fmt: skip
    """Per holder (job / pod) and (cluster, pool): its energy in ``[frm, to)`` (only the
    holders ``ids`` names, when given: a Slurm job id or a pod's namespace/name, as ``alloc_ids`` holds
    them). The per-job report and the chargeback use this; sum it per user / account / queue
    with :func:`by`, or over the (cluster, pool) rows of one holder."""
    q = ENERGY_BY_HOLDER_MIN_IDLE if min_idle_s > 0 else ENERGY_BY_HOLDER
    rows = store.query(q, {**_params(frm, to, cluster, idle_threshold, min_idle_s, grid), "ids": list(ids)})
    return [
        HolderEnergy(
            str(r["cluster"]),
            str(r["pool"]),
            str(r["id"]),
            str(r["name"]),
            str(r["user"]),
            str(r["account"]),
            str(r["queue"]),
            _num(r, "energy_j"),
            _num(r, "energy_idle_j"),
            _num(r, "energy_estimated_j"),
            _num(r, "energy_no_intensity_j"),
            _num(r, "co2_g"),
        )
        for r in rows
    ]


_BY_SUMS = ("energy_j", "energy_idle_j", "energy_estimated_j", "energy_no_intensity_j", "co2_g")


def by(holders: Iterable[HolderEnergy], key: str) -> dict[str, dict[str, float]]:
    """The holders' energy summed per ``key`` (``user``, ``account``, ``queue``, ``id``)."""
    out: dict[str, dict[str, float]] = {}
    for h in holders:
        d = out.setdefault(getattr(h, key), dict.fromkeys(_BY_SUMS, 0.0))
        for k in _BY_SUMS:
            d[k] += getattr(h, k)
    return dict(sorted(out.items()))


def kwh(joules: float) -> float:
    return joules / J_PER_KWH


def fleet_json(groups: Sequence[FleetEnergy]) -> dict[str, Any]:
    """The fleet's energy as ``demo --json`` / ``chargeback --json`` carry it (kWh, kg CO2)."""

    def tot(k: str) -> float:
        return float(sum(getattr(g, k) for g in groups))

    return {
        "energy_kwh": round(kwh(tot("energy_j")), 6),
        "held_kwh": round(kwh(tot("energy_held_j")), 6),
        "allocated_idle_kwh": round(kwh(tot("energy_allocated_idle_j")), 6),
        "unallocated_kwh": round(kwh(tot("energy_unallocated_j")), 6),
        "outside_capacity_kwh": round(kwh(tot("energy_outside_capacity_j")), 6),
        "estimated_kwh": round(kwh(tot("energy_estimated_j")), 6),
        "no_intensity_kwh": round(kwh(tot("energy_no_intensity_j")), 6),
        "co2_kg": round(tot("co2_g") / 1000.0, 6),
        "unmeasured_gpu_hours": round(tot("unmeasured_s") / 3600.0, 6),
    }


def measured(
    store: Store, cfg: Any, frm: float, to: float, cluster: str = ""
) -> tuple[list[FleetEnergy], list[HolderEnergy]]:
    """The fleet's groups and the holders of ``[frm, to)`` in the part of the fleet
    ``cfg.match`` covers (cluster and pool), with the config's idle test and grid intensity."""
    ok = cfg.match

    def keep(x: FleetEnergy | HolderEnergy) -> bool:
        return bool(ok.ok("cluster", x.cluster) and ok.ok("pool", x.pool))

    args = (store, frm, to, cfg.idle_threshold, cluster, cfg.min_idle_s, cfg.grid_intensity)
    return [g for g in fleet_energy(*args) if keep(g)], [h for h in holder_energy(*args) if keep(h)]


def summary_of(groups: Sequence[FleetEnergy], holders: Sequence[HolderEnergy]) -> dict[str, Any]:
    """The energy as ``demo --json`` (``energy.measured``) and ``chargeback --json`` (``energy``)
    carry it: the fleet's split, and each account's and user's own (its holders') kWh."""
    return {
        **fleet_json(groups),
        "by_account_kwh": {k: round(kwh(v["energy_j"]), 6) for k, v in by(holders, "account").items()},
        "by_user_kwh": {k: round(kwh(v["energy_j"]), 6) for k, v in by(holders, "user").items()},
        "by_account_co2_kg": {k: round(v["co2_g"] / 1000.0, 6) for k, v in by(holders, "account").items()},
        # the carbon above is of the energy with a grid intensity; this is the rest (0: none)
        "by_account_no_intensity_kwh": {
            k: round(kwh(v["energy_no_intensity_j"]), 6) for k, v in by(holders, "account").items()
        },
    }


def co2_words(energy: Mapping[str, Any], places: int) -> str:
    """The carbon of :func:`fleet_json`'s figures in words for a page or a terminal: energy with
    no grid intensity (a cluster not listed and no default, or before its series' first row) is
    said as such, never as zero carbon (a fleet with no intensity at all read "CO2 0.00 kg")."""
    co2, none, total = (float(energy.get(k) or 0) for k in ("co2_kg", "no_intensity_kwh", "energy_kwh"))
    if none <= 0:
        return f"{co2:.{places}f} kg CO2"
    if none >= total:
        return f"CO2 not known: no grid intensity for its {none:.{places}f} kWh"
    return f"{co2:.{places}f} kg CO2, and no grid intensity for {none:.{places}f} kWh more"


def summary_json(store: Store, cfg: Any, frm: float, to: float, cluster: str = "") -> dict[str, Any]:
    """:func:`summary_of` the window."""
    return summary_of(*measured(store, cfg, frm, to, cluster))

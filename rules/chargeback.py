"""Chargeback: the window's GPU-hours and energy per account (and per user and queue), split
into used, allocated-idle and a share of unallocated capacity, priced by the rules config's
price sheet (docs/operations.md#chargeback).

The GPU-seconds are the rules' own terms (rules.measures FLEET_TERMS and OWNER_TERMS over
rules.sql CAPACITY_SAMPLES, or IDLE_RUNS with ``min_idle_s``), grouped by GPU model as well: the
totals are the numbers ``rules eval`` reports. Energy is rules.energy's.

Money is exact: prices are Decimals, the window's cost is computed unrounded and rounded once to
the cent (half to even); the cents are shared out over the lines by largest remainder (ties to
the line first in name order), so the lines add up to the total exactly. GPU-hours and kWh are
shown to 6 decimals, shared out the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from gpuslo.ingest.sqltext import fill
from gpuslo.ingest.store import Store
from gpuslo.rules import energy as en
from gpuslo.rules import measures as m
from gpuslo.rules import rawcover, sql
from gpuslo.rules import rightsize as rs
from gpuslo.rules.config import Chargeback, RulesConfig, UnallocatedTo

CENT = Decimal("0.01")
HOURS_PLACES = 6

_FLEET = f"""
SELECT cluster, pool, model, {{sums}}
FROM ({{samples}})
WHERE cap_s > 0
GROUP BY cluster, pool, model
ORDER BY cluster, pool, model
{sql.JOIN_SETTINGS}
"""
_HOLDERS = f"""
SELECT cluster, pool, model, alloc_account AS account, alloc_user AS user, alloc_queue AS queue, {{sums}}
FROM ({{samples}})
ARRAY JOIN alloc_accounts AS alloc_account, alloc_users AS alloc_user, alloc_queues AS alloc_queue,
    alloc_shares AS share, alloc_act_shares AS act_share
WHERE cap_s > 0
GROUP BY cluster, pool, model, account, user, queue
ORDER BY cluster, pool, model, account, user, queue
{sql.JOIN_SETTINGS}
"""
_OWNER_SUMS = ("allocated_s", "idle_s")
GPU_BY_MODEL = fill(_FLEET, sums=m.sums(m.FLEET_TERMS), samples=sql.CAPACITY_SAMPLES)
GPU_BY_MODEL_MIN_IDLE = fill(_FLEET, sums=m.sums(m.FLEET_TERMS, "idle_ok"), samples=sql.IDLE_RUNS)
HOLDERS_BY_MODEL = fill(_HOLDERS, sums=m.sums(m.OWNER_TERMS, names=_OWNER_SUMS), samples=sql.CAPACITY_SAMPLES)
HOLDERS_BY_MODEL_MIN_IDLE = fill(
    _HOLDERS, sums=m.sums(m.OWNER_TERMS, "idle_ok", names=_OWNER_SUMS), samples=sql.IDLE_RUNS
)

Key = tuple[str, str, str]  # (account, user, queue)


class ChargebackError(ValueError):
    """The rules config has no price sheet, or the window's raw rows are gone."""


class RawRowsGone(ChargebackError, rawcover.RawRowsGone):
    """The minute rollups hold capacity in the window that its raw rows no longer have (past
    the store's retention, or deleted): a bill of what is left would be a smaller bill passed
    off as a whole one (the bill needs the raw rows: each sample's GPU model and holders)."""


@dataclass(slots=True)
class _Line:
    used_s: float = 0.0
    idle_s: float = 0.0
    unalloc_s: float = 0.0
    energy_j: float = 0.0
    gpu_cost: Decimal = field(default_factory=Decimal)  # unrounded
    energy_cost: Decimal = field(default_factory=Decimal)


@dataclass(frozen=True, slots=True)
class Bill:
    """The chargeback of one window; :meth:`to_json` is ``chargeback --json``."""

    window: dict[str, Any]
    currency: str
    unallocated_mode: str
    lines: dict[Key, _Line]
    totals: dict[str, Any]
    unpriced: tuple[dict[str, Any], ...]
    energy: dict[str, Any]
    # per account and MIG profile: jobs that would have fit that slice, GPU-hours to give back
    # (rules.rightsize, the per-job report's and the Workloads panel's rule)
    rightsize: tuple[dict[str, Any], ...] = ()
    # the totals of HOURS_COLUMNS unrounded (``totals`` has them at HOURS_PLACES), so that a total
    # shown at fewer places is rounded once
    exact: dict[str, float] = field(default_factory=dict)

    def rows(self, dim: str, places: int = HOURS_PLACES) -> list[dict[str, Any]]:
        """One row per account, user or queue (``dim``), the lines summed, money to the cent,
        GPU-hours and kWh to ``places`` decimals adding up to :meth:`totals_at` ``places``
        (a page showing 2 places asks for 2: each row's own 6 rounded were 0.33 x 3 for 1.00)."""
        i = {"account": 0, "user": 1, "queue": 2}[dim]
        groups: dict[str, list[_Line]] = {}
        for k, line in self.lines.items():
            groups.setdefault(k[i], []).append(line)
        return _rounded(dim, groups, {**self.totals, **self.exact}, places)

    def totals_at(self, places: int) -> dict[str, Any]:
        """The totals with GPU-hours and kWh to ``places`` decimals (half to even), each the total
        rounded once (its 6-place figure rounded again was 0.02 for 0.025000416 GPU-h)."""
        return {
            **self.totals,
            **{k: at_places(self.exact.get(k, self.totals[k]), places) for k in HOURS_COLUMNS},
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "currency": self.currency,
            "unallocated": self.unallocated_mode,
            "accounts": self.rows("account"),
            "users": self.rows("user"),
            "queues": self.rows("queue"),
            "totals": self.totals,
            "unpriced": list(self.unpriced),
            "energy": self.energy,
            "rightsize": list(self.rightsize),
        }


def apportion(total: int, weights: Sequence[float | Decimal]) -> list[int]:
    """``total`` units shared in proportion to ``weights`` (largest remainder; ties to the lower
    index): the parts add up to ``total`` exactly. No weight: all to nobody (zeros), unless the
    total is not zero, then equally by the same rule."""
    n = len(weights)
    if n == 0:
        return []
    w = [max(Decimal(0), Decimal(x)) for x in weights]
    s = sum(w, Decimal(0))
    if s == 0:
        w, s = [Decimal(1)] * n, Decimal(n)
    exact = [Decimal(total) * x / s for x in w]
    parts = [int(e.to_integral_value(rounding="ROUND_FLOOR")) for e in exact]
    left = total - sum(parts)
    order = sorted(range(n), key=lambda j: (-(exact[j] - parts[j]), j))
    for j in order[: max(0, left)]:
        parts[j] += 1
    return parts


def _units(x: float, places: int = HOURS_PLACES) -> int:
    return int(Decimal(repr(x)).scaleb(places).to_integral_value(rounding=ROUND_HALF_EVEN))


def _cents(x: Decimal) -> int:
    return int(x.quantize(CENT, rounding=ROUND_HALF_EVEN).scaleb(2))


def _money(cents: int) -> str:
    return str(Decimal(cents).scaleb(-2).quantize(CENT))


def _shown(units: int, places: int = HOURS_PLACES) -> float:
    return float(Decimal(units).scaleb(-places))


def at_places(x: float, places: int) -> float:
    """GPU-hours or kWh to ``places`` decimals (half to even); :meth:`Bill.totals_at` rounds the
    unrounded totals with it, which :meth:`Bill.rows` with ``places`` adds up to."""
    return _shown(_units(x, places), places)


_SHOWN = (
    ("gpu_hours_used", "used_s", 3600.0),
    ("gpu_hours_allocated_idle", "idle_s", 3600.0),
    ("gpu_hours_unallocated_share", "unalloc_s", 3600.0),
    ("energy_kwh", "energy_j", en.J_PER_KWH),
)
HOURS_COLUMNS = tuple(col for col, _attr, _per in _SHOWN)  # a row's GPU-hours and kWh


def _rounded(
    dim: str, groups: Mapping[str, list[_Line]], totals: Mapping[str, Any], places: int = HOURS_PLACES
) -> list[dict[str, Any]]:
    """Rows whose columns add up exactly to the totals' at ``places`` (largest remainder per column)."""
    names = sorted(groups)
    out: list[dict[str, Any]] = [{dim: n} for n in names]
    for col, attr, per in _SHOWN:
        vals = [sum(getattr(x, attr) for x in groups[n]) / per for n in names]
        for row, u in zip(out, apportion(_units(totals[col], places), vals), strict=True):
            row[col] = _shown(u, places)
    gpu = apportion(
        _cents(Decimal(totals["cost_gpu"])), [sum((x.gpu_cost for x in groups[n]), Decimal(0)) for n in names]
    )
    nrg = apportion(
        _cents(Decimal(totals["cost_energy"])),
        [sum((x.energy_cost for x in groups[n]), Decimal(0)) for n in names],
    )
    for row, g, e in zip(out, gpu, nrg, strict=True):
        row["cost_gpu"], row["cost_energy"], row["cost"] = _money(g), _money(e), _money(g + e)
    return out


def _gpu_rows(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    p: dict[str, Any] = {"from": float(frm), "to": float(to), "cluster": cluster, "idle": cfg.idle_threshold}
    if cfg.min_idle_s > 0:
        p["min_idle"] = cfg.min_idle_s
        fleet, holders = GPU_BY_MODEL_MIN_IDLE, HOLDERS_BY_MODEL_MIN_IDLE
    else:
        fleet, holders = GPU_BY_MODEL, HOLDERS_BY_MODEL
    ok = cfg.match

    def keep(r: dict[str, Any]) -> bool:
        return ok.ok("cluster", str(r["cluster"])) and ok.ok("pool", str(r["pool"]))

    groups = store.query(fleet, p)
    _raw_rows_kept(store, cfg, frm, to, cluster)
    return [r for r in groups if keep(r)], [r for r in store.query(holders, p) if keep(r)]


def _raw_rows_kept(store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str) -> None:
    """Raise :class:`RawRowsGone` where the raw rows of part of the window are gone (on a node of a
    cluster the bill covers; :func:`rules.rawcover.check`)."""
    rawcover.check(
        store, frm, to, cluster, "a bill needs the raw rows (each sample's GPU model and holders)",
        keep=lambda c: cfg.match.ok("cluster", c), gone=RawRowsGone,
    )  # fmt: skip


def compute(store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str = "") -> Bill:
    """The bill of ``[frm, to)`` (every cluster, or ``cluster``), over the raw rows."""
    cb = cfg.chargeback
    if cb is None:
        raise ChargebackError("the rules config has no `chargeback:` price sheet (see rules/example.yaml)")
    groups, holders = _gpu_rows(store, cfg, frm, to, cluster)
    lines: dict[Key, _Line] = {}
    unpriced: dict[tuple[str, str], float] = {}
    cap_cost = Decimal(0)
    tot = dict.fromkeys(
        ("capacity_s", "allocated_s", "active_s", "idle_allocated_s", "idle_unallocated_s"), 0.0
    )
    by_group: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for h in holders:
        by_group.setdefault((str(h["cluster"]), str(h["pool"]), str(h["model"])), []).append(h)
    unalloc_charged_s = 0.0
    for g in groups:
        gk = (str(g["cluster"]), str(g["pool"]), str(g["model"]))
        for k in tot:
            tot[k] += float(g[k] or 0)
        price = cb.price(gk[2])
        cap_h = float(g["capacity_s"] or 0) / 3600.0
        if price is None:
            unpriced[(gk[0], gk[2])] = unpriced.get((gk[0], gk[2]), 0.0) + cap_h
            price = Decimal(0)
        cap_cost += price * Decimal(repr(cap_h))
        unalloc = max(0.0, float(g["capacity_s"] or 0) - float(g["allocated_s"] or 0))
        members = by_group.get(gk, [])
        shares = _unallocated_shares(cb, unalloc, members)
        for key, s in shares.items():
            unalloc_charged_s += s
            line = lines.setdefault(key, _Line())
            line.unalloc_s += s
            line.gpu_cost += price * Decimal(repr(s / 3600.0))
        for h in members:
            line = lines.setdefault(_key(h), _Line())
            a, i = float(h["allocated_s"] or 0), float(h["idle_s"] or 0)
            line.used_s += a - i
            line.idle_s += i
            line.gpu_cost += price * Decimal(repr(a / 3600.0))
    fleet_e, hold_e = en.measured(store, cfg, frm, to, cluster)
    energy_charged = _charge_energy(cb, lines, holders, fleet_e, hold_e)
    for line in lines.values():
        line.energy_cost = cb.per_kwh * Decimal(repr(en.kwh(line.energy_j)))
    gpu_charged = sum((x.gpu_cost for x in lines.values()), Decimal(0))
    cap_cents = _cents(cap_cost)
    gpu_cents = min(cap_cents, _cents(gpu_charged))
    energy_cents = _cents(cb.per_kwh * Decimal(repr(en.kwh(energy_charged))))
    # used and allocated-idle: the holders' own, which the lines add up to (on a GPU whose split
    # was measured, the idle holder's allocated-idle is not the fleet's); the rest the fleet's
    used = sum(x.used_s for x in lines.values())
    idle = sum(x.idle_s for x in lines.values())
    exact = {
        "gpu_hours_used": used / 3600.0,
        "gpu_hours_allocated_idle": idle / 3600.0,
        "gpu_hours_unallocated_share": unalloc_charged_s / 3600.0,
        "energy_kwh": en.kwh(energy_charged),
    }
    totals = {
        "gpu_hours_capacity": _shown(_units(tot["capacity_s"] / 3600.0)),
        "gpu_hours_allocated": _shown(_units(tot["allocated_s"] / 3600.0)),
        "gpu_hours_used": _shown(_units(exact["gpu_hours_used"])),
        "gpu_hours_allocated_idle": _shown(_units(exact["gpu_hours_allocated_idle"])),
        "gpu_hours_unallocated": _shown(_units(max(0.0, tot["capacity_s"] - tot["allocated_s"]) / 3600.0)),
        "gpu_hours_unallocated_share": _shown(_units(exact["gpu_hours_unallocated_share"])),
        "energy_kwh": _shown(_units(exact["energy_kwh"])),
        "capacity_cost": _money(cap_cents),
        "cost_gpu": _money(gpu_cents),
        "cost_energy": _money(energy_cents),
        "cost": _money(gpu_cents + energy_cents),
        "uncharged_cost": _money(cap_cents - gpu_cents),
    }
    window = {"from": float(frm), "to": float(to), "cluster": cluster or None}
    mode = cb.unallocated if isinstance(cb.unallocated, str) else f"account:{cb.unallocated.account}"
    return Bill(
        window, cb.currency, mode, lines, totals,
        tuple({"cluster": c, "model": mdl, "gpu_hours": round(hrs, HOURS_PLACES)} for (c, mdl), hrs in sorted(unpriced.items())),
        en.summary_of(fleet_e, hold_e),
        tuple(asdict(a) for a in _rightsizing(store, cfg, frm, to, cluster)), exact,
    )  # fmt: skip


def _rightsizing(
    store: Store, cfg: RulesConfig, frm: float, to: float, cluster: str
) -> tuple[rs.AccountAdvice, ...]:
    """rules.rightsize's advice per account, over the jobs of the part of the fleet the bill covers
    (``match.cluster`` and ``match.pool``, as its GPU-hours)."""
    ok = cfg.match
    jobs = rs.job_advice(store, frm, to, cluster)
    return rs.by_account([j for j in jobs if ok.ok("cluster", j.cluster) and ok.ok("pool", j.pool)])


def _key(h: Mapping[str, Any] | en.HolderEnergy) -> Key:
    if isinstance(h, en.HolderEnergy):
        return (h.account, h.user, h.queue)
    return (str(h["account"]), str(h["user"]), str(h["queue"]))


def _unallocated_shares(
    cb: Chargeback, unalloc_s: float, members: Iterable[Mapping[str, Any]]
) -> dict[Key, float]:
    """Who pays for one (cluster, pool, model) group's unallocated GPU-seconds."""
    if unalloc_s <= 0 or cb.unallocated == "none":
        return {}
    if isinstance(cb.unallocated, UnallocatedTo):
        return {(cb.unallocated.account, "", ""): unalloc_s}
    weights: dict[Key, float] = {}
    for h in members:
        weights[_key(h)] = weights.get(_key(h), 0.0) + float(h["allocated_s"] or 0)
    total = sum(weights.values())
    if total <= 0:
        return {}  # nobody used the group: nobody to share it with (uncharged)
    return {k: unalloc_s * w / total for k, w in weights.items()}


def _charge_energy(
    cb: Chargeback, lines: dict[Key, _Line], holders: Sequence[Mapping[str, Any]],
    fleet_e: Sequence[en.FleetEnergy], hold_e: Sequence[en.HolderEnergy],
) -> float:  # fmt: skip
    """Each line's energy: its holders' own, and its share of unallocated energy by the same
    rule as unallocated GPU-hours (per cluster, pool and GPU model, weighted by allocated
    GPU-seconds there: a group nobody held is not charged, its energy no more than its hours).
    Returns the energy charged in all (joules)."""
    charged = 0.0
    for e in hold_e:
        lines.setdefault(_key(e), _Line()).energy_j += e.energy_j
        charged += e.energy_j
    by_group: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for h in holders:
        by_group.setdefault((str(h["cluster"]), str(h["pool"]), str(h["model"])), []).append(h)
    for f in fleet_e:
        for k, j in _unallocated_shares(
            cb, f.energy_unallocated_j, by_group.get((f.cluster, f.pool, f.model), [])
        ).items():
            lines.setdefault(k, _Line()).energy_j += j
            charged += j
    return charged

"""Each number defined once, as SQL: the rules engine (rules/sql.py), the rollups
(rules/rollup.py), every dashboard panel and the report build their queries from these
terms, so a number cannot mean two things (docs/metrics.md).

Per-sample terms are summed over the rows of ``rules.sql.CAPACITY_SAMPLES`` (``cap_s``: the
sample's capacity seconds inside the window). ``{is_idle}`` is the idle test: ``activity <
{idle:Float64}``, or ``idle_ok`` with a minimum idle duration (``rules.sql.IDLE_RUNS``).
"""

from __future__ import annotations

import re

from gpuslo.ingest.sqltext import fill, literal

IDLE_TEST = "activity < {idle:Float64}"

# the fleet's GPU-seconds: name -> per-sample term
FLEET_TERMS: dict[str, str] = {
    "capacity_s": "cap_s",
    "allocated_s": "cap_s * alloc_share",
    "active_s": "cap_s * activity",
    "idle_allocated_s": "if({is_idle}, cap_s * alloc_share, 0)",
    "idle_unallocated_s": "if({is_idle}, cap_s * (1 - alloc_share), 0)",
}
# one holder's (job / pod) GPU-seconds, on rows ARRAY JOINed over its ``share`` of the GPU and
# ``act_share``, its part of the GPU's activity (gpuslo.wire.Allocation.activity_share: measured
# from its processes on a shared GPU, else its share). Its activity on what it holds is
# HOLDER_ACTIVITY: the GPU's own for a sole holder or an equal split; on a shared GPU split by
# measurement, 0 for a holder whose processes did nothing (it is idle while the GPU is busy), and
# above the GPU's for the one that did the work (it used what the idle ones held).
HOLDER_ACTIVITY = "(activity * act_share / share)"
OWNER_TERMS: dict[str, str] = {
    "allocated_s": "cap_s * share",
    "active_s": f"cap_s * share * {HOLDER_ACTIVITY}",
    "idle_s": "if({is_idle}, cap_s * share, 0)",
}
# ratios of the sums above (NULL without capacity)
CUR_ALLOCATION = "allocated_s / nullIf(capacity_s, 0)"
CUR_ACTIVE = "active_s / nullIf(capacity_s, 0)"

# requests of a latency row at or under the threshold (the SLO's "good" requests)
GOOD = "arraySum(arrayMap((c, b) -> if(b <= {threshold:Float64}, c, 0), arrayPopBack(counts), bounds_ms))"


def holder_idle(is_idle: str) -> str:
    """An idle test on the GPU's ``activity`` made the holder's (HOLDER_ACTIVITY). A test
    that is a column (``idle_ok``: the GPU's runs of idle samples) stays the GPU's."""
    return re.sub(r"\bactivity\b", HOLDER_ACTIVITY, is_idle)


def term(terms: dict[str, str], name: str, is_idle: str = IDLE_TEST) -> str:
    """A term with its idle test (where it has one): for OWNER_TERMS, the holder's."""
    return fill(terms[name], optional={"is_idle": holder_idle(is_idle) if terms is OWNER_TERMS else is_idle})


def sums(terms: dict[str, str], is_idle: str = IDLE_TEST, names: tuple[str, ...] | None = None) -> str:
    """``sum(term) AS name, ...`` for the named terms (all of them by default)."""
    return ",\n    ".join(f"sum({term(terms, n, is_idle)}) AS {n}" for n in (names or tuple(terms)))


def sli(good: str = "good", total: str = "total") -> str:
    return f"{good} / nullIf({total}, 0)"


def burn(objective: float, good: str = "good", total: str = "total") -> str:
    """(1 - SLI) / (1 - objective)."""
    return f"(1 - {sli(good, total)}) / {literal(1 - objective)}"


def budget_remaining(objective: float, good: str = "good", total: str = "total") -> str:
    """1 - bad / (total * (1 - objective)) over the SLO period."""
    return f"1 - ({total} - {good}) / nullIf({total} * {literal(1 - objective)}, 0)"


def split_by_bucket(
    source: str, bucket_s: str, origin: str = "0", amount: str = "cap_s",
    start: str = "greatest(toFloat64(ts), {from:Float64})", end: str = "least(toFloat64(ts) + interval_s, {to:Float64})",
) -> str:  # fmt: skip
    """The rows of ``source`` (CAPACITY_SAMPLES-shaped) split at bucket edges ``origin + k *
    bucket_s``: each row once per bucket its clipped interval overlaps, with ``cap_s`` scaled to
    the overlap and the bucket's start as ``bucket``. A sample longer than a bucket, or crossing
    an edge, counts in each bucket for the seconds it spends there, as the engine counts it for
    a window equal to that bucket. ``amount`` names the column so split (a row's ``joules``
    for rules.energy's rows, whose clipped interval is ``[start, end)``)."""
    return f"""
SELECT * REPLACE ({amount} * (least(end_t, bucket + {bucket_s}) - greatest(start_t, bucket)) / (end_t - start_t) AS {amount})
FROM
(
    SELECT *, {start} AS start_t, {end} AS end_t,
        arrayJoin(arrayMap(k -> toFloat64({origin} + k * {bucket_s}),
            range(toInt64(floor((start_t - {origin}) / {bucket_s})),
                  toInt64(ceil((end_t - {origin}) / {bucket_s}))))) AS bucket
    FROM ({source})
    WHERE {amount} > 0
)
"""


# ---------------------------------------------------------------------------- energy (rules/energy.py)
# Per-sample terms over rules.energy's ENERGY_SAMPLES: ``joules`` is the row's energy inside the
# window (its physical GPU's mean power over the sample x the row's fraction of that GPU x its
# seconds in the window: drawn whatever the node's state), ``estimated`` says the power is
# POWER_USAGE (no usable counter delta), ``measured`` that it is known at all, ``intensity`` the
# cluster's grid intensity (gCO2/kWh) in force at the sample's start (NULL: none configured).
# A holder draws its share of the row's energy wherever it holds it; allocated-idle and
# unallocated energy are of capacity rows only (docs/metrics.md), the rest is outside capacity.
ENERGY_FLEET_TERMS: dict[str, str] = {
    "energy_j": "joules",
    "energy_estimated_j": "if(estimated, joules, 0)",
    "energy_held_j": "joules * alloc_share",
    "energy_allocated_idle_j": "if(cap_w > 0 AND {is_idle}, joules * alloc_share, 0)",
    "energy_unallocated_j": "if(cap_w > 0, joules * (1 - alloc_share), 0)",
    "energy_outside_capacity_j": "if(cap_w > 0, 0, joules * (1 - alloc_share))",
    "energy_no_intensity_j": "if(intensity IS NULL, joules, 0)",
    "co2_g": "ifNull(joules * intensity / 3.6e6, 0)",
    "unmeasured_s": "if(measured, 0, secs * gpu_fraction)",
}
ENERGY_OWNER_TERMS: dict[str, str] = {
    "energy_j": "joules * share",
    "energy_idle_j": "if(cap_w > 0 AND {is_idle}, joules * share, 0)",
    "energy_estimated_j": "if(estimated, joules * share, 0)",
    "energy_no_intensity_j": "if(intensity IS NULL, joules * share, 0)",
    "co2_g": "ifNull(joules * share * intensity / 3.6e6, 0)",
}

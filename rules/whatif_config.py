"""The what-if replay's configuration (the ``whatif:`` key of the rules config): the fair-share
priority's weights, shares and half-life, the back-fill scan's bound, how far back the loader
looks for requests still pending or running at the window's start. Frozen models, unknown keys
rejected, units in names (:mod:`rules.config`); docs/whatif.md says what each one does."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gpuslo.core.configmodel import ConfigModel

DAY_S = 86_400.0
Seconds = Annotated[float, Field(gt=0, le=400 * DAY_S, allow_inf_nan=False)]
Weight = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
Share = Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)]
Discipline = Literal["strict", "first-fit", "backfill"]


_M = ConfigModel  # frozen, unknown keys rejected, every float finite, no boolean for a number


class FairShare(_M):
    """Slurm's multifactor priority, two of its factors: ``priority = weight_age × age_factor +
    weight_fairshare × fairshare_factor``; ``age_factor = min(1, age / max_age_s)``;
    ``fairshare_factor = 2^(-usage / share)``, both normalised over the accounts (Slurm's
    classic formula), usage being the GPU-seconds held, decayed with ``half_life_s``. The
    defaults are Slurm's (PriorityMaxAge and PriorityDecayHalfLife 7 days, PriorityCalcPeriod
    5 minutes) with the weights its documentation's example uses."""

    weight_age: Weight = 1000.0
    weight_fairshare: Weight = 10000.0
    max_age_s: Seconds = 7 * DAY_S
    half_life_s: Seconds = 7 * DAY_S
    calc_period_s: Seconds = 300.0
    shares: dict[str, Share] = Field(default_factory=dict)  # account -> its share (raw, normalised)
    default_share: Share = 1.0  # an account not listed
    discipline: Discipline = "backfill"  # how the priority order is served (Slurm: sched/backfill)


class Backfill(_M):
    # at most this many requests behind the head are tried per pass (Slurm's bf_max_job_test)
    max_job_test: Annotated[int, Field(ge=1, le=10_000_000)] = 1000
    # use a recorded time limit as the run-time estimate where one exists (none is recorded today)
    use_time_limits: bool = False


Gpus = Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)]


class Limits(_M):
    """Limits every policy applies (the recorded column excepted): a request that would take
    its user's (account's) GPUs held at once over the limit is skipped, as Slurm skips a job
    held by a QOS limit (``MaxTRESPerUser=gres/gpu=N``: reason QOSMaxGRESPerUser;
    ``GrpTRES=gres/gpu=N`` on the account); it never blocks a queue. ``None``: no limit."""

    user_gpus: Gpus | None = None
    account_gpus: Gpus | None = None


class FirstFit(_M):
    # a request pending this long that cannot start blocks every later one in first-fit order
    # until it starts (Slurm's top-priority job held back by a reservation); None: never
    reserve_after_s: Seconds | None = None


class WhatIf(_M):
    fairshare: FairShare = Field(default_factory=FairShare)
    backfill: Backfill = Field(default_factory=Backfill)
    limits: Limits = Field(default_factory=Limits)
    first_fit: FirstFit = Field(default_factory=FirstFit)
    # requests submitted this long before the window's start are looked at (still pending or
    # running at the start)
    lookback_s: Seconds = 30 * DAY_S

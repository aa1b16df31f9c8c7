"""The typed result of one evaluation (:func:`gpuslo.rules.evaluate.summary`): what the text
summary, the alerts, the ``rule_results`` rows, the report and the JSON of ``rules eval
--json`` / ``rules run`` / ``demo --json`` read. Frozen dataclasses, so a renamed field fails
the type check in every reader; :func:`to_json` writes the JSON form, field by field in
declaration order (a field's ``json`` metadata names its key there, ``SKIP`` leaves it out).

Frozen all through: lists are tuples, and mappings read-only views (``types.MappingProxyType``).
Numbers are rounded as the JSON shows them (GPU-hours to 4 places, ratios to 6); ``None`` where
the window has no capacity (or no requests) to divide by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final, Literal

from gpuslo.rules.config import row_hold_s
from gpuslo.wire.models import StarvationCause

Cause = StarvationCause  # the wire's causes (a scheduler may give one): the summary has no others
CAUSES: Final[tuple[Cause, ...]] = ("capacity", "fragmentation", "policy")
Over = Literal["rollups", "raw rows"]

SKIP: Final = "\0skip"  # a ``json`` metadata value: the field is not in the JSON form


@dataclass(frozen=True, slots=True)
class Window:
    """The evaluated window ``[from, to)`` (epoch seconds), its cluster (``None``: all) and
    what it was computed over."""

    from_: float = field(metadata={"json": "from"})
    to: float
    cluster: str | None
    over: Over


@dataclass(frozen=True, slots=True)
class PoolSummary:
    """One (cluster, pool) group with a named pool."""

    cluster: str
    pool: str
    capacity_gpu_hours: float | None
    cur_allocation: float | None
    cur_active: float | None
    idle_allocated_gpu_hours: float | None
    idle_unallocated_gpu_hours: float | None


@dataclass(slots=True)
class Incident:
    """A starvation incident opened in the window. (Not frozen: a month of a big fleet's queue is
    100,000 of them, and a frozen dataclass's ``__init__`` costs 4.5 times a plain one's.)"""

    request_id: str
    cluster: str
    scheduler: str
    queue: str
    user: str
    account: str
    gpus: float  # GPUs per node × nodes
    nodes: int
    opened: float
    closed: float | None  # None: still open at the end of the window
    closed_by: str | None  # start, cancel or end; None while open
    wait_s: float | None  # submit to close (or to the window's end while open)
    free_gpus_at_open: float | None
    cause: Cause
    reason: str | None  # the scheduler's pending reason at the opening (None: it gave none)


@dataclass(frozen=True, slots=True)
class IdleHolder:
    """A job or pod and its allocated and allocated-idle GPU-hours in the window. (Its JSON keys
    are ``allocated_s`` and ``idle_s``, as they have always been, though they hold GPU-hours.)"""

    cluster: str
    id: str
    name: str
    user: str
    account: str
    queue: str
    allocated_gpu_hours: float | None = field(metadata={"json": "allocated_s"})
    idle_gpu_hours: float | None = field(metadata={"json": "idle_s"})


@dataclass(frozen=True, slots=True)
class FairShare:
    """An account's share of the allocated GPU-seconds and of the GPUs requested, both over the
    matched part of the fleet (the shares of the listed accounts add up to 1)."""

    account: str
    allocated_gpu_hours: float | None
    share_allocated: float | None
    gpus_requested: float
    share_requested: float | None


@dataclass(frozen=True, slots=True)
class SloAlert:
    slo: str
    service: str
    severity: str
    long_window: str
    short_window: str
    factor: float
    started: float
    ended: float | None  # None: still firing at the end of the window
    peak_burn_long: float
    peak_burn_short: float
    firing_minutes: float = 0.0  # evaluation steps it fired, in minutes


@dataclass(frozen=True, slots=True)
class SloHeldBack:
    """An interval in which both windows burned faster than the factor, yet no alert fired
    because the short window saw fewer than ``min_requests`` requests (the traffic guard)."""

    slo: str
    service: str
    severity: str
    long_window: str
    short_window: str
    factor: float
    started: float
    ended: float | None  # None: still held back at the end of the window
    minutes: float
    min_requests: int
    max_short_requests: int  # the most requests the short window saw meanwhile


@dataclass(frozen=True, slots=True)
class SeverityMinutes:
    """The minutes in which any window pair of one severity fired, and those in which one was
    held back by the traffic guard while none fired."""

    firing_minutes: float
    held_back_minutes: float


@dataclass(frozen=True, slots=True)
class SloStatus:
    slo: str
    service: str
    objective: float
    threshold_ms: float
    total: int
    good: int
    sli: float | None
    burn: float | None
    budget_remaining: float | None  # over the SLO period ending at ``to``
    p99_ms: float | None
    error: str = ""
    # the end of the minute of the service's latest histogram row (in the SLO period, else
    # before it; None: none ever), over raw rows and rollups alike
    last_data_at: float | None = None
    # set when that is more than the SLO's no_data_s before the evaluation's end
    no_data_since: float | None = None
    # no row of the service ever (at or before the evaluation's end), while the cluster's
    # agents have sent heartbeats for more than the SLO's no_data_s (within its period)
    never_seen: bool = False
    # the interval_s the SLO is judged by: of the service's sources whose latest row still stands
    # (younger than max(no_data_s, rules.config.row_hold_s of its interval)), the shortest bound's;
    # with none standing, the latest row's (None: no row, or its raw rows no longer kept)
    # (not in the JSON, nor in a summary's equality: over rollups whose raw rows are gone it is
    # not known, and the numbers of the two sources are the same wherever the raw rows are kept;
    # no_data_after_s is what it sets. A summary over rollups after the raw rows' TTL compared
    # unequal to the same one before it, for this alone: `bench rules`' same_without_raw)
    data_interval_s: float | None = field(default=None, compare=False, metadata={"json": SKIP})
    # how long without a standing row the SLO is not evaluable: no_data_s, or twice the interval
    # above (up to a whole minute) where that is longer
    no_data_after_s: int | None = None
    # the window pairs ("1h/5m") not judged at the evaluation's end: their short window is shorter
    # than that bound, so it may hold none of the rows while the SLO is evaluable (their alerts
    # fired and resolved with every row); their burn alerts stay as they were
    unjudged_windows: tuple[str, ...] = ()
    # in the summary's JSON at its top level (slo_alerts, slo_held_back, slo_minutes), not here
    alerts: tuple[SloAlert, ...] = field(default=(), metadata={"json": SKIP})
    held_back: tuple[SloHeldBack, ...] = field(default=(), metadata={"json": SKIP})
    minutes: Mapping[str, SeverityMinutes] = field(
        default_factory=lambda: MappingProxyType({}), metadata={"json": SKIP}
    )


def why_not_evaluable(s: SloStatus, to: float) -> str:
    """Why the SLO cannot be judged at ``to`` ('' when it can): its threshold no bucket bound of
    some of its rows, its rows stopped more than its ``no_data_s`` ago, or it never had one while
    the agents report (``never_seen``). One text for the alert's summary, the terminal and the
    report (the report said "no requests in the window" of a service that never sent a row)."""
    if s.error:
        return f"not evaluated: {s.error}"
    if s.no_data_since is not None:
        at = datetime.fromtimestamp(s.no_data_since, UTC).strftime("%Y-%m-%d %H:%M:%S")
        return (f"no latency histogram of service {s.service!r} since {at} UTC ({(to - s.no_data_since) / 60:.0f} "
                "min): its scrape, its agent or the service is down")  # fmt: skip
    if s.never_seen:
        return (f"no latency histogram of service {s.service!r} ever, while the cluster's agents have been "
                "reporting: is the SLO's service (or cluster) name the one the service sends, and is it instrumented?")  # fmt: skip
    return ""


def why_windows_unjudged(s: SloStatus) -> str:
    """Why some of the SLO's window pairs are not judged ('' when all are, or when the SLO as a
    whole cannot be: :func:`why_not_evaluable` says why): its rows come so seldom that their short
    window may hold none of them (:attr:`SloStatus.unjudged_windows`)."""
    if not s.unjudged_windows or s.error or s.no_data_since is not None or s.never_seen:
        return ""
    iv = s.data_interval_s or 0.0
    hold = row_hold_s(iv)
    return (f"burn windows {', '.join(s.unjudged_windows)} not judged: service {s.service!r} sends a latency "
            f"histogram every {iv:g} s, and a short window under {hold // 60} min (twice that) holds none of its "
            "rows for part of each interval (its alert fired and resolved with every row); their alerts are kept "
            "as they were: give windows of at least that, or send the histogram more often")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Summary:
    """The four numbers for a window (see the metric definitions in the docs)."""

    window: Window
    capacity_gpu_hours: float | None
    cur_allocation: float | None
    cur_active: float | None
    cur_target: float
    idle_allocated_gpu_hours: float | None
    idle_unallocated_gpu_hours: float | None
    idle_pct_of_capacity: float | None
    pools: tuple[PoolSummary, ...]
    starvation_incidents: tuple[Incident, ...]
    starvation_by_cause: Mapping[Cause, int]  # every cause, 0 included
    slo_alerts: tuple[SloAlert, ...]
    slo_minutes: Mapping[str, Mapping[str, SeverityMinutes]]  # per SLO and severity
    slo_held_back: tuple[SloHeldBack, ...]
    top_idle: tuple[IdleHolder, ...]  # the largest allocated-idle first
    fair_share: tuple[FairShare, ...]
    slos: tuple[SloStatus, ...]
    # a scheduler event of the window's cluster came at or before its end: without one no
    # collector (Slurm, Kubernetes, Kueue) has reported, and no incident means no data, not none
    scheduler_events_seen: bool = True
    # the parts of the evaluation that failed and were left out (``summary(..., failed=...)``):
    # part name -> the error; the rules service reports them and keeps what they would judge
    errors: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), metadata={"json": SKIP})


def to_json(obj: Any) -> Any:
    """The JSON form (dicts, lists and scalars) of a result: a dataclass as a dict of its fields
    in declaration order, keyed by their ``json`` metadata or their name."""
    if is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in fields(obj):
            key = f.metadata.get("json", f.name)
            if key != SKIP:
                out[key] = to_json(getattr(obj, f.name))
        return out
    if isinstance(obj, list | tuple):
        return [to_json(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: to_json(v) for k, v in obj.items()}
    return obj

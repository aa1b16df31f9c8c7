"""Rules configuration: frozen pydantic models, unknown keys rejected, units in names.

A bad file fails at load with the file, the key and the reason (:class:`ConfigError`).
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections import Counter
from datetime import datetime
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from gpuslo.core.configmodel import ConfigModel
from gpuslo.core.fileio import NotARegularFile, read_regular
from gpuslo.core.yamlfile import load_file, load_model, validate
from gpuslo.rules.promql_regex import PROMQL_SPACE, PROMQL_SPACE_CHARS, selector_problem
from gpuslo.rules.reclaim_config import Reclaim
from gpuslo.rules.whatif_config import WhatIf

WINDOWS_FILE = Path(__file__).with_name("burn_windows.yaml")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DAY_S = 86400

# every float a config holds is finite: `.inf` and `.nan` are YAML floats; an infinite
# threshold would export `le="inf"` and compare true nowhere
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ConfigError(ValueError):
    pass


@cache  # pure; a large config asks for the same few durations many times
def parse_duration_s(text: str) -> int:
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"bad duration {text!r} (use e.g. 5m, 1h, 3d)")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds <= 0 or seconds % 60:
        raise ValueError(f"duration {text!r} must be a positive whole number of minutes")
    return int(seconds)


_M = ConfigModel  # frozen, unknown keys rejected, every float finite, no boolean for a number


class BurnWindow(_M):
    """One multi-window pair. Its factor is not configured: it derives from the share of the
    error budget the long window may consume and the SLO's period (Sloth's definition):
    ``factor = budget_percent / 100 × period / long window``, i.e. the burn at which the long
    window consumes exactly ``budget_percent`` of the period's budget."""

    severity: Literal["page", "ticket"]
    long: str
    short: str
    budget_percent: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)]
    # set from the SLO's period_d, never by a user (see _no_derived_keys); left out of dumps, so a
    # dumped config loads again
    period_s: int = Field(default=30 * DAY_S, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _no_derived_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "factor" in data:
                raise ValueError(
                    "factor is derived, not configured: give budget_percent, the share of the error "
                    "budget the long window may consume (factor = budget_percent / 100 × period / long)"
                )
            if "period_s" in data:
                raise ValueError("period_s is not a window key: the period is the SLO's period_d")
        return data

    @field_validator("long", "short")
    @classmethod
    def _dur(cls, v: str) -> str:
        parse_duration_s(v)
        return v

    @property
    def long_s(self) -> int:
        return parse_duration_s(self.long)

    @property
    def short_s(self) -> int:
        return parse_duration_s(self.short)

    @property
    def factor(self) -> float:
        # one correctly rounded division of exact products: 2 % of 30 d over 1 h is exactly 14.4
        return self.budget_percent * self.period_s / (100 * self.long_s)

    @model_validator(mode="after")
    def _order(self) -> BurnWindow:
        if self.short_s >= self.long_s:
            raise ValueError(f"short window {self.short} must be shorter than long window {self.long}")
        return self


@cache
def window_catalog() -> dict[int, tuple[BurnWindow, ...]]:
    """``rules/burn_windows.yaml``: period in days → its windows (read once per process)."""
    data = load_file(WINDOWS_FILE, ConfigError)
    out = {}
    for period, windows in data["periods"].items():
        days = parse_duration_s(str(period)) // DAY_S
        out[days] = tuple(BurnWindow.model_validate({**w}).model_copy(update={"period_s": days * DAY_S})
                          for w in windows)  # fmt: skip
    return out


@cache  # immutable models, shared by every SLO of that period
def default_windows(period_d: int = 30) -> tuple[BurnWindow, ...]:
    """The catalogued windows of ``period_d``; any other period gets the budget shares of the
    30-day set (Google's), with factors derived for its own length."""
    cat = window_catalog()
    base = cat.get(period_d, cat[30])
    return tuple(w.model_copy(update={"period_s": period_d * DAY_S}) for w in base)


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# the escapes PromQL's lexer takes in a quoted string (any other, such as \q, is a parse error),
# besides the string's own quote
_ESCAPE = (
    r"\\(?:[abfnrtv\\]|[0-3][0-7]{2}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U(?:0010|000[0-9a-fA-F])[0-9a-fA-F]{4}"
)
# one PromQL label matcher: a label name, an operator, a string literal (double, single or back quotes)
_MATCHER = (
    rf"""{PROMQL_SPACE}*[a-zA-Z_][a-zA-Z0-9_]*{PROMQL_SPACE}*(?:=~|!~|!=|=){PROMQL_SPACE}*"""
    rf"""(?:"(?:[^"\\\n]|{_ESCAPE}|"))*"|'(?:[^'\\\n]|{_ESCAPE}|'))*'|`[^`]*`){PROMQL_SPACE}*"""
)
_MATCHERS = re.compile(rf"{_MATCHER}(?:,{_MATCHER})*,?{PROMQL_SPACE}*")


class Slo(_M):
    """ "p99 ≤ threshold_ms" as the objective "≥ objective of requests take ≤ threshold_ms"."""

    name: Annotated[str, Field(min_length=1)]
    service: Annotated[str, Field(min_length=1)]
    cluster: str = ""  # empty: every cluster
    objective: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = 0.99
    threshold_ms: Positive
    buckets_ms: tuple[Positive, ...] = ()  # the service's histogram bounds, if known at config time
    period_d: Annotated[int, Field(ge=1, le=366)] = 30
    min_requests: Annotated[int, Field(ge=0, le=2**53)] = 100  # in the short window, else no alert
    # the service's histogram rows stopped this long before the evaluation (its scrape, its agent
    # or the service down): GpusloSLONotEvaluable, its burn alerts kept. None: the shortest short
    # window (5 m by default); never longer, or a page would resolve for want of data first
    no_data_s: Annotated[int, Field(ge=1)] | None = None
    # empty: the windows of rules/burn_windows.yaml for period_d; each window's factor is
    # derived from its budget_percent and period_d (filled in by _windows_for_period)
    windows: tuple[BurnWindow, ...] = ()
    # for `gpuslo rules export-prometheus`: the service's histogram as Prometheus scrapes it
    prometheus_metric: str = ""  # histogram name without _bucket (default: <service>_request_latency_seconds)
    prometheus_unit: Literal["s", "ms", "us"] = "s"
    prometheus_selector: str = ""  # extra label matchers, e.g. model_name="llama"

    @field_validator("objective", mode="before")
    @classmethod
    def _objective_below_one(cls, v: object) -> object:
        """An objective of 1 or more, said in the SLO's words: "less than 1" alone read as wrong
        for 0.99999999999999999, which YAML reads as the 64-bit float 1.0."""
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 1:
            raise ValueError(
                f"objective {v!r} is not below 1: 1 leaves no error budget (17 or more nines, such as "
                "0.99999999999999999, are 1 as a 64-bit float: give at most 16)"
            )
        return v

    @field_validator("prometheus_metric")
    @classmethod
    def _metric_name(cls, v: str) -> str:
        """A metric name, as Prometheus writes one: anything else went into the exported rules
        as it was (``foo{bar``: every rule a parse error, found only by Prometheus)."""
        if v and not _METRIC_NAME.fullmatch(v):
            raise ValueError(f"prometheus_metric {v[:100]!r} is not a metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        return v

    @field_validator("prometheus_selector")
    @classmethod
    def _matchers(cls, v: str) -> str:
        """Label matchers (``model_name="llama", route=~"/v1/.*"``) and nothing else: the text
        goes inside the exported rules' braces, where a ``}`` would end them and start PromQL.
        Each must be one Prometheus loads (:mod:`gpuslo.rules.promql_regex`): a regex Python's
        ``re`` took and Go's refused, or a ``__name__`` matcher, made a rules file Prometheus
        refused whole."""
        if v.strip(PROMQL_SPACE_CHARS) and not _MATCHERS.fullmatch(v):
            raise ValueError(
                f"prometheus_selector {v[:100]!r} is not a list of label matchers "
                '(name="value", name!="value", name=~"regex", name!~"regex", separated by commas; '
                "white space is PromQL's: space, tab, newline, carriage return)"
            )
        if v.strip(PROMQL_SPACE_CHARS) and (why := selector_problem(v)):
            raise ValueError(f"prometheus_selector {v[:100]!r}: {why}")
        return v

    @model_validator(mode="after")
    def _threshold_is_a_bound(self) -> Slo:
        if self.buckets_ms and self.threshold_ms not in self.buckets_ms:
            raise ValueError(
                f"threshold_ms {self.threshold_ms:g} is not a bucket bound of service {self.service!r} "
                f"(buckets_ms: {', '.join(f'{b:g}' for b in self.buckets_ms)}); an SLO on a latency "
                "histogram must use an existing `le` bound"
            )
        return self

    @model_validator(mode="after")
    def _windows_for_period(self) -> Slo:
        period_s = self.period_d * DAY_S
        given = self.windows or default_windows(self.period_d)
        windows = tuple(
            w if w.period_s == period_s else w.model_copy(update={"period_s": period_s}) for w in given
        )
        max_burn = 1 / (1 - self.objective)  # every request bad
        for w in windows:
            where = f"window {w.long}/{w.short} ({w.severity})"
            if w.long_s > period_s:
                raise ValueError(
                    f"{where}: the long window is longer than the SLO period ({self.period_d} d); "
                    f"give `windows:` that fit the period (catalogued periods: {_catalogued()})"
                )
            if w.factor >= max_burn:
                raise ValueError(
                    f"{where} can never fire: its factor {w.factor:.6g} (= {w.budget_percent:g} % of a "
                    f"{self.period_d} d budget in {w.long}) is not below the highest possible burn "
                    f"{max_burn:.6g} (every request slow at objective {self.objective:g}); give `windows:` "
                    "with a smaller budget_percent, or a longer long window"
                )
        object.__setattr__(self, "windows", windows)  # frozen: filled in once, at validation
        shortest = min(w.short_s for w in windows)
        if self.no_data_s is not None and self.no_data_s > shortest:
            raise ValueError(
                f"no_data_s {self.no_data_s} is longer than the shortest burn window ({shortest} s): a firing "
                "alert would resolve for want of data before the SLO is said not evaluable; give at most "
                f"{shortest}, or leave it out (the shortest window)"
            )
        return self

    @property
    def stale_after_s(self) -> int:
        """How long without histogram rows the SLO is not evaluable (:attr:`no_data_s`), for rows
        that come at least every half of it (:meth:`stale_bound_s` for any other)."""
        return self.no_data_s if self.no_data_s is not None else min(w.short_s for w in self.windows)

    def stale_bound_s(self, interval_s: float | None) -> int:
        """How long after its latest row, one of ``interval_s`` (None: not known), the SLO is not
        evaluable: :attr:`stale_after_s`, or when longer :func:`row_hold_s` of the row (its next
        one due, and one more interval of grace). A service that sends a delta every 10 min was
        said to be down 5 min after each of them, and back at the next (the ticket flapped)."""
        if interval_s is None:
            return self.stale_after_s
        return max(self.stale_after_s, row_hold_s(interval_s))

    def unjudged_windows(self, interval_s: float | None) -> tuple[BurnWindow, ...]:
        """The window pairs whose short window is shorter than :meth:`stale_bound_s` for rows of
        ``interval_s``: while the SLO is evaluable such a window may hold none of the service's
        rows (5 m over deltas of 10 min: empty half the time, its alert fired and resolved every
        interval), so they are not judged; every other window holds the latest row until the SLO
        is said not evaluable."""
        bound = self.stale_bound_s(interval_s)
        return tuple(w for w in self.windows if w.short_s < bound)


def row_hold_s(interval_s: float) -> int:
    """How long a latency row of ``interval_s`` stands for its service: until its next one is
    due and one more interval has passed (twice the interval, as a GPU sample stands for its
    node), rounded up to a whole minute (so that raw rows and the per-minute rollups, whose
    rows are at the end of their minute, judge alike from a whole-minute evaluation time)."""
    return 60 * math.ceil(2.0 * float(interval_s) / 60.0)


def _catalogued() -> str:
    return ", ".join(f"{d} d" for d in sorted(window_catalog()))


class Starvation(_M):
    threshold_s: Positive = 600.0
    queue_threshold_s: dict[str, Positive] = Field(default_factory=dict)

    def threshold_for(self, queue: str, scheduler: str = "", account: str = "") -> float:
        """The request's queue's own threshold; for a Kueue request (its queue is
        ``namespace/LocalQueue``) without one, its namespace's (``account``); else ``threshold_s``.
        A namespace's override was left out of its Kueue Workloads' waits (the same test in
        rules.sql.STARVATION)."""
        if queue in self.queue_threshold_s:
            return self.queue_threshold_s[queue]
        if scheduler == "kueue" and account in self.queue_threshold_s:
            return self.queue_threshold_s[account]
        return self.threshold_s


class Match(_M):
    """Which part of the fleet the rules cover; an empty list matches everything."""

    cluster: tuple[str, ...] = ()
    pool: tuple[str, ...] = ()  # Slurm partition / node pool (capacity side)
    # a Slurm partition, a Kubernetes namespace, or a Kueue LocalQueue as namespace/name (the queue
    # of a Kueue request; a namespace listed selects its Kueue requests too)
    queue: tuple[str, ...] = ()
    account: tuple[str, ...] = ()

    def ok(self, field: Literal["cluster", "pool", "queue", "account"], value: str) -> bool:
        allowed: tuple[str, ...] = getattr(self, field)
        return not allowed or value in allowed

    def request_ok(self, queue: str, scheduler: str, account: str) -> bool:
        """Whether ``queue`` selects a request: its queue listed exactly, or, for a Kueue request
        (its queue ``namespace/LocalQueue``, its account the namespace), its namespace listed, as
        :meth:`Starvation.threshold_for` reads an override (the SQL: rules.sql.request_matched).
        ``queue: [team-a]`` selected team-a's pods and missed its Kueue Workloads, whose queue is
        ``team-a/lq``. A ClusterQueue's name, or a LocalQueue's without its namespace, is no
        request's queue."""
        return not self.queue or queue in self.queue or (scheduler == "kueue" and account in self.queue)


MAX_INTENSITY_G_PER_KWH = 5000.0  # above any grid's (coal plants emit about 1000)
Intensity = Annotated[float, Field(ge=0, le=MAX_INTENSITY_G_PER_KWH, allow_inf_nan=False)]
SERIES_COLUMNS = ("start", "g_per_kwh")
MAX_SERIES_BYTES = 64 << 20  # ten years of 5-minute rows is about 30 MB


def _series_time(text: str) -> float:
    """Epoch seconds, or ISO-8601 with a zone (``Z`` or ``+hh:mm``): a time without one is ambiguous."""
    t = text.strip()
    try:
        v = float(t)
    except ValueError:
        try:
            d = datetime.fromisoformat(t.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"start {t!r} is neither epoch seconds nor ISO-8601") from None
        if d.tzinfo is None:
            raise ValueError(f"start {t!r} has no time zone (write e.g. 2026-01-01T00:00:00Z)") from None
        return d.timestamp()
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"start {t!r} is not a time")
    return v


@cache  # a config names its file once; the points are read once per process
def load_series(path: str) -> tuple[tuple[float, float], ...]:
    """A grid intensity time series file: CSV with the header ``start,g_per_kwh``, one row per
    change, ``start`` in epoch seconds or ISO-8601 with a zone, strictly increasing; each value
    holds from its start to the next row's (the last one onwards). Errors name the line. A
    regular file of at most MAX_SERIES_BYTES only (a FIFO would block the start, a device
    would fill memory); UTF-8, a BOM accepted (spreadsheets write one)."""
    try:
        text = read_regular(path, MAX_SERIES_BYTES).decode("utf-8-sig")
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except NotARegularFile as exc:
        raise ValueError(f"grid intensity file {exc}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:  # csv.Error: a field over its limit, a torn quote
        raise ValueError(f"grid intensity file {path}: {exc}") from None
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if not rows or tuple(c.strip() for c in rows[0]) != SERIES_COLUMNS:
        raise ValueError(f"grid intensity file {path}: line 1 must be the header {','.join(SERIES_COLUMNS)}")
    out: list[tuple[float, float]] = []
    for n, r in enumerate(rows[1:], start=2):
        try:
            if len(r) != 2:
                raise ValueError(f"{len(r)} columns, want 2 ({','.join(SERIES_COLUMNS)})")
            t, g = _series_time(r[0]), float(r[1])
            if not (math.isfinite(g) and 0 <= g <= MAX_INTENSITY_G_PER_KWH):
                raise ValueError(f"g_per_kwh {r[1].strip()!r} outside [0, {MAX_INTENSITY_G_PER_KWH:g}]")
            if out and t <= out[-1][0]:
                raise ValueError(
                    "start not after the previous row's (rows must be in time order, no repeats)"
                )
        except ValueError as exc:
            raise ValueError(f"grid intensity file {path}, line {n}: {exc}") from None
        out.append((t, g))
    if not out:
        raise ValueError(f"grid intensity file {path}: no rows after the header")
    return tuple(out)


class IntensityFile(_M):
    file: Annotated[str, Field(min_length=1)]

    @field_validator("file")
    @classmethod
    def _readable(cls, v: str) -> str:
        load_series(v)
        return v


class GridIntensity(_M):
    """gCO2 per kWh per cluster: a constant, or a time series file; ``default_g_per_kwh`` for the
    clusters not named (none: their energy has no carbon figure, reported as such)."""

    default_g_per_kwh: Intensity | None = None
    clusters: dict[str, Intensity | IntensityFile] = Field(default_factory=dict)

    def points(self) -> list[tuple[str, float, float]]:
        """(cluster, start, g/kWh), each value in force from its start until the next one's."""
        out: list[tuple[str, float, float]] = []
        for c in sorted(self.clusters):
            v = self.clusters[c]
            out += (
                [(c, 0.0, float(v))]
                if isinstance(v, float | int)
                else [(c, t, g) for t, g in load_series(v.file)]
            )
        return out


# a price per GPU-hour or per kWh; bounded so that price x GPU-hours stays inside Decimal's
# 28 digits at the cent (1e9 x a century of a million GPUs is 1e24): a larger price made the
# rounding to the cent raise InvalidOperation, a traceback
MAX_PRICE = Decimal(10**9)
Money = Annotated[Decimal, Field(ge=0, le=MAX_PRICE, allow_inf_nan=False, decimal_places=6)]


class UnallocatedTo(_M):
    account: Annotated[str, Field(min_length=1)]


class Chargeback(_M):
    """The price sheet: per GPU model (as the GPU reports its name) per GPU-hour, a MIG instance
    at its fraction; optionally per kWh; and who pays for unallocated capacity: ``none``,
    ``proportional`` (to the accounts' allocated GPU-hours of the same cluster, pool and model),
    or ``{account: NAME}`` (an overhead account)."""

    currency: str = ""
    per_gpu_hour: dict[str, Money] = Field(default_factory=dict)
    default_per_gpu_hour: Money | None = None  # a model not listed; none: it is reported `unpriced`
    per_kwh: Money = Decimal(0)
    unallocated: Literal["none", "proportional"] | UnallocatedTo = "proportional"

    def price(self, model: str) -> Decimal | None:
        return self.per_gpu_hour.get(model, self.default_per_gpu_hour)


class RulesConfig(_M):
    match: Match = Field(default_factory=Match)
    idle_threshold: Annotated[float, Field(ge=0, le=1)] = 0.05
    # idle counts only in runs of consecutive idle samples at least this long (0: every idle
    # sample counts); a short pause between kernels or batches is not waste
    min_idle_s: Annotated[float, Field(ge=0, le=86_400)] = 0.0
    cur_target: Annotated[float, Field(ge=0, le=1)] = 0.80
    eval_step_s: Annotated[int, Field(ge=60, le=86_400, multiple_of=60)] = 60  # at most a day
    starvation: Starvation = Field(default_factory=Starvation)
    slos: tuple[Slo, ...] = ()
    reclaim: Reclaim = Field(default_factory=Reclaim)  # the idle-reclaim loop (rules/reclaim.py)
    grid_intensity: GridIntensity | None = None
    chargeback: Chargeback | None = None
    whatif: WhatIf = Field(default_factory=WhatIf)  # `gpuslo whatif` (rules/whatif.py)

    @model_validator(mode="after")
    def _unique(self) -> RulesConfig:
        # one pass (a config with 100,000 SLOs once took quadratic time here)
        dup = {n for n, k in Counter(s.name for s in self.slos).items() if k > 1}
        if dup:
            raise ValueError(f"duplicate SLO names: {', '.join(sorted(dup))}")
        return self


def load(path: str | Path) -> RulesConfig:
    return load_model(Path(path), RulesConfig, ConfigError)


def parse(data: Any, origin: str = "<config>") -> RulesConfig:
    return validate(RulesConfig, data, origin, ConfigError)


EXAMPLE_FILE = Path(__file__).with_name("example.yaml")


def example() -> RulesConfig:
    """The shipped example: the seed targets (p99 ≤ 5 ms, CUR ≥ 80 %)."""
    return load(EXAMPLE_FILE)

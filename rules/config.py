"""Rules configuration: frozen pydantic models, unknown keys rejected, units in names.

A bad file fails at load with the file, the key and the reason (:class:`ConfigError`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

WINDOWS_FILE = Path(__file__).with_name("burn_windows.yaml")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ConfigError(ValueError):
    pass


def parse_duration_s(text: str) -> int:
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"bad duration {text!r} (use e.g. 5m, 1h, 3d)")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds <= 0 or seconds % 60:
        raise ValueError(f"duration {text!r} must be a positive whole number of minutes")
    return int(seconds)


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BurnWindow(_M):
    severity: Literal["page", "ticket"]
    long: str
    short: str
    factor: Annotated[float, Field(gt=0)]

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

    @model_validator(mode="after")
    def _order(self) -> BurnWindow:
        if self.short_s >= self.long_s:
            raise ValueError(f"short window {self.short} must be shorter than long window {self.long}")
        return self


def default_windows() -> tuple[BurnWindow, ...]:
    data = yaml.safe_load(WINDOWS_FILE.read_text())
    return tuple(BurnWindow.model_validate(w) for w in data["windows"])


class Slo(_M):
    """ "p99 ≤ threshold_ms" as the objective "≥ objective of requests take ≤ threshold_ms"."""

    name: Annotated[str, Field(min_length=1)]
    service: Annotated[str, Field(min_length=1)]
    cluster: str = ""  # empty: every cluster
    objective: Annotated[float, Field(gt=0, lt=1)] = 0.99
    threshold_ms: Annotated[float, Field(gt=0)]
    buckets_ms: tuple[float, ...] = ()  # the service's histogram bounds, if known at config time
    period_d: Annotated[int, Field(ge=1, le=366)] = 30
    min_requests: Annotated[int, Field(ge=0)] = 100  # in the short window, else no alert
    windows: tuple[BurnWindow, ...] = Field(default_factory=default_windows)
    # for `gpuslo rules export-prometheus`: the service's histogram as Prometheus scrapes it
    prometheus_metric: str = ""  # histogram name without _bucket (default: <service>_request_latency_seconds)
    prometheus_unit: Literal["s", "ms", "us"] = "s"
    prometheus_selector: str = ""  # extra label matchers, e.g. model_name="llama"

    @model_validator(mode="after")
    def _threshold_is_a_bound(self) -> Slo:
        if self.buckets_ms and self.threshold_ms not in self.buckets_ms:
            raise ValueError(
                f"threshold_ms {self.threshold_ms:g} is not a bucket bound of service {self.service!r} "
                f"(buckets_ms: {', '.join(f'{b:g}' for b in self.buckets_ms)}); an SLO on a latency "
                "histogram must use an existing `le` bound"
            )
        return self


class Starvation(_M):
    threshold_s: Annotated[float, Field(gt=0)] = 600.0
    queue_threshold_s: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)

    def threshold_for(self, queue: str) -> float:
        return self.queue_threshold_s.get(queue, self.threshold_s)


class Match(_M):
    """Which part of the fleet the rules cover; an empty list matches everything."""

    cluster: tuple[str, ...] = ()
    pool: tuple[str, ...] = ()  # Slurm partition / node pool (capacity side)
    queue: tuple[str, ...] = ()  # Slurm partition / Kubernetes namespace (request side)
    account: tuple[str, ...] = ()

    def ok(self, field: str, value: str) -> bool:
        allowed: tuple[str, ...] = getattr(self, field)
        return not allowed or value in allowed


class RulesConfig(_M):
    match: Match = Field(default_factory=Match)
    idle_threshold: Annotated[float, Field(ge=0, le=1)] = 0.05
    # idle counts only in runs of consecutive idle samples at least this long (0: every idle
    # sample counts); a short pause between kernels or batches is not waste
    min_idle_s: Annotated[float, Field(ge=0, le=86_400)] = 0.0
    cur_target: Annotated[float, Field(ge=0, le=1)] = 0.80
    eval_step_s: Annotated[int, Field(ge=60, multiple_of=60)] = 60
    starvation: Starvation = Field(default_factory=Starvation)
    slos: tuple[Slo, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> RulesConfig:
        names = [s.name for s in self.slos]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate SLO names: {', '.join(sorted(dup))}")
        return self


def load(path: str | Path) -> RulesConfig:
    p = Path(path)
    try:
        data: Any = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse(data if data is not None else {}, str(p))


def parse(data: Any, origin: str = "<config>") -> RulesConfig:
    try:
        return RulesConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for e in exc.errors(include_url=False):
            key = ".".join(str(x) for x in e["loc"]) or "<root>"
            lines.append(f"{origin}: {key}: {e['msg']}")
        raise ConfigError("\n".join(lines)) from None


EXAMPLE_FILE = Path(__file__).with_name("example.yaml")


def example() -> RulesConfig:
    """The shipped example: the seed targets (p99 ≤ 5 ms, CUR ≥ 80 %)."""
    return load(EXAMPLE_FILE)

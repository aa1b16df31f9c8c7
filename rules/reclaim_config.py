"""The idle-reclaim loop's configuration (the ``reclaim:`` key of the rules config): when a
holder counts as idle, how its owner is told, and what may be done about it after a grace
period. Frozen models, unknown keys rejected, units in names (:mod:`rules.config`)."""

from __future__ import annotations

import string
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gpuslo.core.configmodel import ConfigModel

Seconds = Annotated[float, Field(gt=0, le=30 * 86_400, allow_inf_nan=False)]
ActionMode = Literal["off", "dry-run", "on"]


_M = ConfigModel  # frozen, unknown keys rejected, every float finite, no boolean for a number


class ReclaimAction(_M):
    """What is done to a holder idle ``grace_s`` beyond its notice. Off by default; ``dry-run``
    records what would be done and does nothing; ``on`` acts, only in the allowed queues."""

    mode: ActionMode = "off"
    slurm: Literal["cancel", "requeue"] = "cancel"  # scancel JOB / scontrol requeue JOB
    kubernetes: Literal["delete", "suspend"] = "delete"  # delete the pod / deactivate its Kueue Workload
    grace_s: Seconds = 1800.0
    # Slurm partitions / Kubernetes namespaces the action may touch; empty: none (an allow-list)
    allow_queues: tuple[str, ...] = ()
    max_attempts: Annotated[int, Field(ge=1, le=100)] = 3  # failed calls per holder before giving up
    timeout_s: Seconds = 30.0  # one scancel / API call
    # the calls of one round start within this; the holders left wait for the next round
    round_s: Seconds = 120.0
    # no action on a judgement whose newest samples end longer than this before now (the agent
    # or the ingest behind): the notice still goes, the action waits for data
    max_sample_age_s: Seconds = 300.0
    # the Kubernetes API outside a cluster (empty: in-cluster, the pod's ServiceAccount); the
    # token is read from a file, never written in the config
    kube_server: str = ""
    kube_token_file: str = ""
    kube_ca_file: str = ""

    @model_validator(mode="after")
    def _kube_token(self) -> ReclaimAction:
        if bool(self.kube_server) != bool(self.kube_token_file):
            raise ValueError(
                "kube_server and kube_token_file go together (the API server and its token's file)"
            )
        return self

    @field_validator("kube_server")
    @classmethod
    def _https(cls, v: str) -> str:
        """An ``https://host[:port][/prefix]`` API server: the bearer token goes nowhere else
        (``http://`` would send it in clear; ``file://`` made a delete "succeed" reading a file)."""
        if not v:
            return v
        try:
            u = urlsplit(v)
            ok = u.scheme == "https" and bool(u.hostname) and (u.port is None or u.port > 0)
            ok = ok and not (u.username or u.password or u.query or u.fragment)
        except ValueError:  # a port that is no number, a bracket that does not close
            ok = False
        if not ok:
            raise ValueError(f"kube_server {v!r} is not an https://HOST[:PORT] URL of the Kubernetes API server "
                             "(no credentials, query or fragment in it: the token comes from kube_token_file)")  # fmt: skip
        return v

    @field_validator("allow_queues")
    @classmethod
    def _no_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not q for q in v):
            raise ValueError("an allowed queue is an exact Slurm partition or namespace name, not ''")
        return v


_URL_FIELDS = ("job", "cluster", "scheduler")


class Reclaim(_M):
    """Holders (Slurm jobs, pods) idle without a break for ``idle_after_s`` (per queue: a
    Slurm partition or a namespace) get a notice, an alert ``GpusloIdleHolder`` repeated every
    ``resend_s`` and resolved when the holder is active again or gone."""

    enabled: bool = False
    idle_after_s: Seconds = 3600.0
    queue_idle_after_s: dict[str, Seconds] = Field(default_factory=dict)
    resend_s: Seconds = 4 * 3600.0
    # the link to the per-job report in the notice; {job}, {cluster} and {scheduler} are filled
    # in (URL-quoted). Empty: the notice names the CLI command instead (`gpuslo job ID`)
    report_url: str = ""
    severity: Literal["ticket", "page", "info"] = "ticket"
    action: ReclaimAction = Field(default_factory=ReclaimAction)

    def threshold_for(self, queue: str) -> float:
        return self.queue_idle_after_s.get(queue, self.idle_after_s)

    @property
    def lookback_s(self) -> float:
        """How far back the samples are read: a holder idle longer is idle for at least this."""
        longest = max([self.idle_after_s, *self.queue_idle_after_s.values()])
        return longest + self.action.grace_s + 600.0

    @field_validator("report_url")
    @classmethod
    def _template(cls, v: str) -> str:
        """Plain ``{job}``, ``{cluster}``, ``{scheduler}`` only: no attribute, index, conversion or
        format spec (``{job.__class__}`` would format an attribute of the value)."""
        try:
            fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(v) if f is not None]
        except ValueError as exc:
            raise ValueError(f"report_url {v!r}: {exc} (write a literal brace as {{{{ or }}}})") from None
        bad = [f for f, spec, conv in fields if f not in _URL_FIELDS or spec or conv]
        if bad:
            raise ValueError(f"report_url {v!r}: only the fields {{job}}, {{cluster}} and {{scheduler}} may be "
                             f"used, as they are (not {', '.join(repr(b) for b in bad)})")  # fmt: skip
        return v

    @model_validator(mode="after")
    def _action_needs_notices(self) -> Reclaim:
        if self.action.mode != "off" and not self.enabled:
            raise ValueError("reclaim.action.mode is not off but reclaim.enabled is false: an action "
                             "never comes without the notice before it; set enabled: true")  # fmt: skip
        return self

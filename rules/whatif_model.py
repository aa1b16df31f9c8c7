"""The what-if replay's data: requests, capacity, policies and the replay's outcome (frozen
dataclasses: built in bulk, tens of thousands per window). docs/whatif.md defines them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Order = Literal["fifo", "first-fit", "backfill", "fairshare", "recorded"]
Placement = Literal["pack", "spread", "first"]
ORDERS: tuple[str, ...] = ("fifo", "first-fit", "backfill", "fairshare")
PLACEMENTS: tuple[str, ...] = ("pack", "spread", "first")
EPS = 1e-9


class PolicyError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Request:
    """One GPU request as recorded. ``run_s`` is the run time it actually had (``inf``: it never
    ran, or had not ended by the end of the data); ``withdrawn`` the time it left the queue
    without running (cancelled while pending, or gone unobserved), ``None`` if it did not."""

    request_id: str
    scheduler: str
    cluster: str
    queue: str
    account: str
    user: str
    submit: float
    nodes: int
    gpus_per_node: float
    run_s: float
    time_limit_s: float | None = None
    recorded_start: float | None = None
    pool: str = ""
    recorded_nodes: tuple[str, ...] = ()
    withdrawn: float | None = None

    @property
    def recorded_end(self) -> float | None:
        if self.recorded_start is None:
            return None
        return self.recorded_start + self.run_s


@dataclass(frozen=True, slots=True)
class Node:
    """A node and its GPUs over time: ``spans`` are ``(start, end, gpus)``, sorted, not
    overlapping; outside them the node has no capacity (absent, drained, its GPUs lost)."""

    name: str
    pool: str = ""
    spans: tuple[tuple[float, float, float], ...] = ()
    model: str = ""
    added: bool = False

    @property
    def max_gpus(self) -> float:
        return max((g for _, _, g in self.spans), default=0.0)


@dataclass(frozen=True, slots=True)
class Capacity:
    frm: float
    to: float
    nodes: tuple[Node, ...] = ()

    def with_added(self, gpus: int, gpus_per_node: int, model: str = "", pool: str | None = None) -> Capacity:
        """``gpus`` more GPUs in nodes of ``gpus_per_node`` (the last one takes the rest),
        present for the whole window, named ``whatif-added-N``; in ``pool`` (default: every
        pool a node of the fleet serves, so that every request may use them)."""
        if gpus < 1 or gpus_per_node < 1:
            raise PolicyError("--add-gpus and --gpus-per-node must be at least 1")
        if pool is None:
            seen = sorted({p for n in self.nodes for p in n.pool.split(",") if p})
            pool = ",".join(seen)
        out = list(self.nodes)
        left, k = gpus, 0
        while left > 0:
            g = min(left, gpus_per_node)
            out.append(Node(f"whatif-added-{k}", pool, ((self.frm, self.to, float(g)),), model, True))
            left -= g
            k += 1
        return Capacity(self.frm, self.to, tuple(out))


@dataclass(frozen=True, slots=True)
class Policy:
    order: Order
    gang: bool = False
    placement: Placement = "pack"

    @property
    def name(self) -> str:
        if self.order == "recorded":
            return "recorded"
        return f"{self.order}{'+gang' if self.gang else ''}:{self.placement}"


RECORDED = Policy("recorded", gang=True)


def _shown(text: str) -> str:
    """A policy as an error names it: quoted and escaped, at most 60 characters of that (the
    text comes from a flag or a config: one short line, never the whole of a hostile one)."""
    shown = repr(text)
    return shown if len(shown) <= 60 else f"{shown[:60]}... ({len(text)} characters)"


def parse_policy(text: str) -> Policy:
    """``ORDER[+gang][:pack|:spread|:first]``: fifo, first-fit, backfill or fairshare; ``+gang`` makes
    multi-node requests all-or-nothing; placement ``pack`` (the default), ``spread`` or ``first``."""
    t = text.strip().lower()
    place = "pack"
    if ":" in t:
        t, place = t.split(":", 1)
    gang = False
    parts = t.split("+")
    order, mods = parts[0], parts[1:]
    for m in mods:
        if m != "gang":
            raise PolicyError(f"unknown policy modifier {_shown(m)} in {_shown(text)} (only +gang)")
        if gang:
            raise PolicyError(f"+gang given twice in {_shown(text)}")
        gang = True
    if order not in ORDERS:
        raise PolicyError(
            f"unknown policy {_shown(text)}: use one of {', '.join(ORDERS)}, optionally +gang and :pack, :spread "
            "or :first (e.g. backfill+gang:spread)"
        )
    if place not in PLACEMENTS:
        raise PolicyError(f"unknown placement {_shown(place)} in {_shown(text)}: use pack, spread or first")
    return Policy(order, gang, place)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request under one policy: ``start`` when its last part was placed (``None``: not in
    the window), its nodes, and each part's holding ``(node, from, to)``."""

    request: Request
    start: float | None
    nodes: tuple[str, ...]
    holdings: tuple[tuple[str, float, float], ...]
    carried: str = ""  # "running" / "pending": in the replay from before the window's start

    @property
    def wait_s(self) -> float | None:
        return None if self.start is None else self.start - self.request.submit


@dataclass(frozen=True, slots=True)
class Incident:
    request_id: str
    scheduler: str
    queue: str
    opened: float
    cause: str
    free_gpus: float
    fitting_nodes: int


@dataclass(frozen=True, slots=True)
class Replay:
    policy: Policy
    frm: float
    to: float
    outcomes: tuple[Outcome, ...]
    incidents: tuple[Incident, ...]
    capacity: Capacity
    # EASY back-fill: each head's reservation when it first became head (tests check it holds)
    reservations: dict[str, float] = field(default_factory=dict)
    never_fit: tuple[str, ...] = ()  # requests no node set of the fleet could ever host
    skipped: tuple[str, ...] = ()  # requests for no GPU: not replayed

    @property
    def horizon(self) -> float:
        return self.to if math.isfinite(self.to) else self.frm

"""Drive the simulated fleet through the agent loop on its accelerated clock."""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpuslo.agent.base import Sink
from gpuslo.agent.runner import Runner
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import RealtimeSimClock, SimClock, SimNodeSource, sim_sources


def run_fleet(cfg: SimConfig, sink: Sink, on_tick: Callable[[int], None] | None = None) -> Fleet:
    """Sample every tick in [start, end); then send what happened after the last tick
    (scheduler and health events, the last latency interval). Returns the fleet, whose
    ``truth`` is the simulator's own account of the run."""
    fleet = Fleet(cfg)
    sources = sim_sources(fleet)
    runner = Runner(sources, sink, SimClock(fleet), cfg.interval_s)
    runner.run(cfg.start_ts, ticks=ticks(cfg), on_tick=on_tick)
    fleet.finish()
    tail = Runner(
        [s for s in sources if not isinstance(s, SimNodeSource)], sink, SimClock(fleet), cfg.interval_s
    )
    tail.tick(cfg.end_ts)
    sink.flush()
    return fleet


def run_fleet_realtime(cfg: SimConfig, sink: Sink, stop: threading.Event, n: int | None = None) -> Fleet:
    """Sample the simulated fleet on the wall clock, from ``cfg.start_ts`` (the current
    interval), ``n`` ticks (default: the configured hours) or until ``stop`` is set."""
    fleet = Fleet(cfg)
    runner = Runner(sim_sources(fleet), sink, RealtimeSimClock(fleet), cfg.interval_s)
    runner.run(cfg.start_ts, ticks=n or ticks(cfg), stop=stop)
    return fleet


def ticks(cfg: SimConfig) -> int:
    return round(cfg.hours * 3600.0 / cfg.interval_s)

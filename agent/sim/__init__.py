"""The simulated fleet (``--source sim``): deterministic from a seed, with its own ground truth."""

from gpuslo.agent.sim.fleet import Fleet, SimConfig, Truth, classify
from gpuslo.agent.sim.sources import (
    SimClock,
    SimHealthSource,
    SimLatencySource,
    SimNodeSource,
    SimSchedulerSource,
    sim_sources,
)

__all__ = [
    "Fleet",
    "SimClock",
    "SimConfig",
    "SimHealthSource",
    "SimLatencySource",
    "SimNodeSource",
    "SimSchedulerSource",
    "Truth",
    "classify",
    "sim_sources",
]

"""Node agent: sources sample the node (or the simulated fleet), sinks ship the messages."""

from gpuslo.agent.base import SendResult, Sink, Source

__all__ = ["SendResult", "Sink", "Source"]

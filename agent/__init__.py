"""Node agent: sources sample the node (or the simulated fleet), sinks ship the messages."""

from agent.base import Sink, SendResult, Source

__all__ = ["SendResult", "Sink", "Source"]

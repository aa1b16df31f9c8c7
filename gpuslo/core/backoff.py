"""Exponential backoff: the one rule by which the agent's Kafka sink, the ingest's store
writes, the store-open loop and each alert receiver wait before their next try.

The first failure waits ``initial_s``, each further one twice the last, never more than
``max_s``; a success resets it. No jitter: each of these has one peer per process (a broker,
a store, a receiver) and retries one thing at a time, so there is no herd in a process to
spread out.
"""

from __future__ import annotations


class Backoff:
    """The delay before the next try after a run of failures."""

    __slots__ = ("delay_s", "initial_s", "max_s")

    def __init__(self, initial_s: float, max_s: float) -> None:
        if not (initial_s > 0 and max_s > 0):
            raise ValueError(f"backoff needs positive delays, not initial_s={initial_s!r}, max_s={max_s!r}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.delay_s = 0.0  # 0: not failing

    @property
    def failing(self) -> bool:
        return self.delay_s > 0

    def fail(self) -> float:
        """One more failure: the delay before the next try (``initial_s``, doubling, capped)."""
        self.delay_s = min(self.max_s, max(self.initial_s, self.delay_s * 2))
        return self.delay_s

    def reset(self) -> None:
        """A success: the next failure waits ``initial_s`` again."""
        self.delay_s = 0.0

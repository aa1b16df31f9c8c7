"""The two things that vary in the agent: where messages come from, and where they go."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from gpuslo.wire import Message


class Source(ABC):
    """Produces the messages observed at ``now`` (epoch seconds). Must not raise for
    device or scheduler trouble: such trouble becomes health events and counters."""

    name: str = "source"

    @abstractmethod
    def collect(self, now: float) -> list[Message]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


@dataclass(frozen=True, slots=True)
class SendResult:
    sent: int
    failed: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.failed == 0


class Sink(ABC):
    @abstractmethod
    def send(self, msgs: Sequence[Message]) -> SendResult: ...

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Deliver what is buffered; True when nothing is left undelivered."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class Sequencer:
    """The (source, boot_id, seq) stamp of one producer."""

    def __init__(self, source: str, boot_id: str, start: int = 0) -> None:
        self.source = source
        self.boot_id = boot_id
        self._next = start

    def next(self) -> int:
        n = self._next
        self._next += 1
        return n

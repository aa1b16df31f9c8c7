"""The two things that vary in the agent: where messages come from, and where they go."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gpuslo.wire import Allocation, Message
from gpuslo.wire.models import NAME_MAX


class Source(ABC):
    """Produces the messages observed at ``now`` (epoch seconds). Must not raise for
    device or scheduler trouble: such trouble becomes health events and counters."""

    name: str = "source"

    @abstractmethod
    def collect(self, now: float) -> list[Message]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class Attribution(Protocol):
    """GPU → who holds it (Slurm jobs, Kubernetes pods). The GPU source that is given one
    calls :meth:`refresh` itself, once per collect, before it reads a GPU's holders: no other
    source and no order of the source list is involved. ``refresh`` keeps the last mapping
    when the scheduler cannot be asked."""

    def refresh(self) -> None: ...

    def __call__(self, index: int, uuid: str) -> tuple[Allocation, ...]:
        """The holders of GPU ``index`` (``uuid``: the GPU's, or its MIG instance's)."""
        ...


@dataclass(frozen=True, slots=True)
class Device:
    """A row the GPU source sends: a whole GPU (``gi`` None), or one MIG instance of GPU
    ``index`` (GPU instance ``gi``, compute instance ``ci``, NVIDIA's ``profile`` name).
    ``minor``: the GPU's minor number, the N of its ``/dev/nvidiaN`` (NVML's
    ``nvmlDeviceGetMinorNumber``; None where unknown), which is how Slurm's gres.conf names it."""

    index: int
    uuid: str
    model: str = ""
    gi: int | None = None
    ci: int | None = None
    profile: str = ""
    minor: int | None = None


@runtime_checkable
class LayoutAttribution(Attribution, Protocol):
    """An attribution that needs the node's device layout to place what the scheduler names
    (Slurm's gres IDX, dcgm-exporter's ``GPU.GI`` files) on rows: the GPU source calls
    :meth:`bind` once, with every row it will send, before the first refresh."""

    def bind(self, devices: Sequence[Device]) -> None: ...


class StaticAttribution:
    """An attribution from a function that needs no refresh (a fixed mapping, the tests)."""

    def __init__(self, holders: Callable[[int, str], tuple[Allocation, ...]]) -> None:
        self._holders = holders

    def refresh(self) -> None:
        pass

    def __call__(self, index: int, uuid: str) -> tuple[Allocation, ...]:
        return self._holders(index, uuid)


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


def wire_source(name: str) -> str:
    """``name`` as the wire carries a source: whole up to ``NAME_MAX`` characters, a longer one
    (a node name of 253 characters, Kubernetes' longest, with ``-latency#2``; a long URL) cut and
    told apart from its likes by a hash of the whole, the same at every start. Given whole, the
    wire refused every message of the producer."""
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{name[: NAME_MAX - len(digest) - 1]}~{digest}"


class Sequencer:
    """The (source, boot_id, seq) stamp of one producer (its source as the wire carries it:
    :func:`wire_source`)."""

    def __init__(self, source: str, boot_id: str, start: int = 0) -> None:
        self.source = wire_source(source)
        self.boot_id = boot_id
        self._next = start

    def next(self) -> int:
        n = self._next
        self._next += 1
        return n

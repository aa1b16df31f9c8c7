"""Sinks that need no server: the embedded in-process bus and JSON-lines files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO

from agent.base import SendResult, Sink
from gpuslo.bus import Bus
from gpuslo.wire import Message, encode


class BusSink(Sink):
    """Encodes each message to its wire bytes and publishes it on the in-process bus,
    so the embedded mode exercises the same decode path as Kafka."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus

    def send(self, msgs: Sequence[Message]) -> SendResult:
        for m in msgs:
            self._bus.publish(m.kind, encode(m))
        return SendResult(sent=len(msgs))


class JsonLinesSink(Sink):
    """One message per line; the format ``gpuslo ingest --file`` replays."""

    def __init__(self, path: Path | str | IO[bytes]) -> None:
        if isinstance(path, (str, Path)):
            self._fh: IO[bytes] = open(path, "ab")  # noqa: SIM115 - closed in close()
            self._owned = True
        else:
            self._fh = path
            self._owned = False

    def send(self, msgs: Sequence[Message]) -> SendResult:
        self._fh.write(b"".join(encode(m) + b"\n" for m in msgs))
        return SendResult(sent=len(msgs))

    def flush(self, timeout_s: float = 30.0) -> bool:
        self._fh.flush()
        return True

    def close(self) -> None:
        self.flush()
        if self._owned:
            self._fh.close()

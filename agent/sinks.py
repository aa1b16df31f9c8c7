"""Sinks that need no server: the embedded in-process bus and JSON-lines files."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from gpuslo.agent.base import SendResult, Sink
from gpuslo.core.bus import Bus
from gpuslo.core.fileio import write_all
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
    """One message per line; the format ``gpuslo ingest --file`` replays.

    Each send is written through to the file descriptor (nothing waits in a buffer to fail
    later). A write that fails (disk full, I/O error, a closed pipe) is cut back to the last
    whole line on a regular file, so a torn line never glues onto the next one; the send
    returns a failure result and counts it (the runner logs it once per outage)."""

    def __init__(self, path: Path | str | IO[bytes]) -> None:
        if isinstance(path, (str, Path)):
            self._fh: IO[bytes] = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
            self._owned = True
            self.name = str(path)
        else:
            self._fh = path
            self._owned = False
            self.name = getattr(path, "name", "stream")
            path.flush()  # what it buffered goes first; from here on, writes go straight through
        try:
            self._fd: int | None = self._fh.fileno()
        except (OSError, ValueError, AttributeError):  # an in-memory stream
            self._fd = None
        self.send_failures = 0  # messages that could not be written

    def send(self, msgs: Sequence[Message]) -> SendResult:
        blob = b"".join(encode(m) + b"\n" for m in msgs)
        try:
            self._write(blob)
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed
            self.send_failures += len(msgs)
            why = getattr(exc, "strerror", None) or str(exc)
            return SendResult(
                sent=0, failed=len(msgs), error=f"cannot write JSON lines to {self.name}: {why}"
            )
        return SendResult(sent=len(msgs))

    def _write(self, blob: bytes) -> None:
        if self._fd is None:
            self._fh.write(blob)
            return
        fd = self._fd
        start = os.lseek(fd, 0, os.SEEK_END) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        try:
            write_all(fd, blob)
        except OSError:
            if start is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                    os.lseek(fd, start, os.SEEK_SET)
            raise

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True  # nothing is buffered

    def close(self) -> None:
        if self._owned:
            self._fh.close()

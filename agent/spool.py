"""A crash-safe, bounded, on-disk FIFO of records: the agent's write-ahead buffer.

Every message goes through the spool: ``append`` writes it to the tail segment, the
Kafka sink drains from the head and ``advance`` moves a persisted cursor past what the
broker acknowledged. So a broker outage, a slow broker or an agent restart loses
nothing and keeps the order; the price is that a crash between "acknowledged" and
"cursor saved" sends a few records twice, which the consumer's idempotent writes absorb.

On disk: ``DIR/NNNNNNNNNNNNNNNNNNNN.seg`` segments of records, and ``DIR/cursor``
(segment number and byte offset of the next record to drain; written by rename, so it is
never torn). A record is ``u32 length | u32 crc32 | body`` with body
``f64 appended_at | u16 topic length | topic | u16 key length | key | value``. A torn
record at the end of the last segment (power loss mid-write) is cut off on open.

Bounds: total bytes and record age. Past either, whole segments are dropped oldest first;
each drop is counted (``dropped_records``) and logged.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")
_META = struct.Struct("<dH")
_U16 = struct.Struct("<H")
_CURSOR = struct.Struct("<QQ")


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    key: bytes
    value: bytes
    appended_at: float


@dataclass(frozen=True, slots=True)
class Position:
    segment: int
    offset: int


class SpoolError(RuntimeError):
    pass


def _encode(r: Record) -> bytes:
    t = r.topic.encode()
    body = _META.pack(r.appended_at, len(t)) + t + _U16.pack(len(r.key)) + r.key + r.value
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def _decode(body: bytes) -> Record:
    appended_at, tl = _META.unpack_from(body, 0)
    p = _META.size
    topic = body[p : p + tl].decode()
    p += tl
    (kl,) = _U16.unpack_from(body, p)
    p += _U16.size
    return Record(topic, body[p : p + kl], body[p + kl :], appended_at)


class Spool:
    def __init__(
        self,
        directory: str | Path,
        max_bytes: int = 256 * 2**20,
        max_age_s: float = 7 * 86400.0,
        segment_bytes: int | None = None,
        fsync: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes <= 0 or max_age_s <= 0:
            raise SpoolError("spool bounds must be positive")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.segment_bytes = segment_bytes or max(64 * 1024, max_bytes // 16)
        self.fsync = fsync
        self.clock = clock
        self.dropped_records = 0
        self.dropped_bytes = 0
        self._segments: list[int] = sorted(int(p.stem) for p in self.dir.glob("*.seg"))
        self._cursor = self._load_cursor()
        self._repair_tail()
        self._sizes = {s: self._path(s).stat().st_size for s in self._segments}
        self._newest: dict[int, float] = {}
        for s in self._segments:
            recs = self._records(s, 0)
            if recs:
                self._newest[s] = recs[-1][1].appended_at
        self._pending = self._count_pending()
        self._tail: int | None = None  # open segment number for appends

    # ------------------------------------------------------------------ files
    def _path(self, seg: int) -> Path:
        return self.dir / f"{seg:020d}.seg"

    def _load_cursor(self) -> Position:
        p = self.dir / "cursor"
        if p.exists():
            data = p.read_bytes()
            if len(data) == _CURSOR.size:
                seg, off = _CURSOR.unpack(data)
                return Position(seg, off)
            log.warning("spool %s: unreadable cursor file; draining from the oldest segment", self.dir)
        return Position(self._segments[0] if self._segments else 0, 0)

    def _save_cursor(self) -> None:
        tmp = self.dir / "cursor.tmp"
        with open(tmp, "wb") as f:
            f.write(_CURSOR.pack(self._cursor.segment, self._cursor.offset))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.dir / "cursor")

    def _repair_tail(self) -> None:
        """Cut a torn record off the end of the newest segment."""
        if not self._segments:
            return
        path = self._path(self._segments[-1])
        good = 0
        with open(path, "rb") as f:
            data = f.read()
        while good + _HEAD.size <= len(data):
            n, crc = _HEAD.unpack_from(data, good)
            body = data[good + _HEAD.size : good + _HEAD.size + n]
            if len(body) < n or zlib.crc32(body) != crc:
                break
            good += _HEAD.size + n
        if good < len(data):
            log.warning("spool %s: cut %d torn bytes off %s", self.dir, len(data) - good, path.name)
            with open(path, "r+b") as f:
                f.truncate(good)

    def _records(self, seg: int, offset: int, max_bytes: int | None = None) -> list[tuple[int, Record]]:
        """(end offset, record) for the whole records of ``seg`` from ``offset``, about
        ``max_bytes`` of them (at least one)."""
        try:
            with open(self._path(seg), "rb") as f:
                f.seek(offset)
                data = f.read() if max_bytes is None else f.read(max_bytes)
                if max_bytes is not None and len(data) >= _HEAD.size:
                    first = _HEAD.size + _HEAD.unpack_from(data, 0)[0]
                    if first > len(data):  # one record longer than the budget: read it whole
                        data += f.read(first - len(data))
        except FileNotFoundError:
            return []
        out = []
        p = 0
        while p + _HEAD.size <= len(data):
            n, crc = _HEAD.unpack_from(data, p)
            body = data[p + _HEAD.size : p + _HEAD.size + n]
            if len(body) < n:
                break  # partial read at the limit; or a record still being written
            if zlib.crc32(body) != crc:
                raise SpoolError(f"corrupt record in {self._path(seg)} at {offset + p}")
            p += _HEAD.size + n
            out.append((offset + p, _decode(body)))
        return out

    def _count_pending(self) -> int:
        n = 0
        for seg in self._segments:
            if seg < self._cursor.segment:
                continue
            n += len(self._records(seg, self._cursor.offset if seg == self._cursor.segment else 0))
        return n

    # ------------------------------------------------------------------ API
    def __len__(self) -> int:
        """Records not yet drained."""
        return self._pending

    @property
    def size_bytes(self) -> int:
        return sum(self._sizes.values())

    def append(self, records: list[Record]) -> None:
        if not records:
            return
        blob = b"".join(_encode(r) for r in records)
        if self._tail is None or self._tail != (self._segments[-1] if self._segments else None):
            self._tail = self._segments[-1] if self._segments else None
        if self._tail is None or self._sizes[self._tail] >= self.segment_bytes:
            self._tail = (self._segments[-1] + 1) if self._segments else max(1, self._cursor.segment)
            self._segments.append(self._tail)
            self._sizes[self._tail] = 0
        with open(self._path(self._tail), "ab") as f:
            f.write(blob)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        self._sizes[self._tail] += len(blob)
        self._newest[self._tail] = records[-1].appended_at
        self._pending += len(records)
        self._enforce_bounds()

    def peek(self, max_records: int = 1000, max_bytes: int = 4 * 2**20) -> list[tuple[Position, Record]]:
        """The oldest undrained records, each with the position just after it."""
        out: list[tuple[Position, Record]] = []
        size = 0
        for seg in self._segments:
            if seg < self._cursor.segment:
                continue
            start = self._cursor.offset if seg == self._cursor.segment else 0
            for end, rec in self._records(seg, start, max_bytes - size + 65536):
                out.append((Position(seg, end), rec))
                size += len(rec.value)
                if len(out) >= max_records or size >= max_bytes:
                    return out
        return out

    def advance(self, to: Position, count: int) -> None:
        """Mark everything before ``to`` drained (``count`` records); delete drained segments."""
        self._pending = max(0, self._pending - count)
        for seg in list(self._segments):
            if seg < to.segment or (seg == to.segment and self._at_end(seg, to)):
                self._delete(seg)
        if to.segment not in self._segments:  # drained to the end of a deleted segment
            to = Position(self._segments[0] if self._segments else to.segment + 1, 0)
        self._cursor = to
        self._save_cursor()

    def _at_end(self, seg: int, pos: Position) -> bool:
        return self._sizes[seg] <= pos.offset

    def _delete(self, seg: int) -> None:
        self._segments.remove(seg)
        self._sizes.pop(seg, None)
        self._newest.pop(seg, None)
        self._path(seg).unlink(missing_ok=True)
        if self._tail == seg:
            self._tail = None

    def _enforce_bounds(self) -> None:
        now = self.clock()
        while len(self._segments) > 1:
            oldest = self._segments[0]
            too_big = self.size_bytes > self.max_bytes
            newest_in_oldest = self._newest.get(oldest)
            too_old = newest_in_oldest is not None and now - newest_in_oldest > self.max_age_s
            if not (too_big or too_old):
                break
            start = self._cursor.offset if oldest == self._cursor.segment else 0
            lost = self._records(oldest, start) if oldest >= self._cursor.segment else []
            nbytes = self._sizes[oldest] - start
            self._delete(oldest)
            if lost:
                self.dropped_records += len(lost)
                self.dropped_bytes += max(0, nbytes)
                self._pending -= len(lost)
                log.warning(
                    "spool %s over its %s bound: dropped the oldest %d undrained records (%d bytes; %d dropped so far)",
                    self.dir,
                    "byte" if too_big else "age",
                    len(lost),
                    nbytes,
                    self.dropped_records,
                )
            if self._cursor.segment <= oldest:
                self._cursor = Position(self._segments[0], 0)
                self._save_cursor()

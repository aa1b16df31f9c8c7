"""A crash-safe, bounded, on-disk FIFO of records: the agent's write-ahead buffer.

Every message goes through the spool: ``append`` writes it to the tail segment, the
Kafka sink drains from the head and ``advance`` moves a persisted cursor past what the
broker acknowledged. So a broker outage, a slow broker or an agent restart loses
nothing and keeps the order; the price is that a crash between "acknowledged" and
"cursor saved" sends a few records twice, which the consumer's idempotent writes absorb.

On disk: ``DIR/NNNNNNNNNNNNNNNNNNNN.spl`` segments of records and ``DIR/cursor``
(segment, byte offset and sequence number of the next record to drain, with a CRC;
written by rename, so it is never torn). A record is
``magic | u32 body length | u64 seq | u32 crc32(length, seq, body) | body`` with body
``f64 appended_at | u16 topic length | topic | u16 key length | key | value``. Every
record carries the next number of one gap-free sequence, so the records lost to a
corrupt stretch are counted exactly (the gap between the sequence numbers around it);
the magic (bytes that never occur in UTF-8 text) lets a reader resynchronise on the next
intact record after a torn, bit-flipped or mis-sized one.

Faults of its own files never stop the spool:
- a failed append (disk full, I/O error) is rolled back to the last whole record and
  raises :class:`SpoolWriteError`; nothing of it stays, and the next append works as
  soon as space returns;
- a corrupt stretch is skipped, the records in it are counted as dropped and logged,
  every intact record after it is delivered; a torn tail (power lost mid-write) is cut;
- one process per directory (an exclusive ``flock`` on ``DIR/lock``; a second one gets a
  clear :class:`SpoolError`, never interleaved appends);
- a stray file in the directory is logged and left alone; an unreadable cursor, or one naming a
  segment past the one after the last on disk, means a re-send from the oldest segment
  (duplicates, which the consumer absorbs), not a loss;
- the cursor's segment ending before the cursor (a power loss kept the cursor, not the segment's
  end) is read and appended on from its end, the records it lost after the cursor counted;
- a segment that cannot be read for now (out of file descriptors or memory) keeps its records:
  the drain waits before it (counted, logged); any other read error counts them as lost;
- a segment that cannot be read at open (a bad sector's EIO) is read up to where it failed, the
  rest counted as lost, and it is sealed: never appended to, cut or written over; one the process
  cannot read for now (out of file descriptors or memory) is a :class:`SpoolError`: the spool is
  not opened, its records kept for the next start (so is one whose format cannot be looked at
  for now: a newer agent's segment was taken for this format's, read as corrupt and cut);
- a segment of a newer format (a downgrade: the magic with a higher version byte, no record of
  this format in it) is left alone, never taken for corruption and cut; new segments follow it;
- the directory deleted while running is made again at the next append (its records counted
  as lost), so appends do not fail until a restart;
- segments of the previous format (``*.seg``: ``u32 length | u32 crc32 | body``) are
  still drained; that format cannot resynchronise, so its records after a corrupt one
  are lost (counted as one).

Bounds: total bytes and record age. Past either, whole segments are dropped oldest first;
each drop is counted and logged.

Accounting: ``accepted = delivered + pending + dropped`` holds exactly at every moment
(:meth:`Spool.stats`); records found on disk at open count as accepted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gpuslo.core.fileio import pwrite_all, replace_file

log = logging.getLogger(__name__)

MAGIC = b"\xf9GS\x02"  # 0xF9 never occurs in UTF-8, so never inside a JSON value
_HEAD = struct.Struct("<4sIQI")  # magic, body length, seq, crc
_LENSEQ = struct.Struct("<IQ")
_LEGACY_HEAD = struct.Struct("<II")  # the previous format: length, crc32(body)
_META = struct.Struct("<dH")
_U16 = struct.Struct("<H")
_CURSOR = struct.Struct("<QQQ")  # segment, offset, seq; then u32 crc32
_LEGACY_CURSOR = struct.Struct("<QQ")
_NAME = re.compile(r"^(\d{20})\.(spl|seg)$")
_KNOWN = {"cursor", "cursor.tmp", "lock", "lost+found"}  # the last: a file system's own
_CHUNK = 256 * 1024
_MAX_SEGMENT = 10**19  # numbers stay 20 digits wide; a larger one is not the spool's
MAX_RECORD_BYTES = 64 * 2**20
# read errors that say nothing of the file, only of the process's state now (out of file
# descriptors, of memory): the records are there, and are read once it passes
_PASSING = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR})


def _boot_clock() -> float:
    """Seconds on a clock no one sets that counts a suspended host's time too (``CLOCK_BOOTTIME``;
    the monotonic clock where there is none)."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    key: bytes
    value: bytes
    appended_at: float


@dataclass(frozen=True, slots=True)
class Position:
    """Just after a record: its segment, the byte offset of the next record, and the
    sequence number of the next record."""

    segment: int
    offset: int
    seq: int = 0


@dataclass(frozen=True, slots=True)
class SpoolStats:
    """Records since this spool was opened (those found on disk at open included).
    ``accepted == delivered + pending + dropped_bound + dropped_corrupt`` always."""

    accepted: int
    delivered: int
    pending: int
    dropped_bound: int
    dropped_corrupt: int
    refused: int  # appends that failed (disk full, I/O error): never accepted
    bytes: int
    dropped_rejected: int = 0  # refused by the broker for what they are (too large): never deliverable
    read_failures: int = 0  # reads that failed for now (out of file descriptors, memory): the drain waited

    @property
    def dropped(self) -> int:
        return self.dropped_bound + self.dropped_corrupt + self.dropped_rejected


class SpoolError(RuntimeError):
    """The spool cannot be used at all (its directory is missing, not a directory, read-only)."""


class SpoolWriteError(SpoolError):
    """One append failed and was rolled back; the spool stays usable."""


class _Unreadable(Exception):
    """A segment that cannot be read now, for a reason that passes (out of file descriptors or
    memory): its records are not lost; the drain stops before them."""


def _encode(r: Record, seq: int) -> bytes:
    """The record's bytes; ``ValueError`` for one the format cannot hold (it could not be read back)."""
    t = r.topic.encode()
    if len(t) > 0xFFFF or len(r.key) > 0xFFFF:
        raise ValueError(f"topic of {len(t)} or key of {len(r.key)} bytes (at most 65,535)")
    if _META.size + len(t) + _U16.size + len(r.key) + len(r.value) > MAX_RECORD_BYTES:
        raise ValueError(f"value of {len(r.value)} bytes (a record holds at most {MAX_RECORD_BYTES:,})")
    body = _META.pack(r.appended_at, len(t)) + t + _U16.pack(len(r.key)) + r.key + r.value
    crc = zlib.crc32(body, zlib.crc32(_LENSEQ.pack(len(body), seq)))
    return _HEAD.pack(MAGIC, len(body), seq, crc) + body


def _decode(body: bytes) -> Record:
    appended_at, tl = _META.unpack_from(body, 0)
    p = _META.size
    topic = body[p : p + tl].decode()
    p += tl
    (kl,) = _U16.unpack_from(body, p)
    p += _U16.size
    if p + kl > len(body):
        raise ValueError("key runs past the record")
    return Record(topic, body[p : p + kl], body[p + kl :], appended_at)


# ---------------------------------------------------------------------- reading
@dataclass(frozen=True, slots=True)
class _Good:
    end: int
    seq: int | None  # None: a record of the previous format, which has no sequence number
    record: Record


@dataclass(frozen=True, slots=True)
class _Gap:
    start: int
    end: int
    magics: int  # record starts seen in it: the loss estimate where no sequence number tells


class _Window:
    """Bytes ``[start, end)`` of an open file, read on demand in chunks; only what is still
    needed stays in memory."""

    def __init__(self, f: BinaryIO, start: int, end: int) -> None:
        self.f, self.base, self.end, self.buf = f, start, end, b""

    def get(self, p: int, n: int) -> bytes | None:
        if p < self.base or p + n > self.end:
            return None
        have = self.base + len(self.buf)
        if p + n > have:
            self.f.seek(have)
            more = self.f.read(min(self.end - have, max(p + n - have, _CHUNK)))
            self.buf += more
            if p + n > self.base + len(self.buf):  # the file shrank under us
                self.end = self.base + len(self.buf)
                return None
        return self.buf[p - self.base : p - self.base + n]

    def forget_before(self, p: int) -> None:
        if p - self.base > _CHUNK:
            self.buf = self.buf[p - self.base :]
            self.base = p

    def find(self, needle: bytes, p: int) -> int | None:
        while True:
            i = self.buf.find(needle, max(0, p - self.base))
            if i >= 0:
                return self.base + i
            have = self.base + len(self.buf)
            if have >= self.end:
                return None
            self.forget_before(max(p, have - len(needle) + 1))
            p = max(p, have - len(needle) + 1)
            if self.get(have, min(_CHUNK, self.end - have)) is None:
                return None


def _parse(w: _Window, p: int) -> _Good | None:
    h = w.get(p, _HEAD.size)
    if h is None:
        return None
    magic, n, seq, crc = _HEAD.unpack(h)
    if magic != MAGIC or n > MAX_RECORD_BYTES:
        return None
    body = w.get(p + _HEAD.size, n)
    if body is None or zlib.crc32(body, zlib.crc32(_LENSEQ.pack(n, seq))) != crc:
        return None
    try:
        rec = _decode(body)
    except (ValueError, struct.error):
        return None
    return _Good(p + _HEAD.size + n, seq, rec)


def _parse_legacy(w: _Window, p: int) -> _Good | None:
    h = w.get(p, _LEGACY_HEAD.size)
    if h is None:
        return None
    n, crc = _LEGACY_HEAD.unpack(h)
    body = w.get(p + _LEGACY_HEAD.size, n) if n <= MAX_RECORD_BYTES else None
    if body is None or zlib.crc32(body) != crc:
        return None
    try:
        rec = _decode(body)
    except (ValueError, struct.error):
        return None
    return _Good(p + _LEGACY_HEAD.size + n, None, rec)


def _scan(f: BinaryIO, start: int, end: int, legacy: bool) -> Iterator[_Good | _Gap]:
    """The intact records of ``[start, end)`` and the corrupt stretches between them."""
    w = _Window(f, start, end)
    p = start
    while p < end:
        good = _parse_legacy(w, p) if legacy else _parse(w, p)
        if good is not None:
            yield good
            p = good.end
            w.forget_before(p)
            continue
        if legacy:  # no way to find the next record
            yield _Gap(p, end, 1)
            return
        magics = 1 if w.get(p, len(MAGIC)) == MAGIC else 0
        q: int | None = p + 1
        while q is not None:
            q = w.find(MAGIC, q)
            if q is None or _parse(w, q) is not None:
                break
            magics += 1
            q += 1
        yield _Gap(p, end if q is None else q, magics)
        p = end if q is None else q


# ---------------------------------------------------------------------- the spool
@dataclass(slots=True)
class _Seg:
    num: int
    legacy: bool
    size: int = 0  # bytes of whole records; nothing past it is read or kept
    end_seq: int = 0  # the sequence number after its last record
    # the latest appended_at of its records (the largest, not the last written: a wall clock set
    # back and then forward again made a segment of fresh records look as old as the step)
    newest: float | None = None
    fresh_at: float | None = None  # the elapsed clock at its newest append by this process
    sealed: bool = False  # no more appends (legacy, or a tail that could not be cut)


@dataclass(slots=True)
class _Counts:
    accepted: int = 0
    delivered: int = 0
    dropped_bound: int = 0
    dropped_corrupt: int = 0
    dropped_rejected: int = 0
    refused: int = 0
    read_failures: int = 0
    dropped_bytes: int = 0
    logged: set[str] = field(default_factory=set)


class Spool:
    def __init__(
        self,
        directory: str | Path,
        max_bytes: int = 256 * 2**20,
        max_age_s: float = 7 * 86400.0,
        segment_bytes: int | None = None,
        fsync: bool = False,
        clock: Callable[[], float] = time.time,
        elapsed: Callable[[], float] = _boot_clock,
    ) -> None:
        """``clock``: the wall clock, read once at open to age the segments found on disk (their
        records' ``appended_at``); from then on ages are measured on ``elapsed``, a clock no one
        sets: a wall clock set forward, even for one tick, made every segment look as old as the
        step, and the age bound dropped them all."""
        if max_bytes <= 0 or max_age_s <= 0:
            raise SpoolError("spool bounds must be positive")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.segment_bytes = segment_bytes or max(64 * 1024, max_bytes // 16)
        self.fsync = fsync
        self.clock = clock
        self.elapsed = elapsed
        self._wall0, self._elapsed0 = clock(), elapsed()  # the instant the disk's ages are taken at
        self._n = _Counts()
        self._gaps: dict[int, int] = {}  # first seq of a counted corrupt stretch -> records lost in it
        self._check_directory()
        self._lock_fd: int | None = self._lock()
        self._dir_id = self._identity()  # the directory this spool holds (see _replaced)
        self._segs: dict[int, _Seg] = {}  # in segment order
        self._newer_top = 0  # the highest number of a segment of a newer format (left alone)
        self._cursor = self._load_cursor()
        self._next_seq = self._cursor.seq
        try:
            self._open_segments()
        except SpoolError:
            self.close()  # the directory released: a later open (of this process too) may take it
            raise
        self._n.accepted = self._next_seq - self._cursor.seq

    # ------------------------------------------------------------------ open
    def _check_directory(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise SpoolError(f"spool directory {self.dir} exists and is not a directory") from None
        except OSError as exc:
            raise SpoolError(f"cannot create the spool directory {self.dir}: {exc.strerror}") from None
        if not self.dir.is_dir():
            raise SpoolError(f"spool directory {self.dir} exists and is not a directory")
        if not os.access(self.dir, os.R_OK | os.W_OK | os.X_OK):
            raise SpoolError(
                f"spool directory {self.dir} is not writable by this process (read-only file system or "
                "permissions): the agent needs it to buffer messages; mount it read-write or choose "
                "another --spool-dir"
            )

    def _lock(self) -> int | None:
        """One process per spool directory (two would interleave their appends): an exclusive
        ``flock`` on ``DIR/lock``, held until :meth:`close` or the process ends."""
        path = self.dir / "lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk never stops the agent from starting
                log.warning(
                    "spool %s: cannot create the lock file (%s); running without it", self.dir, exc.strerror
                )
                return None
            raise SpoolError(f"cannot open the spool lock {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SpoolError(
                f"spool directory {self.dir} is in use by another agent (pid {holder}); "
                "give each agent its own --spool-dir"
            ) from None
        with contextlib.suppress(OSError):  # the pid is for the message above only
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def close(self) -> None:
        """Release the directory (the spool's state is on disk already)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _load_cursor(self) -> Position:
        p = self.dir / "cursor"
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            # none yet (nothing delivered so far), or lost: read from the oldest segment, its
            # records numbering themselves (a lost cursor re-sends, never counts what was
            # delivered before as lost to corruption)
            return Position(-1, 0, -1)
        except OSError as exc:
            log.warning(
                "spool %s: cannot read the cursor (%s); re-sending from the oldest segment", self.dir, exc
            )
            return Position(-1, 0, -1)
        if len(data) == _CURSOR.size + 4 and zlib.crc32(data[: _CURSOR.size]) == int.from_bytes(
            data[-4:], "little"
        ):
            return Position(*_CURSOR.unpack_from(data))
        if len(data) == _LEGACY_CURSOR.size:  # the previous format: no sequence number
            seg, off = _LEGACY_CURSOR.unpack(data)
            return Position(seg, off, -1)
        log.warning(
            "spool %s: corrupt cursor file; re-sending from the oldest segment (duplicates, no loss)",
            self.dir,
        )
        return Position(-1, 0, -1)

    def _list(self) -> list[tuple[int, bool]]:
        found: dict[int, bool] = {}
        stray: list[str] = []
        try:
            entries = sorted(os.scandir(self.dir), key=lambda e: e.name)
        except OSError as exc:
            raise SpoolError(f"cannot list the spool directory {self.dir}: {exc.strerror}") from None
        for e in entries:
            m = _NAME.match(e.name)
            try:
                regular = e.is_file(follow_symlinks=False)
            except OSError:
                regular = False
            if m and regular and int(m.group(1)) < _MAX_SEGMENT and int(m.group(1)) not in found:
                found[int(m.group(1))] = m.group(2) == "seg"
            elif e.name not in _KNOWN:
                stray.append(e.name)
        if stray:
            log.warning(
                "spool %s: %d files that are not the spool's, left alone: %s",
                self.dir,
                len(stray),
                ", ".join(stray[:5]) + (" ..." if len(stray) > 5 else ""),
            )
        return sorted(found.items())

    def _newer_format(self, num: int) -> int | None:
        """The format version of a segment that a newer agent wrote (after a downgrade): it starts
        with the spool's magic but a higher version byte, and holds no record of this format.
        None for a segment of this format (a corrupt one of it included)."""
        try:
            with open(self.dir / f"{num:020d}.spl", "rb") as f:
                head = f.read(len(MAGIC))
                if len(head) < len(MAGIC) or head[:-1] != MAGIC[:-1] or head[-1] <= MAGIC[-1]:
                    return None
                size = os.fstat(f.fileno()).st_size
                if any(isinstance(x, _Good) for x in _scan(f, 0, size, False)):
                    return None  # a record of this format in it: its first one is corrupt
                return head[-1]
        except OSError as exc:
            if exc.errno in _PASSING:
                # out of memory or file descriptors for now: taken for a segment of this format, a
                # newer agent's segment was read as corrupt data (counted lost, the last one cut)
                raise SpoolError(
                    f"cannot read the spool segment {self.dir / f'{num:020d}.spl'} now ({exc.strerror}): not "
                    "opening the spool rather than take a newer agent's segment for corrupt data; start "
                    "again when the process has memory and file descriptors to spare"
                ) from None
            return None  # unreadable for good (a bad sector): its read at open says so

    def _list_segments(self) -> Position:
        """The segments on disk (those drained before a crash deleted); where reading starts.
        Segments of a newer format are left alone: neither read, nor cut, nor deleted, and new
        segments are numbered after them (the newer agent finds them intact after an upgrade)."""
        cur = self._cursor
        listed = self._list()
        if listed and cur.segment > listed[-1][0] + 1:
            # past the segment after the last one: no spool of this directory wrote that cursor
            # (a cursor of the previous format has no CRC: 16 bytes of garbage read as one). Believed,
            # it had every segment deleted as drained; a re-send duplicates, never loses
            log.warning("spool %s: the cursor names segment %d, past the last one on disk (%d); not "
                        "believed: re-sending from the oldest segment (duplicates, no loss)", self.dir,
                        cur.segment, listed[-1][0])  # fmt: skip
            cur = self._cursor = Position(-1, 0, -1)
        newer: list[str] = []
        for num, legacy in listed:
            version = None if legacy else self._newer_format(num)
            if version is not None:
                newer.append(f"{num:020d}.spl (version {version})")
                self._newer_top = max(self._newer_top, num)
                continue
            if cur.segment >= 0 and num < cur.segment:  # drained before a crash: delete
                self._unlink(num, legacy)
                continue
            self._segs[num] = _Seg(num, legacy, sealed=legacy)
        if newer:
            log.warning(
                "spool %s: %d segments of a newer format (this agent writes version %d), left alone for "
                "the agent that wrote them: %s",
                self.dir, len(newer), MAGIC[-1], ", ".join(newer[:5]) + (" ..." if len(newer) > 5 else ""),
            )  # fmt: skip
        if cur.segment < 0 or cur.segment not in self._segs:
            # the cursor's segment was drained and deleted: the next one starts at its sequence number
            cur = Position(
                next(iter(self._segs), max(cur.segment, 0)), 0, cur.seq if cur.segment >= 0 else -1
            )
        return cur

    def _open_segments(self) -> None:
        """Read every segment once: sizes, newest times, the sequence numbers; count the
        corrupt stretches; cut a torn tail."""
        cur = self._list_segments()
        expected: int | None = cur.seq if cur.seq >= 0 else None
        gap: tuple[int, int, _Gap] | None = None  # (segment, first seq, stretch) not yet resolved
        for s in self._segs.values():
            start = cur.offset if s.num == cur.segment else 0
            for item in self._read(s, start, open_scan=True):
                if isinstance(item, _Gap) and s.legacy:  # to its end; the old format tells no count: one
                    if expected is None:
                        expected = max(cur.seq, 0)
                        cur = Position(cur.segment, cur.offset, expected) if cur.seq < 0 else cur
                    self._count_gap(expected, 1, f"old-format segment {s.num} at byte {item.start}")
                    expected += 1
                    continue
                if isinstance(item, _Gap):
                    if gap is None:
                        gap = (s.num, -1 if expected is None else expected, item)
                    continue
                seq = item.seq if item.seq is not None else (0 if expected is None else expected)
                if gap is not None:  # the stretch held the records numbered [first, seq)
                    first = gap[1] if gap[1] >= 0 else max(0, seq - max(1, gap[2].magics))
                    self._count_gap(first, seq - first, f"segment {gap[0]} at byte {gap[2].start}")
                    expected, gap = first, None
                if expected is None:
                    expected = seq
                elif seq > expected:  # records missing without a trace (a file lost): count them
                    self._count_gap(expected, seq - expected, f"segment {s.num}")
                if cur.seq < 0:
                    cur = Position(cur.segment, cur.offset, expected)
                expected = max(seq, expected) + 1
                if s.newest is None or item.record.appended_at > s.newest:
                    s.newest = item.record.appended_at
            if s.num == cur.segment and cur.offset > s.size:
                expected = self._short_of_cursor(s, cur, expected)
                cur = Position(cur.segment, s.size, cur.seq)
            if expected is not None:
                s.end_seq = expected
        if expected is None:
            expected = max(cur.seq, 0)
            cur = Position(cur.segment, cur.offset, expected)
        if gap is not None:
            expected = self._trailing_gap(gap, expected)
        self._cursor = cur
        self._next_seq = expected

    def _short_of_cursor(self, s: _Seg, cur: Position, expected: int | None) -> int | None:
        """The cursor's segment ends before the cursor: a power loss kept the cursor (renamed into
        place) but not the segment's end (appended before, never synced). What came before the
        cursor was delivered; at least one record came after it (or the cursor would be at the next
        segment), lost: counted as a torn tail is (one, or exactly by the next segment's first
        sequence number). Reads and appends go on from the end the segment has: read from the
        cursor, the records appended after the restart were skipped as corrupt. The next number."""
        log.warning("spool %s: segment %s ends at byte %d, before the cursor (%d): its end was lost (a "
                    "power loss); reading on from its end", self.dir, self._path(s).name, s.size,
                    cur.offset)  # fmt: skip
        if expected is None:  # a cursor of the previous format: no sequence number to count with
            return None
        self._count_gap(expected, 1, f"segment {s.num} after byte {s.size} (before the cursor)")
        return expected + 1

    def _trailing_gap(self, gap: tuple[int, int, _Gap], expected: int) -> int:
        """A stretch corrupt up to the end: nothing after it tells how many records it held;
        counted (at least one), the tail cut; the next sequence number."""
        num, first, g = gap
        first = expected if first < 0 else first
        lost = max(1, g.magics)
        self._count_gap(first, lost, f"segment {num} at byte {g.start} (to the end)")
        expected = first + lost
        for s in self._segs.values():
            if s.num >= num:
                s.end_seq = expected
        self._cut(self._segs[num], g.start)
        return expected

    def _cut(self, s: _Seg, at: int) -> None:
        """Cut the corrupt tail of a segment, so appends follow intact records."""
        if s.legacy or s.sealed or s.num != next(reversed(self._segs)):
            return
        try:
            os.truncate(self._path(s), at)
            s.size = at
        except OSError as exc:
            log.warning("spool %s: cannot cut the corrupt tail of %s (%s); appending to a new segment",
                        self.dir, self._path(s).name, exc.strerror)  # fmt: skip
            s.sealed = True

    def _read(self, s: _Seg, start: int, open_scan: bool = False) -> Iterator[_Good | _Gap]:
        path = self._path(s)
        read = start if open_scan else min(start, s.size)  # (at open: the end of what was read of it)
        try:
            with open(path, "rb") as f:
                if open_scan:
                    s.size = os.fstat(f.fileno()).st_size
                    read = min(start, s.size)
                for item in _scan(f, min(start, s.size), s.size, s.legacy):
                    read = item.end
                    yield item
        except (FileNotFoundError, NotADirectoryError):  # the file, or its directory, is gone
            self._log_once(f"missing {s.num}", "spool %s: segment %s vanished; its records count as lost",
                           self.dir, path.name)  # fmt: skip
        except OSError as exc:
            if open_scan and exc.errno in _PASSING:
                # out of memory or file descriptors for now: its records are there, and counting
                # them as lost (as for a bad sector) lost them; the spool is not opened (the agent
                # says so and exits; started again, it reads them all)
                raise SpoolError(
                    f"cannot read the spool segment {path} now ({exc.strerror}): not opening the spool rather "
                    "than count its records as lost; start again when the process has memory and file "
                    "descriptors to spare"
                ) from None
            if open_scan:
                # unreadable at open (EIO of a bad sector): what was read of it is all it
                # holds for this process, the rest a corrupt stretch counted as lost (exactly, by the
                # next segment's first sequence number); sealed, so that no append goes over its
                # bytes (it was taken for an empty tail: the next append wrote over its records at
                # byte 0), nor is it cut, nor read past that point (its numbers are given again)
                self._log_once(f"read {s.num}", "spool %s: cannot read %s at open (%s) past byte %d; its "
                               "records from there count as lost, the file not written to", self.dir,
                               path.name, exc.strerror, read)  # fmt: skip
                s.size, s.sealed = read, True
                yield _Gap(read, read, 1)
                return
            if exc.errno in _PASSING and not open_scan:  # the records are there: never counted lost
                self._n.read_failures += 1
                self._log_once(f"unreadable {s.num} {exc.errno}", "spool %s: cannot read %s now (%s); the "
                               "drain waits before it and tries again, its records kept", self.dir, path.name,
                               exc.strerror)  # fmt: skip
                raise _Unreadable(path.name) from exc
            self._log_once(f"read {s.num}", "spool %s: cannot read %s (%s); its records count as lost",
                           self.dir, path.name, exc.strerror)  # fmt: skip

    # ------------------------------------------------------------------ files
    def _path(self, s: _Seg) -> Path:
        return self.dir / f"{s.num:020d}.{'seg' if s.legacy else 'spl'}"

    def _unlink(self, num: int, legacy: bool) -> None:
        try:
            (self.dir / f"{num:020d}.{'seg' if legacy else 'spl'}").unlink(missing_ok=True)
        except OSError as exc:
            self._log_once(
                "unlink", "spool %s: cannot delete drained segment %s: %s", self.dir, num, exc.strerror
            )

    def _save_cursor(self) -> bool:
        """Whether the cursor is on disk; not (a full disk): the segments it passed are kept."""
        c = self._cursor
        data = _CURSOR.pack(c.segment, c.offset, c.seq)
        try:
            replace_file(
                self.dir / "cursor", data + zlib.crc32(data).to_bytes(4, "little"), durable=self.fsync
            )
        except OSError as exc:  # a later save retries; at worst a restart re-sends (duplicates)
            self._log_once(f"cursor {exc.errno}", "cannot save the spool cursor: %s (retried at the next "
                           "advance; a restart before then re-sends what was drained)", exc.strerror)  # fmt: skip
            return False
        return True

    def _log_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._n.logged:
            self._n.logged.add(key)
            log.warning(msg, *args)

    def _count_gap(self, first: int, n: int, where: str) -> None:
        old = self._gaps.get(first, 0)
        if n <= old:
            return
        self._gaps[first] = n
        self._n.dropped_corrupt += n - old
        log.warning("spool %s: corrupt data in %s; skipped %d records (%d lost to corruption so far)",
                    self.dir, where, n - old, self._n.dropped_corrupt)  # fmt: skip

    # ------------------------------------------------------------------ API
    def __len__(self) -> int:
        """Records not yet drained."""
        return self._next_seq - self._cursor.seq - sum(self._gaps.values())

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self._segs.values())

    @property
    def dropped_records(self) -> int:
        return self._n.dropped_bound + self._n.dropped_corrupt + self._n.dropped_rejected

    @property
    def dropped_bytes(self) -> int:
        return self._n.dropped_bytes

    def stats(self) -> SpoolStats:
        n = self._n
        return SpoolStats(n.accepted, n.delivered, len(self), n.dropped_bound, n.dropped_corrupt, n.refused,
                          self.size_bytes, n.dropped_rejected, n.read_failures)  # fmt: skip

    def _tail(self, nbytes: int) -> _Seg:
        last = self._segs[next(reversed(self._segs))] if self._segs else None
        if (
            last is not None
            and not last.sealed
            and (last.size == 0 or last.size + nbytes <= self.segment_bytes)
        ):
            return last
        num = last.num + 1 if last is not None else max(self._cursor.segment, 1)
        num = max(num, self._newer_top + 1)  # never into a newer agent's segment
        s = _Seg(num, False, 0, self._next_seq)
        self._segs[num] = s
        if not self._segs or self._cursor.segment < next(iter(self._segs)):
            self._cursor = Position(next(iter(self._segs)), 0, self._cursor.seq)
        return s

    def append(self, records: list[Record]) -> None:
        """Append whole records, or nothing: on failure the segment is cut back and
        :class:`SpoolWriteError` raised (the records are not accepted)."""
        if not records:
            return
        seq0 = self._next_seq
        try:
            blob = b"".join(_encode(r, seq0 + i) for i, r in enumerate(records))
        except ValueError as exc:  # refused before anything is written
            self._n.refused += len(records)
            raise SpoolWriteError(f"cannot spool a record: {exc}") from None
        s = self._tail(len(blob))
        fresh = s.size == 0
        try:
            try:
                if self._replaced():  # deleted and made again by someone else: as if it vanished
                    s, fresh = self._remake_directory(len(blob)), True
                self._write(s, blob)
            except FileNotFoundError:
                if self.dir.is_dir():
                    raise
                s, fresh = self._remake_directory(len(blob)), True
                self._write(s, blob)
        except OSError as exc:
            self._n.refused += len(records)
            if fresh and s.num in self._segs:
                del self._segs[s.num]
                self._unlink(s.num, False)
            raise SpoolWriteError(f"cannot write to the spool {self.dir}: {exc.strerror or exc}") from None
        s.size += len(blob)
        latest = max(r.appended_at for r in records)
        s.newest = latest if s.newest is None else max(s.newest, latest)
        s.fresh_at = self.elapsed()
        self._next_seq = s.end_seq = seq0 + len(records)
        self._n.accepted += len(records)
        self._enforce_bounds()

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.dir)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _replaced(self) -> bool:
        """Whether the directory is another one than the spool holds: deleted and made again by
        someone else (a configuration tool, a restore). Written into as it was, the appends went on
        without the lock (a second agent could open it) and at the old offsets of files no longer
        there. (A missing one is found by the write.)"""
        now = self._identity()
        return now is not None and now != self._dir_id

    def _remake_directory(self, nbytes: int) -> _Seg:
        """The spool's directory vanished under it (deleted by hand, a temporary-files cleaner), or
        was made again by someone else: made again (or taken as it is), and the lock taken again in it, so that appends go on rather than fail until a
        restart; the records that were in it are counted as lost and logged. The tail segment to
        write to. ``OSError`` when it cannot be made (the append is refused)."""
        lost = len(self)
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._lock_fd is not None:  # a lock on a deleted file locks nothing
            os.close(self._lock_fd)
            self._lock_fd = None
        try:
            self._lock_fd = self._lock()
        except SpoolError as exc:  # another agent made it first
            raise OSError(errno.EBUSY, str(exc)) from None
        self._dir_id = self._identity()
        top = max([*self._segs, self._cursor.segment, self._newer_top])
        self._segs.clear()
        self._gaps.clear()  # (their records are in dropped_corrupt already)
        self._cursor = Position(top + 1, 0, self._next_seq)
        self._n.dropped_corrupt += lost
        log.error("spool %s: its directory vanished with %d undrained records; made again, those records "
                  "counted as lost (%d lost so far)", self.dir, lost, self._n.dropped_corrupt)  # fmt: skip
        self._save_cursor()
        return self._tail(nbytes)

    def _write(self, s: _Seg, blob: bytes) -> None:
        fd = os.open(self._path(s), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            try:
                pwrite_all(fd, blob, s.size)
                if self.fsync:
                    os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, s.size)  # roll back to the last whole record
                except (
                    OSError
                ) as exc:  # the bytes past s.size are never read; the next append overwrites them
                    self._log_once("rollback", "spool %s: cannot cut a failed append back: %s", self.dir, exc)
                raise
        finally:
            os.close(fd)

    def peek(self, max_records: int = 1000, max_bytes: int = 4 * 2**20) -> list[tuple[Position, Record]]:
        """The oldest undrained records, each with the position just after it. Corrupt
        stretches on the way are skipped and counted; a segment that cannot be read for now (the
        process out of file descriptors or memory) ends the list before it, its records kept, the
        failure counted (``read_failures``) and logged: EMFILE took every record for lost and
        passed them. Any other read error (EIO of a bad sector) counts its records as lost, so that
        one bad segment never stops the drain."""
        out: list[tuple[Position, Record]] = []
        size = 0
        expected = self._cursor.seq
        for s in list(self._segs.values()):
            if s.num < self._cursor.segment:
                continue
            start = self._cursor.offset if s.num == self._cursor.segment else 0
            gap: _Gap | None = None
            try:
                for item in self._read(s, start):
                    if isinstance(item, _Gap):
                        gap = gap or item
                        continue
                    seq = expected if item.seq is None else max(item.seq, expected)
                    if seq > expected:
                        where = f"segment {s.num} at byte {gap.start}" if gap else f"segment {s.num}"
                        self._count_gap(expected, seq - expected, where)
                    gap = None
                    expected = seq + 1
                    out.append((Position(s.num, item.end, expected), item.record))
                    size += len(item.record.value)
                    if len(out) >= max_records or size >= max_bytes:
                        return out
            except _Unreadable:  # kept for the next peek (logged, counted)
                return out
            if s.end_seq > expected:  # lost at the segment's end (corrupt, cut, or the file vanished)
                where = f"segment {s.num}" + (f" at byte {gap.start}" if gap else "")
                self._count_gap(expected, s.end_seq - expected, where)
            expected = max(expected, s.end_seq)
            if not out and expected > self._cursor.seq:  # nothing intact before here: pass the lost stretch
                self.advance(Position(s.num, s.size, expected), 0)
        return out

    def advance(self, to: Position, count: int, rejected: bool = False) -> None:
        """Mark everything before ``to`` drained (``count`` records delivered, or with ``rejected``
        dropped as undeliverable); delete drained segments. The counts come from the sequence
        numbers; ``count`` is a cross-check."""
        if to.seq <= self._cursor.seq:  # evicted (bounds) while the drainer had it out: already counted
            return
        passed = self._pass_gaps(to.seq)
        moved = to.seq - self._cursor.seq - passed
        if moved != count:
            log.debug("spool advance: %d records by sequence, %d by the caller", moved, count)
        if rejected:
            self._n.dropped_rejected += max(0, moved)
        else:
            self._n.delivered += max(0, moved)
        drained = [
            s
            for s in self._segs.values()
            if s.num < to.segment or (s.num == to.segment and s.size <= to.offset)
        ]
        if any(s.num == to.segment for s in drained) or to.segment not in self._segs:
            # drained to the end of its segment: the cursor moves to the next one left
            left = next((n for n in self._segs if n > to.segment), to.segment + 1)
            to = Position(left, 0, to.seq)
        self._cursor = to
        if self._save_cursor():  # first the cursor, then the files: a crash between never loses count
            for s in drained:  # (not saved: kept, deleted by the next advance that saves, or at open)
                self._delete(s)

    def _pass_gaps(self, upto: int) -> int:
        passed = [k for k in self._gaps if k < upto]
        return sum(self._gaps.pop(k) for k in passed)

    def _delete(self, s: _Seg) -> None:
        del self._segs[s.num]
        self._unlink(s.num, s.legacy)

    def _age(self, s: _Seg) -> float | None:
        """The age of the segment's newest record: by the elapsed clock since this process's last
        append to it; for one found on disk, its wall-clock age at open plus the time elapsed since.
        None where no record tells."""
        if s.fresh_at is not None:
            return self.elapsed() - s.fresh_at
        if s.newest is None:
            return None
        return self._wall0 - s.newest + (self.elapsed() - self._elapsed0)

    def _enforce_bounds(self) -> None:
        while len(self._segs) > 1:
            oldest = self._segs[next(iter(self._segs))]
            if oldest.num < self._cursor.segment:  # drained, kept while the cursor could not be saved
                if not self._save_cursor():
                    break
                self._delete(oldest)
                continue
            too_big = self.size_bytes > self.max_bytes
            age = self._age(oldest)
            too_old = age is not None and age > self.max_age_s
            if not (too_big or too_old):
                break
            start = self._cursor.offset if oldest.num == self._cursor.segment else 0
            nbytes = max(0, oldest.size - start)
            following = list(self._segs)[1]  # there are two or more
            kept, self._cursor = self._cursor, Position(following, 0, max(self._cursor.seq, oldest.end_seq))
            if not self._save_cursor():  # first the cursor, then the file (as in advance)
                self._cursor = kept  # nothing dropped: over the bound until a cursor can be saved
                break
            passed = self._pass_gaps(oldest.end_seq)
            lost = max(0, oldest.end_seq - kept.seq - passed)
            self._delete(oldest)
            if lost:
                self._n.dropped_bound += lost
                self._n.dropped_bytes += nbytes
                log.warning(
                    "spool %s over its %s bound: dropped the oldest %d undrained records (%d bytes; %d dropped so far)",
                    self.dir,
                    "byte" if too_big else "age",
                    lost,
                    nbytes,
                    self._n.dropped_bound,
                )

"""The disk spool: order, bounds, and its own files under faults (torn, bit-flipped,
mis-sized, stray, old-format, read-only, full). Every case asserts the exact accounting
identity ``accepted == delivered + pending + dropped`` and which records came out."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import resource
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.spool import MAGIC, Record, Spool, SpoolError, SpoolStats, SpoolWriteError
from tests.fs import tmpfs

HEAD = 20  # magic, u32 length, u64 seq, u32 crc (the record layout in docs/deployment.md)


def recs(n: int, start: int = 0, t: float = 1000.0, size: int = 10) -> list[Record]:
    return [Record("topic", b"node", f"{i:06d}".encode() + b"x" * size, t) for i in range(start, start + n)]


def ids(values: list[bytes]) -> list[int]:
    return [int(v[:6]) for v in values]


def drain(sp: Spool, max_records: int = 7) -> list[bytes]:
    out: list[bytes] = []
    while len(sp):
        batch = sp.peek(max_records=max_records)
        if not batch:
            break
        out += [r.value for _, r in batch]
        sp.advance(batch[-1][0], len(batch))
        check(sp.stats())
    return out


def check(st: SpoolStats) -> None:
    assert st.accepted == st.delivered + st.pending + st.dropped_bound + st.dropped_corrupt, st


def on_disk_size(r: Record) -> int:
    return HEAD + 8 + 2 + len(r.topic.encode()) + 2 + len(r.key) + len(r.value)


def test_fifo_across_segments_and_restart(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=10**6, segment_bytes=200, clock=lambda: 1000.0)
    for k in range(10):
        sp.append(recs(5, start=5 * k))
    assert len(sp) == 50
    assert len(list(tmp_path.glob("*.spl"))) > 3
    batch = sp.peek(max_records=12)
    sp.advance(batch[-1][0], len(batch))  # 12 drained, then the agent restarts
    check(sp.stats())
    sp.close()
    sp2 = Spool(tmp_path, max_bytes=10**6, segment_bytes=200, clock=lambda: 1000.0)
    assert len(sp2) == 38 and sp2.stats().accepted == 38
    got = drain(sp2)
    assert ids(got) == list(range(12, 50))
    assert sp2.stats() == SpoolStats(38, 38, 0, 0, 0, 0, sp2.size_bytes)
    assert sp2.size_bytes < 200  # drained segments are deleted
    sp2.close()
    assert len(Spool(tmp_path)) == 0


def test_record_layout_is_the_documented_one(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    r = Record("gpuslo.samples", b"n1", b'{"a":1}', 1234.5)
    sp.append([r, r])
    (seg,) = tmp_path.glob("*.spl")
    data = seg.read_bytes()
    assert len(data) == 2 * on_disk_size(r)
    magic, n, seq, crc = struct.unpack_from("<4sIQI", data, 0)
    body = data[HEAD : HEAD + n]
    assert (magic, seq) == (MAGIC, 0) and struct.unpack_from("<IQ", data, on_disk_size(r) + 4)[1] == 1
    assert crc == zlib.crc32(body, zlib.crc32(struct.pack("<IQ", n, seq)))
    assert (
        body == struct.pack("<dH", 1234.5, 14) + b"gpuslo.samples" + struct.pack("<H", 2) + b"n1" + b'{"a":1}'
    )


def test_torn_tail_is_cut_counted_and_the_rest_survives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sp = Spool(tmp_path)
    sp.append(recs(3))
    seg = sorted(tmp_path.glob("*.spl"))[-1]
    whole = seg.stat().st_size
    with open(seg, "ab") as f:  # power lost mid-write: a header and half a body
        f.write(MAGIC + struct.pack("<IQI", 64, 3, 0) + b"\x01\x02")
    sp.close()
    with caplog.at_level(logging.WARNING):
        sp2 = Spool(tmp_path)
    assert "corrupt data" in caplog.text
    assert seg.stat().st_size == whole  # cut back to the whole records
    assert sp2.stats() == SpoolStats(4, 0, 3, 0, 1, 0, whole)
    assert ids(drain(sp2)) == [0, 1, 2]
    sp2.append(recs(1, start=3))
    assert ids(drain(sp2)) == [3]
    check(sp2.stats())


def test_byte_bound_drops_oldest_counts_and_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sp = Spool(tmp_path, max_bytes=2000, segment_bytes=500, clock=lambda: 1000.0)
    with caplog.at_level(logging.WARNING):
        for k in range(40):
            sp.append(recs(1, start=k, size=60))
            check(sp.stats())
    assert sp.size_bytes <= 2000
    assert sp.dropped_records > 0
    assert "over its byte bound: dropped the oldest" in caplog.text
    got = ids(drain(sp))
    assert got == list(range(40 - len(got), 40))  # the newest survive, in order
    st = sp.stats()
    assert st.dropped_bound == sp.dropped_records == 40 - len(got) and st.accepted == 40


def test_byte_bound_after_a_partial_drain(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1500, segment_bytes=500, clock=lambda: 1000.0)
    sp.append(recs(5, size=60))
    batch = sp.peek(max_records=2)
    sp.advance(batch[-1][0], 2)  # cursor in the middle of the oldest segment
    for k in range(5, 40):
        sp.append(recs(1, start=k, size=60))
        check(sp.stats())
    got = ids(drain(sp))
    st = sp.stats()
    assert got == list(range(40 - len(got), 40))
    assert st.delivered == 2 + len(got) and st.dropped_bound == 40 - 2 - len(got)


def test_age_bound(tmp_path: Path) -> None:
    now = [1000.0]
    sp = Spool(tmp_path, max_age_s=60, segment_bytes=100, clock=lambda: now[0], elapsed=lambda: now[0])
    sp.append(recs(3, t=1000.0))
    now[0] = 2000.0
    sp.append(recs(3, start=3, t=2000.0))
    assert sp.dropped_records == 3
    assert ids(drain(sp)) == [3, 4, 5]
    check(sp.stats())


@pytest.mark.parametrize("back_s", [0.0, 1.0, 3539.0, 3540.0, 3541.0, 3600.0, 10 * 86400.0, 1e9])
@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("restart", [False, True])
def test_a_clock_set_back_and_forward_again_never_ages_fresh_records(
    tmp_path: Path, back_s: float, together: bool, restart: bool
) -> None:
    """A segment is dropped for its age only when all its records are older than the bound: a
    wall clock set back (an NTP step, an operator) while records were appended, then set right,
    made a segment of records a minute old look as old as the step, and dropped them."""
    t0, bound = 1_790_000_000.0, 3600.0
    now = [t0]
    spool = lambda: Spool(tmp_path, max_age_s=bound, segment_bytes=3 * on_disk_size(recs(1)[0]),  # noqa: E731
                          clock=lambda: now[0])  # fmt: skip
    sp = spool()
    stale = recs(1, start=2, t=t0 - back_s)  # stamped while the clock was back
    sp.append(recs(2, t=t0) + (stale if together else []))
    if restart:
        sp.close()
        sp = spool()
    now[0] = t0 - back_s
    if not together:
        sp.append(stale)  # into the same segment as the fresh records
    now[0] = t0 + 60.0  # set right: the fresh records are a minute old
    for k in range(3, 11):
        sp.append(recs(1, start=k, t=now[0]))  # the next segments; the bounds are checked each time
    assert len(list(tmp_path.glob("*.spl"))) >= 3
    assert sp.stats().dropped_bound == 0
    assert ids(drain(sp)) == list(range(11))
    check(sp.stats())


@pytest.mark.parametrize("step_s", [1.0, 3539.0, 3541.0, 30 * 86400.0, 100 * 365 * 86400.0])
@pytest.mark.parametrize("found_at_open", [False, True])
def test_a_wall_clock_set_forward_never_ages_the_spool(
    tmp_path: Path, step_s: float, found_at_open: bool
) -> None:
    """The age bound measures time on a clock no one sets: a wall clock set forward (an NTP server
    ahead, an operator's typo), even for one tick, made every segment look as old as the step, and
    the bound dropped every undrained record, minutes old. Segments found at open are aged by the
    wall clock then, and by the elapsed clock from there on. Time that did elapse still ages them."""
    t0, bound = 1_790_000_000.0, 3600.0
    wall, elapsed = [t0], [50.0]  # the two clocks, moved apart by the step only
    per = on_disk_size(recs(1)[0])
    spool = lambda: Spool(tmp_path, max_age_s=bound, segment_bytes=2 * per, clock=lambda: wall[0],  # noqa: E731
                          elapsed=lambda: elapsed[0])  # fmt: skip
    sp = spool()
    for k in range(10):  # five segments over 100 s
        sp.append(recs(1, start=k, t=wall[0]))
        wall[0] += 10.0
        elapsed[0] += 10.0
    if found_at_open:
        sp.close()
        sp = spool()
    wall[0] += step_s  # set forward for one tick, then right again
    sp.append(recs(1, start=10, t=wall[0]))
    wall[0] -= step_s
    for k in range(11, 14):
        sp.append(recs(1, start=k, t=wall[0]))
    assert sp.stats().dropped_bound == 0
    elapsed[0] += bound  # an hour does pass: the five first segments are past the bound
    wall[0] += bound
    sp.append(recs(1, start=14, t=wall[0]))
    assert ids(drain(sp)) == [10, 11, 12, 13, 14]
    assert sp.stats().dropped_bound == 10
    check(sp.stats())


def test_record_bigger_than_the_peek_budget_still_comes_out(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    sp.append([Record("t", b"k", b"z" * 1_000_000, 1.0)])
    ((_, r),) = sp.peek(max_bytes=1000)
    assert len(r.value) == 1_000_000


# ---------------------------------------------------------------------- corruption
def small_spool(d: Path) -> tuple[list[int], dict[str, list[tuple[int, int, int]]]]:
    """Three segments of 4 records (ids 0..11), 3 already drained: what is pending, and per
    segment file the (start, end, id) byte range of each record."""
    sp = Spool(d, segment_bytes=4 * on_disk_size(recs(1)[0]), clock=lambda: 1000.0)
    layout: dict[str, list[tuple[int, int, int]]] = {}
    for k in range(12):
        before = {p.name: p.stat().st_size for p in d.glob("*.spl")}
        sp.append(recs(1, start=k, size=3 + k % 3))
        for p in d.glob("*.spl"):
            if p.stat().st_size != before.get(p.name, 0):
                layout.setdefault(p.name, []).append((before.get(p.name, 0), p.stat().st_size, k))
    batch = sp.peek(max_records=3)
    sp.advance(batch[-1][0], 3)
    assert len(layout) == 3 and all(len(v) == 4 for v in layout.values())
    return list(range(3, 12)), layout


@pytest.fixture
def pristine(tmp_path: Path) -> tuple[Path, list[int], dict[str, list[tuple[int, int, int]]]]:
    d = tmp_path / "pristine"
    pending, layout = small_spool(d)
    return d, pending, layout


def flipped_copies(
    src: Path, dst: Path, layout: dict[str, list[tuple[int, int, int]]], bits: int
) -> Iterator[tuple[int | None, str, int]]:
    """For every byte of every segment: a fresh copy of the spool with ``bits`` xored into
    that byte; yields the id of the record hit (None: an already drained one)."""
    for name, ranges in layout.items():
        size = ranges[-1][1]
        for off in range(size):
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst)
            p = dst / name
            data = bytearray(p.read_bytes())
            data[off] ^= bits
            p.write_bytes(bytes(data))
            hit = next(k for a, b, k in ranges if a <= off < b)
            yield (hit if hit >= 3 else None), name, off


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    ("bits", "chunk"),
    [  # the fast tier: one bit at every offset, also with reads smaller than a record
        (0x01, None),
        (0x04, 7),
        pytest.param(0x80, None, marks=pytest.mark.integration),  # the top bit, and all of them
        pytest.param(0xFF, None, marks=pytest.mark.integration),
    ],
)
def test_bit_flip_at_every_byte_offset_at_open(
    pristine: tuple[Path, list[int], dict[str, list[tuple[int, int, int]]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    bits: int,
    chunk: int | None,
) -> None:
    """A flip anywhere: exactly the record hit is lost and counted, every intact one comes
    out in order, the spool starts, and later appends drain. (chunk: the reader's read size,
    small so that every record and every resynchronisation crosses reads.)"""
    if chunk is not None:
        monkeypatch.setattr("gpuslo.agent.spool._CHUNK", chunk)
    src, pending, layout = pristine
    cases = 0
    for hit, name, off in flipped_copies(src, tmp_path / "case", layout, bits):
        sp = Spool(tmp_path / "case", clock=lambda: 1000.0)
        want = [k for k in pending if k != hit]
        got = ids(drain(sp))
        st = sp.stats()
        assert got == want, (name, off)
        assert st.dropped_corrupt == (0 if hit is None else 1), (name, off, st)
        assert st.accepted == len(pending) and st.pending == 0, (name, off, st)
        check(st)
        sp.append(recs(2, start=100))
        assert ids(drain(sp)) == [100, 101], (name, off)
        check(sp.stats())
        cases += 1
    assert cases == sum(r[-1][1] for r in layout.values())


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_bit_flip_at_every_byte_offset_while_running(
    pristine: tuple[Path, list[int], dict[str, list[tuple[int, int, int]]]], tmp_path: Path
) -> None:
    """The same flips under an open spool (found by the drainer, not at open)."""
    src, pending, layout = pristine
    for name, ranges in layout.items():
        for off in range(ranges[-1][1]):
            case = tmp_path / "case"
            if case.exists():
                shutil.rmtree(case)
            shutil.copytree(src, case)
            sp = Spool(case, clock=lambda: 1000.0)
            p = case / name
            data = bytearray(p.read_bytes())
            data[off] ^= 0x10
            p.write_bytes(bytes(data))
            hit = next(k for a, b, k in ranges if a <= off < b)
            got = ids(drain(sp, max_records=2))
            assert got == [k for k in pending if k != hit], (name, off)
            assert sp.stats().dropped_corrupt == (1 if hit >= 3 else 0), (name, off)
            check(sp.stats())


def _set_length(p: Path, at: int, n: int) -> None:
    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, at + 4, n)
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("which", [0, 1, 3])  # first, middle, last record of a segment
def test_bad_lengths(
    pristine: tuple[Path, list[int], dict[str, list[tuple[int, int, int]]]], tmp_path: Path, which: int
) -> None:
    src, pending, layout = pristine
    for name, ranges in layout.items():
        a, b, k = ranges[which]
        true_n = b - a - HEAD
        seg_size = ranges[-1][1]
        for n in sorted({0, 1, true_n - 1, true_n + 1, true_n + HEAD, seg_size - a - HEAD, seg_size,
                         2**31, 2**32 - 1} - {true_n}):  # fmt: skip
            case = tmp_path / "case"
            if case.exists():
                shutil.rmtree(case)
            shutil.copytree(src, case)
            _set_length(case / name, a, n)
            sp = Spool(case, clock=lambda: 1000.0)
            got = ids(drain(sp))
            lost = 1 if k >= 3 else 0
            assert got == [x for x in pending if x != k], (name, which, n)
            assert sp.stats().dropped_corrupt == lost, (name, which, n)
            check(sp.stats())


def test_a_whole_segment_of_garbage_and_a_vanished_segment(tmp_path: Path) -> None:
    d = tmp_path / "s"
    _, layout = small_spool(d)
    names = sorted(layout)
    (d / names[1]).write_bytes(random.Random(7).randbytes(300))  # the middle segment: 4 records lost
    sp = Spool(d)
    assert ids(drain(sp)) == [3, 8, 9, 10, 11]
    assert sp.stats().dropped_corrupt == 4
    check(sp.stats())
    # while running: a segment deleted under the spool
    d2 = tmp_path / "s2"
    small_spool(d2)
    sp2 = Spool(d2)
    (d2 / names[1]).unlink()
    assert ids(drain(sp2)) == [3, 8, 9, 10, 11]
    assert sp2.stats().dropped_corrupt == 4
    check(sp2.stats())


def test_corrupt_cursor_resends_instead_of_losing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "s"
    small_spool(d)
    data = bytearray((d / "cursor").read_bytes())
    for off in range(len(data)):
        case = tmp_path / "case"
        if case.exists():
            shutil.rmtree(case)
        shutil.copytree(d, case)
        bad = bytearray(data)
        bad[off] ^= 0x04
        (case / "cursor").write_bytes(bytes(bad))
        with caplog.at_level(logging.WARNING):
            sp = Spool(case)
        got = ids(drain(sp))
        assert got == list(range(12)), off  # from the oldest segment: duplicates, nothing lost
        assert sp.stats().dropped == 0
        check(sp.stats())
    assert "corrupt cursor file" in caplog.text


@pytest.mark.parametrize("drained", [1, 10, 149, 150, 199, 200])
def test_a_lost_cursor_resends_and_counts_nothing_lost(tmp_path: Path, drained: int) -> None:
    """The cursor file gone (an operator's cleanup, a lost file) after ``drained`` records went:
    the spool reads from its oldest segment, re-sending what is left of it (duplicates, never a
    loss), and counts nothing as lost to corruption (it counted every record drained before)."""
    d = tmp_path / "s"
    sp = Spool(d, max_bytes=10**6, segment_bytes=4096, clock=lambda: 1000.0)
    for k in range(0, 200, 10):  # segments of about 4 KiB
        sp.append(recs(10, k, size=100))
    while sp.stats().delivered < drained:
        batch = sp.peek(max_records=min(7, drained - sp.stats().delivered))
        sp.advance(batch[-1][0], len(batch))
    sp.close()
    (d / "cursor").unlink()
    again = Spool(d, max_bytes=10**6, segment_bytes=4096, clock=lambda: 1000.0)
    got = ids(drain(again))
    assert got[-(200 - drained) :] == list(range(drained, 200)) and got == sorted(got)
    assert again.stats().dropped == 0 and again.stats().dropped_corrupt == 0
    check(again.stats())


@pytest.mark.parametrize("bound", [False, True])
def test_a_crash_between_the_cursor_and_the_files_loses_no_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: bool
) -> None:
    """The process dies after saving the cursor past drained segments (or past the oldest one,
    dropped by the byte bound) and before deleting their files: the files are deleted at the
    next start, nothing counted as lost to corruption, nothing delivered twice. (The files were
    deleted first: a crash there counted every record delivered from them as lost.)"""
    d = tmp_path / "s"
    sp = Spool(d, max_bytes=6000 if bound else 10**6, segment_bytes=4096, clock=lambda: 1000.0)
    for k in range(0, 90, 10):  # segments of about 4 KiB: 30 records each
        sp.append(recs(10, k, size=100))

    class Died(Exception):
        pass

    def die(*a: object) -> None:
        raise Died

    monkeypatch.setattr(Spool, "_delete", die)
    with pytest.raises(Died):
        if bound:
            sp.append(recs(30, 90, size=100))  # over the byte bound: the oldest segment goes
        else:
            batch = sp.peek(max_records=45)  # the whole first segment and more
            sp.advance(batch[-1][0], len(batch))
    monkeypatch.undo()
    sp.close()
    again = Spool(d, max_bytes=6000 if bound else 10**6, segment_bytes=4096, clock=lambda: 1000.0)
    st = again.stats()
    assert st.dropped_corrupt == 0, st
    got = ids(drain(again))
    assert got == (sorted(set(got)) if bound else list(range(45, 90))), got  # nothing delivered twice
    check(again.stats())


@pytest.mark.parametrize("bound", [False, True])
def test_a_cursor_that_cannot_be_saved_keeps_the_segments_it_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: bool
) -> None:
    """The disk full as the drainer advances past whole segments (or as the byte bound would
    drop the oldest): the cursor is not saved, so the segments stay, and a restart re-sends
    from them, counting nothing delivered as lost to corruption and nothing dropped twice."""
    import errno

    import gpuslo.agent.spool as spool_mod

    d = tmp_path / "s"
    sp = Spool(d, max_bytes=1000 if bound else 10**6, segment_bytes=200, clock=lambda: 1000.0)
    for k in range(6):
        sp.append(recs(1, k, size=50))
    first = sp.peek(max_records=2)
    sp.advance(first[-1][0], 2)
    real = spool_mod.replace_file

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod, "replace_file", full)
    if bound:
        for k in range(6, 20):  # over the byte bound: the oldest cannot be dropped without a cursor
            sp.append(recs(1, k, size=50))
    else:
        more = sp.peek(max_records=2)
        sp.advance(more[-1][0], 2)
    check(sp.stats())
    monkeypatch.setattr(spool_mod, "replace_file", real)
    sp.close()
    again = Spool(d, max_bytes=1000 if bound else 10**6, segment_bytes=200, clock=lambda: 1000.0)
    st = again.stats()
    assert st.dropped_corrupt == 0, st
    got = ids(drain(again))
    assert got == sorted(set(got)) and got[-1] == (19 if bound else 5), got
    check(again.stats())


def test_stray_files_are_logged_and_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sp = Spool(tmp_path)
    sp.append(recs(3))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "123.seg").write_bytes(b"x")  # not a segment name
    (tmp_path / "00000000000000000099.spl.bak").write_bytes(b"x")
    (tmp_path / "00000000000000000050.spl").mkdir()  # a directory with a segment's name
    (tmp_path / "lost+found").mkdir()
    sp.close()
    with caplog.at_level(logging.WARNING):
        sp2 = Spool(tmp_path)
    assert "files that are not the spool's, left alone" in caplog.text
    assert ids(drain(sp2)) == [0, 1, 2]
    sp2.append(recs(1, start=3))
    assert ids(drain(sp2)) == [3]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "00000000000000000050.spl").is_dir()


def test_cursor_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "cursor").mkdir()
    sp = Spool(tmp_path)
    sp.append(recs(2))
    assert ids(drain(sp)) == [0, 1]  # the cursor cannot be saved: logged, nothing stops
    check(sp.stats())


def test_spool_directory_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(SpoolError, match="exists and is not a directory"):
        Spool(tmp_path / "f")
    with pytest.raises(SpoolError, match="cannot create the spool directory"):
        Spool(tmp_path / "f" / "sub")


def legacy_record(r: Record) -> bytes:
    t = r.topic.encode()
    body = struct.pack("<dH", r.appended_at, len(t)) + t + struct.pack("<H", len(r.key)) + r.key + r.value
    return struct.pack("<II", len(body), zlib.crc32(body)) + body


def test_segments_of_the_previous_format_still_drain(tmp_path: Path) -> None:
    (tmp_path / f"{1:020d}.seg").write_bytes(b"".join(legacy_record(r) for r in recs(4)))
    (tmp_path / f"{2:020d}.seg").write_bytes(b"".join(legacy_record(r) for r in recs(3, start=4)))
    first = len(legacy_record(recs(1)[0]))
    (tmp_path / "cursor").write_bytes(struct.pack("<QQ", 1, first))  # the old cursor: one drained
    sp = Spool(tmp_path, clock=lambda: 1000.0)
    assert len(sp) == 6
    sp.append(recs(2, start=7))  # new records go to a new-format segment after them
    assert ids(drain(sp)) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert not list(tmp_path.glob("*.seg"))
    check(sp.stats())


def test_corrupt_old_format_segment_loses_its_rest_counted_but_starts(tmp_path: Path) -> None:
    data = bytearray(b"".join(legacy_record(r) for r in recs(4)))
    data[len(legacy_record(recs(1)[0])) + 12] ^= 0xFF  # inside the second record
    (tmp_path / f"{1:020d}.seg").write_bytes(bytes(data))
    (tmp_path / f"{2:020d}.seg").write_bytes(b"".join(legacy_record(r) for r in recs(2, start=4)))
    sp = Spool(tmp_path, clock=lambda: 1000.0)
    assert ids(drain(sp)) == [0, 4, 5]  # the old format cannot resynchronise: counted as one
    assert sp.stats().dropped_corrupt == 1
    check(sp.stats())


# ---------------------------------------------------------------------- the file system
def test_read_only_spool_directory_is_a_clear_error(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as d, pytest.raises(SpoolError, match="not writable"):
        Spool(d)


def fill(d: Path, leave: int) -> Path:
    """A filler file that takes all of ``d``'s free space but ``leave`` bytes."""
    st = os.statvfs(d)
    filler = d / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_full_disk_rolls_back_resumes_and_loses_nothing(tmp_path: Path) -> None:
    """A 1 MiB tmpfs: appends until the disk is full, each failure rolled back whole; space
    freed; appends resume; a restart finds exactly what was accepted, nothing corrupt."""
    with tmpfs(tmp_path / "tiny", "1m") as d:
        filler = fill(d, 200 * 1024)
        sp = Spool(d / "spool", segment_bytes=64 * 1024, clock=lambda: 1000.0)
        accepted: list[int] = []
        refused = 0
        k = 0
        while refused < 20:
            batch = recs(7, start=k, size=900)
            k += 7
            try:
                sp.append(batch)
                accepted += range(k - 7, k)
            except SpoolWriteError as exc:
                assert "No space left on device" in str(exc)
                refused += 7
            check(sp.stats())
            whole = sum(on_disk_size(r) for r in recs(1, size=900)) * len(accepted)
            assert sp.size_bytes == whole == sum(p.stat().st_size for p in (d / "spool").glob("*.spl"))
        assert accepted and sp.stats().refused == refused
        filler.unlink()  # space returns
        after = recs(20, start=k, size=900)
        sp.append(after)
        accepted += range(k, k + 20)
        sp.close()
        sp2 = Spool(d / "spool", clock=lambda: 1000.0)  # a restart: everything accepted is there
        assert sp2.stats() == SpoolStats(len(accepted), 0, len(accepted), 0, 0, 0, sp2.size_bytes)
        assert ids(drain(sp2)) == accepted


def test_long_corrupt_stretch_across_many_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """10 KiB of garbage (no magic in it) between records, read 64 bytes at a time."""
    monkeypatch.setattr("gpuslo.agent.spool._CHUNK", 64)
    sp = Spool(tmp_path, clock=lambda: 1000.0)
    sp.append(recs(3))
    (seg,) = tmp_path.glob("*.spl")
    good = seg.read_bytes()
    sp.append(recs(4, start=3))
    tail = seg.read_bytes()[len(good) :]
    r3 = on_disk_size(recs(1, start=3)[0])
    seg.write_bytes(good + bytes(range(1, 200)) * 50 + tail[r3:])  # record 3 overwritten by garbage
    sp.close()
    sp2 = Spool(tmp_path, clock=lambda: 1000.0)
    assert ids(drain(sp2, max_records=2)) == [0, 1, 2, 4, 5, 6]
    assert sp2.stats().dropped_corrupt == 1
    check(sp2.stats())


def test_segment_numbers_that_are_not_the_spools(tmp_path: Path) -> None:
    (tmp_path / f"{10**19:020d}.spl").write_bytes(b"x")  # would overflow the name width
    sp = Spool(tmp_path)
    sp.append(recs(2))
    sp.close()
    assert ids(drain(Spool(tmp_path))) == [0, 1]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_random_multiple_corruptions(
    pristine: tuple[Path, list[int], dict[str, list[tuple[int, int, int]]]], tmp_path: Path
) -> None:
    """1-4 random overwrites (1-40 bytes each) anywhere in the segments, 200 seeded cases: the
    spool opens, delivers exactly the untouched records in order, counts every damaged one
    (exactly, wherever a later intact record tells; at least one at the very end), and the
    identity holds."""
    src, pending, layout = pristine
    rng = random.Random(12)
    names = sorted(layout)
    last = (names[-1], layout[names[-1]][-1][2])
    for case in range(200):
        dst = tmp_path / "case"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        damaged: set[int] = set()
        for _ in range(rng.randint(1, 4)):
            name = rng.choice(names)
            p = dst / name
            data = bytearray(p.read_bytes())
            at = rng.randrange(len(data))
            n = min(rng.randint(1, 40), len(data) - at)
            new = rng.randbytes(n)
            if new == bytes(data[at : at + n]):
                continue
            data[at : at + n] = new
            p.write_bytes(bytes(data))
            damaged |= {k for a, b, k in layout[name] if a < at + n and at < b and k >= 3}
        sp = Spool(dst, clock=lambda: 1000.0)
        got = ids(drain(sp))
        st = sp.stats()
        assert got == [k for k in pending if k not in damaged], (case, damaged)
        check(st)
        tail_hit = last[1] in damaged
        assert (st.dropped_corrupt >= 1 if tail_hit else True) and (
            st.dropped_corrupt == len(damaged) or tail_hit
        ), (case, damaged, st)


def test_one_agent_per_spool_directory(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    sp.append(recs(1))
    with pytest.raises(SpoolError, match=f"in use by another agent \\(pid {os.getpid()}\\)"):
        Spool(tmp_path)
    sp.close()
    assert ids(drain(Spool(tmp_path))) == [0]  # released: the next one opens it


def test_no_inode_left_at_the_first_start(tmp_path: Path) -> None:
    """A file system out of inodes before the spool made any file: it starts (without its lock),
    refuses appends with the reason, and takes them once there is room."""
    with tmpfs(tmp_path / "full", "64k,nr_inodes=3") as d:
        (d / "spool").mkdir()
        (d / "taken").write_bytes(b"")  # the last inode
        sp = Spool(d / "spool", clock=lambda: 1000.0)
        with pytest.raises(SpoolWriteError, match="No space left on device"):
            sp.append(recs(2))
        (d / "taken").unlink()
        sp.append(recs(2))
        assert ids(drain(sp)) == [0, 1]
        assert sp.stats() == SpoolStats(2, 2, 0, 0, 0, 2, sp.size_bytes)


@pytest.mark.parametrize(
    "bad",
    [
        Record("t" * 65_536, b"k", b"v", 1.0),  # topic length past its u16
        Record("t", b"k" * 65_536, b"v", 1.0),  # key length past its u16
        Record("t", b"k", b"v" * 5000, 1.0),  # past MAX_RECORD_BYTES (made 4,096 here)
    ],
    ids=["topic", "key", "value"],
)
def test_a_record_the_format_cannot_hold_is_refused_never_spooled_as_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: Record
) -> None:
    monkeypatch.setattr("gpuslo.agent.spool.MAX_RECORD_BYTES", 4096)
    s = Spool(tmp_path / "s")
    s.append(recs(2))
    with pytest.raises(SpoolWriteError, match="cannot spool a record"):
        s.append([*recs(1, start=2), bad])
    s.append(recs(1, start=3))
    got = [r.value for _, r in s.peek()]
    assert got == [r.value for r in recs(2)] + [r.value for r in recs(1, start=3)]
    st = s.stats()
    assert (st.accepted, st.pending, st.dropped, st.refused) == (3, 3, 0, 2)
    s.close()
    again = Spool(tmp_path / "s")
    assert (len(again), again.stats().dropped) == (3, 0)


def test_segments_kept_for_an_unsaved_cursor_are_dropped_by_the_bound_without_moving_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cursor could not be saved past two drained segments; room again, an append takes the
    spool over its byte bound: the drained segments go (nothing counted lost), the cursor stays
    where it was (it moved back onto them: delivered records came out again, and ``len()`` of
    the spool went negative)."""
    import errno

    import gpuslo.agent.spool as spool_mod

    sp = Spool(
        tmp_path / "s", max_bytes=600, segment_bytes=200, clock=lambda: 1000.0
    )  # 6 records fit, 7 do not
    for k in range(6):
        sp.append(recs(1, k, size=50))
    real = spool_mod.replace_file

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod, "replace_file", full)
    first = sp.peek(max_records=4)
    sp.advance(first[-1][0], 4)
    monkeypatch.setattr(spool_mod, "replace_file", real)
    sp.append(recs(1, 6, size=50))
    check(sp.stats())
    assert len(sp) == 3 and ids(drain(sp)) == [4, 5, 6]
    assert sp.stats().dropped == 0


@pytest.mark.parametrize("version", [MAGIC[-1] + 1, 0x10, 0xFF])
def test_a_segment_of_a_newer_format_is_left_alone_and_numbered_past(
    tmp_path: Path, version: int, caplog: pytest.LogCaptureFixture
) -> None:
    """After a downgrade, the segments a newer agent wrote (the magic with a higher version byte)
    are neither read as corrupt, nor cut, nor deleted, nor appended to: the newer agent finds
    them intact. (They were cut to nothing and counted as one record lost.)"""
    d = tmp_path / "s"
    sp = Spool(d, segment_bytes=4 * on_disk_size(recs(1)[0]), clock=lambda: 1000.0)
    for k in range(6):  # two segments of ours
        sp.append(recs(1, start=k))
    sp.close()
    newer = sorted(d.glob("*.spl"))
    for p in newer:
        p.write_bytes(p.read_bytes().replace(MAGIC, MAGIC[:-1] + bytes([version])))
    before = {p.name: p.read_bytes() for p in newer}
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.spool"):
        sp = Spool(d, clock=lambda: 1000.0)
    assert sp.stats() == SpoolStats(0, 0, 0, 0, 0, 0, 0)
    assert f"2 segments of a newer format (this agent writes version {MAGIC[-1]})" in caplog.text
    sp.append(recs(3, start=10))
    assert ids(drain(sp)) == [10, 11, 12]
    check(sp.stats())
    sp.close()
    ours = sorted(set(d.glob("*.spl")) - set(newer))
    assert all(p.name > newer[-1].name for p in ours)  # numbered after them
    sp = Spool(d, clock=lambda: 1000.0)  # a restart: still left alone
    sp.append(recs(1, start=20))
    assert ids(drain(sp)) == [20] and sp.stats().dropped_corrupt == 0
    assert {p.name: p.read_bytes() for p in newer} == before


@pytest.mark.parametrize("which", [0, 1], ids=["older", "newer"])  # which of the newer agent's two segments
@pytest.mark.parametrize(
    "errno_", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN], ids=errno.errorcode.get
)
def test_a_newer_segment_unreadable_for_now_when_its_format_is_looked_at_is_left_alone(
    tmp_path: Path, which: int, errno_: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look at a segment's format (is it a newer agent's?) failing for now (out of memory or
    file descriptors) took the segment for one of this format; read next, when the error had
    passed, a newer agent's segment was corrupt data: its records counted as lost, the last one cut
    to nothing. Now the spool is not opened (as for a read of its records failing for now), the
    segments untouched; the next open leaves them alone."""
    d = tmp_path / "s"
    sp = Spool(d, segment_bytes=4 * on_disk_size(recs(1)[0]), clock=lambda: 1000.0)
    for k in range(6):  # two segments
        sp.append(recs(1, start=k))
    sp.close()
    newer = sorted(d.glob("*.spl"))
    for p in newer:
        p.write_bytes(p.read_bytes().replace(MAGIC, MAGIC[:-1] + bytes([MAGIC[-1] + 1])))
    before = {p.name: p.read_bytes() for p in newer}
    real_open = open
    failed: list[Path] = []

    def once(path: Any, *a: Any, **kw: Any) -> Any:  # the first open of the segment fails, for now
        if Path(path) == newer[which] and not failed:
            failed.append(Path(path))
            raise OSError(errno_, os.strerror(errno_))
        return real_open(path, *a, **kw)

    monkeypatch.setattr("gpuslo.agent.spool.open", once, raising=False)
    with pytest.raises(SpoolError, match=f"cannot read the spool segment .*{newer[which].name} now"):
        Spool(d, clock=lambda: 1000.0)
    monkeypatch.undo()
    assert failed and {p.name: p.read_bytes() for p in newer} == before
    sp = Spool(d, clock=lambda: 1000.0)  # the lock was released; the segments still left alone
    assert sp.stats().dropped_corrupt == 0
    sp.append(recs(1, start=20))
    assert ids(drain(sp)) == [20]
    assert {p.name: p.read_bytes() for p in newer} == before


def test_a_segment_of_ours_whose_first_version_byte_is_flipped_is_still_ours(tmp_path: Path) -> None:
    """What tells a newer segment from a corrupt one of ours: a record of this format in it."""
    d = tmp_path / "s"
    sp = Spool(d, clock=lambda: 1000.0)
    sp.append(recs(4))
    sp.close()
    (p,) = d.glob("*.spl")
    data = bytearray(p.read_bytes())
    data[len(MAGIC) - 1] = MAGIC[-1] + 1
    p.write_bytes(bytes(data))
    sp = Spool(d, clock=lambda: 1000.0)
    assert ids(drain(sp)) == [1, 2, 3] and sp.stats().dropped_corrupt == 1
    check(sp.stats())


@pytest.mark.parametrize("cut", [0.0, 2.0, 2.5, 5.0, 5.9])  # the segment's length left, in records
@pytest.mark.parametrize("later", [False, True])  # a segment after the cursor's
def test_a_segment_that_lost_its_end_but_not_the_cursor_loses_nothing_appended_after(
    tmp_path: Path, cut: float, later: bool
) -> None:
    """A power loss keeps the cursor (renamed into place) but not the end of its segment (appended
    earlier, never synced): the segment ends before the cursor. Appends after the restart went
    to the segment's end and reads from the cursor, past them: records written after the restart
    were skipped as corrupt. The records after the cursor are lost: exactly those counted when a
    later segment's sequence numbers tell, else one (as for a torn tail)."""
    per = on_disk_size(recs(1)[0])
    sp = Spool(tmp_path, segment_bytes=10 * per, clock=lambda: 1000.0)
    sp.append(recs(10))  # segment 1: ids 0..9
    if later:
        sp.append(recs(5, start=10))  # segment 2: ids 10..14
    batch = sp.peek(max_records=6)
    sp.advance(batch[-1][0], len(batch))
    sp.close()
    os.truncate(tmp_path / f"{batch[-1][0].segment:020d}.spl", int(cut * per))
    sp = Spool(tmp_path, segment_bytes=10 * per, clock=lambda: 1000.0)
    check(sp.stats())
    sp.append(recs(5, start=100))
    assert ids(drain(sp, max_records=3)) == [*(range(10, 15) if later else ()), *range(100, 105)]
    assert sp.stats().dropped_corrupt == (4 if later else 1)
    check(sp.stats())


@pytest.mark.parametrize(
    "cursor",
    [
        (5, 0),  # two past the last segment
        (2**32, 7),
        (2**64 - 1, 2**64 - 1),
        *(struct.unpack("<QQ", random.Random(k).randbytes(16)) for k in range(4)),  # 16 bytes of garbage
    ],
)
@pytest.mark.parametrize("fmt", ["previous", "current"])
def test_a_cursor_past_every_segment_is_not_believed(
    tmp_path: Path, cursor: tuple[int, int], fmt: str
) -> None:
    """A cursor naming a segment past the one after the last on disk was never written by this
    spool: believed, every segment was deleted as drained (a cursor of the previous format has no
    CRC, so any 16 bytes read as one). It re-sends from the oldest segment instead: duplicates,
    which the ingest absorbs, never a loss."""
    per = on_disk_size(recs(1)[0])
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    for k in range(12):  # segments 1, 2, 3
        sp.append(recs(1, start=k))
    sp.close()
    data = struct.pack("<QQ", *cursor)
    if fmt == "current":  # a well-formed cursor of today's format, sequence number and CRC
        data = struct.pack("<QQQ", *cursor, 3)
        data += zlib.crc32(data).to_bytes(4, "little")
    (tmp_path / "cursor").write_bytes(data)
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    assert ids(drain(sp)) == list(range(12))
    assert sp.stats().dropped == 0
    check(sp.stats())


def test_a_cursor_just_past_the_last_segment_is_every_record_drained(tmp_path: Path) -> None:
    """The cursor one segment past the last is what draining it all writes (the crash came before
    the segments were deleted): believed, nothing sent again."""
    per = on_disk_size(recs(1)[0])
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    for k in range(12):
        sp.append(recs(1, start=k))
    sp.close()
    (tmp_path / "cursor").write_bytes(struct.pack("<QQ", 4, 0))
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    assert drain(sp) == [] and list(tmp_path.glob("*.spl")) == []
    check(sp.stats())


@contextlib.contextmanager
def out_of_file_descriptors() -> Iterator[None]:
    """This process out of file descriptors (its soft limit lowered, then every one taken), as an
    agent with many connections or watches gets; given back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    held: list[int] = []
    try:
        with pytest.raises(OSError) as exc:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        assert exc.value.errno == errno.EMFILE
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("drained", [0, 2, 5])  # before the descriptors run out (mid-segment: 2)
@pytest.mark.parametrize("peeks", [1, 4])
def test_a_spool_read_while_out_of_file_descriptors_loses_nothing(
    tmp_path: Path, segments: int, drained: int, peeks: int
) -> None:
    """A segment that could not be opened for now (EMFILE) was taken for lost: every pending
    record counted as dropped to corruption and passed, though all were intact on disk. The
    drain now waits before it, counts and logs the failure, and delivers all once it passes."""
    sp = Spool(tmp_path, segment_bytes=4 * on_disk_size(recs(1)[0]), clock=lambda: 1000.0)
    for k in range(4 * segments + 2):
        sp.append(recs(1, start=k))
    total = len(sp)
    out: list[bytes] = []
    if drained:
        batch = sp.peek(max_records=drained)
        sp.advance(batch[-1][0], len(batch))
        out += [r.value for _, r in batch]
    with out_of_file_descriptors():
        for _ in range(peeks):
            assert sp.peek(max_records=100) == []
    st = sp.stats()
    assert (st.pending, st.dropped) == (total - drained, 0)
    assert st.read_failures == peeks
    out += drain(sp)
    assert ids(out) == list(range(total))
    assert sp.stats().dropped == 0
    check(sp.stats())


@pytest.mark.parametrize("drained", [0, 2, 5])
@pytest.mark.parametrize("remade", ["no", "empty", "with a stray file"])
def test_a_spool_directory_deleted_while_running_is_made_again(
    tmp_path: Path, drained: int, remade: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The directory deleted under a running agent (by hand, a temporary-files cleaner): the next
    append makes it again (and the lock in it) and goes on; the records that were in it are
    counted as lost, logged. (Every later append was refused until a restart.) Made again by
    someone else before that append (a configuration tool, a restore), the appends went on in it
    without the lock (a second agent opened it) and at the old offsets of files no longer there."""
    d = tmp_path / "s"
    per = on_disk_size(recs(1)[0])
    sp = Spool(d, segment_bytes=4 * per, clock=lambda: 1000.0)
    sp.append(recs(5))
    if drained:
        batch = sp.peek(max_records=drained)
        sp.advance(batch[-1][0], len(batch))
    shutil.rmtree(d)
    if remade != "no":
        d.mkdir()
        if remade == "with a stray file":
            (d / "README").write_text("made by the configuration tool")
    with caplog.at_level(logging.ERROR, logger="gpuslo.agent.spool"):
        sp.append(recs(2, start=10))
    st = sp.stats()
    check(st)
    assert sum(f.stat().st_size for f in d.glob("*.spl")) == 2 * per  # the two records, no hole
    assert (st.accepted, st.delivered, st.dropped_corrupt, st.pending, st.refused) == (
        7,
        drained,
        5 - drained,
        2,
        0,
    )
    assert f"vanished with {5 - drained} undrained records" in caplog.text
    sp.append(recs(1, start=12))
    assert ids(drain(sp)) == [10, 11, 12]
    check(sp.stats())
    with pytest.raises(SpoolError, match="in use by another agent"):  # the lock is held in the new one
        Spool(d)
    sp.append(recs(1, start=13))
    sp.close()
    again = Spool(d, clock=lambda: 1000.0)  # a restart finds what was appended since, nothing lost
    assert ids(drain(again)) == [13] and again.stats().dropped_corrupt == 0


@pytest.mark.parametrize("bad", [0, 1, 2], ids=["first", "middle", "last"])  # which of three segments
@pytest.mark.parametrize("at", [0, 1], ids=["the open", "a read past a record"])  # where it fails
@pytest.mark.parametrize(
    "errno_", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN], ids=errno.errorcode.get
)
def test_a_segment_the_process_cannot_read_at_open_for_now_keeps_its_records(
    tmp_path: Path, bad: int, at: int, errno_: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory or file descriptors at open (the open, or a read past its first records),
    a segment's records are there: they were counted as lost like a bad sector's, and never sent.
    The spool is not opened (a clear error: the agent exits, and its supervisor starts it again),
    the directory is released, and the next open delivers every record, none counted lost."""
    per = on_disk_size(recs(1)[0])
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    for k in range(10):  # segments 1, 2 of four records, 3 of two
        sp.append(recs(1, start=k))
    sp.close()
    (target,) = [p for p in sorted(tmp_path.glob("*.spl")) if p.name.endswith(f"{bad + 1}.spl")]
    before = target.read_bytes()
    real_open = open

    class _Fails(_BadSector):
        def read(self, n: int) -> bytes:
            if self.f.tell() >= self.at:
                raise OSError(errno_, os.strerror(errno_))
            return bytes(self.f.read(min(n, self.at - self.f.tell())))

    def faulty(path: Any, *a: Any, **kw: Any) -> Any:
        if Path(path) == target:
            if at == 0:
                raise OSError(errno_, os.strerror(errno_))
            return _Fails(real_open(path, *a, **kw), at * per)
        return real_open(path, *a, **kw)

    monkeypatch.setattr("gpuslo.agent.spool.open", faulty, raising=False)
    with pytest.raises(SpoolError, match=f"cannot read the spool segment .*{target.name} now"):
        Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    monkeypatch.undo()
    assert target.read_bytes() == before
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)  # the lock was released
    assert ids(drain(sp)) == list(range(10))
    assert sp.stats().dropped_corrupt == 0


class _BadSector:
    """A segment file whose bytes from ``at`` on cannot be read, as the kernel answers a read
    that reaches a bad sector: the bytes before it (a short read), then EIO."""

    def __init__(self, f: Any, at: int) -> None:
        self.f, self.at = f, at

    def __enter__(self) -> _BadSector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def fileno(self) -> int:
        return int(self.f.fileno())

    def seek(self, p: int) -> int:
        return int(self.f.seek(p))

    def read(self, n: int) -> bytes:
        if self.f.tell() >= self.at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return bytes(self.f.read(min(n, self.at - self.f.tell())))


@pytest.mark.parametrize("bad", [0, 1, 2], ids=["first", "middle", "last"])  # which of three segments
@pytest.mark.parametrize("at", [0, 1, 2], ids=lambda k: f"from record {k}")  # where its bad sector starts
@pytest.mark.parametrize("drained", [0, 2, 5])  # before the restart
def test_a_segment_unreadable_at_open_is_never_written_over(
    tmp_path: Path, bad: int, at: int, drained: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment that cannot be read at open (a bad sector) was taken for empty:
    its size 0, the tail the next append went to, at byte 0, over its intact records (lost, and
    never counted). Now what was read of it is all this process reads of it, the rest counted
    as lost (exactly where a later segment tells), and its bytes are never written over: the
    records appended since are all delivered, and a restart that reads it finds them all."""
    per = on_disk_size(recs(1)[0])
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    for k in range(10):  # segments 1, 2 of four records, 3 of two
        sp.append(recs(1, start=k))
    if drained:
        batch = sp.peek(max_records=drained)
        sp.advance(batch[-1][0], len(batch))
    sp.close()
    segs = sorted(tmp_path.glob("*.spl"))
    target = [p for p in segs if p.name.endswith(f"{bad + 1}.spl")]
    if not target:
        pytest.skip("that segment was drained and deleted")
    before = target[0].read_bytes()
    real_open = open

    def faulty(path: Any, *a: Any, **kw: Any) -> Any:
        if Path(path) == target[0]:
            if at == 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return _BadSector(real_open(path, *a, **kw), at * per)
        return real_open(path, *a, **kw)

    monkeypatch.setattr("gpuslo.agent.spool.open", faulty, raising=False)
    sp = Spool(tmp_path, segment_bytes=4 * per, clock=lambda: 1000.0)
    check(sp.stats())
    sp.append(recs(3, start=100))  # the agent goes on sampling
    out = ids(drain(sp, max_records=3))
    st = sp.stats()
    check(st)
    assert [i for i in out if i >= 100] == [100, 101, 102]  # every new record delivered, in order
    assert out == sorted(out) and len(set(out)) == len(out)
    held = [i for i in range(4 * bad, min(4 * bad + 4, 10)) if i >= drained]  # the bad segment's undrained
    unread = [i for i in held if i not in out]
    assert unread == [i for i in held if i >= 4 * bad + at]  # what was read of it came out
    assert [i for i in range(drained, 10) if i not in held] == [i for i in out if i < 100 and i not in held]
    lost = st.dropped_corrupt
    if bad < 2 and (drained or bad):  # a later segment and a known start tell the count exactly
        assert lost == len(unread)
    else:  # (as a torn tail, or a first segment with no cursor yet: at least one)
        assert (1 <= lost <= len(unread)) if unread else lost == 0
    assert not target[0].exists() or target[0].read_bytes() == before  # never written over

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.spool import Record, Spool


def recs(n: int, start: int = 0, t: float = 1000.0, size: int = 10) -> list[Record]:
    return [Record("topic", b"node", f"{i:06d}".encode() + b"x" * size, t) for i in range(start, start + n)]


def drain(sp: Spool, max_records: int = 7) -> list[bytes]:
    out = []
    while len(sp):
        batch = sp.peek(max_records=max_records)
        out += [r.value for _, r in batch]
        sp.advance(batch[-1][0], len(batch))
    return out


def test_fifo_across_segments_and_restart(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=10**6, segment_bytes=200, clock=lambda: 1000.0)
    for k in range(10):
        sp.append(recs(5, start=5 * k))
    assert len(sp) == 50
    batch = sp.peek(max_records=12)
    sp.advance(batch[-1][0], len(batch))  # 12 drained, then the agent restarts
    sp2 = Spool(tmp_path, max_bytes=10**6, segment_bytes=200, clock=lambda: 1000.0)
    assert len(sp2) == 38
    got = drain(sp2)
    assert [int(v[:6]) for v in got] == list(range(12, 50))
    assert sp2.size_bytes < 200  # drained segments are deleted
    assert len(Spool(tmp_path)) == 0


def test_torn_tail_is_cut_and_the_rest_survives(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sp = Spool(tmp_path)
    sp.append(recs(3))
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # a record header with half a body: power lost mid-write
    with caplog.at_level(logging.WARNING):
        sp2 = Spool(tmp_path)
    assert "torn bytes" in caplog.text
    assert [int(v[:6]) for v in drain(sp2)] == [0, 1, 2]
    sp2.append(recs(1, start=3))
    assert [int(v[:6]) for v in drain(sp2)] == [3]


def test_byte_bound_drops_oldest_counts_and_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sp = Spool(tmp_path, max_bytes=2000, segment_bytes=500, clock=lambda: 1000.0)
    with caplog.at_level(logging.WARNING):
        for k in range(40):
            sp.append(recs(1, start=k, size=60))  # 84 bytes each on disk
    assert sp.size_bytes <= 2000 + 500
    assert sp.dropped_records > 0
    assert "over its byte bound: dropped the oldest" in caplog.text
    got = [int(v[:6]) for v in drain(sp)]
    assert got == list(range(40 - len(got), 40))  # the newest survive, in order
    assert len(got) + sp.dropped_records == 40


def test_age_bound(tmp_path: Path) -> None:
    now = [1000.0]
    sp = Spool(tmp_path, max_age_s=60, segment_bytes=100, clock=lambda: now[0])
    sp.append(recs(3, t=1000.0))
    now[0] = 2000.0
    sp.append(recs(3, start=3, t=2000.0))
    assert sp.dropped_records == 3
    assert [int(v[:6]) for v in drain(sp)] == [3, 4, 5]


def test_record_bigger_than_the_peek_budget_still_comes_out(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    sp.append([Record("t", b"k", b"z" * 100_000, 1.0)])
    ((_, r),) = sp.peek(max_bytes=1000)
    assert len(r.value) == 100_000

"""The hourly rollup tier: a window read as [minute edges] + [whole hours] + [minute edges] gives
the minute tier's numbers, which are the raw rows' and the reference's (tests/test_properties.py:
the definitions of docs/metrics.md in plain Python), for windows starting and ending on either
side of hour boundaries, shorter than an hour, exactly one, and across day partitions; after
late rows land in hours already rolled (a late sample, a late heartbeat that drains a node for
hours, every sample of a node re-sent with another pool); and on a store made before the tier
(its first refresh builds it from the minute tier; until then the engine reads minutes)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import fair_share, idle_by_owner, summary, utilization
from gpuslo.rules.model import Summary
from gpuslo.rules.tables import SCHEMA
from tests.test_properties import IDLE, Gpu, Node, Request, Sample, _messages, ref_utilization

H = 3600.0
D = 86400.0
B = 1_790_000_000.0 // D * D - 2 * D  # a midnight; the fleet spans [B + 20 h, B + 1 d + 5 h)
_BUSY = Gpu(share=1.0, activity=0.3, healthy=True)
_IDLE_HELD = Gpu(share=1.0, activity=0.01, healthy=True)
_FREE = Gpu(share=0.0, activity=0.0, healthy=True)
_HALF = Gpu(share=0.5, activity=0.04, healthy=True)


def _series(t0: float, t1: float, every: float, gpus: list[tuple[Gpu, ...]]) -> tuple[Sample, ...]:
    n = int((t1 - t0) // every)
    return tuple(Sample(t0 + i * every, gpus[i % len(gpus)]) for i in range(n))


def _fleet() -> list[Node]:
    """Three nodes: 60 s samples from 20:00 over midnight (a day partition) to 05:00; 90 s samples
    (they straddle minutes) starting at 20:07:30; 10 s samples around 23:00-01:00 with a gap,
    drained by a heartbeat for 00:17-00:43."""
    s0, s1 = B + 20 * H, B + D + 5 * H
    a = Node("a", "p", 60.0, _series(s0, s1, 60.0, [(_BUSY, _FREE), (_IDLE_HELD, _HALF), (_HALF, _BUSY)]), ())
    b = Node("b", "", 90.0, _series(s0 + 450, s1, 90.0, [(_IDLE_HELD,), (_BUSY,), (_FREE,)]), ())
    c_samples = _series(B + 23 * H, B + D + 1 * H, 10.0, [(_BUSY, _IDLE_HELD, _FREE), (_HALF, _HALF, _BUSY)])
    c_samples = tuple(x for x in c_samples if not B + D + 600 <= x.ts < B + D + 900)  # a dead agent
    c = Node("c", "q", 10.0, c_samples, ((B + D + 17 * 60, False), (B + D + 43 * 60, True)))
    return [a, b, c]


def _windows() -> list[tuple[float, float]]:
    """Starts and ends on both sides of hour edges, from a minute to the whole fleet."""
    out = [(B + 20 * H, B + D + 5 * H), (B + 22 * H, B + 23 * H), (B + 22 * H + 60, B + 23 * H - 60)]
    for edge in (B + 22 * H, B + D, B + D + H):
        for da in (-61 * 60, -3600, -60, 0, 60, 3600 + 60):
            for length in (60, 59 * 60, 3600, 3660, 2 * 3600 - 60, 3 * 3600 + 120, 26 * 3600):
                out.append((edge + da, edge + da + length))
    return sorted(set(out))


def _util(store: ChdbStore, frm: float, to: float, cluster: str, **kw: Any) -> dict[str, dict[str, float]]:
    return {
        u.pool: {"cap": u.capacity_s, "alloc": u.allocated_s, "active": u.active_s,
                 "idle_a": u.idle_allocated_s, "idle_u": u.idle_unallocated_s}
        for u in utilization(store, frm, to, IDLE, cluster, **kw)
        if u.capacity_s > 0
    }  # fmt: skip


def _approx(d: dict[str, dict[str, float]], rel: float = 1e-9) -> object:
    return {k: pytest.approx(v, rel=rel, abs=1e-6) for k, v in d.items()}


def _same(a: Summary, b: Summary) -> bool:
    return replace(a, window=replace(a.window, over=b.window.over)) == b


def _agree(store: ChdbStore, ns: list[Node], cluster: str, windows: list[tuple[float, float]]) -> None:
    """Per window: raw == minute tier == both tiers == the reference (per pool), and the holders'
    views (top idle, fair share) of both tiers == the minute tier's."""
    assert rollup.hourly_built(store)
    for frm, to in windows:
        ref = _approx(ref_utilization(ns, frm, to), rel=1e-6)  # activity is a Float32 there
        minute = _util(store, frm, to, cluster, rollup=True)
        assert _util(store, frm, to, cluster) == ref, (frm - B, to - B)
        assert minute == ref, (frm - B, to - B)
        assert _util(store, frm, to, cluster, rollup=True, hourly=True) == _approx(minute), (frm - B, to - B)
        for fn in (idle_by_owner, fair_share):
            kw: dict[str, Any] = {"idle_threshold": IDLE} if fn is idle_by_owner else {}
            by_min = fn(store, frm, to, cluster=cluster, rollup=True, **kw)  # type: ignore[operator]
            by_hour = fn(store, frm, to, cluster=cluster, rollup=True, hourly=True, **kw)  # type: ignore[operator]
            assert _rounded(by_hour) == _rounded(by_min), (fn.__name__, frm - B, to - B)


def _rounded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()} for r in rows]


@pytest.mark.integration  # over 0.7 s
def test_both_tiers_give_the_minute_and_raw_answers_at_every_hour_edge(store: ChdbStore) -> None:
    ns = _fleet()
    write(store, _messages("hr", ns, []))  # type: ignore[arg-type]
    rollup.refresh(store)
    assert int(store.query("SELECT count() AS n FROM gpu_rollup_1h FINAL")[0]["n"]) > 0
    _agree(store, ns, "hr", _windows())


@pytest.mark.integration  # over 0.7 s
def test_late_rows_into_rolled_hours_are_rerolled(store: ChdbStore) -> None:
    """A late sample, a late heartbeat draining a node for hours, and every sample of a node sent
    again with another pool (its old pool's hourly rows must vanish, not linger): after a refresh
    both tiers give the answers of the fleet as it now is."""
    ns = _fleet()
    a, b, c = ns
    late_b = Sample(B + 21 * H + 30 * 60 + 15, (_BUSY,))  # inside a rolled hour, between two samples
    write(store, _messages("late", ns, []))  # type: ignore[arg-type]
    rollup.refresh(store)
    drained = replace(a, heartbeats=((B + 21 * H + 5 * 60, False), (B + D + 2 * H + 30 * 60, True)))
    moved = replace(c, pool="p2")
    b2 = replace(b, samples=tuple(sorted((*b.samples, late_b), key=lambda s: s.ts)))
    now = [drained, b2, moved]
    write(store, _messages("late", now, []))  # type: ignore[arg-type]
    rollup.refresh(store, overlap_s=0.0)
    pools = {
        r["pool"] for r in store.query("SELECT DISTINCT pool FROM gpu_rollup_1h FINAL WHERE cluster = 'late'")
    }
    assert pools == {"p", "", "p2"}  # q's hours became p2's: tombstones hide the old rows
    _agree(store, now, "late", [(B + 20 * H, B + D + 5 * H), (B + 21 * H, B + 22 * H), (B + 21 * H + 60, B + D + H - 60),
                                (B + 23 * H - 120, B + D + 2 * H + 60)])  # fmt: skip


@pytest.mark.integration  # over 0.7 s
def test_summary_over_both_tiers_is_the_minute_tiers_and_the_raw_one(store: ChdbStore) -> None:
    ns = _fleet()
    rs = [
        Request("r1", B + 22 * H + 13, 2.0, 1, "p", None),
        Request("r2", B + D + 3 * 60, 1.0, 1, "", B + D + H),
    ]
    write(store, _messages("sum", ns, rs))  # type: ignore[arg-type]
    rollup.refresh(store)
    cfg = RulesConfig()
    for frm, to in (
        (B + 21 * H + 60, B + D + 4 * H - 60),
        (B + 22 * H, B + 23 * H),
        (B + 22 * H + 60, B + 22 * H + 120),
    ):
        tiers = summary(store, cfg, frm, to, "sum", source="rollup")
        minutes = summary(store, cfg, frm, to, "sum", source="rollup", hourly=False)
        raw = summary(store, cfg, frm, to, "sum", source="raw")
        assert _same(tiers, minutes) and _same(tiers, raw), (frm - B, to - B)
        assert tiers.capacity_gpu_hours and tiers.capacity_gpu_hours > 0


@pytest.mark.integration  # over 0.7 s
def test_a_store_made_before_the_hourly_tier_is_upgraded_and_backfilled(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old store: no hourly tables, its minute tier filled by the refresh as it was. Migrated,
    it reads minutes until its first refresh has built the hourly tier from them; then both."""
    for t in ("gpu_rollup_1h", "owner_rollup_1h"):
        store.execute(f"DROP TABLE {t}")
    ns = _fleet()
    write(store, _messages("old", ns, []))  # type: ignore[arg-type]
    with monkeypatch.context() as m:
        m.setattr(rollup, "_refresh_hours", lambda *a: None)  # the refresh before the hourly tier
        rollup.refresh(store)
    assert not rollup.hourly_built(store)
    store.migrate(SCHEMA)
    assert int(store.query("SELECT count() AS n FROM gpu_rollup_1h")[0]["n"]) == 0
    frm, to = B + 21 * H + 60, B + D + 4 * H - 60
    cfg = RulesConfig()
    before = summary(store, cfg, frm, to, "old", source="rollup")  # not built: the minute tier
    assert _same(before, summary(store, cfg, frm, to, "old", source="raw"))
    rollup.refresh(store)  # no new marks: the backfill alone
    assert rollup.hourly_built(store)
    hours = int(
        store.query("SELECT uniqExact(node, hour) AS n FROM gpu_rollup_1h FINAL WHERE cluster = 'old'")[0][
            "n"
        ]
    )
    # a: 20:00-05:00 and b: 20:07:30-05:00, 9 h each + the hour 05 their last samples' snapshots
    # reach (2 x the interval), c: 23:00-01:00 + the hour 01 likewise
    assert hours == 10 + 10 + 3
    assert _same(summary(store, cfg, frm, to, "old", source="rollup"), before)
    _agree(store, ns, "old", [(frm, to), (B + 22 * H, B + 23 * H), (B + 23 * H + 60, B + D + 60)])


def test_hour_split() -> None:
    assert rollup.hour_split(B + 60, B + 2 * H + 60) == (B + H, B + 2 * H)
    assert rollup.hour_split(B, B + H) == (B, B + H)
    assert rollup.hour_split(B + 60, B + H + 60) == (B + H + 60, B + H + 60)  # no whole hour: minutes
    assert rollup.hour_split(B + 60, B + 120) == (B + 120, B + 120)
    assert all(math.isfinite(x) for x in rollup.hour_split(0.0, 60.0))


class _Killed(Exception):
    pass


@pytest.mark.integration  # over 0.7 s
@pytest.mark.parametrize("after", [1, 3])
def test_a_refresh_killed_between_its_hour_writes_leaves_no_hour_missing(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch, after: int
) -> None:
    """Late rows into rolled hours (a late sample, a late heartbeat draining a node for hours),
    then a refresh killed after ``after`` of its hour statements: a reader before the next
    refresh finds every re-rolled hour (new sums, never a tombstone without them), so both
    tiers give the minute tier's answers for what was re-rolled; the next refresh completes."""
    ns = _fleet()
    a, b, c = ns
    write(store, _messages("kill", ns, []))  # type: ignore[arg-type]
    rollup.refresh(store)
    drained = replace(a, heartbeats=((B + 21 * H + 5 * 60, False), (B + D + 2 * H + 30 * 60, True)))
    late_b = Sample(B + 21 * H + 30 * 60 + 15, (_BUSY,))
    b2 = replace(b, samples=tuple(sorted((*b.samples, late_b), key=lambda s: s.ts)))
    now = [drained, b2, c]
    write(store, _messages("kill", now, []))  # type: ignore[arg-type]
    done: list[str] = []
    real = store.execute

    def execute(sql: str, params: Any = None) -> None:
        if len(done) == after:
            raise _Killed
        real(sql, params)
        if sql in rollup.HOUR_STATEMENTS:
            done.append(sql)

    with monkeypatch.context() as m:
        m.setattr(store, "execute", execute)
        with pytest.raises(_Killed):
            rollup.refresh(store, overlap_s=0.0)
    for frm, to in ((B + 20 * H, B + D + 5 * H), (B + 21 * H, B + 22 * H), (B + 21 * H + 60, B + D + H - 60)):
        minute = _util(store, frm, to, "kill", rollup=True)
        assert minute == _approx(ref_utilization(now, frm, to), rel=1e-6)  # the minutes were re-rolled
        assert _util(store, frm, to, "kill", rollup=True, hourly=True) == _approx(minute), (after, frm - B)
        if after >= 3:  # the holders' hours re-rolled too
            by_min = fair_share(store, frm, to, cluster="kill", rollup=True)
            by_hour = fair_share(store, frm, to, cluster="kill", rollup=True, hourly=True)
            assert _rounded(by_hour) == _rounded(by_min), (after, frm - B)
    rollup.refresh(store, overlap_s=0.0)
    _agree(store, now, "kill", [(B + 20 * H, B + D + 5 * H), (B + 21 * H + 60, B + D + H - 60)])

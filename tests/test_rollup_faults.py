"""The rollups under the faults of what runs them: refreshes from rules hosts whose clocks
disagree (another host, a clock stepped), a store whose rows were versioned by such a host
before, a rules service first started (or back) after the marks of what was ingested expired;
each checked against the raw rows and the plain-Python reference of the definitions
(tests/test_properties.py) over windows on both sides of minute and hour edges."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.rules.evaluate import summary
from gpuslo.rules.tables import MARKS_TTL_DAYS
from tests import helpers as h
from tests.test_properties import Node, Request, Sample, _messages, ref_utilization
from tests.test_rollup_hourly import _BUSY, _FREE, _IDLE_HELD, B, D, H, _approx, _fleet, _util

_WINDOWS = [(B + 20 * H, B + D + 5 * H), (B + 21 * H, B + 22 * H), (B + 21 * H + 60, B + 21 * H + 120),
            (B + 21 * H + 25 * 60, B + 21 * H + 35 * 60), (B + 23 * H - 120, B + D + 2 * H + 60)]  # fmt: skip


def _agree(store: ChdbStore, ns: list[Node], cluster: str) -> None:
    """Raw rows, the minute tier and both tiers give the reference's numbers, per pool."""
    for frm, to in _WINDOWS:
        ref = _approx(ref_utilization(ns, frm, to), rel=1e-6)
        assert _util(store, frm, to, cluster) == ref, (frm - B, to - B)
        assert _util(store, frm, to, cluster, rollup=True) == ref, ("minutes", frm - B, to - B)
        assert _util(store, frm, to, cluster, rollup=True, hourly=True) == ref, ("hours", frm - B, to - B)


def _late(ns: list[Node], k: int) -> list[Node]:
    """The fleet with the k-th round of late rows: a sample between two of b's (a minute and an
    hour already rolled), c's samples re-sent busy (replaced under their natural key)."""
    a, b, c = ns
    extra = Sample(B + 21 * H + 30 * 60 + 15 + k, (_BUSY,))
    b2 = replace(b, samples=tuple(sorted((*b.samples, extra), key=lambda s: s.ts)))
    busy = (_BUSY, _IDLE_HELD, _FREE)[k % 3]
    c2 = replace(c, samples=tuple(replace(s, gpus=(busy,) * len(s.gpus)) for s in c.samples))
    return [a, b2, c2]


@pytest.mark.integration  # over 0.7 s
@pytest.mark.parametrize("skew_s", [-3600.0, 5.0, 3600.0, 86400.0, 400 * 86400.0])
def test_a_refresh_after_one_on_a_host_with_another_clock_rolls_the_late_rows(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch, skew_s: float
) -> None:
    """Rules hosts take turns (a failover, two services, a clock stepped back by NTP): one whose
    clock is ``skew_s`` off refreshes, late rows land in minutes and hours it rolled, a host with
    the right clock refreshes; then the other way round. Every refresh's rows win over the
    earlier ones: the rollups give the raw and the reference numbers after each. (The versions
    came from the rules host's clock: after a host ``skew_s`` ahead, the late rows were lost
    from the rollups until the right clock passed its versions.)"""
    import time as real_time

    ns = _fleet()
    write(store, _messages("skew", ns, []))  # type: ignore[arg-type]
    clocks = (lambda: real_time.time() + skew_s, real_time.time)
    for k in range(4):
        with monkeypatch.context() as m:
            m.setattr(rollup.time, "time", clocks[k % 2])
            rollup.refresh(store, overlap_s=0.0)
        _agree(store, ns, "skew")
        ns = _late(ns, k)
        write(store, _messages("skew", ns, []))  # type: ignore[arg-type]
    rollup.refresh(store, overlap_s=0.0)
    _agree(store, ns, "skew")


@pytest.mark.integration  # over 0.7 s
@pytest.mark.parametrize("ahead_s", [60.0, 3600.0, 30 * 86400.0])
def test_a_store_versioned_by_a_host_clock_ahead_takes_its_late_rows(
    store: ChdbStore, ahead_s: float
) -> None:
    """A store whose rollup rows carry versions ``ahead_s`` past the store's clock (written by a
    rules host whose clock was ahead, before the versions came from the store), and no record of
    the last version: the next refresh's rows still win over them."""
    ns = _fleet()
    write(store, _messages("old", ns, []))  # type: ignore[arg-type]
    rollup.refresh(store)
    ms = int(ahead_s * 1000)
    for t in ("gpu_rollup_1m", "owner_rollup_1m", "gpu_rollup_1h", "owner_rollup_1h", "capacity_steps_1m"):
        store.execute(f"INSERT INTO {t} SELECT * REPLACE (version + {ms} AS version) FROM {t} FINAL")
    store.execute("ALTER TABLE rollup_state DELETE WHERE name = 'rollup_version' SETTINGS mutations_sync = 1")
    ns = _late(ns, 0)
    write(store, _messages("old", ns, []))  # type: ignore[arg-type]
    rollup.refresh(store, overlap_s=0.0)
    _agree(store, ns, "old")


def test_versions_only_grow(store: ChdbStore) -> None:
    assert rollup.VERSION_STATE == "rollup_version"  # (the name test_a_store_versioned_... deletes)
    """Each refresh's version is above the last one recorded (and its hourly sums' + 1), even
    when the store's clock reads earlier (a clock stepped back); none below the store's clock."""
    now = float(store.query("SELECT toFloat64(now64(3)) AS t")[0]["t"])
    v1 = rollup.next_version(store, now)
    assert v1 >= int(now * 1000)
    v2 = rollup.next_version(store, now - 86400)  # the store's clock stepped back a day
    assert v2 >= v1 + 2
    v3 = rollup.next_version(store, now + 3600)
    assert v3 >= int((now + 3600) * 1000) and v3 > v2 + 1


_NOW = "SELECT toFloat64(now64(3)) AS t"  # the store's clock, as a refresh reads its cut


def _days_later(store: ChdbStore, monkeypatch: pytest.MonkeyPatch, days: float) -> None:
    """The store's clock as the refresh reads it ``days`` on (the rows' ingest and the marks'
    times stay now): the time passing between the ingest and the refresh."""
    real = store.query

    def query(sql: str, params: Any = None) -> Any:
        rows = real(sql, params)
        return [{"t": rows[0]["t"] + days * 86400}] if sql == _NOW else rows

    monkeypatch.setattr(store, "query", query)


def _expire_marks(store: ChdbStore) -> None:
    """What the marks' TTL does to the marks of rows ingested before it."""
    store.flush_marks()
    store.execute("TRUNCATE TABLE rollup_dirty_store")


def _latency(cluster: str) -> list[Any]:
    """A service's histogram rows every 45 s (off minute edges, on some), bad for a while."""
    out = []
    for i in range(int(6 * H // 45)):
        t = B + 21 * H + 45 * i
        bad = 40 if B + 22 * H <= t < B + 23 * H else 1
        m = h.latency(t, 500, bad, interval_s=45.0)
        out.append(m.model_copy(update={"cluster": cluster}))
    return out


@pytest.mark.integration  # over 0.7 s
@pytest.mark.parametrize("refreshed_before", [False, True])
@pytest.mark.parametrize("days", [MARKS_TTL_DAYS + 1.0, 400.0])
def test_rows_whose_marks_expired_before_a_refresh_are_rolled(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch, refreshed_before: bool, days: float
) -> None:
    """Rows ingested, then no refresh for ``days`` (the rules service first started on a store
    ingesting for weeks, or down that long): the marks' TTL took their marks. The refresh then
    rolls them all the same (they were left out of every tier, and ``auto`` read the rollups):
    CUR, idle, starvation and the SLO over the rollups are the raw rows' and the reference's."""
    ns = _fleet()
    rs = [
        Request("r1", B + 22 * H + 13, 2.0, 1, "p", None),
        Request("r2", B + D + 3 * 60, 1.0, 1, "", B + D + H),
    ]
    if refreshed_before:  # the service ran once, early; everything after came while it was down
        write(store, _messages("ttl", ns[:1], []))  # type: ignore[arg-type]
        rollup.refresh(store)
    write(store, _messages("ttl", ns, rs) + _latency("ttl"))  # type: ignore[arg-type]
    _expire_marks(store)
    _days_later(store, monkeypatch, days)
    rollup.refresh(store)
    _agree(store, ns, "ttl")
    cfg = RulesConfig(slos=(Slo(name="lat", service="svc", threshold_ms=5.0),))
    for frm, to in _WINDOWS:
        ru = summary(store, cfg, frm, to, "ttl", source="rollup")
        raw = summary(store, cfg, frm, to, "ttl", source="raw")
        assert ru == replace(raw, window=replace(raw.window, over=ru.window.over)), (frm - B, to - B)
    whole = summary(store, cfg, B + 20 * H, B + D + 5 * H, "ttl", source="rollup")
    assert whole.slos[0].total > 0 and whole.starvation_incidents


@pytest.mark.integration  # over 0.7 s
def test_a_refresh_in_time_re_marks_nothing(store: ChdbStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steady state reads its marks only: a refresh whose last one is younger than the
    marks' retention (less a day) runs none of the re-marking statements; one older runs them."""
    write(store, _messages("q", _fleet(), []))  # type: ignore[arg-type]
    rollup.refresh(store)
    ran: list[str] = []
    real = store.execute

    def execute(sql: str, params: Any = None) -> None:
        ran.append(sql)
        real(sql, params)

    monkeypatch.setattr(store, "execute", execute)
    _days_later(store, monkeypatch, MARKS_TTL_DAYS - 1.5)
    rollup.refresh(store)
    assert not set(ran) & set(rollup.REMARKS)
    _days_later(store, monkeypatch, MARKS_TTL_DAYS - 0.5)  # on top: that long after the last one
    rollup.refresh(store)
    assert set(rollup.REMARKS) <= set(ran)

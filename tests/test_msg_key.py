"""Health events of one tick are rows of their own (``msg_key``).

A node's XIDs drained in one tick all carry the tick's time. Keyed by (node, gpu, ts, event)
alone, ``ReplacingMergeTree`` kept one of them (a fatal XID 79 could give way to an XID 31 of the
same tick): the ingest reported every message written while ``FINAL`` (the dashboards' health
panels) saw one. Each is counted here against the store, and a replay of them (another run: the
dedup window is per process) still adds nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuslo.ingest import pipeline, schema
from gpuslo.ingest.pipeline import Ingestor, upgrade
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules.tables import SCHEMA
from tests.helpers import T0

SEQS = (0, 1, 2**63, 2**64 - 1)  # the wire's edges of seq (UInt64)


def _health(seq: int, code: int, source: str = "n1", boot: str = "b1") -> dict[str, Any]:
    return {"v": 1, "kind": "health", "source": source, "boot_id": boot, "seq": seq, "cluster": "c",
            "ts": T0, "node": "n1", "gpu": 0, "uuid": "GPU-0", "event": "xid", "code": code,
            "fatal": code == 79, "message": f"XID {code}"}  # fmt: skip


def _tick(n: int, codes: tuple[int, ...] = (13, 31, 79)) -> list[dict[str, Any]]:
    """``n`` health events of one tick and GPU: distinct ids (seq at its edges, boot ids), XID
    codes taken in turn (the same code twice is two events too)."""
    seqs = [SEQS[i % len(SEQS)] for i in range(n)]
    boots = [f"b{i // len(SEQS)}" for i in range(n)]
    return [
        _health(s, codes[i % len(codes)], boot=b) for i, (s, b) in enumerate(zip(seqs, boots, strict=True))
    ]


def _ingest(store: ChdbStore, msgs: list[dict[str, Any]], name: str) -> pipeline.IngestReport:
    raws = [Raw(f"{name}:{i}", orjson.dumps(m)) for i, m in enumerate(msgs)]
    return Ingestor(store).ingest_or_isolate(raws)  # a new one per call: another run


STORED = "SELECT count() AS n, sum(code) AS s, sum(fatal) AS f FROM health_events FINAL"


def _expected(msgs: list[dict[str, Any]]) -> dict[str, int]:
    return {"n": len(msgs), "s": sum(m["code"] for m in msgs), "f": sum(m["fatal"] for m in msgs)}


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = ChdbStore(tmp_path / "s")
    s.migrate(SCHEMA)
    upgrade(s, schema=SCHEMA)
    yield s
    s.close()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 9])
def test_every_health_event_of_one_tick_is_stored_once(store: ChdbStore, n: int) -> None:
    msgs = _tick(n)
    assert _ingest(store, msgs, "a").written == {"health_events": n}
    want = _expected(msgs)
    assert store.query(STORED)[0] == want
    # again, in another run (its dedup window empty), whole and reversed: replays replace themselves
    _ingest(store, msgs, "a")
    _ingest(store, msgs[::-1], "b")
    assert store.query(STORED)[0] == want
    store.execute("OPTIMIZE TABLE health_events FINAL")
    assert store.query(STORED.replace(" FINAL", ""))[0] == want


_SEQS = "SELECT groupArray(seq) AS seqs FROM (SELECT seq FROM health_events FINAL ORDER BY seq)"


_PARTS = "SELECT DISTINCT partition_id AS p FROM system.parts WHERE table = 'health_events' AND active"


def _old_store(tmp_path: Path) -> ChdbStore:
    """A store made before ``msg_key``."""
    old = SCHEMA.render().replace(",\n    msg_key UInt64 DEFAULT cityHash64(source, boot_id, seq)", "")
    old = old.replace(", msg_key)", ")")
    assert "msg_key" not in old
    s = ChdbStore(tmp_path / "s")
    for stmt in schema.statements(old):
        s.execute(stmt)
    return s


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("stop_after", [None, 1, 2, 3])
def test_a_store_keyed_without_msg_key_is_upgraded(tmp_path: Path, stop_after: int | None) -> None:
    """A store made before ``msg_key``: its rows keep what they hold (events of one tick that had
    not been merged yet come back apart), a replay after the upgrade adds nothing and brings back
    those the old key had lost, and an upgrade stopped after any of its statements is finished
    by the next."""
    s = _old_store(tmp_path)
    try:
        msgs = _tick(3)
        for i, m in enumerate(msgs):
            _ingest(s, [m], f"old{i}")
        before = set(s.query(_SEQS)[0]["seqs"])
        assert len(before) == 1  # the old key kept one
        if stop_after is not None:  # an upgrade killed midway
            key = s.query("SELECT sorting_key AS k FROM system.tables WHERE name = 'health_events'")[0]["k"]
            parts = [r["p"] for r in s.query(_PARTS)]  # one: the events are of one tick
            for stmt in schema.msg_key_upgrade("health_events", key, parts)[:stop_after]:
                s.execute(stmt)
        s.migrate(SCHEMA)
        upgrade(s, schema=SCHEMA)
        row = s.query("SELECT sorting_key AS k FROM system.tables WHERE name = 'health_events'")[0]
        assert row["k"] == "cluster, node, gpu, ts, event, msg_key"
        got = s.query(_SEQS)[0]["seqs"]
        assert before <= set(got) and len(got) == len(set(got))  # nothing lost, nothing twice
        _ingest(s, msgs, "again")  # a replay after the upgrade
        upgrade(s, schema=SCHEMA)  # and a second upgrade: nothing to do
        assert s.query(STORED)[0] == _expected(msgs)
    finally:
        s.close()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_an_old_store_of_more_days_than_one_insert_may_write_is_upgraded(tmp_path: Path) -> None:
    """A store's health events span its retention (400 days by default), a partition a day:
    the rows are written again under their key a partition at a time, never in one insert over
    ClickHouse's ``max_partitions_per_insert_block`` (which refused the upgrade: the ingest did
    not start)."""
    days = schema.MAX_PARTITIONS_PER_INSERT + 1
    s = _old_store(tmp_path)
    try:
        msgs = [{**_health(i, 13), "ts": T0 - 86400 * i} for i in range(days)]
        _ingest(s, msgs, "old")
        s.migrate(SCHEMA)
        upgrade(s, schema=SCHEMA)
        got = s.query(_SEQS)[0]["seqs"]
        assert got == list(range(days))
        stale = "SELECT count() AS n FROM health_events WHERE msg_key != cityHash64(source, boot_id, seq)"
        assert s.query(stale)[0]["n"] == 0
        _ingest(s, msgs, "again")  # a replay adds nothing
        assert s.query(STORED)[0] == _expected(msgs)
    finally:
        s.close()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_rows_written_during_the_upgrade_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ingest of an earlier version still writing (a rolling restart) names no ``msg_key``:
    a row it writes after any statement of the upgrade is kept (one written after the copy and
    before the delete held 0 and was deleted, silently), and the upgrade still finishes."""
    s = _old_store(tmp_path)
    try:
        first = _tick(3)
        for i, m in enumerate(first):
            _ingest(s, [m], f"old{i}")
        s.migrate(SCHEMA)
        later: list[dict[str, Any]] = []
        execute = s.execute

        writing = False

        def and_another_writer(sql: str, params: Any = None) -> None:
            nonlocal writing
            execute(sql, params)
            if sql.startswith(("ALTER TABLE health_events", "INSERT INTO health_events")) and not writing:
                writing = True
                later.append(_health(1000 + len(later), 48, source="n2"))  # an XID 48, meanwhile
                _ingest(s, later[-1:], f"meanwhile{len(later)}")
                writing = False

        monkeypatch.setattr(s, "execute", and_another_writer)
        upgrade(s, schema=SCHEMA)
        monkeypatch.undo()
        assert len(later) >= 3  # after the key, the copy, the delete
        got = s.query(_SEQS)[0]["seqs"]
        assert {m["seq"] for m in later} <= set(got)  # every row written meanwhile is there
        upgrade(s, schema=SCHEMA)  # the next start
        stale = "SELECT count() AS n FROM health_events WHERE msg_key != cityHash64(source, boot_id, seq)"
        assert s.query(stale)[0]["n"] == 0
    finally:
        s.close()

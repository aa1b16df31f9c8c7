"""Opening the store a service writes to (ingest/connect.py): a ClickHouse server that is
not up yet is waited for with backoff; a store that is wrong is not."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpuslo.core.settings import ClickHouseSettings
from gpuslo.ingest.clickhouse_store import ClickHouseStore
from gpuslo.ingest.connect import open_store, open_when_ready
from gpuslo.ingest.schema import Schema
from gpuslo.ingest.store import ChdbStore, Failure, Store, StoreError
from gpuslo.rules.tables import SCHEMA
from tests.servers.ports import free_port


class Waits(threading.Event):
    """A stop event that records each wait and returns at once (no time passes in the test)."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.stop_after = stop_after

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0))
        if self.stop_after is not None and len(self.waits) >= self.stop_after:
            self.set()
        return self.is_set()


def test_a_server_not_up_yet_is_retried_with_capped_backoff(tmp_path: Path) -> None:
    down = ClickHouseSettings(host="127.0.0.1", port=free_port(), connect_timeout_s=1)
    tries: list[Store] = []
    retried: list[tuple[str, float]] = []

    def open_fn() -> Store:
        # a real server that refuses connections four times (nothing listens), then chDB
        tries.append(ClickHouseStore(down) if len(tries) < 4 else ChdbStore(tmp_path / "s"))
        return tries[-1]

    stop = Waits()
    store = open_when_ready(open_fn, lambda s: s.migrate(SCHEMA), stop, 1.0, 5.0,
                            lambda exc, w: retried.append((exc.failure.value, w)))  # fmt: skip
    try:
        assert isinstance(store, ChdbStore) and len(tries) == 5
        assert stop.waits == [1.0, 2.0, 4.0, 5.0]
        assert retried == [("transient", 1.0), ("transient", 2.0), ("transient", 4.0), ("transient", 5.0)]
        assert store.query("SELECT count() AS n FROM node_heartbeats")[0]["n"] == 0  # prepared
    finally:
        if store is not None:
            store.close()


def test_a_store_that_is_wrong_is_raised_and_closed() -> None:
    closed: list[bool] = []

    class Wrong(ChdbStore):
        def __init__(self) -> None:  # no directory: nothing to open
            pass

        def migrate(self, schema: Schema) -> None:
            raise StoreError("Code: 516. Authentication failed", Failure.FATAL, 516)

        def close(self) -> None:
            closed.append(True)

    stop = Waits()
    with pytest.raises(StoreError, match="Authentication failed"):
        open_when_ready(Wrong, lambda s: s.migrate(SCHEMA), stop, 1.0, 5.0)
    assert closed == [True] and stop.waits == []


def test_a_stop_while_waiting_gives_none() -> None:
    down = ClickHouseSettings(host="127.0.0.1", port=free_port(), connect_timeout_s=1)
    stop = Waits(stop_after=2)
    assert open_when_ready(lambda: ClickHouseStore(down), lambda s: s.migrate(SCHEMA), stop, 1.0, 5.0) is None
    assert stop.waits == [1.0, 2.0]


def test_open_store_picks_the_server_when_configured(tmp_path: Path) -> None:
    ch = ClickHouseSettings(host="127.0.0.1", port=free_port())
    assert isinstance(open_store(ch, tmp_path / "unused"), ClickHouseStore)
    assert not (tmp_path / "unused").exists()
    st = open_store(None, tmp_path / "s")
    try:
        assert isinstance(st, ChdbStore)
    finally:
        st.close()

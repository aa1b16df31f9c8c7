"""The server store turns a batch into the driver's Python lists with the cyclic garbage
collector paused (the lists are acyclic and freed by reference counting when the insert
returns), and leaves the collector as it found it whatever the insert did: written, refused
while building the columns, or failed on the wire."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslo.core.settings import ClickHouseSettings
from gpuslo.ingest.clickhouse_store import ClickHouseStore
from gpuslo.ingest.failures import Failure
from gpuslo.ingest.store import StoreError


class Client:
    """clickhouse-driver's Client as the store uses it: column types, then the insert (which
    records whether the collector was on, and fails as told)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.collector_on_during_insert: list[bool] = []

    def execute(self, sql: str, *args: Any, **kw: Any) -> Any:
        if sql.startswith("SELECT name, type FROM system.columns"):
            return [("ts", "DateTime"), ("v", "Float64"), ("tags", "Array(String)")]
        self.collector_on_during_insert.append(gc.isenabled())
        if self.fail is not None:
            raise self.fail
        return None

    def disconnect(self) -> None:
        pass


@pytest.fixture(params=[True, False], ids=["collector-on", "collector-off"])
def collector(request: pytest.FixtureRequest) -> Iterator[bool]:
    was = gc.isenabled()
    gc.enable() if request.param else gc.disable()
    try:
        yield request.param
    finally:
        gc.enable() if was else gc.disable()


def store(client: Client) -> ClickHouseStore:
    return ClickHouseStore(ClickHouseSettings(), client_factory=lambda **kw: client)


ROWS = {"ts": [1.0, 2.0], "v": [0.5, None], "tags": [["a"], []]}


def test_written_with_the_collector_paused_and_restored(collector: bool) -> None:
    c = Client()
    assert store(c).insert("t", ROWS) == 2
    assert c.collector_on_during_insert == [False]
    assert gc.isenabled() is collector


@pytest.mark.parametrize(
    ("fail", "failure"),
    [
        (ConnectionResetError(104, "Connection reset by peer"), Failure.TRANSIENT),
        (EOFError("Unexpected EOF"), Failure.TRANSIENT),
    ],
)
def test_a_failed_insert_restores_the_collector(
    collector: bool, fail: BaseException, failure: Failure
) -> None:
    c = Client(fail)
    with pytest.raises(StoreError) as err:
        store(c).insert("t", ROWS)
    assert err.value.failure is failure
    assert c.collector_on_during_insert == [False]
    assert gc.isenabled() is collector


def test_a_batch_refused_while_building_restores_the_collector(collector: bool) -> None:
    c = Client()
    with pytest.raises(StoreError) as err:
        store(c).insert("t", {"ts": [float("inf")], "v": [1.0], "tags": [[]]})  # no DateTime holds inf
    assert err.value.failure is Failure.REFUSED
    assert c.collector_on_during_insert == []
    assert gc.isenabled() is collector


def test_two_writers_overlapping_leave_the_collector_on() -> None:
    """Writer A pauses, B enters (finds it paused), A leaves, B leaves: the collector must be on
    again. With a per-call "restore what I found", B would turn it off for good."""
    import threading

    from gpuslo.ingest.clickhouse_store import collector_paused

    assert gc.isenabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def a() -> None:
        with collector_paused():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with collector_paused():
            b_in.set()
            a_out.wait(10)
            seen.append(gc.isenabled())  # A is out, B still in: still paused

    ts = [threading.Thread(target=f) for f in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert seen == [False]
    assert gc.isenabled()

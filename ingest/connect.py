"""Opening the store a service writes to: the ClickHouse server when one is configured,
else chDB in a directory; and waiting for a server that comes up after us."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from gpuslo.core.backoff import Backoff
from gpuslo.core.settings import ClickHouseSettings
from gpuslo.ingest.store import Store, StoreError


def open_store(clickhouse: ClickHouseSettings | None, directory: str | Path) -> Store:
    """The ClickHouse server when configured, else chDB at ``directory``."""
    if clickhouse is not None:
        from gpuslo.ingest.clickhouse_store import ClickHouseStore

        return ClickHouseStore(clickhouse)
    from gpuslo.ingest.store import ChdbStore

    return ChdbStore(directory)


def open_when_ready(
    open_fn: Callable[[], Store],
    prepare: Callable[[Store], None],
    stop: threading.Event,
    initial_s: float,
    max_s: float,
    on_retry: Callable[[StoreError, float], None] = lambda exc, wait_s: None,
) -> Store | None:
    """Open the store and ``prepare`` it (migrate, ...), retrying a transient failure with
    exponential backoff from ``initial_s`` to ``max_s`` (``on_retry`` is told each wait)
    until ``stop`` is set (None then). A failure waiting will not fix (credentials,
    database, schema) is raised."""
    store = None
    backoff = Backoff(initial_s, max_s)
    while store is None and not stop.is_set():  # the store may come up after us
        try:
            store = open_fn()
            prepare(store)
        except StoreError as exc:
            if store is not None:
                store.close()
            store = None
            if not exc.retriable:
                raise
            wait_s = backoff.fail()
            on_retry(exc, wait_s)
            stop.wait(wait_s)
    return store

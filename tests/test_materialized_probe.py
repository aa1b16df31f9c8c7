"""The materialized-CTE probe (rules.evaluate.materialized_ctes) on engines that list
``enable_materialized_cte`` but do not let a query set it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore, Row, Store
from gpuslo.ingest.writer import write
from gpuslo.rules import evaluate, sql
from gpuslo.rules.tables import SCHEMA
from tests.test_starvation_tier import M0, _cfg, _fleet


@pytest.mark.integration  # chDB
def test_an_engine_refusing_experimental_settings_reads_the_plain_query(tmp_path: Path) -> None:
    # a server whose config allows only beta and production settings ('allow_feature_tier' 1):
    # system.settings still lists the experimental enable_materialized_cte, a query may not set it
    store = ChdbStore(f"{tmp_path / 'store'}?allow_feature_tier=1")
    try:
        store.migrate(SCHEMA)
        batches, events, _ = _fleet(3, "C")
        write(store, batches + events)
        listed = store.query("SELECT count() AS n FROM system.settings WHERE name = {s:String}",
                             {"s": sql.MATERIALIZED_CTE})  # fmt: skip
        assert listed[0]["n"] == 1
        cfg = _cfg()
        frm, to = M0 - 600.0, M0 + 900.0
        assert not evaluate.materialized_ctes(store)
        rows = evaluate.starvation(store, frm, to, cfg)
        assert rows and rows == store.query(
            sql.STARVATION, evaluate._starvation_query(store, frm, to, cfg, "", False)[1]
        )
        assert len(evaluate.incidents(store, frm, to, cfg)) == len(rows)
    finally:
        store.close()


@dataclass
class _Wrapped(Store):
    """A store as a dataclass (``eq``: unhashable, so no key of a weak dictionary)."""

    inner: ChdbStore
    queries: int = 0

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self.inner.execute(sql, params)

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        return self.inner.insert(table, columns)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        self.queries += 1
        return self.inner.query(sql, params)


@pytest.mark.integration  # chDB
def test_an_unhashable_store_is_probed_and_reads_the_same_rows(tmp_path: Path) -> None:
    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        batches, events, _ = _fleet(4, "C")
        write(store, batches + events)
        cfg = _cfg()
        frm, to = M0 - 600.0, M0 + 900.0
        w = _Wrapped(store)
        with pytest.raises(TypeError):
            hash(w)
        assert evaluate.materialized_ctes(w) == evaluate.materialized_ctes(store)
        rows = evaluate.starvation(w, frm, to, cfg)
        assert rows and rows == evaluate.starvation(store, frm, to, cfg)
        assert len(evaluate.incidents(w, frm, to, cfg)) == len(rows)
    finally:
        store.close()

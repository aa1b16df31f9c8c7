"""The materialized-CTE probe (rules.evaluate.materialized_ctes) on engines that list
``enable_materialized_cte`` but do not let a query set it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslo.ingest.store import ChdbStore
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

"""``Store.query_columns``: the result of ``query`` as columns, on the embedded store and by the
default (from rows); and the summary's incidents built from the starvation query's columns are the
rows :func:`gpuslo.rules.evaluate._incident` makes, filtered by the config's match. (The server
store's: tests/test_clickhouse_server.py.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore, Row, Store
from gpuslo.ingest.writer import write
from gpuslo.rules.config import Match
from gpuslo.rules.evaluate import _incident, incidents, starvation
from tests.test_starvation_tier import M0, _cfg, _fleet

Q = """SELECT number AS n, toString(number) AS s, if(number % 2 = 0, NULL, number / 4) AS f,
    range(number % 3) AS a, toDateTime(1796083200 + number, 'UTC') AS t
FROM numbers({k:UInt32}) ORDER BY n"""


class _Rows(Store):
    """Only ``query``: the default ``query_columns``."""

    def __init__(self, inner: ChdbStore) -> None:
        self.inner = inner

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self.inner.execute(sql, params)

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        return self.inner.insert(table, columns)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        return self.inner.query(sql, params)


@pytest.mark.integration  # chDB
def test_columns_are_the_rows_transposed(store: ChdbStore) -> None:
    rows = store.query(Q, {"k": 7})
    cols = store.query_columns(Q, {"k": 7})
    assert list(cols) == ["n", "s", "f", "a", "t"]
    assert cols == {k: [r[k] for r in rows] for k in rows[0]}
    assert cols["f"][:2] == [None, 0.25] and cols["a"][2] == [0, 1]
    assert _Rows(store).query_columns(Q, {"k": 7}) == cols
    # no rows: the embedded store still names its columns; the default cannot (a caller reads a
    # missing column as empty)
    assert store.query_columns(Q, {"k": 0}) == {"n": [], "s": [], "f": [], "a": [], "t": []}
    assert _Rows(store).query_columns(Q, {"k": 0}) == {}


@pytest.mark.integration  # chDB rounds
@pytest.mark.parametrize("seed", [2, 6])
@pytest.mark.parametrize(
    "match",
    [Match(), Match(cluster=("D",)), Match(queue=("q",)), Match(queue=("other",)), Match(account=("b", "a"))],
    ids=repr,
)
def test_incidents_from_columns_are_the_incident_rows(store: ChdbStore, seed: int, match: Match) -> None:
    for k, cluster in enumerate(("C", "D")):  # two clusters' fleets, of which a match may keep one
        batches, events, _ = _fleet(seed + k, cluster)
        write(store, batches + events)
    cfg = _cfg().model_copy(update={"match": match})
    frm, to = M0 - 600.0, M0 + 900.0
    rows = starvation(store, frm, to, cfg)
    assert {i["cluster"] for i in rows} == {"C", "D"}  # both fleets open incidents in the window
    want = [
        _incident(i, to) for i in rows
        if match.ok("cluster", i["cluster"]) and match.ok("queue", i["queue"]) and match.ok("account", i["account"])
    ]  # fmt: skip
    assert incidents(store, frm, to, cfg) == want
    for st in (store, _Rows(store)):  # none in the window: none, from either form of the columns
        assert incidents(st, to + 86400, to + 86460, cfg) == []

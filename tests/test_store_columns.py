"""``Store.query_columns``: the result of ``query`` as columns, on the embedded store and by the
default (from rows); and the summary's incidents built from the starvation query's columns are the
rows :func:`gpuslo.rules.evaluate._incident` makes, filtered by the config's match. (The server
store's: tests/test_clickhouse_server.py.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
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


# one row per byte string: the value alone and inside every type that nests a String
NESTED = """SELECT i, unhex(h) AS s, toNullable(unhex(h)) AS n, if(i % 2 = 0, NULL, unhex(h)) AS half,
    [unhex(h), 'x'] AS a, [[unhex(h)], []] AS aa, CAST((unhex(h), i), 'Tuple(t String, i UInt32)') AS t,
    map(unhex(h), [unhex(h)]) AS m, toLowCardinality(unhex(h)) AS lc
FROM (SELECT i, {hs:Array(String)}[i] AS h FROM (SELECT arrayJoin(range(1, length({hs:Array(String)}) + 1)) AS i))
ORDER BY i"""


@pytest.mark.integration  # chDB
def test_a_string_not_utf8_comes_back_as_its_bytes_at_any_depth(store: ChdbStore) -> None:
    """A ``String`` holds any bytes (a dead letter's raw Kafka message): one that is not UTF-8
    was a UnicodeDecodeError from ``query`` and ``query_columns`` (pyarrow's conversion), for
    the whole result. Each value comes back as the server store gives it (clickhouse-driver):
    its text where it is UTF-8, else its bytes, at every depth; the other values of the column
    as text."""
    from tests.hostile import as_read, byte_strings

    values = byte_strings()
    rows = store.query(NESTED, {"hs": [v.hex() for v in values]})
    assert len(rows) == len(values)
    for i, (row, v) in enumerate(zip(rows, values, strict=True), start=1):
        e = as_read(v)
        want = {"i": i, "s": e, "n": e, "half": None if i % 2 == 0 else e, "a": [e, "x"], "aa": [[e], []],
                "t": {"t": e, "i": i}, "m": [(e, [e])], "lc": e}  # fmt: skip
        assert row == want, v[:40]
    cols = store.query_columns(NESTED, {"hs": [v.hex() for v in values]})
    assert cols == {k: [r[k] for r in rows] for k in rows[0]}
    assert store.query_columns(NESTED, {"hs": [v.hex() for v in values]}, names=["s"]) == {"s": cols["s"]}


@pytest.mark.integration  # chDB
def test_dead_letters_read_back_as_they_came(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every line of bytes ``ingest --file`` dead-letters reads back from ``dead_letters.raw``
    exactly (its first line not UTF-8 stopped every read of the table with a traceback)."""
    from gpuslo.app.cli import main
    from tests.hostile import as_read, byte_strings

    # a blank line is no message (skipped); a BOM alone is read past
    lines = [
        v for v in byte_strings() if v.strip() and b"\n" not in v and b"\r" not in v and v != b"\xef\xbb\xbf"
    ]
    f = tmp_path / "bytes.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    store_dir = tmp_path / "store"
    assert main(["ingest", "--file", str(f), "--store", str(store_dir), "--max-report", "0"]) == 2
    capsys.readouterr()
    s = ChdbStore(store_dir)
    try:
        got = s.query("SELECT origin, raw FROM dead_letters FINAL")
    finally:
        s.close()
    by_line = {int(r["origin"].rpartition(":")[2]): r["raw"] for r in got}
    assert by_line == {n: as_read(v) for n, v in enumerate(lines, start=1)}

"""The clickhouse-driver store against a real ClickHouse server over the native protocol.

Debian's server is 18.16: too old for the schema (DateTime64, LowCardinality), so this
proves the transport: password auth from a file, columnar inserts with the column types
read from system.columns, typed parameter binding, rows back as dicts, error classes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslo.settings import ClickHouseSettings
from ingest.clickhouse_store import ClickHouseStore, bind
from ingest.store import StoreError
from tests.servers.clickhouse import PASSWORD, ClickHouseServer
from tests.servers.kafka import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseServer]:
    s = ClickHouseServer(tmp_path_factory.mktemp("clickhouse"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def test_native_protocol_round_trip(server: ClickHouseServer, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    cfg = ClickHouseSettings(
        host="127.0.0.1", port=server.port, database="gpuslo_smoke", password_file=tmp_path / "pw"
    )
    st = ClickHouseStore(cfg)
    try:
        st.execute("CREATE DATABASE IF NOT EXISTS gpuslo_smoke")
        st.execute(
            "CREATE TABLE IF NOT EXISTS gpuslo_smoke.t (ts DateTime, node String, ids Array(String), v Nullable(Float64)) "
            "ENGINE = MergeTree PARTITION BY toYYYYMM(ts) ORDER BY (node, ts)"
        )
        t0 = float(int(time.time()))
        n = st.insert("t", {"ts": [t0, t0 + 10, t0 + 20], "node": ["a", "b", "a'b"], "ids": [["1"], [], ["2", "3"]],
                            "v": [0.5, None, 2.0]})  # fmt: skip
        assert n == 3
        rows = st.query(
            "SELECT node, length(ids) AS k, v FROM gpuslo_smoke.t WHERE has({nodes:Array(String)}, node) "
            "AND ts >= toDateTime({from:UInt32}) ORDER BY node",
            {"nodes": ["a", "a'b"], "from": int(t0)},
        )
        assert rows == [{"node": "a", "k": 1, "v": 0.5}, {"node": "a'b", "k": 2, "v": 2.0}]
        with pytest.raises(StoreError) as ei:
            st.query("SELECT no_such_column FROM gpuslo_smoke.t")
        assert not ei.value.retriable  # the query is wrong: retrying will not help
    finally:
        st.close()


def test_wrong_password_and_unreachable_server(server: ClickHouseServer) -> None:
    bad = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=server.port, password="wrong-pw-123"))
    with pytest.raises(StoreError) as ei:
        bad.query("SELECT 1")
    assert "wrong-pw-123" not in str(ei.value)
    down = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=free_port(), connect_timeout_s=1))
    with pytest.raises(StoreError) as ei:
        down.query("SELECT 1")
    assert ei.value.retriable  # the ingest waits this out instead of dead-lettering


def test_hostile_strings_round_trip_through_the_server(server: ClickHouseServer) -> None:
    """The same escaping as the embedded store (ingest/sqltext.py), read back by a real server:
    every hostile string as a bound scalar, inside a bound array, and as a literal."""
    from ingest.sqltext import literal
    from tests.hostile import corpus, names

    st = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=server.port, password=PASSWORD))
    try:
        for v in corpus():
            row = st.query(
                f"SELECT {{v:String}} AS p, {{a:Array(String)}} AS a, {literal(v)} AS lit",
                {"v": v, "a": [v, "'" + v, v + "\\"]},
            )[0]
            assert row == {"p": v, "a": [v, "'" + v, v + "\\"], "lit": v}, repr(v)[:80]
        # the rules' cluster filter, on a table this server supports: one row per hostile name,
        # each name selects exactly its own row
        st.execute("CREATE DATABASE IF NOT EXISTS gpuslo_hostile")
        st.execute("CREATE TABLE gpuslo_hostile.t (cluster String, v UInt32) ENGINE = Memory")
        ns = names()
        st._client.execute(
            "INSERT INTO gpuslo_hostile.t (cluster, v) VALUES", list(zip(ns, range(len(ns)), strict=True))
        )
        for k, name in enumerate(ns):
            rows = st.query(
                "SELECT groupArray(v) AS vs FROM gpuslo_hostile.t WHERE ({cluster:String} = '' OR cluster = {cluster:String})",
                {"cluster": name},
            )
            assert rows == [{"vs": [k]}], repr(name)[:80]
    finally:
        st.close()


def test_bind_quotes_and_types() -> None:
    assert bind(
        "SELECT {a:String}, {b:Float64}, {c:Array(String)}", {"a": "x'\\y\t", "b": 1.5, "c": ["q\\"]}
    ) == ("SELECT CAST('x\\'\\\\y\\x09' AS String), CAST(1.5 AS Float64), CAST(['q\\\\'] AS Array(String))")
    with pytest.raises(StoreError, match="'missing' is not given"):
        bind("SELECT {missing:UInt8}", {"other": 1})
    # text inside a quoted literal or identifier is never a parameter (ClickHouse's parser agrees)
    assert bind("SELECT '{a:String}', 'x\\'{a:String}', `{a:String}`, {a:String}", {"a": "v"}) == (
        "SELECT '{a:String}', 'x\\'{a:String}', `{a:String}`, CAST('v' AS String)"
    )

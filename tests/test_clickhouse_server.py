"""The clickhouse-driver store against a real ClickHouse server over the native protocol.

Each server test runs on two servers (the ``server`` fixture's parameters): Debian's 18.16, too
old for the schema (DateTime64, LowCardinality), which proves the transport (password auth from
a file, columnar inserts with the column types read from system.columns, typed parameter
binding, rows back as dicts, error classes, restarts under load) and the failure of a schema a
server cannot hold; and the compose file's server image (24.8, the oldest the schema supports)
where a Docker engine answers (tests/servers/backend.py; skipped with the reason elsewhere),
where the real schema migrates and the same transport tests run on the real ingest tables. The
error codes that changed between the two (a wrong password or an unknown user: 193 and 192 on
18.16, 516 AUTHENTICATION_FAILED since 20.x) are per server."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.core.settings import ClickHouseSettings
from gpuslo.ingest.clickhouse_store import ClickHouseStore, bind
from gpuslo.ingest.failures import Failure
from gpuslo.ingest.store import StoreError
from gpuslo.rules.evaluate import materialized_ctes
from gpuslo.rules.tables import SCHEMA
from tests.servers.clickhouse import PASSWORD, Server, ingest_ddl, make_server
from tests.servers.ports import free_port
from tests.test_kafka import TABLE_OF

pytestmark = pytest.mark.integration

KINDS = [pytest.param(False, id="ch-18.16"), pytest.param(True, id="ch-image")]


def _make(request: pytest.FixtureRequest, workdir: Path, modern: bool) -> Server:
    if modern:
        request.getfixturevalue("container_backend")  # skipped with the reason where no engine answers
    return make_server(workdir, modern)


@pytest.fixture(scope="module", params=KINDS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _make(request, tmp_path_factory.mktemp("clickhouse"), request.param)
    s.start()
    try:
        yield s
    finally:
        s.close()


def auth_code(server: Server, unknown_user: bool = False) -> int:
    """WRONG_PASSWORD 193 / UNKNOWN_USER 192 on 18.16; one AUTHENTICATION_FAILED (516) for both since 20.x."""
    if server.modern:
        return 516
    return 192 if unknown_user else 193


def test_native_protocol_round_trip(server: Server, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    cfg = ClickHouseSettings(
        host="127.0.0.1", port=server.port, database="gpuslo_smoke", password_file=tmp_path / "pw"
    )
    st = ClickHouseStore(cfg)
    try:
        st.create_database()  # the store connects to its database: it must exist first
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
        # the same result as columns (the summary's incidents), and an empty one: its names, no values
        q = "SELECT node, length(ids) AS k, v FROM gpuslo_smoke.t WHERE has({nodes:Array(String)}, node) ORDER BY node"
        assert st.query_columns(q, {"nodes": ["a", "a'b"]}) == {
            "node": ["a", "a'b"],
            "k": [1, 2],
            "v": [0.5, 2.0],
        }
        assert st.query_columns(q, {"nodes": []}) == {"node": [], "k": [], "v": []}
        # only the named columns (a name the result lacks is left out), of rows and of none
        assert st.query_columns(q, {"nodes": ["a"]}, names=("v", "node", "x")) == {"node": ["a"], "v": [0.5]}
        assert st.query_columns(q, {"nodes": []}, names=("k",)) == {"k": []}
        if server.version < (24,):  # 18.16 has no materialized CTE: the plain starvation query
            assert materialized_ctes(st) is False
        with pytest.raises(StoreError) as ei:
            st.query("SELECT no_such_column FROM gpuslo_smoke.t")
        assert not ei.value.retriable  # the query is wrong: retrying will not help
        assert ei.value.failure is Failure.FATAL and ei.value.code == 47  # the SQL does not match the schema
    finally:
        st.close()


def test_wrong_password_and_unreachable_server(server: Server) -> None:
    bad = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=server.port, password="wrong-pw-123"))
    with pytest.raises(StoreError) as ei:
        bad.query("SELECT 1")
    assert "wrong-pw-123" not in str(ei.value)
    assert ei.value.failure is Failure.FATAL and ei.value.code == auth_code(server)  # exit, do not retry
    down = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=free_port(), connect_timeout_s=1))
    with pytest.raises(StoreError) as ei:
        down.query("SELECT 1")
    assert ei.value.retriable  # the ingest waits this out instead of dead-lettering
    assert ei.value.failure is Failure.TRANSIENT


def test_hostile_strings_round_trip_through_the_server(server: Server) -> None:
    """The same escaping as the embedded store (ingest/sqltext.py), read back by a real server:
    every hostile string as a bound scalar, inside a bound array, and as a literal."""
    from gpuslo.ingest.sqltext import literal
    from tests.hostile import corpus, names

    st = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=server.port, password=PASSWORD))
    try:
        st.create_database()  # the store connects to its database: it must exist first
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
        # the rules' label matchers (rules.sql.matched, bound arrays): a list of names selects
        # exactly those rows, an empty list every row
        from gpuslo.rules.sql import matched

        q = f"SELECT groupArray(v) AS vs FROM gpuslo_hostile.t WHERE {matched('cluster', 'cluster')}"
        present = set(ns)
        for k, name in enumerate(ns):
            near = [name, *(d for d in (name + "\\", "'" + name, name + "'") if d not in present)]
            assert st.query(q, {"match_cluster": near}) == [{"vs": [k]}], repr(name)[:80]
        assert sorted(st.query(q, {"match_cluster": []})[0]["vs"]) == list(range(len(ns)))
        assert st.query(q, {"match_cluster": ns[:2]}) == [{"vs": [0, 1]}]
    finally:
        st.close()


def test_a_string_not_utf8_comes_back_as_its_bytes(server: Server) -> None:
    """The meaning the embedded store keeps too (tests/test_store_columns.py): a ``String``
    value that is not UTF-8 (a dead letter's raw message) comes back as its bytes, the others
    as text, alone, Nullable and inside arrays, from ``query`` and ``query_columns``."""
    from tests.hostile import as_read, byte_strings

    st = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=server.port, password=PASSWORD))
    try:
        st.create_database()
        values = byte_strings()
        q = (
            "SELECT i, unhex(hs[i]) AS s, toNullable(unhex(hs[i])) AS n, [unhex(hs[i]), 'x'] AS a, "
            "[[unhex(hs[i])], []] AS aa FROM (SELECT {hs:Array(String)} AS hs, arrayJoin(arrayEnumerate(hs)) AS i) "
            "ORDER BY i"
        )
        p = {"hs": [v.hex() for v in values]}
        rows = st.query(q, p)
        want = [{"i": i, "s": as_read(v), "n": as_read(v), "a": [as_read(v), "x"], "aa": [[as_read(v)], []]}
                for i, v in enumerate(values, start=1)]  # fmt: skip
        assert rows == want
        assert st.query_columns(q, p) == {k: [r[k] for r in want] for k in want[0]}
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


def _settings(server: Server, database: str, **kw: Any) -> ClickHouseSettings:
    return ClickHouseSettings(host="127.0.0.1", port=server.port, database=database, password=PASSWORD,
                              connect_timeout_s=2, **kw)  # fmt: skip


def _raises(fn: Callable[[], object]) -> StoreError:
    with pytest.raises(StoreError) as ei:
        fn()
    return ei.value


def test_error_classes_of_the_real_server(server: Server) -> None:
    """Each class from what the server and the driver really return (the codes are ClickHouse's).
    The real schema fails on 18.16 (FATAL) and migrates on the image's server (every table there)."""
    ok = ClickHouseStore(_settings(server, "gpuslo_classes"))
    try:
        ok.create_database()
        ok.execute("CREATE TABLE IF NOT EXISTS t (k UInt32, s String) ENGINE = MergeTree ORDER BY k")
        cases: list[tuple[str, Callable[[], object], Failure, int | None]] = [
            ("value the column cannot hold", lambda: ok.insert("t", {"k": [2**40], "s": ["x"]}), Failure.REFUSED, 53),
            ("text that does not parse", lambda: ok.query("SELECT CAST('abc' AS UInt32) AS v"), Failure.REFUSED, 6),
            ("unknown column (schema)", lambda: ok.insert("t", {"k": [1], "nope": ["x"]}), Failure.FATAL, 16),
            ("missing table", lambda: ok.insert("no_such_table", {"k": [1]}), Failure.FATAL, None),
            ("SQL this server cannot parse", lambda: ok.execute("SELEC 1"), Failure.FATAL, 62),
        ]  # fmt: skip
        if not server.modern:
            cases.append(
                (
                    "the real schema on a server too old for it",
                    lambda: ok.migrate(SCHEMA),
                    Failure.FATAL,
                    None,
                )
            )
        for what, fn, failure, code in cases:
            err = _raises(fn)
            assert (what, err.failure) == (what, failure), str(err)
            if code is not None:
                assert err.code == code, (what, str(err))
        assert ok.query("SELECT count() AS n FROM t") == [{"n": 0}]  # nothing refused got in
        if server.modern:
            ok.migrate(SCHEMA)
            ok.migrate(SCHEMA)  # again: a restarted service migrates an existing store
            tables = {
                r["name"]
                for r in ok.query("SELECT name FROM system.tables WHERE database = currentDatabase()")
            }
            want = {
                m.group(1)
                for s in SCHEMA.create()
                if (m := re.match(r"CREATE (?:TABLE|VIEW|MATERIALIZED VIEW) IF NOT EXISTS (\w+)", s))
            }
            assert want and want <= tables, sorted(want - tables)
    finally:
        ok.close()
    for what, st, failure, code in [
        ("missing database", ClickHouseStore(_settings(server, "gpuslo_nowhere")), Failure.FATAL, 81),
        (
            "unknown user",
            ClickHouseStore(_settings(server, "default", user="nobody")),
            Failure.FATAL,
            auth_code(server, unknown_user=True),
        ),
    ]:
        err = _raises(lambda st=st: st.query("SELECT 1"))  # type: ignore[misc]
        assert (what, err.failure, err.code) == (what, failure, code), str(err)


def _restart_in_background(server: Server, kill: bool, delay_s: float) -> threading.Thread:
    def go() -> None:
        time.sleep(delay_s)
        server.kill() if kill else server.stop()
        time.sleep(0.5)
        server.start()

    t = threading.Thread(target=go)
    t.start()
    return t


@pytest.mark.parametrize("modern", KINDS)
def test_restart_between_and_during_writes_loses_and_doubles_nothing(
    request: pytest.FixtureRequest, tmp_path: Path, modern: bool
) -> None:
    """The store's own server (restarted and SIGKILLed here). Writes go through the server
    store to a ReplacingMergeTree table of the real schema (dead_letters, as 18.16 holds it):
    after a restart between writes the next write lands at once (the database is a connection
    parameter; with ``USE`` the driver reconnected to a database named with backticks: code
    81 on every write); a restart or SIGKILL during a write gives TRANSIENT errors until the
    server is back, and the retried write lands. Exact count after, every key once. On the
    image's server the table is the schema's own (DateTime64, LowCardinality, its TTL: the rows
    are of now, so none expires)."""
    srv = _make(request, tmp_path / "ch", modern)
    srv.start()
    st = ClickHouseStore(_settings(srv, "gpuslo_restart"))
    rows, batches = 20_000, 8
    errors: list[StoreError] = []
    now = float(int(time.time()))
    try:
        st.create_database()
        (ddl,) = [d for d in ingest_ddl(srv) if "dead_letters" in d]
        st.execute(ddl)  # unqualified: lands in the connection's database
        for b in range(batches):
            if b in (1, 2):  # between writes: graceful restart, then SIGKILL and start
                srv.kill() if b == 2 else srv.stop()
                srv.start()
            bg = _restart_in_background(srv, kill=b % 2 == 1, delay_s=0.05) if b in (4, 5, 6, 7) else None
            cols = {
                "received_at": [now + b] * rows,
                "origin": [f"b{b}/{i}" for i in range(rows)],
                "topic": ["t"] * rows, "partition": [0] * rows, "offset": list(range(rows)),
                "reason": ["r"] * rows, "raw": ["x" * 200] * rows,
            }  # fmt: skip
            attempts = 0
            while True:
                attempts += 1
                try:
                    st.insert("dead_letters", cols)
                    break
                except StoreError as exc:
                    errors.append(exc)
                    assert exc.failure is Failure.TRANSIENT, str(exc)
                    assert attempts < 200, "the server did not come back"
                    time.sleep(0.2)
            if b in (1, 2):
                assert attempts == 1, "a write after a restart must reconnect to the same database"
            if bg is not None:
                bg.join()
        want = {f"b{b}/{i}" for b in range(batches) for i in range(rows)}
        got = st.query("SELECT count() AS n, uniqExact(origin) AS k FROM dead_letters FINAL")[0]
        assert (got["n"], got["k"]) == (len(want), len(want))
        assert st.query("SELECT currentDatabase() AS db")[0]["db"] == "gpuslo_restart"
        sample = {r["origin"] for r in st.query("SELECT origin FROM dead_letters WHERE offset IN (0, 19999)")}
        assert sample == {f"b{b}/{i}" for b in range(batches) for i in (0, rows - 1)}
    finally:
        st.close()
        srv.close()


@pytest.mark.parametrize("case", ["wrong password", "schema too new for the server"])
def test_services_exit_non_zero_on_a_fatal_store(server: Server, tmp_path: Path, case: str) -> None:
    """``rules run`` (no --once: it would loop forever on a retriable error) and ``ingest
    --kafka`` stop at once with exit 2 and one clear line when the store is fatally wrong
    (credentials; a schema the server cannot hold, as 18.16 cannot hold ours), so the
    supervisor restarts them and the operator sees why. The password never appears."""
    if case != "wrong password" and server.modern:
        pytest.skip("this server holds the schema: no 'schema too new' here (18.16 shows it)")
    import subprocess
    import sys

    import yaml

    pw = "wrong-pw-456" if case == "wrong password" else PASSWORD
    svc = {"clickhouse": {"host": "127.0.0.1", "port": server.port, "database": "gpuslo_svc", "password": pw},
           "kafka": {"bootstrap_servers": [f"127.0.0.1:{free_port()}"]}, "ingest": {"metrics_port": 0}}  # fmt: skip
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(svc))
    gpuslo = str(Path(sys.executable).with_name("gpuslo"))
    for cmd in (
        [gpuslo, "rules", "run", "--service-config", str(path), "--every-s", "1"],
        [gpuslo, "ingest", "--kafka", "-", "--config", str(path)],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 2, (cmd[1], r.returncode, r.stderr[-2000:])
        last = r.stderr.strip().splitlines()[-1]
        assert "cannot use the store" in last and "(fatal, code " in last, (cmd[1], last)
        assert PASSWORD not in r.stderr and "wrong-pw-456" not in r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize("case", ["wrong password", "schema too new for the server"])
def test_chargeback_on_a_fatal_server_exits_2_with_one_line(
    server: Server, tmp_path: Path, case: str
) -> None:
    """``gpuslo chargeback --clickhouse`` on the real server: a wrong password, or the schema this
    18.16 server cannot hold, is exit 2 and a line saying why, never a traceback or the password."""
    if case != "wrong password" and server.modern:
        pytest.skip("this server holds the schema: no 'schema too new' here (18.16 shows it)")
    import subprocess
    import sys

    import yaml

    pw = "wrong-pw-789" if case == "wrong password" else PASSWORD
    svc = {"clickhouse": {"host": "127.0.0.1", "port": server.port, "database": "gpuslo_cb", "password": pw}}
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(svc))
    gpuslo = str(Path(sys.executable).with_name("gpuslo"))
    for command in ("chargeback", "whatif"):  # (whatif: the what-if replay reads the same way)
        r = subprocess.run([gpuslo, command, "--service-config", str(path), "--from", "0", "--to", "3600",
                            "--config", "rules/example.yaml"], capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert r.returncode == 2, (command, r.returncode, r.stderr[-2000:])
        assert r.stderr.strip().splitlines()[-1].startswith(f"gpuslo {command}: ")
        assert "Traceback" not in r.stderr
        assert PASSWORD not in r.stderr and "wrong-pw-789" not in r.stderr


# (table, column, the server's type now, whether the ingest's values still fit it): a column made
# of another kind of type (number <-> text, array <-> scalar, float -> integer, a time -> a number),
# and, as controls, types of the same kind (wider, or integer -> float) that still take the values
TYPE_CHANGES = [
    ("gpu_samples", "activity", "Nullable(String)", False),
    ("gpu_samples", "model", "UInt32", False),
    ("gpu_samples", "alloc_users", "String", False),
    ("gpu_samples", "DCGM_FI_DEV_SM_CLOCK", "Nullable(Int64)", False),
    ("node_heartbeats", "ts", "UInt32", False),
    ("dead_letters", "raw", "UInt64", False),
    ("gpu_samples", "DCGM_FI_DEV_ENC_UTIL", "Float64", False),  # NULLs refused (no GPU of the sim has it)
    ("gpu_samples", "gpu", "Float64", True),
    ("gpu_samples", "interval_s", "Float64", True),
    ("node_heartbeats", "gpus", "UInt64", True),
]


def test_a_column_whose_type_changed_stops_the_ingest_instead_of_dead_lettering_everything(
    server: Server,
) -> None:
    """A table of the store re-made under the running ingest with a column of another kind of type
    (a hand-made migration gone wrong): the driver cannot encode one value of it, and refused
    values are isolated message by message, so every message of every batch became a dead letter
    and its offsets were committed (the numbers gone from the tables). It is the schema, FATAL:
    the batch is neither written nor dead-lettered (``run`` stops, the supervisor restarts, the
    operator repairs the table and the batch is re-read). Found by the running ingest (whose
    column types were read before the change) and by a new one. A type of the same kind (wider,
    integer to float) still takes every message."""
    from gpuslo.ingest.pipeline import Ingestor
    from gpuslo.ingest.writer import Raw
    from gpuslo.wire import GpuSampleBatch, encode
    from tests.test_ingest_faults import fleet_messages, stored_keys

    msgs = fleet_messages(7, hours=0.5)
    assert {t for t, *_ in TYPE_CHANGES} <= {TABLE_OF[m.kind] for m in msgs} | {"dead_letters"}
    first = [Raw(f"first:{i}", encode(m)) for i, m in enumerate(msgs[:40])]
    # the second batch holds a message of every table the first does, GPUs with allocations (their
    # arrays are not empty), and a poison message (its dead letter goes to dead_letters: checked too)
    later = msgs[180:260]
    assert {m.kind for m in later} >= {m.kind for m in msgs[:40]}
    assert any(g.allocations for m in later if isinstance(m, GpuSampleBatch) for g in m.gpus)
    second = [Raw(f"second:{i}", encode(m)) for i, m in enumerate(later)] + [Raw("poison", b"{")]
    for i, (table, column, typ, fits) in enumerate(TYPE_CHANGES):
        st = ClickHouseStore(_settings(server, f"gpuslo_retyped_{i}"))
        st.create_database()
        for ddl in ingest_ddl(server):
            st.execute(ddl)
        running = Ingestor(st)
        assert running.ingest_or_isolate(first).dead_lettered == 0
        st.execute(f"DROP TABLE {table}")
        (ddl,) = [
            d
            for d in ingest_ddl(server, {column: typ})
            if d.startswith(f"CREATE TABLE IF NOT EXISTS {table}\n")
        ]
        st.execute(ddl)
        fresh = ClickHouseStore(st.settings)
        try:
            for who, ing in (("running", running), ("new", Ingestor(fresh))):
                keys_before = stored_keys(st)
                if fits:
                    rep = ing.ingest_or_isolate(second)
                    assert (rep.dead_lettered, rep.n_rejected) == (1, 1), (column, who, rep.rejected[:3])
                    continue
                with pytest.raises(StoreError) as err:
                    ing.ingest_or_isolate(second)
                assert err.value.failure is Failure.FATAL, (column, who, str(err.value))
                assert f"column {column!r}" in str(err.value) and typ in str(err.value), str(err.value)
                assert stored_keys(st) - keys_before <= {
                    (m.source, m.boot_id, m.seq) for m in later if TABLE_OF[m.kind] != table
                }, (column, who)
                got = st.query("SELECT count() AS n FROM dead_letters WHERE origin LIKE 'second:%'")
                assert got == [{"n": 0}], (column, who, "a message of a good batch was dead-lettered")
        finally:
            fresh.close()
            st.close()

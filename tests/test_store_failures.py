"""Store failures are classified once, at the store, into transient / refused / fatal (the
callers act on the class only); the classes of the embedded store come from chDB's own
errors. The server store's classes are checked against a real server in
test_clickhouse_server.py and test_ingest_faults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpuslo.core.kafka_errors import explain
from gpuslo.core.settings import ClickHouseSettings, KafkaSettings
from gpuslo.ingest.failures import CODES, Failure, StoreError, classify_code, code_in_text
from gpuslo.ingest.store import ChdbStore
from tests.servers.ports import free_port


def test_code_table() -> None:
    # the cases of issue 12.1 and the promises of docs/deployment.md, by ClickHouse's ErrorCodes numbers
    assert classify_code(81) is Failure.FATAL  # UNKNOWN_DATABASE: was retried, then "LOST"
    assert classify_code(193) is Failure.FATAL and classify_code(516) is Failure.FATAL  # credentials
    assert classify_code(60) is Failure.FATAL and classify_code(16) is Failure.FATAL  # schema
    assert classify_code(210) is Failure.TRANSIENT and classify_code(252) is Failure.TRANSIENT
    assert classify_code(241) is Failure.TRANSIENT and classify_code(243) is Failure.TRANSIENT
    assert classify_code(53) is Failure.REFUSED and classify_code(6) is Failure.REFUSED
    # the server's own disk and files (a full disk is code 75 on the real 18.16 server:
    # test_full_disk_under_the_server_is_transient_and_dead_letters_nothing), never the data
    for code in (74, 75, 76, 172, 204, 1000):
        assert classify_code(code) is Failure.TRANSIENT, code
    assert classify_code(123456) is Failure.REFUSED and classify_code(None) is Failure.REFUSED
    names = [name for name, _ in CODES.values()]
    assert len(names) == len(set(names)), "a name listed under two codes"
    assert code_in_text("Code: 60. DB::Exception: Unknown table") == 60
    assert code_in_text("no code here") is None


def test_embedded_store_classes(store: ChdbStore) -> None:
    """chDB raises text; the code in it decides the class."""
    with pytest.raises(StoreError) as ei:
        store.query("SELECT * FROM no_such_table")
    assert (ei.value.failure, ei.value.code) == (Failure.FATAL, 60)
    with pytest.raises(StoreError) as ei:
        store.query("SELECT CAST('abc' AS UInt8) AS v")
    assert (ei.value.failure, ei.value.code) == (Failure.REFUSED, 6)
    with pytest.raises(StoreError) as ei:
        store.insert("no_such_table", {"a": [1]})
    assert ei.value.fatal


_WRITE_UNDER_A_LIMIT = """
import resource, sys, time
from gpuslo.ingest.store import ChdbStore, StoreError
from gpuslo.rules.tables import SCHEMA
path, limit, n, table = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
s = ChdbStore(path)
s.migrate(SCHEMA)
if limit >= 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail, EFBIG
now = time.time()
rows = {"fingerprint": [f"{limit}-{i}" for i in range(n)], "alertname": ["A"] * n, "labels": [[("k", "v")]] * n,
        "annotations": [[]] * n, "state": ["firing"] * n, "started_at": [now] * n, "ended_at": [None] * n,
        "last_sent_at": [now] * n, "updated_at": [now] * n}
try:
    if table == "optimize":
        s.execute("OPTIMIZE TABLE alert_state FINAL")
    elif table == "merge-then-failing-select":  # a merge the store does not run (a background one)
        s._sess.query("OPTIMIZE TABLE alert_state FINAL", "CSV")
        s.query("SELECT CAST('abc' AS UInt8) AS v")
    else:
        s.insert(table, rows)
    print("returned")
except StoreError as e:
    print("raised", e.failure.value, str(e).splitlines()[0])
print("count", s.query("SELECT count() AS c FROM alert_state")[0]["c"])
"""


def _under_a_limit(path: Path, limit: int, n: int, what: str = "alert_state") -> str:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _WRITE_UNDER_A_LIMIT, str(path), str(limit), str(n), what],
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize(("limit", "n"), [(0, 5), (512, 5), (0, 25_000), (20_000, 25_000)])
def test_a_write_that_fails_in_the_embedded_stores_files_is_fatal_never_reported_done(
    tmp_path: Path, limit: int, n: int
) -> None:
    """A part's files cut short (a file size limit here; a disk filling midway, an I/O error
    alike): chDB ends the INSERT as done, the rows counted in this process, and the next start
    detaches the part as broken, its rows gone. The store now raises a fatal error instead (the
    ingest then stops before committing, and reads the batch again at its next start). Sizes:
    a small batch (staged as a file, then through Python() in memory) and a large one."""
    store = tmp_path / "store"
    assert _under_a_limit(store, -1, 3).splitlines() == ["returned", "count 3"]
    out = _under_a_limit(store, limit, n).splitlines()
    assert (
        out[0].startswith("raised fatal the embedded store failed ") and "write(s) into its files" in out[0]
    ), out
    again = _under_a_limit(store, -1, 0).splitlines()  # a fresh process: the broken part is gone
    assert again[-1] == "count 3", again


def test_a_merge_whose_part_fails_to_be_written_is_fatal(tmp_path: Path) -> None:
    """The same for a merge (OPTIMIZE here; a background merge's failure is caught by the next
    statement that writes): its source parts stay on disk, nothing lost."""
    store = tmp_path / "store"
    _under_a_limit(store, -1, 3)
    _under_a_limit(store, -1, 2)
    out = _under_a_limit(store, 0, 0, "optimize").splitlines()
    assert out[0].startswith("raised fatal the embedded store failed "), out
    assert _under_a_limit(store, -1, 0).splitlines()[-1] == "count 5"
    # a merge the store did not run, then a statement that fails for its own reason: still fatal
    # (the failure's own error once took the count as its own, and the merge's loss went unsaid)
    out = _under_a_limit(store, 0, 0, "merge-then-failing-select").splitlines()
    assert (
        out[0].startswith("raised fatal the embedded store failed ") and "the statement failed too" in out[0]
    ), out
    assert _under_a_limit(store, -1, 0).splitlines()[-1] == "count 5"


def test_second_process_on_an_embedded_store_is_fatal(tmp_path: Path, store: ChdbStore) -> None:
    with pytest.raises(StoreError) as ei:
        ChdbStore(tmp_path / "other")  # chDB: one data directory per process
    assert ei.value.fatal


@pytest.mark.parametrize("where", ["file", "file/below", "ro/store"])
def test_an_embedded_store_it_cannot_create_is_fatal_and_clear(tmp_path: Path, where: str) -> None:
    """A file in the way, or a directory it may not write: one line naming the path (was an
    OSError traceback from every command that opens the store)."""
    (tmp_path / "file").write_text("")
    (tmp_path / "ro").mkdir(mode=0o500)
    path = tmp_path / where
    if where.startswith("ro") and os.access(tmp_path / "ro", os.W_OK):
        pytest.skip("running as a user that ignores directory permissions")
    with pytest.raises(StoreError, match=f"cannot create embedded store at {path}: ") as ei:
        ChdbStore(path)
    assert ei.value.fatal


def test_rules_run_once_exits_non_zero_when_the_store_is_down(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuslo.app.cli import EXIT_ERROR, main

    port = free_port()  # nothing listens there: connection refused, TRANSIENT
    assert main(["rules", "run", "--once", "--clickhouse", f"127.0.0.1:{port}"]) == EXIT_ERROR
    assert capsys.readouterr().out == ""  # no summary line for a round that did not run


def plain_at(server: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=[server])


def test_kafka_bootstrap_failures_are_told_apart() -> None:
    """kafka-python says "Unable to bootstrap" for all of these; the servers are probed."""
    from kafka.errors import KafkaTimeoutError

    exc = KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:9")
    sasl = KafkaSettings(bootstrap_servers=["127.0.0.1:9"], security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="SCRAM-SHA-256", sasl_username="alice", sasl_password="hunter2-secret")  # fmt: skip
    up, down = (lambda h, p, t: True), (lambda h, p, t: False)
    msg = explain(sasl, exc, probe=up)
    assert "authentication failed" in msg and "SCRAM-SHA-256" in msg and "'alice'" in msg
    assert "hunter2" not in msg
    assert "no Kafka broker reachable at 127.0.0.1:9 (nothing accepts" in explain(sasl, exc, probe=down)
    # a name no resolver knows is said as such, not as a broker down (`ingest --kafka kafak:9092`)
    two = KafkaSettings(bootstrap_servers=["kafak.invalid:9092", "127.0.0.1:9"])
    msg = explain(two, exc, probe=down)
    assert msg.endswith(": kafak.invalid has no address (check the name)"), msg
    known = {"127.0.0.1"}
    assert "nothing accepts" in explain(plain_at("127.0.0.1:9"), exc, probe=down, resolve=known.__contains__)
    assert "x has no address" in explain(plain_at("x:1"), exc, probe=down, resolve=known.__contains__)
    plain = KafkaSettings(bootstrap_servers=["127.0.0.1:9"])
    assert "does not answer as a broker" in explain(plain, exc, probe=up)
    from kafka.errors import SaslAuthenticationFailedError

    leak = SaslAuthenticationFailedError("bad password hunter2-secret for alice")
    msg = explain(sasl, leak, probe=up)
    assert "authentication failed" in msg and "hunter2" not in msg


def test_server_store_config_errors_are_fatal_and_clear(tmp_path: Path) -> None:
    from gpuslo.ingest.clickhouse_store import ClickHouseStore

    with pytest.raises(StoreError) as ei:  # a password file that is not there: no traceback
        ClickHouseStore(ClickHouseSettings(password_file=tmp_path / "missing"))
    assert ei.value.fatal and "missing" in str(ei.value)
    for bad in ("gpuslo`; DROP DATABASE x; --", "a b", "", "x" * 201):
        with pytest.raises(ValidationError):
            ClickHouseSettings(database=bad)
    assert ClickHouseSettings(database="gpuslo-prod_2").database == "gpuslo-prod_2"


def test_demo_says_why_when_its_store_cannot_open(
    tmp_path: Path, store: ChdbStore, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuslo.app.cli import EXIT_ERROR, main

    # chDB already holds a data directory in this process (the fixture's): a second is refused
    assert main(["demo", "--out", str(tmp_path / "demo"), "--hours", "0.1", "--quiet"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "gpuslo demo: the embedded store failed (fatal): cannot open embedded store" in err


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--window-s", "90"], "whole minutes"),  # [to - 90 s, to): a window the rollups cannot cut
        (["--config", "MIN_IDLE"], "min_idle_s"),  # idle runs across minutes: raw rows only
    ],
)
def test_rules_run_over_rollups_it_cannot_use_is_a_clear_error_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], why: str
) -> None:
    """``--source rollup`` with a window or config the rollups cannot answer: one line and
    exit 2 before anything is opened (was: a ValueError traceback at every start, a crash
    loop under a supervisor). The store here is unreachable: the reason must be the source."""
    from gpuslo.app.cli import EXIT_ERROR, main

    cfg = tmp_path / "rules.yaml"
    text = (Path(__file__).parent.parent / "rules" / "example.yaml").read_text()
    cfg.write_text(text.replace("min_idle_s: 0 ", "min_idle_s: 600 "))
    assert "min_idle_s: 600" in cfg.read_text()
    args = [str(cfg) if x == "MIN_IDLE" else x for x in extra]
    port = free_port()
    assert (
        main(["rules", "run", "--once", "--source", "rollup", "--clickhouse", f"127.0.0.1:{port}", *args])
        == EXIT_ERROR
    )
    err = capsys.readouterr().err
    assert "cannot evaluate over the rollups" in err and why in err, err
    assert "Traceback" not in err


def test_driver_side_state_errors_are_transient() -> None:
    """clickhouse-driver's own errors about the connection, not the data: a connection left
    mid-query (code -1, not a server code) and a block that arrived corrupted (code 40) are
    retried, never isolated into dead letters."""
    from clickhouse_driver import errors

    from gpuslo.ingest.clickhouse_store import classify

    assert classify(errors.PartiallyConsumedQueryError())[0] is Failure.TRANSIENT
    assert classify(errors.ChecksumDoesntMatchError("checksum"))[0] is Failure.TRANSIENT
    assert classify(errors.TypeMismatchError("x"))[0] is Failure.REFUSED  # the data: still refused


def test_a_failed_write_count_that_cannot_be_read_keeps_the_last_one(store: ChdbStore) -> None:
    """chDB's count not readable once (-1): the last count read stays the baseline, so a rise
    read afterwards is still fatal (it became the baseline, the failed writes never said)."""
    store.execute("CREATE TABLE t (a UInt8) ENGINE = MergeTree ORDER BY a")
    counts = iter([-1, 24])
    store._write_failures = 0
    store._count_write_failures = lambda: next(counts)  # type: ignore[method-assign]
    store.insert("t", {"a": [1]})  # unreadable: nothing said, nothing forgotten
    assert store._write_failures == 0
    with pytest.raises(StoreError, match="failed 24 write") as ei:
        store.insert("t", {"a": [2]})
    assert ei.value.fatal
    store._count_write_failures = lambda: 24  # type: ignore[method-assign]  # the fixture's close


def test_misfit_tells_a_column_of_another_kind_from_values_it_may_refuse_one_by_one() -> None:
    """The server store's check of a column's type against the values written to it (a column
    re-made with another kind of type is FATAL, not every message a dead letter): every type of
    the schema against a value of each kind. Whether a kind fits is written out here, from what
    clickhouse-driver takes (its columns' py_types), not from the function."""
    from datetime import UTC, datetime

    import numpy as np

    from gpuslo.ingest.clickhouse_store import misfit
    from gpuslo.ingest.schema import TABLES, column_types

    samples = {"int": 3, "numpy int": np.int64(3), "float": 1.5, "numpy float": np.float32(1.5),
               "str": "x", "bytes": b"x", "time": datetime(2026, 1, 1, tzinfo=UTC), "list": ["x"]}  # fmt: skip
    takes = {"int": {"int", "numpy int"}, "float": {"int", "numpy int", "float", "numpy float"},
             "str": {"str", "bytes"}, "time": {"time"}}  # fmt: skip

    def kind(typ: str) -> str:
        typ = typ.removeprefix("Nullable(").removeprefix("LowCardinality(")
        return ("int" if typ.startswith(("UInt", "Int")) else "float" if typ.startswith("Float")
                else "str" if typ.startswith("String") else "time" if typ.startswith("DateTime") else "?")  # fmt: skip

    seen = set()
    for table in TABLES:
        for col, typ in column_types(table).items():
            if typ.startswith("Array("):
                inner = typ[len("Array(") : -1]
                assert misfit(typ, [[], None, []]) is None, typ  # nothing tells: no verdict
                assert misfit(typ, [3]) == "int", typ  # a scalar for an array
                cases = [(typ, [None, [], [samples[k]]], k, kind(inner)) for k in samples if k != "list"]
            else:
                assert misfit(typ, [None] * 10) is None, typ
                cases = [(typ, [None, samples[k]], k, kind(typ)) for k in samples]
            for t, values, k, want in cases:
                assert want != "?", (table, col, typ)
                seen.add(want)
                got = misfit(t, values)
                assert (got is None) == (k in takes[want]), (table, col, t, k, got)
    assert seen == set(takes)
    # only the first MISFIT_LOOK values are read: a column of NULLs costs no scan of a batch
    assert misfit("Float64", [None] * 64 + ["x"]) is None
    assert misfit("Float64", [None] * 63 + ["x"]) == "str"
    assert misfit("Map(String, String)", [["x"]]) is None  # a type not listed: not judged


def test_every_wait_of_the_server_store_is_bounded_by_its_settings() -> None:
    """The server store's client is made with a bound on every socket read or write (not the
    driver's 300 s): ``send_receive_timeout_s`` (30 s unless set), the ping before a query at most
    5 s; an absurd bound is a config error."""
    from gpuslo.ingest.clickhouse_store import ClickHouseStore

    made: list[dict[str, object]] = []

    class Client:
        def __init__(self, **kw: object) -> None:
            made.append(kw)

        def disconnect(self) -> None:
            pass

    for settings, want in ((ClickHouseSettings(), (30.0, 5.0)),
                           (ClickHouseSettings(send_receive_timeout_s=2), (2.0, 2.0))):  # fmt: skip
        ClickHouseStore(settings, client_factory=Client).close()
        assert (made[-1]["send_receive_timeout"], made[-1]["sync_request_timeout"]) == want
    for bad in (0, -1, 3601):
        with pytest.raises(ValidationError):
            ClickHouseSettings(send_receive_timeout_s=bad)

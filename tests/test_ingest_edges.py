"""The ingest at its edges: ids reused, chunk boundaries, many days, far future, retention,
dead-letter keys, bounded memory, odd inputs to --file, time arguments."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuslo.app.cli import EXIT_ERROR, EXIT_OK, EXIT_PARTIAL, main
from gpuslo.ingest import pipeline
from gpuslo.ingest.jsonlines import batches as _lines
from gpuslo.ingest.pipeline import Ingestor, IngestReport
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import WireError, decode, encode
from tests import helpers as h
from tests.helpers import T0


def _hb(node: str, ts: float, seq: int, source: str = "export") -> bytes:
    obj = orjson.loads(encode(h.heartbeat(node, T0, True)))
    obj["source"], obj["boot_id"], obj["seq"], obj["ts"] = source, "b", seq, ts
    return orjson.dumps(obj)


def _q(store_dir: Path, sql: str) -> list[dict[str, Any]]:
    s = ChdbStore(store_dir)
    try:
        return s.query(sql)
    finally:
        s.close()


def test_three_nodes_sharing_an_id_one_lands_two_dead_letters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "hb.jsonl"
    f.write_bytes(b"\n".join(_hb(n, T0, 0) for n in ("a", "b", "c")) + b"\n")
    rc = main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert rc == EXIT_PARTIAL
    assert "ingested 1 of 3" in err and "rejected 2;" in err
    dead = _q(tmp_path / "s", "SELECT origin, reason FROM dead_letters ORDER BY origin")
    assert [d["origin"] for d in dead] == [f"{f}:2", f"{f}:3"]
    assert all("conflicting message" in d["reason"] and "seq 0" in d["reason"] for d in dead)
    assert _q(tmp_path / "s", "SELECT node FROM node_heartbeats") == [{"node": "a"}]


def _run(raws: list[bytes], chunk: int) -> tuple[Any, ...]:
    ing = Ingestor(_NoStore(), clock=lambda: T0 + 3600)
    total = IngestReport()
    items = [Raw(f"f:{i}", r) for i, r in enumerate(raws)]
    for k in range(0, len(items), chunk):
        p = ing.prepare(items[k : k + chunk])
        total.merge(p.report)
        total.written["rows"] = total.written.get("rows", 0) + sum(
            (c.num_rows if hasattr(c, "num_rows") else len(next(iter(c.values()))))
            for c in p.columns.values()
        )
    return total.written.get("rows"), total.duplicates, tuple(sorted(total.rejected))


class _NoStore(pipeline.Store):
    def execute(self, sql: str, params: Any = None) -> None:
        raise AssertionError

    def insert(self, table: str, columns: Any) -> int:
        raise AssertionError

    def query(self, sql: str, params: Any = None) -> list[Any]:
        raise AssertionError


def test_replays_and_conflicts_do_not_depend_on_chunk_boundaries() -> None:
    raws = [_hb("a", T0 + i, i) for i in range(20)]
    raws += [raws[3], raws[17], _hb("b", T0 + 1, 5), raws[0]]  # 3 replays, 1 conflict (seq 5)
    raws += [encode(h.batch("n1", T0 + i, [h.gpu(0, 0.5)])) for i in range(10)]  # fast path
    raws.append(raws[-4])
    results = {_run(raws, chunk) for chunk in (1, 2, 3, 7, 16, len(raws))}
    assert len(results) == 1, results
    rows, dups, rejected = results.pop()
    assert (rows, dups) == (30, 4)
    assert [o for o, _ in rejected] == ["f:22"]


def test_a_seq_beyond_int64_lands_next_to_fast_path_messages(tmp_path: Path) -> None:
    big = orjson.loads(encode(h.batch("n9", T0, [h.gpu(0, 0.5)])))
    big["seq"] = 2**64 - 1  # Arrow's int64 refuses it: the model path takes it, in the same batch
    over = dict(big, seq=2**64, ts=T0 + 1)
    health = {"v": 1, "kind": "health", "source": "x", "boot_id": "b", "seq": 1, "cluster": "c", "ts": T0,
              "node": "n", "gpu": 0, "event": "xid", "code": 2**32}  # fmt: skip
    raws = [encode(h.batch("n1", T0 + i, [h.gpu(0, 0.5)])) for i in range(5)]
    raws += [
        orjson.dumps(big),
        json_big(over),
        orjson.dumps(health),
        orjson.dumps(health | {"code": 2**32 - 1, "seq": 2}),
    ]
    s = ChdbStore(tmp_path / "s")
    try:
        s.migrate(SCHEMA)
        rep = Ingestor(s).ingest([Raw(f"t:{i}", r) for i, r in enumerate(raws)])
        assert sorted(o for o, _ in rep.rejected) == ["t:6", "t:7"]
        assert s.query("SELECT max(seq) AS m FROM gpu_samples")[0]["m"] == 2**64 - 1
        assert s.query("SELECT code FROM health_events")[0]["code"] == 2**32 - 1
    finally:
        s.close()


def json_big(obj: dict[str, Any]) -> bytes:
    import json

    return json.dumps(obj).encode()  # orjson refuses integers past 64 bits


def test_a_value_that_cannot_be_stored_is_isolated_not_fatal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = pipeline.typed

    def typed(table: str, cols: Any) -> Any:  # a column type that refuses node "poison"
        if table == "node_heartbeats" and "poison" in list(cols.get("node", [])):
            raise OverflowError("value out of range (injected)")
        return real(table, cols)

    monkeypatch.setattr(pipeline, "typed", typed)
    s = ChdbStore(tmp_path / "s")
    try:
        s.migrate(SCHEMA)
        rep = Ingestor(s).ingest(
            [Raw("t:0", _hb("a", T0, 1)), Raw("t:1", _hb("poison", T0, 2)), Raw("t:2", _hb("c", T0, 3))]
        )
        assert [o for o, _ in rep.rejected] == ["t:1"]
        assert "cannot be stored: OverflowError" in rep.rejected[0][1]
        assert {r["node"] for r in s.query("SELECT node FROM node_heartbeats")} == {"a", "c"}
        assert s.query("SELECT origin FROM dead_letters") == [{"origin": "t:1"}]
    finally:
        s.close()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_file_spanning_many_days_lands_whole(tmp_path: Path) -> None:
    f = tmp_path / "days.jsonl"
    lines = [encode(h.sched("submit", f"r{d}", T0 - d * 86400)) for d in range(250)]
    f.write_bytes(b"\n".join(lines) + b"\n")
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_OK
    assert _q(tmp_path / "s", "SELECT count() AS n, uniq(toDate(ts)) AS d FROM sched_events") == [
        {"n": 250, "d": 250}
    ]
    # in one batch, without the message-by-message fallback (which would also land them, slowly)
    store = ChdbStore(tmp_path / "one")
    try:
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest([Raw(f"t:{i}", r) for i, r in enumerate(lines)])
        assert rep.written == {"sched_events": 250}
    finally:
        store.close()


def test_far_future_rows_survive_the_ttl_and_past_2106_is_refused(tmp_path: Path) -> None:
    from gpuslo.wire.bounds import TS_MAX

    ok, late = _hb("a", TS_MAX, 1), _hb("a", TS_MAX + 1, 2)
    with pytest.raises(WireError, match="2106"):
        decode(late)
    f = tmp_path / "f.jsonl"
    f.write_bytes(ok + b"\n" + late + b"\n")
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_PARTIAL
    s = ChdbStore(tmp_path / "s")
    try:
        s.execute("OPTIMIZE TABLE node_heartbeats FINAL")
        assert s.query("SELECT toFloat64(ts) AS t FROM node_heartbeats") == [{"t": TS_MAX}]
    finally:
        s.close()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_backfill_beyond_the_default_retention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = T0 - 3000 * 86400
    f = tmp_path / "old.jsonl"
    f.write_bytes(_hb("a", old, 1) + b"\n")
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_ERROR  # nothing landed
    assert "--retention-days" in capsys.readouterr().err
    assert (
        main(["ingest", "--file", str(f), "--store", str(tmp_path / "s"), "--retention-days", "4000"])
        == EXIT_OK
    )
    s = ChdbStore(tmp_path / "s")
    try:
        s.execute("OPTIMIZE TABLE node_heartbeats FINAL")
        assert s.query("SELECT count() AS n FROM node_heartbeats")[0]["n"] == 1
        assert pipeline.retention_days(s) == 4000
    finally:
        s.close()
    f.write_bytes(_hb("a", old, 2) + b"\n")  # the store keeps its retention for the next run
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_OK
    assert (
        main(["ingest", "--file", str(f), "--store", str(tmp_path / "x"), "--retention-days", "0"])
        == EXIT_ERROR
    )


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_two_streams_with_the_same_origin_keep_every_dead_letter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = str(tmp_path / "s")
    for text in (b"{first garbage\n", b"{second garbage\n", b"{second garbage\n"):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text)))
        assert main(["ingest", "--file", "-", "--store", store]) == EXIT_ERROR
    dead = _q(tmp_path / "s", "SELECT origin, raw FROM dead_letters FINAL ORDER BY raw")
    assert [(d["origin"], d["raw"]) for d in dead] == [
        ("stdin:1", "{first garbage"),
        ("stdin:1", "{second garbage"),
    ]


def test_rejections_in_memory_are_bounded_by_max_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "g.jsonl"
    f.write_bytes(b"".join(b"{bad %d\n" % i for i in range(300)) + _hb("a", T0, 1) + b"\n")
    assert (
        main(["ingest", "--file", str(f), "--store", str(tmp_path / "s"), "--max-report", "4"])
        == EXIT_PARTIAL
    )
    err = capsys.readouterr().err
    assert err.count("rejected /") == 4 and "... 296 more" in err and "rejected 300;" in err
    assert _q(tmp_path / "s", "SELECT count() AS n FROM dead_letters")[0]["n"] == 300
    rep = IngestReport(keep=4)
    for i in range(10):
        rep.reject(str(i), "r")
    assert len(rep.rejected) == 4 and rep.n_rejected == 10


def test_an_over_long_line_is_a_dead_letter_and_its_neighbours_land(tmp_path: Path) -> None:
    f = tmp_path / "long.jsonl"
    f.write_bytes(_hb("a", T0, 1) + b"\n" + b"x" * 50_000 + b"\n" + _hb("b", T0, 2) + b"\n")
    assert (
        main(["ingest", "--file", str(f), "--store", str(tmp_path / "s"), "--max-line-bytes", "4096"])
        == EXIT_PARTIAL
    )
    dead = _q(tmp_path / "s", "SELECT origin, reason, length(raw) AS n FROM dead_letters")
    assert dead == [
        {
            "origin": f"{f}:2",
            "reason": "line of 50000 bytes is over the limit of 4096 (--max-line-bytes)",
            "n": 1024,
        }
    ]
    assert _q(tmp_path / "s", "SELECT count() AS n FROM node_heartbeats")[0]["n"] == 2


@pytest.mark.parametrize(
    "name", [b"\xff\xfe.jsonl", b"caf\xe9.jsonl", b"\xe9\x80.jsonl", b"caf\xc3\xa9.jsonl", b"a\\xff.jsonl"]
)
def test_a_file_whose_name_is_not_utf8_lands_with_its_dead_letters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: bytes
) -> None:
    """A file name is bytes: one that is not UTF-8 (a Latin-1 system's caf\xe9.jsonl) reached
    Python with lone surrogates, and its first dead letter (the line's origin) was a
    UnicodeEncodeError traceback, exit 1, nothing said. Its lines land; the origin writes the
    bytes that are not UTF-8 as \\xNN (a UTF-8 name unchanged); a store directory whose name is
    not UTF-8 (chDB opens UTF-8 paths only) is refused, exit 2, said, nothing made."""
    path = os.path.join(os.fsencode(tmp_path), name)
    with open(path, "wb") as fh:
        fh.write(_hb("a", T0, 1) + b"\n{bad\n" + _hb("b", T0, 2) + b"\n")
    rc = main(["ingest", "--file", os.fsdecode(path), "--store", str(tmp_path / "s")])
    assert rc == EXIT_PARTIAL, capsys.readouterr().err
    origin = path.decode("utf-8", "backslashreplace") + ":2"  # what the name's bytes say, as text
    assert _q(tmp_path / "s", "SELECT origin FROM dead_letters") == [{"origin": origin}]
    assert _q(tmp_path / "s", "SELECT count() AS n FROM node_heartbeats")[0]["n"] == 2
    capsys.readouterr()
    store = os.path.join(os.fsencode(tmp_path), b"store-" + name)
    rc = main(["ingest", "--file", os.fsdecode(path), "--store", os.fsdecode(store)])
    utf8 = name == b"caf\xc3\xa9.jsonl" or name == b"a\\xff.jsonl"
    assert rc == (EXIT_PARTIAL if utf8 else EXIT_ERROR)
    assert utf8 or ("its path is not UTF-8" in capsys.readouterr().err and not os.path.exists(store))


@pytest.mark.parametrize("size", [4095, 4096, 4097, 10_000_000])
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b""])
def test_the_line_limit_at_its_edge(size: int, end: bytes) -> None:
    data = b"{first}\n" + b"a" + b"x" * (size - 1) + end
    (batch,) = list(_lines(io.BytesIO(data), "f", max_line=4096))
    n = size + (1 if end == b"\r\n" else 0)  # the \r counts: it is a byte before the newline
    taken = n <= 4096
    assert [r.origin for r in batch] == ["f:1", "f:2"]
    assert (batch[1].refused == "") is taken, batch[1].refused
    if not taken:
        assert batch[1].value == data[8 : 8 + 1024]
        assert batch[1].refused == f"line of {n} bytes is over the limit of 4096 (--max-line-bytes)"
    else:
        assert batch[1].value == data[8:].rstrip(b"\r\n")


@pytest.mark.parametrize("size", [1, 4094, 4095, 4096, 4097, 4099, 100_000])
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b""])
def test_a_utf8_signature_before_the_first_line_is_not_part_of_it(size: int, end: bytes) -> None:
    """A file saved as "UTF-8 with BOM" (PowerShell, Notepad) lost its first message: a dead
    letter, "BOM is not supported". The signature is read past at the stream's start only (one
    inside it is the line's own bytes), and the line limit is the line's, the signature apart."""
    bom = b"\xef\xbb\xbf"
    first = b"{" + b"x" * (size - 1)
    data = bom + first + end + (b"{second}\n" + bom + b"{third}\n" if end else b"")
    lines = [r for b in _lines(io.BytesIO(data), "f", max_line=4096) for r in b]
    n = size + (1 if end == b"\r\n" else 0)  # its bytes before the newline
    assert lines[0].origin == "f:1"
    if n <= 4096:
        assert (lines[0].value, lines[0].refused) == (first, "")
    else:
        assert lines[0].value == first[:1024]
        assert lines[0].refused == f"line of {n} bytes is over the limit of 4096 (--max-line-bytes)"
    rest = [(r.origin, r.value, r.refused) for r in lines[1:]]
    assert rest == ([("f:2", b"{second}", ""), ("f:3", bom + b"{third}", "")] if end else [])


def test_a_file_with_a_utf8_signature_lands_whole(tmp_path: Path) -> None:
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + _hb("a", T0, 1) + b"\r\n" + _hb("b", T0, 2) + b"\r\n")
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_OK
    assert _q(tmp_path / "s", "SELECT count() AS n FROM node_heartbeats")[0]["n"] == 2


def test_batches_are_bounded_in_bytes_and_lines() -> None:
    data = b"".join(b"%d" % i + b"y" * 1000 + b"\n" for i in range(100))
    batches = list(_lines(io.BytesIO(data), "f", max_line=2000, chunk=30, chunk_bytes=10_000))
    assert [len(b) for b in batches] == [10] * 10
    batches = list(_lines(io.BytesIO(data), "f", max_line=2000, chunk=30, chunk_bytes=10**9))
    assert [len(b) for b in batches] == [30, 30, 30, 10]
    assert batches[3][-1].origin == "f:100"


def test_a_fifo_is_read_and_a_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb") as w:
            w.write(_hb("a", T0, 1) + b"\n")

    t = threading.Thread(target=feed)
    t.start()
    assert main(["ingest", "--file", str(fifo), "--store", str(tmp_path / "s")]) == EXIT_OK
    t.join()
    assert main(["ingest", "--file", str(tmp_path), "--store", str(tmp_path / "s")]) == EXIT_ERROR
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "1e300", "-5", str(T0 * 1000)])
@pytest.mark.parametrize("cmd", [["rules", "eval"], ["report"], ["rules", "eval", "--json"]])
def test_time_arguments_are_checked_at_the_edge(
    bad: str, cmd: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for args in ([f"--from={bad}", "--to", str(T0)], ["--from", str(T0), f"--to={bad}"]):
        with pytest.raises(SystemExit) as ei:
            main([*cmd, "--store", str(tmp_path), *args])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "is not a time between 1970-01-01 and 2106-01-01" in err and "SELECT" not in err


def test_demo_refuses_a_foreign_non_empty_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    assert main(["demo", "--out", str(out), "--hours", "0.05", "--nodes", "1", "--quiet"]) == EXIT_ERROR
    assert "not empty and was not created by the demo" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda o: o | {"schedulable": "yes"}, "schedulable: Input should be a valid boolean"),
        (lambda o: o | {"interval_s": "10"}, "interval_s: Input should be a valid number"),
        (lambda o: o | {"gpus": 8.0}, "gpus: Input should be a valid integer"),
    ],
)
def test_the_wire_is_strict(mutate: Any, reason: str) -> None:
    obj = orjson.loads(_hb("a", T0, 1))
    with pytest.raises(WireError, match=reason):
        decode(orjson.dumps(mutate(obj)))
    assert decode(orjson.dumps(obj | {"interval_s": 10})).interval_s == 10.0  # an int where a float is


def test_gpu_rows_are_bounded_and_unique() -> None:
    from gpuslo.ingest import fastpath

    obj = orjson.loads(encode(h.batch("n1", T0, [h.gpu(0, 0.5), h.gpu(1, 0.5)])))
    dup = dict(obj, gpus=[obj["gpus"][0], obj["gpus"][0]])
    many = dict(obj, gpus=[dict(obj["gpus"][0], index=i % 1024, uuid=f"G{i}") for i in range(1025)])
    for bad, why in ((dup, "GPU 0 appears more than once"), (many, "at most 1024")):
        raw = orjson.dumps(bad)
        with pytest.raises(WireError, match=why):
            decode(raw)
        d, rest = fastpath.decode([raw])
        assert d.positions == [] and rest == [0]  # the vectorised path leaves it to the models
    ok = dict(obj, gpus=[dict(obj["gpus"][0], index=i, uuid=f"G{i}") for i in range(1024)])
    assert len(decode(orjson.dumps(ok)).gpus) == 1024
    assert fastpath.decode([orjson.dumps(ok)])[0].positions == [0]


OLD_DDL = {  # what stores made before the Date TTL and the dead letters' byte key have
    "ttl": "TTL toDate(ts) + INTERVAL 400 DAY",
    "old_ttl": "TTL toDateTime(ts) + INTERVAL 400 DAY",
    "dead": "ORDER BY (origin, raw_hash)",
    "old_dead": "ORDER BY origin",
}


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_store_made_by_an_earlier_version_is_upgraded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuslo.ingest import schema

    old = (
        SCHEMA.render()
        .replace(OLD_DDL["ttl"], OLD_DDL["old_ttl"])
        .replace(OLD_DDL["dead"], OLD_DDL["old_dead"])
    )
    old = old.replace("    raw String,\n    raw_hash UInt64\n", "    raw String\n")
    assert OLD_DDL["old_ttl"] in old and "raw_hash" not in old
    s = ChdbStore(tmp_path / "s")
    try:
        for stmt in schema.statements(old):
            s.execute(stmt)
        assert pipeline.retention_days(s) == 400
    finally:
        s.close()
    for text in (b"{first garbage\n", b"{second garbage\n"):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text)))
        assert main(["ingest", "--file", "-", "--store", str(tmp_path / "s")]) == EXIT_ERROR
    s = ChdbStore(tmp_path / "s")
    try:
        q = s.query("SELECT create_table_query AS q FROM system.tables WHERE name = 'gpu_samples'")[0]["q"]
        assert "TTL toDate(ts) + toIntervalDay(400)" in q
        s.execute("OPTIMIZE TABLE dead_letters FINAL")
        assert s.query("SELECT count() AS n FROM dead_letters FINAL")[0]["n"] == 2
    finally:
        s.close()


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "0", "1e300", "x"])
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--hours"],
        ["demo", "--interval-s"],
        ["rules", "run", "--window-s"],
        ["rules", "run", "--every-s"],
        ["ingest", "--idle-exit-s"],
    ],
)
def test_durations_are_finite_and_in_range(
    argv: list[str], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ei:
        main([*argv[:-1], f"{argv[-1]}={bad}"])
    assert ei.value.code == 2
    assert "is not a" in capsys.readouterr().err


def test_decoder_faults_stay_with_their_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuslo.ingest import fastpath

    def broken(values: Any) -> Any:
        raise MemoryError("injected")

    real_decode = pipeline.decode

    def decode_or_fault(raw: bytes) -> Any:
        if b'"node":"b"' in raw:
            raise RecursionError("injected")
        return real_decode(raw)

    monkeypatch.setattr(fastpath, "decode", broken)
    monkeypatch.setattr(pipeline, "decode", decode_or_fault)
    raws = [encode(h.batch("n1", T0 + i, [h.gpu(0, 0.5)])) for i in range(3)] + [
        _hb("b", T0, 1),
        _hb("c", T0, 2),
    ]
    p = Ingestor(_NoStore(), clock=lambda: T0 + 3600).prepare([Raw(f"t:{i}", r) for i, r in enumerate(raws)])
    assert [(o, r.split(":")[0]) for o, r in p.report.rejected] == [("t:3", "cannot be decoded")]
    assert p.report.vectorised == 0 and set(p.columns) == {"gpu_samples", "node_heartbeats"}


def test_ingest_or_isolate_dead_letters_only_what_the_store_refuses(store: ChdbStore) -> None:
    """The store refuses any insert that holds node 'bad' (as a server refuses a value its
    column cannot hold): the batch is written message by message, 'bad' becomes a dead letter
    with the store's reason, the others land. A transient failure is raised, not isolated."""
    from gpuslo.ingest.store import Failure, StoreError

    class Refusing(ChdbStore):
        transient = False

        def __init__(self, inner: ChdbStore) -> None:
            self.__dict__.update(inner.__dict__)

        def insert(self, table: str, columns: Any) -> int:
            if self.transient:
                raise StoreError("Code: 210. Connection refused", Failure.TRANSIENT, 210)
            nodes = (
                columns.column("node").to_pylist() if hasattr(columns, "column") else columns.get("node", [])
            )
            if table == "node_heartbeats" and "bad" in nodes:
                raise StoreError("Code: 53. Type mismatch", Failure.REFUSED, 53)
            return super().insert(table, columns)

    st = Refusing(store)
    ing = Ingestor(st)
    items = [Raw(f"f:{i}", _hb(n, T0, i), offset=i) for i, n in enumerate(["a", "bad", "c"])]
    rep = ing.ingest_or_isolate(items)
    assert (rep.received, rep.accepted, rep.n_rejected, rep.dead_lettered) == (3, 2, 1, 1)
    nodes = {r["node"] for r in store.query("SELECT node FROM node_heartbeats FINAL")}
    assert nodes == {"a", "c"}
    (dead,) = store.query("SELECT origin, reason FROM dead_letters FINAL")
    assert dead["origin"] == "f:1" and "store refused it: Code: 53" in dead["reason"]
    st.transient = True
    with pytest.raises(StoreError, match="Connection refused"):
        ing.ingest_or_isolate([Raw("f:9", _hb("d", T0, 9), offset=9)])


@pytest.mark.parametrize(
    ("kind", "pack"),
    [
        ("gzip", lambda b: __import__("gzip").compress(b)),
        ("bzip2", lambda b: __import__("bz2").compress(b)),
        ("xz", lambda b: __import__("lzma").compress(b)),
        ("zstd", lambda b: b"\x28\xb5\x2f\xfd" + b),  # the frame's magic (no zstd module needed)
    ],
)
def test_a_compressed_file_is_refused_with_the_command_that_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, pack: Any
) -> None:
    """Read as text, each of its lines was a dead letter "not UTF-8", the cause nowhere said."""
    f = tmp_path / "wire.jsonl.z"
    f.write_bytes(pack(_hb("a", T0, 1) + b"\n"))
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"is {kind}-compressed" in err and "gpuslo ingest --file -" in err
    assert not (tmp_path / "s").exists()  # refused before any store is opened
    # a JSON-lines file that merely starts like one of them is no such file: "BZh" is text
    f.write_bytes(b"BZh\n" + _hb("a", T0, 2) + b"\n")
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_PARTIAL

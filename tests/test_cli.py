from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gpuslo.app.cli import EXIT_ERROR, EXIT_OK, EXIT_PARTIAL, main, parse_time
from gpuslo.ingest.store import ChdbStore
from gpuslo.wire import encode
from tests import helpers as h
from tests.helpers import T0


def test_parse_time() -> None:
    assert parse_time("1767225600") == 1767225600.0
    assert parse_time("2026-01-01T00:00:00Z") == 1767225600.0
    assert parse_time("2026-01-01T01:00:00+01:00") == 1767225600.0
    assert parse_time("2026-01-01 00:00:00") == 1767225600.0  # no zone: UTC
    with pytest.raises(Exception, match="neither epoch seconds nor ISO-8601"):
        parse_time("yesterday")


def _write_lines(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_ingest_file_reports_bad_lines_and_lands_the_good_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good1 = encode(h.batch("n1", T0 + 10, [h.gpu(0, 0.5, (("j", 1.0),))]))
    good2 = encode(h.batch("n1", T0 + 20, [h.gpu(0, 0.5, (("j", 1.0),))]))
    earlier = encode(h.batch("n1", T0, [h.gpu(0, 0.5, (("j", 1.0),))]))  # out of order: lands, with a warning
    v2 = orjson.loads(good1)
    v2["v"] = 2
    ancient = encode(h.batch("n1", 1_000_000_000.0, [h.gpu(0, 0.5)]))  # 2001: beyond retention
    lines = [good1, b"{garbage", good2, orjson.dumps(v2), b"", earlier, ancient]
    f = tmp_path / "in.jsonl"
    _write_lines(f, lines)
    store = tmp_path / "store"
    rc = main(["ingest", "--file", str(f), "--store", str(store)])
    err = capsys.readouterr().err
    assert rc == EXIT_PARTIAL
    assert f"rejected {f}:2: not JSON" in err
    assert f"rejected {f}:4: unsupported wire version 2" in err
    assert (
        f"rejected {f}:7: ts 1000000000.000 (2001-09-09T01:46:40Z) is older than the store's retention (400"
        in err
    )
    assert "--retention-days" in err  # says how to backfill
    assert f"warning  {f}:6: out-of-order: ts {T0:.3f} is 20.000 s before {f}:3" in err
    assert "ingested 3 of 6 messages" in err
    s = ChdbStore(store)
    try:
        assert s.query("SELECT count() AS n FROM gpu_samples")[0]["n"] == 3
        dead = s.query("SELECT origin, reason FROM dead_letters ORDER BY origin")
        assert [d["origin"] for d in dead] == [f"{f}:2", f"{f}:4", f"{f}:7"]
    finally:
        s.close()


def test_ingest_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["ingest", "--file", str(tmp_path / "nope.jsonl"), "--store", str(tmp_path / "s")]) == EXIT_ERROR
    )
    assert "no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["ingest", "--file", str(empty), "--store", str(tmp_path / "s")]) == EXIT_ERROR


def test_ingest_file_summary_lists_only_the_tables_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing landed: "(0 rows)", not "(0 rows: )"; a table with no row is not listed."""
    f = tmp_path / "bad.jsonl"
    _write_lines(f, [b"not json"])
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_ERROR
    assert "ingested 0 of 1 messages (0 rows); rejected 1;" in capsys.readouterr().err
    _write_lines(f, [encode(h.batch("n1", T0, [h.gpu(0, 0.5)]))])
    assert main(["ingest", "--file", str(f), "--store", str(tmp_path / "s")]) == EXIT_OK
    assert "ingested 1 of 1 messages (1 rows: gpu_samples 1); rejected 0;" in capsys.readouterr().err


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_replay_path_agent_file_ingest_rules_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet.jsonl"
    start = T0
    assert (
        main(
            [
                "agent",
                "--source",
                "sim",
                "--hours",
                "2",
                "--nodes",
                "2",
                "--seed",
                "3",
                "--start",
                str(start),
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    store = tmp_path / "store"
    assert main(["ingest", "--file", str(out), "--store", str(store)]) == EXIT_OK
    capsys.readouterr()
    iso_from = datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rc = main(
        ["rules", "eval", "--store", str(store), "--from", iso_from, "--to", str(start + 7200), "--json"]
    )
    assert rc == EXIT_OK
    s = json.loads(capsys.readouterr().out)
    assert {
        "cur_allocation",
        "cur_active",
        "idle_allocated_gpu_hours",
        "idle_unallocated_gpu_hours",
        "starvation_incidents",
        "slo_alerts",
    } <= s.keys()
    assert "ground_truth" not in s
    assert 0 < s["cur_allocation"] <= 1
    # capacity: 2 nodes x 8 GPUs x 2 h, no drain (its window starts at hour 4)
    assert s["capacity_gpu_hours"] == pytest.approx(32.0)
    # ingesting the same file again doubles nothing (ReplacingMergeTree + FINAL)
    assert main(["ingest", "--file", str(out), "--store", str(store)]) == EXIT_OK
    capsys.readouterr()
    assert (
        main(
            [
                "rules",
                "eval",
                "--store",
                str(store),
                "--from",
                str(start),
                "--to",
                str(start + 7200),
                "--json",
            ]
        )
        == EXIT_OK
    )
    assert json.loads(capsys.readouterr().out) == s


def test_rules_eval_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "eval", "--store", str(tmp_path), "--from", "10", "--to", "5"]) == EXIT_ERROR
    assert main(["rules", "eval", "--store", str(tmp_path / "no"), "--from", "1", "--to", "5"]) == EXIT_ERROR
    bad = tmp_path / "bad.yaml"
    bad.write_text("idle_threshold: 2\nunknown_key: 1\n")
    capsys.readouterr()
    argv = ["rules", "eval", "--store", str(tmp_path), "--from", "1", "--to", "5", "--config", str(bad)]
    assert main(argv) == EXIT_ERROR
    assert "bad.yaml: idle_threshold: Input should be less than or equal to 1" in capsys.readouterr().err


@pytest.mark.integration  # the whole demo in its own process
def test_demo_console_script_runs_and_prints_the_summary(tmp_path: Path) -> None:
    """The installed console script, in its own process, on a short run."""
    exe = Path(sys.executable).with_name("gpuslo")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gpuslo"]
    r = subprocess.run(
        [*cmd, "demo", "--hours", "1", "--nodes", "2", "--out", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "Allocation CUR" in r.stdout and "simulator truth" in r.stdout
    assert "simulating: 100%" in r.stderr  # progress display (not a terminal: line per quarter)
    assert (tmp_path / "d" / "dashboards" / "fleet-overview.json").is_file()
    # the demo refuses to wipe a directory it did not create
    other = tmp_path / "mine"
    other.mkdir()
    (other / "store").mkdir()
    (other / "store" / "precious.txt").write_text("x")
    r = subprocess.run(
        [*cmd, "demo", "--hours", "0.1", "--out", str(other)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode != 0 and "was not created by the demo" in r.stderr
    assert (other / "store" / "precious.txt").exists()


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI; it must refuse with exit 2 (argparse's own, or a returned one) and say why in
    one line or a config error, never a traceback. What it said."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["agent", "--source", "latency"], "needs at least one --latency"),
        (["agent", "--source", "latency", "--latency", "=svc"], "expected URL=SERVICE"),
        (["agent", "--source", "sim", "--nodes", "0"], "--nodes must be >= 1"),
        (["agent", "--metrics-port", "99999"], "not an integer in [0, 65535]"),
        (["agent", "--metrics-port", "-1"], "not an integer in [0, 65535]"),
        (["agent", "--ticks", "-1"], "not an integer in [0,"),
        (["agent", "--kafka", ",,", "--hours", "0.01"], "--kafka: bootstrap_servers.0"),
        (["ingest", "--kafka", "x:1", "--metrics-port", "70000"], "not an integer in [0, 65535]"),
        (
            ["ingest", "--file", "in.jsonl", "--clickhouse", "host:notaport"],
            "the port is a number from 1 to 65535",
        ),
        (
            ["ingest", "--file", "in.jsonl", "--clickhouse", "host:99999"],
            "the port is a number from 1 to 65535",
        ),
        (["ingest", "--file", "in.jsonl", "--clickhouse", "host:0"], "the port is a number from 1 to 65535"),
        # "host:" was host on port 9000; a blank host a name the resolver did not know, a transient
        # error (rules run retried it for ever); [::1]:9000 was "port: got ':1]:9000'"
        (["ingest", "--file", "in.jsonl", "--clickhouse", "host:"], "the port is a number from 1 to 65535"),
        (["ingest", "--file", "in.jsonl", "--clickhouse", ":9000"], "--clickhouse: ':9000': no host name"),
        (["ingest", "--file", "in.jsonl", "--clickhouse", " "], "--clickhouse: ' ': no host name"),
        (["rules", "run", "--once", "--clickhouse", " :9000"], "--clickhouse: ' :9000': no host name"),
        (["chargeback", "--from", "0", "--to", "1", "--clickhouse", "\t"], "no host name"),
        (["ingest", "--file", "in.jsonl", "--clickhouse", "::1"], "write an IPv6 address in brackets"),
        (["ingest", "--file", "in.jsonl", "--clickhouse", "[nohost]:9000"], "in brackets is no IPv6 address"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 1 is "ran, but not everything was delivered"; a refused option is 2, like argparse's."""
    (tmp_path / "in.jsonl").write_bytes(b"")
    argv = [str(tmp_path / w) if w == "in.jsonl" else w for w in argv]
    assert says in _refused(argv, capsys)


@pytest.mark.parametrize("argv", [["schema"], ["rules", "export-prometheus"]])
def test_a_reader_that_closes_stdout_gets_one_line_not_a_traceback(argv: list[str]) -> None:
    """`gpuslo rules run | head -1`: the reader leaves; the command stops with exit 1 and says so."""
    import os

    r, w = os.pipe()
    os.close(r)  # a reader gone before the first write
    try:
        p = subprocess.run([sys.executable, "-m", "gpuslo", *argv], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=120, check=False)  # fmt: skip
    finally:
        os.close(w)
    assert p.returncode == EXIT_PARTIAL, p.stderr
    assert "Traceback" not in p.stderr and "standard output was closed" in p.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("argv", [["schema"], ["rules", "export-prometheus"]])
def test_stdout_on_a_full_disk_gets_one_line_not_a_traceback(argv: list[str]) -> None:
    """`gpuslo schema > out.sql` on a full disk (/dev/full: every write fails with ENOSPC): an
    OSError traceback from print, or for a short output Python's "Exception ignored" at exit;
    now one line and exit 1 ("ran, but not everything was delivered"), as a closed pipe."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "gpuslo", *argv], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120, check=False)  # fmt: skip
    assert p.returncode == EXIT_PARTIAL, p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert p.stderr == "gpuslo: cannot write standard output: No space left on device; stopped\n"


def test_output_files_the_user_names_are_utf8_and_a_bad_path_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`report --out`, `job --html`, `rules export-prometheus --out`, `dashboards --out`: a path
    that is a directory or under a missing one was an IsADirectoryError / FileNotFoundError
    traceback; the pages (always non-ASCII: '–', '→') were written in the locale's encoding, a
    UnicodeEncodeError under POSIX without UTF-8 mode."""
    from gpuslo.app.cli import write_out

    for bad, says in [
        (tmp_path, "Is a directory"),
        (tmp_path / "no" / "x.html", "No such file or directory"),
    ]:
        assert not write_out(bad, "x", "report")
        assert capsys.readouterr().err == f"gpuslo report: cannot write --out {bad}: {says}\n"
        assert main(["rules", "export-prometheus", "--out", str(bad)]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert err.startswith("gpuslo rules export-prometheus: cannot write --out") and says in err
        assert err.count("\n") == 1
    (tmp_path / "file").write_text("")
    assert main(["dashboards", "generate", "--out", str(tmp_path / "file" / "d")]) == EXIT_ERROR
    assert "gpuslo dashboards: cannot write --out" in capsys.readouterr().err
    out = tmp_path / "page.html"
    code = f"from gpuslo.app.cli import write_out; assert write_out({str(out)!r}, '\\u2013 \\u2192 \\u202e', 'job')"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[1]), "LC_ALL": "POSIX",
           "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}  # fmt: skip
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    assert out.read_bytes() == "\u2013 \u2192 \u202e".encode()


def test_a_reading_command_never_makes_a_store_in_a_directory_that_is_not_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuslo job 1 --store ~` made chDB's data/, metadata/, store/ and tmp/ in the home
    directory and answered as for an empty fleet: every reading command refuses it, the
    directory left as it was."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    window = ["--from", str(T0), "--to", str(T0 + 3600)]
    for argv in (["job", "1"], ["rightsize", *window], ["rules", "eval", *window], ["chargeback", *window],
                 ["whatif", *window], ["report", *window, "--out", str(tmp_path / "r.html")]):  # fmt: skip
        assert main([*argv, "--store", str(home)]) == EXIT_ERROR, argv
        err = capsys.readouterr().err
        assert f"{home}: not a gpuslo store (no metadata/ in it" in err and err.count("\n") == 1, argv
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]


def test_a_library_error_is_logged_on_one_line_without_its_traceback() -> None:
    """kafka-python logs a broker restarting under the consumer with a traceback (its socket
    reset): on one line with the exception (``-v`` keeps them); gpuslo's own stay as they are."""
    import io
    import logging

    from gpuslo.app.cli import OneLineLibraryErrors

    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.addFilter(OneLineLibraryErrors(("kafka",)))
    for name in ("kafka.net.transport", "gpuslo.ingest.x"):
        lg = logging.getLogger(name)
        lg.addHandler(h)
        lg.propagate = False
        try:
            try:
                raise ConnectionResetError(104, "Connection reset by peer")
            except ConnectionResetError:
                lg.exception("recv from node %s failed", 1)
        finally:
            lg.removeHandler(h)
            lg.propagate = True
    kafka_part, ours = out.getvalue().split("recv from node 1 failed", 2)[1:]
    assert kafka_part.startswith(": ConnectionResetError: [Errno 104] Connection reset by peer\n"), kafka_part
    assert "Traceback" not in kafka_part
    assert ours.startswith("\nTraceback")


def test_a_library_message_repeated_is_held_back_and_counted() -> None:
    """kafka-python logs every try to reach a broker that is down (four or five lines a try, a
    try every few seconds: 81 lines of stderr in a 36 s agent run against an unresolvable host,
    9 now). The same text again (numbers aside) within a minute is held back, the next one says
    how many were; another text, another level or gpuslo's own records pass."""
    import io
    import logging

    from gpuslo.app.cli import RepeatedLibraryLogs

    now = [0.0]
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    h.addFilter(RepeatedLibraryLogs(("kafka",), every_s=60.0, clock=lambda: now[0]))
    loggers = [logging.getLogger(n) for n in ("kafka.net.manager", "gpuslo.agent.kafka_sink")]
    for lg in loggers:
        lg.addHandler(h)
        lg.propagate = False
    try:
        k, ours = loggers
        for i in range(5):  # every 10 s, the backoff in the text changing
            now[0] = 10.0 * i
            k.warning(
                "Bootstrap connection to %s failed: %s (backoff %.2f secs)", "b-0", "DNS", 0.1 * (i + 1)
            )
            ours.warning("Kafka unavailable")
        k.error(
            "Bootstrap connection to %s failed: %s (backoff %.2f secs)", "b-0", "DNS", 9.0
        )  # another level
        k.warning("Topic %s not found in cluster metadata", "gpuslo.latency")  # another text
        now[0] = 60.0
        k.warning("Bootstrap connection to %s failed: %s (backoff %.2f secs)", "b-0", "DNS", 0.3)
        now[0] = 70.0
        k.warning("Bootstrap connection to %s failed: %s (backoff %.2f secs)", "b-0", "DNS", 0.4)
    finally:
        for lg in loggers:
            lg.removeHandler(h)
            lg.propagate = True
    lines = out.getvalue().splitlines()
    assert lines.count("gpuslo.agent.kafka_sink WARNING Kafka unavailable") == 5
    kafka = [x for x in lines if x.startswith("kafka.")]
    assert kafka == [
        "kafka.net.manager WARNING Bootstrap connection to b-0 failed: DNS (backoff 0.10 secs)",
        "kafka.net.manager ERROR Bootstrap connection to b-0 failed: DNS (backoff 9.00 secs)",
        "kafka.net.manager WARNING Topic gpuslo.latency not found in cluster metadata",
        "kafka.net.manager WARNING Bootstrap connection to b-0 failed: DNS (backoff 0.30 secs) "
        "(4 more like it held back in 60 s)",
    ]


def _repeats_run(records: list[tuple[str, str]], handlers: int = 1) -> list[list[str]]:
    """What each of ``handlers`` handlers (one RepeatedLibraryLogs on them all, the clock
    standing still) writes of WARNING ``records`` (logger, text)."""
    import io
    import logging

    from gpuslo.app.cli import RepeatedLibraryLogs

    repeats = RepeatedLibraryLogs(("kafka",), every_s=60.0, clock=lambda: 0.0)
    outs = [io.StringIO() for _ in range(handlers)]
    hs = [logging.StreamHandler(o) for o in outs]
    for hd in hs:
        hd.setFormatter(logging.Formatter("%(name)s %(message)s"))
        hd.addFilter(repeats)
    names = {n for n, _ in records}
    for n in names:
        lg = logging.getLogger(n)
        lg.propagate = False
        for hd in hs:
            lg.addHandler(hd)
    try:
        for n, text in records:
            logging.getLogger(n).warning("%s", text)
    finally:
        for n in names:
            lg = logging.getLogger(n)
            lg.propagate = True
            for hd in hs:
                lg.removeHandler(hd)
    return [o.getvalue().splitlines() for o in outs]


def test_library_messages_that_differ_by_more_than_a_duration_are_all_shown() -> None:
    """Recorded from kafka-python 3.0 against localhost:1, kafka1:9092 and kafka2:9092 (down and
    unresolvable): its repeats differ by the backoff only. Another broker whose name differs by
    a digit, another node id, address or error code is another message (with every number
    ignored, kafka2's DNS failure was held back as a repeat of kafka1's)."""
    distinct = [
        "DNS lookup failed for kafka1:9092, gaierror(-2, 'Name or service not known')",
        "DNS lookup failed for kafka2:9092, gaierror(-2, 'Name or service not known')",
        "<KafkaConnection node_id=bootstrap-0 broker_version=unknown (disconnected)>: Connection lost: x",
        "<KafkaConnection node_id=bootstrap-1 broker_version=unknown (disconnected)>: Connection lost: x",
        "Connection failed: KafkaConnectionError: 111 ECONNREFUSED",
        "Connection failed: KafkaConnectionError: 113 EHOSTUNREACH",
        "connect to 10.0.0.1:9092 failed",
        "connect to 10.0.0.2:9092 failed",
        "<KafkaTCPTransport [10.0.0.1:9092<-49300]>: socket disconnected",  # another broker
        "<KafkaTCPTransport [10.0.0.2:9092<-49300]>: socket disconnected",
    ]
    repeats = [
        "Bootstrap connection to bootstrap-1 failed: DNS Resolution failure (backoff 0.48 secs)",
        "Bootstrap connection to bootstrap-1 failed: DNS Resolution failure (backoff 27.92 secs)",
        "Bootstrap bootstrap-1 not ready; waiting 0.09 secs",
        "Bootstrap bootstrap-1 not ready; waiting 20.49 secs",
        "<KafkaConnection node_id=1>: Produce throttled by broker (100 ms)",
        "<KafkaConnection node_id=1>: Produce throttled by broker (2500 ms)",
        # a broker that closes each connection (a wrong SASL password): a new local port each try
        "<KafkaTCPTransport [127.0.0.1:26540<-49300]>: socket disconnected",
        "<KafkaTCPTransport [127.0.0.1:26540<-57392]>: socket disconnected",
    ]
    [out] = _repeats_run([("kafka.net.inet", t) for t in distinct + repeats])
    assert out == [f"kafka.net.inet {t}" for t in distinct + repeats[::2]]


def test_one_repeats_filter_on_two_handlers_shows_each_record_on_both() -> None:
    """main() puts the same filter on every root handler: the second handler dropped each
    kafka record the first had shown (it judged it a repeat of itself)."""
    text = "DNS lookup failed for kafka:9092"
    a, b = _repeats_run([("kafka.net.inet", text), ("kafka.net.inet", text)], handlers=2)
    assert a == b == [f"kafka.net.inet {text}"]


def test_only_the_named_libraries_loggers_are_held_back() -> None:
    """``kafka`` names kafka-python's loggers (``kafka``, ``kafka.*``), not every logger whose
    name begins with those letters."""
    records = [("kafkaesque.client", "retrying"), ("kafkaesque.client", "retrying")]
    assert _repeats_run(records) == [["kafkaesque.client retrying"] * 2]


@pytest.mark.parametrize("source", ["sim", "nvml", "dcgm", "slurm-events", "k8s-events"])
@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--node", "n" * 257, "at most 256"),
        ("--cluster", "c" * 257, "at most 256"),
        ("--cluster", "", "at least 1"),
        ("--pool", "p" * 257, "at most 256"),
    ],
)
def test_agent_names_the_wire_refuses_are_refused_at_start(
    source: str, flag: str, value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name the agent puts on every message, which the wire would refuse on every tick after
    a clean start (a --node of 300 characters), is refused before anything starts: exit 2."""
    assert main(["agent", "--source", source, flag, value]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"gpuslo agent: {flag}: " in err and why in err and "Traceback" not in err
    ok = main(["agent", "--source", "sim", flag, value[:256] or "c", "--hours", "0.01", "--out", os.devnull])
    # the simulated fleet takes a --cluster; it names its own nodes and pools (refused, not ignored)
    assert ok == (EXIT_OK if flag == "--cluster" else EXIT_ERROR)


#: a value other than the default for each agent flag (the sweeps below derive the flags from the
#: parser: one added without a value here, or without a row in flag_rules.AGENT, fails them)
_OTHER_VALUE: dict[str, list[str]] = {
    "--out": ["/tmp/out.jsonl"], "--kafka": ["kafka:9092"], "--config": ["/etc/gpuslo/service.yaml"],
    "--spool-dir": ["/tmp/spool"], "--flush-timeout-s": ["5"], "--cluster": ["prod"], "--interval-s": ["30"],
    "--realtime": [], "--ticks": ["3"], "--once": [], "--print": [],
    "--node": ["gpu01"], "--pool": ["a100"], "--pool-label": ["pool"], "--slurm": [],
    "--slurm-gres-conf": ["/etc/slurm/gres.conf"], "--slurm-refresh-s": ["30"],
    "--hpc-job-mapping-dir": ["/run/hpc"], "--k8s-pod-resources": [], "--k8s-resource-slices": [],
    "--no-k8s-dra": [], "--dra-gpu-class": ["gpu.example.com"], "--proc-root": ["/host/proc"],
    "--pod-log-dir": ["/host/pods"], "--state-file": ["/tmp/state.json"], "--kueue": [],
    "--k8s-api": ["https://k8s:6443"], "--k8s-token-file": ["/tmp/token"], "--k8s-ca-file": ["/tmp/ca"],
    "--dcgm-url": ["http://dcgm:9400/metrics"], "--dcgm-mig-slices": ["4"],
    "--latency": ["http://svc/metrics=chat"], "--metrics-port": ["9500"], "--dcgm-names": ["dcgm47"],
    "--metrics-addr": ["0.0.0.0"],
    "--nodes": ["2"], "--gpus": ["4"], "--hours": ["2"], "--seed": ["7"], "--start": ["2026-01-01"],
}  # fmt: skip

_AGENT_SOURCES = ["sim", "nvml", "dcgm", "latency", "slurm-events", "k8s-events"]


def _agent_parser() -> argparse.ArgumentParser:
    from gpuslo.app.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["agent"]  # type: ignore[no-any-return]


def _refusals(argv: list[str]) -> list[str]:
    """What the agent's check says of ``gpuslo agent ARGV`` (nothing run)."""
    from gpuslo.app.cli import build_parser
    from gpuslo.app.flag_rules import AGENT as RULES
    from gpuslo.app.flag_rules import refusals, typed

    a = build_parser().parse_args(["agent", *argv])
    return refusals(a.source, typed(build_parser(), ["agent", *argv], ("agent",), RULES))


def test_every_agent_flag_has_a_rule_and_a_value_in_the_sweeps() -> None:
    from gpuslo.app.flag_rules import AGENT as RULES

    flags = {o.option_strings[0] for o in _agent_parser()._actions if o.option_strings}
    flags -= {"-h", "-v", "--source"}  # help, the common --verbose, and the choice itself
    assert flags == set(RULES) == set(_OTHER_VALUE), (flags ^ set(RULES)) | (flags ^ set(_OTHER_VALUE))
    for flag, rule in RULES.items():
        assert set(rule.sources) <= set(_AGENT_SOURCES) and rule.sources, flag
        # a not_with may name a flag with its "off" value: "--metrics-port 0"
        # a not_with may name a flag with its "off" value ("--metrics-port 0"), or flags given together ("A+B")
        parts = {p.split(" ")[0] for f in rule.not_with for p in f.split("+")}
        assert set(rule.needs) | set(rule.unless) | parts <= set(RULES), flag
        assert bool(rule.why) == bool(rule.needs or rule.not_with), (
            flag
        )  # a refusal by them says what it does
        for clash, on in rule.not_with_on.items():  # a clash on some of the sources that read it
            assert clash in rule.not_with and on and set(on) < set(rule.sources), flag


@pytest.mark.parametrize("flag", sorted(_OTHER_VALUE))
def test_a_flag_the_chosen_source_would_ignore_is_refused(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpuslo agent --node gpu01 --slurm --kafka ...`` without ``--source`` ran the simulated fleet
    (the default source) into that Kafka, exit 0, every node flag ignored; ``--source nvml --hours
    2`` ignored the hours; ``--source slurm-events --dcgm-url ...`` scraped nothing. Each flag given
    to a source that does not read it is refused, naming itself and the sources that do: exit 2,
    before anything starts (here through main(), as a user meets it)."""
    from gpuslo.app.flag_rules import AGENT as RULES

    rule = RULES[flag]
    for source in _AGENT_SOURCES:
        if source in rule.sources:
            continue
        assert main(["agent", "--source", source, flag, *_OTHER_VALUE[flag]]) == EXIT_ERROR, source
        err = capsys.readouterr().err
        assert err.startswith(f"gpuslo agent: {flag}: for "), err
        assert f"--source {source}" in err and "would ignore it" in err and "Traceback" not in err, err
        assert all(f" {s}" in err.split(";")[0] for s in rule.sources), err


@pytest.mark.parametrize("flag", sorted(_OTHER_VALUE))
def test_a_flag_without_what_it_needs_or_with_what_rules_it_out_is_refused(flag: str) -> None:
    """Every source that reads a flag: alone it is taken, unless it needs another flag (then it is
    refused, and taken with each of those); with a flag that makes it mean nothing it is refused."""
    from gpuslo.app.flag_rules import AGENT as RULES

    rule = RULES[flag]
    for source in rule.sources:
        argv = ["--source", source, flag, *_OTHER_VALUE[flag]]
        alone = [w for w in _refusals(argv) if w.startswith(f"{flag} ")]
        if rule.needs and source in (rule.needs_on or (source,)):
            assert len(alone) == 1 and "is read only with" in alone[0], (source, alone)
            for need in rule.needs:
                words = [w for w in _refusals([*argv, need, *_OTHER_VALUE[need]]) if w.startswith(f"{flag} ")]
                assert words == [], (source, need, words)
        else:
            assert alone == [], (source, alone)
        for clash in rule.not_with:
            on = rule.not_with_on.get(clash, _AGENT_SOURCES)  # the sources it clashes on
            given: list[str] = []
            for part in clash.split("+"):  # flags given together
                other, _, off = part.partition(" ")  # a flag, or one with its "off" value (--metrics-port 0)
                if source not in RULES[other].sources:
                    break
                given += [other, *(shlex.split(off) if off else _OTHER_VALUE[other])]
            else:
                if source not in on:
                    continue
                needs = [n for n in rule.needs if source in (rule.needs_on or (source,))][:1]
                more = [w for n in needs for w in (n, *_OTHER_VALUE[n])]
                words = _refusals([*argv, *more, *given])
                said = clash.replace("+", " and ")
                assert f"{flag} ({rule.why}) would be ignored with {said}: give one of them" in words, words


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        # found ignored: each ran, exit 0, doing something other than asked
        (["--source", "slurm-events", "--dcgm-url", "http://dcgm:9400/metrics"], ["--dcgm-url"]),
        (["--source", "nvml", "--kueue"], ["--kueue"]),
        # (--latency is read there: only --once, which latency does not read, would be ignored)
        (["--source", "latency", "--once", "--latency", "http://v/metrics=chat"], ["--once"]),
        (["--source", "sim", "--once", "--print"], ["--once", "--print"]),
        (["--hours", "0.1", "--ticks", "5"], ["--ticks"]),
        (["--config", "service.yaml"], ["--config"]),
        (["--kafka", "k:9092", "--out", "o.jsonl"], ["--out"]),
        (["--source", "nvml", "--once", "--kafka", "k:9092"], ["--kafka"]),
        (["--source", "nvml", "--k8s-resource-slices"], ["--k8s-resource-slices"]),
        (["--source", "dcgm", "--hpc-job-mapping-dir", "/run/hpc"], ["--hpc-job-mapping-dir"]),
        (["--source", "k8s-events", "--k8s-ca-file", "ca.pem"], ["--k8s-ca-file"]),
        (["--source", "k8s-events", "--no-k8s-dra", "--dra-gpu-class", "x"], ["--dra-gpu-class"]),
        (["--source", "nvml", "--slurm", "--pool", "a", "--pool-label", "p"], ["--pool-label"]),
        (["--source", "nvml", "--hpc-job-mapping-dir", "/run/hpc", "--k8s-pod-resources", "--pool", "p"],
         ["--k8s-pod-resources"]),
        # typed with its default value, abbreviated, or as --flag=value: as ignored as any
        (["--source", "slurm-events", "--dcgm-url", "http://localhost:9400/metrics"], ["--dcgm-url"]),
        (["--source", "nvml", "--nodes", "4"], ["--nodes"]),
        (["--metrics-port", "9400", "--hours", "0.1"], ["--metrics-port"]),
        (["--source", "k8s-events", "--dcgm-u=http://localhost:9400/metrics"], ["--dcgm-url"]),
        # taken: each is read
        (["--source", "dcgm", "--latency", "http://v/metrics=chat", "--slurm", "--node", "n"], []),
        (["--source", "nvml", "--once", "--print", "--metrics-port", "0"], []),  # port 0: /metrics off
        (["--source", "nvml", "--slurm", "--slurm-gres-conf", "g", "--proc-root", ""], []),
        (["--source", "nvml", "--hpc-job-mapping-dir", "/run/hpc", "--k8s-pod-resources"], []),  # the Node's pool
        # found ignored: with the HPC job mapping squeue's gres IDX are not read; with Slurm's jobs
        # and pool the kubelet's and the API server's are not
        (["--source", "nvml", "--hpc-job-mapping-dir", "/run/hpc", "--slurm-gres-conf", "g"], ["--slurm-gres-conf"]),
        (["--source", "nvml", "--slurm", "--hpc-job-mapping-dir", "/h", "--slurm-gres-conf", "g"], ["--slurm-gres-conf"]),
        (["--source", "nvml", "--k8s-pod-resources", "--k8s-resource-slices", "--hpc-job-mapping-dir", "/h"],
         ["--k8s-resource-slices"]),
        (["--source", "nvml", "--k8s-pod-resources", "--k8s-resource-slices", "--slurm"],
         ["--k8s-pod-resources", "--k8s-resource-slices"]),
        (["--source", "dcgm", "--slurm", "--k8s-pod-resources"], ["--k8s-pod-resources"]),
        # found ignored: dcgm reads PodResources' flag for the Node's pool only, which --pool replaces
        (["--source", "dcgm", "--pool", "a", "--k8s-pod-resources"], ["--k8s-pod-resources"]),
        (["--source", "nvml", "--pool", "a", "--k8s-pod-resources"], []),  # nvml: the pods of its GPUs
        (["--source", "nvml", "--slurm", "--k8s-api", "https://k:6443"], ["--k8s-api"]),
        (["--source", "k8s-events", "--slurm", "--k8s-api", "https://k:6443"], ["--slurm"]),  # read there
        # found ignored: with --pool the Node's pool label is not read, the API server only for DRA
        (["--source", "nvml", "--pool", "a", "--k8s-api", "https://k:6443", "--k8s-token-file", "t"], ["--k8s-api"]),
        (["--source", "dcgm", "--pool", "a", "--k8s-api", "https://k:6443"], ["--k8s-api"]),
        (["--source", "nvml", "--pool", "a", "--k8s-api", "https://k", "--k8s-pod-resources", "--k8s-resource-slices"],
         []),
        (["--source", "nvml", "--k8s-api", "https://k:6443", "--pool-label", "p"], []),  # the Node's pool
        # found ignored: what --metrics-port 0 (no /metrics) and --proc-root '' (no split) turn off
        (["--source", "nvml", "--metrics-port", "0", "--metrics-addr", "0.0.0.0"], ["--metrics-addr"]),
        (["--source", "k8s-events", "--metrics-port", "0", "--metrics-addr", "0.0.0.0"], ["--metrics-addr"]),
        (["--source", "dcgm", "--metrics-port", "0", "--dcgm-names", "classic"], ["--dcgm-names"]),
        (["--source", "nvml", "--k8s-pod-resources", "--proc-root", "", "--pod-log-dir", "/x"], ["--pod-log-dir"]),
        (["--source", "dcgm", "--proc-root", ""], []),  # off: asks for nothing, as --metrics-port 0
        # off: --pool '' is the scheduler's pool, as without it (--k8s-api and --pool-label read it)
        (["--source", "dcgm", "--pool", "", "--k8s-api", "https://k:6443"], []),
        (["--source", "nvml", "--k8s-pod-resources", "--pool", "", "--pool-label", "p"], []),
        # found ignored: with a Slurm attribution the split's holders are jobs, never pods
        (["--source", "nvml", "--hpc-job-mapping-dir", "/h", "--k8s-pod-resources", "--pod-log-dir", "/x"],
         ["--pod-log-dir"]),
        (["--source", "sim", "--metrics-port", "0", "--proc-root", ""], []),
        (["--source", "k8s-events", "--kueue", "--k8s-api", "https://k:6443", "--k8s-ca-file", "ca.pem"], []),
        (["--realtime", "--ticks", "2", "--hours", "1", "--kafka", "-", "--config", "s.yaml"], []),
    ],
)  # fmt: skip
def test_the_agent_flags_found_ignored_are_refused_and_those_read_are_taken(
    argv: list[str], refused: list[str]
) -> None:
    """Written out, not derived from flag_rules.AGENT: the runs found doing something other than
    asked, and runs that read every flag they are given."""
    assert [w.split(" ")[0].rstrip(":") for w in _refusals(argv)] == refused


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--source", "dcgm", "--proc-root", "/host/proc"], "--proc-root: for --source nvml only; --source dcgm would ignore it"),
        (["--source", "latency", "--latency", "http://v/metrics=chat", "--pool", "a"], "--pool: for --source nvml or dcgm only; --source latency would ignore it"),
        (["--source", "slurm-events", "--kueue"], "--kueue: for --source k8s-events only; --source slurm-events would ignore it"),
    ],
)  # fmt: skip
def test_a_flag_of_another_source_of_the_same_kind_is_refused_without_contradiction(
    argv: list[str], said: str
) -> None:
    """``--source dcgm --proc-root ...`` was refused as "for an agent on a node (--source nvml) only;
    --source dcgm is an agent on a node and would ignore it": the sources named, not their kind."""
    assert _refusals(argv) == [said]


@pytest.mark.parametrize("clash", [["--pool", "a"], ["--slurm"]])
def test_a_dcgm_refusal_of_k8s_pod_resources_says_what_it_does_there(clash: list[str]) -> None:
    """``--source dcgm --k8s-pod-resources --pool a`` was refused as "(attributes GPUs to pods, reads
    the Node's pool)": dcgm-exporter attributes the pods, the flag there reads the pool only."""
    (said,) = _refusals(["--source", "dcgm", "--k8s-pod-resources", *clash])
    assert said == (
        "--k8s-pod-resources (nvml: attributes GPUs to pods; nvml, dcgm: reads the Node's pool) would be "
        f"ignored with {clash[0]}: give one of them"
    )


def test_a_dcgm_refusal_of_k8s_api_names_resource_slices_as_nvmls() -> None:
    """``--source dcgm --pool a --k8s-api URL`` said --k8s-api "reads the Node's pool label and
    ResourceSlices": dcgm never reads ResourceSlices (nvml with --k8s-resource-slices does)."""
    assert _refusals(["--source", "dcgm", "--pool", "a", "--k8s-api", "https://k:6443"]) == [
        "--k8s-api (reads the Node's pool label; nvml with --k8s-resource-slices: its ResourceSlices) would be "
        "ignored with --pool: give one of them"
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["agent", "--kafka", "-", "--hours", "0.01"],
        ["agent", "--source", "slurm-events", "--kafka", "-", "--spool-dir", "/tmp/spool"],
        ["ingest", "--kafka", "-"],
    ],
)
def test_kafka_dash_without_a_config_is_refused(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--kafka -`` (the config's bootstrap servers) without ``--config`` took the defaults'
    localhost:9092: ``agent --kafka -`` spooled for it and exited 1. Refused, exit 2, nothing started."""
    import gpuslo.agent.assemble as assemble
    import gpuslo.app.cli as cli

    def reached(*args: object, **kw: object) -> None:
        raise AssertionError("Kafka reached")

    monkeypatch.setattr(assemble, "kafka_sink", reached)
    monkeypatch.setattr(cli, "_agent_cluster_events", reached)
    monkeypatch.setattr("gpuslo.ingest.connect.open_when_ready", reached)
    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"gpuslo {argv[0]}: --kafka - takes the bootstrap servers from --config" in err, err


def test_realtime_hours_given_as_the_default_value_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """``agent --realtime --hours 1`` ran a month: an hours value equal to the default was taken
    as not given. Given, it is taken; not given, a realtime fleet runs a month, a fast one an hour."""
    import gpuslo.agent.sim.run as run

    seen: list[float] = []
    monkeypatch.setattr(run, "run_fleet_realtime", lambda sim, sink, stop, ticks: seen.append(sim.hours))
    monkeypatch.setattr(run, "run_fleet", lambda sim, sink: seen.append(sim.hours))
    for argv in (["--realtime", "--hours", "1"], ["--realtime"], [], ["--hours", "720"]):
        assert main(["agent", *argv, "--out", os.devnull]) == EXIT_OK
    assert seen == [1.0, 720.0, 1.0, 720.0]


@pytest.mark.parametrize(
    "argv",
    [
        ["chargeback", "--from", "1", "--to", "2", "--csv", ""],
        ["job", "1", "--html", ""],
        ["rules", "eval", "--from", "1", "--to", "2", "--config", ""],
        ["rules", "eval", "--from", "1", "--to", "2", "--store", ""],
        ["report", "--from", "1", "--to", "2", "--out", ""],
        ["ingest", "--file", ""],
        ["demo", "--out", ""],
        ["rules", "export-prometheus", "--out", ""],
        ["dashboards", "generate", "--out", ""],
    ],
)
def test_an_empty_path_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A path option given empty (a shell variable unset) is a usage error, not the option
    left out: --config "" read the shipped example, --csv "" wrote nothing with exit 0."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == EXIT_ERROR and "an empty path" in capsys.readouterr().err


def test_a_cluster_the_store_does_not_hold_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --cluster gave an empty fleet, an all-zero bill, with exit 0: the store says it
    holds no such cluster and names those it holds; a cluster it holds runs as before."""
    from tests import helpers as h

    store_dir = tmp_path / "store"
    f = tmp_path / "in.jsonl"
    _write_lines(f, [encode(h.batch("n1", h.T0, [h.gpu(0, 0.5)]))])
    assert main(["ingest", "--file", str(f), "--store", str(store_dir)]) == EXIT_OK
    capsys.readouterr()
    window = ["--store", str(store_dir), "--from", str(h.T0 - 3600), "--to", str(h.T0 + 3600)]
    for cmd in (
        ["rules", "eval"],
        ["chargeback"],
        ["rightsize"],
        ["whatif"],
        ["report", "--out", str(tmp_path / "r.html")],
    ):
        assert main([*cmd, *window, "--cluster", "prod-typo"]) == EXIT_ERROR, cmd
        err = capsys.readouterr().err
        assert "no data of --cluster 'prod-typo' in the store (its clusters: " in err, err
    assert main(["rules", "eval", *window, "--cluster", h.batch("n1", h.T0, []).cluster]) == EXIT_OK


@pytest.mark.parametrize(
    "argv",
    [
        ["ingest", "--file", "x", "--store", ""],
        ["agent", "--source", "slurm-events", "--state-file", ""],
        ["agent", "--spool-dir", ""],
        ["agent", "--source", "k8s-events", "--k8s-api", "https://h", "--k8s-token-file", ""],
        ["agent", "--pod-log-dir", ""],
        ["rules", "run", "--alertmanager-url-file", ""],
    ],
)
def test_every_path_option_refuses_an_empty_path(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The options the first sweep missed (written over several lines): --store "" of the ingest
    scattered chDB's directories into the current one; --k8s-token-file "" dropped the token."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == EXIT_ERROR and "an empty path" in capsys.readouterr().err


def test_no_path_option_is_left_without_its_check() -> None:
    """Every option named like a path or a file (``--*-file``, ``--*-dir``, ``--store``, ``--out``...)
    takes ``path_arg``, whatever the layout of its declaration."""
    from gpuslo.app.argtypes import path_arg
    from tests.helpers import cli_actions

    pathy = ("--store", "--out", "--html", "--csv", "--config", "--service-config", "--file", "--state-file")
    missed = sorted(
        {o for act in cli_actions() for o in act.option_strings
         if (o in pathy or o.endswith(("-file", "-dir"))) and act.type is not path_arg}
    )  # fmt: skip
    assert missed == [], missed


@pytest.mark.parametrize(
    "argv",
    [
        ["agent", "--kafka", ""],
        ["agent", "--node", ""],
        ["agent", "--metrics-addr", ""],
        ["agent", "--source", "nvml", "--k8s-pod-resources", ""],
        ["ingest", "--kafka", ""],
        ["ingest", "--clickhouse", ""],
        ["ingest", "--group", ""],
        ["ingest", "--metrics-addr", ""],
        ["report", "--clickhouse", ""],
        ["rules", "run", "--outbox", ""],
    ],
)
def test_an_empty_value_is_refused_not_read_as_the_flag_not_given(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--kafka "$KAFKA"`` with the variable unset ran the agent writing JSON lines to stdout
    instead of sending to Kafka; ``--clickhouse ""`` wrote into a local chDB store instead of the
    server; ``--group ""`` consumed as the default group; ``--metrics-addr ""`` served on every
    interface."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == EXIT_ERROR and "an empty" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [["demo"], ["agent", "--source", "sim"]])
def test_a_simulated_fleets_cluster_is_checked_as_the_wire_checks_it(
    cmd: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo --cluster ""`` made every batch one the wire refuses: a traceback per node, nothing
    ingested, exit 0."""
    for bad in ("", "x" * 300):
        assert main([*cmd, "--cluster", bad, "--hours", "0.01"]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert "--cluster" in err and "Traceback" not in err, err


def test_no_text_option_reads_an_empty_value_as_absent() -> None:
    """Every option taking free text either refuses an empty value (``text_arg``, ``path_arg``)
    or is one where empty says something the help names (every cluster; the scheduler's pool;
    the process split off)."""
    from tests.helpers import cli_actions

    meaningful_empty = {"--cluster", "--pool", "--proc-root", "--gpu-model", "--source"}
    raw = sorted(
        {o for act in cli_actions() for o in act.option_strings
         if type(act).__name__ == "_StoreAction" and act.type is None and act.choices is None
         and o.startswith("--") and o not in meaningful_empty}
    )  # fmt: skip
    assert raw == [], raw


def test_a_window_with_no_data_is_said_not_answered_as_an_idle_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A window with no row in it (a year mistyped, a month before the fleet reported) was
    answered as an idle fleet: a bill of 0.00, CUR "-", exit 0. Swept across the data's edges:
    a window is refused exactly when no row lies in it or stands for part of it (a sample stands
    for the time after it until it is 2 x its interval old: 10 s here), and the message says
    where the data is."""
    from gpuslo.rules.sql import SNAP_LOOKBACK_S

    store_dir = tmp_path / "store"
    f = tmp_path / "in.jsonl"
    stamps = [h.T0, h.T0 + 600.0]
    _write_lines(f, [encode(h.batch("n1", t, [h.gpu(0, 0.5)])) for t in stamps])
    assert main(["ingest", "--file", str(f), "--store", str(store_dir)]) == EXIT_OK
    capsys.readouterr()
    cmds = (
        ["rules", "eval"],
        ["chargeback"],
        ["rightsize"],
        ["whatif"],
        ["report", "--out", str(tmp_path / "r.html")],
    )
    edges = [
        h.T0 - SNAP_LOOKBACK_S - 7200, h.T0 - 3600, h.T0 - 1, h.T0, h.T0 + 19, h.T0 + 20, h.T0 + 600,
        h.T0 + 601, h.T0 + 619.999, h.T0 + 620, h.T0 + SNAP_LOOKBACK_S, h.T0 + 600 + SNAP_LOOKBACK_S,
    ]  # fmt: skip
    from gpuslo.app.cli import _empty_window

    swept = ChdbStore(store_dir)  # the rule over the edges, read as the commands read it
    try:
        for frm in edges:
            for to in (frm + 1, frm + 3600):
                empty = not any(frm - 2 * 10.0 < t < to for t in stamps)
                said = _empty_window(swept, frm, to, "")
                assert (said is not None) == empty, (frm - h.T0, to - h.T0, said)
                assert _empty_window(swept, frm, to, "other") is not None  # --cluster narrows it
    finally:
        swept.close()
    # each command says it, and answers a window with data (the bill: exit 1, a model unpriced)
    for frm, to, empty in ((edges[0], edges[0] + 3600, True), (h.T0, h.T0 + 1, False)):
        for cmd in cmds:
            rc = main([*cmd, "--store", str(store_dir), "--from", str(frm), "--to", str(to)])
            err = capsys.readouterr().err
            assert (rc == EXIT_ERROR, "no data in the window" in err) == (empty, empty), (
                cmd,
                frm - h.T0,
                err,
            )
            if empty:
                assert "its GPU samples run from" in err, err


@pytest.mark.parametrize("interval", [1.0, 10.0, 3600.0, 86_400.0])
def test_a_window_after_the_fleet_stopped_is_refused_once_its_last_samples_stand_for_nothing(
    store: ChdbStore, interval: float
) -> None:
    """A sample stands for the time after it until it is 2 x its interval old (the snapshot's
    rule; the rollups mark those minutes), and for the GPU capacity the bill, the right-sizing
    and the replay read, for its interval: a window a day after a 10 s fleet stopped was not
    refused (any row up to 2 days before it counted, whatever its interval) and was answered as
    an idle fleet, a bill of 0.00, and so was one just past the last sample's interval. Swept
    across the last sample's edges for several intervals, the raw samples and, once they are
    gone, the minute rollups that outlive them."""
    from gpuslo.app.cli import _empty_window
    from gpuslo.ingest.writer import write
    from gpuslo.rules import rollup

    stamps = [T0, T0 + interval]
    write(store, [h.batch("n1", t, [h.gpu(0, 0.5)], interval_s=interval) for t in stamps])
    last = stamps[-1]
    starts = [T0 - 1, T0 + interval / 2, *(last + k * interval + d for k in (1, 2) for d in (-1, -0.001, 0, 1)),
              last + 3 * interval, T0 + 2 * 86_400]  # fmt: skip
    spans = {"rules eval": 2, "report": 2, "chargeback": 1, "rightsize": 1, "whatif": 1}  # x the interval
    for frm in starts:
        for to in (frm + 1, frm + 3600):
            for prog, k in spans.items():
                held = any(t < to and t + k * interval > frm for t in stamps)
                said = _empty_window(store, frm, to, "", prog)
                assert (said is None) == held, (interval, frm - last, to - frm, prog, said)
    rollup.refresh(store)
    store.execute("DELETE FROM gpu_samples WHERE 1")  # the raw retention passed; the rollups stay

    def minutes(k: int) -> set[int]:  # the minutes the samples' k intervals reach
        return {m for t in stamps for m in range(int(t // 60 * 60), int(t + k * interval), 60)}

    for frm in starts:
        for to in (frm + 1, frm + 3600):
            for prog, k in (("rules eval", 2), ("chargeback", 1)):
                rolled = any(m < to and m + 60 > frm for m in minutes(k))  # a minute stands for itself
                assert (_empty_window(store, frm, to, "", prog) is None) == rolled, (
                    prog,
                    frm - last,
                    to - frm,
                )
            assert _empty_window(store, frm, to, "", "rightsize") is not None  # it reads raw samples only


@pytest.mark.parametrize(
    ("rows", "answered"),
    [
        ("latency", {"rules eval", "report"}),  # a scraper's rows: the SLOs, no GPU
        ("sched", {"rules eval", "report", "whatif"}),  # a scheduler's events: its queue
        ("heartbeat", {"rules eval", "report"}),
        ("gpu", {"rules eval", "report", "chargeback", "rightsize", "whatif"}),
    ],
)
def test_a_window_of_rows_a_command_does_not_read_is_refused_by_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: str, answered: set[str]
) -> None:
    """A window holding only a scraper's latency rows, or a scheduler's events, was billed
    0.00 by chargeback (exit 0) and said 0 of 0 jobs by rightsize: each command refuses a
    window with no row of the tables it answers from, and answers one with them."""
    from gpuslo.app.cli import _empty_window
    from gpuslo.ingest.writer import write

    msgs = {
        "latency": [h.latency(T0 + 60, 10, 1)],
        "sched": [h.sched("submit", "1", T0 + 60)],
        "heartbeat": [h.heartbeat("n1", T0 + 60, True)],
        "gpu": [h.batch("n1", T0 + 60, [h.gpu(0, 0.5, (("j", 1.0),))])],
    }[rows]
    s = ChdbStore(tmp_path / "store")
    try:
        from gpuslo.rules.tables import SCHEMA

        s.migrate(SCHEMA)
        write(s, msgs)
        for prog in ("rules eval", "report", "chargeback", "rightsize", "whatif"):
            said = _empty_window(s, T0, T0 + 3600, "", prog)
            assert (said is None) == (prog in answered), (prog, said)
    finally:
        s.close()
    # the command line says it (exit 2), no bill of 0.00 printed
    if "chargeback" not in answered:
        rc = main(
            ["chargeback", "--store", str(tmp_path / "store"), "--from", str(T0), "--to", str(T0 + 3600)]
        )
        out, err = capsys.readouterr()
        assert (rc, out) == (EXIT_ERROR, ""), (out, err)
        assert "no data in the window" in err and "it holds no GPU samples" in err, err


# host names the resolver refuses to encode (socket encodes a str host as IDNA): an empty
# label, one over 63 characters, a lone surrogate
UNENCODABLE_HOSTS = ["a..b", ".", ".x", "a" * 64, "x." + "a" * 64, "é..x", "\udcff"]


@pytest.mark.parametrize("host", UNENCODABLE_HOSTS)
def test_a_host_name_no_resolver_reads_is_refused_by_every_option_naming_a_host(
    host: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host name socket cannot encode was taken: ``--metrics-addr a..b`` was a UnicodeError
    traceback at the bind, ``--kafka a..b:9092`` retried its bootstrap for 30 s and then was one
    (the failure explanation's probe), ``--dcgm-url http://a..b/`` a failed scrape at each tick,
    exit 0. Each option and config key naming a host refuses it before any connect."""
    import socket

    with pytest.raises(UnicodeError):  # the oracle: the resolver's own encoding refuses it
        socket.getaddrinfo(host, 9092)
    store, url = str(tmp_path / "s"), f"http://{host}:9400/metrics"
    win = ["--from", str(T0), "--to", str(T0 + 60)]
    argvs = [
        ["ingest", "--kafka", f"{host}:9092", "--store", store],
        ["agent", "--source", "sim", "--kafka", f"{host}:9092", "--hours", "0.01"],
        ["rules", "eval", "--clickhouse", f"{host}:9000", *win],
        ["agent", "--source", "dcgm", "--dcgm-url", url, "--once"],
        ["agent", "--source", "latency", "--latency", f"{url}=svc", "--ticks", "1"],
        ["agent", "--source", "slurm-events", "--metrics-port", "19411", "--metrics-addr", host],
        ["ingest", "--file", "-", "--metrics-addr", host, "--store", store],
    ]
    if host.isprintable():  # a lone surrogate is no UTF-8 a file could hold
        for key, value in (
            ("kafka", {"bootstrap_servers": [f"{host}:9092"]}),
            ("clickhouse", {"host": host}),
        ):
            conf = tmp_path / f"{key}.yaml"
            conf.write_text(json.dumps({key: value}), encoding="utf-8")
            argvs.append(["ingest", "--kafka", "-", "--config", str(conf), "--store", store])
            argvs.append(["rules", "eval", "--service-config", str(conf), *win])
    for argv in argvs:
        try:
            code: int | str | None = main(argv)
        except SystemExit as exc:
            code = exc.code
        said = code if isinstance(code, str) else capsys.readouterr().err
        assert code not in (0, None) and said, argv
        assert "Traceback" not in said and "UnicodeError" not in said, (argv, said)
        # the host refused, not a flag the run ignores (--ticks without --realtime was, first)
        assert "would be ignored" not in said and "would ignore it" not in said, (argv, said)
    from gpuslo.rules.receivers import Receiver, ReceiverError

    for kind in ("alertmanager", "webhook"):  # rules run's receivers: each delivery failed, retried
        with pytest.raises(ReceiverError, match="no name a resolver reads"):
            Receiver.parse(kind, f"http://{host}:9093/")
    # a name the resolver encodes (an IDNA one, an underscore, a trailing dot) is taken
    from gpuslo.app.argtypes import bind_addr, http_url
    from gpuslo.core.settings import host_port

    for ok in ("bücher.example", "xn--bcher-kva.example", "my_host", "h.", "::1"):
        assert host_port(f"[{ok}]:9" if ":" in ok else f"{ok}:9")[0] == ok
        assert bind_addr(ok) == ok
        http_url(f"http://[{ok}]/" if ":" in ok else f"http://{ok}/")
        assert Receiver.parse("alertmanager", f"http://[{ok}]/" if ":" in ok else f"http://{ok}/").host == ok


@pytest.mark.parametrize(
    ("key", "taken"),
    [("", False), (" ", False), ("gke nodepool", False), ("/x", False), ("x/", False), ("-a", False),
     ("a-", False), ("a" * 64, False), ("a/b/c", False), ("Example.com/x", False), ("a..b/x", False),
     ("x/" + "a" * 64, False), ("a" * 254 + "/x", False), ("a" * 63, True), ("agentpool", True),
     ("cloud.google.com/gke-nodepool", True), ("karpenter.sh/nodepool", True), ("kubernetes.io/os", True),
     ("a_b.c-D", True), ("a" * 253 + "/x", True), ("x/A.b_c", True)],
)  # fmt: skip
def test_a_pool_label_no_node_can_carry_is_refused(
    key: str, taken: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--pool-label "$VAR"`` with the variable unset (or a key with a space, a name over 63
    characters) replaced the default keys and was looked up on every Node in vain, the pool left
    empty, exit 0: a key Kubernetes would not take (apimachinery's qualified name, as its docs
    give it) is a usage error."""
    from gpuslo.app.cli import build_parser

    argv = ["agent", "--source", "dcgm", f"--pool-label={key}"]
    if taken:
        assert build_parser().parse_args(argv).pool_label == [key]
        return
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(argv)
    assert ei.value.code == EXIT_ERROR and "no Kubernetes label key" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "host", "port"),
    [("h", "h", 9000), ("h:9440", "h", 9440), ("[::1]:9001", "::1", 9001), ("[::1]", "::1", 9000),
     ("10.0.0.1:1", "10.0.0.1", 1), ("é.example:65535", "é.example", 65535)],
)  # fmt: skip
def test_clickhouse_flag_names_the_server_as_the_config_file_does(flag: str, host: str, port: int) -> None:
    """--clickhouse is read as host[:port], an IPv6 address in brackets, and reaches the same
    settings as the config file's clickhouse.host (an IPv6 address without brackets, as the driver
    connects to it) and clickhouse.port."""
    from gpuslo.app.cli import _service_config
    from gpuslo.core.settings import ClickHouseSettings

    got = _service_config(argparse.Namespace(clickhouse=flag)).clickhouse
    assert (got.host, got.port) == (host, port)
    assert got == ClickHouseSettings(host=host, port=port)


@pytest.mark.parametrize("host", ["", " ", "\t", "a b", "[::1]", "h\x00", "h/x"])
def test_a_config_file_clickhouse_host_no_driver_can_reach_is_refused_at_load(
    tmp_path: Path, host: str
) -> None:
    """It was taken, and every command's first connect failed as a transient network error: ingest
    stopped, rules run retried it for ever."""
    from gpuslo.core.settings import SettingsError, load

    p = tmp_path / "service.yaml"
    p.write_text(yaml.safe_dump({"clickhouse": {"host": host}}), encoding="utf-8")
    with pytest.raises(SettingsError, match=r"clickhouse\.host"):
        load(p)


# text no name holds: a byte that is not UTF-8 (a Latin-1 terminal's é, kept by Python as a lone
# surrogate), alone and inside a name; one character over the wire's longest name
NOT_UTF8 = ("\udce9", "caf\udce9", "a\udcffb")


def test_every_name_or_value_option_refuses_text_that_is_not_utf8() -> None:
    """Each option or argument taking a name or a value (not a path: a file name is bytes, kept)
    refuses text that is not UTF-8 with its bytes shown: ``--cluster`` and the job id reached
    chDB as "Unable to cast Python instance of type <class 'str'> to C++ type"."""
    from gpuslo.app import argtypes
    from gpuslo.wire.models import NAME_MAX
    from tests.helpers import cli_actions

    assert argtypes.NAME_MAX == NAME_MAX
    names = (argtypes.text_arg, argtypes.name_arg, argtypes.node_arg, argtypes.utf8_text,
             argtypes.bind_addr, argtypes.http_url, argtypes.label_key)  # fmt: skip
    swept = {
        (o or act.dest) for act in cli_actions() if act.type in names for o in act.option_strings or [""]
    }
    assert {
        "--cluster",
        "--node",
        "--pool",
        "--group",
        "--kafka",
        "--clickhouse",
        "--gpu-model",
        "id",
    } <= swept
    for act in cli_actions():
        if act.type in names:
            for v in NOT_UTF8:
                with pytest.raises(
                    argparse.ArgumentTypeError, match=r"not UTF-8 text|no Kubernetes label key"
                ):
                    act.type(v)


WINDOW = ["--from", str(T0), "--to", str(T0 + 600)]


@pytest.mark.parametrize(
    "cmd",
    [
        ["rules", "eval", *WINDOW],
        ["chargeback", *WINDOW],
        ["rightsize", *WINDOW],
        ["whatif", *WINDOW],
        ["report", *WINDOW],
        ["job", "1"],
    ],
)
def test_a_cluster_is_selected_by_its_exact_name(
    cmd: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cluster`` of the store commands: text that is not UTF-8 and a name longer than any the
    wire carries are usage errors (exit 2, the option named, no traceback); any other name is
    taken exactly, white space and control characters included, and one the store does not
    hold is said with the names it does (never an empty answer); '' is every cluster."""
    store_dir = tmp_path / "store"
    f = tmp_path / "in.jsonl"
    odd = " \t"  # a cluster of white space only: the wire carries it, and so it is selected
    lines = [encode(h.batch(f"n{i}", T0, [h.gpu(0, 0.5)], cluster=c)) for i, c in enumerate(("sim", odd))]
    _write_lines(f, lines)
    assert main(["ingest", "--file", str(f), "--store", str(store_dir)]) == EXIT_OK
    capsys.readouterr()
    base = [*cmd, "--store", str(store_dir)] + (
        ["--out", str(tmp_path / "r.html")] if cmd[0] == "report" else []
    )
    for bad in (*NOT_UTF8, "c" * 257):
        with pytest.raises(SystemExit) as ei:
            main([*base, "--cluster", bad])
        assert ei.value.code == EXIT_ERROR
        err = capsys.readouterr().err
        assert "argument --cluster: " in err and "Traceback" not in err, err
    for absent in (" ", "sim ", "si\x01m", "c" * 256):
        assert main([*base, "--cluster", absent]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and repr(absent)[:40] in err, err
    if cmd[0] != "job":  # the job is no job's: its own message
        assert main([*base, "--cluster", odd]) in (EXIT_OK, EXIT_PARTIAL), capsys.readouterr().err
        every = main([*base, "--cluster", ""])  # whatif replays one cluster: it asks for one
        err = capsys.readouterr().err
        assert every in (EXIT_OK, EXIT_PARTIAL) or (
            cmd[0] == "whatif" and "name one with --cluster" in err
        ), err


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (" ", "white space"),
        ("gpu1 ", "white space"),
        ("a\tb", "white space"),
        ("a\x01b", "control"),
        ("a\x85b", "control"),
        ("", "empty"),
        ("n" * 257, "at most 256"),
        ("caf\udce9", "not UTF-8"),
    ],
)
def test_a_node_name_no_scheduler_knows_is_refused(
    value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``agent --node``: the agent asks the scheduler for the node's jobs, pods, pool and
    ResourceSlices by it, and no Slurm NodeName or Kubernetes node name holds white space or a
    control character: ``--node " gpu1"`` found none of them, every GPU unallocated, without a
    word. Refused at start, exit 2, the option named; the longest name is taken."""
    try:
        rc = main(
            ["agent", "--source", "nvml", "--node", value, "--once"]
        )  # the wire's length: checked after
    except SystemExit as exc:  # argparse's own refusal
        rc = exc.code
    assert rc == EXIT_ERROR
    err = capsys.readouterr().err
    assert "--node: " in err and why in err and "Traceback" not in err, err
    from gpuslo.app.argtypes import node_arg

    for ok in ("n" * 256, "gpu-node-01", "gpu1.cluster.local", "节点"):
        assert node_arg(ok) == ok


def test_parse_time_takes_the_iso_and_rfc_3339_forms_at_the_right_instant() -> None:
    """The time syntax's dimension, each against an instant computed by calendar.timegm: RFC
    3339's lower-case t and z (refused), offsets, fractions, a leap second (:60, refused: the
    second after :59, as POSIX counts it), dates whose year is out of range, epoch numbers of
    every odd form, and the range's edges."""
    import calendar
    import math

    def at(*ymdhms: int) -> float:
        return float(calendar.timegm((*ymdhms, 0, 0, 0)))

    for z in ("Z", "z", "+00:00", "-00:00", "+0000", " Z", " z", ""):
        for sep in ("T", "t", " "):
            assert parse_time(f"2026-01-01{sep}00:00:00{z}") == at(2026, 1, 1, 0, 0, 0), (sep, z)
    assert parse_time("2026-01-01z") == parse_time("2026-01-01Z") == at(2026, 1, 1, 0, 0, 0)
    assert parse_time("2026-01-01T05:30:00+05:30") == at(2026, 1, 1, 0, 0, 0)
    assert parse_time("2025-12-31T19:00:00-05:00") == at(2026, 1, 1, 0, 0, 0)
    assert parse_time("2026-01-01T00:00:00.25z") == at(2026, 1, 1, 0, 0, 0) + 0.25
    assert parse_time("2026-01-01T00:00:00,5Z") == at(2026, 1, 1, 0, 0, 0) + 0.5
    for leap in (
        "2016-12-31T23:59:60Z",
        "2016-12-31t23:59:60z",
        "2016-12-31 23:59:60",
        "2017-01-01T05:29:60+05:30",
    ):
        assert parse_time(leap) == at(2017, 1, 1, 0, 0, 0), leap
    assert parse_time("2016-12-31T23:59:60.5Z") == at(2017, 1, 1, 0, 0, 0) + 0.5
    assert parse_time("1970-01-01T05:30:00+05:30") == 0.0
    assert parse_time("2106-01-01T00:00:00z") == 4_291_747_200.0 == parse_time("2105-12-31T23:59:60Z")
    assert (
        parse_time(" 1767225600 ") == parse_time("1767225600.0") == parse_time("1.7672256e9") == 1767225600.0
    )
    refused = {
        "0000-01-01": "year is out of range",
        "10000-01-01T00:00:00Z": "year is out of range",
        "+10000-01-01": "year is out of range",
        "1969-12-31T23:59:59z": "between 1970-01-01 and 2106-01-01",
        "1970-01-01T00:00:00+05:30": "between 1970-01-01 and 2106-01-01",
        "2106-01-01T00:00:00.001Z": "between 1970-01-01 and 2106-01-01",
        "-1": "between", "-1e-9": "between", "4291747200.001": "between", "1e309": "between",
        "1767225600000": "milliseconds?",
        "nan": "between", "NaN": "between", "inf": "between", "-Infinity": "between",
        "2026-01-01T00:00:61Z": "neither", "2026-01-01T00:60:00Z": "neither", "2026-01-01T24:00:01Z": "neither",
        "2026-13-01": "neither", "2026-01-01T00:00:00+25:00": "neither", "": "neither", "now": "neither",
        "yesterday": "neither", "0x10": "neither", "2026-01-01T00:00:00zz": "neither",
    }  # fmt: skip
    for text, why in refused.items():
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_time(text)
    assert math.isfinite(parse_time("0")) and parse_time("0") == 0.0


@pytest.mark.parametrize(
    ("start", "hours", "ok"),
    [
        ("20260101", "1", False),  # epoch seconds: 1970-08-23, before any time the wire takes
        ("0", "1", False),
        ("1999-12-31T23:59:59Z", "1", False),
        ("2000-01-01T00:00:00Z", "0.01", True),
        ("2105-12-31T23:00:00Z", "1", True),  # its last sample at 23:59:50
        ("2105-12-31T23:00:00Z", "1.01", False),
        ("4291740000", "10", False),
    ],
)
@pytest.mark.parametrize("cmd", ["agent", "demo"])
def test_a_simulated_start_is_where_the_wire_takes_times(
    cmd: str, start: str, hours: str, ok: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo --start 20260101`` (1970) ingested nothing and reported an empty fleet, exit 0;
    ``agent --start 0`` and a start whose hours run past 2106 were ValidationError tracebacks."""
    out = ["--out", str(tmp_path / ("d" if cmd == "demo" else "a.jsonl"))] + (
        ["--quiet"] if cmd == "demo" else []
    )
    if ok and cmd == "demo":
        return  # the demo's full run at the edges: covered by the agent's messages the wire takes
    rc = main([cmd, "--start", start, "--hours", hours, "--nodes", "1", "--gpus", "1", *out])
    err = capsys.readouterr().err
    if ok:
        assert rc == EXIT_OK, err
        from gpuslo.wire import decode

        lines = (tmp_path / "a.jsonl").read_bytes().splitlines()
        assert lines and all(decode(x) for x in lines)
    else:
        assert rc == EXIT_ERROR and "the times the wire takes" in err and "Traceback" not in err, err


_HISTOGRAM = b"""# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.005"} 10
vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 12
vllm:e2e_request_latency_seconds_sum 0.1
vllm:e2e_request_latency_seconds_count 12
"""


@pytest.mark.parametrize(
    ("service", "metric", "ok"),
    [
        ("s" * 256, "", True),
        (" ", "", True),  # the wire carries it: an SLO's service names it exactly
        ("s" * 257, "", False),
        ("caf\udce9", "", False),
        ("svc", ":m-x", False),
        ("svc", ":1abc", False),
        ("svc", ":vllm:e2e_request_latency_seconds", True),
    ],
)
def test_a_latency_service_is_checked_as_the_wire_checks_it(
    service: str, metric: str, ok: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--latency URL=SERVICE[:METRIC]``: a service of 300 characters made every scrape a batch
    the wire refuses (a warning, counted, exit 0 and no message sent); a metric no Prometheus
    family can be named never matched. Refused at start, exit 2; the others are scraped."""
    import http.server
    import threading

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(_HISTOGRAM)))
            self.end_headers()
            self.wfile.write(_HISTOGRAM)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    out = tmp_path / "lat.jsonl"
    spec = f"http://127.0.0.1:{srv.server_address[1]}/metrics={service}{metric}"
    try:
        args = ["agent", "--source", "latency", "--node", "n1", "--latency", spec, "--realtime", "--ticks", "2",
                "--interval-s", "0.2", "--metrics-port", "0", "--out", str(out)]  # fmt: skip
        try:
            rc = main(args)
        except SystemExit as exc:  # argparse's refusal (not UTF-8)
            rc = exc.code
    finally:
        srv.shutdown()
        srv.server_close()
    err = capsys.readouterr().err
    if not ok:
        assert rc == EXIT_ERROR and "--latency" in err and "Traceback" not in err, err
        return
    assert rc == EXIT_OK, err
    from gpuslo.wire import decode

    got = [decode(x) for x in out.read_bytes().splitlines()]
    assert got and {getattr(m, "service", None) for m in got} == {service}


def test_docs_agent_md_shows_the_agent_flag_rules_as_they_are() -> None:
    from gpuslo.app.flag_rules import markdown_table

    page = (Path(__file__).resolve().parents[1] / "docs/agent.md").read_text()
    shown = page.split("<!-- agent-flags:begin -->\n", 1)[1].split("\n<!-- agent-flags:end -->", 1)[0]
    assert shown == markdown_table(), (
        "regenerate it: python -c 'from gpuslo.app.flag_rules import markdown_table as m; print(m())'"
    )


def test_a_refusal_says_what_to_give_instead_and_a_default_is_named_as_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--source dcgm --hpc-job-mapping-dir`` did start the node's Slurm heartbeat, as --slurm
    does: its refusal says so. ``--realtime --start 2105-12-31`` blamed an --hours 720 never given."""
    assert main(["agent", "--source", "dcgm", "--hpc-job-mapping-dir", "/run/hpc"]) == EXIT_ERROR
    assert "--slurm gives the node's Slurm state and pool" in capsys.readouterr().err
    assert main(["agent", "--realtime", "--start", "2105-12-31"]) == EXIT_ERROR
    assert "with --hours 720 (the default with --realtime): " in capsys.readouterr().err
    assert main(["agent", "--realtime", "--start", "2105-12-31", "--hours", "720"]) == EXIT_ERROR
    assert "with --hours 720: " in capsys.readouterr().err


@pytest.mark.parametrize("path", [("ingest",), ("rules", "run")])
def test_every_flag_of_a_command_with_a_table_has_a_row(path: tuple[str, ...]) -> None:
    """A flag added to ``ingest`` or ``rules run`` without a row in its table (flag_rules) fails
    here: which runs read it is decided when it is added, not found later."""
    from gpuslo.app.cli import build_parser
    from gpuslo.app.flag_rules import ANY, BY_COMMAND

    p = build_parser()
    for name in path:
        (sub,) = (x for x in p._actions if isinstance(x, argparse._SubParsersAction))
        p = sub.choices[name]
    flags = {o.option_strings[0] for o in p._actions if o.option_strings} - {"-h", "-v"}
    rules = BY_COMMAND[path]
    assert flags == set(rules), flags ^ set(rules)
    for flag, rule in rules.items():
        assert rule.sources == ANY, flag
        assert set(rule.not_with) <= set(rules) | {"--metrics-port 0"}, flag
        assert set(rule.needs) <= set(rules) | {r for r in rule.needs if r.startswith("$")}, flag
        assert bool(rule.why) == bool(rule.needs or rule.not_with), flag


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        # each ran, exit 0 or on to Kafka, the flag read by nothing
        (["ingest", "--file", "F", "--kafka", "k:9092"], ["--file"]),
        (["ingest", "--file", "F", "--group", "g"], ["--group"]),
        (
            ["ingest", "--file", "F", "--metrics-port", "9466", "--idle-exit-s", "5"],
            ["--metrics-port", "--idle-exit-s"],
        ),
        (["ingest", "--file", "F", "--kill-after-write", "1"], ["--kill-after-write"]),
        (
            ["ingest", "--kafka", "k:9092", "--metrics-port", "0", "--metrics-addr", "0.0.0.0"],
            ["--metrics-addr"],
        ),
        (
            ["ingest", "--kafka", "k:9092", "--max-report", "5", "--max-line-bytes", "2048"],
            ["--max-report", "--max-line-bytes"],
        ),
        (["ingest", "--file", "F", "--store", "S", "--clickhouse", "h:9000"], ["--store"]),
        (["rules", "run", "--once", "--every-s", "5"], ["--every-s"]),
        (["rules", "run", "--outbox", "D", "--resend-s", "60"], ["--outbox", "--resend-s"]),
        (["rules", "run", "--store", "S", "--clickhouse", "h:9000"], ["--store"]),
        (
            ["rules", "eval", "--from", "1", "--to", "2", "--store", "S", "--clickhouse", "h:9000"],
            ["--store"],
        ),
        (["report", "--from", "1", "--to", "2", "--store", "gpuslo-data", "--clickhouse", "h"], ["--store"]),
        # taken: each is read
        (
            [
                "ingest",
                "--kafka",
                "-",
                "--config",
                "C",
                "--group",
                "g",
                "--metrics-port",
                "9466",
                "--metrics-addr",
                "0.0.0.0",
                "--idle-exit-s",
                "5",
                "--dedup-window",
                "10",
                "--retention-days",
                "30",
                "--clickhouse",
                "h",
            ],
            [],
        ),
        (
            [
                "ingest",
                "--file",
                "F",
                "--max-report",
                "3",
                "--max-line-bytes",
                "2048",
                "--dedup-window",
                "10",
                "--store",
                "S",
                "--metrics-port",
                "0",
            ],
            [],
        ),
        (
            [
                "rules",
                "run",
                "--alertmanager",
                "http://am:9093",
                "--outbox",
                "D",
                "--resend-s",
                "60",
                "--every-s",
                "30",
            ],
            [],
        ),
        (
            [
                "rules",
                "run",
                "--webhook-url-file",
                "W",
                "--delivery-deadline-s",
                "5",
                "--outbox-max-age-s",
                "60",
            ],
            [],
        ),
    ],
)
def test_the_flags_other_commands_would_ignore_are_refused(
    argv: list[str], refused: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written out, not derived from the tables: through main(), exit 2 and one line per flag
    before anything starts (no file opened, no broker asked); a run reading every flag passes
    the check (its name checked, nothing run)."""
    from gpuslo.app.cli import _refused, build_parser

    monkeypatch.delenv("GPUSLO_ALERTMANAGER_URL", raising=False)
    monkeypatch.delenv("GPUSLO_WEBHOOK_URL", raising=False)
    if not refused:
        assert _refused(build_parser().parse_args(argv), argv) is None
        return
    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    cmd = "gpuslo " + " ".join(argv[: 2 if argv[0] == "rules" else 1]) + ": "
    assert [line.removeprefix(cmd).split(" ")[0].rstrip(":") for line in err.splitlines()] == refused, err


def test_a_receiver_named_by_the_environment_lets_rules_run_take_its_delivery_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``$GPUSLO_ALERTMANAGER_URL`` is a receiver as a flag is (the shipped manifests may name it
    so); a variable holding only a comment names none."""
    from gpuslo.app.cli import _refused, build_parser

    argv = ["rules", "run", "--outbox", "D"]
    monkeypatch.delenv("GPUSLO_WEBHOOK_URL", raising=False)
    monkeypatch.setenv("GPUSLO_ALERTMANAGER_URL", "http://am:9093")
    assert _refused(build_parser().parse_args(argv), argv) is None
    monkeypatch.setenv("GPUSLO_ALERTMANAGER_URL", "# none yet")
    assert "--outbox (" in (_refused(build_parser().parse_args(argv), argv) or "")


def test_a_service_config_without_a_server_is_refused_where_only_that_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rules eval --service-config {}`` read the file and used none of it; it also skipped the
    reading commands' check, so chDB made a store (data/, metadata/, store/) in any directory
    given. --store typed beside a config naming a server was ignored likewise."""
    empty, server = tmp_path / "empty.yaml", tmp_path / "server.yaml"
    empty.write_text("{}\n")
    server.write_text("clickhouse:\n  host: 127.0.0.1\n  port: 1\n")
    home = tmp_path / "home"
    home.mkdir()
    window = ["--from", "1", "--to", "2"]
    assert (
        main(["rules", "eval", "--store", str(home), "--service-config", str(empty), *window]) == EXIT_ERROR
    )
    assert "names no ClickHouse server" in capsys.readouterr().err
    assert list(home.iterdir()) == []
    assert (
        main(["rules", "eval", "--store", str(home), "--service-config", str(server), *window]) == EXIT_ERROR
    )
    assert "--store (the embedded store's directory) would be ignored" in capsys.readouterr().err
    assert main(["ingest", "--file", os.devnull, "--config", str(empty), "--store", str(home)]) == EXIT_ERROR
    assert "names no ClickHouse server" in capsys.readouterr().err
    assert list(home.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["rules", "eval", "--from", "1", "--to", "2", "--service-config", "CFG"],
        ["rules", "run", "--once", "--service-config", "CFG"],
        ["ingest", "--file", os.devnull, "--config", "CFG"],
    ],
    ids=["rules-eval", "rules-run", "ingest-file"],
)
def test_a_service_config_without_a_server_is_refused_beside_clickhouse_too(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--clickhouse H --service-config C``, C with no clickhouse section: the server was
    --clickhouse's, C read and ignored (its kafka section names no store), exit as for H alone."""
    cfg = tmp_path / "kafka-only.yaml"
    cfg.write_text("kafka:\n  bootstrap_servers: ['k1:9092']\n")
    argv = [str(cfg) if w == "CFG" else w for w in argv]
    assert main([*argv, "--clickhouse", "127.0.0.1:1"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"{cfg} names no ClickHouse server" in err and "the store being --clickhouse" in err, err


def test_ingest_metrics_addr_is_refused_where_the_config_turns_metrics_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ingest --kafka - --config C --metrics-addr 0.0.0.0``, C with ``ingest.metrics_port: 0``:
    no /metrics was served and the address was taken, exit 0 (``--metrics-port 0`` typed was
    refused; the config's 0 was not). Refused before any broker is asked."""
    cfg = tmp_path / "svc.yaml"
    cfg.write_text("kafka:\n  bootstrap_servers: ['127.0.0.1:1']\ningest:\n  metrics_port: 0\n")
    argv = ["ingest", "--kafka", "-", "--config", str(cfg), "--store", str(tmp_path / "s")]
    assert main([*argv, "--metrics-addr", "0.0.0.0"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "--metrics-addr (serves /metrics while it consumes) would be ignored" in err, err
    assert "ingest.metrics_port 0" in err and "reachable" not in err, err
    assert not (tmp_path / "s").exists()


def test_a_config_with_a_stray_key_of_the_other_kind_is_not_said_to_be_the_other_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rules config with a ``kafka:`` section beside its own keys was "a service config"; a
    service config with a misspelt key beside its sections got no line at all. The line is
    decided on the document's keys, not the refused ones alone."""
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("idle_threshold: 0.1\nkafka: {bootstrap_servers: ['k:9092']}\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("kafka: {bootstrap_servers: ['k:9092']}\nkafak: 1\n")
    stray = tmp_path / "stray.yaml"
    stray.write_text("kafka: {bootstrap_servers: ['k:9092']}\nslos: []\n")
    store = ["--store", str(tmp_path / "s"), "--from", "1", "--to", "2"]
    runs = [
        (["rules", "eval", *store, "--config", str(mixed)], "kafka: a service config's sections, not this file's"),
        (["rules", "eval", *store, "--config", str(typo)], "kafka: a service config's sections: that file is a service"),
        (["ingest", "--config", str(stray), "--kafka", "-"], "slos: a rules config's keys, not this file's"),
    ]  # fmt: skip
    for argv, last in runs:
        assert main(argv) == EXIT_ERROR, argv
        said = capsys.readouterr().err
        assert said.splitlines()[-1].startswith(last) and "that file is" not in said.replace(last, ""), (
            argv,
            said,
        )


def test_a_key_both_kinds_hold_names_neither_kind() -> None:
    from gpuslo.app.cli import _other_kind

    exc = ValueError("f: clickhouse.x: Extra inputs are not permitted")
    exc.top_keys = ("clickhouse",)  # type: ignore[attr-defined]
    assert _other_kind(exc, ["clickhouse", "kafka"], ["clickhouse"], "a service config", "its", "f") == str(
        exc
    )


def test_rightsize_takes_no_rules_config(capsys: pytest.CaptureFixture[str]) -> None:
    """Its advice reads none: --config was loaded, checked and never read."""
    with pytest.raises(SystemExit) as ei:
        main(["rightsize", "--from", "1", "--to", "2", "--config", "x.yaml"])
    assert ei.value.code == EXIT_ERROR and "unrecognized arguments: --config" in capsys.readouterr().err


def test_a_config_of_the_other_kind_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """deployment.md said every command takes `--config service.yaml`; a rules command reads
    --config as a rules config, and each refused key said only "Extra inputs are not permitted".
    The refusal now says which kind of file it is and which flag takes it, both ways; a rules
    config with a misspelt key of its own gets no such line."""
    service = tmp_path / "service.yaml"
    service.write_text("clickhouse:\n  host: 127.0.0.1\n  port: 1\n")
    rules = tmp_path / "rules.yaml"
    rules.write_text("idle_threshold: 0.1\nslos: []\n")
    runs = [
        (["rules", "eval", "--store", str(tmp_path / "s"), "--from", "1", "--to", "2", "--config", str(service)],
         "clickhouse: a service config's sections", "--service-config"),
        (["rules", "eval", "--service-config", str(rules), "--from", "1", "--to", "2"],
         "idle_threshold, slos: a rules config's keys", "take as --config"),
        (["ingest", "--config", str(rules), "--kafka", "-"], "idle_threshold, slos: a rules config's keys", "--config"),
    ]  # fmt: skip
    for argv, kind, flag in runs:
        assert main(argv) == EXIT_ERROR, argv
        said = capsys.readouterr().err
        assert "Extra inputs are not permitted" in said and kind in said and flag in said, (argv, said)
    typo = tmp_path / "typo.yaml"
    typo.write_text("idle_treshold: 0.1\n")
    argv = [
        "rules",
        "eval",
        "--store",
        str(tmp_path / "s"),
        "--from",
        "1",
        "--to",
        "2",
        "--config",
        str(typo),
    ]
    assert main(argv) == EXIT_ERROR
    assert capsys.readouterr().err.splitlines()[-1].endswith("idle_treshold: Extra inputs are not permitted")


def _all_parsers(
    p: argparse.ArgumentParser, path: str = "gpuslo"
) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, p)]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _all_parsers(sub, f"{path} {name}")
    return out


def _is_default(token: str, d: Any) -> bool:
    """Whether ``token`` of a help text reads as the value ``d`` (a number by its value: 60 is
    60.0), computed apart from the formatter."""
    if isinstance(d, int | float) and not isinstance(d, bool):
        try:
            return float(token) == d
        except ValueError:
            return False
    return token == str(d)


def test_every_option_with_a_default_says_it_in_its_help() -> None:
    """`gpuslo rules run --help` gave no default for --every-s, --window-s, --outbox, --resend-s,
    `ingest --help` none for --store: an operator had to read the docs or the code. Every
    option whose default is a value (not None, a flag's False or an empty text) says it: the
    word default, and the value itself, read back as a number where it is one. (The check
    formatted the value as the formatter did, %g, so a default shown as another number passed,
    and a help saying "default" of its own was never compared: --hours' "(default 12)" with
    the default changed to 24 passed. It wrapped at $COLUMNS: a path broke at its hyphen.)"""
    from gpuslo.app.cli import build_parser

    silent = []
    for path, parser in _all_parsers(build_parser()):
        for action in parser._actions:
            d = action.default
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if d is None or d is False or d is argparse.SUPPRESS or d in ("", (), []):
                continue
            fmt = parser.formatter_class(prog=parser.prog, width=100_000, max_help_position=100_000)
            fmt.add_argument(action)
            block = fmt.format_help()
            tokens = [t.strip("(),;:") for t in block.split()]
            if "default" not in block or not any(_is_default(t, d) for t in tokens):
                silent.append(f"{path} {action.option_strings[-1]} (default {d!r}): {block}")
    assert not silent, silent


@pytest.mark.parametrize(
    ("default", "shown"),
    [(60.0, "60"), (2592000.0, "2592000"), (1234567.0, "1234567"), (0.123456789, "0.123456789"),
     (1e-09, "1e-09"), (1e300, "1e+300"), (7, "7"), ("50%", "50%"), (Path("/var/x"), "/var/x")],
)  # fmt: skip
def test_a_default_is_shown_as_the_value_it_is(default: Any, shown: str) -> None:
    """%g wrote 1234567.0 as 1.23457e+06 and 0.123456789 as 0.123457: another number."""
    from gpuslo.app.cli import _Parser

    p = _Parser(prog="t")
    p.add_argument("--x", default=default, help="a value")
    assert " ".join(p.format_help().split()).endswith(f"--x X a value (default: {shown})")

"""The sinks that need no server, and the agent command around them, under file-system
faults: a full disk, a closed pipe, a read-only or wrong spool directory, a bad --out."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from gpuslo.agent.base import Source
from gpuslo.agent.runner import Runner, WallClock
from gpuslo.agent.sinks import JsonLinesSink
from gpuslo.app.cli import EXIT_ERROR, EXIT_PARTIAL, main
from gpuslo.wire import Message, NodeHeartbeat, decode
from tests.fs import tmpfs


def beats(n: int, start: int = 0) -> list[Message]:
    return [NodeHeartbeat(source="n1", boot_id="b", seq=i, cluster="c", ts=1_790_000_000.0 + i, node="n1",
                          interval_s=10.0, schedulable=True, reason="r" * 200, gpus=8)
            for i in range(start, start + n)]  # fmt: skip


def run(argv: list[str]) -> int:
    """The exit status of ``gpuslo ARGV`` (a SystemExit is how the process ends, too)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def fill(d: Path, leave: int) -> Path:
    st = os.statvfs(d)
    filler = d / "filler"
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_json_lines_on_a_full_disk_cut_back_counted_and_resumed(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "tiny", "256k") as d:
        filler = fill(d, 40 * 1024)
        sink = JsonLinesSink(d / "out.jsonl")
        sent, failed, k = [], 0, 0
        while failed < 30:
            batch = beats(7, start=k)
            k += 7
            res = sink.send(batch)
            if res.ok:
                sent += batch
            else:
                assert (res.sent, res.failed) == (0, 7) and "No space left on device" in res.error
                failed += 7
            lines = (d / "out.jsonl").read_bytes().splitlines()
            assert [decode(x) for x in lines] == sent  # never a torn line, never a refused message
        assert sink.send_failures == failed and sent
        filler.unlink()
        more = beats(5, start=k)
        assert sink.send(more).ok
        sink.close()
        assert [decode(x) for x in (d / "out.jsonl").read_bytes().splitlines()] == sent + more


def test_closed_pipe_is_a_failure_result(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.close(r)
    with open(w, "wb", buffering=0) as fh:
        res = JsonLinesSink(fh).send(beats(2))
    assert (res.sent, res.failed) == (0, 2) and "Broken pipe" in res.error


class _Beats(Source):
    name = "beats"

    def __init__(self) -> None:
        self.k = 0

    def collect(self, now: float) -> list[Message]:
        self.k += 1
        return beats(1, start=self.k)


class _Flaky(JsonLinesSink):
    def __init__(self, path: Path, fail: set[int]) -> None:
        super().__init__(path)
        self.fail, self.n = fail, 0

    def _write(self, blob: bytes) -> None:
        self.n += 1
        if self.n in self.fail:
            raise OSError(28, "No space left on device")
        super()._write(blob)


def test_runner_logs_a_sink_outage_once_and_its_end_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = _Flaky(tmp_path / "o.jsonl", fail={2, 3, 4, 5, 7})
    runner = Runner([_Beats()], sink, WallClock(), 1.0)
    with caplog.at_level(logging.WARNING, logger="agent"):
        for t in range(8):
            runner.tick(float(t))
    assert runner.stats.send_failures == 5 == sink.send_failures and runner.stats.messages == 3
    assert caplog.text.count("sink failed to send") == 2  # two outages
    assert caplog.text.count("sink accepts messages again") == 2


def test_cli_agent_on_a_full_disk_exits_partial_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with tmpfs(tmp_path / "tiny", "256k") as d:
        fill(d, 64 * 1024)
        rc = main(["agent", "--source", "sim", "--nodes", "2", "--hours", "0.2", "--out", str(d / "o.jsonl")])
        err = capsys.readouterr().err
        assert rc == EXIT_PARTIAL
        assert "messages could not be sent" in err and "Traceback" not in err
        assert caplog.text.count("No space left on device") == 1, caplog.text  # logged once
        for line in (d / "o.jsonl").read_bytes().splitlines():
            decode(line)  # what landed is whole lines


@pytest.mark.parametrize("case", ["read-only", "a file", "under a file"])
def test_cli_agent_with_an_unusable_spool_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    (tmp_path / "file").write_text("")
    argv = ["agent", "--source", "sim", "--hours", "0.01", "--kafka", "127.0.0.1:1", "--spool-dir"]
    if case == "read-only":
        with tmpfs(tmp_path / "ro", "64k", read_only=True) as d:
            rc = run([*argv, str(d)])
        want = "is not writable by this process"
    else:
        rc = run([*argv, str(tmp_path / "file" / ("sub" if case == "under a file" else ""))])
        want = "cannot create the spool directory" if case == "under a file" else "is not a directory"
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR and want in err and "Traceback" not in err, err


def test_cli_agent_out_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["agent", "--source", "sim", "--hours", "0.01", "--out", str(tmp_path)]) == EXIT_ERROR
    assert f"cannot open --out {tmp_path}: Is a directory" in capsys.readouterr().err


def test_a_sink_that_raises_is_contained_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    from gpuslo.agent.base import SendResult, Sink

    class Boom(Sink):
        def send(self, msgs: object) -> SendResult:
            raise RuntimeError("bug")

    runner = Runner([_Beats()], Boom(), WallClock(), 1.0)
    with caplog.at_level(logging.WARNING, logger="agent"):
        for t in range(3):
            runner.tick(float(t))
    assert runner.stats.ticks == 3 and runner.stats.send_failures == 3
    assert caplog.text.count("sink raised") == 1

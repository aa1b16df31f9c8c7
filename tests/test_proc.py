"""Every child process gpuslo starts (gpuslo.core.proc) is ended, its whole process group: at its
own timeout, when it exits, and when the run that started it ends. ``subprocess.run``'s timeout
killed the direct child only: a Slurm command wrapped in a shell, or one that forked, ran on
after the timeout, and a command on a thread of its own was abandoned at the agent's exit.

The Slurm commands here are stand-ins on PATH (shell scripts that fork a ``sleep`` and say its
pid): a fake of a command that is slow to answer and forks, which the real ones do not do on
demand; tests/test_slurm.py ends the real ``sinfo`` against a stopped slurmctld."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gpuslo.agent.slurm import SlurmCli
from gpuslo.rules.actions import SlurmActor
from gpuslo.rules.reclaim import IdleHolder


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed grandchild is reaped by init, later)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def ended(pids: list[int]) -> list[int]:
    """``pids`` still running once SIGKILL had the time to land (30 s at most): [] when all ended."""
    deadline = time.monotonic() + 30
    while (left := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stand_in(bin_dir: Path, name: str, pids: Path, body: str) -> None:
    """``name`` on PATH: a shell that writes its pid and its forked ``sleep``'s to ``pids``, then
    runs ``body``."""
    bin_dir.mkdir(exist_ok=True)
    p = bin_dir / name
    p.write_text(f"#!/bin/sh\nsleep 600 >/dev/null 2>&1 &\necho $$ $! >> {pids}\n{body}\n")
    p.chmod(0o755)


def pids_in(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


@pytest.fixture
def path_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    return d


@pytest.mark.integration  # waits out a 1 s timeout
def test_a_timeout_ends_the_command_and_what_it_forked(tmp_path: Path, path_bin: Path) -> None:
    """squeue past its timeout, a shell that forked: both gone when the call returns (the fork
    kept running for its 600 s, holding the output pipe)."""
    pids = tmp_path / "pids"
    stand_in(path_bin, "squeue", pids, "wait")
    cli = SlurmCli(timeout_s=1.0)
    assert cli.text("squeue", "--json") is None and cli.failures == 1
    got = pids_in(pids)
    assert len(got) == 2 and ended(got) == []


def test_a_command_that_answered_leaves_nothing_running(tmp_path: Path, path_bin: Path) -> None:
    """A command that answers and exits, leaving what it forked behind: that is ended too."""
    pids = tmp_path / "pids"
    stand_in(path_bin, "squeue", pids, "echo '{\"jobs\": []}'")
    cli = SlurmCli(timeout_s=30.0)
    assert cli.jobs() == [] and cli.failures == 0
    got = pids_in(pids)
    assert len(got) == 2 and ended(got) == []


@pytest.mark.integration  # waits out a 1 s timeout
def test_the_reclaim_actions_timeout_ends_the_command_and_its_fork(tmp_path: Path, path_bin: Path) -> None:
    """The rules' reclaim action (squeue before scancel) on the same terms: timed out, recorded
    as a failure, nothing left running."""
    pids = tmp_path / "pids"
    stand_in(path_bin, "squeue", pids, "wait")
    h = IdleHolder(cluster="c", scheduler="slurm", id="42", name="j", user="u", account="a", queue="gpu",
                   gpus=1.0, idle_since=0.0, idle_for_s=3600.0, held_since=0.0, threshold_s=600.0)  # fmt: skip
    out = SlurmActor(timeout_s=1.0).act("cancel", h)
    assert not out.ok and "timed out" in out.reason
    got = pids_in(pids)
    assert len(got) == 2 and ended(got) == []


def test_closing_the_run_ends_a_command_running_on_another_thread(tmp_path: Path, path_bin: Path) -> None:
    """The agent asks Slurm on a thread of its own: the run's end kills the command there (and
    what it forked) and reaps it; the thread's call fails as stopped, and no command starts
    after."""
    from gpuslo.core.proc import Children, Stopped

    pids = tmp_path / "pids"
    stand_in(path_bin, "squeue", pids, "wait")
    kids = Children()
    got: list[BaseException] = []

    def call() -> None:
        try:
            kids.run(["squeue", "--json"], 3600.0)
        except BaseException as exc:  # the outcome is the test's
            got.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    for _ in range(600):  # bounded: the stand-in says its pids at once
        if pids.exists() and len(pids.read_text().split()) == 2:
            break
        time.sleep(0.05)
    started = pids_in(pids)
    assert kids.live == 1
    kids.close()
    t.join(30)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], Stopped), got
    with pytest.raises(ProcessLookupError):
        os.kill(started[0], 0)  # the direct child: killed and reaped by the run
    assert ended(started) == [] and kids.live == 0
    with pytest.raises(Stopped):
        kids.run(["true"], 5.0)


def test_a_command_that_cannot_start_is_an_oserror_and_nothing_is_kept() -> None:
    from gpuslo.core.proc import Children

    kids = Children()
    with pytest.raises(OSError):
        kids.run(["/nonexistent/squeue"], 5.0)
    assert kids.live == 0
    done = kids.run(["sh", "-c", "echo out; echo err >&2; exit 3"], 30.0)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        kids.run(["false"], 30.0, check=True)


def test_a_command_that_raises_ends_the_slurm_commands_it_started(
    tmp_path: Path, path_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gpuslo agent --slurm`` whose run raises while its sinfo runs on the agent's thread (the
    error here is injected after the sinfo started): the command's end, by an exception, ends
    the sinfo and what it forked."""
    from gpuslo.agent.slurm import SlurmNodeSource
    from gpuslo.app import cli

    pids = tmp_path / "pids"
    stand_in(path_bin, "sinfo", pids, "wait")

    def run_then_fail(a: object, sources: list[object], *args: object, **kw: object) -> int:
        (node,) = [s for s in sources if isinstance(s, SlurmNodeSource)]
        threading.Thread(target=node.sinfo, args=(1_796_430_000.0,), daemon=True).start()
        for _ in range(600):  # bounded: the stand-in says its pids at once
            if pids.exists() and len(pids.read_text().split()) == 2:
                break
            time.sleep(0.05)
        raise RuntimeError("a bug in the run")

    monkeypatch.setattr(cli, "_run_on_wall_clock", run_then_fail)
    with pytest.raises(RuntimeError, match="a bug in the run"):
        cli.main(["agent", "--source", "dcgm", "--slurm", "--dcgm-url", "http://127.0.0.1:9/metrics",
                  "--node", "n1", "--interval-s", "2", "--metrics-port", "0", "--out", str(tmp_path / "o")])  # fmt: skip
    got = pids_in(pids)
    assert len(got) == 2 and ended(got) == []


def test_a_program_that_exits_ends_the_commands_nobody_closed(tmp_path: Path, path_bin: Path) -> None:
    """A program using the agent's Slurm reader as a library (no CLI, no run closed) that exits
    while a command runs on a daemon thread: the interpreter's exit ends it and its fork."""
    import sys

    pids = tmp_path / "pids"
    stand_in(path_bin, "squeue", pids, "wait")
    program = f"""
import threading, time
from pathlib import Path
from gpuslo.agent.slurm import SlurmCli
threading.Thread(target=SlurmCli().jobs, daemon=True).start()
p = Path({str(pids)!r})
for _ in range(600):
    if p.exists() and len(p.read_text().split()) == 2:
        break
    time.sleep(0.05)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = pids_in(pids)
    assert len(got) == 2 and ended(got) == []


def test_a_command_that_answered_is_answered_though_what_it_left_holds_its_output(
    tmp_path: Path, path_bin: Path
) -> None:
    """A command that answers and exits, leaving a fork (one in its group, one that left it with
    setsid) holding its standard output: its answer is taken at its exit, the fork in its group
    is ended. The end of the pipe stood for the exit: the call waited for the timeout and counted
    the command failed, its answer lost."""
    pids, left = tmp_path / "pids", tmp_path / "left"
    body = f"sleep 600 &\necho $! >> {left}\nsetsid sleep 600 &\necho $! >> {left}\necho '{{\"jobs\": []}}'"
    stand_in(path_bin, "squeue", pids, body)
    cli = SlurmCli(timeout_s=60.0)
    try:
        assert cli.jobs() == [] and cli.failures == 0
        in_group = pids_in(left)[0]  # the other left the group: out of reach
        assert ended([*pids_in(pids), in_group]) == []
    finally:
        for pid in pids_in(left):  # the one out of reach: this test's to end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_output_that_is_not_utf8_is_an_answer_not_an_error(tmp_path: Path, path_bin: Path) -> None:
    """scancel's verbose line naming a job whose name is not UTF-8: the cancel is done and said,
    with the byte replaced. It raised UnicodeDecodeError from the command's run (the reclaim
    action counted a cancel that was done as a failed attempt, and tried it again)."""
    from gpuslo.core.proc import Children

    done = Children().run(["printf", "\\377 ok"], 30.0)
    assert (done.returncode, done.stdout) == (0, "\ufffd ok")
    stand_in(path_bin, "squeue", tmp_path / "pids", "echo '42 42 RUNNING'")
    stand_in(
        path_bin, "scancel", tmp_path / "pids", "printf 'scancel: Terminating job 42 (\\377\\376)\\n' >&2"
    )
    h = IdleHolder(cluster="c", scheduler="slurm", id="42", name="j", user="u", account="a", queue="gpu",
                   gpus=1.0, idle_since=0.0, idle_for_s=3600.0, held_since=0.0, threshold_s=600.0)  # fmt: skip
    out = SlurmActor(timeout_s=30.0).act("cancel", h)
    assert out.ok and "scancel --verbose 42" in out.reason, out


@pytest.mark.integration  # starts a Python process with the store
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("embedded", [False, True])
def test_a_command_ended_by_a_signal_ends_its_commands_first(
    tmp_path: Path, path_bin: Path, signum: int, embedded: bool
) -> None:
    """``gpuslo job 123_4`` (no graceful stop: SIGTERM and SIGHUP end it at once) while its
    scontrol hangs: killed (``timeout``, a closed terminal), it ends by the signal as before, and
    the scontrol and its fork with it. Run in sessions of their own, they were out of reach of
    the signal to gpuslo's group, and ran on. ``embedded``: a program that runs a Slurm command
    of its own on a thread (its own Children) before it calls main(): that one goes too."""
    import sys

    pids = tmp_path / "pids"
    stand_in(path_bin, "scontrol", pids, "wait")
    store = tmp_path / "store"
    (store / "metadata").mkdir(parents=True)
    own = f"""
import os, threading, time
from gpuslo.agent.slurm import SlurmCli
threading.Thread(target=SlurmCli().text, args=("scontrol", "ping"), daemon=True).start()
for _ in range(1200):
    if os.path.exists({str(pids)!r}) and len(open({str(pids)!r}).read().split()) == 2:
        break
    time.sleep(0.05)
"""
    program = f"{own if embedded else ''}import sys\nfrom gpuslo.app.cli import main\nsys.exit(main())"
    want = 4 if embedded else 2
    p = subprocess.Popen([sys.executable, "-c", program, "job", "--store", str(store), "123_4"],
                         stderr=subprocess.PIPE)  # fmt: skip
    try:
        for _ in range(1200):  # bounded: the stand-ins say their pids once started
            if (pids.exists() and len(pids.read_text().split()) == want) or p.poll() is not None:
                break
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1]
        p.send_signal(signum)
        assert p.wait(60) == -signum
    finally:
        p.kill()
        p.wait()
        assert p.stderr is not None
        p.stderr.close()
    got = pids_in(pids)
    try:
        assert len(got) == want and ended(got) == []
    finally:
        for pid in got:  # what this test started is ended, whatever the outcome
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.integration  # a real-time agent, stopped twice
def agent_to_a_broker_down(tmp_path: Path, flush_timeout_s: float) -> tuple[list[str], Path]:
    """The command line of an agent ticking every second and sending to a port nothing listens
    on (the broker down), and its spool: its graceful end waits ``flush_timeout_s``."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spool = tmp_path / "spool"
    argv = [sys.executable, "-m", "gpuslo", "agent", "--source", "sim", "--realtime", "--interval-s", "1",
            "--kafka", f"127.0.0.1:{port}", "--spool-dir", str(spool), "--flush-timeout-s", f"{flush_timeout_s:g}"]  # fmt: skip
    return argv, spool


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_a_graceful_stop_at_once(tmp_path: Path, signum: int) -> None:
    """The first SIGTERM or SIGINT stops the agent gracefully: its last delivery waits for a
    broker that is down (``--flush-timeout-s``, here 600 s). The second ends it at once, by that
    signal (a second Ctrl-C did nothing); what it had not sent stays in the spool."""
    argv, spool = agent_to_a_broker_down(tmp_path, flush_timeout_s=600)
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        for _ in range(1200):  # bounded: ticking once a record is spooled
            if p.poll() is not None or (spool.is_dir() and any(f.suffix == ".spl" for f in spool.iterdir())):
                break
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1]
        p.send_signal(signum)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(2)  # the graceful end, waiting for the broker
        p.send_signal(signum)
        assert p.wait(120) == -signum  # not the 600 s of the flush
        assert f"{signal.Signals(signum).name} again: ending now" in (p.stderr.read() if p.stderr else "")
    finally:
        p.kill()
        p.wait()
        if p.stderr is not None:
            p.stderr.close()
    assert any(f.suffix == ".spl" and f.stat().st_size for f in spool.iterdir())  # kept for the next start


@pytest.mark.parametrize("how", ["timeout", "twice"])
def test_one_stop_signalled_twice_at_once_is_one_graceful_stop(tmp_path: Path, how: str) -> None:
    """GNU ``timeout`` sends its signal to the command and then to its process group, the command
    again; a terminal's Ctrl-C reaches each process of its group. Two signals that close together
    are one request: the stop stays graceful, here the agent's last delivery to a broker that is
    down, waited out (``timeout 600 gpuslo ingest ...`` was ended at once by its own second
    SIGTERM, without writing and committing what it had read)."""
    import shutil

    argv, spool = agent_to_a_broker_down(tmp_path, flush_timeout_s=3)
    if how == "timeout":
        if shutil.which("timeout") is None:
            pytest.skip("GNU timeout is not installed")
        argv = ["timeout", "--preserve-status", "-s", "TERM", "6", *argv]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        if how == "twice":
            for _ in range(1200):  # bounded: ticking once a record is spooled
                if p.poll() is not None or (
                    spool.is_dir() and any(f.suffix == ".spl" for f in spool.iterdir())
                ):
                    break
                time.sleep(0.05)
            assert p.poll() is None, p.communicate()[1]
            p.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # past the first one's handler (two at once are one to Python already)
            assert p.poll() is None  # still in its graceful end, waiting for the broker
            p.send_signal(signal.SIGTERM)
        rc = p.wait(120)
        err = p.stderr.read() if p.stderr else ""
    finally:
        p.kill()
        p.wait()
        if p.stderr is not None:
            p.stderr.close()
    assert "again" not in err, err
    # the graceful end's status (1: not everything was delivered), not death by SIGTERM (-15, or
    # 143 through timeout)
    assert rc == 1, err
    assert "not everything was delivered within 3 s" in err


def test_a_command_puts_the_handlers_back_however_it_ends_and_runs_off_the_main_thread(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() sets SIGTERM and SIGHUP (at their default) to end the run's commands first: the
    handlers before it are back when it returns or raises; called from a thread (an embedding
    program), where no handler can be set, it runs."""
    from gpuslo.app import cli

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {s: signal.getsignal(s) for s in signals}
    assert before[signal.SIGHUP] == signal.SIG_DFL  # what main() replaces for the run
    assert cli.main(["schema"]) == 0
    assert {s: signal.getsignal(s) for s in signals} == before
    during: list[object] = []

    def fails(a: object) -> int:
        during.append(signal.getsignal(signal.SIGHUP))
        raise RuntimeError("a bug in the command")

    monkeypatch.setattr(cli, "_run_command", fails)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["schema"])
    assert during[0] not in (signal.SIG_DFL, None) and {s: signal.getsignal(s) for s in signals} == before
    monkeypatch.undo()

    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(cli.main(["schema"])))
    t.start()
    t.join(120)
    assert got == [0] and {s: signal.getsignal(s) for s in signals} == before
    assert "CREATE TABLE" in capsys.readouterr().out


def test_closing_the_run_is_not_held_by_a_command_that_is_still_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command whose start hangs (Popen waits for the exec, and an exec of a binary on a hung
    NFS mount, where Slurm's commands often live, waits with it; here Popen is held by a fake
    until the close is done): the run's close() returns, and the command, started after it, is
    killed at once and said stopped. The start held the lock close() takes: the run's end, and
    so the agent's exit at SIGTERM, waited for the mount."""
    from gpuslo.core import proc

    real, go, starting = subprocess.Popen, threading.Event(), threading.Event()

    def held_popen(*args: object, **kw: object) -> object:
        starting.set()
        go.wait(120)  # bounded: the test sets it once close() returned (or gave up on it)
        return real(*args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(proc.subprocess, "Popen", held_popen)
    kids = proc.Children()
    got: list[BaseException] = []

    def call() -> None:
        try:
            kids.run(["sh", "-c", "sleep 600"], 3600.0)
        except BaseException as exc:  # the outcome is the test's
            got.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    assert starting.wait(60)
    closer = threading.Thread(target=kids.close, daemon=True)
    closer.start()
    closer.join(30)
    closed_while_starting = not closer.is_alive()
    go.set()
    t.join(60)
    assert closed_while_starting
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], proc.Stopped), got
    assert kids.live == 0


def test_without_a_pidfd_a_command_that_answered_leaves_nothing_running(
    tmp_path: Path, path_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel with no pidfd_open (before 5.3: EL7's 3.10, common on Slurm nodes; here
    os.pidfd_open fails with ENOSYS as it does there): the exit is the pipes' end, and what the
    command left in its group is still ended (the group was not killed once the child was
    reaped)."""
    import errno

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    test_a_command_that_answered_leaves_nothing_running(tmp_path, path_bin)


def test_what_a_command_left_writing_to_its_output_is_not_read_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the command's exit its pipes are drained of what it wrote (at most their capacity):
    a writer it left out of its group (setsid) that keeps the pipe full held the call reading
    for ever, the answer growing without bound. The writer is a fake read that never finds the
    pipe empty (a real one is a race with the reader), ending after 64 MiB."""
    from gpuslo.core import proc

    r, w = os.pipe()
    real_read, calls = os.read, [0]

    def always_full(fd: int, n: int) -> bytes:
        if fd != r:
            return real_read(fd, n)
        calls[0] += 1
        return b"x" * n if calls[0] <= 1024 else b""

    monkeypatch.setattr(os, "read", always_full)
    got: list[bytes] = []
    try:
        proc._drain(r, got)
    finally:
        monkeypatch.undo()
        os.close(r)
        os.close(w)
    assert 0 < sum(map(len, got)) <= 1 << 20  # a pipe holds at most pipe-max-size, 1 MiB by default

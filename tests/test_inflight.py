"""A stop ends every wait for a slow dependency's answer (InFlight's ``stop``, the run's): a node
agent told to stop while its tick waited for a stopped slurmctld held the exit for the command's
whole timeout, once per dependency it asks. The stop is the run's, not the process's: a
module-wide event, set by one run's SIGTERM and never cleared, ended every wait of the next run
in the same process at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpuslo.agent.inflight import InFlight
from tests.test_proc import ended


@pytest.mark.parametrize(("first_whole", "wait_s"), [(True, 0.05), (False, 3600.0), (True, 0.0)])
def test_a_stop_ends_the_wait_for_an_answer_that_has_not_come(first_whole: bool, wait_s: float) -> None:
    """The first answer's whole wait, and a long one, end at the stop; the call stays in flight
    (its own timeout ends it) and its answer, when it comes, is taken as before."""
    gate = threading.Event()
    calls: list[int] = []
    stop = threading.Event()
    f: InFlight[int] = InFlight("a slurmctld", wait_s, "t-inflight", first_whole=first_whole, stop=stop)

    def call() -> int:
        calls.append(1)
        gate.wait(60)
        return 7

    got: list[tuple[bool, int | None]] = []
    taker = threading.Thread(target=lambda: got.append(f.take(call)), daemon=True)
    try:
        taker.start()
        taker.join(0.3)  # waiting (whole, or for the hour)
        assert taker.is_alive() == (first_whole or wait_s > 1)
        stop.set()
        taker.join(30)  # bounded: without the stop the wait lasts until the gate opens
        assert not taker.is_alive(), "the stop did not end the wait"
        assert got == [(False, None)]
    finally:
        gate.set()
    stop.clear()
    assert f.take(call) == (True, 7)  # the call that was in flight, not a new one
    assert calls == [1]


def test_an_answer_that_came_is_taken_while_stopping() -> None:
    stop = threading.Event()
    f: InFlight[int] = InFlight("a kubelet", 0.05, "t-inflight", first_whole=True, stop=stop)
    stop.set()
    got = f.take(lambda: 3)
    for _ in range(500):  # bounded: the call returns at once
        if got[0]:
            break
        threading.Event().wait(0.01)
        got = f.take(lambda: 4)
    assert got == (True, 3)


@pytest.mark.integration  # an agent process
def test_sigterm_stops_an_agent_whose_tick_waits_for_a_silent_slurmctld(tmp_path: Path) -> None:
    """``gpuslo agent --slurm`` on a node whose slurmctld takes the calls and answers nothing (its
    squeue and sinfo hang, as Slurm's own do while slurmctld is stopped): SIGTERM ends the agent
    before the commands' 15 s timeout, with exit 0 and what it had written kept; and the commands
    end with it, with what they forked (stand-ins: a shell that forks a ``sleep`` and waits; the
    command on the agent's thread was left running, an orphan holding a slurmctld RPC)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started = tmp_path / "started"
    for cmd in ("squeue", "sinfo", "scontrol"):
        p = bin_dir / cmd
        p.write_text(f"#!/bin/sh\nsleep 600 &\necho $$ $! >> {started}\nwait\n")
        p.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "gpuslo", "agent", "--source", "dcgm", "--slurm",
                          "--dcgm-url", "http://127.0.0.1:9/metrics", "--node", "n1", "--interval-s", "2",
                          "--metrics-port", "0", "--out", str(out)],
                         env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(2400):  # the tick asks slurmctld, and waits for the first answer whole
            if started.exists() and len(started.read_text().split()) >= 2:
                break
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            threading.Event().wait(0.05)
        else:
            pytest.fail("the agent never asked Slurm (2 minutes)")
        threading.Event().wait(0.5)
        os.kill(p.pid, signal.SIGTERM)
        try:
            rc = p.wait(10)  # the commands' own timeout (15 s) would end the wait without the stop
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM did not end the agent's wait for slurmctld's answer")
        assert rc in (0, 1), p.stderr.read() if p.stderr else ""
        kids = [int(x) for x in started.read_text().split()]
        assert ended(kids) == [], "a Slurm command the agent started outlived it"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid in started.read_text().split() if started.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_one_runs_stop_ends_no_wait_of_another() -> None:
    """Two runs in one process (an agent run, then ``gpuslo demo``, or tests): the stop of the
    first, set and never cleared, ended every wait of the second at once (a module-wide event):
    its first answer was not waited for, its ticks went without the attribution."""
    first: InFlight[int] = InFlight(
        "a slurmctld", 3600.0, "t-inflight", first_whole=True, stop=threading.Event()
    )
    gate = threading.Event()
    assert first.stop is not None
    first.stop.set()  # the first run was stopped (SIGTERM)
    assert first.take(lambda: (gate.wait(60), 1)[1]) == (False, None)
    second: InFlight[int] = InFlight(
        "a slurmctld", 3600.0, "t-inflight", first_whole=True, stop=threading.Event()
    )
    third: InFlight[int] = InFlight("a slurmctld", 3600.0, "t-inflight", first_whole=True)  # no stop given
    threading.Timer(0.2, gate.set).start()
    assert second.take(lambda: (gate.wait(60), 2)[1]) == (True, 2)  # waited for whole
    assert third.take(lambda: 3) == (True, 3)

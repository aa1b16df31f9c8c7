"""The test servers' ports (tests/servers/ports.py): never from the range the kernel gives
outgoing connections, never the same for two processes, never one something already listens on;
and a server that cannot bind says so (a CI run lost a Kafka broker to a taken port, with no
word of why: the broker's log went to SLF4J's no-op logger)."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.servers import ports


@pytest.fixture
def claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "claims"
    monkeypatch.setattr(ports, "CLAIMS", d)
    return d


def test_ports_are_outside_the_ephemeral_range(claims: Path) -> None:
    lo, hi = ports.ephemeral_range()
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)
    assert not [p for p in got if lo <= p <= hi]
    assert all(ports.LOWEST <= p <= 65535 for p in got)
    assert sorted(int(p.name) for p in claims.iterdir() if p.name != ".lock") == sorted(got)


@pytest.mark.parametrize(
    ("eph", "spans"),
    [
        ((32768, 60999), [(20000, 32767), (61000, 65535)]),  # Linux's default
        ((49152, 65535), [(20000, 49151)]),  # IANA's
        ((1024, 65535), [(20000, 65535)]),  # all of it: the claim and bind check alone guard
        ((20500, 65400), [(20000, 65535)]),  # 635 ports left outside: too few
        ((10000, 20000), [(20001, 65535)]),
    ],
)
def test_the_spans_drawn_from_for_each_ephemeral_range(
    eph: tuple[int, int], spans: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: eph)
    assert ports.candidates() == spans


def test_an_unreadable_or_odd_range_file_is_linux_default(tmp_path: Path) -> None:
    for text in ("", "garbage", "1 2 3"):
        (tmp_path / "r").write_text(text)
        assert ports.ephemeral_range(tmp_path / "r") == (32768, 60999)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    (tmp_path / "r").write_text("40000\t50000\n")
    assert ports.ephemeral_range(tmp_path / "r") == (40000, 50000)


def _draw(claims: str, seed: int, n: int, out: multiprocessing.Queue, done: Any) -> None:  # type: ignore[type-arg]
    ports.CLAIMS = Path(claims)
    rng = random.Random(seed)
    out.put([ports.free_port(rng) for _ in range(n)])
    done.wait(120)  # alive until every process has drawn: an exited owner's claims pass, by design


def test_processes_drawing_the_same_numbers_get_different_ports(claims: Path) -> None:
    """Four processes on the same random sequence, alive until all have drawn: without the claims
    every one would get the same ports. (A process that had drawn and exited left its claims to
    be taken over, as an exited owner's are: CI saw 180 distinct ports of 240 that way.)"""
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    done = ctx.Event()
    procs = [ctx.Process(target=_draw, args=(str(claims), 7, 60, q, done)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=60) for _ in procs]
    finally:
        done.set()
    for p in procs:
        p.join(timeout=60)
    flat = [p for g in got for p in g]
    assert len(flat) == 240 and len(set(flat)) == 240


class _Scripted(random.Random):
    """Draws the given ports first, then random ones."""

    def __init__(self, first: list[int]) -> None:
        super().__init__(1)
        self.first = list(first)

    def randint(self, a: int, b: int) -> int:
        return self.first.pop(0) if self.first else super().randint(a, b)


def test_a_port_something_listens_on_is_never_given(claims: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", ports.free_port()))
    held.listen()
    taken = held.getsockname()[1]
    (claims / str(taken)).unlink()  # as if another program, not a test, held it
    try:
        got = ports.free_port(_Scripted([taken, taken]))
    finally:
        held.close()
    assert got != taken
    assert not (claims / str(taken)).exists()


def test_claims_of_live_processes_hold_and_of_exited_ones_pass(claims: Path) -> None:
    claims.mkdir()
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    a, b, c = 20001, 20002, 20003
    (claims / str(a)).write_text(str(os.getppid()))  # alive, not this process
    (claims / str(b)).write_text(exited.stdout.strip())  # gone
    (claims / str(c)).write_text("not a pid")
    got = ports.free_port(_Scripted([a, c, b]))
    assert got == b or not ports._bindable(b)
    assert (claims / str(a)).read_text() == str(os.getppid())
    assert (claims / str(c)).read_text() == "not a pid"
    if got == b:
        assert (claims / str(b)).read_text() == ports.owner_text()
    assert ports.free_port(_Scripted([got])) != got  # this process's own claim is not given twice


def _ns() -> str:
    return os.readlink("/proc/self/ns/pid")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_claim_is_its_owners_process_not_its_pid_alone(claims: Path) -> None:
    """A claim whose process id a later process uses (another start time) is a dead owner's:
    taken over (it held the port for as long as the new process lived); the owner's own start
    time holds. A claim of another PID namespace (a container sharing /tmp), whose owner cannot
    be looked up here, holds for FOREIGN_CLAIM_S, then passes. Odd bytes are nobody's to judge."""
    claims.mkdir()
    parent = os.getppid()
    live = ports.owner_text(parent)
    reused = f"{parent} 1 {_ns()}"  # the parent's pid, another process's start time
    foreign = f"{parent} {live.split()[1]} pid:[1]"
    a, b, c, d, e = 20011, 20012, 20013, 20014, 20015
    for port, text in ((a, live), (b, reused), (c, foreign), (d, foreign)):
        (claims / str(port)).write_text(text)
    old = time.time() - ports.FOREIGN_CLAIM_S - 60
    os.utime(claims / str(d), (old, old))
    (claims / str(e)).write_bytes(b"\xff\xfe")
    got = [ports.free_port(_Scripted([a, c, e, b])), ports.free_port(_Scripted([a, c, e, d]))]
    for port, want in zip(got, (b, d), strict=True):
        assert port == want or not ports._bindable(want)  # (something else listens on it)
    assert (claims / str(a)).read_text() == live and (claims / str(c)).read_text() == foreign
    assert (claims / str(e)).read_bytes() == b"\xff\xfe"
    for port in got:
        assert (
            (claims / str(port)).read_text()
            == ports.owner_text()
            == f"{os.getpid()} {ports._start_time(os.getpid())} {_ns()}"
        )


def test_a_claims_directory_not_this_users_is_refused_with_its_path(
    claims: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink (placed by anyone in a shared /tmp) or another user's directory is not where this
    user's claims go: a clear refusal naming it, not files written through it."""
    elsewhere = claims.parent / "elsewhere"
    elsewhere.mkdir()
    claims.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match=r"claims directory is not a directory of this user") as err:
        ports.free_port()
    assert str(claims) in str(err.value) and not list(elsewhere.iterdir())
    claims.unlink()
    claims.mkdir()
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)
    with pytest.raises(RuntimeError, match=r"set TMPDIR"):
        ports.free_port()


_DRAW = (
    "import sys; sys.path.insert(0, sys.argv[1]); from tests.servers import ports; print(ports.free_port())"
)


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to be two users"
)
def test_two_users_on_one_machine_both_get_ports() -> None:
    """The claims directory was one for every user, made with the first one's umask (0755) and
    its lock file 0644: every other user's test servers failed with PermissionError. Each user's
    claims are its own now (the default path, under one shared temporary directory)."""
    root = Path(__file__).resolve().parents[1]
    shared = Path(tempfile.mkdtemp(prefix="gpuslo-ports-users-"))
    try:
        shared.chmod(0o1777)
        env = {**os.environ, "TMPDIR": str(shared)}
        first = subprocess.run(
            [sys.executable, "-c", _DRAW, str(root)], env=env, capture_output=True, text=True
        )
        assert first.returncode == 0, first.stderr[-2000:]
        other = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", _DRAW, str(root)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if "ModuleNotFoundError" in other.stderr or "Permission denied: '" + str(root) in other.stderr:
            pytest.skip(f"the checkout is not readable by uid 65534: {other.stderr[-300:]}")
        assert other.returncode == 0, other.stderr[-2000:]
        assert sorted(p.name for p in shared.iterdir()) == ["gpuslo-test-ports-0", "gpuslo-test-ports-65534"]
        assert (shared / "gpuslo-test-ports-65534" / other.stdout.strip()).exists()
    finally:
        shutil.rmtree(shared)


def test_a_kafka_broker_whose_port_is_taken_says_so(tmp_path: Path) -> None:
    """The broker's log reaches broker.log (an SLF4J 2 API beside log4j-slf4j2-impl): the error
    names the port and the reason. The controller's port is the one held: the controller binds
    first, and the harness waits on the client port, which a held socket would answer for."""
    from tests.servers.kafka import KafkaBroker

    broker = KafkaBroker(tmp_path / "kafka", partitions=1)
    held = socket.socket()
    held.bind(("127.0.0.1", broker.controller_port))
    held.listen()
    try:
        with pytest.raises(RuntimeError, match=r"Kafka exited with 1") as err:
            broker.start(timeout_s=60)
    finally:
        held.close()
        broker.stop()
    assert "Address already in use" in str(err.value)
    assert str(broker.controller_port) in str(err.value)
    assert "NOP" not in str(err.value)

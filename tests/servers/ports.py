"""Loopback ports for the servers the tests start, that nothing else takes before the server
binds them.

Asking the kernel for port 0 and closing the socket hands out a port of the ephemeral range: the
range every outgoing connection on the machine draws its own port from. Between that close and
the server's bind, any client (the suite opens thousands) may be given the same port, and the
server exits with "Address already in use" (a CI run lost a Kafka broker that way). Two test
workers may also pick the same port at once.

So a port here comes from below the ephemeral range, where the kernel never puts an outgoing
connection, is claimed across processes by a file in a claims directory (a claim whose owner has
exited may be taken over), and is checked free by binding it.

The claims directory is the user's own (``gpuslo-test-ports-UID`` in the temporary directory,
mode 0700, refused when it is not a directory this user owns): one shared by every user was
created with the first user's umask, and every other user's test servers failed on it with
PermissionError. Another user's servers are guarded by the bind check alone. A claim names its
owner by process id, start time and PID namespace: a process id used again by a later process
does not keep a dead owner's claim, and a claim of another PID namespace (a container sharing
the temporary directory), whose owner cannot be looked up here, holds for a day."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import stat
import tempfile
import time
from pathlib import Path

CLAIMS = Path(tempfile.gettempdir()) / f"gpuslo-test-ports-{os.getuid()}"
FOREIGN_CLAIM_S = 86400.0  # how long a claim of another PID namespace holds (test servers live minutes)
LOWEST = 20000  # above the well-known and registered ports most daemons listen on


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports (Linux's default when unreadable)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), "" when
    it cannot be read (no /proc, or no such process)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat_line.rpartition(")")[2].split()  # the command name before ')' may hold spaces
    return fields[19] if len(fields) > 19 else ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_text(pid: int | None = None) -> str:
    """What a claim file holds: ``PID START PIDNS`` of its owner (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid} {_start_time(pid) or '-'} {_pid_namespace() or '-'}"


def _held(text: str, age_s: float) -> bool:
    """Whether the claim ``text`` (``PID [START [PIDNS]]``, a claim of an earlier version holds its
    PID alone) still holds: its owner is alive (the same process: a process id used again by a
    later one is not its owner), or cannot be looked up here (another PID namespace: for
    FOREIGN_CLAIM_S). ValueError for a text no claim has."""
    parts = text.split()
    if not parts:
        return False  # torn before its first write: nobody's
    pid = int(parts[0])
    if pid <= 0 or len(parts) > 3:
        raise ValueError(text)
    ns = parts[2] if len(parts) > 2 else "-"
    if ns != "-" and ns != (_pid_namespace() or "-"):
        return age_s < FOREIGN_CLAIM_S
    if not _pid_alive(pid):
        return False
    start = parts[1] if len(parts) > 1 else "-"
    now = _start_time(pid)
    return start == "-" or not now or now == start  # another start time: the id was used again


def _claims_dir() -> Path:
    """The claims directory, made this user's own (not a symlink, not another user's)."""
    CLAIMS.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(CLAIMS)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(
            f"{CLAIMS}: the test ports' claims directory is not a directory of this user (uid {os.getuid()}, "
            f"found uid {st.st_uid}, {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a directory'}): "
            "remove it, or set TMPDIR to a directory of your own"
        )
    return CLAIMS


def _claim(port: int) -> bool:
    """Write the port's claim file for this process, under a lock on the claims directory (so
    two processes never both take over one dead owner's claim); a claim whose owner has exited
    is taken over."""
    claims = _claims_dir()
    path = claims / str(port)
    with open(claims / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = path.read_text()
            age_s = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            text, age_s = "", 0.0
        except (OSError, ValueError):  # ValueError: bytes that are not UTF-8
            return False  # not a claim this code wrote: not ours to judge
        try:
            if text.strip() in (owner_text(), str(os.getpid())) or _held(text, age_s):
                return False  # this process's own claims are not given twice
        except ValueError:
            return False  # not a claim this code wrote: not ours to judge
        path.write_text(owner_text())
        return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def candidates() -> list[tuple[int, int]]:
    """The spans to draw from: above LOWEST and outside the ephemeral range; the whole of it
    above LOWEST where the ephemeral range leaves too little outside it (then only the claim
    and the bind check guard)."""
    lo, hi = ephemeral_range()
    spans = [(a, b) for a, b in ((LOWEST, min(lo - 1, 65535)), (max(hi + 1, LOWEST), 65535)) if b - a >= 0]
    if sum(b - a + 1 for a, b in spans) < 1000:
        return [(LOWEST, 65535)]
    return spans


def free_port(rng: random.Random | None = None) -> int:
    """A port outside the ephemeral range, claimed for this process and free to bind now."""
    draw = rng or random.SystemRandom()
    spans = candidates()
    weights = [b - a + 1 for a, b in spans]
    for _ in range(500):
        a, b = draw.choices(spans, weights)[0]
        port = draw.randint(a, b)
        if not _claim(port):
            continue
        if _bindable(port):
            return port
        (CLAIMS / str(port)).unlink(missing_ok=True)  # held by something else: leave it be
    raise RuntimeError(f"no free loopback port in {spans} after 500 tries")

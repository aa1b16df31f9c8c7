"""Loopback ports for the servers the tests start, that nothing else takes before the server
binds them.

Asking the kernel for port 0 and closing the socket hands out a port of the ephemeral range: the
range every outgoing connection on the machine draws its own port from. Between that close and
the server's bind, any client (the suite opens thousands) may be given the same port, and the
server exits with "Address already in use" (a CI run lost a Kafka broker that way). Two test
workers may also pick the same port at once.

So a port here comes from below the ephemeral range, where the kernel never puts an outgoing
connection, is claimed across processes by a file created exclusively in a shared directory
(a claim whose owner has exited may be taken over), and is checked free by binding it."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

CLAIMS = Path(tempfile.gettempdir()) / "gpuslo-test-ports"
LOWEST = 20000  # above the well-known and registered ports most daemons listen on


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports (Linux's default when unreadable)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(port: int) -> bool:
    """Write the port's claim file for this process, under a lock on the claims directory (so
    two processes never both take over one dead owner's claim); a claim whose owner has exited
    is taken over."""
    CLAIMS.mkdir(mode=0o777, exist_ok=True)
    path = CLAIMS / str(port)
    with open(CLAIMS / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            owner = int(path.read_text() or "0")
        except FileNotFoundError:
            owner = 0
        except (OSError, ValueError):
            return False  # not a claim this code wrote: not ours to judge
        if owner and (owner == os.getpid() or _alive(owner)):
            return False
        path.write_text(str(os.getpid()))
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

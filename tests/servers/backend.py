"""Which back-end the integration fixtures start their servers on: local processes from packages
(Kafka jars, Debian's Alertmanager and clickhouse-server 18.16), or containers through
testcontainers where a Docker engine answers.

``GPUSLO_TEST_SERVERS``:

- ``local``: processes only; the tests that need a container (ClickHouse >= 24.8, Grafana) are
  skipped with that reason.
- ``containers``: containers; an engine that does not answer is an error of the run (asked for,
  not there), never a quiet fallback.
- ``auto`` (unset or empty): containers iff the engine answers ``GET /_ping`` with ``OK`` within
  :data:`PING_TIMEOUT_S`; else local processes, and the container-only tests are skipped with the
  reason ("no Docker engine reachable at ...").

The engine is the one the Docker CLI and testcontainers use: ``DOCKER_HOST`` (``unix://PATH``
or ``tcp://HOST[:PORT]``), else ``unix:///var/run/docker.sock``. The ping is the Docker Engine
API's own (``/_ping``: 200 and the body ``OK``), spoken here over a plain socket within one
total deadline, so choosing needs neither the docker package nor testcontainers. An engine this
cannot probe (``ssh://``, ``npipe://``, TLS with ``DOCKER_TLS_VERIFY``) is used when
``containers`` is asked for (testcontainers then connects itself, and fails loudly if it
cannot), and not guessed at by ``auto``."""

from __future__ import annotations

import enum
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ENV = "GPUSLO_TEST_SERVERS"
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
PING_TIMEOUT_S = 1.0
MAX_REPLY = 64 * 1024  # a /_ping reply is a few hundred bytes


class Choice(enum.Enum):
    LOCAL = "local"
    CONTAINERS = "containers"
    AUTO = "auto"


class BackendError(ValueError):
    """A value of GPUSLO_TEST_SERVERS that names no back-end, or containers asked for and no engine."""


@dataclass(frozen=True)
class Backend:
    """The outcome: ``containers`` is True when the fixtures start containers; ``reason`` says why
    (the skip reason of the container-only tests when it is False)."""

    containers: bool
    reason: str
    docker_host: str


def parse_choice(env: Mapping[str, str]) -> Choice:
    raw = env.get(ENV, "")
    if raw == "":
        return Choice.AUTO
    try:
        return Choice(raw)
    except ValueError:
        allowed = ", ".join(c.value for c in Choice)
        raise BackendError(
            f"{ENV}={raw!r} is not a back-end; allowed: {allowed} (unset means auto)"
        ) from None


def docker_host(env: Mapping[str, str]) -> str:
    return env.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


def unprobeable(host: str, env: Mapping[str, str]) -> str | None:
    """Why the engine at ``host`` cannot be pinged here, or None when it can."""
    try:
        scheme = urlsplit(host).scheme
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        return f"not probed here: {host!r} is not a URL ({exc})"
    if scheme not in ("unix", "tcp"):
        return f"the {scheme or '(no scheme)'}:// transport is not probed here (unix:// and tcp:// are)"
    if scheme == "tcp" and env.get("DOCKER_TLS_VERIFY"):
        return "a TLS engine (DOCKER_TLS_VERIFY) is not probed here"
    return None


def _connect(host: str, timeout_s: float) -> socket.socket:
    u = urlsplit(host)
    if u.scheme == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect(host[len("unix://") :])  # the path as written, as docker-py takes it
        except OSError:
            s.close()
            raise
        return s
    if u.scheme == "tcp":
        try:
            port = 2375 if u.port is None else u.port  # the Docker CLI's default for plain tcp://
        except ValueError:
            raise OSError(f"{host!r} has no valid port") from None
        if port == 0:  # not "the default": no engine listens on port 0
            raise OSError(f"{host!r} has no valid port")
        if not u.hostname:
            raise OSError(f"{host!r} names no host")
        return _tcp(u.hostname, port, time.monotonic() + timeout_s)
    raise OSError(unprobeable(host, {}))


def _resolve(name: str, port: int, deadline: float) -> list[Any]:
    """getaddrinfo within the deadline (TimeoutError): the resolver takes no timeout, and a slow
    or dead DNS server would hold the choice for its own retries (seconds each)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(socket.getaddrinfo(name, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError, ValueError) as exc:
            out.append(exc)

    t = threading.Thread(target=run, name="docker-host-resolve", daemon=True)  # left behind if stuck
    t.start()
    t.join(max(deadline - time.monotonic(), 0.0))
    if not out:
        raise TimeoutError
    if isinstance(out[0], BaseException):
        raise out[0]
    return list(out[0])


def _tcp(name: str, port: int, deadline: float) -> socket.socket:
    """A connection to the first address of ``name`` that answers, all within the deadline (a
    name with several addresses, each dropped silently, cannot take the timeout once each)."""
    last: OSError = OSError(f"{name!r} has no address")
    for family, kind, proto, _, addr in _resolve(name, port, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        s = socket.socket(family, kind, proto)
        s.settimeout(left)
        try:
            s.connect(addr)
            return s
        except OSError as exc:
            s.close()
            if isinstance(exc, TimeoutError):
                raise
            last = exc
    raise last


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                n = int(value.strip())
            except ValueError:
                return None
            return n if n >= 0 else None
    return None


def _read_reply(s: socket.socket, deadline: float) -> bytes:
    """Until the body is complete, the peer closes, MAX_REPLY bytes, or the deadline (TimeoutError:
    a peer that trickles bytes cannot hold the choice longer than one timeout in all)."""
    data = b""
    while len(data) < MAX_REPLY:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        s.settimeout(left)
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = _content_length(head) if sep else None
        if length is not None and len(body) >= length:
            break
    return data


def ping(host: str, timeout_s: float = PING_TIMEOUT_S) -> str | None:
    """None when the engine at ``host`` answers ``/_ping`` with 200 ``OK``; else why not (one line).
    Bounded: connecting, sending and reading the reply take at most ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    try:
        with _connect(host, timeout_s) as s:
            s.settimeout(max(deadline - time.monotonic(), 0.001))
            s.sendall(b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n")
            reply = _read_reply(s, deadline)
    except TimeoutError:
        return f"no answer to /_ping within {timeout_s:g} s"
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        return f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"
    head, _sep, body = reply.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    parts = status.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        return f"not an HTTP reply to /_ping: {status[:80]!r}"
    if parts[1] != "200":
        return f"/_ping answered {status[:80]!r}"
    if b"chunked" in head.lower():  # Transfer-Encoding: chunked: "2\r\nOK\r\n0\r\n\r\n"
        body = body.split(b"\r\n")[1] if body.count(b"\r\n") >= 2 else body
    if body.strip() != b"OK":
        return f"/_ping answered 200 with {body[:40]!r}, not OK"
    return None


def select(env: Mapping[str, str], probe: Callable[[str], str | None] = ping) -> Backend:
    """The back-end for this run (see the module's text). Raises BackendError for a bogus value,
    and for ``containers`` when the engine does not answer."""
    choice = parse_choice(env)
    host = docker_host(env)
    if choice is Choice.LOCAL:
        return Backend(False, f"{ENV}=local: local processes only", host)
    cannot = unprobeable(host, env)
    if cannot is not None:
        if choice is Choice.CONTAINERS:  # asked for: testcontainers connects (and fails loudly)
            return Backend(True, f"{ENV}=containers: the engine at {host} ({cannot})", host)
        return Backend(False, f"the Docker engine at {host} is not probed by auto ({cannot}): "
                              f"set {ENV}=containers to use it", host)  # fmt: skip
    why = probe(host)
    if why is None:
        return Backend(True, f"a Docker engine answers at {host}", host)
    reason = f"no Docker engine reachable at {host} ({why})"
    if choice is Choice.CONTAINERS:
        raise BackendError(f"{ENV}=containers but {reason}")
    return Backend(False, reason, host)

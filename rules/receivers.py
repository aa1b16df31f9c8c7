"""Alert receivers: where a notification goes, and one delivery attempt to it.

A receiver's URL is a secret (Basic credentials in ``user:password@``; a Slack webhook's path is
the token itself): it is held here, never written to the outbox, never logged. Logs and
summaries name a receiver by ``name`` (kind plus a hash of its URL, stable across restarts)
and ``redacted`` (scheme, host and port only).

One attempt is bounded by a total deadline: connecting, sending and reading the status line
all together, whatever the peer does (a receiver trickling one byte a second is cut at the
deadline, not at a per-read timeout). A redirect is never followed: a POST redirected is a
failed delivery. The result is classified once, here:

- ``sent``: 2xx;
- ``transient`` (retried with backoff): 408, 429, 5xx, timeouts, connection and TLS errors,
  a response that is not HTTP;
- ``permanent`` (reported, counted, not retried): 3xx and every other 4xx.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote, urlsplit

Kind = Literal["alertmanager", "webhook"]
OutcomeKind = Literal["sent", "transient", "permanent"]


class ReceiverError(ValueError):
    """A receiver URL that cannot be used (the message never holds the URL's secrets)."""


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    status: int | None  # HTTP status, None when no response came
    detail: str
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Receiver:
    kind: Kind
    url: str = field(repr=False)  # the target of the POST (Alertmanager: base + /api/v2/alerts)
    name: str
    redacted: str
    host: str = field(repr=False)
    port: int = field(repr=False)
    tls: bool = field(repr=False)
    target: str = field(repr=False)  # path and query sent in the request line
    authorization: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, kind: Kind, url: str) -> Receiver:
        url = url.strip()
        label = f"{kind} URL"
        try:  # a bracket that does not close ("http://[::1") is refused by urlsplit itself
            parts = urlsplit(url)
        except ValueError as exc:
            raise ReceiverError(f"{label}: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise ReceiverError(f"{label}: scheme must be http or https, not {parts.scheme or 'none'!r}")
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            raise ReceiverError(f"{label}: bad port") from None
        if not host:
            raise ReceiverError(f"{label}: no host")
        if ":" not in host:  # a name (not an IPv6 address), as socket encodes it at each connect
            try:
                host.encode("idna")
            except UnicodeError:  # a..b, a label over 63 characters: each delivery failed, retried
                raise ReceiverError(f"{label}: the host is no name a resolver reads ({_IDNA})") from None
        if any(c.isspace() or ord(c) < 32 for c in url):
            raise ReceiverError(f"{label}: contains whitespace or control characters")
        path = parts.path or "/"
        if kind == "alertmanager":
            path = path.rstrip("/") + "/api/v2/alerts"
        target = path + (f"?{parts.query}" if parts.query else "")
        auth = None
        if parts.username is not None or parts.password is not None:
            user, pw = unquote(parts.username or ""), unquote(parts.password or "")
            auth = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
        tls = parts.scheme == "https"
        port = port or (443 if tls else 80)
        shown = f"{parts.scheme}://{host if ':' not in host else f'[{host}]'}:{port}"
        digest = hashlib.sha256(f"{kind} {url}".encode()).hexdigest()[:10]
        return cls(kind, url, f"{kind}-{digest}", shown, host, port, tls, target, auth)

    def secrets(self) -> list[str]:
        """Strings that must never reach a log: the URL, its credentials in every encoding
        they travel in, and (webhooks: the path is the token) the path and query."""
        parts = urlsplit(self.url)
        # an Alertmanager URL without credentials is no secret (masking it would only blind the logs)
        out = [self.url] if self.authorization or self.kind == "webhook" else []
        if parts.password:
            out += [parts.password, unquote(parts.password)]
        if parts.username and parts.password is not None:
            out.append(f"{parts.username}:{parts.password}")
        if self.authorization:
            out.append(self.authorization.removeprefix("Basic "))
        if self.kind == "webhook":
            out += [p for p in (parts.path, parts.query, self.target) if len(p) >= 8]
            # each long part of the path alone too (a receiver's error page may echo its token)
            out += [
                seg
                for seg in re.split(r"[/?&=]", f"{parts.path}?{parts.query}")
                if len(seg) >= SEGMENT_SECRET
            ]
        return [s for s in dict.fromkeys(out) if s]


def classify(status: int) -> OutcomeKind:
    if 200 <= status < 300:
        return "sent"
    if status in (408, 429) or 500 <= status < 600:
        return "transient"
    return "permanent"  # 1xx as a final answer, 3xx (never followed), other 4xx


Post = Callable[[Receiver, bytes, float], Outcome]


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        s = float(value.strip())
    except ValueError:
        return None  # an HTTP date: ignored, our own backoff applies
    return s if 0 <= s < 86400 else None


# a part of a webhook's path this long is masked in the logs by itself (a token), shorter ones
# (``services``, ``hooks``) only within the whole path
SEGMENT_SECRET = 16


def _said(text: object, limit: int = 200) -> str:
    """What a receiver said (its reason phrase, its error body, a malformed answer quoted by
    the exception), fit for one log line: control characters escaped, at most ``limit``
    characters. A receiver writing ``\r\n`` in its answer wrote lines of its own into the log."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(str(text).split()))
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _snippet(resp: http.client.HTTPResponse) -> str:
    """The start of an error body, for the log; the status alone decides the outcome (a body
    cut by the deadline does not turn a 400 into a timeout)."""
    try:
        text = resp.read(300).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException, ValueError):
        return ""
    return _said(text)


def http_post(receiver: Receiver, body: bytes, deadline_s: float) -> Outcome:
    """One POST of ``body`` (JSON), all of it within ``deadline_s`` seconds."""
    start = time.monotonic()
    conn: http.client.HTTPConnection
    if receiver.tls:
        conn = http.client.HTTPSConnection(
            receiver.host, receiver.port, timeout=deadline_s, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(receiver.host, receiver.port, timeout=deadline_s)
    expired = threading.Event()

    def abort() -> None:  # the total deadline: cut whatever read or write is in progress
        expired.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(deadline_s, abort)
    watchdog.daemon = True
    watchdog.start()
    headers = {"Content-Type": "application/json", "User-Agent": "gpuslo-rules"}
    if receiver.authorization:
        headers["Authorization"] = receiver.authorization
    try:
        conn.request("POST", receiver.target, body=body, headers=headers)
        resp = conn.getresponse()
        status = resp.status
        kind = classify(status)
        detail = f"HTTP {status} {_said(resp.reason, 80)}".strip()
        if 300 <= status < 400:
            detail += " (a redirect is not followed for a POST: fix the receiver URL)"
        elif kind != "sent":
            snippet = _snippet(resp)
            if snippet:
                detail += f": {snippet}"
        return Outcome(kind, status, detail, _retry_after(resp.getheader("Retry-After")))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # The watchdog and the socket's own timeout are both the deadline: whichever fires first
        # (a loaded machine delays the timer thread), the outcome and its words are the same.
        if expired.is_set() or isinstance(exc, TimeoutError) or time.monotonic() - start >= deadline_s:
            return Outcome(
                "transient", None, f"no complete answer within the total deadline of {deadline_s:g} s"
            )
        what = type(exc).__name__
        return Outcome("transient", None, f"{what} after {time.monotonic() - start:.1f} s: {_said(exc)}")
    finally:
        watchdog.cancel()
        conn.close()


ENV = {"alertmanager": "GPUSLO_ALERTMANAGER_URL", "webhook": "GPUSLO_WEBHOOK_URL"}


def urls_in(text: str) -> list[str]:
    """URLs in a file or variable: one per line (or separated by blanks); ``#`` starts a comment."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        out += line.split()
    return out


_IDNA = "a label empty or over 63 characters, or a character IDNA refuses"


def from_sources(kind: Kind, flags: list[str] | None, files: list[str] | None,
                 environ: dict[str, str]) -> tuple[list[Receiver], list[str]]:  # fmt: skip
    """The receivers of ``kind`` from command-line URLs, URL files and the environment
    (``GPUSLO_ALERTMANAGER_URL`` / ``GPUSLO_WEBHOOK_URL``), and warnings to log (secrets on the
    command line, a URL file others can read). Errors never quote a URL."""
    found: list[Receiver] = []
    warnings: list[str] = []
    for i, url in enumerate(flags or []):
        r = _parse(kind, url, f"--{kind} #{i + 1}")
        found.append(r)
        if r.authorization or kind == "webhook":
            warnings.append(
                f"--{kind}: the URL {'holds credentials' if r.authorization else 'is a secret'} and the command line "
                f"is visible to every local user (ps, /proc); use --{kind}-url-file or {ENV[kind]}"
            )
    for path in files or []:
        try:
            with open(path, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ReceiverError(f"--{kind}-url-file {path}: cannot read: {why}") from None
        urls = urls_in(text)
        if not urls:
            raise ReceiverError(f"--{kind}-url-file {path}: holds no URL")
        found += [_parse(kind, u, f"--{kind}-url-file {path}") for u in urls]
        if mode & 0o077:
            warnings.append(
                f"--{kind}-url-file {path} is readable by other users (mode {mode & 0o777:o}); chmod 600 it"
            )
    env = environ.get(ENV[kind], "")
    found += [_parse(kind, u, f"${ENV[kind]}") for u in urls_in(env)]
    return found, warnings


def _parse(kind: Kind, url: str, where: str) -> Receiver:
    try:
        return Receiver.parse(kind, url)
    except ReceiverError as exc:
        raise ReceiverError(f"{where}: {exc}") from None

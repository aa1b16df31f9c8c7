"""HTTP reads bounded in their whole time and in their size.

``urlopen``'s timeout bounds each socket operation, not the request: a server (or a proxy in
the way) that trickles a byte now and then keeps every ``recv`` under it for ever, and a body
read whole is as long as the server makes it. Every HTTP read of the project goes through
here: a :class:`Deadline` shuts the request's sockets when its time is spent, so the blocked
read returns and the request fails with ``TimeoutError``; a body past its bound is an
``OSError``; an error answer's body (what ``HTTPError.read()`` gives the caller) is read under
the same deadline and cut at :data:`ERROR_BODY_BYTES`.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import socket
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import IO, Any

#: the most of an error answer's body kept (a message for a log line, never a page)
ERROR_BODY_BYTES = 64 << 10


class Deadline:
    """A request's whole time: at ``timeout_s`` after it began every socket it opened is shut,
    so a read blocked on a server that trickles returns. :meth:`cancel` when done."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.passed = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
            if self.passed:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.passed = True
            for sock in self._socks:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()

    def __enter__(self) -> Deadline:
        return self

    def __exit__(self, *_: object) -> None:
        self.cancel()


def _shut(sock: socket.socket) -> None:
    # the plain socket's shutdown (an SSLSocket's would first unwrap, talking to the peer); one
    # closed already raises OSError
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def opener(deadline: Deadline, context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """urllib's opener (redirects, proxies, TLS with ``context``) whose connections ``deadline``
    watches. Only http and https are opened, a redirect's target too: ``build_opener``'s ftp (a
    redirect to ``ftp://`` followed, its sockets unwatched: a trickling FTP server held the
    caller for ever), file and data handlers are not in it."""

    def connection(
        address: tuple[str, int], timeout: float | None = None, source_address: tuple[str, int] | None = None
    ) -> socket.socket:
        # watched from its creation: a proxy's CONNECT tunnel is set up on it before connect()
        # returns (a proxy that trickled its answer to CONNECT held the caller for ever)
        sock = socket.create_connection(address, timeout, source_address)
        deadline.watch(sock)
        return sock

    class _Http(http.client.HTTPConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = connection

    class _Https(http.client.HTTPSConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = connection

        def connect(self) -> None:
            super().connect()  # the TLS socket replaces (detaches) the watched one
            deadline.watch(self.sock)

    class _HttpHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(_Http, req)

    class _HttpsHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(_Https, req, context=self._context)  # type: ignore[attr-defined]

    director = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),  # HTTP(S)_PROXY and NO_PROXY, as build_opener
        urllib.request.UnknownHandler(),  # any other scheme: URLError
        _HttpHandler(),
        _HttpsHandler(context=context),
        urllib.request.HTTPDefaultErrorHandler(),
        _Redirects(),
        urllib.request.HTTPErrorProcessor(),
    ):
        director.add_handler(handler)
    return director


#: the headers that say who the caller is: never sent on to another origin (a bearer token
#: redirected to another host, or from https to http, is that host's to use)
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urllib.parse.urlsplit(url)
    scheme = u.scheme.lower()
    return scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(scheme)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects (at most 10, loops refused), to http and https only, and without the
    caller's credentials where the origin (scheme, host, port) changes, as Go's client and
    requests drop them: urllib sent them on to any host."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            fp.close()
            raise urllib.error.URLError(f"redirected to {newurl[:200]!r}: only http and https are followed")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(new.full_url) != _origin(req.full_url):
            for name in [k for k in new.headers if k.lower() in CREDENTIAL_HEADERS]:
                del new.headers[name]
        return new


def _bounded(exc: urllib.error.HTTPError) -> urllib.error.HTTPError:
    """The same error with its body read now (at most ``ERROR_BODY_BYTES``), so a caller's
    ``read()`` neither waits past the deadline nor holds a page of any length."""
    try:
        body = exc.read(ERROR_BODY_BYTES)
    except (OSError, http.client.HTTPException, ValueError):
        body = b""
    finally:
        exc.close()
    return urllib.error.HTTPError(exc.url, exc.code, exc.msg, exc.hdrs, io.BytesIO(body))


def read_url(
    req: str | urllib.request.Request, timeout_s: float, max_bytes: int, context: ssl.SSLContext | None = None
) -> bytes:
    """The body at ``req``, read whole within ``timeout_s`` and at most ``max_bytes`` long.
    ``TimeoutError`` for the time, an ``HTTPError`` for an error answer (its body bounded), an
    ``OSError`` otherwise: a longer body, a body cut short (before its ``Content-Length``, or a
    chunk), an answer that is not HTTP, what urllib raises (``URLError``)."""
    deadline = Deadline(timeout_s)
    try:
        try:
            with opener(deadline, context).open(req, timeout=timeout_s) as r:
                body: bytes = r.read(max_bytes + 1)
                short = r.length  # of a Content-Length, the bytes that never came (None: none said)
        except urllib.error.HTTPError as exc:
            raise _bounded(exc) from None
    except urllib.error.HTTPError:
        raise
    except (OSError, http.client.HTTPException) as exc:
        if deadline.passed:
            raise TimeoutError(f"not read whole within {timeout_s:g} s") from exc
        if isinstance(exc, OSError):
            raise
        # IncompleteRead (a chunked body cut short), a status line or headers that are no HTTP:
        # the caller's one family of transport failures (the reclaim actor's traceback otherwise)
        raise OSError(f"no whole HTTP answer: {type(exc).__name__}: {exc}"[:300]) from exc
    finally:
        deadline.cancel()
    if deadline.passed:  # shut while reading a body of no stated length: the end it read is none
        raise TimeoutError(f"not read whole within {timeout_s:g} s")
    if len(body) > max_bytes:
        raise OSError(f"answer longer than {max_bytes} bytes")
    if short:  # http.client returns what came before the connection closed, as if it were all
        raise OSError(
            f"answer cut short: {len(body)} bytes of the {len(body) + short} its Content-Length said"
        )
    return body


def open_stream(
    req: urllib.request.Request, timeout_s: float, whole_s: float, context: ssl.SSLContext | None = None
) -> tuple[http.client.HTTPResponse, Deadline]:
    """A response to read as a stream (a watch): each read bounded by ``timeout_s``, the whole
    by ``whole_s`` (its sockets shut then: the stream ends). The caller cancels the deadline
    when it is done. An error answer raises as in :func:`read_url`."""
    deadline = Deadline(whole_s)
    try:
        r: http.client.HTTPResponse = opener(deadline, context).open(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        try:  # its body read under the deadline (cancelled first, a trickling body held the watcher)
            raise _bounded(exc) from None
        finally:
            deadline.cancel()
    except BaseException:
        deadline.cancel()
        raise
    return r, deadline

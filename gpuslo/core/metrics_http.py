"""The HTTP server of a ``/metrics`` page (the agent's, the ingest's): prometheus-client's WSGI
app behind a server a hostile or unlucky client cannot wear down.

prometheus-client's own ``start_http_server`` starts a thread per connection with no bound on
their number and no timeout: a client that opens a connection and sends nothing (or a byte now
and then) holds a thread for ever, and a few thousand of them exhaust the threads (or the
pod's pid limit) of the process the page belongs to. It also answers an ``Accept`` header
whose ``version`` is not a number with a 500 and a traceback on stderr. Here:

- every exchange has a whole deadline (:data:`DEADLINE_S`: the request read, the page made
  and written): past it the connection is shut (:class:`gpuslo.core.http.Deadline`, the one
  the project's HTTP reads use), however the client trickles;
- at most :data:`MAX_CONNECTIONS` are served at once, and at most :data:`MAX_PER_PEER` of one
  peer address: one client that holds connections open (idle or trickling, opened again as
  they are cut) held every slot, and Prometheus' scrapes were refused for as long as it went on;
  one more is closed unanswered, counted (``refused``) and logged (once, then once a minute);
- an ``Accept`` media range whose ``version`` is not dotted digits is not offered (the page
  comes in the default text format, as for a range not understood);
- the app's failure is a 500 with one line, logged (once a minute), never a traceback; a
  client gone, slow or malformed costs its own connection only (debug log).
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.registry import Collector

from gpuslo.core.http import Deadline

log = logging.getLogger(__name__)

#: the longest one exchange may take: a scrape's own timeout is 10 s by default in Prometheus
DEADLINE_S = 10.0
#: connections served at once: Prometheus (a pair of them), probes, a person with curl
MAX_CONNECTIONS = 32
#: connections one peer address is served at once (a quarter of the slots: the others stay free
#: for the scrapers, whatever one client does)
MAX_PER_PEER = 8
_LOG_EVERY_S = 60.0
_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*")

StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class MetricsServer(ThreadingMixIn, WSGIServer):
    """``registry``'s page on ``addr:port`` (``OSError`` when it cannot listen there). Served
    by :meth:`start` (a daemon thread); :meth:`close` stops it and releases the port."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # the listen backlog (socketserver's 5 dropped a burst's SYNs: 1 s retries)

    def __init__(
        self,
        port: int,
        addr: str,
        registry: Collector,
        deadline_s: float = DEADLINE_S,
        max_connections: int = MAX_CONNECTIONS,
        max_per_peer: int = MAX_PER_PEER,
    ) -> None:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]  # an IPv6 address listens on IPv6, as prometheus-client's
        self.address_family = family
        self.deadline_s = deadline_s
        self.max_connections = max_connections
        self.max_per_peer = max(1, min(max_per_peer, max_connections))
        self.refused = 0  # connections closed unanswered: every slot, or the peer's share, taken
        self._slots = threading.BoundedSemaphore(max_connections)
        self._peers: dict[str, int] = {}  # peer address -> its connections being served
        self._peers_lock = threading.Lock()
        self._said: dict[str, float] = {}  # what was logged → when
        self._thread: threading.Thread | None = None
        super().__init__((str(sockaddr[0]), port), _Handler)
        self.set_app(_guarded(make_wsgi_app(registry), self._say))

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port (the exchanges in progress end with their deadline)."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = _peer(client_address)
        if not self._slots.acquire(blocking=False):
            self._refuse(request, "busy", "%d connections being served", self.max_connections)
            return
        with self._peers_lock:
            held = self._peers.get(peer, 0)
            if held < self.max_per_peer:
                self._peers[peer] = held + 1
        if held >= self.max_per_peer:
            self._slots.release()
            self._refuse(request, "peer", "%s holds %d connections already", peer, held)
            return
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:  # no thread started (the process is out of threads)
            self._release(peer)
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(_peer(client_address))

    def _release(self, peer: str) -> None:
        with self._peers_lock:
            left = self._peers.pop(peer, 1) - 1
            if left > 0:
                self._peers[peer] = left
        self._slots.release()

    def _refuse(self, request: Any, key: str, why: str, *args: Any) -> None:
        self.refused += 1
        self._say(key, logging.WARNING, f"/metrics: {why}; one more closed unanswered (%d so far)",
                  *args, self.refused)  # fmt: skip
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone, too slow or malformed: its connection ends, the server goes on."""
        log.debug("/metrics: connection from %s ended: %r", client_address, sys.exc_info()[1])

    def _say(self, key: str, level: int, msg: str, *args: Any) -> None:
        """Log ``msg``, at most once a minute per ``key``."""
        now = time.monotonic()
        last = self._said.get(key)
        if last is None or now - last >= _LOG_EVERY_S:
            self._said[key] = now
            log.log(level, msg, *args)


def _peer(client_address: Any) -> str:
    """The address a connection came from (IPv4 or IPv6, without its port)."""
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else "?"


class _Handler(WSGIRequestHandler):
    """One exchange under the server's deadline; no access log, no traceback on stderr."""

    server: MetricsServer

    def setup(self) -> None:
        self._deadline = Deadline(self.server.deadline_s)
        self._deadline.watch(self.request)  # shut when the time is spent: a blocked read returns
        super().setup()
        self.connection.settimeout(self.server.deadline_s)  # and no single read or write waits longer

    def finish(self) -> None:
        try:
            with contextlib.suppress(OSError):
                super().finish()
        finally:
            self._deadline.cancel()

    def log_message(self, format: str, *args: Any) -> None:
        """No access log."""

    def get_stderr(self) -> Any:
        # wsgiref prints a failed write's traceback there (the client went away mid-page)
        return _Discard()


class _Discard:
    def write(self, s: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _guarded(app: App, say: Callable[..., None]) -> App:
    """``app`` with the ``Accept`` ranges it cannot read left out, and its failure a 500."""

    def guarded(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        accept = environ.get("HTTP_ACCEPT")
        if accept:
            environ["HTTP_ACCEPT"] = offered(accept)
        try:
            return app(environ, start_response)
        except Exception as exc:  # a collector's failure: the page, not the server
            say("app", logging.ERROR, "/metrics failed: %s: %s", type(exc).__name__, exc)
            start_response(
                "500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")], sys.exc_info()
            )
            return [f"# /metrics failed: {type(exc).__name__}\n".encode()]

    return guarded


def offered(accept: str) -> str:
    """The media ranges of an ``Accept`` header whose ``version`` (if any) is dotted digits:
    prometheus-client compares the parts of any other with numbers and fails (``TypeError``)."""
    keep = []
    for media in accept.split(","):
        params = [tok.strip().split("=", 1) for tok in media.split(";")[1:] if "=" in tok]
        if all(not v.strip() or _VERSION.fullmatch(v.strip()) for k, v in params if k == "version"):
            keep.append(media)
    return ",".join(keep)

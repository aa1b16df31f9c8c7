"""A TCP proxy in front of a real server that can reset every connection through it at once, or
each one as its client next sends: the server stays up, the connections die mid-stream (an insert
half sent, a reply half read), as when a load balancer, a NAT table or the server's own
connection handling drops them."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

from tests.servers.ports import free_port


class CuttingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = free_port()
        self.cuts = 0
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._peer: dict[socket.socket, socket.socket] = {}  # each client socket's server socket
        self._armed: dict[socket.socket, int] = {}  # client sockets to reset: the bytes they may send first
        self.resets_on_send = 0
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._live |= {client, server}
                self._peer[client] = server
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), name="proxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if src in self._armed:  # reset it once it sends more than its allowance
                    with self._lock:
                        left = self._armed.get(src)
                        if left is not None:
                            self._armed[src] = left - len(data)
                        reset = left is not None and left - len(data) < 0
                        self.resets_on_send += reset
                    if reset:
                        self._reset([src, dst])
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            for s in socks:
                self._live.discard(s)
                self._peer.pop(s, None)
                self._armed.pop(s, None)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self) -> int:
        """Reset (RST, not FIN) every connection now open through the proxy; how many there were."""
        with self._lock:
            live = list(self._live)
        self._reset(live)
        self.cuts += 1
        return len(live) // 2

    def arm(self, allowance: int = 2048) -> int:
        """Reset each connection now open once its client has sent more than ``allowance`` bytes
        more: in its next insert however long it idles first (a timer's cut can miss a client
        between writes), and not at a ping (clickhouse-driver pings an idle connection before
        a query and reconnects silently when the ping fails). Connections opened later are not
        affected; one armed already keeps what it has left. How many were armed anew."""
        with self._lock:
            clients = [c for c in self._peer if c in self._live and c not in self._armed]
            for c in clients:
                self._armed[c] = allowance
        return len(clients)

    def _reset(self, socks: list[socket.socket]) -> None:
        with self._lock:
            self._live -= set(socks)
            for s in socks:
                self._peer.pop(s, None)
                self._armed.pop(s, None)
        for s in socks:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RD)  # wakes its pump (no FIN is sent); the close sends the RST
            s.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self.cut()

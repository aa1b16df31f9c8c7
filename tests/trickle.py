"""Small TCP servers that speak HTTP (or anything) as badly as a test needs."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class Raw:
    """A TCP server that gives each connection to ``answer`` (a server that speaks HTTP, or FTP,
    or anything, as badly as a test needs)."""

    def __init__(self, answer: Callable[[socket.socket], None], host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.answer = answer
        self.port = self.sock.getsockname()[1]
        self.base = f"http://{host}:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        with c, contextlib.suppress(OSError):
            self.answer(c)

    def close(self) -> None:
        self.sock.close()


class Trickle(Raw):
    """An HTTP server that answers at once, then sends its body a piece at a time for ever: every
    read ends within any socket timeout, the body never does (a server gone wrong, or a proxy)."""

    def __init__(self, status: str = "200 OK", chunk: bytes = b"# more\n", path: str = "/metrics") -> None:
        self.status = status
        self.chunk = chunk
        self.stop = threading.Event()
        super().__init__(self._trickle)
        self.url = self.base + path

    def _trickle(self, c: socket.socket) -> None:
        c.recv(65536)
        c.sendall(f"HTTP/1.1 {self.status}\r\nContent-Type: application/json\r\n\r\n".encode())
        while not self.stop.wait(0.05):
            c.sendall(self.chunk)

    def close(self) -> None:
        self.stop.set()
        super().close()


def read_request(c: socket.socket) -> bytes:
    """A request's head and its body (by its Content-Length), read whole: a server that closes
    with a request's bytes unread makes the kernel reset the connection, and the client may see
    the reset before the answer it was sent."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = c.recv(65536)
        if not got:
            return data
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                   if k.strip().lower() == b"content-length"), 0)  # fmt: skip
    while len(body) < length:
        got = c.recv(65536)
        if not got:
            break
        body += got
    return head + b"\r\n\r\n" + body

"""An HTTP server that answers at once, then sends its body a piece at a time for ever: every
read ends within any socket timeout, the body never does (a server gone wrong, or a proxy)."""

from __future__ import annotations

import socket
import threading


class Trickle:
    def __init__(self, status: str = "200 OK", chunk: bytes = b"# more\n", path: str = "/metrics") -> None:
        self.status = status
        self.chunk = chunk
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.url = self.base + path
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(c,), daemon=True).start()

    def _answer(self, c: socket.socket) -> None:
        with c:
            c.recv(65536)
            try:
                c.sendall(f"HTTP/1.1 {self.status}\r\nContent-Type: application/json\r\n\r\n".encode())
                while not self.stop.wait(0.05):
                    c.sendall(self.chunk)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()

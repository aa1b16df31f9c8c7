"""Local HTTP receivers that misbehave the way real ones do, on real TCP sockets: answer a
status (a revoked Slack hook says 400), redirect, never answer, or trickle the answer one
byte a second. Each records what it saw, so a test asserts on state, not on time."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field
from typing import Literal

Behaviour = Literal["status", "hang", "trickle"]


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    behaviour: Behaviour = "status"
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    trickled: list[int] = field(default_factory=list)  # bytes sent per trickled answer before the client left
    answer_len: int = 0

    def __post_init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket) -> Seen | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
        n = int(headers.get("content-length", "0"))
        while len(body) < n:
            chunk = conn.recv(65536)
            if not chunk:
                break
            body += chunk
        return Seen(method, path, headers, body)

    def _answer(self) -> bytes:
        reason = {200: "OK", 302: "Found", 307: "Temporary Redirect", 400: "Bad Request", 500: "Internal Server Error",
                  503: "Service Unavailable"}.get(self.status, "Whatever")  # fmt: skip
        body = b'{"status":"' + reason.encode() + b'"}'
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers)
        return (
            f"HTTP/1.1 {self.status} {reason}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                req = self._read_request(conn)
            except OSError:
                return
            if req is None:
                return
            with self._lock:
                self.seen.append(req)
            answer = self._answer()
            self.answer_len = len(answer)
            sent = 0
            try:
                if self.behaviour == "hang":
                    self._stop.wait()
                elif self.behaviour == "trickle":
                    for b in answer:
                        if self._stop.wait(1.0):
                            break
                        conn.sendall(bytes([b]))
                        sent += 1
                    with self._lock:
                        self.trickled.append(sent)
                else:
                    conn.sendall(answer)
            except OSError:  # the client hung up: what was sent until then is recorded
                with self._lock:
                    if self.behaviour == "trickle":
                        self.trickled.append(sent)

    def posts(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.method == "POST"]

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):  # wakes the accepting thread (a bare close does not)
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

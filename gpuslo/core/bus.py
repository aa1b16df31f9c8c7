"""In-process message bus for the embedded mode: topics of wire bytes, consumed in order.

It stands where Kafka stands in production; it carries bytes, not objects, so the
ingest decodes exactly what it would decode from Kafka."""

from __future__ import annotations

from collections import deque


class Bus:
    def __init__(self) -> None:
        self._q: deque[tuple[str, bytes]] = deque()
        self.published = 0

    def publish(self, topic: str, value: bytes) -> None:
        self._q.append((topic, value))
        self.published += 1

    def poll(self, max_records: int = 100_000) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        q = self._q
        while q and len(out) < max_records:
            out.append(q.popleft())
        return out

    def __len__(self) -> int:
        return len(self._q)

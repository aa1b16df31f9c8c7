"""One receiver's undelivered notifications, on disk.

An append-only JSON-lines log: ``{"id", "queued_at", "payload"}`` when a notification is
queued (written and fsynced before :meth:`Outbox.add` returns), ``{"done": id, "how"}`` when it
was delivered, refused or expired. At open the log is read, torn or corrupt lines are skipped
and counted, and the file is compacted (rewritten atomically with only what is pending), so a
crash at any point loses at most the notification being appended and resends at most the one
being acknowledged. A restarted engine therefore sends every pending notification exactly
once more, and nothing already acknowledged.

The file holds payloads only, never the receiver's URL or credentials; it is created ``0600``
in a ``0700`` directory (an existing one is tightened), because alert texts name services,
users and queues.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuslo.core.fileio import replace_file, write_all

log = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
COMPACT_AFTER = 512  # acknowledgements appended before the log is rewritten


@dataclass(frozen=True)
class Item:
    id: str
    queued_at: float
    payload: Any


def secure_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, DIR_MODE)


class Outbox:
    def __init__(self, path: Path, max_pending: int = 10_000) -> None:
        self.path = path
        self.max_pending = max_pending
        self.corrupt = 0  # lines skipped at open (torn by a crash, or damaged)
        self.dropped = 0  # oldest notifications dropped because max_pending was reached
        self._lock = threading.Lock()
        self._items: deque[Item] = deque()
        self._acks = 0
        secure_dir(path.parent)
        self._load()
        try:
            self._rewrite()  # compact, and drop a torn tail so the next append starts a line
        except OSError as exc:
            log.warning("outbox %s: cannot compact (%s); appending to it as it is", self.path, exc.strerror)

    # -- reading -------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        items: dict[str, Item] = {}
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if "done" in rec:
                    items.pop(str(rec["done"]), None)
                elif not math.isfinite(float(rec["queued_at"])):  # it would never expire
                    raise ValueError("queued_at is not finite")
                else:
                    items[str(rec["id"])] = Item(str(rec["id"]), float(rec["queued_at"]), rec["payload"])
            except (ValueError, KeyError, TypeError, RecursionError):  # a damaged line never stops the engine
                self.corrupt += 1
        self._items.extend(items.values())
        if self.corrupt:
            log.warning(
                "outbox %s: skipped %d torn or corrupt line(s) (a notification being written at a crash)",
                self.path, self.corrupt,
            )  # fmt: skip

    # -- writing -------------------------------------------------------------------------
    def _append(self, rec: dict[str, Any]) -> None:
        data = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            size = os.fstat(fd).st_size
            try:
                write_all(fd, data)
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):  # no torn line left behind (a full disk, say)
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def _rewrite(self) -> None:
        data = "".join(
            json.dumps({"id": i.id, "queued_at": i.queued_at, "payload": i.payload}, separators=(",", ":")) + "\n"
            for i in self._items
        ).encode()  # fmt: skip
        # the log as it is stays the truth until the whole copy replaces it (a file left by an
        # older version may have been 0644: the mode is set again)
        replace_file(self.path, data, durable=True, mode=FILE_MODE)
        self._acks = 0

    def add(self, payload: Any, now: float) -> Item:
        """Queue durably (raises OSError when it cannot be written: nothing is queued then)."""
        item = Item(uuid.uuid4().hex, now, payload)
        with self._lock:
            self._append({"id": item.id, "queued_at": item.queued_at, "payload": item.payload})
            self._items.append(item)
            while len(self._items) > self.max_pending:
                old = self._items.popleft()
                self.dropped += 1
                self._ack(old.id, "dropped")
        return item

    def head(self) -> Item | None:
        with self._lock:
            return self._items[0] if self._items else None

    def done(self, item: Item, how: str) -> None:
        """``item`` (the head) is finished: delivered, refused or expired."""
        with self._lock:
            if self._items and self._items[0].id == item.id:
                self._items.popleft()
            else:
                try:
                    self._items.remove(item)
                except ValueError:
                    return
            self._ack(item.id, how)

    def _ack(self, item_id: str, how: str) -> None:
        try:
            self._append({"done": item_id, "how": how})
            self._acks += 1
            if self._acks >= COMPACT_AFTER:
                self._rewrite()
        except OSError as exc:
            # not acknowledged on disk: a restart would send it once more; say so
            log.warning("outbox %s: cannot record a finished notification (%s)", self.path, exc.strerror)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

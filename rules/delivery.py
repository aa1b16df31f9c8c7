"""Delivery: one queue and one worker thread per receiver.

Each receiver has its own on-disk :class:`~rules.outbox.Outbox` and its own thread, so a
receiver that is down, slow or refusing never delays another, and the evaluation loop only
appends to the outboxes (it never waits on a receiver). Within one receiver notifications go
in order (a resolve never overtakes its firing): a transient failure keeps the head and
retries it with exponential backoff (``Retry-After`` honoured up to the cap); a permanent
failure is logged at ERROR, counted and dropped, and the next notification goes at once. A
notification older than ``max_age_s`` is dropped as expired (counted): a firing alert is
re-sent every ``resend_s`` anyway.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpuslo.core.backoff import Backoff
from gpuslo.rules.outbox import Item, Outbox
from gpuslo.rules.receivers import Outcome, Post, Receiver, http_post

log = logging.getLogger(__name__)


def redact(text: str, secrets: list[str]) -> str:
    for sec in secrets:
        if len(sec) >= 4 and sec in text:
            text = text.replace(sec, "***")
    return text


@dataclass
class ReceiverStats:
    sent: int = 0
    failed: int = 0  # permanent failures: reported and dropped
    retries: int = 0  # transient failures (each retried)
    expired: int = 0
    dropped: int = 0  # queue over max_pending, or the outbox could not be written
    corrupt: int = 0  # torn/corrupt outbox lines skipped at start
    pending: int = 0
    last_status: int | None = None
    last_error: str = ""


@dataclass(frozen=True)
class Policy:
    deadline_s: float = 10.0  # total, per attempt
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 300.0
    max_age_s: float = 86_400.0
    max_pending: int = 10_000


class ReceiverQueue:
    """A receiver's outbox and its retry state; :meth:`attempt` makes one delivery step."""

    def __init__(self, receiver: Receiver, outbox: Outbox, policy: Policy, post: Post = http_post,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.receiver = receiver
        self.outbox = outbox
        self.policy = policy
        self.post = post
        self.clock = clock
        self.monotonic = monotonic
        self.stats = ReceiverStats(corrupt=outbox.corrupt)
        self._unwritable = 0  # notifications lost because the outbox could not be written
        self._secrets = sorted(receiver.secrets(), key=len, reverse=True)
        self._backoff = Backoff(policy.backoff_initial_s, policy.backoff_max_s)
        self._next_try = 0.0
        self._lock = threading.Lock()

    def put(self, payload: Any) -> bool:
        try:
            self.outbox.add(payload, self.clock())
        except OSError as exc:
            with self._lock:
                self._unwritable += 1
                self.stats.last_error = f"outbox not writable: {exc.strerror}"
            log.error(
                "alert notification for %s (%s) not queued: cannot write its outbox %s (%s)",
                self.receiver.name, self.receiver.redacted, self.outbox.path, exc.strerror,
            )  # fmt: skip
            return False
        return True

    def due_in(self) -> float | None:
        """Seconds until the next attempt is due (0: now); None when nothing is pending."""
        if self.outbox.head() is None:
            return None
        return max(0.0, self._next_try - self.monotonic())

    def idle(self) -> bool:
        """Nothing to do now: empty, or waiting out a backoff."""
        d = self.due_in()
        return d is None or d > 0

    def attempt(self) -> Outcome | None:
        item = self.outbox.head()
        if item is None or self.monotonic() < self._next_try:
            return None
        if self.clock() - item.queued_at > self.policy.max_age_s:
            self.outbox.done(item, "expired")
            with self._lock:
                self.stats.expired += 1
            log.error("alert notification for %s (%s) expired undelivered after %.0f s",
                      self.receiver.name, self.receiver.redacted, self.policy.max_age_s)  # fmt: skip
            return None
        body = json.dumps(item.payload).encode()
        try:
            out = self.post(self.receiver, body, self.policy.deadline_s)
        except Exception as exc:  # a post function must not kill the worker: count it as transient
            out = Outcome("transient", None, f"{type(exc).__name__}: {exc}")
        self._record(item, out)
        return out

    def _record(self, item: Item, out: Outcome) -> None:
        r = self.receiver
        # the answer's text may echo the URL or token back (it also reaches stdout, in the summary)
        out = replace(out, detail=redact(out.detail, self._secrets))
        with self._lock:
            self.stats.last_status = out.status
            if out.kind == "sent":
                self.stats.sent += 1
                if self._backoff.failing:
                    log.warning("alert delivery to %s (%s) works again", r.name, r.redacted)
                self._backoff.reset()
                self._next_try = 0.0
            elif out.kind == "permanent":
                self.stats.failed += 1
                self.stats.last_error = out.detail
            else:
                self.stats.retries += 1
                self.stats.last_error = out.detail
                first = not self._backoff.failing
                wait = max(self._backoff.fail(), min(out.retry_after_s or 0.0, self.policy.backoff_max_s))
                self._next_try = self.monotonic() + wait
        if out.kind == "sent":
            self.outbox.done(item, "sent")
        elif out.kind == "permanent":
            self.outbox.done(item, "refused")
            log.error(
                "alert delivery to %s (%s) refused, notification dropped: %s", r.name, r.redacted, out.detail
            )
        elif first:
            log.warning("alert delivery to %s (%s) failed (%s); kept in its outbox, retried with backoff",
                        r.name, r.redacted, out.detail)  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            self.stats.pending = len(self.outbox)
            self.stats.dropped = self._unwritable + self.outbox.dropped
            return asdict(self.stats)


class Worker:
    """The thread that drains one :class:`ReceiverQueue`."""

    def __init__(self, queue: ReceiverQueue) -> None:
        self.queue = queue
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"deliver-{queue.receiver.name}", daemon=True)
        self._busy = False

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    @property
    def idle(self) -> bool:
        return not self._busy and self.queue.idle()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            wait = self.queue.due_in()
            if wait is None or wait > 0:
                self._wake.wait(wait)
                continue
            self._busy = True
            try:
                self.queue.attempt()
            except Exception:  # never let one receiver's bug end its deliveries silently
                log.exception("alert delivery worker for %s failed; retrying", self.queue.receiver.name)
                self._stop.wait(1.0)
            finally:
                self._busy = False

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

"""Kafka sink (kafka-python): spool first, drain in order in the background.

``send`` only appends to the disk spool (fast, crash-safe) and wakes the drainer; a
background thread sends the spool's oldest records with ``acks=all`` and an idempotent
producer, and moves the spool cursor past what the broker acknowledged. A broker that
is down or slow leaves records in the spool, bounded by bytes and age; they drain in
order when it returns, also after an agent restart.

Topic per message kind, key = the producing node (so one node's messages stay in one
partition, in order).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuslo.agent.base import SendResult, Sink
from gpuslo.agent.spool import Position, Record, Spool, SpoolStats, SpoolWriteError
from gpuslo.core.backoff import Backoff
from gpuslo.core.settings import KafkaSettings, ProducerSettings, SpoolSettings
from gpuslo.wire import Message, encode

log = logging.getLogger(__name__)

ProducerFactory = Callable[..., Any]

# kafka-python's max_request_size default and about the broker's message.max.bytes default: a
# record larger than this is refused by the producer (or the broker) every time it is tried, so
# once spooled it would stop the drain forever; it is refused at send, before the spool
MAX_REQUEST_BYTES = 1_048_576
RECORD_OVERHEAD_BYTES = 128  # the record batch's header and the record's own framing, rounded up


# Kafka error codes that refuse a record for what it is, on every try: MESSAGE_TOO_LARGE,
# RECORD_LIST_TOO_LARGE, INVALID_RECORD. Retrying such a record would stop the drain forever.
REJECTED_ERRNOS = frozenset({10, 18, 87})


def rejects_the_record(exc: BaseException | None) -> bool:
    return getattr(exc, "errno", None) in REJECTED_ERRNOS


def fits_a_request(r: Record) -> bool:
    return len(r.key) + len(r.value) + RECORD_OVERHEAD_BYTES <= MAX_REQUEST_BYTES


def _default_factory(**kw: Any) -> Any:
    from kafka import KafkaProducer  # the agent's only Kafka import

    return KafkaProducer(**kw)


def message_key(m: Message) -> bytes:
    node = getattr(m, "node", None)
    return str(node or m.source).encode()


class KafkaSink(Sink):
    def __init__(
        self,
        kafka: KafkaSettings,
        spool: SpoolSettings,
        producer: ProducerSettings | None = None,
        producer_factory: ProducerFactory = _default_factory,
        clock: Callable[[], float] = time.time,
        start: bool = True,
    ) -> None:
        self.kafka = kafka
        self.settings = producer or ProducerSettings()
        self.spool = Spool(spool.directory, spool.max_bytes, spool.max_age_s, fsync=spool.fsync, clock=clock)
        self._factory = producer_factory
        self._clock = clock
        self._producer: Any = None
        self._lock = threading.Lock()  # the spool is shared with the drainer
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._backoff = Backoff(0.5, 30.0)
        self._next_try = 0.0
        self._last_error = ""
        self._solo = False  # the head record refused with others: the next try sends it alone
        # a batch whose flush timed out with records still in the producer: the next try waits for
        # those (the producer delivers or expires each itself) instead of sending them a second time
        self._inflight: tuple[list[tuple[Position, Record]], list[Any]] | None = None
        self.sent_records = 0
        self.send_failures = 0  # messages the spool could not take (never accepted)
        self._thread: threading.Thread | None = None
        if len(self.spool):
            log.info(
                "spool %s holds %d records from before; draining them first", spool.directory, len(self.spool)
            )
        if start:
            self._thread = threading.Thread(target=self._run, name="gpuslo-kafka-drain", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ Sink
    def send(self, msgs: Sequence[Message]) -> SendResult:
        now = self._clock()
        made = [Record(self.kafka.topics.for_kind(m.kind), message_key(m), encode(m), now) for m in msgs]
        recs = [r for r in made if fits_a_request(r)]
        too_big = len(made) - len(recs)
        error = (
            f"{too_big} message(s) larger than a Kafka request ({MAX_REQUEST_BYTES:,} bytes) refused; "
            f"the largest: {max(len(r.key) + len(r.value) for r in made):,} bytes"
            if too_big
            else ""
        )
        self.send_failures += too_big
        try:
            with self._lock:
                self.spool.append(recs)
        except SpoolWriteError as exc:  # disk full, I/O error: rolled back; refused, and says so (the
            self.send_failures += len(recs)  # runner logs it once per outage); the next send retries
            return SendResult(sent=0, failed=len(made), error="; ".join(filter(None, (str(exc), error))))
        if recs:
            self._wake.set()
        return SendResult(sent=len(recs), failed=too_big, error=error)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Drain until the spool is empty or ``timeout_s`` passes; True when empty."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not len(self.spool):
                    return True
            if self._thread is None:
                self.drain_once(force=True)
            else:
                self._wake.set()
                time.sleep(0.05)
        with self._lock:
            return not len(self.spool)

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s + 5)
        if self._producer is not None:
            try:
                self._producer.close(timeout=timeout_s)
            except Exception as exc:
                log.warning("closing the Kafka producer: %s", exc)
        with self._lock:
            left = len(self.spool)
            self.spool.close()
        if left:
            log.warning("closing with %d records still in the spool; they drain on the next start", left)

    def spool_stats(self) -> SpoolStats:
        """A consistent snapshot (the drainer holds the same lock), for /metrics' thread."""
        with self._lock:
            return self.spool.stats()

    @property
    def pending(self) -> int:
        return len(self.spool)

    @property
    def last_error(self) -> str:
        return self._last_error

    # ------------------------------------------------------------------ draining
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(
                timeout=max(0.05, self._next_try - time.monotonic()) if self._backoff.failing else 1.0
            )
            self._wake.clear()
            try:
                while not self._stop.is_set() and self.drain_once():
                    pass
            except Exception:  # never let the drainer die: log and back off
                log.exception("Kafka drainer failed; retrying")
                self._fail("internal error")

    def _ensure_producer(self) -> bool:
        if self._producer is not None:
            return True
        s = self.settings
        request_ms = max(1000, int(s.flush_timeout_s * 800) - s.linger_ms)
        try:
            self._producer = self._factory(
                acks="all",
                enable_idempotence=True,
                compression_type=None if s.compression == "none" else s.compression,
                linger_ms=s.linger_ms,
                max_block_ms=int(s.flush_timeout_s * 1000),
                # give up on a record within one flush, so it stays in the spool for the next try
                # (kafka-python refuses a delivery timeout not above linger + request timeout)
                delivery_timeout_ms=max(int(s.flush_timeout_s * 1000), request_ms + s.linger_ms + 1),
                request_timeout_ms=request_ms,
                max_request_size=MAX_REQUEST_BYTES,
                bootstrap_timeout_ms=int(s.flush_timeout_s * 1000),
                **self.kafka.client_kwargs(),
            )
        except Exception as exc:  # NoBrokersAvailable, DNS, auth: keep spooling
            self._fail(
                f"cannot connect to Kafka {','.join(self.kafka.bootstrap_servers)}: {type(exc).__name__}: {exc}"
            )
            return False
        return True

    def drain_once(self, force: bool = False) -> bool:
        """Send one batch from the spool. True if the whole batch was acknowledged and more may wait."""
        if not force and self._backoff.failing and time.monotonic() < self._next_try:
            return False
        refused: BaseException | None = None  # raised by send() for the record after the futures
        if self._inflight is not None:
            batch, futures = self._inflight
            self._flush_producer()
        else:
            with self._lock:
                batch = self.spool.peek(
                    max_records=1 if self._solo else self.settings.drain_batch,
                    max_bytes=self.settings.drain_max_bytes,
                )
            if not batch:
                return False
            if not self._ensure_producer():
                return False
            futures = []
            for _, r in batch:
                try:
                    futures.append(self._producer.send(r.topic, key=r.key, value=r.value))
                except Exception as exc:
                    refused = exc
                    break
            self._flush_producer()
        if refused is not None:
            self._last_error = f"{type(refused).__name__}: {refused}"
        if any(not f.is_done for f in futures):  # neither delivered nor expired yet: never send twice
            self._inflight = (batch, futures)
            self._fail(self._last_error or "broker did not acknowledge in time")
            return False
        self._inflight = None
        ok = 0
        for f in futures:
            if f.is_done and f.succeeded():
                ok += 1
            else:
                if f.is_done and not self._last_error:
                    self._last_error = f"{type(f.exception).__name__}: {f.exception}"
                break
        if ok:
            with self._lock:
                self.spool.advance(batch[ok - 1][0], ok)
            self.sent_records += ok
        if ok < len(batch) and self._rejected(batch[ok], futures[ok] if ok < len(futures) else None, refused):
            return True
        if ok < len(batch):
            self._fail(self._last_error or "broker did not acknowledge in time")
            return False
        self._backoff.reset()
        self._last_error = ""
        self._solo = False
        return True

    def _flush_producer(self) -> None:
        try:
            self._producer.flush(timeout=self.settings.flush_timeout_s)
        except Exception as exc:  # KafkaTimeoutError: what is not done stays in flight
            self._last_error = f"{type(exc).__name__}: {exc}"

    def _rejected(self, head: tuple[Position, Record], future: Any, raised: BaseException | None) -> bool:
        """The head record refused by the producer or the broker for what it is (too large): retried it
        would stop the drain forever, so it is dropped, counted and logged, and the drain goes on."""
        exc = (
            future.exception if future is not None and future.is_done else raised if future is None else None
        )
        if not rejects_the_record(exc):
            self._solo = False
            return False
        self._reset_producer()  # its idempotent sequence for the partition is spoiled by the failed batch
        if future is not None and not self._solo:
            # the broker answers for a whole batch: a small record sent with a large one is refused
            # with it; only a record refused when sent alone is dropped
            self._solo = True
            return True
        self._solo = False
        pos, rec = head
        with self._lock:
            self.spool.advance(pos, 1, rejected=True)
        log.error("Kafka rejected a %d-byte record for %s (%s: %s); dropped from the spool, counted",
                  len(rec.key) + len(rec.value), rec.topic, type(exc).__name__, exc)  # fmt: skip
        self._last_error = ""
        return True

    def _reset_producer(self) -> None:
        producer, self._producer = self._producer, None
        self._inflight = None  # its futures end with it: what they did not deliver is sent again
        if producer is not None:
            try:
                producer.close(timeout=self.settings.flush_timeout_s)
            except Exception as exc:
                log.warning("closing the Kafka producer: %s", exc)

    def _fail(self, why: str) -> None:
        first = not self._backoff.failing
        self._next_try = time.monotonic() + self._backoff.fail()
        self._last_error = why
        if first:
            log.warning("Kafka unavailable (%s); spooling to disk and retrying", why)

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
from gpuslo.core.settings import CODEC_PACKAGES, KafkaSettings, ProducerSettings, SettingsError, SpoolSettings
from gpuslo.core.topic_watch import TopicWatch
from gpuslo.wire import Message, encode
from gpuslo.wire.pack import pack

log = logging.getLogger(__name__)

ProducerFactory = Callable[..., Any]

# kafka-python's max_request_size default and about the broker's message.max.bytes default: a
# record larger than this is refused by the producer (or the broker) every time it is tried, so
# once spooled it would stop the drain forever; it is refused at send, before the spool
MAX_REQUEST_BYTES = 1_048_576
RECORD_OVERHEAD_BYTES = 128  # the record batch's header and the record's own framing, rounded up


# Closing, the drainer is waited for this long past the close's own bound, then left (a daemon
# thread): a send that waits for a topic's metadata cannot be interrupted.
CLOSE_GRACE_S = 1.0


#: The longest the drain waits between tries while Kafka fails it (0.5 s, doubling). At 30 s,
#: the spool of an agent that had been cut off for 20 s drained 23 s after the broker was back
#: (``python -m bench recovery``); a try costs a connection refused, or one request.
DRAIN_RETRY_MAX_S = 4.0
#: The same while Kafka refuses this client's writes (an ACL): 30 s, as before the 4 s cap, since
#: each try then makes a new producer (kafka-python's idempotent one turns fatal on the refusal).
REFUSED_RETRY_MAX_S = 30.0


def close_producer(producer: Any, timeout_s: float) -> None:
    """Close a kafka-python producer within ``timeout_s``. Its ``close`` flushes first and raises
    KafkaTimeoutError when that times out, before it stops its sender thread: the thread ran on
    with its connections, and the producer's ``__del__`` closed it again at the exit and printed
    the error's traceback ("Exception ignored in: KafkaProducer.__del__"). Then it is closed by
    force: its batches fail (their records are still in the spool, sent again)."""
    try:
        producer.close(timeout=timeout_s)
    except Exception as exc:
        log.warning("closing the Kafka producer: %s", exc)
        sender = getattr(producer, "_sender", None)
        if sender is not None and hasattr(sender, "force_close"):
            sender.force_close()
        if hasattr(producer, "_closed"):
            producer._closed = True  # its __del__ and atexit hook close nothing again


# Kafka error codes that refuse a record for what it is, on every try: MESSAGE_TOO_LARGE,
# RECORD_LIST_TOO_LARGE, INVALID_RECORD. Retrying such a record would stop the drain forever.
REJECTED_ERRNOS = frozenset({10, 18, 87})


def check_codec(compression: str) -> None:
    """Raises :class:`SettingsError` when kafka-python cannot compress with ``compression`` here.
    Checked when the sink is made: otherwise every drain would fail (kafka-python refuses to make
    the producer), the spool would fill, and the error would read as a broker that cannot be reached."""
    package = CODEC_PACKAGES.get(compression)
    if package is None:
        return
    from kafka import codec

    has = {"snappy": codec.has_snappy, "lz4": codec.has_lz4, "zstd": codec.has_zstd}[compression]
    if not has():
        raise SettingsError(
            f"producer.compression {compression}: kafka-python needs the Python package {package!r} for it, "
            f"which is not installed (pip install {package}, or set producer.compression to gzip or none)"
        )


def rejects_the_record(exc: BaseException | None) -> bool:
    return getattr(exc, "errno", None) in REJECTED_ERRNOS


def fits_a_request(r: Record) -> bool:
    return len(r.key) + len(r.value) + RECORD_OVERHEAD_BYTES <= MAX_REQUEST_BYTES


#: The JSON bytes a pack is made from at most (a pack is about 0.36× its JSON with every field, but
#: up to 2× with sparse ones: a pack over a request is halved until it fits).
PACK_SOURCE_BYTES = 2 * MAX_REQUEST_BYTES


def _packable(r: Record, gpu_topic: str) -> bool:
    return r.topic == gpu_topic and r.value[:1] == b"{" and b'"kind":"gpu_samples"' in r.value


def messages(
    records: Sequence[Record], gpu_topic: str, pack_min: int, max_bytes: int = PACK_SOURCE_BYTES
) -> list[tuple[list[int], Record]]:
    """What to send for ``records``: (the positions of the records it stands for, the record to
    send), in the order of each one's first record. When at least ``pack_min`` records are
    gpu_samples of one key (a node's batches, between which its heartbeats and events sit in
    the spool), they become packs of at most ``max_bytes`` of JSON each, in order;
    a record the packer refuses, and every other record, is sent as it is. (Kafka orders a
    partition, never two topics: the records of other topics may go before a pack's later ones.)"""
    runs: dict[bytes, list[int]] = {}
    if pack_min:
        for i, r in enumerate(records):
            if _packable(r, gpu_topic):
                runs.setdefault(r.key, []).append(i)
    out: list[tuple[list[int], Record]] = []
    packed: set[int] = set()
    for run in runs.values():
        if len(run) < max(pack_min, 2):
            continue
        at = 0
        while at < len(run):
            k, size = at, 0
            while k < len(run) and (k == at or size + len(records[run[k]].value) <= max_bytes):
                size += len(records[run[k]].value)
                k += 1
            rec, took = _pack_prefix([records[i] for i in run[at:k]])
            while rec is not None and not fits_a_request(rec):  # halve until it fits
                rec, took = _pack_prefix([records[i] for i in run[at : at + took // 2]])
            if rec is None:
                at += 1  # sent as it is, below
                continue
            out.append((run[at : at + took], rec))
            packed.update(run[at : at + took])
            at += took
    out += [([i], r) for i, r in enumerate(records) if i not in packed]
    out.sort(key=lambda m: m[0][0])
    return out


def _pack_prefix(run: Sequence[Record]) -> tuple[Record | None, int]:
    """The pack of the longest prefix of ``run`` the packer takes whole (None if it refuses the first)."""
    value, took = pack(r.value for r in run)
    n = next((k for k, p in enumerate(took) if p != k), len(took))
    if n < 2:
        return None, 0
    if n != len(took):  # the packer skipped a record after the prefix: the prefix alone
        value, _ = pack(r.value for r in run[:n])
    r = run[0]
    return Record(r.topic, r.key, value, r.appended_at), n


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
        check_codec(self.settings.compression)
        # the password (its variable or file) and the TLS files resolve now, or the start fails
        # (SettingsError): found at connect, they read as a broker down and were retried for ever
        kafka.client_kwargs()
        self.spool = Spool(spool.directory, spool.max_bytes, spool.max_age_s, fsync=spool.fsync, clock=clock)
        self._factory = producer_factory
        self._clock = clock
        self._producer: Any = None
        self._lock = threading.Lock()  # the spool is shared with the drainer
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._backoff = Backoff(0.5, DRAIN_RETRY_MAX_S)
        self._next_try = 0.0
        self._last_error = ""
        self._solo = False  # the head record refused with others: the next try sends it alone
        # a batch whose flush timed out with records still in the producer: the next try waits for
        # those (the producer delivers or expires each itself) instead of sending them a second time
        self._inflight: tuple[list[tuple[Position, Record]], list[list[int]], list[Any]] | None = None
        # the JSON a pack is made from at most: halved each time the broker refuses a pack for its
        # size (message.max.bytes under a pack), so that the drain does not refuse one per record
        self._pack_bytes = PACK_SOURCE_BYTES
        self.sent_records = 0
        self.sent_packs = 0  # Kafka messages that were packs of several gpu_samples records
        self.packed_records = 0  # the records sent in them
        self.send_failures = 0  # messages the spool could not take (never accepted)
        # the topics records were sent to, and the broker's answers for them: a topic it does not
        # have (a broker that makes none on first use) is said as such, not as a broker down
        self._asked: set[str] = set()
        self._topics: TopicWatch | None = None
        self._flush_gave_up = False  # the last flush ended with records left: close waits no more
        self._closed = False
        self._told = ""  # "down" or "refused": logged, not delivered since (a change is said again)
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
                    self._flush_gave_up = False
                    return True
            if self._thread is None:
                self.drain_once(force=True)
            else:
                self._wake.set()
                time.sleep(0.05)
        with self._lock:
            self._flush_gave_up = bool(len(self.spool))
            return not self._flush_gave_up

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver for up to ``timeout_s`` (not again after a flush that gave up: the caller
        waited its own bound), then stop, within about ``timeout_s`` + ``CLOSE_GRACE_S`` in all:
        the drainer is not waited for past that (a send waiting for a topic's metadata holds it
        up to the producer's ``flush_timeout_s``, and the stop took the agent's whole
        ``--flush-timeout-s`` again and then some: 33 s for 15). What the spool holds stays on
        disk for the next start; what the producer held unacknowledged is sent again then."""
        deadline = time.monotonic() + (0.0 if self._flush_gave_up else timeout_s)
        if not self._flush_gave_up:
            self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + CLOSE_GRACE_S)
        if self._producer is not None:
            close_producer(self._producer, max(0.0, deadline - time.monotonic()))
        if self._topics is not None:
            self._topics.close()
        with self._lock:
            self._closed = True  # a drainer still in a send touches the spool no more
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

    def missing_topics(self) -> list[str]:
        """The topics the broker answered it does not have (the drain waits at the first record
        for one of them), sorted; empty while none is, or before any answer."""
        return list(self._topics.missing) if self._topics is not None else []

    # ------------------------------------------------------------------ draining
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._topics is not None:
                self._topics.check()  # a topic that came back is said as soon as it is seen
            self._wake.wait(
                timeout=max(0.05, self._next_try - time.monotonic()) if self._backoff.failing else 1.0
            )
            self._wake.clear()
            try:
                while not self._stop.is_set() and self.drain_once():
                    pass
            except Exception:  # never let the drainer die: log and back off
                if self._stop.is_set():  # the producer closed under a send at the end: nothing to say
                    log.debug("Kafka drainer stopped in a send", exc_info=True)
                    return
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
        self._topics = TopicWatch(
            self._producer,
            lambda: self._asked,
            ",".join(self.kafka.bootstrap_servers),
            "the spool keeps its records, and those behind them, in order,",
            told=self._topics.told if self._topics is not None else (),
        )
        return True

    def drain_once(self, force: bool = False) -> bool:
        """Send one batch from the spool. True if the whole batch was acknowledged and more may wait."""
        if not force and self._backoff.failing and time.monotonic() < self._next_try:
            return False
        refused: BaseException | None = None  # raised by send() for the record after the futures
        if self._inflight is not None:
            batch, parts, futures = self._inflight
            self._flush_producer()
        else:
            with self._lock:
                if self._closed:
                    return False
                batch = self.spool.peek(
                    max_records=1 if self._solo else self.settings.drain_batch,
                    max_bytes=self.settings.drain_max_bytes,
                )
            if not batch:
                return False
            if not self._ensure_producer():
                return False
            topics = {r.topic for _, r in batch}
            if not topics <= self._asked:  # a new set: it is read on kafka-python's thread
                self._asked = self._asked | topics
            sends = messages(
                [r for _, r in batch],
                self.kafka.topics.gpu_samples,
                self.settings.pack_min_records,
                self._pack_bytes,
            )
            futures = []
            for _, r in sends:
                try:
                    futures.append(self._producer.send(r.topic, key=r.key, value=r.value))
                except Exception as exc:
                    refused = exc
                    break
            parts = [p for p, _ in sends]
            self._flush_producer()
        if refused is not None:
            self._last_error = f"{type(refused).__name__}: {refused}"
        if any(not f.is_done for f in futures):  # neither delivered nor expired yet: never send twice
            if self._wedged():  # nor will they be: what is not delivered is sent again by a new one
                log.warning(
                    "the Kafka producer lost its producer id and sends nothing more; making a new one"
                )
                self._reset_producer(timeout_s=0.0)  # it would flush nothing: no wait for it
            else:
                self._inflight = (batch, parts, futures)
            self._fail(self._last_error or "broker did not acknowledge in time")
            return False
        self._inflight = None
        acked = [False] * len(batch)
        failed: dict[int, Any] = {}  # record position -> the future of the message it was in
        for part, f in zip(parts, futures, strict=False):
            if f.is_done and f.succeeded():
                for i in part:
                    acked[i] = True
            else:
                if f.is_done and not self._last_error:
                    self._last_error = f"{type(f.exception).__name__}: {f.exception}"
                failed.update((i, f) for i in part)
        # the spool moves past the acknowledged prefix; an acknowledged record after it (a pack's
        # later batch) is sent again with the rest: the ingest drops the replay
        ok = next((i for i, a in enumerate(acked) if not a), len(batch))
        if ok:
            with self._lock:
                if self._closed:  # closed meanwhile: sent again at the next start
                    return False
                self.spool.advance(batch[ok - 1][0], ok)
            self.sent_records += ok
            packs = [len(part) for part in parts[: len(futures)] if len(part) > 1 and part[-1] < ok]
            self.sent_packs += len(packs)
            self.packed_records += sum(packs)
        # a refused pack (too large for the broker) is retried record by record (solo), as JSON
        in_pack = any(len(part) > 1 and ok in part for part in parts)
        if ok < len(batch) and self._rejected(batch[ok], failed.get(ok), refused, in_pack):
            return True
        if ok < len(batch):
            if self._spoiled(failed.get(ok), refused):
                self._reset_producer()
            self._fail(self._last_error or "broker did not acknowledge in time")
            return False
        self._backoff.reset()
        self._told = ""
        self._last_error = ""
        self._solo = False
        return True

    def _flush_producer(self) -> None:
        try:
            self._producer.flush(timeout=self.settings.flush_timeout_s)
        except Exception as exc:  # KafkaTimeoutError: what is not done stays in flight
            self._last_error = f"{type(exc).__name__}: {exc}"

    def _rejected(
        self, head: tuple[Position, Record], future: Any, raised: BaseException | None, in_pack: bool = False
    ) -> bool:
        """The head record refused by the producer or the broker for what it is (too large): retried it
        would stop the drain forever, so it is dropped, counted and logged, and the drain goes on."""
        exc = (
            future.exception if future is not None and future.is_done else raised if future is None else None
        )
        if not rejects_the_record(exc):
            self._solo = False
            return False
        self._reset_producer()  # its idempotent sequence for the partition is spoiled by the failed batch
        if in_pack:  # the broker refuses packs this large: the next ones are smaller
            self._pack_bytes = max(1, self._pack_bytes // 2)
            log.warning("Kafka refused a pack (%s: %s); packs now of at most %d bytes of JSON",
                        type(exc).__name__, exc, self._pack_bytes)  # fmt: skip
        if (future is not None or in_pack) and not self._solo:
            # the broker answers for a whole batch: a small record sent with a large one is refused
            # with it; only a record refused when sent alone is dropped
            self._solo = True
            return True
        self._solo = False
        pos, rec = head
        with self._lock:
            if self._closed:
                return False
            self.spool.advance(pos, 1, rejected=True)
        log.error("Kafka rejected a %d-byte record for %s (%s: %s); dropped from the spool, counted",
                  len(rec.key) + len(rec.value), rec.topic, type(exc).__name__, exc)  # fmt: skip
        self._last_error = ""
        return True

    def _spoiled(self, future: Any, raised: BaseException | None) -> bool:
        """Whether the producer must be made anew before the next try: the head's error is not
        one Kafka calls retriable (an authorization refused, an unknown error), or the producer
        says its state is fatal. kafka-python's idempotent producer moves to a fatal state on such
        an error and fails every later batch with it, for good: after a write right taken away
        and given back, the agent never delivered again until restarted."""
        exc = future.exception if future is not None and future.is_done else raised
        txn = getattr(self._producer, "_transaction_manager", None)
        try:
            fatal = bool(txn is not None and txn.has_fatal_error())
        except Exception:  # a kafka-python without it: judged by the error alone
            fatal = False
        return fatal or (exc is not None and not getattr(exc, "retriable", False))

    def _wedged(self) -> bool:
        """kafka-python 3.0.12's idempotent producer, when a batch it had sent expires (a topic
        deleted under it: the broker answered UNKNOWN_TOPIC_OR_PARTITION until the delivery
        timeout), drops its producer id (``reset_producer_id``) and stays READY, where
        ``init_producer_id`` asks for none: its sender then sends nothing, to any topic, and its
        batches never expire. The agent waited on them for good (the topic made again, nothing
        delivered until a restart). Seen here as READY without a producer id."""
        from kafka.producer.transaction_manager import TransactionState

        txn = getattr(self._producer, "_transaction_manager", None)
        try:
            return bool(
                txn is not None
                and not txn.is_transactional()
                and not txn.has_producer_id()
                and txn._current_state == TransactionState.READY
            )
        except Exception:  # another kafka-python: not judged
            return False

    def _reset_producer(self, timeout_s: float | None = None) -> None:
        """Close the producer (within ``timeout_s``, else the producer's ``flush_timeout_s``); the
        next drain makes a new one."""
        producer, self._producer = self._producer, None
        self._inflight = None  # its futures end with it: what they did not deliver is sent again
        if self._topics is not None:
            self._topics.close()
        if producer is not None:
            close_producer(producer, self.settings.flush_timeout_s if timeout_s is None else timeout_s)

    def _fail(self, why: str) -> None:
        kind = "refused" if "AuthorizationFailed" in why else "down"
        # a refusal waits for an operator (a right given back): each try makes the producer anew
        # (a connection, metadata, a producer id), so a fleet's agents retry it at the slower pace
        self._backoff.max_s = REFUSED_RETRY_MAX_S if kind == "refused" else DRAIN_RETRY_MAX_S
        self._next_try = time.monotonic() + self._backoff.fail()
        # the broker answered within this try, without these topics: not a broker down (the watch
        # says it, once sure); an answer older than that is from before an outage
        fresh_s = self.settings.flush_timeout_s + 1.0
        absent = self._topics.absent(within_s=fresh_s) if self._topics is not None else []
        if absent and self._topics is not None:
            self._last_error = self._topics.words(absent)
            self._told = ""  # it answered: a later outage is said again
            return
        self._last_error = why
        if self._told != kind:  # an outage, then a refusal (or back): each said once
            self._told = kind
            if kind == "refused":  # the broker answered, and refused this client
                log.warning("Kafka refused this client (%s): its principal needs WRITE on the topic (and "
                            "IDEMPOTENT_WRITE on the cluster before Kafka 3.0); spooling to disk and "
                            "retrying", why)  # fmt: skip
            else:
                log.warning("Kafka unavailable (%s); spooling to disk and retrying", why)

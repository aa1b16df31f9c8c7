"""Kafka → store, with nothing lost and nothing doubled.

One consumer in a consumer group. Batches close by message count or by time; each
batch is one columnar insert per table (bad messages go to ``dead_letters`` with
topic, partition, offset, reason and raw bytes); offsets are committed only after the
batch's rows and dead letters are written. The store's errors come classified
(:mod:`ingest.failures`): transient (unreachable, restarting) - the consumer pauses its
partitions, retries the same batch with exponential backoff, commits nothing, and keeps
its group membership by polling while paused; refused data - after a few attempts the
batch is written message by message and the refused ones are dead-lettered (a dead letter
that cannot be written is not a commit); fatal (credentials, database, schema) - nothing
more is written or committed and ``run`` raises. A crash anywhere before the commit re-reads the
batch; the tables' ReplacingMergeTree keys make the second write replace the first.
A rebalance drops what was read but not yet written from the partitions taken away
(their new owner reads it again from the last commit: nothing lost, nothing written
twice); SIGTERM (``stop``) writes and commits what was read, then leaves the group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kafka.errors import (
    AuthorizationError,
    CorruptRecordError,
    KafkaError,
    TopicAuthorizationFailedError,
    UnsupportedCodecError,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuslo.core.backoff import Backoff
from gpuslo.core.settings import CODEC_PACKAGES, IngestSettings, KafkaSettings
from gpuslo.core.topic_watch import TopicWatch
from gpuslo.ingest.arrow_memory import use_ingest_pool
from gpuslo.ingest.kafka_join import guard_join
from gpuslo.ingest.pipeline import DEDUP_WINDOW, Ingestor, Prepared, retention_days
from gpuslo.ingest.store import Store, StoreError
from gpuslo.ingest.writer import Raw

log = logging.getLogger(__name__)


class ReadingStopped(RuntimeError):
    """The ingest stopped reading for a reason that waiting will not fix: it wrote and committed
    what it read before, and the next start reads on from there."""


class StoppedStarting(RuntimeError):
    """Stopped (SIGTERM) while the Kafka consumer was being made: nothing was read."""


class UnreadableRecords(ReadingStopped):
    """Records the consumer cannot read here: compressed with a codec this installation lacks,
    or a record batch that fails its checksum. kafka-python raises the error from ``poll`` (or
    holds it for its next poll) with the partition's position left before the batch: the ingest
    polls no more, writes and commits what it read before, then stops and says why; nothing
    after the batch is skipped, and the next start meets the same batch."""


class KafkaRefused(ReadingStopped):
    """Kafka refused the consumer: a poll failed for want of rights (an ACL that no longer lets
    this user read a topic), or with another error Kafka does not call retriable (kafka-python's
    ``retriable`` is False) on every poll for ``REFUSED_AFTER_S``; a subscribed topic the user
    may not read; a commit refused for want of rights (the group's ACL). Trying again gets the
    same answer, so the ingest stops as for :class:`UnreadableRecords` (a commit refused for
    another reason, a rebalance, is tried again with the next one)."""


def _named(exc: BaseException) -> str:
    """The error's text with its class named once (kafka-python's errors name themselves:
    "[Error 2] CorruptRecordError: ...")."""
    name, text = type(exc).__name__, str(exc)
    return text if name in text else f"{name}: {text}" if text else name


def _brief(exc: BaseException) -> str:
    """The error's class and the first line of its text, for a log line."""
    return _named(exc).splitlines()[0]


def _refused(exc: Exception) -> str:
    return f"Kafka refused the consumer ({_named(exc)}); check the user's ACLs on the topics and the group"


def _held_error(consumer: Any) -> tuple[Exception, Any, int] | None:
    """The error kafka-python 3 holds back for its next poll (its fetcher's "in-line exception":
    a poll that returned some partitions' records, then met records it cannot read), with the
    partition and offset; None when there is none, or this consumer keeps no such state."""
    meta = getattr(getattr(consumer, "_fetcher", None), "_next_in_line_exception_metadata", None)
    exc = getattr(meta, "exception", None)
    if not isinstance(exc, Exception):
        return None
    return exc, getattr(meta, "partition", None), int(getattr(meta, "fetched_offset", -1))


def _awaits_an_answer(consumer: Any) -> bool:
    """Whether kafka-python waits on a broker that does not answer: a request sent on a
    connection that is up and not answered, or a connection neither made nor refused (a broker
    frozen, or a firewall that drops). A broker restarting refuses connections, and kafka-python
    closes them: a commit then waits out its whole timeout for a coordinator too, but the next
    try may be answered (the broker back; skipped at close, what was written since the last
    commit was read again by the next start). Unknown (kafka-python's internals changed): as if
    it waited on an answer."""
    try:
        conns = list(consumer._client._manager._conns.values())
        return any((c.connected and c.in_flight_requests) or c.initializing for c in conns)
    except Exception:
        return True


def _rebalancing(consumer: Any) -> bool:
    """Whether kafka-python's member is between generations (a join or sync in progress, or one
    needed): it keeps the partitions it had in ``assignment()`` meanwhile, and the rebalance
    waits for the group's slowest member (one inside a long insert polls only after it)."""
    from kafka.structs import MemberState

    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None:
        return False
    state = getattr(coordinator, "state", MemberState.STABLE)
    return getattr(coordinator, "rejoin_needed", False) is True or state != MemberState.STABLE


def _unauthorized(consumer: Any) -> set[str]:
    """The topics the cluster's last metadata says this user may not read (kafka-python keeps
    them, and means to raise them, but 3.0.12 only logs them); empty where it keeps none."""
    cluster = getattr(getattr(consumer, "_client", None), "cluster", None)
    topics = getattr(cluster, "unauthorized_topics", None)
    return set(topics) if isinstance(topics, (set, frozenset)) else set()


def _unreadable(exc: Exception, where: str, offset: int = -1) -> str:
    text = _named(exc)
    at = f" at offset {offset}" if offset >= 0 else ""
    hint = ""
    if isinstance(exc, UnsupportedCodecError):  # the codec from kafka-python's own words, not a topic name
        words = str(exc).lower().split()
        hint = next(
            (
                f": install the Python package {pkg!r} beside the ingest (gpuslo[ingest] brings zstandard)"
                for codec, pkg in CODEC_PACKAGES.items()
                if codec in words
            ),
            "",
        )
    return f"cannot read the records of {where}{at} ({text}){hint}"


# The heartbeat is also how a member hears that its group is rebalancing (a member joined, or
# left cleanly): the coordinator completes the rebalance only when every member has rejoined, so
# until the busiest member's next heartbeat the joining process owns nothing and the partitions
# of one that left are read by nobody. At session/4 (11.25 s at the default 45 s) a second ingest
# process waited 8-10 s for its partitions (bench scaleout). Kafka's own consumer heartbeats every
# 3 s at a 45 s session and advises no more than a third of the session.
MAX_HEARTBEAT_S = 3.0

# The lag gauges are informative: read at most once a second, and never waited on for long.
LAG_EVERY_S = 1.0
LAG_TIMEOUT_MS = 1000
# The group's commit of a partition given back (read once per rebalance): a broker that does
# not answer in this long leaves the partition uncommitted by us until it is read again.
COMMITTED_TIMEOUT_MS = 5000
# A commit, and leaving the group at close: a broker away fails them after this long, not after
# kafka-python's 30 s request timeout (a failed commit is made with the next one, or re-read).
COMMIT_TIMEOUT_MS = 5000
CLOSE_TIMEOUT_MS = 5000
# Leaving the group at the end of a stop whose commit Kafka did not answer: tried, not waited for.
CLOSE_SHORT_MS = 1000
# A failed commit that took this long was not answered (a broker silent, frozen, or cut off by a
# firewall that drops), not refused: trying again at once waits as long.
UNANSWERED_S = 0.8 * COMMIT_TIMEOUT_MS / 1000
# Stopping, a commit is not tried again this long after one Kafka left unanswered (it would wait
# out its own timeout too); tried once this has passed (a long write at close), the broker may be back.
UNANSWERED_HOLD_S = 2 * COMMIT_TIMEOUT_MS / 1000
# Stopping (SIGTERM), a write still in flight is given this long to finish, then the store is
# interrupted: with the close's own bound, a stop ends well inside Kubernetes' 30 s grace period.
STOP_WRITE_GRACE_S = 10.0
# A poll error Kafka does not call retriable, other than rights taken away, stops the ingest only
# when every poll this long ends with one (a broker's UNKNOWN_SERVER_ERROR can be a moment's).
REFUSED_AFTER_S = 30.0


def _merge_offsets(offsets: dict[Any, Any], batch: list[Any]) -> None:
    """The offsets after ``batch``'s records into ``offsets`` (per partition, the furthest)."""
    from kafka.structs import OffsetAndMetadata, TopicPartition

    for r in batch:
        tp = TopicPartition(r.topic, r.partition)
        if tp not in offsets or offsets[tp].offset <= r.offset:
            offsets[tp] = OffsetAndMetadata(r.offset + 1, "", -1)


def heartbeat_interval_ms(session_timeout_s: float) -> int:
    """The consumer's heartbeat interval: at most ``MAX_HEARTBEAT_S``, at most a quarter of the session."""
    return int(min(MAX_HEARTBEAT_S, session_timeout_s / 4) * 1000)


def _default_factory(**kw: Any) -> Any:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(**kw)
    guard_join(consumer)  # kafka-python 3.0.12 can leave a join unfinished for good (ingest/kafka_join.py)
    return consumer


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.consumed = Counter(
            "gpuslo_ingest_consumed_messages", "Messages read from Kafka", ["topic"], registry=registry
        )
        self.written = Counter(
            "gpuslo_ingest_written_rows", "Rows written to the store", ["table"], registry=registry
        )
        self.dead = Counter(
            "gpuslo_ingest_dead_letters", "Messages sent to the dead_letters table", registry=registry
        )
        self.duplicates = Counter(
            "gpuslo_ingest_duplicates_dropped", "Messages dropped as in-batch duplicates", registry=registry
        )
        self.decoded = Counter(
            "gpuslo_ingest_decoded_messages",
            "Messages decoded, by path: vectorised (Arrow) or models (pydantic: other kinds, anything unusual)",
            ["path"],
            registry=registry,
        )
        self.store_errors = Counter(
            "gpuslo_ingest_store_errors", "Failed batch writes (retried)", registry=registry
        )
        self.poll_errors = Counter(
            "gpuslo_ingest_poll_errors",
            "Kafka polls that failed, by kafka-python's error (retriable ones are polled again)",
            ["error"],
            registry=registry,
        )
        self.renewals = Counter(
            "gpuslo_ingest_consumer_renewals",
            "Kafka consumers closed and made anew because they read nothing for ingest.stall_s while behind",
            registry=registry,
        )
        self.commit_errors = Counter(
            "gpuslo_ingest_commit_errors", "Failed offset commits", registry=registry
        )
        self.batches = Counter("gpuslo_ingest_batches", "Batches written and committed", registry=registry)
        self.lag = Gauge(
            "gpuslo_ingest_lag_messages",
            "End offset minus position",
            ["topic", "partition"],
            registry=registry,
        )
        self.batch_seconds = Histogram(
            "gpuslo_ingest_batch_seconds",
            "Write + commit time of one batch",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.paused = Gauge(
            "gpuslo_ingest_paused",
            "1 while the store is unreachable and consumption is paused",
            registry=registry,
        )
        self.topics_missing = Gauge(
            "gpuslo_ingest_kafka_topics_missing",
            "Subscribed Kafka topics the broker answered it does not have: nothing is read from them "
            "until they are made (gpuslo topics --create)",
            registry=registry,
        )
        self.assigned = Gauge(
            "gpuslo_ingest_assigned_partitions",
            "Partitions the consumer group gave this process at its last rebalance",
            registry=registry,
        )


class KafkaIngest:
    def __init__(
        self,
        kafka: KafkaSettings,
        settings: IngestSettings,
        store: Store,
        registry: CollectorRegistry | None = None,
        consumer_factory: Callable[..., Any] = _default_factory,
        sleep: Callable[[float], None] | None = None,
        after_write: Callable[[int], None] | None = None,
        dedup_window: int = DEDUP_WINDOW,
        stop_event: threading.Event | None = None,
    ) -> None:
        self.kafka = kafka
        self.settings = settings
        # beside the writer thread and kafka-python's IO thread, mimalloc (pyarrow's default)
        # gave the decoding its memory as fresh huge pages, doubling its CPU (arrow_memory)
        self.arrow_pool = use_ingest_pool()
        # the store's TTL; ids remembered to tell a replay from a reused id (``ingest --dedup-window``)
        self.ingestor = Ingestor(store, retention_days=retention_days(store), dedup_window=dedup_window)
        self.registry = registry or CollectorRegistry()
        self.metrics = IngestMetrics(self.registry)
        # the writer's backoff between tries: by default cut short by stop_event (a SIGTERM during
        # a store outage is not held for up to retry_max_s)
        self._sleep = sleep if sleep is not None else self._wait_for_stop
        self._after_write = after_write  # test hook: called between the write and the commit
        self._pending: list[Any] = []  # ConsumerRecords read but not yet handed to the writer
        self._record_bytes: int | None = None  # the mean value size of the last poll's records
        # being written, not committed: its future, records, when handed over, and whether the
        # store flushes its marks after it (``_flush_due``)
        self._inflight: tuple[Future[None], list[Any], float, bool] | None = None
        # written batches' offsets held back until the store has flushed their marks (a store
        # that buffers them, Store.buffers_marks), then committed; and when it last flushed
        self._held: dict[Any, Any] = {}
        self._flushed_at = time.monotonic()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuslo-ingest-writer")
        self._store_down = threading.Event()
        self._revoked: set[Any] = set()
        # written offsets whose commit failed (the broker was away): committed with the next
        # batch's, or by the next step that reads nothing, or at close, while still owned
        self._uncommitted: dict[Any, Any] = {}
        # partitions revoked and given back since our last commit of them: another member may
        # have owned them meanwhile and committed past what we hold. Each with the group's
        # commit of it, read at our next commit (None: not read yet); ours is made only past it
        self._regained: dict[Any, int | None] = {}
        # a left-over commit is tried again by an idle step no sooner than this (a commit to a
        # broker that is away blocks up to the request timeout)
        self._commit_backoff = Backoff(settings.retry_initial_s, settings.retry_max_s)
        self._commit_again_at = 0.0
        self._lag_at = 0.0  # the next lag update, no sooner
        self._batches = 0
        self.failed: StoreError | None = None  # the fatal store error that stopped the loop
        self._broken = False  # the writer raised something else: nothing more is committed
        # records kafka-python cannot read were reached, or Kafka refused us: nothing more is
        # polled; what was read before is written and committed, then run() raises it
        self._stopped: ReadingStopped | None = None
        self._kafka_down_since: float | None = None  # the first of the polls failing now
        self._refused_since: float | None = None  # the first of the polls failing non-retriably now
        # the run's stop (SIGTERM): given here, a stop while the consumer is made is not held by it
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self._consumer_factory = consumer_factory
        # progress: the last time records were read or a batch was written; behind: the last
        # lag read found records waiting on an owned partition that is not paused (None: not)
        self._progress_at = time.monotonic()
        self._behind: int | None = None
        self._lag_answered = False  # whether Kafka answered the last lag read
        self._rebalancing_since: float | None = None  # seen rebalancing by the stall check since
        self._topics: TopicWatch | None = None  # the subscribed topics the broker does not have
        self._closing = False  # close() runs: a commit Kafka left unanswered a moment ago is not tried again
        self._unanswered_at: float | None = None  # the last commit timed out then, none succeeded since
        self.consumer = self._new_consumer()

    def _wait_for_stop(self, seconds: float) -> None:
        self.stop_event.wait(seconds)  # (read at each call: the CLI gives its own event after __init__)

    def _new_consumer(self) -> Any:
        """A kafka-python consumer of the group, subscribed to the topics."""
        s = self.settings
        consumer = self._made(
            group_id=s.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=min(s.batch_messages, 5000),
            max_partition_fetch_bytes=s.fetch_partition_bytes,
            session_timeout_ms=int(s.session_timeout_s * 1000),
            heartbeat_interval_ms=heartbeat_interval_ms(s.session_timeout_s),
            **self.kafka.client_kwargs(),
        )
        from kafka import ConsumerRebalanceListener

        ingest = self

        class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            # called by kafka-python inside poll() (ours, or the paused poll of a store outage),
            # on the polling thread: it only records what changed (no write, no commit)
            def on_partitions_revoked(self, revoked: Any) -> None:
                ingest._revoked.update(revoked)

            def on_partitions_assigned(self, assigned: Any) -> None:
                ingest._progress_at = time.monotonic()  # not stalled: just given its partitions
                log.info("assigned %s", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned))
                ingest.metrics.assigned.set(len(assigned))

        consumer.subscribe(self.kafka.topics.all(), listener=_Listener())
        told: list[str] = []
        if self._topics is not None:
            self._topics.close()
            told = self._topics.told
        topics = set(self.kafka.topics.all())
        self._topics = TopicWatch(
            consumer,
            lambda: topics,
            ",".join(self.kafka.bootstrap_servers),
            "nothing is read from {it}",
            told=told,
        )
        return consumer

    def _made(self, **kw: Any) -> Any:
        """The factory's consumer, made on a thread of its own: kafka-python's bootstrap waits up
        to 30 s for a broker that accepts connections and does not answer (hung, SIGSTOPped, a
        firewall that drops), and a SIGTERM meanwhile waited it out (28 s after it at the start,
        past the ingest's 20 s stop). A stop raises :class:`StoppedStarting` at once; the thread,
        a daemon, is left to its bootstrap (nothing was read: nothing is lost); a consumer it
        makes after the stop is closed there (it was left open: its connection and its threads
        lived on in the process)."""
        done = threading.Event()
        out: list[Any] = []
        lock = threading.Lock()
        abandoned = False

        def make() -> None:
            try:
                made = self._consumer_factory(**kw)
            except BaseException as exc:  # raised on the caller's thread
                made = exc
            with lock:
                if abandoned and not isinstance(made, BaseException):
                    try:
                        made.close(timeout_ms=0)  # it joined no group: nothing to leave
                    except Exception as exc:
                        log.debug("closing the consumer made after the stop failed: %s", exc)
                out.append(made)
                done.set()

        threading.Thread(target=make, name="gpuslo-ingest-connect", daemon=True).start()
        while not done.wait(0.05):
            if self.stop_event.is_set():
                with lock:
                    if not done.is_set():  # made meanwhile: returned, and the stop closes it
                        abandoned = True
                        raise StoppedStarting("stopped while waiting for Kafka to answer; nothing was read")
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    # ------------------------------------------------------------------ loop
    def run(self, idle_exit_s: float | None = None) -> None:
        """Until ``stop_event`` (SIGTERM); with ``idle_exit_s``, also after that long with nothing
        read, held or being written while owning partitions (a rebalance in progress does not
        count as idle, nor does a step that read nothing because it still held a whole batch, or
        that waited out a store or a Kafka outage, nor one whose partitions hold records it has not
        read: only a consumer with nothing left to do is idle).
        Raises :class:`ReadingStopped` after writing and committing what was read before it."""
        last_msg = time.monotonic()
        try:
            while not self.stop_event.is_set() and self._stopped is None:
                n = self.step()
                busy = n or self._pending or self._inflight is not None or self._kafka_down_since is not None
                busy = busy or bool(self._behind)  # records wait that this consumer has not read
                if busy or not self.consumer.assignment():
                    last_msg = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - last_msg > idle_exit_s:
                    break
        finally:
            self.close()
        if self._stopped is not None:  # also when reached while stopping or in close()'s writes
            raise self._stopped

    def step(self) -> int:
        """Read one batch (by count or time) and hand it to the writer thread; commit the
        previous batch once the writer finished it. Returns messages read. Raises
        :class:`ReadingStopped` once the records read before it are handed over."""
        if self._stopped is not None:
            raise self._stopped
        s = self.settings
        deadline = time.monotonic() + s.batch_s
        got = 0
        size = sum(len(r.value or b"") for r in self._pending)
        while len(self._pending) < s.batch_messages and size < s.batch_bytes and not self.stop_event.is_set():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            n, nbytes = self._keep(self._poll(min(left_ms, 500), self._records_wanted(size)))
            got, size = got + n, size + nbytes
            if n:
                self._record_bytes = max(1, nbytes // n)
                self._progress_at = time.monotonic()
            if self._stopped is not None:
                break
        if self._pending:
            self._submit_pending()
        else:
            self._finish_inflight()
            if self._held:  # caught up: what was written waits for no later batch
                self._flush_held()
            if self._uncommitted and time.monotonic() >= self._commit_again_at:
                self._commit([])
        self._update_lag()
        self.metrics.topics_missing.set(len(self._topics.check()) if self._topics is not None else 0)
        self._renew_if_stalled()
        return got

    def _renew_if_stalled(self) -> None:
        """A consumer that owns partitions holding records it has not read, that Kafka answers,
        and that has read nothing and written nothing for ``stall_s``, is stuck: kafka-python
        3.0.12 was seen, after a few broker restarts in a row, to stay in the group with its
        positions frozen and every fetch empty, for good (an ingest with ``--idle-exit-s`` then
        exited 0 with the backlog unread). A member waiting for a rebalance is not stuck (the
        group waits for its slowest member, one inside a long insert) unless it waits past
        ``stall_s`` + ``session_timeout_s``. It is closed and a new consumer joins the group; what
        was written is committed first, and a commit left over is dropped rather than made by a
        consumer that may no longer own its partition (its batch is re-read, deduplicated)."""
        if (
            not self._behind
            or not self._lag_answered  # Kafka does not answer now: an outage, not a stuck consumer
            or self._pending
            or self._inflight is not None
            or self._kafka_down_since is not None
            or self._stopped is not None
            or self.stop_event.is_set()
        ):
            return
        now = time.monotonic()
        if _rebalancing(self.consumer):  # waiting for the group (its slowest member), not stuck
            self._rebalancing_since = self._rebalancing_since or now
            if now - self._rebalancing_since < self.settings.stall_s + self.settings.session_timeout_s:
                return
        elif self._rebalancing_since is not None:  # the new generation's partitions get stall_s anew
            self._rebalancing_since, self._progress_at = None, now
        stalled = now - self._progress_at
        if stalled < self.settings.stall_s:
            return
        log.warning(
            "no record read for %.0f s while %d wait on this consumer's partitions: leaving the "
            "group and joining it again with a new Kafka consumer",
            stalled,
            self._behind,
        )
        self.metrics.renewals.inc()
        if self._uncommitted:
            self._commit([])
        self._close_consumer()
        # held offsets too: their marks may not be flushed yet; their batches are read again
        self._uncommitted, self._held, self._regained, self._revoked = {}, {}, {}, set()
        self._kafka_down_since, self._refused_since, self._behind = None, None, None
        self._rebalancing_since = None
        self._progress_at = time.monotonic()
        try:
            self.consumer = self._new_consumer()
        except StoppedStarting:  # SIGTERM meanwhile: nothing read since the old one was closed
            return
        except Exception as exc:  # the old one is closed: stop, the next start joins afresh
            why = f"the Kafka consumer read nothing for {stalled:.0f} s while behind, and a new one could not be made"
            self._stop(ReadingStopped(f"{why} ({_brief(exc)})"), exc)

    def _stop(self, error: ReadingStopped, cause: BaseException) -> None:
        """Read no more: what was read is written and committed, then ``run`` raises ``error``."""
        error.__cause__ = cause
        self._stopped = error

    def _records_wanted(self, size: int) -> int:
        """The most records the next poll may return: the batch's messages left, and about as
        many records as its bytes left hold (by the mean size of the last poll's records; one
        before any was read). kafka-python decompresses only the records a poll returns, so a
        batch is decoded and written as soon as its own records are read, not once the whole
        fetch is (a backlog's first insert waited for every pack fetched: about a tenth of a
        run), and what waits in ``_pending`` stays about one batch of records of one size. Where
        sizes change within a poll (small JSON messages, then packs) it can still take up to the
        estimate's count of the larger ones, as every poll could before."""
        s = self.settings
        left = s.batch_messages - len(self._pending)
        if self._record_bytes is None:
            return min(left, 1)
        return max(1, min(left, -(-(s.batch_bytes - size) // self._record_bytes)))

    def _poll(self, timeout_ms: int, max_records: int | None = None) -> dict[Any, list[Any]]:
        """One poll of kafka-python. Records it cannot read (:class:`UnreadableRecords`) end the
        reading, whether kafka-python raises them now or holds the error back for its next poll
        (a poll that returned other partitions' records first): kafka-python 3.0.12 drops a held
        error when the next poll has its partition paused (a store outage) and then loops for good
        in a later poll, so after either nothing is polled again.

        Any other error kafka-python raises out of a poll is Kafka's, not the records': one it
        calls retriable (a broker away or restarting, a coordinator moving) is a poll that read
        nothing, taking its whole timeout, and the next poll tries again (kafka-python 3.0.12
        raises the connection error of a coordinator lookup during a broker restart out of
        ``poll``: the lookup's metadata refresh in ``ensure_coordinator_ready_async`` is not
        guarded); rights taken away, or another error on every poll for ``REFUSED_AFTER_S``
        (:class:`KafkaRefused`), end the reading."""
        if self._stopped is not None:
            return {}
        try:
            if max_records is None:
                polled: dict[Any, list[Any]] = self.consumer.poll(timeout_ms=timeout_ms)
            else:
                polled = self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except (UnsupportedCodecError, CorruptRecordError) as exc:
            self._stop(UnreadableRecords(_unreadable(exc, self._where(None))), exc)
            return {}
        except KafkaError as exc:
            self.metrics.poll_errors.labels(error=type(exc).__name__).inc()
            now = time.monotonic()
            if exc.retriable:
                self._refused_since = None  # only an unbroken run of refusals counts
            else:
                # rights taken away are for good; another error (a broker's UNKNOWN_SERVER_ERROR
                # once) only when every poll for REFUSED_AFTER_S ends with it
                first = self._refused_since if self._refused_since is not None else now
                self._refused_since = first
                if isinstance(exc, AuthorizationError) or now - first >= REFUSED_AFTER_S:
                    self._stop(KafkaRefused(_refused(exc)), exc)
                    return {}
            if self._kafka_down_since is None:
                self._kafka_down_since = now
                log.warning(
                    "Kafka unavailable (%s); polling on: nothing read is lost or skipped", _brief(exc)
                )
            self.stop_event.wait(timeout_ms / 1000)  # as long as a poll that read nothing
            return {}
        if self._kafka_down_since is not None:
            log.warning("Kafka answers again after %.1f s", time.monotonic() - self._kafka_down_since)
            self._kafka_down_since = None
        self._refused_since = None
        denied = _unauthorized(self.consumer)
        if denied and (denied := denied & set(self.kafka.topics.all())):
            # kafka-python 3.0.12 only logs it: the topic is never assigned, never read
            self.metrics.poll_errors.labels(error="TopicAuthorizationFailedError").inc()
            error = TopicAuthorizationFailedError(", ".join(sorted(denied)))
            self._stop(KafkaRefused(_refused(error)), error)
        held = _held_error(self.consumer)
        if held is not None:
            error, tp, offset = held
            if isinstance(error, AuthorizationError):
                # held back like records it cannot read (a poll that returned another partition's
                # records first), but Kafka's refusal, as if raised now: it was told as unreadable
                # records (a CI run: the topic's READ taken away mid-run)
                self.metrics.poll_errors.labels(error=type(error).__name__).inc()
                self._stop(KafkaRefused(_refused(error)), error)
            else:
                self._stop(UnreadableRecords(_unreadable(error, self._where(tp), offset)), error)
        return polled

    def _where(self, tp: Any) -> str:
        if tp is not None:
            return f"{tp.topic}/{tp.partition}"
        topics = sorted({t.topic for t in self.consumer.assignment()})
        return (
            "one of " + ", ".join(topics) if len(topics) > 1 else "".join(topics) or "the subscribed topics"
        )

    def _keep(self, polled: dict[Any, list[Any]]) -> tuple[int, int]:
        """Polled records into ``_pending`` (after dropping what a rebalance took away); (records, bytes)."""
        if self._revoked:
            self._drop_revoked()
        n = nbytes = 0
        for tp, recs in polled.items():
            self._pending.extend(recs)
            n += len(recs)
            nbytes += sum(len(r.value or b"") for r in recs)
            self.metrics.consumed.labels(tp.topic).inc(len(recs))
        return n, nbytes

    def _drop_revoked(self) -> None:
        from kafka.structs import TopicPartition

        revoked, self._revoked = self._revoked, set()
        owned = set(self.consumer.assignment())
        # a commit left over for a partition taken away is its new owner's to make
        self._uncommitted = {tp: o for tp, o in self._uncommitted.items() if tp in owned}
        self._held = {tp: o for tp, o in self._held.items() if tp in owned}
        self._regained = {tp: f for tp, f in self._regained.items() if tp in owned}
        self._regained |= dict.fromkeys(revoked & owned)  # given back: the group's commit is read again
        keep = [r for r in self._pending if TopicPartition(r.topic, r.partition) in owned]
        if len(keep) < len(self._pending):
            log.info(
                "rebalance took %s: dropped %d unwritten messages; their new owner re-reads them",
                sorted(f"{tp.topic}/{tp.partition}" for tp in revoked),
                len(self._pending) - len(keep),
            )
        self._pending = keep

    def _finish_inflight(self) -> None:
        """Wait for the batch being written, then commit it."""
        done = self._await_inflight()
        if done is not None:
            self._done(*done)

    def _flush_held(self) -> None:
        """Flush the store's marks of the batches written (on the writer thread, as a batch is
        written: a store outage pauses the partitions the same way), then commit them."""
        self._finish_inflight()
        if self._broken or not self._held:
            return
        self._inflight = (self._writer.submit(self._flush_marks), [], time.monotonic(), True)
        self._finish_inflight()

    def _flush_due(self, full: bool) -> bool:
        """Whether the store flushes its marks after the batch being handed over (so that its
        offsets and those held before it are committed): always where it holds none; else when
        the batch closed short (caught up) or ``commit_interval_s`` has passed since the last."""
        if not self.ingestor.store.buffers_marks:
            return True
        return not full or time.monotonic() - self._flushed_at >= self.settings.commit_interval_s

    def _await_inflight(self) -> tuple[list[Any], float, bool] | None:
        """Wait for the batch being written; while the store is down, pause the partitions
        and keep polling (nothing comes back) so the group keeps us. Returns the written
        batch and when it was handed over (None: nothing was in flight, or it stays unwritten)."""
        if self._inflight is None:
            return None
        fut, batch, t0, flushed = self._inflight
        self._inflight = None
        paused = False
        interrupt_at: float | None = None  # stopping: when the store is interrupted (again)
        while True:
            try:
                fut.result(timeout=0.2)
                break
            except FutureTimeout:
                if self.stop_event.is_set():
                    now = time.monotonic()
                    if interrupt_at is None:
                        interrupt_at = now + STOP_WRITE_GRACE_S
                    elif now >= interrupt_at:
                        # a store that does not answer must not hold a stopping ingest (its socket
                        # waits up to send_receive_timeout_s, again at each retry): the write is
                        # cut, fails as TRANSIENT, and is not committed (re-read at the next start);
                        # again each second, should the writer be waiting on a new connection
                        log.warning("stopping: the store has not finished a write; interrupting it")
                        self.ingestor.store.interrupt()
                        interrupt_at = now + 1.0
                if self._store_down.is_set() and not paused:
                    self.metrics.paused.set(1)
                    paused = True
                if paused:
                    # a partition assigned since (a rebalance inside this very poll) is paused too,
                    # and whatever a poll still returns is kept: dropped, its offsets would be
                    # passed by the next commit of its partition
                    self.consumer.pause(*self.consumer.assignment())
                    self._keep(self._poll(0))
            except StoreError as exc:  # nothing of this batch is committed
                if paused:
                    self.consumer.resume(*self.consumer.paused())
                    self.metrics.paused.set(0)
                if not exc.fatal and self.stop_event.is_set():  # stopping while retrying
                    log.warning(
                        "stopping with an unwritten batch of %d messages (re-read on restart): %s"
                        if batch
                        else "stopping with the rollups' marks unflushed (the batches since the last "
                        "commit are re-read on restart): %s",
                        *([len(batch)] if batch else []),
                        str(exc).splitlines()[0],
                    )
                    # a later batch committed would pass this one's offsets: none is written
                    self._broken, self._pending = True, []
                    return None
                self.failed = exc  # fatal: close() writes nothing more; the caller exits non-zero
                raise
            except Exception:  # a bug in the writer: this batch is unwritten, so no later one may commit
                self._broken = True
                raise
        if paused:
            self.consumer.resume(*self.consumer.paused())
            self.metrics.paused.set(0)
        self._progress_at = time.monotonic()
        if batch:  # (a flush of the store's marks alone is no batch)
            self._batches += 1
            if self._after_write is not None:
                self._after_write(self._batches)
        return batch, t0, flushed

    def _done(self, batch: list[Any], t0: float, flushed: bool = True) -> None:
        """A written batch: its offsets committed (with those held before it) where the store
        has flushed its marks since, else held (``_held``); its metrics."""
        if flushed:
            self._flushed_at = time.monotonic()
            for tp, o in self._held.items():  # each partition's furthest, as _merge_offsets keeps
                if tp not in self._uncommitted or self._uncommitted[tp].offset < o.offset:
                    self._uncommitted[tp] = o
            self._held = {}
            self._commit(batch)
        else:
            _merge_offsets(self._held, batch)
        if batch:
            self.metrics.batch_seconds.observe(time.monotonic() - t0)
            self.metrics.batches.inc()

    def _flush_marks(self) -> None:
        """(Writer thread.) The store's marks made durable, retried as a write is while the
        store is away or refuses (nothing to isolate: the marks are the store's own); a fatal
        error, or stopping meanwhile, raises (nothing held is committed)."""
        backoff = Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)
        failing = False
        while True:
            try:
                self.ingestor.store.flush_marks()
                break
            except StoreError as exc:
                self.metrics.store_errors.inc()
                if exc.fatal:
                    self._store_down.clear()
                    raise
                if not failing:
                    log.warning(
                        "store could not flush the rollups' marks; pausing consumption and retrying: %s",
                        str(exc).splitlines()[0],
                    )
                    failing = True
                    self._store_down.set()
                if self.stop_event.is_set():
                    raise
                self._sleep(backoff.fail())
        if failing:
            self._store_down.clear()
            log.info("store flushed the rollups' marks; resuming consumption")

    def _write_with_retry(self, items: list[Raw], prepared: Prepared, flush: bool = False) -> None:
        """(Writer thread.) Retry while the store is unreachable (forever; the main thread
        pauses consumption); when it refuses the data itself, retry a few times, then write
        message by message so that only the refused ones are dead-lettered (a poison message
        never blocks a partition)."""
        backoff = Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)
        refused = 0
        failing = False
        while True:
            try:
                rep = self.ingestor.write(prepared)
                break
            except StoreError as exc:
                self.metrics.store_errors.inc()
                if exc.fatal:
                    self._store_down.clear()
                    raise  # the deployment is wrong: stop, commit nothing
                if not exc.retriable:
                    refused += 1
                    if refused >= self.settings.refused_attempts:
                        log.error(
                            "store refused a batch %d times (%s); isolating the bad messages",
                            refused,
                            str(exc).splitlines()[0],
                        )
                        try:
                            rep = self.ingestor.ingest_isolating(items)
                            break
                        except StoreError as again:  # a message neither written nor dead-lettered
                            self.metrics.store_errors.inc()
                            if not again.retriable:
                                self._store_down.clear()
                                raise
                            exc = again
                if not failing:
                    log.warning(
                        "store write failed; pausing consumption and retrying: %s", str(exc).splitlines()[0]
                    )
                    failing = True
                    self._store_down.set()
                if self.stop_event.is_set():
                    raise  # shutting down: commit nothing, the next consumer re-reads the batch
                self._sleep(backoff.fail())
        if failing:
            self._store_down.clear()
            log.info("store reachable again; resuming consumption")
        for table, n in rep.written.items():
            self.metrics.written.labels(table).inc(n)
        self.metrics.dead.inc(rep.dead_lettered)
        self.metrics.duplicates.inc(rep.duplicates)
        self.metrics.decoded.labels("vectorised").inc(rep.vectorised)
        self.metrics.decoded.labels("models").inc(rep.received - rep.vectorised)
        if flush:
            self._flush_marks()

    def _commit(self, batch: list[Any]) -> None:
        """Commit the batch's offsets with any left over from a failed commit. A failure
        (the broker away, the group rebalancing) keeps them for the next try: a partition
        that reads nothing more would otherwise keep its old commit, and its next owner
        would re-read (deduplicated, but needless). Only owned partitions are committed."""
        if self._revoked:  # a rebalance heard while the batch was written (a paused poll)
            self._drop_revoked()
        offsets = self._uncommitted
        _merge_offsets(offsets, batch)
        try:
            owned = set(self.consumer.assignment())
        except Exception:  # a closed consumer: nothing can be committed
            owned = set()
        for tp in [tp for tp in offsets if tp not in owned]:
            del offsets[tp]  # lost meanwhile: the new owner re-reads; writes are idempotent
        unknown = set()  # regained partitions whose group commit cannot be read now
        for tp in [tp for tp in offsets if tp in self._regained]:
            # lost and given back: the member that had it meanwhile may have committed further
            floor = self._regained[tp]
            if floor is None:
                try:  # bounded: kafka-python retries a coordinator away for ever without one
                    got = self.consumer.committed(tp, timeout_ms=COMMITTED_TIMEOUT_MS)
                except Exception:
                    # unknown now: ours could move theirs back, so not now; kept for the next
                    # try (dropping it lost the commit of a partition that reads nothing more)
                    unknown.add(tp)
                    continue
                floor = self._regained[tp] = -1 if got is None else int(got)
            if offsets[tp].offset <= floor:
                del offsets[tp]  # the group's commit is there already; a later batch passes it
        now = {tp: o for tp, o in offsets.items() if tp not in unknown}
        if unknown:  # idle steps try again after the backoff, and close() once more
            self._commit_again_at = time.monotonic() + self._commit_backoff.fail()
        if not now:
            return
        if (
            self._closing
            and self._unanswered_at is not None
            and (time.monotonic() - self._unanswered_at < UNANSWERED_HOLD_S)
        ):
            # stopping, and Kafka let the last commit time out a moment ago: another try would
            # wait out its own timeout too (three in a row and the leave: a stop of 22 s with the
            # broker silent); what is not committed is read again at the next start, deduplicated
            return
        t0 = time.monotonic()
        try:
            self.consumer.commit(now, timeout_ms=COMMIT_TIMEOUT_MS)
        except Exception as exc:
            if time.monotonic() - t0 >= UNANSWERED_S and _awaits_an_answer(self.consumer):
                self._unanswered_at = time.monotonic()  # no answer: not a refusal or a reset
            self.metrics.commit_errors.inc()
            if isinstance(exc, AuthorizationError) and self._stopped is None:
                # the group's ACL taken away: every later commit is refused too, and an ingest
                # reading on would write for ever what a restart re-reads from the last commit
                self._stop(KafkaRefused(_refused(exc)), exc)
            if not unknown:  # one call, one step of the backoff (an unreadable floor took it already)
                self._commit_again_at = time.monotonic() + self._commit_backoff.fail()
            log.warning(
                "offset commit failed (%s: %s); tried again with the next commit (a restart "
                "before it re-reads the batch, deduplicated)",
                type(exc).__name__,
                exc,
            )
            return
        self._unanswered_at = None
        if not unknown:
            self._commit_backoff.reset()
            self._commit_again_at = 0.0
        for tp in now:
            self._regained.pop(tp, None)  # ours is past the group's: we are its only committer now
            del offsets[tp]

    def _update_lag(self) -> None:
        """The lag gauges, at most every ``LAG_EVERY_S``: a round trip to the broker that, while
        it is away, gives up after ``LAG_TIMEOUT_MS`` (kafka-python's own bound is the 30 s
        request timeout, and ``position`` of a partition just assigned has none)."""
        now = time.monotonic()
        if now < self._lag_at:
            return
        self._lag_at = now + LAG_EVERY_S
        try:
            assigned = list(self.consumer.assignment())
            if not assigned:
                self._behind = None
                return
            ends = self.consumer.end_offsets(assigned, timeout_ms=LAG_TIMEOUT_MS)
            paused = set(self.consumer.paused())
            behind = 0
            for tp in assigned:
                pos = self.consumer.position(tp, timeout_ms=LAG_TIMEOUT_MS)
                lag = max(0, ends.get(tp, pos) - pos)
                self.metrics.lag.labels(tp.topic, str(tp.partition)).set(lag)
                behind += 0 if tp in paused else lag
            self._behind, self._lag_answered = behind or None, True
        except Exception as exc:  # lag is informative; never fail the loop for it
            self._lag_answered = False
            log.debug("lag update failed: %s", exc)

    def close(self) -> None:
        """Write and commit what was read (also on SIGTERM), then leave the group. After a
        fatal store error nothing more is written or committed: the next start re-reads. A
        commit Kafka left unanswered a moment ago is not tried again, and the group is then left
        within ``CLOSE_SHORT_MS``: a broker that does not answer costs the stop one wait."""
        self._closing = True
        try:
            if self.failed is None and not self._broken:
                self.flush()
        finally:
            self.stop_event.set()  # a writer still retrying gives up (it commits nothing)
            self._writer.shutdown(wait=True)
            self._close_consumer(CLOSE_SHORT_MS if self._unanswered_at is not None else CLOSE_TIMEOUT_MS)

    def _close_consumer(self, timeout_ms: int = CLOSE_TIMEOUT_MS) -> None:
        """Leave the group, within ``timeout_ms`` (kafka-python's own bound is the 30 s request
        timeout: a SIGTERM during a broker outage outlived Kubernetes' grace period)."""
        try:
            self.consumer.close(timeout_ms=timeout_ms)
        except Exception as exc:  # leaving the group is best effort: the group drops us anyway
            log.warning(
                "leaving the consumer group failed (%s); the group gives this member's "
                "partitions to the others after session_timeout_s",
                _brief(exc),
            )

    def flush(self) -> None:
        """Write and commit everything read so far (the group is kept)."""
        while self._pending:
            self._submit_pending()
        self._finish_inflight()
        if self._held and not self._broken:
            self._flush_held()
        if self._uncommitted and not self._broken:
            self._commit([])

    def _submit_pending(self) -> None:
        if not self._pending:
            return
        cut, size = 0, 0  # at most batch_bytes (one message at least): the rest waits for the next
        while cut < len(self._pending) and (cut == 0 or size < self.settings.batch_bytes):
            size += len(self._pending[cut].value or b"")
            cut += 1
        batch, self._pending = self._pending[:cut], self._pending[cut:]
        items = [
            Raw(
                f"{r.topic}/{r.partition}/{r.offset}",
                r.value if r.value is not None else b"",
                r.topic,
                r.partition,
                r.offset,
            )
            for r in batch
        ]
        t0 = time.monotonic()
        try:
            prepared = self.ingestor.prepare(items)  # decoding overlaps the previous batch's insert
        except BaseException:
            # a bug in the decoding (a bad message is dead-lettered, never raised): this batch,
            # out of _pending, is unwritten, so no later one may commit (close() writes none)
            self._broken, self._pending = True, []
            raise
        done = self._await_inflight()
        if self._broken:  # the previous batch is unwritten: this one waits for the restart too
            return
        full = len(batch) >= self.settings.batch_messages or size >= self.settings.batch_bytes
        flush = self._flush_due(full)
        self._inflight = (
            self._writer.submit(self._write_with_retry, items, prepared, flush),
            batch,
            t0,
            flush,
        )
        if done is not None:  # committed while the writer has the next batch (a round trip)
            self._done(*done)

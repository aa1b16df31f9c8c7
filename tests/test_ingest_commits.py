"""The ingest's offset commits when a commit fails: the broker away (a restart) or the group
rebalancing. A written batch whose commit failed is committed with the next one; a partition
that reads nothing more is committed by the next step that reads nothing, or at close. Its
offsets are never committed once the partition is taken away (its new owner's commit must
not be moved back), and a commit never moves a partition's offset backwards.

The consumer here follows kafka-python's ``KafkaConsumer`` as ``KafkaIngest`` uses it: a
commit raises ``KafkaConnectionError`` while the broker is away (the real broker's outage is
in tests/test_ingest_faults.py)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from kafka.errors import CommitFailedError, KafkaConnectionError, KafkaTimeoutError
from kafka.structs import TopicPartition

from gpuslo.core.settings import IngestSettings, KafkaSettings
from gpuslo.ingest.kafka_consumer import KafkaIngest
from gpuslo.ingest.store import Failure, Row, Store, StoreError

TOPIC = "gpuslo.latency"


class Recording(Store):
    def __init__(self) -> None:
        self.rows = 0

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        pass

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        n = len(next(iter(columns.values())))
        self.rows += n
        return n

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        return []


class Consumer:
    """Records arrive per poll as the test scripts them; ``commit`` fails while ``down``."""

    def __init__(self, partitions: int) -> None:
        self.owned = {TopicPartition(TOPIC, p) for p in range(partitions)}
        self.script: list[dict[int, int]] = []  # per poll: partition -> how many records
        self.next = dict.fromkeys(range(partitions), 0)
        self.committed: dict[TopicPartition, int] = {}
        self.history: list[dict[TopicPartition, int]] = []
        self.down: Any = None  # the exception a commit raises now
        self.listener: Any = None
        self.attempts = 0
        # what a commit got wrong (asserting inside commit() would be caught by the ingest as a
        # failed commit): checked by every test
        self.violations: list[str] = []

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        self.listener = listener

    def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        if not self.script:
            return {}
        out: dict[Any, list[Any]] = {}
        for p, n in self.script.pop(0).items():
            tp = TopicPartition(TOPIC, p)
            out[tp] = [
                type(
                    "R",
                    (),
                    {"topic": TOPIC, "partition": p, "offset": self.next[p] + i, "value": b"not json"},
                )()
                for i in range(n)
            ]
            self.next[p] += n
        return out

    def revoke(self, p: int) -> None:
        tp = TopicPartition(TOPIC, p)
        self.owned.discard(tp)
        self.listener.on_partitions_revoked({tp})

    def commit(self, offsets: dict[Any, Any], timeout_ms: Any = None) -> None:
        self.attempts += 1
        if self.down is not None:
            raise self.down
        for tp, o in offsets.items():
            if tp not in self.owned:
                self.violations.append(f"committed {tp} after it was taken away")
            if o.offset < self.committed.get(tp, 0):
                self.violations.append(f"a commit moved {tp} back from {self.committed[tp]} to {o.offset}")
            self.committed[tp] = o.offset
        self.history.append({tp: o.offset for tp, o in offsets.items()})

    def assignment(self) -> set[Any]:
        return set(self.owned)

    def end_offsets(self, tps: list[Any], timeout_ms: Any = None) -> dict[Any, int]:
        return dict.fromkeys(tps, 0)

    def position(self, tp: Any, timeout_ms: Any = None) -> int:
        return 0

    def pause(self, *tps: Any) -> None:
        pass

    def paused(self) -> set[Any]:
        return set()

    def resume(self, *tps: Any) -> None:
        pass

    def close(self, timeout_ms: Any = None) -> None:
        pass


def _ingest(c: Consumer, store: Store, retry_s: float = 1e-4) -> KafkaIngest:
    s = IngestSettings(
        batch_messages=5, batch_s=0.05, metrics_port=0, retry_initial_s=retry_s, retry_max_s=retry_s
    )
    return KafkaIngest(KafkaSettings(), s, store, consumer_factory=lambda **_: c)


def written_commit_failed(c: Consumer, error: Exception | None = None, retry_s: float = 1e-4) -> KafkaIngest:
    """An ingest over ``c`` that read and wrote its first records while every commit failed
    with ``error`` (the broker away by default); commits work again when it returns."""
    ing = _ingest(c, Recording(), retry_s)
    c.down = error or KafkaConnectionError("111 ECONNREFUSED")
    ing.step()
    ing.step()  # written; its commit fails
    assert c.attempts >= 1 and not c.history
    c.down = None
    return ing


OUTAGES = [KafkaConnectionError("111 ECONNREFUSED"), CommitFailedError("group rebalanced")]


@pytest.mark.parametrize("error", OUTAGES, ids=["broker-away", "rebalancing"])
@pytest.mark.parametrize("fail_from,fail_for", [(a, b) for a in range(4) for b in range(1, 4)])
def test_a_failed_commit_is_made_later_whichever_commits_fail(
    error: Exception, fail_from: int, fail_for: int
) -> None:
    """Three partitions; partition 2 reads only in the first batches, so a failed commit of it
    has no later batch of its own to ride on. Every sweep of which commits fail ends with each
    partition committed past everything written."""
    c = Consumer(3)
    c.script = [{0: 3, 1: 2, 2: 4}, {0: 4, 2: 1}, {0: 2, 1: 3}, {0: 1}, {1: 2}, {0: 3}]
    store = Recording()
    ing = _ingest(c, store)
    for step in itertools.count():
        c.down = error if fail_from <= step < fail_from + fail_for else None
        ing.step()
        if not c.script and not ing._pending and ing._inflight is None and step > fail_from + fail_for:
            break
    assert c.committed == {TopicPartition(TOPIC, p): n for p, n in c.next.items()}
    assert store.rows == sum(c.next.values())  # every record a dead letter, none lost
    ing.close()
    assert c.violations == []


def test_the_last_failed_commit_is_made_at_close() -> None:
    c = Consumer(1)
    c.script = [{0: 3}]
    ing = written_commit_failed(c)
    ing.close()
    assert c.committed == {TopicPartition(TOPIC, 0): 3} and c.violations == []


def test_a_failed_commit_of_a_partition_taken_away_is_never_made() -> None:
    c = Consumer(2)
    c.script = [{0: 3, 1: 3}]
    ing = written_commit_failed(c)
    c.revoke(1)  # the rebalance after the outage gave partition 1 to another member
    c.script = [{}]
    ing.step()
    assert c.committed == {TopicPartition(TOPIC, 0): 3}
    ing.close()
    assert all(TopicPartition(TOPIC, 1) not in h for h in c.history) and c.violations == []


def test_a_partition_taken_away_while_polling_drops_its_left_over_commit() -> None:
    """The revocation arrives (from kafka-python's IO thread) during a poll that also returns
    more of the partition still owned: the next commit carries only that one."""
    c = Consumer(2)
    c.script = [{0: 2, 1: 2}]
    ing = written_commit_failed(c)
    real_poll = c.poll

    def poll(timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        c.revoke(1)
        c.poll = real_poll  # type: ignore[method-assign]
        return real_poll(timeout_ms, max_records)

    c.poll = poll  # type: ignore[method-assign]
    c.script = [{0: 2}]
    for _ in range(3):
        ing.step()
    assert c.committed == {TopicPartition(TOPIC, 0): 4}
    ing.close()
    assert c.violations == []


def test_idle_steps_try_a_left_over_commit_again_only_after_the_backoff() -> None:
    """A commit to a broker that is away blocks up to the request timeout: an idle step does
    not try again before the retry backoff (30 s here), so the loop keeps stepping."""
    c = Consumer(1)
    c.script = [{0: 3}]
    ing = written_commit_failed(c, retry_s=30.0)
    c.down = KafkaConnectionError("111 ECONNREFUSED")
    assert c.attempts == 1
    for _ in range(10):
        ing.step()
    assert c.attempts == 1 and c.committed == {}
    c.down = None
    ing.close()  # the last try, whatever the backoff
    assert c.committed == {TopicPartition(TOPIC, 0): 3} and c.attempts == 2


def test_the_lag_is_read_seldom_and_each_read_is_bounded() -> None:
    """The lag gauges cost a broker round trip (kafka-python waits up to its 30 s request
    timeout for one, and for ever for the position of a partition just assigned): read at
    most once a second, never every step, each read with a timeout."""
    calls: list[tuple[str, Any]] = []

    class Timed(Consumer):
        def end_offsets(self, tps: list[Any], timeout_ms: Any = None) -> dict[Any, int]:
            calls.append(("end_offsets", timeout_ms))
            return super().end_offsets(tps)

        def position(self, tp: Any, timeout_ms: Any = None) -> int:
            calls.append(("position", timeout_ms))
            return 0

    c = Timed(3)
    ing = _ingest(c, Recording())
    steps = 40  # 50 ms each (batch_s): about 2 s
    for _ in range(steps):
        ing.step()
    ends = [t for name, t in calls if name == "end_offsets"]
    assert 1 <= len(ends) <= steps // 4, f"the lag was read {len(ends)} times in {steps} steps"
    assert all(t is not None and t <= 5000 for _, t in calls), calls
    ing.close()


def test_a_batch_is_committed_while_the_writer_has_the_next_one() -> None:
    """A commit is a round trip to the broker: made while the writer thread inserts the next
    batch, not while it waits (the writer idle through every commit cost the ingest about 6 % of
    its throughput on packs). Each commit still follows the write of the batch it commits."""
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    class Held(Recording):
        def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
            inside.set()
            if self.rows:  # every insert after the first waits until a commit has looked (bounded)
                release.wait(5)
            inside.clear()
            return super().insert(table, columns)

    class Looking(Consumer):
        def commit(self, offsets: dict[Any, Any], timeout_ms: Any = None) -> None:
            seen.append(inside.wait(2.0))  # the next batch's insert under way?
            release.set()
            super().commit(offsets)

    c = Looking(1)
    c.script = [{0: 5}, {0: 5}]
    store = Held()
    ing = _ingest(c, store)
    ing.step()  # batch 1 handed to the writer
    ing.step()  # batch 2 read; batch 1 written, batch 2 handed over, then batch 1 committed
    ing.close()
    assert seen[0], "batch 1 was committed while the writer had nothing to do"
    assert c.history[0] == {TopicPartition(TOPIC, 0): 5} and c.committed == {TopicPartition(TOPIC, 0): 10}
    assert store.rows == 10 and not c.violations, c.violations


def test_a_consumer_that_cannot_leave_its_group_still_closes(caplog: pytest.LogCaptureFixture) -> None:
    """kafka-python's close leaves the group over the network: an error there (the broker away)
    is a warning, never an exception out of ``run`` or ``close`` after everything was committed."""
    c = Consumer(1)
    c.script = [{0: 3}]

    def close(timeout_ms: Any = None) -> None:
        raise KafkaConnectionError("111 ECONNREFUSED")

    c.close = close  # type: ignore[method-assign]
    ing = _ingest(c, Recording())
    with caplog.at_level(logging.WARNING, logger="gpuslo.ingest.kafka_consumer"):
        ing.run(idle_exit_s=0.2)
    assert c.committed == {TopicPartition(TOPIC, 0): 3}
    assert any(
        "leaving the consumer group failed (KafkaConnectionError" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("lasts", [False, True])
def test_a_non_retriable_poll_error_stops_the_ingest_only_when_it_lasts(
    monkeypatch: pytest.MonkeyPatch, lasts: bool
) -> None:
    """A broker's UNKNOWN_SERVER_ERROR (kafka-python: not retriable) out of a few polls is
    polled through; out of every poll for ``REFUSED_AFTER_S`` it stops the ingest
    (:class:`KafkaRefused`) after what was read before is written and committed. Rights taken
    away stop it at once (tests/test_ingest_kafka_errors.py, on the real broker)."""
    from kafka.errors import UnknownError

    from gpuslo.ingest import kafka_consumer
    from gpuslo.ingest.kafka_consumer import KafkaRefused

    monkeypatch.setattr(kafka_consumer, "REFUSED_AFTER_S", 0.3)
    c = Consumer(1)
    c.script = [{0: 3}, {}, {}, {0: 2}]
    failing = {"n": 10**9 if lasts else 3}
    real_poll = c.poll

    def poll(timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        if c.script and len(c.script) == 3 and failing["n"] > 0:  # after the first records
            failing["n"] -= 1
            raise UnknownError("the broker had a moment")
        return real_poll(timeout_ms, max_records)

    c.poll = poll  # type: ignore[method-assign]
    ing = _ingest(c, Recording())
    if lasts:
        with pytest.raises(KafkaRefused, match="UnknownError"):
            ing.run(idle_exit_s=5)
        assert c.committed == {TopicPartition(TOPIC, 0): 3}
    else:
        ing.run(idle_exit_s=0.5)
        assert c.committed == {TopicPartition(TOPIC, 0): 5}
    assert not c.violations


class Behind(Consumer):
    """Records wait on partition 0 (end offset 100, position 0) and no poll returns any;
    ``answers``: whether Kafka answers the lag reads."""

    def __init__(self, answers: bool = True) -> None:
        super().__init__(1)
        self.answers = answers
        self.closed = False

    def end_offsets(self, tps: list[Any], timeout_ms: Any = None) -> dict[Any, int]:
        if not self.answers:
            raise KafkaConnectionError("111 ECONNREFUSED")
        return dict.fromkeys(tps, 100)

    def close(self, timeout_ms: Any = None) -> None:
        self.closed = True


def _stalling(factory: Any, stall_s: float = 1.0) -> KafkaIngest:
    s = IngestSettings(batch_messages=5, batch_s=0.05, metrics_port=0, stall_s=stall_s)
    return KafkaIngest(KafkaSettings(), s, Recording(), consumer_factory=factory)


def test_a_stuck_consumer_that_cannot_be_made_anew_stops_the_ingest_with_one_line() -> None:
    from gpuslo.ingest.kafka_consumer import ReadingStopped

    made: list[Behind] = []

    def factory(**_: Any) -> Behind:
        if made:
            raise KafkaConnectionError("NoBrokersAvailable")
        made.append(Behind())
        return made[0]

    ing = _stalling(factory)
    with pytest.raises(ReadingStopped, match="could not be made"):
        ing.run(idle_exit_s=0.2)  # behind: never idle
    assert made[0].closed and ing.registry.get_sample_value("gpuslo_ingest_consumer_renewals_total") == 1


def test_a_consumer_behind_while_kafka_does_not_answer_is_waiting_not_stuck() -> None:
    """An outage is not a stall: lag reads failing, the consumer is kept (a new one could not
    join anyway), and it is not idle either (the records are still there)."""
    c = Behind()
    ing = _stalling(lambda **_: c)
    ing.step()  # one lag read answered: behind
    c.answers = False
    time.sleep(1.1)  # the next step reads the lag again (at most once a second), and past stall_s
    threading.Timer(2.5, ing.stop_event.set).start()
    ing.run(idle_exit_s=0.2)
    assert ing.registry.get_sample_value("gpuslo_ingest_consumer_renewals_total") == 0


class Buffering(Recording):
    """A store that holds the rollups' marks of what it took until ``flush_marks`` (as the
    embedded store's Buffer does): each row written is durable only once flushed. Its flushes
    fail as scripted (``fail``: the errors the next flushes raise, in order)."""

    buffers_marks = True

    def __init__(self) -> None:
        super().__init__()
        self.flushed = 0  # the rows whose marks are durable
        self.flushes = 0
        self.fail: list[Exception] = []

    def flush_marks(self) -> None:
        if self.fail:
            raise self.fail.pop(0)
        self.flushes += 1
        self.flushed = self.rows


def _watched(c: Consumer, store: Buffering) -> list[str]:
    """Every commit of ``c`` checked: no offset committed past what the store has flushed (every
    record here is one dead letter, one row)."""
    wrong: list[str] = []
    commit = c.commit

    def checked(offsets: dict[Any, Any], timeout_ms: Any = None) -> None:
        after = {**c.committed, **{tp: o.offset for tp, o in offsets.items()}}
        if sum(after.values()) > store.flushed:
            wrong.append(f"committed {sum(after.values())} records, {store.flushed} flushed")
        commit(offsets, timeout_ms)

    c.commit = checked  # type: ignore[method-assign]
    return wrong


@pytest.mark.parametrize("interval_s", [0.0, 0.02, 60.0])
@pytest.mark.parametrize(
    "fail",
    [
        [],
        [StoreError("the disk is full", Failure.TRANSIENT)] * 3,
        [StoreError("constraint", Failure.REFUSED)],
    ],
    ids=["none", "transient-x3", "refused"],
)
def test_a_store_that_buffers_marks_has_them_flushed_before_any_commit(
    interval_s: float, fail: list[Exception]
) -> None:
    """Full batches (a backlog) hold their commits for ``commit_interval_s``, a short one
    (caught up) flushes and commits at once; whichever flushes fail meanwhile, nothing is ever
    committed past the marks flushed, and everything ends flushed and committed."""
    c = Consumer(2)
    c.script = [{0: 5}, {1: 5}, {0: 3, 1: 2}, {0: 5}, {1: 1}, {}, {0: 5}, {1: 5}]
    store = Buffering()
    store.fail = list(fail)
    wrong = _watched(c, store)
    s = IngestSettings(batch_messages=5, batch_s=0.05, metrics_port=0, retry_initial_s=1e-4,
                       retry_max_s=1e-4, commit_interval_s=interval_s)  # fmt: skip
    ing = KafkaIngest(KafkaSettings(), s, store, consumer_factory=lambda **_: c)
    while c.script:
        ing.step()
    ing.step()  # nothing read: what is held is flushed and committed
    assert store.flushed == store.rows == sum(c.next.values())
    assert c.committed == {TopicPartition(TOPIC, p): n for p, n in c.next.items()}
    ing.close()
    assert wrong == [] and c.violations == []
    assert not store.fail  # every scripted failure was met, and retried
    if interval_s == 60.0:  # the full batches of the backlog share their flushes
        assert store.flushes < len([b for b in c.history if b]) + 3


def test_a_fatal_error_flushing_marks_commits_nothing_they_cover() -> None:
    c = Consumer(1)
    c.script = [{0: 5}, {0: 5}]
    store = Buffering()
    s = IngestSettings(batch_messages=5, batch_s=0.05, metrics_port=0, commit_interval_s=60.0)
    ing = KafkaIngest(KafkaSettings(), s, store, consumer_factory=lambda **_: c)
    ing.step()
    ing.step()
    store.fail = [StoreError("no such table rollup_dirty_store", Failure.FATAL)]
    with pytest.raises(StoreError):
        ing.step()  # caught up: the flush of both batches' marks fails for good
    ing.close()
    assert c.committed == {} and ing.failed is not None and store.flushed == 0


def test_the_kafka_ingest_remembers_as_many_ids_as_it_is_told() -> None:
    """``gpuslo ingest --kafka ... --dedup-window N``: the window was read by a file's ingest only
    (the consumer kept the default 250,000 ids)."""
    for n in (0, 7, 250_000):
        ing = KafkaIngest(KafkaSettings(), IngestSettings(metrics_port=0), Recording(),
                          consumer_factory=lambda **_: Consumer(1), dedup_window=n)  # fmt: skip
        try:
            assert ing.ingestor._ids.size == n
        finally:
            ing.close()


def test_a_stop_after_a_commit_kafka_left_unanswered_does_not_wait_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker that does not answer (frozen, or behind a firewall that drops): each commit waits
    out its timeout. A stop right after one does not try again (it tried twice more, then left
    the group: 22 s on the real broker, SIGSTOPped), and leaves within ``CLOSE_SHORT_MS``; what is
    not committed is read again at the next start. A commit refused at once (a broker restarting)
    is still tried at close (the test above)."""
    from gpuslo.ingest import kafka_consumer

    monkeypatch.setattr(kafka_consumer, "UNANSWERED_S", 0.05)
    c = Consumer(1)
    c.script = [{0: 3}]
    left: list[Any] = []
    c.close = lambda timeout_ms=None: left.append(timeout_ms)  # type: ignore[method-assign]
    real_commit = c.commit

    def silent(offsets: dict[Any, Any], timeout_ms: Any = None) -> None:
        if c.down is not None:
            time.sleep(0.1)  # the broker's silence, waited out
        real_commit(offsets, timeout_ms)

    c.commit = silent  # type: ignore[method-assign]
    ing = _ingest(c, Recording())
    c.down = KafkaTimeoutError("Timeout waiting for future")
    ing.step()
    ing.step()  # written; its commit waited and failed
    tried = c.attempts
    assert tried >= 1 and not c.history
    ing.close()
    assert c.attempts == tried  # not again
    assert left == [kafka_consumer.CLOSE_SHORT_MS]
    assert c.committed == {} and c.violations == []


def test_sigterm_while_a_stuck_consumer_is_made_anew_ends_the_ingest_without_an_error() -> None:
    """The new consumer's bootstrap waits for a broker that does not answer (up to 30 s): a
    SIGTERM meanwhile ends the run at once and cleanly (nothing was read since the old one was
    closed), not with 'a new one could not be made' and exit 2."""
    made: list[Behind] = []
    release = threading.Event()

    def factory(**_: Any) -> Behind:
        if made:
            release.wait(30)  # kafka-python's bootstrap, waiting for an answer
        made.append(Behind())
        return made[-1]

    ing = _stalling(factory)
    threading.Timer(2.0, ing.stop_event.set).start()
    try:
        t0 = time.monotonic()
        ing.run(idle_exit_s=0.2)  # behind: never idle; stalled after 1 s, renewed; then stopped
        assert time.monotonic() - t0 < 15
    finally:
        release.set()
    assert made[0].closed and ing.registry.get_sample_value("gpuslo_ingest_consumer_renewals_total") == 1


def test_a_consumer_made_after_a_stop_at_the_start_is_closed() -> None:
    """SIGTERM while the consumer is made (kafka-python's bootstrap waiting for a broker that
    answers late): the ingest stops at once, and the consumer the bootstrap gives afterwards is
    closed, not left open in the process with its connection and threads."""
    from gpuslo.ingest.kafka_consumer import StoppedStarting

    c = Consumer(1)
    closed: list[Any] = []
    c.close = lambda timeout_ms=None: closed.append(timeout_ms)  # type: ignore[method-assign]
    answer = threading.Event()

    def late(**_: Any) -> Consumer:
        answer.wait(10)
        return c

    stop = threading.Event()
    stop.set()
    with pytest.raises(StoppedStarting):
        KafkaIngest(KafkaSettings(), IngestSettings(metrics_port=0), Recording(), consumer_factory=late,
                    stop_event=stop)  # fmt: skip
    answer.set()  # the broker answers after the stop
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed, "the consumer made after the stop was left open"


def test_the_consumer_reconnects_within_a_second_of_a_broker_back() -> None:
    """kafka-python's reconnect backoff doubles up to 30 s: after a broker restart the ingest
    went on refusing to connect for up to that long, and a stop meanwhile committed nothing
    (tests/test_ingest_close_commit.py shows it on the real broker). Kafka's own client stops
    at 1 s; so does every client gpuslo makes (the agent's producer: test_kafka_sink.py)."""
    from gpuslo.core.settings import RECONNECT_BACKOFF_MAX_MS

    made: list[dict[str, Any]] = []

    def factory(**kw: Any) -> Consumer:
        made.append(kw)
        return Consumer(1)

    ing = KafkaIngest(KafkaSettings(), IngestSettings(metrics_port=0), Recording(), consumer_factory=factory)
    ing.close()
    assert made and made[0]["reconnect_backoff_max_ms"] == RECONNECT_BACKOFF_MAX_MS == 1000

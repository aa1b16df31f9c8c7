"""The guarded join (ingest/kafka_join.py) when its JoinGroup/SyncGroup task fails, on the real
broker: a failure injected once into the task, then the consumer must end stable with its
partitions, each poll returning (kafka-python's own loop retries a failed task on the next poll)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.servers.kafka import KafkaBroker
from tests.test_kafka_join import _consumer, _topic

pytestmark = pytest.mark.integration


def _fail_once(consumer: Any, error: BaseException) -> list[int]:
    """The coordinator's next join task raises ``error``; the ones after it are its own."""
    coordinator = consumer._coordinator
    real = coordinator._do_join_and_sync_async
    calls: list[int] = []

    async def once() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return await real()

    coordinator._do_join_and_sync_async = once
    return calls


def _polls_to_stable(consumer: Any, topic: str, deadline_s: float) -> tuple[bool, list[BaseException]]:
    """Polls (1 ms, then 0.2 s) until stable with the topic's 3 partitions; each poll on its own
    thread, given 10 s to return (a poll that does not is reported, and unstuck)."""
    from kafka.structs import MemberState

    raised: list[BaseException] = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:

        def poll() -> None:
            try:
                consumer.poll(timeout_ms=1)
            except Exception as exc:
                raised.append(exc)

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():
            consumer._coordinator._join_task = None  # breaks the loop that spins (it reads the task)
            t.join(10)
            raise AssertionError("a poll did not return in 10 s: the join loop spins on the IO thread")
        owned = [tp for tp in consumer.assignment() if tp.topic == topic]
        if consumer._coordinator.state is MemberState.STABLE and len(owned) == 3:
            return True, raised
        time.sleep(0.2)
    return False, raised


def _join_ended_unread(consumer: Any, wait_end: bool = True) -> None:
    """Polls (1 ms) until a join is scheduled, then (``wait_end``) waits for it to end, unread."""
    deadline = time.monotonic() + 30
    while consumer._coordinator._join_task is None:
        assert time.monotonic() < deadline, "no join scheduled"
        consumer.poll(timeout_ms=1)
        time.sleep(0.05)
    while wait_end and not consumer._coordinator._join_task.is_done:
        assert time.monotonic() < deadline, "the join did not end"
        time.sleep(0.1)


def _errors() -> list[Any]:
    from kafka import errors

    return [
        errors.KafkaTimeoutError("a request that timed out before it was sent"),
        errors.RequestTimedOutError(),
        errors.CoordinatorNotAvailableError(),
        errors.NodeNotReadyError(),
        errors.RebalanceInProgressError(),
        errors.UnknownMemberIdError(),
        errors.IllegalGenerationError(),
        errors.MemberIdRequiredError(),
    ]


@pytest.mark.parametrize("error", _errors(), ids=lambda e: type(e).__name__)
def test_a_retried_join_failure_ends_stable(kafka: KafkaBroker, error: BaseException) -> None:
    topic = _topic(kafka)
    consumer = _consumer(kafka, f"g-{topic}", guarded=True)
    calls = _fail_once(consumer, error)
    consumer.subscribe([topic])
    try:
        stable, raised = _polls_to_stable(consumer, topic, 40)
        assert stable, f"not stable after the join task failed once with {error!r}"
        assert not raised, f"poll raised {raised!r}"
        assert len(calls) >= 2
    finally:
        consumer.close()


@pytest.mark.parametrize("case", ["assignor crash", "non-retriable"])
def test_a_join_that_raised_is_retried_by_the_next_poll(kafka: KafkaBroker, case: str) -> None:
    """The task's error comes out of one poll (as without the guard); the next poll joins
    again instead of raising the same error for good."""
    from kafka import errors

    error = (
        RuntimeError("assignor crashed")
        if case == "assignor crash"
        else errors.GroupAuthorizationFailedError()
    )
    topic = _topic(kafka)
    consumer = _consumer(kafka, f"g-{topic}", guarded=True)
    _fail_once(consumer, error)
    consumer.subscribe([topic])
    try:
        stable, raised = _polls_to_stable(consumer, topic, 40)
        assert stable, f"not stable after one failed join ({raised[:1]!r}, raised {len(raised)} times)"
        assert len(raised) == 1, f"the error came out of {len(raised)} polls"
    finally:
        consumer.close()


def _counting() -> Any:
    from kafka import ConsumerRebalanceListener

    class Counting(ConsumerRebalanceListener):  # type: ignore[misc]
        def __init__(self) -> None:
            self.revoked = 0
            self.assigned = 0

        def on_partitions_revoked(self, revoked: Any) -> None:
            self.revoked += 1

        def on_partitions_assigned(self, assigned: Any) -> None:
            self.assigned += 1

    return Counting()


def test_the_listener_hears_each_rebalance_once(kafka: KafkaBroker) -> None:
    """A busy guarded consumer: its first join and the rejoin for grown partitions are each
    heard once by the listener (one revocation, one assignment)."""
    from tests.test_kafka_join import _grow, _stable_with

    topic = _topic(kafka)
    consumer = _consumer(kafka, f"g-{topic}", guarded=True)
    listener = _counting()
    consumer.subscribe([topic], listener=listener)
    try:
        assert _stable_with(consumer, topic, 3, 30)
        first = (listener.revoked, listener.assigned)
        _grow(kafka, topic, 5)
        assert _stable_with(consumer, topic, 5, 30)
        for _ in range(10):  # nothing more to hear
            consumer.poll(timeout_ms=1)
            time.sleep(0.2)
        assert first == (1, 1), first
        assert (listener.revoked, listener.assigned) == (2, 2), (listener.revoked, listener.assigned)
    finally:
        consumer.close()


def test_a_member_dropped_while_its_join_is_unread_joins_again(kafka: KafkaBroker) -> None:
    """The join ends between polls, the member then sleeps past its session timeout (dropped
    by the broker); its polls after that make it stable again, its commits taken."""
    from kafka.structs import OffsetAndMetadata

    from tests.test_kafka_join import _stable_with

    topic = _topic(kafka)
    consumer = _consumer(kafka, f"g-{topic}", guarded=True)
    consumer.subscribe([topic])
    try:
        _join_ended_unread(consumer)
        time.sleep(8)  # session timeout 6 s: dropped before the join is read
        assert _stable_with(consumer, topic, 3, 40)
        for _ in range(20):  # stays stable (the heartbeat found the stale generation: rejoined)
            consumer.poll(timeout_ms=100)
        assert _stable_with(consumer, topic, 3, 40)
        consumer.commit({tp: OffsetAndMetadata(0, "", -1) for tp in consumer.assignment()})
    finally:
        consumer.close()


def test_the_broker_restarted_while_the_join_is_in_flight(kafka: KafkaBroker) -> None:
    """The broker stops just after the join is scheduled and comes back a few seconds later:
    each poll meanwhile returns, and the consumer ends stable with its partitions."""
    topic = _topic(kafka)
    consumer = _consumer(kafka, f"g-{topic}", guarded=True)
    consumer.subscribe([topic])
    try:
        _join_ended_unread(consumer, wait_end=False)  # the join scheduled
        kafka.stop()
        try:
            for _ in range(10):  # polls while it is down: each returns (bounded by the thread's wait)
                _polls_to_stable(consumer, topic, 0.3)
                time.sleep(0.3)
        finally:
            kafka.start()
        stable, raised = _polls_to_stable(consumer, topic, 90)
        assert stable, f"not stable after the broker came back (polls raised {raised[:3]!r})"
        assert not raised, raised[:3]
    finally:
        consumer.close()


def test_three_busy_members_join_and_leave(kafka: KafkaBroker) -> None:
    """Three guarded members of one group, each polled busily from its own thread: together
    they own the 3 partitions once each; after one closes, the other two own all 3."""
    from kafka.structs import MemberState

    topic = _topic(kafka)
    group = f"g-{topic}"
    members = [_consumer(kafka, group, guarded=True) for _ in range(3)]
    for m in members:
        m.subscribe([topic])
    stop = threading.Event()
    raised: list[BaseException] = []

    def drive(m: Any, alive: threading.Event) -> None:
        while not stop.is_set() and alive.is_set():
            try:
                m.poll(timeout_ms=1)
            except Exception as exc:
                raised.append(exc)
            time.sleep(0.3)

    alive = [threading.Event() for _ in members]
    threads = []
    for m, a in zip(members, alive, strict=True):
        a.set()
        threads.append(threading.Thread(target=drive, args=(m, a), daemon=True))
        threads[-1].start()

    def settled(live: list[Any]) -> bool:
        owned = [tp for m in live for tp in m.assignment() if tp.topic == topic]
        stable = all(m._coordinator.state is MemberState.STABLE for m in live)
        return stable and len(owned) == 3 and len(set(owned)) == 3

    try:
        end = time.monotonic() + 60
        while not settled(members) and time.monotonic() < end:
            time.sleep(0.5)
        assert settled(members), [sorted(m.assignment()) for m in members]
        alive[0].clear()
        threads[0].join(10)
        members[0].close()
        end = time.monotonic() + 60
        while not settled(members[1:]) and time.monotonic() < end:
            time.sleep(0.5)
        assert settled(members[1:]), [sorted(m.assignment()) for m in members[1:]]
        assert not raised, raised[:3]
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for m in members[1:]:
            m.close()


@pytest.mark.parametrize("when", ["in flight", "ended unread"])
def test_closing_with_a_join_scheduled(kafka: KafkaBroker, when: str) -> None:
    """close() with the join in flight or ended unread returns, and the group's next member
    gets every partition."""
    from tests.test_kafka_join import _stable_with

    topic = _topic(kafka)
    group = f"g-{topic}"
    consumer = _consumer(kafka, group, guarded=True)
    consumer.subscribe([topic])
    _join_ended_unread(consumer, wait_end=when == "ended unread")
    closer = threading.Thread(target=consumer.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() did not return"
    other = _consumer(kafka, group, guarded=True)
    other.subscribe([topic])
    try:
        assert _stable_with(other, topic, 3, 40)
    finally:
        other.close()

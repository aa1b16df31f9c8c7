"""kafka-python 3.0.12's unfinished group join, on the real broker (ingest/kafka_join.py).

The race: a consumer's poll schedules its JoinGroup/SyncGroup round trip and returns
before it ends (a short timeout); the round trip ends before the next poll. When the
rejoin came from a metadata change that the member itself, as the group's leader, put
into the new assignment, the next poll sees nothing left to do: the member stays
rebalancing for good, its heartbeat off, its commits refused. The ingest meets it at
start (its topics created after it subscribed) and when a topic gets partitions; the
two-consumer rebalance test lost an ingest process to it 1 run in 7 under load. And a
round trip that ends between polls is not read but replaced by a new one: a member that
is busy between polls may never join at all.

Each case drives one consumer the way a busy ingest does (a 1 ms poll, then 0.3 s of
other work), for its first join and across a partition increase, and needs it stable
with its partitions.
The same scenario is run first on a consumer without the guard: if that one joins too,
the scenario no longer exercises the race and says so (a kafka-python that fixed it
should leave :data:`AFFECTED`, not keep this test passing for the wrong reason).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from tests.servers.kafka import KafkaBroker

pytestmark = pytest.mark.integration

# what a consumer needs to see a partition increase at once (the default looks every 5 min)
FAST_METADATA = {"metadata_max_age_ms": 500, "allow_auto_create_topics": False}


def _consumer(kafka: KafkaBroker, group: str, guarded: bool) -> Any:
    from kafka import KafkaConsumer

    from gpuslo.ingest.kafka_consumer import _default_factory

    kw = dict(bootstrap_servers=kafka.bootstrap, group_id=group, enable_auto_commit=False,
              session_timeout_ms=6000, heartbeat_interval_ms=1500, **FAST_METADATA)  # fmt: skip
    return _default_factory(**kw) if guarded else KafkaConsumer(**kw)


def _stable_with(consumer: Any, topic: str, partitions: int, deadline_s: float, busy_s: float = 0.3) -> bool:
    """Polls as a busy ingest does (1 ms, then ``busy_s`` of other work; 0: a 100 ms poll
    and nothing else) until ``consumer`` is stable owning ``partitions`` of ``topic``."""
    from kafka.structs import MemberState

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        consumer.poll(timeout_ms=1 if busy_s else 100)
        owned = [tp for tp in consumer.assignment() if tp.topic == topic]
        if consumer._coordinator.state is MemberState.STABLE and len(owned) == partitions:
            return True
        time.sleep(busy_s)
    return False


def _grow(kafka: KafkaBroker, topic: str, partitions: int) -> None:
    from kafka.admin import KafkaAdminClient, NewPartitions

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        admin.create_partitions({topic: NewPartitions(partitions)})
    finally:
        admin.close()


def _topic(kafka: KafkaBroker) -> str:
    from kafka import KafkaProducer

    topic = f"join-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
    producer.send(topic, b"x").get(30)  # created with the broker's 3 partitions
    producer.close()
    return topic


def _joins(kafka: KafkaBroker, case: str, guarded: bool, deadline_s: float) -> tuple[bool, Any]:
    """Whether a consumer polled as a busy ingest does joins: in ``case`` "first" its first
    join; in "grown" the rejoin after its topic went from 3 partitions to 5."""
    topic = _topic(kafka)
    consumer = _consumer(kafka, f"g-{topic}", guarded)
    if case == "grown":
        # the first join must not be a rejoin for a topic the member's metadata had not seen
        # yet (the race itself, which a CI run met): the topic's 3 partitions known first
        end = time.monotonic() + 30
        while len(consumer.partitions_for_topic(topic)) != 3 and time.monotonic() < end:
            time.sleep(0.1)
    consumer.subscribe([topic])
    if case == "first":
        return _stable_with(consumer, topic, 3, deadline_s), consumer
    first = _stable_with(consumer, topic, 3, 60, busy_s=0)
    if not first and not guarded:  # the leader's metadata still changed under its first join:
        return False, consumer  # the same race, met a step early
    assert first, "the first join (polled without pause) did not complete"
    _grow(kafka, topic, 5)
    return _stable_with(consumer, topic, 5, deadline_s), consumer


@pytest.mark.parametrize(
    "case",
    [
        "first",  # each round trip ends between polls and is thrown away for a new one: never joined
        "grown",  # the leader's own assignment hides the rejoin: joined, never finished
    ],
)
def test_a_busy_consumer_finishes_its_join(kafka: KafkaBroker, case: str) -> None:
    import kafka as kafka_python

    unguarded, plain = _joins(kafka, case, guarded=False, deadline_s=8)
    plain.close()
    assert not unguarded, (
        f"kafka-python {kafka_python.__version__} joined without the guard: this scenario no "
        "longer exercises the race; if the release fixed it, take it out of AFFECTED"
    )
    joined, consumer = _joins(kafka, case, guarded=True, deadline_s=30)
    try:
        assert joined, f"the guarded consumer did not finish its join ({case})"
        # and the group takes its commits again (the stuck member's were all refused)
        consumer.commit({tp: _offset(0) for tp in consumer.assignment()})
    finally:
        consumer.close()


def _offset(n: int) -> Any:
    from kafka.structs import OffsetAndMetadata

    return OffsetAndMetadata(n, "", -1)


def test_the_ingest_consumer_gets_the_guard(kafka: KafkaBroker) -> None:
    """The pinned kafka-python is an affected one, and the ingest's consumer has the guard:
    a version bump that drops it fails here instead of stalling an ingest process."""
    import kafka as kafka_python

    from gpuslo.ingest.kafka_join import AFFECTED, _join_group_async

    assert kafka_python.__version__ in AFFECTED, (
        f"kafka-python {kafka_python.__version__}: check its join loop (ingest/kafka_join.py), then AFFECTED"
    )
    consumer = _consumer(kafka, f"g-{uuid.uuid4().hex[:8]}", guarded=True)
    try:
        assert consumer._coordinator.join_group_async.__func__ is _join_group_async
    finally:
        consumer.close()

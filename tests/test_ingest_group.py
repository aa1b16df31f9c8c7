"""The ingest's consumer-group settings: how soon a rebalance reaches every member.

A member hears that its group is rebalancing (another ingest process joined, or one left) from
its next heartbeat, and the coordinator completes the rebalance only when every member has
rejoined: until then the joining process owns nothing. Kafka's consumer documentation: the
heartbeat "must be set lower than session.timeout.ms, but typically should be set no higher
than 1/3 of that value" (default 3 s at a 45 s session). With session/4 the default was 11.25 s,
and ``bench scaleout`` measured a second process waiting 8-10 s for its partitions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuslo.core.settings import IngestSettings, KafkaSettings
from gpuslo.ingest.kafka_consumer import KafkaIngest
from gpuslo.ingest.store import Row, Store


class NoTables(Store):
    """A store with no tables yet (the consumer reads its retention at start; none: the default)."""

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        pass

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        raise AssertionError("nothing is written in this test")

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        return []


class Consumer:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        self.topics = topics


# the settings' bounds (session_timeout_s: 6..1800), the default, and one each side of 12 s (where
# a quarter of the session reaches 3 s)
@pytest.mark.parametrize("session_s", [6.0, 11.0, 12.0, 13.0, 45.0, 1800.0])
def test_heartbeat_is_at_most_3_s_and_a_third_of_the_session(session_s: float) -> None:
    made: list[Consumer] = []

    def factory(**kw: Any) -> Consumer:
        made.append(Consumer(**kw))
        return made[-1]

    KafkaIngest(KafkaSettings(), IngestSettings(session_timeout_s=session_s, metrics_port=0), NoTables(),
                consumer_factory=factory)  # fmt: skip
    (c,) = made
    assert c.kw["session_timeout_ms"] == session_s * 1000
    hb = c.kw["heartbeat_interval_ms"]
    assert 0 < hb <= 3000
    assert hb <= session_s * 1000 / 3
    if session_s >= 12:  # a quarter of the session is 3 s or more: Kafka's default
        assert hb == 3000

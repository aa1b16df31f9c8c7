"""The agent and the ingest against a real Apache Kafka broker that makes no topic on first use
(``auto.create.topics.enable=false``, as many managed and production brokers run), started
before anyone made gpuslo's topics: each says which topics the broker does not have (not "Kafka
unavailable", not nothing), keeps what it has, and goes on by itself once they are made, every
record landing once. Closing while a topic is missing ends within its bound, not after the
agent's whole flush again (33 s for a 15 s ``--flush-timeout-s``, measured)."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpuslo.agent.base import SendResult, Sink
from gpuslo.agent.kafka_sink import CLOSE_GRACE_S, KafkaSink
from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.agent.sim.run import run_fleet
from gpuslo.core.settings import ProducerSettings
from gpuslo.core.topic_watch import MISSING_AFTER_S, TopicWatch
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import Message
from tests.servers.kafka import KafkaBroker
from tests.test_kafka import GPUSLO, Sent, Tee, assert_exactly_once, service_config

pytestmark = pytest.mark.integration


@pytest.fixture
def broker(kafka_no_autocreate: KafkaBroker) -> KafkaBroker:
    return kafka_no_autocreate


def make_topics(config: Path) -> None:
    """As the operator does: ``gpuslo topics --create`` with the service's own config."""
    r = subprocess.run([*GPUSLO, "topics", "--create", "--partitions", "2", "--config", str(config)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


class Collect(Sink):
    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, msgs: Sequence[Message]) -> SendResult:
        self.sent.extend(msgs)
        return SendResult(sent=len(msgs))


def fleet(sim: SimConfig) -> list[Message]:
    """The simulated fleet's messages (run_fleet's own flush at the end waits 30 s for a sink
    whose topics are missing: they are sent here through the sink under test)."""
    c = Collect()
    run_fleet(sim, c)
    return c.sent


def until(what: str, ok: object, bound_s: float = 60.0) -> None:
    """Wait, bounded, for ``ok()`` (a callable) to be true."""
    end = time.monotonic() + bound_s
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < end, f"not within {bound_s:g} s: {what}"
        time.sleep(0.1)


def test_agent_and_ingest_say_the_missing_topics_then_deliver_once_they_are_made(
    broker: KafkaBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gpuslo.ingest.kafka_consumer import KafkaIngest

    caplog.set_level(logging.INFO)
    cfg, path = service_config(tmp_path, "late", broker.bootstrap)
    cfg = cfg.model_copy(update={"producer": ProducerSettings(flush_timeout_s=2.0)})
    topics = sorted(set(cfg.kafka.topics.all()))
    store = ChdbStore(tmp_path / "store")
    store.migrate(SCHEMA)
    ing = KafkaIngest(cfg.kafka, cfg.ingest, store)
    done = threading.Event()
    failed: list[BaseException] = []

    def ingest() -> None:
        try:
            while not done.is_set():
                ing.step()
        except BaseException as exc:  # said by the test, not lost in a thread
            failed.append(exc)

    reader = threading.Thread(target=ingest, name="ingest")
    reader.start()
    sink = KafkaSink(cfg.kafka, cfg.spool, cfg.producer)
    tee = Tee(sink)
    try:
        tee.send(fleet(SimConfig(nodes=2, gpus_per_node=2, hours=0.05, seed=5)))
        sent = Sent(tee.sent)
        sent_topics = sorted({cfg.kafka.topics.for_kind(m.kind) for m in sent})
        # the agent: the topics it sends to, said missing; its records kept
        until("the agent says its topics are missing", lambda: bool(sink.missing_topics()))
        assert set(sink.missing_topics()) <= set(sent_topics)
        assert sink.pending == len(sent)
        # the ingest: every subscribed topic, on its gauge
        until(
            "the ingest says its topics are missing",
            lambda: ing.metrics.topics_missing._value.get() == len(topics),
        )
        assert not failed, failed
        said = [r.getMessage() for r in caplog.records if r.name == "gpuslo.core.topic_watch"]
        assert any("has no topic" in m and "gpuslo topics --create" in m for m in said), said
        assert not [r for r in caplog.records if "Kafka unavailable" in r.getMessage()]  # the broker answered
        make_topics(path)
        assert tee.flush(60), "the agent did not deliver once its topics were made"
        until("the agent sees its topics", lambda: sink.missing_topics() == [])
        until("the ingest sees its topics", lambda: ing.metrics.topics_missing._value.get() == 0)
        until("the ingest wrote what was sent", lambda: _landed(store, sent), bound_s=90)
    finally:
        tee.close()
        done.set()
        reader.join(60)
        ing.close()
        store.close()
    assert not failed, failed
    assert any(
        "is there now" in r.getMessage() for r in caplog.records if r.name == "gpuslo.core.topic_watch"
    )
    assert_exactly_once(tmp_path / "store", sent)


def _landed(store: ChdbStore, sent: Sent) -> bool:
    want = sum(1 for m in sent if m.kind == "heartbeat")
    return bool(store.query("SELECT count() AS n FROM node_heartbeats")[0]["n"] >= want)


def test_closing_while_a_topic_is_missing_ends_within_its_bound(broker: KafkaBroker, tmp_path: Path) -> None:
    """The run's flush gave up (its records stay spooled); the close does not wait for it again,
    nor for a send still waiting for the topic's metadata (the producer's ``flush_timeout_s``,
    here 10 s): it ends within about ``CLOSE_GRACE_S``. Before: flush again (10 s), wait for the
    drainer (up to 15 s), close the producer (10 s)."""
    cfg, _ = service_config(tmp_path, "never", broker.bootstrap)
    cfg = cfg.model_copy(update={"producer": ProducerSettings(flush_timeout_s=10.0)})
    sink = KafkaSink(cfg.kafka, cfg.spool, cfg.producer)
    sink.send(fleet(SimConfig(nodes=1, gpus_per_node=2, hours=0.01, seed=6)))
    held = sink.pending
    assert held and not sink.flush(2.0)
    t0 = time.monotonic()
    sink.close()
    took = time.monotonic() - t0
    assert took < 10.0 - CLOSE_GRACE_S, f"close took {took:.1f} s after a flush that gave up"
    again = KafkaSink(cfg.kafka, cfg.spool, cfg.producer, start=False)  # the next start
    try:
        assert again.pending == held  # nothing lost by the short close
    finally:
        again.close(timeout_s=0)


class Cluster:
    """kafka-python's ClusterMetadata as TopicWatch reads it: listeners called after each answer."""

    def __init__(self) -> None:
        self.partitions: dict[str, set[int]] = {}
        self.unauthorized_topics: set[str] = set()
        self.listeners: set[object] = set()

    def add_listener(self, fn: object) -> None:
        self.listeners.add(fn)

    def remove_listener(self, fn: object) -> None:
        self.listeners.remove(fn)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self.partitions.get(topic)

    def answer(self) -> None:
        for fn in list(self.listeners):
            fn(self)  # type: ignore[operator]


class Producer:
    def __init__(self) -> None:
        self._metadata = Cluster()


def test_the_watch_judges_by_the_clock_tells_denied_apart_and_says_each_change_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpuslo.core.topic_watch")
    now = [100.0]
    p = Producer()
    c = p._metadata
    wanted = {"a", "b", "c"}
    w = TopicWatch(p, lambda: wanted, "k:9092", "records wait", clock=lambda: now[0])
    c.unauthorized_topics = {"c"}  # not a missing topic: Kafka's authorization error, said elsewhere
    c.partitions = {"b": {0}}
    c.answer()
    assert w.check() == []  # a topic being made answers without partitions for a moment
    now[0] += MISSING_AFTER_S  # no other answer meanwhile (a consumer asks again minutes later)
    assert w.check() == ["a"]
    assert w.check() == ["a"]
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "has no topic a " in told[0] and "records wait" in told[0]
    c.partitions = {"a": {0, 1}, "b": {0}}
    c.answer()
    assert w.check() == [] and w.missing == []
    assert sum("is there now" in r.getMessage() for r in caplog.records) == 1
    wanted.discard("a")
    c.partitions = {}
    c.answer()
    now[0] += MISSING_AFTER_S
    assert w.check() == ["b"]  # a topic no longer wanted is not said
    w.close()
    assert not c.listeners
    w.close()  # twice: no error
    assert TopicWatch(object(), lambda: wanted, "k", "x").watching is False  # another client: nothing


def test_a_watch_made_anew_says_back_what_the_one_it_replaces_said_missing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A producer (or consumer) made anew comes with a new watch: the topic the first one said
    missing is still missing until an answer says otherwise, then said back once, and never said
    back and missing again while it is absent. Before, the new watch knew nothing of it: a topic
    deleted, said missing, made again, was never said back (the agent makes a new producer after
    a topic is deleted under it)."""
    caplog.set_level(logging.INFO, logger="gpuslo.core.topic_watch")
    now = [100.0]
    first = Producer()
    w1 = TopicWatch(first, lambda: {"a"}, "k:9092", "records wait", clock=lambda: now[0])
    first._metadata.answer()
    now[0] += MISSING_AFTER_S
    assert w1.check() == ["a"]
    w1.close()
    again = Producer()
    w2 = TopicWatch(again, lambda: {"a"}, "k:9092", "records wait", clock=lambda: now[0], told=w1.told)
    assert w2.check() == ["a"] and w2.missing == ["a"]  # no answer yet: still missing
    again._metadata.answer()  # absent still, in a fresh answer: missing, not back
    assert w2.check() == ["a"]
    again._metadata.partitions = {"a": {0}}
    again._metadata.answer()
    assert w2.check() == []
    said = [r.getMessage() for r in caplog.records]
    assert sum("has no topic a " in m for m in said) == 1
    assert sum("Kafka topic a is there now" in m for m in said) == 1

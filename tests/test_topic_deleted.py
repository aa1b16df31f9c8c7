"""A topic deleted while the agent sends to it, then made again, and a broker that stops
answering under a send (SIGSTOPped: its kernel still accepts), on a real Apache Kafka broker
that makes no topic on first use: the agent keeps what the broker does not take, delivers it
once the topic is there again or the broker answers, and its producer leaves nothing running
behind it.

kafka-python 3.0.12's idempotent producer, when a batch it had sent expired (the broker answered
UNKNOWN_TOPIC_OR_PARTITION until the delivery timeout), dropped its producer id and never asked
for another: it sent nothing more, to any topic, and the agent waited on its batches for good
(measured: the topic made again, nothing delivered in 50 s, 495 records left in the spool).
A request that timed out on a broker that froze does the same."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from gpuslo.agent.kafka_sink import KafkaSink
from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.core.settings import ProducerSettings
from tests.servers.kafka import KafkaBroker
from tests.test_kafka import assert_exactly_once, run_ingest, service_config
from tests.test_topics_missing import fleet, make_topics, until

pytestmark = pytest.mark.integration


@pytest.fixture
def broker(kafka_no_autocreate: KafkaBroker) -> KafkaBroker:
    return kafka_no_autocreate


def _said(caplog: pytest.LogCaptureFixture, words: str) -> bool:
    return any(words in r.getMessage() for r in caplog.records if r.name == "gpuslo.core.topic_watch")


def _senders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-network-thread") and t.is_alive()]


def test_a_topic_deleted_and_made_again_is_delivered_to_once_it_is_back(
    broker: KafkaBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cfg, path = service_config(tmp_path, "deleted", broker.bootstrap)
    cfg = cfg.model_copy(update={"producer": ProducerSettings(flush_timeout_s=3.0)})
    make_topics(path)
    msgs = fleet(SimConfig(nodes=1, gpus_per_node=2, hours=0.05, seed=7))
    third = len(msgs) // 3
    before, during, after = msgs[:third], msgs[third : 2 * third], msgs[2 * third :]
    samples = cfg.kafka.topics.gpu_samples
    senders_before = set(_senders())
    sink = KafkaSink(cfg.kafka, cfg.spool, cfg.producer)
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        sink.send(before)
        assert sink.flush(30), "the agent could not deliver to a running broker"
        admin.delete_topics([samples])
        sink.send(during)
        assert not sink.flush(8)  # its records wait in the spool
        until("the agent says the deleted topic is missing", lambda: sink.missing_topics() == [samples])
        assert sink.pending
        admin.create_topics([NewTopic(samples, 2, 1)])
        sink.send(after)
        assert sink.flush(60), f"nothing delivered once the topic was made again: {sink.last_error}"
        assert sink.pending == 0
        # said back, by the watch of the producer made anew (it knew nothing of the first's words)
        until("the agent says the topic is there now", lambda: _said(caplog, f"topic {samples} is there now"))
        assert sink.missing_topics() == []
    finally:
        admin.close()
        sink.close(timeout_s=2)
    # the producers it made and closed leave no sender thread behind (kafka-python's close raises
    # from its flush before it stops its sender: that one ran on, and printed a traceback at exit)
    until("the producers' sender threads end", lambda: not set(_senders()) - senders_before, bound_s=10)
    # what the broker still has: everything but the samples sent before the deletion, once each
    r = run_ingest(path, tmp_path / "store")
    assert r.returncode == 0, r.stderr[-3000:]
    kept = [m for m in before if m.kind != "gpu_samples"] + during + after
    assert_exactly_once(tmp_path / "store", kept)


def test_a_broker_frozen_under_a_send_is_delivered_to_once_it_answers_again(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    assert broker.proc is not None
    cfg, path = service_config(tmp_path, "frozen", broker.bootstrap)
    cfg = cfg.model_copy(update={"producer": ProducerSettings(flush_timeout_s=3.0)})
    make_topics(path)
    msgs = fleet(SimConfig(nodes=1, gpus_per_node=2, hours=0.05, seed=8))
    half = len(msgs) // 2
    sink = KafkaSink(cfg.kafka, cfg.spool, cfg.producer)
    try:
        sink.send(msgs[:half])
        assert sink.flush(30), "the agent could not deliver to a running broker"
        os.killpg(broker.proc.pid, signal.SIGSTOP)
        try:
            sink.send(msgs[half:])  # sent, timed out, retried, expired: kept in the spool
            assert not sink.flush(10)
        finally:
            os.killpg(broker.proc.pid, signal.SIGCONT)
        assert sink.flush(60), f"nothing delivered once the broker answered again: {sink.last_error}"
    finally:
        sink.close(timeout_s=2)
    r = run_ingest(path, tmp_path / "store")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_exactly_once(tmp_path / "store", msgs)


def test_a_broker_that_answered_without_the_topics_then_went_away_is_said_down(
    broker: KafkaBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Topics missing, then the broker stopped: the agent says Kafka unavailable (it said nothing:
    its error stayed the broker's last answer, 'has no topics', through the outage). Restarts the
    module's broker: the last test here."""
    caplog.set_level(logging.INFO)
    cfg, _ = service_config(tmp_path, "never-made", broker.bootstrap)
    cfg = cfg.model_copy(update={"producer": ProducerSettings(flush_timeout_s=2.0)})
    sink = KafkaSink(cfg.kafka, cfg.spool, cfg.producer)
    try:
        sink.send(fleet(SimConfig(nodes=1, gpus_per_node=1, hours=0.01, seed=9)))
        until("the agent says its topics are missing", lambda: bool(sink.missing_topics()))
        assert "has no topic" in sink.last_error
        broker.stop()
        try:
            assert not sink.flush(8)
            assert "has no topic" not in sink.last_error, sink.last_error
            assert any("Kafka unavailable" in r.getMessage() for r in caplog.records)
        finally:
            broker.start()
        until("the broker's answer says them missing again", lambda: "has no topic" in sink.last_error)
    finally:
        sink.close(timeout_s=0)

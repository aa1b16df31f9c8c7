"""The agent's Kafka sink without a broker: spooling, bounds, memory."""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import pytest

from gpuslo.agent.kafka_sink import KafkaSink
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.core.settings import KafkaSettings, ProducerSettings, SpoolSettings
from gpuslo.wire import Message
from tests.servers.ports import free_port


def batches(n: int) -> list[list[Message]]:
    cfg = SimConfig(nodes=1, gpus_per_node=8, hours=n * 10 / 3600 + 0.01, seed=1)
    fleet = Fleet(cfg)
    sources = sim_sources(fleet)
    out = []
    for k in range(n):
        t = cfg.start_ts + k * cfg.interval_s
        fleet.advance_to(t)
        out.append([m for s in sources for m in s.collect(t)])
    return out


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_unreachable_broker_spool_hits_its_byte_bound_memory_stays_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kafka = KafkaSettings(bootstrap_servers=[f"127.0.0.1:{free_port()}"])  # nothing listens there
    spool = SpoolSettings(directory=tmp_path / "spool", max_bytes=512 * 1024)
    data = batches(300)  # about 2 MB of wire bytes: four times the bound
    with caplog.at_level(logging.WARNING, logger="agent"):
        sink = KafkaSink(kafka, spool, ProducerSettings(flush_timeout_s=0.5))
        tracemalloc.start()
        for _ in range(3):
            for msgs in data:
                assert sink.send(msgs).ok
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert sink.spool.size_bytes <= spool.max_bytes + sink.spool.segment_bytes
        assert sink.spool.dropped_records > 0
        kept = sink.pending
        sink.close(timeout_s=0.5)
    assert "over its byte bound: dropped the oldest" in caplog.text
    assert "Kafka unavailable" in caplog.text
    assert peak < 16 * 2**20, f"peak traced memory {peak / 2**20:.1f} MiB while spooling"
    # a restarted agent finds the newest records still there
    again = KafkaSink(kafka, spool, ProducerSettings(flush_timeout_s=0.5), start=False)
    assert again.pending == kept > 0
    again.close(timeout_s=0.1)


def test_password_never_in_repr_or_dump(tmp_path: Path) -> None:
    k = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="u",
        sasl_password="hunter2-secret",
    )
    assert "hunter2-secret" not in repr(k)
    assert "hunter2-secret" not in k.model_dump_json()
    assert k.client_kwargs()["sasl_plain_password"] == "hunter2-secret"


def test_sasl_needs_a_mechanism() -> None:
    with pytest.raises(ValueError, match="needs sasl_mechanism and sasl_username"):
        KafkaSettings(security_protocol="SASL_PLAINTEXT")


def test_metrics_show_the_spool_identity_while_it_changes(tmp_path: Path) -> None:
    """/metrics is read on its own thread: every exposition is one consistent snapshot, in which
    accepted = delivered + records + dropped (both reasons)."""
    import threading

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuslo.agent.exporter import AgentCollector, registry_with

    kafka = KafkaSettings(bootstrap_servers=[f"127.0.0.1:{free_port()}"])
    sink = KafkaSink(kafka, SpoolSettings(directory=tmp_path / "spool", max_bytes=64 * 1024),
                     ProducerSettings(flush_timeout_s=0.2))  # fmt: skip
    reg = registry_with(AgentCollector(spool=sink.spool_stats))
    data = batches(60)
    done = threading.Event()

    def produce() -> None:
        for msgs in data * 3:
            sink.send(msgs)
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    seen = 0
    while not done.is_set() or seen < 5:
        v = {s.name + str(s.labels.get("reason", "")): s.value
             for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples}  # fmt: skip
        assert v["gpuslo_agent_spool_accepted_records_total"] == (
            v["gpuslo_agent_spool_delivered_records_total"] + v["gpuslo_agent_spool_records"]
            + v["gpuslo_agent_spool_dropped_records_totalbound"] + v["gpuslo_agent_spool_dropped_records_totalcorrupt"]
            + v["gpuslo_agent_spool_dropped_records_totalrejected"]
        ), v  # fmt: skip
        seen += 1
    t.join()
    assert sink.spool.stats().dropped_bound > 0  # the bound dropped segments while it was read
    sink.close(timeout_s=0.1)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_message_larger_than_a_kafka_request_is_refused_at_send_and_never_blocks_the_spool(
    tmp_path: Path,
) -> None:
    """kafka-python refuses a record over max_request_size on every try (and the broker one over
    message.max.bytes): spooled, it would sit at the head and stop the drain forever."""
    from gpuslo.agent.kafka_sink import MAX_REQUEST_BYTES
    from gpuslo.wire import SchedulerEvent

    def event(seq: int, nodes: int) -> SchedulerEvent:
        return SchedulerEvent(source="a", boot_id="b", seq=seq, cluster="c", ts=1e9, scheduler="slurm",
                              event="start", request_id=f"j{seq}",
                              assigned_nodes=tuple(f"node-{i:08d}" for i in range(nodes)))  # fmt: skip

    big = event(1, 100_000)  # valid on the wire: 100,000 assigned nodes, about 1.6 MB
    assert len(big.model_dump_json()) > MAX_REQUEST_BYTES
    kafka = KafkaSettings(bootstrap_servers=[f"127.0.0.1:{free_port()}"])
    sink = KafkaSink(kafka, SpoolSettings(directory=tmp_path / "spool"), start=False)
    res = sink.send([event(0, 2), big, event(2, 2)])
    assert (res.sent, res.failed) == (2, 1)
    assert "larger than a Kafka request" in res.error
    assert [b'"j0"' in r.value for _, r in sink.spool.peek()] == [True, False]
    assert [b'"j2"' in r.value for _, r in sink.spool.peek()] == [False, True]
    assert sink.send_failures == 1
    sink.close(timeout_s=0.1)


class _Future:
    """kafka-python's FutureRecordMetadata as the sink reads it: is_done, succeeded(), exception."""

    def __init__(self) -> None:
        self.is_done = False
        self.exception: BaseException | None = None

    def succeeded(self) -> bool:
        return self.is_done and self.exception is None


class _SlowProducer:
    """A producer whose broker acknowledges only when the test says so: flush() times out the way
    kafka-python's does (KafkaTimeoutError) while records are unacknowledged."""

    def __init__(self, **_: object) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.futures: list[_Future] = []

    def send(self, topic: str, key: bytes, value: bytes) -> _Future:
        self.sent.append((topic, value))
        self.futures.append(_Future())
        return self.futures[-1]

    def flush(self, timeout: float | None = None) -> None:
        from kafka.errors import KafkaTimeoutError

        if any(not f.is_done for f in self.futures):
            raise KafkaTimeoutError(f"Failed to flush buffered records within {timeout} secs")

    def close(self, timeout: float | None = None) -> None:
        pass

    def ack(self, n: int | None = None, error: BaseException | None = None) -> None:
        for f in [f for f in self.futures if not f.is_done][:n]:
            f.is_done, f.exception = True, error


@pytest.mark.parametrize("outcome", ["acknowledged", "expired"])
def test_a_flush_that_times_out_never_sends_the_records_still_in_flight_again(
    tmp_path: Path, outcome: str
) -> None:
    """A broker slower than the flush timeout: the records stay in the producer, which delivers or
    expires each itself. Sent again meanwhile, each acknowledged record would land twice; so the
    sink waits for them, and re-sends only what the producer gave up on (delivery timeout)."""
    from kafka.errors import KafkaTimeoutError

    made: list[_SlowProducer] = []

    def factory(**kw: object) -> _SlowProducer:
        made.append(_SlowProducer(**kw))
        return made[-1]

    kafka = KafkaSettings(bootstrap_servers=["127.0.0.1:1"])
    sink = KafkaSink(
        kafka, SpoolSettings(directory=tmp_path / "spool"), producer_factory=factory, start=False
    )  # type: ignore[arg-type]
    msgs = [m for b in batches(4) for m in b]
    assert len(msgs) > 4 and sink.send(msgs).ok
    for _ in range(3):  # three tries while the broker has not answered: nothing sent twice
        assert sink.drain_once(force=True) is False
    p = made[0]
    assert len(p.sent) == len(msgs) and len(sink.spool) == len(msgs)
    if outcome == "acknowledged":
        p.ack()
        assert sink.drain_once(force=True) is True
        assert len(p.sent) == len(msgs) and len(sink.spool) == 0
        assert sink.spool.stats().delivered == len(msgs)
    else:
        p.ack(2)  # the first two acknowledged, the rest expired by the producer's delivery timeout
        p.ack(error=KafkaTimeoutError("Batch expired"))
        assert sink.drain_once(force=True) is False  # the expired ones: sent again on the next try
        assert len(sink.spool) == len(msgs) - 2
        assert sink.drain_once(force=True) is False  # sent again now, not acknowledged yet
        assert p.sent[len(msgs) :] == p.sent[2 : len(msgs)]  # exactly the expired ones, once more
        p.ack()
        assert sink.drain_once(force=True) is True
        assert len(sink.spool) == 0 and sink.spool.stats().delivered == len(msgs)
    sink.close(timeout_s=0.1)


def test_an_outage_and_a_refusal_are_each_said_once_and_each_change_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker down, then a write refused by its ACLs (or the other way round): each is said
    when it begins (one flag for both kept the refusal, after an outage, from ever being said);
    the same failure again is not said again."""
    caplog.set_level(logging.WARNING, logger="gpuslo.agent.kafka_sink")
    kafka = KafkaSettings(bootstrap_servers=[f"127.0.0.1:{free_port()}"])
    sink = KafkaSink(kafka, SpoolSettings(directory=tmp_path / "spool"), start=False)
    try:
        for why in ["KafkaTimeoutError: no answer", "KafkaTimeoutError: no answer",
                    "TopicAuthorizationFailedError: t", "TopicAuthorizationFailedError: t",
                    "KafkaConnectionError: reset"]:  # fmt: skip
            sink._fail(why)
    finally:
        sink.close(timeout_s=0)
    said = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert said == ["Kafka unavailable", "Kafka refused this client", "Kafka unavailable"], said


def test_the_producer_reconnects_within_a_second_of_a_broker_back(tmp_path: Path) -> None:
    """kafka-python's reconnect backoff doubles up to 30 s; the agent's producer stops at 1 s,
    as Kafka's own client does (the ingest's consumer likewise: test_ingest_commits.py)."""
    from gpuslo.core.settings import RECONNECT_BACKOFF_MAX_MS

    made: list[dict[str, object]] = []

    def factory(**kw: object) -> _SlowProducer:
        made.append(kw)
        return _SlowProducer(**kw)

    sink = KafkaSink(KafkaSettings(bootstrap_servers=["127.0.0.1:1"]), SpoolSettings(directory=tmp_path / "spool"),
                     producer_factory=factory, start=False)  # type: ignore[arg-type]  # fmt: skip
    assert sink.send([m for b in batches(1) for m in b]).ok
    sink.drain_once(force=True)
    sink.close(timeout_s=0.1)
    assert made and made[0]["reconnect_backoff_max_ms"] == RECONNECT_BACKOFF_MAX_MS == 1000


def test_the_drain_retries_a_broker_down_within_4_s_and_a_refusal_at_30_s(tmp_path: Path) -> None:
    """A broker down is tried again within ``DRAIN_RETRY_MAX_S`` (at 30 s, an agent's spool
    drained 23 s after the broker was back); a write refused by an ACL, which waits for an
    operator and makes a new producer each try, at ``REFUSED_RETRY_MAX_S``, for a fleet of agents
    not to make 250 producers a second on the broker; back to the short pace once it is down."""
    from gpuslo.agent.kafka_sink import DRAIN_RETRY_MAX_S, REFUSED_RETRY_MAX_S

    sink = KafkaSink(KafkaSettings(bootstrap_servers=["127.0.0.1:1"]), SpoolSettings(directory=tmp_path / "spool"),
                     start=False)  # fmt: skip
    try:
        delays = []
        for _ in range(10):
            sink._fail("KafkaTimeoutError: Failed to update metadata")
            delays.append(sink._backoff.delay_s)
        assert delays[0] == 0.5 and max(delays) == delays[-1] == DRAIN_RETRY_MAX_S == 4.0
        for _ in range(10):
            sink._fail("TopicAuthorizationFailedError: [Error 29] TopicAuthorizationFailedError")
        assert sink._backoff.delay_s == REFUSED_RETRY_MAX_S == 30.0
        sink._fail("KafkaTimeoutError: Failed to update metadata")
        assert sink._backoff.delay_s == DRAIN_RETRY_MAX_S
    finally:
        sink.close(timeout_s=0.1)

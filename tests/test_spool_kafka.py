"""The agent's spool on a real, tiny, full file system, drained by a real Kafka broker that
comes up afterwards: what the sink accepted is delivered exactly, what it refused says so."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpuslo.agent.kafka_sink import KafkaSink
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.core.settings import KafkaSettings, ProducerSettings, SpoolSettings, Topics
from gpuslo.ingest import packed
from gpuslo.wire import Message, decode
from gpuslo.wire.pack import is_pack
from tests.fs import tmpfs
from tests.servers.kafka import KafkaBroker

pytestmark = pytest.mark.integration


def ticks(n: int) -> list[list[Message]]:
    cfg = SimConfig(nodes=2, gpus_per_node=8, hours=n * 10 / 3600 + 0.01, seed=3)
    fleet = Fleet(cfg)
    sources = sim_sources(fleet)
    out = []
    for k in range(n):
        t = cfg.start_ts + k * cfg.interval_s
        fleet.advance_to(t)
        out.append([m for s in sources for m in s.collect(t)])
    return out


def key(m: Message) -> tuple[str, str, int]:
    return (m.source, m.boot_id, m.seq)


def messages_of(value: bytes) -> list[Message]:
    """The messages of one Kafka value: one JSON message, or each batch of a pack (the agent
    packs a backlog of a node's gpu_samples)."""
    if not is_pack(value):
        return [decode(value)]
    u = packed.unpack(value)
    return [decode(packed.as_json(u.table, k)) for k in range(u.table.num_rows)]


def consume(bootstrap: str, topics: list[str], want: int, deadline_s: float = 90.0) -> list[Message]:
    from kafka import KafkaConsumer

    c = KafkaConsumer(*topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    got: list[Message] = []
    try:
        end = time.monotonic() + deadline_s
        while len(got) < want and time.monotonic() < end:
            for recs in c.poll(timeout_ms=1000).values():
                got += [m for r in recs for m in messages_of(r.value)]
        got += [m for recs in c.poll(timeout_ms=2000).values() for r in recs for m in messages_of(r.value)]
    finally:
        c.close()
    return got


def test_full_tmpfs_then_space_then_broker_delivers_exactly_what_was_accepted(
    kafka_libs: Path, tmp_path: Path
) -> None:
    broker = KafkaBroker(tmp_path / "kafka", libs=kafka_libs)  # not started yet: the broker is down
    topics = Topics(**{k: f"full.{k}" for k in Topics.model_fields})
    kafka = KafkaSettings(bootstrap_servers=[broker.bootstrap], topics=topics)
    producer = ProducerSettings(flush_timeout_s=1.0)
    data = ticks(400)
    with tmpfs(tmp_path / "tiny", "1m") as d:
        st = os.statvfs(d)
        filler = d / "filler"
        filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 256 * 1024))
        spool = SpoolSettings(directory=d / "spool")
        sink = KafkaSink(kafka, spool, producer)
        accepted: list[Message] = []
        refused = 0
        k = 0
        while refused < 5 * len(data[0]):  # the disk fills, and stays full for a while
            res = sink.send(data[k])
            assert (res.sent, res.failed) in ((len(data[k]), 0), (0, len(data[k]))), res
            if res.ok:
                accepted += data[k]
            else:
                assert "No space left on device" in res.error
                refused += res.failed
            k += 1
        st1 = sink.spool.stats()
        assert st1.accepted == len(accepted) and st1.refused == refused == sink.send_failures
        assert st1.accepted == st1.delivered + st1.pending + st1.dropped
        filler.unlink()  # space returns: sending resumes at once
        for msgs in data[k : k + 20]:
            assert sink.send(msgs).ok
            accepted += msgs
        sink.close(timeout_s=0.5)  # the agent restarts while the broker is still down
        broker.start()
        try:
            again = KafkaSink(kafka, spool, producer)
            st2 = again.spool.stats()
            assert (st2.accepted, st2.pending, st2.dropped) == (len(accepted), len(accepted), 0)
            assert again.flush(120), again.last_error
            st3 = again.spool.stats()
            assert (st3.delivered, st3.pending, st3.dropped) == (len(accepted), 0, 0)
            again.close()
            got = consume(broker.bootstrap, [getattr(topics, f) for f in Topics.model_fields], len(accepted))
        finally:
            broker.stop()
    # nothing lost, nothing that was not accepted; a copy only where the producer expired a batch the
    # broker had written after all (at least once: the ingest absorbs it; a flush that merely timed
    # out is waited for, never re-sent, tests/test_kafka_sink.py)
    assert sorted(set(map(key, got))) == sorted(map(key, accepted))
    assert len(accepted) > 100 and refused > 0


@pytest.mark.parametrize("flush_timeout_s", [0.2, 1.0, 1.25])
def test_short_flush_timeouts_still_deliver(
    kafka: KafkaBroker, tmp_path: Path, flush_timeout_s: float
) -> None:
    """kafka-python refuses a delivery timeout not above linger + request timeout, once it has
    bootstrapped; the sink's derived timeouts must pass at every flush timeout, or the spool
    never drains."""
    topics = Topics(**{k: f"short{int(flush_timeout_s * 100)}.{k}" for k in Topics.model_fields})
    sink = KafkaSink(KafkaSettings(bootstrap_servers=[kafka.bootstrap], topics=topics),
                     SpoolSettings(directory=tmp_path / "spool"), ProducerSettings(flush_timeout_s=flush_timeout_s))  # fmt: skip
    msgs = ticks(3)
    for m in msgs:
        assert sink.send(m).ok
    assert sink.flush(60), sink.last_error
    assert sink.spool.stats().delivered == sum(map(len, msgs))
    sink.close()


def test_a_record_the_broker_rejects_as_too_large_is_dropped_counted_and_the_rest_delivered(
    kafka: KafkaBroker, tmp_path: Path
) -> None:
    """A topic whose max.message.bytes is below a record (an operator's choice, under the 1 MiB the
    sink checks at send): the broker answers MESSAGE_TOO_LARGE on every try. The record must not
    stop the drain: it is dropped and counted, the records behind it arrive."""
    from kafka.admin import KafkaAdminClient, NewTopic

    from gpuslo.wire import SchedulerEvent

    topics = Topics(**{k: f"small.{k}" for k in Topics.model_fields})
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        admin.create_topics([NewTopic(topics.sched_event, 1, 1, topic_configs={"max.message.bytes": "4096"})])
    finally:
        admin.close()

    def event(seq: int, nodes: int) -> SchedulerEvent:
        return SchedulerEvent(source="a", boot_id="b", seq=seq, cluster="c", ts=1e9, scheduler="slurm",
                              event="start", request_id=f"j{seq}",
                              assigned_nodes=tuple(os.urandom(20).hex() for _ in range(nodes)))  # fmt: skip

    sent = [event(0, 2), event(1, 1000), event(2, 2)]  # the middle one: about 43 kB, 20 kB compressed
    sink = KafkaSink(KafkaSettings(bootstrap_servers=[kafka.bootstrap], topics=topics),
                     SpoolSettings(directory=tmp_path / "spool"), ProducerSettings(flush_timeout_s=2.0))  # fmt: skip
    for m in sent:  # one per send: each its own batch, as ticks are
        assert sink.send([m]).ok
    assert sink.flush(60), sink.last_error
    st = sink.spool.stats()
    assert (st.accepted, st.delivered, st.pending, st.dropped_rejected) == (3, 2, 0, 1), st
    sink.close()
    got = consume(kafka.bootstrap, [topics.sched_event], 2)
    assert sorted(m.seq for m in got) == [0, 2]

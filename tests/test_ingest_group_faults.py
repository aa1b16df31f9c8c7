"""Two ingest processes in one consumer group (the scale-out deployment), writing to a real
ClickHouse server (Debian's 18.16; also the compose file's image where a Docker engine answers) through a proxy that resets every connection at random moments while
they write: the server stays up, the connections die mid-insert or mid-reply. Every such failure
must be a retry (transient), never a dead letter or a commit of what was not written: at the end
every message is in the store exactly once (FINAL), nothing is dead-lettered and every offset is
committed."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from gpuslo.agent.kafka_sink import message_key
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.ingest.clickhouse_store import ClickHouseStore
from gpuslo.ingest.kafka_consumer import KafkaIngest
from gpuslo.wire import Message, encode
from tests.servers.clickhouse import Server
from tests.servers.kafka import KafkaBroker
from tests.servers.proxy import CuttingProxy
from tests.test_ingest_faults import assert_all_committed, ch_store, chserver, expected_rows, stored_keys
from tests.test_kafka import service_config

pytestmark = pytest.mark.integration
__all__ = ["chserver"]  # the fixture, imported for pytest

PARTITIONS = 4


def fleet(seed: int, nodes: int = 8, hours: float = 0.15) -> list[Message]:
    f = Fleet(SimConfig(nodes=nodes, gpus_per_node=2, hours=hours, seed=seed))
    sources = sim_sources(f)
    out: list[Message] = []
    for k in range(round(hours * 3600 / f.cfg.interval_s)):
        t = f.cfg.start_ts + k * f.cfg.interval_s
        f.advance_to(t)
        out += [m for s in sources for m in s.collect(t)]
    return out


def produce(bootstrap: str, cfg: object, msgs: list[Message]) -> dict[tuple[str, int, int], object]:
    """Keyed as the agent keys them (the node): a node's messages stay in one partition."""
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    futs = [p.send(cfg.kafka.topics.for_kind(m.kind), key=message_key(m), value=encode(m)) for m in msgs]  # type: ignore[attr-defined]
    p.flush()
    sent = {}
    for f in futs:
        md = f.get(timeout=30)
        sent[(md.topic, md.partition, md.offset)] = None
    p.close()
    return sent


def test_two_ingest_processes_with_their_server_connections_reset_under_load(
    kafka: KafkaBroker, chserver: Server, tmp_path: Path
) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    seed = 5
    cfg, _ = service_config(tmp_path, "cuts", kafka.bootstrap, batch_messages=40, retry_max_s=0.5)
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    admin.create_topics(
        [NewTopic(t, num_partitions=PARTITIONS, replication_factor=1) for t in cfg.kafka.topics.all()]
    )
    admin.close()
    st = ch_store(chserver, "gpuslo_cuts")
    proxy = CuttingProxy(chserver.port)
    through = st.settings.model_copy(update={"port": proxy.port})
    stores = [ClickHouseStore(through) for _ in range(2)]
    ings = [KafkaIngest(cfg.kafka, cfg.ingest, s) for s in stores]
    threads = [
        threading.Thread(target=i.run, kwargs={"idle_exit_s": 8}, name=f"ingest-{n}")
        for n, i in enumerate(ings)
    ]
    for t in threads:
        t.start()
    done = threading.Event()
    rnd = random.Random(seed)
    cut_connections = 0

    def cutter() -> None:
        # first every connection open (both consumers' stores, and any opened since) armed to be
        # reset in its next insert, until a reset reached a write of each consumer, whatever the
        # load's timing; only then resets at random times (mid-insert or between), and more armed
        nonlocal cut_connections
        while not all(i.metrics.store_errors._value.get() > 0 for i in ings):
            cut_connections += proxy.arm()
            if done.wait(0.05):
                return
        while not done.wait(rnd.uniform(0.05, 0.5)):
            cut_connections += proxy.cut() if rnd.random() < 0.7 else proxy.arm()

    try:
        deadline = time.monotonic() + 60  # both own partitions before the data comes: both write
        while not all(i.metrics.assigned._value.get() > 0 for i in ings):
            assert time.monotonic() < deadline, "the two consumers did not both get partitions"
            time.sleep(0.1)
        msgs = fleet(seed)
        cuts = threading.Thread(target=cutter, name="cutter")
        cuts.start()
        sent = produce(kafka.bootstrap, cfg, msgs)
        for t in threads:
            t.join(240)
            assert not t.is_alive(), "an ingest did not finish"
    finally:
        done.set()
        for i in ings:
            i.stop_event.set()
        for t in threads:
            t.join(30)
        proxy.close()
        for s in stores:
            s.close()
    assert all(i.failed is None for i in ings), [str(i.failed) for i in ings]
    assert proxy.resets_on_send >= 2, "the armed connections were not reset in an insert"
    assert cut_connections > 0 and all(i.metrics.store_errors._value.get() > 0 for i in ings), (
        "no reset reached a write of both consumers"
    )
    assert all(i.metrics.written.labels("gpu_samples")._value.get() > 0 for i in ings)
    for table, rows in expected_rows(msgs).items():
        got = st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"]
        assert got == rows, f"{table}: {got} rows, want {rows}"
    assert stored_keys(st) == {(m.source, m.boot_id, m.seq) for m in msgs}
    assert st.query("SELECT count() AS n FROM dead_letters")[0]["n"] == 0, (
        "a reset connection dead-lettered good data"
    )
    assert_all_committed(kafka, cfg, sent)
    st.close()

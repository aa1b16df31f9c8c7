"""agent → Kafka → ingest → store on a real Apache Kafka 4.x broker, through the faults an
operator meets: a broker outage, an ingest killed between insert and commit, a consumer
leaving its group, poison messages, SASL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gpuslo.agent.base import SendResult, Sink
from gpuslo.agent.kafka_sink import KafkaSink
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.run import run_fleet
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.core.settings import KafkaSettings, ProducerSettings, ServiceConfig, SpoolSettings, Topics
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSampleBatch, Message, encode
from tests.servers.kafka import SASL_USERS, SCRAM_USERS, KafkaBroker
from tests.servers.ports import free_port

pytestmark = pytest.mark.integration

GPUSLO = [str(Path(sys.executable).with_name("gpuslo"))]
TABLE_OF = {
    "gpu_samples": "gpu_samples",
    "heartbeat": "node_heartbeats",
    "sched_event": "sched_events",
    "latency": "latency",
    "health": "health_events",
}


class Tee(Sink):
    """Records what the agent handed to the real sink."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.sent: list[Message] = []

    def send(self, msgs: Sequence[Message]) -> SendResult:
        self.sent.extend(msgs)
        return self.inner.send(msgs)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self.inner.flush(timeout_s)

    def close(self) -> None:
        self.inner.close()


def service_config(tmp: Path, name: str, bootstrap: str, **ingest: Any) -> tuple[ServiceConfig, Path]:
    topics = Topics(**{k: f"{name}.{k}" for k in Topics.model_fields})
    cfg = ServiceConfig(
        kafka=KafkaSettings(bootstrap_servers=[bootstrap], topics=topics),
        spool=SpoolSettings(directory=tmp / f"spool-{name}"),
        producer=ProducerSettings(flush_timeout_s=5.0),
        ingest={"group_id": f"g-{name}", "batch_s": 0.5, "metrics_port": 0, "session_timeout_s": 6, **ingest},  # type: ignore[arg-type]
    )
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(orjson.loads(cfg.model_dump_json())))
    return cfg, path


def expected(sent: Sequence[Message]) -> dict[str, tuple[int, set[tuple[str, str, int]]]]:
    out: dict[str, tuple[int, set[tuple[str, str, int]]]] = {}
    for m in sent:
        table = TABLE_OF[m.kind]
        rows, keys = out.get(table, (0, set()))
        out[table] = (
            rows + (len(m.gpus) if isinstance(m, GpuSampleBatch) else 1),
            keys | {(m.source, m.boot_id, m.seq)},
        )
    return out


def stored(store_dir: Path, tables: Sequence[str]) -> dict[str, tuple[int, int, set[tuple[str, str, int]]]]:
    """table -> (rows as the rules see them (FINAL), rows physically stored, message keys)."""
    s = ChdbStore(store_dir)
    try:
        out = {}
        for t in tables:
            final = s.query(f"SELECT count() AS n FROM {t} FINAL")[0]["n"]
            raw = s.query(f"SELECT count() AS n FROM {t}")[0]["n"]
            keys = {
                (r["source"], r["boot_id"], r["seq"])
                for r in s.query(f"SELECT DISTINCT source, boot_id, seq FROM {t}")
            }
            out[t] = (final, raw, keys)
        return out
    finally:
        s.close()


def assert_exactly_once(store_dir: Path, sent: Sequence[Message]) -> dict[str, tuple[int, int, set[Any]]]:
    want = expected(sent)
    got = stored(store_dir, list(want))
    for table, (rows, keys) in want.items():
        final, _raw, gkeys = got[table]
        assert gkeys == keys, f"{table}: {len(keys - gkeys)} missing, {len(gkeys - keys)} unexpected"
        assert final == rows, f"{table}: {final} rows, want {rows}"
    return got


def run_ingest(
    cfg_path: Path, store: Path, *extra: str, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    cmd = [
        *GPUSLO,
        "ingest",
        "--kafka",
        "-",
        "--config",
        str(cfg_path),
        "--store",
        str(store),
        "--idle-exit-s",
        "6",
        *extra,
    ]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
        raise AssertionError(f"ingest did not finish in {timeout_s} s; its stderr:\n{err[-4000:]}") from None


class Sent(list[Message]):
    """The messages the agent handed to its sink, and the Kafka messages that carried them (a
    backlog of a node's gpu_samples goes as packs: several batches in one Kafka message)."""

    kafka_messages = 0
    kafka_gpu_messages = 0


def produce_fleet(cfg: ServiceConfig, sim: SimConfig) -> Sent:
    sink = KafkaSink(cfg.kafka, cfg.spool, cfg.producer)
    tee = Tee(sink)
    run_fleet(sim, tee)
    assert tee.flush(60), "the agent could not deliver to a running broker"
    tee.close()
    out = Sent(tee.sent)
    assert sink.sent_records == len(out)
    packs = sink.sent_packs - sink.packed_records  # each pack: one message for its records
    out.kafka_messages = len(out) + packs
    out.kafka_gpu_messages = sum(isinstance(m, GpuSampleBatch) for m in out) + packs
    return out


SIM = SimConfig(nodes=2, gpus_per_node=4, hours=0.5, seed=3)


def test_steady_run_every_message_exactly_once(kafka: KafkaBroker, tmp_path: Path) -> None:
    cfg, path = service_config(tmp_path, "steady", kafka.bootstrap)
    sent = produce_fleet(cfg, SIM)
    r = run_ingest(path, tmp_path / "store")
    assert r.returncode == 0, r.stderr[-3000:]
    got = assert_exactly_once(tmp_path / "store", sent)
    for table, (final, raw, _) in got.items():
        assert raw == final, f"{table}: physical duplicates in a run without faults"
    # checksum of values, not only keys: total activity of all GPU samples
    s = ChdbStore(tmp_path / "store")
    try:
        total = s.query("SELECT sum(DCGM_FI_PROF_GR_ENGINE_ACTIVE) AS a FROM gpu_samples FINAL")[0]["a"]
    finally:
        s.close()
    want = sum(
        g.fields.get("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.0)
        for m in sent
        if isinstance(m, GpuSampleBatch)
        for g in m.gpus
    )
    assert total == pytest.approx(want, rel=1e-9)


def test_broker_outage_spools_then_drains_in_order(kafka_libs: Path, tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path / "kafka", libs=kafka_libs)
    broker.start()
    try:
        cfg, path = service_config(tmp_path, "outage", broker.bootstrap)
        cfg = cfg.model_copy(update={"producer": ProducerSettings(flush_timeout_s=2.0)})
        sink = Tee(KafkaSink(cfg.kafka, cfg.spool, cfg.producer))
        inner = sink.inner
        assert isinstance(inner, KafkaSink)
        sim = SimConfig(nodes=2, gpus_per_node=4, hours=0.25, seed=4)
        fleet = Fleet(sim)
        sources = sim_sources(fleet)
        n = round(sim.hours * 3600 / sim.interval_s)
        spooled_during_outage = 0
        for k in range(n):
            t = sim.start_ts + k * sim.interval_s
            fleet.advance_to(t)
            sink.send([m for s in sources for m in s.collect(t)])
            if k == n // 3:
                assert inner.flush(30)
                broker.stop()
            if k == 2 * n // 3:
                time.sleep(3)  # let the drainer hit the dead broker
                spooled_during_outage = inner.pending
                broker.start()
        assert spooled_during_outage > 0, "nothing was spooled while the broker was down"
        assert inner.flush(120), f"spool did not drain after the broker returned: {inner.last_error}"
        sink.close()
        r = run_ingest(path, tmp_path / "store")
        assert r.returncode == 0, r.stderr[-3000:]
        assert_exactly_once(tmp_path / "store", sink.sent)
    finally:
        broker.stop()


def _committed(bootstrap: str, group: str, topics: Sequence[str]) -> dict[str, int | None]:
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        out = {}
        for t in topics:
            for p in c.partitions_for_topic(t) or ():
                out[f"{t}/{p}"] = c.committed(TopicPartition(t, p))
        return out
    finally:
        c.close()


def test_ingest_killed_between_insert_and_commit_loses_and_doubles_nothing(
    kafka: KafkaBroker, tmp_path: Path
) -> None:
    cfg, path = service_config(tmp_path, "sigkill", kafka.bootstrap, batch_messages=200)
    sent = produce_fleet(cfg, SIM)
    store = tmp_path / "store"
    r = run_ingest(path, store, "--kill-after-write", "1")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    # the first batch is in the store, but no offset was committed
    written = stored(store, ["gpu_samples", "node_heartbeats"])
    assert sum(v[1] for v in written.values()) > 0
    assert all(
        v is None for v in _committed(kafka.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all()).values()
    )
    r = run_ingest(path, store)
    assert r.returncode == 0, r.stderr[-3000:]
    got = assert_exactly_once(store, sent)
    assert any(raw > final for final, raw, _ in got.values()), "the replayed batch should exist physically"


def _metric(port: int, name: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_two_consumers_one_stops_mid_run_nothing_lost(kafka: KafkaBroker, tmp_path: Path) -> None:
    cfg, path = service_config(tmp_path, "rebalance", kafka.bootstrap, batch_messages=100)
    first = produce_fleet(cfg, SimConfig(nodes=4, gpus_per_node=2, hours=0.25, seed=5))
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [*GPUSLO, "ingest", "--kafka", "-", "--config", str(path), "--store", str(tmp_path / f"store{i}"),
             "--metrics-port", str(ports[i]), "--metrics-addr", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"ingest{i}.log", "w"),  # noqa: SIM115
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        # both in the group with partitions of their own (the second may join after the first read
        # everything: a loaded machine starts it later); then more messages, for both to read
        while not all(_metric(p, "gpuslo_ingest_assigned_partitions") > 0 for p in ports):
            assert time.monotonic() < deadline, "the two consumers did not both get partitions"
            time.sleep(0.5)
        more = produce_fleet(cfg, SimConfig(nodes=4, gpus_per_node=2, hours=0.1, seed=7, cluster="sim3"))
        first_messages = first.kafka_messages + more.kafka_messages
        first += more
        while sum(_metric(p, "gpuslo_ingest_consumed_messages_total") for p in ports) < first_messages:
            assert time.monotonic() < deadline, "the consumers did not read the first half"
            time.sleep(0.5)
        a_consumed = _metric(ports[0], "gpuslo_ingest_consumed_messages_total")
        b_consumed = _metric(ports[1], "gpuslo_ingest_consumed_messages_total")
        assert a_consumed > 0 and b_consumed > 0, (
            "both consumers must own partitions for this test to mean something"
        )
        procs[0].send_signal(signal.SIGTERM)  # graceful: writes and commits what it read, leaves the group
        assert procs[0].wait(60) == 0
        second = produce_fleet(cfg, SimConfig(nodes=4, gpus_per_node=2, hours=0.25, seed=6, cluster="sim2"))
        deadline = time.monotonic() + 120
        while _metric(ports[1], "gpuslo_ingest_consumed_messages_total") < b_consumed + second.kafka_messages:
            assert time.monotonic() < deadline, "the remaining consumer did not take over the partitions"
            time.sleep(0.5)
        time.sleep(2)  # its last batch: written and committed
        # the GPU sample batches took the vectorised path; heartbeats, events... the models
        assert _metric(ports[1], 'gpuslo_ingest_decoded_messages_total{path="vectorised"}') > 0
        assert _metric(ports[1], 'gpuslo_ingest_decoded_messages_total{path="models"}') > 0
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    want = expected(first + second)
    a = stored(tmp_path / "store0", list(want))
    b = stored(tmp_path / "store1", list(want))
    for table, (_rows, keys) in want.items():
        assert a[table][2] | b[table][2] == keys, f"{table}: lost {len(keys - (a[table][2] | b[table][2]))}"


def test_poison_messages_are_dead_lettered_and_good_ones_land(kafka: KafkaBroker, tmp_path: Path) -> None:
    from kafka import KafkaProducer

    cfg, path = service_config(tmp_path, "poison", kafka.bootstrap)
    fleet = Fleet(SimConfig(nodes=1, gpus_per_node=2, hours=0.1, seed=7))
    sources = sim_sources(fleet)
    good = [m for k in range(3) for s in sources for m in s.collect(fleet.cfg.start_ts + 10 * k)]
    sample = next(m for m in good if isinstance(m, GpuSampleBatch))
    obj = orjson.loads(encode(sample))
    bad_cases = {
        "garbage": b"\x00\xff not json at all",
        "version": orjson.dumps({**obj, "v": 2, "seq": 9001}),
        "negative power": orjson.dumps({**obj, "seq": 9002, "gpus": [{**obj["gpus"][0], "fields": {"DCGM_FI_DEV_POWER_USAGE": -50.0}}]}),
        "absurd util": orjson.dumps({**obj, "seq": 9003, "gpus": [{**obj["gpus"][0], "fields": {"DCGM_FI_DEV_GPU_UTIL": 1e12}}]}),
        "empty": b"",
    }  # fmt: skip
    topic = cfg.kafka.topics.gpu_samples
    p = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    bad_iter = iter(bad_cases.values())
    on_topic: list[bool] = []  # what went to the samples topic, in order (True: a bad one)
    for i, m in enumerate(good):
        p.send(cfg.kafka.topics.for_kind(m.kind), key=b"n", value=encode(m))
        if cfg.kafka.topics.for_kind(m.kind) == topic:
            on_topic.append(False)
        if i % 2 == 0:
            nxt = next(bad_iter, None)
            if nxt is not None:
                p.send(topic, key=b"n", value=nxt)
                on_topic.append(True)
    for rest in bad_iter:
        p.send(topic, key=b"n", value=rest)
        on_topic.append(True)
    p.flush()
    p.close()
    r = run_ingest(path, tmp_path / "store")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_exactly_once(tmp_path / "store", good)
    s = ChdbStore(tmp_path / "store")
    try:
        dead = s.query(
            "SELECT topic, partition, offset, reason, length(raw) AS n FROM dead_letters FINAL ORDER BY offset"
        )
    finally:
        s.close()
    assert len(dead) == len(bad_cases)
    # one key, so one partition (of 3), in which each message's offset is its position
    assert {d["topic"] for d in dead} == {topic} and len({d["partition"] for d in dead}) == 1
    assert dead[0]["partition"] in range(3)
    assert [d["offset"] for d in dead] == [k for k, bad in enumerate(on_topic) if bad]
    reasons = " | ".join(d["reason"] for d in dead)
    for needle in (
        "not JSON",
        "unsupported wire version 2",
        "DCGM_FI_DEV_POWER_USAGE=-50.0 outside",
        "DCGM_FI_DEV_GPU_UTIL=1000000000000.0 outside",
    ):
        assert needle in reasons, reasons
    assert sorted(d["n"] for d in dead) == sorted(len(v) for v in bad_cases.values())


@pytest.mark.parametrize(("mechanism", "users"), [("PLAIN", SASL_USERS), ("SCRAM-SHA-256", SCRAM_USERS)])
def test_sasl_end_to_end_and_secrets_stay_secret(
    kafka: KafkaBroker,
    tmp_path: Path,
    mechanism: str,
    users: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    ((user, password),) = users.items()
    name = "sasl-" + mechanism.lower()
    topics = Topics(**{k: f"{name}.{k}" for k in Topics.model_fields})
    (tmp_path / "pw").write_text(password + "\n")
    kafka_cfg = KafkaSettings(
        bootstrap_servers=[kafka.sasl_bootstrap], topics=topics, security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=mechanism, sasl_username=user, sasl_password_file=tmp_path / "pw",
    )  # fmt: skip
    assert password not in repr(kafka_cfg)
    cfg = ServiceConfig(
        kafka=kafka_cfg,
        spool=SpoolSettings(directory=tmp_path / "spool"),
        producer=ProducerSettings(flush_timeout_s=5.0),
        ingest={"group_id": f"g-{name}", "batch_s": 0.5, "metrics_port": 0},  # type: ignore[arg-type]
    )
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(orjson.loads(cfg.model_dump_json())))
    sent = produce_fleet(cfg, SimConfig(nodes=1, gpus_per_node=2, hours=0.05, seed=8))
    r = run_ingest(path, tmp_path / "store", "-v")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_exactly_once(tmp_path / "store", sent)
    assert password not in r.stderr  # not even at debug level
    # a wrong password: the agent keeps spooling and says why, without the secret
    os.environ["GPUSLO_TEST_BAD_PW"] = "definitely-wrong-" + password
    try:
        bad = kafka_cfg.model_copy(
            update={"sasl_password_file": None, "sasl_password_env": "GPUSLO_TEST_BAD_PW"}
        )
        # our own loggers at DEBUG (the CLI keeps kafka-python's protocol dump, which prints
        # SASL bytes, at INFO or above; the subprocess run with -v above checks that path)
        with caplog.at_level(logging.DEBUG, logger="agent"):
            sink = KafkaSink(
                bad, SpoolSettings(directory=tmp_path / "spool-bad"), ProducerSettings(flush_timeout_s=2.0)
            )
            sink.send(sent[:3])
            assert not sink.flush(6)
            assert sink.pending == 3
            sink.close(timeout_s=1)
        ours = "\n".join(
            r.getMessage() for r in caplog.records if r.name.startswith(("agent", "gpuslo", "ingest"))
        )
        assert "Kafka unavailable" in ours
        assert "definitely-wrong" not in ours
    finally:
        del os.environ["GPUSLO_TEST_BAD_PW"]


@pytest.mark.parametrize("protocol", ["SSL", "SASL_SSL"])
def test_tls_end_to_end(kafka: KafkaBroker, tmp_path: Path, protocol: str) -> None:
    """SSL: mutual TLS (the listener requires a client certificate); SASL_SSL: SCRAM inside
    TLS. The broker's certificate is checked against the test CA, host name included."""
    tls = kafka.tls_dir
    name = protocol.lower().replace("_", "-")
    topics = Topics(**{k: f"{name}.{k}" for k in Topics.model_fields})
    common: dict[str, Any] = {"topics": topics, "security_protocol": protocol, "ssl_cafile": tls / "ca.pem"}
    if protocol == "SSL":
        common |= {"bootstrap_servers": [kafka.ssl_bootstrap], "ssl_certfile": tls / "client.crt",
                   "ssl_keyfile": tls / "client.key"}  # fmt: skip
    else:
        ((user, password),) = SCRAM_USERS.items()
        common |= {"bootstrap_servers": [kafka.sasl_ssl_bootstrap], "sasl_mechanism": "SCRAM-SHA-256",
                   "sasl_username": user, "sasl_password": password}  # fmt: skip
    kafka_cfg = KafkaSettings(**common)
    cfg = ServiceConfig(
        kafka=kafka_cfg,
        spool=SpoolSettings(directory=tmp_path / "spool"),
        producer=ProducerSettings(flush_timeout_s=5.0),
        ingest={"group_id": f"g-{name}", "batch_s": 0.5, "metrics_port": 0},  # type: ignore[arg-type]
    )
    path = tmp_path / "svc.yaml"
    dumped = orjson.loads(cfg.model_dump_json())
    if protocol == "SASL_SSL":
        dumped["kafka"]["sasl_password"] = password  # the dump masks it
    path.write_text(yaml.safe_dump(dumped))
    sent = produce_fleet(cfg, SimConfig(nodes=1, gpus_per_node=2, hours=0.05, seed=9))
    r = run_ingest(path, tmp_path / "store")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_exactly_once(tmp_path / "store", sent)
    # a CA that did not sign the broker's certificate: nothing is sent, everything stays spooled
    stranger = tmp_path / "stranger-ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "s.key"),
         "-out", str(stranger), "-days", "1", "-subj", "/CN=stranger"],
        capture_output=True, check=True,
    )  # fmt: skip
    sink = KafkaSink(
        kafka_cfg.model_copy(update={"ssl_cafile": stranger}),
        SpoolSettings(directory=tmp_path / "spool-bad"),
        ProducerSettings(flush_timeout_s=2.0),
    )
    sink.send(sent[:3])
    assert not sink.flush(6)
    assert sink.pending == 3
    sink.close(timeout_s=1)


class FlakyStore:
    """A real chDB store that is 'unreachable' for the first ``failures`` inserts."""

    def __init__(self, inner: ChdbStore, failures: int) -> None:
        self.inner = inner
        self.failures = failures
        self.attempts = 0

    def insert(self, table: str, columns: Any) -> int:
        self.attempts += 1
        if self.attempts <= self.failures:
            from gpuslo.ingest.store import Failure, StoreError

            raise StoreError("connection refused (injected)", Failure.TRANSIENT)
        return self.inner.insert(table, columns)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_store_unreachable_pauses_commits_nothing_loses_nothing(kafka: KafkaBroker, tmp_path: Path) -> None:
    from gpuslo.ingest.kafka_consumer import KafkaIngest

    cfg, _ = service_config(tmp_path, "storedown", kafka.bootstrap)
    sent = produce_fleet(cfg, SimConfig(nodes=1, gpus_per_node=2, hours=0.1, seed=9))
    store = ChdbStore(tmp_path / "store")
    store.migrate(SCHEMA)
    flaky = FlakyStore(store, failures=4)
    committed_while_down: list[dict[str, int | None]] = []
    sleeps: list[float] = []

    def sleep(
        s: float,
    ) -> None:  # the consumer's backoff: record it, and look at the group's offsets meanwhile
        sleeps.append(s)
        committed_while_down.append(_committed(kafka.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all()))

    ing = KafkaIngest(cfg.kafka, cfg.ingest, flaky, sleep=sleep)  # type: ignore[arg-type]
    try:
        ing.run(idle_exit_s=6)
    finally:
        store.close()
    assert sleeps[:4] == [0.5, 1.0, 2.0, 4.0]  # exponential backoff
    assert all(v is None for c in committed_while_down for v in c.values())  # nothing committed while down
    assert ing.metrics.store_errors._value.get() == 4
    assert_exactly_once(tmp_path / "store", sent)
    after = _committed(kafka.bootstrap, cfg.ingest.group_id, [cfg.kafka.topics.gpu_samples])
    assert sum(v or 0 for v in after.values()) == sent.kafka_gpu_messages


def test_a_backlog_is_polled_a_batch_at_a_time(kafka: KafkaBroker, tmp_path: Path) -> None:
    """On the real broker and kafka-python: a backlog of 24 packs (~500 kB each, zstd as the
    agent sends them) read with ``batch_bytes`` 1 MiB. kafka-python fetches them together, but
    each poll returns about what the batch has room for (the first poll one record), so the
    first insert does not wait for the whole fetch to be decompressed and the ingest holds about
    a batch; every row lands, the last offset is committed."""
    from kafka import KafkaProducer

    from gpuslo.ingest.kafka_consumer import KafkaIngest
    from gpuslo.wire import pack as P
    from tests.helpers import T0
    from tests.test_fastpath import _batch

    cfg, _ = service_config(tmp_path, "backlog", kafka.bootstrap, batch_messages=5000, batch_bytes=1 << 20)
    topic = cfg.kafka.topics.gpu_samples
    values = [
        P.pack([encode(_batch(k * 1000 + i, T0 + k * 1000 + i)) for i in range(600)])[0] for k in range(24)
    ]
    p = KafkaProducer(bootstrap_servers=kafka.bootstrap, compression_type="zstd", linger_ms=200,
                      max_request_size=32 << 20, batch_size=16 << 20)  # fmt: skip
    for v in values:
        p.send(topic, key=b"n", value=v)  # one key: one partition, one fetch holds the backlog
    p.flush()
    p.close()
    store = ChdbStore(tmp_path / "store")
    store.migrate(SCHEMA)
    ing = KafkaIngest(cfg.kafka, cfg.ingest, store)
    ing.ingestor.clock = lambda: T0 + 3600
    returned: list[int] = []
    poll = ing.consumer.poll

    def counted(*a: Any, **k: Any) -> Any:
        got = poll(*a, **k)
        if got:
            returned.append(sum(len(v) for v in got.values()))
        return got

    ing.consumer.poll = counted  # type: ignore[method-assign]
    ing.run(idle_exit_s=3)
    try:
        rows = store.query("SELECT count() AS n FROM gpu_samples FINAL")[0]["n"]
    finally:
        store.close()
    assert rows == 24 * 600 * 7
    assert returned[0] == 1 and sum(returned) == 24
    room = -(-(1 << 20) // min(len(v) for v in values))  # the most records a batch has room for
    assert max(returned) <= room, returned
    assert sum(o or 0 for o in _committed(kafka.bootstrap, cfg.ingest.group_id, [topic]).values()) == 24


def test_ingest_metrics_port_taken_is_a_clear_error(kafka: KafkaBroker, tmp_path: Path) -> None:
    """The ingest's /metrics on a port something else holds ended in a traceback (an uncaught
    OSError from the server's bind); the agent's said what was wrong. Both say it now, exit 2."""
    import socket

    _, path = service_config(tmp_path, "busyport", kafka.bootstrap)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = run_ingest(path, tmp_path / "store", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"cannot serve /metrics on 127.0.0.1:{port}: Address already in use" in p.stderr
    assert "Traceback" not in p.stderr


def test_the_broker_refuses_a_topic_named_apart_from_another_only_by_dot_and_underscore(
    kafka: KafkaBroker,
) -> None:
    """The premise of the config's refusal of such names (``Topics``): on the real broker the
    second topic is never created, so a producer to it waits for metadata at every send."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import InvalidTopicError

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap, request_timeout_ms=20_000)
    try:
        admin.create_topics([NewTopic("collide.a_b", 1, 1)])
        with pytest.raises(InvalidTopicError, match="collides"):
            admin.create_topics([NewTopic("collide_a.b", 1, 1)], raise_errors=True)
    finally:
        admin.close()
    with pytest.raises(ValueError, match="differ only"):
        Topics(gpu_samples="collide.a_b", heartbeat="collide_a.b")


def test_the_longest_group_id_the_config_takes_reads_and_commits_on_the_broker(
    kafka: KafkaBroker, tmp_path: Path
) -> None:
    """A Kafka protocol string holds 32,767 bytes: a consumer of a longer group id read nothing and
    committed nothing on the real broker, without an error, and an empty one failed its join. The
    config takes the longest that works and refuses the rest, naming the key."""
    from kafka import KafkaProducer, TopicPartition

    from gpuslo.core.settings import IngestSettings, KafkaSettings
    from gpuslo.ingest.kafka_consumer import _default_factory

    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
    producer.send("longgroup", b"x").get(timeout=30)
    producer.close()
    for gid in ("g" * 32767, "é" * 16383):
        group = IngestSettings(group_id=gid).group_id
        # the ingest's consumer (its join guarded: kafka-python 3.0.12's unguarded one can leave
        # its first join unfinished for good, ingest/kafka_join.py, and read nothing)
        c = _default_factory(bootstrap_servers=kafka.bootstrap, group_id=group, client_id=KafkaSettings().client_id,
                          enable_auto_commit=False, auto_offset_reset="earliest", consumer_timeout_ms=15_000)  # fmt: skip
        try:
            c.subscribe(["longgroup"])
            got = list(c)
            c.commit()
            assert len(got) == 1
            assert c.committed(TopicPartition("longgroup", got[0].partition)) == 1
        finally:
            c.close()
    for bad in ("", "g" * 32768, "é" * 16384):
        with pytest.raises(ValueError, match="group_id"):
            IngestSettings(group_id=bad)

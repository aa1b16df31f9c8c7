"""Kafka compression: zstd by default, and a codec a process lacks is a clear error on both sides.

The agent's producer compresses with zstd unless told otherwise (``producer.compression``); the
ingest reads whatever its kafka-python can decompress. A codec the agent lacks would make every
drain fail (kafka-python refuses to make the producer) while the spool fills, reported as a broker
that cannot be reached: it is refused when the sink is made. A codec the ingest lacks makes
kafka-python's ``poll`` raise (and a second poll hung): the ingest writes and commits what it read
before, then stops with the reason and the package to install.

The integration tests run a real broker; the codec the ingest lacks is real too: a topic whose
``compression.type`` is lz4 makes the broker recompress what is produced to it, and this
installation has no lz4 module (constraints.txt)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from kafka import codec
from kafka.errors import CorruptRecordError, UnsupportedCodecError
from kafka.structs import TopicPartition

from gpuslo.agent.kafka_sink import CODEC_PACKAGES, KafkaSink, check_codec
from gpuslo.core.settings import IngestSettings, KafkaSettings, ProducerSettings, SettingsError, SpoolSettings
from gpuslo.ingest.failures import Failure
from gpuslo.ingest.kafka_consumer import KafkaIngest, UnreadableRecords
from gpuslo.ingest.store import StoreError
from tests.test_ingest_commits import TOPIC, Consumer, Recording, _ingest

GPUSLO = [str(Path(sys.executable).with_name("gpuslo"))]


def test_zstd_is_the_default_and_this_installation_has_it() -> None:
    assert ProducerSettings().compression == "zstd"
    assert codec.has_zstd()  # gpuslo[agent] and gpuslo[ingest] install zstandard
    for c in ("none", "gzip", "zstd"):
        check_codec(c)


@pytest.mark.parametrize("name", sorted(CODEC_PACKAGES))
def test_a_codec_kafka_python_cannot_use_is_refused_with_its_package(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for attr in ("snappy", "zstd", "lz4", "lz4f", "lz4framed"):  # every module kafka-python looks for
        monkeypatch.setattr(codec, attr, None)
    with pytest.raises(SettingsError) as err:
        check_codec(name)
    assert f"producer.compression {name}" in str(err.value) and repr(CODEC_PACKAGES[name]) in str(err.value)
    # refused when the sink is made, before the spool is opened or a drain thread started
    spool = tmp_path / "spool"
    threads = threading.active_count()
    with pytest.raises(SettingsError):
        KafkaSink(KafkaSettings(), SpoolSettings(directory=spool), ProducerSettings(compression=name))  # type: ignore[arg-type]
    assert not spool.exists() and threading.active_count() == threads


class Unreadable(Consumer):
    """kafka-python's consumer whose fetch reached records it cannot read: ``poll`` raises (as
    kafka-python 3 does from the fetcher's inline exception) once the scripted polls are done."""

    def __init__(self, error: Exception) -> None:
        super().__init__(partitions=2)
        self.error = error
        self.polls_after_error = 0

    def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        if self.script:
            return super().poll(timeout_ms, max_records)
        self.polls_after_error += 1
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        UnsupportedCodecError("Libraries for zstd compression codec not found"),
        UnsupportedCodecError("Libraries for lz4 compression codec not found"),
        CorruptRecordError("Record batch for partition gpuslo.latency-1 at offset 7 failed crc check"),
    ],
    ids=["zstd", "lz4", "crc"],
)
def test_records_the_ingest_cannot_read_stop_it_after_what_it_read_before_is_committed(
    error: Exception,
) -> None:
    c = Unreadable(error)
    c.script = [{0: 3, 1: 2}, {0: 1}]
    store = Recording()
    ing = _ingest(c, store)
    with pytest.raises(UnreadableRecords) as err:
        ing.run()
    text = str(err.value)
    assert type(error).__name__ in text and "gpuslo.latency" in text
    if "zstd" in str(error):
        assert "'zstandard'" in text
    elif "lz4" in str(error):
        assert "'lz4'" in text
    # kafka-python 3.0.12 hung on a second poll after such an error: never polled again
    assert c.polls_after_error == 1
    # the 6 records read before were written (each a dead letter: "not json") and committed
    assert store.rows == 6
    assert {tp.partition: o for tp, o in c.committed.items()} == {0: 4, 1: 2}
    assert not c.violations


class Held(Consumer):
    """kafka-python's consumer when one poll returned a partition's records and then met
    records it cannot read on another: the error is held for the next poll (its fetcher's
    ``_next_in_line_exception_metadata``), which kafka-python 3.0.12 drops if that poll has the
    partition paused, and then loops for good: so any poll after it fails the test."""

    def __init__(self, error: Exception) -> None:
        super().__init__(partitions=2)
        self.error = error
        self._fetcher = type("Fetcher", (), {"_next_in_line_exception_metadata": None})()
        self.polls_after_held = 0

    def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        if self._fetcher._next_in_line_exception_metadata is not None:
            self.polls_after_held += 1
            return {}
        out = super().poll(timeout_ms, max_records)
        if not self.script and out:  # the last scripted records: then the unreadable batch
            meta = type(
                "Meta",
                (),
                {"partition": TopicPartition(TOPIC, 1), "fetched_offset": 2, "exception": self.error},
            )
            self._fetcher._next_in_line_exception_metadata = meta()
        return out


def test_an_error_kafka_python_holds_for_its_next_poll_stops_the_ingest_without_that_poll() -> None:
    c = Held(UnsupportedCodecError("Libraries for lz4 compression codec not found"))
    c.script = [{0: 3, 1: 2}, {0: 2}]
    store = Recording()
    ing = _ingest(c, store)
    with pytest.raises(UnreadableRecords) as err:
        ing.run()
    assert c.polls_after_held == 0
    assert f"{TOPIC}/1 at offset 2" in str(err.value) and "'lz4'" in str(err.value)
    assert store.rows == 7
    assert {tp.partition: o for tp, o in c.committed.items()} == {0: 5, 1: 2}
    assert not c.violations


def test_a_refusal_kafka_python_holds_for_its_next_poll_is_a_refusal_not_unreadable_records() -> None:
    """kafka-python holds a TopicAuthorizationFailedError back like records it cannot read (a CI
    run: the topic's READ taken away mid-run, after a poll that returned another partition's
    records): it stopped the ingest as unreadable records, which says to install a codec. It is
    Kafka's refusal, as if raised out of the poll; what was read before is written and committed."""
    from kafka.errors import TopicAuthorizationFailedError

    from gpuslo.ingest.kafka_consumer import KafkaRefused

    c = Held(TopicAuthorizationFailedError({TOPIC}))
    c.script = [{0: 3, 1: 2}, {0: 2}]
    store = Recording()
    ing = _ingest(c, store)
    with pytest.raises(KafkaRefused) as err:
        ing.run()
    assert c.polls_after_held == 0 and "TopicAuthorizationFailedError" in str(err.value)
    assert store.rows == 7
    assert {tp.partition: o for tp, o in c.committed.items()} == {0: 5, 1: 2}
    assert not c.violations


class Outage(Recording):
    """A store whose first ``down`` inserts fail as a server that cannot be reached."""

    def __init__(self, down: int) -> None:
        super().__init__()
        self.down = down

    def insert(self, table: str, columns: Any) -> int:
        if self.down > 0:
            self.down -= 1
            raise StoreError("connection refused", Failure.TRANSIENT)
        return super().insert(table, columns)


class Reassigned(Consumer):
    """While the store is away the ingest pauses its partitions and keeps polling; a rebalance
    inside such a poll gives it a partition that is not paused, whose records that very poll
    returns (kafka-python fetches every partition not paused)."""

    def __init__(self) -> None:
        super().__init__(partitions=2)
        self.owned = {TopicPartition(TOPIC, 0)}
        self.paused_polls = 0
        self.is_paused: set[Any] = set()

    def pause(self, *tps: Any) -> None:
        self.is_paused |= set(tps)

    def resume(self, *tps: Any) -> None:
        self.is_paused -= set(tps)

    def paused(self) -> set[Any]:
        return set(self.is_paused)

    def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        if self.is_paused:
            self.paused_polls += 1
            if self.paused_polls == 2:  # partition 1 assigned, not paused: its records come back
                self.owned.add(TopicPartition(TOPIC, 1))
                self.script.insert(0, {1: 4})
            else:
                return {}
        got = super().poll(timeout_ms, max_records)
        for tp in got:
            assert tp not in self.is_paused, "a paused partition returned records"
        return got


def test_records_a_paused_poll_returns_are_written_not_dropped() -> None:
    c = Reassigned()
    c.script = [{0: 3}, {}, {0: 2}]
    store = Outage(down=60)  # about 0.6 s of retries: the ingest waits on them with its partitions paused
    ing = KafkaIngest(
        KafkaSettings(),
        IngestSettings(
            batch_messages=5, batch_s=0.05, metrics_port=0, retry_initial_s=0.01, retry_max_s=0.01
        ),
        store,
        consumer_factory=lambda **_: c,
    )
    for _ in range(12):
        ing.step()
    ing.close()
    assert c.paused_polls >= 2
    assert store.rows == 3 + 4 + 2  # every record read, those of the paused poll's new partition too
    assert {tp.partition: o for tp, o in c.committed.items()} == {0: 5, 1: 4}
    assert not c.violations


@pytest.mark.integration
def test_the_agent_sends_zstd_by_default_and_the_ingest_reads_it(
    kafka: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real broker: JSON messages and packs, produced with the default settings, arrive
    zstd-compressed (every record batch the ingest reads goes through kafka-python's zstd
    decoder) and land whole."""
    from kafka.record import default_records

    from gpuslo.agent.sim.fleet import SimConfig
    from tests.test_kafka import assert_exactly_once, produce_fleet, service_config

    decoded = [0]
    real = default_records.zstd_decode

    def counting(payload: bytes) -> bytes:
        decoded[0] += 1
        return bytes(real(payload))

    monkeypatch.setattr(default_records, "zstd_decode", counting)
    cfg, _path = service_config(tmp_path, "zstd", kafka.bootstrap)
    assert cfg.producer.compression == "zstd"
    sent = produce_fleet(cfg, SimConfig(nodes=2, gpus_per_node=4, hours=0.25, seed=5))
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules.tables import SCHEMA

    store = ChdbStore(tmp_path / "store")
    try:
        store.migrate(SCHEMA)
        ing = KafkaIngest(cfg.kafka, cfg.ingest, store)
        ing.run(idle_exit_s=4)
    finally:
        store.close()
    assert decoded[0] >= 1
    assert_exactly_once(tmp_path / "store", sent)


@pytest.mark.integration
def test_a_codec_the_ingest_lacks_is_a_clear_stop_not_a_traceback(kafka: Any, tmp_path: Path) -> None:
    """The broker recompresses a topic with lz4 (``compression.type``), which this installation
    cannot read: ``gpuslo ingest`` exits 2 with one line naming the codec and the package."""
    from kafka.admin import KafkaAdminClient, NewTopic

    from gpuslo.agent.sim.fleet import SimConfig
    from tests.test_kafka import produce_fleet, run_ingest, service_config

    if codec.has_lz4():
        pytest.skip("this installation reads lz4: no codec left to lack (constraints.txt pins none)")
    cfg, path = service_config(tmp_path, "lz4topic", kafka.bootstrap)
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        admin.create_topics(
            [NewTopic(cfg.kafka.topics.heartbeat, 3, 1, topic_configs={"compression.type": "lz4"})]
        )
    finally:
        admin.close()
    produce_fleet(cfg, SimConfig(nodes=2, gpus_per_node=2, hours=0.05, seed=6))
    r = run_ingest(path, tmp_path / "store")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("gpuslo ingest: stopped"))
    assert "UnsupportedCodecError" in line and "lz4" in line and "'lz4'" in line, line
    assert line.count("UnsupportedCodecError") == 1, line


@pytest.mark.integration
def test_an_agent_configured_with_a_codec_it_lacks_says_so(tmp_path: Path) -> None:
    """``gpuslo agent`` with ``producer.compression: lz4`` and no lz4 module: exit 2, one line."""
    if codec.has_lz4():
        pytest.skip("this installation has lz4")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"producer:\n  compression: lz4\nspool:\n  directory: {tmp_path / 'spool'}\n")
    r = subprocess.run(
        [
            *GPUSLO,
            "agent",
            "--source",
            "sim",
            "--kafka",
            "127.0.0.1:9",
            "--config",
            str(cfg),
            "--nodes",
            "1",
            "--hours",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert "producer.compression lz4" in r.stderr and "'lz4'" in r.stderr
    assert not (tmp_path / "spool").exists()


@pytest.mark.integration
def test_a_store_outage_at_an_unreadable_batch_stops_the_ingest_instead_of_hanging(
    kafka: Any, tmp_path: Path
) -> None:
    """On a real broker, kafka-python 3.0.12 itself: a poll returns one topic's records and holds
    the error of another's lz4 batch for its next poll; the store is down, so the ingest waits
    with its partitions paused. A paused poll would drop the held error and a later poll loop
    for good (found by the attack of session 16): the ingest must stop with the reason, having
    written and committed every readable record."""
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules.tables import SCHEMA
    from tests.test_kafka import _committed, service_config

    if codec.has_lz4():
        pytest.skip("this installation reads lz4")
    cfg, _ = service_config(tmp_path, "held", kafka.bootstrap, batch_messages=5000, batch_bytes=1 << 20,
                            retry_initial_s=0.2, retry_max_s=0.2)  # fmt: skip
    good, bad = cfg.kafka.topics.heartbeat, cfg.kafka.topics.gpu_samples
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        admin.create_topics(
            [NewTopic(good, 1, 1), NewTopic(bad, 1, 1, topic_configs={"compression.type": "lz4"})]
        )
    finally:
        admin.close()
    p = KafkaProducer(bootstrap_servers=kafka.bootstrap, compression_type="gzip", linger_ms=0)
    for i in range(22):  # ~100 kB each: one poll fills a 1 MiB batch, the rest waits in _pending
        p.send(good, b"x%d " % i + bytes(100_000))
    for i in range(5):
        p.send(bad, b"y%d" % i)
    p.flush()
    p.close()

    store = ChdbStore(tmp_path / "store")
    store.migrate(SCHEMA)
    down = [3]  # inserts that fail as an unreachable server (each retry 0.2 s: paused polls between)

    class Away:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def insert(self, table: str, columns: Any) -> int:
            if down[0] > 0:
                down[0] -= 1
                raise StoreError("connection refused", Failure.TRANSIENT)
            return store.insert(table, columns)

    result: list[BaseException | None] = []
    ing = KafkaIngest(cfg.kafka, cfg.ingest, Away())  # type: ignore[arg-type]

    def run() -> None:
        try:
            ing.run(idle_exit_s=5)
            result.append(None)
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(90)
    try:
        assert not t.is_alive(), "the ingest hung"
        (got,) = result
        assert isinstance(got, UnreadableRecords), got
        assert "lz4" in str(got) and "'lz4'" in str(got)
        rows = store.query("SELECT count() AS n FROM dead_letters")[0]["n"]  # not JSON: dead letters
    finally:
        store.close()
    # kafka-python drains the two partitions of a fetch in either order: the good one first (its
    # 22 records returned, the error held: the case of the hang) or the bad one (the error raised
    # at once, nothing read). Either way what was read is written and committed, nothing past it
    committed = _committed(kafka.bootstrap, cfg.ingest.group_id, [good, bad])
    assert rows in (0, 22)
    assert committed == {f"{good}/0": rows or None, f"{bad}/0": None}

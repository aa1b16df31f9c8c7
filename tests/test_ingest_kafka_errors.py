"""Kafka's own errors under a running ingest, on the real Apache Kafka broker.

A poll that kafka-python ends with an error is either one Kafka calls retriable (a broker
away or restarting, the coordinator moving: polled through, nothing lost or skipped) or one it
does not (an ACL taken away: the ingest stops after writing and committing what it read, and
``gpuslo ingest`` exits 2 with one line). A CI run met the first as a traceback out of
``ingest.run``: kafka-python 3.0.12 raises the connection error of a coordinator lookup during
a broker restart out of ``poll``. The ACLs here are the broker's own (StandardAuthorizer), taken
away from a SASL user while it reads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from kafka.errors import (
    CoordinatorNotAvailableError,
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    NotCoordinatorError,
    RequestTimedOutError,
)

from gpuslo.core.settings import KafkaSettings, ProducerSettings, ServiceConfig, SpoolSettings, Topics
from gpuslo.ingest.kafka_consumer import KafkaIngest, KafkaRefused, _default_factory
from gpuslo.rules.tables import SCHEMA
from tests.servers.kafka import SASL_USERS, KafkaBroker
from tests.test_ingest_faults import (
    CommitWatch,
    assert_all_committed,
    expected_rows,
    fleet_messages,
    origin_key,
    produce,
    stored_keys,
    workload,
)
from tests.test_kafka import run_ingest, service_config

pytestmark = pytest.mark.integration

Fault = Callable[[Any], Callable[[], None] | None]  # armed on the real consumer; returns its undo


class Faulty:
    """The real kafka-python consumer, with a fault armed before chosen polls (by number)."""

    def __init__(self, real: Any, faults: dict[int, Fault]) -> None:
        self._real = real
        self.faults = faults
        self.polls = 0

    def poll(self, *args: Any, **kw: Any) -> Any:
        self.polls += 1
        fault = self.faults.pop(self.polls, None)
        undo = fault(self._real) if fault is not None else None
        try:
            return self._real.poll(*args, **kw)
        finally:
            if undo is not None:
                undo()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def coordinator_lookup_refused(c: Any) -> Callable[[], None]:
    """What the broker restart did in CI, through kafka-python's own code: the coordinator
    connection lost, its lookup failing with the connection refused, and the metadata refresh
    that ``ensure_coordinator_ready_async`` then waits for failing the same way (its second
    wait is not guarded: the error leaves ``poll``)."""
    from kafka.future import Future

    err = KafkaConnectionError("111 ECONNREFUSED")
    coord = c._coordinator
    coord.coordinator_dead(err)
    coord.lookup_coordinator = lambda: Future().failure(err)
    coord._cluster.request_update = lambda: Future().failure(err)

    def undo() -> None:
        del coord.lookup_coordinator
        del coord._cluster.request_update

    return undo


def raises(exc: Exception) -> Fault:
    def fault(_c: Any) -> None:
        raise exc

    return fault


def counted(ing: KafkaIngest, error: str) -> float:
    return ing.registry.get_sample_value("gpuslo_ingest_poll_errors_total", {"error": error}) or 0.0


def test_retriable_kafka_errors_out_of_a_poll_are_polled_through(kafka: KafkaBroker, tmp_path: Path) -> None:
    """Every retriable error a poll can end with, one after another mid-run (two in a row for
    one: an outage longer than a poll): none stops the ingest, which ends with exact counts and
    everything committed, the store holding all below every commit at every commit."""
    from gpuslo.ingest.store import ChdbStore

    seed = 41
    cfg, _ = service_config(tmp_path, "pollerrors", kafka.bootstrap, batch_messages=20)
    sent = produce(kafka.bootstrap, cfg, workload(cfg, seed, poison=1))
    st = ChdbStore(tmp_path / "store")
    st.migrate(SCHEMA)
    watch = CommitWatch(sent, st)  # type: ignore[arg-type]
    faults: dict[int, Fault] = {
        3: coordinator_lookup_refused,
        5: raises(NodeNotReadyError("node 1")),
        6: raises(NodeNotReadyError("node 1")),
        9: raises(RequestTimedOutError()),
        12: raises(NotCoordinatorError()),
        15: raises(CoordinatorNotAvailableError()),
        18: raises(KafkaTimeoutError("Timeout after 500 ms")),
    }
    consumers: list[Faulty] = []

    def factory(**kw: Any) -> Faulty:
        consumers.append(Faulty(_default_factory(**kw), faults))
        return consumers[0]

    try:
        ing = KafkaIngest(cfg.kafka, cfg.ingest, st, consumer_factory=factory, after_write=watch)
        watch.ing = ing
        ing.run(idle_exit_s=8)
        assert not faults, f"polls {sorted(faults)} never came: the run was shorter than the faults"
        assert consumers[0].polls > 18
        # the coordinator lookup's error did leave kafka-python's poll (else this tests nothing of it)
        assert counted(ing, "KafkaConnectionError") == 1
        assert counted(ing, "NodeNotReadyError") == 2
        for name in (
            "RequestTimedOutError",
            "NotCoordinatorError",
            "CoordinatorNotAvailableError",
            "KafkaTimeoutError",
        ):
            assert counted(ing, name) == 1, name
        assert watch.checks > 3
        assert ing.failed is None
        assert_all_stored(st, sent, seed)
    finally:
        st.close()
    assert_all_committed(kafka, cfg, sent)


def assert_all_stored(st: Any, sent: dict[tuple[str, int, int], Any], seed: int) -> None:
    assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}
    for table, rows in expected_rows(fleet_messages(seed)).items():
        assert st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"] == rows, table


# ------------------------------------------------------------------------------- ACLs
@pytest.fixture(scope="module")
def acl_broker(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    b = KafkaBroker(tmp_path_factory.mktemp("kafka-acl"), libs=kafka_libs, authorizer=True)
    b.start()
    try:
        yield b
    finally:
        b.stop()


def _acl(kind: str, name: str, op: str = "READ") -> Any:
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern
    from kafka.admin import ResourceType as R

    user = next(iter(SASL_USERS))
    pattern = ResourcePattern(R.TOPIC if kind == "topic" else R.GROUP, name, ACLResourcePatternType.LITERAL)
    return ACL(f"User:{user}", "*", getattr(ACLOperation, op), ACLPermissionType.DENY, pattern)


def deny(broker: KafkaBroker, kind: str, name: str, op: str = "READ") -> None:
    """A DENY ACL (READ unless told) for the SASL user on a topic or a group (the admin is the super user)."""
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        got = admin.create_acls([_acl(kind, name, op)])
        assert not got["failed"], got
    finally:
        admin.close()


def allow_again(broker: KafkaBroker, kind: str, name: str, op: str = "READ") -> None:
    from kafka.admin import ACLFilter, KafkaAdminClient

    acl = _acl(kind, name, op)
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        admin.delete_acls(
            [ACLFilter(acl.principal, acl.host, acl.operation, acl.permission_type, acl.resource_pattern)]
        )
    finally:
        admin.close()


def sasl_config(broker: KafkaBroker, tmp_path: Path, name: str) -> tuple[ServiceConfig, Path]:
    ((user, password),) = SASL_USERS.items()
    topics = Topics(**{k: f"{name}.{k}" for k in Topics.model_fields})
    kafka = KafkaSettings(
        bootstrap_servers=[broker.sasl_bootstrap], topics=topics, security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN", sasl_username=user, sasl_password=password,
    )  # fmt: skip
    ingest = {
        "group_id": f"g-{name}",
        "batch_s": 0.5,
        "metrics_port": 0,
        "session_timeout_s": 6,
        "batch_messages": 20,
    }
    cfg = ServiceConfig(
        kafka=kafka,
        spool=SpoolSettings(directory=tmp_path / f"spool-{name}"),
        producer=ProducerSettings(flush_timeout_s=5.0),
        ingest=ingest,  # type: ignore[arg-type]
    )
    path = tmp_path / f"{name}.yaml"
    dumped = orjson.loads(cfg.model_dump_json())
    dumped["kafka"]["sasl_password"] = password  # the dump masks it
    path.write_text(yaml.safe_dump(dumped))
    return cfg, path


@pytest.mark.parametrize("kind", ["topic", "group"])
def test_an_acl_taken_away_mid_run_stops_the_ingest_after_committing_what_it_read(
    acl_broker: KafkaBroker, tmp_path: Path, kind: str
) -> None:
    """The user's READ on the GPU topic (the next fetch is refused: TopicAuthorizationFailedError
    out of ``poll``) or on the group (the next commit is refused: GroupAuthorizationFailedError)
    taken away after three batches: the ingest stops with :class:`KafkaRefused` naming the error,
    never committing what the store does not hold; given the right back, the next run reads on
    from the last commit and ends with exact counts."""
    from gpuslo.ingest.store import ChdbStore

    seed = 43
    cfg, _ = sasl_config(acl_broker, tmp_path, f"acl-{kind}")
    sent = produce(acl_broker.bootstrap, cfg, workload(cfg, seed))
    resource = cfg.kafka.topics.gpu_samples if kind == "topic" else cfg.ingest.group_id
    group = (acl_broker.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all())
    st = ChdbStore(tmp_path / "store")
    st.migrate(SCHEMA)
    watch = CommitWatch(sent, st)  # type: ignore[arg-type]
    denied = threading.Event()

    def hook(n: int) -> None:
        watch.batches = n
        watch.check(group)  # read by the admin: the user may have lost its rights
        if n == 3:
            deny(acl_broker, kind, resource)
            denied.set()

    ing = KafkaIngest(cfg.kafka, cfg.ingest, st, after_write=hook)
    try:
        with pytest.raises(KafkaRefused) as err:
            ing.run(idle_exit_s=30)
        assert denied.is_set()
        want = "TopicAuthorizationFailedError" if kind == "topic" else "GroupAuthorizationFailedError"
        assert want in str(err.value) and "ACLs" in str(err.value), str(err.value)
        assert str(err.value).count(want) == 1, str(err.value)
        watch.check(group)
        assert watch.checks > 3
        committed = watch.committed(group)
        assert sum(committed.values()) < len(sent), "stopped after everything: the refusal came too late"
        allow_again(acl_broker, kind, resource)
        again = KafkaIngest(cfg.kafka, cfg.ingest, st)
        again.run(idle_exit_s=8)
        assert_all_stored(st, sent, seed)
    finally:
        allow_again(acl_broker, kind, resource)
        st.close()
    assert_all_committed(acl_broker, cfg, sent)


def test_gpuslo_ingest_refused_by_an_acl_exits_2_with_one_line(
    acl_broker: KafkaBroker, tmp_path: Path
) -> None:
    """``gpuslo ingest`` as a user denied its group from the start: exit 2, one line naming the
    refusal and what to check, no traceback, no password."""
    cfg, path = sasl_config(acl_broker, tmp_path, "acl-cli")
    produce(acl_broker.bootstrap, cfg, workload(cfg, 47)[:30])
    deny(acl_broker, "group", cfg.ingest.group_id)
    try:
        r = run_ingest(path, tmp_path / "store", timeout_s=90)
    finally:
        allow_again(acl_broker, "group", cfg.ingest.group_id)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("gpuslo ingest: stopped"))
    assert "Kafka refused the consumer" in line and "GroupAuthorizationFailedError" in line, line
    assert next(iter(SASL_USERS.values())) not in r.stderr


class Stuck(Faulty):
    """The real consumer that, after ``reads`` polls that returned records, returns nothing for
    good while staying in the group: what kafka-python 3.0.12 did after a few broker restarts
    in a row (positions frozen, every fetch empty, no error)."""

    def __init__(self, real: Any, reads: int) -> None:
        super().__init__(real, {})
        self.reads = reads

    def poll(self, *args: Any, **kw: Any) -> Any:
        if self.reads <= 0:  # kafka-python's own thread keeps the membership (heartbeats)
            timeout = kw.get("timeout_ms", 0)
            threading.Event().wait(timeout / 1000)
            return {}
        got = self._real.poll(*args, **kw)
        self.reads -= bool(got)
        return got


def test_a_consumer_stuck_behind_is_made_anew_and_never_idles_out(kafka: KafkaBroker, tmp_path: Path) -> None:
    """A consumer that reads nothing more while its partitions hold records (Kafka answering)
    is not idle: ``idle_exit_s`` shorter than ``stall_s`` does not end the run; after ``stall_s``
    it is closed and a new one joins the group, which reads the rest: exact counts, everything
    committed, the store holding all below every commit."""
    from gpuslo.ingest.store import ChdbStore

    seed = 53
    cfg, _ = service_config(tmp_path, "stuck", kafka.bootstrap, batch_messages=20, stall_s=4)
    sent = produce(kafka.bootstrap, cfg, workload(cfg, seed))
    st = ChdbStore(tmp_path / "store")
    st.migrate(SCHEMA)
    watch = CommitWatch(sent, st)  # type: ignore[arg-type]
    made: list[Any] = []

    def factory(**kw: Any) -> Any:
        real = _default_factory(**kw)
        made.append(Stuck(real, reads=3) if not made else real)
        return made[-1]

    try:
        ing = KafkaIngest(cfg.kafka, cfg.ingest, st, consumer_factory=factory, after_write=watch)
        watch.ing = ing
        ing.run(idle_exit_s=2)
        assert len(made) == 2, "the stuck consumer was not made anew"
        assert ing.registry.get_sample_value("gpuslo_ingest_consumer_renewals_total") == 1
        assert watch.checks > 3
        assert_all_stored(st, sent, seed)
    finally:
        st.close()
    assert_all_committed(kafka, cfg, sent)


def test_a_topic_denied_from_the_start_stops_the_ingest_rather_than_being_skipped(
    acl_broker: KafkaBroker, tmp_path: Path
) -> None:
    """kafka-python 3.0.12 only logs a subscribed topic the user may not read: it is never
    assigned, and the ingest read the other topics and idled out, the denied one unread. It
    stops with :class:`KafkaRefused` naming the topic."""
    from gpuslo.ingest.store import ChdbStore

    cfg, _ = sasl_config(acl_broker, tmp_path, "acl-start")
    produce(acl_broker.bootstrap, cfg, workload(cfg, 59))
    topic = cfg.kafka.topics.gpu_samples
    deny(acl_broker, "topic", topic)
    st = ChdbStore(tmp_path / "store")
    st.migrate(SCHEMA)
    try:
        ing = KafkaIngest(cfg.kafka, cfg.ingest, st)
        with pytest.raises(KafkaRefused) as err:
            ing.run(idle_exit_s=20)
        assert "TopicAuthorizationFailedError" in str(err.value) and topic in str(err.value), str(err.value)
        assert st.query("SELECT count() AS n FROM gpu_samples")[0]["n"] == 0
    finally:
        allow_again(acl_broker, "topic", topic)
        st.close()


def test_the_agent_delivers_again_once_its_write_right_is_given_back(
    acl_broker: KafkaBroker, tmp_path: Path
) -> None:
    """The agent's WRITE on its topic taken away mid-run, then given back: what it spooled
    meanwhile is delivered by the same running sink, nothing lost. (kafka-python's idempotent
    producer turned fatal on the refusal and failed every later batch with it: the agent never
    delivered again until restarted, its spool growing to its bounds.)"""
    import collections

    from kafka import KafkaConsumer

    from gpuslo.agent.kafka_sink import KafkaSink
    from tests import helpers as h

    cfg, _ = sasl_config(acl_broker, tmp_path, "acl-write")
    topic = cfg.kafka.topics.heartbeat
    sink = KafkaSink(cfg.kafka, cfg.spool, ProducerSettings(flush_timeout_s=3.0))

    def beats(first: int) -> list[Any]:
        return [
            h.heartbeat("n1", h.T0 + i, True).model_copy(update={"seq": i}) for i in range(first, first + 10)
        ]

    try:
        sink.send(beats(0))
        assert sink.flush(30)
        deny(acl_broker, "topic", topic, "WRITE")
        try:
            sink.send(beats(10))
            deadline = time.monotonic() + 30
            while "TopicAuthorization" not in sink.last_error:
                assert time.monotonic() < deadline, f"the refusal not seen: {sink.last_error!r}"
                sink.flush(1)
            assert sink.pending == 10
        finally:
            allow_again(acl_broker, "topic", topic, "WRITE")
        sink.send(beats(20))
        assert sink.flush(60), (sink.pending, sink.last_error)
    finally:
        sink.close(5)
    c = KafkaConsumer(topic, bootstrap_servers=acl_broker.bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=5000, enable_auto_commit=False, group_id=None)  # fmt: skip
    try:
        seqs = collections.Counter(orjson.loads(r.value)["seq"] for r in c)
    finally:
        c.close()
    assert set(seqs) == set(range(30))


def test_the_agent_refused_write_says_so_and_never_calls_the_topic_missing(
    acl_broker: KafkaBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The SASL user's WRITE on its GPU topic denied: the agent's sink keeps the records and says
    the broker refused this client, naming the right it needs (it said "Kafka unavailable", as for
    a broker down), and never calls the topic missing (the broker answers for it)."""
    from kafka.admin import KafkaAdminClient

    from gpuslo.agent.kafka_sink import KafkaSink
    from tests.helpers import heartbeat

    cfg, _ = sasl_config(acl_broker, tmp_path, "nowrite")
    topic = cfg.kafka.topics.heartbeat
    admin = KafkaAdminClient(bootstrap_servers=acl_broker.bootstrap)
    try:
        admin.create_topics({topic: {"num_partitions": 1, "replication_factor": 1}})
    finally:
        admin.close()
    deny(acl_broker, "topic", topic, "WRITE")
    caplog.set_level(logging.WARNING)
    sink = KafkaSink(cfg.kafka, cfg.spool, cfg.producer)
    try:
        sink.send([heartbeat("n1", 1.7e9, True)])
        assert not sink.flush(8.0)
        assert sink.pending == 1 and sink.missing_topics() == []
    finally:
        sink.close(timeout_s=0)
    said = [r.getMessage() for r in caplog.records if r.name == "gpuslo.agent.kafka_sink"]
    assert any("Kafka refused this client" in m and "WRITE" in m for m in said), said
    assert not any("Kafka unavailable" in m for m in said), said

"""The consumer's commit decision under the faults of its store, on real servers: Kafka 4.x
and Debian's clickhouse-server (18.16) holding the ingest's tables as 18.16 can
(``legacy_ingest_ddl``: derived from the real schema). The errors that reach the consumer
are what the real server and driver return, classified by the real store.

Invariant checked at every commit and at the end: every message below a committed offset
has its rows (or its dead letter) in the store; at the end, exact counts."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.core.settings import ClickHouseSettings, IngestSettings
from gpuslo.ingest.clickhouse_store import ClickHouseStore
from gpuslo.ingest.failures import Failure
from gpuslo.ingest.kafka_consumer import KafkaIngest
from gpuslo.ingest.store import StoreError
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSampleBatch, Message, encode
from tests.servers.clickhouse import PASSWORD, ClickHouseServer, Server, ingest_ddl, make_server
from tests.servers.kafka import KafkaBroker
from tests.test_kafka import TABLE_OF, _committed, service_config

pytestmark = pytest.mark.integration

Key = tuple[str, str, int]


@pytest.fixture(params=[pytest.param(False, id="ch-18.16"), pytest.param(True, id="ch-image")])
def chserver(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    """The store's server: Debian's 18.16 (the ingest's tables as it holds them), and the compose
    file's image (24.8+, the schema's own tables) where a Docker engine answers."""
    if request.param:
        request.getfixturevalue("container_backend")  # skipped with the reason where no engine answers
    s = make_server(tmp_path / "ch", request.param)
    s.start()
    try:
        yield s
    finally:
        s.close()


def ch_store(server: Server, db: str, narrow: dict[str, str] | None = None) -> ClickHouseStore:
    st = ClickHouseStore(
        ClickHouseSettings(
            host="127.0.0.1", port=server.port, database=db, password=PASSWORD, connect_timeout_s=2
        )
    )
    st.create_database()
    for ddl in ingest_ddl(server, narrow):
        st.execute(ddl)
    return st


def fleet_messages(seed: int, hours: float = 0.1) -> list[Message]:
    fleet = Fleet(SimConfig(nodes=2, gpus_per_node=2, hours=hours, seed=seed))
    sources = sim_sources(fleet)
    n = round(fleet.cfg.hours * 3600 / fleet.cfg.interval_s)
    out: list[Message] = []
    for k in range(n):
        t = fleet.cfg.start_ts + k * fleet.cfg.interval_s
        fleet.advance_to(t)
        out += [m for s in sources for m in s.collect(t)]
    return out


def produce(
    bootstrap: str, cfg: Any, msgs: list[tuple[str, bytes, Key | None]]
) -> dict[tuple[str, int, int], Any]:
    """Send (topic, value, key) in order; (topic, partition, offset) -> key (None: a poison message)."""
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    futs = [(p.send(topic, key=b"k%d" % (i % 3), value=v), k) for i, (topic, v, k) in enumerate(msgs)]
    p.flush()
    out = {}
    for f, k in futs:
        md = f.get(timeout=30)
        out[(md.topic, md.partition, md.offset)] = k
    p.close()
    return out


def stored_keys(st: ClickHouseStore) -> set[Any]:
    """Message keys in the store (a table the test renamed aside still holds its rows)."""
    names = {r["name"] for r in st.query("SELECT name FROM system.tables WHERE database = currentDatabase()")}

    def table(t: str) -> str | None:  # None: not created yet (an ingest killed before it migrated)
        return t if t in names else f"{t}_aside" if f"{t}_aside" in names else None

    keys: set[Any] = set()
    for t in sorted(set(TABLE_OF.values())):
        if (name := table(t)) is not None:
            q = f"SELECT DISTINCT source, boot_id, seq FROM {name}"
            keys |= {(r["source"], r["boot_id"], r["seq"]) for r in st.query(q)}
    if (dead := table("dead_letters")) is not None:
        keys |= {("dead", r["origin"]) for r in st.query(f"SELECT DISTINCT origin FROM {dead}")}
    return keys


def origin_key(where: tuple[str, int, int], key: Key | None) -> Any:
    return key if key is not None else ("dead", f"{where[0]}/{where[1]}/{where[2]}")


class CommitWatch:
    """After each write, before its commit (the consumer's ``after_write`` hook, on the
    consumer's thread): everything below the committed offsets must be in the store."""

    def __init__(self, sent: dict[tuple[str, int, int], Any], st: ClickHouseStore) -> None:
        self.sent = sent
        self.st = st
        self.ing: KafkaIngest | None = None
        self.checks = 0
        self.batches = 0

    def committed(self, group: tuple[str, str, list[str]] | None = None) -> dict[tuple[str, int], int]:
        """From the running consumer, or (``group``: bootstrap, group id, topics) from outside."""
        from kafka.structs import TopicPartition

        tps = {(t, p) for t, p, _ in self.sent}
        if group is not None:
            outside = _committed(*group)
            return {(t, p): outside.get(f"{t}/{p}") or 0 for t, p in tps}
        assert self.ing is not None
        out = {}
        for t, p in tps:
            c = self.ing.consumer.committed(TopicPartition(t, p))
            out[(t, p)] = c if c is not None else 0
        return out

    def check(self, group: tuple[str, str, list[str]] | None = None) -> None:
        committed = self.committed(group)
        want = {origin_key(w, k) for w, k in self.sent.items() if w[2] < committed[(w[0], w[1])]}
        try:
            have = stored_keys(self.st)
        except StoreError as exc:  # the server is being restarted by the test right now
            assert exc.failure is Failure.TRANSIENT, str(exc)
            return
        missing = want - have
        assert not missing, f"committed but not in the store: {sorted(missing, key=str)[:5]} ({len(missing)})"
        self.checks += 1

    def __call__(self, n: int) -> None:
        self.batches = n
        self.check()


def workload(cfg: Any, seed: int, poison: int = 0, hours: float = 0.1) -> list[tuple[str, bytes, Key | None]]:
    msgs = fleet_messages(seed, hours)
    out: list[tuple[str, bytes, Key | None]] = [
        (cfg.kafka.topics.for_kind(m.kind), encode(m), (m.source, m.boot_id, m.seq)) for m in msgs
    ]
    rnd = random.Random(seed)
    for i in range(poison):
        out.insert(rnd.randrange(len(out)), (cfg.kafka.topics.gpu_samples, b"\x00garbage %d" % i, None))
    return out


def assert_all_committed(kafka: KafkaBroker, cfg: Any, sent: dict[tuple[str, int, int], Any]) -> None:
    ends: dict[str, int] = {}
    for t, p, o in sent:
        ends[f"{t}/{p}"] = max(ends.get(f"{t}/{p}", 0), o + 1)
    got = {
        k: v
        for k, v in _committed(kafka.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all()).items()
        if k in ends
    }
    assert got == ends, "everything written must be committed at the end"


def expected_rows(msgs: list[Message]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in msgs:
        t = TABLE_OF[m.kind]
        out[t] = out.get(t, 0) + (len(m.gpus) if isinstance(m, GpuSampleBatch) else 1)
    return out


def test_clickhouse_restarted_and_killed_under_load(
    kafka: KafkaBroker, chserver: Server, tmp_path: Path
) -> None:
    """Graceful restarts and SIGKILLs of the store's server at seeded points between and during
    writes: the consumer pauses on the TRANSIENT errors, commits nothing unwritten, resumes;
    exact counts after, every message once (FINAL), the poison messages dead-lettered once."""
    seed = 11
    cfg, _ = service_config(tmp_path, "chrestart", kafka.bootstrap, batch_messages=15, retry_max_s=1.0)
    load = workload(cfg, seed, poison=3, hours=0.2)
    sent = produce(kafka.bootstrap, cfg, load)
    st = ch_store(chserver, "gpuslo_faults")
    ing_store = ClickHouseStore(st.settings)
    watch = CommitWatch(sent, st)
    rnd = random.Random(seed)
    fault_at = set(rnd.sample(range(2, 16), 5))
    faults: list[threading.Thread] = []

    def fault(n: int) -> None:
        kill = rnd.random() < 0.5
        delay = rnd.uniform(0.0, 0.4)  # 0: between writes (before the next starts); else often during one
        first = not faults
        if first:  # down before the next write, and up only once a write has failed on it
            chserver.kill()
        errors_before = ing.metrics.store_errors._value.get()

        def go() -> None:
            if first:
                deadline = time.monotonic() + 60
                while ing.metrics.store_errors._value.get() == errors_before and time.monotonic() < deadline:
                    time.sleep(0.1)
            else:
                time.sleep(delay)
                chserver.kill() if kill else chserver.stop()
                time.sleep(1.0)
            chserver.start()

        t = threading.Thread(target=go)
        t.start()
        faults.append(t)

    def hook(n: int) -> None:
        for t in faults:
            t.join()  # one fault at a time
        watch(n)
        if n in fault_at:
            fault(n)

    ing = KafkaIngest(cfg.kafka, cfg.ingest, ing_store, after_write=hook)
    watch.ing = ing
    try:
        ing.run(idle_exit_s=8)
    finally:
        for t in faults:
            t.join()
        ing_store.close()
    assert ing.failed is None
    assert watch.batches > max(fault_at), "the run ended before every fault was injected"
    assert ing.metrics.store_errors._value.get() > 0, "no fault reached a write"
    good = fleet_messages(seed, 0.2)
    want = expected_rows(good)
    for table, rows in want.items():
        got = st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"]
        assert got == rows, f"{table}: {got} rows, want {rows}"
    assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}
    dead = st.query("SELECT count() AS n, uniqExact(origin) AS k FROM dead_letters FINAL")[0]
    assert (dead["n"], dead["k"]) == (3, 3)
    assert_all_committed(kafka, cfg, sent)
    st.close()


def test_refused_message_is_dead_lettered_and_the_batch_lands(
    kafka: KafkaBroker, chserver: Server, tmp_path: Path
) -> None:
    """A GPU index the wire allows (≤ 1023) in a column the real server keeps narrower (UInt8):
    the driver refuses that message (code 53, REFUSED); it becomes a dead letter with the
    server's reason, every other message lands, and the offsets are committed to the end."""
    cfg, _ = service_config(tmp_path, "chrefused", kafka.bootstrap, batch_messages=60, refused_attempts=1)
    load = workload(cfg, 12)
    i, (topic, value, _key) = next((i, x) for i, x in enumerate(load) if x[0] == cfg.kafka.topics.gpu_samples)
    obj = orjson.loads(value)
    obj["gpus"][0]["index"] = 300
    load[i] = (topic, orjson.dumps(obj), None)
    sent = produce(kafka.bootstrap, cfg, load)
    st = ch_store(chserver, "gpuslo_refused", narrow={"gpu": "UInt8"})
    watch = CommitWatch(sent, st)
    ing = KafkaIngest(cfg.kafka, cfg.ingest, ClickHouseStore(st.settings), after_write=watch)
    watch.ing = ing
    ing.run(idle_exit_s=6)
    assert ing.failed is None
    assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}
    (dead,) = st.query("SELECT origin, reason FROM dead_letters FINAL")
    assert "code 53" in dead["reason"] and "store refused it" in dead["reason"], dead
    assert watch.checks >= 2
    assert_all_committed(kafka, cfg, sent)
    st.close()


def test_fatal_store_errors_stop_the_consumer_and_commit_nothing_unwritten(
    kafka: KafkaBroker, chserver: Server, tmp_path: Path
) -> None:
    """Two fatal cases from the real server: a table gone mid-run (the schema does not
    match), and a refused message whose dead letter cannot be written (no dead_letters
    table). The consumer stops (``run`` raises FATAL), the batch is not committed, and a
    restart after the repair writes everything exactly once."""
    cfg, _ = service_config(tmp_path, "chfatal", kafka.bootstrap, batch_messages=15, refused_attempts=1)
    load = workload(cfg, 13)
    i, (topic, value, _key) = next((i, x) for i, x in enumerate(load) if x[0] == cfg.kafka.topics.gpu_samples)
    obj = orjson.loads(value)
    obj["gpus"][0]["index"] = 300
    load[i] = (topic, orjson.dumps(obj), None)
    # the second half is produced only for case 2, so that case 1 (which may stop anywhere in
    # the first half) always leaves case 2 many batches, heartbeats among them, after its first
    half = len(load) // 2
    assert i < half
    sent = produce(kafka.bootstrap, cfg, load[:half])
    st = ch_store(chserver, "gpuslo_fatal", narrow={"gpu": "UInt8"})
    st.execute("RENAME TABLE dead_letters TO dead_letters_aside")

    def run(hook: Any = None) -> KafkaIngest:
        watch = CommitWatch(sent, st)

        def after(n: int) -> None:
            watch(n)
            if hook is not None:
                hook(n)

        ing = KafkaIngest(cfg.kafka, cfg.ingest, ClickHouseStore(st.settings), after_write=after)
        watch.ing = ing
        try:
            ing.run(idle_exit_s=6)
        except StoreError as exc:
            assert exc.failure is Failure.FATAL, str(exc)
        # after the stop: still nothing committed that is not in the store
        watch.check((kafka.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all()))
        return ing

    # 1: the refused message's dead letter cannot be written -> fatal, that batch not committed
    ing = run()
    assert ing.failed is not None and ing.failed.fatal and "cannot dead-letter" in str(ing.failed)
    st.execute("RENAME TABLE dead_letters_aside TO dead_letters")

    # 2: a table renamed away after the first batch -> the next write to it is fatal
    def rename_away(n: int) -> None:
        if n == 1:
            st.execute("RENAME TABLE node_heartbeats TO node_heartbeats_aside")

    sent.update(produce(kafka.bootstrap, cfg, load[half:]))
    ing = run(rename_away)
    # found by the store's column lookup, or by the server (code 60) when the types were cached
    assert ing.failed is not None and ing.failed.fatal and "node_heartbeats" in str(ing.failed), ing.failed
    st.execute("RENAME TABLE node_heartbeats_aside TO node_heartbeats")

    # 3: repaired: everything lands, once
    ing = run()
    assert ing.failed is None
    assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}
    good = [m for m in fleet_messages(13) if (m.source, m.boot_id, m.seq) in set(sent.values())]
    for table, rows in expected_rows(good).items():
        assert st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"] == rows, table
    assert st.query("SELECT count() AS n FROM dead_letters FINAL")[0]["n"] == 1
    assert_all_committed(kafka, cfg, sent)
    st.close()


def test_ingest_sigkilled_at_random_points_then_restarted(kafka: KafkaBroker, tmp_path: Path) -> None:
    """``gpuslo ingest --kafka`` SIGKILLed at seeded points (at random times: starting,
    reading, decoding, writing; and between a write and its commit, ``--kill-after-write``),
    restarted each time. After every kill: nothing committed that is not in the store. At
    the end: exact counts, every message once (FINAL), the poison messages dead-lettered once."""
    from gpuslo.ingest.store import ChdbStore
    from tests.test_kafka import GPUSLO

    seed = 21
    cfg, path = service_config(tmp_path, "randkill", kafka.bootstrap, batch_messages=30)
    load = workload(cfg, seed, poison=2, hours=0.3)
    rounds = 6
    sent: dict[tuple[str, int, int], Any] = {}
    store = tmp_path / "store"
    rnd = random.Random(seed)
    group = (kafka.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all())
    cmd = [
        *GPUSLO,
        "ingest",
        "--kafka",
        "-",
        "--config",
        str(path),
        "--store",
        str(store),
        "--idle-exit-s",
        "6",
    ]
    killed = {"timer": 0, "after_write": 0}
    for k in range(rounds):  # the agents keep sending while the ingest crashes: a slice per round
        sent |= produce(kafka.bootstrap, cfg, load[k * len(load) // rounds : (k + 1) * len(load) // rounds])
        extra = ["--kill-after-write", str(rnd.randint(1, 2))] if k % 2 else []
        _run_or_kill([*cmd, *extra], tmp_path / f"ingest{k}.log", 120 if extra else rnd.uniform(1.5, 8.0),
                     killed, "after_write" if extra else "timer")  # fmt: skip
        st = ChdbStore(store)
        try:
            watch = CommitWatch(sent, st)  # type: ignore[arg-type]
            watch.check(group)
        finally:
            st.close()
    assert killed["timer"] >= 2 and killed["after_write"] == rounds // 2, killed
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    st = ChdbStore(store)
    try:
        assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}  # type: ignore[arg-type]
        for table, rows in expected_rows(fleet_messages(seed, 0.3)).items():
            assert st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"] == rows, table
        assert st.query("SELECT count() AS n FROM dead_letters FINAL")[0]["n"] == 2
    finally:
        st.close()
    assert_all_committed(kafka, cfg, sent)


def _run_or_kill(cmd: list[str], log_path: Path, timeout_s: float, killed: dict[str, int], why: str,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
    """Run an ingest: SIGKILLed at ``timeout_s`` (counted in ``killed[why]``, as is its own
    SIGKILL), else it must exit 0 (its stderr in ``log_path`` says why not)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            rc = proc.wait(30)
    if rc == -signal.SIGKILL:
        killed[why] += 1
    else:
        assert rc == 0, log_path.read_text()[-3000:]


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_wrong_sasl_password_is_a_clear_error(kafka: KafkaBroker, tmp_path: Path, mechanism: str) -> None:
    """The real broker refuses the password: ``gpuslo ingest`` exits non-zero saying the
    authentication failed, with the mechanism and the user, never the password (kafka-python
    itself says only "Unable to bootstrap")."""
    import yaml

    from tests.servers.kafka import SASL_USERS, SCRAM_USERS
    from tests.test_kafka import GPUSLO

    ((user, password),) = (SASL_USERS if mechanism == "PLAIN" else SCRAM_USERS).items()
    wrong = "wrong-" + password
    cfg = {
        "kafka": {"bootstrap_servers": [kafka.sasl_bootstrap], "security_protocol": "SASL_PLAINTEXT",
                  "sasl_mechanism": mechanism, "sasl_username": user, "sasl_password": wrong},
        "ingest": {"metrics_port": 0},
    }  # fmt: skip
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [*GPUSLO, "ingest", "--kafka", "-", "--config", str(path), "--store", str(tmp_path / "s")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuslo ingest: Kafka authentication failed"), r.stderr[-3000:]
    assert mechanism in last and repr(user) in last
    assert wrong not in r.stderr and password not in r.stderr


def test_broker_stopped_and_restarted_under_the_consumer(kafka_libs: Path, tmp_path: Path) -> None:
    """The consumer's side of a broker outage (the agent's side, spooling, is in
    test_kafka.py): the broker is stopped after a few batches and restarted on the same
    ports; the ingest keeps running, rejoins, and ends with exact counts; nothing committed
    that is not in the store at any commit."""
    from gpuslo.ingest.store import ChdbStore

    broker = KafkaBroker(tmp_path / "kafka", libs=kafka_libs)
    broker.start()
    try:
        seed = 31
        cfg, _ = service_config(tmp_path, "brokerdown", broker.bootstrap, batch_messages=20)
        sent = produce(broker.bootstrap, cfg, workload(cfg, seed, poison=1, hours=0.2))
        st = ChdbStore(tmp_path / "store")
        st.migrate(SCHEMA)
        watch = CommitWatch(sent, st)  # type: ignore[arg-type]
        outage: list[threading.Thread] = []

        def hook(n: int) -> None:
            if outage and outage[0].is_alive():
                watch.batches = n
                # the broker is down: the committed offsets cannot be read now. Writing slower
                # than it comes back: the consumer holds its commits (commit_interval_s) and
                # would otherwise write every fetched batch before it returns
                time.sleep(0.3)
                return
            watch(n)
            if n == 3:

                def bounce() -> None:
                    broker.stop()
                    time.sleep(2.0)
                    broker.start()

                outage.append(threading.Thread(target=bounce))
                outage[0].start()

        ing = KafkaIngest(cfg.kafka, cfg.ingest, st, after_write=hook)
        watch.ing = ing
        try:
            ing.run(idle_exit_s=30)
        finally:
            for t in outage:
                t.join()
        assert outage and watch.batches > 3, "the outage did not happen mid-run"
        assert watch.checks > 3, "no commit was checked after the broker came back"
        assert ing.failed is None
        assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}  # type: ignore[arg-type]
        for table, rows in expected_rows(fleet_messages(seed, 0.2)).items():
            assert st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"] == rows, table
        st.close()
        assert_all_committed(broker, cfg, sent)
    finally:
        broker.stop()


def test_full_disk_under_the_server_is_transient_and_dead_letters_nothing(tmp_path: Path) -> None:
    """The server's data directory on a real tmpfs that fills up: the real 18.16 server
    answers code 75 (CANNOT_WRITE_TO_FILE_DESCRIPTOR, errno 28). That is the server's disk,
    not the data: the batch is TRANSIENT (retry, commit nothing), never isolated into dead
    letters (a small dead letter can fit where the batch did not: good rows would leave the
    numbers) and never FATAL (exit 2 on a disk that frees up). Once space is back, every
    message lands and nothing is dead-lettered."""
    from gpuslo.ingest.pipeline import Ingestor
    from gpuslo.ingest.writer import Raw
    from tests.fs import tmpfs

    server = ClickHouseServer(tmp_path / "ch")
    with tmpfs(tmp_path / "ch" / "data", "16m") as data:
        server.start()
        try:
            st = ch_store(server, "gpuslo_full")
            msgs = fleet_messages(5)
            items = [Raw(f"full:{i}", encode(m)) for i, m in enumerate(msgs)]
            filler = data / "filler"
            with filler.open("wb") as f, pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            ing = Ingestor(st)
            with pytest.raises(StoreError) as batch:
                ing.ingest(items)
            assert batch.value.failure is Failure.TRANSIENT, batch.value
            with pytest.raises(StoreError) as isolated:
                ing.ingest_isolating(items)
            assert isolated.value.failure is Failure.TRANSIENT, isolated.value
            filler.unlink()
            rep = ing.ingest(items)
            assert rep.dead_lettered == 0
            assert stored_keys(st) == {(m.source, m.boot_id, m.seq) for m in msgs}
            st.close()
        finally:
            server.stop()


@contextlib.contextmanager
def _hung_server_run(
    kafka: KafkaBroker, tmp_path: Path, name: str, seed: int, retry_max_s: float = 1.0, **settings: Any
) -> Iterator[tuple[Any, dict[tuple[str, int, int], Any], ClickHouseServer, ClickHouseStore, CommitWatch]]:
    """A workload in Kafka, the store's server (18.16, SIGSTOP-able) with the ingest's tables, the
    consumer's store (``settings``: ``ingest.*`` where IngestSettings has them, else
    ``clickhouse.*``) and a CommitWatch on its own store; all closed after, the server too
    (resumed first), whatever the test ran into."""
    ingest = {k: settings.pop(k) for k in list(settings) if k in IngestSettings.model_fields}
    cfg, _ = service_config(
        tmp_path, name, kafka.bootstrap, batch_messages=15, retry_max_s=retry_max_s, **ingest
    )
    sent = produce(kafka.bootstrap, cfg, workload(cfg, seed, hours=0.1))
    server = ClickHouseServer(tmp_path / "ch")
    try:
        server.start()
        st = ch_store(server, f"gpuslo_{name}")
        ing_store = ClickHouseStore(st.settings.model_copy(update=settings))
        try:
            yield cfg, sent, server, ing_store, CommitWatch(sent, st)
        finally:
            ing_store.close()
            st.close()
    finally:
        server.close()


def _assert_all_landed_once(st: ClickHouseStore, seed: int, sent: dict[tuple[str, int, int], Any]) -> None:
    assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}
    for table, rows in expected_rows(fleet_messages(seed)).items():
        assert st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"] == rows, table


def test_a_server_that_stops_answering_mid_write_is_transient_and_the_batch_lands(
    kafka: KafkaBroker, tmp_path: Path
) -> None:
    """The store's server hangs (SIGSTOP: a server wedged, or its host gone silent, no FIN, no
    RST) while the consumer writes: each wait on it ends after ``send_receive_timeout_s`` as a
    TRANSIENT failure (clickhouse-driver's own bound, 300 s, held the writer as long as Kafka's
    max.poll.interval), the consumer pauses and retries, commits nothing meanwhile, and once the
    server answers again every message lands once."""
    seed = 41
    with _hung_server_run(kafka, tmp_path, "chhang", seed, send_receive_timeout_s=2) as run:
        _hung_mid_write(kafka, seed, *run)


def _hung_mid_write(
    kafka: KafkaBroker,
    seed: int,
    cfg: Any,
    sent: dict[tuple[str, int, int], Any],
    server: ClickHouseServer,
    ing_store: ClickHouseStore,
    watch: CommitWatch,
) -> None:
    hung: list[threading.Thread] = []

    def hook(n: int) -> None:
        for t in hung:
            t.join()
        watch(n)
        if n == 2:

            def hang() -> None:
                server.pause()
                deadline = time.monotonic() + 60  # hung until two waits on it have ended
                while ing.metrics.store_errors._value.get() < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                hung_for.append(time.monotonic() - t0)
                server.resume()

            t0 = time.monotonic()
            hung.append(threading.Thread(target=hang))
            hung[0].start()

    hung_for: list[float] = []
    ing = KafkaIngest(cfg.kafka, cfg.ingest, ing_store, after_write=hook)
    watch.ing = ing
    try:
        ing.run(idle_exit_s=6)
    finally:
        server.resume()
        for t in hung:
            t.join()
    assert ing.failed is None
    assert hung_for and hung_for[0] < 30, f"the waits on the hung server did not end: {hung_for}"
    assert ing.metrics.store_errors._value.get() >= 2
    assert watch.batches > 3
    _assert_all_landed_once(watch.st, seed, sent)
    assert_all_committed(kafka, cfg, sent)


@pytest.mark.parametrize("how", ["hung", "down"])
def test_sigterm_while_the_server_hangs_or_is_down_stops_within_the_grace_period(
    kafka: KafkaBroker, tmp_path: Path, how: str
) -> None:
    """SIGTERM (``stop_event``) while the consumer's write waits on the store: ``hung``, a server
    that does not answer (SIGSTOP) under the default timeouts: the write in flight is given
    ``STOP_WRITE_GRACE_S`` (10 s), then the store is interrupted (it waited for the driver's 300 s);
    ``down``, a server killed, the writer between two tries (a backoff of a minute here): the
    backoff ends at once (it slept it out). Either way the ingest stops well inside Kubernetes'
    30 s grace period, committing nothing unwritten, and the next start writes everything once."""
    seed = 42
    retry = {"retry_initial_s": 60.0, "retry_max_s": 60.0} if how == "down" else {}
    with _hung_server_run(kafka, tmp_path, f"chsigterm{how}", seed, **retry) as run:
        _sigterm_on_a_stuck_write(kafka, seed, how, *run)


def _sigterm_on_a_stuck_write(
    kafka: KafkaBroker,
    seed: int,
    how: str,
    cfg: Any,
    sent: dict[tuple[str, int, int], Any],
    server: ClickHouseServer,
    ing_store: ClickHouseStore,
    watch: CommitWatch,
) -> None:
    stopped_at: list[float] = []

    def hook(n: int) -> None:
        watch(n)
        if n == 2:
            server.pause() if how == "hung" else server.kill()  # the next write waits on it
            errors = ing.metrics.store_errors._value.get()

            def sigterm() -> None:
                time.sleep(1.0)
                while how == "down" and ing.metrics.store_errors._value.get() == errors:
                    time.sleep(0.1)  # the writer failed once: it is in its backoff
                stopped_at.append(time.monotonic())
                ing.stop_event.set()

            threading.Thread(target=sigterm, daemon=True).start()

    ing = KafkaIngest(cfg.kafka, cfg.ingest, ing_store, after_write=hook)
    watch.ing = ing
    runner = threading.Thread(target=ing.run, kwargs={"idle_exit_s": 30})
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while not stopped_at and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stopped_at, "the run ended before the server hung"
        runner.join(max(0.0, stopped_at[0] + 25 - time.monotonic()))  # Kubernetes' grace is 30 s
        took = time.monotonic() - stopped_at[0]
        assert not runner.is_alive(), f"still stopping {took:.0f} s after SIGTERM"
    finally:
        if how == "hung":
            server.resume()
        elif server.proc is None:  # killed by the hook (a second start would take its place)
            server.start()
        runner.join(400)
    assert ing.failed is None
    watch.check((kafka.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all()))
    again = ClickHouseStore(watch.st.settings)
    try:
        KafkaIngest(cfg.kafka, cfg.ingest, again).run(idle_exit_s=6)
    finally:
        again.close()
    _assert_all_landed_once(watch.st, seed, sent)
    assert_all_committed(kafka, cfg, sent)


# ``gpuslo ingest --kafka`` cannot run on 18.16 (its schema is too new for it): the same consumer
# and server store, in a process of their own, on the ingest's tables as 18.16 holds them
_SERVER_INGEST = """
import os, signal, sys
import yaml
from gpuslo.core.settings import ClickHouseSettings, ServiceConfig
from gpuslo.ingest.clickhouse_store import ClickHouseStore
from gpuslo.ingest.kafka_consumer import KafkaIngest
cfg = ServiceConfig.model_validate(yaml.safe_load(open(sys.argv[1])))
st = ClickHouseStore(ClickHouseSettings.model_validate_json(sys.argv[2]))
kill_after = int(sys.argv[3])
def after(n):
    if kill_after and n >= kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
KafkaIngest(cfg.kafka, cfg.ingest, st, after_write=after).run(idle_exit_s=5)
"""


def test_ingest_on_the_server_store_sigkilled_at_random_points_then_restarted(
    kafka: KafkaBroker, tmp_path: Path
) -> None:
    """The consumer writing to the real 18.16 server, SIGKILLed at seeded points (at random times:
    reading, decoding, writing; and between a write and its commit) and restarted on the same
    group while the agents keep producing. After every kill nothing is committed that the server
    lacks; at the end every message is there once (FINAL) and the poison ones are dead-lettered
    once (a batch re-read after a kill is written again: the tables' keys collapse it)."""
    seed = 61
    cfg, path = service_config(tmp_path, "chkill", kafka.bootstrap, batch_messages=30)
    load = workload(cfg, seed, poison=2, hours=0.3)
    server = ClickHouseServer(tmp_path / "ch")
    server.start()
    try:
        st = ch_store(server, "gpuslo_chkill")
        group = (kafka.bootstrap, cfg.ingest.group_id, cfg.kafka.topics.all())
        settings = st.settings.model_copy(
            update={"password": None, "password_env": "GPUSLO_TEST_CH_PASSWORD"}
        )
        settings = settings.model_dump_json()
        rnd = random.Random(seed)
        sent: dict[tuple[str, int, int], Any] = {}
        rounds, killed = 6, {"timer": 0, "after_write": 0}
        for k in range(rounds):
            sent |= produce(
                kafka.bootstrap, cfg, load[k * len(load) // rounds : (k + 1) * len(load) // rounds]
            )
            after = rnd.randint(1, 2) if k % 2 else 0
            cmd = [sys.executable, "-c", _SERVER_INGEST, str(path), settings, str(after)]
            _run_or_kill(cmd, tmp_path / f"ingest{k}.log", 120 if after else rnd.uniform(1.5, 8.0),
                         killed, "after_write" if after else "timer", env=_env())  # fmt: skip
            CommitWatch(sent, st).check(group)
        assert killed["timer"] >= 2 and killed["after_write"] == rounds // 2, killed
        r = subprocess.run(
            [*cmd[:-1], "0"], capture_output=True, text=True, timeout=300, check=False, env=_env()
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert stored_keys(st) == {origin_key(w, k) for w, k in sent.items()}
        for table, rows in expected_rows(fleet_messages(seed, 0.3)).items():
            assert st.query(f"SELECT count() AS n FROM {table} FINAL")[0]["n"] == rows, table
        dead = st.query("SELECT count() AS n, uniqExact(origin) AS k FROM dead_letters FINAL")[0]
        assert (dead["n"], dead["k"]) == (2, 2)
        assert_all_committed(kafka, cfg, sent)
        st.close()
    finally:
        server.close()


def _env() -> dict[str, str]:
    """This checkout first on the path of a child Python (the package as the tests import it), and
    the server's password where the store's settings say (not on a command line)."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "GPUSLO_TEST_CH_PASSWORD": PASSWORD}

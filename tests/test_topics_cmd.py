"""``gpuslo topics`` against a real Apache Kafka broker that makes no topic on first use
(``auto.create.topics.enable=false``, as many production brokers run), with Kafka's own
authorizer: the PLAINTEXT listener is the super user (the tests' admin, which checks what the
command did), the SASL users lose rights by DENY ACLs. One broker for the module; each test
names its topics apart. The command runs as a process, as an init container runs it: its exit
code, its lines, and never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslo.core.settings import Topics
from tests.servers.kafka import SASL_USERS, SCRAM_USERS, KafkaBroker
from tests.servers.ports import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
BROKER_PARTITIONS = 5  # the broker's num.partitions: what --create makes without --partitions
KINDS = list(Topics.model_fields)


@pytest.fixture(scope="module")
def broker(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    b = KafkaBroker(
        tmp_path_factory.mktemp("kafka-topics"),
        libs=kafka_libs,
        partitions=BROKER_PARTITIONS,
        authorizer=True,
        auto_create_topics=False,
    )
    b.start()
    try:
        yield b
    finally:
        b.stop()


def topics_of(prefix: str, **shared: str) -> dict[str, str]:
    return {k: shared.get(k, f"{prefix}.{k}") for k in KINDS}


def write_config(tmp: Path, name: str, kafka: dict[str, Any]) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"kafka": kafka}))
    return path


def plain_config(tmp: Path, broker: KafkaBroker, prefix: str, **shared: str) -> Path:
    return write_config(
        tmp, prefix, {"bootstrap_servers": [broker.bootstrap], "topics": topics_of(prefix, **shared)}
    )


def sasl_config(tmp: Path, broker: KafkaBroker, prefix: str, scram: bool = False, password: str = "") -> Path:
    ((user, secret),) = (SCRAM_USERS if scram else SASL_USERS).items()
    return write_config(
        tmp,
        prefix,
        {
            "bootstrap_servers": [broker.sasl_bootstrap],
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-256" if scram else "PLAIN",
            "sasl_username": user,
            "sasl_password": password or secret,
            "topics": topics_of(prefix),
        },
    )


def topics_cmd(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "gpuslo", "topics", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        check=False,
    )
    assert "Traceback" not in out.stderr, out.stderr
    return out


def described(broker: KafkaBroker, names: list[str]) -> dict[str, tuple[int, int] | None]:
    """name -> (partitions, replication factor), None where the broker knows no such topic: asked
    as the super user, apart from the command."""
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        out: dict[str, tuple[int, int] | None] = {}
        for t in admin.describe_topics(names):
            parts = t["partitions"]
            out[t["name"]] = (len(parts), len(parts[0]["replica_nodes"])) if t["error_code"] == 0 else None
        return out
    finally:
        admin.close()


def make_topic(broker: KafkaBroker, name: str, partitions: int) -> None:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        admin.create_topics({name: {"num_partitions": partitions, "replication_factor": 1}})
    finally:
        admin.close()


def lines_of(out: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """topic -> its line on stdout."""
    return {ln.split(":", 1)[0]: ln for ln in out.stdout.splitlines()}


def test_a_check_names_each_missing_topic_and_exits_1(broker: KafkaBroker, tmp_path: Path) -> None:
    cfg = plain_config(tmp_path, broker, "chk")
    names = list(topics_of("chk").values())
    out = topics_cmd("--config", str(cfg))
    assert out.returncode == 1, out
    lines = lines_of(out)
    assert sorted(lines) == sorted(names)
    for kind, name in topics_of("chk").items():
        assert lines[name] == f"{name}: missing (kinds: {kind})"
    assert "5 of 5 topics missing" in out.stderr and "--create" in out.stderr
    assert described(broker, names) == dict.fromkeys(names)  # asking made none


def test_create_makes_a_shared_topic_once_with_the_partitions_asked_and_a_rerun_makes_nothing(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    cfg = plain_config(tmp_path, broker, "mk", sched_event="mk.heartbeat")  # two kinds, one topic
    names = ["mk.gpu_samples", "mk.heartbeat", "mk.latency", "mk.health"]
    out = topics_cmd("--config", str(cfg), "--create", "--partitions", "2")
    assert out.returncode == 0, out
    assert out.stdout.splitlines() == [
        "mk.gpu_samples: created, 2 partitions, replication factor 1 (kinds: gpu_samples)",
        "mk.heartbeat: created, 2 partitions, replication factor 1 (kinds: heartbeat, sched_event)",
        "mk.latency: created, 2 partitions, replication factor 1 (kinds: latency)",
        "mk.health: created, 2 partitions, replication factor 1 (kinds: health)",
    ]
    assert described(broker, names) == dict.fromkeys(names, (2, 1))
    for args in (("--create",), ()):  # again: nothing made, nothing altered, all there
        again = topics_cmd("--config", str(cfg), *args)
        assert again.returncode == 0, again
        assert "created" not in again.stdout
        assert lines_of(again)["mk.heartbeat"] == (
            "mk.heartbeat: exists, 2 partitions, replication factor 1 (kinds: heartbeat, sched_event)"
        )
        assert described(broker, names) == dict.fromkeys(names, (2, 1))


def test_create_without_partitions_takes_the_brokers_defaults(broker: KafkaBroker, tmp_path: Path) -> None:
    """-1 in CreateTopics (v4+, Kafka 2.4+): the broker's num.partitions and replication factor."""
    cfg = plain_config(tmp_path, broker, "dflt")
    names = list(topics_of("dflt").values())
    out = topics_cmd("--kafka", broker.bootstrap, "--config", str(cfg), "--create")
    assert out.returncode == 0, out
    assert described(broker, names) == dict.fromkeys(names, (BROKER_PARTITIONS, 1))
    assert all(
        f"created, {BROKER_PARTITIONS} partitions, replication factor 1" in ln
        for ln in out.stdout.splitlines()
    )


def test_an_existing_topic_with_fewer_partitions_is_reported_not_altered(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    cfg = plain_config(tmp_path, broker, "few")
    make_topic(broker, "few.gpu_samples", 1)
    out = topics_cmd("--config", str(cfg), "--create", "--partitions", "3")
    assert out.returncode == 0, out
    assert lines_of(out)["few.gpu_samples"].startswith("few.gpu_samples: exists, 1 partition, ")
    assert "few.gpu_samples has 1 partition, fewer than --partitions 3: not altered" in out.stderr
    assert "kafka-topics.sh --alter --topic few.gpu_samples --partitions 3" in out.stderr
    assert "ingest processes" in out.stderr
    assert out.stderr.count("fewer than") == 1  # the ones made now have 3
    got = described(broker, list(topics_of("few").values()))
    assert got.pop("few.gpu_samples") == (1, 1)
    assert set(got.values()) == {(3, 1)}


def test_a_replication_factor_the_broker_cannot_meet_is_refused_naming_it(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    cfg = plain_config(tmp_path, broker, "rf")
    out = topics_cmd("--config", str(cfg), "--create", "--replication-factor", "2", "--partitions", "1")
    assert out.returncode == 1, out
    assert sorted(lines_of(out)) == sorted(topics_of("rf").values())
    for ln in out.stdout.splitlines():
        # '1 partition', not '1 partitions'
        assert "missing, not created: 1 partition, replication factor 2 refused" in ln, ln
        assert "InvalidReplicationFactorError" in ln and "only 1 broker" in ln, ln  # the broker's words
    names = list(topics_of("rf").values())
    assert described(broker, names) == dict.fromkeys(names)


def test_a_topic_made_meanwhile_by_someone_else_counts_as_there(broker: KafkaBroker) -> None:
    """TopicAlreadyExistsError from the CreateTopics of a topic described as missing a moment before."""
    from gpuslo.app.topics import Topic, create, open_admin

    make_topic(broker, "race.t", 2)
    admin = open_admin({"bootstrap_servers": [broker.bootstrap], "request_timeout_ms": 10_000})
    try:
        t = Topic("race.t", ["gpu_samples"])
        assert create(admin, t, -1, -1, time.monotonic() + 30, "someone") is True
        assert t.state == "missing"  # not made here: described again by the command
    finally:
        admin.close()


def test_sasl_from_the_config_and_no_password_shown(broker: KafkaBroker, tmp_path: Path) -> None:
    cfg = sasl_config(tmp_path, broker, "sasl")
    out = topics_cmd("--config", str(cfg), "--create", "--partitions", "1")
    assert out.returncode == 0, out
    names = list(topics_of("sasl").values())
    assert described(broker, names) == dict.fromkeys(names, (1, 1))
    wrong = sasl_config(tmp_path, broker, "sasl-wrong", password="not-the-password-7")
    out = topics_cmd("--config", str(wrong), "--timeout-s", "5")
    assert out.returncode == 2, out
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert "authentication failed" in out.stderr and "gpuslo-plain" in out.stderr
    assert "not-the-password-7" not in out.stderr


def _acl(op: str, permission: str, kind: str, name: str, prefixed: bool = False) -> Any:
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern
    from kafka.admin import ResourceType as R

    ((user, _),) = SCRAM_USERS.items()
    pattern = ResourcePattern(
        getattr(R, kind),
        name,
        ACLResourcePatternType.PREFIXED if prefixed else ACLResourcePatternType.LITERAL,
    )
    return ACL(
        f"User:{user}", "*", getattr(ACLOperation, op), getattr(ACLPermissionType, permission), pattern
    )


def add_acls(broker: KafkaBroker, acls: list[Any]) -> None:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        got = admin.create_acls(acls)
        assert not got["failed"], got
    finally:
        admin.close()


def test_no_right_to_create_is_said_per_topic_naming_the_right(broker: KafkaBroker, tmp_path: Path) -> None:
    """The SCRAM user (the PLAIN one keeps its rights for the other tests) may describe the
    topics but not create them: Kafka asks for CREATE on the cluster, else on the topic."""
    add_acls(
        broker,
        [
            _acl("CREATE", "DENY", "CLUSTER", "kafka-cluster"),
            _acl("CREATE", "DENY", "TOPIC", "deny.", prefixed=True),
            _acl("DESCRIBE", "ALLOW", "TOPIC", "deny.", prefixed=True),
        ],
    )
    cfg = sasl_config(tmp_path, broker, "deny", scram=True)
    out = topics_cmd("--config", str(cfg), "--create")
    assert out.returncode == 1, out
    lines = lines_of(out)
    assert sorted(lines) == sorted(topics_of("deny").values())
    for name, ln in lines.items():
        assert f"{name}: missing, not created: not authorized to create it" in ln, ln
        assert f"CREATE on the cluster or on topic {name}" in ln and "'gpuslo-scram'" in ln, ln
    assert "5 of 5 topics missing" in out.stderr
    assert "scram-secret" not in out.stdout + out.stderr
    names = list(topics_of("deny").values())
    assert described(broker, names) == dict.fromkeys(names)


def test_a_topic_the_user_may_not_describe_is_exit_2(broker: KafkaBroker, tmp_path: Path) -> None:
    add_acls(broker, [_acl("DESCRIBE", "DENY", "TOPIC", "hidden.", prefixed=True)])
    cfg = sasl_config(tmp_path, broker, "hidden", scram=True)
    out = topics_cmd("--config", str(cfg), "--create")
    assert out.returncode == 2, out
    assert all("cannot tell: not authorized to describe it" in ln for ln in out.stdout.splitlines())
    assert "needs DESCRIBE" in out.stderr


def test_no_broker_is_one_line_and_exit_2_within_the_timeout(tmp_path: Path) -> None:
    """Nothing listening, and a listener that accepts and never answers (a broker hung): each
    ends by --timeout-s with one line, never a hang."""
    port = free_port()
    t0 = time.monotonic()
    out = topics_cmd("--kafka", f"127.0.0.1:{port}", "--create", "--timeout-s", "3")
    assert out.returncode == 2, out
    assert out.stdout == ""
    assert out.stderr.splitlines() == [
        f"gpuslo topics: no Kafka broker reachable at 127.0.0.1:{port} (nothing accepts TCP connections there)"
    ]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t0 = time.monotonic()
        out = topics_cmd("--kafka", f"127.0.0.1:{silent.getsockname()[1]}", "--timeout-s", "3")
        took = time.monotonic() - t0
    assert out.returncode == 2, out
    assert len(out.stderr.splitlines()) == 1 and "accepts connections but does not answer" in out.stderr
    assert out.stderr.rstrip().endswith("waited --timeout-s 3")
    assert 3 <= took < 3 + 15, took  # the interpreter's start besides


def test_a_config_that_does_not_resolve_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        "nofile",
        {
            "bootstrap_servers": ["127.0.0.1:9"],
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "u",
            "sasl_password_file": str(tmp_path / "absent"),
        },
    )
    out = topics_cmd("--config", str(cfg))
    assert out.returncode == 2, out
    assert len(out.stderr.splitlines()) == 1 and "sasl_password" in out.stderr, out.stderr
    bad = write_config(tmp_path, "badkey", {"bootstrap_servers": ["127.0.0.1:9"], "topicz": {}})
    out = topics_cmd("--config", str(bad))
    assert out.returncode == 2, out
    assert "topicz" in out.stderr

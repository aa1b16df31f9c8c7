"""Topic names in the service config are judged at load by Kafka's own rule: kafka-python (which
copies Kafka's ``Topic.validate``) is the oracle over every ASCII character, non-ASCII ones and the
length bound; a file naming a topic Kafka refuses stops the command with the key and the reason.

Before: any string was taken; kafka-python refused it at each send, so the agent spooled its
records until the spool's bounds dropped them, and the ingest stopped with a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kafka.util import ensure_valid_topic_name
from pydantic import ValidationError

from gpuslo.core.settings import TOPIC_MAX_LENGTH, SettingsError, Topics, load
from tests.servers.kafka import KafkaBroker

GPUSLO = str(Path(sys.executable).with_name("gpuslo"))


def _names() -> list[str]:
    one = [chr(c) for c in range(128)] + ["é", "日", "\u200b", "ａ"]
    out = one + [f"gpuslo.{c}x" for c in one] + ["", ".", "..", "...", "-", "_", "a..b", ".hidden"]
    out += ["a" * n for n in (TOPIC_MAX_LENGTH - 1, TOPIC_MAX_LENGTH, TOPIC_MAX_LENGTH + 1, 10_000)]
    return out


def _kafka_takes(name: str) -> bool:
    try:
        ensure_valid_topic_name(name)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("kind", list(Topics.model_fields))
def test_the_config_takes_exactly_the_topic_names_kafka_takes(kind: str) -> None:
    wrong = []
    for name in _names():
        try:
            Topics(**{kind: name})
            ours = True
        except ValidationError as e:
            assert kind in str(e)
            ours = False
        if ours != _kafka_takes(name):
            wrong.append((name[:30], ours))
    assert wrong == []


def test_names_differing_only_by_dot_and_underscore_are_refused() -> None:
    with pytest.raises(ValidationError, match="differ only by"):
        Topics(gpu_samples="fleet.a_b", heartbeat="fleet_a.b")
    Topics(gpu_samples="fleet.x", heartbeat="fleet.x")  # one topic for two kinds: each message says its kind


@pytest.mark.parametrize("topic", ["gpu samples", "gpuslo/gpu", "x" * 250, ".."])
def test_a_config_file_naming_such_a_topic_stops_the_command_with_the_key(tmp_path: Path, topic: str) -> None:
    p = tmp_path / "gpuslo.yaml"
    p.write_text(yaml.safe_dump({"kafka": {"topics": {"gpu_samples": topic}}}), encoding="utf-8")
    with pytest.raises(SettingsError, match="gpu_samples"):
        load(p)
    r = subprocess.run([GPUSLO, "ingest", "--config", str(p), "--kafka", "127.0.0.1:1"], capture_output=True,
                       text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "gpu_samples" in r.stderr and "Traceback" not in r.stderr, r.stderr


KAFKAS_OWN = ["__consumer_offsets", "__transaction_state", "__cluster_metadata", "__share_group_state"]


@pytest.mark.parametrize("topic", [*KAFKAS_OWN, "__consumer.offsets", "__cluster.metadata"])
def test_a_topic_of_kafkas_own_is_refused(topic: str) -> None:
    """kafka-python's check takes these names (they are Kafka's own topics), and no send to one
    ever succeeded: the agent spooled its records until its bounds dropped them."""
    assert _kafka_takes(topic)
    with pytest.raises(ValidationError, match="Kafka's own"):
        Topics(gpu_samples=topic)


@pytest.mark.integration
def test_the_real_broker_takes_no_record_on_a_topic_of_its_own(kafka: KafkaBroker) -> None:
    """The oracle for the refusal above: a producer's send to each fails on the broker, while a
    name that only starts with two underscores is an ordinary topic."""
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=kafka.bootstrap, max_block_ms=8000, request_timeout_ms=8000,
                      delivery_timeout_ms=20_000)  # fmt: skip
    try:
        p.send("__ordinary", b"x").get(timeout=20)
        for topic in KAFKAS_OWN:
            with pytest.raises(Exception):  # noqa: B017 (kafka-python's ValueError or KafkaTimeoutError)
                p.send(topic, key=b"k", value=b"x").get(timeout=20)
    finally:
        p.close()

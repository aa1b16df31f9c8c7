"""Bootstrap servers in the service config (and ``--kafka``) are judged at load as kafka-python
reads them (``host``, ``host:port``, ``[ipv6]:port``, an optional ``PROTOCOL://``): kafka-python's
own parser is the oracle over a sweep of hosts, ports and forms, and the real broker takes each
form the config takes.

Before: any non-empty string was taken. ``--kafka localhost:abc`` was kafka-python's int()
ValueError at connect: the agent spooled its records, saying Kafka was unavailable and retrying
for ever, and the ingest said no broker was reachable; a port past 65535 or a host of white space
was a broker that never answered, and ``::1:9092`` an IPv6 address on port 9092."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kafka.cluster import collect_hosts
from pydantic import ValidationError

from gpuslo.core.settings import KafkaSettings, load
from tests.servers.kafka import KafkaBroker

HOSTS = ["localhost", "kafka-1.example.com", "kafka_1", "127.0.0.1", "é.example", "", " ", "a b", "\t", "h\x00",
         "[::1]", "[fe80::1%eth0]", "[::ffff:1.2.3.4]", "[x]", "[]", "[::1", "::1]", "::1", "fe80::1", "::1:9092",
         "a/b", "u@h", "[", "]"]  # fmt: skip
PORTS = [None, "9092", "1", "0", "65535", "65536", "99999", "-1", "+9092", " 9092", "9_092", "٩٠٩٢", "abc", "",
         "9092 ", "1:2", "00009092"]  # fmt: skip
PREFIXES = ["", "PLAINTEXT://", "SASL_SSL://", "  ", "://"]


def _candidates() -> list[str]:
    return [f"{pre}{h}{'' if p is None else ':' + p}" for pre in PREFIXES for h in HOSTS for p in PORTS]


def _kafka_python(server: str) -> tuple[str, int] | str:
    """(host, port) as kafka-python's bootstrap reads ``server``, or its exception's name."""
    try:
        ((host, port, _),) = collect_hosts([server], randomize=False)
    except Exception as e:  # what kafka-python raises at the producer's or consumer's start
        return type(e).__name__
    return host, port


def _ipv6(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6, host)
    except OSError:
        return False
    return True


def _ours(server: str) -> tuple[str, int] | None:
    from gpuslo.core.settings import kafka_address

    try:
        KafkaSettings(bootstrap_servers=[server])
    except ValidationError:
        return None
    return kafka_address(server)


def test_the_config_takes_a_server_as_kafka_python_reads_it_and_refuses_what_it_cannot_reach() -> None:
    """What the config takes, kafka-python reads as the same host and port; what it refuses,
    kafka-python cannot connect to: its own error at start, a port outside 1..65535, no host or
    one with white space, control characters or URL punctuation, or a bare IPv6 address (read
    as an address where ``:9092`` was meant as its port)."""
    wrong = []
    taken = 0
    for s in _candidates():
        theirs, ours = _kafka_python(s), _ours(s)
        if ours is not None:
            taken += 1
            if theirs != ours:
                wrong.append(f"{s!r}: the config reads {ours}, kafka-python {theirs}")
            continue
        if isinstance(theirs, str):
            continue  # kafka-python refuses it too (at every start)
        host, port = theirs
        unreachable = (
            not 0 < port < 65536
            or not host.strip()
            or any(c.isspace() or not c.isprintable() or c in "[]/@," for c in host)
            or ":" in host  # an IPv6 address kafka-python took unbracketed: ::1:9092 is no port
            or ("[" in s and not _ipv6(host))  # a name in brackets: kafka-python looks up IPv6 only
            or not s.split("://")[-1].strip().rsplit(":", 1)[-1].isascii()  # "٩٠٩٢": a port, by int()
            or "_" in s.rsplit(":", 1)[-1]  # "9_092"
            or s.rsplit(":", 1)[-1][:1] in "+ "  # "+9092", " 9092": int() is lenient, the config not
        )
        if not unreachable:
            wrong.append(f"{s!r}: refused, though kafka-python reads it as {theirs}")
    assert wrong == []
    assert 100 < taken < len(_candidates()) // 2


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("kafka_arg", ["localhost:abc", "localhost:99999", " ", "::1:9092", "[::1", "h:1:2"])
def test_a_server_kafka_cannot_read_stops_the_command_with_a_usage_error(
    tmp_path: Path, kafka_arg: str
) -> None:
    """Exit 2 at start, naming the server, for the agent and the ingest (each retried or waited
    on the broker before), and from a config file naming the key."""
    gpuslo = [sys.executable, "-m", "gpuslo"]
    runs = [
        [*gpuslo, "agent", "--source", "sim", "--hours", "0.01", "--spool-dir", str(tmp_path / "sp"),
         "--flush-timeout-s", "1", "--kafka", kafka_arg],
        [*gpuslo, "ingest", "--store", str(tmp_path / "st"), "--kafka", kafka_arg],
    ]  # fmt: skip
    p = tmp_path / "service.yaml"
    p.write_text(yaml.safe_dump({"kafka": {"bootstrap_servers": [kafka_arg]}}), encoding="utf-8")
    runs.append([*gpuslo, "ingest", "--store", str(tmp_path / "st"), "--config", str(p), "--kafka", "-"])
    for cmd in runs:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 2, (cmd, r.stdout[-1000:], r.stderr[-2000:])
        assert "Traceback" not in r.stderr
        assert repr(kafka_arg)[1:-1] in r.stderr or "bootstrap_servers" in r.stderr, r.stderr[-2000:]
        assert "reachable" not in r.stderr and "spooling" not in r.stderr, r.stderr[-2000:]
    with pytest.raises(Exception, match="bootstrap_servers"):
        load(p)


@pytest.mark.integration
def test_every_form_the_config_takes_reaches_the_real_broker(kafka: KafkaBroker) -> None:
    """host:port with a protocol prefix or white space around, as kafka-python reads them, send
    and read on the broker; the failure explanation probes the host and port the server names."""
    from kafka import KafkaConsumer, KafkaProducer

    from gpuslo.core.kafka_errors import explain

    host, port = kafka.bootstrap.rsplit(":", 1)
    forms = [kafka.bootstrap, f"PLAINTEXT://{kafka.bootstrap}", f" {kafka.bootstrap} "]
    for i, form in enumerate(forms):
        kw = KafkaSettings(bootstrap_servers=[form]).client_kwargs()
        producer = KafkaProducer(**kw)
        producer.send(f"forms{i}", b"x").get(timeout=30)
        producer.close()
        consumer = KafkaConsumer(f"forms{i}", auto_offset_reset="earliest", consumer_timeout_ms=15_000, **kw)
        try:
            assert next(iter(consumer)).value == b"x"
        finally:
            consumer.close()
        seen: list[tuple[str, int]] = []

        def probe(h: str, p: int, _t: float, seen: list[tuple[str, int]] = seen) -> bool:
            seen.append((h, p))
            return True

        explain(KafkaSettings(bootstrap_servers=[form]), RuntimeError("x"), probe)
        assert seen == [(host, int(port))]

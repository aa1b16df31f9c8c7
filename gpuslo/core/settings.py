"""Service configuration: Kafka (agent and ingest), ClickHouse server, agent spool, ingest
batching. Frozen pydantic models, unknown keys rejected, units in names; a bad file
fails at start naming the file, the key and the reason.

Secrets: a password may come from an environment variable (``*_env``) or a file
(``*_file``) rather than the YAML; it is held as ``SecretStr``, so neither ``repr``,
logs nor ``/metrics`` ever show it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, model_validator

from gpuslo.core.configmodel import ConfigModel
from gpuslo.core.fileio import NotARegularFile, read_regular
from gpuslo.core.yamlfile import load_model


class SettingsError(ValueError):
    pass


_M = ConfigModel  # frozen, unknown keys rejected, every float finite, no boolean for a number


MAX_SECRET_BYTES = 1 << 20  # a password or token file; more is not one
# every number is bounded: a timeout of 1e300 s (or .inf) reached sleep, a socket timeout or an
# int() of milliseconds and came out as an OverflowError long after a clean start
DAY_S = 86_400.0
MAX_AGE_S = 400 * DAY_S


def _path_text(v: Any) -> Any:
    """A path the config names, as text: an empty one was read as the current directory (the
    agent's spool went wherever it was started, ``/`` under systemd), a NUL was a ValueError
    traceback where it was first opened (no path holds one)."""
    if isinstance(v, str) and not v.strip():
        raise ValueError("an empty or blank path (an empty one was read as the current directory)")
    if isinstance(v, str) and "\0" in v:
        raise ValueError("a NUL character, which no path holds")
    return v


ConfigPath = Annotated[Path, BeforeValidator(_path_text)]


def resolve_secret(value: SecretStr | None, env: str | None, file: Path | None, what: str) -> str | None:
    """The secret from exactly one of: the value, an environment variable, a file."""
    given = [x for x in (value, env, file) if x is not None]
    if len(given) > 1:
        raise SettingsError(f"{what}: give one of the value, *_env or *_file, not several")
    if value is not None:
        return value.get_secret_value()
    if env is not None:
        v = os.environ.get(env)
        if v is None:
            raise SettingsError(f"{what}: environment variable {env} is not set")
        return v
    if file is not None:
        try:  # a regular file (a mounted Secret's link to one too), not a device or a FIFO
            return read_regular(file, MAX_SECRET_BYTES, pipes=True).decode("utf-8").rstrip("\n")
        except NotARegularFile as exc:
            raise SettingsError(f"{what}: cannot read {exc}") from None
        except OSError as exc:
            raise SettingsError(f"{what}: cannot read {file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise SettingsError(f"{what}: {file} is not UTF-8 text (byte {exc.start})") from None
    return None


def readable_file(path: Path, what: str) -> Path:
    """``path`` when it is a regular file this process may read, else a SettingsError naming
    ``what``: kafka-python opened a missing CA file only when it connected, and the failure read
    as a broker that was down (the agent spooled and retried for ever)."""
    if not path.is_file():
        why = "no such file" if not path.exists() else "not a regular file"
        raise SettingsError(f"{what}: cannot read {path}: {why}")
    if not os.access(path, os.R_OK):
        raise SettingsError(f"{what}: cannot read {path}: permission denied")
    return path


def ca_bundle(path: Path, what: str) -> Path:
    """``path`` when it is a CA bundle with at least one certificate (loaded once to see), else a
    SettingsError naming ``what``: a file with none failed at every connect, a TLS error the
    store classified as a network error and retried for ever."""
    readable_file(path, what)
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, OSError) as exc:
        raise SettingsError(f"{what}: {path} is no CA bundle: {exc}") from None
    return path


# Kafka's own rule for a topic name (its Topic.validate, which kafka-python copies and applies at
# each send and subscribe): ASCII letters, digits, ".", "_" and "-", at most 249, not "." or ".."
_TOPIC_CHARS = re.compile(r"[a-zA-Z0-9._-]+")
TOPIC_MAX_LENGTH = 249
# the broker's own topics (offsets, transactions, KRaft's metadata, share groups): Topic.validate
# takes their names, but a producer's send to one never succeeds (kafka-python: "Partitioner did
# not assign a partition", or metadata never comes), and nor does one named apart only by . and _
INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state", "__cluster_metadata", "__share_group_state")


def _topic_name(v: str) -> str:
    if v in (".", ".."):
        raise ValueError(f"{v!r} is no Kafka topic name")
    if v.replace(".", "_") in INTERNAL_TOPICS:
        raise ValueError(f"{v!r} is (or collides with) a topic of Kafka's own: name the topic apart")
    if len(v) > TOPIC_MAX_LENGTH:
        raise ValueError(f"a Kafka topic name is at most {TOPIC_MAX_LENGTH} characters ({len(v)} given)")
    if not _TOPIC_CHARS.fullmatch(v):
        raise ValueError(f"{v[:100]!r} is no Kafka topic name (ASCII letters, digits, '.', '_' and '-' only)")
    return v


TopicName = Annotated[str, AfterValidator(_topic_name)]
KAFKA_STRING_MAX_BYTES = 32767  # a STRING of Kafka's protocol: int16 length, UTF-8


def _kafka_string(v: str) -> str:
    """A group or client id Kafka's protocol can carry: a longer one was cut short on the wire, and
    a consumer of a 32,768-byte group id read nothing and committed nothing, without an error."""
    if len(v.encode("utf-8", "surrogatepass")) > KAFKA_STRING_MAX_BYTES:
        raise ValueError(f"at most {KAFKA_STRING_MAX_BYTES} bytes of UTF-8 (a Kafka protocol string)")
    return v


KafkaString = Annotated[str, AfterValidator(_kafka_string)]


def _group_id(v: str) -> str:
    if not v:
        raise ValueError("empty: the broker answers INVALID_GROUP_ID at the first join")
    return _kafka_string(v)


class Topics(_M):
    """Topic per message kind. Each a name Kafka takes: kafka-python refused any other at every
    send, so the agent spooled its records until the spool's bounds dropped them, and the ingest
    stopped with a traceback at subscribe."""

    gpu_samples: TopicName = "gpuslo.gpu_samples"
    heartbeat: TopicName = "gpuslo.heartbeats"
    sched_event: TopicName = "gpuslo.sched_events"
    latency: TopicName = "gpuslo.latency"
    health: TopicName = "gpuslo.health"

    @model_validator(mode="after")
    def _no_collision(self) -> Topics:
        """Kafka refuses a topic whose name differs from an existing one's only by ``.`` against
        ``_`` (their metric names collide): the second one was never created, and the producer
        waited for its metadata at every send. Two kinds on one topic are allowed (each message
        says its kind)."""
        seen: dict[str, str] = {}
        for kind in type(self).model_fields:
            name = getattr(self, kind)
            folded = name.replace(".", "_")
            other = seen.setdefault(folded, name)
            if other != name:
                raise ValueError(
                    f"topics {other!r} and {name!r} differ only by '.' against '_', which Kafka refuses "
                    "(their metric names collide): name them apart"
                )
        return self

    def for_kind(self, kind: str) -> str:
        t: str = getattr(self, kind)
        return t

    def all(self) -> list[str]:
        return [self.gpu_samples, self.heartbeat, self.sched_event, self.latency, self.health]


KAFKA_DEFAULT_PORT = 9092
_PROTOCOL_PREFIX = re.compile(r"^.*://")  # kafka-python drops one, as Java's client does
_HOST_PORT = re.compile(r"\[(?P<v6>[^\[\]]*)\](?::(?P<v6port>.*))?|(?P<host>[^:]*)(?::(?P<port>.*))?")


def _is_ipv6(text: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6, text)
    except (OSError, ValueError):
        return False
    return True


def _bad_host(host: str) -> bool:
    """No host name or address a connection can be made to: empty, white space or a character
    no name holds, or a name the resolver cannot encode (socket encodes it as IDNA: a label empty
    or over 63 characters, ``a..b``, ``.x``, a lone surrogate): kafka-python retried such a
    bootstrap server until its timeout, then the failure explanation's own probe of it was a
    UnicodeError traceback."""
    if not host or any(c.isspace() or not c.isprintable() or c in "[]/@," for c in host):
        return True
    return not _is_ipv6(host) and not _idna_ok(host)


def _idna_ok(host: str) -> bool:
    try:
        host.encode("idna")  # what socket.getaddrinfo does with a str host
    except UnicodeError:
        return False
    return True


def host_port(server: str) -> tuple[str, int | None]:
    """``host``, ``host:port`` (1 to 65535), ``[ipv6]`` or ``[ipv6]:port``: (host, port or None).
    Raises ValueError for anything else: no host, one with white space, a port that is no number
    in range, or a bare IPv6 address (``::1:9092``: an address, or ``::1`` on port 9092?)."""
    if _is_ipv6(server):
        raise ValueError(f"{server[:200]!r}: write an IPv6 address in brackets, as [{server[:100]}]:port")
    m = _HOST_PORT.fullmatch(server)
    if m is None:
        raise ValueError(f"{server[:200]!r} is not host:port, nor [IPv6 address]:port")
    host, port = (m["v6"], m["v6port"]) if m["v6"] is not None else (m["host"], m["port"])
    if m["v6"] is not None and not _is_ipv6(host):
        raise ValueError(f"{server[:200]!r}: {host[:100]!r} in brackets is no IPv6 address")
    if _bad_host(host):
        raise ValueError(f"{server[:200]!r}: no host name or address (host:port, or [IPv6 address]:port)")
    if port is None:
        return host, None
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{server[:200]!r}: the port is a number from 1 to 65535")
    return host, int(port)


def kafka_address(server: str) -> tuple[str, int]:
    """A bootstrap server as kafka-python reads it: :func:`host_port` (port 9092 where none is
    given), after white space and an optional ``PROTOCOL://``.

    kafka-python read ``host:abc`` as an int's ValueError, a port past 65535 or a host of white
    space as a broker it could not reach: the agent spooled, retrying for ever, and the ingest said
    no broker was reachable; it read ``::1:9092`` as the address ``::1:9092`` on port 9092."""
    host, port = host_port(_PROTOCOL_PREFIX.sub("", server.strip()))
    return host, KAFKA_DEFAULT_PORT if port is None else port


def _bootstrap_server(v: str) -> str:
    kafka_address(v)
    return v


BootstrapServer = Annotated[str, AfterValidator(_bootstrap_server)]


def _sasl_username_problem(mechanism: str | None, user: str) -> str | None:
    """Why the broker cannot authenticate ``user`` by ``mechanism``: kafka-python sends an empty
    name (SCRAM's own check is never raised), PLAIN's fields are separated by NUL, and the broker
    reads a SCRAM name of ASCII only (its saslname: U+0001 to U+007F; ``,`` and ``=`` escaped,
    which :meth:`KafkaSettings.client_kwargs` does). Each read as a wrong password at connect."""
    if not user:
        return "empty"
    if "\0" in user:
        return "a NUL character (PLAIN separates its fields by NUL; SCRAM refuses it)"
    if mechanism != "PLAIN" and not user.isascii():
        return f"{mechanism} takes ASCII user names only (Kafka's broker refuses any other at login)"
    return None


class KafkaSettings(_M):
    # each one kafka-python reads as a host and a port (see kafka_address)
    bootstrap_servers: Annotated[list[BootstrapServer], Field(min_length=1)] = Field(
        default_factory=lambda: ["localhost:9092"]
    )
    client_id: KafkaString = "gpuslo"
    topics: Topics = Field(default_factory=Topics)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    sasl_password_env: str | None = None
    sasl_password_file: ConfigPath | None = None
    ssl_cafile: ConfigPath | None = None
    ssl_certfile: ConfigPath | None = None
    ssl_keyfile: ConfigPath | None = None
    ssl_check_hostname: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSettings:
        sasl = self.security_protocol.startswith("SASL")
        if sasl and (self.sasl_mechanism is None or self.sasl_username is None):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_mechanism and sasl_username"
            )
        if not sasl and self.sasl_mechanism is not None:
            raise ValueError(f"sasl_mechanism is set but security_protocol is {self.security_protocol}")
        if sasl and (why := _sasl_username_problem(self.sasl_mechanism, self.sasl_username or "")):
            raise ValueError(f"sasl_username {(self.sasl_username or '')[:100]!r}: {why}")
        return self

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for kafka-python's producer and consumer (holds the secret: never log it)."""
        kw: dict[str, Any] = {
            "bootstrap_servers": list(self.bootstrap_servers),
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        }
        if self.security_protocol.startswith("SASL"):
            kw["sasl_mechanism"] = self.sasl_mechanism
            password = resolve_secret(
                self.sasl_password, self.sasl_password_env, self.sasl_password_file, "kafka.sasl_password"
            )
            if self.sasl_mechanism == "PLAIN" and password and "\0" in password:
                raise SettingsError("kafka.sasl_password: a NUL character, which separates PLAIN's fields")
            user = self.sasl_username or ""
            if self.sasl_mechanism != "PLAIN":  # RFC 5802's saslname, which kafka-python does not write
                user = user.replace("=", "=3D").replace(",", "=2C")
            kw["sasl_plain_username"] = user
            kw["sasl_plain_password"] = password
        if self.security_protocol.endswith("SSL"):
            kw["ssl_check_hostname"] = self.ssl_check_hostname
            for k in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                v = getattr(self, k)
                if v is not None:
                    check = ca_bundle if k == "ssl_cafile" else readable_file
                    kw[k] = str(check(v, f"kafka.{k}"))
        return kw


#: The longest kafka-python waits between tries to connect to a broker that refused (Kafka's own
#: client's default, ``reconnect.backoff.max.ms``). kafka-python's is 30 s, doubling from 50 ms:
#: after an outage of a few seconds it reconnected up to 30 s after the broker was back, and an
#: ingest stopped meanwhile committed nothing of what it had written (its commit timed out).
RECONNECT_BACKOFF_MAX_MS = 1000


class SpoolSettings(_M):
    directory: ConfigPath = Path("/var/lib/gpuslo/spool")
    max_bytes: Annotated[int, Field(gt=0, le=1 << 50)] = 256 * 2**20
    max_age_s: Annotated[float, Field(gt=0, le=MAX_AGE_S)] = 7 * 86400.0
    fsync: bool = False


#: The Python package kafka-python needs for each codec it cannot use without one (gzip is the
#: standard library's). zstd, the default, comes with gpuslo[agent] and gpuslo[ingest].
CODEC_PACKAGES = {"zstd": "zstandard", "lz4": "lz4", "snappy": "python-snappy"}


class ProducerSettings(_M):
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "zstd"
    linger_ms: Annotated[int, Field(ge=0, le=60_000)] = 50
    # the in-memory bound: at most this much is read from the spool and in flight at once
    drain_max_bytes: Annotated[int, Field(gt=0, le=1 << 30)] = 4 * 2**20
    # also the producer's request timeout (4/5 of it, in ms): an int32 on the wire (ProduceRequest)
    flush_timeout_s: Annotated[float, Field(gt=0, le=DAY_S)] = 10.0
    drain_batch: Annotated[int, Field(gt=0, le=1_000_000)] = 500
    # a backlog of at least this many gpu_samples records of one topic and key is sent as packs
    # (gpuslo.wire.pack: many batches per Kafka message, columns the ingest reads without
    # parsing); 0: always one JSON message per record
    pack_min_records: Annotated[int, Field(ge=0, le=1_000_000)] = 16


def _clickhouse_host(v: str) -> str:
    """A host name or address as clickhouse-driver connects to it (an IPv6 address without
    brackets): an empty or blank one was a name the resolver did not know, a transient error the
    commands retried (``rules run`` for ever), not the config error it is."""
    if _bad_host(v):
        raise ValueError(f"{v[:200]!r} is no host name or address (an IPv6 address without brackets)")
    return v


class ClickHouseSettings(_M):
    host: Annotated[str, AfterValidator(_clickhouse_host)] = "localhost"
    port: Annotated[int, Field(gt=0, lt=65536)] = 9000
    # quoted in backticks in DDL: letters, digits, _ and - only (no quote can break out)
    database: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,200}$")] = "gpuslo"
    user: str = "default"
    password: SecretStr | None = None
    password_env: str | None = None
    password_file: ConfigPath | None = None
    secure: bool = False
    ca_certs: ConfigPath | None = None
    verify: bool = True
    connect_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # every read or write of the connection (the server's hello included): a server that says
    # nothing for this long, or a connection gone silent (its host lost, a NAT entry dropped: no
    # FIN or RST ever comes), fails the operation as TRANSIENT, retried on a new connection
    # (clickhouse-driver's own default is 300 s, as long as Kafka's max.poll.interval)
    send_receive_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0

    def password_value(self) -> str:
        return (
            resolve_secret(self.password, self.password_env, self.password_file, "clickhouse.password") or ""
        )


class IngestSettings(_M):
    group_id: Annotated[str, AfterValidator(_group_id)] = "gpuslo-ingest"
    batch_messages: Annotated[int, Field(gt=0, le=10_000_000)] = 5000
    # and at most about this many bytes of messages (a pack of the agent's backlog is ~1 MiB: 5000
    # of them would be 5 GB in memory); a batch holds at least one message, whatever its size
    batch_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 36)] = 64 << 20
    batch_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    # how soon the group notices a crashed consumer and hands its partitions to another
    session_timeout_s: Annotated[float, Field(ge=6, le=1800)] = 45.0
    retry_initial_s: Annotated[float, Field(gt=0, le=DAY_S)] = 0.5
    # then write one by one, dead-lettering what is refused
    refused_attempts: Annotated[int, Field(ge=1, le=100)] = 3
    retry_max_s: Annotated[float, Field(gt=0, le=DAY_S)] = 30.0
    metrics_port: Annotated[int, Field(ge=0, lt=65536)] = 9466  # 0: no /metrics
    # bytes one fetch may return per partition (kafka-python's default, 1 MiB, is ~150 node
    # batches: too many round trips at full speed); memory in flight is about this × partitions
    fetch_partition_bytes: Annotated[int, Field(ge=65536, le=256 * 1024 * 1024)] = 8 * 1024 * 1024
    # records wait on an owned partition, Kafka answers, and nothing was read or written this
    # long: the Kafka consumer is stuck (kafka-python after broker restarts) and is made anew
    stall_s: Annotated[float, Field(ge=1, le=DAY_S)] = 60.0
    # under a backlog (batches full), offsets are committed at most this often: where the store
    # holds the rollups' marks in memory (the embedded store) each commit first makes them
    # durable, one write for all the batches since; a batch that closes short (caught up) is
    # committed at once
    commit_interval_s: Annotated[float, Field(ge=0, le=60)] = 2.0

    @model_validator(mode="after")
    def _retry_order(self) -> IngestSettings:
        if self.retry_initial_s > self.retry_max_s:
            raise ValueError(
                f"retry_initial_s {self.retry_initial_s:g} is above retry_max_s {self.retry_max_s:g}: "
                "the first retry waits retry_initial_s, doubling up to retry_max_s"
            )
        return self


class ServiceConfig(_M):
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    producer: ProducerSettings = Field(default_factory=ProducerSettings)
    spool: SpoolSettings = Field(default_factory=SpoolSettings)
    clickhouse: ClickHouseSettings | None = None
    ingest: IngestSettings = Field(default_factory=IngestSettings)

    def secrets(self) -> list[str]:
        """The secret values this config resolves to (for log redaction); unresolvable ones are skipped."""
        out = []
        for fn in (
            lambda: self.kafka.client_kwargs().get("sasl_plain_password"),
            lambda: self.clickhouse.password_value() if self.clickhouse else None,
        ):
            try:
                v = fn()
            except SettingsError:
                continue
            if v:
                out.append(str(v))
        return out


class RedactSecrets(logging.Filter):
    """Replaces known secret values in log records (defence in depth: our own code never
    logs them, but a library or an exception's text might): in the message, in the traceback
    of ``log.exception`` and in ``stack_info``. Installed on the handlers, so it sees every
    record that is written, whichever logger it came from."""

    MASK = "***"

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets: list[str] = []
        self.add(secrets)

    def add(self, secrets: list[str]) -> None:
        # longest first, so that a URL is masked whole before its password part is
        new = {s for s in secrets if len(s) >= 4} | set(self.secrets)
        self.secrets = sorted(new, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for s in self.secrets:
            if s in text:
                text = text.replace(s, self.MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string: the handler would print msg and args raw
            msg = f"{record.msg} {record.args!r}"
            record.msg, record.args = msg, None
        red = self.redact(msg)
        if red != msg:
            record.msg, record.args = red, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            # the handler's formatter uses exc_text as it is; without exc_info no handler
            # formats the traceback again from the exception (unredacted)
            record.exc_text = self.redact(record.exc_text)
            record.exc_info = None
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


def redact_logs(secrets: list[str]) -> None:
    """Add ``secrets`` to the redaction filter of every root handler (installing one where
    there is none yet)."""
    for h in logging.getLogger().handlers:
        f = next((x for x in h.filters if isinstance(x, RedactSecrets)), None)
        if f is None:
            h.addFilter(RedactSecrets(secrets))
        else:
            f.add(secrets)


def load(path: str | Path | None) -> ServiceConfig:
    """Load and validate a service config; ``None`` gives the defaults."""
    if path is None:
        return ServiceConfig()
    return load_model(Path(path), ServiceConfig, SettingsError)

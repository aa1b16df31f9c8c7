"""``gpuslo topics``: the Kafka topics of the service config, checked, and made with ``--create``.

A broker that does not make topics on first use (``auto.create.topics.enable=false``, as many
managed and production brokers run) left the agent blocking and spooling on every send to a
topic never made, and the ingest idle, with nothing said about why. This command reads the same
``--config`` as the agent and the ingest (its ``kafka`` section: the servers, SASL and TLS, a
topic per message kind), so it asks with their credentials, as an init container or a preflight
before either starts. It never alters a topic that exists.

Exit codes: 0 every topic exists (made now or before); 1 one is missing, or the broker refused to
make it (rights, partitions, replication); 2 Kafka could not be asked (no broker, authentication,
a bad config, no answer within ``--timeout-s``, a topic the user may not describe).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpuslo.app.argtypes import path_arg, text_arg

EXIT_OK, EXIT_MISSING, EXIT_ERROR = 0, 1, 2
DEFAULT_TIMEOUT_S = 30.0
BROKER_DEFAULT = -1  # CreateTopics v4+ (Kafka 2.4+): the broker's num.partitions / default.replication.factor
MAX_PARTITIONS = 2**31 - 1  # an INT32 on the wire; the broker refuses far fewer per request
MAX_REPLICATION = 2**15 - 1  # an INT16 on the wire (kafka-python's encoder raised struct.error past it)
PROG = "gpuslo topics"
DENIED = "TopicAuthorizationFailedError"


@dataclass
class Topic:
    """One topic of the config and what the broker says of it. ``state``: exists, missing,
    created, refused (the broker would not make it), unknown (it may not be described)."""

    name: str
    kinds: list[str]
    state: str = "missing"
    partitions: int = 0
    replication: int = 0
    why: str = ""


def config_topics(topics: Any) -> list[Topic]:
    """The config's topics, each once (two kinds may share one), in the kinds' order."""
    out: dict[str, Topic] = {}
    for kind in type(topics).model_fields:
        name = topics.for_kind(kind)
        out.setdefault(name, Topic(name, [])).kinds.append(kind)
    return list(out.values())


class Expired(Exception):
    """The run's --timeout-s passed while Kafka had not answered."""


class _Watchdog:
    """Closes the admin client when the run's deadline passes: kafka-python bounds each request
    by its request timeout, fixed when the client is made, and a CreateTopics by that and the
    broker's own wait, so a broker that answered the bootstrap and then stopped answering held
    the run several times --timeout-s. Closing fails the call in flight; the run says why."""

    def __init__(self, admin: Any, remaining_s: float) -> None:
        self.admin = admin
        self.fired = False
        self._timer = threading.Timer(max(0.0, remaining_s), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        self.admin.close()

    def cancel(self) -> None:
        """Stops the timer; one that fired is waited for, its close done (kafka-python's IO
        thread ended) before the run goes on."""
        self._timer.cancel()
        self._timer.join()


def open_admin(kw: dict[str, Any]) -> Any:
    """kafka-python's admin client, made with ``kw``; one whose bootstrap fails is closed too
    (kafka-python leaves its IO thread running: one more thread per failed try)."""
    from kafka.admin import KafkaAdminClient

    holder: list[Any] = []
    try:
        from kafka.net.compat import KafkaNetClient
    except ImportError:  # another kafka-python: no clean-up of a failed bootstrap, the rest the same
        return KafkaAdminClient(**kw)

    def client(**ckw: Any) -> Any:
        holder.append(KafkaNetClient(**ckw))
        return holder[-1]

    try:
        return KafkaAdminClient(kafka_client=client, **kw)
    except BaseException:
        for c in holder:
            c.close()
            c._manager._net.stop()
        raise


def describe(admin: Any, topics: list[Topic], deadline: float) -> None:
    """Each topic's partitions and replication factor, or missing; a topic the user may not
    describe is ``unknown`` (Kafka answers so for a topic that does not exist as well)."""
    from kafka.errors import TopicAuthorizationFailedError, UnknownTopicOrPartitionError, for_code

    if time.monotonic() >= deadline:
        raise Expired
    by_name = {t["name"]: t for t in admin.describe_topics([t.name for t in topics])}
    for t in topics:
        d = by_name.get(t.name)
        code = 0 if d is None else d.get("error_code", 0)
        if d is None or code == UnknownTopicOrPartitionError.errno:
            t.state = "missing"
        elif code == TopicAuthorizationFailedError.errno:  # also what a topic that does not exist gets
            t.state, t.why = "unknown", f"not authorized to describe it ({DENIED})"
        elif code:
            t.state, t.why = "unknown", f"Kafka answered {for_code(code).__name__}"
        else:
            parts = d.get("partitions") or []
            t.state = "exists"
            t.partitions = len(parts)
            t.replication = max((len(p.get("replica_nodes") or []) for p in parts), default=0)


def create(admin: Any, t: Topic, partitions: int, replication: int, deadline: float, who: str) -> bool:
    """Makes ``t``; True if it exists now (made here, or meanwhile by someone else: then it is
    described again). A refusal is kept in ``t.why``."""
    from kafka.errors import for_code

    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0:
        raise Expired
    spec = {"num_partitions": partitions, "replication_factor": replication}
    res = admin.create_topics({t.name: spec}, timeout_ms=left_ms, raise_errors=False)
    row = next((r for r in res.get("topics", []) if r.get("name") == t.name), None)
    if row is None:
        t.state, t.why = "refused", "the broker's answer did not name the topic"
        return False
    err = for_code(row.get("error_code", 0))
    if err.__name__ == "NoError":
        t.state, t.partitions, t.replication = "created", row["num_partitions"], row["replication_factor"]
        return True
    if err.__name__ == "TopicAlreadyExistsError":
        return True
    t.state, t.why = "refused", _refusal(t, err, row.get("error_message"), partitions, replication, who)
    return False


def _refusal(t: Topic, err: Any, message: str | None, partitions: int, replication: int, who: str) -> str:
    name = err.__name__
    if name in ("TopicAuthorizationFailedError", "ClusterAuthorizationFailedError"):
        return (
            f"not authorized to create it ({name}): {who} needs CREATE on the cluster or on topic "
            f"{t.name} (kafka-acls.sh --add --operation Create), or an administrator makes the topic"
        )
    said = message or getattr(err, "description", "") or name
    asked = (
        f"{'the broker default partitions' if partitions == BROKER_DEFAULT else _partitions(partitions)}, "
        f"replication factor {'the broker default' if replication == BROKER_DEFAULT else replication}"
    )
    return f"{asked} refused by the broker ({name}): {said}"


def line(t: Topic) -> str:
    kinds = ", ".join(t.kinds)
    if t.state in ("exists", "created"):
        shape = f"{_partitions(t.partitions)}, replication factor {t.replication}"
        return f"{t.name}: {t.state}, {shape} (kinds: {kinds})"
    if t.state == "unknown":
        return f"{t.name}: cannot tell: {t.why} (kinds: {kinds})"
    if t.state == "refused":
        return f"{t.name}: missing, not created: {t.why} (kinds: {kinds})"
    return f"{t.name}: missing (kinds: {kinds})"


def _partitions(n: int) -> str:
    return f"{n} partition{'s' * (n != 1)}"


def short_of(t: Topic, partitions: int | None, replication: int | None) -> list[str]:
    """What an existing topic has less of than asked, and how to add it (nothing is altered)."""
    out: list[str] = []
    if t.state not in ("exists", "created"):
        return out
    if partitions is not None and t.partitions < partitions:
        out.append(
            f"{t.name} has {_partitions(t.partitions)}, fewer than --partitions {partitions}: not altered "
            f"(kafka-topics.sh --alter --topic {t.name} --partitions {partitions} adds them; partitions "
            "are what lets more ingest processes share the work, each partition read by one)"
        )
    if replication is not None and t.replication < replication:
        out.append(
            f"{t.name} has replication factor {t.replication}, below --replication-factor {replication}: "
            "not altered (kafka-reassign-partitions.sh raises it)"
        )
    return out


def cmd_topics(a: argparse.Namespace) -> int:
    from gpuslo.app.cli import _service_config
    from gpuslo.app.text import terminal_safe
    from gpuslo.core.kafka_errors import explain
    from gpuslo.core.settings import SettingsError

    deadline = time.monotonic() + a.timeout_s
    cfg = _service_config(a)  # a bad config: SystemExit with its message, exit 2
    try:  # the password and TLS files resolve now: at connect they read as a broker down
        kw = cfg.kafka.client_kwargs()
    except SettingsError as exc:
        print(f"{PROG}: bad service config {a.service_config or '(the defaults)'}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    a.kafka_settings = cfg.kafka
    topics = config_topics(cfg.kafka.topics)
    servers = ",".join(cfg.kafka.bootstrap_servers)
    timeout_ms = max(1, int(a.timeout_s * 1000))
    quiet = None if a.verbose else _quiet_kafka()
    try:
        try:
            admin = open_admin({**kw, "request_timeout_ms": timeout_ms, "bootstrap_timeout_ms": timeout_ms})
        except Exception as exc:  # kafka-python: no broker, authentication, TLS
            why = explain(cfg.kafka, exc)
            if "accepts connections" in why:  # or a broker too slow for a short --timeout-s
                why += f"; waited --timeout-s {a.timeout_s:g}"
            print(f"{PROG}: {terminal_safe(why)}", file=sys.stderr)
            return EXIT_ERROR
        watchdog = _Watchdog(admin, deadline - time.monotonic())
        try:
            rc = _run(admin, a, topics, deadline)
        except Exception as exc:
            timed_out = type(exc).__name__ in ("RequestTimedOutError", "KafkaTimeoutError")
            if watchdog.fired or timed_out or isinstance(exc, Expired):
                why = f"no answer from Kafka at {servers} within --timeout-s {a.timeout_s:g}"
            else:
                why = f"Kafka at {servers} failed the request: {type(exc).__name__}: {_first_line(exc)}"
            print(f"{PROG}: {terminal_safe(why)}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            watchdog.cancel()
            admin.close()
    finally:
        if quiet is not None:
            logging.getLogger("kafka").setLevel(quiet)
    for t in topics:
        print(terminal_safe(line(t)))
    for t in topics:
        for note in short_of(t, a.partitions, a.replication_factor):
            print(f"{PROG}: {note}", file=sys.stderr)
    if rc == EXIT_MISSING:
        missing = [t.name for t in topics if t.state in ("missing", "refused")]
        hint = "" if a.create else f"; `{PROG} --create` makes them (or kafka-topics.sh --create)"
        print(f"{PROG}: {len(missing)} of {len(topics)} topics missing: {', '.join(missing)}{hint}",
              file=sys.stderr)  # fmt: skip
    elif rc == EXIT_ERROR:
        unknown = [t for t in topics if t.state == "unknown"]
        rights = (
            f": {_principal(a)} needs DESCRIBE on them (WRITE or READ grants it)"
            if any(DENIED in t.why for t in unknown)
            else ""
        )
        print(
            f"{PROG}: cannot tell whether {', '.join(t.name for t in unknown)} exist{rights}", file=sys.stderr
        )
    return rc


def _run(admin: Any, a: argparse.Namespace, topics: list[Topic], deadline: float) -> int:
    describe(admin, topics, deadline)
    if a.create:
        partitions = BROKER_DEFAULT if a.partitions is None else a.partitions
        replication = BROKER_DEFAULT if a.replication_factor is None else a.replication_factor
        who = _principal(a)
        raced = [
            t
            for t in topics
            if t.state == "missing" and create(admin, t, partitions, replication, deadline, who)
        ]
        raced = [t for t in raced if t.state != "created"]  # made meanwhile by someone else
        if raced:
            describe(admin, raced, deadline)
    if any(t.state == "unknown" for t in topics):
        return EXIT_ERROR
    if any(t.state in ("missing", "refused") for t in topics):
        return EXIT_MISSING
    return EXIT_OK


def _principal(a: argparse.Namespace) -> str:
    """Whom the broker authorizes, as the refusal names it (never the password)."""
    k = a.kafka_settings
    if k.security_protocol.startswith("SASL"):
        return f"user {k.sasl_username!r} (SASL {k.sasl_mechanism})"
    if k.ssl_certfile is not None:
        return "the principal of the client certificate"
    return "this client's principal (User:ANONYMOUS on a listener without authentication)"


def _quiet_kafka() -> int:
    """kafka-python's own log, off for the run (its level before, to put back): a broker down
    was a warning per try and an error besides the command's one line, which says it all
    (``-v`` keeps them)."""
    log = logging.getLogger("kafka")
    before = log.level
    log.setLevel(logging.CRITICAL + 1)
    return before


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    from gpuslo.app.cli import integer, seconds

    p = sub.add_parser(
        "topics",
        parents=[common],
        help="check the Kafka topics of the service config, and make the missing ones (--create)",
        description="One line per topic of the service config's kafka.topics (each once, with the kinds it "
        "carries): exists with its partitions and replication factor, or missing. Exit 0: all exist; 1: one "
        "is missing or could not be made; 2: Kafka could not be asked. Topics that exist are never altered.",
    )
    p.add_argument(
        "--config",
        type=path_arg,
        dest="service_config",
        help="service config YAML (its kafka section: servers, SASL/TLS, topics), as the agent and ingest read it",
    )
    p.add_argument("--kafka", type=text_arg, metavar="HOST:PORT[,..]",
                   help="bootstrap servers (override the config's; '-': the config's)")  # fmt: skip
    p.add_argument("--create", action="store_true", help="make the topics that are missing")
    p.add_argument(
        "--partitions",
        type=integer(1, MAX_PARTITIONS),
        metavar="N",
        help="partitions of a topic made (default: the broker's num.partitions); an existing topic with "
        "fewer is reported, not altered",
    )
    p.add_argument(
        "--replication-factor",
        type=integer(1, MAX_REPLICATION),
        metavar="R",
        help="replication factor of a topic made (default: the broker's default.replication.factor); an "
        "existing topic with a lower one is reported, not altered",
    )
    p.add_argument(
        "--timeout-s",
        type=seconds(0, 3600),
        default=DEFAULT_TIMEOUT_S,
        help="the whole run's bound: Kafka not answered by then is exit 2",
    )
    p.set_defaults(func=cmd_topics)

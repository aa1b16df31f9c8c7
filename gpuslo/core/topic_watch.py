"""Which of a Kafka client's topics the broker says it does not have.

A broker that does not make topics on first use (``auto.create.topics.enable=false``, as many
managed and production brokers run) answers a metadata request for a topic no one made with
UNKNOWN_TOPIC_OR_PARTITION. kafka-python logs that once at ERROR and goes on: the producer's
``send`` waits out ``max_block_ms`` and raises ``KafkaTimeoutError: Failed to update metadata``,
which the agent read as a broker down ("Kafka unavailable"); the consumer subscribes and reads
nothing, without another word, and noticed the topic only at its next scheduled metadata
refresh (kafka-python's default: every 5 minutes). Measured on the real broker.

:class:`TopicWatch` listens to the client's metadata updates, each one an answer from a broker
that is up, and keeps which of the topics the client asked about the answer had no partitions
for (a topic the client may not see is Kafka's authorization error, told apart). It logs a
topic that goes missing or comes back, once each, and says so in one line for the caller's
error. It reads kafka-python's cluster metadata (``ClusterMetadata.add_listener``,
``partitions_for_topic``, ``unauthorized_topics``); on a client without them it watches
nothing and says nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

# A topic a broker that makes topics on first use is making answers LEADER_NOT_AVAILABLE for a
# moment, with no partitions yet: missing only once no answer has had it for this long.
MISSING_AFTER_S = 3.0


def cluster_of(client: Any) -> Any | None:
    """kafka-python's ClusterMetadata of a producer (``_metadata``) or a consumer
    (``_client.cluster``); None for another client (a test's fake)."""
    cluster = getattr(client, "_metadata", None)
    if cluster is None:
        cluster = getattr(getattr(client, "_client", None), "cluster", None)
    needs = ("add_listener", "remove_listener", "partitions_for_topic")
    return cluster if cluster is not None and all(hasattr(cluster, n) for n in needs) else None


class TopicWatch:
    """The topics in ``wanted()`` that the broker's answers have had no partitions for since
    ``MISSING_AFTER_S`` (:attr:`missing`, sorted). ``where`` names the brokers in the log; ``what``
    says what waits on a missing topic, ``{it}`` standing for the topic or topics ("nothing is read
    from {it}")."""

    def __init__(
        self,
        client: Any,
        wanted: Callable[[], Iterable[str]],
        where: str,
        what: str,
        clock: Callable[[], float] = time.monotonic,
        told: Iterable[str] = (),
    ) -> None:
        self._wanted = wanted
        self._where = where
        self._what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._absent_since: dict[str, float] = {}  # topic -> first answer without it, in a row
        # topics logged as missing, not yet back; ``told``: by the watch of the client this one
        # replaces (a producer or consumer made anew), kept missing until an answer says otherwise,
        # so that a topic said missing is said back (a new watch knew nothing of it and never did)
        self._told: set[str] = set(told)
        self.missing: list[str] = sorted(self._told)
        self._answered_at: float | None = None  # when the last answer came (clock); None: none yet
        self._cluster = cluster_of(client)
        if self._cluster is not None:
            self._cluster.add_listener(self._updated)

    @property
    def watching(self) -> bool:
        return self._cluster is not None

    def close(self) -> None:
        if self._cluster is not None:
            with contextlib.suppress(KeyError):  # removed already
                self._cluster.remove_listener(self._updated)

    def _updated(self, cluster: Any) -> None:
        """kafka-python's listener, called on its IO thread after each metadata answer."""
        try:
            self.seen(cluster)
        except Exception:  # never let a log line break kafka-python's metadata update
            log.debug("topic watch failed", exc_info=True)

    def seen(self, cluster: Any) -> None:
        """A broker's answer: which wanted topics it had no partitions for (kept, not judged: a
        client may ask again only minutes later, so :meth:`check` judges by the clock)."""
        now = self._clock()
        denied = set(getattr(cluster, "unauthorized_topics", ()) or ())
        with self._lock:
            self._answered_at = now
            wanted = set(self._wanted())
            for topic in wanted:
                if cluster.partitions_for_topic(topic) is None and topic not in denied:
                    self._absent_since.setdefault(topic, now)
                else:
                    self._absent_since.pop(topic, None)
            for topic in list(self._absent_since):
                if topic not in wanted:
                    del self._absent_since[topic]

    def absent(self, within_s: float | None = None) -> list[str]:
        """The wanted topics the broker's last answer had no partitions for, however briefly (a
        topic being made on first use among them): the broker is up, whatever else failed. With
        ``within_s``, none unless that answer came within the last ``within_s`` seconds: a broker
        that answered without a topic and then went away is a broker down, not a topic missing."""
        with self._lock:
            if within_s is not None and (
                self._answered_at is None or self._clock() - self._answered_at > within_s
            ):
                return []
            return sorted(self._absent_since)

    def check(self) -> list[str]:
        """The topics missing now (sorted); logs each that went missing or came back since the
        last call, once. Called from the owner's own loop, cheap (no I/O)."""
        now = self._clock()
        with self._lock:
            if self._answered_at is None:  # no answer yet: what the replaced watch said stands
                return list(self.missing)
            missing = sorted(
                t
                for t, since in self._absent_since.items()
                if now - since >= MISSING_AFTER_S or t in self._told  # said missing, absent still
            )
            gone = [t for t in missing if t not in self._told]
            back = sorted(self._told - set(missing))
            self._told = set(missing)
            self.missing = missing
        if gone:
            log.warning("%s", self.words(gone))
        for topic in back:
            log.info("Kafka topic %s is there now (at %s)", topic, self._where)
        return missing

    @property
    def told(self) -> list[str]:
        """The topics logged as missing and not yet said back (for the watch that replaces this one)."""
        with self._lock:
            return sorted(self._told)

    def words(self, topics: list[str] | None = None) -> str:
        """One line for the missing topics (or ``topics``): what, where, what waits, what to do."""
        topics = self.missing if topics is None else topics
        if not topics:
            return ""
        names = ", ".join(topics)
        s = "" if len(topics) == 1 else "s"
        what = self._what.replace("{it}", "it" if s == "" else "them")  # the topics, as the count says
        return (
            f"Kafka at {self._where} has no topic{s} {names} and does not make topics on first use "
            f"(auto.create.topics.enable=false): {what} until {'it is' if s == '' else 'they are'} "
            f"made (gpuslo topics --create --config ..., or kafka-topics.sh --create)"
        )

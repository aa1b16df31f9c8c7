"""The ingest's stop after a commit that failed, on a real broker, the fault made at the commit
itself (the broker stopped or frozen as the first commit is made), so that it is that commit
that fails, whatever the machine's load:

- the broker restarting (it refuses connections: the commit fails at once, or waits out its
  whole timeout looking for a coordinator): the commit is judged refused, not unanswered, and
  the close tries it again once the broker is back, so the group's commit reaches what was
  written (da4a07b judged by the time alone, and with kafka-python's own reconnect backoff of up
  to 30 s the client was still waiting to reconnect when the close came: either way the close
  committed nothing, and every batch since the last commit was read again at the next start);
- the broker frozen (SIGSTOP: it holds the connection and answers nothing): the commit is
  judged unanswered, the close does not wait out another, and leaves the group within
  ``CLOSE_SHORT_MS`` (it tried twice more and then left: 22 s for a stop)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.ingest import kafka_consumer
from gpuslo.ingest.kafka_consumer import KafkaIngest
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.tables import SCHEMA
from tests.servers.kafka import KafkaBroker
from tests.test_ingest_faults import produce, workload
from tests.test_kafka import _committed, service_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    b = KafkaBroker(tmp_path_factory.mktemp("kafka-close"), libs=kafka_libs, partitions=1)
    b.start()
    try:
        yield b
    finally:
        b.stop()


def _answering(b: KafkaBroker, group: str, topics: list[str], within_s: float = 90.0) -> None:
    """Until the group's coordinator answers an offset fetch (loaded after a restart)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            _committed(b.bootstrap, group, topics)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _stop(b: KafkaBroker) -> Callable[[KafkaIngest], None]:
    """The broker stopped, and kafka-python told so (its connections closed, the group's
    coordinator marked dead by its heartbeat), as after a broker's restart has begun."""

    def stop(ing: KafkaIngest) -> None:
        b.stop()
        deadline = time.monotonic() + 60
        while ing.consumer._coordinator.coordinator_id is not None or any(
            c.connected for c in ing.consumer._client._manager._conns.values()
        ):
            assert time.monotonic() < deadline, "kafka-python kept the stopped broker as its coordinator"
            time.sleep(0.05)

    return stop


class Failed:
    """An ingest (the default 45 s session) that wrote its first batch, ``fault`` made just
    before its first commit, which then failed: its commit calls' offsets and times, its
    consumer's close timeouts, and what the failed commit held."""

    def __init__(
        self, b: KafkaBroker, tmp_path: Path, name: str, fault: Callable[[KafkaIngest], None]
    ) -> None:
        self.cfg, _ = service_config(tmp_path, name, b.bootstrap, batch_messages=20, session_timeout_s=45)
        produce(b.bootstrap, self.cfg, workload(self.cfg, 3, hours=0.05))
        self.store = ChdbStore(tmp_path / "store")
        self.store.migrate(SCHEMA)
        self.ing = ing = KafkaIngest(self.cfg.kafka, self.cfg.ingest, self.store)
        self.calls: list[dict[Any, Any]] = []
        self.at: list[float] = []
        self.took: list[float] = []
        self.closes: list[Any] = []
        commit, close = ing.consumer.commit, ing.consumer.close

        def committing(offsets: Any = None, *a: Any, **k: Any) -> Any:
            self.calls.append(dict(offsets or {}))
            self.at.append(time.monotonic())
            if len(self.calls) == 1:
                fault(ing)
            t0 = time.monotonic()
            try:
                return commit(offsets, *a, **k)
            finally:
                self.took.append(round(time.monotonic() - t0, 2))

        def closing(*a: Any, **k: Any) -> Any:
            self.closes.append(k.get("timeout_ms", a[0] if a else None))
            return close(*a, **k)

        ing.consumer.commit, ing.consumer.close = committing, closing
        self.held: dict[Any, Any] = {}

    def __enter__(self) -> Failed:
        deadline = time.monotonic() + 120
        while not self.calls:
            assert time.monotonic() < deadline, f"no commit in 120 s: {self.ing.failed}"
            self.ing.step()
        assert self.ing.metrics.commit_errors._value.get() == 1, (
            "the first commit, in the fault, did not fail"
        )
        self.held = dict(self.ing._uncommitted)
        assert self.held, "the failed commit's offsets were not kept for the next try"
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.closes:
            self.ing.close()
        self.store.close()

    @property
    def topics(self) -> list[str]:
        return sorted({tp.topic for tp in self.held})

    def group(self, b: KafkaBroker) -> dict[Any, int | None]:
        """The group's commit of each partition the failed commit held, once its coordinator answers."""
        _answering(b, self.cfg.ingest.group_id, self.topics)
        got = _committed(b.bootstrap, self.cfg.ingest.group_id, self.topics)
        return {tp: got[f"{tp.topic}/{tp.partition}"] for tp in self.held}


def test_a_commit_failed_while_the_broker_restarted_is_made_at_close(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    try:
        with Failed(broker, tmp_path, "restarted", _stop(broker)) as f:
            assert f.ing._unanswered_at is None, f"a broker refusing connections was judged silent: {f.took}"
            broker.start()
            _answering(broker, f.cfg.ingest.group_id, f.topics)
            f.ing.close()  # SIGTERM now, the broker back and answering
            assert len(f.calls) >= 2, "the close did not try the commit again"
            assert f.ing.metrics.commit_errors._value.get() == 1, f"the close's commit failed too: {f.took}"
            for tp, got in f.group(broker).items():
                assert got is not None and got >= f.held[tp].offset, (tp, got, f.held[tp].offset, f.took)
            assert f.closes == [kafka_consumer.CLOSE_TIMEOUT_MS]
    finally:
        if broker.proc is None:  # failed in the outage: the next test has its broker
            broker.start()


def test_a_stop_after_a_commit_the_frozen_broker_left_unanswered_tries_no_other(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    assert broker.proc is not None
    pid = broker.proc.pid
    frozen: list[bool] = []

    def freeze(_: KafkaIngest) -> None:
        os.killpg(pid, signal.SIGSTOP)
        frozen.append(True)

    try:
        with Failed(broker, tmp_path, "frozen", freeze) as f:
            assert f.ing._unanswered_at is not None, (
                f"a broker that answered nothing was judged refusing: {f.took}"
            )
            unanswered_at = f.ing._unanswered_at
            f.ing.close()  # SIGTERM right after it
            # not again, unless the close's own writes took longer than the hold (a loaded machine)
            again = [t - unanswered_at for t in f.at[1:]]
            assert all(s >= kafka_consumer.UNANSWERED_HOLD_S for s in again), (
                f"the close waited out another commit to a broker that does not answer, {again} s after"
            )
            assert f.closes == [kafka_consumer.CLOSE_SHORT_MS]
    finally:
        if frozen:
            os.killpg(pid, signal.SIGCONT)
    # the commit the frozen broker held in its socket may land once it runs again (the request was
    # sent; the client gave up on its answer): never past what was written, and what it does not
    # cover is read again by the next start
    for tp, got in f.group(broker).items():
        assert got is None or got <= f.held[tp].offset, (tp, got, f.held[tp].offset)

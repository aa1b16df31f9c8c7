"""The ingest's stop after a commit that failed, on a real broker: a commit that failed while
the broker restarted (it refused connections: kafka-python waited out the whole commit timeout
for a coordinator all the same) is tried again at close, the broker back; only one that a broker
left unanswered (frozen, or a firewall that drops) is not. da4a07b told the two apart by the
time the commit took alone: after a broker restart with
the default 45 s session, the close committed nothing of what was written (measured: every
partition's commit left where it was; before da4a07b all of it was committed at close)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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


def _answering(b: KafkaBroker, topic: str, within_s: float = 90.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            _committed(b.bootstrap, "probe", [topic])
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _ingest_whose_commit_fails(
    b: KafkaBroker, tmp_path: Path, name: str, outage: Any
) -> tuple[KafkaIngest, ChdbStore, list[float], Any]:
    """An ingest (the default 45 s session) that wrote its first batch, whose commit then failed
    in ``outage``; the times of its commit calls."""
    cfg, _ = service_config(tmp_path, name, b.bootstrap, batch_messages=20, session_timeout_s=45)
    produce(b.bootstrap, cfg, workload(cfg, 3, hours=0.05))
    st = ChdbStore(tmp_path / "store")
    st.migrate(SCHEMA)

    def hook(n: int) -> None:
        if n == 1:
            outage()

    ing = KafkaIngest(cfg.kafka, cfg.ingest, st, after_write=hook)
    calls: list[float] = []
    real = ing.consumer.commit

    def commit(*a: Any, **k: Any) -> Any:
        calls.append(time.monotonic())
        return real(*a, **k)

    ing.consumer.commit = commit
    deadline = time.monotonic() + 120
    while ing.metrics.commit_errors._value.get() == 0:
        assert time.monotonic() < deadline, (
            f"no commit failed: {ing.consumer.assignment()} {ing._pending[:1]} {ing.failed} {ing._stopped}"
        )
        ing.step()
    return ing, st, calls, cfg


def test_a_commit_failed_while_the_broker_restarted_is_tried_again_at_close(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    ing, st, calls, cfg = _ingest_whose_commit_fails(broker, tmp_path, "restarted", broker.stop)
    back = threading.Thread(target=lambda: (broker.start(), _answering(broker, cfg.kafka.topics.heartbeat)))
    back.start()
    try:
        while back.is_alive():  # the ingest runs on meanwhile: its commits fail until the broker is back
            ing.step()
        before = len(calls)
        assert ing.metrics.commit_errors._value.get() >= 1
        if not ing._uncommitted:
            pytest.skip("a commit made it after the broker came back: nothing left for the close")
        ing.close()  # SIGTERM now, the broker back and answering
        assert len(calls) > before, "the close did not try the commit again"
    finally:
        back.join()
        st.close()

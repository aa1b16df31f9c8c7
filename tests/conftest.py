from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ingest.store import ChdbStore

if TYPE_CHECKING:
    from tests.servers.kafka import KafkaBroker


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChdbStore]:
    """A fresh embedded store. chDB allows one data directory per process at a time,
    so it is closed after each test."""
    s = ChdbStore(tmp_path / "store")
    s.migrate()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def kafka_libs() -> Path:
    from tests.servers.kafka import provision

    return provision()


@pytest.fixture(scope="session")
def kafka(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """One real Apache Kafka broker for the test session (KRaft, 3 partitions per topic)."""
    from tests.servers.kafka import KafkaBroker

    b = KafkaBroker(tmp_path_factory.mktemp("kafka"), libs=kafka_libs)
    b.start()
    try:
        yield b
    finally:
        b.stop()

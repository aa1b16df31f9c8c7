from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ingest.store import ChdbStore


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

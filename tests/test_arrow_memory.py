"""The Kafka ingest's Arrow allocator (gpuslo.ingest.arrow_memory): jemalloc, or the system's
where pyarrow has no jemalloc, never mimalloc unless the operator asks for it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pyarrow as pa
import pytest

from gpuslo.core.settings import IngestSettings, KafkaSettings
from gpuslo.ingest.arrow_memory import POOL_ENV, use_ingest_pool
from gpuslo.ingest.kafka_consumer import KafkaIngest
from tests.test_ingest_commits import Consumer, Recording


@pytest.fixture
def pool_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = pa.default_memory_pool()
    monkeypatch.delenv(POOL_ENV, raising=False)
    try:
        yield
    finally:
        pa.set_memory_pool(before)


def _fresh(env: dict[str, str]) -> str:
    """``use_ingest_pool()`` in a fresh interpreter: the pool it reports, then the default's."""
    code = (
        "import pyarrow as pa; from gpuslo.ingest.arrow_memory import use_ingest_pool; "
        "print(use_ingest_pool(), pa.default_memory_pool().backend_name)"
    )
    base = {k: v for k, v in os.environ.items() if k != POOL_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    return out.stdout.strip()


def test_a_fresh_process_leaves_mimalloc_for_jemalloc_or_the_system_allocator() -> None:
    said, default = _fresh({}).split()
    assert said == default
    assert default in ("jemalloc", "system")
    if "jemalloc" in pa.supported_memory_backends():
        assert default == "jemalloc"


@pytest.mark.parametrize("backend", ["mimalloc", "system"])
def test_the_operators_choice_stands(backend: str) -> None:
    if backend not in pa.supported_memory_backends():
        pytest.skip(f"this pyarrow has no {backend}")
    assert _fresh({POOL_ENV: backend}) == f"{backend} {backend}"


@pytest.mark.parametrize("value", ["bogus", "JEMALLOC"])
def test_a_pool_arrow_does_not_have_is_no_choice_and_is_replaced(value: str) -> None:
    """Arrow warns "Unsupported backend" and falls back to mimalloc: that is not the operator's
    choice, and it is the pool the ingest avoids."""
    said, default = _fresh({POOL_ENV: value}).split()
    assert said == default != "mimalloc"


def test_without_jemalloc_the_system_allocator(pool_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> pa.MemoryPool:
        raise NotImplementedError("jemalloc support is not built")

    monkeypatch.setattr(pa, "jemalloc_memory_pool", missing)
    pa.set_memory_pool(pa.mimalloc_memory_pool())
    assert use_ingest_pool() == "system"
    assert pa.default_memory_pool().backend_name == "system"


def test_the_kafka_ingest_builds_its_batches_from_that_pool(pool_restored: None) -> None:
    pa.set_memory_pool(pa.mimalloc_memory_pool())
    ing = KafkaIngest(KafkaSettings(), IngestSettings(metrics_port=0), Recording(),
                      consumer_factory=lambda **_: Consumer(1))  # fmt: skip
    try:
        assert ing.arrow_pool == pa.default_memory_pool().backend_name != "mimalloc"
        before = pa.default_memory_pool().bytes_allocated()
        batch = pa.array(range(100_000), pa.int64())  # what the decoding allocates: from that pool
        assert pa.default_memory_pool().bytes_allocated() - before >= 800_000
        del batch
    finally:
        ing.close()

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.tables import SCHEMA

if TYPE_CHECKING:
    from gpuslo.agent.sim.fleet import SimConfig
    from gpuslo.app.embedded import DemoResult
    from tests.servers.k8s import KubeControlPlane
    from tests.servers.kafka import KafkaBroker


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChdbStore]:
    """A fresh embedded store. chDB allows one data directory per process at a time,
    so it is closed after each test."""
    s = ChdbStore(tmp_path / "store")
    s.migrate(SCHEMA)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def short_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[SimConfig, DemoResult, Path]:
    """One demo run of the 4-hour compressed scenario (tests.helpers.short_sim: seed 1, 2 nodes),
    shared by the fast tier's pipeline and dashboard tests: (its config, its result, its output
    directory, the store under ``store/``)."""
    from gpuslo.app.embedded import run_demo
    from gpuslo.rules.config import example
    from tests.helpers import short_sim

    out = tmp_path_factory.mktemp("short-demo")
    sim = short_sim(seed=1, nodes=2)
    return sim, run_demo(sim, example(), out), out


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


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeControlPlane]:
    """A real control plane for the session: etcd, kube-apiserver, kube-scheduler built from the
    Go module proxy by provision/k8s.sh (cached in ~/.cache/gpuslo). Where it cannot be built
    the tests are skipped with the reason; GPUSLO_REQUIRE_K8S=1 (the test command) makes that
    a failure instead."""
    from tests.servers.k8s import KubeControlPlane, provision

    try:
        bin_dir = provision()
    except RuntimeError as exc:
        if os.environ.get("GPUSLO_REQUIRE_K8S") == "1":
            raise
        pytest.skip(f"no Kubernetes control plane here: {exc}")
    for attempt in range(3):  # a free port taken by someone else before a server bound it: retry
        k = KubeControlPlane(tmp_path_factory.mktemp("kube"), bin_dir)
        try:
            k.start()
            break
        except RuntimeError as exc:
            k.stop()
            if "address already in use" not in str(exc) or attempt == 2:
                raise
    try:
        yield k
    finally:
        k.stop()

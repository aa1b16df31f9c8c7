from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.tables import SCHEMA

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuslo.agent.sim.fleet import SimConfig
    from gpuslo.app.embedded import DemoResult
    from tests.servers.alertmanager import Alertmanager
    from tests.servers.backend import Backend
    from tests.servers.k8s import KubeControlPlane
    from tests.servers.kafka import KafkaBroker


def pytest_configure(config: pytest.Config) -> None:
    """A GPUSLO_TEST_SERVERS that names no back-end stops the run at once, with the allowed values."""
    from tests.servers.backend import BackendError, parse_choice

    try:
        parse_choice(os.environ)
    except BackendError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest test files first (tests/ordering.py): the workers of ``--dist loadfile`` take
    files in this order, so no long file starts last and runs alone. First of the hooks: ``--sw``
    skips what comes before the last failure in this order, the order the tests ran in (after it,
    a file collected earlier but never run was skipped as passed)."""
    from tests.ordering import longest_first, weights

    items[:] = longest_first(items, weights())


@pytest.fixture(scope="session")
def server_backend() -> Backend:
    """The back-end of the integration fixtures (tests/servers/backend.py): local processes, or
    containers where a Docker engine answers (GPUSLO_TEST_SERVERS=containers|local|auto)."""
    from tests.servers.backend import BackendError, select

    try:
        return select(os.environ)
    except BackendError as exc:  # containers asked for and no engine: the run is wrong, not skipped
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def container_backend(server_backend: Backend) -> Backend:
    """For the tests that only a container can serve (ClickHouse >= 24.8, Grafana): skipped with
    the reason where the back-end is local ("no Docker engine reachable at ...")."""
    if not server_backend.containers:
        pytest.skip(f"needs a container: {server_backend.reason}")
    return server_backend


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
def kafka(
    server_backend: Backend, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KafkaBroker]:
    """One real Apache Kafka broker for the test session (KRaft, 3 partitions per topic): the
    local jars, or the compose file's image with the same configuration and ports."""
    from tests.servers.kafka import KafkaBroker

    workdir = tmp_path_factory.mktemp("kafka")
    if server_backend.containers:
        b = KafkaBroker(workdir, container=True)
    else:
        b = KafkaBroker(workdir, libs=request.getfixturevalue("kafka_libs"))
    b.start()
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="session")
def kafka_no_autocreate(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A real Apache Kafka broker that makes no topic on first use (``auto.create.topics.enable=
    false``, as managed brokers run), 2 partitions per topic made without a count; each test
    names its topics apart."""
    from tests.servers.kafka import KafkaBroker

    b = KafkaBroker(
        tmp_path_factory.mktemp("kafka-noauto"), libs=kafka_libs, partitions=2, auto_create_topics=False
    )
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def make_alertmanager(server_backend: Backend) -> Callable[..., Alertmanager]:
    """``make_alertmanager(workdir, config="")``: a real Alertmanager (not started) on the chosen
    back-end: Debian's, or the compose file's image with the same configuration and port."""
    from tests.servers.alertmanager import Alertmanager

    def make(workdir: Path, config: str = "") -> Alertmanager:
        return Alertmanager(workdir, config, container=server_backend.containers)

    return make


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

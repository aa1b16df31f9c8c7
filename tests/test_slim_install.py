"""A fresh virtualenv with only gpuslo[agent] installed (by pip, from a copy of this checkout, with
the pins): the agent runs on the simulated fleet, chdb, pyarrow, the ClickHouse driver and grafanalib
are not importable, the component folders exist only as gpuslo.agent, gpuslo.ingest, ..., and the
distributions installed are exactly what the agent extra asks for."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.install import VENV_OWN, InstallError, installed, make_venv, site_packages, size_mb
from gpuslo.wire import decode
from tests.distributions import closure, norm

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
NOT_IN_THE_AGENT = ("chdb", "pyarrow", "clickhouse_driver", "grafanalib", "pandas")


@pytest.fixture(scope="module")
def agent_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return make_venv(("agent",), tmp_path_factory.mktemp("agent-venv"))
    except InstallError as exc:
        pytest.fail(str(exc))


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{python.parent}:/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run([*args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_agent_runs_on_the_simulated_fleet(agent_python: Path, tmp_path: Path) -> None:
    r = _run(
        agent_python,
        str(agent_python.parent / "gpuslo"),
        "agent",
        "--source",
        "sim",
        "--hours",
        "0.01",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    kinds = {decode(line.encode()).kind for line in r.stdout.splitlines()}
    assert {"gpu_samples", "heartbeat", "latency"} <= kinds


@pytest.mark.parametrize("module", NOT_IN_THE_AGENT)
def test_store_and_dashboard_libraries_are_not_importable(
    agent_python: Path, tmp_path: Path, module: str
) -> None:
    r = _run(agent_python, str(agent_python), "-c", f"import {module}", cwd=tmp_path)
    assert r.returncode == 1 and f"No module named '{module}'" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["agent", "ingest", "rules", "dashboards"])
def test_components_exist_only_under_the_gpuslo_namespace(
    agent_python: Path, tmp_path: Path, name: str
) -> None:
    bare = _run(agent_python, str(agent_python), "-c", f"import {name}", cwd=tmp_path)
    assert bare.returncode == 1 and f"No module named '{name}'" in bare.stderr, bare.stderr
    ours = _run(
        agent_python,
        str(agent_python),
        "-c",
        f"import gpuslo.{name}; print(gpuslo.{name}.__file__)",
        cwd=tmp_path,
    )
    assert ours.returncode == 0, ours.stderr
    assert Path(ours.stdout.strip()).is_relative_to(site_packages(agent_python))


def test_a_store_command_says_which_extra_it_needs(agent_python: Path, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("")
    gpuslo = str(agent_python.parent / "gpuslo")
    r = _run(agent_python, gpuslo, "ingest", "--file", "in.jsonl", "--store", "st", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "gpuslo ingest: the Python module 'pyarrow' is not installed; this command needs gpuslo[ingest]: "
        "pip install 'gpuslo[ingest]'"
    ], r.stderr


def test_exactly_the_agent_extra_is_installed_at_the_pins(agent_python: Path) -> None:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, _, version = line.split("#", 1)[0].strip().partition("==")
        if version:
            pins[norm(name)] = version
    got = {norm(n): v for n, v in installed(agent_python).items()}
    got = {n: v for n, v in got.items() if n not in {norm(x) for x in VENV_OWN} | {"gpuslo"}}
    assert set(got) == closure(("agent",))
    assert {n: v for n, v in got.items() if pins.get(n) != v} == {}, "installed versions differ from the pins"
    print(f"gpuslo[agent] site-packages: {size_mb(site_packages(agent_python)):.1f} MB")

"""Each role runs on its own extra: every command is run in a subprocess where a module outside the
distributions its extra pulls in (read from pyproject.toml and the installed packages' own metadata)
cannot be imported, as in an environment holding only that extra; the agent's path never even
tries chdb, pyarrow, clickhouse_driver or grafanalib. A command run without its extra says which
extra to install, in one line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuslo.app.entry import COMMAND_EXTRA, OPTIONAL_MODULES, missing_extra
from gpuslo.wire import decode
from tests.distributions import PROJECT, by_module, closure, modules

ROOT = Path(__file__).resolve().parents[1]
STORE_AND_DASHBOARD_MODULES = {"chdb", "pyarrow", "clickhouse_driver", "grafanalib"}

# Runs one gpuslo command with an import hook in front of every finder: a top-level module of an
# installed distribution outside the allowed ones raises ModuleNotFoundError (as if it were not
# installed) and is recorded. Writes what was blocked and what was loaded to a JSON file.
HOOK = r"""
import atexit, importlib.abc, json, sys
absent, out, argv = set(json.loads(sys.argv[1])), sys.argv[2], json.loads(sys.argv[3])
blocked = []
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in absent:
            return None
        blocked.append(name)
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
def report():
    with open(out, "w") as fh:
        loaded = sorted({m.partition(".")[0] for m in sys.modules})
        ours = sorted(m for m in sys.modules if m.startswith("gpuslo."))
        json.dump({"blocked": sorted(set(blocked)), "loaded": loaded, "modules": ours}, fh)
atexit.register(report)
if argv[:1] == ["--import"]:  # import every module of the packages named
    import importlib, pkgutil
    for root in argv[1:]:
        importlib.import_module(root)
        for info in pkgutil.walk_packages(getattr(sys.modules[root], "__path__", []), root + "."):
            importlib.import_module(info.name)
    sys.exit(0)
from gpuslo.app.entry import main
sys.exit(main(argv))
"""


def _absent(dists: frozenset[str]) -> str:
    """The top-level modules of every installed distribution but `dists` (and gpuslo), as JSON."""
    keep = set(modules(dists | {"gpuslo"}))
    return json.dumps(sorted(set(by_module()) - keep))


def run_as(dists: frozenset[str], argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], Any]:
    """`gpuslo ARGV` in `cwd` as if only `dists` (and the standard library) were installed."""
    out = cwd / "imports.json"
    r = subprocess.run(
        [sys.executable, "-c", HOOK, _absent(dists), str(out), json.dumps(argv)],
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return r, json.loads(out.read_text())


def with_extra(extra: str) -> frozenset[str]:
    return closure((extra,))


def _ours(names: list[str]) -> set[str]:
    """The blocked modules that belong to a gpuslo dependency (not a library's optional probe)."""
    return {n.partition(".")[0] for n in names} & set(modules(closure(("all",))))


def _imported_by_gpuslo() -> set[str]:
    """The top-level modules gpuslo's own code imports (anywhere in a module, lazily or not)."""
    names: set[str] = set()
    for folder in ("gpuslo", "agent", "ingest", "rules", "dashboards"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name.partition(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.partition(".")[0])
    return names


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_the_extras_and_the_optional_modules_agree() -> None:
    """Both ways: every module gpuslo imports from a distribution only an extra adds is one the
    entry point explains when missing, and every one it explains is imported and comes from an extra."""
    base = closure(())
    added = set().union(*(closure((e,)) for e in PROJECT["optional-dependencies"] if e != "test")) - base
    from_extras = {m for m in _imported_by_gpuslo() if m in set(modules(frozenset(added)))}
    assert from_extras == OPTIONAL_MODULES
    assert closure(("all",)) >= added
    for extra in COMMAND_EXTRA.values():
        assert extra in PROJECT["optional-dependencies"]


def test_the_core_needs_no_extra() -> None:
    base = closure(())
    assert (
        base & {"chdb", "pyarrow", "numpy", "grafanalib", "clickhouse-driver", "kafka-python", "grpcio"}
        == set()
    )
    for module in modules(base):
        assert module not in OPTIONAL_MODULES


def test_the_agent_extra_holds_no_store_or_dashboard_library() -> None:
    assert (
        closure(("agent",)) & {"chdb", "chdb-core", "pyarrow", "pandas", "grafanalib", "clickhouse-driver"}
        == set()
    )


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_agent_sim_runs_on_the_agent_extra_alone(tmp_path: Path) -> None:
    r, seen = run_as(with_extra("agent"), ["agent", "--source", "sim", "--hours", "0.01"], tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines
    kinds = {decode(line.encode()).kind for line in lines}
    assert {"gpu_samples", "heartbeat"} <= kinds
    assert _ours(seen["blocked"]) == set(), seen["blocked"]
    assert set(seen["loaded"]) & STORE_AND_DASHBOARD_MODULES == set()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_every_agent_module_imports_on_the_agent_extra(tmp_path: Path) -> None:
    """Not only the simulated fleet's path: every module of the agent (NVML, Slurm, Kubernetes,
    scrapes, Kafka sink, exporter), the wire, the settings and the CLI import with the agent extra."""
    roots = ["gpuslo.agent", "gpuslo.wire", "gpuslo.core", "gpuslo.app.cli", "gpuslo.app.entry"]
    r, seen = run_as(with_extra("agent"), ["--import", *roots], tmp_path)
    assert r.returncode == 0, r.stderr
    assert {"gpuslo.agent.nvml", "gpuslo.agent.k8s", "gpuslo.agent.kafka_sink"} <= set(seen["modules"])
    assert _ours(seen["blocked"]) == set(), seen["blocked"]
    assert set(seen["loaded"]) & STORE_AND_DASHBOARD_MODULES == set()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_the_agent_never_tries_a_store_or_dashboard_library(tmp_path: Path) -> None:
    """Allowed everything installed but chdb, pyarrow, clickhouse_driver and grafanalib: the agent's
    path must not even attempt them (a caught ImportError would hide a slow, heavy import)."""
    everything = closure(("all", "test"))
    dists = frozenset(everything - {"chdb", "chdb-core", "pyarrow", "clickhouse-driver", "grafanalib"})
    r, seen = run_as(dists, ["agent", "--source", "sim", "--hours", "0.01"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert {b.partition(".")[0] for b in seen["blocked"]} & STORE_AND_DASHBOARD_MODULES == set()


@pytest.mark.parametrize(
    ("extra", "argv"),
    [
        ("rules", ["rules", "export-prometheus"]),
        ("ingest", ["schema"]),
        ("dashboards", ["dashboards", "generate", "--out", "dash"]),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_command_runs_on_its_extra(extra: str, argv: list[str], tmp_path: Path) -> None:
    r, seen = run_as(with_extra(extra), argv, tmp_path)
    assert r.returncode == 0, r.stderr
    assert _ours(seen["blocked"]) == set(), seen["blocked"]


def test_a_command_without_its_extra_says_which_to_install(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("")
    r, seen = run_as(with_extra("agent"), ["ingest", "--file", "in.jsonl", "--store", "st"], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("pip install 'gpuslo[ingest]'"), r.stderr
    assert _ours(seen["blocked"])  # it did need a module the agent extra lacks


def test_missing_extra_line() -> None:
    exc = ModuleNotFoundError("No module named 'chdb'", name="chdb")
    assert missing_extra(exc, ["-v", "rules", "eval"], lambda m: False) == (
        "gpuslo rules: the Python module 'chdb' is not installed; this command needs gpuslo[rules]: "
        "pip install 'gpuslo[rules]'"
    )
    assert missing_extra(ModuleNotFoundError("x", name="pyarrow.compute"), [], lambda m: False) == (
        "gpuslo: the Python module 'pyarrow' is not installed; this command needs gpuslo[all]: "
        "pip install 'gpuslo[all]'"
    )
    # installed, but a part of it is missing (a half-installed or broken wheel): not "install the
    # extra", which pip would answer with "already satisfied"; the real installation is asked
    for name in ("pyarrow.compute", "chdb._chdb", "kafka.vendor.six"):
        assert missing_extra(ModuleNotFoundError("x", name=name), ["ingest"]) is None
    # a module of gpuslo itself, or one no extra provides, is a bug: not explained away
    assert missing_extra(ModuleNotFoundError("x", name="gpuslo.nope"), ["agent"]) is None
    assert missing_extra(ModuleNotFoundError("x", name="requests"), ["agent"]) is None
    assert missing_extra(ModuleNotFoundError("x", name=None), ["agent"]) is None


@pytest.mark.integration
def test_store_commands_run_on_their_extras(tmp_path: Path) -> None:
    r, _ = run_as(
        with_extra("agent"),
        [
            "agent",
            "--source",
            "sim",
            "--hours",
            "0.2",
            "--start",
            "2026-11-28T00:00:00Z",
            "--out",
            "fleet.jsonl",
        ],
        tmp_path,
    )  # the window below holds the data (it read an empty window: the fleet started yesterday)
    assert r.returncode == 0, r.stderr
    window = ["--from", "2026-11-28T00:00:00Z", "--to", "2026-11-28T00:10:00Z"]
    for extra, argv in [
        ("ingest", ["ingest", "--file", "fleet.jsonl", "--store", "st"]),
        ("rules", ["rules", "eval", "--store", "st", *window, "--json"]),
        ("dashboards", ["report", "--store", "st", *window, "--out", "r.html"]),
    ]:
        r, seen = run_as(with_extra(extra), argv, tmp_path)
        assert r.returncode == 0, (argv, r.stderr)
        assert _ours(seen["blocked"]) == set(), (argv, seen["blocked"])
    assert (tmp_path / "r.html").stat().st_size > 0

"""The layer contract (pyproject's [tool.importlinter]) holds for the tree, and it is a contract that
can break: each kind of back-edge, added to a copy of the package, makes `lint-imports` fail and
name the contract it broke."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_tree(tmp: Path) -> Path:
    """The package as installed: gpuslo/ with its component links followed, and the contract."""
    dst = tmp / "tree"
    dst.mkdir()
    shutil.copytree(
        ROOT / "gpuslo", dst / "gpuslo", symlinks=False, ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_tree_keeps_every_contract() -> None:
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout
    # every component is in the graph (a link that grimp did not follow would keep contracts trivially)
    for pkg in ("gpuslo.agent", "gpuslo.ingest", "gpuslo.rules", "gpuslo.dashboards", "gpuslo.app"):
        assert (ROOT / pkg.replace(".", "/") / "__init__.py").exists()


@pytest.mark.parametrize(
    ("module", "back_edge", "contract"),
    [
        ("gpuslo/wire/models.py", "import gpuslo.core.settings", "Layers point one way"),
        ("gpuslo/ingest/store.py", "import gpuslo.rules.config", "Layers point one way"),
        ("gpuslo/rules/config.py", "import gpuslo.dashboards.spec", "Layers point one way"),
        ("gpuslo/dashboards/spec.py", "import gpuslo.app.cli", "Layers point one way"),
        ("gpuslo/agent/base.py", "import gpuslo.ingest.store", "The agent depends on the wire and core only"),
        ("gpuslo/rules/sql.py", "import gpuslo.agent.base", "The store side does not import the agent"),
        ("gpuslo/agent/runner.py", "import chdb", "No store or dashboard library in the agent"),
    ],
)
def test_a_back_edge_breaks_the_contract(tmp_path: Path, module: str, back_edge: str, contract: str) -> None:
    tree = copy_tree(tmp_path)
    target = tree / module
    target.write_text(target.read_text() + f"\n{back_edge}  # noqa\n")
    r = lint(tree)
    assert r.returncode != 0, r.stdout
    verdicts = [
        line.rstrip()
        for line in r.stdout.splitlines()
        if line.rstrip() in (f"{contract} KEPT", f"{contract} BROKEN")
    ]
    assert verdicts == [f"{contract} BROKEN"], r.stdout


def test_only_the_gpuslo_namespace_is_installed(tmp_path: Path) -> None:
    """Installed gpuslo puts one name at top level: outside the checkout, `import agent` (or rules,
    ingest, dashboards: names other PyPI projects install) fails and `import gpuslo.agent` works."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import importlib, importlib.util\n"
        "for bare in ('agent', 'ingest', 'rules', 'dashboards'):\n"
        "    assert importlib.util.find_spec(bare) is None, bare\n"
        "    print(importlib.import_module('gpuslo.' + bare).__name__)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gpuslo.agent", "gpuslo.ingest", "gpuslo.rules", "gpuslo.dashboards"]

"""The pinned versions (constraints.txt) are what the suite runs with, and pin every dependency."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[_norm(name)] = version
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [r for r in extra if not r.startswith("gpuslo")]
    return {_norm(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in reqs}


def test_every_dependency_is_pinned() -> None:
    missing = _requirement_names() - set(_pins())
    assert not missing, f"pyproject dependencies without a pin in constraints.txt: {sorted(missing)}"


def test_installed_versions_are_the_pins() -> None:
    wrong = {}
    for name, version in _pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong[name] = (version, None)
            continue
        if installed != version:
            wrong[name] = (version, installed)
    assert not wrong, f"pinned vs installed: {wrong}"


def test_install_commands_use_the_pins() -> None:
    assert "-c constraints.txt" in (ROOT / "scripts" / "test.sh").read_text()
    assert "-c constraints.txt" in (ROOT / "Dockerfile").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "pip install -q -c constraints.txt -e '.[all]'" in readme

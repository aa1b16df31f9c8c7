"""What `pip install gpuslo[EXTRA]` installs: the distributions, from pyproject.toml and, below its
requirements, each installed distribution's own metadata; and the top-level modules they provide."""

from __future__ import annotations

import re
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def closure(extras: tuple[str, ...]) -> frozenset[str]:
    """Every distribution `pip install gpuslo[extras]` installs (normalised names), from the
    project's requirements and, below them, each installed distribution's own metadata."""
    optional = PROJECT["optional-dependencies"]
    todo = [(r, "") for r in PROJECT["dependencies"]] + [(r, "") for e in extras for r in optional[e]]
    expanded: set[tuple[str, str]] = set()
    dists: set[str] = set()
    while todo:
        text, context = todo.pop()  # context: the extra of the distribution that asked for it
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": context}):
            continue
        name = norm(req.name)
        if name == "gpuslo":  # gpuslo[rules] inside another extra
            todo += [(r, "") for e in req.extras for r in optional[e]]
            continue
        dists.add(name)
        for extra in ("", *req.extras):
            if (name, extra) not in expanded:
                expanded.add((name, extra))
                todo += [(sub, extra) for sub in metadata.requires(name) or []]
    return frozenset(dists)


@cache
def by_module() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions that provide it."""
    return dict(metadata.packages_distributions())


def modules(dists: frozenset[str]) -> list[str]:
    return sorted(m for m, ds in by_module().items() if {norm(d) for d in ds} & dists)

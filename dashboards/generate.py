"""Write the dashboards as sorted-key Grafana JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder

from dashboards import overview, views
from dashboards.spec import PanelSpec, build
from rules.config import RulesConfig

# file → (title, uid, panel specs, template variables beyond cluster)
VIEWS: dict[str, tuple[str, str, Callable[[RulesConfig], list[PanelSpec]], tuple[str, ...]]] = {
    "node-gpu.json": ("gpuslo / Node and GPU", "gpuslo-node-gpu", views.node_gpu, ("node",)),
    "workloads.json": ("gpuslo / Workloads", "gpuslo-workloads", views.workloads, ("job",)),
    "scheduler.json": ("gpuslo / Scheduler and starvation", "gpuslo-scheduler", views.scheduler, ()),
    "slo.json": ("gpuslo / SLOs", "gpuslo-slo", views.slo, ()),
}


def _view(name: str) -> Callable[[RulesConfig], Any]:
    title, uid, specs, variables = VIEWS[name]
    return lambda cfg: build(title, uid, specs(cfg), views.templating(*variables))


DASHBOARDS: dict[str, Callable[[RulesConfig], Any]] = {
    "fleet-overview.json": overview.dashboard,
    **{name: _view(name) for name in VIEWS},
}


def render(cfg: RulesConfig) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, make in DASHBOARDS.items():
        data: Any = make(cfg).to_json_data()
        out[name] = json.dumps(data, cls=DashboardEncoder, sort_keys=True, indent=2) + "\n"
    return out


def write(cfg: RulesConfig, directory: str | Path) -> list[Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render(cfg).items():
        p = d / name
        p.write_text(text)
        paths.append(p)
    return paths

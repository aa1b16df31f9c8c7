"""Write the dashboards as sorted-key Grafana JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder

from dashboards import overview
from rules.config import RulesConfig

DASHBOARDS = {"fleet-overview.json": overview.dashboard}


def render(cfg: RulesConfig) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, build in DASHBOARDS.items():
        data: Any = build(cfg).to_json_data()
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

"""Write the dashboards as sorted-key Grafana JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder

from gpuslo.core.fileio import write_outputs
from gpuslo.dashboards import chargeback_view, overview, views
from gpuslo.dashboards.spec import PanelSpec, build
from gpuslo.rules.config import RulesConfig

# file → (title, uid, panel specs, template variables beyond cluster)
VIEWS: dict[str, tuple[str, str, Callable[[RulesConfig], list[PanelSpec]], tuple[str, ...]]] = {
    "node-gpu.json": ("gpuslo / Node and GPU", "gpuslo-node-gpu", views.node_gpu, ("node",)),
    "workloads.json": ("gpuslo / Workloads", "gpuslo-workloads", views.workloads, ("queue", "job")),
    "scheduler.json": ("gpuslo / Scheduler and starvation", "gpuslo-scheduler", views.scheduler, ("queue",)),
    "slo.json": ("gpuslo / SLOs", "gpuslo-slo", views.slo, ()),
    "chargeback.json": (
        "gpuslo / Chargeback and energy",
        "gpuslo-chargeback",
        chargeback_view.chargeback,
        ("queue",),
    ),
}


def _view(name: str) -> Callable[[RulesConfig], Any]:
    title, uid, specs, variables = VIEWS[name]
    return lambda cfg: build(title, uid, specs(cfg), views.templating(*variables))


DASHBOARDS: dict[str, Callable[[RulesConfig], Any]] = {
    "fleet-overview.json": overview.dashboard,
    **{name: _view(name) for name in VIEWS},
}


# Members grafanalib still writes from Grafana's legacy (pre-schema) dashboard model; the
# published schema (@grafana/schema, checked in the tests) has no such fields.
LEGACY_PANEL_KEYS = {"editable", "error", "color", "span", "height", "minSpan", "columns", "isNew", "renderer",
                     "fontSize", "mappings"}  # fmt: skip
LEGACY_KEYS_IN = {
    "": {"__inputs", "hideControls", "sharedCrosshair", "style", "rows", "gnetId"},  # the dashboard itself
    "current": {"tags"},
    "options": {"tags"},
    "timepicker": {"time_options"},
    "list": {
        "auto",
        "autoCount",
        "autoMin",
        "auto_count",
        "auto_min",
        "useTags",
        "tagsQuery",
        "tagValuesQuery",
    },
}
LEGACY_STEP_KEYS = {"index", "op", "line", "yaxis"}


def prune(v: Any, key: str = "") -> Any:
    """Drop null members (grafanalib writes ``null`` for unset options where Grafana's
    schema wants them absent) and the legacy members; a threshold step keeps its
    ``value: null`` (the base step), written by grafanalib as the string "null"."""
    if isinstance(v, dict):
        if key == "steps" and "color" in v:  # a threshold step: the base one has value null
            value = v.get("value")
            return {"color": v["color"], "value": None if value in ("null", None) else value}
        out = {}
        for k, x in v.items():
            if x is None or (key == "panels" and k in LEGACY_PANEL_KEYS) or k in LEGACY_KEYS_IN.get(key, ()):
                continue
            if k == "thresholds" and x == "":
                continue
            if k == "steps" and x == "":
                x = [{"color": "green", "value": None}]
            out[k] = prune(x, k)
        if key == "fieldConfig" and "defaults" in out:
            out.setdefault("overrides", [])
        return out
    if isinstance(v, list):
        return [prune(x, key) for x in v]
    return v


def literal_title(text: str) -> str:
    """A panel title (it holds names from the config: an SLO's) shown as written. Grafana
    substitutes its variables in panel titles (``$var``, ``${var}``, ``[[var]]``, and its own
    ``$__from``...): an SLO named ``llama$cluster`` was titled "llamac1: ..." with cluster c1
    chosen. An invisible word joiner (U+2060) after each ``$`` and between two ``[`` leaves no
    variable to find and shows the same text."""
    return re.sub(r"\[(?=\[)", "[\u2060", text.replace("$", "$\u2060"))


def _literal_titles(panels: list[Any]) -> None:
    for p in panels:
        if isinstance(p.get("title"), str):
            p["title"] = literal_title(p["title"])
        _literal_titles(p.get("panels") or [])  # a row's panels


def render(cfg: RulesConfig) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, make in DASHBOARDS.items():
        data: Any = prune(json.loads(json.dumps(make(cfg).to_json_data(), cls=DashboardEncoder)))
        _literal_titles(data.get("panels") or [])
        out[name] = json.dumps(data, sort_keys=True, indent=2) + "\n"
    return out


def write(cfg: RulesConfig, directory: str | Path) -> list[Path]:
    """The dashboards as files in ``directory`` (made if missing), all whole or none changed
    (core.fileio.write_outputs)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = {d / name: text.encode("utf-8") for name, text in render(cfg).items()}
    write_outputs(files)
    return list(files)

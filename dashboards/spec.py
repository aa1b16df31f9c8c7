"""Dashboards as data: a list of panel specs per dashboard, built into grafanalib objects
by one layout function. Tests run every spec's SQL (see tests/test_dashboards.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import attr
from grafanalib.core import (
    BarGauge,
    Dashboard,
    DashboardLink,
    GridPos,
    Stat,
    Table,
    Template,
    Templating,
    Threshold,
    Time,
    TimeSeries,
)

from gpuslo.dashboards.clickhouse import (
    DATASOURCE_UID,
    FORMAT_TABLE,
    FORMAT_TIMESERIES,
    ClickHouseTarget,
    inert,
)

DS = {"type": "grafana-clickhouse-datasource", "uid": DATASOURCE_UID}

Kind = Literal["timeseries", "table", "stat", "bars"]


@attr.s(frozen=True)
class RawPanel:
    """A panel type grafanalib does not model (e.g. ``status-history``), as plain JSON."""

    data: dict[str, Any] = attr.ib()
    id: int | None = attr.ib(default=None)

    def to_json_data(self) -> dict[str, Any]:
        return {**self.data, **({"id": self.id} if self.id is not None else {})}

    def _map_panels(self, f: Any) -> Any:  # grafanalib's panel protocol (auto_panel_ids)
        return f(self)


@dataclass(frozen=True)
class PanelSpec:
    title: str
    kind: Kind
    sql: str
    unit: str = "none"
    width: int = 12
    height: int = 8
    stacked: bool = False
    per_cluster: bool = True  # False: the data is not per cluster (an SLO across clusters)
    thresholds: tuple[float, ...] = ()  # drawn as dashed lines (time series)

    def __post_init__(self) -> None:  # the SQL as the panel's target holds it (clickhouse.inert)
        object.__setattr__(self, "sql", inert(self.sql))

    @property
    def format(self) -> int:
        return FORMAT_TIMESERIES if self.kind == "timeseries" else FORMAT_TABLE


def variable(name: str, label: str, query: str, include_all: bool = True) -> Template:
    return Template(name=name, label=label, query=query, dataSource=DS, includeAll=include_all,
                    allValue="" if include_all else None, default="" if include_all else None)  # fmt: skip


CLUSTER_VAR = ("cluster", "Cluster", "SELECT DISTINCT cluster FROM node_heartbeats ORDER BY cluster")

LINKS = [
    ("Fleet overview", "gpuslo-fleet-overview"),
    ("Node and GPU", "gpuslo-node-gpu"),
    ("Workloads", "gpuslo-workloads"),
    ("Scheduler and starvation", "gpuslo-scheduler"),
    ("SLOs", "gpuslo-slo"),
]


def links() -> list[DashboardLink]:
    return [
        DashboardLink(title=t, uri=f"/d/{uid}", type="link", keepTime=True, includeVars=True)
        for t, uid in LINKS
    ]


def build(title: str, uid: str, specs: list[PanelSpec], variables: list[Template]) -> Dashboard:
    panels: list[object] = []
    x = y = row_h = 0
    for s in specs:
        if x + s.width > 24:
            x, y, row_h = 0, y + row_h, 0
        pos = GridPos(h=s.height, w=s.width, x=x, y=y)
        target = [ClickHouseTarget(rawSql=s.sql, format=s.format)]
        if s.kind == "timeseries":
            extra: dict[str, Any] = (
                {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60} if s.stacked else {}
            )
            if s.thresholds:
                extra["thresholdsStyleMode"] = "dashed"
                extra["thresholds"] = [Threshold("transparent", 0, 0.0)] + [
                    Threshold("red", i + 1, v) for i, v in enumerate(sorted(set(s.thresholds)))
                ]
            panels.append(
                TimeSeries(title=s.title, dataSource=DS, targets=target, unit=s.unit, gridPos=pos, **extra)
            )
        elif s.kind == "stat":
            panels.append(Stat(title=s.title, dataSource=DS, targets=target, format=s.unit, reduceCalc="lastNotNull",
                               gridPos=pos))  # fmt: skip
        elif s.kind == "bars":
            panels.append(BarGauge(title=s.title, dataSource=DS, targets=target, format=s.unit, gridPos=pos,
                                   orientation="horizontal"))  # fmt: skip
        else:
            panels.append(Table(title=s.title, dataSource=DS, targets=target, gridPos=pos))
        x += s.width
        row_h = max(row_h, s.height)
    return Dashboard(
        title=title,
        uid=uid,
        tags=["gpuslo"],
        timezone="utc",
        refresh="1m",
        time=Time("now-12h", "now"),
        templating=Templating(list=variables),
        links=links(),
        panels=panels,
    ).auto_panel_ids()

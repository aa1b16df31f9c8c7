"""The MIG right-sizing panel of the Workloads dashboard: the rule's own query
(``rules.rightsize.ACCOUNT_SUMMARY``) over the dashboard's time range and cluster variable."""

from __future__ import annotations

from gpuslo.dashboards.clickhouse import for_grafana
from gpuslo.dashboards.spec import PanelSpec
from gpuslo.ingest.sqltext import literal
from gpuslo.rules import rightsize as rs
from gpuslo.rules.config import RulesConfig


def panels(cfg: RulesConfig) -> list[PanelSpec]:
    consts = {"job:String": literal(""), "headroom:Float64": literal(rs.DEFAULT_HEADROOM)}
    return [
        PanelSpec(
            "MIG right-sizing per account: jobs that would have fit a smaller slice, GPU-hours to give back",
            "table",
            for_grafana(rs.ACCOUNT_SUMMARY, **consts),
            width=24,
        )
    ]

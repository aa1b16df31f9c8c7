"""A grafanalib target for the Grafana ClickHouse datasource plugin
(``grafana-clickhouse-datasource``), and the adapter that turns a rule query's
``{name:Type}`` parameters into the plugin's macros and dashboard variables."""

from __future__ import annotations

from typing import Any

import attr

PLUGIN_TYPE = "grafana-clickhouse-datasource"
DATASOURCE_UID = "gpuslo-clickhouse"

# The plugin's query model: format 0 = time series, 1 = table.
FORMAT_TIMESERIES = 0
FORMAT_TABLE = 1


@attr.s(frozen=True)
class ClickHouseTarget:
    rawSql: str = attr.ib()
    refId: str = attr.ib(default="A")
    format: int = attr.ib(default=FORMAT_TABLE)
    datasource_uid: str = attr.ib(default=DATASOURCE_UID)

    def to_json_data(self) -> dict[str, Any]:
        return {
            "datasource": {"type": PLUGIN_TYPE, "uid": self.datasource_uid},
            "editorType": "sql",
            "format": self.format,
            "queryType": "timeseries" if self.format == FORMAT_TIMESERIES else "table",
            "rawSql": self.rawSql,
            "refId": self.refId,
        }


# Rule-query parameter → Grafana text. The plugin expands $__fromTime_ms/$__toTime_ms to
# fromUnixTimestamp64Milli(...) of the dashboard's time range; ${cluster} is a dashboard
# variable whose "All" value is the empty string, which the queries read as "every cluster".
PARAMS = {
    "{from:Float64}": "(toUnixTimestamp64Milli($__fromTime_ms) / 1000)",
    "{to:Float64}": "(toUnixTimestamp64Milli($__toTime_ms) / 1000)",
    "{cluster:String}": "'${cluster}'",
}


def for_grafana(sql: str, **consts: str) -> str:
    """Replace the rule query's parameters by macros, variables and constants
    (``consts`` maps ``name:Type`` to SQL text, e.g. ``{"idle:Float64": "0.05"}``)."""
    out = sql
    for k, v in PARAMS.items():
        out = out.replace(k, v)
    for k, v in consts.items():
        out = out.replace("{" + k + "}", v)
    if "{" in out.replace("${cluster}", "").replace("{}", ""):
        left = out[out.index("{") : out.index("{") + 40]
        raise ValueError(f"unreplaced query parameter near {left!r}")
    return out.strip()

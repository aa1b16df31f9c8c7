"""A grafanalib target for the Grafana ClickHouse datasource plugin
(``grafana-clickhouse-datasource``), and the adapter that turns a rule query's
``{name:Type}`` parameters into the plugin's macros and dashboard variables."""

from __future__ import annotations

import re
from typing import Any

import attr

from gpuslo.ingest.sqltext import SKIP, fill, inline

PLUGIN_TYPE = "grafana-clickhouse-datasource"
DATASOURCE_UID = "gpuslo-clickhouse"

# The plugin's query model: format 0 = time series, 1 = table.
FORMAT_TIMESERIES = 0
FORMAT_TABLE = 1


# Grafana replaces its variables (``$name``, ``${name...}``, ``[[name]]``) and the plugin its
# macros (``$__name``) everywhere in a panel's SQL, inside string literals too: a constant the
# generator wrote (an SLO's service ``llama$cluster``, a model in the price sheet) became the
# variable's value, raw (a cluster named ``it's`` ended the literal). In every literal but a
# variable's own (var()), ``$`` and ``[`` are written ``\x24`` and ``\x5b``, which ClickHouse
# reads back as the same byte. A variable's own literal is known by where var() writes it (the
# argument of its decoding), never by its text alone: a config's constant may read the same (an
# SLO on service ``${cluster:percentencode}`` was the cluster chosen).
_TEXT = re.compile(SKIP.rstrip("|"), re.DOTALL)
_VAR_LITERAL = re.compile(r"'\$\{\w+:percentencode\}'")
_VAR_DECODE = "decodeURLComponent("


def inert(sql: str) -> str:
    """``sql`` with no string literal Grafana or the plugin would substitute into (idempotent)."""

    def one(m: re.Match[str]) -> str:
        t = m.group(0)
        if not t.startswith("'") or is_var_literal(m):
            return t
        return t.replace("$", "\\x24").replace("[", "\\x5b")

    return _TEXT.sub(one, sql)


@attr.s(frozen=True)
class ClickHouseTarget:
    rawSql: str = attr.ib(converter=inert)
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


# Grafana text for the dashboard's time range, in epoch seconds (the plugin's macros).
FROM_S = "(toUnixTimestamp64Milli($__fromTime_ms) / 1000)"
TO_S = "(toUnixTimestamp64Milli($__toTime_ms) / 1000)"


def var(name: str) -> str:
    """The SQL value of dashboard variable ``name``. Grafana's ``percentencode`` format writes
    only ``A-Z a-z 0-9 - _ . ~`` and ``%XX`` (RFC 3986 unreserved, UTF-8), so no value can end
    the literal or escape from it; ClickHouse decodes it back to the exact bytes. (Grafana's
    ``sqlstring`` and ``singlequote`` formats escape the quote but not the backslash, which
    ClickHouse reads as an escape: ``x\\`` would swallow the closing quote.)"""
    return f"{_VAR_DECODE}'${{{name}:percentencode}}')"


def is_var_literal(m: re.Match[str]) -> bool:
    """Whether the literal ``m`` (a match in its query) is a variable's own, as :func:`var` writes it."""
    return bool(_VAR_LITERAL.fullmatch(m.group(0))) and m.string.endswith(_VAR_DECODE, 0, m.start())


def var_filter(column: str, name: str) -> str:
    """``column`` equals the variable, or no filter when "All" (or nothing) is selected: the
    plugin's ``$__conditionalAll`` becomes ``1=1`` then. (An empty custom "All" value is not one
    in Grafana: it sends the list of every option instead.)"""
    return f"$__conditionalAll({column} = {var(name)}, ${name})"


# a rule query's cluster filter (rules/sql.py), as the dashboards' cluster variable
_CLUSTER_FILTER = re.compile(r"\(\{cluster:String\} = '' OR ([\w.]+) = \{cluster:String\}\)")
PARAMS = {"from:Float64": FROM_S, "to:Float64": TO_S}


def for_grafana(sql: str, **consts: str) -> str:
    """Replace the rule query's parameters by macros, variables and constants
    (``consts`` maps ``name:Type`` to SQL text, e.g. ``{"idle:Float64": "0.05"}``; a string
    constant must come from ``ingest.sqltext.literal``)."""
    out = _CLUSTER_FILTER.sub(lambda m: var_filter(m.group(1), "cluster"), sql)
    fill(out, keep=())  # a fragment slot left unfilled is an error here too
    return inline(out, optional={**PARAMS, **consts}).strip()

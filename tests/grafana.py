"""What Grafana and the ClickHouse plugin do to a panel's SQL before ClickHouse sees it,
ported from their sources (grafana/clickhouse-datasource src/data/CHDatasource.ts
applyTemplateVariables / applyConditionalAll, pkg/macros/macros.go; Grafana's templateSrv
variable regex and scenes' formatRegistry), so tests can run every panel with any variable value:

1. ``$__conditionalAll(condition, $var)``: ``1=1`` when the variable's current value is ``''`` or
   ``$__all``, else the condition (the plugin's own argument scan, brackets counted);
2. variables: ``$var`` / ``${var}`` / ``${var:format}`` with the plugin's default format (a
   string as it is) or the named format;
3. the backend macros ($__timeFilter, $__fromTime_ms, $__interval_s, ...).

Not emulated: "All" for a reference outside ``$__conditionalAll`` (with an empty custom all
value Grafana sends every option of the variable; here it stays ``$__all`` and :func:`expand`
fails on it, so the dashboards cannot rely on it)."""

from __future__ import annotations

import re
from urllib.parse import quote

ALL = "$__all"
INTERVAL_S = 300

# Grafana's variable regex (public/app/features/variables/utils.ts variableRegex)
VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^\}]+))?(?::([^\}]+))?\}")


def percentencode(v: str) -> str:
    """encodeURIComponentStrict: RFC 3986 unreserved characters stay, the rest is %XX of UTF-8."""
    return quote(v, safe="")


FORMATS = {
    "percentencode": percentencode,
    "raw": str,
    "singlequote": lambda v: "'" + v.replace("'", "\\'") + "'",
    "sqlstring": lambda v: "'" + v.replace("'", "''").replace('"', '\\"') + "'",
}


def _macro_args(query: str, args_index: int) -> list[str]:
    """CHDatasource.getMacroArgs: split at top-level commas, brackets counted (quotes are not)."""
    args: list[str] = []
    depth, last = 0, 1
    sub = query[args_index:]
    for m in re.finditer(r"\(|\)|,", sub):
        tok = m.group(0)
        if tok == "(":
            depth += 1
        elif tok == ")":
            depth -= 1
        if tok == "," and depth == 1:
            args.append(sub[last : m.end() - 1])
            last = m.end()
        if depth == 0:
            args.append(sub[last : m.end() - 1])
            return args
    return []


def conditional_all(sql: str, current: dict[str, str]) -> str:
    macro = "$__conditionalAll("
    i = sql.rfind(macro)
    while i != -1:
        params = _macro_args(sql, i + len(macro) - 1)
        if len(params) != 2:
            return sql
        found = re.search(r"(?<=\$\{)[\w\d]+(?=\})|(?<=\$)[\w\d]+", params[1].strip())
        phrase = params[0]
        if found and current.get(found.group(0), ALL) in ("", ALL):
            phrase = "1=1"
        # JavaScript's String.replace: the first occurrence; '$' patterns in the replacement are special
        assert not re.search(r"\$[$&`'0-9<]", phrase), phrase
        sql = sql.replace(f"{macro}{params[0]},{params[1]})", phrase, 1)
        i = sql.rfind(macro)
    return sql


def variables(sql: str, current: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(4)
        fmt = m.group(3) or m.group(6)
        if name not in current:
            return m.group(0)  # not a variable of the dashboard: left for the macros
        value = current[name]
        if fmt is None:
            return value  # the plugin's format(): a single value as it is
        return FORMATS.get(fmt, str)(value)

    return VARIABLE.sub(one, sql)


def macros(sql: str, frm: float, to: float) -> str:
    fm, tm = int(frm * 1000), int(to * 1000)
    out = sql.replace("$__interval_s", str(INTERVAL_S))
    out = out.replace("$__fromTime_ms", f"fromUnixTimestamp64Milli({fm})")
    out = out.replace("$__toTime_ms", f"fromUnixTimestamp64Milli({tm})")
    out = out.replace("$__fromTime", f"toDateTime({int(frm)})").replace("$__toTime", f"toDateTime({int(to)})")
    out = re.sub(
        r"\$__timeFilter\(([^)]+)\)", rf"\1 >= toDateTime({int(frm)}) AND \1 <= toDateTime({int(to)})", out
    )
    return re.sub(
        r"\$__timeInterval\(([^)]+)\)",
        rf"toStartOfInterval(toDateTime(\1), INTERVAL {INTERVAL_S} second)",
        out,
    )


DASHBOARD_VARIABLES = ("cluster", "node", "job", "queue")


def expand(sql: str, frm: float, to: float, **values: str) -> str:
    """The SQL ClickHouse receives for a panel, with the given variable values ("All" for the rest)."""
    current = {v: values.get(v, ALL) for v in DASHBOARD_VARIABLES}
    out = macros(variables(conditional_all(sql, current), current), frm, to)
    assert not re.search(r"\$__\w|\$\{|\$(cluster|node|job|queue)\b", out), out  # nothing left unexpanded
    return out

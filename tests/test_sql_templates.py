"""Queries assembled from fragments (ingest/sqltext.py ``fill``, ``inline``): a fragment without
a slot, a slot without a fragment and a slot left over are errors (TemplateError, not an
``assert`` that ``python -O`` removes); a fragment's text is never searched again; ClickHouse's
own ``{name:Type}`` parameters and Grafana's ``${name}`` variables are not slots."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslo.ingest.sqltext import TemplateError, fill, inline, literal, slots
from gpuslo.rules import chargeback, energy, rollup, sql
from gpuslo.rules import measures as m
from tests.hostile import names

ROOT = Path(__file__).resolve().parent.parent


def test_fill_replaces_each_slot_once() -> None:
    assert (
        fill("SELECT {a} FROM {t} WHERE {a} > 0", a="x", t="gpu_samples")
        == "SELECT x FROM gpu_samples WHERE x > 0"
    )


def test_a_fragment_without_a_slot_is_an_error() -> None:
    with pytest.raises(TemplateError, match="no slot for extra"):
        fill("SELECT {a}", a="1", extra="2")


def test_a_slot_without_a_fragment_is_an_error() -> None:
    with pytest.raises(TemplateError, match="no text for b"):
        fill("SELECT {a}, {b}", a="1")


def test_a_slot_may_be_kept_for_a_later_fill_and_then_must_be_filled() -> None:
    half = fill("SELECT {a}, {b}", keep=("b",), a="1")
    assert half == "SELECT 1, {b}"
    assert fill(half, b="2") == "SELECT 1, 2"
    with pytest.raises(TemplateError, match="no text for b"):
        fill(half)


def test_an_optional_fragment_is_used_where_there_is_a_slot() -> None:
    assert fill("cap_s", optional={"is_idle": "x"}) == "cap_s"
    assert fill("if({is_idle}, 1, 0)", optional={"is_idle": "x"}) == "if(x, 1, 0)"


def test_a_fragment_holding_slot_syntax_is_not_substituted_again() -> None:
    # one pass: the text of a is written as it is, the {b} in it is no slot of the template
    assert fill("{a} {b}", a="{b}", b="2") == "{b} 2"
    assert fill("{a}", a="{a}") == "{a}"
    assert (
        inline("{x:String} {y:String}", {"x:String": "'{y:String}'", "y:String": "'2'"}) == "'{y:String}' '2'"
    )


SHAPED = ["{x}", "{to:Float64}", "{from:Float64}", "{cluster:String}", "a{b}c", "'{x}'", "{x:String", "`{x}`"]


@pytest.mark.parametrize("value", SHAPED + [n for n in names() if "{" in n or "'" in n or "`" in n])
def test_a_value_shaped_like_a_slot_or_parameter_is_text_in_every_later_pass(value: str) -> None:
    """A value goes in once, as literal(); a later fill or inline over the query (the dashboards'
    for_grafana does both) leaves it byte for byte: no slot taken from it, nothing put into it,
    no TemplateError because of it."""
    q = fill(
        "SELECT 1 WHERE service = {v} AND ts <= {to:Float64} AND x = {later}",
        keep=("later",),
        v=literal(value),
    )
    assert literal(value) in q
    q = fill(q, later="`{later}`")  # a quoted identifier is no slot either
    assert inline(q, optional={"to:Float64": "99", "x:String": "'no'", "from:Float64": "0"}) == (
        f"SELECT 1 WHERE service = {literal(value)} AND ts <= 99 AND x = `{{later}}`"
    )


def test_a_service_shaped_like_a_parameter_keeps_its_dashboard_filter() -> None:
    from gpuslo.dashboards.overview import latency_where
    from gpuslo.rules.config import Slo

    for service in ("{to:Float64}", "svc{x}"):
        slo = Slo(name="s", service=service, threshold_ms=5, buckets_ms=[1, 5, 10])
        assert f"service = {literal(service)} AND" in latency_where(slo)


def test_query_parameters_and_grafana_variables_are_not_slots() -> None:
    q = "SELECT {idle:Float64}, ${cluster:percentencode}, ${job}, {{n}}x, map('k', 1){w}"
    assert slots(q) == frozenset({"n", "w"})
    assert fill("WHERE a < {idle:Float64} AND {b}", b="1") == "WHERE a < {idle:Float64} AND 1"


def test_a_fragment_is_sql_text_never_a_value() -> None:
    with pytest.raises(TypeError, match="literal"):
        fill("SELECT {a}", a=1)  # type: ignore[arg-type]
    # a value goes in through the escaping function
    assert fill("WHERE name = {v}", v=literal("o'brien\\")) == "WHERE name = 'o\\'brien\\\\'"


def test_inline_replaces_parameters_and_rejects_unused_and_left_over_ones() -> None:
    good = inline(m.GOOD, {"threshold:Float64": literal(5.0)})
    assert "{threshold" not in good and "b <= 5.0" in good
    with pytest.raises(TemplateError, match="no slot for idle:Float64"):
        inline(m.GOOD, {"threshold:Float64": "5.0", "idle:Float64": "0.05"})
    with pytest.raises(TemplateError, match="no text for threshold:Float64"):
        inline(m.GOOD, optional={"idle:Float64": "0.05"})


def test_the_rule_queries_have_no_slot_left() -> None:
    queries = {
        f"{mod.__name__}.{k}": v
        for mod in (sql, rollup, energy, chargeback)
        for k, v in vars(mod).items()
        if k.isupper() and not k.startswith("_") and isinstance(v, str) and "SELECT" in v
    }
    names = {k.rsplit(".", 1)[1] for k in queries}
    assert {
        "UTILIZATION_MIN_IDLE",
        "FAIR_SHARE_ROLLUP",
        "STARVATION_ROLLUP",
        "SLO_WINDOW_TOTALS_ROLLUP",
    } <= names
    assert "HEARTBEAT_MARKS" in names
    assert {k: slots(v) for k, v in queries.items() if slots(v)} == {}
    steps = sql.slo_steps([300, 3600], 60, rollup=True)
    assert slots(steps) == frozenset()
    assert "total_300" in steps and "RANGE BETWEEN 3540 PRECEDING" in steps and "latency_rollup_1m" in steps


def _rule_queries() -> dict[str, str]:
    return {
        f"{mod.__name__}.{k}": v
        for mod in (sql, rollup, energy, chargeback)
        for k, v in vars(mod).items()
        if k.isupper() and not k.startswith("_") and isinstance(v, str) and "SELECT" in v
    }


def test_the_server_store_binds_every_parameter_of_every_rule_query() -> None:
    """The server store binds ``{name:Type}`` itself, stepping over literals: a quote in a SQL
    comment (``-- the node's pool``) opened a literal there and left the parameters after it
    unbound, to the server's syntax error (STARVATION: 34 of them)."""
    from gpuslo.ingest.clickhouse_store import bind

    param = re.compile(r"\{(\w+):[^{}]+\}")
    with_comment_quote = 0
    for name, q in _rule_queries().items():
        given = {p: 1.0 for p in param.findall(q)}
        with_comment_quote += any("'" in line.partition("--")[2] for line in q.splitlines())
        assert param.findall(bind(q, given)) == [], name
    assert with_comment_quote > 0  # the case above is among them


@pytest.mark.integration  # a Python started with -O: over 0.7 s
def test_the_checks_hold_under_python_O() -> None:
    code = (
        "from gpuslo.ingest.sqltext import TemplateError, fill\n"
        "import gpuslo.rules.sql, gpuslo.dashboards.overview\n"
        "assert False, 'not reached under -O'\n"
    )
    # asserts are gone under -O (the line above does not fire), the template checks are not
    probe = code + (
        "for parts in ({'a': '1', 'extra': '2'}, {}):\n"
        "    try:\n"
        "        fill('SELECT {a}', **parts)\n"
        "    except TemplateError as e:\n"
        "        print('raised', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("raised") == 2, out.stdout


def _sources() -> list[Path]:
    return [p for d in ("ingest", "rules", "dashboards") for p in sorted((ROOT / d).rglob("*.py"))]


def test_no_query_is_assembled_by_replace_format_or_guarded_by_assert() -> None:
    """The class, not the case: no ``assert`` in the packages that build SQL, and no
    ``.replace``/``.format`` on a query constant (UPPER_CASE) or with a ``{...}`` argument."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Assert):
                found.append(f"{where} assert")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr not in ("replace", "format"):
                    continue
                recv = node.func.value
                name = (
                    recv.attr
                    if isinstance(recv, ast.Attribute)
                    else recv.id
                    if isinstance(recv, ast.Name)
                    else ""
                )
                braces = any(isinstance(a, ast.Constant) and "{" in str(a.value) for a in node.args)
                if (
                    name.lstrip("_").isupper()
                    or braces
                    or (isinstance(recv, ast.Constant) and "{" in str(recv.value))
                ):
                    found.append(f"{where} .{node.func.attr}")
    assert found == []


@pytest.mark.parametrize("name", ["STARVATION", "STARVATION_MINUTE_SWEEP", "STARVATION_ROLLUP"])
def test_the_starvation_queries_materialize_their_incidents_once(name: str) -> None:
    q = getattr(sql, name)
    got = sql.materialized(q)
    assert got.count("incidents AS MATERIALIZED\n(") == 1 and "incidents AS\n(" not in got
    assert got.rstrip().endswith(f"{sql.JOIN_SETTINGS}, {sql.MATERIALIZED_CTE} = 1")
    # nothing else changed
    assert (
        got.replace(" MATERIALIZED\n(", "\n(").replace(f", {sql.MATERIALIZED_CTE} = 1", "").rstrip()
        == q.rstrip()
    )


@pytest.mark.parametrize("q", [sql.STARVATION_NESTED, "SELECT 1", sql.STARVATION + sql.STARVATION])
def test_only_a_whole_starvation_query_is_materialized(q: str) -> None:
    with pytest.raises(ValueError, match="not a starvation query"):
        sql.materialized(q)

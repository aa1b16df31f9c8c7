"""Config text reaches the panels' SQL as literals, and Grafana substitutes its variables and
the ClickHouse plugin's macros inside literals too: every generated constant must come through
as the config wrote it. (Apart from tests/test_dashboards.py, whose module-wide demo store holds
chDB's one data directory of the process: these tests each open a store of their own.)"""

from __future__ import annotations

import json
import re

import pytest

from gpuslo.dashboards.generate import VIEWS, render
from gpuslo.dashboards.overview import panel_queries
from gpuslo.ingest.store import ChdbStore
from tests.grafana import expand
from tests.helpers import T0

# config strings Grafana would take for its variables or the plugin's macros, and a quote (and
# a variable's own literal, as var() writes it)
GRAFANA_TEXT = ("llama$cluster", "s${node:raw}", "[[queue]]", "m$__timeFilter(ts)", "x$__all", "it's\\$job",
                "${cluster:percentencode}")  # fmt: skip


def _constants(sql: str) -> list[str]:
    """The literals of ``sql`` but the variables' own (the argument of var()'s decoding)."""
    from gpuslo.ingest.sqltext import SKIP

    return [
        m.group(0)
        for m in re.finditer(SKIP.rstrip("|"), sql, flags=re.S)
        if m.group(0).startswith("'")
        and not (
            re.fullmatch(r"'\$\{\w+:percentencode\}'", m.group(0))
            and sql[: m.start()].endswith("decodeURLComponent(")
        )
    ]


@pytest.mark.parametrize("text", GRAFANA_TEXT)
def test_grafana_leaves_every_generated_constant_as_it_is(text: str, store: ChdbStore) -> None:
    """An SLO's name and service and a price sheet's model reach the panels' SQL as literals;
    Grafana substitutes its variables and macros inside literals too, so no literal but a
    variable's own may hold one, and each still reads back as the config's text."""
    from gpuslo.rules.config import parse

    cfg = parse({"slos": [{"name": f"n-{text}", "service": text, "threshold_ms": 5.0}],
                 "chargeback": {"per_gpu_hour": {text: 1.5}}})  # fmt: skip
    sqls = {k: q for k, (q, _f) in panel_queries(cfg).items()}
    sqls.update(
        {f"{uid}: {s.title}": s.sql for _n, (_t, uid, specs, _v) in VIEWS.items() for s in specs(cfg)}
    )
    raw = {t["rawSql"] for d in render(cfg).values() for p in json.loads(d)["panels"] for t in p["targets"]}
    assert set(sqls.values()) == raw  # the tests run what the dashboards hold
    seen: set[str] = set()
    for key, q in sqls.items():
        out = expand(q, T0, T0 + 3600, cluster="c'1", node="n'1", queue="q'1", job="j'1")
        mine = _constants(q)
        assert all(x in out for x in mine), key  # Grafana changed none of them
        seen.update(x for x in mine if "$" in text or "[" in text)
    values = {r["v"] for x in seen for r in store.query(f"SELECT {x} AS v")}
    assert {text, f"n-{text}", f"slo=n-{text}"} <= values


def test_a_service_named_like_a_variable_has_its_slo_panels(store: ChdbStore) -> None:
    """The SLI panel of service ``llama$cluster``, as Grafana sends it with cluster c1 chosen,
    finds the service's requests (it looked for ``llamac1``)."""
    from gpuslo.dashboards.views import slo
    from gpuslo.ingest.writer import write
    from gpuslo.rules.config import parse
    from tests import helpers as h

    write(store, [h.latency(T0 + 60 * k, 90, 10, service="llama$cluster") for k in range(1, 4)])
    cfg = parse({"slos": [{"name": "inference", "service": "llama$cluster", "threshold_ms": 5.0}]})
    (sli,) = [s for s in slo(cfg) if s.title.endswith("SLI vs objective")]
    rows = store.query(expand(sli.sql, T0, T0 + 3600, cluster="c1"))
    assert rows and all(r["sli"] == pytest.approx(0.9) for r in rows)


@pytest.mark.parametrize("text", [*GRAFANA_TEXT, "[[[queue]]]", "$$cluster", "a$", "[["])
def test_panel_titles_show_an_slo_name_as_written(text: str) -> None:
    """Grafana substitutes its variables in panel titles too: an SLO named ``llama$cluster`` was
    titled "llamac1: SLI vs objective" with cluster c1 chosen. No title of any dashboard holds a
    variable Grafana would find (its own regex, tests/grafana.py), and each reads, as shown (the
    invisible word joiner aside), as the config wrote it."""
    from gpuslo.rules.config import parse
    from tests.grafana import VARIABLE

    name = f"n-{text}"
    cfg = parse({"slos": [{"name": name, "service": "svc", "threshold_ms": 5.0}]})
    titles = [p["title"] for d in render(cfg).values() for p in json.loads(d)["panels"]]
    mine = [t for t in titles if name in t.replace("\u2060", "")]
    assert len(mine) == 1 + len(VIEWS["slo.json"][2](cfg))  # the overview's and the SLO dashboard's
    for t in titles:
        assert VARIABLE.search(t) is None, t

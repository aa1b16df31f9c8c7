"""One escaping function for every value that reaches SQL (ingest/sqltext.py): hostile strings
round-trip unchanged through chDB query parameters (scalars and arrays), through literals
pasted into SQL text, and through the rules engine as cluster and service names."""

from __future__ import annotations

import pytest

from gpuslo.ingest.sqltext import escape, literal, param_text, quote
from gpuslo.ingest.store import ChdbStore, StoreError
from gpuslo.ingest.writer import write
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.rules.evaluate import cluster_totals, slo_status, summary, utilization
from tests import helpers as h
from tests.helpers import T0
from tests.hostile import corpus, few_names, names


def test_escape_is_backslash_escaping_of_quote_backslash_and_controls() -> None:
    # by hand: backslash and quote get a backslash, controls become \xHH, the rest stays
    assert escape("o'brien") == "o\\'brien"
    assert escape("q\\") == "q\\\\"
    assert escape("a\tb\n\x00\x7f") == "a\\x09b\\x0a\\x00\\x7f"
    assert escape("é中😀") == "é中😀"
    assert quote("x'") == "'x\\''"
    assert literal(["a", 1, 2.5, True]) == "['a', 1, 2.5, 1]"
    assert param_text("lab\\tx") == "lab\\\\tx"
    with pytest.raises(TypeError):
        escape(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        literal(object())


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_every_hostile_string_round_trips_through_chdb(store: ChdbStore) -> None:
    values = corpus()
    for v in values:
        row = store.query(
            f"SELECT {{v:String}} AS p, {{a:Array(String)}} AS a, {quote(v)} AS lit, {literal([v, v])} AS arr",
            {"v": v, "a": [v, "'" + v, v + "\\"]},
        )[0]
        assert row == {"p": v, "a": [v, "'" + v, v + "\\"], "lit": v, "arr": [v, v]}, repr(v)[:80]


def test_a_parameter_of_an_unsupported_type_is_a_store_error(store: ChdbStore) -> None:
    with pytest.raises(StoreError, match="unsupported"):
        store.query("SELECT {v:String} AS v", {"v": object()})


# a string that is not Unicode text: Python's stand-in for each byte that is not UTF-8 (an
# argument, a file name, the environment: surrogateescape) alone and inside text, any other lone
# surrogate (a JSON or YAML escape), and the first and last of each half
NOT_TEXT = (
    "\udcff",
    "caf\udce9",
    "a\udc80b\n",
    "\ud800",
    "\udbff",
    "\udc00",
    "\udfff",
    "é\ud83dx",
    "x" * 300 + "\udcff",
)


def test_text_that_is_not_utf8_is_refused_by_the_one_escaping_function(store: ChdbStore) -> None:
    """chDB said "Unable to cast Python instance of type <class 'str'> to C++ type '?'" to a
    ``--cluster`` typed on a Latin-1 terminal: every way into SQL (a parameter, a literal, an
    array's member) refuses it with its bytes shown, and the embedded store's query is a refused
    store error that says so; the surrogate pair of real text is no such string."""
    from gpuslo.ingest.clickhouse_store import bind
    from gpuslo.ingest.sqltext import NotText

    for v in NOT_TEXT:
        with pytest.raises(StoreError, match="not UTF-8 text"):  # the server store's binding
            bind("SELECT {v:String} AS v", {"v": v})
        for make in (escape, quote, literal, param_text, lambda x: literal(["ok", x])):
            with pytest.raises(NotText, match="not UTF-8 text"):
                make(v)
        with pytest.raises(StoreError, match="not UTF-8 text") as ei:
            store.query("SELECT {v:String} AS v", {"v": v})
        assert not ei.value.retriable and not ei.value.fatal
    assert escape("😀") == "😀"
    assert store.query("SELECT {v:String} AS v", {"v": "café 😀"}) == [{"v": "café 😀"}]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    "ns",
    [
        pytest.param(few_names(), id="one-of-each-class"),
        pytest.param(names(), id="every-name", marks=pytest.mark.integration),
    ],
)
def test_hostile_cluster_and_service_names_give_the_right_numbers(store: ChdbStore, ns: list[str]) -> None:
    # One cluster per hostile name, each with one node of one GPU sampled once for 10 s,
    # allocated (share 1) at activity 0: capacity 10 GPU-s, allocation CUR 1, idle 10 GPU-s
    # allocated. A neighbour cluster with a free GPU must never leak into it. Each name
    # is also a service with 3 good and 1 bad request: SLI 0.75.
    msgs: list[object] = [h.batch("n1", T0, [h.gpu(0, 0.0)], cluster="neighbour-0")]
    for k, name in enumerate(ns):
        msgs.append(h.batch(f"n{k}", T0, [h.gpu(0, 0.0, (("j", 1.0),))], cluster=name))
        msgs.append(h.latency(T0 + 60, 3, 1, service=name))
    write(store, msgs)  # type: ignore[arg-type]
    for name in ns:
        rows = cluster_totals(utilization(store, T0, T0 + 10, 0.05, cluster=name))
        assert [(c, u.capacity_s, u.allocated_s, u.idle_allocated_s) for c, u in rows.items()] == [
            (name, 10.0, 10.0, 10.0)
        ], repr(name)
        st = slo_status(store, Slo(name="s", service=name, threshold_ms=5.0), T0, T0 + 60)
        assert (st.total, st.good) == (4, 3), repr(name)
    s = summary(store, RulesConfig(), T0, T0 + 10, cluster="lab\\tx")
    assert (s.capacity_gpu_hours, s.cur_allocation) == (round(10 / 3600, 4), 1.0)

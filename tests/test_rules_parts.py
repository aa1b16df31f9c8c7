"""One failing part of a rules round never silences the others: a rollup refresh that fails
(a memory limit met by a backlog, a bug met by its data) and one SLO's, the incidents' or the
results' failure each are reported in the round's ``errors``, and every other SLO and incident
is still evaluated and alerted on; what the failed part would judge stays as it was (never
resolved, never paged again as new). Before, any of them failed the whole round: no alert went
out, and none resolved, for as long as it kept failing. Its own module: the function-scoped
chDB store (one data directory per process)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuslo.ingest.schema import Schema
from gpuslo.ingest.store import ChdbStore, Failure, Store, StoreError
from gpuslo.ingest.writer import write
from gpuslo.rules import evaluate, results, service, sql
from gpuslo.rules.alerts import AlertState, Notifier
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.rules.delivery import Outcome
from gpuslo.rules.receivers import Receiver
from gpuslo.rules.service import RulesService
from tests import helpers as h
from tests.helpers import T0

END = T0 + 7200.0
SLOS = (
    Slo(name="a-p99", service="svc", threshold_ms=5.0, min_requests=10, period_d=7),
    Slo(name="b-p99", service="svc2", threshold_ms=5.0, min_requests=10, period_d=7),
)


class Failing(Store):
    """The test's real store, failing the queries (``query``, ``query_columns``) and statements
    (``execute``, ``insert``) that ``fails`` picks, as a server answering an error does, for as
    long as ``fails`` is set; ``close`` is counted (the service reopens after a transient one)."""

    def __init__(self, inner: ChdbStore) -> None:
        self.inner = inner
        self.fails: Callable[[str, Mapping[str, Any]], Exception | None] | None = None
        self.closed = 0

    def _check(self, what: str, params: Mapping[str, Any] | None) -> None:
        if self.fails is not None and (exc := self.fails(what, params or {})) is not None:
            raise exc

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self._check("execute " + sql, params)
        self.inner.execute(sql, params)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        self._check("query " + sql, params)
        return self.inner.query(sql, params)

    def query_columns(
        self, sql: str, params: Mapping[str, Any] | None = None, names: Sequence[str] | None = None
    ) -> dict[str, list[Any]]:
        self._check("query " + sql, params)
        return self.inner.query_columns(sql, params, names)

    def insert(self, table: str, columns: Mapping[str, Any]) -> int:
        self._check("insert " + table, {})
        return self.inner.insert(table, columns)

    def migrate(self, schema: Schema) -> None:
        self.inner.migrate(schema)

    def close(self) -> None:
        self.closed += 1  # the fixture's store stays open: the "reopened" one is the same


def _burning(store: ChdbStore, frm: float, to: float) -> None:
    """Both services' requests all slow (burn 100x), a node of 8 GPUs, and a request pending
    since ``to - 1800`` (open past its 600 s threshold at ``to``)."""
    msgs: list[Any] = []
    for t in range(int(frm), int(to), 60):
        msgs += [h.latency(t, good=0, bad=100), h.latency(t, good=0, bad=100, service="svc2")]
    for t in range(int(frm), int(to), 300):
        msgs.append(h.batch("n", t, [h.gpu(i, 0.0) for i in range(8)], interval_s=300))
    write(store, msgs)


def _service(
    store: Store, tmp_path: Path, now: list[float], source: service.Source = "raw"
) -> tuple[RulesService, list[str]]:
    posted: list[str] = []

    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.extend(json.loads(body)["text"].splitlines())
        return Outcome("sent", 200, "")

    n = Notifier(tmp_path / "o", [Receiver.parse("webhook", "http://hooks/x")], post=post)
    opened: list[int] = []

    def open_store() -> Store:
        opened.append(1)
        return store

    svc = RulesService(RulesConfig(slos=SLOS), open_store, window_s=3600, source=source, notifier=n,
                       resend_s=60, flush_s=5.0, clock=lambda: now[0])  # fmt: skip
    return svc, posted


def _firing(store: Store) -> set[tuple[str, str]]:
    """(alertname, slo or request) of every alert the state holds firing."""
    return {
        (dict(v["labels"])["alertname"], dict(v["labels"]).get("slo") or dict(v["labels"]).get("request", ""))
        for v in AlertState(store).firing().values()
    }


PAGES = {("GpusloSLOBurn", "a-p99"), ("GpusloSLOBurn", "b-p99")}
STARVED = ("GpusloStarvation", "pod")


def _boom(part: str) -> Callable[..., Any]:
    def fail(*a: Any, **kw: Any) -> Any:
        raise ValueError(f"a bug met by the {part}'s data")

    return fail


def _memory(*a: Any, **kw: Any) -> Any:
    raise StoreError("Code: 241. DB::Exception: Memory limit (total) exceeded", Failure.TRANSIENT, 241)


# each part of the evaluation, failing the way it can: a query the server refuses (one SLO's,
# over its service), a server short of memory (transient), a bug met by the part's data
PARTS: dict[str, Callable[[pytest.MonkeyPatch, Failing], None]] = {
    "slo:b-p99 memory": lambda mp, st: setattr(
        st,
        "fails",
        lambda w, p: (
            StoreError("Code: 241. DB::Exception: Memory limit (total) exceeded", Failure.TRANSIENT, 241)
            if p.get("service") == "svc2"
            else None
        ),
    ),
    "slo:b-p99 refused": lambda mp, st: setattr(
        st,
        "fails",
        lambda w, p: (
            StoreError("Code: 53. DB::Exception: Type mismatch", Failure.REFUSED, 53)
            if p.get("service") == "svc2"
            else None
        ),
    ),
    "slo:b-p99 bug": lambda mp, st: mp.setattr(evaluate, "_pairs_of", _boom("slo")),  # every SLO's
    "utilization": lambda mp, st: mp.setattr(evaluate, "utilization", _boom("utilization")),
    "starvation": lambda mp, st: mp.setattr(evaluate, "incidents", _boom("starvation")),
    "top_idle": lambda mp, st: mp.setattr(evaluate, "idle_by_owner", _boom("top_idle")),
    "fair_share": lambda mp, st: mp.setattr(evaluate, "fair_share", _boom("fair_share")),
    "rule_results": lambda mp, st: mp.setattr(results, "write", _boom("rule_results")),
    # the reclaim loop's judgement: its holders' query short of memory (it failed the whole round)
    "reclaim memory": lambda mp, st: mp.setattr(service, "judge", _memory),
    "reclaim bug": lambda mp, st: mp.setattr(service, "judge", _boom("reclaim")),
    "rule_results full disk": lambda mp, st: setattr(
        st,
        "fails",
        lambda w, p: (
            StoreError(
                "Code: 243. DB::Exception: Cannot reserve 1.00 MiB, not enough space", Failure.TRANSIENT, 243
            )
            if w == "insert rule_results"
            else None
        ),
    ),
}


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("case", list(PARTS))
def test_one_failing_part_of_a_round_leaves_the_others_evaluated_and_alerted(
    store: ChdbStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    _burning(store, T0, END)
    write(store, [h.sched("submit", "pod", END - 1800)])
    failing = Failing(store)
    now = [END]
    svc, posted = _service(failing, tmp_path, now)
    try:
        first = svc.round()
        assert "errors" not in first and _firing(store) == PAGES | {STARVED}
        part = case.split(" ")[0]
        failed_slos = {"b-p99"} if case in ("slo:b-p99 memory", "slo:b-p99 refused") else set()
        if case == "slo:b-p99 bug":
            failed_slos = {"a-p99", "b-p99"}
        PARTS[case](monkeypatch, failing)
        _burning(store, END, END + 240)
        now[0] = END + 240
        second = svc.round()
        errors = second["errors"]
        if part.startswith("slo:"):
            assert set(errors) == {f"slo:{s}" for s in failed_slos}, errors
        else:
            assert set(errors) == {part}, errors
        # nothing resolved: the failed part's alerts kept, the others judged (still burning)
        assert second["alerting"]["resolved"] == 0 and second["alerting"]["new"] == len(failed_slos)
        assert not [p for p in posted if p.startswith("RESOLVED")], posted
        tickets = {(n, s) for n, s in _firing(store) if n == "GpusloSLONotEvaluable"}
        assert tickets == {("GpusloSLONotEvaluable", s) for s in failed_slos}
        assert _firing(store) == PAGES | {STARVED} | tickets
        by_slo = {s["slo"]: s for s in second["slos"]}
        for name in ("a-p99", "b-p99"):
            if name in failed_slos:
                assert "its evaluation failed" in by_slo[name]["error"] and by_slo[name]["total"] == 0
            else:  # evaluated: the hour's requests, all bad
                assert (
                    by_slo[name]["error"] == ""
                    and by_slo[name]["total"] >= 5000
                    and by_slo[name]["sli"] == 0.0
                )
                assert {a["slo"] for a in second["slo_alerts"] if a["ended"] is None} >= {name}
        if part != "starvation":
            assert [i["request_id"] for i in second["starvation_incidents"]] == ["pod"]
        if part != "utilization":
            assert second["capacity_gpu_hours"] == pytest.approx(8.0)
        # its failure over: the part judged again, the tickets resolve, no page was paged twice
        monkeypatch.undo()
        failing.fails = None
        _burning(store, END + 240, END + 480)
        now[0] = END + 480
        third = svc.round()
        assert "errors" not in third and _firing(store) == PAGES | {STARVED}
        assert third["alerting"]["resolved"] == len(failed_slos) and third["alerting"]["new"] == 0
        started = {float(v["started"]) for v in AlertState(store).firing().values()}
        assert started == {END}  # each page and incident fired once, at the first round
    finally:
        svc.close()


# a refresh failing the way it can: the server short of memory for a backlog (transient: the
# connection is then reopened), a statement refused, a bug met by the marks' data
REFRESH_FAILS: dict[str, Exception] = {
    "memory": StoreError("Code: 241. DB::Exception: Memory limit (total) exceeded", Failure.TRANSIENT, 241),
    "refused": StoreError("Code: 69. DB::Exception: Argument out of bound", Failure.REFUSED, 69),
    "bug": ZeroDivisionError("a bug met by the marks' data"),
}


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("kind", list(REFRESH_FAILS))
def test_a_failing_rollup_refresh_still_evaluates_over_the_raw_rows_and_alerts(
    store: ChdbStore, tmp_path: Path, kind: str
) -> None:
    _burning(store, T0, END)
    write(store, [h.sched("submit", "pod", END - 1800)])
    raw_svc = RulesService(
        RulesConfig(slos=SLOS), lambda: store, window_s=3600, source="raw", clock=lambda: END
    )
    expected = raw_svc.round()  # the same window over the raw rows, its own evaluation
    failing = Failing(store)
    failing.fails = lambda w, p: REFRESH_FAILS[kind] if w.startswith("execute") else None
    now = [END]
    svc, posted = _service(failing, tmp_path, now, source="auto")
    try:
        s = svc.round()
        assert s["window"]["over"] == "raw rows" and "error" in s["rollup_refresh"]
        assert (
            set(s["errors"]) == {"rollup_refresh"}
            and type(REFRESH_FAILS[kind]).__name__ in s["errors"]["rollup_refresh"]
        )
        for k in ("capacity_gpu_hours", "cur_allocation", "slos", "slo_alerts", "starvation_incidents"):
            assert s[k] == expected[k], k
        fired = len(AlertState(store).firing())  # the SLOs' pages and tickets, and the incident
        assert s["alerting"]["new"] == fired > 3 and _firing(store) == PAGES | {STARVED}
        assert sum(p.startswith("FIRING") for p in posted) == fired
        assert failing.closed == (1 if kind == "memory" else 0)  # a transient one: reopened
        # `rules run --once`: the summary is emitted, and the round is not a success (exit 2)
        got: list[dict[str, Any]] = []
        now[0] = END + 60
        assert svc.run(threading.Event(), 60.0, got.append, once=True) is False
        assert [set(g["errors"]) for g in got] == [{"rollup_refresh"}]
    finally:
        svc.close()


def test_a_fatal_store_error_in_a_refresh_still_leaves_the_loop(store: ChdbStore) -> None:
    failing = Failing(store)
    failing.fails = lambda w, p: (
        StoreError("Code: 60. Table rollup_state doesn't exist", Failure.FATAL, 60)
        if w.startswith("execute")
        else None
    )
    svc = RulesService(
        RulesConfig(slos=SLOS), lambda: failing, window_s=3600, source="auto", clock=lambda: END
    )
    with pytest.raises(StoreError, match="rollup_state"):
        svc.round()


def _results(store: Store, at: float) -> dict[tuple[str, str], float | None]:
    rows = store.query(
        "SELECT rule, label, value FROM rule_results FINAL WHERE evaluated_at = toDateTime({at:Float64}, 'UTC') "
        "AND pool = ''",
        {"at": at},
    )
    return {(r["rule"], r["label"]): r["value"] for r in rows}


UTILIZATION_RULES = {"capacity_gpu_hours", "cur_allocation", "cur_active", "idle_allocated_gpu_hours",
                     "idle_unallocated_gpu_hours"}  # fmt: skip
STARVATION_RULES = {"starvation_incidents", "starvation_open"}
# each part whose numbers go to rule_results, failing as a bug met by its data does; what it
# measures: the rules of its rows
RESULT_PARTS: dict[str, tuple[Callable[[pytest.MonkeyPatch, Failing], None], set[str]]] = {
    "utilization": (PARTS["utilization"], UTILIZATION_RULES),
    "starvation": (PARTS["starvation"], STARVATION_RULES),
    "scheduler_events_seen": (
        lambda mp, st: setattr(
            st,
            "fails",
            lambda w, p: (
                StoreError("Code: 241. DB::Exception: Memory limit (total) exceeded", Failure.TRANSIENT, 241)
                if w == "query " + sql.SCHED_SEEN
                else None
            ),
        ),
        STARVATION_RULES,
    ),
}


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("case", list(RESULT_PARTS))
def test_a_failed_part_writes_no_numbers_to_rule_results_the_others_whole(
    store: ChdbStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A round with a failed part wrote that part's rows of rule_results as measured zeros (0
    GPU-hours of capacity, 0 incidents open while one was): a dashboard read a failed query as an
    empty fleet, a starving queue as none. They are no data (NULL); every other row is the one
    the round writes where nothing fails."""
    _burning(store, T0, END)
    write(store, [h.sched("submit", "pod", END - 1800)])
    whole = RulesService(RulesConfig(slos=SLOS), lambda: store, window_s=3600, source="raw",
                         clock=lambda: END)  # fmt: skip
    whole.round()
    expected = _results(store, END)
    assert expected[("capacity_gpu_hours", "")] == pytest.approx(8.0)
    assert expected[("starvation_open", "")] == 1.0
    store.execute("TRUNCATE TABLE rule_results")
    failing = Failing(store)
    svc, _ = _service(failing, tmp_path, [END])
    fail, rules = RESULT_PARTS[case]
    fail(monkeypatch, failing)
    try:
        s = svc.round()
        assert case in s["errors"], s["errors"]
        got = _results(store, END)
        assert set(got) == set(expected)
        for key, value in expected.items():
            if key[0] in rules:
                assert got[key] is None, key
            else:
                assert got[key] == value, key
        if case == "utilization":
            assert s["capacity_gpu_hours"] is None and s["cur_active"] is None
    finally:
        svc.close()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("gone_s", [0.0, 600.0, 1800.0])
def test_a_failed_refresh_over_a_window_whose_raw_rows_are_gone_keeps_the_rollups(
    store: ChdbStore, tmp_path: Path, gone_s: float
) -> None:
    """A failed refresh evaluated the round over the raw rows; where those of part of the window
    were gone (past the retention, or deleted: the rollups outlive them) the round measured what
    was left as the whole window (capacity and CUR cut, written to rule_results). Over the raw
    rows only where they cover the window; else over the rollups as they are (behind by the
    minutes since their last refresh), the numbers of the round before."""
    _burning(store, T0, END)
    failing = Failing(store)
    now = [END]
    svc, _ = _service(failing, tmp_path, now, source="auto")
    try:
        first = svc.round()
        assert "errors" not in first and first["window"]["over"] == "rollups"
        store.execute(  # the raw GPU samples of the window's first gone_s
            "DELETE FROM gpu_samples WHERE ts < toDateTime64({t:Float64}, 3, 'UTC')",
            {"t": END - 3600 + gone_s},
        )
        failing.fails = lambda w, p: REFRESH_FAILS["refused"] if w.startswith("execute") else None
        s = svc.round()
        assert set(s["errors"]) == {"rollup_refresh"}, s["errors"]
        assert s["capacity_gpu_hours"] == pytest.approx(8.0) == first["capacity_gpu_hours"]
        assert s["window"]["over"] == ("rollups" if gone_s else "raw rows")
        assert s["alerting"]["resolved"] == 0 and _firing(store) == PAGES
    finally:
        svc.close()

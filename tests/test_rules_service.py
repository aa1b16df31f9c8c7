"""The rules service (rules/service.py) is the one loop behind ``gpuslo rules run`` and the
embedded stack: the same data gives the same ``rule_results`` on both paths, and its loop
survives a store that goes away."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.cli import main
from gpuslo.app.embedded import run_demo
from gpuslo.ingest.schema import Schema
from gpuslo.ingest.store import ChdbStore, Failure, Store, StoreError
from gpuslo.rules import service as service_module
from gpuslo.rules.config import example
from gpuslo.rules.service import RulesService

END = 1_790_002_800.0  # a whole hour
SIM = SimConfig(nodes=2, gpus_per_node=4, hours=2.0, start_ts=END - 7200, seed=5)


def _rows(store_dir: Path, at: float) -> list[tuple[Any, ...]]:
    """Every version of the rows written at ``at`` (no FINAL: each writer's rows are seen)."""
    store = ChdbStore(store_dir)
    try:
        rows = store.query(
            "SELECT rule, cluster, pool, label, value FROM rule_results "
            "WHERE window_s = 3600 AND evaluated_at = toDateTime64({at:Float64}, 3, 'UTC')",
            {"at": at},
        )
    finally:
        store.close()
    return sorted(
        (r["rule"], r["cluster"], r["pool"], r["label"], None if r["value"] is None else round(r["value"], 9))
        for r in rows
    )


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_the_demo_and_rules_run_write_the_same_rule_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_demo(SIM, example(), tmp_path / "demo")
    store_dir = tmp_path / "demo" / "store"
    demo = _rows(store_dir, END)
    assert len(demo) > 10
    capsys.readouterr()
    monkeypatch.setattr(service_module, "wall_clock", lambda: END + 30.0)  # the round ending at END
    assert main(["rules", "run", "--once", "--store", str(store_dir), "--window-s", "3600"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["evaluated_at"] == END and out["window"]["over"] == "rollups"
    both = _rows(store_dir, END)
    assert both == sorted(demo + demo)  # each row twice: the demo's, and the same one from rules run
    fleet = {r[0]: r[4] for r in demo if r[1:4] == ("", "", "")}
    assert fleet["cur_allocation"] == pytest.approx(out["cur_allocation"])
    assert fleet["capacity_gpu_hours"] == pytest.approx(out["capacity_gpu_hours"]) == pytest.approx(8.0)


class Breaks(Store):
    """A real store that loses its connection at the ``at``-th query and stays broken (as a
    ClickHouse connection to a server that went away does): only a new store works again."""

    def __init__(self, inner: ChdbStore, at: int) -> None:
        self.inner, self.at, self.queries, self.broken = inner, at, 0, False

    def _check(self) -> None:
        if self.broken:
            raise StoreError("Code: 210. Connection refused (127.0.0.1:9000)", Failure.TRANSIENT, 210)

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self._check()
        self.inner.execute(sql, params)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        self._check()
        self.queries += 1
        if self.queries == self.at:
            self.broken = True
            self._check()
        return self.inner.query(sql, params)

    def insert(self, table: str, columns: Mapping[str, Any]) -> int:
        self._check()
        return self.inner.insert(table, columns)

    def migrate(self, schema: Schema) -> None:
        self._check()
        self.inner.migrate(schema)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_the_loop_reconnects_after_a_store_error_and_contains_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_demo(SIM, example(), tmp_path / "demo")
    store_dir = tmp_path / "demo" / "store"
    opened: list[Breaks] = []

    def open_store() -> Store:
        if len(opened) == 0:
            opened.append(Breaks(ChdbStore(store_dir), at=0))
            raise StoreError("Code: 210. Connection refused", Failure.TRANSIENT, 210)  # not up yet
        opened.append(Breaks(ChdbStore(store_dir), at=3 if len(opened) == 1 else 0))  # breaks mid-round
        return opened[-1]

    stop = threading.Event()
    got: list[dict[str, Any]] = []

    def emit(s: dict[str, Any]) -> None:
        got.append(s)
        stop.set()

    svc = RulesService(example(), open_store, window_s=3600.0, source="raw", clock=lambda: END + 30.0)
    with caplog.at_level(logging.WARNING, logger="gpuslo.rules.service"):
        assert svc.run(stop, 0.0, emit) is True
    svc.close()
    # round 1: the open failed; round 2: the store broke mid-round and was dropped; round 3 on a new one
    assert len(opened) == 3 and opened[1].broken and not opened[2].broken
    assert caplog.text.count("rules evaluation failed") == 2
    assert (
        len(got) == 1 and got[0]["evaluated_at"] == END and got[0]["capacity_gpu_hours"] == pytest.approx(8.0)
    )


def test_a_fatal_store_error_leaves_the_loop(tmp_path: Path) -> None:
    def open_store() -> Store:
        raise StoreError("Code: 516. Authentication failed", Failure.FATAL, 516)

    svc = RulesService(example(), open_store, clock=lambda: END)
    with pytest.raises(StoreError, match="Authentication failed"):
        svc.run(threading.Event(), 0.0, lambda s: None)
    svc.close()


def test_once_reports_a_failed_round() -> None:
    def open_store() -> Store:
        raise StoreError("Code: 210. Connection refused", Failure.TRANSIENT, 210)

    svc = RulesService(example(), open_store, clock=lambda: END)
    assert svc.run(threading.Event(), 3600.0, lambda s: None, once=True) is False  # returns: no wait


def test_a_round_that_fails_for_another_reason_is_contained(caplog: pytest.LogCaptureFixture) -> None:
    """Not the store: a bug met by one round's data (here in opening it) is logged with its
    traceback once per kind, the round counts as failed, and the service goes on to the next."""
    calls: list[int] = []
    stop = threading.Event()

    def open_store() -> Store:
        calls.append(1)
        if len(calls) == 3:
            stop.set()
        raise ZeroDivisionError("a bug")

    svc = RulesService(example(), open_store, clock=lambda: END)
    with caplog.at_level(logging.WARNING, logger="gpuslo.rules.service"):
        assert svc.run(stop, 0.0, lambda s: None) is False
    svc.close()
    assert len(calls) == 3
    assert (
        caplog.text.count("Traceback") == 1
        and caplog.text.count("rules round failed: ZeroDivisionError: a bug") == 3
    )

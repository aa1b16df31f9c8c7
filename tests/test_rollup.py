"""Per-minute rollups: the rules over rollups give the raw answers, keep giving them after the
raw rows are gone, and converge under replays and late rows."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.base import SendResult, Sink
from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.agent.sim.run import run_fleet
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw, write
from gpuslo.rules import rollup
from gpuslo.rules.config import RulesConfig, example
from gpuslo.rules.evaluate import summary
from gpuslo.rules.model import to_json
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import Message, encode
from tests.helpers import short_sim
from tests.test_starvation_tier import _fleet
from tests.test_starvation_tier_late import _drains

SIM = short_sim(nodes=2, gpus_per_node=8, seed=1)
# the fast tier: the 4-hour compressed scenario on 2 nodes; the integration tier: 8 hours on 3
RUNS = [
    pytest.param(SIM, id="4h"),
    pytest.param(
        SimConfig(nodes=3, gpus_per_node=8, hours=8, seed=1), id="8h", marks=pytest.mark.integration
    ),
]


class _Collect(Sink):
    def __init__(self) -> None:
        self.msgs: list[Message] = []

    def send(self, msgs: Sequence[Message]) -> SendResult:
        self.msgs.extend(msgs)
        return SendResult(len(msgs))


@pytest.fixture(scope="module", params=RUNS)
def run(request: pytest.FixtureRequest) -> tuple[SimConfig, list[Message]]:
    sink = _Collect()
    run_fleet(request.param, sink)
    return request.param, sink.msgs


def _ingest(store: ChdbStore, msgs: Sequence[Message], tag: str, sim: SimConfig = SIM) -> None:
    rep = Ingestor(store, clock=lambda: sim.end_ts).ingest(
        Raw(f"{tag}:{i}", encode(m)) for i, m in enumerate(msgs)
    )
    assert not rep.rejected


def _cfg() -> RulesConfig:
    cfg = example()
    # short starvation thresholds so the simulated queue opens incidents of every cause
    return cfg.model_copy(update={"starvation": cfg.starvation.model_copy(update={"threshold_s": 300.0})})


def _eval(store: ChdbStore, source: Any, sim: SimConfig = SIM) -> dict[str, Any]:
    s: dict[str, Any] = to_json(summary(store, _cfg(), sim.start_ts, sim.end_ts, source=source))
    s["window"].pop("over")
    return s


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_rollups_answer_like_raw_and_outlive_it(tmp_path: Path, run: tuple[SimConfig, list[Message]]) -> None:
    sim, messages = run
    store = ChdbStore(tmp_path / "s")
    try:
        store.migrate(SCHEMA)
        _ingest(store, messages, "a", sim)
        rep = rollup.refresh(store)
        # by hand: every node sampled every 10 s in each minute of the run, and the last
        # sample's starvation snapshot (2 x 10 s) reaches the minute after it; one service
        minutes = round(sim.hours * 60)
        assert (rep.node_minutes, rep.service_minutes) == (sim.nodes * (minutes + 1), minutes)
        raw = _eval(store, "raw", sim)
        assert raw["capacity_gpu_hours"] > 0 and raw["starvation_incidents"] and raw["slo_alerts"]
        assert {i["cause"] for i in raw["starvation_incidents"]} >= {"capacity", "policy"}
        assert _eval(store, "rollup", sim) == raw
        # rollups keep the answers once the raw rows are gone (TTL, or a smaller retention)
        for t in ("gpu_samples", "node_heartbeats", "latency"):
            store.execute(f"TRUNCATE TABLE {t}")
        assert _eval(store, "rollup", sim) == raw
        assert _eval(store, "raw", sim)["capacity_gpu_hours"] == 0
    finally:
        store.close()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_replays_and_late_rows_converge(tmp_path: Path, run: tuple[SimConfig, list[Message]]) -> None:
    sim, messages = run
    store = ChdbStore(tmp_path / "s")
    try:
        store.migrate(SCHEMA)
        # the second half first, refresh, then the first half late, a replay, refresh again
        half = len(messages) // 2
        _ingest(store, messages[half:], "b", sim)
        rollup.refresh(store)
        time.sleep(0.01)
        _ingest(store, messages[:half], "a", sim)
        _ingest(store, messages[half - 500 : half + 500], "replay", sim)  # a Kafka batch read twice
        rollup.refresh(store)
        rows = store.query("SELECT count() AS n, sum(samples) AS s FROM gpu_rollup_1m FINAL")[0]
        raw_rows = store.query("SELECT count() AS n FROM gpu_samples FINAL")[0]["n"]
        assert rows["s"] == raw_rows, "every sample counted once in the rollup"
        assert _eval(store, "rollup", sim) == _eval(store, "raw", sim)
        q = "SELECT * EXCEPT version FROM gpu_rollup_1m FINAL ORDER BY cluster, node, minute"
        before = store.query(q)
        rollup.refresh(store)  # nothing new (re-takes the last marks): nothing changes
        after = store.query(q)
        assert before == after
    finally:
        store.close()


_TIERS = ("gpu_rollup_1m", "owner_rollup_1m", "latency_rollup_1m", "capacity_steps_1m", "gpu_rollup_1h",
          "owner_rollup_1h")  # fmt: skip


def _tiers(store: ChdbStore) -> dict[str, list[Any]]:
    return {t: sorted(map(repr, store.query(f"SELECT * EXCEPT version FROM {t} FINAL"))) for t in _TIERS}


@pytest.mark.integration  # two stores, two refreshes each
def test_a_refresh_in_spans_writes_what_one_statement_writes(
    tmp_path: Path, run: tuple[SimConfig, list[Message]]
) -> None:
    """A backlog re-rolled span by span (2 nodes x 8 GPUs every 10 s: 96 sample rows a minute, so
    3,000 rows make spans of 31 minutes) gives every tier the rows of one statement over all of it
    (the owners', the hours' and the latency's included), through a late half and a replay too.
    Spans of one minute over hostile fleets: tests/test_starvation_tier_late.py."""
    sim, messages = run
    if sim.hours > 4:
        pytest.skip("the 4-hour run covers it (a span's statements cost the same at any length)")
    chunk_rows = 3000
    half = len(messages) // 2
    tiers = []
    for k, rows in enumerate((10**12, chunk_rows)):
        store = ChdbStore(tmp_path / f"s{k}")
        try:
            store.migrate(SCHEMA)
            _ingest(store, messages[half:], "b", sim)
            rollup.refresh(store, chunk_rows=rows)
            time.sleep(0.01)
            _ingest(store, messages[:half], "a", sim)
            _ingest(store, messages[half - 200 : half + 200], "replay", sim)
            rollup.refresh(store, chunk_rows=rows)
            tiers.append(_tiers(store))
            if k:
                assert _eval(store, "rollup", sim) == _eval(store, "raw", sim)
        finally:
            store.close()
    assert all(
        tiers[0][t] for t in ("gpu_rollup_1m", "owner_rollup_1m", "capacity_steps_1m", "gpu_rollup_1h")
    )
    assert tiers[1] == tiers[0]


@pytest.mark.integration  # two stores, two refreshes each, per seed
@pytest.mark.parametrize("seed", [1, 4])
def test_a_refresh_minute_by_minute_writes_what_one_statement_writes(tmp_path: Path, seed: int) -> None:
    """The hostile fleets (samples off minute edges, intervals up to 90 s whose pieces and
    snapshots straddle minutes, gaps, two pools at once) re-rolled one marked minute per
    statement (``chunk_rows=1``) give every tier the rows of one statement over the backlog,
    through late samples and drains too: no span writes a minute of another."""
    cluster = f"L{seed}"
    batches, events, _ = _fleet(seed, cluster)
    nodes = sorted({b.node for b in batches})
    drains = _drains(cluster, nodes, sorted({b.ts for b in batches}))
    tiers = []
    for k, rows in enumerate((10**12, 1)):
        st = ChdbStore(tmp_path / f"s{k}")
        try:
            st.migrate(SCHEMA)
            write(st, batches[::2] + events)
            rollup.refresh(st, chunk_rows=rows)
            write(st, batches[1::2] + drains)
            rollup.refresh(st, chunk_rows=rows)
            tiers.append({t: sorted(map(repr, st.query(f"SELECT * EXCEPT version FROM {t} FINAL")))
                          for t in ("gpu_rollup_1m", "capacity_steps_1m", "gpu_rollup_1h")})  # fmt: skip
        finally:
            st.close()
    assert all(tiers[0].values())
    assert tiers[1] == tiers[0]


class _Counts:
    """A store answering refresh_spans' two queries: sample rows per minute, marked minutes."""

    def __init__(self, rows: dict[int, int], marked: list[int]) -> None:
        self.rows, self.marked = rows, marked

    def query(self, q: str, p: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if "FROM gpu_samples" in q:
            assert p is not None
            return [{"m": float(m), "n": n} for m, n in sorted(self.rows.items()) if p["from"] <= m < p["to"]]
        return [{"m": float(m)} for m in self.marked]


@pytest.mark.parametrize(
    ("rows", "marked", "chunk", "spans"),
    [
        # every minute 100 rows: 250 rows take two minutes a span, 99 one (a minute is never split)
        ({m * 60: 100 for m in range(5)}, [0, 60, 120, 180, 240], 250, [(0, 120), (120, 240), (240, 300)]),
        (
            {m * 60: 100 for m in range(5)},
            [0, 60, 120, 180, 240],
            99,
            [(m * 60, m * 60 + 60) for m in range(5)],
        ),
        ({m * 60: 100 for m in range(5)}, [0, 60, 120, 180, 240], 500, [(0, 300)]),
        # the unmarked minutes between two marked ones count: their rows are read
        ({0: 10, 60: 1000, 120: 10}, [0, 120], 500, [(0, 60), (120, 180)]),
        ({0: 10, 60: 10, 120: 10}, [0, 120], 500, [(0, 180)]),
        # exactly the budget stays one span; one row over starts the next
        ({0: 100, 60: 150}, [0, 60], 250, [(0, 120)]),
        ({0: 100, 60: 151}, [0, 60], 250, [(0, 60), (60, 120)]),
        # no sample rows at all (marks of a heartbeat's reach): one span
        ({}, [0, 60, 600], 1, [(0, 660)]),
        # marks gone between the reads
        ({0: 5}, [], 1, []),
    ],
)
def test_refresh_spans(
    rows: dict[int, int], marked: list[int], chunk: int, spans: list[tuple[int, int]]
) -> None:
    lo, hi = (min(marked), max(marked)) if marked else (0, 0)
    gpu = {"n": 10**6, "lo": float(lo), "hi": float(hi)}
    got = rollup.refresh_spans(_Counts(rows, marked), {}, gpu, chunk)  # type: ignore[arg-type]
    assert got == [(float(a), float(b)) for a, b in spans]


def test_a_few_marks_are_one_span_without_counting() -> None:
    class _NoQueries:
        def query(self, *_a: Any) -> Any:
            raise AssertionError("a refresh of a few marks counts no rows")

    gpu = {"n": 3, "lo": 60.0, "hi": 600.0}
    assert rollup.refresh_spans(_NoQueries(), {}, gpu, 3 * rollup.ROWS_PER_MARK) == [(60.0, 660.0)]  # type: ignore[arg-type]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_when_rollups_cannot_answer(tmp_path: Path) -> None:
    store = ChdbStore(tmp_path / "s")
    try:
        store.migrate(SCHEMA)
        with pytest.raises(ValueError, match="whole minutes"):
            summary(store, _cfg(), SIM.start_ts + 30, SIM.end_ts, source="rollup")
        odd = _cfg().model_copy(update={"idle_threshold": 0.07})
        with pytest.raises(ValueError, match=r"idle_threshold 0\.07"):
            summary(store, odd, SIM.start_ts, SIM.end_ts, source="rollup")
        assert summary(store, odd, SIM.start_ts, SIM.end_ts, source="auto").window.over == "raw rows"
        assert summary(store, _cfg(), SIM.start_ts, SIM.end_ts, source="auto").window.over == "rollups"
    finally:
        store.close()


@pytest.mark.integration  # the whole pipeline: a demo run, then `rules run` and `rules eval` on its store
def test_rules_run_evaluates_over_rollups_and_writes_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from gpuslo.app.cli import main
    from gpuslo.app.embedded import run_demo

    now = time.time()
    sim = SimConfig(nodes=2, gpus_per_node=4, hours=1.0, start_ts=float(int(now // 60) * 60 - 3600), seed=3)
    run_demo(sim, example(), tmp_path / "demo")
    store_dir = str(tmp_path / "demo" / "store")
    store = ChdbStore(store_dir)
    try:  # as if the rollups were never refreshed: `rules run` computes every minute itself
        store.execute("TRUNCATE TABLE rollup_state")
    finally:
        store.close()
    assert main(["rules", "run", "--once", "--store", store_dir, "--window-s", "3600"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["window"]["over"] == "rollups" and out["capacity_gpu_hours"] > 0
    # by hand (ingest/schema.py marks): 2 nodes sampled every 10 s for minutes 0..59, and a
    # sample at ts marks the minutes of [ts, ts + 2 x 10 s) (its starvation snapshot), so the
    # last one at 59:50 reaches minute 60: 2 x 61 node-minutes; one service, 60 minutes
    refreshed = out["rollup_refresh"]
    assert (refreshed["node_minutes"], refreshed["service_minutes"]) == (2 * 61, 60)
    assert set(refreshed) == {"node_minutes", "service_minutes", "seconds"}
    frm, to = str(int(out["window"]["from"])), str(int(out["window"]["to"]))

    def rules_eval(*extra: str) -> int:
        return main(["rules", "eval", "--store", store_dir, "--to", to, *extra])

    evals = {}
    for source in ("raw", "rollup"):
        assert rules_eval("--from", frm, "--json", "--source", source) == 0
        evals[source] = json.loads(capsys.readouterr().out)
        evals[source]["window"].pop("over")
    assert evals["raw"] == evals["rollup"]
    store = ChdbStore(store_dir)
    try:
        res = {
            (r["rule"], r["pool"], r["label"]): r["value"]
            for r in store.query(
                "SELECT rule, pool, label, value FROM rule_results FINAL WHERE window_s = 3600"
            )
        }
    finally:
        store.close()
    assert res[("cur_allocation", "", "")] == pytest.approx(out["cur_allocation"])
    assert res[("idle_unallocated_gpu_hours", "gpu", "")] == pytest.approx(
        out["pools"][0]["idle_unallocated_gpu_hours"]
    )
    assert res[("starvation_incidents", "", "cause=capacity")] == out["starvation_by_cause"]["capacity"]
    assert ("slo_burn", "", "slo=llm-chat-p99") in res
    # unaligned window: the rollups cannot answer, and say why
    assert rules_eval("--from", str(int(frm) + 7), "--source", "rollup") == 2
    assert "whole minutes" in capsys.readouterr().err

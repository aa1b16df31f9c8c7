"""The DDL and the rule SQL on ClickHouse 24.8, the oldest server version we support.

chDB 2.1.1 embeds ClickHouse 24.8.4. It lives in its own virtual environment
(``.venv-ch24``, made by scripts/test.sh) because two chDB versions cannot share one; the
test feeds it the same DDL, the same rows and the same rule queries as the current engine
and requires the same answers."""

from __future__ import annotations

import json
import math
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gpuslo.app.cli import window_rows_query
from gpuslo.ingest.schema import GPU_SAMPLES_PART_UPGRADE, GPU_SAMPLES_UPGRADE, SCHED_EVENTS_UPGRADE
from gpuslo.ingest.store import ChdbStore, param_text
from gpuslo.ingest.writer import to_columns, write
from gpuslo.rules import chargeback as cb
from gpuslo.rules import energy as en
from gpuslo.rules import rawcover, rollup, sql
from gpuslo.rules.config import GridIntensity, Slo
from gpuslo.rules.evaluate import slo_steps_query
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSample, MigInstance
from tests import helpers as h
from tests.helpers import T0

ROOT = Path(__file__).resolve().parents[1]
PY24 = ROOT / ".venv-ch24" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not PY24.exists() and not os.environ.get("GPUSLO_REQUIRE_CH24"),
    reason="no .venv-ch24 (scripts/test.sh makes it: python -m venv .venv-ch24 && pip install chdb==2.1.1)",
)


def _fixture() -> list[Any]:
    msgs: list[Any] = []
    for k in range(60):
        t = T0 + 10 * k
        msgs.append(
            h.batch("n1", t, [h.gpu(0, 0.7, (("j1", 1.0),)), h.gpu(1, 0.01, (("j2", 0.5),)), h.gpu(2, 0.0)])
        )
        msgs.append(h.heartbeat("n1", t, k < 40, gpus=3))
        msgs.append(h.batch("n2", t, [  # one GPU in MIG mode: its own row and two instances
            GpuSample(index=0, uuid="GPU-m", fraction=1 / 7, fields={"DCGM_FI_DEV_POWER_USAGE": 90.0,
                      "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 9e5 * k + (0 if k < 30 else -2e5)}),  # a reset at k 30
            GpuSample(index=0, uuid="MIG-1", fraction=2 / 7, mig=MigInstance(gi=1, profile="2g.20gb"),
                      fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.4}, allocations=h.gpu(0, 0.4, (("j3", 1.0),)).allocations),
            GpuSample(index=0, uuid="MIG-2", fraction=4 / 7, mig=MigInstance(gi=2, ci=0, profile="4g.40gb"),
                      fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0}),
        ]))  # fmt: skip
    msgs += [
        h.sched("submit", "A", T0, gpn=2),
        h.sched("submit", "B", T0 + 5, gpn=1),
        h.sched("start", "B", T0 + 400),
    ]
    msgs += [h.latency(T0 + 60 * i, 900, 100 if i > 3 else 0) for i in range(1, 11)]
    return msgs


def _literal(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_literal(x) for x in v) + "]"
    return repr(v)


def _inserts(msgs: list[Any]) -> list[str]:
    out = []
    for table, cols in to_columns(msgs).items():
        names = list(cols)
        cols = {k: (v.to_pylist() if hasattr(v, "to_pylist") else v) for k, v in cols.items()}
        rows = []
        for i in range(len(cols[names[0]])):
            vals = []
            for n in names:
                v = cols[n][i]
                if n == "ts":
                    v = datetime.fromtimestamp(v, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
                vals.append(_literal(v))
            rows.append("(" + ",".join(vals) + ")")
        out.append(f"INSERT INTO {table} ({', '.join(names)}) VALUES " + ",".join(rows))
    return out


def _refresh() -> list[tuple[str, dict[str, Any]]]:
    """rules/rollup.refresh's statements, with every mark taken (the fixture spans 10 minutes)."""
    p = {"wm": 0.0, "cut": 4e9, "version": 1, "cluster": ""}
    # the fixture's marks reach minute T0+600 at most (10 s samples, snapshots valid 20 s)
    return [
        (rollup.HEARTBEAT_MARKS, {**p, "lo": T0}),
        (rollup.GPU_REFRESH, {**p, "from": T0, "to": T0 + 660}),
        (rollup.STEPS_REFRESH, {**p, "from": T0, "to": T0 + 660}),
        (rollup.OWNER_REFRESH, {**p, "from": T0, "to": T0 + 660}),
        (rollup.LATENCY_REFRESH, {**p, "from": T0, "to": T0 + 660}),
    ]


def _queries() -> list[tuple[str, dict[str, Any]]]:
    frm, to = T0, T0 + 600
    base = {"from": frm, "to": to, "cluster": ""}
    slo = Slo(name="s", service="svc", threshold_ms=5)
    thr = {"thr_queues": ["debug"], "thr_values": [60.0], "thr_default": 300.0, "thr_max": 300.0}
    ti = rollup.threshold_index(0.05)
    every = {"match_cluster": [], "match_queue": [], "match_account": []}  # the matchers: all
    some = {"match_cluster": ["c1"], "match_queue": ["q"], "match_account": ["acct", "other"]}
    grid = GridIntensity(default_g_per_kwh=300.0, clusters={"c1": 100.0})
    nrg = {"idle": 0.05, **en.intensity_params(grid)}
    return [
        (sql.UTILIZATION_ROLLUP, {**base, "ti": ti}),
        (sql.IDLE_BY_OWNER_ROLLUP, {**base, **every, "ti": ti, "limit": 10}),
        (sql.FAIR_SHARE_ROLLUP, {**base, **every}),
        (sql.STARVATION_ROLLUP, {**base, **thr}),
        (
            slo_steps_query(slo, rollup=True),
            {**base, "service": "svc", "threshold": 5.0, "step": 60, "lookback": 259200.0},
        ),
        (sql.SLO_WINDOW_TOTALS_ROLLUP, {**base, "service": "svc", "threshold": 5.0}),
        (sql.UTILIZATION, {**base, "idle": 0.05}),
        (sql.IDLE_BY_OWNER, {**base, "idle": 0.05, "limit": 10}),
        (
            sql.STARVATION,
            {**base, "thr_queues": ["debug"], "thr_values": [60.0], "thr_default": 300.0, "thr_max": 300.0},
        ),
        (sql.PENDING_AGE, {"to": to, "cluster": ""}),
        (sql.FAIR_SHARE, base),
        (
            slo_steps_query(slo),
            {**base, "service": "svc", "threshold": 5.0, "step": 60, "lookback": 259200.0},
        ),
        (sql.SLO_WINDOW_TOTALS, {**base, "service": "svc", "threshold": 5.0}),
        (sql.UTILIZATION_MIN_IDLE, {**base, "idle": 0.05, "min_idle": 30.0}),
        (sql.IDLE_BY_OWNER_MIN_IDLE, {**base, "idle": 0.05, "min_idle": 30.0, "limit": 10}),
        # the engine's, narrowed by the matchers (rules.config.Match) before the limit
        (sql.IDLE_BY_OWNER_MATCHED, {**base, **some, "idle": 0.05, "limit": 2}),
        (sql.FAIR_SHARE_MATCHED, {**base, **some}),
        (sql.IDLE_BY_OWNER_MATCHED_MIN_IDLE, {**base, **some, "idle": 0.05, "min_idle": 30.0, "limit": 2}),
        (sql.IDLE_BY_OWNER_ROLLUP, {**base, **some, "ti": ti, "limit": 2}),
        (sql.FAIR_SHARE_ROLLUP, {**base, **some}),
        # energy and chargeback (rules/energy.py, rules/chargeback.py)
        (en.ENERGY_FLEET, {**base, **nrg}),
        (en.ENERGY_BY_HOLDER, {**base, **nrg, "ids": []}),
        (en.ENERGY_FLEET_MIN_IDLE, {**base, **nrg, "min_idle": 30.0}),
        (en.ENERGY_BY_HOLDER_MIN_IDLE, {**base, **nrg, "min_idle": 30.0, "ids": ["j1", "j3"]}),
        (cb.GPU_BY_MODEL, {**base, "idle": 0.05}),
        (cb.HOLDERS_BY_MODEL, {**base, "idle": 0.05}),
        (cb.GPU_BY_MODEL_MIN_IDLE, {**base, "idle": 0.05, "min_idle": 30.0}),
        (cb.HOLDERS_BY_MODEL_MIN_IDLE, {**base, "idle": 0.05, "min_idle": 30.0}),
        *_job_queries(base),
        # the reading commands' check that a window holds rows (app/cli.py), at and past the data's end
        *[
            (
                window_rows_query(prog),
                {
                    "lo": f - sql.SNAP_LOOKBACK_S,
                    "frm": f,
                    "to": f + 60,
                    "c": "",
                    "span": float(sql.SNAP_LOOKBACK_S),
                },
            )
            for prog in ("rules eval", "chargeback", "rightsize", "whatif")
            for f in (frm, T0 + 600, T0 + 619.5, T0 + 620, T0 + 86_400)
        ],
        # whether the raw rows cover a window (rules/rawcover.py), every mark taken
        (rawcover._ROLLUP_CAPACITY, {**base, "wm": 4e9}),
        (rawcover._RAW_CAPACITY, {**base, "wm": 4e9}),
        # (last: raw_of below compares it with the raw starvation)
        # the starvation snapshot swept over the minute tier (a store whose starvation tier is not built)
        (sql.STARVATION_MINUTE_SWEEP, {**base, **thr}),
    ]


def _job_queries(base: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The per-job report's and the MIG right-sizing's queries (rules/jobreport.py, rules/rightsize.py)."""
    from gpuslo.rules import jobreport as jr
    from gpuslo.rules import rightsize as rs
    from gpuslo.rules.config import RulesConfig

    job = {**base, "cluster": "c1", "job": "j1", "headroom": 0.1}
    return [
        (rs.JOB_ADVICE, {**base, "job": "", "headroom": 0.1}),
        (rs.ACCOUNT_SUMMARY, {**base, "job": "", "headroom": 0.1}),
        (jr._EVENTS, {"job": "B", "cluster": ""}),
        (jr._HOLDERS, {"ids": ["j1", "j3"], "cluster": "", "lo": 0.0, "hi": 4e9, "after": -1.0}),
        (jr.GPU_DETAILS, job),
        (jr.GPU_SERIES, {**job, "bucket": 60}),
        (jr._gpu_sums(RulesConfig()), {**job, "idle": 0.05}),
        (jr._gpu_sums(RulesConfig(min_idle_s=30)), {**job, "idle": 0.05, "min_idle": 30.0}),
    ]


def _norm(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 6)
    if isinstance(v, str):
        try:
            return round(float(v), 6)
        except ValueError:
            return v
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return [_norm(x) for x in v.values()]
    return v


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_ddl_and_rule_sql_on_clickhouse_24_8(tmp_path: Path) -> None:
    msgs = _fixture()
    queries = _queries()
    steps = [
        {"sql": s}
        for s in [*SCHEMA.create(), SCHED_EVENTS_UPGRADE, GPU_SAMPLES_UPGRADE, GPU_SAMPLES_PART_UPGRADE]
    ] + [{"sql": s} for s in _inserts(msgs)]
    steps += [{"sql": q, "params": {k: param_text(v) for k, v in p.items()}} for q, p in _refresh()]
    steps += [{"sql": q, "params": {k: param_text(v) for k, v in p.items()}} for q, p in queries]
    r = subprocess.run([str(PY24), str(ROOT / "tests/compat/run_sql.py")], input=json.dumps(steps),
                       capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout)
    assert results[0]["version"].startswith("24.8."), results[0]
    for step, res in zip(steps, results[1:], strict=True):
        assert "error" not in res, f"{res['error']}\n-- in:\n{step['sql'][:1500]}"
    # same data, same queries on the current engine: same answers
    store = ChdbStore(tmp_path / "cur")
    try:
        store.migrate(SCHEMA)
        write(store, msgs)
        for q, p in _refresh():
            store.execute(q, p)
        old = results[1 + len(steps) - len(queries) :]
        for (q, p), res in zip(queries, old, strict=True):
            new = [list(row.values()) for row in store.query(q, p)]
            assert new, q[:300]  # every query has something to agree on
            assert _norm(res["rows"]) == _norm(new), q[:300]
        # and the rollup queries give the raw queries' answers (the first six are the rollup ones)
        answers = [_norm([list(row.values()) for row in store.query(q, p)]) for q, p in queries]
        raw_of = {0: 6, 1: 7, 3: 8, 2: 10, 4: 11, 5: 12, 18: 15, 19: 16, len(queries) - 1: 8}
        for r_i, w_i in raw_of.items():
            assert answers[r_i] == answers[w_i], queries[r_i][0][:300]
    finally:
        store.close()

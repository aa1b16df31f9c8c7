"""The store's insert (no insert-time merge) stores what the insert before it stored, and
every way chDB takes a batch (bench/insert_paths.py) stores the same rows: every column type
of gpu_samples, hostile strings, MIG instances, several holders per GPU. No timing here."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from bench import ingest as ingest_bench
from bench.insert_paths import MERGE_ON_INSERT, TWIN, InsertPaths, PathResult
from gpuslo.ingest.schema import GPU_SAMPLES_PART_UPGRADE, GPU_SAMPLES_UPGRADE, SCHED_EVENTS_UPGRADE
from gpuslo.ingest.store import INSERT_SETTINGS, ChdbStore, StoreError, arrow_stream, file_insert_sql
from gpuslo.ingest.writer import to_columns
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch, MigInstance
from tests import helpers as h
from tests.helpers import T0
from tests.hostile import few_names
from tests.test_clickhouse_24_8 import PY24, _norm

ROOT = Path(__file__).resolve().parents[1]
KEY = "cluster, node, gpu, mig_gi, mig_ci, ts"


def _messages() -> list[GpuSampleBatch]:
    """One batch per hostile name: it is the node, the model, the MIG profile and every
    string of the two holders; the fields take their type's edge values."""
    out = []
    for k, name in enumerate(few_names()):
        holders = (
            Allocation(scheduler="slurm", id=name, name=name, user=name, account=name, queue=name, share=0.25),
            Allocation(scheduler="k8s", id=f"{k}", user="u", share=0.5, activity_share=0.125, fb_share=0.75,
                       share_source="processes"),
        )  # fmt: skip
        gpus = [
            GpuSample(index=0, uuid=name, model=name, fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.5,
                      "DCGM_FI_DEV_FB_USED": 1e7, "DCGM_FI_DEV_POWER_USAGE": 5e-324},
                      allocations=holders),
            GpuSample(index=1023, uuid="MIG-x", fraction=3 / 7, mig=MigInstance(gi=255, ci=0, profile=name),
                      fields={}),
            GpuSample(index=1, uuid="GPU-1", healthy=False, fields={}),
        ]  # fmt: skip
        out.append(h.batch(name, T0 + k + 0.001 * (k % 1000), gpus, interval_s=0.5, pool=name))
    return out


def _rows(store: ChdbStore, table: str) -> list[dict[str, Any]]:
    return store.query(f"SELECT * EXCEPT ingested_at FROM {table} FINAL ORDER BY {KEY}")


def _old_insert(store: ChdbStore, table: str, cols: Any) -> None:
    """The insert before this change: Python() with the insert-time merge."""
    store.insert_settings = MERGE_ON_INSERT
    try:
        store.insert_python(table, store.prepare_columns(table, cols))
    finally:
        store.insert_settings = INSERT_SETTINGS


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path / "store")
    try:
        s.migrate(SCHEMA)
        s.execute(f"CREATE TABLE {TWIN} AS gpu_samples")
        yield s
    finally:
        s.close()


def test_the_store_insert_keeps_every_column_as_the_insert_time_merge_did(store: ChdbStore) -> None:
    msgs = _messages()
    cols = to_columns(msgs)["gpu_samples"]
    assert store.insert("gpu_samples", cols) == 3 * len(msgs)
    _old_insert(store, TWIN, cols)
    new, old = _rows(store, "gpu_samples"), _rows(store, TWIN)
    assert new == old and len(new) == 3 * len(msgs)
    # and what was sent, read back independently of either path
    by_node = {(r["node"], r["gpu"]): r for r in new}
    for m in msgs:
        r = by_node[(m.node, 0)]
        assert r["uuid"] == r["model"] == r["pool"] == m.node
        assert r["alloc_names"] == [m.node, ""] and r["alloc_ids"] == [m.node, m.gpus[0].allocations[1].id]
        assert r["alloc_users"] == [m.node, "u"] and r["alloc_queues"] == [m.node, ""]
        assert r["alloc_shares"] == [0.25, 0.5] and r["alloc_act_shares"] == [0.25, 0.125]
        assert r["alloc_fb_shares"] == [0.25, 0.75] and r["alloc_share_sources"] == ["", "processes"]
        assert r["DCGM_FI_DEV_FB_USED"] == 1e7 and r["DCGM_FI_DEV_POWER_USAGE"] == 5e-324
        assert r["DCGM_FI_DEV_GPU_UTIL"] is None
        assert r["ts"] == datetime.fromtimestamp(round(m.ts, 3), UTC)
        mig = by_node[(m.node, 1023)]
        assert (mig["mig_gi"], mig["mig_ci"], mig["mig_profile"]) == (255, 0, m.node)
        assert mig["gpu_fraction"] == pytest.approx(3 / 7, rel=1e-7)  # Float32
        assert by_node[(m.node, 1)]["healthy"] == 0


def test_types_of_the_stored_columns_are_the_schemas(store: ChdbStore) -> None:
    store.insert("gpu_samples", to_columns(_messages()[:2])["gpu_samples"])
    got = store.query("SELECT toTypeName(ts) AS ts, toTypeName(node) AS node, toTypeName(alloc_users) AS u, "
                      "toTypeName(activity) AS a FROM gpu_samples LIMIT 1")[0]  # fmt: skip
    assert got == {"ts": "DateTime64(3, 'UTC')", "node": "LowCardinality(String)",
                   "u": "Array(LowCardinality(String))", "a": "Nullable(Float32)"}  # fmt: skip


def test_one_key_twice_in_one_batch_reads_as_the_later_row_as_before(store: ChdbStore) -> None:
    """Without the insert-time merge both rows are written; FINAL keeps the later one (equal
    versions: the last inserted), the row the merge kept."""
    msgs = [h.batch("n1", T0, [h.gpu(0, 0.25)]), h.batch("n1", T0, [h.gpu(0, 0.75)])]
    cols = to_columns(msgs)["gpu_samples"]
    store.insert("gpu_samples", cols)
    _old_insert(store, TWIN, cols)
    for t in ("gpu_samples", TWIN):
        (r,) = store.query(f"SELECT activity, seq FROM {t} FINAL")
        assert r == {"activity": 0.75, "seq": msgs[1].seq}
    assert store.query("SELECT count() AS n FROM gpu_samples")[0]["n"] == 2  # until a merge
    assert store.query(f"SELECT count() AS n FROM {TWIN}")[0]["n"] == 1


def _chunks(store: ChdbStore) -> list[pa.Table]:
    msgs = _messages()
    half = len(msgs) // 2
    return [
        store.prepare_columns("gpu_samples", to_columns(part)["gpu_samples"])
        for part in (msgs[:half], msgs[half:])
    ]


def test_every_insert_path_stores_the_same_rows(store: ChdbStore) -> None:
    paths = InsertPaths(store, _chunks(store))
    stored: dict[str, list[dict[str, Any]]] = {}
    for name, (go, _note) in paths._paths().items():
        store.execute(f"TRUNCATE TABLE {paths.table_of(name)}")
        for i, c in enumerate(paths.chunks):
            go(c, i)
        stored[name] = _rows(store, paths.table_of(name))
    assert set(stored) == {
        "native",
        "store_views",
        "python_arrow",
        "python_arrow_merge",
        "file_arrow_stream",
        "arrow_stream",
        "parquet",
        "native_chdb",
        "row_binary",
    }
    # the views' twin path ran the store's view into its own twin of the view's target
    marks = store.query("SELECT count() AS n FROM rollup_dirty_twin")[0]["n"]
    assert marks > 0 and store.query("SELECT count() AS n FROM rollup_dirty")[0]["n"] == 0
    reference = stored.pop("python_arrow")
    assert len(reference) == paths.rows
    for name, rows in stored.items():
        assert rows == reference, name
    results = paths.measure(repeat=1)  # the benchmark's own check passes on the same rows
    assert [r.name for r in results][:3] == ["native", "store_views", "python_arrow"]
    assert all(len(r.seconds) == 1 and r.seconds[0] > 0 for r in results)


def test_a_path_that_stores_other_rows_is_an_error(store: ChdbStore) -> None:
    class Lossy(InsertPaths):
        def _paths(self) -> dict[str, Any]:
            good = super()._paths()
            drop = (lambda t, i: self.store.insert(TWIN, t.slice(1)), "drops a row")
            return {"python_arrow": good["python_arrow"], "lossy": drop}

    with pytest.raises(ValueError, match="path lossy stored"):
        Lossy(store, _chunks(store)).measure(repeat=1)


TABLES = ("gpu_samples", "node_heartbeats", "sched_events", "latency", "dead_letters")


@pytest.mark.parametrize("path", ["python", "arrow_stream", "file"])
def test_every_store_path_stores_every_table_as_the_old_insert(
    store: ChdbStore, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever path a batch size or the chDB picks, every table (arrays, Nullable, raw bytes that are not
    UTF-8 in the dead letters) reads back as the old insert stored it."""
    name = few_names()[3]
    msgs = [*_messages()[:4], h.heartbeat(name, T0, False, gpus=3), h.sched("submit", name, T0, gpn=2),
            h.latency(T0 + 60, 900, 100)]  # fmt: skip
    tables = to_columns(msgs)
    raw = [b"\xff\xfe not utf-8 \x00", name.encode(), b"{}"]
    tables["dead_letters"] = {
        "received_at": [T0, T0 + 0.5, T0 + 1], "origin": [name, "o", "p"], "topic": [name, "t", "t"],
        "partition": [0, 2**31 - 1, -1], "offset": [0, 2**63 - 1, -1], "reason": [name, "r", ""],
        "raw": raw, "raw_hash": [0, 2**64 - 1, 1],
    }  # fmt: skip
    assert set(tables) >= set(TABLES)
    store.stream_below_rows = 0 if path == "python" else 10**9
    if path == "file":  # as on a chDB without a streaming insert
        monkeypatch.setattr(ChdbStore, "streaming", property(lambda _self: False))
    for t in TABLES:
        store.execute(f"CREATE TABLE {t}_old AS {t}")
        assert store.insert(t, tables[t]) == len(next(iter(tables[t].values())))
        _old_insert(store, f"{t}_old", tables[t])
        order = ", ".join("hex(raw)" if c == "raw" else f"`{c}`" for c in tables[t])  # bytes: not UTF-8
        new = store.query(f"SELECT {order} FROM {t} FINAL ORDER BY {order}")
        old = store.query(f"SELECT {order} FROM {t}_old FINAL ORDER BY {order}")
        assert new == old and len(new) == len(next(iter(tables[t].values()))), t
    got = store.query("SELECT hex(raw) AS h FROM dead_letters ORDER BY received_at")
    assert [r["h"] for r in got] == [b.hex().upper() for b in raw]  # the bytes as they came


def test_a_refused_file_insert_leaves_no_file(store: ChdbStore, monkeypatch: pytest.MonkeyPatch) -> None:
    staged: list[str] = []
    real = tempfile.mkstemp

    def mkstemp(**kw: Any) -> tuple[int, str]:
        fd, p = real(**kw)
        staged.append(p)
        return fd, p

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with pytest.raises(StoreError, match="nope"):  # no such column: the engine refuses
        store.insert_file(TWIN, pa.table({"nope": pa.array([1])}))
    assert staged and not any(Path(p).exists() for p in staged)


def test_encoded_bytes_the_engine_refuses_are_a_store_error(store: ChdbStore) -> None:
    with pytest.raises(StoreError) as e:
        store.insert_encoded(TWIN, ["node"], "ArrowStream", b"not arrow")
    assert "ArrowStream" in str(e.value)
    assert store.query(f"SELECT count() AS n FROM {TWIN}")[0]["n"] == 0


@pytest.mark.skipif(not PY24.exists(), reason="no .venv-ch24 (scripts/test.sh makes it)")
def test_the_fallback_file_insert_stores_the_same_rows_on_clickhouse_24_8(
    store: ChdbStore, tmp_path: Path
) -> None:
    """chDB 2.1 (ClickHouse 24.8) has no streaming insert and its Python() cannot take Arrow
    lists: the store writes the batch's ArrowStream bytes to a file read by file(). Those
    bytes and that SQL, on 24.8, store what the current engine stores from the same bytes."""
    tables = to_columns(
        [*_messages(), h.heartbeat("n1", T0, True, gpus=3), h.sched("submit", "A", T0, gpn=2)]
    )
    steps: list[dict[str, Any]] = [
        {"sql": s}
        for s in [*SCHEMA.create(), SCHED_EVENTS_UPGRADE, GPU_SAMPLES_UPGRADE, GPU_SAMPLES_PART_UPGRADE]
    ]
    reads = []
    for t in ("gpu_samples", "node_heartbeats", "sched_events"):
        batch = store.prepare_columns(t, tables[t])
        path = tmp_path / f"{t}.arrows"
        path.write_bytes(arrow_stream(batch))
        sql = file_insert_sql(t, batch.column_names, str(path))
        store.execute(sql)
        steps.append({"sql": sql})
        order = ", ".join(f"`{c}`" for c in batch.column_names)
        reads.append(f"SELECT {order} FROM {t} FINAL ORDER BY {order}")
    steps += [{"sql": q} for q in reads]
    r = subprocess.run([str(PY24), str(ROOT / "tests/compat/run_sql.py")], input=json.dumps(steps),
                       capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout)
    assert results[0]["version"].startswith("24.8."), results[0]
    for step, res in zip(steps, results[1:], strict=True):
        assert "error" not in res, f"{res['error']}\n-- in:\n{step['sql'][:1500]}"
    for q, res in zip(reads, results[1 + len(steps) - len(reads) :], strict=True):
        new = json.loads(str(store._run(q, "JSONCompact", None)))["data"]
        assert len(new) == len(res["rows"]) > 0 and _norm(res["rows"]) == _norm(new), q[:200]


@pytest.mark.integration  # a real broker, chDB and clickhouse-server: the benchmark end to end
def test_bench_ingest_runs_at_a_tiny_size_and_every_path_agrees() -> None:
    r = subprocess.run([sys.executable, "-m", "bench", "ingest", "--batches", "200", "--batch-messages", "50",
                        "--repeat", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["bench"] == "ingest" and fig["gpu_rows"] == 200 * 8
    for path in (
        "native",
        "store_views",
        "python_arrow",
        "python_arrow_merge",
        "file_arrow_stream",
        "arrow_stream",
        "parquet",
        "native_chdb",
        "row_binary",
    ):
        assert fig[f"raw_{path}_best_rows_per_s"] > 0
    assert fig["raw_path"] in (
        "native",
        "python_arrow",
        "python_arrow_merge",
        "file_arrow_stream",
        "arrow_stream",
        "parquet",
    )
    for wire in ("json", "pack"):
        assert fig[f"e2e_{wire}_rows_per_s"] > 0 and fig[f"ratio_e2e_{wire}_vs_raw"] > 0
        # where the writer's clock went: the first batch decoded, then the inserts, inside the clock
        first, inserts = fig[f"e2e_{wire}_first_insert_s"], fig[f"e2e_{wire}_inserts_s"]
        assert first > 0 and inserts > 0 and first + inserts <= fig[f"e2e_{wire}_s"] + 0.002, fig
    # the pack run --repeat times in one ingest process, each copy stored (else exit 2): its figure the fastest
    assert fig["e2e_pack_runs"] == 2 and fig["e2e_pack_s"] <= fig["e2e_pack_median_s"]
    assert fig["e2e_pack_s"] <= fig["e2e_pack_first_s"] and fig["ratio_e2e_pack_median_vs_raw_median"] > 0
    # each pack run beside the raw round made right after it
    paired = fig["ratio_e2e_pack_vs_raw_paired"]
    assert len(paired) == 2 and min(paired) <= fig["ratio_e2e_pack_vs_raw_paired_median"] <= max(paired)
    assert fig["packs"] > 0 and fig["packed_batches"] == 200  # 25 batches a node: each node's backlog packed
    assert fig["contended_rows_per_s"] > 0 and fig["ratio_contended_vs_alone"] > 0
    # the CPU inside each clock by thread kind (in clock ticks: a tiny run may show none)
    assert all(fig[f"cpu_{wire}_python_s"] >= 0 <= fig[f"cpu_{wire}_cores_busy"] for wire in ("json", "pack"))
    assert fig["cpu_json_python_s"] + fig["cpu_json_threadpool_s"] > 0
    for wire in ("json", "pack"):  # the broker shares the cores; no run can beat its own CPU's ceiling
        assert fig[f"cpu_{wire}_broker_s"] >= 0 and fig[f"cpu_{wire}_ended_s"] >= 0
        assert fig[f"e2e_{wire}_ceiling_rows_per_s"] >= 0.9 * fig[f"e2e_{wire}_rows_per_s"], fig
    if "server_rows_per_s" in fig:  # clickhouse-server installed
        assert fig["ratio_server_vs_chdb_store"] > 0


def test_cpu_between_counts_each_thread_under_its_kind_and_the_ended_ones_from_the_process_total() -> None:
    """A thread renamed in between counts under its new kind (not as one kind's loss and
    another's gain), a new thread its whole CPU, and threads that ended in between the rest of
    the process's own counter: never a negative kind (the old per-kind difference read the pack
    run's Python as 0.00 s)."""
    before = (10.0, {1: ("python", 4.0), 2: ("python", 3.0), 3: ("ThreadPool", 1.0)})
    # thread 2 (3 s so far) ended after using 1.4 s more; thread 3 renamed; thread 4 new
    after = (12.5, {1: ("python", 4.6), 3: ("MergeMutate", 1.2), 4: ("ThreadPool", 0.3)})
    got = ingest_bench.cpu_between(before, after)
    assert got == {"python": 0.6, "ThreadPool": 0.3, "MergeMutate": 0.2, "ended": 1.4}
    assert sum(got.values()) == pytest.approx(2.5)  # the process's total, exactly


def test_a_run_busier_than_the_cores_is_an_impossible_figure(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {ingest_bench.JSON_CLUSTER: 10, "bench-pack": 10}
    cores, slack = ingest_bench.CORES, ingest_bench.CPU_SLACK_S
    assert ingest_bench.sanity(rows, 10, {"json": 0.5}, {"pack": (cores * 0.2 + slack, 0.2)}) == 0  # ticks
    assert ingest_bench.sanity(rows, 10, {"json": 0.5}, {"pack": (cores * 2.0 + 1.0, 2.0)}) == 2
    assert "CPU outside its clock" in capsys.readouterr().err


def test_the_bench_counts_the_warnings_of_what_its_ingest_prepares() -> None:
    """A stream out of order (a copy of the pack run dated before the one it follows, as the
    bench first had it) is warned of, batch by batch: the bench counts it and refuses the run."""
    from types import SimpleNamespace

    from gpuslo.ingest.pipeline import Ingestor
    from gpuslo.ingest.writer import Raw
    from gpuslo.wire import encode
    from tests.test_ingest_commits import Recording

    gpu = [GpuSample(index=0, uuid="GPU-0", fields={"DCGM_FI_DEV_GPU_UTIL": 1.0})]
    first = [h.batch("n0", T0 + 10 * k, gpu).model_copy(update={"seq": k}) for k in range(3)]
    earlier = [b.model_copy(update={"ts": b.ts - 86400, "seq": b.seq + (1 << 40)}) for b in first]
    ing: Any = SimpleNamespace(ingestor=Ingestor(Recording(), clock=lambda: T0 + 2 * 86400))
    seen = ingest_bench.count_warnings(ing)
    later = [b.model_copy(update={"ts": b.ts + 86400, "seq": b.seq + (2 << 40)}) for b in first]
    for run, batches in enumerate((first, later)):
        ing.ingestor.prepare([Raw(f"t/0/{run}{k}", encode(b), "t", 0, k) for k, b in enumerate(batches)])
    assert seen == [0]  # a copy a day after the one before (as the bench makes them): in order
    ing.ingestor.prepare([Raw(f"t/0/e{k}", encode(b), "t", 0, k) for k, b in enumerate(earlier)])
    assert seen == [3]  # each of the earlier copy's batches out of order


def test_the_bench_refuses_fewer_than_one_repeat(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ingest_bench.main(["--repeat", "0"])
    assert exc.value.code == 2 and "'0' is not an integer in [1, 100]" in capsys.readouterr().err


def test_each_copy_of_the_pack_run_must_be_stored(capsys: pytest.CaptureFixture[str]) -> None:
    """A copy the ingest dropped (as replays of the one before, say) is an impossible figure."""
    json_rows = {ingest_bench.JSON_CLUSTER: 10}
    assert ingest_bench.sanity(json_rows | {"bench-pack": 30}, 10, {"pack": 0.5}, None, 3) == 0
    assert ingest_bench.sanity(json_rows | {"bench-pack": 10}, 10, {"pack": 0.5}, None, 3) == 2
    assert "10 GPU rows in the store from the pack run, 30 sent" in capsys.readouterr().err


def test_the_report_without_proc_leaves_the_cpu_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where there is no /proc nothing is measured: no CPU line, no zeros, no division by them."""
    monkeypatch.setattr(ingest_bench, "Path", lambda p: Path("/nonexistent-proc") / str(p).lstrip("/"))
    assert ingest_bench.thread_cpu() == (0.0, {})
    cpu = ingest_bench.cpu_between(ingest_bench.thread_cpu(), ingest_bench.thread_cpu())
    assert cpu == {}
    run = ingest_bench.Run(1.0, 1, 10, cpu)
    f = ingest_bench.Figures(1, 10, 10, {}, 0.1, run, [run], 1, 1, [PathResult("python_arrow", (0.5,))])
    out = ingest_bench.report(f, 1)
    assert out and "CPU inside the clock" not in capsys.readouterr().out


def _over_days(n: int = 60, days: int = 3) -> list[GpuSampleBatch]:
    """Batches whose days interleave (a backlog's packs of several nodes), one ending a day a
    millisecond short of midnight."""
    gpu = [GpuSample(index=0, uuid="GPU-0", fields={"DCGM_FI_DEV_GPU_UTIL": 1.0})]
    out = [h.batch(f"n{k % 4}", T0 - (k % days) * 86400 + 10 * k, gpu) for k in range(n)]
    out.append(h.batch("edge", T0 - 0.001, gpu))
    return out


@pytest.mark.parametrize("path", ["native", "arrow_stream", "python"])
def test_a_batch_over_several_days_goes_in_one_insert_a_day_and_stores_what_one_insert_stores(
    store: ChdbStore, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chDB's insert of a batch spanning partitions (days) cost about three times the same rows
    in one: the store hands it one day at a time, and what it stores is what one insert of the
    whole batch stores (the day a millisecond before midnight included), whichever way in."""
    if path != "native":
        monkeypatch.setattr(store, "insert_native", False)
    else:  # Native goes in only through a streaming insert that raises its errors (not chDB 4.4's)
        monkeypatch.setattr(store, "_stream_raises", True)
    if path == "python":
        monkeypatch.setattr(store, "stream_below_rows", 0)
    msgs = _over_days()
    cols = to_columns(msgs)["gpu_samples"]
    seen: list[list[float]] = []
    ways: list[str] = []
    real_python, real_encoded = store.insert_python, store.insert_encoded

    def python(table: str, batch: pa.Table) -> None:
        seen.append(batch.column("ts").to_pylist())
        ways.append("python")
        real_python(table, batch)

    def encoded(table: str, names: Any, fmt: str, data: bytes) -> int:
        if fmt == "ArrowStream":
            seen.append(pa.ipc.open_stream(data).read_all().column("ts").to_pylist())
        else:  # the rows as the store reads them back (a Memory twin of the table)
            store.execute("CREATE TABLE IF NOT EXISTS day_probe AS gpu_samples ENGINE = Memory")
            store.execute("TRUNCATE TABLE day_probe")
            real_encoded("day_probe", names, fmt, data)
            seen.append([float(r["t"]) for r in store.query("SELECT toFloat64(ts) AS t FROM day_probe")])
        ways.append({"ArrowStream": "arrow_stream", "Native": "native"}[fmt])
        return real_encoded(table, names, fmt, data)

    monkeypatch.setattr(store, "insert_python", python)
    monkeypatch.setattr(store, "insert_encoded", encoded)
    assert store.insert("gpu_samples", cols) == len(msgs)
    assert set(ways) == {path}
    days = [{int(t // 86400) for t in ts} for ts in seen]
    assert all(len(d) == 1 for d in days) and [d.pop() for d in days] == sorted(
        {int(m.ts // 86400) for m in msgs}
    )
    for ts in seen:  # a day's rows keep their order
        mine = [m.ts for m in msgs if int(m.ts // 86400) == int(ts[0] // 86400)]
        assert ts == mine
    monkeypatch.setattr(store, "insert_python", real_python)
    _old_insert(store, TWIN, cols)  # one insert of the whole batch
    assert _rows(store, "gpu_samples") == _rows(store, TWIN) and len(_rows(store, TWIN)) == len(msgs)


def test_only_a_replacing_table_partitioned_by_its_day_goes_in_by_day(store: ChdbStore) -> None:
    """A retry of a batch half written (one day in, the next refused) writes the first day again:
    only a table whose duplicates collapse (ReplacingMergeTree) is split."""
    assert store._day_column("gpu_samples") == "ts" and store._day_column("node_heartbeats") == "ts"
    assert store._day_column("rollup_dirty") is None  # MergeTree: a second mark would be a duplicate
    assert store._day_column("dead_letters") is None  # by month
    assert store._day_column("alert_state") is None  # not partitioned
    assert store._day_column("no_such_table") is None


def test_by_day_leaves_a_batch_it_cannot_split_as_it_is() -> None:
    from gpuslo.ingest.store import by_day

    one = pa.table({"ts": [T0, T0 + 86399.999], "v": [1, 2]})
    assert by_day(one, "ts")[0] is one and len(by_day(one, "ts")) == 1
    two = pa.table({"ts": [T0 + 86400, T0, T0 + 86400.5, T0 + 1], "v": [1, 2, 3, 4]})
    assert [t.column("v").to_pylist() for t in by_day(two, "ts")] == [[2, 4], [1, 3]]
    for odd in (
        pa.table({"ts": [T0, None, T0 + 86400], "v": [1, 2, 3]}),  # a null: the insert says what is wrong
        pa.table({"ts": [T0, float("nan"), T0 + 86400], "v": [1, 2, 3]}),
        pa.table({"ts": pa.array([1, 86401], pa.int64()), "v": [1, 2]}),  # not epoch seconds as float
        pa.table({"v": [1, 2]}),
    ):
        assert by_day(odd, "ts") == [odd]
    assert by_day(two, None) == [two] and by_day(two.slice(0, 1), "ts") == [two.slice(0, 1)]


def test_a_table_recreated_after_its_day_column_was_asked_is_not_split_on_a_stale_answer(
    store: ChdbStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu_samples dropped and made again as a plain MergeTree in the same process: the answer
    ``ts`` must not outlive the DDL, or a batch half written (its second day refused) is written
    again by the retry and its first day doubles (nothing collapses it). Found by this round's
    attack: 81 rows where 61 were sent."""
    assert store._day_column("gpu_samples") == "ts"
    ddl = store.query(
        "SELECT create_table_query AS q FROM system.tables WHERE database = currentDatabase() AND name = 'gpu_samples'"
    )[0]["q"]
    store.execute("DROP TABLE gpu_samples")
    store.execute(ddl.replace("ReplacingMergeTree(ingested_at)", "MergeTree"))
    cols = to_columns(_over_days())["gpu_samples"]
    calls: list[int] = []
    real = store.insert_encoded

    def refuse_the_second(*a: Any) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise StoreError("refused")
        return real(*a)

    monkeypatch.setattr(store, "insert_encoded", refuse_the_second)
    try:
        store.insert("gpu_samples", cols)
    except StoreError:
        monkeypatch.setattr(store, "insert_encoded", real)
        store.insert("gpu_samples", cols)  # the ingest's retry
    assert store.query("SELECT count() AS c FROM gpu_samples")[0]["c"] == len(cols["ts"])


def test_a_table_missing_when_first_asked_goes_in_by_day_once_it_exists(store: ChdbStore) -> None:
    assert store._day_column("later") is None
    store.execute("CREATE TABLE later AS gpu_samples")
    assert store._day_column("later") == "ts"


@pytest.mark.parametrize("n", [0, 1, 17, 18, 20, 21, 40, 41])
@pytest.mark.parametrize("per", [1, 18, 20])
def test_contended_decoding_takes_every_pack(n: int, per: int) -> None:
    """The decoding beside the contended inserts is the pack run's: batches of its packs per
    batch, every pack in one (it once took 18 of every batch, whatever the batch)."""
    from bench.ingest import in_batches

    items = list(range(n))
    batches = in_batches(items, per)
    assert [x for b in batches for x in b] == items
    assert all(len(b) == per for b in batches[:-1]) and all(0 < len(b) <= per for b in batches)

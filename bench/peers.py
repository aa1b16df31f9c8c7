"""gpuslo against what teams run instead: dcgm-exporter scraped by Prometheus, side by side.

One synthetic fleet (the generator of ``bench rules``: GPUs on 8-GPU nodes every 10 s, 2-hour
Slurm jobs, a drained day, one service's latency histogram with a degraded day) is
  - written to gpuslo's store (chDB) by SQL, with its per-minute rollups, and
  - exported from that store, by SQL, as OpenMetrics text in dcgm-exporter's names and labels
    (``DCGM_FI_DEV_GPU_UTIL`` and ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` with gpu, UUID, device,
    modelName, Hostname, and ``hpc_job`` while a job holds the GPU, as dcgm-exporter's
    ``--hpc-job-mapping-dir`` adds it; the node's drain state as kube-state-metrics'
    ``kube_node_spec_unschedulable``; the latency as a Prometheus histogram), backfilled into a
    real Prometheus TSDB with ``promtool tsdb create-blocks-from openmetrics``, and Prometheus
    started on it.
Then, side by side: bytes on disk per sample, the RSS of each while answering (Prometheus: its
process; gpuslo: a subprocess holding chDB), and the time of the same numbers over the whole
window, in PromQL (HTTP API, ``time=`` the window's end) and in gpuslo over rollups and over raw
rows: active CUR, allocation CUR, idle GPU-hours allocated/unallocated, the SLO's SLI over the
window and its burn rate over every alert window ending there. Every pair is compared; the run
fails when one disagrees. What PromQL cannot express is printed, not left out.

Every step has a timeout (``--timeout``) and fails with the step's name. Sizes: ``--gpus``,
``--days``; the figures say which size they are for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

IDLE = 0.05  # gpuslo's default idle threshold (activity below it is idle)
STEP_S = 10  # the fleet's sample interval
PROMTOOL = "/usr/bin/promtool"
PROMETHEUS = "/usr/bin/prometheus"
METRIC = "bench_svc_request_latency_seconds"  # gpuslo's Prometheus export names it so (rules/prometheus.py)
RAW_TABLES = ("gpu_samples", "node_heartbeats", "latency")
ROLLUP_TABLES = ("gpu_rollup_1m", "owner_rollup_1m", "latency_rollup_1m")
UTIL_KEYS = (
    "capacity_gpu_h",
    "active_cur",
    "allocation_cur",
    "idle_allocated_gpu_h",
    "idle_unallocated_gpu_h",
)
TOLERANCE = 1e-6  # relative; the store keeps activity as Float32, the text carries its shortest decimal

CANNOT = {
    "starvation incidents with cause": (
        "a pending request's wait is an interval per request, and its cause (capacity, fragmentation, "
        "policy) needs the free GPUs of every node at the moment it opens, matched against the request's "
        "per-node shape; PromQL has series and instants, no per-request intervals and no placement test"
    ),
    "min-duration idle": (
        "idle counted only in runs of at least min_idle_s needs the length of each run of consecutive "
        "idle samples; PromQL has no run-length or sequence function (a subquery sees each step alone)"
    ),
    "fractional shares": (
        "a GPU shared by several holders (MIG, time-slicing, MPS, DRA) splits its seconds by each "
        "holder's share; dcgm-exporter labels one pod per series, so a shared GPU is either one holder's "
        "or counted once per pod, never split"
    ),
}


class StepFailed(Exception):
    """A step of the run did not finish (timeout, a tool's error); the message names it."""


# ---------------------------------------------------------------- the gpuslo side (subprocesses)


def label_sql(expr: str) -> str:
    """SQL: a string as an OpenMetrics label value (backslash, double quote and newline escaped)."""
    return rf"""replaceAll(replaceAll(replaceAll({expr}, '\\', '\\\\'), '"', '\\"'), '\n', '\\n')"""


def _om_gpu(family: str, value: str) -> str:
    """One DCGM family, by SQL: a line per GPU sample, in dcgm-exporter's labels."""
    return f"""
        SELECT concat('{family}{{gpu="', toString(gpu), '",UUID="', {label_sql("uuid")}, '",device="nvidia',
            toString(gpu), '",modelName="', {label_sql("model")}, '",Hostname="', {label_sql("node")}, '"',
            if(length(alloc_ids) > 0, concat(',hpc_job="', {label_sql("alloc_ids[1]")}, '"'), ''),
            '}} ', {value}, ' ', toString(toFloat64(ts)))
        FROM gpu_samples ORDER BY ts, node, gpu"""


def _om_nodes() -> str:
    return f"""
        SELECT concat('kube_node_spec_unschedulable{{node="', {label_sql("node")}, '"}} ',
            toString(toUInt8(NOT schedulable)),
            ' ', toString(toFloat64(ts)))
        FROM node_heartbeats ORDER BY ts, node"""


def _om_latency(les: Sequence[str]) -> str:
    """The histogram: cumulative counters at each row's ts (a row counts the requests of
    (ts - interval, ts], as gpuslo's SLO windows (from, to] read it)."""
    le_list = ", ".join(f"'{le}'" for le in les)
    return f"""
        SELECT arrayJoin(arrayConcat(
                arrayMap((le, c) -> concat('{METRIC}_bucket{{le="', le, '"}} ', toString(c), ' ', t),
                         [{le_list}, '+Inf'], cum),
                [concat('{METRIC}_count ', toString(cum[-1]), ' ', t), concat('{METRIC}_sum 0 ', t)]))
        FROM
        (
            SELECT toString(toFloat64(ts)) AS t, ts,
                sumForEach(arrayCumSum(counts)) OVER (ORDER BY ts ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
                    AS cum
            FROM latency WHERE service = 'bench-svc'
        )
        ORDER BY ts"""


def le_label(bound_ms: float) -> str:
    """The ``le`` of a bucket bound in milliseconds, in seconds as the histogram's label."""
    return repr(bound_ms / 1000.0)


def _export(store: Any, out: Path, bounds: Sequence[float]) -> None:
    """The OpenMetrics file: every family contiguous, each series in time order, ``# EOF``."""
    parts = [
        (
            "DCGM_FI_DEV_GPU_UTIL",
            "gauge",
            _om_gpu("DCGM_FI_DEV_GPU_UTIL", "toString(toUInt8(round(activity * 100)))"),
        ),
        (
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
            "gauge",
            _om_gpu("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "toString(activity)"),
        ),
        ("kube_node_spec_unschedulable", "gauge", _om_nodes()),
        (METRIC, "histogram", _om_latency([le_label(b) for b in bounds])),
    ]
    with out.open("wb") as f:
        for i, (name, kind, q) in enumerate(parts):
            part = out.with_suffix(f".{i}")
            store.execute(f"{q} INTO OUTFILE '{part}' FORMAT TSVRaw")
            f.write(f"# TYPE {name} {kind}\n".encode())
            with part.open("rb") as p:
                shutil.copyfileobj(p, f, 1 << 20)
            part.unlink()
        f.write(b"# EOF\n")


def _bytes(store: Any, tables: Sequence[str]) -> int:
    names = ", ".join(f"'{t}'" for t in tables)
    rows = store.query(
        "SELECT sum(bytes_on_disk) AS b FROM system.parts "
        f"WHERE active AND database = currentDatabase() AND table IN ({names})"
    )
    return int(rows[0]["b"] or 0)


def _child_generate(a: argparse.Namespace) -> dict[str, Any]:
    from bench.rules import BOUNDS, populate
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules import rollup
    from gpuslo.rules.tables import SCHEMA

    store = ChdbStore(a.store)
    try:
        store.migrate(SCHEMA)
        gen_s, counts = _timed(lambda: populate(store, a.gpus, a.days))
        refresh_s, _ = _timed(lambda: rollup.refresh(store))
        for t in RAW_TABLES + ROLLUP_TABLES:  # merged as a store settles; sizes of the settled parts
            store.execute(f"OPTIMIZE TABLE {t} FINAL")
        raw_b, roll_b = _bytes(store, RAW_TABLES), _bytes(store, ROLLUP_TABLES)
        export_s, _ = _timed(lambda: _export(store, Path(a.openmetrics), BOUNDS))
    finally:
        store.close()
    return {
        "counts": counts, "generate_s": gen_s, "refresh_s": refresh_s, "export_s": export_s,
        "raw_bytes": raw_b, "rollup_bytes": roll_b,
    }  # fmt: skip


def _child_eval(a: argparse.Namespace) -> dict[str, Any]:
    from bench.rules import START, _config
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules import sql
    from gpuslo.rules.evaluate import summary, utilization

    cfg = _config()
    slo = cfg.slos[0]
    frm, to = START, START + a.days * 86400
    store = ChdbStore(a.store)
    out: dict[str, Any] = {}
    try:
        store.query("SELECT 1 AS one")  # the engine's start, not a query's cost
        for over, ru in (("rollup", True), ("raw", False)):
            sec, groups = _best2(partial(utilization, store, frm, to, IDLE, "", ru))
            out[f"util_{over}_s"] = sec
            out[f"util_{over}"] = _fleet(groups)
            slos: dict[str, Any] = {}
            total_s = 0.0
            for w in _windows(a.days, slo):
                q = sql.SLO_WINDOW_TOTALS_ROLLUP if ru else sql.SLO_WINDOW_TOTALS
                p = {"service": slo.service, "cluster": "", "threshold": float(slo.threshold_ms),
                     "from": float(to - w), "to": float(to)}  # fmt: skip
                sec, rows = _best2(partial(store.query, q, p))
                total_s += sec
                good, total = float(rows[0]["good"] or 0), float(rows[0]["total"] or 0)
                slos[str(w)] = {
                    "sli": good / total if total else None,
                    "burn": _burn(good, total, slo.objective),
                }
            out[f"slo_{over}_s"] = total_s
            out[f"slo_{over}"] = slos
        out["summary_rollup_s"], _ = _timed(lambda: summary(store, cfg, frm, to, source="rollup"))
    finally:
        store.close()
    out["vm_hwm_kb"] = _status_kb(os.getpid(), "VmHWM")
    return out


def _fleet(groups: Sequence[Any]) -> dict[str, float | None]:
    cap = sum(g.capacity_s for g in groups)
    alloc = sum(g.allocated_s for g in groups)
    act = sum(g.active_s for g in groups)
    return {
        "capacity_gpu_h": cap / 3600,
        "active_cur": act / cap if cap else None,
        "allocation_cur": alloc / cap if cap else None,
        "idle_allocated_gpu_h": sum(g.idle_allocated_s for g in groups) / 3600,
        "idle_unallocated_gpu_h": sum(g.idle_unallocated_s for g in groups) / 3600,
    }


def _burn(good: float, total: float, objective: float) -> float | None:
    """The burn rate of rules/evaluate.py (the metric definitions): (1 - SLI) / (1 - objective)."""
    return (1.0 - good / total) / (1.0 - objective) if total else None


def _windows(days: float, slo: Any) -> list[int]:
    """The whole window, then every alert window (long and short) of the SLO that fits in it."""
    whole = int(days * 86400)
    lengths = sorted({w.long_s for w in slo.windows} | {w.short_s for w in slo.windows})
    return [whole] + [w for w in lengths if w <= whole and w != whole]


# ---------------------------------------------------------------- processes, memory, steps


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _best2(fn: Callable[[], T]) -> tuple[float, T]:
    """Best of two runs (the first warms caches: page cache, chDB's and Prometheus's own)."""
    s1, _ = _timed(fn)
    s2, out = _timed(fn)
    return min(s1, s2), out


def _status_kb(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` figure in kB (0 once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


@contextmanager
def _rss_peak(pid: int, limit_mb: float, every_s: float = 0.05) -> Iterator[list[int]]:
    """The highest VmRSS of ``pid`` sampled while the block runs (``peak[0]``, kB); a process
    over ``limit_mb`` is killed (``peak[1]`` = 1): this machine is shared, and a PromQL subquery
    over a long window at the sample's resolution grows with series churn x steps."""
    peak = [0, 0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status_kb(pid, "VmRSS"))
            if peak[0] > limit_mb * 1024 and not peak[1]:
                peak[1] = 1
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            stop.wait(every_s)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        yield peak
    finally:
        stop.set()
        th.join()


def _over(what: str, limit_mb: float) -> StepFailed:
    return StepFailed(
        f"{what}: RSS over {limit_mb:g} MB, killed (try smaller --gpus/--days, or raise --max-rss-mb)"
    )


def _child(step: str, args: list[str], timeout_s: float, limit_mb: float) -> tuple[dict[str, Any], int]:
    """Run a gpuslo step in its own process; its JSON line and its peak sampled RSS (kB)."""
    cmd = [sys.executable, "-m", "bench", "peers", f"_{step}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with _rss_peak(proc.pid, limit_mb) as peak:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise StepFailed(
                f"gpuslo {step}: not done within {timeout_s:g} s (try smaller --gpus/--days)"
            ) from None
    if peak[1]:
        raise _over(f"gpuslo {step}", limit_mb)
    if proc.returncode != 0:
        raise StepFailed(f"gpuslo {step} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1]), peak[0]


def _promtool(promtool: str, om: Path, tsdb: Path, block_h: int, timeout_s: float) -> float:
    cmd = [promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet",
           f"--max-block-duration={block_h}h", str(om), str(tsdb)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise StepFailed(
            f"promtool backfill: not done within {timeout_s:g} s (try smaller --gpus/--days)"
        ) from None
    except OSError as exc:
        raise StepFailed(f"promtool backfill: cannot run {promtool}: {exc}") from None
    if r.returncode != 0:
        raise StepFailed(
            f"promtool backfill failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}"
        )
    return time.perf_counter() - t0


def _dir_bytes(path: Path, skip: Sequence[str] = ()) -> int:
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not any(part in skip for part in p.relative_to(path).parts):
            total += p.stat().st_size
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Prometheus:
    proc: subprocess.Popen[bytes]
    url: str
    timeout_s: float

    def query(self, q: str, at: float) -> float | None:
        """One instant query at ``at``: the single value, ``None`` for an empty result."""
        args = urllib.parse.urlencode({"query": q, "time": f"{at:.3f}", "timeout": f"{int(self.timeout_s)}s"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{args}", timeout=self.timeout_s + 5) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            raise StepFailed(f"PromQL {q!r}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise StepFailed(f"PromQL {q!r}: no answer within {self.timeout_s:g} s: {exc}") from None
        res = body.get("data", {}).get("result", [])
        if not res:
            return None
        if len(res) != 1:
            raise StepFailed(f"PromQL {q!r}: {len(res)} series, expected one")
        return float(res[0]["value"][1])


@contextmanager
def _prometheus(binary: str, tsdb: Path, work: Path, timeout_s: float) -> Iterator[Prometheus]:
    cfg = work / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 10s\n")
    port = _free_port()
    log = (work / "prometheus.log").open("wb")
    cmd = [
        binary, f"--config.file={cfg}", f"--storage.tsdb.path={tsdb}", f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=100y",  # retention counts back from the newest block: keep all
        # no compaction of the backfilled blocks while it answers (the planner's only range: 2 h)
        "--storage.tsdb.min-block-duration=2h", "--storage.tsdb.max-block-duration=2h",
        "--query.max-samples=2000000000", f"--query.timeout={int(timeout_s)}s",
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    except OSError as exc:
        raise StepFailed(f"prometheus: cannot run {binary}: {exc}") from None
    try:
        prom = Prometheus(proc, f"http://127.0.0.1:{port}", timeout_s)
        _ready(prom, work / "prometheus.log", timeout_s)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(prom: Prometheus, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if prom.proc.poll() is not None:
            raise StepFailed(f"prometheus exited ({prom.proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise StepFailed(f"prometheus: not ready within {timeout_s:g} s")


# ---------------------------------------------------------------- PromQL


def _sched() -> str:
    # a node is capacity while its latest state says schedulable; samples only at their own ts
    return 'label_replace(last_over_time(kube_node_spec_unschedulable[5s]) == 0, "Hostname", "$1", "node", "(.*)")'


def _gpus(sel: str = "", cond: str = "") -> str:
    """Per GPU and step: its activity while it is capacity. ``[5s]``: a sample stands only for
    its own step (gpuslo's [ts, ts + interval_s)); the default 5-minute lookback would keep a
    finished job's series alive next to the GPU's next one (backfilled data has no staleness
    markers)."""
    return f"(last_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{sel}}}[5s]){cond}) and on(Hostname) {_sched()}"


def promql(days: float, slo_le: str, objective: float, windows: Sequence[int]) -> dict[str, str]:
    """The PromQL of every compared number, evaluated at the window's end. The subquery's steps
    are [end - W - 10 s, end - 10 s] (``offset 10s``: its range is closed at both ends, and the
    step at the end itself would see the last sample again through the lookback)."""
    sub = f"[{int(days * 86400)}s:{STEP_S}s] offset {STEP_S}s"
    every, held = _gpus(), _gpus('hpc_job!=""')
    held_idle, free_idle = _gpus('hpc_job!=""', f" < {IDLE}"), _gpus('hpc_job=""', f" < {IDLE}")
    cap = f"sum(count_over_time(({every}){sub}))"
    q = {
        "capacity_gpu_h": f"{STEP_S} * {cap} / 3600",
        "active_cur": f"sum(sum_over_time(({every}){sub})) / {cap}",
        "allocation_cur": f"sum(count_over_time(({held}){sub})) / {cap}",
        "idle_allocated_gpu_h": f"{STEP_S} * sum(count_over_time(({held_idle}){sub})) / 3600",
        "idle_unallocated_gpu_h": f"{STEP_S} * sum(count_over_time(({free_idle}){sub})) / 3600",
    }
    for w in windows:
        ratio = f'sum(increase({METRIC}_bucket{{le="{slo_le}"}}[{w}s])) / sum(increase({METRIC}_count[{w}s]))'
        q[f"sli_{w}"] = ratio
        q[f"burn_{w}"] = f"(1 - {ratio}) / {1 - objective!r}"
    return q


def naive_promql(days: float) -> dict[str, tuple[str, str]]:
    """What is usually written instead, for the difference it makes (not compared for agreement):
    name -> (the gpuslo quantity it stands for, PromQL)."""
    w = f"{int(days * 86400)}s"
    plain = f"DCGM_FI_PROF_GR_ENGINE_ACTIVE and on(Hostname) {_sched().replace('last_over_time(', '(').replace('[5s])', ')')}"
    return {
        # a dashboard's CUR: the mean of each series' mean; every hpc_job series weighs the same
        # however long it lived, and drained nodes count
        "naive_active_cur_avg_of_avgs": (
            "active_cur",
            f"avg(avg_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE[{w}]))",
        ),
        # sample-weighted over every sample: right weights, but drained nodes count
        "naive_active_cur_all_samples": (
            "active_cur",
            f"sum(sum_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE[{w}])) / "
            f"sum(count_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE[{w}]))",
        ),
        # the drain joined at every step with the default 5-minute lookback: a finished job's
        # series stays alive for 5 minutes next to the GPU's next series (no staleness markers)
        "naive_capacity_gpu_h_lookback_5m": (
            "capacity_gpu_h",
            f"{STEP_S} * sum(count_over_time(({plain})[{w}:{STEP_S}s] offset {STEP_S}s)) / 3600",
        ),
    }


# ---------------------------------------------------------------- the run


def _rel(a: float | None, b: float | None) -> float | None:
    """Relative difference (None when one side has no value and the other has)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else None
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def _pairs(
    g: dict[str, Any], over: str, prom: dict[str, float | None], windows: Sequence[int]
) -> dict[str, Any]:
    """gpuslo's number next to PromQL's, per compared quantity."""
    util = g[f"util_{over}"]
    slos = g[f"slo_{over}"]
    out: dict[str, Any] = {}
    for k in UTIL_KEYS:
        out[k] = (util[k], prom[k])
    for w in windows:
        out[f"sli_{w}"] = (slos[str(w)]["sli"], prom[f"sli_{w}"])
        out[f"burn_{w}"] = (slos[str(w)]["burn"], prom[f"burn_{w}"])
    return out


def _run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from bench.rules import BOUNDS, _config

    slo = _config().slos[0]
    store, om, tsdb = work / "store", work / "fleet.om", work / "tsdb"
    size = ["--gpus", str(a.gpus), "--days", repr(a.days), "--store", str(store)]
    gen, _ = _child("generate", [*size, "--openmetrics", str(om)], a.timeout, a.max_rss_mb)
    c = gen["counts"]
    print(f"fleet: {a.gpus} GPUs x {a.days:g} days at {STEP_S} s: {c} (generated in {gen['generate_s']:.1f} s, "
          f"rollups {gen['refresh_s']:.1f} s, OpenMetrics export {gen['export_s']:.1f} s, "
          f"{om.stat().st_size / 1e6:.1f} MB)")  # fmt: skip
    prom_samples = 2 * c["gpu_samples"] + c["node_heartbeats"] + (len(BOUNDS) + 3) * c["latency"]
    backfill_s = _promtool(a.promtool, om, tsdb, a.block_h, a.timeout)
    prom_bytes = _dir_bytes(tsdb)
    om.unlink()
    print(
        f"promtool backfill: {prom_samples:,} samples in {backfill_s:.1f} s, {prom_bytes / 1e6:.1f} MB on disk"
    )

    windows = _windows(a.days, slo)
    queries = promql(a.days, le_label(slo.threshold_ms), slo.objective, windows)
    end = _window_end(a.days)
    prom_vals: dict[str, float | None] = {}
    prom_times: dict[str, float] = {}
    with _prometheus(a.prometheus, tsdb, work, a.timeout) as prom:
        with _rss_peak(prom.proc.pid, a.max_rss_mb) as prom_peak:
            for k, q in queries.items():
                _prom_query(prom, prom_peak, a.max_rss_mb, k, q, end, prom_times, prom_vals, _best2)
        prom_hwm = _status_kb(prom.proc.pid, "VmHWM")
        with _rss_peak(
            prom.proc.pid, a.max_rss_mb
        ) as naive_peak:  # after the memory figures: not counted there
            for k, (_, q) in naive_promql(a.days).items():
                _prom_query(prom, naive_peak, a.max_rss_mb, k, q, end, prom_times, prom_vals, _timed)
    g, g_peak = _child("eval", size, a.timeout, a.max_rss_mb)
    return _report(a, gen, g, g_peak, prom_vals, prom_times, prom_peak[0], prom_hwm, prom_bytes, prom_samples,
                   backfill_s, windows, queries)  # fmt: skip


def _prom_query(
    prom: Prometheus, peak: list[int], limit_mb: float, k: str, q: str, end: float,
    times: dict[str, float], vals: dict[str, float | None], timing: Callable[[Callable[[], float | None]], Any],
) -> None:  # fmt: skip
    try:
        times[k], vals[k] = timing(partial(prom.query, q, end))
    except StepFailed:
        if peak[1]:
            raise _over(f"prometheus answering {k}", limit_mb) from None
        raise


def _window_end(days: float) -> float:
    """The window's end: the generator's start plus the history."""
    from bench.rules import START

    return START + days * 86400


def _report(
    a: argparse.Namespace, gen: dict[str, Any], g: dict[str, Any], g_peak: int, prom_vals: dict[str, float | None],
    prom_times: dict[str, float], prom_peak: int, prom_hwm: int, prom_bytes: int, prom_samples: int,
    backfill_s: float, windows: Sequence[int], queries: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    prom_util_s = sum(prom_times[k] for k in UTIL_KEYS)
    prom_slo_s = sum(t for k, t in prom_times.items() if k not in UTIL_KEYS and not k.startswith("naive_"))
    worst = 0.0
    agree = True
    print(
        f"{'quantity':26s} {'gpuslo rollups':>16s} {'gpuslo raw':>16s} {'PromQL':>16s}  PromQL s  max rel diff"
    )
    roll, raw = _pairs(g, "rollup", prom_vals, windows), _pairs(g, "raw", prom_vals, windows)
    for k, (rv, pv) in roll.items():
        d1, d2 = _rel(rv, pv), _rel(raw[k][0], pv)
        ok = d1 is not None and d2 is not None and d1 <= TOLERANCE and d2 <= TOLERANCE
        agree = agree and ok
        worst = max(worst, d1 or 0.0, d2 or 0.0)
        print(f"{k:26s} {_f(rv):>16s} {_f(raw[k][0]):>16s} {_f(pv):>16s}  {prom_times[k]:8.2f}  "
              f"{max(d1 or 0, d2 or 0):.1e}{'' if ok else '  DISAGREE'}")  # fmt: skip
    print(f"time, CUR and idle over {a.days:g} days: PromQL {prom_util_s:.2f} s ({len(UTIL_KEYS)} queries); gpuslo "
          f"{g['util_rollup_s']:.3f} s over rollups, {g['util_raw_s']:.3f} s over raw rows (1 query)")  # fmt: skip
    print(f"time, SLI and burn over {len(windows)} windows: PromQL {prom_slo_s:.2f} s; gpuslo "
          f"{g['slo_rollup_s']:.3f} s over rollups, {g['slo_raw_s']:.3f} s over raw rows")  # fmt: skip
    print(f"gpuslo, every rule of the summary over rollups (starvation incidents included): "
          f"{g['summary_rollup_s']:.2f} s")  # fmt: skip
    g_bytes = gen["raw_bytes"]
    print(f"bytes per sample: Prometheus {prom_bytes / prom_samples:.3f}; gpuslo raw rows {g_bytes / prom_samples:.3f} "
          f"(+ rollups {gen['rollup_bytes'] / prom_samples:.3f}) for the same {prom_samples:,} samples")  # fmt: skip
    print(f"RSS while answering (peak sampled): Prometheus {prom_peak / 1024:.0f} MB (VmHWM {prom_hwm / 1024:.0f} MB); "
          f"gpuslo (chDB in a subprocess) {g_peak / 1024:.0f} MB (VmHWM {g['vm_hwm_kb'] / 1024:.0f} MB)")  # fmt: skip
    for k, (like, _q) in naive_promql(a.days).items():
        d = _rel(prom_vals[k], g["util_raw"][like])
        print(f"as usually written, {k}: {_f(prom_vals[k])} against {_f(g['util_raw'][like])} "
              f"({'-' if d is None else f'{100 * d:.3g} %'} off; {prom_times[k]:.2f} s)")  # fmt: skip
    for what, why in CANNOT.items():
        print(f"PromQL cannot express {what}: {why}")
    return {
        "bench": "peers", "gpus": a.gpus, "days": a.days, "gpu_sample_rows": gen["counts"]["gpu_samples"],
        "prom_samples": prom_samples, "backfill_s": round(backfill_s, 2), "generate_s": round(gen["generate_s"], 2),
        "agree": agree, "max_rel_diff": worst,
        "prom_bytes_per_sample": round(prom_bytes / prom_samples, 4),
        "gpuslo_bytes_per_sample": round(g_bytes / prom_samples, 4),
        "gpuslo_rollup_bytes_per_sample": round(gen["rollup_bytes"] / prom_samples, 4),
        "prom_rss_mb": round(prom_peak / 1024, 1), "gpuslo_rss_mb": round(g_peak / 1024, 1),
        "prom_util_s": round(prom_util_s, 3), "prom_slo_s": round(prom_slo_s, 3),
        "gpuslo_util_rollup_s": round(g["util_rollup_s"], 4), "gpuslo_util_raw_s": round(g["util_raw_s"], 4),
        "gpuslo_slo_rollup_s": round(g["slo_rollup_s"], 4), "gpuslo_slo_raw_s": round(g["slo_raw_s"], 4),
        "gpuslo_summary_rollup_s": round(g["summary_rollup_s"], 3),
        "ratio_bytes_per_sample": _ratio(g_bytes, prom_bytes),
        "ratio_rss": _ratio(g_peak, prom_peak),
        "ratio_util_rollup_s": _ratio(g["util_rollup_s"], prom_util_s),
        "ratio_util_raw_s": _ratio(g["util_raw_s"], prom_util_s),
        "ratio_slo_rollup_s": _ratio(g["slo_rollup_s"], prom_slo_s),
        "ratio_slo_raw_s": _ratio(g["slo_raw_s"], prom_slo_s),
        "values": {k: {"gpuslo_rollup": v, "gpuslo_raw": raw[k][0], "promql": p} for k, (v, p) in roll.items()},
        "promql": queries,
        "naive": {k: {"promql": prom_vals[k], "gpuslo_raw": g["util_raw"][like], "query": q}
                  for k, (like, q) in naive_promql(a.days).items()},
        "promql_cannot": sorted(CANNOT),
    }  # fmt: skip


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench peers")
    ap.add_argument("--gpus", type=int, default=1000, help="GPUs in the fleet (8 per node)")
    ap.add_argument("--days", type=float, default=7.0, help="days of history at 10 s")
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds each step may take before the run fails"
    )
    ap.add_argument("--block-h", type=int, default=0,
                    help="promtool's --max-block-duration in hours (default: the whole window, at most 31 d)")  # fmt: skip
    ap.add_argument("--promtool", default=PROMTOOL, help="promtool to backfill with")
    ap.add_argument("--prometheus", default=PROMETHEUS, help="Prometheus to answer the PromQL")
    ap.add_argument("--max-rss-mb", type=float, default=6144.0,
                    help="a process of the run (Prometheus, a gpuslo step) over this is killed and the run fails")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=None, help="where the store, the file and the TSDB go")
    a = ap.parse_args(argv)
    if a.gpus < 8 or a.days <= 0 or a.timeout <= 0:
        ap.error("--gpus must be at least 8 (one node), --days and --timeout positive")
    if abs(a.days * 1440 - round(a.days * 1440)) > 1e-9:
        ap.error("--days must be a whole number of minutes (the rollups are per minute)")
    if a.block_h <= 0:
        a.block_h = min(31 * 24, max(2, int(-(-a.days * 24 // 1))))
    return a


def _child_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench peers _child")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--days", type=float, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--openmetrics", default="")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("_generate", "_eval"):
        ca = _child_args(argv[1:])
        try:
            print(json.dumps(_child_generate(ca) if argv[0] == "_generate" else _child_eval(ca)))
        except Exception as exc:  # the parent names the step; one line, not a traceback
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        return 0
    a = _args(argv)
    if a.gpus % 8:
        print(f"note: {a.gpus} GPUs is not a multiple of 8; the fleet has {a.gpus // 8 * 8}")
        a.gpus = a.gpus // 8 * 8  # the figures name the fleet measured
    try:
        work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-peers-", dir=a.workdir))
    except OSError as exc:
        print(f"bench peers: cannot make a work directory in {a.workdir or tempfile.gettempdir()}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        fig = _run(a, work)
    except StepFailed as exc:
        print(f"bench peers: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(fig))
    return 0 if fig["agree"] else 1

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
import itertools
import json
import os
import re
import shutil
import signal
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


ONE_RUN_S = 30.0  # a step that took longer is not run again: its warm-up is a small part of it


def _best2(fn: Callable[[], T]) -> tuple[float, T]:
    """Best of two runs (the first warms caches: page cache, chDB's and Prometheus's own); one
    run when the first took over ``ONE_RUN_S`` (at the issue's size the PromQL over the raw
    series takes minutes, and a second run would double the bench for a warm-up's worth)."""
    s1, out = _timed(fn)
    if s1 > ONE_RUN_S:
        return s1, out
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


def _tool(cmd: list[str], what: str, timeout_s: float, cwd: Path | None = None) -> tuple[Any, float]:
    """Run a tool of the peer's (promtool) within ``timeout_s``; its result and its seconds."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise StepFailed(f"{what}: not done within {timeout_s:g} s (try smaller --gpus/--days)") from None
    except OSError as exc:
        raise StepFailed(f"{what.split(' (')[0]}: cannot run {cmd[0]}: {exc}") from None
    return r, time.perf_counter() - t0


def _promtool(promtool: str, om: Path, tsdb: Path, block_h: int, timeout_s: float) -> float:
    cmd = [promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet",
           f"--max-block-duration={block_h}h", str(om), str(tsdb)]  # fmt: skip
    r, sec = _tool(cmd, "promtool backfill", timeout_s)
    if r.returncode != 0:
        raise StepFailed(
            f"promtool backfill failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}"
        )
    return sec


def _dir_bytes(path: Path, skip: Sequence[str] = ()) -> int:
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not any(part in skip for part in p.relative_to(path).parts):
            total += p.stat().st_size
    return total


@dataclass(frozen=True, slots=True)
class Prometheus:
    proc: subprocess.Popen[bytes]
    url: str
    timeout_s: float

    def _get(self, q: str, at: float) -> Any:
        args = urllib.parse.urlencode({"query": q, "time": f"{at:.3f}", "timeout": f"{int(self.timeout_s)}s"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{args}", timeout=self.timeout_s + 5) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            raise StepFailed(f"PromQL {q!r}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            if self.proc.poll() is not None:  # not a slow answer: the server is gone
                raise StepFailed(f"PromQL {q!r}: prometheus exited ({self.proc.returncode})") from None
            raise StepFailed(f"PromQL {q!r}: no answer within {self.timeout_s:g} s: {exc}") from None
        return body.get("data", {}).get("result", [])

    def query(self, q: str, at: float) -> float | None:
        """One instant query at ``at``: the single value, ``None`` for an empty result."""
        res = self._get(q, at)
        if not res:
            return None
        if len(res) != 1:
            raise StepFailed(f"PromQL {q!r}: {len(res)} series, expected one")
        return float(res[0]["value"][1])

    def times(self, series: str, at: float, range_s: int) -> list[float]:
        """The timestamps of one series' samples in ``[at - range_s, at]``."""
        q = f"{series}[{range_s}s]"
        res = self._get(q, at)
        if len(res) > 1:
            raise StepFailed(f"PromQL {q!r}: {len(res)} series, expected one")
        return [float(t) for t, _ in res[0]["values"]] if res else []


@contextmanager
def _prometheus(binary: str, tsdb: Path, work: Path, timeout_s: float) -> Iterator[Prometheus]:
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 10s\n")
    from tests.servers.ports import free_port  # outside the ephemeral range: see there

    port = free_port()
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


def _sched(lookback: str = "5s") -> str:
    # a node is capacity while its latest state says schedulable; samples only at their own ts
    return (
        f"label_replace(last_over_time(kube_node_spec_unschedulable[{lookback}]) == 0, "
        '"Hostname", "$1", "node", "(.*)")'
    )


def _gpus(sel: str = "", cond: str = "", lookback: str = "5s") -> str:
    """Per GPU and step: its activity while it is capacity. ``[5s]``: a sample stands only for
    its own step (gpuslo's [ts, ts + interval_s)); the default 5-minute lookback would keep a
    finished job's series alive next to the GPU's next one (backfilled data has no staleness
    markers)."""
    return (
        f"(last_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{sel}}}[{lookback}]){cond}) "
        f"and on(Hostname) {_sched(lookback)}"
    )


# the five sums the utilization numbers are made of: name -> (selector, condition, aggregation)
COMPONENTS: dict[str, tuple[str, str, str]] = {
    "capacity": ("", "", "count"),  # GPU samples on schedulable nodes
    "active": ("", "", "sum"),  # their activity
    "held": ('hpc_job!=""', "", "count"),  # of them, held by a job
    "held_idle": ('hpc_job!=""', f" < {IDLE}", "count"),
    "free_idle": ('hpc_job=""', f" < {IDLE}", "count"),
}


def util_promql(range_s: int) -> dict[str, str]:
    """The PromQL of each component over the samples of ``[t - range_s, t)``, evaluated at
    ``t``. The subquery's steps are ``[t - range_s, t - 10 s]`` (``offset 10s``: its range is
    closed at both ends, and a step at ``t`` itself would see the sample at ``t``, the next
    range's). Disjoint ranges give disjoint steps, so a window split into ranges (as a query
    frontend splits a long query, and as this run does to bound Prometheus's memory) sums to
    exactly the whole window's answer."""
    sub = f"[{range_s - STEP_S}s:{STEP_S}s] offset {STEP_S}s"
    agg_over = {"count": "count_over_time", "sum": "sum_over_time"}
    return {
        k: f"sum({agg_over[agg]}(({_gpus(sel, cond)}){sub}))" for k, (sel, cond, agg) in COMPONENTS.items()
    }


def util_values(sums: dict[str, float]) -> dict[str, float | None]:
    """The compared numbers from the five sums (samples are 10 s each: ``STEP_S`` x a count is
    GPU-seconds)."""
    cap = sums["capacity"]
    return {
        "capacity_gpu_h": STEP_S * cap / 3600,
        "active_cur": sums["active"] / cap if cap else None,
        "allocation_cur": sums["held"] / cap if cap else None,
        "idle_allocated_gpu_h": STEP_S * sums["held_idle"] / 3600,
        "idle_unallocated_gpu_h": STEP_S * sums["free_idle"] / 3600,
    }


def chunks(frm: float, to: float, chunk_s: int) -> list[tuple[float, int]]:
    """``[frm, to)`` as (end, length) ranges of ``chunk_s`` (the last one shorter); one range
    when ``chunk_s`` is 0."""
    whole = round(to - frm)
    if chunk_s <= 0 or chunk_s >= whole:
        return [(to, whole)]
    out = []
    for start in range(0, whole, chunk_s):
        length = min(chunk_s, whole - start)
        out.append((frm + start + length, length))
    return out


EVALUATIONS = "gpuslo_peer:evaluations"  # the bench's own marker rule (recording_rules)


def rule_name(component: str) -> str:
    """The recorded series of a component (Prometheus's ``level:metric:operations`` naming)."""
    return f"cluster:gpuslo_peer_{component}:{COMPONENTS[component][2]}10s"


def recording_rules() -> str:
    """The recording rules a Prometheus deployment would run for these numbers: each component
    at every sample (``interval: 10s``), kept as one series per component. ``[9999ms]``: an
    evaluation sees each GPU's one sample of the 10 s it ends, whatever the group's evaluation
    offset (Prometheus spreads groups over the interval by a hash of their name: with the
    samples on the 10 s grid, a closed range of 9.999 s holds exactly one grid point at any
    millisecond), so every sample is counted by exactly one evaluation (the SLO's rules, as Sloth
    generates them, are a file of their own: :func:`sloth_rules`)."""
    lines = ["groups:", "  - name: gpuslo_peer", f"    interval: {STEP_S}s", "    rules:"]
    for k, (sel, cond, agg) in COMPONENTS.items():
        expr = _gpus(sel, cond, lookback="9999ms")
        lines += [f"      - record: {rule_name(k)}", f"        expr: {json.dumps(f'{agg}({expr})')}"]
    # a sample at every evaluation whatever the data (a component can be absent for a while: no
    # GPU idle, a drained node): the run checks that no evaluation is missing (check_evaluations)
    lines += [f"      - record: {EVALUATIONS}", "        expr: vector(1)"]
    return "\n".join(lines) + "\n"


SLOTH_INTERVAL_S = 30  # Sloth leaves the interval to Prometheus's evaluation_interval; 30 s is common


def duration(seconds: int) -> str:
    """A Prometheus duration as Sloth names its windows (5m, 1h, 1d)."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % n == 0:
            return f"{seconds // n}{unit}"
    return f"{seconds}s"


def sloth_rules(slo_le: str, windows: Sequence[int]) -> str:
    """The SLO's recording rules as Sloth (v0.11) generates them for a latency SLI: per alert
    window, ``slo:sli_error:ratio_rate<w>`` = errors / total over the window, errors being the
    requests above the threshold (``_count`` less the bucket ``le``); the period's SLI is then
    the mean of the 5-minute ratios (Sloth's ``slo:sli_error:ratio_rate30d`` rule, asked here
    over the bench's window: :func:`sloth_promql`)."""
    lines = ["  - name: gpuslo_peer_sloth", f"    interval: {SLOTH_INTERVAL_S}s", "    rules:"]
    for w in windows:
        d = duration(w)
        errors = f'sum(rate({METRIC}_count[{d}])) - sum(rate({METRIC}_bucket{{le="{slo_le}"}}[{d}]))'
        expr = f"({errors}) / (sum(rate({METRIC}_count[{d}])))"
        lines += [f"      - record: slo:sli_error:ratio_rate{d}", f"        expr: {json.dumps(expr)}",
                  "        labels:", "          sloth_service: bench-svc", "          sloth_slo: bench-p99",
                  f"          sloth_window: {d}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def sloth_promql(objective: float, whole_s: int, windows: Sequence[int]) -> dict[str, str]:
    """What Sloth's dashboards and alerts read, at the window's end: each alert window's burn
    from its recorded error ratio, and the SLI and burn over the whole window as Sloth's period
    rule computes them (the mean of the recorded 5-minute error ratios)."""
    q = {f"burn_{w}": f"slo:sli_error:ratio_rate{duration(w)} / {1 - objective!r}" for w in windows}
    if 300 in windows:
        five = "slo:sli_error:ratio_rate5m"
        mean = f"(sum_over_time({five}[{whole_s}s]) / count_over_time({five}[{whole_s}s]))"
        q["period_sli"], q["period_burn"] = f"1 - {mean}", f"{mean} / {1 - objective!r}"
    return q


def recorded_promql(range_s: int) -> dict[str, str]:
    """The compared numbers over the recorded series: what a dashboard over the rules asks. A
    component with nothing to count records no sample (``count()`` of nothing is empty), so a
    sum over the window falls back to 0; the capacity stays empty when there is none, as
    gpuslo's ratios have no value then."""
    over = {k: f"(sum_over_time({rule_name(k)}[{range_s}s]) or vector(0))" for k in COMPONENTS}
    cap = f"sum_over_time({rule_name('capacity')}[{range_s}s])"
    return {
        "capacity_gpu_h": f"{STEP_S} * {over['capacity']} / 3600",
        "active_cur": f"{over['active']} / {cap}",
        "allocation_cur": f"{over['held']} / {cap}",
        "idle_allocated_gpu_h": f"{STEP_S} * {over['held_idle']} / 3600",
        "idle_unallocated_gpu_h": f"{STEP_S} * {over['free_idle']} / 3600",
    }


def slo_promql(slo_le: str, objective: float, windows: Sequence[int]) -> dict[str, str]:
    """The SLO's SLI and burn rate over each window ending at the evaluation time."""
    q = {}
    for w in windows:
        ratio = f'sum(increase({METRIC}_bucket{{le="{slo_le}"}}[{w}s])) / sum(increase({METRIC}_count[{w}s]))'
        q[f"sli_{w}"] = ratio
        q[f"burn_{w}"] = f"(1 - {ratio}) / {1 - objective!r}"
    return q


def naive_promql(range_s: int) -> dict[str, tuple[str, str, bool]]:
    """What is usually written instead, for the difference it makes (not compared for agreement):
    name -> (the gpuslo quantity it stands for, PromQL over ``[t - range_s, t)``, whether it is
    a sum over steps that may be split into ranges as the compared ones are)."""
    w = f"{range_s}s"
    plain = f"DCGM_FI_PROF_GR_ENGINE_ACTIVE and on(Hostname) {_sched().replace('last_over_time(', '(').replace('[5s])', ')')}"
    return {
        # a dashboard's CUR: the mean of each series' mean; every hpc_job series weighs the same
        # however long it lived, and drained nodes count
        "naive_active_cur_avg_of_avgs": (
            "active_cur",
            f"avg(avg_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE[{w}]))",
            False,
        ),
        # sample-weighted over every sample: right weights, but drained nodes count
        "naive_active_cur_all_samples": (
            "active_cur",
            f"sum(sum_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE[{w}])) / "
            f"sum(count_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE[{w}]))",
            False,
        ),
        # the drain joined at every step with the default 5-minute lookback: a finished job's
        # series stays alive for 5 minutes next to the GPU's next series (no staleness markers)
        "naive_capacity_gpu_h_lookback_5m": (
            "capacity_gpu_h",
            f"{STEP_S} * sum(count_over_time(({plain})[{range_s - STEP_S}s:{STEP_S}s] offset {STEP_S}s)) / 3600",
            True,
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
    slo_q = slo_promql(le_label(slo.threshold_ms), slo.objective, windows)
    frm, end = _window_start(), _window_end(a.days)
    parts = chunks(frm, end, a.chunk_s)
    vals: dict[str, float | None] = {}
    times: dict[str, float] = {}
    whole = round(end - frm)
    rules_file, sloth_file, rules_tsdb = work / "rules.yml", work / "sloth.yml", work / "rules-tsdb"
    alert_windows = [
        w for w in sorted({x.long_s for x in slo.windows} | {x.short_s for x in slo.windows}) if w <= whole
    ]
    rules_file.write_text(recording_rules())
    sloth_file.write_text("groups:\n" + sloth_rules(le_label(slo.threshold_ms), alert_windows))
    lim = a.max_rss_mb
    with _prometheus(a.prometheus, tsdb, work / "prometheus", a.timeout) as prom:
        with _rss_peak(prom.proc.pid, lim) as peak:
            # over the raw samples: the five sums over the ranges, best of two passes
            util = partial(_sum_ranges, prom, parts, util_promql)
            times["util"], sums = _guarded(peak, lim, "the utilization", _best2, util)
            vals.update(util_values(sums))
            for k, q in slo_q.items():
                times[k], vals[k] = _guarded(peak, lim, k, _best2, partial(prom.query, q, end))
        prom_hwm = _status_kb(prom.proc.pid, "VmHWM")
        # what a deployment runs instead: recording rules at every sample, backfilled from the
        # raw series by promtool (range queries at the rules' 10 s over 2-hour blocks)
        with _rss_peak(prom.proc.pid, lim) as rules_peak:
            rules_s = _guarded(rules_peak, lim, "the recording rules' backfill", _promtool_rules,
                               a.promtool, rules_file, prom.url, frm, end, rules_tsdb, a.timeout)  # fmt: skip
            sloth_s = _guarded(rules_peak, lim, "the Sloth rules' backfill", _promtool_rules,
                               a.promtool, sloth_file, prom.url, frm, end, rules_tsdb, a.timeout)  # fmt: skip
        with _rss_peak(prom.proc.pid, lim) as naive_peak:  # after the memory figures: not counted there
            for k, (_, q, split) in naive_promql(round(end - frm)).items():
                if split:
                    one = partial(_sum_ranges, prom, parts, partial(_naive_one, k))
                    times[k], got = _guarded(naive_peak, lim, k, _timed, one)
                    vals[k] = got[k]
                else:
                    times[k], vals[k] = _guarded(naive_peak, lim, k, _timed, partial(prom.query, q, end))
    rules_bytes = _dir_bytes(rules_tsdb)
    rec: dict[str, float | None] = {}
    times["util_recorded"] = 0.0
    with (
        _prometheus(a.prometheus, rules_tsdb, work / "prometheus-rules", a.timeout) as prom2,
        _rss_peak(prom2.proc.pid, lim) as rec_peak,
    ):
        evaluations = {"utilization": check_evaluations(prom2, EVALUATIONS, STEP_S, frm, end)}
        if 300 in alert_windows:  # a window under 5 minutes has no Sloth rule to check
            evaluations["sloth"] = check_evaluations(
                prom2, "slo:sli_error:ratio_rate5m", SLOTH_INTERVAL_S, frm, end
            )
        for k, q in recorded_promql(whole).items():
            sec, rec[k] = _guarded(rec_peak, lim, f"recorded {k}", _best2, partial(prom2.query, q, end))
            times["util_recorded"] += sec
        sloth: dict[str, float | None] = {}
        times["slo_sloth"] = 0.0
        for k, q in sloth_promql(slo.objective, whole, alert_windows).items():
            sec, sloth[k] = _guarded(rec_peak, lim, f"Sloth's {k}", _best2, partial(prom2.query, q, end))
            times["slo_sloth"] += sec
    g, g_peak = _child("eval", size, a.timeout, a.max_rss_mb)
    prom_run = PromRun(vals, rec, sloth, times, peak[0], prom_hwm, rules_peak[0], rec_peak[0], rules_s, sloth_s,
                       rules_bytes, slo_q, len(parts), max(n for _, n in parts), evaluations)  # fmt: skip
    return _report(a, gen, g, g_peak, prom_run, prom_bytes, prom_samples, backfill_s, windows)


@dataclass(frozen=True, slots=True)
class PromRun:
    """What the Prometheus side gave: values over the raw series and over the recorded ones,
    times, memory, the rules' backfill."""

    vals: dict[str, float | None]
    recorded: dict[str, float | None]
    sloth: dict[str, float | None]  # the SLO as Sloth's rules record it (compared, not required to agree)
    times: dict[str, float]
    peak_kb: int
    hwm_kb: int
    rules_peak_kb: int
    recorded_peak_kb: int
    rules_s: float
    sloth_s: float
    rules_bytes: int
    slo_queries: dict[str, str]
    ranges: int
    range_s: int  # the longest range the PromQL over raw series was split into
    evaluations: dict[str, int]  # the rules' evaluations, every one present (check_evaluations)


def _sum_ranges(
    prom: Prometheus, parts: Sequence[tuple[float, int]], queries: Callable[[int], dict[str, str]]
) -> dict[str, float]:
    """Each query evaluated at the end of every range, summed (an empty answer is 0)."""
    sums: dict[str, float] = {}
    for at, length in parts:
        for k, q in queries(length).items():
            sums[k] = sums.get(k, 0.0) + (prom.query(q, at) or 0.0)
    return sums


def _naive_one(k: str, range_s: int) -> dict[str, str]:
    return {k: naive_promql(range_s)[k][1]}


def _guarded(peak: list[int], limit_mb: float, what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, with a failure while the sampled process was killed for its memory named so."""
    try:
        return fn(*args)
    except StepFailed:
        if peak[1]:
            raise _over(f"prometheus answering {what}", limit_mb) from None
        raise


def _promtool_rules(
    promtool: str, rules: Path, url: str, frm: float, to: float, out: Path, timeout_s: float
) -> float:
    """Backfill the rules of ``rules`` from the Prometheus at ``url`` into blocks under ``out``.
    promtool runs in the file's directory and is given its bare name: Prometheus derives a
    group's evaluation offset from a hash of its name and file, so the same names give the same
    offsets in every run (a random work directory in the path gave a random one)."""
    cmd = [promtool, "tsdb", "create-blocks-from", "rules", "--quiet", f"--url={url}", f"--start={int(frm)}",
           f"--end={int(to)}", f"--output-dir={out.resolve()}", rules.name]  # fmt: skip
    r, sec = _tool(cmd, f"promtool rules backfill ({rules.name})", timeout_s, cwd=rules.parent)
    said = "\n".join(line for line in (r.stderr + r.stdout).splitlines() if "level=info" not in line).strip()
    # promtool 2.42 exits 1 when a rule fails; a logged error with exit 0 is a failure too
    if r.returncode != 0 or re.search(r"^(level=error|import error)", said, re.M):
        raise StepFailed(
            f"promtool rules backfill ({rules.name}) failed (exit {r.returncode}): {said[-2000:]}"
        )
    if not any(out.glob("*/meta.json")):
        raise StepFailed(
            f"promtool rules backfill ({rules.name}): exit 0, but no block in {out}: {said[-500:]}"
        )
    return sec


def check_evaluations(prom: Prometheus, series: str, interval_s: int, frm: float, to: float) -> int:
    """A recorded series has a sample at every evaluation of its rule over ``[frm, to]``, and
    none missing (promtool 2.42 ends each 2-hour block a second early and starts the next at
    the first evaluation on or after its whole second, so an evaluation in the last second
    before a block's end is in neither block). Returns the evaluations."""
    ts = prom.times(series, to, round(to - frm))
    gaps = [(a, b) for a, b in itertools.pairwise(ts) if abs(b - a - interval_s) > 0.0005]
    ok = bool(ts) and ts[0] < frm + interval_s and ts[-1] > to - interval_s and not gaps
    if not ok:
        where = (
            f", the first gap {gaps[0][0] - frm:.3f} s to {gaps[0][1] - frm:.3f} s into the window"
            if gaps
            else ""
        )
        raise StepFailed(
            f"recording rule {series}: {len(ts)} evaluations every {interval_s} s over the window, "
            f"{round((to - frm) / interval_s) - len(ts)} missing{where} (the rules' backfill left holes: "
            "promtool skips an evaluation in the last second before a 2-hour block boundary)"
        )
    return len(ts)


def _window_start() -> float:
    from bench.rules import START

    return START


def _window_end(days: float) -> float:
    """The window's end: the generator's start plus the history."""
    from bench.rules import START

    return START + days * 86400


def _report(
    a: argparse.Namespace, gen: dict[str, Any], g: dict[str, Any], g_peak: int, pr: PromRun, prom_bytes: int,
    prom_samples: int, backfill_s: float, windows: Sequence[int],
) -> dict[str, Any]:  # fmt: skip
    times, vals = pr.times, pr.vals
    prom_util_s, rec_util_s = times["util"], times["util_recorded"]
    prom_slo_s = sum(times[k] for k in pr.slo_queries)
    worst = 0.0
    missing: list[str] = []  # a value on one side and none on another: never agreement
    print(f"{'quantity':26s} {'gpuslo rollups':>16s} {'gpuslo raw':>16s} {'PromQL':>16s} {'PromQL rules':>16s}"
          "  max rel diff")  # fmt: skip
    roll, raw = _pairs(g, "rollup", vals, windows), _pairs(g, "raw", vals, windows)
    disagree: list[str] = []
    for k, (rv, pv) in roll.items():
        recv = pr.recorded.get(k)
        diffs = [_rel(rv, pv), _rel(raw[k][0], pv)] + ([_rel(rv, recv)] if k in UTIL_KEYS else [])
        known = [d for d in diffs if d is not None]
        if len(known) < len(diffs):
            missing.append(k)
        if len(known) < len(diffs) or max(known, default=0.0) > TOLERANCE:
            disagree.append(k)
        worst = max([worst, *known])
        shown = "missing" if k in missing else f"{max(known, default=0.0):.1e}"
        print(f"{k:26s} {_f(rv):>16s} {_f(raw[k][0]):>16s} {_f(pv):>16s} {_f(recv) if k in UTIL_KEYS else '':>16s}  "
              f"{shown}{'  DISAGREE' if k in disagree else ''}")  # fmt: skip
    agree = not disagree
    print(f"time, CUR and idle over {a.days:g} days over the raw series: PromQL {prom_util_s:.2f} s "
          f"({len(COMPONENTS)} queries x {pr.ranges} range(s) of at most {pr.range_s / 3600:g} h; one run when "
          f"the first took over {ONE_RUN_S:g} s, else the best of two); gpuslo {g['util_raw_s']:.3f} s over raw rows "
          f"(1 query, best of two)")  # fmt: skip
    print(f"the recording rules' evaluations, every one present: {pr.evaluations}")
    print(f"time, CUR and idle over pre-aggregates: PromQL over the recording rules' series {rec_util_s:.3f} s "
          f"({len(UTIL_KEYS)} queries); gpuslo over its rollups {g['util_rollup_s']:.3f} s (1 query)")  # fmt: skip
    print(f"cost of the pre-aggregates over the whole history: Prometheus's recording rules backfilled by "
          f"promtool {pr.rules_s:.1f} s for the utilization + {pr.sloth_s:.1f} s for Sloth's SLO rules "
          f"({pr.rules_bytes / 1e6:.2f} MB); gpuslo's rollup refresh, every tier, {gen['refresh_s']:.1f} s")  # fmt: skip
    print(f"time, SLI and burn over {len(windows)} windows: PromQL {prom_slo_s:.2f} s; gpuslo "
          f"{g['slo_rollup_s']:.3f} s over rollups, {g['slo_raw_s']:.3f} s over raw rows")  # fmt: skip
    sloth = _sloth(g, pr.sloth, round(a.days * 86400))
    print(f"the SLO as Sloth's rules record it (every {SLOTH_INTERVAL_S} s; backfilled in {pr.sloth_s:.1f} s, "
          f"asked in {times['slo_sloth']:.3f} s), against gpuslo's exact windows:")  # fmt: skip
    for k, row in sloth.items():
        apart = row["rel_diff"]
        print(f"  {k:24s} Sloth {_f(row['sloth']):>12s}  gpuslo {_f(row['gpuslo']):>12s}  "
              f"{'-' if apart is None else f'{100 * apart:.3g} %'} apart")  # fmt: skip
    print(f"gpuslo, every rule of the summary over rollups (starvation incidents included): "
          f"{g['summary_rollup_s']:.2f} s")  # fmt: skip
    g_bytes = gen["raw_bytes"]
    print(f"bytes per sample: Prometheus {prom_bytes / prom_samples:.3f}; gpuslo raw rows {g_bytes / prom_samples:.3f} "
          f"(+ rollups {gen['rollup_bytes'] / prom_samples:.3f}) for the same {prom_samples:,} samples")  # fmt: skip
    print(f"RSS while answering (peak sampled): Prometheus {pr.peak_kb / 1024:.0f} MB (VmHWM {pr.hwm_kb / 1024:.0f} MB), "
          f"{pr.rules_peak_kb / 1024:.0f} MB while promtool backfilled the rules, {pr.recorded_peak_kb / 1024:.0f} MB "
          f"holding only the recorded series; gpuslo (chDB in a subprocess) {g_peak / 1024:.0f} MB "
          f"(VmHWM {g['vm_hwm_kb'] / 1024:.0f} MB)")  # fmt: skip
    naive = naive_promql(round(a.days * 86400))
    for k, (like, _q, _split) in naive.items():
        d = _rel(vals[k], g["util_raw"][like])
        print(f"as usually written, {k}: {_f(vals[k])} against {_f(g['util_raw'][like])} "
              f"({'-' if d is None else f'{100 * d:.3g} %'} off; {times[k]:.2f} s)")  # fmt: skip
    for what, why in CANNOT.items():
        print(f"PromQL cannot express {what}: {why}")
    return {
        "bench": "peers", "gpus": a.gpus, "days": a.days, "gpu_sample_rows": gen["counts"]["gpu_samples"],
        "prom_samples": prom_samples, "backfill_s": round(backfill_s, 2), "generate_s": round(gen["generate_s"], 2),
        "agree": agree, "max_rel_diff": worst, "disagree": disagree, "missing": missing,
        "chunk_h": a.chunk_s / 3600, "prom_ranges": pr.ranges, "rule_evaluations": pr.evaluations,
        "prom_bytes_per_sample": round(prom_bytes / prom_samples, 4),
        "gpuslo_bytes_per_sample": round(g_bytes / prom_samples, 4),
        "gpuslo_rollup_bytes_per_sample": round(gen["rollup_bytes"] / prom_samples, 4),
        "prom_rules_bytes": pr.rules_bytes,
        "prom_rss_mb": round(pr.peak_kb / 1024, 1), "gpuslo_rss_mb": round(g_peak / 1024, 1),
        "prom_rules_backfill_rss_mb": round(pr.rules_peak_kb / 1024, 1),
        "prom_recorded_rss_mb": round(pr.recorded_peak_kb / 1024, 1),
        "prom_util_s": round(prom_util_s, 3), "prom_util_recorded_s": round(rec_util_s, 4),
        "prom_slo_s": round(prom_slo_s, 3), "prom_rules_backfill_s": round(pr.rules_s, 2),
        "prom_sloth_backfill_s": round(pr.sloth_s, 2), "prom_slo_sloth_s": round(times["slo_sloth"], 4),
        "sloth": sloth,
        "gpuslo_refresh_s": round(gen["refresh_s"], 2),
        "gpuslo_util_rollup_s": round(g["util_rollup_s"], 4), "gpuslo_util_raw_s": round(g["util_raw_s"], 4),
        "gpuslo_slo_rollup_s": round(g["slo_rollup_s"], 4), "gpuslo_slo_raw_s": round(g["slo_raw_s"], 4),
        "gpuslo_summary_rollup_s": round(g["summary_rollup_s"], 3),
        "ratio_bytes_per_sample": _ratio(g_bytes, prom_bytes),
        "ratio_rss": _ratio(g_peak, pr.peak_kb),
        "ratio_util_raw_s": _ratio(g["util_raw_s"], prom_util_s),
        "ratio_util_rollup_vs_recorded_s": _ratio(g["util_rollup_s"], rec_util_s),
        "ratio_util_rollup_s": _ratio(g["util_rollup_s"], prom_util_s),
        # gpuslo's refresh builds every tier (the latency's too): against every rule's backfill
        "ratio_refresh_vs_rules_backfill_s": _ratio(gen["refresh_s"], pr.rules_s + pr.sloth_s),
        "ratio_slo_rollup_s": _ratio(g["slo_rollup_s"], prom_slo_s),
        "ratio_slo_raw_s": _ratio(g["slo_raw_s"], prom_slo_s),
        "values": {k: {"gpuslo_rollup": v, "gpuslo_raw": raw[k][0], "promql": p,
                       **({"promql_recorded": pr.recorded[k]} if k in UTIL_KEYS else {})}
                   for k, (v, p) in roll.items()},
        # the utilization's PromQL as asked of each range (promql_range_s long, prom_ranges of them)
        "promql": {**util_promql(pr.range_s), **pr.slo_queries}, "promql_range_s": pr.range_s,
        "promql_recorded": recorded_promql(round(a.days * 86400)),
        "recording_rules": recording_rules(),
        "naive": {k: {"promql": vals[k], "gpuslo_raw": g["util_raw"][like], "query": q}
                  for k, (like, q, _split) in naive.items()},
        "promql_cannot": sorted(CANNOT),
    }  # fmt: skip


def _sloth(
    g: dict[str, Any], sloth: dict[str, float | None], whole_s: int
) -> dict[str, dict[str, float | None]]:
    """Sloth's numbers beside gpuslo's (raw rows: the exact windows) and how far apart."""
    out = {}
    for k, v in sloth.items():
        kind, w = k.split("_")
        if kind == "period":
            kind, w = w, str(whole_s)
        exact = g["slo_raw"][w][kind] if w in g["slo_raw"] else None
        out[k] = {"sloth": v, "gpuslo": exact, "rel_diff": _rel(v, exact)}
    return out


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
    ap.add_argument("--chunk-h", type=float, default=2.0,
                    help="PromQL over the raw series in ranges of this many hours, summed (0: one query over the "
                         "window; Prometheus's memory for it grows with series x steps)")  # fmt: skip
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
    a.chunk_s = round(a.chunk_h * 3600) if 0 <= a.chunk_h <= 366 * 24 else -1  # NaN: -1
    if (
        not (a.chunk_h == 0 or 60 <= a.chunk_s <= 366 * 86400)
        or abs(a.chunk_h * 60 - round(a.chunk_h * 60)) > 1e-9
    ):
        ap.error("--chunk-h must be 0 (one query) or a whole number of minutes from 1 minute to a year")
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

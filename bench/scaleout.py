"""Ingest scale-out: 1 and then 2 ingest processes in one consumer group, into a ClickHouse server.

A real Kafka broker and Debian's clickhouse-server (18.16) are started. One topic with
``--partitions`` partitions is filled with ``--messages`` node batches in the agent's wire
format (the generator of ``bench ingest``, keyed by node as the agent keys them; not timed).
Then for each process count K (``--processes``, default 1 then 2), with a fresh consumer group
and a fresh database (the ingest's tables as 18.16 holds them, ``legacy_ingest_ddl``):

  timed: from the spawn of the first of K ingest processes until the group's committed offsets
         reach the end of every partition (polled every ``POLL_S`` from outside the group; the
         ingest commits a batch only after its rows are written, so at that moment every row is
         durably in the server). Process start-up, group join and rebalances are inside the clock.

Each ingest process is ``python -m bench scaleout --worker``: the objects ``gpuslo ingest
--kafka --clickhouse`` runs (``KafkaIngest`` over ``ClickHouseStore``, SIGTERM to stop), without
the CLI's schema migration, which 18.16 cannot parse (no TTL, no DateTime64).

After each run (not timed): the server must hold exactly the rows sent (``count() FINAL``, the
distinct dedup keys and the distinct message ids, each against what was generated), no dead
letter; the broker's own tool (``ConsumerGroupCommand --describe``) must show no lag. CPU seconds
of every process (each ingest process, the broker, the server, this bench) over the timed
window are read from ``/proc/PID/stat``, and the machine's busy CPU from ``/proc/stat`` (other
users of the machine included): they tell whether the ingest's CPU, the server or the machine's
cores bound the rate. An impossible figure (rows missing or unknown, lag left, more CPU than the
machine has) is an error, exit 2 (scaling beyond the processes' number is said as suspect); every wait is bounded
(``--stall-s`` without progress: exit 3, naming what it waited for).
"""

from __future__ import annotations

import argparse
import ast
import faulthandler
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.args import count, counts, number
from bench.ingest import CLK_TCK, Watchdog, make_batches, stat_cpu_s
from gpuslo.wire import GpuSampleBatch, encode

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.25  # how often the committed offsets are read during a run (the clock's resolution)
MAX_PROCESSES = 64  # ingest processes in one run: far beyond it is no bench of one machine
MAX_PARTITIONS = 1024
MAX_SCALING_SLACK = 1.15  # K processes faster than K x one process by more than noise: said as suspect


# ------------------------------------------------------------------ the ingest process
def ch_settings(port: int, database: str) -> Any:
    from gpuslo.core.settings import ClickHouseSettings
    from tests.servers.clickhouse import PASSWORD

    return ClickHouseSettings.model_validate(
        {"host": "127.0.0.1", "port": port, "database": database, "password": PASSWORD}
    )


def worker(argv: list[str]) -> int:
    """One ingest process: what ``gpuslo ingest --kafka B --clickhouse H:P`` runs, on tables made
    beforehand; prints one JSON line (its counters and assignments) when it stops (SIGTERM)."""
    entered = time.time()
    ap = argparse.ArgumentParser(prog="python -m bench scaleout --worker")
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--prefix", required=True, help="topic names: PREFIX.KIND")
    ap.add_argument("--group", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--database", required=True)
    ap.add_argument("--batch-messages", type=int, required=True)
    ap.add_argument("--batch-s", type=float, required=True)
    a = ap.parse_args(argv)

    from gpuslo.core.settings import IngestSettings, KafkaSettings, Topics
    from gpuslo.ingest.clickhouse_store import ClickHouseStore
    from gpuslo.ingest.kafka_consumer import KafkaIngest
    from gpuslo.ingest.store import StoreError

    assignments: list[tuple[float, str]] = []
    warnings: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if msg.startswith("assigned "):
                assignments.append((time.time(), msg[len("assigned ") :]))
            if record.levelno >= logging.WARNING:
                warnings.append(msg[:300])

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger().addHandler(Seen())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the bench's watchdog asks for the stacks
    gc_s = gc_time()
    topics = Topics(**{k: f"{a.prefix}.{k}" for k in Topics.model_fields})
    store = ClickHouseStore(ch_settings(a.port, a.database))
    ing = KafkaIngest(
        KafkaSettings(bootstrap_servers=[a.bootstrap], topics=topics),
        IngestSettings(group_id=a.group, batch_messages=a.batch_messages, batch_s=a.batch_s, metrics_port=0),
        store,
    )
    ing.stop_event = stop
    rc, error = 0, ""
    try:
        ing.run()
    except StoreError as exc:  # fatal: as gpuslo ingest, exit 2 with one line
        rc, error = 2, str(exc).splitlines()[0]
    finally:
        store.close()

    def value(name: str, **labels: str) -> int:
        return int(ing.registry.get_sample_value(name, labels) or 0)

    print(json.dumps({
        "pid": os.getpid(), "entered": entered, "assignments": assignments, "warnings": warnings,
        "error": error, "consumed": value("gpuslo_ingest_consumed_messages_total", topic=topics.gpu_samples),
        "written_rows": value("gpuslo_ingest_written_rows_total", table="gpu_samples"),
        "batches": value("gpuslo_ingest_batches_total"), "store_errors": value("gpuslo_ingest_store_errors_total"),
        "commit_errors": value("gpuslo_ingest_commit_errors_total"),
        "dead_letters": value("gpuslo_ingest_dead_letters_total"), "gc_s": [round(x, 3) for x in gc_s],
    }), flush=True)  # fmt: skip
    return rc


def gc_time() -> list[float]:
    """CPU seconds spent in Python's cyclic garbage collector, by generation, from now on (a list
    the collector's callback keeps adding to)."""
    spent = [0.0, 0.0, 0.0]
    began = [0.0]

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.thread_time()
        else:
            spent[info["generation"]] += time.thread_time() - began[0]

    gc.callbacks.append(cb)
    return spent


# ------------------------------------------------------------------ CPU from /proc
def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads)."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, every core, every process."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split()[1:9]
    )
    busy = user + nice + system + irq + softirq + steal
    return busy / CLK_TCK, (busy + idle + iowait) / CLK_TCK


# ------------------------------------------------------------------ the data
@dataclass(frozen=True)
class Data:
    topic: str
    prefix: str
    messages: int
    rows: int
    keys: int  # distinct (cluster, node, gpu, mig_gi, mig_ci, ts): the table's dedup key
    ids: int  # distinct (source, boot_id, seq)
    ends: dict[int, int]  # partition -> end offset
    nodes: int


def expected(batches: list[GpuSampleBatch]) -> tuple[int, int, int]:
    """(rows, distinct dedup keys, distinct message ids), from the generated batches."""
    keys = {
        (b.cluster, b.node, g.index, g.mig.gi if g.mig else -1, g.mig.ci if g.mig else -1, int(b.ts))
        for b in batches
        for g in b.gpus
    }
    ids = {(b.source, b.boot_id, b.seq) for b in batches}
    return sum(len(b.gpus) for b in batches), len(keys), len(ids)


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()


def prefill(
    bootstrap: str, topic: str, batches: list[GpuSampleBatch], dog: Watchdog, timeout_s: float
) -> dict[int, int]:
    """The batches into ``topic``, keyed by node (as the agent's sink); partition -> end offset."""
    from kafka import KafkaProducer

    dog.progress("filling the topic")
    # large producer batches: the test broker syncs its log after every append (one per batch)
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=50, batch_size=1024 * 1024,
                      max_request_size=16 * 1024 * 1024)  # fmt: skip
    futures = []
    for i, b in enumerate(batches):
        futures.append(p.send(topic, key=b.node.encode(), value=encode(b)))
        if i % 1000 == 0:
            dog.progress(detail=f"{i} of {len(batches)} sent")
    ends: dict[int, int] = {}
    for i, f in enumerate(futures):  # each acknowledgement in turn: every wait bounded
        md = f.get(timeout=timeout_s)
        ends[md.partition] = max(ends.get(md.partition, 0), md.offset + 1)
        if i % 500 == 0:
            dog.progress(detail=f"{i} of {len(batches)} acknowledged")
    p.close()
    return ends


def kafka_tool(libs: Path, *args: str, timeout_s: float = 120.0) -> str:
    """One of the broker distribution's own tools (the jars of provision/kafka.sh)."""
    java = [ "java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-cp", f"{libs}/*"]  # fmt: skip
    r = subprocess.run([*java, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    if r.returncode != 0:
        raise SystemExit(f"bench scaleout: {args[0]} failed ({r.returncode}): {r.stderr[-1500:]}")
    return r.stdout


def group_lag(libs: Path, bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """Partition -> lag as ``kafka-consumer-groups.sh --describe`` shows it (the broker's own tool)."""
    out = kafka_tool(libs, "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
                     "--bootstrap-server", bootstrap, "--describe", "--group", group)  # fmt: skip
    lines = [ln.split() for ln in out.splitlines() if ln.strip()]
    header = next((ln for ln in lines if "LAG" in ln and "PARTITION" in ln), None)
    if header is None:
        raise SystemExit(f"bench scaleout: no offsets table in ConsumerGroupCommand's output:\n{out[-1500:]}")
    ti, pi, li = header.index("TOPIC"), header.index("PARTITION"), header.index("LAG")
    lag: dict[int, int] = {}
    for ln in lines:
        if len(ln) > li and ln[ti] == topic and ln[pi].isdigit():
            lag[int(ln[pi])] = int(ln[li]) if ln[li].lstrip("-").isdigit() else -1  # '-': nothing committed
    return lag


# ------------------------------------------------------------------ one run
@dataclass(frozen=True)
class Worker:
    cpu_s: float
    report: dict[str, Any]


@dataclass(frozen=True)
class Run:
    processes: int
    wall_s: float
    started: float  # time.time() at the first spawn
    workers: list[Worker]
    broker_cpu_s: float
    server_cpu_s: float
    bench_cpu_s: float
    machine_busy_s: float
    machine_total_s: float
    load_before: tuple[float, float, float]
    stored: dict[str, int] = field(default_factory=dict)
    lag: dict[int, int] = field(default_factory=dict)

    def rows_per_s(self, rows: int) -> float:
        return rows / self.wall_s

    @property
    def ours_cpu_s(self) -> float:
        return sum(w.cpu_s for w in self.workers) + self.broker_cpu_s + self.server_cpu_s + self.bench_cpu_s


@dataclass
class Servers:
    broker: Any
    server: Any
    libs: Path


def _spawn(
    k: int, i: int, data: Data, srv: Servers, a: argparse.Namespace, work: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "bench", "scaleout", "--worker", "--bootstrap", srv.broker.bootstrap,
           "--prefix", data.prefix, "--group", f"scaleout-{k}", "--port", str(srv.server.port),
           "--database", f"scaleout_{k}", "--batch-messages", str(a.batch_messages), "--batch-s", str(a.batch_s)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(work / f"worker-{k}-{i}.out", "wb"),
                            stderr=open(work / f"worker-{k}-{i}.err", "wb"), start_new_session=True)  # fmt: skip


def _tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _dump_workers(procs: list[subprocess.Popen[bytes]], k: int, work: Path) -> None:
    """Each live ingest process's stacks (SIGUSR1: faulthandler), then the tail of its stderr."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    for i in range(len(procs)):
        print(
            f"--- ingest process {i} of {k}, stderr:\n{_tail(work / f'worker-{k}-{i}.err', 6000)}",
            file=sys.stderr,
        )


def _stop_workers(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait_committed(k: int, data: Data, srv: Servers, procs: list[subprocess.Popen[bytes]], dog: Watchdog,
                    work: Path) -> None:  # fmt: skip
    """Until the group's committed offsets reach every partition's end (each worker alive)."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    checker = KafkaConsumer(
        bootstrap_servers=srv.broker.bootstrap, group_id=f"scaleout-{k}", enable_auto_commit=False
    )
    tps = [TopicPartition(data.topic, p) for p in sorted(data.ends)]
    total = sum(data.ends.values())
    last = -1
    try:
        while True:
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    raise SystemExit(f"bench scaleout: ingest process {i} of {k} exited ({p.returncode}) "
                                     f"before the end: {_tail(work / f'worker-{k}-{i}.err')}")  # fmt: skip
            committed = {tp.partition: checker.committed(tp) or 0 for tp in tps}
            done = sum(min(c, data.ends[p]) for p, c in committed.items())
            if done != last:  # progress: the watchdog waits for the next commit, not for the end
                dog.progress(detail=f"{done} of {total} messages committed, by partition {committed}")
                last = done
            if all(c >= data.ends[p] for p, c in committed.items()):
                return
            time.sleep(POLL_S)
    finally:
        checker.close()


def run_one(k: int, data: Data, srv: Servers, a: argparse.Namespace, dog: Watchdog, work: Path) -> Run:
    from gpuslo.ingest.clickhouse_store import ClickHouseStore
    from tests.servers.clickhouse import legacy_ingest_ddl

    dog.progress(f"preparing the run with {k} ingest process(es)")
    st = ClickHouseStore(ch_settings(srv.server.port, f"scaleout_{k}"))
    st.create_database()
    for ddl in legacy_ingest_ddl():
        st.execute(ddl)
    load = os.getloadavg()
    pids = {"broker": srv.broker.proc.pid, "server": srv.server.proc.pid}
    before = {n: proc_cpu_s(pid) for n, pid in pids.items()}
    me0, (busy0, tot0) = time.process_time(), machine_cpu_s()
    dog.progress(f"{k} ingest process(es) consuming")
    t0, started = time.perf_counter(), time.time()
    procs = [_spawn(k, i, data, srv, a, work) for i in range(k)]
    dog.on_abort.insert(0, lambda: _dump_workers(procs, k, work))  # before the servers stop
    dog.on_abort.append(lambda: _stop_workers(procs, 5))
    try:
        _wait_committed(k, data, srv, procs, dog, work)
        wall_s = time.perf_counter() - t0
        cpu = [proc_cpu_s(p.pid) for p in procs]
        after = {n: proc_cpu_s(pid) for n, pid in pids.items()}
        me1, (busy1, tot1) = time.process_time(), machine_cpu_s()
    finally:
        dog.progress(f"stopping {k} ingest process(es)")
        _stop_workers(procs, a.stall_s)
    workers = []
    for i, (p, c) in enumerate(zip(procs, cpu, strict=True)):
        lines = (work / f"worker-{k}-{i}.out").read_text().splitlines()
        if p.returncode != 0 or not lines:
            raise SystemExit(f"bench scaleout: ingest process {i} of {k} exited {p.returncode}: "
                             f"{_tail(work / f'worker-{k}-{i}.err')}")  # fmt: skip
        workers.append(Worker(c, json.loads(lines[-1])))
    dog.progress("counting what the server holds")
    stored = {name: int(st.query(sql)[0]["n"]) for name, sql in (
        ("final", "SELECT count() AS n FROM gpu_samples FINAL"),
        ("raw", "SELECT count() AS n FROM gpu_samples"),
        ("keys", "SELECT uniqExact(cluster, node, gpu, mig_gi, mig_ci, ts) AS n FROM gpu_samples"),
        ("ids", "SELECT uniqExact(source, boot_id, seq) AS n FROM gpu_samples"),
        ("dead_letters", "SELECT count() AS n FROM dead_letters"),
    )}  # fmt: skip
    st.close()
    dog.progress("reading the group's lag with the broker's own tool")
    lag = group_lag(srv.libs, srv.broker.bootstrap, f"scaleout-{k}", data.topic)
    return Run(k, wall_s, started, workers, after["broker"] - before["broker"], after["server"] - before["server"],
               me1 - me0, busy1 - busy0, tot1 - tot0, load, stored, lag)  # fmt: skip


# ------------------------------------------------------------------ checks and report
def owned_at(rep: dict[str, Any], topic: str, started: float) -> str:
    """'0.8 s: 0,1,2,3; 3.9 s: 0,1': the process's partitions of ``topic`` at each assignment."""
    out = []
    for at, parts in rep["assignments"]:
        mine = [p.rsplit("/", 1)[1] for p in ast.literal_eval(parts) if p.rsplit("/", 1)[0] == topic]
        out.append(f"{at - started:.1f} s: {','.join(mine) or '-'}")
    return "; ".join(out)


def settled_s(r: Run, topic: str) -> float:
    """Seconds from the start until the last assignment of any process (after it the group was stable)."""
    times = [at for w in r.workers for at, _ in w.report["assignments"]]
    return max(times) - r.started if times else float("nan")


def _lag_ok(end: int, lag: int | None) -> bool:
    """0; or, on an empty partition (nothing to commit), left out by the tool or shown '-' (-1)."""
    return lag == 0 or (end == 0 and lag in (None, -1))


def problems(r: Run, data: Data) -> list[str]:
    out = []
    want = {"final": data.rows, "keys": data.keys, "ids": data.ids, "dead_letters": 0}
    for name, n in want.items():
        if r.stored.get(name) != n:
            out.append(
                f"{r.processes} process(es): {name} = {r.stored.get(name)} in the server, {n} expected"
            )
    if r.stored.get("raw", 0) < data.rows:
        out.append(
            f"{r.processes} process(es): {r.stored.get('raw')} rows stored, fewer than the {data.rows} sent"
        )
    lagging = {p: r.lag.get(p) for p, end in data.ends.items() if not _lag_ok(end, r.lag.get(p))}
    if lagging or set(r.lag) - set(data.ends):
        out.append(
            f"{r.processes} process(es): the broker's tool shows lag {r.lag} (partitions {sorted(data.ends)})"
        )
    for w in r.workers:
        if w.report.get("error"):
            out.append(f"{r.processes} process(es): pid {w.report['pid']} stopped: {w.report['error']}")
    cores = os.cpu_count() or 1
    if r.ours_cpu_s > cores * r.wall_s * 1.05 + 0.5:
        out.append(f"{r.processes} process(es): {r.ours_cpu_s:.1f} CPU s in {r.wall_s:.1f} s on {cores} cores: "
                   "the clock missed work")  # fmt: skip
    return out


def scaling_problems(runs: list[Run], data: Data) -> list[str]:
    base = runs[0]
    out = []
    for r in runs[1:]:
        s = r.rows_per_s(data.rows) / base.rows_per_s(data.rows)
        if s > r.processes / base.processes * MAX_SCALING_SLACK:
            out.append(
                f"{r.processes} processes are {s:.2f}x {base.processes}: more than their number allows"
            )
    return out


def describe(r: Run, data: Data) -> list[str]:
    rows_s = r.rows_per_s(data.rows)
    cores = os.cpu_count() or 1
    ingest = sum(w.cpu_s for w in r.workers)
    lines = [
        f"{r.processes} ingest process(es): {r.wall_s:6.2f} s  {rows_s:10,.0f} GPU rows/s  "
        f"{data.messages / r.wall_s:8,.0f} messages/s   (load average before: {r.load_before[0]:.2f})",
    ]
    for w in r.workers:
        rep = w.report
        owned = owned_at(rep, data.topic, r.started)
        lines.append(
            f"    pid {rep['pid']}: {w.cpu_s:6.2f} CPU s ({w.cpu_s / r.wall_s:4.0%} of a core), "
            f"{rep['written_rows']:,} rows written in {rep['batches']} batches, started in {rep['entered'] - r.started:.1f} s, "
            f"garbage collector {sum(rep['gc_s']):.2f} s (full collections {rep['gc_s'][2]:.2f} s), "
            f"partitions by seconds from the start: {owned or 'none'}; store errors {rep['store_errors']}, "
            f"commit errors {rep['commit_errors']}"
        )
    lines.append(
        f"    the group owned every partition, stably, {settled_s(r, data.topic):.1f} s after the start"
    )
    lines.append(
        f"    CPU s: ingest {ingest:.2f}, server {r.server_cpu_s:.2f}, broker {r.broker_cpu_s:.2f}, "
        f"bench {r.bench_cpu_s:.2f}; all of these {r.ours_cpu_s:.2f} of {cores * r.wall_s:.2f} "
        f"({r.ours_cpu_s / (cores * r.wall_s):.0%}); the machine was busy {r.machine_busy_s / r.machine_total_s:.0%} "
        f"(other processes included)"
    )
    lines.append(
        f"    server holds {r.stored['final']:,} rows FINAL ({r.stored['raw'] - data.rows:,} written twice, "
        f"absorbed by the dedup key), {r.stored['keys']:,} keys, {r.stored['ids']:,} message ids; lag {r.lag}"
    )
    return lines


def as_json(r: Run, data: Data) -> dict[str, Any]:
    k = r.processes
    cores = os.cpu_count() or 1
    return {
        f"wall_s_{k}": round(r.wall_s, 3), f"rows_per_s_{k}": round(r.rows_per_s(data.rows)),
        f"ingest_cpu_s_{k}": [round(w.cpu_s, 2) for w in r.workers],
        f"ingest_gc_s_{k}": [round(sum(w.report["gc_s"]), 2) for w in r.workers],
        f"server_cpu_s_{k}": round(r.server_cpu_s, 2), f"broker_cpu_s_{k}": round(r.broker_cpu_s, 2),
        f"bench_cpu_s_{k}": round(r.bench_cpu_s, 2),
        f"our_cpu_share_{k}": round(r.ours_cpu_s / (cores * r.wall_s), 3),
        f"machine_busy_share_{k}": round(r.machine_busy_s / r.machine_total_s, 3),
        f"ingest_cpu_ms_per_1000_rows_{k}": round(1000 * sum(w.cpu_s for w in r.workers) / data.rows * 1000, 1),
        f"rows_written_twice_{k}": r.stored["raw"] - data.rows,
        f"stored_{k}": r.stored, f"lag_{k}": sum(r.lag.values()),
        f"written_rows_{k}": [w.report["written_rows"] for w in r.workers],
        f"load_avg_1m_before_{k}": round(r.load_before[0], 2),
        f"group_settled_s_{k}": round(settled_s(r, data.topic), 2),
    }  # fmt: skip


def bound_lines(runs: list[Run], data: Data) -> list[str]:
    """What the 2-core machine allows: the CPU all our processes need per row, spread over every core."""
    cores = os.cpu_count() or 1
    out = []
    for r in runs:
        per_row = r.ours_cpu_s / data.rows
        out.append(
            f"{r.processes} process(es): {per_row * 1e6:.0f} CPU µs per row in all (ingest "
            f"{sum(w.cpu_s for w in r.workers) / data.rows * 1e6:.0f}, server {r.server_cpu_s / data.rows * 1e6:.0f}, "
            f"broker {r.broker_cpu_s / data.rows * 1e6:.0f}): {cores} cores at most {cores / per_row:,.0f} rows/s"
        )
    return out


# ------------------------------------------------------------------ main
def start_servers(work: Path, partitions: int, dog: Watchdog) -> Servers:
    from tests.servers.clickhouse import ClickHouseServer, binary
    from tests.servers.kafka import KafkaBroker, provision

    if binary() is None:
        raise SystemExit(
            "bench scaleout: clickhouse-server is not installed (apt-get install clickhouse-server)"
        )
    dog.progress("starting the Kafka broker")
    broker = KafkaBroker(work / "kafka", partitions=partitions)
    dog.on_abort.append(broker.stop)
    broker.start()
    dog.progress("starting clickhouse-server")
    server = ClickHouseServer(work / "clickhouse")
    dog.on_abort.append(server.stop)
    server.start()
    return Servers(broker, server, broker.libs or provision())  # the local jars: its tools are there


def make_data(a: argparse.Namespace, srv: Servers, dog: Watchdog) -> Data:
    dog.progress("simulating node batches")
    batches = make_batches(a.messages, nodes=a.nodes)
    rows, keys, ids = expected(batches)
    prefix = "scaleout"
    topic = f"{prefix}.gpu_samples"
    dog.progress("creating the topic")
    create_topic(srv.broker.bootstrap, topic, a.partitions)
    ends = prefill(srv.broker.bootstrap, topic, batches, dog, a.stall_s)
    if sum(ends.values()) != len(batches):
        raise SystemExit(
            f"bench scaleout: the topic holds {sum(ends.values())} messages, {len(batches)} sent"
        )
    return Data(
        topic,
        prefix,
        len(batches),
        rows,
        keys,
        ids,
        {p: ends.get(p, 0) for p in range(a.partitions)},
        a.nodes,
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench scaleout")
    ap.add_argument(
        "--messages",
        type=count(1, 10_000_000),
        default=12_000,
        help="node batches (8 GPUs each) in the topic",
    )
    ap.add_argument(
        "--nodes", type=count(1, 1_000_000), default=256, help="nodes they come from (the partition key)"
    )
    ap.add_argument("--partitions", type=count(1, MAX_PARTITIONS), default=4)
    ap.add_argument(
        "--processes",
        type=counts(1, MAX_PROCESSES, 8),
        default=[1, 2],
        help="ingest processes per run, in order (the first is the base)",
    )
    ap.add_argument(
        "--batch-messages", type=count(1, 1_000_000), default=5000, help="the ingest's batch_messages"
    )
    ap.add_argument(
        "--batch-s",
        type=number(0, 3600),
        default=0.5,
        help="the ingest's batch_s (how long a partial batch waits)",
    )
    ap.add_argument(
        "--stall-s", type=number(0, 86_400), default=120.0, help="give up after this long without progress"
    )
    a = ap.parse_args(argv)
    runs_of: list[int] = a.processes

    dog = Watchdog(a.stall_s, name="scaleout")
    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-scaleout-"))
    srv = None
    try:
        srv = start_servers(work, a.partitions, dog)
        data = make_data(a, srv, dog)
        per_partition = ", ".join(f"{p}: {n}" for p, n in sorted(data.ends.items()))
        print(f"{data.messages} node batches ({data.rows} GPU rows) from {data.nodes} nodes in {a.partitions} "
              f"partitions ({per_partition}); ingest batch {a.batch_messages} messages / {a.batch_s:g} s")  # fmt: skip
        runs = [run_one(k, data, srv, a, dog, work) for k in runs_of]
    finally:
        dog.stop()
        if srv is not None:
            srv.server.stop()
            srv.broker.stop()
    for r in runs:
        for line in describe(r, data):
            print(line)
    for line in bound_lines(runs, data):
        print(line)
    out: dict[str, Any] = {"bench": "scaleout", "messages": data.messages, "gpu_rows": data.rows,
                           "partitions": a.partitions, "nodes": data.nodes, "batch_messages": a.batch_messages,
                           "batch_s": a.batch_s, "cores": os.cpu_count()}  # fmt: skip
    for r in runs:
        out.update(as_json(r, data))
    base = runs[0]
    for r in runs[1:]:
        s = r.rows_per_s(data.rows) / base.rows_per_s(data.rows)
        out[f"scaling_{r.processes}_vs_{base.processes}"] = round(s, 3)
        print(
            f"scaling {r.processes} vs {base.processes} process(es): {s:.2f}x  (ideal {r.processes / base.processes:g}x)"
        )
    print(json.dumps(out))
    # above-ideal scaling is suspect, not impossible: a load burst on the shared machine during
    # the one-process run does it (a tiny run under a loaded test suite showed it); said, kept
    for p in scaling_problems(runs, data):
        print(
            f"bench scaleout: SUSPECT FIGURE (the one-process run slowed by other load?): {p}",
            file=sys.stderr,
        )
    bad = [p for r in runs for p in problems(r, data)]
    for p in bad:
        print(f"bench scaleout: IMPOSSIBLE FIGURE: {p}", file=sys.stderr)
    if bad:
        print(f"bench scaleout: the servers' and the processes' files are in {work}", file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)  # the broker's log of the run (hundreds of MB at full size)
    return 0

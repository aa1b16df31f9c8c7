"""End-to-end ingest throughput, Kafka → store, against the store's raw insert limit.

A real Kafka broker (provision/kafka.sh jars, Kafka's default flush: the page cache, as production
brokers run, not the tests' flush of every message) is started; N simulated node batches are
produced to it twice (not timed), on two topics: one JSON message per batch (what an agent
sends as it samples), and as the agent sends a backlog: through the agent's own KafkaSink
(its spool, its drain, its producer settings: zstd) which packs them (gpuslo.wire.pack,
``producer.pack_min_records``). Then, timed, each form on its own:
  e2e: KafkaIngest (consume, decode, validate, columnar insert per table, commit) into chDB,
       from the moment the consumer owns its partitions (it joined while the topic was empty
       and stayed paused while the data was produced: nothing fetched before the clock)
       until the last batch is written and committed; the JSON run's batches hold
       ``--batch-messages`` messages, the pack run's the whole packs that carry about as many
       node batches (``pack_batch_messages``), each closing on its run's timer when short
       (``JSON_BATCH_S``, ``PACK_BATCH_S``: the report says when a run's last batch was); both runs' rows per insert are reported. The pack run is made ``--repeat`` times in the
       same ingest process (each on a copy of the batches on days of its own, after the copy
       before, with sequence numbers of its own), and its fastest run is its figure, as each raw path's is its fastest: the
       first run of a process pays for its warm-up (the first, the median and every run's
       seconds are reported too);
  raw: the same GPU-sample rows as prepared columns, inserted straight into the same chDB
       (same process, same run, the pack run's batch size: ``raw_batch_messages``) into a twin table, by every way chDB takes
       a batch (bench/insert_paths.py), in ``--repeat`` rounds, each round made right after
       a pack run (a burst of load on the shared machine falls on both): the store's limit is
       the fastest of them; each pack run is also given as a ratio to the round after it;
  contended: the store's insert of the same prepared rows (its own path) while another thread
       runs the ingest's own decoding of them as packs (what the writer thread meets), as a
       ratio to the same insert alone; and for each e2e run, the CPU seconds of its threads
       by kind inside the clock (Linux): where the two cores went;
  server (when clickhouse-server is installed, unless ``--no-server``): the same rows
       through the server store (clickhouse-driver, native protocol, columnar) into Debian's
       18.16 with the tables as 18.16 holds them, as a ratio to chDB's store insert.

Every wait is bounded (``--stall-s`` without progress): a watchdog says which phase it was
waiting in and dumps the stacks, then exits 3. A figure that cannot be true (end to end
faster than the raw insert it contains, rows missing) is reported as an error, exit 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.args import count
from bench.insert_paths import InsertPaths, PathResult, as_json, fastest, table
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import SimNodeSource
from gpuslo.core.settings import MAX_AGE_S, IngestSettings, KafkaSettings, Topics
from gpuslo.ingest.kafka_consumer import KafkaIngest
from gpuslo.ingest.store import ChdbStore, by_day
from gpuslo.ingest.writer import to_columns
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import GpuSampleBatch, encode


def make_batches(n: int, nodes: int = 8) -> list[GpuSampleBatch]:
    cfg = SimConfig(nodes=nodes, gpus_per_node=8, hours=n / nodes * 10 / 3600 + 0.01, seed=1)
    fleet = Fleet(cfg)
    sources = [SimNodeSource(fleet, i) for i in range(nodes)]
    out: list[GpuSampleBatch] = []
    k = 0
    while len(out) < n:
        t = cfg.start_ts + k * cfg.interval_s
        fleet.advance_to(t)
        for s in sources:
            out += [m for m in s.collect(t) if isinstance(m, GpuSampleBatch)]
        k += 1
    return out[:n]


class Watchdog:
    """Exits the process (3) when ``progress()`` was not called for ``stall_s``, saying which
    phase it was in and what it had seen, with every thread's stack."""

    def __init__(self, stall_s: float, name: str = "ingest") -> None:
        self.stall_s = stall_s
        self.name = name  # the benchmark's, in what it says
        self.phase = "starting"
        self.detail: Any = ""
        self._last = time.monotonic()
        self._done = threading.Event()
        self.on_abort: list[Any] = []  # cleanups before the exit (the broker: no orphan process)
        threading.Thread(target=self._watch, name="bench-watchdog", daemon=True).start()

    def progress(self, phase: str | None = None, detail: Any = "") -> None:
        if phase is not None:
            self.phase = phase
        self.detail = detail
        self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(1.0):
            idle = time.monotonic() - self._last
            if idle > self.stall_s:
                detail = self.detail() if callable(self.detail) else self.detail
                print(
                    f"bench {self.name}: no progress for {idle:.0f} s while {self.phase}"
                    + (f" ({detail})" if detail else "")
                    + "; stacks:",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                for fn in self.on_abort:
                    try:
                        fn()
                    except Exception as exc:  # exiting anyway; say what was left behind
                        print(f"bench {self.name}: cleanup failed: {exc}", file=sys.stderr)
                os._exit(3)


def join_paused(ing: KafkaIngest, dog: Watchdog, timeout_s: float) -> float:
    """Join the group while the topic is still empty and pause the partitions: nothing can
    be fetched before the clock starts (the data is produced after this)."""
    t0 = time.monotonic()
    c = ing.consumer
    while not c.assignment():
        dog.progress("joining the consumer group (empty topic)", f"{time.monotonic() - t0:.0f} s")
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"bench ingest: no partition assignment after {timeout_s:g} s")
        got = c.poll(timeout_ms=100)
        if got:
            raise SystemExit("bench ingest: the topic was not empty before producing")
    for tp in c.assignment():
        c.position(tp)  # resolved on the empty topic (auto_offset_reset: the start)
    c.pause(*c.assignment())
    return time.monotonic() - t0


def produce(bootstrap: str, topic: str, batches: list[GpuSampleBatch], ing: KafkaIngest, dog: Watchdog,
            timeout_s: float) -> None:  # fmt: skip
    """The batches into Kafka (not timed); the paused consumer keeps its membership meanwhile."""
    from kafka import KafkaProducer

    dog.progress("producing to Kafka")
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    for i, b in enumerate(batches):
        p.send(topic, key=b.node.encode(), value=encode(b))
        if i % 1000 == 0:
            ing.consumer.poll(timeout_ms=0)  # paused: returns nothing, keeps the membership
            dog.progress()
    p.flush(timeout=timeout_s)
    p.close()


_KINDS = ("python", "ThreadPool", "MergeMutate")
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds in a ``/proc/.../stat`` file: a process's (its ended threads
    included) or one thread's (``task/TID/stat``)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15)


def thread_cpu() -> tuple[float, dict[int, tuple[str, float]]]:
    """CPU seconds of this process so far (its threads that ended included) and of each live
    thread by id with its kind (Linux /proc; nothing elsewhere): "python" (the consumer's, the
    writer's and kafka-python's threads: Python names none of its own), chDB's query pool
    ("ThreadPool"), its background merges ("MergeMutate"), "other"."""
    threads: dict[int, tuple[str, float]] = {}
    try:
        total = stat_cpu_s(Path("/proc/self/stat"))
    except OSError:  # no /proc
        return 0.0, threads
    for task in Path("/proc/self/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            threads[int(task.name)] = (name if name in _KINDS else "other", stat_cpu_s(task / "stat"))
        except OSError:  # the thread ended meanwhile
            continue
    return total, threads


def cpu_between(before: tuple[float, dict[int, tuple[str, float]]],
                after: tuple[float, dict[int, tuple[str, float]]]) -> dict[str, float]:  # fmt: skip
    """CPU seconds between two ``thread_cpu`` readings by kind; a thread counts under its kind
    at the second reading (a thread may rename itself), and the threads that ended in between
    (the writer's, at close; an idle pool thread) under "ended": the process's total less the
    live threads' (exact, since the process's own counter keeps what its ended threads used)."""
    (t0, th0), (t1, th1) = before, after
    if not th1:  # no /proc: nothing measured (not zeros: the report leaves the CPU out)
        return {}
    out = dict.fromkeys(_KINDS, 0.0)
    for tid, (kind, c) in th1.items():
        out[kind] = out.get(kind, 0.0) + c - th0.get(tid, ("", 0.0))[1]
    out["ended"] = t1 - t0 - sum(out.values())
    return {k: round(max(0.0, v), 3) for k, v in out.items()}


def pid_cpu(pid: int | None) -> float | None:
    """CPU seconds of another process so far (Linux /proc); None without one."""
    if pid is None:
        return None
    try:
        return stat_cpu_s(Path(f"/proc/{pid}/stat"))
    except OSError:  # gone
        return None


def consume_all(
    ing: KafkaIngest, dog: Watchdog, n: int, broker_pid: int | None = None
) -> tuple[float, dict[str, float]]:
    """Seconds from resuming the paused consumer until ``n`` messages are written and committed,
    and the CPU seconds in that time: the process's by thread kind (``cpu_between``) and the
    broker's (``broker_pid``), which shares the cores. The consumer is left paused, open."""
    ing.consumer.resume(*ing.consumer.paused())
    consumed = 0

    def state() -> str:
        return (
            f"consumed {consumed} of {n} messages, assignment {sorted(map(str, ing.consumer.assignment()))}"
        )

    b0, c0 = pid_cpu(broker_pid), thread_cpu()
    t0 = time.perf_counter()  # the consumer owns its partitions, positions known; nothing fetched yet
    while consumed < n:
        dog.progress("consuming", state)
        consumed += ing.step()
    dog.progress("writing and committing the last batch", state)
    ing.flush()
    e2e_s = time.perf_counter() - t0
    cpu, b1 = cpu_between(c0, thread_cpu()), pid_cpu(broker_pid)
    if b0 is not None and b1 is not None:
        cpu["broker"] = round(b1 - b0, 3)
    ing.consumer.pause(*ing.consumer.assignment())  # nothing more is read until the next run
    return e2e_s, cpu


def settle(store: ChdbStore, dog: Watchdog, timeout_s: float) -> None:
    """Wait (not timed) until the store runs no merge: a run's clock holds its own merges only,
    not those left by the run before it."""
    t0 = time.monotonic()
    while store.query("SELECT count() AS n FROM system.merges")[0]["n"]:
        dog.progress("waiting for the store's merges before the next run")
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"bench ingest: the store still merged after {timeout_s:g} s")
        time.sleep(0.05)


def prepared_chunks(store: ChdbStore, batches: list[GpuSampleBatch], batch_messages: int) -> list[Any]:
    """The rows as the store's prepared Arrow tables, one per batch of ``batch_messages`` and
    day, as the store inserts them (``by_day``: a chDB insert spanning days costs ~3× one that
    does not, and the raw limit is the fastest way in)."""
    return [
        part
        for i in range(0, len(batches), batch_messages)
        for part in by_day(
            store.prepare_columns("gpu_samples", to_columns(batches[i : i + batch_messages])["gpu_samples"]),
            "ts",
        )
    ]


def raw_round(paths: InsertPaths, k: int, dog: Watchdog) -> None:
    """Round ``k`` of every insert path (same prepared rows, same batch size), right after the
    pack run ``k``: a burst of load on the shared machine falls on both."""
    dog.progress(f"raw inserts, every path (round {k + 1})")
    try:
        paths.round(dog.progress)
    except ValueError as exc:  # a path stored other rows than it was given
        raise SystemExit(f"bench ingest: IMPOSSIBLE FIGURE: {exc}") from None


def in_batches(items: list[Any], per: int) -> list[list[Any]]:
    """``items`` cut into batches of ``per`` (the last one shorter), every item in one."""
    return [items[j : j + per] for j in range(0, len(items), max(1, per))]


def contended_inserts(store: ChdbStore, chunks: list[Any], batches: list[GpuSampleBatch], repeat: int,
                      dog: Watchdog, packs_per_batch: int) -> list[float]:  # fmt: skip
    """Seconds of the store's insert of the prepared chunks (its own path, into a twin: Native
    bytes encoded and sent), ``repeat`` times, while another thread runs the ingest's own
    decoding of the same batches as packs (Ingestor.prepare, as the consumer thread does beside
    the writer): the writer's lot."""
    from bench.insert_paths import TWIN
    from gpuslo.ingest.pipeline import Ingestor
    from gpuslo.ingest.writer import Raw
    from gpuslo.wire.pack import pack

    values = [encode(b) for b in batches]
    packs = [pack(values[i : i + 250])[0] for i in range(0, len(values), 250)]
    items = [Raw(f"bench/0/{k}", v, "bench", 0, k) for k, v in enumerate(packs)]
    now = max(b.ts for b in batches) + 60  # the batches are recent: the decoding takes them all
    running, done = threading.Event(), threading.Event()

    def decode() -> None:
        while not done.is_set():
            if not running.wait(0.05):
                continue
            ing = Ingestor(store, clock=lambda: now, dedup_window=1)  # a fresh one: nothing is a replay
            for batch in in_batches(items, packs_per_batch):  # the pack run's batches
                if not running.is_set():
                    break
                ing.prepare(batch)

    store.execute(f"CREATE TABLE IF NOT EXISTS {TWIN} AS gpu_samples")  # the paths dropped theirs
    worker = threading.Thread(target=decode, name="bench-decode", daemon=True)
    worker.start()
    out: list[float] = []
    try:
        for _ in range(repeat):
            dog.progress("the store's inserts beside the decoding")
            store.execute(f"TRUNCATE TABLE {TWIN}")
            running.set()
            t0 = time.perf_counter()
            for c in chunks:
                store.insert(TWIN, c)
            out.append(time.perf_counter() - t0)
            running.clear()
    finally:
        running.clear()
        done.set()
        worker.join(timeout=30)
        store.execute(f"DROP TABLE IF EXISTS {TWIN}")
    return out


def server_insert(
    work: Path, batches: list[GpuSampleBatch], batch_messages: int, dog: Watchdog
) -> float | None:
    """Seconds for the server store's inserts of the same batches into clickhouse-server (the
    store's own column conversion timed with it); None where no server is installed."""
    from gpuslo.core.settings import ClickHouseSettings
    from gpuslo.ingest.clickhouse_store import ClickHouseStore
    from tests.servers.clickhouse import PASSWORD, ClickHouseServer, binary, legacy_ingest_ddl

    if binary() is None:
        return None
    dog.progress("starting clickhouse-server")
    server = ClickHouseServer(work / "clickhouse")
    dog.on_abort.append(server.stop)
    server.start()
    try:
        settings = ClickHouseSettings.model_validate(
            {"host": "127.0.0.1", "port": server.port, "database": "bench", "password": PASSWORD}
        )
        st = ClickHouseStore(settings)
        st.create_database()
        (ddl,) = [d for d in legacy_ingest_ddl() if "TABLE IF NOT EXISTS gpu_samples" in d]
        st.execute(ddl)
        chunks = [to_columns(batches[i : i + batch_messages])["gpu_samples"]
                  for i in range(0, len(batches), batch_messages)]  # fmt: skip
        dog.progress("server inserts")
        t0 = time.perf_counter()
        for cols in chunks:
            st.insert("gpu_samples", cols)
            dog.progress()
        seconds = time.perf_counter() - t0
        n = st.query("SELECT count() AS n FROM gpu_samples")[0]["n"]
        rows = sum(len(b.gpus) for b in batches)
        if n != rows:
            raise SystemExit(f"bench ingest: IMPOSSIBLE FIGURE: the server holds {n} GPU rows, {rows} sent")
        st.close()
        return seconds
    finally:
        server.stop()


class CountingStore(ChdbStore):
    """The chDB store, counting the GPU-sample inserts and their rows (rows per insert of a run)."""

    inserts = 0
    rows = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (start, end) perf_counter of each GPU-sample insert: where a run's clock went
        self.spans: list[tuple[float, float]] = []

    def insert(self, table: str, columns: Any) -> int:
        t0 = time.perf_counter()
        n = super().insert(table, columns)
        if table == "gpu_samples" and n:
            self.spans.append((t0, time.perf_counter()))
            self.inserts += 1
            self.rows += n
        return n


# each run's ``ingest.batch_s``: long enough for one whole batch to be polled (5,000 JSON messages
# take about 0.3 s of polls here, a pack batch 10-50 ms), so that batches close by count (the pack
# run's by ``pack_batch_messages``); only a last one left short (a count that does not divide,
# packs of uneven size) waits for its run's timer, for messages that never come, which the report
# says (with the default 2 s the clock would hold a longer idle wait)
JSON_BATCH_S = 1.0
PACK_BATCH_S = 0.25


def pack_batch_messages(batch_messages: int, packs: int, packed: int) -> int:
    """The packs per batch that hold about ``batch_messages`` node batches, by the packs' mean
    count (at least one pack)."""
    if not packs:
        return batch_messages
    return max(1, round(batch_messages / (packed / packs)))


def raw_batch_messages(batch_messages: int, packs: int, packed: int) -> int:
    """The node batches of each raw insert: those of the pack run's batch (``pack_batch_messages``
    whole packs), so that the end to end and the raw insert make inserts of the same rows (a
    tenth more inserts, and a last batch cut short, cost the pack run about a tenth when its
    batches were cut by an estimate of their bytes; where a pack holds more batches than
    ``batch_messages``, a raw insert of ``batch_messages`` would be smaller than any of the pack
    run's, and the run said that end to end was impossibly fast)."""
    if not packs:
        return batch_messages
    return max(1, round(pack_batch_messages(batch_messages, packs, packed) * packed / packs))


def ingest_consumer(
    bootstrap: str,
    topics: Topics,
    store: ChdbStore,
    batch_messages: int,
    group: str,
    batch_bytes: int = 64 << 20,
    batch_s: float = 1.0,
) -> KafkaIngest:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topics.gpu_samples, num_partitions=3, replication_factor=1)])
    admin.close()
    return KafkaIngest(
        KafkaSettings(bootstrap_servers=[bootstrap], topics=topics),
        IngestSettings(
            group_id=group,
            batch_messages=batch_messages,
            batch_bytes=batch_bytes,
            batch_s=batch_s,
            metrics_port=0,
        ),
        store,
    )


def count_warnings(ing: KafkaIngest) -> list[int]:
    """A counter (``[n]``) of the warnings of every batch ``ing`` prepares from now on (a stream
    out of order, say: its batches are then taken one by one, not at once)."""
    seen = [0]
    prepare = ing.ingestor.prepare

    def counted(items: Any) -> Any:
        p = prepare(items)
        seen[0] += p.report.n_warnings
        return p

    ing.ingestor.prepare = counted  # type: ignore[method-assign]
    return seen


def produce_packed(bootstrap: str, topics: Topics, batches: list[GpuSampleBatch], work: Path,
                   ings: list[KafkaIngest], dog: Watchdog, timeout_s: float) -> tuple[int, int]:  # fmt: skip
    """The batches through the agent's KafkaSink (spool, drain, default producer settings), one
    per node as each node's agent sends its backlog, which packs them; (packs sent, batches in them)."""
    from gpuslo.agent.kafka_sink import KafkaSink
    from gpuslo.core.settings import ProducerSettings, SpoolSettings

    nodes: dict[str, list[GpuSampleBatch]] = {}
    for b in batches:
        nodes.setdefault(b.node, []).append(b)
    packs = packed = 0
    for node, mine in nodes.items():  # each node's agent drains its own spool
        sink = KafkaSink(
            KafkaSettings(bootstrap_servers=[bootstrap], topics=topics),
            SpoolSettings(directory=work / "spool" / node, max_bytes=2**40, max_age_s=MAX_AGE_S),
            ProducerSettings(),
            start=False,
        )
        if not sink.send(mine).ok:
            raise SystemExit(f"bench ingest: the agent's spool refused {node}'s batches")
        while len(sink.spool):
            if not sink.drain_once(force=True):
                raise SystemExit(f"bench ingest: the agent's drain failed: {sink.last_error}")
            for ing in ings:
                ing.consumer.poll(timeout_ms=0)  # paused: keeps the membership
            dog.progress(
                "producing packs through the agents' sinks", f"{node}: {sink.sent_records} of {len(mine)}"
            )
        packs, packed = packs + sink.sent_packs, packed + sink.packed_records
        sink.close(timeout_s=timeout_s)
    return packs, packed


@dataclass(frozen=True)
class Run:
    """One timed end-to-end run: seconds, GPU-sample inserts and their rows."""

    seconds: float
    inserts: int
    rows: int
    cpu: dict[str, float]  # CPU seconds by thread kind inside the clock (thread_cpu)
    # from the clock's start to the first GPU-sample insert (the first batch read and decoded
    # while the writer waits), and the seconds the writer spent in them: the rest of the clock is
    # the writer waiting between inserts and the last commit
    first_insert_s: float = 0.0
    inserts_s: float = 0.0

    @property
    def rows_per_insert(self) -> float:
        return self.rows / max(1, self.inserts)


@dataclass(frozen=True)
class Figures:
    batches: int
    rows: int
    field_values: int
    stored: dict[str, int]
    join_s: float
    json: Run
    pack_runs: list[Run]  # in the order run: the first is the process's first pack run
    packs: int
    packed_batches: int
    paths: list[PathResult]
    server_s: float | None = None
    contended: list[float] | None = None  # seconds per repeat (contended_inserts)
    raw_chunks: int = 0  # inserts of each raw path (a batch of ``raw_batch_messages`` per day)
    pack_per_batch: int = 0  # packs per batch of the pack runs (``pack_batch_messages``)
    store_native: bool = False  # whether the store sends these batches as Native (ChdbStore.native)

    @property
    def pack(self) -> Run:
        """The fastest pack run, as the raw paths' figure is their fastest."""
        return min(self.pack_runs, key=lambda r: r.seconds)

    @property
    def raw(self) -> PathResult:
        return fastest(self.paths, self.rows)

    @property
    def store_path(self) -> PathResult:
        """The store's own path for these batches into the bare twin: Native where it sends
        Native (a streaming insert that raises the engine's errors), else ``Python()``."""
        by_name = {p.name: p for p in self.paths}
        return by_name["native"] if self.store_native else by_name["python_arrow"]


def timed(ing: KafkaIngest, store: CountingStore, dog: Watchdog, n: int, broker_pid: int | None) -> Run:
    i0, r0, k0 = store.inserts, store.rows, len(store.spans)
    t0 = time.perf_counter()  # a hair before consume_all's own clock (its resume call)
    seconds, cpu = consume_all(ing, dog, n, broker_pid)
    spans = store.spans[k0:]
    first = spans[0][0] - t0 if spans else 0.0
    return Run(seconds, store.inserts - i0, store.rows - r0, cpu, first, sum(b - a for a, b in spans))


def run(a: argparse.Namespace, dog: Watchdog, work: Path) -> Figures:
    """Starts the broker, produces both forms, times both end-to-end runs and the raw runs."""
    from tests.servers.kafka import KafkaBroker

    dog.progress("starting the Kafka broker")
    broker = KafkaBroker(work / "kafka", flush_each_message=False)  # Kafka's default, as production runs
    dog.on_abort.append(broker.stop)
    broker.start()
    try:
        dog.progress("simulating node batches")
        batches = make_batches(a.batches)
        rows = sum(len(b.gpus) for b in batches)
        field_values = sum(len(g.fields) for b in batches for g in b.gpus)
        # the packed run's batches are the same but for their cluster, so each run's rows are
        # counted, and their day, so that its parts are its own partitions: merges of the JSON
        # run's parts are never the pack run's work. It runs ``--repeat`` times in the same
        # ingest process, as the raw paths do, each on a copy of its own days (its own partitions),
        # each copy after the one before (else every stream is out of order and the ingest takes
        # its batches one by one), all before the JSON run's days, with sequence numbers of its
        # own (else the ingest drops the copy as replays)
        shift = 86400.0 * (2 + (max(b.ts for b in batches) - min(b.ts for b in batches)) // 86400)
        as_packed = [
            b.model_copy(update={"cluster": "bench-pack", "ts": b.ts - shift * a.repeat}) for b in batches
        ]
        json_topics = Topics(**{k: f"bench.{k}" for k in Topics.model_fields})
        pack_topics = Topics(**{k: f"benchpk.{k}" for k in Topics.model_fields})
        dog.progress("creating the topics")
        store = CountingStore(work / "store")
        store.migrate(SCHEMA)
        ing_json = ingest_consumer(
            broker.bootstrap, json_topics, store, a.batch_messages, "bench-json", batch_s=JSON_BATCH_S
        )
        # its batches' count is set once the packs are made (pack_batch_messages)
        ing_pack = ingest_consumer(
            broker.bootstrap, pack_topics, store, a.batch_messages, "bench-pack", batch_s=PACK_BATCH_S
        )
        join_s = join_paused(ing_json, dog, a.stall_s) + join_paused(ing_pack, dog, a.stall_s)
        produce(broker.bootstrap, json_topics.gpu_samples, batches, ing_json, dog, a.stall_s)
        packs, packed = produce_packed(
            broker.bootstrap, pack_topics, as_packed, work, [ing_json, ing_pack], dog, a.stall_s
        )
        singles = len(batches) - packed
        per_batch = pack_batch_messages(a.batch_messages, packs, packed)  # packs per pack-run batch
        ing_pack.settings = ing_pack.settings.model_copy(update={"batch_messages": per_batch})
        print(f"{len(batches)} node batches in Kafka twice: {rows} GPU rows, {field_values} field values each; "
              f"as {len(batches)} JSON messages, and as {packs} packs (+{singles} JSON)")  # fmt: skip
        # the bench's own objects (the simulated batches, as models) are not an ingest process's:
        # the cycle collector would walk them on every collection inside the clock
        gc.collect()
        gc.freeze()
        settle(store, dog, a.stall_s)
        pid = broker.proc.pid if broker.proc else None
        json_run = timed(ing_json, store, dog, len(batches), pid)
        ing_json.close()
        warnings = count_warnings(ing_pack)
        per_raw = raw_batch_messages(a.batch_messages, packs, packed)
        chunks = prepared_chunks(store, batches, per_raw)
        raw = InsertPaths(store, chunks)  # its twins; the chDB-made bytes are made in its first round
        pack_runs = []
        for k in range(a.repeat):
            if k:  # the next copy, a later backlog of the same agents (not timed)
                shifted = [b.model_copy(update={"ts": b.ts + shift * k, "seq": b.seq + (k << 40)})
                           for b in as_packed]  # fmt: skip
                # its own count: the agent's spool reads are bounded in bytes, and longer
                # sequence numbers may cut its packs elsewhere
                packs_k, packed_k = produce_packed(broker.bootstrap, pack_topics, shifted, work / f"copy{k}",
                                                   [ing_pack], dog, a.stall_s)  # fmt: skip
                singles = len(batches) - packed_k
                del shifted
                gc.collect()
                gc.freeze()
            else:
                packs_k = packs
            settle(store, dog, a.stall_s)
            pack_runs.append(timed(ing_pack, store, dog, packs_k + singles, pid))
            settle(store, dog, a.stall_s)
            raw_round(raw, k, dog)
        ing_pack.close()
        if warnings[0]:  # an out-of-order stream or the like: batches taken one by one, not the path timed
            raise SystemExit(
                f"bench ingest: IMPOSSIBLE FIGURE: the pack runs' ingest warned {warnings[0]} times"
            )
        stored = {
            r["cluster"]: r["n"]
            for r in store.query("SELECT cluster, count() AS n FROM gpu_samples FINAL GROUP BY cluster")
        }
        paths = raw.results()
        store_native = store.native("gpu_samples", chunks[0]) is not None  # the path it takes
        contended = contended_inserts(store, chunks, batches, a.repeat, dog, per_batch)
        store.close()
        broker.stop()
        server_s = None if a.no_server else server_insert(work, batches, a.batch_messages, dog)
    finally:
        dog.stop()
        broker.stop()
    return Figures(len(batches), rows, field_values, stored, join_s, json_run, pack_runs, packs, packed, paths,
                   server_s, contended, len(chunks), per_batch, store_native)  # fmt: skip


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
TICK_S = 0.01  # /proc's CPU counters move in clock ticks (100 a second)
# CPU a run's counters may show beyond its clock without any work outside it: the threads' own
# counters are read one after another, after the process's, while they run on
CPU_SLACK_S = 0.2


def paired_ratios(pack_runs: list[Run], raw: PathResult) -> list[float]:
    """Each pack run's rate as a ratio to the raw path's round made right after it (the same
    rows: a ratio of their seconds), in run order: a burst of load that slows a whole round of
    both cancels out, where the best of each may come from different moments."""
    return [r_s / p.seconds for p, r_s in zip(pack_runs, raw.seconds, strict=False)]


def report(f: Figures, batch_messages: int) -> dict[str, float]:
    """Prints the figures (the last line JSON); returns each run's ratio to the fastest raw insert."""
    raw = f.raw
    raw_best = raw.best(f.rows)
    print(f"group joins on the empty topics (not timed): {f.join_s:.2f} s")
    out: dict[str, Any] = {"bench": "ingest", "batches": f.batches, "gpu_rows": f.rows, "field_values": f.field_values,
                           "join_s": round(f.join_s, 3), "packs": f.packs, "packed_batches": f.packed_batches}  # fmt: skip
    ratios: dict[str, float] = {}
    for name, r, what in (
        ("json", f.json, "one JSON message per batch"),
        ("pack", f.pack, f"the agent's packs, {f.packed_batches / max(1, f.packs):.0f} batches each"),
    ):
        per_s = f.rows / r.seconds
        ratios[name] = per_s / raw_best
        print(
            f"end to end, {what} (Kafka → decode → chDB, committed): {r.seconds:6.2f} s  {per_s:12,.0f} GPU rows/s"
            f"  {f.field_values / r.seconds:12,.0f} field values/s  ({r.inserts} inserts, {r.rows_per_insert:,.0f} rows each)"
        )
        if name == "pack" and len(f.pack_runs) > 1:  # the best of the runs, as the raw paths' figure
            secs = [p.seconds for p in f.pack_runs]
            median_s = statistics.median(secs)
            print(f"  the fastest of {len(secs)} runs in one ingest process, each on a copy of its own "
                  f"(seconds in order: {', '.join(f'{x:.2f}' for x in secs)}); median {f.rows / median_s:,.0f} "
                  f"GPU rows/s, {f.rows / median_s / raw.median(f.rows):.3f} of the fastest raw insert's median")  # fmt: skip
            out |= {"e2e_pack_runs": len(secs), "e2e_pack_first_s": round(secs[0], 3),
                    "e2e_pack_median_s": round(median_s, 3),
                    "ratio_e2e_pack_median_vs_raw_median": round(f.rows / median_s / raw.median(f.rows), 3)}  # fmt: skip
        if r.inserts:
            print(f"  the writer: first insert after {r.first_insert_s:.3f} s, in inserts {r.inserts_s:.3f} s "
                  f"({r.inserts_s / r.seconds:.0%} of the clock), waiting between them and after the last "
                  f"{max(0.0, r.seconds - r.first_insert_s - r.inserts_s):.3f} s")  # fmt: skip
            out |= {f"e2e_{name}_first_insert_s": round(r.first_insert_s, 3),
                    f"e2e_{name}_inserts_s": round(r.inserts_s, 3)}  # fmt: skip
        if r.cpu:
            used = sum(r.cpu.values())
            print(f"  CPU inside the clock: {used:.2f} s on {CORES} cores = {used / r.seconds:.2f} cores busy"
                  f" ({', '.join(f'{k} {v:.2f} s' for k, v in sorted(r.cpu.items(), key=lambda kv: -kv[1]))})")  # fmt: skip
            out |= {f"cpu_{name}_{k.lower()}_s": round(v, 3) for k, v in r.cpu.items()}
            out[f"cpu_{name}_cores_busy"] = round(used / r.seconds, 3)
            # the most this run's work allows here: the same CPU seconds with no core ever idle
            ceiling = f.rows / (max(used, TICK_S) / CORES)  # a run too short to count: one tick
            print(f"  the same CPU on {CORES} cores never idle: at most {ceiling:,.0f} GPU rows/s, "
                  f"{ceiling / raw_best:.3f} of the fastest raw insert")  # fmt: skip
            out[f"e2e_{name}_ceiling_rows_per_s"] = round(ceiling)
            out[f"ratio_e2e_{name}_ceiling_vs_raw"] = round(ceiling / raw_best, 3)
        out |= {f"e2e_{name}_s": round(r.seconds, 3), f"e2e_{name}_rows_per_s": round(per_s),
                f"e2e_{name}_rows_per_insert": round(r.rows_per_insert), f"ratio_e2e_{name}_vs_raw": round(ratios[name], 3)}  # fmt: skip
    for line in table(f.paths, f.rows):
        print(line)
    print(
        f"fastest raw insert (best median): {raw.name}, best {raw_best:,.0f} GPU rows/s "
        f"({f.raw_chunks} inserts, {f.rows / max(1, f.raw_chunks):,.0f} rows each)"
    )
    out["raw_inserts"] = f.raw_chunks
    print(f"ratio end-to-end / fastest raw (its best): JSON {ratios['json']:.3f}, packs {ratios['pack']:.3f}"
          "   (goals: >= 0.7, and >= 250,000 GPU rows/s)")  # fmt: skip
    paired = paired_ratios(f.pack_runs, raw)
    if paired:
        print(f"each pack run / the raw round right after it ({raw.name}): "
              f"{', '.join(f'{x:.3f}' for x in paired)}; median {statistics.median(paired):.3f}")  # fmt: skip
        out |= {"ratio_e2e_pack_vs_raw_paired": [round(x, 3) for x in paired],
                "ratio_e2e_pack_vs_raw_paired_median": round(statistics.median(paired), 3)}  # fmt: skip
        # each pair is a figure of its own: one past what the rows allow is as impossible (sanity)
        ratios |= {f"pack (run {k + 1}, against the raw round after it)": x for k, x in enumerate(paired)}
    views = [p for p in f.paths if p.name == "store_views"]
    if views:  # the store's own insert, whichever path it takes, its materialized views included
        store_best = views[0].best(f.rows)
        print(f"the store's insert with its views (store_views: {f.store_path.name}), best {store_best:,.0f} GPU rows/s: "
              f"ratio end-to-end / it: JSON {f.rows / f.json.seconds / store_best:.3f}, "
              f"packs {f.rows / f.pack.seconds / store_best:.3f}")  # fmt: skip
        out |= {"ratio_e2e_pack_vs_store_insert": round(f.rows / f.pack.seconds / store_best, 3),
                "ratio_e2e_json_vs_store_insert": round(f.rows / f.json.seconds / store_best, 3)}  # fmt: skip
    print(f"packs / JSON end to end: {f.json.seconds / f.pack.seconds:.2f}×")
    out |= {"ratio_e2e_pack_vs_json": round(f.json.seconds / f.pack.seconds, 3), "raw_path": raw.name,
            "raw_rows_per_s": round(raw_best), **as_json(f.paths, f.rows)}  # fmt: skip
    if f.contended:
        rate, alone = f.rows / statistics.median(f.contended), f.store_path.median(f.rows)
        print(f"the store's insert ({f.store_path.name}) beside the ingest's decoding on another thread: median "
              f"{rate:,.0f} GPU rows/s, {rate / alone:.2f}× its median alone")  # fmt: skip
        out |= {"contended_rows_per_s": round(rate), "ratio_contended_vs_alone": round(rate / alone, 3)}
    if f.server_s is not None:
        server_rows = f.rows / f.server_s
        store_rows = f.store_path.best(f.rows)
        out["server_rows_per_s"] = round(server_rows)
        out["ratio_server_vs_chdb_store"] = round(server_rows / store_rows, 3)
        print(
            f"server store (clickhouse-driver, native protocol, columnar) into clickhouse-server 18.16: "
            f"{f.server_s:6.2f} s  {server_rows:12,.0f} GPU rows/s  ({server_rows / store_rows:.2f}× chDB's store insert)"
        )
    if f.batches % batch_messages:  # the JSON run's last batch waited for its timer
        print(
            f"note: {f.batches} messages are not whole batches of {batch_messages}: the JSON run's last "
            f"batch of {f.batches % batch_messages} waited up to its {JSON_BATCH_S:g} s timer for more, "
            "inside its clock"
        )
    if f.pack_per_batch and f.packs % f.pack_per_batch:
        print(
            f"note: {f.packs} packs are not whole batches of {f.pack_per_batch}: the pack runs' last "
            f"batch waited up to its {PACK_BATCH_S:g} s timer for more, inside their clocks"
        )
    print(json.dumps(out))
    return ratios


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench ingest")
    ap.add_argument("--batches", type=int, default=20_000, help="node batches (8 GPUs each)")
    ap.add_argument("--batch-messages", type=int, default=5000)
    ap.add_argument("--stall-s", type=float, default=120.0, help="give up after this long without progress")
    ap.add_argument("--repeat", type=count(1, 100), default=3,
                    help="runs of each raw insert path (interleaved) and of the pack run end to end")  # fmt: skip
    ap.add_argument("--no-server", action="store_true", help="skip the clickhouse-server section")
    a = ap.parse_args(argv)

    dog = Watchdog(a.stall_s)
    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-ingest-"))
    try:
        f = run(a, dog, work)
    except BaseException:
        print(f"bench ingest: the servers' and the processes' files are in {work}", file=sys.stderr)
        raise
    runs = [("JSON", f.json)] + [
        (f"pack ({k + 1} of {len(f.pack_runs)})", r) for k, r in enumerate(f.pack_runs)
    ]
    busy = {run: (sum(r.cpu.values()), r.seconds) for run, r in runs if r.cpu}
    rc = sanity(f.stored, f.rows, report(f, a.batch_messages), busy, len(f.pack_runs))
    if rc:
        print(f"bench ingest: the servers' and the processes' files are in {work}", file=sys.stderr)
    else:  # the broker's and the server's data of the run (hundreds of MB at full size)
        shutil.rmtree(work, ignore_errors=True)
    return rc


# end to end contains the same inserts as the raw run (and more): faster than raw by more than
# run-to-run noise means the clock missed work
MAX_RATIO = 1.2


JSON_CLUSTER = SimConfig().cluster  # the simulated fleet's: the JSON run's rows


def sanity(
    stored: dict[str, int],
    rows: int,
    ratios: dict[str, float],
    busy: dict[str, tuple[float, float]] | None = None,
    pack_runs: int = 1,
) -> int:
    """Exit status 2 (each problem said) for a figure that cannot be true; ``busy``: each run's
    measured CPU seconds and its clock's seconds, whose ratio cannot pass the cores there are
    (beyond ``CPU_SLACK_S``); ``pack_runs``: the pack run's copies, each ``rows`` GPU rows."""
    problems = []
    for run, (cpu, seconds) in (busy or {}).items():
        if cpu > CORES * seconds + CPU_SLACK_S:
            problems.append(
                f"the {run} run used {cpu:.2f} s of CPU in {seconds:.2f} s on {CORES} cores: "
                "CPU outside its clock was counted"
            )
    for cluster, run, sent in ((JSON_CLUSTER, "JSON", rows), ("bench-pack", "pack", rows * pack_runs)):
        if stored.get(cluster, 0) != sent:
            problems.append(f"{stored.get(cluster, 0)} GPU rows in the store from the {run} run, {sent} sent")
    for run, ratio in ratios.items():
        if ratio > MAX_RATIO:
            problems.append(
                f"the {run} run end to end is {ratio:.2f}× the raw insert it contains (> {MAX_RATIO}): the timing missed work"
            )
    for p in problems:
        print(f"bench ingest: IMPOSSIBLE FIGURE: {p}", file=sys.stderr)
    return 2 if problems else 0

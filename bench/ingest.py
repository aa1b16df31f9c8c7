"""End-to-end ingest throughput, Kafka → store, against the store's raw insert limit.

A real Kafka broker (provision/kafka.sh jars) is started; N simulated node batches are
produced to it (not timed). Then, timed:
  e2e: KafkaIngest (consume, decode, validate, columnar insert per table, commit) into chDB;
  raw: the same GPU-sample rows as prepared columns, inserted straight into the same chDB
       (same process, same run, same batch size) into a twin table: the store's limit.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.sim.fleet import Fleet, SimConfig
from agent.sim.sources import SimNodeSource
from gpuslo.settings import IngestSettings, KafkaSettings, Topics
from gpuslo.wire import GpuSampleBatch, encode
from ingest.kafka_consumer import KafkaIngest
from ingest.store import ChdbStore
from ingest.writer import to_columns


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


def main(argv: list[str]) -> int:
    from kafka import KafkaProducer

    from tests.servers.kafka import KafkaBroker

    ap = argparse.ArgumentParser(prog="python -m bench ingest")
    ap.add_argument("--batches", type=int, default=20_000, help="node batches (8 GPUs each)")
    ap.add_argument("--batch-messages", type=int, default=5000)
    a = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-ingest-"))
    broker = KafkaBroker(work / "kafka")
    broker.start()
    try:
        batches = make_batches(a.batches)
        rows = sum(len(b.gpus) for b in batches)
        field_values = sum(len(g.fields) for b in batches for g in b.gpus)
        topics = Topics(**{k: f"bench.{k}" for k in Topics.model_fields})
        p = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", linger_ms=20)
        for b in batches:
            p.send(topics.gpu_samples, key=b.node.encode(), value=encode(b))
        p.flush()
        p.close()
        print(f"{len(batches)} node batches in Kafka: {rows} GPU rows, {field_values} field values")

        store = ChdbStore(work / "store")
        store.migrate()
        ing = KafkaIngest(
            KafkaSettings(bootstrap_servers=[broker.bootstrap], topics=topics),
            IngestSettings(group_id="bench", batch_messages=a.batch_messages, batch_s=1.0, metrics_port=0),
            store,
        )
        consumed = 0
        t0 = 0.0
        while consumed < len(batches):
            n = ing.step()
            if n and not t0:
                t0 = time.perf_counter()  # from the first batch read: group join is not ingest work
            consumed += n
        e2e_s = time.perf_counter() - t0
        ing.close()
        stored = store.query("SELECT count() AS n FROM gpu_samples FINAL")[0]["n"]
        assert stored == rows, (stored, rows)

        # raw: the same rows as prepared columns, same batch size, into a twin table
        store.execute("CREATE TABLE gpu_samples_raw AS gpu_samples")
        chunks: list[dict[str, Any]] = []
        for i in range(0, len(batches), a.batch_messages):
            # prepared = already the Arrow table the store inserts: only the insert is timed
            chunks.append(
                store.prepare_columns(
                    "gpu_samples_raw", to_columns(batches[i : i + a.batch_messages])["gpu_samples"]
                )
            )
        t1 = time.perf_counter()
        for cols in chunks:
            store.insert("gpu_samples_raw", cols)
        raw_s = time.perf_counter() - t1
        store.close()
    finally:
        broker.stop()

    e2e_rows = rows / e2e_s
    raw_rows = rows / raw_s
    ratio = e2e_rows / raw_rows
    fps = field_values / e2e_s
    print(
        f"end to end (Kafka → decode → chDB, committed): {e2e_s:6.2f} s  {e2e_rows:12,.0f} GPU rows/s  {fps:12,.0f} field values/s"
    )
    print(f"raw prepared columnar insert into chDB:          {raw_s:6.2f} s  {raw_rows:12,.0f} GPU rows/s")
    print(f"ratio end-to-end / raw: {ratio:.3f}   (goals: >= 0.5, and >= 200,000 field values/s)")
    print(json.dumps({
        "bench": "ingest", "batches": len(batches), "gpu_rows": rows, "field_values": field_values,
        "e2e_s": round(e2e_s, 3), "e2e_rows_per_s": round(e2e_rows), "e2e_field_values_per_s": round(fps),
        "raw_s": round(raw_s, 3), "raw_rows_per_s": round(raw_rows), "ratio_e2e_vs_raw": round(ratio, 3),
    }))  # fmt: skip
    return 0

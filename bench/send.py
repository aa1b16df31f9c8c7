"""The agent's send path and the ingest's read of it, per producer codec, on a real broker.

For each codec this installation has (none, gzip, zstd, and lz4 or snappy where installed), the
same node batches go through the agent's ``KafkaSink`` (spool, drain, packs of a backlog, as the
agent sends them), then are read back by a consumer made as the ingest makes its own. Figures per
1,000 node batches (8 GPUs each, plus heartbeats):

  send   CPU seconds of the whole process (``time.process_time``: the thread appending to the
         spool and the drainer sending) from the first ``send`` until the broker acknowledged
         the last record. Message building is outside (that is the sources' cost).
  read   CPU seconds of the reading process from its first ``poll`` until it has every Kafka
         message sent (fetch, decompression, record parsing: what the ingest pays before it
         decodes), bounded by ``--timeout-s``.
  bytes  the topics' log segments on the broker's disk.

Each figure is also given as a ratio to ``none`` and to ``gzip`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.args import count, number
from gpuslo.agent.kafka_sink import KafkaSink, check_codec
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.core.settings import (
    CODEC_PACKAGES,
    KafkaSettings,
    ProducerSettings,
    SettingsError,
    SpoolSettings,
    Topics,
)
from gpuslo.wire import Message

#: Every codec kafka-python has, and the package it needs (none for gzip: the standard library).
CODECS = (("none", None), ("gzip", None), *CODEC_PACKAGES.items())


def node_ticks(n: int) -> list[list[Message]]:
    """``n`` ticks of one 8-GPU node: its batch, heartbeat, and what the node-level sources add."""
    cfg = SimConfig(nodes=1, gpus_per_node=8, hours=n * 10 / 3600 + 0.01, seed=1)
    fleet = Fleet(cfg)
    sources = sim_sources(fleet)
    out: list[list[Message]] = []
    for k in range(n):
        t = cfg.start_ts + k * cfg.interval_s
        fleet.advance_to(t)
        out.append([m for s in sources for m in s.collect(t) if m.kind in ("gpu_samples", "heartbeat")])
    return out


def available() -> list[str]:
    """The codecs kafka-python can use here (the agent's own check)."""
    out = []
    for c, _ in CODECS:
        try:
            check_codec(c)
        except SettingsError:
            continue
        out.append(c)
    return out


def read_back(bootstrap: str, topics: list[str], messages: int, timeout_s: float) -> float:
    """CPU seconds of this process to read ``messages`` Kafka messages from ``topics``, as the
    ingest's consumer reads (its fetch settings); raises SystemExit when they do not all arrive."""
    from kafka import KafkaConsumer

    c = KafkaConsumer(
        *topics,
        bootstrap_servers=[bootstrap],
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=5000,
    )
    try:
        got = 0
        deadline = time.monotonic() + timeout_s
        c0 = time.process_time()
        while got < messages:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench send: read {got} of {messages} messages in {timeout_s:g} s")
            got += sum(len(v) for v in c.poll(timeout_ms=500).values())
        cpu = time.process_time() - c0
    finally:
        c.close()
    if got != messages:
        raise SystemExit(f"bench send: read {got} messages, {messages} were sent: IMPOSSIBLE FIGURE")
    return cpu


def _unacknowledged(sink: KafkaSink, timeout_s: float) -> str:
    why = sink.last_error or "no error from the broker: it was slower than that (raise --timeout-s)"
    return f"the broker did not acknowledge every record in {timeout_s:g} s: {why}"


def on_disk(data: Path, topics: list[str]) -> int:
    return sum(f.stat().st_size for t in topics for f in data.glob(f"{t}-*/*.log"))


def run(a: argparse.Namespace) -> dict[str, dict[str, float]]:
    from tests.servers.kafka import KafkaBroker

    ticks = node_ticks(a.batches)
    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-send-"))
    broker = KafkaBroker(work / "kafka")
    broker.start()
    figures: dict[str, dict[str, float]] = {}
    try:
        for codec in available():
            topics = Topics(**{k: f"send-{codec}.{k}" for k in Topics.model_fields})
            sink = KafkaSink(
                KafkaSettings(bootstrap_servers=[broker.bootstrap], topics=topics),
                SpoolSettings(directory=work / f"spool-{codec}"),
                ProducerSettings(compression=codec),  # type: ignore[arg-type]
            )
            sink.send(ticks[0])  # connect and create the topics outside the measurement
            if not sink.flush(a.timeout_s):
                raise SystemExit(f"bench send: {codec}: {_unacknowledged(sink, a.timeout_s)}")
            c0, w0 = time.process_time(), time.perf_counter()
            for msgs in ticks:
                sink.send(msgs)
            if not sink.flush(a.timeout_s):
                raise SystemExit(f"bench send: {codec}: {_unacknowledged(sink, a.timeout_s)}")
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            sent = sink.sent_records - sink.packed_records + sink.sent_packs  # Kafka messages
            packs = sink.sent_packs
            sink.close()
            names = [topics.gpu_samples, topics.heartbeat]
            read = read_back(broker.bootstrap, names, sent, a.timeout_s)
            figures[codec] = {
                "send_cpu_s_per_1000_batches": round(cpu / len(ticks) * 1000, 3),
                "send_wall_s": round(wall, 3),
                # the read has the warm-up tick's messages too
                "read_cpu_s_per_1000_batches": round(read / (len(ticks) + 1) * 1000, 3),
                "bytes_per_batch": round(on_disk(broker.dir / "data", names) / (len(ticks) + 1)),
                "kafka_messages": sent,
                "packs": packs,
            }
    finally:
        broker.stop()
    shutil.rmtree(work, ignore_errors=True)  # the broker's data of the run (kept where it failed)
    return figures


def report(figures: dict[str, dict[str, float]], batches: int) -> dict[str, Any]:
    print(f"{batches} node batches (8 GPUs) + heartbeats per codec, spool → Kafka (acks=all) → a consumer")
    print(
        f"{'compression':12s} {'send CPU s/1000':>16s} {'read CPU s/1000':>16s} {'bytes/batch':>12s}  (× none, × gzip)"
    )
    for codec, f in figures.items():
        for base in ("none", "gzip"):
            for k in ("send_cpu_s_per_1000_batches", "read_cpu_s_per_1000_batches", "bytes_per_batch"):
                b = figures[base][k]  # a figure of 0 (below the clock's resolution) has no ratio
                ratio = round(f[k] / b, 3) if b else None
                f[f"ratio_{k.split('_per_')[0].removesuffix('_s')}_vs_{base}"] = ratio  # type: ignore[assignment]
        r = {k: "—" if v is None else f"{v:.2f}" for k, v in f.items() if k.startswith("ratio_")}
        print(
            f"{codec:12s} {f['send_cpu_s_per_1000_batches']:16.3f} {f['read_cpu_s_per_1000_batches']:16.3f} "
            f"{f['bytes_per_batch']:12,.0f}  (send {r['ratio_send_cpu_vs_none']}, {r['ratio_send_cpu_vs_gzip']}; "
            f"read {r['ratio_read_cpu_vs_none']}, {r['ratio_read_cpu_vs_gzip']}; "
            f"bytes {r['ratio_bytes_vs_none']}, {r['ratio_bytes_vs_gzip']})"
        )
    return {"bench": "send", "batches": batches, "default": ProducerSettings().compression, **figures}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench send")
    ap.add_argument("--batches", type=count(1, 1_000_000), default=3000, help="node batches per codec")
    ap.add_argument("--timeout-s", type=number(0, 3600), default=120.0, help="bound on each wait")
    a = ap.parse_args(argv)
    print(json.dumps(report(run(a), a.batches)))
    return 0

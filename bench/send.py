"""The agent's send path: CPU seconds per 1,000 node batches, spool → real Kafka broker,
with and without compression.

CPU is the whole process's (``time.process_time``: the sampling thread appending to the
spool and the drainer thread sending), from the first ``send`` until the broker acknowledged
the last record. Message building is outside the measurement (that is the sources' cost).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

from gpuslo.agent.kafka_sink import KafkaSink
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.core.settings import KafkaSettings, ProducerSettings, SpoolSettings, Topics
from gpuslo.wire import Message


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


def main(argv: list[str]) -> int:
    from tests.servers.kafka import KafkaBroker

    ap = argparse.ArgumentParser(prog="python -m bench send")
    ap.add_argument("--batches", type=int, default=3000, help="node batches per codec")
    a = ap.parse_args(argv)
    codecs = ["none", "gzip"] + [
        c for c, mod in (("lz4", "lz4"), ("zstd", "zstandard")) if importlib.util.find_spec(mod)
    ]
    ticks = node_ticks(a.batches)
    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-send-"))
    broker = KafkaBroker(work / "kafka")
    broker.start()
    figures: dict[str, dict[str, float]] = {}
    try:
        for codec in codecs:
            topics = Topics(**{k: f"send-{codec}.{k}" for k in Topics.model_fields})
            sink = KafkaSink(
                KafkaSettings(bootstrap_servers=[broker.bootstrap], topics=topics),
                SpoolSettings(directory=work / f"spool-{codec}"),
                ProducerSettings(compression=codec),  # type: ignore[arg-type]
            )
            sink.send(ticks[0])  # connect and create the topics outside the measurement
            assert sink.flush(60)
            c0, w0 = time.process_time(), time.perf_counter()
            for msgs in ticks:
                sink.send(msgs)
            assert sink.flush(120), sink.last_error
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            sink.close()
            per_1000 = cpu / len(ticks) * 1000
            figures[codec] = {"cpu_s_per_1000_batches": round(per_1000, 3), "wall_s": round(wall, 3)}
    finally:
        broker.stop()
    base = figures["none"]["cpu_s_per_1000_batches"]
    print(f"{len(ticks)} node batches (8 GPUs) + heartbeats per codec, spool → Kafka (acks=all)")
    print(f"{'compression':12s} {'CPU s / 1000 batches':>21s} {'vs none':>8s}")
    for codec, f in figures.items():
        f["ratio_vs_none"] = round(f["cpu_s_per_1000_batches"] / base, 3)
        print(f"{codec:12s} {f['cpu_s_per_1000_batches']:21.3f} {f['ratio_vs_none']:8.2f}")
    print(json.dumps({"bench": "send", "batches": len(ticks), **figures}))
    return 0

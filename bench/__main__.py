from __future__ import annotations

import importlib
import sys

BENCHES = {
    "encode": "wire encoding: encode+decode rate of a realistic 8-GPU batch, JSON vs msgpack",
    "ingest": "Kafka → store rows/s end to end vs the store's raw columnar insert (real broker, chDB)",
    "agent": "agent overhead: CPU per 1,000 ticks, share of a core at 1 s and 10 s, peak RSS; the fake NVML at 8 GPUs, and the real NVML beside the fake at its GPU count where a GPU is",
    "rules": "every rule over a 1,000-GPU x 7-day fleet (60 M sample rows): per-minute rollups vs raw rows, chDB",
    "starvation": "the starvation rule at 1,000 / 10,000 / 50,000 nodes x pending requests over one hour: seconds, peak RSS, growth exponents, vs the old SQL",
    "config": "rules config load time against its size (SLOs per file): the cost per SLO stays flat",
    "send": "agent send path: CPU seconds per 1,000 node batches to a real broker, with and without compression",
    "peers": "gpuslo vs dcgm-exporter + Prometheus on one fleet: bytes per sample, RSS, CUR/idle/SLO time in PromQL vs gpuslo",
    "whatif": "the what-if replay of a month of a 1,000-GPU fleet's queue (30,000 requests) per policy: seconds, peak RSS; --load: loading the window from chDB",
    "scaleout": "ingest scale-out: 1 vs 2 ingest processes in one consumer group on a 4-partition topic into clickhouse-server: rows/s, scaling, CPU s per process",
    "parts": "gpu_samples' part format: insert seconds and the background merges' CPU after them, the schema's setting vs gpuslo's former one (Compact up to 256 MiB)",
    "recovery": "after a Kafka broker outage: seconds until the ingest has caught up and the agent's spool is drained, gpuslo's reconnect backoff vs kafka-python's default (real broker)",
    "install": "installed size of each role: a fresh venv per extra (gpuslo[agent] vs gpuslo[all]), site-packages MB",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m bench NAME [options]\n\nbenchmarks:")
        for name, what in BENCHES.items():
            print(f"  {name:10s} {what}")
        return 0
    name = argv[0]
    if name not in BENCHES:
        print(f"unknown benchmark {name!r}; known: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"bench.{name}")
    rc: int = mod.main(argv[1:])
    return rc


sys.exit(main(sys.argv[1:]))

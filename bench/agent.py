"""Agent overhead at 8 GPUs: CPU seconds per 1,000 ticks and peak RSS, on the fake NVML
(pynvml's own structs; the NVML calls themselves cost nothing here, so this measures
the agent's own work: reading, validating, building and encoding the messages).

Each tick: NvmlSource.collect (8 GPUs, every catalogue field NVML gives, GPM metrics),
then the message encoded to wire bytes as the sink would. The interval only matters for
the share of a core: CPU per tick / interval.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from gpuslo.agent.nvml import NvmlSource
from gpuslo.wire import encode


def main(argv: list[str]) -> int:
    import pynvml

    from tests.fake_nvml import FakeGpu, FakeNvml

    ap = argparse.ArgumentParser(prog="python -m bench agent")
    ap.add_argument("--ticks", type=int, default=3000)
    a = ap.parse_args(argv)
    gpm = {pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 70.0, pynvml.NVML_GPM_METRIC_SM_UTIL: 60.0,
           pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 30.0, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 40.0,
           pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 20.0, pynvml.NVML_GPM_METRIC_FP16_UTIL: 10.0}  # fmt: skip
    gpus = [FakeGpu(f"GPU-{i}", gpm_pct=gpm, nvlink_links=18) for i in range(8)]  # H100 SXM: 18 links
    fake = FakeNvml(gpus)
    src = NvmlSource("bench-node", "bench", 1.0, nvml=fake, boot_id="bench")
    src.collect(0.0 + 1_790_000_000)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c0, w0 = time.process_time(), time.perf_counter()
    nbytes = 0
    for k in range(a.ticks):
        for g in gpus:  # NVLink counters move, so every tick computes rates
            g.nvlink_tx_kib += 1000
            g.nvlink_rx_kib += 800
            g.nvlink_ts_us += 1_000_000
        for m in src.collect(1_790_000_001.0 + k):
            nbytes += len(encode(m))
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    per_tick = cpu / a.ticks
    figures = {
        "gpus": 8,
        "ticks": a.ticks,
        "cpu_s_per_1000_ticks": round(per_tick * 1000, 3),
        "core_share_at_1s_pct": round(per_tick / 1.0 * 100, 3),
        "core_share_at_10s_pct": round(per_tick / 10.0 * 100, 4),
        "peak_rss_mb": round(rss / 1024, 1),
        "rss_growth_mb": round((rss - rss0) / 1024, 1),
        "bytes_per_tick": round(nbytes / a.ticks),
    }
    print(f"{a.ticks} ticks of 8 GPUs in {wall:.2f} s wall, {cpu:.2f} s CPU")
    print(f"CPU per 1000 ticks: {figures['cpu_s_per_1000_ticks']} s  → {figures['core_share_at_1s_pct']} % of a core at 1 s, "
          f"{figures['core_share_at_10s_pct']} % at 10 s  (goal < 1 % at 1 s)")  # fmt: skip
    print(
        f"peak RSS {figures['peak_rss_mb']} MB (growth during the run {figures['rss_growth_mb']} MB; goal < 80 MB)"
    )
    print(json.dumps({"bench": "agent", **figures}))
    return 0

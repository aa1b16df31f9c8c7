"""Agent overhead: CPU seconds per 1,000 ticks and peak RSS of the agent's NVML source, each
tick ``NvmlSource.collect`` (every catalogue field NVML gives, GPM metrics, NVLink counters)
and its messages encoded to wire bytes as the sink would. The interval only matters for the
share of a core: CPU per tick / interval.

- **The fake NVML** (pynvml's own structs and errors, ``tests/fake_nvml.py``): 8 GPUs, every
  field, GPM, 18 NVLink links each (an H100 SXM). Its NVML calls cost nothing, so this is the
  agent's own work: reading, validating, building and encoding the messages.
- **The real NVML**, where this machine has an NVIDIA driver and GPUs (``--nvml auto``, the
  default, or ``real``): the same source on pynvml, with the driver's time per call, and beside
  it in the same run the fake shaped as the real GPUs (as many, as many with GPM and as many with
  NVLink; MIG instances are not mirrored: the real run reports its count) as its baseline
  (``ratio_*_real_vs_fake``). Where NVML does not start, sees no GPU or fails while measured,
  ``auto`` says why and reports the fake alone; ``real`` exits 2 with the reason.

Each measurement runs in a child process of its own (``bench.child``: its own peak RSS, its
``VmHWM``, and a bound on its time); ``--only fake|real`` is that child.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from bench.args import count
from bench.child import peak_rss_mb, run_child
from gpuslo.wire import encode

FAKE_GPUS, FAKE_LINKS = 8, 18  # the standing figure: an 8-GPU H100 SXM node
MAX_GPUS = 1024  # the most a fake (or a baseline shaped as a real node) is given
MAX_TICKS = 100_000  # about 6 minutes of the fake's 8 GPUs: inside a child's bound
CHILD_TIMEOUT_S = 600.0


def _fake_source(gpus: int, gpm_gpus: int, nvlink_gpus: int) -> tuple[Any, list[Any]]:
    import pynvml

    from gpuslo.agent.nvml import NvmlSource
    from tests.fake_nvml import FakeGpu, FakeNvml

    pct = {pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 70.0, pynvml.NVML_GPM_METRIC_SM_UTIL: 60.0,
           pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 30.0, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 40.0,
           pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 20.0, pynvml.NVML_GPM_METRIC_FP16_UTIL: 10.0}  # fmt: skip
    fakes = [
        FakeGpu(f"GPU-{i}", gpm=i < gpm_gpus, gpm_pct=pct, nvlink_links=FAKE_LINKS if i < nvlink_gpus else 0)
        for i in range(gpus)
    ]
    return NvmlSource("bench-node", "bench", 1.0, nvml=FakeNvml(fakes), boot_id="bench"), fakes


def measure(kind: str, ticks: int, gpus: int, gpm_gpus: int, nvlink_gpus: int) -> dict[str, Any]:
    """``ticks`` collections back to back on one source, after a first one not counted (it
    sets the counters that rates are taken from): CPU of the process, its own peak RSS
    (``VmHWM``: not the parent's), bytes sent. The fake has ``gpus`` GPUs, the first
    ``gpm_gpus`` with GPM and the first ``nvlink_gpus`` with 18 NVLink links; the real NVML has
    what it has (one that starts but sees no GPU is reported unavailable)."""
    if kind == "real":
        from gpuslo.agent.nvml import NvmlSource

        try:
            src = NvmlSource("bench-node", "bench", 1.0, boot_id="bench")
        except Exception as exc:  # no driver, no GPU, no permission: NVML says which
            return {"kind": "real", "unavailable": f"NVML did not start ({type(exc).__name__}: {exc})"}
        if not src.gpus:
            src.close()
            return {"kind": "real", "unavailable": f"NVML (driver {src.driver}) started but sees no GPU"}
        fakes: list[Any] = []
        clock = time.time
    else:
        src, fakes = _fake_source(gpus, gpm_gpus, nvlink_gpus)
        t0 = 1_790_000_000.0
        clock = iter(t0 + k for k in range(ticks + 1)).__next__
    try:
        src.collect(clock())
        rss0 = peak_rss_mb()
        c0, w0 = time.process_time(), time.perf_counter()
        nbytes = 0
        for _ in range(ticks):
            for g in fakes:  # the fake's NVLink counters move, so every tick computes rates
                g.nvlink_tx_kib += 1000
                g.nvlink_rx_kib += 800
                g.nvlink_ts_us += 1_000_000
            for m in src.collect(clock()):
                nbytes += len(encode(m))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        rss = peak_rss_mb()
        return {
            "kind": kind,
            "gpus": len(src.gpus),
            "models": sorted({g.model for g in src.gpus}),
            "driver": str(src.driver),
            "gpm_gpus": sum(bool(g.gpm) for g in src.gpus),
            "nvlink_gpus": sum("nvlink" not in g.unsupported for g in src.gpus),
            "mig_instances": sum(len(g.instances) for g in src.gpus),
            "unsupported": src.stats.unsupported,
            "errors": src.stats.errors,
            "ticks": ticks,
            "wall_s": round(wall, 3),
            "cpu_s_per_1000_ticks": round(cpu / ticks * 1000, 3),
            "peak_rss_mb": round(rss, 1),
            "rss_growth_mb": round(rss - rss0, 1),
            "bytes_per_tick": round(nbytes / ticks),
        }
    finally:
        src.close()


def _child(
    kind: str, ticks: int, gpus: int = FAKE_GPUS, gpm_gpus: int = FAKE_GPUS, nvlink_gpus: int = FAKE_GPUS
) -> dict[str, Any]:
    """One measurement in a child process. The real NVML's failing there (a GPU lost, a driver
    fault: the child's last words) is reported as unavailable; the fake's ends the run."""
    args = ["agent", "--only", kind, "--ticks", str(ticks), "--gpus", str(gpus),
            "--gpm-gpus", str(gpm_gpus), "--nvlink-gpus", str(nvlink_gpus)]  # fmt: skip
    got, why = run_child("bench", args, CHILD_TIMEOUT_S)
    if got is None:
        if kind == "real":
            return {"kind": "real", "unavailable": f"the measurement failed: {why}"}
        raise SystemExit(f"bench agent: the {kind} NVML measurement failed: {why}")
    return got


def _say(label: str, f: dict[str, Any]) -> None:
    share = f["cpu_s_per_1000_ticks"] / 1000 * 100  # % of a core at a 1 s interval
    print(f"{label}: {f['gpus']} GPUs ({', '.join(f['models'])}; GPM on {f['gpm_gpus']}, NVLink on "
          f"{f['nvlink_gpus']}, {f['mig_instances']} MIG instances), driver {f['driver']}")  # fmt: skip
    print(f"  {f['ticks']} ticks in {f['wall_s']:.2f} s wall; CPU per 1000 ticks {f['cpu_s_per_1000_ticks']} s "
          f"→ {share:.3f} % of a core at 1 s, {share / 10:.4f} % at 10 s (goal < 1 % at 1 s)")  # fmt: skip
    print(f"  peak RSS {f['peak_rss_mb']} MB (growth during the run {f['rss_growth_mb']} MB; goal < 80 MB); "
          f"{f['bytes_per_tick']} bytes a tick; NVML fields unsupported {f['unsupported']}, errors {f['errors']}")  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench agent")
    ap.add_argument("--ticks", type=count(1, MAX_TICKS), default=3000, help="ticks measured per source")
    ap.add_argument("--nvml", choices=("auto", "real", "fake"), default="auto",
                    help="auto: the real NVML beside the fake where it starts; real: fail without it")  # fmt: skip
    ap.add_argument("--only", choices=("real", "fake"), help=argparse.SUPPRESS)  # a child's measurement
    shape = ("--gpus", "--gpm-gpus", "--nvlink-gpus")  # the fake's, in a child
    ap.add_argument(shape[0], type=count(1, MAX_GPUS), default=FAKE_GPUS, help=argparse.SUPPRESS)
    ap.add_argument(shape[1], type=count(0, MAX_GPUS), default=FAKE_GPUS, help=argparse.SUPPRESS)
    ap.add_argument(shape[2], type=count(0, MAX_GPUS), default=FAKE_GPUS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.only:
        print(
            json.dumps(measure(a.only, a.ticks, a.gpus, min(a.gpm_gpus, a.gpus), min(a.nvlink_gpus, a.gpus)))
        )
        return 0
    if any(arg.split("=")[0] in shape for arg in argv):
        ap.error(f"{', '.join(shape)} shape a child's fake (with --only)")

    fake = _child("fake", a.ticks)
    _say(f"fake NVML ({FAKE_GPUS} GPUs, every field, GPM, {FAKE_LINKS} NVLink links each)", fake)
    out: dict[str, Any] = {"bench": "agent"} | {
        k: fake[k]
        for k in ("gpus", "ticks", "cpu_s_per_1000_ticks", "peak_rss_mb", "rss_growth_mb", "bytes_per_tick")
    }
    out["core_share_at_1s_pct"] = round(fake["cpu_s_per_1000_ticks"] / 10, 3)
    out["core_share_at_10s_pct"] = round(fake["cpu_s_per_1000_ticks"] / 100, 4)
    if a.nvml == "fake":
        out["real_nvml"] = "not asked (--nvml fake)"
    else:
        real = _child("real", a.ticks)
        if "unavailable" in real:
            why = real["unavailable"]
            print(f"real NVML: not measured ({why})")
            if a.nvml == "real":
                print(f"bench agent: --nvml real: not measured ({why})", file=sys.stderr)
                return 2
            out["real_nvml"] = f"unavailable: {why}"
        else:
            _say("real NVML", real)
            same = _child("fake", a.ticks, real["gpus"], real["gpm_gpus"], real["nvlink_gpus"])
            _say(f"fake NVML shaped as the real GPUs (GPM on {real['gpm_gpus']}, NVLink on {real['nvlink_gpus']} "
                 f"with {FAKE_LINKS} links each, no MIG)", same)  # fmt: skip
            out["real_nvml"] = "measured"
            out |= {f"real_{k}": real[k] for k in ("gpus", "models", "driver", "gpm_gpus", "nvlink_gpus",
                                                    "mig_instances", "unsupported", "errors", "cpu_s_per_1000_ticks",
                                                    "peak_rss_mb", "rss_growth_mb", "bytes_per_tick")}  # fmt: skip
            out["fake_same_gpus_cpu_s_per_1000_ticks"] = same["cpu_s_per_1000_ticks"]
            out["fake_same_gpus_peak_rss_mb"] = same["peak_rss_mb"]
            for key, name in (("cpu_s_per_1000_ticks", "cpu"), ("peak_rss_mb", "rss")):
                if same[key] > 0:
                    out[f"ratio_{name}_real_vs_fake"] = round(real[key] / same[key], 3)
            print(f"real / fake shaped alike: CPU {out.get('ratio_cpu_real_vs_fake', 'n/a')}x, "
                  f"peak RSS {out.get('ratio_rss_real_vs_fake', 'n/a')}x")  # fmt: skip
    print(json.dumps(out))
    return 0

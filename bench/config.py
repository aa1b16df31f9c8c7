"""Rules config load time against its size: configs of growing numbers of SLOs, each loaded
from a file with ``rules.config.load`` (read, UTF-8 check, YAML, validation, burn windows).

The cost per SLO must stay flat as the file grows (linear load); the last column is the
cost per SLO relative to the smallest size. A 14 MB config once took 74 s: the burn-window
file was parsed again for every SLO, the duplicate-name check was quadratic, and PyYAML's
pure-Python parser ran with the cycle collector scanning millions of new objects."""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from gpuslo.rules.config import load


def config_text(n: int) -> str:
    lines = ["slos:"] + [
        f"  - {{name: slo-{i}, service: svc-{i % 97}, objective: 0.99, threshold_ms: 5, "
        f"buckets_ms: [1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000], period_d: {(7, 28, 30, 90)[i % 4]}}}"
        for i in range(n)
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench config", description=__doc__)
    ap.add_argument("--sizes", default="2000,8000,32000", help="numbers of SLOs, comma-separated")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    print(f"python {platform.python_version()} on {platform.machine()}")
    print(f"{'SLOs':>8} {'MB':>7} {'load s':>8} {'µs/SLO':>8} {'vs first':>8}")
    first = None
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in sizes:
            p = Path(d) / f"rules-{n}.yaml"
            p.write_text(config_text(n))
            t = time.perf_counter()
            cfg = load(p)
            s = time.perf_counter() - t
            assert len(cfg.slos) == n
            per = s / n * 1e6
            first = first or per
            mb = p.stat().st_size / 1e6
            print(f"{n:>8} {mb:>7.2f} {s:>8.2f} {per:>8.1f} {per / first:>8.2f}")
            rows.append({"slos": n, "mb": round(mb, 3), "load_s": round(s, 3), "us_per_slo": round(per, 1)})
    print(json.dumps({"bench": "config", "sizes": rows}))
    return 0

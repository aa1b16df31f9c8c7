"""The part format of ``gpu_samples`` against what it costs: the inserts and the merges after them.

The same simulated GPU rows (``bench ingest``'s fleet) go into chDB, into twins of ``gpu_samples``
that differ only in ``min_bytes_for_wide_part``: the schema's (``GPU_SAMPLES_PART_SETTING``) and
gpuslo's former one (``FORMER_PART_SETTINGS``, Compact up to 256 MiB). For each insert size
(``--insert-rows``, one insert per that many rows, as the ingest's batches), after one round not
counted (a size's first round is slower whatever its setting), in ``--repeat`` rounds of each,
each repeat starting with the other setting: the seconds of the inserts, then the CPU of the background merges they
set off (chDB's MergeMutate threads, Linux /proc) from the first insert until no merge has run for
``--quiet-s``, bounded by ``--stall-s`` (exit 3 past it), and the part types left. The merges are
work a running ingest pays as surely as its inserts: a table in a steady state merges what it was
given. Each figure of the schema's setting is also a ratio to the former's in the same run.
A round whose table does not hold every row it was given is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from bench.args import count, counts, number
from bench.ingest import cpu_between, make_batches, prepared_chunks, thread_cpu
from gpuslo.ingest.schema import FORMER_PART_SETTINGS, GPU_SAMPLES_PART_SETTING
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.tables import SCHEMA

TWIN = "bench_parts"
# every round's inserts together, at most: a run stays within the machine's evening
MAX_INSERTS = 20_000


def settings() -> dict[str, str]:
    """The two part settings compared, by name in the report."""
    return {"former": FORMER_PART_SETTINGS[0], "schema": GPU_SAMPLES_PART_SETTING}


def merges_quiet(store: ChdbStore, quiet_s: float, stall_s: float) -> float:
    """Wait until no merge of the twin has run for ``quiet_s``; returns the seconds waited. Past
    ``stall_s`` the benchmark stops (exit 3): a merge that never ends is not a figure."""
    t0 = time.monotonic()
    calm_since: float | None = None
    while True:
        now = time.monotonic()
        if now - t0 > stall_s:
            print(f"bench parts: the merges still ran after {stall_s:g} s", file=sys.stderr)
            raise SystemExit(3)
        busy = store.query(f"SELECT count() AS n FROM system.merges WHERE table = '{TWIN}'")[0]["n"]
        if busy:
            calm_since = None
        elif calm_since is None:
            calm_since = now
        elif now - calm_since >= quiet_s:
            return now - t0
        time.sleep(0.05)


def one_round(
    store: ChdbStore, chunks: list[pa.Table], setting: str, quiet_s: float, stall_s: float
) -> dict[str, float]:
    """The chunks into a fresh twin with ``setting``: insert seconds, merge CPU, parts left."""
    store.execute(f"DROP TABLE IF EXISTS {TWIN}")
    store.execute(f"CREATE TABLE {TWIN} AS gpu_samples")
    store.execute(f"ALTER TABLE {TWIN} MODIFY SETTING {setting}")
    merges_quiet(store, quiet_s, stall_s)  # nothing of the round before runs in this one's counters
    c0 = thread_cpu()
    t0 = time.perf_counter()
    for c in chunks:
        store.insert(TWIN, c)
    insert_s = time.perf_counter() - t0
    merges_quiet(store, quiet_s, stall_s)
    cpu = cpu_between(c0, thread_cpu())
    rows = sum(c.num_rows for c in chunks)
    stored = store.query(f"SELECT count() AS n FROM {TWIN}")[0]["n"]  # not FINAL: every row written
    if stored != rows:
        print(f"bench parts: IMPOSSIBLE FIGURE: {stored} rows stored of {rows}", file=sys.stderr)
        raise SystemExit(2)
    parts = store.query(
        f"SELECT part_type AS t, count() AS n FROM system.parts WHERE table = '{TWIN}' AND active GROUP BY t"
    )
    return {
        "insert_s": insert_s,
        "merge_cpu_s": cpu.get("MergeMutate", float("nan")),
        "cpu_s": sum(cpu.values()) if cpu else float("nan"),
        **{f"parts_{p['t'].lower()}": float(p["n"]) for p in parts},
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench parts")
    ap.add_argument("--batches", type=count(8, 1_000_000), default=80_000, help="node batches (8 GPUs each)")
    ap.add_argument("--insert-rows", type=counts(8, 10_000_000, 8), default=[36_000, 180_000],
                    help="distinct GPU rows per insert, comma-separated (each size a run of its own)")  # fmt: skip
    ap.add_argument("--repeat", type=count(1, 20), default=2, help="rounds of each setting, alternated")
    ap.add_argument(
        "--quiet-s", type=number(0, 60), default=3.0, help="merges are done after this long without one"
    )
    ap.add_argument("--stall-s", type=number(0, 3600), default=300.0, help="give up waiting for the merges")
    a = ap.parse_args(argv)
    sizes: list[int] = a.insert_rows
    if a.quiet_s >= a.stall_s:
        ap.error(f"--quiet-s ({a.quiet_s:g}) must be shorter than --stall-s ({a.stall_s:g})")
    inserts = sum(-(-a.batches * 8 // size) for size in sizes) * (2 * a.repeat + 1)
    if inserts > MAX_INSERTS:
        ap.error(f"{inserts:,} inserts in all (--batches x 8 / --insert-rows, 2 x --repeat + 1 rounds): "
                 f"at most {MAX_INSERTS:,} (fewer batches or more rows per insert)")  # fmt: skip
    if not Path("/proc/self/task").is_dir():
        ap.error("this benchmark reads the merges' CPU from Linux's /proc")

    batches = make_batches(a.batches)
    rows = sum(len(b.gpus) for b in batches)
    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-parts-"))
    store = ChdbStore(work / "store")
    out: dict[str, float | int | str] = {"bench": "parts", "gpu_rows": rows}
    try:
        store.migrate(SCHEMA)
        named = settings()
        print(f"{rows:,} GPU rows; part settings: " + "; ".join(f"{k}: {v}" for k, v in named.items()))
        for size in sizes:
            chunks = prepared_chunks(store, batches, max(1, size // 8))
            got: dict[str, list[dict[str, float]]] = {k: [] for k in named}
            # a first round of each size is slower whatever its setting (the attack: 1.5x): one
            # not counted, then each repeat in turn starts with the other setting
            one_round(store, chunks, named["former"], a.quiet_s, a.stall_s)
            for rep in range(a.repeat):
                for name in list(named)[:: 1 if rep % 2 else -1]:
                    got[name].append(one_round(store, chunks, named[name], a.quiet_s, a.stall_s))
            print(f"--- {len(chunks)} inserts of up to {size:,} rows (after a round not counted: median of "
                  f"{a.repeat}, the settings in turn first; inserts: best)")  # fmt: skip
            for name, rounds in got.items():
                f = {
                    "insert_s": min(r["insert_s"] for r in rounds),
                    "merge_cpu_s": statistics.median(r["merge_cpu_s"] for r in rounds),
                    "cpu_s": statistics.median(r["cpu_s"] for r in rounds),
                }
                kinds = sorted({k for r in rounds for k in r if k.startswith("parts_")})
                left = ", ".join(f"{k[6:]} {statistics.median(r.get(k, 0) for r in rounds):g}" for k in kinds)
                print(f"  {name:7s} inserts {f['insert_s']:.3f} s   merges {f['merge_cpu_s']:.2f} s CPU   "
                      f"all {f['cpu_s']:.2f} s CPU   parts left: {left}")  # fmt: skip
                out |= {f"{k}_{name}_{size}": round(v, 3) for k, v in f.items()}
            for k in ("insert_s", "merge_cpu_s", "cpu_s"):
                former = float(out[f"{k}_former_{size}"])
                if former > 0:
                    out[f"ratio_{k}_schema_vs_former_{size}"] = round(
                        float(out[f"{k}_schema_{size}"]) / former, 3
                    )
            said = {k: out.get(f"ratio_{k}_schema_vs_former_{size}", "n/a (no CPU under the former)")
                    for k in ("insert_s", "merge_cpu_s", "cpu_s")}  # fmt: skip
            print(f"  schema / former: inserts {said['insert_s']}, merge CPU {said['merge_cpu_s']}, "
                  f"all CPU {said['cpu_s']}")  # fmt: skip
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))
    return 0

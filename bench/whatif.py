"""The what-if replay at scale: a month of a 1,000-GPU fleet's queue per policy.

A synthetic fleet and queue, seeded: GPUS / 8 nodes of 8 GPUs in two partitions (every 20th node
drained for 6 hours once), REQUESTS requests over DAYS days (Poisson arrivals; 60 % one node of
1, 2 or 4 GPUs, 30 % a whole node, 10 % 2 or 4 whole nodes; log-normal run times, median 2.1 h,
offered load about 90 % of the capacity; a partition named, or none; 10 accounts, 4 queues).
Timed, each in its own process (so that its peak RSS is its own and a run that would not end is
stopped at --timeout-s): the replay of every policy, its metrics (rules/whatif_metrics.py), and
the recorded schedule (the back-fill+gang schedule taken as the record). With --load, the
queue's scheduler events and the fleet's samples (every --sample-s) are written into chDB (not
timed) and loading them back (rules/whatif_load.py) is timed on its own.

    python -m bench whatif [--gpus 1000] [--days 30] [--requests 30000] [--load] [--sample-s 600]

Readable lines, then one JSON line: ``seconds_<policy>`` (replay, wall), ``cpu_seconds_<policy>``
(its CPU time: the figure to read on a shared machine), ``seconds_metrics_<policy>``,
``started_<policy>``, ``cur_<policy>``, ``peak_rss_mb_<policy>``, ``seconds_load``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.args import count, number, policies
from bench.child import peak_rss_mb, run_child
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.whatif import RECORDED, Capacity, Node, Request, parse_policy, replay
from gpuslo.rules.whatif_metrics import summarise

START = 1_795_824_000.0  # a midnight UTC
DAY_S = 86_400.0
GPUS_PER_NODE = 8
POLICIES = ("fifo", "first-fit", "backfill", "fairshare", "backfill+gang", "backfill+gang:spread", "recorded")


def fleet(gpus: int, days: float, seed: int) -> Capacity:
    rnd = random.Random(seed)
    to = START + days * DAY_S
    nodes = []
    for i in range(max(1, gpus // GPUS_PER_NODE)):
        spans: tuple[tuple[float, float, float], ...] = ((START, to, float(GPUS_PER_NODE)),)
        if i % 20 == 7:  # drained for 6 hours once
            d0 = START + rnd.uniform(0, max(0.0, days * DAY_S - 6 * 3600))
            spans = tuple(s for s in ((START, d0, 8.0), (d0 + 6 * 3600, to, 8.0)) if s[1] > s[0])
        nodes.append(Node(f"node-{i:04d}", "a" if i % 2 == 0 else "b", spans, "H100"))
    return Capacity(START, to, tuple(nodes))


def queue(requests: int, days: float, seed: int, gpus: int) -> list[Request]:
    rnd = random.Random(seed + 1)
    span = days * DAY_S
    scale = gpus / 1000 * 30_000 / max(requests, 1) * days / 30  # keep the offered load near 90 %
    t = START
    out = []
    for k in range(requests):
        t += rnd.expovariate(requests / span)
        u = rnd.random()
        if u < 0.6:
            nodes, g = 1, float(rnd.choice((1, 2, 4)))
        elif u < 0.9:
            nodes, g = 1, 8.0
        else:
            nodes, g = rnd.choice((2, 4)), 8.0
        run = min(3 * DAY_S, rnd.lognormvariate(math.log(7600 * scale), 1.0))
        out.append(
            Request(
                request_id=str(k),
                scheduler="slurm",
                cluster="bench",
                queue=f"q{k % 4}",
                account=f"acct{rnd.randrange(10)}",
                user=f"u{rnd.randrange(40)}",
                submit=round(t, 3),
                nodes=nodes,
                gpus_per_node=g,
                run_s=round(run, 3),
                pool=rnd.choice(("a", "b", "")),
            )
        )
    return out


def _with_record(reqs: list[Request], cap: Capacity) -> list[Request]:
    """The back-fill+gang schedule as the record (recorded starts and nodes)."""
    rep = replay(reqs, cap, parse_policy("backfill+gang"))
    by = {o.request.request_id: o for o in rep.outcomes}
    out = []
    for r in reqs:
        o = by.get(r.request_id)
        if o is not None and o.start is not None:
            r = dataclasses.replace(r, recorded_start=o.start, recorded_nodes=o.nodes)
        out.append(r)
    return out


def _child_policy(a: argparse.Namespace) -> dict[str, Any]:
    cap = fleet(a.gpus, a.days, a.seed)
    reqs = queue(a.requests, a.days, a.seed, a.gpus)
    cfg = RulesConfig()
    if a.child_policy == "recorded":
        reqs = _with_record(reqs, cap)
        pol = RECORDED
    else:
        pol = parse_policy(a.child_policy)
    t0, c0 = time.perf_counter(), time.process_time()
    rep = replay(reqs, cap, pol, cfg)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    t1 = time.perf_counter()
    s = summarise(rep, cfg.whatif.fairshare)
    msecs = time.perf_counter() - t1
    return {"seconds": secs, "cpu_seconds": cpu, "seconds_metrics": msecs, "started": s["started"], "requests": s["requests"],
            "cur": s["cur_allocation"], "wait_p50_s": s["wait_p50_s"], "wait_p99_s": s["wait_p99_s"],
            "incidents": s["starvation_incidents"], "peak_rss_mb": peak_rss_mb()}  # fmt: skip


def _write_store(path: str, a: argparse.Namespace) -> dict[str, Any]:
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules.tables import SCHEMA

    cap = fleet(a.gpus, a.days, a.seed)
    reqs = _with_record(queue(a.requests, a.days, a.seed, a.gpus), cap)
    store = ChdbStore(path)
    try:
        store.migrate(SCHEMA)
        for mv in ("gpu_samples_dirty_mv", "node_heartbeats_dirty_mv"):
            store.execute(f"DROP VIEW IF EXISTS {mv}")
        cols: dict[str, list[Any]] = {k: [] for k in ("cluster", "scheduler", "event", "request_id", "ts", "name",
                                                      "user", "account", "queue", "pool", "gpus_per_node", "nodes",
                                                      "reason", "assigned_nodes", "source", "boot_id", "seq")}  # fmt: skip
        seq = 0
        for r in reqs:
            evs: list[tuple[str, float, tuple[str, ...]]] = [("submit", r.submit, ())]
            if r.recorded_start is not None:
                evs.append(("start", r.recorded_start, r.recorded_nodes))
                if r.recorded_start + r.run_s < cap.to:
                    evs.append(("end", r.recorded_start + r.run_s, ()))
            for ev, ts, nodes in evs:
                seq += 1
                for k, v in (("cluster", "bench"), ("scheduler", "slurm"), ("event", ev), ("request_id", r.request_id),
                             ("ts", ts), ("name", "job"), ("user", r.user), ("account", r.account),
                             ("queue", r.queue), ("pool", r.pool), ("gpus_per_node", r.gpus_per_node),
                             ("nodes", r.nodes), ("reason", ""), ("assigned_nodes", list(nodes)),
                             ("source", "collector"), ("boot_id", "b"), ("seq", seq)):  # fmt: skip
                    cols[k].append(v)
        store.insert("sched_events", cols)
        ticks = int(a.days * DAY_S // a.sample_s)
        n = len(cap.nodes)
        store.execute(
            f"""
            INSERT INTO gpu_samples (cluster, node, pool, gpu, uuid, model, ts, interval_s, healthy, activity,
                alloc_share, source, boot_id, seq)
            SELECT 'bench', concat('node-', leftPad(toString(nd), 4, '0')), if(nd % 2 = 0, 'a', 'b'), g,
                concat('GPU-', toString(nd), '-', toString(g)), 'H100',
                toDateTime64({START} + k * {a.sample_s}, 3, 'UTC'), {a.sample_s}, 1, 0.5, 0,
                concat('node-', toString(nd)), 'b', k
            FROM
            (
                SELECT intDiv(number, {GPUS_PER_NODE} * {n}) AS k, intDiv(number, {GPUS_PER_NODE}) % {n} AS nd,
                    number % {GPUS_PER_NODE} AS g
                FROM numbers({ticks * n * GPUS_PER_NODE})
            )
            """
        )
        rows = {
            t: int(store.query(f"SELECT count() AS n FROM {t}")[0]["n"])
            for t in ("gpu_samples", "sched_events")
        }
    finally:
        store.close()
    return rows


def _child_load(a: argparse.Namespace) -> dict[str, Any]:
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules.whatif import load

    store = ChdbStore(a.store)
    try:
        t0 = time.perf_counter()
        win = load(store, START, START + a.days * DAY_S, "", RulesConfig())
        secs = time.perf_counter() - t0
    finally:
        store.close()
    spans = sum(len(n.spans) for n in win.capacity.nodes)
    return {"seconds": secs, "requests": len(win.requests), "nodes": len(win.capacity.nodes), "spans": spans,
            "peak_rss_mb": peak_rss_mb()}  # fmt: skip


def _run(args: list[str], timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    return run_child("bench.whatif", args, timeout_s)


def _key(policy: str) -> str:
    return policy.replace("+", "_").replace(":", "_").replace("-", "_")


def _measure(a: argparse.Namespace) -> dict[str, Any]:
    base = [
        "--gpus",
        str(a.gpus),
        "--days",
        str(a.days),
        "--requests",
        str(a.requests),
        "--seed",
        str(a.seed),
    ]
    fig: dict[str, Any] = {"bench": "whatif", "gpus": a.gpus, "nodes": max(1, a.gpus // GPUS_PER_NODE),
                           "days": a.days, "requests": a.requests, "cpus": os.cpu_count(),
                           "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}  # fmt: skip
    print(f"what-if replay: {fig['nodes']:,} nodes x {GPUS_PER_NODE} GPUs, {a.requests:,} requests over {a.days:g} days "
          f"(load average {fig['load_avg_1m_at_start']} on {fig['cpus']} CPUs)")  # fmt: skip
    for p in a.policies:
        got, why = _run([*base, "--child-policy", p], a.timeout_s)
        k = _key(p)
        if got is None:
            print(f"  {p:24s} {why}")
            fig[f"seconds_{k}"] = None
            fig[f"error_{k}"] = why
            continue
        fig[f"seconds_{k}"] = round(got["seconds"], 3)
        fig[f"cpu_seconds_{k}"] = round(got["cpu_seconds"], 3)
        fig[f"seconds_metrics_{k}"] = round(got["seconds_metrics"], 3)
        fig[f"started_{k}"] = got["started"]
        fig["requests_in_window"] = got["requests"]
        fig[f"cur_{k}"] = None if got["cur"] is None else round(got["cur"], 4)
        fig[f"peak_rss_mb_{k}"] = round(got["peak_rss_mb"], 1)
        print(f"  {p:24s} replay {got['seconds']:6.2f} s ({got['cpu_seconds']:.2f} s CPU), metrics {got['seconds_metrics']:5.2f} s; "
              f"{got['started']:,} of {got['requests']:,} started, CUR {100 * (got['cur'] or 0):.1f} %, "
              f"wait p50 {got['wait_p50_s'] or 0:.0f} s p99 {got['wait_p99_s'] or 0:.0f} s, "
              f"{got['incidents']:,} incidents; peak RSS {got['peak_rss_mb']:.0f} MB")  # fmt: skip
    if a.load:
        work = Path(tempfile.mkdtemp(prefix="bench-whatif-"))
        try:
            store = str(work / "store")
            gen, why = _run(
                [*base, "--store", store, "--child-write", "--sample-s", str(a.sample_s)], a.timeout_s * 4
            )
            if gen is None:
                print(f"  load: store not written ({why})")
                fig["error_load"] = why
            else:
                got, why = _run([*base, "--store", store, "--child-load"], a.timeout_s)
                if got is None:
                    print(f"  load: {why}")
                    fig["error_load"] = why
                else:
                    fig.update(seconds_load=round(got["seconds"], 3), load_sample_rows=gen["gpu_samples"],
                               load_event_rows=gen["sched_events"], load_requests=got["requests"],
                               load_spans=got["spans"], peak_rss_mb_load=round(got["peak_rss_mb"], 1))  # fmt: skip
                    print(f"  load from chDB: {got['seconds']:.2f} s for {gen['gpu_samples']:,} sample rows "
                          f"(every {a.sample_s:g} s) and {gen['sched_events']:,} events: {got['requests']:,} "
                          f"requests, {got['nodes']} nodes in {got['spans']} spans")  # fmt: skip
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return fig


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench whatif", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=count(1, 1_000_000), default=1000)
    p.add_argument("--days", type=number(0, 400), default=30.0)
    p.add_argument("--requests", type=count(1, 10_000_000), default=30_000)
    p.add_argument("--seed", type=count(0, 2**32), default=1)
    p.add_argument("--policies", type=policies, default=list(POLICIES))
    p.add_argument("--timeout-s", type=number(0, 86_400), default=120.0, help="per child process")
    p.add_argument("--load", action="store_true", help="also time loading the window from chDB")
    p.add_argument(
        "--sample-s",
        type=number(0.999, 86_400),
        default=600.0,
        help="sample interval of the store --load writes",
    )
    p.add_argument("--child-policy", help=argparse.SUPPRESS)
    p.add_argument("--child-write", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child_policy:
        print(json.dumps(_child_policy(a)))
        return 0
    if a.child_write:
        print(json.dumps(_write_store(a.store, a)))
        return 0
    if a.child_load:
        print(json.dumps(_child_load(a)))
        return 0
    fig = _measure(a)
    print(json.dumps(fig, sort_keys=True))
    return 0 if all(not k.startswith("error_") for k in fig) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Encode+decode rate of one realistic node batch (8 GPUs, the fields the simulated
agent sends, allocations) for each candidate wire encoding.

Every candidate ends in a validated model: decoding includes the same pydantic
validation the ingest needs, because that is the real cost per message."""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import msgpack
import orjson
from pydantic import TypeAdapter

from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import SimNodeSource
from gpuslo.wire import GpuSampleBatch, Message, decode, encode

ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def realistic_batch() -> GpuSampleBatch:
    """The busiest node's batch of a simulated fleet an hour in (deterministic)."""
    cfg = SimConfig(nodes=4, gpus_per_node=8, hours=2, seed=1, start_ts=1_767_225_600.0)
    fleet = Fleet(cfg)
    t = cfg.start_ts + 3600
    fleet.advance_to(t)
    batches = [
        m
        for n in range(cfg.nodes)
        for m in SimNodeSource(fleet, n).collect(t)
        if isinstance(m, GpuSampleBatch)
    ]
    return max(batches, key=lambda b: sum(len(g.allocations) for g in b.gpus))


def best_of(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Seconds per call, best of ``repeat`` runs of ``n`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


Codec = tuple[Callable[[], bytes], Callable[[bytes], Any]]


def candidates(batch: GpuSampleBatch) -> dict[str, Codec]:
    """Each wire encoding as (encode, decode-and-validate); the chosen one first (the baseline)."""
    return {
        "json (pydantic-core, chosen)": (lambda: encode(batch), decode),
        "json (orjson + validate)": (
            lambda: orjson.dumps(batch.model_dump(mode="json")),
            lambda b: ADAPTER.validate_python(orjson.loads(b)),
        ),
        "msgpack (+ validate)": (
            lambda: msgpack.packb(batch.model_dump(mode="json")),
            lambda b: ADAPTER.validate_python(msgpack.unpackb(b)),
        ),
    }


def time_candidates(batch: GpuSampleBatch, n: int, repeat: int) -> dict[str, Any]:
    """Times every candidate, printing one table row each; the figures keyed by encoding."""
    figures: dict[str, Any] = {}
    base_rt: float | None = None
    print(
        f"{'encoding':32s} {'bytes':>7s} {'enc us':>8s} {'dec us':>8s} {'round trips/s':>14s} {'vs chosen':>9s}"
    )
    for name, (enc, dec) in candidates(batch).items():
        raw = enc()
        assert dec(raw) == batch, name
        e = best_of(enc, n, repeat)
        d = best_of(lambda: dec(raw), n, repeat)  # noqa: B023 - used inside the loop only
        rt = 1.0 / (e + d)
        if base_rt is None:
            base_rt = rt
        key = name.split(" ")[0] + ("_orjson" if "orjson" in name else "")
        figures[key] = {
            "bytes": len(raw),
            "encode_us": round(e * 1e6, 2),
            "decode_us": round(d * 1e6, 2),
            "round_trips_per_s": round(rt),
            "ratio_vs_chosen": round(rt / base_rt, 3),
        }
        print(f"{name:32s} {len(raw):7d} {e * 1e6:8.1f} {d * 1e6:8.1f} {rt:14,.0f} {rt / base_rt:9.2f}")
    return figures


def time_unvalidated(as_dict: dict[str, Any], n: int, repeat: int) -> dict[str, Any]:
    """The serialisers alone, without validation, for scale: what validation costs."""
    raw_json = orjson.dumps(as_dict)
    raw_mp = msgpack.packb(as_dict)
    oj = best_of(lambda: orjson.loads(orjson.dumps(as_dict)), n, repeat)
    mp = best_of(lambda: msgpack.unpackb(msgpack.packb(as_dict)), n, repeat)
    print(f"\nno validation, for scale: orjson round trip {oj * 1e6:.1f} us, msgpack {mp * 1e6:.1f} us")
    return {
        "orjson_round_trip_us": round(oj * 1e6, 2),
        "msgpack_round_trip_us": round(mp * 1e6, 2),
        "orjson_bytes": len(raw_json),
        "msgpack_bytes": len(raw_mp),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench encode")
    ap.add_argument("-n", type=int, default=2000, help="calls per timing run")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)

    batch = realistic_batch()
    gpus = len(batch.gpus)
    fields = sum(len(g.fields) for g in batch.gpus)
    print(
        f"batch: {gpus} GPUs, {fields} field values, {sum(len(g.allocations) for g in batch.gpus)} allocations"
    )
    print(f"python {platform.python_version()}, best of {a.repeat} x {a.n} calls\n")
    figures: dict[str, Any] = {"gpus": gpus, "field_values": fields}
    figures |= time_candidates(batch, a.n, a.repeat)
    figures["unvalidated"] = time_unvalidated(batch.model_dump(mode="json"), a.n, a.repeat)
    print(json.dumps({"bench": "encode", **figures}))
    return 0

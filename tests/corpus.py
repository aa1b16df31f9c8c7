"""A hostile-input corpus generated from the wire models' own JSON schema.

For every leaf of one message of every kind (every field, nested ones included), the edge
values of its type: the bounds the schema declares, one past them, 2^63 and 2^64, negative,
NaN and infinities, huge and control-character strings, wrong types and nulls; for every
list, its length at and past the bound. A new field or bound grows the corpus by itself.
The oracle is the model (``decode``): a message it accepts must land, any other must be a
dead letter with a reason.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

from pydantic import TypeAdapter

from gpuslo.wire import (
    Allocation,
    GpuSample,
    GpuSampleBatch,
    HealthEvent,
    LatencyDelta,
    Message,
    MigInstance,
    NodeHeartbeat,
    SchedulerEvent,
    encode,
)

_SCHEMA = TypeAdapter(Message).json_schema()
_DEFS = _SCHEMA["$defs"]
_BIG = 2**63


def base_messages(ts: float) -> list[Any]:
    """One message of every kind, with every optional part present (every field of every model:
    tests/test_writer_columns.py checks it, so a new field is in every test generated from these)."""
    env = {"source": "h", "boot_id": "b", "seq": 1, "cluster": "c", "ts": ts}
    gpu = GpuSample(
        index=1,
        uuid="GPU-1",
        model="m",
        fields={"DCGM_FI_DEV_GPU_UTIL": 50.0, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.5},
        allocations=(
            Allocation(
                scheduler="slurm",
                id="7",
                name="n",
                user="u",
                account="a",
                queue="q",
                share=0.5,
                activity_share=0.25,
                fb_share=0.5,
                share_source="measured",
            ),
        ),
        fraction=0.5,
        mig=MigInstance(gi=1, ci=0, profile="3g.40gb"),
    )
    return [
        GpuSampleBatch(**env, node="n", pool="p", interval_s=10.0, gpus=(gpu,)),
        NodeHeartbeat(**env, node="n", pool="p", interval_s=10.0, schedulable=True, state="idle", reason="r", gpus=8),
        SchedulerEvent(**env, scheduler="slurm", event="submit", request_id="7", name="n", user="u", account="a",
                       queue="q", pool="p", gpus_per_node=2.0, nodes=2, reason="r", assigned_nodes=("n1",),
                       cause="policy", cluster_queue="cq"),
        LatencyDelta(**env, service="s", interval_s=10.0, bounds_ms=(1.0, 5.0), counts=(1, 2, 3), sum_ms=9.0),
        HealthEvent(**env, node="n", gpu=1, uuid="GPU-1", event="xid", code=79, fatal=True, message="m"),
    ]  # fmt: skip


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while True:
        if "$ref" in node:
            node = _DEFS[node["$ref"].rsplit("/", 1)[1]]
        elif "anyOf" in node:
            node = next(n for n in node["anyOf"] if n.get("type") != "null")
        else:
            return node


def _leaves(
    node: dict[str, Any], obj: Any, path: tuple[Any, ...]
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    node = _resolve(node)
    if isinstance(obj, dict) and "properties" in node:
        for k, v in obj.items():
            yield from _leaves(node["properties"][k], v, (*path, k))
    elif isinstance(obj, dict):  # the DCGM fields: a map of numbers (bounds from the catalogue)
        for k, v in obj.items():
            yield from _leaves(node.get("additionalProperties", {"type": "number"}), v, (*path, k))
    elif isinstance(obj, list):
        yield path, node
        for i, v in enumerate(obj):
            yield from _leaves(node.get("items", {}), v, (*path, i))
    else:
        yield path, node


def edge_values(node: dict[str, Any], current: Any) -> list[Any]:
    t = node.get("type")
    wrong: list[Any] = [None, "1", True, [], {}]
    if t == "integer":
        lo, hi = node.get("minimum", -_BIG), node.get("maximum", 2**64)
        return [lo, hi, lo - 1, hi + 1, _BIG, 2**64, -1, 0, 1.5, float(hi), *wrong]
    if t == "number":
        lo = node.get("minimum", node.get("exclusiveMinimum", -1e308))
        hi = node.get("maximum", 1e308)
        return [
            lo,
            hi,
            lo - 1,
            hi * 10 + 1,
            -1.0,
            0,
            float("nan"),
            float("inf"),
            -float("inf"),
            1e308,
            *wrong,
        ]
    if t == "string":
        n = node.get("maxLength", 4096)
        return ["", "x" * n, "x" * (n + 1), "a\x00b\n'\\\"\u2028é", "y" * 100_000, 5, None, True]
    if t == "boolean":
        return ["yes", 1, 0, "true", None]
    if t == "array":
        n = node.get("maxItems")
        return [] if n is None else [current[:1] * n, current[:1] * (n + 1), None, "x", {}]
    return ["zzz", None, 1, True] if "enum" in node or "const" in node else [None]


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def hostile(ts: float) -> list[bytes]:
    """Every edge value of every leaf of every kind, one message each; ``seq`` and ``ts`` are
    unique per message (unless the leaf is one of them) and the source names the message."""
    out: list[bytes] = []
    for base in base_messages(ts):
        obj = json.loads(encode(base))
        node = _DEFS[type(base).__name__]
        for path, leaf in list(_leaves(node, obj, ())):
            cur = copy.deepcopy(obj)
            for p in path:
                cur = cur[p]
            for value in edge_values(leaf, cur):
                m = copy.deepcopy(obj)
                m["source"] = f"h{len(out)}"
                m["seq"] = 10**6 + len(out)
                m["ts"] = ts + len(out)  # a natural key of its own: the store replaces equal keys
                _set(m, path, value)
                out.append(json.dumps(m, separators=(",", ":"), allow_nan=True).encode())
    return out

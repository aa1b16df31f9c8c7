"""Packs (:mod:`gpuslo.wire.pack`) into the fast path's table: no parsing, the same checks.

A pack is read into a table of exactly :data:`ingest.fastpath.SCHEMA`, the table the JSON
fast path parses its messages into, so everything after (the checks of ``fastpath._valid``,
the columns of ``fastpath.columns``) is one code for both encodings. What the format itself
can get wrong (offsets out of order or past their data, invalid UTF-8, a count that does not
match its buffer, a byte that is not a boolean) makes the whole pack refused with a reason:
the values could not be trusted to mean anything. A batch whose *values* fail a check is
turned back into its JSON object (:func:`as_json`) and decided by the models, which say why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from gpuslo.ingest.fastpath import _ALLOCATION, _GPU, SCHEMA
from gpuslo.wire import pack as P
from gpuslo.wire.fields import FIELDS


class PackError(ValueError):
    """A pack refused whole; ``reason`` goes to its dead letter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Unpacked:
    table: pa.Table  # one row per batch, typed as fastpath.SCHEMA
    digest: list[int]  # per batch: the digest of its JSON (gpuslo.wire.pack.digest)


_DTYPES: dict[str, np.dtype[Any]] = {
    "q": np.dtype("<i8"), "Q": np.dtype("<u8"), "d": np.dtype("<f8"), "B": np.dtype("u1")
}  # fmt: skip


def _fixed(bufs: dict[str, memoryview], name: str, code: str, n: int) -> np.ndarray[Any, Any]:
    dt = _DTYPES[code]
    b = bufs[name]
    if len(b) != n * dt.itemsize:
        raise PackError(f"pack buffer {name}: {len(b)} bytes for {n} values of {dt.itemsize}")
    out: np.ndarray[Any, Any] = np.frombuffer(b, dtype=dt)
    return out


def _offsets(bufs: dict[str, memoryview], name: str, rows: int, end: int) -> np.ndarray[Any, Any]:
    b = bufs[name]
    if len(b) != (rows + 1) * 4:
        raise PackError(f"pack buffer {name}: {len(b)} bytes for {rows + 1} offsets")
    off = np.frombuffer(b, dtype="<i4")
    if off[0] != 0 or off[-1] != end or (rows and bool((np.diff(off) < 0).any())):
        raise PackError(f"pack buffer {name}: offsets must rise from 0 to {end}")
    return off


def _string(bufs: dict[str, memoryview], name: str, rows: int) -> pa.Array:
    data = bufs[f"{name}.data"]
    off = _offsets(bufs, f"{name}.off", rows, len(data))
    arr = pa.StringArray.from_buffers(rows, pa.py_buffer(off), pa.py_buffer(data))
    try:
        arr.validate(full=True)  # UTF-8
    except pa.ArrowInvalid as exc:
        raise PackError(f"pack column {name}: {str(exc).splitlines()[0][:200]}") from None
    return arr


def _bool(bufs: dict[str, memoryview], name: str, n: int) -> np.ndarray[Any, Any]:
    v = _fixed(bufs, name, "B", n)
    if (v > 1).any():
        raise PackError(f"pack column {name}: a byte other than 0 or 1")
    return v.astype(bool)


def _nan_null(v: np.ndarray[Any, Any]) -> pa.Array:
    """float64 with NaN as absent (JSON has no NaN: a NaN is never a value)."""
    nan = np.isnan(v)
    return pa.array(v, pa.float64(), mask=nan if nan.any() else None)


def unpack(value: bytes) -> Unpacked:
    """The batches of a pack, or :class:`PackError`."""
    try:
        h, bufs = P.read(value)
    except ValueError as exc:
        raise PackError(str(exc)) from None
    n, g, a = h["batches"], h["gpus"], h["allocs"]
    if n == 0:  # the agent never sends one; read as well formed it would vanish, counted nowhere
        raise PackError("a pack of no batches")
    fx = {name: _fixed(bufs, name, code, n) for name, code in P.BATCH_FIXED}
    gx = {name: _fixed(bufs, name, code, g) for name, code in P.GPU_FIXED if code != "B"}
    ax = {name: _fixed(bufs, name, code, a) for name, code in P.ALLOC_FIXED}
    gpus_off = _offsets(bufs, "gpus.off", n, g)
    allocs_off = _offsets(bufs, "allocs.off", g, a)
    have = set(h["fields"])
    values = [
        _nan_null(_fixed(bufs, f"field.{f.name}", "d", g)) if f.name in have else pa.nulls(g, pa.float64())
        for f in FIELDS
    ]
    allocation = pa.StructArray.from_arrays(
        [_string(bufs, s, a) for s in ("scheduler", "id", "name", "user", "account", "queue")]
        + [pa.array(ax["share"]), _nan_null(ax["activity_share"]), _nan_null(ax["fb_share"])]
        + [_string(bufs, "share_source", a)],
        fields=list(_ALLOCATION),
    )
    has_mig = _bool(bufs, "mig", g)
    mig_type = _GPU.field("mig").type
    mig = pa.StructArray.from_arrays(
        [pa.array(gx["mig_gi"]), pa.array(gx["mig_ci"]), _string(bufs, "mig_profile", g)],
        fields=list(mig_type),
        mask=pa.array(~has_mig),
    )
    gpu = pa.StructArray.from_arrays(
        [
            pa.array(gx["index"]),
            _string(bufs, "uuid", g),
            _string(bufs, "model", g),
            pa.array(_bool(bufs, "healthy", g)),
            pa.StructArray.from_arrays(values, fields=list(_GPU.field("fields").type)),
            pa.ListArray.from_arrays(pa.array(allocs_off), allocation),
            pa.array(gx["fraction"]),
            mig,
        ],
        fields=list(_GPU),
    )
    strings = {s: _string(bufs, s, n) for s in P.BATCH_STRINGS}
    table = pa.Table.from_arrays(
        [
            pa.array(fx["v"]),
            strings["source"],
            strings["boot_id"],
            pa.array(fx["seq"]),
            strings["cluster"],
            pa.array(fx["ts"]),
            pa.array(["gpu_samples"] * n, pa.string()),
            strings["node"],
            strings["pool"],
            pa.array(fx["interval_s"]),
            pa.ListArray.from_arrays(pa.array(gpus_off), gpu),
        ],
        schema=SCHEMA,
    )
    return Unpacked(table, fx["digest"].tolist())


def _drop_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


def as_json(table: pa.Table, row: int) -> bytes:
    """The JSON object of one batch of a pack: what the models decide, and what a dead letter
    keeps (absent values left out, as the agent's JSON leaves them out)."""
    obj = _drop_none(table.slice(row, 1).to_pylist()[0])
    for gpu in obj.get("gpus", []):
        gpu.setdefault("fields", {})
    return orjson.dumps(obj)

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
    if off[0] != 0 or off[-1] != end:
        raise PackError(f"pack buffer {name}: offsets must rise from 0 to {end}")
    return off  # that they rise in between is checked once for many packs (_cat_offsets)


def _bool(bufs: dict[str, memoryview], name: str, n: int) -> np.ndarray[Any, Any]:
    v = _fixed(bufs, name, "B", n)
    if (v > 1).any():
        raise PackError(f"pack column {name}: a byte other than 0 or 1")
    return v.astype(bool)


def _nan_null(v: np.ndarray[Any, Any]) -> pa.Array:
    """float64 with NaN as absent (JSON has no NaN: a NaN is never a value)."""
    nan = np.isnan(v)
    return pa.array(v, pa.float64(), mask=nan if nan.any() else None)


_ALLOC_STRINGS = P.ALLOC_STRINGS
_GPU_STRINGS = ("mig_profile", "uuid", "model")


@dataclass
class _Read:
    """One pack's buffers, every check of the format passed but two, made when its columns
    become Arrow, over many packs at once: its strings' UTF-8 and that its offsets rise between
    their ends (``_cat_offsets``)."""

    n: int
    g: int
    a: int
    fixed: dict[str, np.ndarray[Any, Any]]  # batch, GPU and allocation columns by name
    values: dict[str, np.ndarray[Any, Any]]  # the DCGM fields carried
    gpus_off: np.ndarray[Any, Any]
    allocs_off: np.ndarray[Any, Any]
    strings: dict[str, tuple[np.ndarray[Any, Any], memoryview]]  # offsets, data


def _read(value: bytes) -> _Read:
    try:
        h, bufs = P.read(value)
    except ValueError as exc:
        raise PackError(str(exc)) from None
    n, g, a = h["batches"], h["gpus"], h["allocs"]
    if n == 0:  # the agent never sends one; read as well formed it would vanish, counted nowhere
        raise PackError("a pack of no batches")
    fixed = {name: _fixed(bufs, name, code, n) for name, code in P.BATCH_FIXED}
    fixed |= {name: _fixed(bufs, name, code, g) for name, code in P.GPU_FIXED if code != "B"}
    fixed |= {name: _fixed(bufs, name, code, a) for name, code in P.ALLOC_FIXED}
    gpus_off = _offsets(bufs, "gpus.off", n, g)
    allocs_off = _offsets(bufs, "allocs.off", g, a)
    values = {f: _fixed(bufs, f"field.{f}", "d", g) for f in h["fields"]}
    strings: dict[str, tuple[np.ndarray[Any, Any], memoryview]] = {}

    def text(s: str, rows: int) -> None:
        data = bufs[f"{s}.data"]
        strings[s] = (_offsets(bufs, f"{s}.off", rows, len(data)), data)

    for s in _ALLOC_STRINGS:
        text(s, a)
    fixed["mig"] = _bool(bufs, "mig", g)
    for s in _GPU_STRINGS:
        text(s, g)
    fixed["healthy"] = _bool(bufs, "healthy", g)
    for s in P.BATCH_STRINGS:
        text(s, n)
    return _Read(n, g, a, fixed, values, gpus_off, allocs_off, strings)


def _cat(arrays: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _cat_offsets(offsets: list[np.ndarray[Any, Any]], name: str) -> np.ndarray[Any, Any]:
    """Offsets of consecutive parts (each from 0 to its part's end: ``_offsets``) as the offsets
    of their concatenation. Raises :class:`PackError` where they do not rise: checked here, once
    over the whole, as the parts' ends are checked (a part that falls somewhere makes the whole
    fall there, and the pack is then found by reading each alone, ``unpack_many``)."""
    if len(offsets) <= 1:
        out = offsets[0] if offsets else np.zeros(1, "<i4")
    else:  # each part shifted by the ends before it, into one int32 array (the caller keeps a
        # table's strings, and so its row counts, under 2^31)
        out = np.empty(sum(len(o) for o in offsets) - len(offsets) + 1, "<i4")
        at = base = 0
        for o in offsets:
            k = len(o) - 1
            np.add(o[:-1], base, out=out[at : at + k])
            at, base = at + k, base + int(o[-1])
        out[at] = base
    if len(out) > 2 and bool((out[1:] < out[:-1]).any()):
        raise PackError(f"pack buffer {name}: offsets must rise from 0 to {int(out[-1])}")
    return out


def _string(parts: list[_Read], name: str) -> pa.Array:
    off = _cat_offsets([p.strings[name][0] for p in parts], f"{name}.off")
    data = parts[0].strings[name][1] if len(parts) == 1 else b"".join(p.strings[name][1] for p in parts)
    arr = pa.StringArray.from_buffers(len(off) - 1, pa.py_buffer(off), pa.py_buffer(data))
    if _ascii(data):  # every slice of ASCII is UTF-8 (the offsets rise from 0 to its end)
        return arr
    try:
        arr.validate(full=True)  # UTF-8
    except pa.ArrowInvalid as exc:
        raise PackError(f"pack column {name}: {str(exc).splitlines()[0][:200]}") from None
    return arr


def _ascii(data: bytes | memoryview) -> bool:
    """No byte of ``data`` past 0x7F: one pass (Arrow's full check of UTF-8 goes value by value,
    some ten times slower on a column of 40,000 UUIDs)."""
    return bool(np.frombuffer(data, dtype=np.uint8).max(initial=0) < 0x80)


def _table(parts: list[_Read]) -> pa.Table:
    """The batches of ``parts`` (in order) as one table: one Arrow array per column for all."""
    n, g = sum(p.n for p in parts), sum(p.g for p in parts)
    fx = {name: _cat([p.fixed[name] for p in parts]) for name in parts[0].fixed}
    values = []
    absent = None  # one all-null column for every field no pack carries (it is never written to)
    for f in FIELDS:
        if not any(f.name in p.values for p in parts):
            absent = pa.nulls(g, pa.float64()) if absent is None else absent
            values.append(absent)
            continue
        got = [p.values.get(f.name) for p in parts]  # a pack without the field: NaN, made only then
        values.append(
            _nan_null(
                _cat([np.full(p.g, np.nan) if v is None else v for p, v in zip(parts, got, strict=True)])
            )
        )
    allocation = pa.StructArray.from_arrays(
        [_string(parts, s) for s in _ALLOC_STRINGS[:6]]
        + [pa.array(fx["share"]), _nan_null(fx["activity_share"]), _nan_null(fx["fb_share"])]
        + [_string(parts, "share_source")],
        fields=list(_ALLOCATION),
    )
    mig = pa.StructArray.from_arrays(
        [pa.array(fx["mig_gi"]), pa.array(fx["mig_ci"]), _string(parts, "mig_profile")],
        fields=list(_GPU.field("mig").type),
        mask=pa.array(~fx["mig"]),
    )
    gpu = pa.StructArray.from_arrays(
        [
            pa.array(fx["index"]),
            _string(parts, "uuid"),
            _string(parts, "model"),
            pa.array(fx["healthy"]),
            pa.StructArray.from_arrays(values, fields=list(_GPU.field("fields").type)),
            pa.ListArray.from_arrays(
                pa.array(_cat_offsets([p.allocs_off for p in parts], "allocs.off")), allocation
            ),
            pa.array(fx["fraction"]),
            mig,
        ],
        fields=list(_GPU),
    )
    strings = {s: _string(parts, s) for s in P.BATCH_STRINGS}
    return pa.Table.from_arrays(
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
            pa.ListArray.from_arrays(pa.array(_cat_offsets([p.gpus_off for p in parts], "gpus.off")), gpu),
        ],
        schema=SCHEMA,
    )


#: The bytes of packs read into one table at most (its string offsets are 32-bit).
_TABLE_BYTES = 1 << 30


@dataclass
class Many:
    """Packs read together: the batches of the well-formed ones (in order) as one table,
    and per pack how many of its rows that is, or why it is refused."""

    table: pa.Table
    outcome: list[int | Exception]  # per pack: its batches in ``table``, or the refusal
    digest: list[int]  # per row of ``table``: the digest of its batch's JSON


def unpack_many(values: list[bytes]) -> Many:
    """Every pack of ``values`` read at once (each Arrow array built once for all, not once
    per pack). A pack that is not well formed is refused alone: :class:`PackError` with the
    reason, or the exception a fault of the reader raised on it."""
    outcome: list[int | Exception] = []
    groups: list[list[tuple[int, _Read]]] = [[]]
    size = 0
    for i, v in enumerate(values):
        try:
            r = _read(v)
        except Exception as exc:
            outcome.append(exc)
            continue
        outcome.append(r.n)
        if groups[-1] and size + len(v) > _TABLE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((i, r))
        size += len(v)
    tables: list[pa.Table] = []
    digest: list[int] = []
    for group in groups:
        if not group:
            continue
        try:
            tables.append(_table([r for _, r in group]))
            kept = group
        except Exception:  # one pack's strings are not UTF-8 (or a fault): each alone decides
            kept = []
            for i, r in group:
                try:
                    tables.append(_table([r]))
                    kept.append((i, r))
                except Exception as exc:
                    outcome[i] = exc
        for _, r in kept:
            digest += r.fixed["digest"].tolist()
    table = (
        SCHEMA.empty_table() if not tables else tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    )
    return Many(table, outcome, digest)


def unpack(value: bytes) -> Unpacked:
    """The batches of a pack, or :class:`PackError` (or the reader's fault)."""
    many = unpack_many([value])
    (got,) = many.outcome
    if isinstance(got, Exception):
        raise got
    return Unpacked(many.table, many.digest)


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

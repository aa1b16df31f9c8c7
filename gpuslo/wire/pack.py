"""The packed encoding of ``gpu_samples``: many node batches in one Kafka message, as columns.

A JSON message costs the ingest 7-9 us per GPU row just to parse (``python -m bench ingest``),
more than the store's insert of the same row. An agent draining a backlog (after an outage,
a restart, a slow broker) sends its spooled batches instead as one *pack*: the same batches,
column by column, which the ingest reads without parsing (``ingest/packed.py``) and checks
with the very code that checks the JSON fast path. A batch in a pack means exactly what its
JSON means: the packer takes the JSON the agent spooled and refuses (leaves as JSON) any
record whose values it cannot carry with their JSON types.

Layout (little-endian)::

    b"GSPK" | u8 PACK_VERSION | 3 bytes zero | u32 header length | header | buffers

The header is a JSON object: ``batches``, ``gpus``, ``allocs`` (the row counts of the three
levels), ``fields`` (the DCGM field names carried, each a float64 column of the GPU level,
NaN where a GPU's ``fields`` lacks it: JSON has no NaN) and ``buffers``: ``[name, bytes]``
in order, each buffer starting on an 8-byte boundary after the header (padded with zeros).
A string column is two buffers, ``NAME.off`` (int32 offsets, rows + 1) and ``NAME.data``
(UTF-8). ``gpus.off`` and ``allocs.off`` are the int32 offsets of each batch's GPUs and
each GPU's holders. ``digest`` is per batch the digest of its JSON bytes (:func:`digest`),
so that a batch sent once as JSON and again in a pack (an agent restarted mid-drain) is
known for the same message by the ingest's replay check.

Absent values: a batch always carries every envelope value (the packer writes the model's
default where the JSON left one out, which is what the models would read); ``mig`` has a
presence byte per GPU; ``activity_share`` and ``fb_share`` are NaN where unset.

This module is the agent's side and the format's single definition; it needs only the
standard library, orjson and crc32c (both in ``gpuslo[agent]``).
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gpuslo.wire.fields import BY_NAME

_crc32c: Callable[[bytes], int] | None
try:  # optional (the slim core has no digest to take); imported once, off the per-message path
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - every extra that digests installs it
    _crc32c = None

MAGIC = b"GSPK"
PACK_VERSION = 1
_PREFIX = struct.Struct("<4sB3xI")
MAX_HEADER_BYTES = 1 << 20

#: Envelope strings of a batch, in buffer order (each ``NAME.off`` then ``NAME.data``).
BATCH_STRINGS = ("source", "boot_id", "cluster", "node", "pool")
#: (name, array typecode) of the fixed-width batch columns.
BATCH_FIXED = (("v", "q"), ("seq", "q"), ("ts", "d"), ("interval_s", "d"), ("digest", "Q"))
GPU_STRINGS = ("uuid", "model", "mig_profile")
GPU_FIXED = (
    ("index", "q"),
    ("healthy", "B"),
    ("fraction", "d"),
    ("mig", "B"),
    ("mig_gi", "q"),
    ("mig_ci", "q"),
)
ALLOC_STRINGS = ("scheduler", "id", "name", "user", "account", "queue", "share_source")
ALLOC_FIXED = (("share", "d"), ("activity_share", "d"), ("fb_share", "d"))

_ENVELOPE_KEYS = frozenset(("v", "kind", "source", "boot_id", "seq", "cluster", "ts", "node", "pool",
                            "interval_s", "gpus"))  # fmt: skip
_GPU_KEYS = frozenset(("index", "uuid", "model", "healthy", "fields", "allocations", "fraction", "mig"))
_ALLOC_KEYS = frozenset(ALLOC_STRINGS + tuple(n for n, _ in ALLOC_FIXED))
_MIG_KEYS = frozenset(("gi", "ci", "profile"))
_INT64_MAX = 2**63 - 1


class NotPackable(ValueError):
    """A record the pack cannot carry with its JSON meaning; it is sent as JSON instead."""


def digest(value: bytes) -> int:
    """The 64-bit digest of a message's bytes the ingest's replay check compares: CRC-32C of
    the bytes in the high half, their length in the low (a different message under one id is
    taken for a replay only if both agree: 2^-32 for messages of one length)."""
    if _crc32c is None:
        raise RuntimeError("the digest needs the crc32c module (in gpuslo[agent] and gpuslo[ingest])")
    return int(_crc32c(value)) << 32 | (len(value) & 0xFFFFFFFF)


def is_pack(value: bytes) -> bool:
    return value[:4] == MAGIC


def buffer_names(fields: Sequence[str]) -> list[str]:
    """Every buffer of a pack carrying ``fields``, in order."""
    names: list[str] = []
    for s in BATCH_STRINGS:
        names += [f"{s}.off", f"{s}.data"]
    names += [n for n, _ in BATCH_FIXED] + ["gpus.off"]
    for s in GPU_STRINGS:
        names += [f"{s}.off", f"{s}.data"]
    names += [n for n, _ in GPU_FIXED] + [f"field.{f}" for f in fields] + ["allocs.off"]
    for s in ALLOC_STRINGS:
        names += [f"{s}.off", f"{s}.data"]
    return names + [n for n, _ in ALLOC_FIXED]


def _str(x: Any) -> str:
    if type(x) is not str:
        raise NotPackable(f"a string was {type(x).__name__}")
    return x


def _int(x: Any) -> int:
    if type(x) is not int or not -_INT64_MAX - 1 <= x <= _INT64_MAX:
        raise NotPackable(f"an integer was {x!r}")
    return x


def _float(x: Any) -> float:
    if type(x) is not float and type(x) is not int:
        raise NotPackable(f"a number was {type(x).__name__}")
    f = float(x)
    if math.isnan(f):
        raise NotPackable("NaN")
    return f


def _bool(x: Any) -> int:
    if type(x) is not bool:
        raise NotPackable(f"a boolean was {type(x).__name__}")
    return int(x)


class _Strings:
    __slots__ = ("data", "off")

    def __init__(self) -> None:
        self.off = array("i", [0])
        self.data = bytearray()

    def add(self, s: str) -> None:
        self.data += s.encode()
        if len(self.data) > 2**31 - 1:
            raise NotPackable("string data over 2 GiB")
        self.off.append(len(self.data))

    def mark(self) -> tuple[int, int]:
        return len(self.off), len(self.data)

    def undo(self, m: tuple[int, int]) -> None:
        del self.off[m[0] :]
        del self.data[m[1] :]


@dataclass
class _Columns:
    fields: list[str]

    def __post_init__(self) -> None:
        self.strings = {s: _Strings() for s in BATCH_STRINGS + GPU_STRINGS + ALLOC_STRINGS}
        self.fixed: dict[str, array[Any]] = {n: array(t) for n, t in BATCH_FIXED + GPU_FIXED + ALLOC_FIXED}
        self.gpus_off = array("i", [0])
        self.allocs_off = array("i", [0])
        self.values: dict[str, array[float]] = {f: array("d") for f in self.fields}

    def mark(self) -> Any:
        return (
            {k: s.mark() for k, s in self.strings.items()},
            {k: len(a) for k, a in self.fixed.items()},
            len(self.gpus_off),
            len(self.allocs_off),
            {k: len(a) for k, a in self.values.items()},
            list(self.fields),
        )

    def undo(self, m: Any) -> None:
        strings, fixed, ng, na, values, fields = m
        for k, s in self.strings.items():
            s.undo(strings[k])
        for k, a in self.fixed.items():
            del a[fixed[k] :]
        del self.gpus_off[ng:]
        del self.allocs_off[na:]
        for f in self.fields[len(fields) :]:
            del self.values[f]
        self.fields[:] = fields
        for k, a in self.values.items():
            del a[values[k] :]

    def add(self, raw: bytes) -> None:
        b = orjson.loads(raw)
        if type(b) is not dict or b.get("kind") != "gpu_samples" or not _ENVELOPE_KEYS.issuperset(b):
            raise NotPackable("not a gpu_samples object with known keys")
        for s in ("source", "boot_id", "cluster", "node"):
            self.strings[s].add(_str(b[s]))
        self.strings["pool"].add(_str(b.get("pool", "")))
        fx = self.fixed
        fx["v"].append(_int(b.get("v", 1)))
        fx["seq"].append(_int(b["seq"]))
        if type(b["ts"]) is int:  # a refusal's hint quotes it as given (ms: 1796083200000, not ...0.0)
            raise NotPackable("ts is an integer")
        fx["ts"].append(_float(b["ts"]))
        fx["interval_s"].append(_float(b["interval_s"]))
        fx["digest"].append(digest(raw))
        gpus = b["gpus"]
        if type(gpus) is not list:
            raise NotPackable("gpus is not a list")
        for g in gpus:
            self._gpu(g)
        self.gpus_off.append(len(fx["index"]))

    def _gpu(self, g: Any) -> None:
        if type(g) is not dict or not _GPU_KEYS.issuperset(g):
            raise NotPackable("a GPU with unknown keys")
        fx = self.fixed
        fx["index"].append(_int(g["index"]))
        self.strings["uuid"].add(_str(g["uuid"]))
        self.strings["model"].add(_str(g.get("model", "")))
        fx["healthy"].append(_bool(g.get("healthy", True)))
        fx["fraction"].append(_float(g.get("fraction", 1.0)))
        mig = g.get("mig")
        if mig is None and "mig" in g:
            raise NotPackable("mig is null")
        if mig is not None:
            if type(mig) is not dict or not _MIG_KEYS.issuperset(mig):
                raise NotPackable("mig with unknown keys")
            fx["mig"].append(1)
            fx["mig_gi"].append(_int(mig["gi"]))
            fx["mig_ci"].append(_int(mig.get("ci", 0)))
            self.strings["mig_profile"].add(_str(mig.get("profile", "")))
        else:
            fx["mig"].append(0)
            fx["mig_gi"].append(0)
            fx["mig_ci"].append(0)
            self.strings["mig_profile"].add("")
        fields = g.get("fields", {})
        if type(fields) is not dict:
            raise NotPackable("fields is not an object")
        n = len(fx["index"]) - 1
        for name, value in fields.items():
            if name not in BY_NAME:  # the models refuse it: they say why, from the JSON
                raise NotPackable(f"unknown field {name!r}")
            if not BY_NAME[name].plausible(_float(value)):  # the models name the first in the JSON's
                raise NotPackable(f"{name} implausible")  # order, which the pack does not keep
            col = self.values.get(name)
            if col is None:
                col = self.values[name] = array("d", [math.nan]) * n
                self.fields.append(name)
            col.append(_float(value))
        for col in self.values.values():
            if len(col) == n:
                col.append(math.nan)
        allocs = g.get("allocations", [])
        if type(allocs) is not list:
            raise NotPackable("allocations is not a list")
        for a in allocs:
            if type(a) is not dict or not _ALLOC_KEYS.issuperset(a):
                raise NotPackable("an allocation with unknown keys")
            for s in ALLOC_STRINGS:
                self.strings[s].add(_str(a[s]) if s in ("scheduler", "id") else _str(a.get(s, "")))
            fx["share"].append(_float(a.get("share", 1.0)))
            for part in ("activity_share", "fb_share"):
                v = a.get(part)
                if v is None and part in a:
                    raise NotPackable(f"{part} is null")
                fx[part].append(math.nan if v is None else _float(v))
        self.allocs_off.append(len(fx["share"]))

    def buffers(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for s in BATCH_STRINGS:
            out += [(f"{s}.off", self.strings[s].off.tobytes()), (f"{s}.data", bytes(self.strings[s].data))]
        out += [(n, self.fixed[n].tobytes()) for n, _ in BATCH_FIXED] + [
            ("gpus.off", self.gpus_off.tobytes())
        ]
        for s in GPU_STRINGS:
            out += [(f"{s}.off", self.strings[s].off.tobytes()), (f"{s}.data", bytes(self.strings[s].data))]
        out += [(n, self.fixed[n].tobytes()) for n, _ in GPU_FIXED]
        out += [(f"field.{f}", self.values[f].tobytes()) for f in self.fields]
        out.append(("allocs.off", self.allocs_off.tobytes()))
        for s in ALLOC_STRINGS:
            out += [(f"{s}.off", self.strings[s].off.tobytes()), (f"{s}.data", bytes(self.strings[s].data))]
        return out + [(n, self.fixed[n].tobytes()) for n, _ in ALLOC_FIXED]


def pack(records: Iterable[bytes]) -> tuple[bytes, list[int]]:
    """The pack of the ``gpu_samples`` JSON ``records`` it can carry, and the positions of those
    it took (in order); the others are left for the caller to send as JSON."""
    if array("i").itemsize != 4 or array("q").itemsize != 8:  # pragma: no cover - every CPython we run
        raise RuntimeError("array typecodes i/q are not 4/8 bytes here")
    c = _Columns([])
    took: list[int] = []
    for i, raw in enumerate(records):
        m = c.mark()
        try:
            c.add(raw)
        except (NotPackable, KeyError, TypeError, ValueError, OverflowError):
            c.undo(m)
            continue
        took.append(i)
    return _assemble(c, len(took)), took


def _assemble(c: _Columns, batches: int) -> bytes:
    bufs = c.buffers()
    header = orjson.dumps(
        {
            "batches": batches,
            "gpus": len(c.fixed["index"]),
            "allocs": len(c.fixed["share"]),
            "fields": c.fields,
            "buffers": [[n, len(b)] for n, b in bufs],
        }
    )
    parts = [_PREFIX.pack(MAGIC, PACK_VERSION, len(header)), header]
    at = _PREFIX.size + len(header)
    for _, b in bufs:
        pad = -at % 8
        parts += [b"\0" * pad, b]
        at += pad + len(b)
    return b"".join(parts)


def read(value: bytes) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """The header and the buffers (views into ``value``) of a pack. Raises ValueError with a
    reason on anything but a well-formed pack: the values inside are not checked here."""
    if len(value) < _PREFIX.size:
        raise ValueError(f"a pack is at least {_PREFIX.size} bytes; this one {len(value)}")
    magic, version, hlen = _PREFIX.unpack_from(value)
    if magic != MAGIC:
        raise ValueError("not a pack (no GSPK magic)")
    if version != PACK_VERSION:
        raise ValueError(f"unsupported pack version {version} (supported: {PACK_VERSION})")
    if value[5:8] != b"\0\0\0":
        raise ValueError("pack prefix: reserved bytes not zero")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > len(value):
        raise ValueError(f"pack header of {hlen} bytes does not fit the {len(value)}-byte message")
    try:
        h = orjson.loads(value[_PREFIX.size : _PREFIX.size + hlen])
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"pack header is not JSON: {exc}") from None
    if type(h) is not dict or set(h) != {"batches", "gpus", "allocs", "fields", "buffers"}:
        raise ValueError("pack header: expected exactly batches, gpus, allocs, fields, buffers")
    for k in ("batches", "gpus", "allocs"):
        if type(h[k]) is not int or not 0 <= h[k] <= 2**31 - 2:
            raise ValueError(f"pack header: {k} must be an integer in [0, 2^31 - 2]")
    fields = h["fields"]
    if type(fields) is not list or any(type(f) is not str for f in fields) or len(set(fields)) < len(fields):
        raise ValueError("pack header: fields must be distinct names")
    unknown = [f for f in fields if f not in BY_NAME]
    if unknown:
        raise ValueError(f"pack header: unknown field {unknown[0]!r} (not in the DCGM field catalogue)")
    listed = h["buffers"]
    expected = buffer_names(fields)
    if (
        type(listed) is not list
        or len(listed) != len(expected)
        or any(
            type(e) is not list or len(e) != 2 or e[0] != n for e, n in zip(listed, expected, strict=False)
        )
    ):
        raise ValueError("pack header: buffers are not the ones of this version, in order")
    out: dict[str, memoryview] = {}
    view = memoryview(value)
    at = _PREFIX.size + hlen
    for name, size in listed:
        if type(size) is not int or size < 0:
            raise ValueError(f"pack header: buffer {name} has no valid size")
        at += -at % 8
        if at + size > len(value):
            raise ValueError(f"pack buffer {name} ({size} bytes) runs past the message's end")
        out[name] = view[at : at + size]
        at += size
    if at != len(value):
        raise ValueError(f"{len(value) - at} bytes after the pack's last buffer")
    return h, out

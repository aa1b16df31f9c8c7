"""Vectorised decoding of ``gpu_samples`` messages: the ingest's hot path.

The pydantic models in :mod:`gpuslo.wire.models` define what a valid message is. Building
one model object per GPU costs more than everything else the ingest does, so the messages
that make up almost all of the traffic (GPU sample batches, as the agent encodes them) are
parsed by Arrow's JSON reader straight into columns and checked with Arrow compute.

The contract: a message this module *accepts* yields exactly the rows the models would; any
message it is not sure about (does not look like the agent's encoding, mentions ``null``,
fails a check, or sits in a block Arrow cannot parse) is handed back to the caller, whose
model path decides and explains why. tests/test_fastpath.py checks the contract
differentially against the models, on mutated messages.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from gpuslo.wire.bounds import FLOAT32_MIN_POSITIVE, MAX_ALLOCATIONS, MAX_GPU_ROWS
from gpuslo.wire.fields import ACTIVITY_FIELD, FIELDS, UTIL_FIELD
from gpuslo.wire.models import _TS_MAX, _TS_MIN, MAX_INTERVAL_S, SHARE_SOURCES, WIRE_VERSION

_ALLOCATION = pa.struct(
    [(k, pa.string()) for k in ("scheduler", "id", "name", "user", "account", "queue")]
    + [
        ("share", pa.float64()),
        ("activity_share", pa.float64()),
        ("fb_share", pa.float64()),
        ("share_source", pa.string()),
    ]
)
_GPU = pa.struct(
    [
        ("index", pa.int64()),
        ("uuid", pa.string()),
        ("model", pa.string()),
        ("healthy", pa.bool_()),
        ("fields", pa.struct([(f.name, pa.float64()) for f in FIELDS])),
        ("allocations", pa.list_(_ALLOCATION)),
        ("fraction", pa.float64()),
        ("mig", pa.struct([("gi", pa.int64()), ("ci", pa.int64()), ("profile", pa.string())])),
    ]
)
#: Every key of GpuSampleBatch / GpuSample / Allocation (a test keeps them in step with the
#: models); any other key makes Arrow refuse the block, as ``extra="forbid"`` does.
SCHEMA = pa.schema(
    [
        ("v", pa.int64()),
        ("source", pa.string()),
        ("boot_id", pa.string()),
        ("seq", pa.int64()),
        ("cluster", pa.string()),
        ("ts", pa.float64()),
        ("kind", pa.string()),
        ("node", pa.string()),
        ("pool", pa.string()),
        ("interval_s", pa.float64()),
        ("gpus", pa.list_(_GPU)),
    ]
)
_PARSE = pj.ParseOptions(explicit_schema=SCHEMA, unexpected_field_behavior="error")
_KIND = b'"kind":"gpu_samples"'
_SMALLEST_BLOCK = 16  # a failing block this small goes to the model path whole
_MAX_NAME = 256  # Name / Label max_length in the models


def candidate(value: bytes) -> bool:
    """Whether a message may take the fast path: one JSON object on one line in the agent's
    encoding, with no ``null`` anywhere (so a null column always means "key absent" and the
    model default applies; an explicit null, which the models refuse, goes to them), in UTF-8:
    Arrow's JSON reader takes a string's bytes as they come, so bytes that are not UTF-8 (which
    the models refuse) would be stored as text, or raise where a column is read back."""
    return (
        value[:1] == b"{"
        and value[-1:] == b"}"
        and _KIND in value
        and b"null" not in value
        and b"\n" not in value
        and b"\r" not in value
        and (value.isascii() or _utf8(value))
    )


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@dataclass(frozen=True)
class Envelope:
    """Per accepted message, the envelope fields the pipeline needs."""

    source: list[str]
    boot_id: list[str]
    seq: list[int]
    ts: list[float]
    node: list[str]


@dataclass
class Decoded:
    """Accepted messages (in input order): their position in the input and the parsed table
    to build the rows from; the envelope fields the pipeline needs per message are read out
    of the table when first asked for (as lists, or as arrays for a run taken at once)."""

    positions: list[int]
    table: pa.Table
    _codes: dict[str, tuple[np.ndarray[Any, Any], list[str]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @functools.cached_property
    def env(self) -> Envelope:
        """The envelope fields, as lists (a message at a time)."""
        d = self.table.select(["source", "boot_id", "seq", "ts", "node"]).to_pydict()
        return Envelope(d["source"], d["boot_id"], d["seq"], d["ts"], d["node"])

    @functools.cached_property
    def ts_array(self) -> np.ndarray[Any, Any]:
        return np.asarray(self.table["ts"].to_numpy(), dtype=np.float64)

    @functools.cached_property
    def seq_array(self) -> np.ndarray[Any, Any]:
        return np.asarray(self.table["seq"].to_numpy(), dtype=np.int64)

    def codes(self, name: str) -> tuple[np.ndarray[Any, Any], list[str]]:
        """A string column as (per message, the index of its value; the distinct values)."""
        got = self._codes.get(name)
        if got is None:
            # one dictionary for every chunk; a null (never on the fast path's rows) is a value
            enc = pc.dictionary_encode(self.table[name], null_encoding="encode")
            idx = [np.asarray(c.indices.to_numpy(zero_copy_only=False)) for c in enc.chunks]
            values = enc.chunk(0).dictionary.to_pylist() if enc.num_chunks else []
            got = self._codes[name] = (np.concatenate([np.zeros(0, np.int64), *idx]).astype(np.int64), values)
        return got


def decoded(positions: list[int], table: pa.Table) -> Decoded:
    """The accepted messages of ``table`` (at ``positions``)."""
    return Decoded(positions, table)


def decode(values: Sequence[bytes]) -> tuple[Decoded, list[int]]:
    """Returns the accepted messages and the positions (into ``values``) of the rest."""
    tables: list[pa.Table] = []
    positions: list[int] = []
    rejected: list[int] = []
    _parse(values, 0, len(values), tables, positions, rejected)
    if tables:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        ok = _valid(table)
        if not ok.all():
            rejected += [p for p, good in zip(positions, ok, strict=True) if not good]
            positions = [p for p, good in zip(positions, ok, strict=True) if good]
            table = table.filter(pa.array(ok))
    else:
        table = SCHEMA.empty_table()
    rejected.sort()
    return decoded(positions, table), rejected


def _parse(
    values: Sequence[bytes],
    lo: int,
    hi: int,
    tables: list[pa.Table],
    positions: list[int],
    rejected: list[int],
) -> None:
    """Parse values[lo:hi] as one block; a block Arrow refuses (or that does not give one row
    per message) is split in halves until the culprits are isolated in small blocks."""
    if lo >= hi:
        return
    try:
        t = pj.read_json(io.BytesIO(b"\n".join(values[lo:hi])), parse_options=_PARSE)
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError):
        t = None
    if t is not None and t.num_rows == hi - lo:
        tables.append(t)
        positions.extend(range(lo, hi))
        return
    if hi - lo <= _SMALLEST_BLOCK:
        rejected.extend(range(lo, hi))
        return
    mid = (lo + hi) // 2
    _parse(values, lo, mid, tables, positions, rejected)
    _parse(values, mid, hi, tables, positions, rejected)


def _gpus(t: pa.Table) -> Any:
    """The ``gpus`` column as one array. (``combine_chunks`` copies even a single chunk: the
    whole nested column, every GPU's values, twice per batch.)"""
    col = t["gpus"]
    if col.num_chunks == 1:
        return col.chunk(0)
    return col.combine_chunks() if col.num_chunks else pa.array([], SCHEMA.field("gpus").type)


def _f(struct: Any, name: str) -> Any:
    """A struct child, honouring the struct's own offset and nulls (``StructArray.field``
    does not: it is taken as it is only where it has neither, as a pack's arrays do)."""
    if isinstance(struct, pa.StructArray) and struct.offset == 0 and struct.null_count == 0:
        child = struct.field(name)
        if len(child) == len(struct):
            return child
    return pc.struct_field(struct, [name])


def _np(a: Any) -> np.ndarray[Any, Any]:
    return np.asarray(a.to_numpy(zero_copy_only=False))


def _length_ok(a: Any, lo: int, optional: bool) -> np.ndarray[Any, Any]:
    """Per value: ``lo`` to ``_MAX_NAME`` characters (code points, as the models count); a null
    passes when ``optional``. By bytes first, which the offsets give without reading the text:
    a string of at most ``_MAX_NAME`` bytes has at most as many characters, and one of ``lo``
    (0 or 1) bytes or more has ``lo`` characters or more; only a column holding a longer string
    (or a minimum over 1) is counted in characters."""
    n = pc.binary_length(a)
    if lo > 1 or (pc.max(n).as_py() or 0) > _MAX_NAME:
        n = pc.utf8_length(a)
    ok = pc.and_(pc.greater_equal(n, lo), pc.less_equal(n, _MAX_NAME))
    return _np(pc.fill_null(ok, optional))


def _range_ok(a: Any, lo: float, hi: float, optional: bool) -> np.ndarray[Any, Any]:
    """Per value: within [lo, hi] (NaN fails); a null passes when ``optional``. (In numpy: half
    the cost of Arrow's compute for the same answer; an integer column's values are ids of at
    most 2^10, exact as floats.)"""
    if a.null_count == len(a):  # every value absent (a DCGM field the node does not carry)
        return np.full(len(a), optional, dtype=bool)
    v = _np(a)
    ok = (v >= lo) & (v <= hi)
    if a.null_count:
        valid = _np(a.is_valid())
        ok = ok | ~valid if optional else ok & valid
    return np.asarray(ok, dtype=bool)


def _roll_up(bad_child: np.ndarray[Any, Any], lists: Any, n_parents: int) -> np.ndarray[Any, Any]:
    """A bad list element makes its parent bad."""
    out = np.zeros(n_parents, dtype=bool)
    if bad_child.any():
        parents = _np(pc.list_parent_indices(lists))
        out[parents[bad_child]] = True
    return out


def _valid(t: pa.Table) -> np.ndarray[Any, Any]:
    """Per message: would the models accept it? (False means "let the models decide".)"""
    ok = _np(pc.fill_null(pc.equal(t["v"], WIRE_VERSION), False))
    ok &= _np(pc.fill_null(pc.equal(t["kind"], "gpu_samples"), False))
    for name in ("source", "boot_id", "cluster", "node"):
        ok &= _length_ok(t[name], 1, optional=False)
    ok &= _length_ok(t["pool"], 0, optional=True)
    ok &= _np(pc.fill_null(pc.greater_equal(t["seq"], 0), False))
    ok &= _range_ok(t["ts"], _TS_MIN, _TS_MAX, optional=False)
    ok &= _range_ok(t["interval_s"], FLOAT32_MIN_POSITIVE, MAX_INTERVAL_S, optional=False)
    gpus = _gpus(t)
    ok &= _np(gpus.is_valid())
    ok &= _np(pc.fill_null(pc.less_equal(pc.list_value_length(gpus), MAX_GPU_ROWS), True))
    g = gpus.flatten()
    if len(g):
        good = _range_ok(_f(g, "index"), 0, 1023, optional=False)
        good &= _length_ok(_f(g, "uuid"), 1, optional=False)
        good &= _length_ok(_f(g, "model"), 0, optional=True)
        fields = _f(g, "fields")
        for f in FIELDS:
            good &= _range_ok(_f(fields, f.name), f.lo, f.hi, optional=True)
        mig = _f(g, "mig")
        has_mig = _np(mig.is_valid())
        if has_mig.any():  # a MIG instance: gi required, ids 0..255, a profile label, fraction > 0
            good &= ~has_mig | _range_ok(_f(mig, "gi"), 0, 255, optional=False)
            good &= ~has_mig | _range_ok(_f(mig, "ci"), 0, 255, optional=True)
            good &= ~has_mig | _length_ok(_f(mig, "profile"), 0, optional=True)
            good &= ~has_mig | _range_ok(_f(g, "fraction"), FLOAT32_MIN_POSITIVE, 1, optional=True)
        good &= _range_ok(_f(g, "fraction"), 0, 1, optional=True)
        good &= _np(
            pc.fill_null(pc.less_equal(pc.list_value_length(_f(g, "allocations")), MAX_ALLOCATIONS), True)
        )
        allocs = _f(g, "allocations")
        a = allocs.flatten()
        if len(a):
            a_ok = _np(pc.fill_null(pc.is_in(_f(a, "scheduler"), pa.array(["slurm", "k8s"])), False))
            a_ok &= _length_ok(_f(a, "id"), 1, optional=False)
            for name in ("name", "user", "account", "queue"):
                a_ok &= _length_ok(_f(a, name), 0, optional=True)
            a_ok &= _range_ok(_f(a, "share"), FLOAT32_MIN_POSITIVE, 1, optional=True)
            for part in ("activity_share", "fb_share"):
                a_ok &= _range_ok(_f(a, part), 0, 1, optional=True)
            a_ok &= _np(pc.fill_null(pc.is_in(_f(a, "share_source"), pa.array(SHARE_SOURCES)), True))
            good &= ~_roll_up(~a_ok, allocs, len(g))
            good &= _share_sum(allocs) <= 1.0 + 1e-6
            for part in ("activity_share", "fb_share"):
                good &= _share_sum(allocs, part) <= 1.0 + 1e-6
        ok &= ~_roll_up(~good, gpus, t.num_rows)
        gpu_key = _gpu_key(gpus, g)
        # the agent's order (each batch's rows by GPU index, one row a GPU): no GPU appears
        # twice in a batch, so neither check below has anything to find (a row's own fraction
        # is checked <= 1 above)
        if not _rising(gpu_key):
            ok &= ~_repeated_gpu(gpu_key, g, has_mig, t.num_rows)
            ok &= ~_overfull_gpu(gpu_key, g, t.num_rows)
    return ok


def _gpu_key(gpus: Any, g: Any) -> np.ndarray[Any, Any]:
    """Per GPU row: its batch and GPU index as one key, ``batch << 10 | index`` (an index out
    of 0..1023 is refused by the range check already; clipped here only to keep keys apart)."""
    parent = _np(pc.list_parent_indices(gpus)).astype(np.int64)
    index = np.clip(_np(pc.fill_null(_f(g, "index"), 0)).astype(np.int64), 0, 1023)
    key: np.ndarray[Any, Any] = parent << 10 | index
    return key


def _overfull_gpu(gpu_key: np.ndarray[Any, Any], g: Any, n: int) -> np.ndarray[Any, Any]:
    """Per message: do the rows of one GPU (its MIG instances, the device row) stand for more
    than one GPU? (The models' rule; an absent fraction is the default, 1.)"""
    frac = _np(pc.fill_null(_f(g, "fraction"), 1.0)).astype(float)
    uniq, inverse = np.unique(gpu_key, return_inverse=True)
    total = np.bincount(inverse.ravel(), weights=frac, minlength=len(uniq))
    out = np.zeros(n, dtype=bool)
    over = total > 1.0 + 1e-6  # NaN is refused by the range check already
    if over.any():
        out[(uniq[over] >> 10).astype(np.int64)] = True
    return out


def _repeated_gpu(
    gpu_key: np.ndarray[Any, Any], g: Any, has_mig: np.ndarray[Any, Any], n: int
) -> np.ndarray[Any, Any]:
    """Per message: does a (GPU index, MIG gi, ci) appear twice? (The ids are in range here
    or the message is already refused: index < 2^10, gi/ci < 2^8.)"""
    mig = _f(g, "mig")
    gi = np.where(has_mig, np.clip(_np(pc.fill_null(_f(mig, "gi"), 0)).astype(np.int64), 0, 255) + 1, 0)
    ci = np.where(has_mig, np.clip(_np(pc.fill_null(_f(mig, "ci"), 0)).astype(np.int64), 0, 255) + 1, 0)
    key = ((gpu_key << 9 | gi) << 9) | ci
    out = np.zeros(n, dtype=bool)
    if _rising(key):  # MIG instances of a GPU in the agent's order: no key twice, no sort needed
        return out
    uniq, counts = np.unique(key, return_counts=True)
    if (counts > 1).any():
        out[(uniq[counts > 1] >> 28).astype(np.int64)] = True
    return out


def _rising(key: np.ndarray[Any, Any]) -> bool:
    """Strictly rising: so no key appears twice (the rows are in their batches' order)."""
    return bool(len(key) < 2 or (key[1:] > key[:-1]).all())


def _share_sum(allocs: Any, part: str = "") -> np.ndarray[Any, Any]:
    """Per GPU: the sum of its holders' shares (an absent share is the model default, 1), or
    of their ``part`` (activity_share, fb_share: an absent one is the holder's share)."""
    n = len(allocs)
    a = allocs.flatten()
    if not len(a):
        return np.zeros(n)
    shares = _np(_part(a, part) if part else pc.fill_null(_f(a, "share"), 1.0)).astype(float)
    return np.bincount(_np(pc.list_parent_indices(allocs)), weights=shares, minlength=n)


def _part(a: Any, part: str) -> Any:
    return pc.coalesce(_f(a, part), pc.fill_null(_f(a, "share"), 1.0))


_ALLOC_ATTRS = (("alloc_schedulers", "scheduler"), ("alloc_ids", "id"), ("alloc_names", "name"),
                ("alloc_users", "user"), ("alloc_accounts", "account"), ("alloc_queues", "queue"))  # fmt: skip


def columns(d: Decoded, keep: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``gpu_samples`` columns (same names and meaning as the model path's) for the
    accepted messages, or for those at ``keep`` (indices into ``d.positions``)."""
    t = d.table if keep is None or len(keep) == len(d.positions) else d.table.take(pa.array(keep, pa.int64()))
    gpus = _gpus(t)
    parent = pc.list_parent_indices(gpus)
    g = gpus.flatten()
    out: dict[str, Any] = {}
    for name in ("cluster", "node", "ts", "interval_s", "source", "boot_id", "seq"):
        out[name] = pc.take(t[name], parent)
    out["pool"] = pc.fill_null(pc.take(t["pool"], parent), "")
    out["gpu"] = _f(g, "index")
    out["uuid"] = _f(g, "uuid")
    out["model"] = pc.fill_null(_f(g, "model"), "")
    out["healthy"] = pc.cast(pc.fill_null(_f(g, "healthy"), True), pa.uint8())
    out["gpu_fraction"] = pc.fill_null(_f(g, "fraction"), 1.0)
    mig = _f(g, "mig")
    out["mig_gi"] = pc.fill_null(_f(mig, "gi"), -1)
    out["mig_ci"] = pc.if_else(mig.is_valid(), pc.fill_null(_f(mig, "ci"), 0), -1)
    out["mig_profile"] = pc.fill_null(_f(mig, "profile"), "")
    fields = _f(g, "fields")
    # a GPU without a "fields" object has every field absent (null), as an empty dict would
    if fields.null_count:
        present = fields.is_valid()
        values = {f.name: pc.if_else(present, _f(fields, f.name), None) for f in FIELDS}
    else:  # every GPU has its "fields" object (always so in a pack)
        values = {f.name: _f(fields, f.name) for f in FIELDS}
    out["activity"] = pc.coalesce(values[ACTIVITY_FIELD], pc.divide(values[UTIL_FIELD], 100.0))
    allocs = _f(g, "allocations")
    counts = pc.fill_null(pc.list_value_length(allocs), 0)
    offsets = pa.array(np.concatenate([[0], np.cumsum(_np(counts), dtype=np.int32)]).astype(np.int32))
    a = allocs.flatten()
    for col, attr in _ALLOC_ATTRS:
        v = _f(a, attr)
        if attr != "scheduler" and attr != "id":
            v = pc.fill_null(v, "")
        out[col] = pa.ListArray.from_arrays(offsets, v)
    shares = pc.fill_null(_f(a, "share"), 1.0) if len(a) else pa.array([], pa.float64())
    out["alloc_shares"] = pa.ListArray.from_arrays(offsets, shares)
    for col, part in (("alloc_act_shares", "activity_share"), ("alloc_fb_shares", "fb_share")):
        out[col] = pa.ListArray.from_arrays(offsets, _part(a, part) if len(a) else pa.array([], pa.float64()))
    sources = pc.fill_null(_f(a, "share_source"), "") if len(a) else pa.array([], pa.string())
    out["alloc_share_sources"] = pa.ListArray.from_arrays(offsets, sources)
    out["alloc_share"] = pa.array(np.minimum(1.0, _share_sum(allocs)))
    out.update(values)
    return out

"""Every numeric field of every message is bounded by the column it lands in.

The bounds live in the wire (gpuslo/wire/bounds.py; the wire does not import the ingest);
these tests walk every numeric leaf of every kind (tests/corpus.py, from the models' JSON
schema), put it at its declared bounds, build the columns with the store's types taken from
ingest/schema.py, and insert them into a real chDB store: a new field or column that forgets
its bound fails here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.schema import MAX_TTL_DAYS, column_types
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules.tables import SCHEMA
from gpuslo.wire import BY_NAME, WireError, bounds, decode, encode
from tests import helpers as h
from tests.corpus import _DEFS, _leaves, _set, base_messages


def _numeric_leaves() -> list[tuple[str, tuple[object, ...], dict[str, object], bytes]]:
    out = []
    for base in base_messages(h.T0):
        obj = json.loads(encode(base))
        for path, leaf in _leaves(_DEFS[type(base).__name__], obj, ()):
            if leaf.get("type") in ("integer", "number") and path[-1] not in ("v",):
                out.append((base.kind, path, leaf, encode(base)))
    return out


LEAVES = _numeric_leaves()


def test_every_integer_field_declares_both_bounds() -> None:
    ints = [(k, p, leaf) for k, p, leaf, _ in LEAVES if leaf["type"] == "integer"]
    assert len(ints) >= 8
    for kind, path, leaf in ints:
        assert "minimum" in leaf and "maximum" in leaf, (kind, path)


@pytest.mark.parametrize(
    ("kind", "path", "leaf", "raw"), LEAVES, ids=lambda x: str(x) if isinstance(x, str) else ""
)
def test_numeric_bounds_fit_their_column(
    kind: str, path: tuple[object, ...], leaf: dict[str, object], raw: bytes, tmp_path: Path
) -> None:
    lo = leaf.get("minimum", leaf.get("exclusiveMinimum"))
    hi = leaf.get("maximum")
    if path[-1] == "ts":
        hi = bounds.TS_MAX  # inside retention: the future end
    if path[-1] in BY_NAME:  # a DCGM field: the catalogue's plausible range (a Float64 column)
        lo, hi = BY_NAME[str(path[-1])].lo, BY_NAME[str(path[-1])].hi
    if lo is None and hi is None:  # unbounded: a Float64 column; only finite values may pass
        assert leaf["type"] == "number", (kind, path)
        for bad in (float("inf"), float("nan")):
            obj = json.loads(raw)
            _set(obj, path, bad)
            with pytest.raises(WireError):
                decode(json.dumps(obj, allow_nan=True).encode())
        return
    values = [v for v in (lo, hi) if v is not None and not (path[-1] == "ts" and v == lo)]
    if "exclusiveMinimum" in leaf:
        values = [v for v in values if v != lo] + [float(lo) + 1e-6]  # type: ignore[arg-type]
    msgs = []
    for i, v in enumerate(values):
        obj = json.loads(raw)
        obj["seq"], obj["ts"] = 5000 + i, h.T0 + i  # distinct ids and natural keys
        _set(obj, path, v)
        m = json.dumps(obj).encode()
        try:
            decode(m)  # the model accepts its own bounds...
        except WireError as exc:  # ...unless a rule across fields refuses it (a MIG row of fraction 0)
            assert "Value error" in exc.reason, exc.reason
            continue
        msgs.append(m)
    assert msgs, (kind, path)
    store = ChdbStore(tmp_path / "s")
    try:
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest([Raw(f"t:{i}", m) for i, m in enumerate(msgs)])
        assert rep.n_rejected == 0, rep.rejected
        assert sum(rep.written.values()) >= len(msgs)
    finally:
        store.close()
    if leaf["type"] == "integer" and hi is not None and path[-1] != "ts":
        obj = json.loads(raw)
        _set(obj, path, hi + 1)  # type: ignore[operator]
        with pytest.raises(WireError):
            decode(json.dumps(obj).encode())


@pytest.mark.parametrize(
    ("table", "column", "hi"),
    [
        ("gpu_samples", "seq", bounds.UINT64_MAX),
        ("health_events", "code", bounds.UINT32_MAX),
        ("gpu_samples", "gpu", 1023),
        ("node_heartbeats", "gpus", 1024),
        ("sched_events", "nodes", 100_000),
        ("gpu_samples", "mig_gi", 255),
    ],
)
def test_integer_bounds_fit_the_schema_types(table: str, column: str, hi: int) -> None:
    lo_t, hi_t = bounds.INT_RANGES[column_types(table)[column]]
    assert lo_t <= 0 and hi <= hi_t


def test_every_integer_column_of_every_table_has_a_range() -> None:
    from gpuslo.ingest.schema import TABLES

    for t in TABLES:
        for name, typ in column_types(t).items():
            base = typ.removeprefix("Array(").removeprefix("Nullable(").rstrip(")")
            if base.startswith(("UInt", "Int")):
                assert base in bounds.INT_RANGES, (t, name, typ)


def test_latency_total_fits_uint64() -> None:
    total_max = bounds.INT_RANGES[column_types("latency")["total"]][1]
    assert total_max >= (bounds.MAX_BUCKETS + 1) * bounds.MAX_COUNT


def test_times_fit_datetime_and_date() -> None:
    # a sample's end and the next minute fit DateTime (rollup minutes); TTL dates fit Date
    assert bounds.TS_MAX + 86_400 + 60 <= bounds.DATETIME_MAX
    assert bounds.TS_MAX // 86400 + MAX_TTL_DAYS <= bounds.DATE_MAX_DAYS


# The fields the wire says are positive: a zero would divide (a holder's activity on what it
# holds is activity x activity_share / share; a MIG instance's seconds are its capacity over its
# fraction; a sample's rate is over its interval). The base gpu_samples row is a MIG instance.
POSITIVE = ("interval_s", "share", "fraction")


@pytest.mark.parametrize(
    ("kind", "path", "leaf", "raw"),
    [x for x in LEAVES if x[1][-1] in POSITIVE],
    ids=lambda x: str(x) if isinstance(x, str) else "",
)
def test_a_positive_field_stays_positive_in_its_float32_column(
    kind: str, path: tuple[object, ...], leaf: dict[str, object], raw: bytes, tmp_path: Path
) -> None:
    """A share of 1e-46 passed ``share > 0`` and its Float32 column stored 0: the job report
    then read the holder's activity 0 / 0, NaN active GPU-hours. Every positive field refuses a
    value its column rounds to 0 (the fast path and the models alike: a dead letter with the
    reason, the good message beside it written), and its least accepted value stays positive."""
    table = {"gpu_samples": "gpu_samples", "heartbeat": "node_heartbeats", "latency": "latency"}[kind]
    column = (
        "alloc_shares" if path[-1] == "share" else "gpu_fraction" if path[-1] == "fraction" else "interval_s"
    )
    assert "Float32" in column_types(table)[column]
    tiny = 1e-46
    assert tiny > 0 and np.float32(tiny) == 0  # positive, but 0 in the column
    obj = json.loads(raw)
    _set(obj, path, tiny)
    bad = json.dumps(obj).encode()
    with pytest.raises(WireError):
        decode(bad)
    _set(obj, path, bounds.FLOAT32_MIN_POSITIVE)
    obj["seq"] = 7000
    least = json.dumps(obj).encode()
    decode(least)
    assert np.float32(bounds.FLOAT32_MIN_POSITIVE) > 0
    store = ChdbStore(tmp_path / "s")
    try:
        store.migrate(SCHEMA)
        rep = Ingestor(store).ingest([Raw("t:0", bad), Raw("t:1", least)])
        assert rep.n_rejected == 1, rep.rejected
        rows = store.query(f"SELECT {column} AS v FROM {table} FINAL", {})
        assert len(rows) == 1
        v = rows[0]["v"]
        assert (min(v) if isinstance(v, list) else v) > 0
    finally:
        store.close()

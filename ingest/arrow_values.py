"""An Arrow result as Python values, String values that are not UTF-8 included.

A ClickHouse ``String`` holds any bytes: a dead letter's ``raw`` is a Kafka message kept as it
came. chDB hands ``String`` to Arrow as ``string`` without checking it, and pyarrow's
``to_pylist`` raised UnicodeDecodeError on the first value that is not UTF-8: reading dead
letters back was a traceback. The meaning is clickhouse-driver's (the server store's): a value
that is UTF-8 is a ``str``, any other is the ``bytes`` as stored, at any depth (an Array, a
Tuple, a Map, a Nullable). Only a result that holds such a value pays for the slow path."""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def rows(table: pa.Table) -> list[dict[str, Any]]:
    """``table.to_pylist()``, with the values that are not UTF-8 as bytes."""
    try:
        out: list[dict[str, Any]] = table.to_pylist()
        return out
    except UnicodeDecodeError:
        names = table.column_names
        values = [column(c) for c in table.columns]
        return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def columns(table: pa.Table) -> dict[str, list[Any]]:
    """``table.to_pydict()``, with the values that are not UTF-8 as bytes."""
    try:
        out: dict[str, list[Any]] = table.to_pydict()
        return out
    except UnicodeDecodeError:
        return {name: column(c) for name, c in zip(table.column_names, table.columns, strict=True)}


def column(col: pa.ChunkedArray | pa.Array) -> list[Any]:
    """One column's values, each text value that is not UTF-8 as its bytes."""
    try:
        out: list[Any] = col.to_pylist()
        return out
    except UnicodeDecodeError:
        return _decoded(col.cast(_as_binary(col.type)).to_pylist(), col.type)


def _as_binary(t: pa.DataType) -> pa.DataType:
    """``t`` with every text type in it made the binary type of the same offsets."""
    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_dictionary(t):  # LowCardinality: its values, decoded
        return _as_binary(t.value_type)
    if pa.types.is_map(t):
        return pa.map_(_as_binary(t.key_type), _as_binary(t.item_type))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_as_binary(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_as_binary(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_as_binary(t.value_type)), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_as_binary(t.field(i).type)) for i in range(t.num_fields)])
    return t


def _decoded(values: list[Any], t: pa.DataType) -> list[Any]:
    return [_value(v, t) for v in values]


def _value(v: Any, t: pa.DataType) -> Any:
    if v is None:
        return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return v
    if pa.types.is_dictionary(t):
        return _value(v, t.value_type)
    if pa.types.is_map(t):  # pyarrow gives a Map as (key, item) pairs
        return [(_value(k, t.key_type), _value(x, t.item_type)) for k, x in v]
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return [_value(x, t.value_type) for x in v]
    if pa.types.is_struct(t):
        return {f.name: _value(v[f.name], f.type) for f in (t.field(i) for i in range(t.num_fields))}
    return v

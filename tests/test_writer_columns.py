"""Every field of every message reaches its table, and the writer fills every column of it.

Three lists are kept by hand and must agree: the wire models' fields (gpuslo/wire/models.py),
the columns of the ``CREATE TABLE`` (ingest/schema.py) and what the writer puts in them
(``to_columns`` in ingest/writer.py). A field added to the model and the DDL but not to the
writer is stored as the column's default (``''``, 0) for every row, and nothing else notices:
the message is valid, the insert succeeds. These tests derive the lists from the models and the
DDL, with no list of their own:

- the writer's columns of each table are the DDL's, less those the store computes itself;
- each leaf of one message of every kind (tests/corpus.py ``base_messages``, which sets every
  field of every model: checked here too) changed to another valid value changes the columns
  written.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pyarrow as pa
import pytest

from gpuslo.ingest.schema import column_types
from gpuslo.ingest.writer import to_columns
from gpuslo.wire import KINDS, WireError, decode, encode
from tests.corpus import _DEFS, _leaves, _resolve, _set, base_messages

T = 1_790_000_000.0
#: Columns the store fills itself (a DEFAULT of the row's arrival, or of its id)
STORE_MADE = frozenset({"ingested_at", "msg_key"})
#: Leaves no other valid value exists for (the wire version, the discriminator)
FIXED = frozenset({("v",), ("kind",)})


def _plain(cols: dict[str, Any]) -> dict[str, list[Any]]:
    return {
        k: v.to_pylist() if isinstance(v, (pa.Array, pa.ChunkedArray)) else list(v) for k, v in cols.items()
    }


def _written(msg: Any) -> dict[str, dict[str, list[Any]]]:
    return {t: _plain(c) for t, c in to_columns([msg]).items()}


def _others(leaf: dict[str, Any], cur: Any) -> list[Any]:
    """Values of ``leaf``'s type other than ``cur``, most likely valid first."""
    leaf = _resolve(leaf)
    if "enum" in leaf:
        return [v for v in leaf["enum"] if v != cur]
    if "const" in leaf:
        return []
    t = leaf.get("type")
    if t == "boolean":
        return [not cur]
    if t == "string":
        return [cur + "x", "x"]
    if t == "integer":
        return [cur + 1, cur - 1]
    if t == "number":
        return [cur / 2, cur * 2, cur + 1, cur - 1, 0.5] if cur else [0.5, 1.0]
    return []


def _paths() -> list[tuple[str, tuple[Any, ...]]]:
    out = []
    for base in base_messages(T):
        obj = json.loads(encode(base))
        for path, leaf in _leaves(_DEFS[type(base).__name__], obj, ()):
            if _resolve(leaf).get("type") not in ("array", "object"):
                out.append((base.kind, path))
    return out


PATHS = _paths()


def test_base_messages_set_every_field_of_every_model() -> None:
    """A field the corpus leaves out is in none of the generated tests (hostile values, bounds,
    the leaves below): each model's every property is in the JSON of one base message."""
    seen: dict[str, set[str]] = {}

    def walk(node: dict[str, Any], obj: Any) -> None:
        while "$ref" in node or "anyOf" in node:
            if "anyOf" in node:  # an optional part: the model it is when set
                node = next(n for n in node["anyOf"] if n.get("type") != "null")
                continue
            name = node["$ref"].rsplit("/", 1)[1]
            seen.setdefault(name, set()).update(obj if isinstance(obj, dict) else ())
            node = _DEFS[name]
        if isinstance(obj, dict) and "properties" in node:
            for k, v in obj.items():
                walk(node["properties"][k], v)
        elif isinstance(obj, list):
            for v in obj:
                walk(node.get("items", {}), v)

    for base in base_messages(T):
        name = type(base).__name__
        obj = json.loads(encode(base))
        seen.setdefault(name, set()).update(obj)
        walk(_DEFS[name], obj)
    assert {m.kind for m in base_messages(T)} == set(KINDS)
    for name, d in _DEFS.items():
        if "properties" in d:
            missing = set(d["properties"]) - seen.get(name, set())
            assert not missing, (
                f"{name}: {sorted(missing)} set in no message of tests/corpus.py base_messages"
            )


@pytest.mark.parametrize("kind", [k for k in KINDS])
def test_the_writer_fills_every_column_of_the_table(kind: str) -> None:
    (base,) = [m for m in base_messages(T) if m.kind == kind]
    for table, cols in to_columns([base]).items():
        ddl = set(column_types(table))
        assert set(cols) <= ddl, (
            f"{table}: the writer makes columns the table lacks: {sorted(set(cols) - ddl)}"
        )
        missing = ddl - STORE_MADE - set(cols)
        assert not missing, (
            f"{table}: columns the writer never fills (each row gets the default): {sorted(missing)}"
        )


@pytest.mark.parametrize(("kind", "path"), PATHS, ids=[f"{k}:{'.'.join(map(str, p))}" for k, p in PATHS])
def test_every_leaf_of_a_message_reaches_its_table(kind: str, path: tuple[Any, ...]) -> None:
    (base,) = [m for m in base_messages(T) if m.kind == kind]
    obj = json.loads(encode(base))
    node: Any = obj
    for p in path:
        node = node[p]
    leaf = dict(_leaves(_DEFS[type(base).__name__], obj, ()))[path]
    before = _written(base)
    for value in _others(leaf, node):
        if isinstance(value, float) and not math.isfinite(value):
            continue
        m = copy.deepcopy(obj)
        _set(m, path, value)
        try:
            changed = decode(json.dumps(m).encode())
        except WireError:
            continue  # not a valid value of this leaf: the next
        assert _written(changed) != before, f"{kind} {'.'.join(map(str, path))}={value!r} is written nowhere"
        return
    assert path in FIXED, f"{kind} {'.'.join(map(str, path))}: no other valid value found to try"

"""The vectorised gpu_samples decoder against the models, which define validity.

Differential: the same raw messages through the Ingestor with and without the fast path must
give the same rows, the same dead letters with the same reasons, the same duplicate count and
the same out-of-order warnings. The inputs are real agent messages and hypothesis-mutated ones
(keys dropped, nulls, wrong types, out-of-range numbers, NaN, long strings, extra keys).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslo.ingest import fastpath
from gpuslo.ingest.pipeline import Ingestor, IngestReport
from gpuslo.ingest.store import Row, Store
from gpuslo.ingest.writer import Raw
from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch, MigInstance, encode
from tests.helpers import T0, env, gpu


class _ColumnsOnly(Store):
    """prepare() is pure: it needs only the store's column conversion, which is the default."""

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        raise AssertionError("no I/O in prepare")

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        raise AssertionError("no I/O in prepare")

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        raise AssertionError("no I/O in prepare")


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v


def _rows(cols: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    names = sorted(cols)
    lists = [
        c.to_pylist() if isinstance(c, (pa.Array, pa.ChunkedArray)) else list(c)
        for c in (cols[n] for n in names)
    ]
    return sorted((tuple(_norm(v) for v in row) for row in zip(*lists, strict=True)), key=repr)


def _both(raws: list[bytes]) -> tuple[Any, Any]:
    items = [Raw(f"t/0/{i}", r) for i, r in enumerate(raws)]
    out = []
    for fast in (True, False):
        ing = Ingestor(_ColumnsOnly(), clock=lambda: T0 + 3600, fast_path=fast)
        p = ing.prepare(items)
        rep: IngestReport = p.report
        out.append(
            (
                {t: _rows(c) for t, c in p.columns.items()},
                sorted(rep.rejected),
                rep.duplicates,
                sorted(rep.warnings),
                sorted((d[1].origin, d[2]) for d in p.dead),
            )
        )
    return out[0], out[1]


def _batch(seq: int, ts: float = T0, node: str = "n1") -> GpuSampleBatch:
    gpus = (
        gpu(0, 0.5, allocs=(("7", 1.0),)),
        gpu(1, None),
        gpu(2, 0.0, allocs=(("8", 0.25), ("9", 0.5))),
        gpu(3, healthy=False),
        GpuSample(
            index=4,
            uuid="GPU-4",
            model="H100",
            fields={"DCGM_FI_DEV_GPU_UTIL": 37.0, "DCGM_FI_DEV_POWER_USAGE": 312.5},
            allocations=(Allocation(scheduler="k8s", id="uid-1", name="ns/pod", queue="ns"),),
        ),
        GpuSample(index=5, uuid="GPU-5", fraction=3 / 7, fields={"DCGM_FI_DEV_POWER_USAGE": 200.0}),
        GpuSample(
            index=5,
            uuid="MIG-5-1",
            fraction=4 / 7,
            mig=MigInstance(gi=1, ci=0, profile="4g.40gb"),
            fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.25},
            allocations=(Allocation(scheduler="k8s", id="uid-2", name="ns/mig", queue="ns"),),
        ),
    )
    e = env(source=node, ts=ts)
    e["seq"] = seq
    return GpuSampleBatch(**e, node=node, pool="gpu", interval_s=10.0, gpus=gpus)


def test_schema_has_exactly_the_models_keys() -> None:
    assert set(fastpath.SCHEMA.names) == set(GpuSampleBatch.model_fields)
    g = fastpath.SCHEMA.field("gpus").type.value_type
    assert {g.field(i).name for i in range(g.num_fields)} == set(GpuSample.model_fields)
    a = g.field("allocations").type.value_type
    assert {a.field(i).name for i in range(a.num_fields)} == set(Allocation.model_fields)
    m = g.field("mig").type
    assert {m.field(i).name for i in range(m.num_fields)} == set(MigInstance.model_fields)


def test_agent_messages_take_the_fast_path_and_give_the_model_rows() -> None:
    raws = [encode(_batch(i, T0 + 10 * i, node=f"n{i % 3}")) for i in range(30)]
    assert all(fastpath.candidate(r) for r in raws)
    d, rest = fastpath.decode(raws)
    assert rest == [] and d.positions == list(range(30))
    fast, slow = _both(raws)
    assert fast == slow
    assert len(fast[0]["gpu_samples"]) == 210


def test_duplicates_and_out_of_order_as_in_the_model_path() -> None:
    raws = [encode(_batch(i, T0 + 10 * i)) for i in range(5)]
    raws += [raws[2], encode(_batch(9, T0 - 50))]
    fast, slow = _both(raws)
    assert fast == slow
    assert fast[2] == 1 and len(fast[3]) == 1


def test_a_bad_message_in_a_block_leaves_the_rest_on_the_fast_path() -> None:
    raws = [encode(_batch(i, T0 + 10 * i)) for i in range(100)]
    raws[37] = raws[37].replace(b'"uuid":"GPU-1"', b'"uuid":1', 1)  # Arrow refuses the block
    raws[60] = raws[60].replace(b'"interval_s":10.0', b'"interval_s":-1.0', 1)  # Arrow parses; a check fails
    _, rest = fastpath.decode(raws)
    assert 37 in rest and 60 in rest and len(rest) <= 2 * 16
    fast, slow = _both(raws)
    assert fast == slow
    assert [o for o, _ in fast[1]] == ["t/0/37", "t/0/60"]


_ODD = st.sampled_from(
    [None, "", "x" * 300, "slurm", "1.5", -1, 0, 1, 1024, 2**70, -0.5, 0.5, 1.5, 1e13, float("nan"),
     float("inf"), True, False, [], {}, [1], {"k": 1}]
)  # fmt: skip


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(obj: Any, path: tuple[Any, ...], op: str, value: Any) -> None:
    *head, last = path
    parent = obj
    for p in head:
        parent = parent[p]
    if op == "drop" and isinstance(parent, dict):
        del parent[last]
    elif op == "extra" and isinstance(parent, dict):
        parent["unexpected"] = value
    else:
        parent[last] = value


def mutated(data: st.DataObject) -> list[bytes]:
    """Six agent messages, each mutated 0-2 times, and maybe one replayed."""
    raws: list[bytes] = []
    for i in range(6):
        obj = json.loads(encode(_batch(i, T0 + 10 * i, node="n1" if i % 2 else "n2")))
        for _ in range(data.draw(st.integers(0, 2))):
            path = data.draw(st.sampled_from(_paths(obj)))
            op = data.draw(st.sampled_from(["set", "drop", "extra"]))
            _mutate(obj, path, op, data.draw(_ODD))
        raws.append(json.dumps(obj, separators=(",", ":"), allow_nan=True).encode())
    if data.draw(st.booleans()):
        raws.append(raws[data.draw(st.integers(0, len(raws) - 1))])  # a replayed message
    return raws


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_messages_agree_with_the_models(data: st.DataObject) -> None:
    fast, slow = _both(mutated(data))
    assert fast == slow


def test_known_traps_agree_with_the_models() -> None:
    good = encode(_batch(0))
    traps = [
        good.replace(b'"share":0.25', b'"share":0.75', 1),  # two holders, 1.25 GPUs: refused
        good.replace(b'"model":"H100"', b'"model":null', 1),  # explicit null: refused, not defaulted
        good.replace(b'"DCGM_FI_DEV_POWER_USAGE":312.5', b'"DCGM_FI_DEV_POWER_USAGE":NaN', 1),
        good.replace(
            b'"DCGM_FI_DEV_POWER_USAGE":312.5', b'"DCGM_FI_DEV_POWER_USAGE":"312.5"', 1
        ),  # strict: refused
        good.replace(b'"DCGM_FI_DEV_GPU_UTIL":37.0', b'"DCGM_FI_DEV_GPU_UTIL":1e12', 1),
        good + good,  # two objects in one message
        good.replace(b'"index":4', b'"index":4.0', 1),
        good.replace(b'"v":1', b'"v":2', 1),
        good.replace(b'"v":1', b'"v":true', 1),  # equal to 1 in Python: refused by both (tests/test_wire.py)
        good.replace(b'"v":1', b'"v":1.0', 1),
        good.replace(b',"pool":"gpu"', b"", 1),  # absent: default ""
        good.replace(b'"healthy":true,', b"", 1),  # absent: default True
        good.replace(b'"gi":1,', b"", 1),  # a MIG instance without its id
        good.replace(b'"gi":1,', b'"gi":300,', 1),
        good.replace(b'"mig":{', b'"mig":{"extra":1,', 1),
        good.replace(
            b'"fraction":0.5714285714285714', b'"fraction":0.0', 1
        ),  # an instance holds some of the GPU
        b"\xff\xfe garbage",
        good.replace(b'"seq":0,', b'"seq":9223372036854775808,', 1),  # past int64: the models take it
        good.replace(b'"seq":0,', b'"seq":18446744073709551616,', 1),  # past UInt64: refused
        good.replace(b'"index":4', b'"index":3', 1),  # GPU 3 twice: refused
        good.replace(b'"gi":1', b'"gi":0', 1),  # another MIG instance id: still one row per (index, gi, ci)
        good.replace(b'"healthy":true', b'"healthy":"yes"', 1),  # strict: refused by both
        good.replace(b'"interval_s":10.0', b'"interval_s":10', 1),  # an int where a float is: accepted
        good.replace(b'"interval_s":10.0', b'"interval_s":"10"', 1),
        good.replace(b'"fraction":0.42857142857142855', b'"fraction":1.0', 1),  # GPU 5's rows: 1 + 4/7
        good.replace(b'"fraction":0.42857142857142855', b'"fraction":0.4', 1),  # 0.4 + 4/7 < 1: accepted
        # the measured split of a shared GPU (holders 8 and 9 hold 0.25 and 0.5)
        good.replace(
            b'"share":0.25,"share_source":""',
            b'"share":0.25,"activity_share":0.75,"share_source":"measured"',
            1,
        ).replace(
            b'"share":0.5,"share_source":""', b'"share":0.5,"activity_share":0.0,"share_source":"measured"', 1
        ),
        good.replace(
            b'"share":0.25,"share_source":""', b'"share":0.25,"activity_share":0.75', 1
        ),  # 0.75 + 0.5: refused
        good.replace(
            b'"share":0.25,"share_source":""', b'"share":0.25,"fb_share":0.6', 1
        ),  # 0.6 + 0.5: refused
        good.replace(
            b'"share":0.25,"share_source":""', b'"share":0.25,"fb_share":0.4,"activity_share":null', 1
        ),
        good.replace(b'"share":0.25,"share_source":""', b'"share":0.25,"activity_share":-0.1', 1),
        good.replace(b'"share":0.25,"share_source":""', b'"share":0.25,"activity_share":NaN', 1),
        good.replace(b'"share":0.25,"share_source":""', b'"share":0.25,"fb_share":"0.1"', 1),
        good.replace(b'"share":0.25,"share_source":""', b'"share":0.25,"share_source":"guessed"', 1),
        good.replace(b'"share":0.25,"share_source":""', b'"share":0.25,"share_source":null', 1),
        good.replace(b'"share":0.25,"share_source":""', b'"share":0.25', 1),  # absent: ""
    ]
    for i, t in enumerate(traps):
        fast, slow = _both([encode(_batch(100 + i, T0 + 1)), t])
        assert fast == slow, (i, t[:80])
    # names counted in characters, as the models count them, at the 256 edge in every UTF-8 width
    for where, key in (((), "node"), ((), "pool"), (("gpus", 0), "uuid"), (("gpus", 0), "model"),
                       (("gpus", 0, "allocations", 0), "user")):  # fmt: skip
        for ch in ("x", "\u00e9", "\u20ac", "\U0001f600"):
            for n in (0, 1, 255, 256, 257):
                obj = json.loads(good)
                parent = obj
                for k in where:
                    parent = parent[k]
                parent[key] = ch * n
                fast, slow = _both(
                    [encode(_batch(998, T0 + 1)), json.dumps(obj, ensure_ascii=False).encode()]
                )
                assert fast == slow, (where, key, ch, n)
                # and a valid one stays on the fast path whatever its bytes (its refusals go to the models)
                valid = 0 < n <= 256 or (n == 0 and key in ("pool", "model", "user"))
                _, rest = fastpath.decode([json.dumps(obj, ensure_ascii=False).encode()])
                assert (not rest) == valid, (where, key, ch, n)
    many = json.loads(good)
    many["gpus"] = [dict(many["gpus"][0], index=k % 1024, uuid=f"G{k}") for k in range(1025)]
    allocs = json.loads(good)
    allocs["gpus"][0]["allocations"] = [dict(allocs["gpus"][0]["allocations"][0], share=0.01)] * 65
    for obj in (many, allocs):
        fast, slow = _both([encode(_batch(999, T0 + 1)), json.dumps(obj).encode()])
        assert fast == slow and len(fast[1]) == 1


# bytes that are not UTF-8: a lone byte over 0x7f, a continuation byte alone, a sequence cut
# short, an overlong encoding, a UTF-16 surrogate, a code point past U+10FFFF
_NOT_UTF8 = (b"\xff", b"\x80", b"\xe9x", b"\xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80")


_STRINGS = (b'"n1"', b'"pool":"gpu"', b'"cluster":"', b'"boot_id":"', b'"uuid":"', b'"model":"', b'"id":"7"',
            b'"user":"', b'"source":"')  # fmt: skip


@pytest.mark.parametrize("bad", _NOT_UTF8)
@pytest.mark.parametrize("needle", _STRINGS)
def test_bytes_that_are_not_utf8_go_to_the_models_in_any_string(needle: bytes, bad: bytes) -> None:
    """Arrow's JSON reader stores a string's bytes unchecked: a message that is not UTF-8 in any
    string goes to the models, which refuse it, and the rest of its block stays on the fast path
    (it once stored a uuid that was not text, or raised reading a node's name back)."""
    good = encode(_batch(0))
    assert needle in good, needle
    raw = good.replace(needle, needle[:-1] + bad + needle[-1:], 1)  # inside the string, at its end
    assert fastpath.candidate(good) and not fastpath.candidate(raw)
    others = [encode(_batch(k, T0 + 10 * k)) for k in range(1, 4)]
    fast, slow = _both([*others, raw])
    assert fast == slow
    assert len(fast[1]) == 1 and "not UTF-8" in fast[1][0][1], fast[1]


def test_a_table_in_slices_or_chunks_gives_the_rows_of_the_whole() -> None:
    """The checks and the columns read the ``gpus`` column as it is (a slice of a larger table,
    several chunks): each view gives exactly the verdicts and rows of its part of the whole."""
    raws = [encode(_batch(i, T0 + 10 * i, node=f"n{i % 3}")) for i in range(40)]
    raws[7] = raws[7].replace(b'"index":2', b'"index":4096', 1)  # refused by the checks
    tables: list[pa.Table] = []
    fastpath._parse(raws, 0, len(raws), tables, [], [])
    (whole,) = tables
    ok = fastpath._valid(whole)
    assert not ok[7] and ok.sum() == 39

    def rows(t: pa.Table) -> list[tuple[Any, ...]]:
        return _rows(fastpath.columns(fastpath.decoded(list(range(t.num_rows)), t)))

    def joined(parts: list[list[tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
        return sorted((r for p in parts for r in p), key=repr)  # the order of _rows

    per_batch = [rows(whole.slice(i, 1)) for i in range(whole.num_rows)]
    assert joined(per_batch) == rows(whole)
    for a, b in ((0, 1), (3, 11), (7, 8), (20, 40), (39, 40)):
        part = whole.slice(a, b - a)
        assert part["gpus"].num_chunks == 1 and part["gpus"].chunk(0).offset == a
        assert fastpath._valid(part).tolist() == ok[a:b].tolist()
        assert rows(part) == joined(per_batch[a:b])
        chunked = pa.concat_tables([whole.slice(0, a), part, whole.slice(b)])
        assert chunked["gpus"].num_chunks == 3
        assert fastpath._valid(chunked).tolist() == ok.tolist()
        assert rows(chunked) == rows(whole)

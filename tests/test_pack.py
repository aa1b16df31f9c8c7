"""Packs (gpuslo.wire.pack, ingest/packed.py) against the models, which define validity.

Differential: the same batches sent one JSON message each and sent as a pack must give the
same rows, the same rejections with the same reasons and the same replay counts. The batches
are the fast path's test batches, hypothesis-mutated the same way; whatever the packer refuses
stays JSON where it stands. A pack that is not well formed (truncated, bytes flipped, a header
that lies) is refused whole with a reason, never a traceback.
"""

from __future__ import annotations

import json
import random
import re
import struct
from typing import Any

import orjson
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslo.agent.kafka_sink import PACK_SOURCE_BYTES, messages
from gpuslo.agent.spool import Record
from gpuslo.ingest import packed
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.writer import Raw
from gpuslo.wire import encode
from gpuslo.wire import pack as P
from tests.helpers import T0
from tests.test_fastpath import _batch, _ColumnsOnly, _rows, mutated


def _prepare(items: list[Raw], fast: bool = True) -> Any:
    ing = Ingestor(_ColumnsOnly(), clock=lambda: T0 + 3600, fast_path=fast)
    return ing.prepare(items)


def _outcome(p: Any, where: dict[str, str]) -> tuple[Any, ...]:
    """Rows, rejections, dead letters and replays, with each origin named by its batch."""
    rep = p.report
    return (
        {t: _rows(c) for t, c in p.columns.items()},
        sorted((where.get(o, o), r) for o, r in rep.rejected),
        rep.duplicates,
        sorted((where.get(d[1].origin, d[1].origin), d[2]) for d in p.dead),
    )


def _as_json(raws: list[bytes]) -> tuple[Any, ...]:
    items = [Raw(f"m/{i}", r) for i, r in enumerate(raws)]
    return _outcome(_prepare(items, fast=False), {})


def _as_pack(raws: list[bytes], fast: bool = True) -> tuple[tuple[Any, ...], list[int]]:
    value, took = P.pack(raws)
    items = [Raw("pack", value)] * bool(took) + [
        Raw(f"m/{i}", r) for i, r in enumerate(raws) if i not in took
    ]
    where = {f"pack#{k}": f"m/{i}" for k, i in enumerate(took)}
    return _outcome(_prepare(items, fast), where), took


def test_agent_batches_pack_and_give_the_json_rows() -> None:
    raws = [encode(_batch(i, T0 + 10 * i, node=f"n{i % 3}")) for i in range(40)]
    value, took = P.pack(raws)
    assert took == list(range(40))
    assert len(value) < sum(map(len, raws))  # 0.6x here (sparse fields); 0.36x for the simulated fleet
    u = packed.unpack(value)
    assert u.table.num_rows == 40 and u.digest == [P.digest(r) for r in raws]
    got, _ = _as_pack(raws)
    assert got == _as_json(raws)
    assert len(got[0]["gpu_samples"]) == 7 * 40
    p = _prepare([Raw("pack", value)])
    assert p.report.vectorised == 40 and p.report.received == 40


def test_the_models_decide_a_pack_without_the_fast_path() -> None:
    raws = [encode(_batch(i, T0 + 10 * i)) for i in range(5)]
    assert _as_pack(raws, fast=False)[0] == _as_json(raws)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_batches_agree_with_the_models(data: st.DataObject) -> None:
    raws = mutated(data)
    got, _ = _as_pack(raws)
    assert got == _as_json(raws)


def test_values_the_checks_refuse_are_explained_by_the_models() -> None:
    good = encode(_batch(0))
    bad = [
        good.replace(b'"share":0.25', b'"share":0.75', 1),  # two holders, 1.25 GPUs
        good.replace(b'"index":4', b'"index":3', 1),  # GPU 3 twice
        good.replace(b'"gi":1,', b'"gi":300,', 1),
        good.replace(b'"v":1', b'"v":2', 1),
        good.replace(b'"interval_s":10.0', b'"interval_s":-1.0', 1),
        good.replace(b'"DCGM_FI_DEV_GPU_UTIL":37.0', b'"DCGM_FI_DEV_GPU_UTIL":1e12', 1),
        good.replace(b'"share":0.25,"share_source":""', b'"share":0.25,"share_source":"guessed"', 1),
        good.replace(b'"seq":0,', b'"seq":-3,', 1),
        good.replace(b'"ts":', b'"ts":1e3,"x":', 1),  # an unknown key: the packer leaves it JSON
    ]
    raws = [encode(_batch(100 + i, T0 + 1 + i)) for i in range(3)]
    for i, b in enumerate(bad):
        raws.append(b.replace(b'"seq":0,', f'"seq":{200 + i},'.encode(), 1))
    got, took = _as_pack(raws)
    assert got == _as_json(raws)
    assert len(took) == len(raws) - 2  # the extra key; the implausible field value (the models name it)
    assert len(got[1]) == len(bad) and all(r.startswith("invalid gpu_samples") or "v" in r for _, r in got[1])
    p = _prepare([Raw("pack", P.pack(raws)[0])])
    kept = [orjson.loads(d[1].value) for d in p.dead]  # a refused batch's dead letter is its JSON
    assert all(k["kind"] == "gpu_samples" and k["node"] == "n1" for k in kept)


def test_a_batch_sent_as_json_then_in_a_pack_is_a_replay() -> None:
    """An agent restarted mid-drain sends again, packed, what the broker already had as JSON."""
    raws = [encode(_batch(i, T0 + 10 * i)) for i in range(10)]
    ing = Ingestor(_ColumnsOnly(), clock=lambda: T0 + 3600)
    first = ing.prepare([Raw(f"m/{i}", r) for i, r in enumerate(raws[:6])])
    again = ing.prepare([Raw("pack", P.pack(raws)[0])])
    assert first.report.accepted == 6
    assert again.report.duplicates == 6 and again.report.accepted == 4 and not again.dead
    assert len(_rows(again.columns["gpu_samples"])) == 4 * 7
    # and a different batch under a taken id is a conflict, dead-lettered, in either form
    other = encode(_batch(3, T0 + 999))
    late = ing.prepare([Raw("pack2", P.pack([other])[0])])
    assert late.report.n_rejected == 1 and "conflicting message" in late.dead[0][2]


def _pack_of(n: int) -> bytes:
    return P.pack([encode(_batch(i, T0 + 10 * i)) for i in range(n)])[0]


def _refused_whole(value: bytes) -> str:
    p = _prepare([Raw("pack", value)])
    assert p.report.received == 1 and p.report.n_rejected == 1 and not p.columns
    assert p.dead[0][1].value == value  # the pack's own bytes, for the record
    return p.dead[0][2]


def _header(value: bytes) -> dict[str, Any]:
    hlen = struct.unpack_from("<I", value, 8)[0]
    return orjson.loads(value[12 : 12 + hlen])


def _with_header(value: bytes, h: dict[str, Any]) -> bytes:
    """The pack with another header, its buffers re-laid out on 8-byte boundaries."""
    hlen = struct.unpack_from("<I", value, 8)[0]
    old = _header(value)
    at, bufs = 12 + hlen, []
    for _, size in old["buffers"]:
        at += -at % 8
        bufs.append(value[at : at + size])
        at += size
    head = orjson.dumps(h)
    out = bytearray(value[:8] + struct.pack("<I", len(head)) + head)
    for b in bufs:
        out += b"\0" * (-len(out) % 8) + b
    return bytes(out)


def test_malformed_packs_are_refused_whole_with_a_reason() -> None:
    good = _pack_of(4)
    h = _header(good)
    cases = {
        b"GSPK": "at least",
        good[:4] + b"\x02" + good[5:]: "unsupported pack version 2",
        good[:-1]: "runs past",
        good + b"\0" * 8: "after the pack's last buffer",
        good[:8] + struct.pack("<I", 10**9) + good[12:]: "does not fit",
        _with_header(good, {**h, "batches": 5}): "bytes for 5 values",
        _with_header(good, {**h, "gpus": -1}): "integer in",
        _with_header(good, {**h, "fields": [*h["fields"], "DCGM_FI_NOT_A_FIELD"]}): "unknown field",
        _with_header(good, {**h, "extra": 1}): "expected exactly",
        _with_header(good, {**h, "buffers": h["buffers"][::-1]}): "not the ones of this version",
    }
    for value, why in cases.items():
        assert why in _refused_whole(value), why


def _buffer_at(value: bytes, name: str) -> tuple[int, int]:
    h = _header(value)
    at = 12 + struct.unpack_from("<I", value, 8)[0]
    for n, size in h["buffers"]:
        at += -at % 8
        if n == name:
            return at, size
        at += size
    raise KeyError(name)


def test_offsets_utf8_and_booleans_are_checked() -> None:
    good = bytearray(_pack_of(3))
    at, _ = _buffer_at(bytes(good), "node.off")
    bad_off = bytearray(good)
    bad_off[at + 4 : at + 8] = struct.pack("<i", 10**6)
    assert "offsets must rise" in _refused_whole(bytes(bad_off))
    at, _ = _buffer_at(bytes(good), "uuid.data")
    bad_utf8 = bytearray(good)
    bad_utf8[at] = 0xFF
    assert "uuid" in _refused_whole(bytes(bad_utf8))
    at, _ = _buffer_at(bytes(good), "healthy")
    bad_bool = bytearray(good)
    bad_bool[at] = 2
    assert "a byte other than 0 or 1" in _refused_whole(bytes(bad_bool))


def test_offsets_are_joined_exactly_and_a_fall_anywhere_is_refused() -> None:
    """``_cat_offsets`` against a plain reference over random parts, empty ones included (a
    pack's strings of no rows: offsets [0]); a part whose offsets fall, wherever it stands, is
    refused with the buffer's name (its ends alone are checked per pack, ``_offsets``)."""
    import numpy as np

    rng = random.Random(11)
    for trial in range(300):
        parts = []
        for _ in range(rng.randint(0, 6)):
            lengths = [rng.choice((0, 0, 1, 3, 40)) for _ in range(rng.choice((0, 1, 2, 7, 50)))]
            parts.append(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype("<i4"))
        want, base = [0], 0
        for o in parts:
            want += [int(x) + base for x in o[1:]]
            base += int(o[-1])
        got = packed._cat_offsets(parts, "x.off")
        assert got.dtype == np.dtype("<i4") and got.tolist() == want, trial
        falls = [k for k, o in enumerate(parts) if len(o) > 2]
        if falls:  # one interior offset made to fall below the one before it
            k = rng.choice(falls)
            bad = parts[k].copy()
            i = rng.randrange(1, len(bad) - 1)
            bad[i] = bad[i - 1] - 1 if rng.random() < 0.5 else bad[-1] + 1
            if bad[i] < bad[i - 1] or bad[i + 1] < bad[i]:
                with pytest.raises(packed.PackError, match=r"pack buffer x\.off: offsets must rise"):
                    packed._cat_offsets([*parts[:k], bad, *parts[k + 1 :]], "x.off")


def test_strings_beyond_ascii_and_bad_bytes_among_many_packs() -> None:
    """Read together, each pack is decided as it is alone: UTF-8 beyond ASCII is kept as sent
    (the whole column then checked value by value), a byte that is not UTF-8 or offsets that
    fall refuse that pack alone, with the column or buffer named, and the others are read."""
    good = _pack_of(3)
    wide = P.pack([encode(_batch(i, T0 + 10 * i, node="nœud-ü1")) for i in range(2)])[0]
    assert "nœud-ü1" in packed.unpack(wide).table.column("node").to_pylist()
    at, _ = _buffer_at(good, "uuid.data")
    not_utf8 = good[:at] + b"\xc3(" + good[at + 2 :]  # a lead byte, then no continuation
    at, _ = _buffer_at(good, "uuid.off")
    falls = good[: at + 4] + struct.pack("<i", 10**6) + good[at + 8 :]
    values = [good, wide, not_utf8, falls, wide, good]
    many = packed.unpack_many(values)
    assert many.outcome[:2] == [3, 2] and many.outcome[4:] == [2, 3]
    assert isinstance(many.outcome[2], packed.PackError) and "pack column uuid" in str(many.outcome[2])
    assert isinstance(many.outcome[3], packed.PackError)
    assert "pack buffer uuid.off: offsets must rise" in str(many.outcome[3])
    for got, v in zip(many.outcome, values, strict=True):
        if isinstance(got, Exception):
            with pytest.raises(packed.PackError) as alone:
                packed.unpack(v)
            assert str(alone.value) == str(got)
    kept = [packed.unpack(v).table for v in (good, wide, wide, good)]
    assert many.table.to_pylist() == pa.concat_tables(kept).to_pylist()


def test_every_corruption_ends_refused_or_accounted_never_raised() -> None:
    """Random byte flips and truncations of a pack: each batch is written, refused with a
    reason, or the whole pack is; nothing raises."""
    rng = random.Random(7)
    good = _pack_of(6)
    for _ in range(400):
        v = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            v[rng.randrange(len(v))] = rng.randrange(256)
        if rng.random() < 0.2:
            v = v[: rng.randrange(len(v))]
        p = _prepare([Raw("pack", bytes(v))])
        rep = p.report
        assert rep.accepted + rep.n_rejected + rep.duplicates == rep.received
        assert all(
            re.match(r"(invalid|pack|conflicting|cannot|ts |not JSON|not UTF-8)", r) for _, r in rep.rejected
        ), rep.rejected


def test_packs_read_together_are_what_each_gives_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ingest reads a call's packs at once (each Arrow array built once for all): the
    table, the digests and each pack's refusal must be what reading each alone gives. The
    packs carry different DCGM fields (a field one carries is absent in another's rows);
    among them, packs with invalid UTF-8 (found only when the strings become Arrow, so the
    others are read again alone), broken offsets, a bad boolean and random corruption."""
    rng = random.Random(11)
    kinds = [_pack_of(3), _pack_of(1)]
    only_power = P.pack(
        [encode(_batch(50 + i, T0 + i, node="p")).replace(b"GPU_UTIL", b"MEM_CLOCK") for i in range(4)]
    )
    kinds.append(only_power[0])
    bad = []
    for name, at_byte in (("uuid.data", 0xFF), ("node.data", 0xC3), ("healthy", 2)):
        v = bytearray(_pack_of(2))
        at, _ = _buffer_at(bytes(v), name)
        v[at] = at_byte
        bad.append(bytes(v))
    v = bytearray(_pack_of(2))
    at, _ = _buffer_at(bytes(v), "model.off")
    v[at + 4 : at + 8] = struct.pack("<i", 10**6)
    bad.append(bytes(v))
    for _ in range(30):
        v = bytearray(_pack_of(3))
        for _ in range(rng.randint(1, 3)):
            v[rng.randrange(len(v))] = rng.randrange(256)
        bad.append(bytes(v))
    built: list[int] = []
    table_of = packed._table

    def counted(parts: Any) -> Any:
        built.append(len(parts))
        return table_of(parts)

    monkeypatch.setattr(packed, "_table", counted)
    for trial in range(60):
        pool = kinds if trial % 2 else kinds * 10 + bad  # every other call well formed throughout
        values = [rng.choice(pool) for _ in range(rng.randint(1, 8))]
        built.clear()
        many = packed.unpack_many(values)
        if all(v in kinds for v in values):  # all well formed: one table built for all
            assert built == [len(values)], trial
        alone: list[Any] = []
        for v in values:
            try:
                alone.append(packed.unpack(v))
            except Exception as exc:
                alone.append(exc)
        assert [type(x) for x in many.outcome] == [
            int if isinstance(a, packed.Unpacked) else type(a) for a in alone
        ]
        for got, a in zip(many.outcome, alone, strict=True):
            if isinstance(a, packed.Unpacked):
                assert got == a.table.num_rows
            else:
                assert str(got) == str(a), trial
        good = [a for a in alone if isinstance(a, packed.Unpacked)]
        assert many.digest == [d for a in good for d in a.digest]
        expect = pa.concat_tables([a.table for a in good]) if good else packed.SCHEMA.empty_table()
        assert many.table.to_pylist() == expect.to_pylist(), trial


def test_the_packer_leaves_what_it_cannot_carry_as_json() -> None:
    good = json.loads(encode(_batch(0)))
    odd = [
        dict(good, pool=1),
        dict(good, seq=2**63),  # past int64: the models take it, the pack cannot
        dict(good, gpus=[dict(good["gpus"][0], index=4.0)]),  # strict: an int must be an int
        dict(good, gpus=[dict(good["gpus"][0], healthy=1)]),
        dict(good, gpus=[dict(good["gpus"][0], mig=None)]),
        dict(good, gpus=[dict(good["gpus"][0], fields={"DCGM_FI_UNKNOWN": 1.0})]),
        dict(good, kind="heartbeat"),
    ]
    raws = [orjson.dumps(o) for o in odd] + [b"not json", b"[1]"]
    assert P.pack(raws)[1] == []
    assert P.pack([*raws, encode(_batch(5))])[1] == [len(raws)]


def test_the_drain_packs_a_nodes_batches_between_its_other_records() -> None:
    gpu, other = "gpuslo.gpu_samples", "gpuslo.heartbeat"
    recs: list[Record] = []
    for i in range(30):  # a tick: the batch, then the heartbeat (as the agent spools them)
        recs.append(Record(gpu, b"n1", encode(_batch(i, T0 + 10 * i)), 0.0))
        recs.append(Record(other, b"n1", b'{"kind":"heartbeat"}', 0.0))
    recs.insert(11, Record(gpu, b"n1", b'{"kind":"gpu_samples","oops":1}', 0.0))  # not packable
    recs += [Record(gpu, b"n2", encode(_batch(100 + i, T0)), 0.0) for i in range(3)]  # too few
    out = messages(recs, gpu, pack_min=4)
    assert sorted(i for part, _ in out for i in part) == list(range(len(recs)))
    assert [part[0] for part, _ in out] == sorted(part[0] for part, _ in out)
    packs = [(part, r) for part, r in out if len(part) > 1]
    assert [len(p) for p, _ in packs] == [6, 24]  # the batches before and after the odd one
    for part, r in out:
        if len(part) == 1:
            assert r.value == recs[part[0]].value
        else:
            assert packed.unpack(r.value).digest == [P.digest(recs[i].value) for i in part]
    assert messages(recs, gpu, pack_min=0) == [([i], r) for i, r in enumerate(recs)]


def test_packs_are_bounded_by_a_request() -> None:
    gpu = "gpuslo.gpu_samples"
    big = [Record(gpu, b"n1", encode(_batch(i, T0 + 10 * i)), 0.0) for i in range(2000)]
    out = messages(big, gpu, pack_min=16)
    assert sum(len(p) for p, _ in out) == 2000 and all(len(p) > 1 for p, _ in out)
    assert all(len(r.value) <= 1_048_576 - 128 for _, r in out)
    assert all(sum(len(big[i].value) for i in p) <= PACK_SOURCE_BYTES for p, _ in out)


class _Recording(_ColumnsOnly):
    def __init__(self) -> None:
        self.inserts: list[tuple[str, int]] = []

    def execute(self, sql: str, params: Any = None) -> None:
        pass

    def query(self, sql: str, params: Any = None) -> list[Any]:
        return []

    def insert(self, table: str, columns: Any) -> int:
        n = len(next(iter(columns.values())))
        self.inserts.append((table, n))
        return n


class _Polled:
    """kafka-python's consumer as KafkaIngest uses it, holding one partition's records, all of
    which its first poll returns (as a large fetch does)."""

    def __init__(self, values: list[bytes]) -> None:
        from kafka.structs import TopicPartition

        self.tp = TopicPartition("gpuslo.gpu_samples", 0)
        self.records = [
            type("R", (), {"topic": self.tp.topic, "partition": 0, "offset": i, "value": v})()
            for i, v in enumerate(values)
        ]
        self.commits: list[int] = []

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        pass

    def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        got, self.records = self.records[:max_records], self.records[max_records:]
        return {self.tp: got} if got else {}

    def commit(self, offsets: dict[Any, Any], timeout_ms: Any = None) -> None:
        self.commits.append(offsets[self.tp].offset)

    def assignment(self) -> set[Any]:
        return {self.tp}

    def end_offsets(self, tps: list[Any], timeout_ms: Any = None) -> dict[Any, int]:
        return {self.tp: 0}

    def position(self, tp: Any, timeout_ms: Any = None) -> int:
        return 0

    def close(self, timeout_ms: Any = None) -> None:
        pass


def test_the_consumer_bounds_a_batch_in_bytes_and_commits_each_prefix() -> None:
    from gpuslo.core.settings import IngestSettings, KafkaSettings
    from gpuslo.ingest.kafka_consumer import KafkaIngest

    values = [
        P.pack([encode(_batch(k * 1000 + i, T0 + k * 1000 + i)) for i in range(600)])[0] for k in range(8)
    ]
    assert all(400_000 < len(v) < 1 << 20 for v in values)
    store = _Recording()
    c = _Polled(values)
    ing = KafkaIngest(KafkaSettings(), IngestSettings(batch_bytes=1 << 20, batch_s=0.2, metrics_port=0), store,
                      consumer_factory=lambda **_: c)  # fmt: skip
    ing.ingestor.clock = lambda: T0 + 3600
    while c.records or ing._pending:
        ing.step()
    ing.flush()
    rows = [n for t, n in store.inserts if t == "gpu_samples"]
    assert sum(rows) == 8 * 600 * 7 and len(rows) >= 3  # at most ~1 MiB of packs per insert
    assert c.commits == sorted(c.commits) and c.commits[-1] == 8
    ing.close()


@pytest.mark.parametrize("batch_mib", [1, 2, 3])
def test_a_poll_asks_for_about_the_records_a_batch_has_room_for(batch_mib: int) -> None:
    """kafka-python decompresses only the records a poll returns: the ingest asks each poll for
    about as many as the batch's bytes left hold (by the last poll's mean size; one before any
    was read), so what it holds decompressed is about one batch, whatever the backlog fetched
    (before: the first poll took every pack of the backlog, up to ``max_poll_records``)."""
    from gpuslo.core.settings import IngestSettings, KafkaSettings
    from gpuslo.ingest.kafka_consumer import KafkaIngest

    values = [
        P.pack([encode(_batch(k * 1000 + i, T0 + k * 1000 + i)) for i in range(600)])[0] for k in range(24)
    ]
    size = max(len(v) for v in values)
    store = _Recording()
    c = _Polled(values)
    asked: list[int] = []
    held: list[int] = []
    poll = c.poll

    def counted(timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        asked.append(max_records)
        held.append(sum(len(r.value) for r in ing._pending))
        return poll(timeout_ms, max_records)

    c.poll = counted  # type: ignore[method-assign]
    batch_bytes = batch_mib << 20
    ing = KafkaIngest(KafkaSettings(), IngestSettings(batch_bytes=batch_bytes, batch_s=0.2, metrics_port=0), store,
                      consumer_factory=lambda **_: c)  # fmt: skip
    ing.ingestor.clock = lambda: T0 + 3600
    while c.records or ing._pending:
        ing.step()
        held.append(sum(len(r.value) for r in ing._pending))
    ing.flush()
    assert asked[0] == 1  # nothing read yet: one record, then by its size
    assert max(asked) <= -(-batch_bytes // min(len(v) for v in values))
    # never more than a batch and the records of one poll's estimate error
    assert max(held) <= batch_bytes + 2 * size
    rows = [n for t, n in store.inserts if t == "gpu_samples"]
    assert sum(rows) == 24 * 600 * 7 and c.commits[-1] == 24
    ing.close()


def test_idle_exit_waits_for_a_backlog_held_or_written_slowly() -> None:
    """``run(idle_exit_s)`` (a backfill's exit) leaves only when nothing is left: a step that read
    nothing because it still held whole batches (a poll of small messages then large ones took
    several), while the store took its time writing them, is not idle (found by the attack of
    session 17: 33 of 41 messages were never read)."""
    import time

    from gpuslo.core.settings import IngestSettings, KafkaSettings
    from gpuslo.ingest.kafka_consumer import KafkaIngest

    values = [encode(_batch(10**6, T0 + 10**6))] + [
        P.pack([encode(_batch(k * 1000 + i, T0 + k * 1000 + i)) for i in range(600)])[0] for k in range(12)
    ]

    class Capped(_Polled):
        def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
            return super().poll(timeout_ms, min(max_records, 8))  # what one fetch held

    class Slow(_Recording):
        def insert(self, table: str, columns: Any) -> int:
            time.sleep(0.3)
            return super().insert(table, columns)

    c, store = Capped(values), Slow()
    ing = KafkaIngest(KafkaSettings(), IngestSettings(batch_bytes=1 << 20, batch_s=0.2, metrics_port=0), store,
                      consumer_factory=lambda **_: c)  # fmt: skip
    ing.ingestor.clock = lambda: T0 + 10**7
    ing.run(idle_exit_s=0.5)
    assert not c.records and c.commits[-1] == len(values)
    assert sum(n for t, n in store.inserts if t == "gpu_samples") == 7 + 12 * 600 * 7


def test_a_batch_the_store_refuses_is_isolated_out_of_its_pack() -> None:
    """The store refuses any insert holding node 'bad': the pack is written batch by batch, and
    only that batch becomes a dead letter (its JSON, under its own origin)."""
    from gpuslo.ingest.store import Failure, StoreError

    class Refusing(_Recording):
        def insert(self, table: str, columns: Any) -> int:
            nodes = columns["node"] if table == "gpu_samples" else []
            if "bad" in (nodes.to_pylist() if hasattr(nodes, "to_pylist") else nodes):
                raise StoreError("Code: 53. Type mismatch", Failure.REFUSED, 53)
            if table == "dead_letters":
                self.dead = list(zip(columns["origin"], columns["raw"], strict=True))
            return super().insert(table, columns)

    store = Refusing()
    ing = Ingestor(store, clock=lambda: T0 + 3600)
    value, _ = P.pack([encode(_batch(i, T0 + i, node=n)) for i, n in enumerate(["a", "bad", "c"])])
    rep = ing.ingest_or_isolate([Raw("t/0/5", value)])
    assert (rep.received, rep.accepted, rep.n_rejected, rep.dead_lettered) == (3, 2, 1, 1)
    assert [n for t, n in store.inserts if t == "gpu_samples"] == [7, 7]
    ((origin, raw),) = store.dead
    assert origin == "t/0/5#1" and orjson.loads(raw)["node"] == "bad"


def test_the_pack_carries_exactly_the_models_keys() -> None:
    """The packer's key sets (gpuslo/wire/pack.py) are kept by hand beside the models: a key it
    does not know makes every record that has it NotPackable, sent as JSON. A field added to the
    models and the fast path's schema alone already fails the pack tests above (ingest/packed.py
    builds its structs from the fast path's), but by their effects; this says which list."""
    from gpuslo.wire.models import Allocation, GpuSample, GpuSampleBatch, MigInstance

    assert set(P._ENVELOPE_KEYS) == set(GpuSampleBatch.model_fields)
    assert set(P._GPU_KEYS) == set(GpuSample.model_fields)
    assert set(P._ALLOC_KEYS) == set(Allocation.model_fields)
    assert set(P._MIG_KEYS) == set(MigInstance.model_fields)

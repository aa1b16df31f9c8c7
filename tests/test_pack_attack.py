"""Attacks on the pack format (gpuslo/wire/pack.py, ingest/packed.py, agent/kafka_sink.py):
each test is a defect found, with its fix; the checks that held are at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from gpuslo.agent.kafka_sink import KafkaSink
from gpuslo.core.settings import KafkaSettings, ProducerSettings, SpoolSettings
from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.writer import Raw
from gpuslo.wire import encode
from gpuslo.wire import pack as P
from tests.helpers import T0
from tests.test_fastpath import _batch, _ColumnsOnly
from tests.test_pack import _as_json, _as_pack, _header, _prepare, _refused_whole, _with_header


def _raw(mut: Any) -> bytes:
    o = json.loads(encode(_batch(0, T0)))
    mut(o)
    return json.dumps(o, separators=(",", ":")).encode()


def test_an_integer_ts_in_milliseconds_has_the_jsons_reason() -> None:
    """ts as an integer (an agent in ms): the models' hint quotes the value as given; a pack
    carried it as a float, so the reason said 1796083200000.0 where the JSON's says 1796083200000."""
    raws = [_raw(lambda o: o.update(ts=int(T0 * 1000))), _raw(lambda o: o.update(ts=int(T0 * 1e6), seq=1))]
    got, _ = _as_pack(raws)
    assert got == _as_json(raws)


def test_two_implausible_fields_of_a_gpu_have_the_jsons_reason() -> None:
    """The models name the first implausible field in the JSON's order; a pack keeps the
    catalogue's order, so the reason named another field."""

    def two_bad(o: dict[str, Any]) -> None:
        o["gpus"][4]["fields"] = {"DCGM_FI_DEV_POWER_USAGE": -5.0, "DCGM_FI_DEV_GPU_UTIL": 1000.0}

    raws = [_raw(two_bad)]
    got, _ = _as_pack(raws)
    assert got == _as_json(raws)


def test_a_pack_of_no_batches_is_refused_not_dropped_unseen() -> None:
    """A pack with batches 0 (every buffer empty, every offset list [0]) passed as well formed and
    became no item at all: a message read and committed with nothing counted or dead-lettered."""
    value, _ = P.pack([])
    assert "no batches" in _refused_whole(value)


def _forged(digest_of: bytes, other: bytes) -> bytes:
    """A pack of ``other`` whose digest buffer claims ``digest_of``'s digest."""
    value, took = P.pack([other])
    assert took == [0]
    from tests.test_pack import _buffer_at

    at, size = _buffer_at(value, "digest")
    assert size == 8
    return value[:at] + P.digest(digest_of).to_bytes(8, "little") + value[at + 8 :]


def test_a_forged_digest_can_only_drop_the_forgers_own_batch() -> None:
    """The ingest takes the digest a pack claims for each batch (the JSON bytes are not in the
    pack). A different batch under a taken id, claiming the taken batch's digest, is dropped as a
    replay where its JSON would be dead-lettered as a conflict: what is lost is the forger's own
    batch, never the taken one (whose rows stay as written). Forging the other way round, taking
    an id first with the digest of a batch not yet sent, needs that batch's bytes before it exists."""
    first = encode(_batch(3, T0))
    other = encode(_batch(3, T0 + 5))  # the same id (source, boot_id, seq), other values
    as_json = Ingestor(_ColumnsOnly(), clock=lambda: T0 + 3600)
    as_json.prepare([Raw("t/0/1", first)])
    assert as_json.prepare([Raw("t/0/2", other)]).report.n_rejected == 1  # a conflict, dead-lettered
    ing = Ingestor(_ColumnsOnly(), clock=lambda: T0 + 3600)
    taken = ing.prepare([Raw("t/0/1", first)])
    assert taken.report.accepted == 1
    forged = ing.prepare([Raw("t/0/2", _forged(first, other))])
    assert forged.report.duplicates == 1 and not forged.columns and not forged.dead


# ---------------------------------------------------------------------------- the agent


class _Future:
    def __init__(self, exc: BaseException | None) -> None:
        self.is_done = True
        self.exception = exc

    def succeeded(self) -> bool:
        return self.exception is None


class _SmallBroker:
    """A broker whose message.max.bytes is ``limit``: a larger message is refused
    (MessageSizeTooLargeError, errno 10) on every try."""

    def __init__(self, limit: int, log: list[bytes], made: list[int]) -> None:
        self.limit, self.log = limit, log
        made.append(1)

    def send(self, topic: str, key: bytes, value: bytes) -> _Future:
        from kafka.errors import MessageSizeTooLargeError

        if len(value) > self.limit:
            return _Future(MessageSizeTooLargeError(f"{len(value)} > {self.limit}"))
        self.log.append(value)
        return _Future(None)

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout_ms: Any = None) -> None:
        pass


def test_a_broker_refusing_packs_does_not_collapse_the_drain(tmp_path: Path) -> None:
    """message.max.bytes lowered under a pack's size: each refused pack made the sink send ONE
    record alone, then pack the rest again (refused again, a new producer each time): a backlog
    of N records took about 2N drains and N reconnects instead of a few."""
    from gpuslo.agent.spool import Record

    delivered: list[bytes] = []
    made: list[int] = []
    kafka = KafkaSettings(bootstrap_servers=["127.0.0.1:1"])
    sink = KafkaSink(kafka, SpoolSettings(directory=tmp_path / "spool"), ProducerSettings(),
                     producer_factory=lambda **_: _SmallBroker(20_000, delivered, made), start=False)  # fmt: skip
    recs = [Record(kafka.topics.gpu_samples, b"n1", encode(_batch(i, T0 + 10 * i)), 0.0) for i in range(300)]
    sink.spool.append(recs)
    drains = 0
    while len(sink.spool) and drains < 2000:
        sink.drain_once(force=True)
        drains += 1
    assert len(sink.spool) == 0 and sink.spool.stats().dropped_rejected == 0
    # every record delivered (as JSON or in a pack that fit), none twice
    seen = []
    for v in delivered:
        if P.is_pack(v):
            from gpuslo.ingest import packed

            seen += packed.unpack(v).table.column("seq").to_pylist()
        else:
            seen.append(orjson.loads(v)["seq"])
    assert sorted(set(seen)) == list(range(300))
    assert drains <= 30 and len(made) <= 10, (drains, len(made))
    sink.close(timeout_s=0.1)


# ---------------------------------------------------------------------------- checks that held


def test_packs_and_their_json_store_the_same_rows_and_dead_letters_in_chdb(store: Any) -> None:
    """End to end into the embedded store: a pack's batches are the JSON's rows; a malformed
    pack's dead letter keeps its binary bytes exactly; a refused batch's dead letter is JSON."""
    raws = [encode(_batch(i, T0 + 10 * i)) for i in range(5)]
    bad = raws[0].replace(b'"seq":0,', b'"seq":9,', 1).replace(b'"interval_s":10.0', b'"interval_s":-1.0', 1)
    value, took = P.pack([*raws, bad])
    assert took == list(range(6))
    broken = bytearray(value)
    from tests.test_pack import _buffer_at

    at, _ = _buffer_at(value, "uuid.data")
    broken[at] = 0xFF
    ing = Ingestor(store, clock=lambda: T0 + 3600)
    rep = ing.ingest_or_isolate([Raw("t/0/1", value), Raw("t/0/2", bytes(broken))])
    assert (rep.accepted, rep.n_rejected, rep.dead_lettered) == (5, 2, 2)
    cols = "cluster, node, ts, seq, gpu, uuid, mig_gi, mig_ci, gpu_fraction, alloc_shares, alloc_act_shares"
    packed_rows = store.query(f"SELECT {cols} FROM gpu_samples ORDER BY seq, gpu, mig_gi")
    dead = store.query("SELECT origin, reason, hex(raw) AS raw FROM dead_letters ORDER BY origin")
    assert [d["origin"] if isinstance(d, dict) else d[0] for d in dead] == ["t/0/1#5", "t/0/2"]
    store.execute("TRUNCATE TABLE gpu_samples")
    ing2 = Ingestor(store, clock=lambda: T0 + 3600, fast_path=False)
    ing2.ingest_or_isolate([Raw(f"j/{i}", r) for i, r in enumerate(raws)])
    assert store.query(f"SELECT {cols} FROM gpu_samples ORDER BY seq, gpu, mig_gi") == packed_rows
    raw_of = {
        (d["origin"] if isinstance(d, dict) else d[0]): (d["raw"] if isinstance(d, dict) else d[2])
        for d in dead
    }
    assert bytes.fromhex(raw_of["t/0/2"]) == bytes(broken)
    assert orjson.loads(bytes.fromhex(raw_of["t/0/1#5"]))["interval_s"] == -1.0


def test_a_shutdown_with_an_unwritten_batch_commits_no_later_batch() -> None:
    """SIGTERM while the store is down: the in-flight batch gives up (its offsets uncommitted),
    but flush() went on to write the batches the byte bound left in _pending and committed them,
    so the committed offset passed the unwritten batch: those messages were never read again."""
    from gpuslo.core.settings import IngestSettings, KafkaSettings
    from gpuslo.ingest.kafka_consumer import KafkaIngest
    from gpuslo.ingest.store import Failure, StoreError
    from tests.test_pack import _Polled, _Recording

    values = [
        P.pack([encode(_batch(k * 1000 + i, T0 + k * 1000 + i)) for i in range(600)])[0] for k in range(3)
    ]
    holder: dict[str, Any] = {}

    class DownOnce(_Recording):
        def insert(self, table: str, columns: Any) -> int:
            if table == "gpu_samples" and not holder.get("failed"):
                holder["failed"] = True
                holder["ing"].stop_event.set()  # SIGTERM arrives during the outage
                raise StoreError("Code: 159. timeout", Failure.TRANSIENT, 159)
            return super().insert(table, columns)

    store = DownOnce()
    c = _Polled(values)
    ing = KafkaIngest(KafkaSettings(), IngestSettings(batch_bytes=1 << 20, batch_s=0.2, metrics_port=0), store,
                      consumer_factory=lambda **_: c, sleep=lambda s: None)  # fmt: skip
    holder["ing"] = ing
    ing.ingestor.clock = lambda: T0 + 3600
    ing.step()  # reads all three packs; writes the first ~1 MiB of them (the store is down)
    ing.close()  # SIGTERM: write and commit what was read
    written = sum(n for t, n in store.inserts if t == "gpu_samples")
    # whatever was committed must have been written: the first batch was not, so nothing may be
    assert not c.commits, (c.commits, written)


def test_hostile_headers_and_values_are_refused_with_reasons() -> None:
    """Held: lying counts, duplicated or unknown fields, a huge count over small buffers, offsets
    out of range, non-finite and negative-zero values: refused whole with a reason, or each
    batch decided by the models; never a traceback."""
    import math
    import struct

    from tests.test_pack import _buffer_at, _pack_of

    good = _pack_of(3)
    h = _header(good)
    name = "DCGM_FI_DEV_GPU_UTIL"
    assert "distinct" in _refused_whole(_with_header(good, {**h, "fields": [*h["fields"], h["fields"][0]]}))
    assert "bytes for" in _refused_whole(_with_header(good, {**h, "gpus": 2**31 - 2}))
    assert "bytes for" in _refused_whole(_with_header(good, {**h, "allocs": 2**31 - 2}))
    assert "integer in" in _refused_whole(_with_header(good, {**h, "batches": True}))
    assert "integer in" in _refused_whole(_with_header(good, {**h, "batches": 3.0}))
    at, _ = _buffer_at(good, "gpus.off")
    neg = good[: at + 4] + struct.pack("<i", -5) + good[at + 8 :]
    assert "offsets must rise" in _refused_whole(neg)
    for col, x in (("ts", math.nan), ("ts", math.inf), ("interval_s", -0.0), ("fraction", math.nan),
                   ("share", math.nan), (f"field.{name}", math.inf), ("seq", -1.0)):  # fmt: skip
        at, _ = _buffer_at(good, col)
        word = struct.pack("<q", -1) if col == "seq" else struct.pack("<d", x)
        p = _prepare([Raw("pack", good[:at] + word + good[at + 8 :])])
        rep = p.report
        assert rep.received == 3 and rep.n_rejected == 1 and rep.accepted == 2, (col, rep.rejected)
        assert rep.rejected[0][0] == "pack#0" and rep.rejected[0][1].startswith("invalid gpu_samples"), col
    # NaN in a field column is "absent" by the format's definition (JSON has no NaN): accepted
    at, _ = _buffer_at(good, f"field.{name}")
    assert (
        _prepare([Raw("pack", good[:at] + struct.pack("<d", math.nan) + good[at + 8 :])]).report.accepted == 3
    )

"""The hostile-input corpus (tests/corpus.py) through ``ingest --file`` and through a real
Kafka broker: every message lands or is a dead letter with a reason, the good messages
around it all land, and the process never dies."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from gpuslo.app.cli import EXIT_PARTIAL, main
from gpuslo.ingest.schema import DEFAULT_TTL_DAYS, TABLES, expires_at
from gpuslo.ingest.store import ChdbStore
from gpuslo.wire import WireError, decode, encode
from tests import helpers as h
from tests.corpus import hostile


def _interleaved() -> tuple[list[bytes], set[tuple[str, int]], set[bytes]]:
    """Corpus lines with a good heartbeat after each; the keys that must land, the raws that
    must be dead letters (the oracle: the models, and the store's retention)."""
    lines: list[bytes] = []
    land: set[tuple[str, int]] = set()
    dead: set[bytes] = set()
    now = time.time()
    for i, raw in enumerate(hostile(h.T0)):
        lines.append(raw)
        try:
            m = decode(raw)
        except WireError:
            dead.add(raw)
        else:
            if expires_at(m.ts, DEFAULT_TTL_DAYS) <= now:
                dead.add(raw)
            else:
                land.add((m.source, m.seq))
        good = orjson.loads(encode(h.heartbeat("good", h.T0 + i, True)))
        good["source"], good["seq"] = "good", i
        lines.append(orjson.dumps(good))
        land.add(("good", i))
    for d in range(150):  # good messages spread over 150 days: more partitions than one insert may touch
        ev = orjson.loads(encode(h.sched("submit", f"r{d}", h.T0 - d * 86400)))
        ev["source"], ev["seq"] = "days", d
        lines.insert(len(lines) * d // 150, orjson.dumps(ev))
        land.add(("days", d))
    # one id three times, far apart: the message, its replay (dropped), a different message (dead letter)
    first = orjson.loads(encode(h.heartbeat("dup-a", h.T0, True)))
    first["source"], first["seq"] = "dup", 1
    other = dict(first, node="dup-b")
    lines[:0] = [orjson.dumps(first)]
    lines += [orjson.dumps(first), orjson.dumps(other)]
    land.add(("dup", 1))
    dead.add(orjson.dumps(other))
    return lines, land, dead


def _check(store_dir: Path, land: set[tuple[str, int]], dead: set[bytes]) -> None:
    s = ChdbStore(store_dir)
    try:
        got: set[tuple[str, int]] = set()
        for t in TABLES:
            if t != "dead_letters":
                got |= {(r["source"], r["seq"]) for r in s.query(f"SELECT DISTINCT source, seq FROM {t}")}
        letters = s.query("SELECT hex(raw) AS raw, reason FROM dead_letters FINAL")
    finally:
        s.close()
    assert got == land, (sorted(land - got)[:5], sorted(got - land)[:5])
    assert {bytes.fromhex(d["raw"]) for d in letters} == dead
    assert len(letters) == len(dead)
    assert all(d["reason"].strip() for d in letters)


def test_corpus_is_generated_from_every_kind_and_has_both_outcomes() -> None:
    corpus = hostile(h.T0)
    lines, land, dead = _interleaved()
    kinds = {orjson.loads(r)["kind"] for r in corpus if r not in dead}
    assert kinds == {"gpu_samples", "heartbeat", "sched_event", "latency", "health"}
    assert len(dead) > 500 and len(land) > len(lines) // 2  # the good half, and the accepted edges
    for edge in (b'"seq":18446744073709551616', b'"code":4294967296', b'"seq":9223372036854775808'):
        assert any(edge in r for r in corpus), edge


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_hostile_corpus_through_ingest_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines, land, dead = _interleaved()
    f = tmp_path / "hostile.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    rc = main(["ingest", "--file", str(f), "--store", str(tmp_path / "store"), "--max-report", "3"])
    err = capsys.readouterr().err
    assert rc == EXIT_PARTIAL, err[-2000:]
    assert f"rejected {len(dead)};" in err
    _check(tmp_path / "store", land, dead)


@pytest.mark.integration
def test_hostile_corpus_through_kafka(kafka: object, tmp_path: Path) -> None:
    from kafka import KafkaProducer

    from tests.test_kafka import run_ingest, service_config

    bootstrap = kafka.bootstrap  # type: ignore[attr-defined]
    cfg, path = service_config(tmp_path, "hostile", bootstrap, batch_messages=200)  # many batches
    lines, land, dead = _interleaved()
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=4 * 2**20)
    for raw in lines:
        try:
            kind = orjson.loads(raw).get("kind")
        except orjson.JSONDecodeError:
            kind = None
        topic = (
            cfg.kafka.topics.for_kind(kind)
            if kind in {"gpu_samples", "heartbeat", "sched_event", "latency", "health"}
            else cfg.kafka.topics.gpu_samples
        )
        p.send(topic, key=b"k", value=raw)
    p.flush()
    p.close()
    r = run_ingest(path, tmp_path / "store", timeout_s=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "LOST" not in r.stderr
    _check(tmp_path / "store", land, dead)

"""How soon after a Kafka broker comes back the pipeline has caught up, on a real broker:
gpuslo's clients (a broker that refused them tried again within ``RECONNECT_BACKOFF_MAX_MS``)
beside the same clients with kafka-python's own reconnect backoff (doubling to 30 s), in the
same run, over ``--runs`` outages of ``--outage-s`` each:

  ingest  seconds from the broker's port open again until the ingest (``KafkaIngest`` into the
          embedded store, as ``gpuslo ingest`` runs it, connected before the outage) has
          written every node batch sent after it (sent by a new producer once the port opened:
          its own wait for the broker is in the figure, for both settings alike);
  agent   seconds from the port open until the agent's ``KafkaSink`` (connected before the
          outage) has had acknowledged every record it spooled during it (its drain retries
          with its own backoff, 0.5 s doubling to ``DRAIN_RETRY_MAX_S``, 4 s, under both
          settings: the ratio is the reconnect backoff's alone).

Each wait is bounded by ``--timeout-s``: a run past it ends the benchmark with an error, never
a figure. The ratios are gpuslo's median over the default's, measured in the same run."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.args import count, number
from bench.send import node_ticks
from gpuslo.core import settings
from gpuslo.core.settings import IngestSettings, KafkaSettings, ProducerSettings, SpoolSettings, Topics
from gpuslo.wire import Message, encode

#: kafka-python 3.0.12's ``reconnect_backoff_max_ms``, the baseline.
KAFKA_PYTHON_DEFAULT_MS = 30_000


@contextmanager
def _backoff(ms: int) -> Iterator[None]:
    """Every client made inside gets ``ms`` as its reconnect backoff's bound (``client_kwargs``
    reads the module's value when it is called)."""
    was = settings.RECONNECT_BACKOFF_MAX_MS
    settings.RECONNECT_BACKOFF_MAX_MS = ms
    try:
        yield
    finally:
        settings.RECONNECT_BACKOFF_MAX_MS = was


def _produce(bootstrap: str, topics: Topics, msgs: list[Message], timeout_s: float) -> None:
    """Every message acknowledged within ``timeout_s``, else SystemExit (one line: kafka-python's
    timeouts, a broker not reached, are the bound's, never a traceback)."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    deadline = time.monotonic() + timeout_s
    try:
        p = KafkaProducer(
            bootstrap_servers=[bootstrap],
            acks="all",
            max_block_ms=max(1, int(timeout_s * 1000)),
            bootstrap_timeout_ms=max(1, int(timeout_s * 1000)),
        )
        try:
            futures = [p.send(topics.for_kind(m.kind), value=encode(m)) for m in msgs]
            p.flush(timeout=max(0.0, deadline - time.monotonic()))
            for f in futures:
                f.get(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            p.close(timeout=5)
    except KafkaError as exc:
        raise SystemExit(
            f"bench recovery: {len(msgs)} messages not acknowledged within {timeout_s:g} s: {exc}"
        ) from None


def _wait(done: Any, timeout_s: float, what: str, t0: float | None = None) -> float:
    """Seconds from ``t0`` (now) until ``done()``; past ``timeout_s``, SystemExit, never a figure."""
    t0 = time.monotonic() if t0 is None else t0
    while True:
        finished = done()
        took = time.monotonic() - t0
        if took > timeout_s:
            raise SystemExit(f"bench recovery: {what} not done {timeout_s:g} s after the broker came back")
        if finished:
            return took
        time.sleep(0.02)


def one_outage(broker: Any, work: Path, name: str, outage_s: float, timeout_s: float) -> tuple[float, float]:
    """(ingest seconds, agent seconds) after one outage of ``outage_s``."""
    from gpuslo.agent.kafka_sink import KafkaSink
    from gpuslo.ingest.kafka_consumer import KafkaIngest
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules.tables import SCHEMA

    ticks = node_ticks(40)
    before, after = [m for t in ticks[:20] for m in t], [m for t in ticks[20:] for m in t]
    read = Topics(**{k: f"{name}-in.{k}" for k in Topics.model_fields})
    sent = Topics(**{k: f"{name}-agent.{k}" for k in Topics.model_fields})
    st = ChdbStore(work / f"store-{name}")
    st.migrate(SCHEMA)
    kafka = KafkaSettings(bootstrap_servers=[broker.bootstrap], topics=read)
    ing = KafkaIngest(kafka, IngestSettings(group_id=f"g-{name}", batch_s=0.2, metrics_port=0), st)
    runner = threading.Thread(target=ing.run, name="bench-ingest", daemon=True)
    sink = KafkaSink(
        KafkaSettings(bootstrap_servers=[broker.bootstrap], topics=sent),
        SpoolSettings(directory=work / f"spool-{name}"),
        ProducerSettings(flush_timeout_s=5.0),
    )
    try:
        runner.start()
        _produce(broker.bootstrap, read, before, timeout_s)

        def written() -> int:
            return int(st.query("SELECT count() AS n FROM node_heartbeats")[0]["n"])

        _wait(lambda: written() == 20, timeout_s, "the ingest's first batches")
        sink.send(ticks[0])
        if not sink.flush(timeout_s):
            raise SystemExit(f"bench recovery: the agent's first records not acknowledged: {sink.last_error}")
        broker.stop()
        for t in ticks[1:]:
            sink.send(t)  # spooled while the broker is away
        time.sleep(outage_s)
        broker.start()
        back = time.monotonic()
        agent_s: list[float] = []
        waiter = threading.Thread(
            target=lambda: agent_s.append(_wait(lambda: sink.pending == 0, timeout_s, "the agent's spool")),
            daemon=True,
        )
        waiter.start()
        _produce(broker.bootstrap, read, after, timeout_s)
        ingest_s = _wait(lambda: written() == 40, timeout_s, "the ingest", t0=back)
        waiter.join(timeout_s + 1)
        if not agent_s:
            raise SystemExit(
                f"bench recovery: the agent's spool not drained {timeout_s:g} s after the broker came back"
            )
        return ingest_s, agent_s[0]
    finally:
        ing.stop_event.set()
        runner.join(30)
        sink.close(timeout_s=1)
        st.close()


def run(a: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    from tests.servers.kafka import KafkaBroker

    work = Path(tempfile.mkdtemp(prefix="gpuslo-bench-recovery-"))
    broker = KafkaBroker(work / "kafka", partitions=1)
    broker.start()
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for i in range(a.runs):  # the two settings alternate: drift on the machine hits both
            for label, ms in (
                ("gpuslo", settings.RECONNECT_BACKOFF_MAX_MS),
                ("kafka_python_default", KAFKA_PYTHON_DEFAULT_MS),
            ):
                with _backoff(ms):
                    ingest_s, agent_s = one_outage(
                        broker, work, f"rec{i}-{label[0]}", a.outage_s, a.timeout_s
                    )
                f = out.setdefault(label, {"ingest_s": [], "agent_s": [], "reconnect_backoff_max_ms": [ms]})
                f["ingest_s"].append(round(ingest_s, 2))
                f["agent_s"].append(round(agent_s, 2))
                print(
                    f"  outage {i + 1} ({label}): ingest caught up {ingest_s:.1f} s, agent's spool drained {agent_s:.1f} s after the port opened"
                )
    finally:
        broker.stop()
    shutil.rmtree(work, ignore_errors=True)
    return out


def report(figures: dict[str, dict[str, list[float]]], a: argparse.Namespace) -> dict[str, Any]:
    g, d = figures["gpuslo"], figures["kafka_python_default"]
    out: dict[str, Any] = {"bench": "recovery", "runs": a.runs, "outage_s": a.outage_s}
    print(
        f"{a.runs} outage(s) of {a.outage_s:g} s per setting; seconds after the broker's port opened again (median)"
    )
    for k in ("ingest_s", "agent_s"):
        gm, dm = statistics.median(g[k]), statistics.median(d[k])
        out[f"{k.removesuffix('_s')}_median_s"] = round(gm, 2)
        out[f"{k.removesuffix('_s')}_median_s_kafka_python_default"] = round(dm, 2)
        out[f"ratio_{k.removesuffix('_s')}_vs_kafka_python_default"] = round(gm / dm, 3) if dm else None
        print(
            f"  {k.removesuffix('_s'):7s} gpuslo {gm:6.1f} s   kafka-python's backoff {dm:6.1f} s   (× {gm / dm if dm else float('nan'):.2f})"
        )
    return {**out, **figures}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench recovery")
    ap.add_argument("--runs", type=count(1, 20), default=2, help="outages per setting")
    ap.add_argument("--outage-s", type=number(0, 600), default=20.0, help="how long the broker stays down")
    ap.add_argument("--timeout-s", type=number(0, 3600), default=120.0, help="bound on each wait")
    a = ap.parse_args(argv)
    print(json.dumps(report(run(a), a)))
    return 0

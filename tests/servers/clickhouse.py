"""Debian's clickhouse-server (18.16) as a native-protocol peer: too old for the schema
(no DateTime64, no LowCardinality), new enough to prove the driver path: connect with a
password, columnar insert, typed parameter binding, query with column names."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.servers.kafka import free_port, port_open

PASSWORD = "gpuslo-test-secret"


def binary() -> str | None:
    return shutil.which("clickhouse-server") or (
        "/usr/sbin/clickhouse-server" if Path("/usr/sbin/clickhouse-server").exists() else None
    )


class ClickHouseServer:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        exe = binary()
        if exe is None:
            raise RuntimeError("clickhouse-server is not installed (apt-get install clickhouse-server)")
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        (d / "users.xml").write_text(
            "<?xml version='1.0'?><yandex><profiles><default/></profiles><users><default>"
            f"<password>{PASSWORD}</password><networks><ip>127.0.0.1</ip></networks>"
            "<profile>default</profile><quota>default</quota></default></users>"
            "<quotas><default/></quotas></yandex>"
        )
        (d / "config.xml").write_text(
            "<?xml version='1.0'?><yandex>"
            f"<logger><level>warning</level><log>{d}/server.log</log><errorlog>{d}/err.log</errorlog>"
            "<console>0</console></logger>"
            f"<tcp_port>{self.port}</tcp_port><listen_host>127.0.0.1</listen_host>"
            f"<path>{d}/data/</path><tmp_path>{d}/tmp/</tmp_path><users_config>{d}/users.xml</users_config>"
            "<default_profile>default</default_profile><default_database>default</default_database>"
            "<mark_cache_size>5368709</mark_cache_size></yandex>"
        )
        self.proc = subprocess.Popen(
            [exe, f"--config-file={d}/config.xml"],
            stdout=open(d / "stdout.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"clickhouse-server did not start: {(d / 'stdout.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies wherever it is (mid-insert included)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None


INGEST_TABLES = ("gpu_samples", "node_heartbeats", "sched_events", "latency", "health_events", "dead_letters")


def legacy_ingest_ddl(narrow: dict[str, str] | None = None) -> list[str]:
    """The ingest's tables as 18.16 can hold them, derived from the real schema (so a new
    column is here too): LowCardinality(T) -> T, DateTime64 -> DateTime (whole seconds), no
    TTL (19.6+); the column names, the other types and the ReplacingMergeTree keys are the
    schema's. ``narrow``: column -> type overrides (a column narrower than the wire, to make
    the real server refuse one message)."""
    from gpuslo.ingest.schema import INGEST_SCHEMA

    out = []
    for stmt in INGEST_SCHEMA.create():
        m = re.match(r"CREATE TABLE IF NOT EXISTS (\w+)", stmt)
        if m is None or m.group(1) not in INGEST_TABLES:
            continue
        sql = re.sub(r"LowCardinality\((\w+)\)", r"\1", stmt)
        sql = sql.replace("DateTime64(3, 'UTC') DEFAULT now64(3)", "DateTime DEFAULT now()")
        sql = sql.replace("DateTime64(3, 'UTC')", "DateTime")
        sql = re.sub(r"\nTTL [^\n;]*", "", sql).rstrip().rstrip(";")
        for col, typ in (narrow or {}).items():
            sql = re.sub(rf"(\n\s+{col}) [^,\n]+", rf"\1 {typ}", sql)
        out.append(sql)
    return out

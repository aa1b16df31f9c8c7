"""Debian's clickhouse-server (18.16) as a native-protocol peer: too old for the schema
(no DateTime64, no LowCardinality), new enough to prove the driver path: connect with a
password, columnar insert, typed parameter binding, query with column names.

:class:`ClickHouseContainer`: the compose file's ClickHouse server (24.8, the oldest version the
schema supports) where the container back-end is chosen (tests/servers/backend.py), with the
same interface (``port``, ``start``/``stop``/``kill``, ``modern``), the compose file's users
(deploy/clickhouse/users.xml: Grafana's read-only user) and environment."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.servers.containers import Container, Mount, Spec
from tests.servers.images import IMAGES, image_version
from tests.servers.kafka import port_open
from tests.servers.ports import free_port

PASSWORD = "gpuslo-test-secret"
GRAFANA_PASSWORD = "gpuslo-grafana-secret"  # GRAFANA_CLICKHOUSE_PASSWORD of the container
ROOT = Path(__file__).resolve().parents[2]
USERS_IN_IMAGE = "/etc/clickhouse-server/users.d/gpuslo.xml"  # where docker-compose.yml mounts users.xml
PORTS_IN_IMAGE = "/etc/clickhouse-server/config.d/gpuslo-test-ports.xml"


def binary() -> str | None:
    return shutil.which("clickhouse-server") or (
        "/usr/sbin/clickhouse-server" if Path("/usr/sbin/clickhouse-server").exists() else None
    )


class ClickHouseServer:
    version = (18, 16)
    modern = False  # cannot hold the schema

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

    def pause(self) -> None:
        """SIGSTOP: the server hangs where it is (mid-insert included); the kernel still accepts
        connections on its port, and nothing answers on them or on those open."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a paused server cannot stop
        self.stop()


class ClickHouseContainer:
    """The compose file's ClickHouse server image on the host network: the native protocol on
    ``port``, HTTP on ``http_port`` (both free loopback ports, set in a config.d file; the
    image's other listeners removed), the default user's password from CLICKHOUSE_PASSWORD and
    Grafana's read-only user from deploy/clickhouse/users.xml, as docker-compose.yml has them.
    ``stop``/``kill`` and ``start`` restart the same container: its data survives, as the local
    server's data directory does."""

    version = image_version(IMAGES["clickhouse"])
    modern = True  # holds the schema

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.port = free_port()
        self.http_port = free_port()
        self.container: Container | None = None

    def ports_xml(self) -> str:
        return (
            "<?xml version='1.0'?><clickhouse>"
            f"<tcp_port>{self.port}</tcp_port><http_port>{self.http_port}</http_port>"
            "<interserver_http_port remove='1'/><mysql_port remove='1'/><postgresql_port remove='1'/>"
            "</clickhouse>"
        )

    def container_spec(self) -> Spec:
        return Spec(
            image=IMAGES["clickhouse"],
            env={"CLICKHOUSE_PASSWORD": PASSWORD, "GRAFANA_CLICKHOUSE_PASSWORD": GRAFANA_PASSWORD},
            mounts=(
                Mount(self.dir / "ports.xml", PORTS_IN_IMAGE),
                Mount(ROOT / "deploy/clickhouse/users.xml", USERS_IN_IMAGE),
            ),
            ulimits=(("nofile", 262144, 262144),),
        )

    def start(self, timeout_s: float = 120.0) -> None:
        if self.container is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "ports.xml").write_text(self.ports_xml())
            (self.dir / "ports.xml").chmod(0o644)  # read by the image's clickhouse user
            self.container = Container(self.container_spec())
        self.container.start()
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if not self.container.running() or time.monotonic() > deadline:
                raise RuntimeError(f"the ClickHouse container did not start: {self.container.logs()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.container is not None:
            self.container.stop()

    def kill(self) -> None:
        if self.container is not None:
            self.container.kill()

    def close(self) -> None:
        if self.container is not None:
            self.container.close()
            self.container = None


Server = ClickHouseServer | ClickHouseContainer


def make_server(workdir: Path, modern: bool) -> Server:
    """The ClickHouse server of one parameter of the fixture: 18.16 from the Debian package, or
    the image's (>= 24.8)."""
    return ClickHouseContainer(workdir) if modern else ClickHouseServer(workdir)


def ingest_ddl(server: Server, narrow: dict[str, str] | None = None) -> list[str]:
    """The ingest's tables as ``server`` holds them: the schema's own DDL on a modern server, the
    18.16 rendering (:func:`legacy_ingest_ddl`) on Debian's; ``narrow`` as there."""
    if not server.modern:
        return legacy_ingest_ddl(narrow)
    from gpuslo.ingest.schema import INGEST_SCHEMA

    return [
        _narrow(stmt, narrow)
        for stmt in INGEST_SCHEMA.create()
        if (m := re.match(r"CREATE TABLE IF NOT EXISTS (\w+)", stmt)) and m.group(1) in INGEST_TABLES
    ]


def _narrow(sql: str, narrow: dict[str, str] | None) -> str:
    for col, typ in (narrow or {}).items():
        sql = re.sub(rf"(\n\s+{col}) [^,\n]+", rf"\1 {typ}", sql)
    return sql


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
        sql = re.sub(r"\nTTL [^\n;]*", "", sql)
        sql = re.sub(r"\nSETTINGS [^\n;]*", "", sql).rstrip().rstrip(";")  # part formats: 20.3+
        out.append(_narrow(sql, narrow))
    return out


def copy_plan(src: Any) -> list[tuple[str, list[str]]]:
    """What :func:`copy_store` copies from the embedded store ``src``: each table (name order) and
    its stored columns (not MATERIALIZED or ALIAS ones), leaving out views and the targets of
    materialized views (the server's own views fill those from the copied rows, as they do from
    the ingest's), and the tables such a target buffers for."""
    tables = src.query(
        "SELECT name, engine, create_table_query AS ddl FROM system.tables WHERE database = currentDatabase() "
        "ORDER BY name"
    )
    targets = {
        m.group(1)
        for t in tables
        if t["engine"] == "MaterializedView" and (m := re.search(r"\bTO\s+(?:`?\w+`?\.)?`?(\w+)`?", t["ddl"]))
    }
    # and what a target holds in memory flushes to (the embedded store's marks: buffer_marks)
    targets |= {
        m.group(1)
        for t in tables
        if t["engine"] == "Buffer"
        and t["name"] in targets
        and (m := re.search(r"Buffer\('?\w+'?, '?(\w+)'?", t["ddl"]))
    }
    plan = []
    for t in tables:
        if t["engine"] in ("MaterializedView", "View") or t["name"] in targets:
            continue
        cols = [r["name"] for r in src.query(
            "SELECT name FROM system.columns WHERE database = currentDatabase() AND table = {t:String} "
            "AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') ORDER BY position", {"t": t["name"]})]  # fmt: skip
        plan.append((str(t["name"]), cols))
    return plan


def native_rows(src: Any, table: str, cols: list[str]) -> bytes:
    """The rows of ``table`` in ClickHouse's Native format (names and types carried with the data)."""
    names = ", ".join(f"`{c}`" for c in cols)
    data: bytes = src._run(f"SELECT {names} FROM `{table}`", "Native", None).bytes()
    return data


def copy_store(src: Any, server: ClickHouseContainer, database: str) -> dict[str, int]:
    """Every row of the embedded store ``src`` (a ChdbStore with the schema) into ``database`` on
    ``server``, migrated with the same schema: each table of :func:`copy_plan` in ClickHouse's
    Native format (the types exactly, no conversion in between), posted to the server's HTTP
    interface. Returns table -> rows copied."""
    from pydantic import SecretStr

    from gpuslo.core.settings import ClickHouseSettings
    from gpuslo.ingest.clickhouse_store import ClickHouseStore
    from gpuslo.rules.tables import SCHEMA

    dst = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=server.port, database=database,
                                             password=SecretStr(PASSWORD), connect_timeout_s=5))  # fmt: skip
    copied: dict[str, int] = {}
    try:
        dst.create_database()
        dst.migrate(SCHEMA)
        for name, cols in copy_plan(src):
            copied[name] = int(src.query(f"SELECT count() AS n FROM `{name}`")[0]["n"])
            if copied[name]:
                names = ", ".join(f"`{c}`" for c in cols)
                sql = f"INSERT INTO `{database}`.`{name}` ({names}) FORMAT Native"
                _http_insert(server, sql, native_rows(src, name, cols))
    finally:
        dst.close()
    return copied


def _http_insert(server: ClickHouseContainer, sql: str, body: bytes) -> None:
    import urllib.parse
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/?" + urllib.parse.urlencode({"query": sql}),
        data=body,
        method="POST",
        headers={"X-ClickHouse-User": "default", "X-ClickHouse-Key": PASSWORD},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()

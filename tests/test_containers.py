"""The container back-end of the integration fixtures, checked where no container can run: the
choice (GPUSLO_TEST_SERVERS and the engine's ping, against fake engines that speak the Docker
Engine API's /_ping or fail the ways a real socket fails), the image pins' agreement with
docker-compose.yml, and what each fixture would start (image, command, environment, mounts,
ports). Nothing here starts a container."""

from __future__ import annotations

import base64
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.servers import backend as be
from tests.servers.alertmanager import CONFIG_IN_IMAGE, Alertmanager
from tests.servers.clickhouse import (
    GRAFANA_PASSWORD,
    PASSWORD,
    PORTS_IN_IMAGE,
    USERS_IN_IMAGE,
    ClickHouseContainer,
    ClickHouseServer,
    make_server,
)
from tests.servers.containers import Spec
from tests.servers.grafana_server import GrafanaContainer, datasource_yaml
from tests.servers.images import CLICKHOUSE_MIN, GRAFANA_PLUGINS, IMAGES, image_version
from tests.servers.kafka import SCRAM_USERS, KafkaBroker, random_cluster_id
from tests.servers.ports import free_port
from tests.servers.tool import ToolFailed, run_tool

ROOT = Path(__file__).resolve().parents[1]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
DOCKER_PING_HEADERS = (  # what Docker Engine 28 sends with /_ping (recorded from its API docs' example)
    b"Api-Version: 1.50\r\nBuilder-Version: 2\r\nCache-Control: no-cache, no-store, must-revalidate\r\n"
    b"Docker-Experimental: false\r\nOstype: linux\r\nPragma: no-cache\r\nServer: Docker/28.2.2 (linux)\r\n"
)


def mounts_of(service: str) -> dict[str, str]:
    """compose volume target -> source (host paths as written there)."""
    out = {}
    for v in SERVICES[service].get("volumes", []):
        src, target = v.split(":")[:2]
        out[target] = src
    return out


# ---------------------------------------------------------------------------- fake engines
class FakeEngine:
    """A unix-socket (or TCP) server that answers each connection with ``reply`` (bytes, or None
    to accept and never answer), after reading the request, as dockerd answers /_ping."""

    def __init__(self, family: int, address: Any, reply: bytes | None, trickle: bool = False) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(8)
        self.reply = reply
        self.trickle = trickle  # send the reply one byte every 0.05 s
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(2)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            self.requests.append(data)
            if self.reply is None:
                self._held.append(conn)  # accepted, never answered
                continue
            if self.trickle:
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()
                continue
            conn.sendall(self.reply)
            conn.close()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            for i in range(len(self.reply or b"")):
                if self._stop.wait(0.05):
                    return
                try:
                    conn.sendall((self.reply or b"")[i : i + 1])
                except OSError:
                    return

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        for c in self._held:
            c.close()
        self.sock.close()


def http(status: str, body: bytes, headers: bytes = DOCKER_PING_HEADERS, chunked: bool = False) -> bytes:
    if chunked:
        framed = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        return f"HTTP/1.1 {status}\r\n".encode() + headers + b"Transfer-Encoding: chunked\r\n\r\n" + framed
    return (f"HTTP/1.1 {status}\r\n".encode() + headers + b"Content-Type: text/plain; charset=utf-8\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for unix sockets (their paths are limited to ~107 bytes)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpuslo-dk-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def engine(sock_dir: Path) -> Iterator[Callable[[bytes | None], str]]:
    """engine(reply) -> the DOCKER_HOST of a fake engine on a unix socket."""
    started: list[FakeEngine] = []

    def make(reply: bytes | None) -> str:
        path = sock_dir / f"docker{len(started)}.sock"
        started.append(FakeEngine(socket.AF_UNIX, str(path), reply))
        return f"unix://{path}"

    yield make
    for e in started:
        e.close()


def test_ping_ok_from_an_engine_that_answers_as_docker_does(engine: Callable[[bytes | None], str]) -> None:
    assert be.ping(engine(http("200 OK", b"OK"))) is None
    assert be.ping(engine(http("200 OK", b"OK", chunked=True))) is None


def test_the_ping_is_the_engine_apis(sock_dir: Path) -> None:
    fake = FakeEngine(socket.AF_UNIX, str(sock_dir / "d.sock"), http("200 OK", b"OK"))
    try:
        assert be.ping(f"unix://{sock_dir / 'd.sock'}") is None
        (req,) = fake.requests
        assert req.startswith(b"GET /_ping HTTP/1.1\r\n") and b"\r\nHost: " in req
    finally:
        fake.close()


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (
            http("500 Internal Server Error", b'{"message":"daemon is not ready"}'),
            "/_ping answered 'HTTP/1.1 500",
        ),
        (http("503 Service Unavailable", b""), "/_ping answered 'HTTP/1.1 503"),
        (http("200 OK", b"NOPE"), "not OK"),
        (http("200 OK", b""), "not OK"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "not an HTTP reply"),
        (b"", "not an HTTP reply"),
    ],
    ids=["500", "503", "200-not-ok", "200-empty", "not-http", "closed-at-once"],
)
def test_ping_refused_by_what_is_not_a_ready_engine(
    engine: Callable[[bytes | None], str], reply: bytes, why: str
) -> None:
    got = be.ping(engine(reply))
    assert got is not None and why in got, got


def test_ping_is_bounded_by_its_timeout_when_nothing_answers(engine: Callable[[bytes | None], str]) -> None:
    host = engine(None)  # accepts, reads the request, never answers
    assert be.ping(host, timeout_s=0.3) == "no answer to /_ping within 0.3 s"


def test_ping_of_what_is_not_there(sock_dir: Path) -> None:
    missing = be.ping(f"unix://{sock_dir / 'absent.sock'}")
    assert missing is not None and missing.startswith("FileNotFoundError"), missing
    dead = sock_dir / "dead.sock"  # a socket file nobody listens on (a daemon that died)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()
    refused = be.ping(f"unix://{dead}")
    assert refused is not None and refused.startswith("ConnectionRefusedError"), refused
    not_sock = sock_dir / "file"
    not_sock.write_text("x")
    assert be.ping(f"unix://{not_sock}") is not None
    port = free_port()  # nothing on it
    tcp = be.ping(f"tcp://127.0.0.1:{port}")
    assert tcp is not None and tcp.startswith("ConnectionRefusedError"), tcp
    for host, why in [("ssh://me@box", "ssh:// transport is not probed"), ("tcp://:2375", "names no host"),
                      ("tcp://127.0.0.1:notaport", "has no valid port"), ("tcp://127.0.0.1:0", "has no valid port"),
                      ("npipe:////./pipe/docker_engine", "npipe:// transport"), ("", "(no scheme)"),
                      ("unix:///tmp/a\x00b.sock", "Error"),
                      ("unix:///" + "d" * 200, "OSError: AF_UNIX path too long"),
                      ("tcp://[::1:2375", "ValueError")]:  # fmt: skip
        got = be.ping(host)
        assert got is not None and why in got, (host, got)


def test_ping_is_bounded_in_all_when_the_name_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """DOCKER_HOST=tcp://NAME with a DNS server that does not answer: the resolver takes no
    timeout (its own retries are seconds each), so the ping gives up at its deadline instead of
    holding the choice until the resolver does (here: 5 s, then 'Name or service not known')."""
    released = threading.Event()

    def stuck(*a: object, **k: object) -> Any:
        released.wait(5.0)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    try:
        assert be.ping("tcp://docker.example:2375", timeout_s=0.2) == "no answer to /_ping within 0.2 s"
    finally:
        released.set()


def test_ping_is_bounded_in_all_when_the_reply_trickles(sock_dir: Path) -> None:
    """A peer that answers one byte at a time (each read well within the timeout) cannot hold
    the choice longer than the timeout in all: 2 KiB of headers at 20 bytes a second."""
    reply = http("200 OK", b"OK", headers=b"X-Pad: " + b"p" * 2048 + b"\r\n")
    fake = FakeEngine(socket.AF_UNIX, str(sock_dir / "t.sock"), reply, trickle=True)
    try:
        assert be.ping(f"unix://{sock_dir / 't.sock'}", timeout_s=0.3) == "no answer to /_ping within 0.3 s"
    finally:
        fake.close()


@pytest.mark.parametrize("length", [b"abc", b"-5", b"", b"99999999999999999999"])
def test_a_malformed_content_length_reads_to_the_close(
    engine: Callable[[bytes | None], str], length: bytes
) -> None:
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\nOK"
    got = be.ping(engine(reply))
    assert got is None or "not OK" in got, got  # a clear answer either way, never an exception


def test_engines_this_cannot_probe() -> None:
    for env in ({"DOCKER_HOST": "ssh://me@box"}, {"DOCKER_HOST": "npipe:////./pipe/docker_engine"},
                {"DOCKER_HOST": "tcp://[::1:2375"},
                {"DOCKER_HOST": "tcp://10.0.0.9:2376", "DOCKER_TLS_VERIFY": "1"}):  # fmt: skip
        asked = be.select({**env, be.ENV: "containers"}, no_probe)
        assert asked.containers and "not probed" in asked.reason  # testcontainers connects itself
        auto = be.select(env, no_probe)
        assert not auto.containers
        assert auto.reason.startswith(f"the Docker engine at {env['DOCKER_HOST']} is not probed by auto (")
        assert auto.reason.endswith(f"set {be.ENV}=containers to use it")


def test_ping_over_tcp() -> None:
    port = free_port()
    fake = FakeEngine(socket.AF_INET, ("127.0.0.1", port), http("200 OK", b"OK"))
    try:
        assert be.ping(f"tcp://127.0.0.1:{port}") is None
    finally:
        fake.close()


# ---------------------------------------------------------------------------- the choice
def no_probe(host: str) -> str | None:
    raise AssertionError("local: the engine is not asked")


@pytest.mark.parametrize("value", ["docker", "Containers", " local", "local\n", "1", "auto,local",
                                   "'; rm -rf / #", "x" * 10_000, "\x00"])  # fmt: skip
def test_a_bogus_value_is_a_clear_error(value: str) -> None:
    with pytest.raises(be.BackendError) as ei:
        be.select({be.ENV: value}, no_probe)
    msg = str(ei.value)
    assert msg.startswith(f"{be.ENV}={value!r} is not a back-end")
    assert "allowed: local, containers, auto" in msg


def test_the_choice() -> None:
    ok: Callable[[str], str | None] = lambda host: None  # noqa: E731
    down: Callable[[str], str | None] = lambda host: "ConnectionRefusedError: Connection refused"  # noqa: E731
    assert be.parse_choice({}) is be.parse_choice({be.ENV: ""}) is be.Choice.AUTO
    local = be.select({be.ENV: "local"}, no_probe)
    assert (local.containers, local.reason) == (False, f"{be.ENV}=local: local processes only")
    assert be.select({}, ok).containers is True
    assert be.select({be.ENV: "auto"}, ok).containers is True
    assert be.select({be.ENV: "containers"}, ok).containers is True
    auto = be.select({"DOCKER_HOST": "tcp://10.0.0.9:2375"}, down)
    assert auto.containers is False
    assert (
        auto.reason
        == "no Docker engine reachable at tcp://10.0.0.9:2375 (ConnectionRefusedError: Connection refused)"
    )
    with pytest.raises(be.BackendError, match=r"^GPUSLO_TEST_SERVERS=containers but no Docker engine reachable at "
                                              r"unix:///var/run/docker.sock \(ConnectionRefusedError"):  # fmt: skip
        be.select({be.ENV: "containers"}, down)
    assert be.docker_host({}) == "unix:///var/run/docker.sock" == be.docker_host({"DOCKER_HOST": ""})


def test_auto_against_fake_engines(engine: Callable[[bytes | None], str], sock_dir: Path) -> None:
    """The whole selection with the real ping: an engine that answers, one that refuses, none."""
    assert be.select({"DOCKER_HOST": engine(http("200 OK", b"OK"))}).containers is True
    refusing = engine(http("500 Internal Server Error", b"{}"))
    r = be.select({"DOCKER_HOST": refusing})
    assert not r.containers and r.reason.startswith(
        f"no Docker engine reachable at {refusing} (/_ping answered"
    )
    absent = f"unix://{sock_dir / 'none.sock'}"
    r = be.select({"DOCKER_HOST": absent, be.ENV: "auto"})
    assert not r.containers and r.reason.startswith(
        f"no Docker engine reachable at {absent} (FileNotFoundError"
    )


# ---------------------------------------------------------------------------- the pins
def test_image_pins_are_the_compose_files() -> None:
    from_compose = {n: s["image"] for n, s in SERVICES.items() if "build" not in s}
    assert from_compose == IMAGES
    assert SERVICES["grafana"]["environment"]["GF_INSTALL_PLUGINS"] == GRAFANA_PLUGINS
    assert image_version(IMAGES["clickhouse"]) >= CLICKHOUSE_MIN
    assert image_version("prom/alertmanager:v0.28.1") == (0, 28, 1)
    assert image_version("grafana/grafana:12.2.0") == (12, 2, 0)


def test_skip_reasons_are_shown_and_the_compose_marker_is_registered() -> None:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert re.search(r"-r\w*[as]", ini["addopts"]), ini["addopts"]  # the summary lists every skip and why
    assert any(m.startswith("compose:") for m in ini["markers"])
    test = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(r.startswith("testcontainers") for r in test)


# ---------------------------------------------------------------------------- what each fixture starts
def check_spec_common(spec: Spec, service: str) -> None:
    assert spec.image == IMAGES[service]
    assert spec.run_kwargs()["network_mode"] == "host"  # the same 127.0.0.1 ports as a local process
    for m in spec.mounts:
        assert m.source.is_absolute(), m


@pytest.mark.integration  # openssl makes the TLS files: over 0.7 s
def test_kafka_container_runs_the_local_configuration(tmp_path: Path) -> None:
    b = KafkaBroker(tmp_path / "kafka", container=True)
    assert b.libs is None  # no jars needed
    b._configure()
    spec = b.container_spec()
    check_spec_common(spec, "kafka")
    assert spec.user == f"{os.getuid()}:{os.getgid()}"
    (m,) = spec.mounts
    assert (m.source, m.target, m.mode) == (b.dir, str(b.dir), "rw")  # the files at their own paths
    assert spec.env["KAFKA_LOG4J_OPTS"] == f"-Dlog4j2.configurationFile={b.dir / 'log4j2.properties'}"
    sh, dash_c, script = spec.command
    assert (sh, dash_c) == ("sh", "-c")
    first, second = [shlex.split(part) for part in script.removeprefix("set -e; ").split("; ")]
    props = str(b.dir / "server.properties")
    scram = [
        a for u, p in SCRAM_USERS.items() for a in ("--add-scram", f"SCRAM-SHA-256=[name={u},password={p}]")
    ]
    assert first == ["/opt/kafka/bin/kafka-storage.sh", "format", "--standalone", "-t", b._cluster_id, "-c",
                     props, *scram, "--ignore-formatted"]  # fmt: skip
    assert second == ["exec", "/opt/kafka/bin/kafka-server-start.sh", props]
    text = (b.dir / "server.properties").read_text()
    for port in (b.port, b.sasl_port, b.ssl_port, b.sasl_ssl_port):
        assert f"127.0.0.1:{port}" in text
    assert f"ssl.keystore.location={b.tls_dir / 'broker.pem'}" in text  # inside the mounted directory


@pytest.mark.integration  # the real Kafka StorageTool and broker (local jars)
def test_the_containers_format_step_on_the_real_storage_tool(kafka_libs: Path, tmp_path: Path) -> None:
    """The container's first command, run by the local jars' StorageTool (the image's
    kafka-storage.sh runs the same class): it formats, and run again on the formatted directory
    (a restarted container) it succeeds and keeps the cluster id; then a broker started on that
    directory serves, and a SCRAM user added at format time authenticates."""
    from kafka import KafkaProducer

    b = KafkaBroker(tmp_path / "kafka", container=True)
    b._configure()
    script = b.container_spec().command[2]
    first = shlex.split(script.removeprefix("set -e; ").split("; ")[0])
    assert first[0] == "/opt/kafka/bin/kafka-storage.sh"
    b.in_container, b.libs = False, kafka_libs
    meta = b.dir / "data" / "meta.properties"
    for attempt in (1, 2):
        r = subprocess.run(b._java("kafka.tools.StorageTool", *first[1:]), capture_output=True, text=True,
                           timeout=120, check=False)  # fmt: skip
        assert r.returncode == 0, (attempt, r.stdout[-2000:], r.stderr[-2000:])
        assert f"cluster.id={b._cluster_id}" in meta.read_text(), attempt
    b._formatted = True
    b.start()
    try:
        ((user, pw),) = SCRAM_USERS.items()
        p = KafkaProducer(bootstrap_servers=b.sasl_bootstrap, security_protocol="SASL_PLAINTEXT",
                          sasl_mechanism="SCRAM-SHA-256", sasl_plain_username=user, sasl_plain_password=pw)  # fmt: skip
        p.send("format-check", b"x").get(timeout=60)
        p.close()
    finally:
        b.stop()


@pytest.mark.integration  # the real Kafka StorageTool (local jars)
def test_a_failed_format_says_why_and_is_tried_once_more(kafka_libs: Path, tmp_path: Path) -> None:
    """The harness's format step on the real StorageTool: a try that fails is a warning that
    carries what the tool printed (here: the directory was formatted already), and the second
    try, on a fresh directory and id, formats."""
    b = KafkaBroker(tmp_path / "kafka", libs=kafka_libs)
    b._configure()
    stale = b._cluster_id
    b._format()  # formatted once: StorageTool refuses to format that directory again
    assert b._formatted
    with pytest.warns(UserWarning, match=r"(?s)format failed once.*exited with status 1.*stderr") as w:
        b._format()
    assert "already formatted" in str(w[0].message).lower(), w[0].message
    assert b._formatted and b._cluster_id != stale
    assert f"cluster.id={b._cluster_id}" in (b.dir / "data" / "meta.properties").read_text()


def test_a_failed_tool_says_what_it_printed() -> None:
    with pytest.raises(ToolFailed, match=r"(?s)exited with status 3.*stderr.*boom.*stdout.*out"):
        run_tool([sys.executable, "-c", "import sys; print('out'); sys.stderr.write('boom'); sys.exit(3)"])
    with pytest.raises(ToolFailed, match=r"still running after 0.5 s"):
        run_tool([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert run_tool([sys.executable, "-c", "print('fine')"]) == "fine\n"


def test_cluster_ids_are_what_kafka_draws() -> None:
    for _ in range(2000):
        cid = random_cluster_id()
        assert len(cid) == 22 and not cid.startswith("-")
        assert len(base64.urlsafe_b64decode(cid + "==")) == 16


def test_clickhouse_container_is_the_compose_servers(tmp_path: Path) -> None:
    ch = make_server(tmp_path, modern=True)
    assert isinstance(ch, ClickHouseContainer) and ch.modern and ch.version >= CLICKHOUSE_MIN
    old = make_server(tmp_path, modern=False)
    assert isinstance(old, ClickHouseServer) and not old.modern and old.version == (18, 16)
    spec = ch.container_spec()
    check_spec_common(spec, "clickhouse")
    compose = SERVICES["clickhouse"]
    assert set(spec.env) == set(compose["environment"])
    assert spec.env == {"CLICKHOUSE_PASSWORD": PASSWORD, "GRAFANA_CLICKHOUSE_PASSWORD": GRAFANA_PASSWORD}
    users = mounts_of("clickhouse")[USERS_IN_IMAGE]
    assert {(m.target, m.source) for m in spec.mounts} == {
        (USERS_IN_IMAGE, (ROOT / users).resolve()), (PORTS_IN_IMAGE, tmp_path / "ports.xml")}  # fmt: skip
    nofile = compose["ulimits"]["nofile"]
    assert spec.ulimits == (("nofile", nofile["soft"], nofile["hard"]),)
    root = ET.fromstring(ch.ports_xml())
    assert (root.findtext("tcp_port"), root.findtext("http_port")) == (str(ch.port), str(ch.http_port))
    for other in ("interserver_http_port", "mysql_port", "postgresql_port"):  # the image's other listeners
        el = root.find(other)
        assert el is not None and el.get("remove") == "1", other
    assert ch.port != ch.http_port


def test_alertmanager_container_is_the_compose_ones(tmp_path: Path) -> None:
    am = Alertmanager(tmp_path / "am", container=True)
    spec = am.container_spec()
    check_spec_common(spec, "alertmanager")
    assert SERVICES["alertmanager"]["command"] == [f"--config.file={CONFIG_IN_IMAGE}"]
    assert spec.command[0] == f"--config.file={CONFIG_IN_IMAGE}"
    assert f"--web.listen-address=127.0.0.1:{am.port}" in spec.command
    assert CONFIG_IN_IMAGE in mounts_of("alertmanager")
    targets = {m.target: m for m in spec.mounts}
    assert targets[CONFIG_IN_IMAGE].source == tmp_path / "am" / "am.yml"
    assert (targets["/alertmanager"].source, targets["/alertmanager"].mode) == (
        tmp_path / "am" / "data",
        "rw",
    )
    assert spec.user == f"{os.getuid()}:{os.getgid()}"


def test_grafana_container_mounts_the_repositorys_provisioning(tmp_path: Path) -> None:
    g = GrafanaContainer(tmp_path / "g", clickhouse_port=19000)
    g.write_files()
    spec = g.container_spec()
    check_spec_common(spec, "grafana")
    compose = SERVICES["grafana"]
    for k in ("GF_INSTALL_PLUGINS", "GF_AUTH_ANONYMOUS_ENABLED"):
        assert spec.env[k] == compose["environment"][k], k
    assert "GRAFANA_CLICKHOUSE_PASSWORD" in compose["environment"]
    assert spec.env["GRAFANA_CLICKHOUSE_PASSWORD"] == GRAFANA_PASSWORD
    assert (spec.env["GF_SERVER_HTTP_ADDR"], spec.env["GF_SERVER_HTTP_PORT"]) == ("127.0.0.1", str(g.port))
    want = mounts_of("grafana")
    got = {m.target: m.source for m in spec.mounts}
    assert set(got) == set(want)  # every compose mount, at the same place
    datasources = "/etc/grafana/provisioning/datasources"
    for target, src in want.items():
        if target != datasources:
            assert got[target] == (ROOT / src).resolve(), target
    # the datasource file: the repository's, but for the address of the test's ClickHouse
    derived = yaml.safe_load((got[datasources] / "clickhouse.yaml").read_text())
    original = yaml.safe_load((ROOT / want[datasources] / "clickhouse.yaml").read_text())
    (d,), (o,) = derived["datasources"], original["datasources"]
    assert (d["jsonData"].pop("host"), d["jsonData"].pop("port")) == ("127.0.0.1", 19000)
    o["jsonData"].pop("host"), o["jsonData"].pop("port")
    assert derived == original
    assert yaml.safe_load(datasource_yaml(1))["datasources"][0]["jsonData"]["port"] == 1
    assert oct(got[datasources].stat().st_mode & 0o777) == "0o755"  # the image's grafana user reads it


def test_the_compose_backfill_agent_parses_with_the_real_cli() -> None:
    from gpuslo.app.cli import build_parser
    from tests.test_compose_stack import BACKFILL_H, override

    now = time.time()
    (svc,) = override(now)["services"].values()
    args = build_parser().parse_args(svc["command"])
    assert callable(args.func) and not args.realtime
    assert args.kafka == "kafka:9092" and args.cluster == "backfill" and args.hours == BACKFILL_H
    assert now - BACKFILL_H * 3600 - 60 < args.start <= now - BACKFILL_H * 3600
    assert svc["image"] == SERVICES["agent"]["image"]


def test_the_container_uses_testcontainers_as_documented(tmp_path: Path) -> None:
    """Spec -> the keyword arguments docker's containers.create gets (testcontainers passes them on)."""
    spec = ClickHouseContainer(tmp_path).container_spec()
    assert spec.run_kwargs() == {
        "network_mode": "host",
        "ulimits": [{"name": "nofile", "soft": 262144, "hard": 262144}],
    }
    assert Spec(image="x", user="1:2").run_kwargs() == {"network_mode": "host", "user": "1:2"}
    # the testcontainers calls Container makes (a DockerContainer cannot even be built without an
    # engine: its constructor connects), checked against the installed version's signatures
    import inspect

    tc = pytest.importorskip("testcontainers.core.container")
    params = {n: list(inspect.signature(getattr(tc.DockerContainer, n)).parameters)
              for n in ("with_kwargs", "with_env", "with_volume_mapping", "with_command", "start", "stop",
                        "get_wrapped_container", "get_logs")}  # fmt: skip
    assert params["with_volume_mapping"][:4] == ["self", "host", "container", "mode"]
    assert params["with_env"][:3] == ["self", "key", "value"]
    assert params["with_kwargs"] == ["self", "kwargs"]


def varint(data: bytes, i: int) -> tuple[int, int]:
    """ClickHouse's VarUInt (LEB128) at ``i``: (value, next index)."""
    value, shift = 0, 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


@pytest.mark.integration  # a store migrated and written: over 0.7 s
def test_the_copy_into_the_servers_store_takes_every_stored_table(store: Any) -> None:
    """tests/test_grafana_image.py copies the demo's store into the containerised server: every
    table of the schema but the materialized views' targets (the server's views fill them), with
    its stored columns, as Native bytes that carry every row."""
    from gpuslo.ingest.writer import write
    from gpuslo.rules.tables import SCHEMA
    from tests.servers.clickhouse import copy_plan, native_rows
    from tests.test_clickhouse_24_8 import _fixture

    ddl = SCHEMA.create()
    tables = {m.group(1) for d in ddl if (m := re.match(r"CREATE TABLE IF NOT EXISTS (\w+)", d))}
    targets = {
        m.group(1) for d in ddl if (m := re.match(r"CREATE MATERIALIZED VIEW IF NOT EXISTS \w+ TO (\w+)", d))
    }
    assert targets == {"rollup_dirty"}
    write(store, _fixture())
    plan = dict(copy_plan(store))
    assert set(plan) == tables - targets
    for name, cols in plan.items():
        stored = [
            r["name"]
            for r in store.query(f"DESCRIBE TABLE `{name}`")
            if r["default_type"] not in ("MATERIALIZED", "ALIAS")
        ]
        assert cols == stored, name
    n = store.query("SELECT count() AS n FROM gpu_samples")[0]["n"]
    assert n > 0
    data = native_rows(store, "gpu_samples", plan["gpu_samples"])
    # Native: each block starts with its column and row counts (varints); the blocks' rows add up
    i, rows, blocks = 0, 0, 0
    while i < len(data) and blocks < 1:
        ncols, i = varint(data, i)
        nrows, i = varint(data, i)
        assert ncols == len(plan["gpu_samples"])
        rows, blocks = rows + nrows, blocks + 1
    assert 0 < rows <= n  # the first block's rows (a store this small writes one or few blocks)
    assert b"DateTime64(3, 'UTC')" in data and b"LowCardinality(String)" in data


# ---------------------------------------------------------------------------- honest skips
@pytest.mark.integration  # a pytest run in a subprocess (a few seconds)
def test_without_an_engine_the_container_tests_are_skipped_with_the_reason(sock_dir: Path) -> None:
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock_dir / 'no-engine.sock'}", be.ENV: "auto"}
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-n0",
                        "tests/test_clickhouse_image.py", "tests/test_compose_stack.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"^(\d+) skipped in ", out, re.M)  # every test of both files skipped, none run
    assert m and int(m.group(1)) >= 2, out[-3000:]
    reason = f"needs a container: no Docker engine reachable at unix://{sock_dir / 'no-engine.sock'} (FileNotFoundError"
    assert out.count(reason) == int(m.group(1)), out[-3000:]  # each one listed with the reason (-rs)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n0",
                        "tests/test_clickhouse_image.py"], cwd=ROOT, env={**env, be.ENV: "containers"},
                       capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert (
        r.returncode == 1 and "GPUSLO_TEST_SERVERS=containers but no Docker engine reachable at" in r.stdout
    )


@pytest.mark.integration  # a pytest run in a subprocess
def test_a_bogus_back_end_stops_the_run_at_once() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n0", "--co",
                        "tests/test_wire.py"], cwd=ROOT, env={**os.environ, be.ENV: "dockerr"},
                       capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 4, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "GPUSLO_TEST_SERVERS='dockerr' is not a back-end; allowed: local, containers, auto" in r.stderr

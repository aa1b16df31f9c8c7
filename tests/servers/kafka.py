"""A real Apache Kafka 4.x broker for the integration tests: KRaft, combined mode,
one node, on free loopback ports; jars from Maven Central via provision/kafka.sh, or the
compose file's image (tests/servers/images.py) with the same server.properties, TLS files and
ports where the container back-end is chosen (tests/servers/backend.py)."""

from __future__ import annotations

import base64
import os
import shlex
import shutil
import socket
import subprocess
import time
import uuid
import warnings
from pathlib import Path

from tests.servers.containers import Container, Mount, Spec
from tests.servers.images import IMAGES
from tests.servers.ports import free_port
from tests.servers.tls import make_certs
from tests.servers.tool import ToolFailed, run_tool

ROOT = Path(__file__).resolve().parents[2]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def provision() -> Path:
    out = subprocess.run(
        ["bash", str(ROOT / "provision/kafka.sh")], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"provision/kafka.sh failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


KAFKA_HOME = "/opt/kafka"  # in the apache/kafka image


def random_cluster_id() -> str:
    """What ``StorageTool random-uuid`` prints (Kafka's Uuid.randomUuid): 16 random bytes in
    URL-safe base64 without padding, never starting with '-' (Kafka re-draws those)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


SASL_USERS = {"gpuslo-plain": "plain-secret-1"}  # PLAIN users (JAAS)
SCRAM_USERS = {"gpuslo-scram": "scram-secret-2"}  # SCRAM-SHA-256 users (added at format time)


class KafkaBroker:
    """Listeners: PLAINTEXT on ``port``; SASL_PLAINTEXT (PLAIN and SCRAM-SHA-256) on ``sasl_port``;
    SSL with client certificates required (mutual TLS) on ``ssl_port``; SASL_SSL on
    ``sasl_ssl_port``. The TLS files (a throw-away CA, the broker's certificate for 127.0.0.1,
    a client certificate) are made with openssl in ``tls_dir``.

    ``container``: run the broker of the compose file's image instead of the local jars, with the
    same files (the work directory is mounted at its own path) on the same ports (host network).

    ``flush_each_message``: the broker writes every message to disk before it answers
    (``log.flush.interval.messages=1``: the tests' broker, whose data outlives a crash of the
    machine's page cache too); False: Kafka's default, which leaves the flush to the page cache
    and durability to replication, as production brokers run (the benchmarks': an offset commit
    then costs a round trip, not an fsync of ``__consumer_offsets``).

    ``authorizer``: Kafka's StandardAuthorizer, with every resource that has no ACL open to
    everyone and the PLAINTEXT listener's principal (``User:ANONYMOUS``: the broker itself, the
    controller, the tests' admin) a super user: a test takes rights away with a DENY ACL.

    ``auto_create_topics``: the broker makes a topic the first time a client asks for it (Kafka's
    default); False, as many managed and production brokers run: a topic exists once made."""

    def __init__(
        self,
        workdir: Path,
        libs: Path | None = None,
        partitions: int = 3,
        container: bool = False,
        flush_each_message: bool = True,
        authorizer: bool = False,
        auto_create_topics: bool = True,
    ) -> None:
        self.flush_each_message = flush_each_message
        self.auto_create_topics = auto_create_topics
        self.authorizer = authorizer
        self.in_container = container
        self.libs = None if container else (libs or provision())
        self.dir = workdir
        self.port = free_port()
        self.sasl_port = free_port()
        self.ssl_port = free_port()
        self.sasl_ssl_port = free_port()
        self.controller_port = free_port()
        self.partitions = partitions
        self.proc: subprocess.Popen[bytes] | None = None
        self.container: Container | None = None
        self._formatted = False
        self._cluster_id = ""

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sasl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.sasl_port}"

    @property
    def ssl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.ssl_port}"

    @property
    def sasl_ssl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.sasl_ssl_port}"

    @property
    def tls_dir(self) -> Path:
        return self.dir / "tls"

    def _make_tls(self) -> None:
        """ca.pem, broker.crt/.key, client.crt/.key; broker.pem is key + certificate for Kafka's
        PEM key store (which wants the key as PKCS#8)."""
        d = self.tls_dir
        make_certs(d, servers=("broker",), clients=("client",))
        (d / "broker.pem").write_text((d / "broker.p8").read_text() + (d / "broker.crt").read_text())

    def _java(self, *args: str) -> list[str]:
        java = shutil.which("java") or "java"
        return [
            java, "-Xmx512m", "-Xms128m", "-XX:+UseSerialGC",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
            "-cp", f"{self.libs}/*", *args,
        ]  # fmt: skip

    def _listeners(self) -> str:
        return (
            f"PLAINTEXT://127.0.0.1:{self.port},SASL_PLAINTEXT://127.0.0.1:{self.sasl_port},"
            f"SSL://127.0.0.1:{self.ssl_port},SASL_SSL://127.0.0.1:{self.sasl_ssl_port}"
        )

    def _configure(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._make_tls()
        tls = self.tls_dir
        jaas = {
            "plain": "org.apache.kafka.common.security.plain.PlainLoginModule required "
            + " ".join(f'user_{u}="{p}"' for u, p in SASL_USERS.items())
            + ";",
            "scram-sha-256": "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        }
        (self.dir / "server.properties").write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.bootstrap.servers=127.0.0.1:{self.controller_port}",
                    f"listeners={self._listeners()},CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners={self._listeners()}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,"
                    "SSL:SSL,SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
                    "sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256",
                    *(
                        f"listener.name.{ln}.{mech}.sasl.jaas.config={cfg}"
                        for ln in ("sasl_plaintext", "sasl_ssl")
                        for mech, cfg in jaas.items()
                    ),
                    "ssl.keystore.type=PEM",
                    f"ssl.keystore.location={tls / 'broker.pem'}",
                    "ssl.truststore.type=PEM",
                    f"ssl.truststore.location={tls / 'ca.pem'}",
                    "listener.name.ssl.ssl.client.auth=required",
                    f"log.dirs={self.dir / 'data'}",
                    f"num.partitions={self.partitions}",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=4",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    f"auto.create.topics.enable={str(self.auto_create_topics).lower()}",
                    *(["log.flush.interval.messages=1"] if self.flush_each_message else []),
                    *(
                        [
                            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                            "allow.everyone.if.no.acl.found=true",
                            "super.users=User:ANONYMOUS",
                        ]
                        if self.authorizer
                        else []
                    ),
                ]
            )
            + "\n"
        )
        (self.dir / "log4j2.properties").write_text(
            "rootLogger.level=WARN\nrootLogger.appenderRef.f.ref=F\n"
            "appender.f.type=File\nappender.f.name=F\n"
            f"appender.f.fileName={self.dir / 'broker.log'}\n"
            "appender.f.layout.type=PatternLayout\nappender.f.layout.pattern=%d %p %c: %m%n\n"
        )
        self._cluster_id = random_cluster_id()

    def _format_args(self) -> list[str]:
        """StorageTool's ``format``: this node alone, the SCRAM users added at format time."""
        return ["format", "--standalone", "-t", self._cluster_id, "-c", str(self.dir / "server.properties"),
                *[a for u, p in SCRAM_USERS.items()
                  for a in ("--add-scram", f"SCRAM-SHA-256=[name={u},password={p}]")]]  # fmt: skip

    def _format(self) -> None:
        """StorageTool ``format``, once more on a fresh data directory and cluster id if the first
        try fails (a CI run saw it exit 1 once, on one worker, without a word kept of why: a
        second failure raises with both tries' output and the broker log; a first one is a
        warning with its output, so the next time says why)."""
        try:
            run_tool(self._java("kafka.tools.StorageTool", *self._format_args()))
        except ToolFailed as first:
            warnings.warn(f"Kafka's StorageTool format failed once, trying again: {first}\n"
                          f"{self.tail()}", stacklevel=2)  # fmt: skip
            shutil.rmtree(self.dir / "data", ignore_errors=True)
            self._cluster_id = random_cluster_id()
            try:
                run_tool(self._java("kafka.tools.StorageTool", *self._format_args()))
            except ToolFailed as second:
                raise RuntimeError(f"Kafka's StorageTool format failed twice:\n{first}\n{second}\n"
                                   f"{self.tail()}") from None  # fmt: skip
        self._formatted = True

    def container_spec(self) -> Spec:
        """The image's broker on this broker's files: formatted on first start (``--ignore-formatted``
        on a restart keeps the data), run as the owner of the work directory."""
        props = shlex.quote(str(self.dir / "server.properties"))
        fmt = " ".join(shlex.quote(a) for a in self._format_args())
        script = (
            f"set -e; {KAFKA_HOME}/bin/kafka-storage.sh {fmt} --ignore-formatted; "
            f"exec {KAFKA_HOME}/bin/kafka-server-start.sh {props}"
        )
        return Spec(
            image=IMAGES["kafka"],
            command=("sh", "-c", script),
            env={
                "KAFKA_HEAP_OPTS": "-Xmx512m -Xms128m",
                "KAFKA_LOG4J_OPTS": f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
                "LOG_DIR": str(self.dir / "logs"),
            },
            mounts=(Mount(self.dir, str(self.dir), "rw"),),
            user=f"{os.getuid()}:{os.getgid()}",
        )

    def start(self, timeout_s: float = 90.0) -> None:
        if self.in_container:
            self._start_container(timeout_s)
            return
        if not self._formatted:
            self._configure()
            self._format()
        log = open(self.dir / "stdout.log", "ab")  # noqa: SIM115 - the broker process owns it
        self.proc = subprocess.Popen(
            self._java("kafka.Kafka", str(self.dir / "server.properties")),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"Kafka exited with {self.proc.returncode}: {self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Kafka did not open port {self.port} in {timeout_s} s: {self.tail()}")
            time.sleep(0.2)

    def _start_container(self, timeout_s: float) -> None:
        if self.container is None:
            self._configure()
            self.container = Container(self.container_spec())
        self.container.start()
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if not self.container.running():
                raise RuntimeError(f"the Kafka container exited: {self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kafka did not open port {self.port} in {timeout_s} s: {self.tail()}")
            time.sleep(0.2)

    def tail(self, n: int = 3000) -> str:
        text = self.container.logs(n) if self.container is not None else ""
        for name in ("stdout.log", "broker.log"):
            p = self.dir / name
            if p.exists():
                text += p.read_text(errors="replace")[-n:]
        return text

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.container is not None:
            self.container.stop(int(timeout_s))
            self._wait_closed()
            return
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None
        self._wait_closed()

    def _wait_closed(self) -> None:
        deadline = time.monotonic() + 10
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        """Stop, and remove the container (the local broker: stop)."""
        self.stop()
        if self.container is not None:
            self.container.close()
            self.container = None

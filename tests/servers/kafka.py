"""A real Apache Kafka 4.x broker for the integration tests: KRaft, combined mode,
one node, on free loopback ports; jars from Maven Central via provision/kafka.sh."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.servers.tls import make_certs

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


SASL_USERS = {"gpuslo-plain": "plain-secret-1"}  # PLAIN users (JAAS)
SCRAM_USERS = {"gpuslo-scram": "scram-secret-2"}  # SCRAM-SHA-256 users (added at format time)


class KafkaBroker:
    """Listeners: PLAINTEXT on ``port``; SASL_PLAINTEXT (PLAIN and SCRAM-SHA-256) on ``sasl_port``;
    SSL with client certificates required (mutual TLS) on ``ssl_port``; SASL_SSL on
    ``sasl_ssl_port``. The TLS files (a throw-away CA, the broker's certificate for 127.0.0.1,
    a client certificate) are made with openssl in ``tls_dir``."""

    def __init__(self, workdir: Path, libs: Path | None = None, partitions: int = 3) -> None:
        self.libs = libs or provision()
        self.dir = workdir
        self.port = free_port()
        self.sasl_port = free_port()
        self.ssl_port = free_port()
        self.sasl_ssl_port = free_port()
        self.controller_port = free_port()
        self.partitions = partitions
        self.proc: subprocess.Popen[bytes] | None = None
        self._formatted = False

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
                    "auto.create.topics.enable=true",
                    "log.flush.interval.messages=1",
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
        cid = (
            subprocess.run(
                self._java("kafka.tools.StorageTool", "random-uuid"),
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "--standalone", "-t", cid,
                       "-c", str(self.dir / "server.properties"),
                       *[a for u, p in SCRAM_USERS.items()
                         for a in ("--add-scram", f"SCRAM-SHA-256=[name={u},password={p}]")]),
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        self._formatted = True

    def start(self, timeout_s: float = 90.0) -> None:
        if not self._formatted:
            self._configure()
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

    def tail(self, n: int = 3000) -> str:
        text = ""
        for name in ("stdout.log", "broker.log"):
            p = self.dir / name
            if p.exists():
                text += p.read_text(errors="replace")[-n:]
        return text

    def stop(self, timeout_s: float = 30.0) -> None:
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
        deadline = time.monotonic() + 10
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)

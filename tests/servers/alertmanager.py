"""A real Prometheus Alertmanager on a free loopback port: Debian's prometheus-alertmanager, or the
compose file's image (tests/servers/images.py) with the same configuration on the same port
where the container back-end is chosen (tests/servers/backend.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.servers.containers import Container, Mount, Spec
from tests.servers.images import IMAGES
from tests.servers.kafka import port_open
from tests.servers.ports import free_port

CONFIG_IN_IMAGE = "/etc/alertmanager/alertmanager.yml"  # where docker-compose.yml mounts it


def binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


class Alertmanager:
    def __init__(self, workdir: Path, config: str = "", container: bool = False) -> None:
        """``config``: the alertmanager.yml text (default: one receiver that sends nowhere);
        ``container``: run the image's Alertmanager (host network: the same 127.0.0.1 port, and
        webhooks on 127.0.0.1 are reached as from the local one)."""
        self.dir = workdir
        self.config = config or "route:\n  receiver: none\nreceivers:\n  - name: none\n"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.in_container = container
        self.container: Container | None = None

    def container_spec(self) -> Spec:
        return Spec(
            image=IMAGES["alertmanager"],
            command=(f"--config.file={CONFIG_IN_IMAGE}", "--storage.path=/alertmanager",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="),
            mounts=(Mount(self.dir / "am.yml", CONFIG_IN_IMAGE), Mount(self.dir / "data", "/alertmanager", "rw")),
            user=f"{os.getuid()}:{os.getgid()}",  # the storage is the work directory's, as the local one's
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start_container(self, timeout_s: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "am.yml").write_text(self.config)
        (self.dir / "data").mkdir(exist_ok=True)
        if self.container is None:
            self.container = Container(self.container_spec())
        self.container.start()
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if not self.container.running() or time.monotonic() > deadline:
                raise RuntimeError(f"the Alertmanager container did not start: {self.container.logs()}")
            time.sleep(0.1)

    def start(self, timeout_s: float = 30.0) -> None:
        if self.in_container:
            self._start_container(timeout_s)
            return
        exe = binary()
        if exe is None:
            raise RuntimeError("Alertmanager is not installed (apt-get install prometheus-alertmanager)")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "am.yml").write_text(self.config)
        self.proc = subprocess.Popen(
            [exe, f"--config.file={self.dir / 'am.yml'}", f"--storage.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=open(self.dir / "am.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True,  # noqa: SIM115
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((self.dir / "am.log").read_text()[-2000:])
            time.sleep(0.1)

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/api/v2/alerts", timeout=5) as r:
            data: list[dict[str, Any]] = json.load(r)
            return data

    def stop(self) -> None:
        if self.container is not None:
            self.container.close()  # a restart is a new container on the same storage, as a new process is
            self.container = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)
        self.proc = None

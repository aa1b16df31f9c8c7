"""A real Prometheus Alertmanager (Debian prometheus-alertmanager) on a free loopback port."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.servers.kafka import free_port, port_open


def binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


class Alertmanager:
    def __init__(self, workdir: Path, config: str = "") -> None:
        """``config``: the alertmanager.yml text (default: one receiver that sends nowhere)."""
        self.dir = workdir
        self.config = config or "route:\n  receiver: none\nreceivers:\n  - name: none\n"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)
        self.proc = None

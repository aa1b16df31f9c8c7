"""Grafana from the compose file's image, with the ClickHouse plugin and the repository's own
provisioning (dashboards/provisioning, dashboards/generated) mounted where docker-compose.yml
mounts them. Only the datasource's address differs: the containerised ClickHouse of the test
(127.0.0.1 and its port, on the host network) instead of the compose service ``clickhouse:9000``;
the datasource file is derived from the repository's and nothing else in it changes."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.servers.clickhouse import GRAFANA_PASSWORD
from tests.servers.containers import Container, Mount, Spec
from tests.servers.images import GRAFANA_PLUGINS, IMAGES
from tests.servers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROVISIONING = ROOT / "dashboards/provisioning"
DATASOURCES_IN_IMAGE = "/etc/grafana/provisioning/datasources"
DASHBOARDS_IN_IMAGE = "/etc/grafana/provisioning/dashboards"
ADMIN_PASSWORD = "gpuslo-grafana-admin"


def dashboards_path() -> str:
    """Where the repository's dashboard provider reads the JSON (gpuslo.yaml's options.path)."""
    prov = yaml.safe_load((PROVISIONING / "dashboards/gpuslo.yaml").read_text())
    path: str = prov["providers"][0]["options"]["path"]
    return path


def datasource_yaml(clickhouse_port: int) -> str:
    """The repository's datasource file with the address of the test's ClickHouse."""
    ds = yaml.safe_load((PROVISIONING / "datasources/clickhouse.yaml").read_text())
    for source in ds["datasources"]:
        source["jsonData"]["host"] = "127.0.0.1"
        source["jsonData"]["port"] = clickhouse_port
    return str(yaml.safe_dump(ds, sort_keys=False))


class GrafanaContainer:
    def __init__(self, workdir: Path, clickhouse_port: int) -> None:
        self.dir = workdir
        self.port = free_port()
        self.clickhouse_port = clickhouse_port
        self.container: Container | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def container_spec(self) -> Spec:
        return Spec(
            image=IMAGES["grafana"],
            env={
                "GF_INSTALL_PLUGINS": GRAFANA_PLUGINS,
                "GF_AUTH_ANONYMOUS_ENABLED": "true",
                "GRAFANA_CLICKHOUSE_PASSWORD": GRAFANA_PASSWORD,
                "GF_SERVER_HTTP_ADDR": "127.0.0.1",
                "GF_SERVER_HTTP_PORT": str(self.port),
                "GF_SECURITY_ADMIN_PASSWORD": ADMIN_PASSWORD,
            },
            mounts=(
                Mount(self.dir / "datasources", DATASOURCES_IN_IMAGE),
                Mount(PROVISIONING / "dashboards", DASHBOARDS_IN_IMAGE),
                Mount(ROOT / "dashboards/generated", dashboards_path()),
            ),
        )

    def write_files(self) -> None:
        d = self.dir / "datasources"
        d.mkdir(parents=True, exist_ok=True)
        (d / "clickhouse.yaml").write_text(datasource_yaml(self.clickhouse_port))
        d.chmod(0o755)  # read by the image's grafana user
        (d / "clickhouse.yaml").chmod(0o644)

    def start(self, timeout_s: float = 300.0) -> None:
        """Started and ready: the API answers and the provisioned datasource exists (the plugin is
        downloaded at the first start: minutes on a slow network)."""
        self.write_files()
        self.container = Container(self.container_spec())
        self.container.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, _ = self.api("GET", "/api/datasources/uid/gpuslo-clickhouse")
                if status == 200:
                    return
            except OSError:
                pass
            if not self.container.running() or time.monotonic() > deadline:
                raise RuntimeError(f"Grafana did not become ready: {self.container.logs()}")
            time.sleep(1.0)

    def api(self, method: str, path: str, body: Any = None, timeout_s: float = 60) -> tuple[int, Any]:
        """One call to Grafana's HTTP API as the admin: (status, decoded JSON or the text)."""
        auth = base64.b64encode(f"admin:{ADMIN_PASSWORD}".encode()).decode()
        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Basic {auth}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def stop(self) -> None:
        if self.container is not None:
            self.container.close()
            self.container = None

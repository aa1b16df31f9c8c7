"""docker-compose.yml cannot run here (no Docker engine): check that it agrees with the
repository and with the code's defaults instead."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslo.app.cli import build_parser
from gpuslo.core.settings import ClickHouseSettings, load
from gpuslo.dashboards.clickhouse import DATASOURCE_UID, PLUGIN_TYPE
from gpuslo.dashboards.generate import render
from gpuslo.rules.config import example

ROOT = Path(__file__).resolve().parents[1]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
GPUSLO = [n for n, s in SERVICES.items() if s.get("image") in ("gpuslo:local", "gpuslo-agent:local")]


def dockerfile_stages() -> dict[str, str]:
    """Each build stage of the Dockerfile (FROM ... AS NAME) and its text."""
    stages: dict[str, str] = {}
    name = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if m := re.match(r"FROM \S+(?: AS (\S+))?$", line):
            name = m.group(1) or f"stage{len(stages)}"
            stages[name] = ""
        elif name:
            stages[name] += line + "\n"
    return stages


def _installs(stage: str) -> list[str]:
    return re.findall(r"pip install [^&]*?-c constraints.txt '(\.\[[a-z,]+\])'", stage)


def test_every_gpuslo_service_command_parses_with_the_real_cli() -> None:
    assert set(GPUSLO) == {"agent", "ingest", "rules"}
    for name in GPUSLO:
        args = build_parser().parse_args(SERVICES[name]["command"])
        assert callable(args.func), name
    for name in GPUSLO:
        assert (ROOT / SERVICES[name]["build"]["context"] / "Dockerfile").is_file()


def test_the_agent_runs_on_the_slim_image_and_the_rest_on_the_full_one() -> None:
    stages = dockerfile_stages()
    assert _installs(stages["agent"]) == [".[agent]"]
    assert _installs(stages["full"]) == [".[all]"]
    assert list(stages)[-1] == "full"  # `docker build .` without --target builds the whole set
    assert SERVICES["agent"]["build"]["target"] == "agent"
    assert SERVICES["agent"]["image"] != SERVICES["ingest"]["image"]
    for name in ("ingest", "rules"):
        assert SERVICES[name]["build"]["target"] == "full", name


def test_bind_mounts_exist_in_the_repository() -> None:
    for name, svc in SERVICES.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: {src} is not in the repository"
            else:
                assert src in COMPOSE["volumes"], f"{name}: named volume {src} is not declared"


def test_ports_and_addresses_agree_with_the_code() -> None:
    kafka = SERVICES["kafka"]["environment"]
    assert "PLAINTEXT://kafka:9092" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    agent = build_parser().parse_args(SERVICES["agent"]["command"])
    ingest = build_parser().parse_args(SERVICES["ingest"]["command"])
    assert agent.kafka == ingest.kafka == "kafka:9092"
    svc_cfg = load(ROOT / "deploy/compose/service.yaml")
    assert svc_cfg.kafka.bootstrap_servers == ["kafka:9092"]
    assert svc_cfg.clickhouse is not None
    assert (svc_cfg.clickhouse.host, svc_cfg.clickhouse.port) == ("clickhouse", ClickHouseSettings().port)
    assert f"{svc_cfg.clickhouse.port}:{svc_cfg.clickhouse.port}" in SERVICES["clickhouse"]["ports"]
    assert f"{ingest.metrics_port}:{ingest.metrics_port}" in SERVICES["ingest"]["ports"]
    assert ingest.metrics_addr == "0.0.0.0"  # a published port: the container's loopback would not do
    assert svc_cfg.ingest.metrics_port == ingest.metrics_port
    assert svc_cfg.clickhouse.password_env == "CLICKHOUSE_PASSWORD"
    assert "CLICKHOUSE_PASSWORD" in SERVICES["ingest"]["environment"]
    rules = build_parser().parse_args(SERVICES["rules"]["command"])
    am_port = SERVICES["alertmanager"]["ports"][0].split(":")[1]
    assert rules.alertmanager == [f"http://alertmanager:{am_port}"]
    assert rules.outbox.startswith("/var/lib/gpuslo/")


def test_grafana_provisioning_matches_the_generated_dashboards() -> None:
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in SERVICES["grafana"]["volumes"]}
    ds = yaml.safe_load((mounts["/etc/grafana/provisioning/datasources"] / "clickhouse.yaml").read_text())
    (source,) = ds["datasources"]
    assert (source["type"], source["uid"]) == (PLUGIN_TYPE, DATASOURCE_UID)
    assert source["jsonData"]["host"] == "clickhouse" and source["jsonData"]["port"] == 9000
    # Grafana reads as a read-only user that the ClickHouse container defines
    import xml.etree.ElementTree as ET

    user = source["jsonData"]["username"]
    users_xml = next(ROOT / v.split(":")[0] for v in SERVICES["clickhouse"]["volumes"] if "users" in v)
    root = ET.parse(users_xml).getroot()
    profile = root.findtext(f"users/{user}/profile")
    assert root.findtext(f"profiles/{profile}/readonly") == "1"
    env = source["secureJsonData"]["password"].lstrip("$")
    assert root.find(f"users/{user}/password").get("from_env") == env  # type: ignore[union-attr]
    assert env in SERVICES["grafana"]["environment"] and env in SERVICES["clickhouse"]["environment"]
    assert PLUGIN_TYPE in SERVICES["grafana"]["environment"]["GF_INSTALL_PLUGINS"]
    prov = yaml.safe_load((mounts["/etc/grafana/provisioning/dashboards"] / "gpuslo.yaml").read_text())
    path = prov["providers"][0]["options"]["path"]
    assert mounts[path] == ROOT / "dashboards/generated"


@pytest.mark.parametrize("name", sorted(render(example())))
def test_checked_in_dashboards_are_up_to_date(name: str) -> None:
    """Golden files: regenerate with `gpuslo dashboards generate --out dashboards/generated`."""
    on_disk = (ROOT / "dashboards/generated" / name).read_text()
    assert on_disk == render(example())[name]
    assert json.loads(on_disk)["uid"]

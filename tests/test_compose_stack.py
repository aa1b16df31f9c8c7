"""``docker compose up`` of the shipped docker-compose.yml, end to end, with testcontainers'
compose support: opt-in (``GPUSLO_TEST_COMPOSE=1``, marker ``compose``) and only where a Docker
engine answers; it builds the two gpuslo images and binds the compose file's host ports (9092,
8123, 9000, 3000, 9093, 9466).

The stack runs as shipped, plus one service from an override file: a backfill agent (the same
image and command, not on the wall clock) that sends the simulated fleet's last 8 hours, whose
latency degrades in the last two (the simulator's degrade_hours 6-8), so that the SLO burns now;
the shipped agent alone starts its fleet now, and its degradation begins six hours later. The
test waits (bounded) for the agents' rows to reach ClickHouse through Kafka and the ingest, for
the rules engine's results table to fill, and for Alertmanager to receive the burn alerts;
then it takes the stack down with its volumes."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from gpuslo.core.settings import ClickHouseSettings
from gpuslo.ingest.clickhouse_store import ClickHouseStore

pytestmark = [pytest.mark.compose, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[1]
OPT_IN = "GPUSLO_TEST_COMPOSE"
WAIT_S = 900.0  # the images' first build and the plugin's download are the slow part
BACKFILL_H = 8


def override(now: float) -> dict[str, Any]:
    """The compose override: the backfill agent (the compose agent's image and arguments, with a
    start 8 hours ago, no --realtime, its own cluster name so that its nodes are not the live
    agent's), on the stack's Kafka."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    agent = compose["services"]["agent"]
    start = int(now // 60 * 60 - BACKFILL_H * 3600)
    command = [a for a in agent["command"] if a != "--realtime"]
    command[command.index("--spool-dir") + 1] = "/tmp/backfill-spool"
    return {"services": {"backfill": {
        "build": agent["build"], "image": agent["image"], "restart": "no", "depends_on": ["kafka"],
        "command": [*command, "--start", str(start), "--hours", str(BACKFILL_H), "--cluster", "backfill"],
    }}}  # fmt: skip


@pytest.fixture(scope="module")
def stack(container_backend: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(
            f"the compose stack is opt-in: {OPT_IN}=1 (builds the images, binds the compose file's ports)"
        )
    from testcontainers.compose import DockerCompose  # type: ignore[import-not-found, unused-ignore]

    extra = tmp_path_factory.mktemp("compose") / "backfill.yml"
    extra.write_text(yaml.safe_dump(override(time.time())))
    c = DockerCompose(ROOT, compose_file_name=["docker-compose.yml", str(extra)], build=True, wait=False)
    c.start()
    try:
        yield c
    finally:
        c.stop(down=True)


def wait_for(what: str, cond: Callable[[], bool], logs: Callable[[], str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            if cond():
                return
        except Exception:  # the service is not up yet (connection refused, no table yet)
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S:g} s; the stack's logs:\n{logs()[-6000:]}")
        time.sleep(5)


def test_compose_stack_fills_clickhouse_rule_results_and_alertmanager(stack: Any) -> None:
    password = os.environ.get("CLICKHOUSE_PASSWORD", "gpuslo")
    st = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=9000, database="gpuslo", password=SecretStr(password),
                                            connect_timeout_s=2))  # fmt: skip

    def logs() -> str:
        out, err = stack.get_logs()
        return str(out) + str(err)

    def count(table: str) -> int:
        return int(st.query(f"SELECT count() AS n FROM {table}")[0]["n"])

    def burn_alerts() -> list[dict[str, Any]]:
        with urllib.request.urlopen("http://127.0.0.1:9093/api/v2/alerts", timeout=5) as r:
            alerts: list[dict[str, Any]] = json.load(r)
        return [a for a in alerts if a["labels"].get("alertname") == "GpusloSLOBurn"]

    try:
        for table in ("gpu_samples", "node_heartbeats", "latency"):
            wait_for(f"the agents' {table} through Kafka into ClickHouse", lambda t=table: count(t) > 0, logs)  # type: ignore[misc]
        wait_for("the rules engine's rule_results", lambda: count("rule_results") > 0, logs)
        wait_for("the simulated fleet's burn alerts in Alertmanager", lambda: bool(burn_alerts()), logs)
        assert {a["labels"]["severity"] for a in burn_alerts()} <= {"page", "ticket"}
        assert count("dead_letters") == 0
    finally:
        st.close()

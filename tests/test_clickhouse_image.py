"""The server store on the compose file's ClickHouse server image (24.8, the oldest version the
schema supports), where a Docker engine answers: the schema migrates, the ingest's writer inserts
through the native protocol, the rollups refresh, and every rule query (the same list as the
chDB 24.8 check, tests/test_clickhouse_24_8.py) gives on the server the answers the current
embedded engine gives for the same rows; and every dashboard panel's query (expanded as Grafana
and the plugin expand it, tests/grafana.py) gives on the demo's rows copied into the server what
it gives on chDB. Elsewhere skipped with the reason (no engine)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import SecretStr

from gpuslo.core.settings import ClickHouseSettings
from gpuslo.ingest.clickhouse_store import ClickHouseStore
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.tables import SCHEMA
from tests.grafana import expand
from tests.servers.clickhouse import PASSWORD, ClickHouseContainer, copy_store
from tests.servers.images import CLICKHOUSE_MIN
from tests.test_clickhouse_24_8 import _fixture, _queries, _refresh

if TYPE_CHECKING:
    from gpuslo.agent.sim.fleet import SimConfig
    from gpuslo.app.embedded import DemoResult

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def image_server(
    container_backend: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClickHouseContainer]:
    s = ClickHouseContainer(tmp_path_factory.mktemp("ch-image"))
    s.start()
    try:
        yield s
    finally:
        s.close()


def norm(v: Any) -> Any:
    """One form for both drivers' values: times as epoch seconds (a naive time is UTC), floats
    rounded to 6 places, NaN as None, rows as lists."""
    if isinstance(v, datetime):
        return round((v if v.tzinfo else v.replace(tzinfo=UTC)).timestamp(), 6)
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 6)
    if isinstance(v, (list, tuple)):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return [norm(x) for x in v.values()]
    return v


def test_schema_writer_rollups_and_every_rule_query_agree_with_the_engine(
    image_server: ClickHouseContainer, tmp_path: Path
) -> None:
    msgs = _fixture()
    srv = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=image_server.port, database="gpuslo_rules",
                                             password=SecretStr(PASSWORD), connect_timeout_s=5))  # fmt: skip
    cur = ChdbStore(tmp_path / "cur")
    try:
        version = srv.query("SELECT version() AS v")[0]["v"]
        assert tuple(int(p) for p in version.split(".")[:2]) >= CLICKHOUSE_MIN, version
        srv.create_database()
        for st in (srv, cur):
            st.migrate(SCHEMA)
            write(st, msgs)
            for q, p in _refresh():
                st.execute(q, p)
        for q, p in _queries():
            want = norm(cur.query(q, p))
            assert want, q[:300]  # every query has something to agree on
            assert norm(srv.query(q, p)) == want, q[:300]
    finally:
        srv.close()
        cur.close()


def test_every_panel_query_on_the_server_equals_chdb(
    image_server: ClickHouseContainer, short_demo: tuple[SimConfig, DemoResult, Path]
) -> None:
    from tests.test_dashboards import ALL

    sim, _res, out = short_demo
    src = ChdbStore(out / "store")
    srv = ClickHouseStore(ClickHouseSettings(host="127.0.0.1", port=image_server.port, database="gpuslo_panels",
                                             password=SecretStr(PASSWORD), connect_timeout_s=5))  # fmt: skip
    try:
        assert copy_store(src, image_server, "gpuslo_panels").get("gpu_samples")
        differ = []
        for title, (text, _fmt) in ALL.items():
            q = expand(text, sim.start_ts, sim.end_ts)
            want = norm(src.query(q))
            assert want, title  # every panel has rows on the demo (tests/test_dashboards.py)
            if norm(srv.query(q)) != want:
                differ.append(title)
        assert not differ, differ
    finally:
        srv.close()
        src.close()

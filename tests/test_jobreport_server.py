"""``gpuslo job`` and ``gpuslo rightsize`` against a real ClickHouse server (Debian's 18.16, which
cannot hold gpuslo's schema: tests/servers/clickhouse.py) and against none: a store that is wrong,
refuses the credentials or is not there is one clear line and exit 2, never a traceback, and the
password never shows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpuslo.app.cli import EXIT_ERROR, main
from tests.servers.clickhouse import PASSWORD, ClickHouseServer
from tests.servers.ports import free_port

pytestmark = pytest.mark.integration  # a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseServer]:
    s = ClickHouseServer(tmp_path_factory.mktemp("clickhouse"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("case", ["wrong password", "schema too new for the server", "no server"])
@pytest.mark.parametrize(
    "command", [["job", "1042"], ["job", "o'brien\\"], ["rightsize", "--from", "0", "--to", "60"]]
)
def test_a_fatal_or_absent_store_is_one_line_and_exit_2(
    server: ClickHouseServer,
    tmp_path: Path,
    case: str,
    command: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    pw = "wrong-pw-789" if case == "wrong password" else PASSWORD
    port = free_port() if case == "no server" else server.port
    svc = {"clickhouse": {"host": "127.0.0.1", "port": port, "database": "gpuslo_job", "password": pw,
                          "connect_timeout_s": 2}}  # fmt: skip
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(svc))
    rc = main([*command, "--service-config", str(path)])
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpuslo {command[0]}: "), err
    assert "Traceback" not in err and PASSWORD not in err and "wrong-pw-789" not in err

"""The server of the agent's (and the ingest's) ``/metrics`` against clients a hostile or
unlucky network brings: connections that send nothing or trickle, more connections than it
serves at once, ``Accept`` headers prometheus-client cannot read, scrapes while the batches
change, and the agent's close. prometheus-client's ``start_http_server`` held a thread per idle
connection for ever (threads without bound), and answered an ``Accept`` whose ``version`` is
not a number with a 500 and a traceback on stderr."""

from __future__ import annotations

import gzip
import io
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from gpuslo.agent.assemble import WallClockAgent
from gpuslo.agent.exporter import AgentCollector, registry_with
from gpuslo.agent.sinks import JsonLinesSink
from gpuslo.wire import GpuSample, GpuSampleBatch
from tests.servers.ports import free_port


def _server(port: int = 0, col: AgentCollector | None = None, **kw: Any) -> Any:
    """A MetricsServer of ``col``'s page (imported here: the agent's server was
    prometheus-client's before, and the tests through the agent ran against that too)."""
    from gpuslo.core.metrics_http import MetricsServer

    return MetricsServer(port, "127.0.0.1", registry_with(col or AgentCollector()), **kw)


def _get(port: int, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture
def agent() -> Iterator[tuple[WallClockAgent, int]]:
    a = WallClockAgent([], JsonLinesSink(io.BytesIO()), 10.0)
    port = free_port()
    a.serve_metrics(port, "127.0.0.1")
    yield a, port
    a.close()


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=abc",
        "application/openmetrics-text; version=1.x",
        "application/openmetrics-text; version=1..0",
        "text/plain; version=foo",
        "text/plain; version=1.0.0-rc1",
    ],
)
def test_an_accept_version_that_is_not_a_number_gets_the_text_page(
    agent: tuple[WallClockAgent, int], accept: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """prometheus-client compares the version's parts with numbers: a 500 and a traceback on
    stderr for every such scrape. The range it cannot read is not offered: the text page, 200."""
    _, port = agent
    status, headers, body = _get(port, {"Accept": accept})
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "gpuslo_agent_gpu_healthy" in {f.name for f in text_string_to_metric_families(body.decode())}
    assert "Traceback" not in capfd.readouterr().err


def test_openmetrics_and_gzip_are_still_offered(agent: tuple[WallClockAgent, int]) -> None:
    _, port = agent
    accept = "application/openmetrics-text; version=abc, application/openmetrics-text; version=1.0.0; q=0.9"
    status, headers, body = _get(port, {"Accept": accept, "Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert "gpuslo_agent_metrics_problems" in {f.name for f in om_families(gzip.decompress(body).decode())}


def test_offered_keeps_the_ranges_prometheus_client_reads() -> None:
    from gpuslo.core.metrics_http import offered

    assert offered("text/plain;version=0.0.4;q=0.3,*/*;q=0.1") == "text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
    assert offered("application/openmetrics-text;version=x,text/plain") == "text/plain"
    assert offered("text/plain; version") == "text/plain; version"  # no value: prometheus-client skips it
    assert offered("text/plain; version=") == "text/plain; version="


def _closed_within(sock: socket.socket, s: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), None if still open after ``s``."""
    t0 = time.monotonic()
    sock.settimeout(s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - t0


def test_idle_and_trickling_clients_are_cut_at_the_deadline(capfd: pytest.CaptureFixture[str]) -> None:
    """A connection that sends nothing, or a byte now and then (each read within any
    per-read timeout), held a server thread for ever."""
    server = _server(deadline_s=1.0).start()
    try:
        idle = socket.create_connection(("127.0.0.1", server.port))
        trickle = socket.create_connection(("127.0.0.1", server.port))
        stop = threading.Event()

        def drip() -> None:
            for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 1000:
                if stop.wait(0.1):
                    return
                try:
                    trickle.send(bytes([b]))
                except OSError:
                    return

        th = threading.Thread(target=drip, daemon=True)
        th.start()
        waited = _closed_within(idle, 5.0)
        assert waited is not None and waited < 3.0
        waited = _closed_within(trickle, 5.0)
        assert waited is not None and waited < 3.0
        stop.set()
        th.join()
        idle.close()
        trickle.close()
        assert _get(server.port)[0] == 200  # and the server goes on
    finally:
        server.close()
    assert "Traceback" not in capfd.readouterr().err


def test_idle_connections_to_the_agent_hold_bounded_threads_and_are_cut(
    agent: tuple[WallClockAgent, int],
) -> None:
    """A hundred connections that send nothing were a hundred threads, each held for ever (the
    agent's own threads, its Kafka sender, its watches, could not start past the process's or
    the pod's limit). Now at most 32 are served at once (a thread and a deadline timer each),
    the rest closed unanswered, and each is cut 10 s after it came."""
    _, port = agent
    before = threading.active_count()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        time.sleep(1.0)
        assert threading.active_count() - before <= 2 * 32
        waited = [_closed_within(s, 15.0) for s in socks]
        assert all(w is not None for w in waited)
        assert _get(port)[0] == 200
    finally:
        for s in socks:
            s.close()


def test_connections_past_the_bound_are_closed_unanswered_and_counted() -> None:
    server = _server(deadline_s=60.0, max_connections=4).start()
    before = threading.active_count()
    socks = []
    try:
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        time.sleep(0.5)  # all four being served (each a thread and its deadline's timer)
        extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(50)]
        for s in extra:  # closed unanswered at once, not held
            assert _closed_within(s, 5.0) is not None
            s.close()
        assert server.refused == 50
        assert threading.active_count() <= before + 2 * 4
        for s in socks:  # the four leave: their slots are free again, and the page is served
            s.close()
        time.sleep(0.5)
        assert _get(server.port)[0] == 200
    finally:
        for s in socks:
            s.close()
        server.close()


def _status_from(peer: str, port: int) -> int | None:
    """The status of a scrape sent from the address ``peer`` (a loopback alias), None when the
    server closed the connection unanswered."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(peer, 0)) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        head = b""
        try:
            while chunk := s.recv(4096):
                head += chunk
        except ConnectionResetError:
            pass
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else None


@pytest.mark.parametrize("held", [1, 7, 8, 9, 32, 100])
def test_one_peer_holding_connections_never_locks_the_scrapers_out(held: int) -> None:
    """One client holding connections open (idle, or trickling within the deadline, opened again
    as they are cut) held all 32 slots: every scrape from Prometheus was refused for as long as
    it went on. One peer address is served at most 8 at once; another peer is served whatever it
    does, and the peer itself while it holds fewer than its share."""
    server = _server(deadline_s=60.0).start()
    socks: list[socket.socket] = []
    try:
        # accepted in the order they came: all are placed before the scrapes below are
        socks = [socket.create_connection(("127.0.0.1", server.port), source_address=("127.0.0.1", 0))
                 for _ in range(held)]  # fmt: skip
        assert _status_from("127.0.0.2", server.port) == 200
        assert server.refused == max(0, held - 8)
        assert _status_from("127.0.0.1", server.port) == (200 if held < 8 else None)
    finally:
        for s in socks:
            s.close()
        server.close()


def test_the_bound_of_all_peers_together_still_holds() -> None:
    """Peers each within their share still fill the server's slots: one more is refused, counted,
    and served once a peer leaves."""
    server = _server(deadline_s=60.0, max_connections=8, max_per_peer=3).start()
    socks: dict[str, list[socket.socket]] = {}
    try:
        for peer, n in (("127.0.0.1", 3), ("127.0.0.2", 3), ("127.0.0.3", 2)):
            socks[peer] = [socket.create_connection(("127.0.0.1", server.port), source_address=(peer, 0))
                           for _ in range(n)]  # fmt: skip
        assert _status_from("127.0.0.4", server.port) is None
        assert server.refused == 1
        for s in socks.pop("127.0.0.1"):
            s.close()
        for _ in range(100):  # their threads see the close and free the slots
            if (status := _status_from("127.0.0.4", server.port)) is not None:
                break
            time.sleep(0.1)
        assert status == 200
    finally:
        for held in socks.values():
            for s in held:
                s.close()
        server.close()


def test_scrapes_while_batches_change_read_one_batch_each() -> None:
    """Scrapes on their threads while the runner's thread replaces the batch: every page shows
    one batch whole (each batch gives all its GPUs the same value, and GPUs 0..n-1)."""
    col = AgentCollector()
    server = _server(col=col).start()
    stop = threading.Event()

    def feed() -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            gpus = tuple(GpuSample(index=i, uuid=f"GPU-{i}", fields={"DCGM_FI_DEV_GPU_TEMP": float(seq % 90)})
                         for i in range(1 + seq % 8))  # fmt: skip
            col.observe([GpuSampleBatch(source="n", boot_id="b", seq=seq, cluster="c", ts=1.8e9, node="n",
                                        interval_s=10.0, gpus=gpus)])  # fmt: skip

    th = threading.Thread(target=feed, daemon=True)
    th.start()
    pages: list[bytes] = []
    try:
        scrapers = [threading.Thread(target=lambda: pages.extend(_get(server.port)[2] for _ in range(15)))
                    for _ in range(3)]  # fmt: skip
        for t in scrapers:
            t.start()
        for t in scrapers:
            t.join(60)
    finally:
        stop.set()
        th.join()
        server.close()
    assert len(pages) == 45
    for body in pages:
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        gpus = {s.labels["gpu"] for s in fams["gpuslo_agent_gpu_healthy"].samples}
        temps = [s.value for s in fams["DCGM_FI_DEV_GPU_TEMP_CELSIUS"].samples]
        assert gpus == {str(i) for i in range(len(gpus))} and len(temps) == len(gpus) and len(set(temps)) == 1


def test_the_agent_closed_stops_serving_and_frees_its_port() -> None:
    a = WallClockAgent([], JsonLinesSink(io.BytesIO()), 10.0)
    port = free_port()
    a.serve_metrics(port, "127.0.0.1")
    assert _get(port)[0] == 200
    a.close()
    with pytest.raises(OSError):
        _get(port)
    _server(port).close()  # the port is free again


def test_a_port_taken_is_an_oserror_and_nothing_left_listening() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        before = threading.active_count()
        with pytest.raises(OSError):
            _server(port)
        assert threading.active_count() == before

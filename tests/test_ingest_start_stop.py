"""SIGTERM while the ingest waits for Kafka to answer at its start: it ends at once, within its
stop's bound (10 s write grace + 5 s commit + 5 s close), not after kafka-python's 30 s
bootstrap. A listener that accepts and never answers is a broker hung or SIGSTOPped (its kernel
still accepts): measured before, 28 s after the SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_kafka import GPUSLO

pytestmark = pytest.mark.integration

STOP_BOUND_S = 20.0  # docs/deployment.md "Stopping": the ingest's write grace, commit and close


@pytest.fixture
def silent() -> Iterator[tuple[str, threading.Event]]:
    """A TCP listener that accepts and never answers, and an event set at its first connection."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:  # closed at the end
                return
            held.append(c)
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{s.getsockname()[1]}", accepted
    finally:
        s.close()
        for c in held:
            c.close()


def test_sigterm_while_kafka_does_not_answer_at_the_start_ends_the_ingest_at_once(
    silent: tuple[str, threading.Event], tmp_path: Path
) -> None:
    addr, accepted = silent
    p = subprocess.Popen(
        [*GPUSLO, "ingest", "--kafka", addr, "--store", str(tmp_path / "store"), "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert accepted.wait(60), "the ingest never connected"
        time.sleep(1.0)  # inside kafka-python's bootstrap, waiting for an answer
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=STOP_BOUND_S / 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the ingest did not end within {STOP_BOUND_S / 2:g} s of SIGTERM")
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert "stopped while waiting for Kafka to answer" in err

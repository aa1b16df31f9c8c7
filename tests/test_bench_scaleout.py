"""``bench scaleout`` runs end to end at a tiny size on the real broker and server, and what it
counts agrees with what was sent (no timing here); its checks refuse a run that lost, doubled
or left behind anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import scaleout
from tests.servers.clickhouse import binary

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = 300  # node batches of the bench's generator: 8 GPUs each
GPUS = 8


@pytest.mark.integration  # a Kafka broker, clickhouse-server, three ingest processes
@pytest.mark.skipif(binary() is None, reason="clickhouse-server is not installed")
def test_bench_scaleout_runs_and_every_row_lands_once() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench", "scaleout", "--messages", str(MESSAGES), "--nodes", "16",
         "--partitions", "4", "--processes", "1,2", "--stall-s", "90"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "scaleout"
    assert (out["messages"], out["gpu_rows"], out["partitions"]) == (MESSAGES, MESSAGES * GPUS, 4)
    for k in (1, 2):
        stored = out[f"stored_{k}"]
        # one row per GPU per message, one message id per message, nothing refused
        assert stored["final"] == stored["keys"] == MESSAGES * GPUS
        assert stored["ids"] == MESSAGES
        assert stored["dead_letters"] == 0
        assert stored["raw"] == MESSAGES * GPUS + out[f"rows_written_twice_{k}"]
        assert out[f"lag_{k}"] == 0
        written = out[f"written_rows_{k}"]
        assert len(written) == len(out[f"ingest_cpu_s_{k}"]) == k
        assert sum(written) >= MESSAGES * GPUS  # a batch re-read after a rebalance is written again
        assert all(c > 0 for c in out[f"ingest_cpu_s_{k}"])
    assert out["scaling_2_vs_1"] > 0


def _run(stored: dict[str, int], lag: dict[int, int], cpu_s: float = 1.0, wall_s: float = 10.0,
         processes: int = 1) -> Any:  # fmt: skip
    worker = scaleout.Worker(cpu_s, {"pid": 1, "error": "", "assignments": []})
    return scaleout.Run(processes, wall_s, 0.0, [worker] * processes, 0.0, 0.0, 0.0, 1.0, 2.0,
                        (0.0, 0.0, 0.0), stored, lag)  # fmt: skip


DATA = scaleout.Data("t", "p", messages=10, rows=80, keys=80, ids=10, ends={0: 6, 1: 4}, nodes=2)
GOOD = {"final": 80, "raw": 80, "keys": 80, "ids": 10, "dead_letters": 0}


@pytest.mark.parametrize(
    ("change", "lag", "says"),
    [
        ({}, {0: 0, 1: 0}, None),
        ({"final": 79, "keys": 79, "raw": 79}, {0: 0, 1: 0}, "final = 79"),  # a row lost
        ({"final": 81, "keys": 81, "raw": 81}, {0: 0, 1: 0}, "final = 81"),  # a row nobody sent
        ({"ids": 9}, {0: 0, 1: 0}, "ids = 9"),
        ({"dead_letters": 1}, {0: 0, 1: 0}, "dead_letters = 1"),
        ({}, {0: 0, 1: 1}, "lag"),  # an offset left uncommitted
        ({}, {0: 0}, "lag"),  # a partition the tool did not show
        ({}, {0: -1, 1: 0}, "lag"),  # '-': nothing committed on a partition that holds messages
        ({}, {0: 0, 1: 0, 2: 0}, "lag"),  # a partition that does not exist
    ],
)
def test_a_run_that_lost_doubled_or_left_anything_is_refused(change: dict[str, int], lag: dict[int, int],
                                                              says: str | None) -> None:  # fmt: skip
    got = scaleout.problems(_run({**GOOD, **change}, lag), DATA)
    assert (got == []) if says is None else any(says in p for p in got), got


def test_an_empty_partition_needs_no_commit() -> None:
    data = scaleout.Data("t", "p", messages=10, rows=80, keys=80, ids=10, ends={0: 10, 1: 0}, nodes=1)
    for lag in ({0: 0}, {0: 0, 1: -1}, {0: 0, 1: 0}):
        assert scaleout.problems(_run(GOOD, lag), data) == [], lag
    assert scaleout.problems(_run(GOOD, {0: 3}), data) != []


def test_rows_rewritten_after_a_rebalance_are_not_a_problem_but_more_cpu_than_the_machine_is() -> None:
    assert scaleout.problems(_run({**GOOD, "raw": 120}, {0: 0, 1: 0}), DATA) == []
    cores = scaleout.os.cpu_count() or 1
    over = _run(GOOD, {0: 0, 1: 0}, cpu_s=cores * 10.0 * 1.2, wall_s=10.0)
    assert any("missed work" in p for p in scaleout.problems(over, DATA))


def test_scaling_beyond_the_process_count_is_refused() -> None:
    one = _run(GOOD, {}, wall_s=10.0, processes=1)
    assert scaleout.scaling_problems([one, _run(GOOD, {}, wall_s=5.5, processes=2)], DATA) == []
    assert scaleout.scaling_problems([one, _run(GOOD, {}, wall_s=4.0, processes=2)], DATA) != []

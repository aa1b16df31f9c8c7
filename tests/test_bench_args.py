"""The benchmarks' flags (bench/args.py): every hostile value of every numeric flag of ``bench
scaleout``, ``bench whatif`` and ``bench rules`` is one line from argparse and exit 2 before
anything starts (no server, no child process): never a traceback deep in a run (``²`` passes
``str.isdigit`` but not ``int``, ``--gpus 0`` took a log of 0), a hang (``--days nan`` never
ended) or a run far beyond the machine (a million ingest processes or partitions)."""

from __future__ import annotations

import importlib

import pytest

HOSTILE_INT = ["0", "-3", "1e3", "1.5", "²", "٣", "nan", "", " ", "99999999999999999999"]
HOSTILE_FLOAT = ["0", "-1", "nan", "inf", "-inf", "1e400", "x", ""]

FLAGS: list[tuple[str, str, list[str]]] = [
    ("scaleout", "--messages", HOSTILE_INT),
    ("scaleout", "--nodes", HOSTILE_INT),
    ("scaleout", "--partitions", [*HOSTILE_INT, "1025", "1000000"]),
    ("scaleout", "--processes", [*HOSTILE_INT, "1,1", "1,,2", "1,2,", "65", "1,2,3,4,5,6,7,8,9", "²,1"]),
    ("scaleout", "--batch-messages", HOSTILE_INT),
    ("scaleout", "--batch-s", [*HOSTILE_FLOAT, "3601"]),
    ("scaleout", "--stall-s", HOSTILE_FLOAT),
    ("whatif", "--gpus", HOSTILE_INT),
    ("whatif", "--days", [*HOSTILE_FLOAT, "401"]),
    ("whatif", "--requests", HOSTILE_INT),
    ("whatif", "--seed", ["-1", "x", "1.5", "²"]),
    ("whatif", "--policies", ["lifo", "", "fifo,,backfill", "fifo:lifo", "+gang", "x" * 100_000]),
    ("whatif", "--timeout-s", HOSTILE_FLOAT),
    ("whatif", "--sample-s", [*HOSTILE_FLOAT, "0.5"]),
    ("rules", "--gpus", HOSTILE_INT),
    ("rules", "--days", [*HOSTILE_FLOAT, "0.001", "1.00001"]),
    ("rules", "--big-gpus", HOSTILE_INT),
    ("rules", "--big-days", [*HOSTILE_FLOAT, "0.0001"]),
    ("send", "--batches", [*HOSTILE_INT, "1000001"]),
    ("send", "--timeout-s", [*HOSTILE_FLOAT, "3601"]),
    ("recovery", "--runs", [*HOSTILE_INT, "21"]),
    ("recovery", "--outage-s", [*HOSTILE_FLOAT, "601"]),
    ("recovery", "--timeout-s", [*HOSTILE_FLOAT, "3601"]),
]


@pytest.mark.parametrize(("bench", "flag", "values"), FLAGS, ids=[f"{b}{f}" for b, f, _ in FLAGS])
def test_a_hostile_flag_is_one_line_and_exit_2(
    bench: str,
    flag: str,
    values: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mod = importlib.import_module(f"bench.{bench}")
    for name in ("_measure", "_measure_big", "start_servers", "run"):  # nothing may run
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail(f"{bench} ran with {flag}"))
    for v in values:
        with pytest.raises(SystemExit) as e:
            mod.main([flag, v])
        assert e.value.code == 2, (flag, v)
        err = capsys.readouterr().err
        said = [x for x in err.splitlines() if "error:" in x]  # after argparse's usage lines
        why = (flag, v[:50], err[:500])
        assert "Traceback" not in err and len(said) == 1 and err.strip().endswith(said[0]), why
        assert f"error: argument {flag}" in said[0] and len(said[0]) < 600, (flag, v[:50], said[0][:600])


@pytest.mark.parametrize(
    ("bench", "argv"),
    [
        ("scaleout", ["--processes", "1,2", "--partitions", "1024", "--batch-s", "3600"]),
        ("whatif", ["--policies", "fifo, backfill+gang:spread,recorded", "--days", "0.5", "--sample-s", "1"]),
        ("rules", ["--days", "0.5", "--big-days", "1", "--gpus", "7"]),
    ],
)
def test_good_flags_reach_the_run(bench: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    mod = importlib.import_module(f"bench.{bench}")

    class Ran(Exception):
        pass

    def ran(*a: object, **k: object) -> None:
        raise Ran

    for name in ("_measure", "_in_store", "start_servers"):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, ran)
    with pytest.raises(Ran):
        mod.main(argv)

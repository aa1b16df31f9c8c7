"""Files the project owns (outbox, collector state) under short writes and damage.

Short writes: a nearly full disk takes part of a write() and refuses the rest. Every file
the project owns must then hold whole records only, and whatever was reported as written
must be there after a restart. Real tmpfs, filled to a few pages (the kernel then returns a
short count for a write larger than what is left, without an error). Damage: a state or
outbox file that parses as the wrong shape, is nested past the parser's depth, is not UTF-8 or
is a directory is logged and skipped; the process still starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuslo.rules.outbox import Outbox
from tests.fs import tmpfs

PAGE = 4096


def fill_leaving(fs: Path, free_bytes: int) -> Path:
    """Fill the file system, then give back ``free_bytes`` (whole pages)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * PAGE)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - free_bytes))
    st = os.statvfs(fs)
    assert st.f_bavail * st.f_frsize == free_bytes
    return filler


def whole_lines(path: Path) -> list[dict[str, object]]:
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "a torn line at the end"
    return [json.loads(line) for line in raw.splitlines()]


def test_outbox_add_on_a_nearly_full_disk_is_whole_or_refused(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "256k") as fs:
        ob = Outbox(fs / "ob" / "r.jsonl")
        filler = fill_leaving(fs, 2 * PAGE)
        added = []
        for i in range(4):  # each about 5,000 bytes: the second one gets a short write
            try:
                ob.add({"i": i, "text": "y" * 5000}, 1.0)
                added.append(i)
            except OSError:
                pass
        assert added == [0], "only the first fits"
        assert [r["payload"]["i"] for r in whole_lines(ob.path)] == added  # type: ignore[index]
        filler.unlink()
        again = Outbox(ob.path)
        assert (again.corrupt, [i.payload["i"] for i in list(again._items)]) == (0, added)


def test_outbox_compaction_on_a_nearly_full_disk_loses_nothing(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "256k") as fs:
        ob = Outbox(fs / "ob" / "r.jsonl")
        for i in range(3):
            ob.add({"i": i, "text": "y" * 5000}, 1.0)
        filler = fill_leaving(fs, 2 * PAGE)  # less than the compacted copy needs
        Outbox(ob.path)  # compacts at open: cannot, so it must keep the file as it is
        filler.unlink()
        again = Outbox(ob.path)
        assert (again.corrupt, [i.payload["i"] for i in list(again._items)]) == (0, [0, 1, 2])
        assert not (ob.path.parent / "r.jsonl.tmp").exists()


HOSTILE_STATE = {
    "deep": b"[" * 100_000,
    "list": b"[]",
    "null": b"null",
    "number": b"5",
    "wrong_values": b'{"rv": 7, "pods": {"a": 1}}',
    "not_utf8": b"\xff\xfe{",
}


@pytest.mark.parametrize("content", HOSTILE_STATE.values(), ids=HOSTILE_STATE.keys())
def test_damaged_collector_state_files_never_stop_the_collectors(tmp_path: Path, content: bytes) -> None:
    from gpuslo.agent.k8s_watch import K8sPodCollector
    from gpuslo.agent.slurm import SlurmEventCollector

    state = tmp_path / "state.json"
    state.write_bytes(content)
    assert SlurmEventCollector("c", state).jobs == {}
    k = K8sPodCollector("c", None, state)  # type: ignore[arg-type]  # the API is not reached at start
    assert (k.rv, k.pods) == ("", {})


def test_a_collector_state_path_that_is_a_directory_never_stops_the_collectors(tmp_path: Path) -> None:
    from gpuslo.agent.k8s_watch import K8sPodCollector
    from gpuslo.agent.slurm import SlurmEventCollector

    (tmp_path / "state.json").mkdir()
    assert SlurmEventCollector("c", tmp_path / "state.json").jobs == {}
    assert K8sPodCollector("c", None, tmp_path / "state.json").pods == {}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "line",
    [
        b"[" * 100_000,
        b'{"id": "n", "queued_at": NaN, "payload": 1}',
        b'{"id": "i", "queued_at": Infinity, "payload": 1}',
    ],
    ids=["deep", "nan", "inf"],
)
def test_damaged_outbox_lines_are_skipped_counted_and_the_rest_kept(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "ob" / "r.jsonl"
    path.parent.mkdir()
    path.write_bytes(
        b'{"id":"a","queued_at":1,"payload":1}\n' + line + b'\n{"id":"b","queued_at":2,"payload":2}\n'
    )
    ob = Outbox(path)
    assert (ob.corrupt, [i.id for i in list(ob._items)]) == (1, ["a", "b"])


# a record of the right shape holding a value of the wrong type: each field of each collector's
# record, given what the file's JSON could hold instead (not loaded, to fail at every later use)
WRONG_FIELDS = [
    ("emitted", 5),
    ("emitted", "submit"),
    ("emitted", [1]),
    ("reason", 7),
    ("reason", None),
    ("attempt", "x"),
    ("queued_at", "soon"),
    ("reason_at", []),
    ("admitted_at", {}),
    ("gpus", "many"),
    ("gpus_per_node", "two"),
    ("last_seen", "now"),
    ("job", []),
    ("started", "no"),
]


@pytest.mark.parametrize(("field", "value"), WRONG_FIELDS, ids=[f"{f}={v!r}" for f, v in WRONG_FIELDS])
def test_a_state_record_with_a_wrong_value_is_unreadable_not_loaded(
    tmp_path: Path, field: str, value: object
) -> None:
    """Every collector that knows the field starts afresh (and relists); one that does not ignores it."""
    import dataclasses
    import json

    from gpuslo.agent import k8s_watch, kueue, slurm

    for record, wrap, make, held in (
        (slurm._Seen, lambda r: r, lambda s: slurm.SlurmEventCollector("c", s), lambda c: c.jobs),
        (k8s_watch._Pod, lambda r: {"rv": "5", "pods": r}, lambda s: k8s_watch.K8sPodCollector("c", None, s),
         lambda c: c.pods),
        (kueue._Wl, lambda r: {"rv": "5", "version": kueue.VERSIONS[0], "workloads": r},
         lambda s: kueue.KueueWorkloadCollector("c", None, s), lambda c: c.wls),
    ):  # fmt: skip
        if field not in {f.name for f in dataclasses.fields(record)}:
            continue
        state = tmp_path / f"{record.__name__}.json"
        state.write_text(json.dumps(wrap({"u": {field: value}})))
        assert held(make(state)) == {}, record.__name__
        state.write_text(json.dumps(wrap({"u": {}})))  # the same without it: loaded
        assert list(held(make(state))) == ["u"], record.__name__

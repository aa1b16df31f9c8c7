"""A gpuslo process (re)started on an embedded store whose disk is full (the rules service
restarted by its supervisor after a refresh failed there, the ingest likewise): it fails with a
clear error, and once the disk is freed the store opens and its rollups give the raw answers.
Every start migrates the store; chDB rewrote a table's metadata file at each ``ALTER``, even
one that changed nothing, and on a full disk wrote it empty: the store never opened again.
A real tiny file system (tests/fs.py), and each start a fresh process, as a restart is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fs import tmpfs

_CHILD = r"""
import json, sys
from gpuslo.ingest.store import ChdbStore, StoreError
path, what = sys.argv[1], sys.argv[2]
if what == "rules-run":  # the rules service's start and round, as its supervisor runs it
    from gpuslo.app.cli import main
    sys.exit(main(["rules", "run", "--once", "--store", path, "--window-s", "3600"]))
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup
from gpuslo.rules.tables import SCHEMA
from tests.test_properties import _messages, ref_utilization
from tests.test_rollup_hourly import B, D, H, _fleet, _util
try:
    s = ChdbStore(path)
    s.migrate(SCHEMA)
except StoreError as e:
    print(json.dumps({"raised": e.failure.value, "error": str(e).splitlines()[0]}))
    sys.exit(0)
try:
    if what == "retention":  # `gpuslo ingest --retention-days 30` (its migrate ran above)
        from gpuslo.ingest.pipeline import upgrade
        try:
            upgrade(s, 30, schema=SCHEMA)
        except StoreError as e:
            print(json.dumps({"raised": e.failure.value, "error": str(e).splitlines()[0]}))
            sys.exit(0)
    elif what.startswith("ingest"):
        write(s, _messages("full", _fleet(), []))
        rollup.refresh(s)
        if what == "ingest-old":  # a store made before a column joined: its next start adds it
            s.execute("ALTER TABLE sched_events DROP COLUMN cluster_queue")
    elif what == "migrate":
        pass
    elif what == "check":
        rollup.refresh(s)
        frm, to = B + 20 * H, B + D + 5 * H
        out = {k: _util(s, frm, to, "full", **kw) for k, kw in
               (("raw", {}), ("minutes", {"rollup": True}), ("hours", {"rollup": True, "hourly": True}))}
        out["ref"] = ref_utilization(_fleet(), frm, to)
        out["columns"] = [r["name"] for r in s.query(
            "SELECT name FROM system.columns WHERE table = 'sched_events' AND name = 'cluster_queue'")]
        print(json.dumps(out))
    print(json.dumps({"ok": what}))
finally:
    s.close()
"""


def _child(path: Path, what: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, str(path), what], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


def _fill(where: Path) -> Path:
    """A file taking every free block of the file system; its path (removing it frees the disk)."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for block in (1 << 20, 4096):  # MiBs while they fit, then the blocks left
            while True:
                try:
                    os.write(fd, b"\0" * block)
                except OSError:
                    break
    finally:
        os.close(fd)
    st = os.statvfs(where)
    assert st.f_bavail == 0, st
    return filler


@pytest.mark.integration  # fresh processes on a mounted file system
@pytest.mark.parametrize(("start", "old"), [("migrate", False), ("rules-run", False), ("migrate", True),
                                            ("rules-run", True), ("retention", False)])  # fmt: skip
def test_a_start_on_a_full_disk_fails_clearly_and_leaves_the_store_to_open(
    tmp_path: Path, start: str, old: bool
) -> None:
    """``old``: a store made before a column joined, whose start must add it: refused on the full
    disk (fatal, 'free the disk first'), added at the start after. ``retention``: a start that
    sets the store's retention (an ALTER of every raw table): refused likewise."""
    with tmpfs(tmp_path / "mnt", "160m") as mnt:
        store = mnt / "store"
        made = _child(store, "ingest-old" if old else "ingest")
        assert made.returncode == 0 and '"ok"' in made.stdout, made.stderr[-3000:]
        filler = _fill(mnt)
        for _ in range(2):  # a supervisor restarts it: twice on the full disk
            r = _child(store, start)
            assert "Traceback" not in r.stderr, r.stderr[-3000:]
            if start == "rules-run":
                assert r.returncode == 2, (r.stdout, r.stderr[-3000:])  # the round failed, or the start
                said = "free the disk first" if old else "not enough space"
                lines = r.stderr.lower().splitlines()
                if old:  # the start refused: one line
                    assert len(lines) == 1 and said in lines[0], r.stderr[-3000:]
                else:  # one line per part that failed (the refresh, the results' write), each saying
                    # why; the rest of the round still evaluated (over the raw rows) and printed
                    assert lines and all(said in ln for ln in lines), r.stderr[-3000:]
                    assert [ln.split(" failed:")[0].rsplit(" ", 1)[-1] for ln in lines] == [
                        "rollup_refresh",
                        "rule_results",
                    ], r.stderr[-3000:]
                    out = json.loads(r.stdout.splitlines()[-1])
                    assert out["window"]["over"] == "raw rows" and set(out["errors"]) == {
                        "rollup_refresh",
                        "rule_results",
                    }
            elif old or start == "retention":
                assert json.loads(r.stdout)["raised"] == "fatal" and "free the disk first" in r.stdout, (
                    r.stdout
                )
            else:
                assert r.returncode == 0 and '"ok"' in r.stdout, r.stderr[-3000:]
        filler.unlink()
        r = _child(store, "check")
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.splitlines()[0])
        ref = {p: pytest.approx(v, rel=1e-6) for p, v in got["ref"].items()}
        assert got["raw"] == ref and got["minutes"] == ref and got["hours"] == ref
        assert got["columns"] == ["cluster_queue"]  # an old store's column added once there was room

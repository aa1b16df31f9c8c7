"""The files a user names for a command's output (``report --out``, ``job --html``, ``rules
export-prometheus --out``, ``dashboards generate --out``, ``chargeback --csv``, the demo's page):
whole or not at all. On a real full disk (a tmpfs filled by the test) the command fails with one
line, the file that was there keeps its content and no temporary is left; on a disk with room the
new content is all there. Where such a name is a link, a device or a FIFO, it stays one."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslo.app.cli import EXIT_OK, main, write_out
from gpuslo.core.fileio import write_outputs
from tests.fs import tmpfs
from tests.test_own_files import fill_leaving

PAGE = 4096
OLD = b"the previous content, complete\n"


def _dashboards(path: Path) -> bytes | None:
    """``dashboards generate`` into ``path``'s directory; the overview's bytes, None on exit 2."""
    rc = main(["dashboards", "generate", "--out", str(path.parent)])
    return path.read_bytes() if rc == EXIT_OK else None


def _export(path: Path) -> bytes | None:
    """``rules export-prometheus`` of three SLOs (the example's one makes less than a page)."""
    slos = [{"name": f"s{i}", "service": "svc", "threshold_ms": 5.0} for i in range(3)]
    conf = path.parents[2] / "rules.json"  # outside the small file system
    conf.write_text(json.dumps({"slos": slos}))
    rc = main(["rules", "export-prometheus", "--config", str(conf), "--out", str(path)])
    return path.read_bytes() if rc == EXIT_OK else None


def _page(path: Path) -> bytes | None:
    """What ``report --out`` and ``job --html`` write through (gpuslo.app.cli.write_out): a page."""
    text = "<!doctype html>\n" + "<p>é – → ‮</p>\n" * 4000
    return text.encode() if write_out(path, text, "report") else None


def _csv(path: Path) -> bytes | None:
    """``chargeback --csv`` (gpuslo.app.chargeback.write_csv) of a bill with many lines."""
    from gpuslo.app.chargeback import CSV_COLUMNS, write_csv

    class Bill:
        totals = dict.fromkeys(CSV_COLUMNS[2:], 1.0)

        def rows(self, dim: str) -> list[dict[str, object]]:
            return [{dim: f"{dim}-{i}", **self.totals} for i in range(200)]

    try:
        write_csv(Bill(), str(path))
    except OSError:
        return None
    return path.read_bytes()


# (name of the file the check looks at, writer): each returns the bytes written, None on refusal
WRITERS: dict[str, tuple[str, Callable[[Path], bytes | None]]] = {
    "dashboards": ("fleet-overview.json", _dashboards),
    "rules export-prometheus": ("rules.yml", _export),
    "report and job pages": ("report.html", _page),
    "chargeback csv": ("bill.csv", _csv),
}


@pytest.mark.parametrize("writer", WRITERS.values(), ids=WRITERS.keys())
def test_a_full_disk_leaves_the_previous_file_whole_and_no_temporary(
    writer: tuple[str, Callable[[Path], bytes | None]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name, write = writer
    with tmpfs(tmp_path / "fs", "1m") as fs:
        out = fs / "out"
        out.mkdir()
        (out / name).write_bytes(OLD)
        filler = fill_leaving(fs, 0)  # each output is larger than the page the old file holds
        assert write(out / name) is None
        assert "Traceback" not in capsys.readouterr().err
        assert (out / name).read_bytes() == OLD  # was truncated to what fitted: a torn page, exit 2
        assert sorted(p.name for p in out.iterdir()) == [name]
        filler.unlink()
        new = write(out / name)
        assert new is not None and len(new) > PAGE and (out / name).read_bytes() == new
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("writer", WRITERS.values(), ids=WRITERS.keys())
def test_a_read_only_disk_is_one_line_and_changes_nothing(
    writer: tuple[str, Callable[[Path], bytes | None]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name, write = writer
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
        assert write(ro / name) is None
        assert list(ro.iterdir()) == []
    err = capsys.readouterr().err
    assert "Traceback" not in err and (err == "" or err.count("\n") == 1), err


def test_an_existing_file_keeps_its_mode_and_a_link_stays_a_link(tmp_path: Path) -> None:
    target = tmp_path / "real.html"
    target.write_bytes(OLD)
    target.chmod(0o640)
    link = tmp_path / "link.html"
    link.symlink_to(target)
    assert write_out(link, "new", "report")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.html", "real.html"]


def test_a_device_or_a_fifo_is_written_to_not_replaced(tmp_path: Path) -> None:
    """``--out /dev/stdout`` or ``--out >(gzip > x)``: nothing can be renamed over those (and as
    root, a temporary renamed over /dev/null would have replaced the device by a file)."""
    assert write_out("/dev/null", "x" * 10_000, "report")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    assert write_out(fifo, "through a pipe", "report")
    reader.join(timeout=30)
    assert got == [b"through a pipe"] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_a_name_ending_in_a_slash_is_a_directory_not_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`report --out reports/` with no such directory: an error, as open() gives, not a file
    named reports."""
    for name in (f"{tmp_path}/reports/", f"{tmp_path}/reports/x.html/"):
        assert not write_out(name, "x", "report")
        assert "Is a directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_permissions_are_those_open_had() -> None:
    """A user who made their page read-only got 'Permission denied' from open(); a rename in a
    directory they may write would have replaced it. A file they may write in a directory they
    may not was written by open(); no temporary can be made there. Run as an unprivileged user
    (root may write any file): the effective uid is nobody's for the calls."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root, to act as another user (chown, seteuid)")
    d = Path(tempfile.mkdtemp(prefix="gpuslo-ro-"))  # outside pytest's root-only tmp: nobody can reach it
    try:
        d.chmod(0o777)
        page = d / "page.html"
        page.write_bytes(OLD)
        os.chown(page, 65534, 65534)
        page.chmod(0o444)
        os.setegid(65534)
        os.seteuid(65534)
        try:
            with pytest.raises(PermissionError):
                write_outputs({str(page): b"new"})
            write_outputs({str(d / "other.html"): b"new"})  # a new file beside it: allowed
            # a file of nobody's in a directory nobody may not write: written in place, as open() did
            os.seteuid(0)
            d.chmod(0o755)
            mine = d / "mine.html"
            mine.write_bytes(OLD)
            os.chown(mine, 65534, 65534)
            os.seteuid(65534)
            write_outputs({str(mine): b"new"})
            with pytest.raises(PermissionError):  # and a new file there is refused
                write_outputs({str(d / "new.html"): b"new"})
        finally:
            os.seteuid(0)
            os.setegid(0)
        assert page.read_bytes() == OLD and mine.read_bytes() == b"new"
        assert sorted(p.name for p in d.iterdir()) == ["mine.html", "other.html", "page.html"]
    finally:
        shutil.rmtree(d)


def test_dev_stdout_of_a_pipe_is_written_to() -> None:
    """``--out /dev/stdout | less``: /dev/stdout leads through /proc's link to ``pipe:[N]``, which
    realpath returns as a name in /proc; the temporary made beside it failed, "cannot write --out
    /dev/stdout: No such file or directory", exit 2. The output goes to the pipe whole, as the
    command prints it without --out. (A socket's cannot be opened by name at all: ENXIO, said.)"""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "gpuslo", "rules", "export-prometheus"]
    want = subprocess.run(cmd, capture_output=True, check=True).stdout
    assert len(want) > 1000
    for out in ("/dev/stdout", "/proc/self/fd/1", "/dev/fd/1"):
        got = subprocess.run([*cmd, "--out", out], capture_output=True, check=False)
        assert (got.returncode, got.stdout, got.stderr) == (0, want + f"{out}\n".encode(), b""), out

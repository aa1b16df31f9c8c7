"""Whole writes to a file descriptor.

``os.write`` and ``os.pwrite`` may write less than asked without an error: a disk with a few
blocks left takes part of a write and refuses the rest only at the next call. A caller that
ignores the count leaves a torn record behind and believes it whole. Every write of a file
the project owns goes through these two, which write everything or raise ``OSError``.

A file replaced whole (a state file, the spool's cursor, a compacted outbox) is written by
:func:`replace_file`: a temporary beside it, then ``os.replace``, so a reader (or a restart
after a crash at any point) sees the old content or the new, never a torn one. A file a user
named for the output of a command (a page, dashboards, rules, a CSV) is written by
:func:`write_outputs`, whole or not at all, likewise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import select
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the descriptor's position, or raise ``OSError``."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # never for a regular file, but a loop must not spin
            raise OSError(0, "write made no progress")
        view = view[n:]


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``, or raise ``OSError``."""
    view, at = memoryview(data), offset
    while view:
        n = os.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(0, "write made no progress")
        view, at = view[n:], at + n


def fsync_dir(path: Path) -> None:
    """Make a rename in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, *, durable: bool = False, mode: int | None = None) -> None:
    """Replace ``path`` by a file holding ``data``, atomically: written to ``<name>.tmp`` beside
    it, then renamed over it. ``durable``: the temporary is fsynced before the rename and the
    directory after it, so the new content survives a power loss too. ``mode``: the file's
    permission bits (set even on a temporary left by an older run); else the umask's default.
    On ``OSError`` the old file is as it was and the temporary is removed."""
    tmp = path.with_name(path.name + ".tmp")
    # a temporary left by a crash, or a link someone put there, goes first: the new one is
    # created, never opened through a link (O_EXCL) onto a file it would truncate
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666 if mode is None else mode)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:  # a short or unsynced copy must never replace the file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def _new_beside(target: Path) -> tuple[Path, int]:
    """A new file beside ``target`` with a random name (never one that exists), open to write."""
    while True:
        tmp = target.with_name(f".{target.name[:200]}.{secrets.token_hex(6)}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except FileExistsError:
            continue


def _write_in_place(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def _special(name: str | Path) -> bool:
    """Whether ``name`` names, through its links, something neither a regular file nor a directory
    that the user may write (a pipe, a socket, a device). Asked of the name, not of its
    ``realpath``: ``/dev/stdout`` of a process whose output is a pipe or a socket leads through
    /proc's link to ``pipe:[N]``, no path at all, which realpath returns as a name in /proc to
    make a temporary beside (``--out /dev/stdout | less``: "No such file or directory")."""
    try:
        st = os.stat(name)
    except OSError:
        return False
    special = not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))
    return special and not str(name).endswith(("/", os.sep)) and os.access(name, os.W_OK, effective_ids=True)


def write_outputs(files: Mapping[str, bytes] | Mapping[Path, bytes]) -> None:
    """Write the files a user named for a command's output (an HTML page, the dashboards, rules,
    a CSV), each whole or not at all. Each is written to a new temporary beside it (a random
    name: nothing of the user's is opened or removed) and fsynced; only when all are written are
    they renamed over their names. A full disk part way used to leave a truncated page at the
    name, which looks complete in a browser, and the previous file destroyed.

    As open() would: a name that is a link is followed (the link stays, its target is
    replaced); an existing file keeps its permission bits (a new one gets the umask's); one the
    user may not write is refused; a directory, or a name ending in ``/``, is refused
    (``IsADirectoryError``). Written in place, as open() wrote them, since nothing can be
    renamed over them: a name that is neither a regular file nor absent (``/dev/stdout``, a
    FIFO, a device), and an existing file the user may write in a directory they may not (no
    temporary can be made there). On ``OSError`` no name has been changed (but those written in
    place; and a rename of several that failed part way) and no temporary is left."""
    staged: list[tuple[Path, Path]] = []
    try:
        for name, data in files.items():
            if _special(name):  # /dev/stdout to a pipe: written through its name, as open() does
                _write_in_place(Path(name), data)
                continue
            target = Path(os.path.realpath(name))
            try:
                st: os.stat_result | None = os.stat(target)
            except FileNotFoundError:
                st = None
            # a name ending in "/" names a directory, there or not (realpath drops the slash:
            # `--out reports/` made a file named reports)
            if (st is not None and stat.S_ISDIR(st.st_mode)) or str(name).endswith(("/", os.sep)):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(name))
            if st is not None and not os.access(target, os.W_OK, effective_ids=True):  # as open() refused it
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(name))
            if st is not None and not stat.S_ISREG(st.st_mode):
                _write_in_place(target, data)
                continue
            try:
                tmp, fd = _new_beside(target)
            except PermissionError:
                if st is None:
                    raise
                _write_in_place(target, data)
                continue
            staged.append((tmp, target))
            try:
                if st is not None:
                    os.fchmod(fd, stat.S_IMODE(st.st_mode))
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        for tmp, target in staged:
            os.replace(tmp, target)
    except OSError:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


# What reading back a state file of our own may raise when it is missing parts, damaged or of
# another shape (a directory, JSON of the wrong type, nesting too deep): its owner starts
# afresh and logs it, never stops.
UNREADABLE_STATE: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TypeError,
    AttributeError,
    RecursionError,
)


def state_records(raw: Any, record: type[T]) -> dict[str, T]:
    """The records of a state file of our own (``{key: {field: value}}``), each value checked
    (strictly: ``"no"`` is no boolean) against its field's type in the dataclass ``record``: a
    file of the right shape holding a wrong value (edited by hand, written by another version)
    is unreadable (a ``ValueError`` or ``TypeError``), not loaded to fail at every later use."""
    import typing

    from pydantic import TypeAdapter

    if not isinstance(raw, dict):
        raise TypeError(f"the records are a {type(raw).__name__}, not an object")
    hints = typing.get_type_hints(record)
    check = {name: TypeAdapter(hints[name]) for name in hints}
    out = {}
    for key, fields in raw.items():
        if not isinstance(fields, dict):
            raise TypeError(f"record {key!r} is a {type(fields).__name__}, not an object")
        for name, value in fields.items():
            if name in check:  # an unknown one: the record(**fields) below says so
                check[name].validate_python(value, strict=True)
        out[str(key)] = record(**fields)
    return out


class NotARegularFile(OSError):
    """A user's input file that is a directory, a FIFO, a device, or larger than its bound."""


PIPE_WAIT_S = 10.0  # how long a pipe handed as a file may take to give its first bytes


def read_regular(path: str | Path, max_bytes: int, pipes: bool = False) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``; :class:`NotARegularFile`
    (an ``OSError``) for a directory, FIFO, socket or device (a FIFO with no writer would block
    the open for ever, ``/dev/zero`` would fill memory) or a larger file. The open does not
    block (``O_NONBLOCK``) and the checks are on the opened file, not on a name that may change.
    With ``pipes``, a pipe or FIFO is read too, to its end or the bound (what a user hands a
    command: ``--config <(...)``, ``/dev/stdin``); one with no writer, which gives nothing, is
    refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        pipe = pipes and stat.S_ISFIFO(st.st_mode)
        if not stat.S_ISREG(st.st_mode) and not pipe:
            raise NotARegularFile(f"{path}: not a regular file")
        if pipe:  # wait for the writer's first bytes (a FIFO whose writer has not opened it yet
            # reads as ended; one no writer ever opens would block a blocking read for ever)
            waiter = select.poll()
            waiter.register(fd, select.POLLIN | select.POLLHUP)
            if not waiter.poll(PIPE_WAIT_S * 1000):
                raise NotARegularFile(f"{path}: a pipe that gave nothing in {PIPE_WAIT_S:g} s (no writer?)")
            os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise NotARegularFile(f"{path}: larger than {max_bytes} bytes")
        if pipe and not size:
            raise NotARegularFile(f"{path}: a pipe that gave nothing (no writer?)")
        return b"".join(chunks)
    finally:
        os.close(fd)

"""The one way gpuslo starts a child process (Slurm's ``squeue``, ``sinfo``, ``scontrol``,
``scancel``, ``sacct``): each in a process group of its own, so that a command wrapped in a
shell, or one that forks, is ended whole.

A child is killed, its whole group with ``SIGKILL``, and reaped:

- when its own timeout passes (``subprocess.run`` killed the direct child only: a wrapper
  shell's ``squeue``, or a forked helper, ran on, and one holding the output pipe held the
  caller past the timeout until it exited);
- when it exits (seen on a pidfd, not as the end of its pipes, which what it left may hold):
  what it left running in its group goes with it, and its answer is taken;
- when the run that started it ends, by any path (:meth:`Children.close`): a command still
  running on a thread of its own (the node agent asks Slurm off its sampling tick,
  ``agent/inflight.py``) was abandoned at exit, an orphan on the node holding a slurmctld RPC.

:class:`Children` is one run's: the CLI opens one per command and closes it when the command
returns, raises or is stopped. A :class:`Children` nobody closes is closed at the interpreter's
exit. A descendant that leaves its group (``setsid``, a daemon) is out of reach, though it no
longer holds the answer: no Slurm command does. :func:`kill_all_now` is for a signal that ends
the process at once (the CLI's SIGTERM and SIGHUP where the command has no graceful stop).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType

log = logging.getLogger(__name__)


class Stopped(subprocess.SubprocessError):
    """The run that started the command ended before it did (the command was killed), or had
    already ended when it was asked to start one."""

    def __init__(self, argv: Sequence[str]) -> None:
        super().__init__(f"{argv[0]}: stopped, the run that started it has ended")
        self.argv = list(argv)


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL to ``p``'s process group (its pid: it leads the group it was started in), unless
    ``p`` was reaped already: its pid may then name another process's group."""
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def _reap(p: subprocess.Popen[bytes]) -> None:
    """Wait for ``p``, SIGKILLed: at once, unless the kill was refused (a command that changed
    its user): said, and not waited for past :data:`_REAP_S` (the exit is not held)."""
    try:
        p.wait(_REAP_S)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) did not end when killed; left running", p.args, p.pid)


_REAP_S = 5.0
_CHUNK = 65536
_PIPE_MAX = 1 << 20  # /proc/sys/fs/pipe-max-size's default


def _text(data: bytes) -> str:
    """A command's output as text: UTF-8, a byte that is not replaced (a job name in another
    encoding must not make the whole answer an error); line ends as ``text=True`` gives them."""
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def _collect(p: subprocess.Popen[bytes], timeout_s: float) -> tuple[bytes, bytes]:
    """``p``'s standard output and error, read until it exits (its group is killed then, ``p``
    left unreaped: a zombie keeps its pid, and so its group's id, from being reused) and what it
    wrote is read; :class:`subprocess.TimeoutExpired` at ``timeout_s``. The exit is seen on a
    pidfd, not as the end of the pipes: a process the command left holding them (a fork, or one
    that left the group) held the answer until the timeout, which then counted it a failure."""
    assert p.stdout is not None and p.stderr is not None
    try:
        exited = os.pidfd_open(p.pid)
    except (AttributeError, OSError):  # not Linux 5.3+ (EL7's 3.10): the pipes' end is the exit
        out, err = p.communicate(timeout=timeout_s)
        # p is reaped (_kill_group passes it by): its pid still names its group while anything
        # is left in it (Linux reuses no pid that is a group's id), so what it left goes now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        return out, err
    deadline = time.monotonic() + timeout_s
    got: dict[int, list[bytes]] = {p.stdout.fileno(): [], p.stderr.fileno(): []}
    try:
        with selectors.DefaultSelector() as sel:
            for fd in got:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            sel.register(exited, selectors.EVENT_READ)
            while exited in sel.get_map():  # until it exits; its pipes may end before
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(p.args, timeout_s)
                for key, _ in sel.select(left):
                    if key.fd == exited:  # what it wrote is in the pipes: read it, nothing waits
                        _kill_group(p)
                        for fd, into in got.items():
                            _drain(fd, into)
                        sel.unregister(exited)
                        break
                    if not _read(key.fd, got[key.fd]):
                        sel.unregister(key.fd)
    finally:
        os.close(exited)
    return b"".join(got[p.stdout.fileno()]), b"".join(got[p.stderr.fileno()])


def _read(fd: int, into: list[bytes]) -> bool:
    """One read of ``fd`` into ``into``; False at its end."""
    try:
        chunk = os.read(fd, _CHUNK)
    except BlockingIOError:
        return True
    if chunk:
        into.append(chunk)
    return bool(chunk)


def _drain(fd: int, into: list[bytes]) -> None:
    """What pipe ``fd`` holds now, to its end or until it is empty, and at most its capacity:
    all the command, exited, can have written that was not read yet. A writer that outlived it,
    out of its group, may keep the pipe open, and full: not waited for, nor read on for ever."""
    try:
        left = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    except OSError:  # not a pipe (a test's): the most a pipe holds
        left = _PIPE_MAX
    while left > 0:
        try:
            chunk = os.read(fd, min(left, _CHUNK))
        except BlockingIOError:
            return
        if not chunk:
            return
        into.append(chunk)
        left -= len(chunk)


class Children:
    """The child processes of one run. :meth:`run` starts one and waits for it at most its
    timeout; :meth:`close` kills and reaps every one still running, and refuses new ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[subprocess.Popen[bytes], str] = {}  # → the command's name
        self._closed = False
        _ALL.add(self)

    @property
    def live(self) -> int:
        """Children started and not yet reaped."""
        with self._lock:
            return len(self._live)

    @property
    def closed(self) -> bool:
        return self._closed

    def run(
        self, argv: Sequence[str], timeout_s: float, *, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)`` with the
        child in a group of its own, no standard input, and the whole group killed at the
        timeout (:class:`subprocess.TimeoutExpired`), at the child's exit and at :meth:`close`
        (:class:`Stopped`). The output is UTF-8, a byte that is not replaced. ``check``:
        :class:`subprocess.CalledProcessError` for a non-zero exit. OSError when it cannot be
        started (ValueError for an argument with a NUL)."""
        argv = list(argv)
        if self._closed:
            raise Stopped(argv)
        # started out of the lock: Popen waits for the exec, which waits for the binary's file
        # system (Slurm's commands on a hung NFS mount): close() must not wait with it
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        with self._lock:  # registered, or ended here: close() came while it started
            self._live[p] = argv[0]
            closed = self._closed
        try:
            try:
                if closed:
                    raise Stopped(argv)
                out, err = _collect(p, timeout_s)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(argv, timeout_s) from None
            finally:  # timeout, close() from another thread, an exception here: the group goes
                self._end(p)
        finally:
            with self._lock:
                self._live.pop(p, None)
        if self._closed and p.returncode == -signal.SIGKILL:
            raise Stopped(argv)
        if check and p.returncode:
            raise subprocess.CalledProcessError(p.returncode, argv, _text(out), _text(err))
        return subprocess.CompletedProcess(argv, p.returncode, _text(out), _text(err))

    @staticmethod
    def _end(p: subprocess.Popen[bytes]) -> None:
        """Kill ``p``'s group (whatever it left in it too, when it exited), reap ``p``, close
        the pipes (a descendant that left the group may hold them: not waited for)."""
        _kill_group(p)
        _reap(p)
        for f in (p.stdout, p.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def close(self) -> None:
        """Kill every child still running (its group) and reap it; :meth:`run` refuses to start
        another from now on (:class:`Stopped`), and one starting now is ended by its own
        :meth:`run` once started (not waited for here: its exec may hang). Idempotent."""
        with self._lock:
            self._closed = True
            live = dict(self._live)
        for p in live:
            _kill_group(p)
        for p in live:
            _reap(p)  # the thread in run() reaps it too: whichever first; both see the status
        if live:
            log.info("stopped %d command(s) still running at the end of the run: %s", len(live),
                     ", ".join(live.values()))  # fmt: skip

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


#: every Children not yet collected: those nobody closed are closed at the interpreter's exit
#: (daemon threads still run then: a command one of them waits for is ended, not abandoned)
_ALL: weakref.WeakSet[Children] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for c in list(_ALL):
        c.close()


def kill_all_now() -> None:
    """SIGKILL the group of every child of every :class:`Children` not yet collected, taking no
    lock and waiting for nothing: for a signal handler about to end the process (the code it
    interrupted may hold a lock). Every run's, not one: the process ends, and a run nested in
    another, or an embedder's own, would be left out."""
    for c in list(_ALL):
        for p in list(c._live):  # a copy the GIL makes whole: Popen hashes by id, no Python code
            _kill_group(p)

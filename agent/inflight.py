"""A slow dependency's call kept off the sampling tick: the node agent samples every GPU in one
loop, and a kubelet or slurmctld that takes a call and answers late held every tick for the
call's whole timeout (at a 1 s interval, four samples of five never taken: the node's capacity
read a fifth of what it was). The call runs on a thread of its own, one at a time; the tick
waits for it at most ``wait_s`` (:data:`WAIT_SHARE` of the interval in the assembled agent), and
an answer that comes later is taken at the next tick after it came. The caller keeps its last
answer meanwhile and counts the tick as slow."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The share of the sampling interval a tick waits for a slow dependency's answer.
WAIT_SHARE = 0.25

_LOOK_S = 0.1  # how often a wait looks at the stop


def _wait(done: threading.Event, timeout_s: float | None, stop: threading.Event) -> bool:
    """``done.wait(timeout_s)``, ended early (False) once ``stop`` is set."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.is_set():
        left = _LOOK_S if end is None else min(_LOOK_S, end - time.monotonic())
        if left <= 0:
            return done.is_set()
        if done.wait(left):
            return True
    return done.is_set()


class _Call(Generic[T]):
    """One call on a daemon thread (a hung dependency never holds the exit: the call's own
    timeout ends it, and a child process it runs is ended with the run, gpuslo.core.proc)."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self.done = threading.Event()
        self.answer: T | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self.answer = fn()
        except Exception as exc:  # handed to the tick that takes the answer
            self.error = exc
        finally:
            self.done.set()


class InFlight(Generic[T]):
    """At most one call of a dependency in flight. :meth:`take` starts one where none is, and
    gives its answer (raises its error) once it has come within ``wait_s``; ``(False, None)``
    while it has not, counted in :attr:`slow` and said once (``what``: the dependency, for the
    log line). ``first_whole``: the first answer is waited for whole (there is no last answer to
    stand for it: the agent's first ticks would go without).

    ``stop``: the run's stop (the agent's SIGTERM handler sets it): once set, every wait ends at
    once, the first answer's whole wait too. A tick waiting for a stopped slurmctld held the exit
    for the command's timeout, once per dependency (9 s measured, up to 30 s on a node asking
    three: a DaemonSet's default grace period), while the runner's stop was already set. It is
    the run's, not the process's: a module-wide event, set by one run's stop and never cleared,
    ended every wait of the next run in the same process at once. The call left in flight is
    ended by its own timeout, or with the run (a command: :class:`gpuslo.core.proc.Children`)."""

    def __init__(self, what: str, wait_s: float, thread_name: str, first_whole: bool = False,
                 stop: threading.Event | None = None) -> None:  # fmt: skip
        self.what = what
        self.wait_s = wait_s
        self.thread_name = thread_name
        self.slow = 0  # ticks that went on without the answer
        self._call: _Call[T] | None = None
        self._logged = False
        self._waiting_first = first_whole
        self.stop = stop if stop is not None else threading.Event()  # none given: never set

    def take(self, fn: Callable[[], T], wait_s: float | None = None) -> tuple[bool, T | None]:
        """``wait_s``: this take's wait, instead of :attr:`wait_s` (0: look, do not wait)."""
        if self._call is None:
            self._call = _Call(fn, self.thread_name)
        if self._waiting_first:
            if not _wait(self._call.done, None, self.stop):  # the call's own timeout ends it, or a stop
                return False, None
            self._waiting_first = False
        if not _wait(self._call.done, self.wait_s if wait_s is None else wait_s, self.stop):
            self.slow += 1
            if not self._logged:
                self._logged = True
                log.warning(
                    "%s has not answered within %.2f s; the last answer stands until it does (logged once; "
                    "counted)", self.what, self.wait_s,
                )  # fmt: skip
            return False, None
        call, self._call = self._call, None
        if call.error is not None:
            raise call.error
        return True, call.answer

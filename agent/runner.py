"""The loop that owns timing, shutdown and failure containment; sources and sinks stay simple.

The model is OpenTelemetry's ``PeriodicExportingMetricReader``: the loop that owns the
thread, the timing and the shutdown is separate from the things that collect and export,
and an exporter that fails is logged and counted, never allowed to stop the loop."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuslo.agent.base import SendResult, Sink, Source
from gpuslo.wire import Message

log = logging.getLogger(__name__)


# a clock this far behind the latest tick was set back (less: a wait made a little longer)
SET_BACK_S = 1.0


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep_until(self, t: float, stop: threading.Event) -> None:
        """Return at ``t``, or as soon as ``stop`` is set."""


class WallClock:
    """The wall clock; a sleep wakes at once when the stop event is set. It waits in steps of
    at most ``step_s``, so that a wall clock set back or forward is noticed within a step: set
    forward, the sleep ends; set back (the wait grown longer than it began), the sleep ends too,
    early, for the caller to see the clock behind and start again from it."""

    def __init__(self, time_fn: Callable[[], float] = time.time, step_s: float = 1.0) -> None:
        self._time = time_fn
        self.step_s = step_s

    def now(self) -> float:
        return self._time()

    def sleep_until(self, t: float, stop: threading.Event) -> None:
        longest = t - self._time()  # the wait as it began
        while not stop.is_set() and (d := t - self._time()) > 0:
            if d > longest + self.step_s:  # the clock was set back while it waited
                return
            stop.wait(min(self.step_s, d))


@dataclass
class RunnerStats:
    ticks: int = 0
    messages: int = 0
    source_errors: dict[str, int] = field(default_factory=dict)
    send_failures: int = 0
    ticks_missed: int = 0  # slots passed over after a stall (a hang, a suspended host, a clock set forward)
    clock_set_back: int = 0  # times the clock went back behind the last tick: the ticks started again from it


class _SinkState:
    """What the runner remembers of one sink: whether it is in an outage (logged once per
    outage), and the exception types it already logged."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.failing = False
        self.logged: set[str] = set()


class Runner:
    """Every ``interval_s``: collect from each source, send everything to each sink.

    A source that raises is logged (once per distinct error) and counted; the other sources
    and later ticks go on. A sink that fails (a failure result, or an exception) is logged
    once per outage and its messages counted in ``send_failures``; the other sinks still get
    every message, and later ticks go on. :meth:`run` returns when its ticks are done or
    when :meth:`stop` (or the ``stop`` event it was given) is called, at once, even while
    it waits for the next tick."""

    def __init__(
        self, sources: Sequence[Source], sink: Sink | Sequence[Sink], clock: Clock, interval_s: float
    ) -> None:
        self.sources = list(sources)
        self._sinks = [_SinkState(s) for s in ([sink] if isinstance(sink, Sink) else sink)]
        if not self._sinks:
            raise ValueError("a runner needs at least one sink")
        if not 0 < interval_s < math.inf:  # NaN fails too
            raise ValueError(f"a runner needs a positive finite interval, not {interval_s!r}")
        self.clock = clock
        self.interval_s = interval_s
        self.stats = RunnerStats()
        self._logged: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._running = threading.Lock()

    @property
    def sinks(self) -> list[Sink]:
        return [s.sink for s in self._sinks]

    def stop(self) -> None:
        """Ask :meth:`run` to return; it does so before its next tick, without waiting for it.
        A stop is final: a later :meth:`run` returns at once."""
        self._stop.set()

    def tick(self, now: float) -> None:
        msgs: list[Message] = []
        for s in self.sources:
            try:
                msgs.extend(s.collect(now))
            except Exception as exc:  # contained: one bad source never stops sampling
                self.stats.source_errors[s.name] = self.stats.source_errors.get(s.name, 0) + 1
                key = (s.name, type(exc).__name__)
                if key not in self._logged:
                    self._logged.add(key)
                    log.exception("source %s failed at %.3f; counting further failures", s.name, now)
        if msgs:
            batch = tuple(msgs)  # every sink sees the same messages, whatever another one does
            for state in self._sinks:
                self._send(state, batch, now)
        self.stats.ticks += 1

    def _send(self, state: _SinkState, msgs: Sequence[Message], now: float) -> None:
        try:
            res = state.sink.send(msgs)
        except Exception as exc:  # contained like a source: a sink that raises never stops sampling
            if type(exc).__name__ not in state.logged:
                state.logged.add(type(exc).__name__)
                log.exception("sink raised at %.3f; counting its failures", now)
            res = SendResult(sent=0, failed=len(msgs), error=f"{type(exc).__name__}: {exc}")
        self.stats.messages += res.sent
        if not res.ok:
            self.stats.send_failures += res.failed
            if not state.failing:  # once per outage: the count goes on in the stats
                state.failing = True
                log.warning("sink failed to send %d messages: %s (further failures are counted, "
                            "logged again when it recovers)", res.failed, res.error)  # fmt: skip
        elif state.failing:
            state.failing = False
            log.warning("sink accepts messages again (%d failed so far)", self.stats.send_failures)

    def run(
        self,
        start: float,
        ticks: int | None = None,
        on_tick: Callable[[int], None] | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Tick at ``start + k * interval_s`` for k = 0, 1, ... (``ticks`` of them, or until
        stopped), passing over the times a stall left a whole interval or more behind; the
        number of ticks done. ``stop``: the caller's event (a signal handler's),
        from then on the one :meth:`stop` sets (and set at once when :meth:`stop` came first).
        One run at a time: a second one while the first runs is a RuntimeError."""
        if not self._running.acquire(blocking=False):
            raise RuntimeError("this runner is already running (one run at a time)")
        try:
            if stop is not None:
                if self._stop.is_set():  # a stop is final, whichever event carries it
                    stop.set()
                self._stop = stop
            return self._loop(start, ticks, on_tick, self._stop)
        finally:
            self._running.release()

    def _loop(
        self, start: float, ticks: int | None, on_tick: Callable[[int], None] | None, ev: threading.Event
    ) -> int:
        k = slot = 0  # ticks done; the slot of the next one
        while (ticks is None or k < ticks) and not ev.is_set():
            slot += self._missed(start, slot)
            t = start + slot * self.interval_s
            if slot and self._set_back(t - self.interval_s):  # before the wait, or ...
                start, slot = self.clock.now(), 0
                continue
            if not self._wait(t, ev):  # ... while it waited
                start, slot = self.clock.now(), 0
                continue
            if ev.is_set():
                break
            self.tick(t)
            k, slot = k + 1, slot + 1
            if on_tick is not None:
                on_tick(k)
        return k

    def _wait(self, t: float, ev: threading.Event) -> bool:
        """Sleep until ``t`` (or the stop); False when the clock went back behind the tick before
        ``t`` meanwhile. A sleep that wakes early for a clock set back less than that waits
        again: the tick is never taken before its time (it was, stamped ahead of the clock)."""
        for _ in range(1000):  # a clock whose sleep ends short of t for ever (a fake) still ticks
            self.clock.sleep_until(t, ev)
            if ev.is_set():
                return True
            if self._set_back(t - self.interval_s):
                return False
            if self.clock.now() >= t:
                return True
        return True

    def _set_back(self, last: float) -> bool:
        """Whether the clock is behind ``last``, the latest tick's time, by more than
        ``SET_BACK_S``: set back (an NTP step, an operator). Waiting for the next slot would
        stop sampling for as long as it went back (an hour set back: a node silent for an
        hour); the ticks start again from the clock instead. Counted and logged."""
        behind = last - self.clock.now()
        if behind <= SET_BACK_S:
            return False
        self.stats.clock_set_back += 1
        log.warning("the clock went back %.1f s behind the last tick; ticking again from it (%d times so far)",
                    behind, self.stats.clock_set_back)  # fmt: skip
        return True

    def _missed(self, start: float, slot: int) -> int:
        """The slots a whole interval or more behind the clock: passed over, not ticked in a
        burst that would stamp what the sources read now with times long gone (a gap stays a
        gap, as the rules read it); counted and logged."""
        late = self.clock.now() - (start + slot * self.interval_s)
        if late < self.interval_s:
            return 0
        missed = int(late // self.interval_s)
        self.stats.ticks_missed += missed
        log.warning("the loop is %.1f s behind its clock: %d ticks passed over (%d so far)", late, missed,
                    self.stats.ticks_missed)  # fmt: skip
        return missed

"""The loop that owns timing and failure containment; sources and sinks stay simple."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuslo.agent.base import SendResult, Sink, Source
from gpuslo.wire import Message

log = logging.getLogger(__name__)


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.time()

    def sleep_until(self, t: float) -> None:
        d = t - time.time()
        if d > 0:
            time.sleep(d)


@dataclass
class RunnerStats:
    ticks: int = 0
    messages: int = 0
    source_errors: dict[str, int] = field(default_factory=dict)
    send_failures: int = 0


class Runner:
    """Every ``interval_s``: collect from each source, send everything to the sink.

    A source that raises is logged (once per distinct error) and counted; the other
    sources and later ticks go on."""

    def __init__(self, sources: Sequence[Source], sink: Sink, clock: Clock, interval_s: float) -> None:
        self.sources = list(sources)
        self.sink = sink
        self.clock = clock
        self.interval_s = interval_s
        self.stats = RunnerStats()
        self._logged: set[tuple[str, str]] = set()
        self._sink_failing = False

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
            try:
                res = self.sink.send(msgs)
            except Exception as exc:  # contained like a source: a sink that raises never stops sampling
                if ("sink", type(exc).__name__) not in self._logged:
                    self._logged.add(("sink", type(exc).__name__))
                    log.exception("sink raised at %.3f; counting its failures", now)
                res = SendResult(sent=0, failed=len(msgs), error=f"{type(exc).__name__}: {exc}")
            self.stats.messages += res.sent
            if not res.ok:
                self.stats.send_failures += res.failed
                if not self._sink_failing:  # once per outage: the count goes on in the stats
                    self._sink_failing = True
                    log.warning("sink failed to send %d messages: %s (further failures are counted, "
                                "logged again when it recovers)", res.failed, res.error)  # fmt: skip
            elif self._sink_failing:
                self._sink_failing = False
                log.warning("sink accepts messages again (%d failed so far)", self.stats.send_failures)
        self.stats.ticks += 1

    def run(
        self, start: float, ticks: int | None = None, on_tick: Callable[[int], None] | None = None
    ) -> None:
        k = 0
        while ticks is None or k < ticks:
            t = start + k * self.interval_s
            self.clock.sleep_until(t)
            self.tick(t)
            k += 1
            if on_tick is not None:
                on_tick(k)

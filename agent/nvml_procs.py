"""The processes on a GPU (or MIG instance) and their utilization, from NVML.

- Running processes: ``nvmlDeviceGetComputeRunningProcesses``, ``…GraphicsRunningProcesses``
  and ``…MPSComputeRunningProcesses`` (pynvml's v3 calls: ``pid``, ``usedGpuMemory`` in bytes
  or None where the driver cannot say, ``gpuInstanceId``/``computeInstanceId``). A process in
  several lists counts once, with the largest memory figure. On a MIG device handle NVML lists
  that instance's processes.
- Per-process utilization: ``nvmlDeviceGetProcessesUtilizationInfo`` (NVML 12.550+), else
  ``nvmlDeviceGetProcessUtilization``: the samples NVML took after ``lastSeenTimeStamp`` (µs,
  the CPU clock); each sample has ``pid``, ``timeStamp``, ``smUtil`` (%) and more. The next
  call passes the newest timestamp seen, so each sample counts once; the first call passes 0
  (whatever NVML still buffers). ``NVML_ERROR_NOT_FOUND`` means no sample is newer: nobody ran
  a kernel since, which is a measurement (every process at 0), not a failure. NVML does not
  give per-process utilization for MIG instances (NOT_SUPPORTED): their split comes from the
  process lists alone.

A call the device does not support is asked no more (counted once); any other error makes
that tick's figure unknown (counted). Nothing here raises an NVML error to the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_LISTS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
          "nvmlDeviceGetMPSComputeRunningProcesses")  # fmt: skip
_CLOCK_SLACK_S = 300.0  # how far the newest sample may be ahead of the clock before it is distrusted
_UTIL_CALLS = ("nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization")


@dataclass(frozen=True)
class ProcView:
    """What NVML said about one row's processes this tick. ``fb_bytes``: pid → framebuffer
    bytes (0 where the driver gives no figure); ``sm``: pid → mean SM utilization (%) over the
    new samples, or None when per-process utilization is not known this tick."""

    fb_bytes: dict[int, int]
    sm: dict[int, float] | None


@dataclass
class ProcStats:
    unsupported: int = 0  # (row, call) pairs found unsupported, each logged once
    errors: int = 0  # other NVML errors, per call per tick


@dataclass
class _Row:
    last_seen_us: int = 0
    unsupported: set[str] = field(default_factory=set)


class NvmlProcesses:
    """Reads :class:`ProcView` for a device handle (``key``: the row's UUID, which keeps the
    per-row lastSeen timestamp and the calls found unsupported)."""

    def __init__(self, nvml: Any, clock: Callable[[], float] = time.time) -> None:
        self.m = nvml
        self.clock = clock
        self.stats = ProcStats()
        self._rows: dict[str, _Row] = {}

    def read(self, key: str, handle: Any) -> ProcView | None:
        """None when no process list could be read (then nothing is known)."""
        row = self._rows.setdefault(key, _Row())
        fb = self._processes(key, row, handle)
        if fb is None:
            return None
        return ProcView(fb, self._utilization(key, row, handle))

    def _call(self, key: str, row: _Row, name: str, *args: Any, none_newer: bool = False) -> tuple[str, Any]:
        """(``ok`` and the answer, ``absent``: not supported, or ``error``). ``none_newer``: a
        utilization call, for which NOT_FOUND is NVML's documented answer "no sample newer"
        (``None``); from a process list (which NVML never answers so) it is an error, never an
        empty list that would make a holder look idle."""
        m = self.m
        fn: Callable[..., Any] | None = getattr(m, name, None)
        if fn is None or name in row.unsupported:
            return "absent", None
        try:
            return "ok", fn(*args)
        except m.NVMLError_NotFound as exc:
            if none_newer:
                return "ok", None
            self.stats.errors += 1
            log.debug("%s: %s: %s", key, name, exc)
            return "error", None
        except (m.NVMLError_NotSupported, m.NVMLError_FunctionNotFound) as exc:
            row.unsupported.add(name)
            self.stats.unsupported += 1
            log.info("%s: %s: %s; not asked again", key, name, exc)
            return "absent", None
        except m.NVMLError as exc:  # lost GPU, no permission, ...: unknown this tick
            mismatch = getattr(m, "NVMLError_ArgumentVersionMismatch", None)
            if mismatch is not None and isinstance(exc, mismatch):
                row.unsupported.add(name)  # this pynvml's struct is not the driver's: never right
            self.stats.errors += 1
            log.debug("%s: %s: %s", key, name, exc)
            return "error", None

    def _processes(self, key: str, row: _Row, handle: Any) -> dict[int, int] | None:
        """pid → framebuffer bytes over the three lists; None when a list failed this tick (a
        partial list would make a holder look idle) or none is supported."""
        fb: dict[int, int] = {}
        answered = False
        for name in _LISTS:
            status, procs = self._call(key, row, name, handle)
            if status == "error":
                return None
            answered |= status == "ok"
            for p in procs or ():
                pid, used = int(p.pid), p.usedGpuMemory
                fb[pid] = max(fb.get(pid, 0), int(used) if isinstance(used, int) and used > 0 else 0)
        return fb if answered else None

    def _utilization(self, key: str, row: _Row, handle: Any) -> dict[int, float] | None:
        if row.last_seen_us > (self.clock() + _CLOCK_SLACK_S) * 1e6:
            # the host's clock went back: NVML's new samples are all "older" than the newest
            # seen, and would stay unseen until the clock caught up; start again from what it holds
            log.warning("%s: process utilization timestamps ahead of the clock; reading from the start", key)
            row.last_seen_us = 0
        for name in _UTIL_CALLS:
            status, samples = self._call(key, row, name, handle, row.last_seen_us, none_newer=True)
            if status == "error":
                return None
            if status == "absent":
                continue
            by_pid: dict[int, list[float]] = {}
            newest = row.last_seen_us
            for s in samples or ():
                ts = int(s.timeStamp)
                if ts <= row.last_seen_us:  # NVML returns only newer ones; never count one twice
                    continue
                newest = max(newest, ts)
                by_pid.setdefault(int(s.pid), []).append(min(100.0, max(0.0, float(s.smUtil))))
            row.last_seen_us = newest
            return {pid: sum(v) / len(v) for pid, v in by_pid.items()}
        return None

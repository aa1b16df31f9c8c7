"""A fake NVML with the real library's shapes: functions return pynvml's own ctypes
structs and raise pynvml's own NVMLError subclasses; constants and types are pynvml's.
Device handles are real ``c_nvmlDevice_t`` pointers to distinct structs."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util: int = 50
    mem_util: int = 20
    fb_total: int = 80 * 2**30
    fb_used: int = 10 * 2**30
    power_mw: int = 350_000
    energy_mj: int = 123_456_789
    temp_c: int = 55
    sm_clock: int = 1980
    mem_clock: int = 2619
    reasons: int = 0
    pcie_tx_kb: int = 1000
    pcie_rx_kb: int = 2000
    replays: int = 3
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    remapped: tuple[int, int, int, int] = (1, 0, 0, 0)
    unsupported: set[str] = field(default_factory=set)  # NVML function names
    lost: bool = False
    gpm: bool = True
    gpm_pct: dict[int, float] = field(default_factory=dict)
    nvlink_links: int = 0  # 0: no NVLink (every link's value comes back NOT_SUPPORTED)
    nvlink_tx_kib: int = 0  # counters per link
    nvlink_rx_kib: int = 0
    nvlink_ts_us: int = 1_000_000
    calls: dict[str, int] = field(default_factory=dict)


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self._structs = [pynvml.struct_c_nvmlDevice_t() for _ in gpus]
        self.xids: list[tuple[int, int]] = []  # (gpu index, xid) queued for the event set
        self.initialized = False

    def __getattr__(self, name: str) -> Any:  # constants, error classes, struct types
        return getattr(pynvml, name)

    # ------------------------------------------------------------ plumbing
    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        for s, g in zip(self._structs, self.gpus, strict=True):
            if ctypes.addressof(s) == addr:
                g.calls[fn] = g.calls.get(fn, 0) + 1
                if g.lost:
                    raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                if fn in g.unsupported:
                    raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
                return g
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlInit(self) -> None:
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        if not 0 <= i < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ctypes.pointer(self._structs[i])

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, h: Any) -> str:
        return self._gpu(h, "nvmlDeviceGetName").name

    # ------------------------------------------------------------ readings
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(gpu=g.util, memory=g.mem_util)

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        return pynvml.c_nvmlMemory_t(total=g.fb_total, free=g.fb_total - g.fb_used, used=g.fb_used)

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(h, "nvmlDeviceGetTemperature").temp_c

    def nvmlDeviceGetClockInfo(self, h: Any, kind: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetClockInfo")
        return {pynvml.NVML_CLOCK_SM: g.sm_clock, pynvml.NVML_CLOCK_MEM: g.mem_clock}[kind]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").reasons

    def nvmlDeviceGetPcieThroughput(self, h: Any, counter: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetPcieThroughput")
        return g.pcie_tx_kb if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else g.pcie_rx_kb

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetPcieReplayCounter").replays

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEccErrors").ecc.get((error_type, counter), 0)

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        return self._gpu(h, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[Any]) -> Any:
        g = self._gpu(h, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, (fid, scope) in enumerate(field_ids):
            v = values[i]
            v.fieldId, v.scopeId = fid, scope
            if scope >= g.nvlink_links or fid not in (
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
            ):
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            v.nvmlReturn = 0
            v.timestamp = g.nvlink_ts_us
            v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            tx = fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
            v.value.ullVal = g.nvlink_tx_kib if tx else g.nvlink_rx_kib
        return values

    # ------------------------------------------------------------ GPM
    def nvmlGpmQueryDeviceSupport(self, h: Any) -> Any:
        g = self._gpu(h, "nvmlGpmQueryDeviceSupport")
        s = pynvml.c_nvmlGpmSupport_t()
        s.isSupportedDevice = 1 if g.gpm else 0
        return s

    def nvmlGpmSampleAlloc(self) -> Any:
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        pass

    def nvmlGpmSampleGet(self, h: Any, sample: Any) -> Any:
        self._last_gpm = self._gpu(h, "nvmlGpmSampleGet")
        return sample

    def nvmlGpmMetricsGet(self, req: Any) -> Any:
        assert req.version == pynvml.NVML_GPM_METRICS_GET_VERSION
        g = self._last_gpm
        for i in range(req.numMetrics):
            mid = req.metrics[i].metricId
            if mid in g.gpm_pct:
                req.metrics[i].value = g.gpm_pct[mid]
                req.metrics[i].nvmlReturn = 0
            else:
                req.metrics[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return req

    # ------------------------------------------------------------ events
    def nvmlEventSetCreate(self) -> Any:
        return pynvml.c_nvmlEventSet_t()

    def nvmlEventSetFree(self, es: Any) -> None:
        pass

    def nvmlDeviceRegisterEvents(self, h: Any, types: int, es: Any) -> None:
        self._gpu(h, "nvmlDeviceRegisterEvents")

    def nvmlEventSetWait_v2(self, es: Any, timeout_ms: int) -> Any:
        if not self.xids:
            raise _err(pynvml.NVML_ERROR_TIMEOUT)
        i, xid = self.xids.pop(0)
        d = pynvml.c_nvmlEventData_t()
        d.device = ctypes.pointer(self._structs[i])
        d.eventType = pynvml.nvmlEventTypeXidCriticalError
        d.eventData = xid
        return d

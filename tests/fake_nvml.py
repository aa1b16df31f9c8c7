"""A fake NVML with the real library's shapes: functions return pynvml's own ctypes
structs and raise pynvml's own NVMLError subclasses; constants and types are pynvml's.
Device handles are real ``c_nvmlDevice_t`` pointers to distinct structs."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import pynvml

F = TypeVar("F", bound=Callable[..., Any])


def _str_bytes(fn: F) -> F:
    """pynvml's own ``convertStrBytes``, as it wraps its string functions."""
    return cast(F, pynvml.convertStrBytes(fn))


@dataclass
class FakeMig:
    """A MIG device (GPU instance ``gi``, compute instance ``ci``) of a FakeGpu in MIG mode."""

    uuid: str
    gi: int
    ci: int = 0
    gi_slices: int = 1
    ci_slices: int = 1
    memory_mb: int = 10 * 1024
    fb_used_mb: int = 1024
    gpm_pct: dict[int, float] = field(default_factory=dict)
    profile_name: str = ""  # what the driver calls the GPU-instance profile ("MIG 3g.40gb"); "" = none


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
    remapped: tuple[int, int, int, int] = (1, 0, 0, 0)  # corrected, uncorrected, pending, failure
    enc_util: int = 0
    dec_util: int = 12
    sampling_us: int = 167_000  # what the encoder/decoder utilization calls answer beside it
    fb_reserved: int = 549 * 2**20  # bytes (nvmlMemory_v2 only)
    power_limit_mw: int = 700_000
    enforced_limit_mw: int = 700_000
    driver: bytes = b"580.95.05"
    memory_v2: bool = True  # False: a driver without nvmlDeviceGetMemoryInfo_v2 (FUNCTION_NOT_FOUND)
    unsupported: set[str] = field(default_factory=set)  # NVML function names
    # NVML function name -> the NVML_ERROR_* code it fails with on this GPU (and its MIG devices),
    # raised as pynvml raises it: NVMLError(code), which is the code's own subclass
    errors: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    gpm: bool = True
    gpm_pct: dict[int, float] = field(default_factory=dict)
    nvlink_links: int = 0  # 0: no NVLink (every link's value comes back NOT_SUPPORTED)
    nvlink_tx_kib: int = 0  # counters per link
    nvlink_rx_kib: int = 0
    nvlink_ts_us: int = 1_000_000
    # link -> the nvmlReturn its counters come back with from nvmlDeviceGetFieldValues (the call
    # itself succeeds; NVML reports each field's own failure in its value, e.g. TIMEOUT, UNKNOWN)
    nvlink_returns: dict[int, int] = field(default_factory=dict)
    mig_capable: bool = False  # False: nvmlDeviceGetMigMode is NOT_SUPPORTED (e.g. L40S)
    mig: list[FakeMig] | None = None  # set: MIG mode enabled with these devices
    slices: int = 7  # the largest GPU-instance profile (7 on A100/H100, 4 on A30)
    # the N of its /dev/nvidiaN (nvmlDeviceGetMinorNumber); None: its place in the list. NVML
    # enumerates by PCI bus id, so a real node's minor numbers need not follow the indices
    minor: int | None = None
    calls: dict[str, int] = field(default_factory=dict)


@dataclass
class FakeProc:
    """A process on a GPU or MIG instance: ``kind`` the list NVML shows it in (compute,
    graphics, mps), ``fb_bytes`` None where the driver gives no figure (WDDM)."""

    pid: int
    fb_bytes: int | None = 1 << 30
    kind: str = "compute"
    gi: int = 0xFFFFFFFF  # NVML's "not a MIG instance"
    ci: int = 0xFFFFFFFF


@dataclass
class FakeProcs:
    """What NVML knows of one row's (GPU or MIG device, by UUID) processes. ``samples``: the
    per-process utilization buffer, (pid, timeStamp µs, smUtil %); ``errors``: NVML function
    name → the error code it fails with; ``utilization_info``: the driver has
    ``nvmlDeviceGetProcessesUtilizationInfo`` (NVML 12.550+)."""

    procs: list[FakeProc] = field(default_factory=list)
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    utilization_info: bool = True


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self._structs = [pynvml.struct_c_nvmlDevice_t() for _ in gpus]
        # one struct per MIG device, so its handle is a distinct pointer too
        self._mig_structs = {
            (i, k): pynvml.struct_c_nvmlDevice_t()
            for i, g in enumerate(gpus)
            for k in range(len(g.mig or []))
        }
        self.xids: list[tuple[int, int]] = []  # (gpu index, xid) queued for the event set
        self.processes: dict[str, FakeProcs] = {}  # row UUID -> its processes
        self.initialized = False
        # NVML function name -> the error code it fails with, for the calls of no one device
        # (nvmlInit, nvmlDeviceGetCount, the event set's, GPM sample allocation ...)
        self.errors: dict[str, int] = {}
        self.registered: set[int] = set()  # GPUs registered for XID events (by index)
        self.gpm_samples_live = 0  # allocated by nvmlGpmSampleAlloc and not freed: NVML's memory

    def _fail(self, fn: str) -> None:
        if fn in self.errors:
            raise _err(self.errors[fn])

    def __getattr__(self, name: str) -> Any:  # constants, error classes, struct types
        return getattr(pynvml, name)

    # ------------------------------------------------------------ plumbing
    def _mig(self, handle: Any, fn: str) -> tuple[FakeGpu, FakeMig] | None:
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        for (i, k), st in self._mig_structs.items():
            if ctypes.addressof(st) == addr:
                g = self.gpus[i]
                g.calls[fn] = g.calls.get(fn, 0) + 1
                if g.lost:
                    raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                if fn in g.errors:
                    raise _err(g.errors[fn])
                assert g.mig is not None
                return g, g.mig[k]
        return None

    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        if self._mig(handle, fn) is not None:  # what a MIG device handle cannot answer
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        for s, g in zip(self._structs, self.gpus, strict=True):
            if ctypes.addressof(s) == addr:
                g.calls[fn] = g.calls.get(fn, 0) + 1
                if g.lost:
                    raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                if fn in g.errors:
                    raise _err(g.errors[fn])
                if fn in g.unsupported:
                    raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
                return g
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlInit(self) -> None:
        self._fail("nvmlInit")
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._fail("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        if not 0 <= i < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        g = self.gpus[i]
        g.calls["nvmlDeviceGetHandleByIndex"] = g.calls.get("nvmlDeviceGetHandleByIndex", 0) + 1
        if g.lost:  # NVML's documented answer for a GPU that fell off the bus
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if "nvmlDeviceGetHandleByIndex" in g.errors:
            raise _err(g.errors["nvmlDeviceGetHandleByIndex"])
        return ctypes.pointer(self._structs[i])

    # the string functions pynvml wraps in its ``convertStrBytes``: the C string decoded as
    # UTF-8, strictly (bytes that are not UTF-8 raise UnicodeDecodeError from pynvml itself)
    def nvmlDeviceGetMinorNumber(self, h: Any) -> int:
        """The GPU's minor number; a MIG device handle has none (NOT_SUPPORTED, via ``_gpu``)."""
        g = self._gpu(h, "nvmlDeviceGetMinorNumber")
        return self.gpus.index(g) if g.minor is None else g.minor

    @_str_bytes
    def nvmlDeviceGetUUID(self, h: Any) -> str:
        mig = self._mig(h, "nvmlDeviceGetUUID")
        return mig[1].uuid if mig else self._gpu(h, "nvmlDeviceGetUUID").uuid

    @_str_bytes
    def nvmlDeviceGetName(self, h: Any) -> str:
        return self._gpu(h, "nvmlDeviceGetName").name

    # ------------------------------------------------------------ readings
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(gpu=g.util, memory=g.mem_util)

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        """pynvml's: no ``version``, the v1 struct; ``nvmlMemory_v2``, nvmlDeviceGetMemoryInfo_v2
        (total = reserved + free + used, as the driver counts them)."""
        mig = self._mig(h, "nvmlDeviceGetMemoryInfo")
        if mig:
            total, used = mig[1].memory_mb * 2**20, mig[1].fb_used_mb * 2**20
            return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)
        if not version:
            g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
            return pynvml.c_nvmlMemory_t(total=g.fb_total, free=g.fb_total - g.fb_used, used=g.fb_used)
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo_v2")
        if not g.memory_v2:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # what pynvml raises for a missing symbol
        if version != pynvml.nvmlMemory_v2:
            raise _err(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        free = g.fb_total - g.fb_used - g.fb_reserved
        return pynvml.c_nvmlMemory_v2_t(version=version, total=g.fb_total, reserved=g.fb_reserved, free=free,
                                        used=g.fb_used)  # fmt: skip

    def nvmlDeviceGetEncoderUtilization(self, h: Any) -> list[int]:
        g = self._gpu(h, "nvmlDeviceGetEncoderUtilization")
        return [g.enc_util, g.sampling_us]

    def nvmlDeviceGetDecoderUtilization(self, h: Any) -> list[int]:
        g = self._gpu(h, "nvmlDeviceGetDecoderUtilization")
        return [g.dec_util, g.sampling_us]

    def nvmlDeviceGetPowerManagementLimit(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerManagementLimit").power_limit_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit").enforced_limit_mw

    @_str_bytes
    def nvmlSystemGetDriverVersion(self) -> bytes:
        self._fail("nvmlSystemGetDriverVersion")
        return self.gpus[0].driver if self.gpus else b"580.95.05"

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
            if scope in g.nvlink_returns:
                v.nvmlReturn = g.nvlink_returns[scope]
                continue
            v.nvmlReturn = 0
            v.timestamp = g.nvlink_ts_us
            v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            tx = fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
            v.value.ullVal = g.nvlink_tx_kib if tx else g.nvlink_rx_kib
        return values

    # ------------------------------------------------------------ MIG
    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        g = self._gpu(h, "nvmlDeviceGetMigMode")
        if not g.mig_capable and g.mig is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if g.mig is not None else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetMaxMigDeviceCount").slices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, k: int) -> Any:
        g = self._gpu(h, "nvmlDeviceGetMigDeviceHandleByIndex")
        i = self.gpus.index(g)
        if (i, k) not in self._mig_structs:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return ctypes.pointer(self._mig_structs[(i, k)])

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: Any, profile: int, version: int = 2) -> Any:
        g = self._gpu(h, "nvmlDeviceGetGpuInstanceProfileInfo")
        slices = {getattr(pynvml, f"NVML_GPU_INSTANCE_PROFILE_{k}_SLICE"): k for k in (1, 2, 3, 4, 6, 7, 8)}[
            profile
        ]
        if slices > g.slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id = profile
        info.sliceCount = slices
        named = [x.profile_name for x in g.mig or [] if x.gi_slices == slices and x.profile_name]
        info.name = (named[0] if isinstance(named[0], bytes) else named[0].encode()) if named else b""
        return info

    def nvmlDeviceGetGpuInstanceById(self, h: Any, gi: int) -> Any:
        g = self._gpu(h, "nvmlDeviceGetGpuInstanceById")
        same = [x for x in g.mig or [] if x.gi == gi]
        if not same:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return ("gpu-instance", same[0].gi_slices)  # opaque to the caller, as the real handle is

    def nvmlGpuInstanceGetInfo(self, inst: Any) -> Any:
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id = 0
        info.profileId = getattr(pynvml, f"NVML_GPU_INSTANCE_PROFILE_{inst[1]}_SLICE")
        return info

    def _mig_only(self, h: Any, fn: str) -> FakeMig:
        mig = self._mig(h, fn)
        if mig is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # not a MIG device handle
        return mig[1]

    def nvmlDeviceGetAttributes(self, h: Any) -> Any:
        x = self._mig_only(h, "nvmlDeviceGetAttributes")
        a = pynvml.c_nvmlDeviceAttributes()
        a.gpuInstanceSliceCount, a.computeInstanceSliceCount, a.memorySizeMB = (
            x.gi_slices,
            x.ci_slices,
            x.memory_mb,
        )
        return a

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> int:
        return self._mig_only(h, "nvmlDeviceGetGpuInstanceId").gi

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> int:
        return self._mig_only(h, "nvmlDeviceGetComputeInstanceId").ci

    def nvmlGpmMigSampleGet(self, h: Any, gi: int, sample: Any) -> Any:
        g = self._gpu(h, "nvmlGpmMigSampleGet")
        same = [m for m in g.mig or [] if m.gi == gi]  # compute instances of one GPU instance share it
        if not same:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._last_gpm: FakeGpu | FakeMig = same[0]
        return sample

    # ------------------------------------------------------------ GPM
    def nvmlGpmQueryDeviceSupport(self, h: Any) -> Any:
        g = self._gpu(h, "nvmlGpmQueryDeviceSupport")
        s = pynvml.c_nvmlGpmSupport_t()
        s.isSupportedDevice = 1 if g.gpm else 0
        return s

    def nvmlGpmSampleAlloc(self) -> Any:
        self._fail("nvmlGpmSampleAlloc")
        self.gpm_samples_live += 1
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._fail("nvmlGpmSampleFree")
        self.gpm_samples_live -= 1

    def nvmlGpmSampleGet(self, h: Any, sample: Any) -> Any:
        self._last_gpm = self._gpu(h, "nvmlGpmSampleGet")
        return sample

    def nvmlGpmMetricsGet(self, req: Any) -> Any:
        assert req.version == pynvml.NVML_GPM_METRICS_GET_VERSION
        g = self._last_gpm
        gpu = g if isinstance(g, FakeGpu) else next(x for x in self.gpus if any(g is y for y in x.mig or ()))
        gpu.calls["nvmlGpmMetricsGet"] = gpu.calls.get("nvmlGpmMetricsGet", 0) + 1
        if "nvmlGpmMetricsGet" in gpu.errors:  # the samples' GPU: the one the request is about
            raise _err(gpu.errors["nvmlGpmMetricsGet"])
        self._fail("nvmlGpmMetricsGet")
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
        self._fail("nvmlEventSetCreate")
        return pynvml.c_nvmlEventSet_t()

    def nvmlEventSetFree(self, es: Any) -> None:
        pass

    def nvmlDeviceRegisterEvents(self, h: Any, types: int, es: Any) -> None:
        g = self._gpu(h, "nvmlDeviceRegisterEvents")
        self.registered.add(self.gpus.index(g))

    def nvmlEventSetWait_v2(self, es: Any, timeout_ms: int) -> Any:
        """The next queued XID of a GPU registered with the set; those of other GPUs never come
        (NVML delivers to a set only what was registered with it)."""
        self._fail("nvmlEventSetWait_v2")
        self.xids = [x for x in self.xids if x[0] in self.registered]
        if not self.xids:
            raise _err(pynvml.NVML_ERROR_TIMEOUT)
        i, xid = self.xids.pop(0)
        d = pynvml.c_nvmlEventData_t()
        d.device = ctypes.pointer(self._structs[i])
        d.eventType = pynvml.nvmlEventTypeXidCriticalError
        d.eventData = xid
        return d

    # ------------------------------------------------------------ processes
    def _procs_of(self, h: Any, fn: str) -> tuple[FakeProcs, bool]:
        """The processes of a GPU or MIG handle (and whether it is a MIG one); the row's
        injected error for ``fn``, the GPU's lost state and unsupported set, as NVML fails."""
        mig = self._mig(h, fn)
        if mig is None:
            g = self._gpu(h, fn)
            uuids = [g.uuid] + [x.uuid for x in g.mig or []]  # a parent handle sees every instance's
        else:
            g, uuids = mig[0], [mig[1].uuid]
            if fn in g.unsupported:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        own = self.processes.setdefault(uuids[0], FakeProcs())
        if fn in own.errors:
            raise _err(own.errors[fn])
        if len(uuids) > 1:
            merged = FakeProcs(utilization_info=own.utilization_info)
            for u in uuids:
                merged.procs += self.processes.get(u, FakeProcs()).procs
            merged.samples = own.samples
            return merged, False
        return own, mig is not None

    def _running(self, h: Any, fn: str, kind: str) -> list[Any]:
        procs, _ = self._procs_of(h, fn)
        out = []
        for p in procs.procs:
            if p.kind != kind:
                continue
            st = pynvml.c_nvmlProcessInfo_v3_t(pid=p.pid, gpuInstanceId=p.gi, computeInstanceId=p.ci,
                                              usedGpuMemory=pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                                              if p.fb_bytes is None else p.fb_bytes)  # fmt: skip
            obj = pynvml.nvmlStructToFriendlyObject(st)  # what pynvml's wrapper returns
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        return self._running(h, "nvmlDeviceGetComputeRunningProcesses", "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:
        return self._running(h, "nvmlDeviceGetGraphicsRunningProcesses", "graphics")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h: Any) -> list[Any]:
        return self._running(h, "nvmlDeviceGetMPSComputeRunningProcesses", "mps")

    def _new_samples(self, h: Any, fn: str, last_seen: int) -> list[tuple[int, int, int]]:
        procs, is_mig = self._procs_of(h, fn)
        if is_mig:  # NVML has no per-process utilization for MIG devices
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if fn == "nvmlDeviceGetProcessesUtilizationInfo" and not procs.utilization_info:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # the driver lacks the symbol
        new = [x for x in procs.samples if x[1] > last_seen]
        if not new:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)  # no sample newer than lastSeenTimeStamp
        return new

    def nvmlDeviceGetProcessUtilization(self, h: Any, timeStamp: int) -> list[Any]:
        new = self._new_samples(h, "nvmlDeviceGetProcessUtilization", timeStamp)
        arr = (pynvml.c_nvmlProcessUtilizationSample_t * len(new))()
        for i, (pid, ts, sm) in enumerate(new):
            arr[i].pid, arr[i].timeStamp, arr[i].smUtil, arr[i].memUtil = pid, ts, sm, sm // 2
        return list(arr[0 : len(new)])

    def nvmlDeviceGetProcessesUtilizationInfo(self, h: Any, timeStamp: int) -> list[Any]:
        new = self._new_samples(h, "nvmlDeviceGetProcessesUtilizationInfo", timeStamp)
        arr = (pynvml.c_nvmlProcessUtilizationInfo_v1_t * len(new))()
        for i, (pid, ts, sm) in enumerate(new):
            arr[i].pid, arr[i].timeStamp, arr[i].smUtil, arr[i].memUtil = pid, ts, sm, sm // 2
        return list(arr[0 : len(new)])

"""NVML source (pynvml from the nvidia-ml-py distribution): the node's GPUs as
``DCGM_FI_*`` fields, XID events, lost GPUs.

The module is passed in (``nvml=``): on a node it is ``pynvml``; in the tests it is a fake
whose functions return pynvml's own ctypes structs and raise pynvml's own ``NVMLError``
subclasses, so the code below runs the same path it runs on a GPU.

Failure containment, per the style guide: a field the device does not support is logged
once and counted (``unsupported``), then never asked again; ``NVML_ERROR_GPU_IS_LOST``
turns that GPU into a ``gpu_lost`` health event and ``healthy=False`` samples while the
others keep sampling; any other NVML error skips that value for this tick and is counted.
A GPU that cannot be opened at start (any error of its handle, UUID or name) is counted and
left out, never stopping the agent, and tried again each tick.
"""

from __future__ import annotations

import logging
import math
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuslo.agent.base import Attribution, Device, LayoutAttribution, Sequencer, Source
from gpuslo.agent.pool import NodePool, pool_at
from gpuslo.agent.procsplit import HolderOf, SplitStats, split
from gpuslo.wire import BY_NAME, Allocation, GpuSample, GpuSampleBatch, HealthEvent, Message, MigInstance
from gpuslo.wire.bounds import UINT32_MAX

log = logging.getLogger(__name__)

Reader = Callable[[Any, Any], float]


def _reader_table(n: Any) -> list[tuple[str, Reader]]:
    """DCGM field name → how to read it with NVML (data: one row per field)."""
    return [
        ("DCGM_FI_DEV_GPU_UTIL", lambda m, h: m.nvmlDeviceGetUtilizationRates(h).gpu),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", lambda m, h: m.nvmlDeviceGetUtilizationRates(h).memory),
        ("DCGM_FI_DEV_FB_TOTAL", lambda m, h: m.nvmlDeviceGetMemoryInfo(h).total / 2**20),
        ("DCGM_FI_DEV_FB_USED", lambda m, h: m.nvmlDeviceGetMemoryInfo(h).used / 2**20),
        ("DCGM_FI_DEV_FB_FREE", lambda m, h: m.nvmlDeviceGetMemoryInfo(h).free / 2**20),
        ("DCGM_FI_DEV_POWER_USAGE", lambda m, h: m.nvmlDeviceGetPowerUsage(h) / 1000.0),  # mW → W
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", lambda m, h: float(m.nvmlDeviceGetTotalEnergyConsumption(h))),
        ("DCGM_FI_DEV_GPU_TEMP", lambda m, h: m.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
        ("DCGM_FI_DEV_SM_CLOCK", lambda m, h: m.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
        ("DCGM_FI_DEV_MEM_CLOCK", lambda m, h: m.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", lambda m, h: float(m.nvmlDeviceGetCurrentClocksEventReasons(h))),
        # KB/s → B/s
        ("DCGM_FI_PROF_PCIE_TX_BYTES", lambda m, h: m.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES) * 1024.0),
        ("DCGM_FI_PROF_PCIE_RX_BYTES", lambda m, h: m.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES) * 1024.0),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", lambda m, h: float(m.nvmlDeviceGetPcieReplayCounter(h))),
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", lambda m, h: float(m.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC))),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", lambda m, h: float(m.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC))),
        ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", lambda m, h: float(m.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_AGGREGATE_ECC))),
        ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", lambda m, h: float(m.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC))),
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", lambda m, h: float(m.nvmlDeviceGetRemappedRows(h)[0])),
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", lambda m, h: float(m.nvmlDeviceGetRemappedRows(h)[1])),
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", lambda m, h: float(m.nvmlDeviceGetRemappedRows(h)[2])),
    ]  # fmt: skip


def _limit_and_codec_readers(n: Any) -> list[tuple[str, Reader]]:
    """The rest of dcgm-exporter's default list (its 4.8 CSV and the 4.8.4 opt-in power
    limits): encoder/decoder utilization, the driver's reserved framebuffer, the row-remap
    failure flag, the configured and the enforced power limit (mW → W)."""
    return [
        ("DCGM_FI_DEV_ENC_UTIL", lambda m, h: m.nvmlDeviceGetEncoderUtilization(h)[0]),  # [util %, period µs]
        ("DCGM_FI_DEV_DEC_UTIL", lambda m, h: m.nvmlDeviceGetDecoderUtilization(h)[0]),
        # nvmlDeviceGetMemoryInfo_v2: the v1 struct has no reserved part (bytes → MiB)
        ("DCGM_FI_DEV_FB_RESERVED", lambda m, h: m.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).reserved / 2**20),
        # (correctable rows, uncorrectable rows, pending, failure occurred)
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", lambda m, h: float(m.nvmlDeviceGetRemappedRows(h)[3])),
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT", lambda m, h: m.nvmlDeviceGetPowerManagementLimit(h) / 1000.0),
        ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", lambda m, h: m.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
    ]  # fmt: skip


def driver_version(nvml: Any) -> str:
    """The driver version (``nvmlSystemGetDriverVersion``), as dcgm-exporter's driver label
    shows it; "" when NVML does not say."""
    try:
        return _call_text(nvml.nvmlSystemGetDriverVersion)
    except nvml.NVMLError as exc:
        log.info("driver version unknown: %s", exc)
        return ""


# GPM metric (Hopper and newer) → DCGM profiling field; GPM reports percent, DCGM a ratio.
GPM_METRICS: tuple[tuple[str, str], ...] = (
    ("NVML_GPM_METRIC_GRAPHICS_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"),
    ("NVML_GPM_METRIC_SM_UTIL", "DCGM_FI_PROF_SM_ACTIVE"),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", "DCGM_FI_PROF_SM_OCCUPANCY"),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "DCGM_FI_PROF_DRAM_ACTIVE"),
    ("NVML_GPM_METRIC_FP64_UTIL", "DCGM_FI_PROF_PIPE_FP64_ACTIVE"),
    ("NVML_GPM_METRIC_FP32_UTIL", "DCGM_FI_PROF_PIPE_FP32_ACTIVE"),
    ("NVML_GPM_METRIC_FP16_UTIL", "DCGM_FI_PROF_PIPE_FP16_ACTIVE"),
)


# XIDs that take a GPU out of service until it is reset (NVIDIA's XID catalogue)
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 92, 94, 95, 119, 120, 136, 140})


@dataclass
class _Mig:
    """A MIG instance (one compute instance of one GPU instance) of a GPU in MIG mode."""

    gi: int
    ci: int
    profile: str  # NVIDIA's naming: <GPU slices>g.<memory GB>gb
    fraction: float  # compute slices / the GPU's slices
    handle: Any
    uuid: str
    gpm_prev: Any = None
    unsupported: set[str] = field(default_factory=set)


# what NVML can read from a MIG device handle (utilization, clocks, power... are the GPU's)
_MIG_FIELDS = ("DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE")


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    model: str
    instances: list[_Mig] = field(default_factory=list)
    minor: int | None = None  # its /dev/nvidiaN's N (None: NVML could not say)
    lost: bool = False
    gpm: bool = False
    gpm_prev: Any = None
    nvlink_prev: tuple[int, int, int] | None = None  # (timestamp µs, TX KiB, RX KiB), all links
    unsupported: set[str] = field(default_factory=set)
    retry: set[str] = field(default_factory=set)  # setup steps that failed for now ("gpm", "events")


@dataclass
class NvmlStats:
    unsupported: int = 0  # (GPU, field) pairs found unsupported, each logged once
    errors: int = 0  # other NVML errors, per value per tick
    lost: int = 0
    attribution_failures: int = 0  # refreshes that raised (the last mapping is kept)


class NvmlSource(Source):
    name = "nvml"

    def __init__(
        self,
        node: str,
        cluster: str,
        interval_s: float,
        nvml: Any = None,
        pool: str | NodePool = "",  # a NodePool: learnt at each collect (agent.pool)
        attribution: Attribution | None = None,
        boot_id: str | None = None,
        clock: Callable[[], float] = time.time,
        holder_of: HolderOf | None = None,  # pid -> holder (agent.procsplit.CgroupHolders)
    ) -> None:
        if nvml is None:
            import pynvml  # the agent's only NVML import; the ingest never imports it

            nvml = pynvml
        self.m = nvml
        self.node, self.cluster, self.pool, self.interval_s = node, cluster, pool, interval_s
        self.attribution = attribution
        self.clock = clock
        self.stats = NvmlStats()
        self.seq = Sequencer(node, boot_id or uuidlib.uuid4().hex[:12])
        self._readers = _reader_table(nvml) + _limit_and_codec_readers(nvml)
        self._init_split(holder_of)
        self._gpm_ids = [(getattr(nvml, a), f) for a, f in GPM_METRICS if hasattr(nvml, a)]
        nvml.nvmlInit()
        self.driver = driver_version(nvml)
        self.gpus: list[_Gpu] = []
        # GPUs NVML counts but could not open (index -> why): each is tried again every tick
        self.unopened: dict[int, Exception] = {}
        self._unopened_said: set[int] = set()  # whose gpu_lost event went out
        for i in range(nvml.nvmlDeviceGetCount()):
            g = self._open(i)
            if g is not None:
                self.gpus.append(g)
        if isinstance(attribution, LayoutAttribution):
            attribution.bind(self.layout())
        self._events_retry = False
        self._events = self._register_xid_events()

    def layout(self) -> list[Device]:
        """Every row this source sends (each GPU, then its MIG instances), for attributions
        that place the scheduler's device names on them."""
        out: list[Device] = []
        for g in self.gpus:
            out.append(Device(g.index, g.uuid, g.model, minor=g.minor))
            out += [Device(g.index, x.uuid, g.model, x.gi, x.ci, x.profile, g.minor) for x in g.instances]
        return out

    # ------------------------------------------------------------------ setup
    def _open(self, i: int) -> _Gpu | None:
        """GPU ``i`` with its handle, UUID, name, GPM support and MIG instances; None when NVML
        cannot open it (fallen off the bus, or any other error): that GPU is kept aside, counted
        and logged, tried again each tick, and never stops the others from being sampled."""
        m = self.m
        try:
            h = m.nvmlDeviceGetHandleByIndex(i)
            g = _Gpu(i, h, _call_text(m.nvmlDeviceGetUUID, h), _call_text(m.nvmlDeviceGetName, h))
        except m.NVMLError as exc:
            if i not in self.unopened:
                if isinstance(exc, m.NVMLError_GpuIsLost):
                    self.stats.lost += 1
                else:
                    self.stats.errors += 1
                log.error("GPU %d cannot be opened: %s; the other GPUs are sampled, this one is tried "
                          "again each tick", i, exc)  # fmt: skip
            self.unopened[i] = exc
            return None
        g.gpm = self._gpm_supported(g)
        g.instances = self._mig_instances(g)
        g.minor = self._minor(g)
        return g

    def _minor(self, g: _Gpu, again: bool = False) -> int | None:
        """The GPU's minor number (the N of ``/dev/nvidiaN``, how Slurm's gres.conf names it);
        None when NVML cannot say: counted as any setup step NVML refuses (a passing error is
        asked again each tick), and that GPU cannot be named by a gres.conf ``File=``."""
        try:
            n = int(self.m.nvmlDeviceGetMinorNumber(g.handle))
        except self.m.NVMLError as exc:
            what = f"GPU {g.index} ({g.uuid}): no minor number; a Slurm gres.conf File= cannot name it"
            self._step_refused(g, "minor", exc, what, again)
            return None
        g.retry.discard("minor")
        return n

    def _reopen(self, now: float, out: list[Message]) -> None:
        """Try the GPUs that could not be opened again; one that is lost is said once (a
        ``gpu_lost`` event of its index: it is out of capacity until it comes back)."""
        for i in sorted(self.unopened):
            why = self.unopened[i]
            g = self._open(i)
            if g is None:
                if isinstance(self.unopened[i], self.m.NVMLError_GpuIsLost) and i not in self._unopened_said:
                    self._unopened_said.add(i)
                    out.append(HealthEvent(**self._env(now), node=self.node, gpu=i, event="gpu_lost", code=79,
                                           fatal=True, message=f"NVML: {self.unopened[i]}"))  # fmt: skip
                continue
            del self.unopened[i]
            self._unopened_said.discard(i)
            log.warning("GPU %d (%s) opened after all (before: %s); sampled from now on", i, g.uuid, why)
            self.gpus = sorted([*self.gpus, g], key=lambda x: x.index)
            if isinstance(self.attribution, LayoutAttribution):
                self.attribution.bind(self.layout())
            if self._events is not None:
                self._register_events(g, self._events)

    def _unavailable(self, exc: Exception, what: str, again: bool = False) -> bool:
        """Count an optional capability NVML refused at setup: not supported (once: False), or an
        error (True: asked again at the next ticks, counted and logged the first time only)."""
        if isinstance(exc, (self.m.NVMLError_NotSupported, self.m.NVMLError_FunctionNotFound)):
            self.stats.unsupported += 1
            log.warning("%s: %s", what, exc)
            return False
        if not again:
            self.stats.errors += 1
            log.warning("%s: %s (asked again each tick)", what, exc)
        return True

    def _step_refused(self, g: _Gpu, step: str, exc: Exception, what: str, again: bool) -> None:
        """A setup step of ``g`` NVML refused (:meth:`_unavailable`): asked again at the next
        ticks where the error may pass, never again where it is not supported."""
        if self._unavailable(exc, what, again):
            g.retry.add(step)
        else:
            g.retry.discard(step)

    def _gpm_supported(self, g: _Gpu, again: bool = False) -> bool:
        if not self._gpm_ids or not hasattr(self.m, "nvmlGpmQueryDeviceSupport"):
            return False
        try:
            supported = bool(self.m.nvmlGpmQueryDeviceSupport(g.handle).isSupportedDevice)
        except self.m.NVMLError as exc:
            what = f"GPU {g.index}: no GPM profiling metrics for now; activity from utilization.gpu"
            self._step_refused(g, "gpm", exc, what, again)
            return False
        g.retry.discard("gpm")
        return supported

    def _setup_again(self, g: _Gpu) -> None:
        """Setup steps that NVML failed for a passing reason (UNKNOWN, TIMEOUT ...), asked again:
        a transient error at start never leaves a GPU without GPM or XID events until a restart."""
        if "gpm" in g.retry:
            g.gpm = self._gpm_supported(g, again=True)
            if g.gpm:
                log.info("GPU %d: GPM profiling metrics available after all", g.index)
        if "events" in g.retry and self._events is not None:
            self._register_events(g, self._events, again=True)
        if "minor" in g.retry:
            g.minor = self._minor(g, again=True)
            if g.minor is not None and isinstance(self.attribution, LayoutAttribution):
                self.attribution.bind(self.layout())  # its gres.conf files can name it now

    def _mig_instances(self, g: _Gpu) -> list[_Mig]:
        """The MIG instances of a GPU in MIG mode (read once at start: changing the MIG layout
        needs the GPU idle and the agent restarted, as for dcgm-exporter)."""
        m = self.m
        if not hasattr(m, "nvmlDeviceGetMigMode"):
            return []
        try:
            current, _pending = m.nvmlDeviceGetMigMode(g.handle)
        except (
            m.NVMLError_NotSupported,
            m.NVMLError_FunctionNotFound,
        ) as exc:  # not MIG-capable, older driver
            log.debug("GPU %d: no MIG mode: %s", g.index, exc)
            return []
        except m.NVMLError as exc:  # a GPU in MIG mode would be sampled as a whole one: say so, count it
            self.stats.errors += 1
            log.warning("GPU %d: MIG mode unknown (%s); sampled as a whole GPU", g.index, exc)
            return []
        if current != m.NVML_DEVICE_MIG_ENABLE:
            return []
        total = self._gpu_slices(g)
        out: list[_Mig] = []
        try:
            slots = int(m.nvmlDeviceGetMaxMigDeviceCount(g.handle))
        except m.NVMLError as exc:
            self.stats.errors += 1
            log.warning("GPU %d is in MIG mode but its MIG devices cannot be listed: %s", g.index, exc)
            return []
        for i in range(slots):
            try:
                mh = m.nvmlDeviceGetMigDeviceHandleByIndex(g.handle, i)
                attrs = m.nvmlDeviceGetAttributes(mh)
                gi, ci = m.nvmlDeviceGetGpuInstanceId(mh), m.nvmlDeviceGetComputeInstanceId(mh)
                uuid = _call_text(m.nvmlDeviceGetUUID, mh)
            except m.NVMLError_NotFound:
                continue  # no instance in this slot
            except m.NVMLError as exc:
                self.stats.errors += 1
                log.warning("GPU %d: MIG device %d unreadable: %s", g.index, i, exc)
                continue
            profile = self._profile_name(g, int(gi), attrs)
            frac = min(1.0, attrs.computeInstanceSliceCount / total)
            out.append(_Mig(int(gi), int(ci), profile, frac, mh, uuid))
        log.info(
            "GPU %d in MIG mode: %s",
            g.index,
            ", ".join(f"{x.gi}/{x.ci} {x.profile}" for x in out) or "no instances",
        )
        return out

    def _profile_name(self, g: _Gpu, gi: int, attrs: Any) -> str:
        """NVIDIA's own name of the instance's profile (``3g.40gb``) from the GPU-instance profile
        info; made up from slices and memory when the driver does not say."""
        m = self.m
        try:
            info = m.nvmlGpuInstanceGetInfo(m.nvmlDeviceGetGpuInstanceById(g.handle, gi))
            prof = m.nvmlDeviceGetGpuInstanceProfileInfo(g.handle, info.profileId)
            name = _call_text(getattr, prof, "name").strip()  # pynvml's struct decodes it, strictly
            if name:
                return name.removeprefix("MIG ").strip()
        except m.NVMLError as exc:
            log.debug("GPU %d: MIG %d profile name: %s", g.index, gi, exc)
        return f"{attrs.gpuInstanceSliceCount}g.{math.ceil(attrs.memorySizeMB / 1024)}gb"

    def _gpu_slices(self, g: _Gpu) -> int:
        """The GPU's slice count: that of the largest GPU-instance profile it supports (7 on
        A100/H100, 4 on A30)."""
        m = self.m
        best = 0
        for k in (1, 2, 3, 4, 6, 7, 8):
            prof = getattr(m, f"NVML_GPU_INSTANCE_PROFILE_{k}_SLICE", None)
            if prof is None:
                continue
            try:
                best = max(best, int(m.nvmlDeviceGetGpuInstanceProfileInfo(g.handle, prof).sliceCount))
            except m.NVMLError:
                continue
        return best or 7

    def _register_xid_events(self, again: bool = False) -> Any:
        try:
            es = self.m.nvmlEventSetCreate()
        except self.m.NVMLError as exc:
            self._events_retry = self._unavailable(exc, "XID events unavailable for now", again)
            return None
        self._events_retry = False
        for g in self.gpus:
            self._register_events(g, es)
        return es

    def _register_events(self, g: _Gpu, es: Any, again: bool = False) -> None:
        try:
            self.m.nvmlDeviceRegisterEvents(g.handle, self.m.nvmlEventTypeXidCriticalError, es)
        except self.m.NVMLError as exc:
            if self._unavailable(exc, f"GPU {g.index}: no XID events for now", again):
                g.retry.add("events")
                return
        g.retry.discard("events")

    # ------------------------------------------------------------------ sampling
    def _env(self, now: float) -> dict[str, Any]:
        return {
            "source": self.node,
            "boot_id": self.seq.boot_id,
            "seq": self.seq.next(),
            "cluster": self.cluster,
            "ts": now,
        }

    def _lost(self, g: _Gpu, now: float, why: str, out: list[Message]) -> None:
        if g.lost:
            return
        g.lost = True
        self.stats.lost += 1
        log.error("GPU %d (%s) is lost: %s; the other GPUs keep sampling", g.index, g.uuid, why)
        out.append(HealthEvent(**self._env(now), node=self.node, gpu=g.index, uuid=g.uuid, event="gpu_lost",
                               code=79, fatal=True, message=why))  # fmt: skip

    def _read(self, g: _Gpu, name: str, fn: Reader, mig: _Mig | None = None) -> float | None:
        where: Any = g if mig is None else mig
        if name in where.unsupported:
            return None
        try:
            v = float(fn(self.m, where.handle))
            f = BY_NAME[name]
            if not f.plausible(v):  # a driver glitch must not cost the whole batch its validity
                self.stats.errors += 1
                log.warning("GPU %d: %s=%r outside its plausible range [%g, %g]; dropped",
                            g.index, name, v, f.lo, f.hi)  # fmt: skip
                return None
            return v
        except (self.m.NVMLError_NotSupported, self.m.NVMLError_FunctionNotFound):  # an older driver
            where.unsupported.add(name)
            self.stats.unsupported += 1
            what = f"GPU {g.index}" if mig is None else f"GPU {g.index} MIG {mig.gi}/{mig.ci}"
            log.info("%s: %s not supported; not asked again", what, name)
        except self.m.NVMLError_GpuIsLost:
            raise
        except self.m.NVMLError as exc:
            self.stats.errors += 1
            log.debug("GPU %d: %s: %s", g.index, name, exc)
        return None

    def _gpm(self, g: _Gpu, fields: dict[str, float], mig: _Mig | None = None) -> None:
        """Profiling metrics between this tick's GPM sample and the last one; for a MIG
        instance, its own (``nvmlGpmMigSampleGet``). Every sample NVML allocates is freed, also
        when a call fails (NVML's memory: one leaked a tick is the agent's memory growing for
        ever); GPM that the device refuses (NOT_SUPPORTED) is counted once and not asked again,
        as is each metric it refuses; any other error is counted."""
        m = self.m
        holder: Any = g if mig is None else mig
        if "gpm" in holder.unsupported:
            return
        try:
            cur = m.nvmlGpmSampleAlloc()  # of no device: whatever it says, no GPU is lost by it
        except m.NVMLError as exc:
            self._gpm_failed(g, holder, exc)
            return
        try:
            if mig is None:
                m.nvmlGpmSampleGet(g.handle, cur)
            else:
                m.nvmlGpmMigSampleGet(g.handle, mig.gi, cur)
        except m.NVMLError as exc:
            self._gpm_free(g, cur)
            if isinstance(exc, m.NVMLError_GpuIsLost):
                raise
            self._gpm_failed(g, holder, exc)
            return
        prev, holder.gpm_prev = holder.gpm_prev, cur
        if prev is None:
            return
        req = m.c_nvmlGpmMetricsGet_t()
        req.version = m.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(self._gpm_ids)
        req.sample1, req.sample2 = prev, cur
        for i, (mid, _) in enumerate(self._gpm_ids):
            req.metrics[i].metricId = mid
        try:
            m.nvmlGpmMetricsGet(req)
        except m.NVMLError_GpuIsLost:
            raise
        except m.NVMLError as exc:
            self._gpm_failed(g, holder, exc)
            return
        finally:
            self._gpm_free(g, prev)
        for i, (_, name) in enumerate(self._gpm_ids):
            rc = req.metrics[i].nvmlReturn
            if rc == 0:
                fields[name] = max(0.0, min(1.0, req.metrics[i].value / 100.0))
            elif rc in (m.NVML_ERROR_NOT_SUPPORTED, m.NVML_ERROR_FUNCTION_NOT_FOUND):
                if name not in holder.unsupported:
                    holder.unsupported.add(name)
                    self.stats.unsupported += 1
                    log.info("GPU %d: GPM metric for %s not supported", g.index, name)
            else:
                self.stats.errors += 1
                log.debug("GPU %d: GPM metric for %s: NVML error %d", g.index, name, rc)

    def _gpm_failed(self, g: _Gpu, holder: Any, exc: Exception) -> None:
        if isinstance(exc, (self.m.NVMLError_NotSupported, self.m.NVMLError_FunctionNotFound)):
            holder.unsupported.add("gpm")
            self.stats.unsupported += 1
            log.info("GPU %d: GPM sampling not supported (%s); not asked again", g.index, exc)
            if holder.gpm_prev is not None:
                self._gpm_free(g, holder.gpm_prev)
                holder.gpm_prev = None
            return
        self.stats.errors += 1
        log.debug("GPU %d: GPM: %s", g.index, exc)

    def _gpm_free(self, g: _Gpu, sample: Any) -> None:
        try:
            self.m.nvmlGpmSampleFree(sample)
        except self.m.NVMLError as exc:
            self.stats.errors += 1
            log.debug("GPU %d: GPM sample free: %s", g.index, exc)

    def _nvlink(self, g: _Gpu, fields: dict[str, float]) -> None:
        """NVLink throughput: NVML's per-link data counters (KiB) summed over the links, as a
        rate between two ticks (the first tick gives none; a counter that went back, none)."""
        if "nvlink" in g.unsupported:
            return
        m = self.m
        links = range(int(getattr(m, "NVML_NVLINK_MAX_LINKS", 18)))
        ids = [(fid, link) for link in links for fid in (m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                                           m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)]  # fmt: skip
        try:
            values = m.nvmlDeviceGetFieldValues(g.handle, ids)
        except m.NVMLError_GpuIsLost:
            raise
        except m.NVMLError_NotSupported:
            values = []
        except m.NVMLError as exc:
            self.stats.errors += 1
            log.debug("GPU %d: NVLink counters: %s", g.index, exc)
            return
        tx = rx = ts = 0
        seen = False
        failed: set[int] = set()  # what NVML said of a value other than "not supported" (no such link)
        for v in values:
            if v.nvmlReturn != 0:
                if v.nvmlReturn not in (m.NVML_ERROR_NOT_SUPPORTED, m.NVML_ERROR_FUNCTION_NOT_FOUND):
                    failed.add(int(v.nvmlReturn))
                continue
            seen = True
            ts = max(ts, int(v.timestamp))
            if v.fieldId == m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
                tx += int(v.value.ullVal)
            else:
                rx += int(v.value.ullVal)
        if failed:
            # a link that failed this tick: a sum without it would make a rate of nothing now and of
            # its whole counter at the next tick; no reading this tick, counted (never "no NVLink")
            if m.NVML_ERROR_GPU_IS_LOST in failed:
                raise m.NVMLError(m.NVML_ERROR_GPU_IS_LOST)
            self.stats.errors += 1
            log.debug("GPU %d: NVLink counters: NVML errors %s", g.index, sorted(failed))
            return
        if not seen:
            g.unsupported.add("nvlink")
            self.stats.unsupported += 1
            log.info("GPU %d: no NVLink counters (no NVLink, or not supported); not asked again", g.index)
            return
        prev, g.nvlink_prev = g.nvlink_prev, (ts, tx, rx)
        if prev is None or ts <= prev[0] or tx < prev[1] or rx < prev[2]:
            return
        dt = (ts - prev[0]) / 1e6
        for name, rate in (
            ("DCGM_FI_PROF_NVLINK_TX_BYTES", (tx - prev[1]) * 1024.0 / dt),
            ("DCGM_FI_PROF_NVLINK_RX_BYTES", (rx - prev[2]) * 1024.0 / dt),
            # DCGM's DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL (dcgm-exporter's NVLINK_BANDWIDTH_TOTAL):
            # the same counters, TX + RX, KiB per second / 1000 (DcgmCacheManager.cpp)
            ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", (tx - prev[1] + rx - prev[2]) / dt / 1000.0),
        ):
            if BY_NAME[name].plausible(rate):
                fields[name] = rate

    def _xid_events(self, now: float, out: list[Message]) -> None:
        if self._events is None:
            return
        by_handle = {_addr(g.handle): g for g in self.gpus}
        for _ in range(1000):  # drain what is queued; never block the sampling loop
            try:
                ev = self.m.nvmlEventSetWait_v2(self._events, 0)
            except self.m.NVMLError_Timeout:
                return
            except self.m.NVMLError as exc:
                self.stats.errors += 1
                log.debug("XID event wait: %s", exc)
                return
            g = by_handle.get(_addr(ev.device))
            code = int(ev.eventData)
            if g is None or not 0 <= code <= UINT32_MAX:
                # never placed on another GPU (a fatal XID takes its GPU out of capacity), never a
                # value the wire refuses (that would cost the whole tick its samples)
                self.stats.errors += 1
                log.warning("XID event %d of a device that is not one of this source's GPUs, or out of "
                            "range; dropped", code)  # fmt: skip
                continue
            out.append(HealthEvent(**self._env(now), node=self.node, gpu=g.index, uuid=g.uuid, event="xid",
                                   code=code, fatal=code in FATAL_XIDS, message=f"XID {code}"))  # fmt: skip

    def _refresh_attribution(self) -> None:
        """The holders as of this tick, before any GPU is read; an attribution that raises
        keeps its last mapping (logged once, counted) and never costs the GPUs' samples."""
        if self.attribution is None:
            return
        try:
            self.attribution.refresh()
        except Exception:  # contained: the scheduler's trouble is not the GPUs'
            self.stats.attribution_failures += 1
            if self.stats.attribution_failures == 1:
                log.exception(
                    "attribution refresh failed; keeping the last mapping (further failures counted)"
                )

    # ------------------------------------------------------------------ shared GPUs
    def _init_split(self, holder_of: HolderOf | None) -> None:
        from gpuslo.agent.nvml_procs import NvmlProcesses

        self.holder_of = holder_of
        self.procs = NvmlProcesses(self.m)
        self.split_stats = SplitStats()
        self._misfits_said: set[str] = set()  # GPUs whose holders did not fit, said once each

    def _split(
        self, handle: Any, key: str, allocs: tuple[Allocation, ...], alive: bool = True
    ) -> tuple[Allocation, ...]:
        """A row's holders with their activity split by their processes (agent.procsplit);
        equal, flagged so, when the processes cannot be read or mapped."""
        view = None
        if len(allocs) > 1 and alive and self.holder_of is not None:
            view = self.procs.read(key, handle)
        st = self.split_stats
        misfits = st.oversubscribed, st.cut
        out = split(allocs, view, self.holder_of or (lambda _pid: None), st)
        if (st.oversubscribed, st.cut) != misfits and key not in self._misfits_said:
            self._misfits_said.add(key)  # once per GPU: the counters say how often
            log.warning(
                "GPU %s: the attribution names %d holders holding %g GPUs; sent as %d holding at most 1 "
                "(gpuslo_agent_rows_oversubscribed_total, gpuslo_agent_rows_holders_cut_total)",
                key, len(allocs), sum(a.share for a in allocs), len(out),
            )  # fmt: skip
        return out

    def collect(self, now: float) -> list[Message]:
        self._refresh_attribution()
        if self.holder_of is not None and hasattr(self.holder_of, "new_tick"):
            self.holder_of.new_tick()
        pool = pool_at(self.pool, now)  # learnt for this tick, whoever asked first
        out: list[Message] = []
        if self.unopened:
            self._reopen(now, out)
        if self._events is None and self._events_retry:
            self._events = self._register_xid_events(again=True)
        for g in self.gpus:
            if g.retry and not g.lost:
                self._setup_again(g)
        samples: list[GpuSample] = []
        for g in self.gpus:
            allocs = self.attribution(g.index, g.uuid) if self.attribution else ()
            if not g.lost:
                fields: dict[str, float] = {}
                try:
                    for name, fn in self._readers:
                        v = self._read(g, name, fn)
                        if v is not None:
                            fields[name] = v
                    self._nvlink(g, fields)
                    if g.gpm:
                        self._gpm(g, fields)
                except self.m.NVMLError_GpuIsLost as exc:
                    self._lost(g, now, f"NVML: {exc}", out)
                else:
                    rest = max(0.0, 1.0 - sum(x.fraction for x in g.instances)) if g.instances else 1.0
                    held = () if g.instances else self._split(g.handle, g.uuid, allocs)
                    samples.append(GpuSample(index=g.index, uuid=g.uuid, model=g.model, fields=fields,
                                             allocations=held, fraction=rest))  # fmt: skip
                    try:
                        samples += [self._mig_sample(g, x) for x in g.instances]
                    except self.m.NVMLError_GpuIsLost as exc:
                        self._lost(g, now, f"NVML: {exc}", out)
                        samples = [x for x in samples if x.index != g.index]
                    else:
                        continue
            rest = max(0.0, 1.0 - sum(x.fraction for x in g.instances)) if g.instances else 1.0
            held = () if g.instances else self._split(g.handle, g.uuid, allocs, alive=False)
            samples.append(GpuSample(index=g.index, uuid=g.uuid, model=g.model, healthy=False,
                                     allocations=held, fraction=rest))  # fmt: skip
            for x in g.instances:  # a lost GPU takes its instances with it
                samples.append(GpuSample(index=g.index, uuid=x.uuid, model=g.model, healthy=False, fraction=x.fraction,
                                         mig=MigInstance(gi=x.gi, ci=x.ci, profile=x.profile),
                                         allocations=self._holders(g, x, alive=False)))  # fmt: skip
        self._xid_events(now, out)
        batch = GpuSampleBatch(
            **self._env(now),
            node=self.node,
            pool=pool,
            interval_s=self.interval_s,
            gpus=tuple(samples),
        )
        return [batch, *out]

    def _holders(self, g: _Gpu, x: _Mig, alive: bool = True) -> tuple[Allocation, ...]:
        allocs = self.attribution(g.index, x.uuid) if self.attribution else ()
        return self._split(x.handle, x.uuid, allocs, alive)

    def _mig_sample(self, g: _Gpu, x: _Mig) -> GpuSample:
        fields: dict[str, float] = {}
        for name, fn in self._readers:
            if name in _MIG_FIELDS:
                v = self._read(g, name, fn, mig=x)
                if v is not None:
                    fields[name] = v
        if g.gpm:
            self._gpm(g, fields, mig=x)
        return GpuSample(index=g.index, uuid=x.uuid, model=g.model, fields=fields, fraction=x.fraction,
                         mig=MigInstance(gi=x.gi, ci=x.ci, profile=x.profile), allocations=self._holders(g, x))  # fmt: skip

    def close(self) -> None:
        try:
            if self._events is not None:
                self.m.nvmlEventSetFree(self._events)
            self.m.nvmlShutdown()
        except self.m.NVMLError as exc:
            log.debug("NVML shutdown: %s", exc)


def _addr(handle: Any) -> int:
    """A device handle's identity: the address it points to (two ctypes pointer objects
    to the same device compare unequal)."""
    import ctypes

    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def _text(v: Any) -> str:
    """An NVML string: bytes that are not UTF-8 (a driver's or a board's odd name) read with
    U+FFFD where they fail, not as an error that stopped the source from starting."""
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _call_text(fn: Any, *args: Any) -> str:
    """What an NVML string function returns, as :func:`_text` reads it. pynvml decodes these
    itself (its ``convertStrBytes``: ``nvmlDeviceGetName``, ``nvmlDeviceGetUUID``,
    ``nvmlSystemGetDriverVersion``; its structs' ``__getattribute__``: a profile's ``name``),
    strictly: bytes that are not UTF-8 raise UnicodeDecodeError from inside pynvml, before any
    decoding here; the error holds the bytes, read with U+FFFD."""
    try:
        return _text(fn(*args))
    except UnicodeDecodeError as exc:
        return bytes(exc.object).decode(errors="replace")

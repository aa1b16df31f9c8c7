"""The catalogue of GPU counter fields carried on the wire.

Names follow dcgm-exporter's ``DCGM_FI_*`` field names so that a user who knows DCGM
reads our data without a glossary. The catalogue is data: the wire validator, the
ClickHouse DDL, the agent's ``/metrics`` and the docs are all generated from it, and a
test checks both directions (everything emitted is catalogued, everything catalogued
has a column).

``lo``/``hi`` are the plausible range of a value; a sample outside it is rejected as
invalid input (negative power, 10^12 % utilisation), never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter"]


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    unit: str
    kind: Kind
    help: str
    lo: float
    hi: float

    def plausible(self, value: float) -> bool:
        """``value`` in ``[lo, hi]``: the one range check of the wire validator, the NVML
        source and the dcgm-exporter scrape (the ingest's vectorised decoder applies the same
        bounds to whole columns). NaN and ±inf fail: every bound is finite."""
        return self.lo <= value <= self.hi


_E15 = 1e15  # headroom for monotonically increasing counters

FIELDS: tuple[Field, ...] = (
    Field("DCGM_FI_DEV_GPU_UTIL", "%", "gauge", "GPU utilization (NVML utilization.gpu)", 0, 100),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", "%", "gauge", "Memory copy utilization", 0, 100),
    Field("DCGM_FI_DEV_ENC_UTIL", "%", "gauge", "Encoder utilization", 0, 100),
    Field("DCGM_FI_DEV_DEC_UTIL", "%", "gauge", "Decoder utilization", 0, 100),
    Field("DCGM_FI_DEV_FB_USED", "MiB", "gauge", "Framebuffer memory used", 0, 1e7),
    Field("DCGM_FI_DEV_FB_FREE", "MiB", "gauge", "Framebuffer memory free", 0, 1e7),
    Field("DCGM_FI_DEV_FB_TOTAL", "MiB", "gauge", "Framebuffer memory total", 0, 1e7),
    Field("DCGM_FI_DEV_FB_RESERVED", "MiB", "gauge", "Framebuffer memory reserved by the driver", 0, 1e7),
    Field("DCGM_FI_DEV_POWER_USAGE", "W", "gauge", "Power draw", 0, 5000),
    Field(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT", "W", "gauge", "Power management limit (the configured one)", 0, 5000
    ),
    Field(
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
        "W",
        "gauge",
        "Power limit the driver enforces (all limiters)",
        0,
        5000,
    ),
    Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "mJ", "counter", "Energy since driver load", 0, _E15),
    Field("DCGM_FI_DEV_GPU_TEMP", "C", "gauge", "GPU temperature", -50, 200),
    Field("DCGM_FI_DEV_MEMORY_TEMP", "C", "gauge", "Memory temperature", -50, 200),
    Field("DCGM_FI_DEV_SM_CLOCK", "MHz", "gauge", "SM clock", 0, 10000),
    Field("DCGM_FI_DEV_MEM_CLOCK", "MHz", "gauge", "Memory clock", 0, 20000),
    Field("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "bitmask", "gauge", "Clock throttle reasons", 0, 2**32),
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "1", "counter", "PCIe replay count", 0, _E15),
    Field("DCGM_FI_DEV_XID_ERRORS", "1", "gauge", "Last XID error code seen", 0, 1e4),
    Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "1", "counter", "Single-bit ECC errors, volatile", 0, _E15),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "1", "counter", "Double-bit ECC errors, volatile", 0, _E15),
    Field("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "1", "counter", "Single-bit ECC errors, aggregate", 0, _E15),
    Field("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "1", "counter", "Double-bit ECC errors, aggregate", 0, _E15),
    Field("DCGM_FI_DEV_ROW_REMAP_PENDING", "1", "gauge", "Row remapping pending", 0, 1),
    Field(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "1", "counter", "Rows remapped (uncorrectable)", 0, _E15
    ),
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "1", "counter", "Rows remapped (correctable)", 0, _E15),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "1", "gauge", "Row remapping failed (no spare rows left)", 0, 1),
    Field(
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "ratio", "gauge", "Graphics engine active (works under MIG)", 0, 1
    ),
    Field("DCGM_FI_PROF_SM_ACTIVE", "ratio", "gauge", "SM active", 0, 1),
    Field("DCGM_FI_PROF_SM_OCCUPANCY", "ratio", "gauge", "SM occupancy", 0, 1),
    Field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "ratio", "gauge", "Tensor pipe active", 0, 1),
    Field("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "ratio", "gauge", "FP64 pipe active", 0, 1),
    Field("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "ratio", "gauge", "FP32 pipe active", 0, 1),
    Field("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "ratio", "gauge", "FP16 pipe active", 0, 1),
    Field("DCGM_FI_PROF_DRAM_ACTIVE", "ratio", "gauge", "DRAM bandwidth utilization", 0, 1),
    Field("DCGM_FI_PROF_PCIE_TX_BYTES", "B/s", "gauge", "PCIe transmit throughput", 0, 1e12),
    Field("DCGM_FI_PROF_PCIE_RX_BYTES", "B/s", "gauge", "PCIe receive throughput", 0, 1e12),
    Field("DCGM_FI_PROF_NVLINK_TX_BYTES", "B/s", "gauge", "NVLink transmit throughput", 0, 1e13),
    Field("DCGM_FI_PROF_NVLINK_RX_BYTES", "B/s", "gauge", "NVLink receive throughput", 0, 1e13),
    # DCGM's own arithmetic: NVML's KiB counters of all links, per second, / 1000
    Field(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "MB/s", "gauge", "NVLink throughput, all links, TX + RX", 0, 1e7
    ),
)

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}

#: The activity signal of the metric definitions, in order of preference.
ACTIVITY_FIELD = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
UTIL_FIELD = "DCGM_FI_DEV_GPU_UTIL"


def activity(fields: dict[str, float]) -> float | None:
    """Activity in [0, 1]: GR_ENGINE_ACTIVE when present (works under MIG), else util/100."""
    v = fields.get(ACTIVITY_FIELD)
    if v is not None:
        return v
    u = fields.get(UTIL_FIELD)
    return None if u is None else u / 100.0

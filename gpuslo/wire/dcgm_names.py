"""The names dcgm-exporter gives the catalogue's fields, generation by generation (data).

The catalogue (:mod:`gpuslo.wire.fields`) keeps the classic names and units (dcgm-exporter up to
4.8.x, DCGM up to 4.6): they are the wire's and the store's column names. dcgm-exporter 4.9.0
(DCGM 4.7) renames the fields DCGM 4.7 deprecates to DCGM's naming standard and changes the unit
of some; 4.10.0 (DCGM 4.8) renames four profiling rates. Each row below says which name stands
for which catalogue field from which generation on, the factor between the two units, and the
source the name was read from. The scrape (``agent/scrape.py``) reads every name of every
generation; the agent's ``/metrics`` (``agent/exporter.py``) speaks the generation an operator
picks (``--dcgm-names``). Nothing here is guessed: a catalogue field whose new name no source
here gives keeps its classic name in every generation (listed in :data:`UNCONFIRMED`).

Sources (exact files and commits):

- ``DCGM-4.6.0``: github.com/NVIDIA/DCGM ``dcgmlib/dcgm_fields.h`` at 72fa3fe (DCGM 4.6.0), the
  block "Deprecated: renamed per DCGM Field Naming Standard": each classic name is a ``#define``
  alias of the new one, the same field id, so the same value and unit.
- ``go-dcgm-4.6.1``: github.com/NVIDIA/go-dcgm ``pkg/dcgm/dcgm_fields.h`` at b7fa315 (DCGM 4.6.1),
  "Base unit field IDs (1600-1799)": new field ids in base units replacing a legacy field "that
  uses a non-base unit" (``DCGM_FI_DEV_SM_CLOCK_HERTZ`` 1603 for ``DCGM_FI_DEV_SM_CLOCK`` 100...).
- ``exporter-4.9.0``: the dcgm-exporter 4.9.0 release notes (github.com/NVIDIA/dcgm-exporter
  releases): utilization "from a percentage to a 0 to 1 ratio", ``DCGM_FI_DEV_FB_CAPACITY_BYTES``
  collected by default, the driver label renamed to ``DCGM_FI_SYSTEM_DRIVER_VERSION``.
- ``exporter-4.10.0``: the dcgm-exporter 4.10.0 release notes: ``DCGM_FI_PROF_PCIE_TX_BYTES`` →
  ``DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND`` (and RX, NVLink TX/RX), units unchanged.
- ``exporter-4.8.3``: github.com/NVIDIA/dcgm-exporter d5e5f51 "Rename Hostname label to
  hostname (#655)", released in 4.6.0-4.8.3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuslo.wire.fields import BY_NAME

Generation = Literal["classic", "dcgm47", "dcgm48"]
#: What ``--dcgm-names`` accepts: ``classic`` is dcgm-exporter up to 4.8.2 (``Hostname``, classic
#: names and units); ``dcgm47`` is dcgm-exporter 4.9.x (DCGM 4.7 names and units, ``hostname``);
#: ``dcgm48`` is dcgm-exporter 4.10.x (DCGM 4.8: 4.9's, and the profiling byte rates renamed
#: ``…_BYTES_PER_SECOND``).
GENERATIONS: tuple[Generation, ...] = ("classic", "dcgm47", "dcgm48")
#: The current dcgm-exporter release's naming (the agent's ``/metrics`` default): 4.10.0.
DEFAULT_GENERATION: Generation = "dcgm48"

#: The node label: ``Hostname`` up to 4.8.2, ``hostname`` from 4.8.3 (source ``exporter-4.8.3``).
HOSTNAME_LABEL: dict[Generation, str] = {"classic": "Hostname", "dcgm47": "hostname", "dcgm48": "hostname"}
HOSTNAME_LABELS = ("Hostname", "hostname")
#: The driver-version label of the exporter's ``label`` row (sources ``DCGM-4.6.0``, ``exporter-4.9.0``).
DRIVER_LABEL: dict[Generation, str] = {
    "classic": "DCGM_FI_DRIVER_VERSION",
    "dcgm47": "DCGM_FI_SYSTEM_DRIVER_VERSION",
    "dcgm48": "DCGM_FI_SYSTEM_DRIVER_VERSION",
}
DRIVER_LABELS = ("DCGM_FI_DRIVER_VERSION", "DCGM_FI_SYSTEM_DRIVER_VERSION")


@dataclass(frozen=True, slots=True)
class Rename:
    """``name`` stands for the catalogue field ``field`` from exporter generation ``since`` on;
    ``name``'s value = the catalogue value × ``scale``."""

    field: str
    name: str
    scale: float
    since: Literal["dcgm47", "dcgm48"]
    source: str


_MIB = float(2**20)

# fmt: off
RENAMES: tuple[Rename, ...] = (
    # unit changed: new field ids in base units
    Rename("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_SM_CLOCK_HERTZ", 1e6, "dcgm47", "go-dcgm-4.6.1"),
    Rename("DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", 1e6, "dcgm47", "go-dcgm-4.6.1"),
    Rename("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", 1e-3, "dcgm47",
           "go-dcgm-4.6.1"),
    Rename("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO", 0.01, "dcgm47", "DCGM-4.6.0, exporter-4.9.0"),
    Rename("DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_FB_CAPACITY_BYTES", _MIB, "dcgm47", "exporter-4.9.0"),
    # renamed, same field id and unit
    Rename("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL", 1.0, "dcgm47",
           "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL", 1.0, "dcgm47",
           "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_FAILED", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_POWER_MGMT_LIMIT", "DCGM_FI_DEV_BOARD_POWER_LIMIT_REQUESTED_WATTS", 1.0, "dcgm47",
           "DCGM-4.6.0"),
    Rename("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_BOARD_POWER_LIMIT_ENFORCED_WATTS", 1.0, "dcgm47",
           "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_SM_OCCUPANCY_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "DCGM_FI_PROF_FP64_UTIL_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "DCGM_FI_PROF_FP32_UTIL_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    Rename("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "DCGM_FI_PROF_FP16_UTIL_RATIO", 1.0, "dcgm47", "DCGM-4.6.0"),
    # dcgm-exporter 4.10.0 (DCGM 4.8): the generation dcgm48 (4.9's names and these)
    Rename("DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND", 1.0, "dcgm48", "exporter-4.10.0"),
    Rename("DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND", 1.0, "dcgm48", "exporter-4.10.0"),
    Rename("DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_TX_BYTES_PER_SECOND", 1.0, "dcgm48",
           "exporter-4.10.0"),
    Rename("DCGM_FI_PROF_NVLINK_RX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND", 1.0, "dcgm48",
           "exporter-4.10.0"),
)
# fmt: on

#: Catalogue fields dcgm-exporter 4.9.0 renames (its release notes: framebuffer MiB → bytes,
#: memory-copy/encoder/decoder utilization % → ratio, NVLink MB/s → B/s) whose new name no
#: source read here gives (DCGM 4.7's header was not available): they keep their classic name
#: and unit in every generation, and a 4.9 exporter's new names for them are not read.
UNCONFIRMED: tuple[str, ...] = (
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL",
    "DCGM_FI_DEV_DEC_UTIL",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
)

#: Every name a dcgm-exporter may give a catalogue field → (catalogue name, factor to divide by).
READ: dict[str, tuple[str, float]] = {
    **{f: (f, 1.0) for f in BY_NAME},
    **{r.name: (r.field, r.scale) for r in RENAMES},
}

_ORDER: dict[Generation, int] = {g: i for i, g in enumerate(GENERATIONS)}
#: Each generation speaks the classic names, renamed by every rename of its own or an earlier one.
_SPOKEN: dict[Generation, dict[str, tuple[str, float]]] = {
    g: {f: (f, 1.0) for f in BY_NAME}
    | {r.field: (r.name, r.scale) for r in RENAMES if _ORDER[r.since] <= _ORDER[g]}
    for g in GENERATIONS
}


def _scaled(value: float, scale: float, up: bool) -> float:
    """``value`` × ``scale`` (``up``) or ÷ ``scale``, by an exact power (10^6, 100, 2^20): a
    ratio of 0.29 is 29 %, not 28.999999999999996 (15 significant digits: a float's noise is in
    the 17th, and a counter below the catalogue's 10^15 keeps every digit)."""
    if scale == 1.0:
        return value
    k = scale if scale >= 1.0 else round(1.0 / scale)
    mul = up == (scale >= 1.0)
    return float(f"{(value * k if mul else value / k):.15g}")


def spoken(field: str, generation: Generation) -> tuple[str, float]:
    """The name ``generation`` gives catalogue field ``field`` and the factor to its unit."""
    return _SPOKEN[generation][field]


def from_catalogue(field: str, value: float, generation: Generation) -> tuple[str, float]:
    """Catalogue field ``field`` = ``value`` as ``generation`` names it, in that generation's unit."""
    name, scale = _SPOKEN[generation][field]
    return name, _scaled(value, scale, up=True)


def to_catalogue(name: str, value: float) -> tuple[str, float] | None:
    """An exporter's series (any generation) as (catalogue name, value in the catalogue's
    unit); None for a name the catalogue does not hold."""
    hit = READ.get(name)
    if hit is None:
        return None
    field, scale = hit
    return field, _scaled(value, scale, up=False)

"""Every field of the catalogue (gpuslo/wire/fields.py) is given by the agent's sources, or is
listed here with the reason it is not.

The catalogue is the one list the wire, the Arrow decoders, the pack, the ClickHouse columns,
their upgrade and ``/metrics`` are derived from, so a field added there alone passes every one
of their tests: it has a column, it is exported when present, and it is never present. These
tests read what the sources give from the sources themselves (the NVML source on the fake
NVML, the simulator) and fail on a catalogue field nothing reads, or on a reader whose NVML
call the fake does not answer (the fake would hand the call to the real pynvml, which raises
``Uninitialized`` here and makes the value an error counted each tick).
"""

from __future__ import annotations

import re
from pathlib import Path

import pynvml

from gpuslo.agent.nvml import GPM_METRICS, NvmlSource
from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import SimNodeSource
from gpuslo.wire import FIELDS, GpuSampleBatch
from tests.fake_nvml import FakeGpu, FakeNvml

ROOT = Path(__file__).resolve().parents[1]
T = 1_790_000_000.0

#: Catalogue fields the NVML source does not give, and why (the dcgm-exporter scrape reads them).
NOT_FROM_NVML: dict[str, str] = {
    "DCGM_FI_DEV_MEMORY_TEMP": "NVML's temperature call has the GPU sensor only; DCGM reads HBM itself",
    "DCGM_FI_DEV_XID_ERRORS": "NVML gives XIDs as events: the source sends them as health events",
}
#: Catalogue fields the simulated fleet does not give, and why.
NOT_SIMULATED: dict[str, str] = {
    name: "not modelled: nothing the demo, the rules or the dashboards read depends on it"
    for name in (
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "DCGM_FI_DEV_ENC_UTIL",
        "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_POWER_MGMT_LIMIT",
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    )
}


def _fields(msgs: list[object]) -> set[str]:
    (b,) = [m for m in msgs if isinstance(m, GpuSampleBatch)]
    return {name for g in b.gpus for name in g.fields}


def test_the_lists_name_catalogue_fields() -> None:
    names = {f.name for f in FIELDS}
    assert set(NOT_FROM_NVML) <= names and set(NOT_SIMULATED) <= names


def test_the_nvml_source_on_the_fake_gives_every_catalogue_field() -> None:
    """A GPU with every capability (GPM, NVLink), two ticks (the rates need two): every field
    but those of :data:`NOT_FROM_NVML`, and no NVML error counted."""
    g = FakeGpu(
        "GPU-all",
        gpm_pct={getattr(pynvml, metric): 50.0 for metric, _ in GPM_METRICS},
        nvlink_links=2,
        nvlink_tx_kib=1000,
        nvlink_rx_kib=1000,
    )
    src = NvmlSource("n1", "c", 10.0, nvml=FakeNvml([g]), boot_id="b")
    src.collect(T)
    g.nvlink_tx_kib += 100
    g.nvlink_rx_kib += 100
    g.nvlink_ts_us += 10_000_000
    got = _fields(src.collect(T + 10))
    want = {f.name for f in FIELDS} - set(NOT_FROM_NVML)
    assert not want - got, f"catalogue fields the NVML source never reads: {sorted(want - got)}"
    assert not got & set(NOT_FROM_NVML), f"read after all: {sorted(got & set(NOT_FROM_NVML))}"
    assert src.stats.errors == 0 and src.stats.unsupported == 0


def test_the_simulator_gives_every_catalogue_field_but_those_it_does_not_model() -> None:
    fleet = Fleet(SimConfig(nodes=1, gpus_per_node=1, hours=1.0, start_ts=T))
    got = _fields(SimNodeSource(fleet, 0).collect(T))
    want = {f.name for f in FIELDS} - set(NOT_SIMULATED)
    assert got == want, (
        f"not simulated and not listed: {sorted(want - got)}; listed yet simulated: {sorted(got - want)}"
    )


def test_the_fake_answers_every_nvml_call_of_the_agent() -> None:
    """FakeNvml hands a name it lacks to pynvml (its constants and errors): an NVML *function*
    it lacks would run the real one. Every ``nvml…(`` the agent's NVML modules call, and every
    ``"nvml…"`` they look up by name (agent/nvml_procs.py), is the fake's own."""
    called: set[str] = set()
    for path in ("agent/nvml.py", "agent/nvml_procs.py"):
        text = (ROOT / path).read_text()
        called |= set(re.findall(r"\.(nvml[A-Z]\w*)\(", text)) | set(re.findall(r"\"(nvml[A-Z]\w*)\"", text))
    assert len(called) > 40  # the scan finds the calls
    missing = {name for name in called if name not in vars(FakeNvml)}
    assert not missing, f"NVML calls tests/fake_nvml.py does not answer: {sorted(missing)}"

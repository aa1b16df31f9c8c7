"""The NVML source on a fake NVML with pynvml's own structs and errors (no GPU here)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from gpuslo.agent.base import StaticAttribution
from gpuslo.agent.nvml import FATAL_XIDS, NvmlSource
from gpuslo.wire import BY_NAME, Allocation, GpuSampleBatch, HealthEvent, decode, encode
from tests.fake_nvml import FakeGpu, FakeMig, FakeNvml

T = 1_790_000_000.0


def source(*gpus: FakeGpu) -> tuple[NvmlSource, FakeNvml]:
    fake = FakeNvml(list(gpus))
    return NvmlSource("node-1", "prod", 10.0, nvml=fake, pool="gpu", boot_id="b"), fake


def batch(msgs: list[object]) -> GpuSampleBatch:
    (b,) = [m for m in msgs if isinstance(m, GpuSampleBatch)]
    return b


def test_fields_and_units() -> None:
    g = FakeGpu("GPU-a", util=63, mem_util=21, fb_total=80 * 2**30, fb_used=20 * 2**30, power_mw=412_500,
                energy_mj=5_000_000, temp_c=61, sm_clock=1755, mem_clock=2619, reasons=4, pcie_tx_kb=1024,
                pcie_rx_kb=512, replays=7, remapped=(2, 1, 1, 1), enc_util=5, dec_util=17, fb_reserved=600 * 2**20,
                power_limit_mw=650_000, enforced_limit_mw=500_500,
                ecc={(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 3})  # fmt: skip
    src, _ = source(g)
    f = batch(src.collect(T)).gpus[0].fields
    assert f == {
        "DCGM_FI_DEV_GPU_UTIL": 63.0,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 21.0,
        "DCGM_FI_DEV_FB_TOTAL": 81920.0,  # MiB
        "DCGM_FI_DEV_FB_USED": 20480.0,
        "DCGM_FI_DEV_FB_FREE": 61440.0,
        "DCGM_FI_DEV_POWER_USAGE": 412.5,  # mW → W
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 5_000_000.0,  # mJ, as DCGM
        "DCGM_FI_DEV_GPU_TEMP": 61.0,
        "DCGM_FI_DEV_SM_CLOCK": 1755.0,
        "DCGM_FI_DEV_MEM_CLOCK": 2619.0,
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 4.0,
        "DCGM_FI_PROF_PCIE_TX_BYTES": 1024.0 * 1024,  # KB/s → B/s
        "DCGM_FI_PROF_PCIE_RX_BYTES": 512.0 * 1024,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 7.0,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0.0,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 3.0,
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": 0.0,
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": 0.0,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 2.0,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 1.0,
        "DCGM_FI_DEV_ROW_REMAP_PENDING": 1.0,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": 1.0,  # the 4th of nvmlDeviceGetRemappedRows
        "DCGM_FI_DEV_ENC_UTIL": 5.0,  # %
        "DCGM_FI_DEV_DEC_UTIL": 17.0,
        "DCGM_FI_DEV_FB_RESERVED": 600.0,  # bytes of nvmlMemory_v2 → MiB
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": 650.0,  # mW → W
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": 500.5,
    }
    assert set(f) <= set(BY_NAME)
    assert src.driver == "580.95.05"  # nvmlSystemGetDriverVersion's bytes, decoded


@pytest.mark.parametrize(
    ("field", "fn"),
    [
        ("DCGM_FI_DEV_ENC_UTIL", "nvmlDeviceGetEncoderUtilization"),
        ("DCGM_FI_DEV_DEC_UTIL", "nvmlDeviceGetDecoderUtilization"),
        ("DCGM_FI_DEV_FB_RESERVED", "nvmlDeviceGetMemoryInfo_v2"),
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "nvmlDeviceGetPowerManagementLimit"),
        ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "nvmlDeviceGetEnforcedPowerLimit"),
    ],
)
def test_a_field_the_device_does_not_support_is_absent_and_not_asked_again(field: str, fn: str) -> None:
    src, fake = source(FakeGpu("GPU-n", unsupported={fn}))
    for k in range(3):
        f = batch(src.collect(T + 10 * k)).gpus[0].fields
        assert field not in f and "DCGM_FI_DEV_GPU_UTIL" in f  # the others are still read
    plain, _ = source(FakeGpu("GPU-n"))
    for k in range(3):  # what the same GPU counts anyway over as many ticks (no NVLink, GPM metrics)
        plain.collect(T + 10 * k)
    assert fake.gpus[0].calls[fn] == 1 and src.stats.errors == 0
    assert src.stats.unsupported == plain.stats.unsupported + 1


def test_a_driver_without_memory_info_v2_loses_the_reserved_part_only() -> None:
    """pynvml raises FUNCTION_NOT_FOUND for a symbol the driver lacks: the field is absent,
    asked once, counted as unsupported, never as an error per tick."""
    src, fake = source(FakeGpu("GPU-o", memory_v2=False))
    for k in range(3):
        f = batch(src.collect(T + 10 * k)).gpus[0].fields
        assert "DCGM_FI_DEV_FB_RESERVED" not in f and f["DCGM_FI_DEV_FB_USED"] == 10240.0
    assert fake.gpus[0].calls["nvmlDeviceGetMemoryInfo_v2"] == 1
    plain, _ = source(FakeGpu("GPU-o"))
    for k in range(3):
        plain.collect(T + 10 * k)
    assert (src.stats.unsupported, src.stats.errors) == (plain.stats.unsupported + 1, 0)


@pytest.mark.parametrize(("limit_mw", "kept"), [(0, True), (5_000_000, True), (5_000_001, False)])
def test_power_limits_are_bounded_by_the_catalogue(limit_mw: int, kept: bool) -> None:
    """0 W .. 5000 W (the catalogue's bounds for every power field); above: dropped, counted."""
    src, _ = source(FakeGpu("GPU-p", power_limit_mw=limit_mw))
    f = batch(src.collect(T)).gpus[0].fields
    assert ("DCGM_FI_DEV_POWER_MGMT_LIMIT" in f) is kept
    if kept:
        assert f["DCGM_FI_DEV_POWER_MGMT_LIMIT"] == limit_mw / 1000
    assert src.stats.errors == (0 if kept else 1)


def test_gpm_profiling_metrics_from_the_second_sample() -> None:
    g = FakeGpu("GPU-h", gpm_pct={pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 75.0, pynvml.NVML_GPM_METRIC_SM_UTIL: 60.0,
                                   pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 40.0, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 25.0})  # fmt: skip
    src, _ = source(g)
    first = batch(src.collect(T)).gpus[0].fields
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" not in first  # a rate needs two samples
    f = batch(src.collect(T + 10)).gpus[0].fields
    assert f["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == pytest.approx(0.75)
    assert f["DCGM_FI_PROF_SM_ACTIVE"] == pytest.approx(0.60)
    assert f["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] == pytest.approx(0.40)
    assert f["DCGM_FI_PROF_DRAM_ACTIVE"] == pytest.approx(0.25)
    assert "DCGM_FI_PROF_PIPE_FP64_ACTIVE" not in f  # the device said NOT_SUPPORTED for it


def test_nvlink_throughput_from_counter_deltas(caplog: pytest.LogCaptureFixture) -> None:
    """Per-link KiB counters summed over the links, as a rate between two ticks; a GPU
    without NVLink is noted once and not asked again."""
    linked = FakeGpu("GPU-a", nvlink_links=4, nvlink_tx_kib=1000, nvlink_rx_kib=500, nvlink_ts_us=5_000_000)
    plain = FakeGpu("GPU-b")
    src, _ = source(linked, plain)
    with caplog.at_level(logging.INFO, logger="gpuslo.agent.nvml"):
        first = batch(src.collect(T))
    assert "DCGM_FI_PROF_NVLINK_TX_BYTES" not in first.gpus[0].fields  # a rate needs two readings
    linked.nvlink_tx_kib += 2500  # per link: 4 links x 2500 KiB in 10 s
    linked.nvlink_rx_kib += 250
    linked.nvlink_ts_us += 10_000_000
    f = batch(src.collect(T + 10)).gpus[0].fields
    assert f["DCGM_FI_PROF_NVLINK_TX_BYTES"] == 4 * 2500 * 1024 / 10
    assert f["DCGM_FI_PROF_NVLINK_RX_BYTES"] == 4 * 250 * 1024 / 10
    # DCGM's total: (10000 + 1000) KiB in 10 s = 1100 KiB/s, / 1000 as DcgmCacheManager divides
    assert f["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] == pytest.approx(1.1)
    linked.nvlink_tx_kib = 0  # counters reset (driver reload): no rate this tick, none negative
    linked.nvlink_ts_us += 10_000_000
    assert "DCGM_FI_PROF_NVLINK_TX_BYTES" not in batch(src.collect(T + 20)).gpus[0].fields
    assert "DCGM_FI_PROF_NVLINK_TX_BYTES" not in batch(src.collect(T + 30)).gpus[1].fields
    assert plain.calls["nvmlDeviceGetFieldValues"] == 1
    assert caplog.text.count("no NVLink counters") == 1


def test_unsupported_field_is_skipped_once_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # no GPM: its metrics (this fake GPU gives none) would count too
    g = FakeGpu("GPU-u", unsupported={"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetRemappedRows"},
                nvlink_links=2, gpm=False)  # fmt: skip
    src, _ = source(g)
    with caplog.at_level(logging.INFO, logger="gpuslo.agent.nvml"):
        for k in range(5):
            f = batch(src.collect(T + 10 * k)).gpus[0].fields
            assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" not in f and "DCGM_FI_DEV_GPU_UTIL" in f
    assert src.stats.unsupported == 5  # energy + the four remapped-row fields, each once
    assert g.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1  # never asked again
    assert caplog.text.count("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION not supported") == 1


def test_lost_gpu_becomes_a_health_event_and_the_others_keep_sampling() -> None:
    a, b = FakeGpu("GPU-a"), FakeGpu("GPU-b")
    src, _ = source(a, b)
    src.collect(T)
    b.lost = True
    out = src.collect(T + 10)
    events = [m for m in out if isinstance(m, HealthEvent)]
    assert [(e.event, e.gpu, e.uuid, e.fatal) for e in events] == [("gpu_lost", 1, "GPU-b", True)]
    gpus = batch(out).gpus
    assert [g.healthy for g in gpus] == [True, False]
    assert gpus[0].fields["DCGM_FI_DEV_GPU_UTIL"] == 50.0
    out = src.collect(T + 20)  # reported once, not every tick
    assert not [m for m in out if isinstance(m, HealthEvent)]
    assert [g.healthy for g in batch(out).gpus] == [True, False]


def test_xid_events_non_blocking_with_fatal_flag() -> None:
    src, fake = source(FakeGpu("GPU-a"), FakeGpu("GPU-b"))
    assert not [m for m in src.collect(T) if isinstance(m, HealthEvent)]  # nothing queued: no wait
    fake.xids += [(1, 79), (0, 13)]
    ev = [m for m in src.collect(T + 10) if isinstance(m, HealthEvent)]
    assert [(e.gpu, e.uuid, e.code, e.fatal) for e in ev] == [(1, "GPU-b", 79, True), (0, "GPU-a", 13, False)]
    assert 79 in FATAL_XIDS and 13 not in FATAL_XIDS


def test_implausible_reading_is_dropped_not_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    src, _ = source(FakeGpu("GPU-t", temp_c=4000))
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.nvml"):
        b = batch(src.collect(T))
    assert "DCGM_FI_DEV_GPU_TEMP" not in b.gpus[0].fields
    assert "outside its plausible range" in caplog.text
    assert decode(encode(b)) == b


def test_attribution_and_wire_round_trip() -> None:
    from gpuslo.wire import Allocation

    fake = FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")])
    src = NvmlSource("node-1", "prod", 10.0, nvml=fake,
                     attribution=StaticAttribution(lambda i, u: (Allocation(scheduler="slurm", id="42", share=1.0),) if i == 1 else ()))  # fmt: skip
    b = batch(src.collect(T))
    assert [tuple(a.id for a in g.allocations) for g in b.gpus] == [(), ("42",)]
    assert decode(encode(b)) == b


def test_cli_without_a_driver_says_why(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("gpuslo")
    r = subprocess.run([str(exe), "agent", "--source", "nvml", "--once", "--print"], capture_output=True, text=True,
                       timeout=60, check=False)  # fmt: skip
    if r.returncode == 0:
        pytest.skip("this machine has an NVIDIA driver")
    assert r.returncode == 2
    assert "cannot start NVML" in r.stderr and "NVIDIA driver" in r.stderr


def test_mig_instances_are_series_of_their_own() -> None:
    """An H100 in MIG mode with a 3g.40gb and a 2g.20gb instance (2 of 7 slices left unused),
    beside a GPU that cannot do MIG. Each instance is a row with its GPU-instance id, profile,
    fraction of the GPU, its memory, its own GPM activity and the pod holding its MIG UUID; the
    GPU's own row keeps the device-level fields and stands for the unused 2/7."""
    gi1 = FakeMig("MIG-aaaa", gi=1, gi_slices=3, ci_slices=3, memory_mb=40 * 1024, fb_used_mb=8 * 1024,
                  gpm_pct={pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 40.0}, profile_name="MIG 3g.40gb")  # fmt: skip
    # the driver gives no profile name here: made up from slices and memory (19.7 GiB → 20gb)
    gi2 = FakeMig("MIG-bbbb", gi=2, gi_slices=2, ci_slices=2, memory_mb=20 * 1024 - 300)
    mig_gpu = FakeGpu("GPU-m", mig=[gi1, gi2], power_mw=300_000)
    plain = FakeGpu("GPU-p")
    pods = {"MIG-aaaa": (Allocation(scheduler="k8s", id="pod-1", name="ml/infer", queue="ml"),)}
    fake = FakeNvml([mig_gpu, plain])
    src = NvmlSource("node-1", "prod", 10.0, nvml=fake, boot_id="b",
                     attribution=StaticAttribution(lambda index, uuid: pods.get(uuid, ())))  # fmt: skip
    src.collect(T)
    b = batch(src.collect(T + 10))
    rows = {(g.index, g.mig.gi if g.mig else None): g for g in b.gpus}
    assert set(rows) == {(0, None), (0, 1), (0, 2), (1, None)}
    parent, a, c = rows[(0, None)], rows[(0, 1)], rows[(0, 2)]
    assert parent.fraction == pytest.approx(2 / 7) and parent.fields["DCGM_FI_DEV_POWER_USAGE"] == 300.0
    assert parent.allocations == ()
    assert (a.uuid, a.mig.profile, a.fraction) == ("MIG-aaaa", "3g.40gb", pytest.approx(3 / 7))  # type: ignore[union-attr]
    assert a.fields["DCGM_FI_DEV_FB_TOTAL"] == 40 * 1024 and a.fields["DCGM_FI_DEV_FB_USED"] == 8 * 1024
    assert c.fields["DCGM_FI_DEV_FB_TOTAL"] == 20 * 1024 - 300
    assert a.fields["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == pytest.approx(0.4)  # activity under MIG
    assert "DCGM_FI_DEV_GPU_UTIL" not in a.fields  # a MIG device has no utilization.gpu
    sole = tuple(x.model_copy(update={"share_source": "sole"}) for x in pods["MIG-aaaa"])
    assert a.allocations == sole and c.allocations == ()  # one holder: nothing to split
    assert (c.mig.profile, c.fraction) == ("2g.20gb", pytest.approx(2 / 7))  # type: ignore[union-attr]
    assert rows[(1, None)].fraction == 1.0 and rows[(1, None)].mig is None
    assert sum(g.fraction for g in b.gpus if g.index == 0) == pytest.approx(1.0)
    assert decode(encode(b)) == b
    # the GPU falls off the bus: it and its instances are unhealthy, the other GPU samples on
    mig_gpu.lost = True
    lost = batch(src.collect(T + 20))
    assert [(g.index, g.healthy) for g in lost.gpus] == [(0, False), (0, False), (0, False), (1, True)]
    assert sum(g.fraction for g in lost.gpus if g.index == 0) == pytest.approx(1.0)

"""dcgm-exporter's two naming generations: the table (gpuslo/wire/dcgm_names.py), the scrape of
recorded output of both, unit conversions at their edges, the agent's /metrics in either
generation and the round trip through our own scrape; the store upgrade for new fields."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuslo.agent.exporter import AgentCollector, registry_with
from gpuslo.agent.nvml import NvmlSource
from gpuslo.agent.scrape import DcgmExporterSource
from gpuslo.wire import BY_NAME, FIELDS, GpuSampleBatch, decode, encode
from gpuslo.wire.dcgm_names import (
    DEFAULT_GENERATION,
    GENERATIONS,
    READ,
    RENAMES,
    UNCONFIRMED,
    from_catalogue,
    spoken,
    to_catalogue,
)
from tests.fake_nvml import FakeGpu, FakeNvml

T = 1_790_000_000.0
DATA = Path(__file__).parent / "data" / "dcgm-exporter"
UUID0, UUID1 = "GPU-7e3a3f0d-6a21-4d52-9a4e-0b1d9c1f2a10", "GPU-c4b2e9a1-3f5e-4c6d-8e7f-1a2b3c4d5e6f"


def scrape(text: str, **kw: object) -> tuple[GpuSampleBatch, DcgmExporterSource]:
    src = DcgmExporterSource(
        "http://exporter/metrics", "prod", 15.0, fetch=lambda url, t: text, boot_id="b", **kw
    )  # type: ignore[arg-type]
    (b,) = src.collect(T)
    assert isinstance(b, GpuSampleBatch)
    return b, src


# ---------------------------------------------------------------- the table
def test_every_rename_names_a_catalogue_field_once_and_no_name_stands_for_two() -> None:
    assert all(r.field in BY_NAME for r in RENAMES)
    assert not {r.name for r in RENAMES} & set(BY_NAME)  # a new name is never a classic one
    names = [r.name for r in RENAMES]
    assert len(names) == len(set(names))
    per_gen = [(r.field, r.since) for r in RENAMES]
    assert len(per_gen) == len(set(per_gen))  # one name per field and generation
    assert set(UNCONFIRMED) <= set(BY_NAME) and not set(UNCONFIRMED) & {r.field for r in RENAMES}
    for r in RENAMES:  # the factor is an exact power (ints, 10^k, 2^20): conversions stay exact
        k = r.scale if r.scale >= 1 else 1 / r.scale
        assert k == round(k) and r.source


def test_the_driver_and_hostname_labels_of_each_generation() -> None:
    from gpuslo.wire.dcgm_names import DRIVER_LABEL, HOSTNAME_LABEL

    assert HOSTNAME_LABEL == {"classic": "Hostname", "dcgm47": "hostname", "dcgm48": "hostname"}
    assert DRIVER_LABEL == {"classic": "DCGM_FI_DRIVER_VERSION", "dcgm47": "DCGM_FI_SYSTEM_DRIVER_VERSION",
                            "dcgm48": "DCGM_FI_SYSTEM_DRIVER_VERSION"}  # fmt: skip


# fmt: off
CONVERSIONS = [
    ("DCGM_FI_DEV_GPU_UTIL_RATIO", 1.0, "DCGM_FI_DEV_GPU_UTIL", 100.0),  # a ratio of 1 is 100 %
    ("DCGM_FI_DEV_GPU_UTIL_RATIO", 0.0, "DCGM_FI_DEV_GPU_UTIL", 0.0),
    ("DCGM_FI_DEV_GPU_UTIL_RATIO", 0.29, "DCGM_FI_DEV_GPU_UTIL", 29.0),  # not 28.999999999999996
    ("DCGM_FI_DEV_GPU_UTIL_RATIO", 0.000001, "DCGM_FI_DEV_GPU_UTIL", 0.0001),  # %f's last digit
    ("DCGM_FI_DEV_FB_CAPACITY_BYTES", 85_520_809_984, "DCGM_FI_DEV_FB_TOTAL", 81_559.0),  # bytes → MiB
    ("DCGM_FI_DEV_FB_CAPACITY_BYTES", 1, "DCGM_FI_DEV_FB_TOTAL", 1 / 2**20),
    ("DCGM_FI_DEV_SM_CLOCK_HERTZ", 1_980_000_000, "DCGM_FI_DEV_SM_CLOCK", 1980.0),  # Hz → MHz
    ("DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", 1, "DCGM_FI_DEV_MEM_CLOCK", 1e-6),
    ("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", 123_456, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 123_456_000.0),
    # a counter near the catalogue's 10^15 mJ keeps every digit through J → mJ
    ("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", 999_999_999_999, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
     999_999_999_999_000.0),
    ("DCGM_FI_DEV_BOARD_POWER_WATTS", 612.5, "DCGM_FI_DEV_POWER_USAGE", 612.5),
    ("DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND", 4096, "DCGM_FI_PROF_PCIE_TX_BYTES", 4096.0),  # 4.10.0
    ("DCGM_FI_DEV_GPU_UTIL", 87, "DCGM_FI_DEV_GPU_UTIL", 87.0),  # a classic name: as it is
]
# fmt: on


@pytest.mark.parametrize(("name", "value", "field", "expected"), CONVERSIONS)
def test_units_convert_back_to_the_catalogue(name: str, value: float, field: str, expected: float) -> None:
    assert to_catalogue(name, value) == (field, expected)


def test_unknown_names_are_not_the_catalogues() -> None:
    assert to_catalogue("DCGM_FI_DEV_FAN_SPEED_RATIO", 0.5) is None
    assert to_catalogue("dcgm_fi_dev_gpu_util_ratio", 0.5) is None  # names are case-sensitive


@pytest.mark.parametrize("generation", GENERATIONS)
def test_every_catalogue_value_survives_the_round_trip_through_either_generation(generation: str) -> None:
    """from_catalogue then to_catalogue is the identity over each field's range (its bounds, a
    third, and values with many digits): no unit conversion loses or invents a digit."""
    for f in FIELDS:
        for v in {f.lo, f.hi, f.lo + (f.hi - f.lo) / 3, round(f.lo + (f.hi - f.lo) * 0.123456, 6)}:
            name, spoken_v = from_catalogue(f.name, v, generation)  # type: ignore[arg-type]
            assert name == spoken(f.name, generation)[0]  # type: ignore[arg-type]
            back = to_catalogue(name, spoken_v)
            assert back is not None and back[0] == f.name
            assert math.isclose(back[1], v, rel_tol=1e-14, abs_tol=0), (f.name, v, spoken_v, back)


# ---------------------------------------------------------------- recorded output of both generations
# On paper, from what was fed to the exporter (tests/data/dcgm-exporter/README.md): GPU 0 held by
# Slurm job 777, GPU 1 free; the same readings in both recordings, in each generation's units.
GPU0 = {
    "DCGM_FI_DEV_SM_CLOCK": 1980.0, "DCGM_FI_DEV_MEM_CLOCK": 2619.0, "DCGM_FI_DEV_MEMORY_TEMP": 48.0,
    "DCGM_FI_DEV_GPU_TEMP": 61.0, "DCGM_FI_DEV_POWER_USAGE": 612.5,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 123_456_000.0, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 3.0,
    "DCGM_FI_DEV_GPU_UTIL": 87.0, "DCGM_FI_DEV_MEM_COPY_UTIL": 41.0, "DCGM_FI_DEV_ENC_UTIL": 0.0,
    "DCGM_FI_DEV_DEC_UTIL": 12.0, "DCGM_FI_DEV_XID_ERRORS": 0.0, "DCGM_FI_DEV_FB_FREE": 16498.0,
    "DCGM_FI_DEV_FB_USED": 64512.0, "DCGM_FI_DEV_FB_RESERVED": 549.0, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 20480.0,
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0.0, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 2.0,
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0.0, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.91,
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.42, "DCGM_FI_PROF_DRAM_ACTIVE": 0.37,
    "DCGM_FI_PROF_PCIE_TX_BYTES": 1_048_576_000.0, "DCGM_FI_PROF_PCIE_RX_BYTES": 524_288_000.0,
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": 700.0, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": 700.0,
}  # fmt: skip
GPU1 = {
    "DCGM_FI_DEV_SM_CLOCK": 345.0, "DCGM_FI_DEV_MEM_CLOCK": 2619.0, "DCGM_FI_DEV_MEMORY_TEMP": 28.0,
    "DCGM_FI_DEV_GPU_TEMP": 30.0, "DCGM_FI_DEV_POWER_USAGE": 71.25,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 9_876_543_000.0, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0.0,
    "DCGM_FI_DEV_GPU_UTIL": 0.0, "DCGM_FI_DEV_MEM_COPY_UTIL": 0.0, "DCGM_FI_DEV_ENC_UTIL": 0.0,
    "DCGM_FI_DEV_DEC_UTIL": 0.0, "DCGM_FI_DEV_XID_ERRORS": 79.0, "DCGM_FI_DEV_FB_FREE": 81010.0,
    "DCGM_FI_DEV_FB_USED": 0.0, "DCGM_FI_DEV_FB_RESERVED": 549.0, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 0.0,
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0.0, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 0.0,
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": 1.0, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0,
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.0, "DCGM_FI_PROF_DRAM_ACTIVE": 0.01,
    "DCGM_FI_PROF_PCIE_TX_BYTES": 0.0, "DCGM_FI_PROF_PCIE_RX_BYTES": 4096.0,
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": 700.0, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": 350.0,
}  # fmt: skip
FB_TOTAL = {"DCGM_FI_DEV_FB_TOTAL": 81559.0}  # only 4.9 collects the total by default (bytes)


@pytest.mark.parametrize(
    ("fixture", "extra", "hostname_label", "driver_label"),
    [
        ("4.8.3-whole-gpus.txt", {}, "hostname", "DCGM_FI_DRIVER_VERSION"),
        ("dcgm47-names-whole-gpus.txt", FB_TOTAL, "hostname", "DCGM_FI_SYSTEM_DRIVER_VERSION"),
    ],
)
def test_both_generations_give_the_same_catalogue_values(
    fixture: str, extra: dict[str, float], hostname_label: str, driver_label: str
) -> None:
    text = (DATA / fixture).read_text()
    assert (
        f'{hostname_label}="n1"' in text and f'{driver_label}="580.95.05"' in text
    )  # what the recording says
    b, src = scrape(text)
    assert b.node == "n1" and src.driver == "580.95.05"
    g0, g1 = b.gpus
    assert (g0.uuid, g1.uuid, g0.model) == (UUID0, UUID1, "NVIDIA H100 80GB HBM3")
    assert g0.fields == GPU0 | extra
    assert g1.fields == GPU1 | extra
    assert [(a.scheduler, a.id) for a in g0.allocations] == [("slurm", "777")] and g1.allocations == ()
    assert src.stats.ignored == {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"} and src.stats.dropped == 0
    assert decode(encode(b)) == b


def test_the_3_6_1_recording_still_reads_as_it_did() -> None:
    b, src = scrape((DATA / "3.6.1-whole-gpus.txt").read_text())
    assert b.node == "n1" and b.gpus[0].fields["DCGM_FI_DEV_GPU_UTIL"] == 87.0 and src.stats.dropped == 1


def test_a_percent_under_a_ratio_name_is_refused_not_stored_a_hundredfold() -> None:
    """DCGM 4.6 already calls field 203 ``DCGM_FI_DEV_GPU_UTIL_RATIO`` while it still holds a
    percent: 87 under that name would be 8700 %, outside the catalogue's 0..100, so it is
    dropped and counted, never stored (only 0 and 1 % would pass, as 0 and 100 %)."""
    text = (DATA / "dcgm47-names-whole-gpus.txt").read_text()
    line = next(x for x in text.splitlines() if x.startswith('DCGM_FI_DEV_GPU_UTIL_RATIO{gpu="0"'))
    assert line.endswith(" 0.87")
    text = text.replace(line, line.removesuffix("0.87") + "87")
    b, src = scrape(text)
    assert "DCGM_FI_DEV_GPU_UTIL" not in b.gpus[0].fields and src.stats.dropped == 1
    assert b.gpus[1].fields["DCGM_FI_DEV_GPU_UTIL"] == 0.0


def test_a_name_of_neither_generation_is_ignored_and_counted_once() -> None:
    text = (DATA / "4.8.3-whole-gpus.txt").read_text()
    text += f'DCGM_FI_DEV_FAN_SPEED_RATIO{{gpu="0",UUID="{UUID0}",hostname="n1"}} 0.4\n'
    _, src = scrape(text)
    src.collect(T + 15)
    assert src.stats.ignored == {"DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_FAN_SPEED_RATIO"}


# ---------------------------------------------------------------- the agent's /metrics, both ways
def _nvml_metrics(names: str) -> tuple[dict[str, object], GpuSampleBatch]:
    fake = FakeNvml([FakeGpu("GPU-a", util=29, energy_mj=5_000_000, sm_clock=1755, fb_total=80 * 2**30)])
    src = NvmlSource("node-7", "prod", 10, nvml=fake)
    msgs = src.collect(T)
    col = AgentCollector(names=names, driver=lambda: src.driver)  # type: ignore[arg-type]
    col.observe(msgs)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry_with(col)).decode())}
    return fams, next(m for m in msgs if isinstance(m, GpuSampleBatch))


def test_metrics_speak_dcgm47_and_classic_on_request() -> None:
    new, _ = _nvml_metrics("dcgm47")
    old, _ = _nvml_metrics("classic")
    (u,) = new["DCGM_FI_DEV_GPU_UTIL_RATIO"].samples  # type: ignore[attr-defined]
    assert u.value == 0.29 and u.labels["hostname"] == "node-7" and "Hostname" not in u.labels
    assert u.labels["DCGM_FI_SYSTEM_DRIVER_VERSION"] == "580.95.05"
    assert new["DCGM_FI_DEV_SM_CLOCK_HERTZ"].samples[0].value == 1_755_000_000  # type: ignore[attr-defined]
    assert new["DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL"].samples[0].value == 5000  # type: ignore[attr-defined]
    assert new["DCGM_FI_DEV_FB_CAPACITY_BYTES"].samples[0].value == 80 * 2**30  # type: ignore[attr-defined]
    assert "(Hz)" in new["DCGM_FI_DEV_SM_CLOCK_HERTZ"].documentation  # type: ignore[attr-defined]
    renamed = {r.field for r in RENAMES if r.since == "dcgm47"}
    assert not renamed & set(new)  # no classic name of a renamed field is left
    (u,) = old["DCGM_FI_DEV_GPU_UTIL"].samples  # type: ignore[attr-defined]
    assert u.value == 29 and u.labels["Hostname"] == "node-7" and "hostname" not in u.labels
    assert u.labels["DCGM_FI_DRIVER_VERSION"] == "580.95.05"
    assert old["DCGM_FI_DEV_SM_CLOCK"].samples[0].value == 1755  # type: ignore[attr-defined]
    assert {n for n in old if n.startswith("DCGM_FI_")} <= set(BY_NAME)
    age = old["gpuslo_agent_last_sample_age_seconds"].samples[0]  # type: ignore[attr-defined]
    assert set(age.labels) == {"Hostname"}
    assert set(new["gpuslo_agent_last_sample_age_seconds"].samples[0].labels) == {"hostname"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("names", GENERATIONS)
def test_our_metrics_in_either_generation_scrape_back_to_the_same_values(names: str) -> None:
    """The agent's /metrics read by the dcgm-exporter scrape source: the catalogue values the
    NVML source sampled, whichever generation was spoken."""
    fake = FakeNvml([FakeGpu("GPU-a", util=29, energy_mj=5_000_001, nvlink_links=2, nvlink_tx_kib=10),
                     FakeGpu("GPU-b", util=100, remapped=(0, 0, 0, 1))])  # fmt: skip
    src = NvmlSource("node-7", "prod", 10, nvml=fake)
    src.collect(T)
    fake.gpus[0].nvlink_tx_kib += 5000
    fake.gpus[0].nvlink_ts_us += 10_000_000
    msgs = src.collect(T + 10)
    sampled = next(m for m in msgs if isinstance(m, GpuSampleBatch))
    col = AgentCollector(names=names, driver=lambda: src.driver)  # type: ignore[arg-type]
    col.observe(msgs)
    text = generate_latest(registry_with(col)).decode()
    b, back = scrape(text)
    assert b.node == "node-7" and back.driver == "580.95.05"
    for g, s in zip(b.gpus, sampled.gpus, strict=True):
        assert g.uuid == s.uuid
        assert g.fields.keys() == s.fields.keys()
        for k, v in s.fields.items():
            assert math.isclose(g.fields[k], v, rel_tol=1e-14), (names, k, g.fields[k], v)
    assert back.stats.ignored == set() and back.stats.dropped == 0
    assert sampled.gpus[0].fields["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] == pytest.approx(2 * 5000 / 10 / 1000)


def test_an_unknown_generation_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed classic, dcgm47, dcgm48"):
        AgentCollector(names="dcgm99")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["bogus", "", "DCGM47", "classic;rm"])
def test_cli_refuses_a_bad_dcgm_names_with_exit_2(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuslo.app.cli import main

    with pytest.raises(SystemExit) as ei:
        main(["agent", "--source", "sim", f"--dcgm-names={bad}"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--dcgm-names" in err and "classic" in err and "dcgm47" in err


def test_every_name_read_has_its_field_in_the_store() -> None:
    from gpuslo.ingest.schema import column_types

    cols = column_types("gpu_samples")
    assert {field for field, _ in READ.values()} <= set(cols)


NEW_FIELDS = (
    "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_POWER_MGMT_LIMIT", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
)  # fmt: skip


@pytest.mark.integration  # chDB: over a second
def test_a_store_made_before_the_new_fields_gets_their_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    """A ``gpu_samples`` table without the seven new columns (as made by the previous release):
    the ingest adds them (NULL in the old rows) and the new fields land."""

    from gpuslo.app.cli import EXIT_OK, main
    from gpuslo.ingest import schema
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules.tables import SCHEMA

    old = "\n".join(x for x in SCHEMA.render().splitlines() if not any(f"    {n} " in x for n in NEW_FIELDS))
    s = ChdbStore(tmp_path / "s")
    try:
        for stmt in schema.statements(old):
            s.execute(stmt)
        s.execute("INSERT INTO gpu_samples (cluster, node, gpu, uuid, ts, interval_s, DCGM_FI_DEV_GPU_UTIL) "
                  "VALUES ('prod', 'n0', 0, 'GPU-old', 1790000000, 15, 40)")  # fmt: skip
        cols = {r["name"] for r in s.query("SELECT name FROM system.columns WHERE table = 'gpu_samples'")}
        assert not cols & set(NEW_FIELDS)
    finally:
        s.close()
    fake = FakeNvml([FakeGpu("GPU-new", enc_util=7, power_limit_mw=650_000, remapped=(0, 0, 0, 1))])
    batch = next(
        m for m in NvmlSource("n1", "prod", 15, nvml=fake).collect(T) if isinstance(m, GpuSampleBatch)
    )
    import sys

    stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(encode(batch) + b"\n"))
    try:
        assert main(["ingest", "--file", "-", "--store", str(tmp_path / "s")]) == EXIT_OK
    finally:
        sys.stdin = stdin
    s = ChdbStore(tmp_path / "s")
    try:
        rows = s.query("SELECT uuid, DCGM_FI_DEV_GPU_UTIL AS u, DCGM_FI_DEV_ENC_UTIL AS e, "
                       "DCGM_FI_DEV_POWER_MGMT_LIMIT AS p, DCGM_FI_DEV_ROW_REMAP_FAILURE AS f, "
                       "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL AS n FROM gpu_samples ORDER BY uuid")  # fmt: skip
        assert [(r["uuid"], r["u"], r["e"], r["p"], r["f"], r["n"]) for r in rows] == [
            ("GPU-new", 50.0, 7.0, 650.0, 1.0, None),  # no NVLink on that GPU: no value, not 0
            ("GPU-old", 40.0, None, None, None, None),
        ]
    finally:
        s.close()


def test_the_docs_catalogue_table_is_the_catalogue_both_ways() -> None:
    """docs/metrics.md lists every field with its unit, kind, range and current name (dcgm-exporter
    4.10, the default generation), and
    nothing else (a field added to the catalogue and not documented fails here)."""
    import re

    doc = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `(DCGM_FI_\w+)` \| (\S+) \| (\w+) \| (\S+) \.\. (\S+) \| (.+) \|$", doc, re.M)
    assert [r[0] for r in rows] == [f.name for f in FIELDS]
    for (name, unit, kind, lo, hi, new), f in zip(rows, FIELDS, strict=True):
        assert (unit, kind, float(lo), float(hi)) == (f.unit, f.kind, f.lo, f.hi), name
        n = spoken(name, DEFAULT_GENERATION)[0]
        assert new == (
            f"`{n}`" if n != name else "same (4.7 name not confirmed)" if name in UNCONFIRMED else "same"
        )


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-0.5", "1.000001", "1e308"])
def test_a_renamed_series_out_of_range_after_conversion_is_dropped_and_counted(value: str) -> None:
    """Under a DCGM 4.7 name the range is checked after the conversion (a ratio above 1 is
    above 100 %); NaN and infinities never pass."""
    text = f'DCGM_FI_DEV_GPU_UTIL_RATIO{{gpu="0",UUID="{UUID0}",hostname="n1"}} {value}\n'
    text += f'DCGM_FI_DEV_BOARD_POWER_WATTS{{gpu="0",UUID="{UUID0}",hostname="n1"}} 300\n'
    b, src = scrape(text)
    assert b.gpus[0].fields == {"DCGM_FI_DEV_POWER_USAGE": 300.0} and src.stats.dropped == 1


def test_a_hostile_driver_label_is_bounded_and_escaped_on_our_metrics() -> None:
    evil = 'x"\\\n' + "v" * 5000
    esc = evil.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    text = f'DCGM_FI_DEV_GPU_TEMP{{gpu="0",UUID="{UUID0}",Hostname="n1",DCGM_FI_DRIVER_VERSION="{esc}"}} 40\n'
    b, src = scrape(text)
    assert src.driver == evil[:256] and b.gpus[0].fields == {"DCGM_FI_DEV_GPU_TEMP": 40.0}
    col = AgentCollector(driver=lambda: src.driver)
    col.observe([b])
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry_with(col)).decode())}
    (s,) = fams["DCGM_FI_DEV_GPU_TEMP_CELSIUS"].samples
    assert s.labels["DCGM_FI_SYSTEM_DRIVER_VERSION"] == evil[:256] and s.value == 40


def test_a_flood_of_unknown_names_is_counted_with_a_bounded_memory() -> None:
    from gpuslo.agent.scrape import IGNORED_NAMES_MAX

    text = "".join(f'DCGM_FI_X_{k}{{gpu="0",UUID="{UUID0}",hostname="n1"}} 1\n' for k in range(1000))
    text += f'DCGM_FI_DEV_GPU_TEMP{{gpu="0",UUID="{UUID0}",hostname="n1"}} 40\n'
    b, src = scrape(text)
    src.collect(T + 15)
    assert len(src.stats.ignored) == IGNORED_NAMES_MAX and src.stats.ignored_series == 2000
    assert b.gpus[0].fields == {"DCGM_FI_DEV_GPU_TEMP": 40.0}


def test_the_scrape_counts_reach_the_agents_metrics() -> None:
    from gpuslo.agent.assemble import NodeOptions, node_agent

    agent = node_agent(NodeOptions(source="dcgm", node="n1", cluster="prod", interval_s=15))
    src = agent.gpu
    assert isinstance(src, DcgmExporterSource) and agent.extra is not None
    src.fetch = lambda url, t: (
        (DATA / "4.8.3-whole-gpus.txt").read_text() + 'DCGM_FI_DEV_GPU_TEMP{gpu="0"} 999\n'
    )
    src.collect(T)
    assert agent.extra() == {"gpuslo_agent_scrape_failures": 0, "gpuslo_agent_scrape_ignored_series": 2,
                             "gpuslo_agent_scrape_dropped_values": 1, "gpuslo_agent_scrape_refused_series": 0}  # fmt: skip


def test_serve_metrics_refuses_an_unknown_generation_before_listening() -> None:
    from gpuslo.agent.assemble import WallClockAgent
    from gpuslo.agent.sinks import JsonLinesSink

    agent = WallClockAgent([], JsonLinesSink(io.BytesIO()), 10.0)
    with pytest.raises(ValueError, match="--dcgm-names 'dcgm49': allowed classic, dcgm47, dcgm48"):
        agent.serve_metrics(0, "127.0.0.1", names="dcgm49")  # type: ignore[arg-type]


def test_the_unit_changes_add_up_to_the_release_notes_eleven() -> None:
    """dcgm-exporter 4.9.0's notes: eleven renamed fields change unit (clocks, energy,
    utilization, GPU memory, NVLink). The table's unit-changing renames of fields the 4.8 default
    list collects, with the fields whose new name is unconfirmed, are exactly eleven."""
    # the active rows of the 4.6.0-4.8.3 default-counters.csv (7ad5832), less the driver label row and
    # DCGM_FI_DEV_VGPU_LICENSE_STATUS (not in the catalogue)
    default_48 = {
        "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
    }  # fmt: skip
    assert default_48 <= set(BY_NAME)  # every default field is in the catalogue
    changed = {r.field for r in RENAMES if r.since == "dcgm47" and r.scale != 1.0 and r.field in default_48}
    assert changed == {"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                       "DCGM_FI_DEV_GPU_UTIL"}  # fmt: skip
    assert len(changed | set(UNCONFIRMED)) == 11 and set(UNCONFIRMED) <= default_48


def test_the_default_is_the_current_release_dcgm48_and_each_generation_adds_to_the_one_before() -> None:
    """dcgm-exporter 4.10.0 (the current release) = 4.9.0's names and units, and the four profiling
    byte rates renamed ``…_BYTES_PER_SECOND`` (its release notes: units unchanged)."""
    assert DEFAULT_GENERATION == "dcgm48" and GENERATIONS == ("classic", "dcgm47", "dcgm48")
    assert AgentCollector().names == "dcgm48"
    rates = {f"DCGM_FI_PROF_{bus}_{way}_BYTES": f"DCGM_FI_PROF_{bus}_{way}_BYTES_PER_SECOND"
             for bus in ("PCIE", "NVLINK") for way in ("TX", "RX")}  # fmt: skip
    for field in BY_NAME:
        classic, in47, in48 = (spoken(field, g) for g in GENERATIONS)
        assert classic == (field, 1.0)
        if field in rates:
            assert in47 == (field, 1.0) and in48 == (rates[field], 1.0)
        else:
            assert in48 == in47
    assert {spoken(f, "dcgm48")[0] for f in BY_NAME} >= set(rates.values())


def test_a_field_under_both_its_names_is_the_newer_names_whatever_the_order() -> None:
    """A 4.9/4.10 exporter with a custom counters file can give a field under its classic and its
    DCGM 4.7 name in one scrape: one value (never two, never summed), the newer name's, in
    either order. GPU_UTIL 50 % (classic) beside GPU_UTIL_RATIO 0.7 (new): 70 %."""
    lab = f'gpu="0",UUID="{UUID0}",hostname="n1"'
    old, new = f"DCGM_FI_DEV_GPU_UTIL{{{lab}}} 50\n", f"DCGM_FI_DEV_GPU_UTIL_RATIO{{{lab}}} 0.7\n"
    for text in (old + new, new + old):
        b, _ = scrape(text)
        assert b.gpus[0].fields == {"DCGM_FI_DEV_GPU_UTIL": 70.0}


def test_labels_the_wire_refuses_cost_their_gpu_row_not_the_scrape() -> None:
    """A `gpu` label that is not a GPU index ('-1', ' 1', '1_0' which int() read as 10, '١'
    which it read as 1, '²', '01' which was GPU 1 again, past the wire's 1023) and a UUID, model or pod name over its 256
    characters: the row is refused and counted; the other GPU of the scrape is still sent.
    Raising, the whole scrape was lost every tick."""
    good = 'DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-ok",hostname="n1"} 40\n'
    for bad in ['gpu="-1",UUID="GPU-x"', 'gpu=" 1",UUID="GPU-x"', 'gpu="1_0",UUID="GPU-x"',
                'gpu="\u0661",UUID="GPU-x"', 'gpu="\u00b2",UUID="GPU-x"', 'gpu="01",UUID="GPU-x"',
                'gpu="1024",UUID="GPU-x"', 'gpu="99999",UUID="GPU-x"', 'gpu="2",UUID="' + "U" * 257 + '"',
                'gpu="2",UUID="GPU-x",modelName="' + "m" * 257 + '"',
                'gpu="2",UUID="GPU-x",namespace="n",pod="' + "p" * 300 + '"',
                'gpu="2",UUID="GPU-x",hpc_job="' + "1" * 300 + '"']:  # fmt: skip
        b, src = scrape(f"DCGM_FI_DEV_GPU_TEMP{{{bad}}} 50\n" + good)
        assert [(g.index, g.uuid, g.fields) for g in b.gpus] == [
            (1, "GPU-ok", {"DCGM_FI_DEV_GPU_TEMP": 40.0})
        ], bad
        assert src.stats.refused == 1, bad

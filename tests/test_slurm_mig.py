"""Slurm jobs holding MIG gres, attributed to their instance rows: Slurm's IDX order and
dcgm-exporter's ``GPU.GI`` mapping files (unit), and on a real slurmctld/slurmd whose
gres.conf declares MIG devices (integration)."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from annotated_types import Le

from gpuslo.agent.base import Device
from gpuslo.agent.nvml import NvmlSource
from gpuslo.agent.slurm import MAX_IDX, SlurmAttribution, SlurmCli, parse_idx
from gpuslo.agent.slurm_gres import MAX_GI, MAX_GPU_INDEX, idx_order, parse_mapping_name, parse_node_gres
from gpuslo.wire import GpuSample, GpuSampleBatch, MigInstance
from tests.fake_nvml import FakeGpu, FakeMig, FakeNvml
from tests.servers.slurm import SlurmCluster, available, bitmap

H100 = "NVIDIA H100 80GB HBM3"


def _gpus() -> list[FakeGpu]:
    """GPU 0 whole; GPU 1 in MIG mode with GI 1 (3g.40gb), 5 (2g.20gb), 13 (1g.10gb); GPU 2
    whole; GPU 3 in MIG mode with GI 7 and 8 (1g.10gb)."""

    def mig(uuid: str, gi: int, slices: int) -> FakeMig:
        return FakeMig(uuid, gi=gi, gi_slices=slices, ci_slices=slices, memory_mb=slices * 10 * 1024,
                       profile_name=f"MIG {slices}g.{slices * 10 if slices != 3 else 40}gb")  # fmt: skip

    return [
        FakeGpu("GPU-0", name=H100),
        FakeGpu("GPU-1", name=H100, mig=[mig("MIG-1-1", 1, 3), mig("MIG-1-5", 5, 2), mig("MIG-1-13", 13, 1)]),
        FakeGpu("GPU-2", name=H100),
        FakeGpu("GPU-3", name=H100, mig=[mig("MIG-3-7", 7, 1), mig("MIG-3-8", 8, 1)]),
    ]


# the same layout as the GPU source binds it (on paper: each GPU, then its instances; the fake
# gives each GPU its index as its minor number)
LAYOUT = [
    Device(0, "GPU-0", H100, minor=0),
    Device(1, "GPU-1", H100, minor=1),
    Device(1, "MIG-1-1", H100, 1, 0, "3g.40gb", 1),
    Device(1, "MIG-1-5", H100, 5, 0, "2g.20gb", 1),
    Device(1, "MIG-1-13", H100, 13, 0, "1g.10gb", 1),
    Device(2, "GPU-2", H100, minor=2),
    Device(3, "GPU-3", H100, minor=3),
    Device(3, "MIG-3-7", H100, 7, 0, "1g.10gb", 3),
    Device(3, "MIG-3-8", H100, 8, 0, "1g.10gb", 3),
]


def test_the_gpu_source_binds_every_row_it_sends() -> None:
    attr = SlurmAttribution("n", cli=SlurmCli(run=lambda argv: "{}"))
    NvmlSource("n", "c", 10, nvml=FakeNvml(_gpus()), attribution=attr)
    assert attr._devices == LAYOUT


def _uuids(order: Sequence[Device | None] | None) -> list[str | None] | None:
    return None if order is None else [d.uuid if d else None for d in order]


@pytest.mark.parametrize(("gres", "expected"), [
    # types in the node's Gres= order, each type's devices in device order (GPU, then GI)
    ("gpu:h100:2,gpu:3g.40gb:1,gpu:2g.20gb:1,gpu:1g.10gb:3",
     ["GPU-0", "GPU-2", "MIG-1-1", "MIG-1-5", "MIG-1-13", "MIG-3-7", "MIG-3-8"]),
    # the order measured on the real slurmctld for this Gres= (see test_mig_jobs_on_real_slurm)
    ("gpu:1g.10gb:3,gpu:h100:2,gpu:2g.20gb:1,gpu:3g.40gb:1",
     ["MIG-1-13", "MIG-3-7", "MIG-3-8", "GPU-0", "GPU-2", "MIG-1-5", "MIG-1-1"]),
    # socket suffixes and other gres are no GPU entries
    ("gpu:1g.10gb:3(S:0-1),mps:100,gpu:h100:2(S:0),gpu:2g.20gb:1,gpu:3g.40gb:1(S:1)",
     ["MIG-1-13", "MIG-3-7", "MIG-3-8", "GPU-0", "GPU-2", "MIG-1-5", "MIG-1-1"]),
    # untyped, as many records as MIG devices and whole GPUs: Slurm's device order
    ("gpu:7", ["GPU-0", "MIG-1-1", "MIG-1-5", "MIG-1-13", "GPU-2", "MIG-3-7", "MIG-3-8"]),
    # a model type matches the MIG devices too (a substring of theirs): Slurm's longest-first
    # matching gives each MIG device its profile type, the whole GPUs what is left
    ("gpu:h100:2,gpu:hbm3_1g.10gb:3,gpu:3g.40gb:1,gpu:2g.20gb:1",
     ["GPU-0", "GPU-2", "MIG-1-13", "MIG-3-7", "MIG-3-8", "MIG-1-1", "MIG-1-5"]),
    # Slurm counts more 1g.10gb than NVML shows: that IDX holds no row
    ("gpu:1g.10gb:4,gpu:3g.40gb:1,gpu:2g.20gb:1,gpu:h100:2",
     ["MIG-1-13", "MIG-3-7", "MIG-3-8", None, "MIG-1-1", "MIG-1-5", "GPU-0", "GPU-2"]),
    # whole GPUs only (untyped, one per physical GPU): IDX is the GPU index, as without MIG
    ("gpu:4", None),
    ("", None),
])  # fmt: skip
def test_idx_order(gres: str, expected: list[str | None] | None) -> None:
    assert _uuids(idx_order(LAYOUT, parse_node_gres(gres))) == expected


def test_idx_order_model_prefixed_types_as_slurm_documents_them() -> None:
    """Slurm's own example: an A100 whole and one in MIG mode as 3g.20gb instances, typed
    ``a100`` and ``a100_3g.20gb`` (the MIG type string is ``nvidia_a100_3g.20gb``)."""
    a100 = "NVIDIA A100-SXM4-40GB"
    layout = [Device(0, "GPU-0", a100), Device(1, "GPU-1", a100), Device(1, "MIG-b", a100, 2, 0, "3g.20gb"),
              Device(1, "MIG-a", a100, 1, 0, "3g.20gb")]  # fmt: skip
    assert _uuids(idx_order(layout, parse_node_gres("gpu:a100:1,gpu:a100_3g.20gb:2"))) == [
        "GPU-0",
        "MIG-a",
        "MIG-b",
    ]
    assert _uuids(idx_order(layout, parse_node_gres("gpu:a100_3g.20gb:2,gpu:a100:1"))) == [
        "MIG-a",
        "MIG-b",
        "GPU-0",
    ]


def test_idx_order_without_mig_is_the_gpu_index() -> None:
    whole = [d for d in LAYOUT if d.gi is None]
    assert idx_order(whole, parse_node_gres("gpu:h100:4")) is None


@pytest.mark.parametrize("count", [str(MAX_IDX), str(MAX_IDX + 1), str(MAX_IDX + 2), "999999999999", "9" * 5000,
                                   "0" * 40 + "3"])  # fmt: skip
def test_a_node_gres_count_past_any_idx_holds_no_position_past_them(count: str) -> None:
    """``sinfo`` text is outside input: a count no node has (a typo, a hostile or broken
    slurm.conf) must neither build a list of that many positions nor raise, and the positions
    an IDX can name stay where Slurm puts them."""
    gres = f"gpu:1g.10gb:3,gpu:h100:{count},gpu:2g.20gb:1"
    parsed = parse_node_gres(gres)
    assert [t for t, _ in parsed] == ["1g.10gb", "h100", "2g.20gb"]
    assert all(0 <= n <= MAX_IDX + 1 for _, n in parsed)
    order = idx_order(LAYOUT, parsed)
    assert order is not None and len(order) <= MAX_IDX + 1
    n = min(int(count), MAX_IDX + 1) if len(count) < 4300 else MAX_IDX + 1
    honest = _uuids(idx_order(LAYOUT, [("1g.10gb", 3), ("h100", n), ("2g.20gb", 1)]))
    assert honest is not None
    assert _uuids(order) == honest[: MAX_IDX + 1]
    assert _uuids(order)[:3] == ["MIG-1-13", "MIG-3-7", "MIG-3-8"]
    if n + 3 > MAX_IDX:  # the 2g.20gb entry lies past every IDX: no job can name it
        assert "MIG-1-5" not in _uuids(order)
    else:
        assert _uuids(order)[n + 3] == "MIG-1-5"


def test_parse_node_gres() -> None:
    assert parse_node_gres("gpu:h100:2(S:0,1),gpu:1g.10gb:3,mps:100,shard:gpu:4") == [
        ("h100", 2),
        ("1g.10gb", 3),
    ]
    assert parse_node_gres("gpu:4(S:0)") == [("", 4)]
    assert parse_node_gres("(null)") == []


def _wire_le(model: type, field: str) -> int:
    return next(m.le for m in model.model_fields[field].metadata if isinstance(m, Le))  # type: ignore[attr-defined]


def test_mapping_name_bounds_are_the_wires() -> None:
    assert (_wire_le(GpuSample, "index"), _wire_le(MigInstance, "gi")) == (MAX_GPU_INDEX, MAX_GI)


@pytest.mark.parametrize(("name", "expected"), [
    ("0", (0, None)), ("7", (7, None)), ("3.10", (3, 10)), ("0.0", (0, 0)),
    (str(MAX_GPU_INDEX), (MAX_GPU_INDEX, None)), (f"{MAX_GPU_INDEX}.{MAX_GI}", (MAX_GPU_INDEX, MAX_GI)),
])  # fmt: skip
def test_mapping_names(name: str, expected: tuple[int, int | None]) -> None:
    assert parse_mapping_name(name) == expected


HOSTILE_NAMES = ["0.x", "-1.2", "1.2.3", "0.", ".5", "1e5", "+3", "NaN", "0 ", " 0", "0\n", "", ".gitkeep",
                 "\u00b2", "\u0661", "\u0661.1", f"{MAX_GPU_INDEX + 1}", f"0.{MAX_GI + 1}", "9" * 30,
                 "0." + "9" * 200, "0/1", "0.1\x00", "'; DROP", "0\\1"]  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_mapping_names_are_refused_with_a_reason(name: str) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        parse_mapping_name(name)


def test_parse_idx_refuses_what_it_cannot_hold(caplog: pytest.LogCaptureFixture) -> None:
    assert parse_idx("gpu:1g.10gb:2(IDX:4-5)") == [4, 5]
    assert parse_idx("gpu:1g.10gb:1(IDX:6),gpu:2g.20gb:1(IDX:3)") == [6, 3]  # a job of two types
    assert parse_idx(f"gpu:1(IDX:{MAX_IDX})") == [MAX_IDX]
    with caplog.at_level(logging.WARNING):
        assert parse_idx("gpu:2(IDX:0-99999999999)") == []
        assert parse_idx(f"gpu:2(IDX:1,{MAX_IDX + 1},3-2,2)") == [1, 2]
        assert parse_idx("gpu:2(IDX:-,--1,0-)") == []
    assert "out of range" in caplog.text and "unreadable" in caplog.text


def _rows(attr: SlurmAttribution, gpus: list[FakeGpu] | None = None) -> dict[str, tuple[str, ...]]:
    """Each row the NVML source sends (by its UUID) → the job ids it carries."""
    src = NvmlSource("vm", "c", 10, nvml=FakeNvml(gpus or _gpus()), attribution=attr)
    (b, *_) = src.collect(time.time())
    assert isinstance(b, GpuSampleBatch)
    return {g.uuid: tuple(a.id for a in g.allocations) for g in b.gpus}


def _mapping(tmp_path: Path, files: dict[str, str]) -> Path:
    d = tmp_path / "jobs"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_mapping_files_gpu_gi_attribute_the_instance_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = _mapping(tmp_path, {"0": "100\n", "1.5": "101\n", "3.7": "102\n103\n", "2": "104",
                            "1": "105\n",  # GPU 1 is in MIG mode: its instances are named 1.<GI>
                            "1.2": "106", "2.0": "107",  # no such instance
                            "0.x": "1", "-1.2": "1", "1.2.3": "1", "9" * 40: "1", "\u0661": "1"})  # fmt: skip
    (d / "3.8").mkdir()  # a directory by a valid name
    attr = SlurmAttribution("vm", mapping_dir=d)
    with caplog.at_level(logging.WARNING):
        rows = _rows(attr)
    assert rows == {"GPU-0": ("100",), "GPU-1": (), "MIG-1-1": (), "MIG-1-5": ("101",), "MIG-1-13": (),
                    "GPU-2": ("104",), "GPU-3": (), "MIG-3-7": ("102", "103"), "MIG-3-8": ()}  # fmt: skip
    assert attr.skipped == 8
    for name in ("0.x", "-1.2", "1.2.3", "'1'", "'1.2'", "'2.0'"):
        assert name in caplog.text
    first = caplog.text.count("skipped")
    _rows(attr)  # every tick skips them again: counted, not logged again
    assert caplog.text.count("skipped") == first and attr.skipped == 16


@pytest.mark.parametrize("extra", [1, 2, 500])
def test_mapping_file_with_more_jobs_than_a_row_carries_keeps_the_first(tmp_path: Path, extra: int) -> None:
    """The same rule as squeue's jobs (tests/test_slurm.py): the first MAX_ALLOCATIONS jobs, in
    the file's order, share the row; the rest are counted."""
    from gpuslo.wire.bounds import MAX_ALLOCATIONS

    many = "".join(f"{i}\n" for i in range(MAX_ALLOCATIONS + extra))
    full = "".join(f"{i}\n" for i in range(MAX_ALLOCATIONS))
    d = _mapping(tmp_path, {"0": many, "3.7": many, "2": full, "1.5": "x" * 10_000 + "\n"})
    (d / "1.1").write_bytes(b"\xff\xfe12\n")  # not text
    attr = SlurmAttribution("vm", mapping_dir=d)
    rows = _rows(attr)  # the batch is valid: it was built
    first = tuple(str(i) for i in range(MAX_ALLOCATIONS))
    assert (rows["GPU-0"], rows["MIG-3-7"], rows["GPU-2"]) == (first, first, first)
    assert (rows["MIG-1-5"], rows["MIG-1-1"]) == (("x" * 256,), ())
    assert attr.skipped == 2 * extra + 1


def test_whole_gpu_mapping_without_mig_unchanged(tmp_path: Path) -> None:
    d = _mapping(tmp_path, {"0": "7\n", "1": "8\n9\n", "3": ""})
    gpus = [FakeGpu(f"GPU-{i}") for i in range(4)]
    shares = {}
    attr = SlurmAttribution("vm", mapping_dir=d)
    src = NvmlSource("vm", "c", 10, nvml=FakeNvml(gpus), attribution=attr)
    (b, *_) = src.collect(time.time())
    assert isinstance(b, GpuSampleBatch)
    for g in b.gpus:
        shares[g.index] = [(a.id, a.share) for a in g.allocations]
    assert shares == {0: [("7", 1.0)], 1: [("8", 0.5), ("9", 0.5)], 2: [], 3: []}


def _squeue(*jobs: tuple[str, str]) -> str:
    return json.dumps({"jobs": [{"job_id": int(j), "job_state": "RUNNING", "name": f"j{j}", "user_name": "u",
                                 "account": "a", "partition": "gpu", "job_resources": {"allocated_nodes":
                                 [{"nodename": "vm"}]}, "gres_detail": [g]} for j, g in jobs]})  # fmt: skip


class _Cli:
    """squeue and sinfo answers as Slurm 22.05 prints them (only the keys read), and what was asked."""

    def __init__(self, squeue: str, gres: str | None) -> None:
        self.squeue, self.gres, self.asked = squeue, gres, []  # type: ignore[var-annotated]

    def __call__(self, argv: Sequence[str]) -> str:
        self.asked.append(argv[0])
        if argv[0] == "sinfo":
            if self.gres is None:
                raise FileNotFoundError("sinfo")
            return json.dumps({"nodes": [{"name": "vm", "gres": self.gres}]})
        return self.squeue


def test_squeue_mig_idx_on_instance_rows() -> None:
    run = _Cli(_squeue(("1", "gpu:1g.10gb:2(IDX:0-1)"), ("2", "gpu:h100:1(IDX:4)"), ("3", "gpu:3g.40gb:1(IDX:6)"),
                       ("4", "gpu:1g.10gb:1(IDX:9)")),  # past the node's 7 gres: no row, logged
               "gpu:1g.10gb:3,gpu:h100:2,gpu:2g.20gb:1,gpu:3g.40gb:1")  # fmt: skip
    attr = SlurmAttribution("vm", cli=SlurmCli(run=run))
    rows = _rows(attr)
    assert rows == {"GPU-0": (), "GPU-1": (), "MIG-1-1": ("3",), "MIG-1-5": (), "MIG-1-13": ("1",),
                    "GPU-2": ("2",), "GPU-3": (), "MIG-3-7": ("1",), "MIG-3-8": ()}  # fmt: skip
    assert attr.skipped == 1
    run.gres = None  # sinfo fails: the last order is kept
    assert _rows(attr) == rows


def test_squeue_whole_gpu_gres_on_a_mig_node_survives_sinfo_failing() -> None:
    """Slurm schedules the MIG-mode GPUs whole (untyped gpu:4): IDX is the GPU index, so GPU 1's
    job reaches none of its instances (nor its device row); once learnt, sinfo failing keeps it."""
    run = _Cli(_squeue(("1", "gpu:1(IDX:1)"), ("2", "gpu:1(IDX:2)")), "gpu:4")
    attr = SlurmAttribution("vm", cli=SlurmCli(run=run))
    rows = _rows(attr)
    assert {u: j for u, j in rows.items() if j} == {"GPU-2": ("2",)}
    run.gres = None
    run.squeue = _squeue(("3", "gpu:1(IDX:0)"))
    assert {u: j for u, j in _rows(attr).items() if j} == {"GPU-0": ("3",)}


def test_squeue_mig_node_without_sinfo_keeps_the_last_mapping() -> None:
    run = _Cli(_squeue(("1", "gpu:1g.10gb:1(IDX:0)")), None)
    attr = SlurmAttribution("vm", cli=SlurmCli(run=run))
    assert set(_rows(attr).values()) == {()}  # never placed rather than placed wrong


def test_squeue_without_mig_asks_no_sinfo_and_idx_is_the_gpu_index() -> None:
    run = _Cli(_squeue(("1", "gpu:2(IDX:0,2)"), ("2", "gpu:1(IDX:3)")), "gpu:4")
    attr = SlurmAttribution("vm", cli=SlurmCli(run=run))
    rows = _rows(attr, [FakeGpu(f"GPU-{i}") for i in range(4)])
    assert rows == {"GPU-0": ("1",), "GPU-1": (), "GPU-2": ("1",), "GPU-3": ("2",)}
    assert run.asked == ["squeue"]


# ---------------------------------------------------------------- on the real slurmctld/slurmd

# gres.conf in device order (GPU, then GI): a fake device file per record, the caps minors
# growing with GPU and GI as in /proc/driver/nvidia-caps/mig-minors
DEVICES = [("h100", "nvidia0"), ("3g.40gb", "nvidia-caps/nvidia-cap21"), ("2g.20gb", "nvidia-caps/nvidia-cap57"),
           ("1g.10gb", "nvidia-caps/nvidia-cap129"), ("h100", "nvidia2"), ("1g.10gb", "nvidia-caps/nvidia-cap336"),
           ("1g.10gb", "nvidia-caps/nvidia-cap345")]  # fmt: skip
DEVICE_UUIDS = ["GPU-0", "MIG-1-1", "MIG-1-5", "MIG-1-13", "GPU-2", "MIG-3-7", "MIG-3-8"]  # the same order


@pytest.fixture(scope="module", params=[None, ["1g.10gb", "h100", "2g.20gb", "3g.40gb"]],
                ids=["gres-conf-order", "1g-first"])  # fmt: skip
def slurm_mig(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[SlurmCluster]:
    """The node's Gres= in gres.conf's order of types, or with the 1g.10gb devices first (Slurm
    then gives them IDX 0-2: the IDX order is not the device order)."""
    if not available():
        pytest.fail("Slurm is not installed (scripts/test.sh installs slurm-wlm and munge)")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm-mig"), devices=DEVICES, type_order=request.param)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _scontrol_jobs(slurm: SlurmCluster) -> dict[str, dict[int, str]]:
    """Job id → {IDX: gres type} read from `scontrol show job -d`'s text (a job may hold
    several types: ``GRES=gpu:1g.10gb:1(IDX:6),gpu:2g.20gb:1(IDX:3)``)."""
    out: dict[str, dict[int, str]] = {}
    job = ""
    for line in slurm.run("scontrol", "show", "job", "-d").splitlines():
        m = re.search(r"JobId=(\d+)", line)
        if m:
            job = m.group(1)
        m = re.search(r" GRES=(\S+)", line)
        if m and "IDX:" in m.group(1):
            for t in re.finditer(r"gpu:([^:(]+):\d+\(IDX:([0-9,\-]+)\)", m.group(1)):
                out.setdefault(job, {}).update(dict.fromkeys(bitmap(t.group(2)), t.group(1)))
    return out


def _node_type_ranges(slurm: SlurmCluster) -> dict[str, list[int]]:
    """Gres type → the IDX Slurm gives it, from `scontrol show node -d`'s GresUsed (every type
    fully used)."""
    text = slurm.run("scontrol", "show", "node", "-d", slurm.node)
    used = re.search(r"GresUsed=(\S+)", text)
    assert used, text
    return {m.group(1): bitmap(m.group(2)) for m in re.finditer(r"gpu:([^:(]+):\d+\(IDX:([0-9,\-]+)\)",
                                                                                used.group(1))}  # fmt: skip


def _wait_running(slurm: SlurmCluster, jobs: list[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while set(slurm.run("squeue", "-h", "-o", "%T", "-j", ",".join(jobs)).split()) != {"RUNNING"}:
        assert time.monotonic() < deadline, "jobs never all ran"
        time.sleep(0.3)


@pytest.mark.integration
def test_mig_jobs_on_real_slurm(slurm_mig: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs holding 1g.10gb, 2g.20gb, 3g.40gb and whole-H100 gres on a real slurmctld whose
    gres.conf declares the fake node's MIG devices: each NVML row carries exactly the job whose
    `scontrol show job -d` IDX is that device, the device rows of MIG-mode GPUs none, and each
    instance row's profile is the type of the gres its job holds."""
    monkeypatch.setenv("SLURM_CONF", slurm_mig.env["SLURM_CONF"])
    a = slurm_mig.sbatch("1g.10gb:2", "mig-a")
    c = slurm_mig.sbatch("1g.10gb:1,gpu:2g.20gb:1", "mig-c")  # two types in one job
    d = slurm_mig.sbatch("3g.40gb:1", "mig-d")
    e = slurm_mig.sbatch("h100:2", "whole-e")
    _wait_running(slurm_mig, [a, c, d, e])

    # Slurm's IDX per type (measured, not assumed); each type's devices in gres.conf order
    ranges = _node_type_ranges(slurm_mig)
    if slurm_mig.type_order:
        assert ranges["1g.10gb"] == [0, 1, 2]
    idx_to_uuid: dict[int, str] = {}
    for t, idx in ranges.items():
        of_type = [u for (tt, _), u in zip(DEVICES, DEVICE_UUIDS, strict=True) if tt == t]
        idx_to_uuid.update(zip(idx, of_type, strict=True))
    assert sorted(idx_to_uuid) == list(range(len(DEVICES)))
    jobs = _scontrol_jobs(slurm_mig)
    expected: dict[str, tuple[str, ...]] = {}
    for job, idx in jobs.items():
        for k in idx:
            expected[idx_to_uuid[k]] = (*expected.get(idx_to_uuid[k], ()), job)

    attr = SlurmAttribution(slurm_mig.node)
    src = NvmlSource(slurm_mig.node, "c", 10, nvml=FakeNvml(_gpus()), attribution=attr)
    (batch, *_) = src.collect(time.time())
    assert isinstance(batch, GpuSampleBatch)
    got = {g.uuid: tuple(x.id for x in g.allocations) for g in batch.gpus if g.allocations}
    assert got == expected
    assert {g.uuid for g in batch.gpus if g.mig is None and g.index in (1, 3)}.isdisjoint(got)
    assert sorted(j for ids in got.values() for j in ids) == sorted([a, a, c, c, d, e, e])
    for g in batch.gpus:
        for x in g.allocations:
            kinds = set(jobs[x.id].values())
            assert (g.mig.profile if g.mig else "h100") in kinds, (g.uuid, x.id, kinds)
    held = next(x for g in batch.gpus for x in g.allocations if x.id == c)
    assert (held.name, held.account, held.queue) == ("mig-c", "research", "gpu")
    for j in (a, c, d, e):
        slurm_mig.run("scancel", j)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized", "dangling"])
def test_mapping_file_that_is_no_bounded_regular_file_is_skipped(tmp_path: Path, kind: str) -> None:
    """A FIFO named like a GPU index blocked the tick for ever; a link to /dev/zero filled memory."""
    import os
    import threading

    from gpuslo.agent.slurm import MAX_MAPPING_BYTES

    d = _mapping(tmp_path, {"0": "7\n", "2": "8\n8\n9\n"})  # a job listed twice holds its share once
    bad = d / "1"
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dev-zero":
        bad.symlink_to("/dev/zero")
    elif kind == "oversized":
        bad.write_bytes(b"5\n" * (MAX_MAPPING_BYTES // 2 + 1))
    else:
        bad.symlink_to(tmp_path / "nowhere")
    attr = SlurmAttribution("vm", mapping_dir=d)
    attr.bind([Device(i, f"GPU-{i}", H100) for i in range(3)])
    t = threading.Thread(target=attr.refresh, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive()
    assert [(a.id, a.share) for a in attr(0, "GPU-0")] == [("7", 1.0)]
    assert [(a.id, a.share) for a in attr(2, "GPU-2")] == [("8", 0.5), ("9", 0.5)]
    assert attr(1, "GPU-1") == () and attr.skipped == 1


def test_a_node_gres_count_with_thousands_of_leading_zeros_is_its_value() -> None:
    """A count's leading zeros are no digits of its value: ``0``x5000 then ``3`` is 3 GPUs. Read
    with int() whole, it raised ValueError (Python's 4,300-digit bound on a str to int) out of
    the node's IDX order, where a count of 5,000 nines was cut to MAX_IDX + 1 as documented."""
    assert parse_node_gres("gpu:1g.10gb:3,gpu:h100:" + "0" * 5000 + "3,gpu:2g.20gb:1") == [
        ("1g.10gb", 3),
        ("h100", 3),
        ("2g.20gb", 1),
    ]

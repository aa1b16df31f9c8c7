"""Slurm's gres IDX placed on NVML's GPUs through the node's gres.conf: an IDX is the place of
a GPU record among gres.conf's ``File=`` devices (not the NVML index), a device file names a
minor number, NVML gives each GPU its minor (``nvmlDeviceGetMinorNumber``). A gres.conf that
lists a subset of the GPUs, or lists them in another order than NVML's (which is by PCI bus id),
charged each job's GPU to another GPU. Unit sweeps on the fake NVML, and the real slurmd's own
numbering (``DebugFlags=Gres``) on a gres.conf with reordered lines, ranges and a subset."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.base import Device
from gpuslo.agent.nvml import NvmlSource
from gpuslo.agent.slurm import SlurmAttribution, SlurmCli
from gpuslo.agent.slurm_gres import GresConf, minor_of, parse_gres_conf
from tests.fake_nvml import FakeGpu, FakeNvml
from tests.servers.slurm import SlurmCluster, available

NODE = "vm"


def _cli(held: dict[int, str], node_gres: str = "gpu:4") -> SlurmCli:
    """squeue: job J running on NODE holding gres IDX i (``held``: IDX → job id); sinfo: NODE
    with ``node_gres``."""
    jobs = [{"job_id": int(j), "job_state": "RUNNING", "name": f"job{j}", "partition": "gpu",
             "job_resources": {"allocated_nodes": [{"nodename": NODE}]}, "gres_detail": [f"gpu:1(IDX:{i})"]}
            for i, j in held.items()]  # fmt: skip

    def run(argv: Any) -> str:
        if argv[0] == "squeue":
            return json.dumps({"jobs": jobs})
        return json.dumps({"nodes": [{"name": NODE, "gres": node_gres}]})

    return SlurmCli(run=run)


def _attributed(minors: list[int], conf: str, held: dict[int, str], tmp_path: Path,
                node_gres: str = "gpu:4") -> tuple[dict[int, list[str]], SlurmAttribution]:  # fmt: skip
    """NVML index → the jobs attributed to that GPU, by the agent as it runs: the GPU source
    over a fake NVML whose GPU i has minor ``minors[i]``, bound to the attribution."""
    path = tmp_path / "gres.conf"
    path.write_text(conf)
    attr = SlurmAttribution(NODE, cli=_cli(held, node_gres), gres_conf=path)
    gpus = [FakeGpu(f"GPU-{i}", minor=m) for i, m in enumerate(minors)]
    NvmlSource(NODE, "c", 10, nvml=FakeNvml(gpus), attribution=attr)
    attr.refresh()
    return {i: [a.id for a in attr(i, f"GPU-{i}")] for i in range(len(minors))}, attr


# gres.conf GPU lines (File= under /dev) → the minor number each IDX names, written out by hand
# from Slurm's rule (gres_common.c: records in file order, each hostlist in its own order)
LAYOUTS = {
    "one range": (["/dev/nvidia[0-3]"], [0, 1, 2, 3]),
    "subset reordered": (["/dev/nvidia[2-3]", "/dev/nvidia0"], [2, 3, 0]),
    "reversed lines": (["/dev/nvidia3", "/dev/nvidia2", "/dev/nvidia1", "/dev/nvidia0"], [3, 2, 1, 0]),
    "one gpu": (["/dev/nvidia1"], [1]),
    "list in a range": (["/dev/nvidia[3,1]", "/dev/nvidia0,/dev/nvidia2"], [3, 1, 0, 2]),
    "gap": (["/dev/nvidia[1-2]"], [1, 2]),
}
# NVML's order (PCI bus id) against the minor numbers: every permutation of four GPUs
MINORS = [list(p) for p in itertools.permutations(range(4))]


@pytest.mark.parametrize("minors", MINORS, ids=lambda m: "".join(map(str, m)))
@pytest.mark.parametrize(("lines", "named"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_each_idx_lands_on_the_gpu_its_file_names(lines: list[str], named: list[int], minors: list[int],
                                                  tmp_path: Path) -> None:  # fmt: skip
    conf = "".join(f"NodeName={NODE} Name=gpu File={f}\n" for f in lines)
    held = {i: str(100 + i) for i in range(len(named))}  # job 100+i holds IDX i
    got, attr = _attributed(minors, conf, held, tmp_path)
    want = {i: [] for i in range(4)} | {minors.index(m): [str(100 + k)] for k, m in enumerate(named)}
    assert got == want and attr.skipped == 0 and attr.unmapped == 0


def test_the_layout_carries_each_gpus_minor_number() -> None:
    attr = SlurmAttribution(NODE, cli=_cli({}))
    NvmlSource(
        NODE, "c", 10, nvml=FakeNvml([FakeGpu("GPU-0", minor=3), FakeGpu("GPU-1", minor=0)]), attribution=attr
    )
    assert attr._devices == [
        Device(0, "GPU-0", FakeGpu("x").name, minor=3),
        Device(1, "GPU-1", FakeGpu("x").name, minor=0),
    ]


@pytest.mark.parametrize("minors", [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 0, 1]], ids=["0123", "3102", "2301"])
def test_with_autodetect_the_gpus_nvml_shows_come_in_nvmls_order(minors: list[int], tmp_path: Path) -> None:
    """AutoDetect=nvml: slurmd sorts the GPUs it matched by their links (NVML's enumeration),
    the files only gres.conf names (nvidia7 here) after them."""
    conf = "AutoDetect=nvml\nName=gpu File=/dev/nvidia7\nName=gpu File=/dev/nvidia[2-3]\n"
    got, attr = _attributed(minors, conf, {0: "100", 1: "101", 2: "102"}, tmp_path)
    first, second = sorted(minors.index(m) for m in (2, 3))
    assert got == {i: [] for i in range(4)} | {first: ["100"], second: ["101"]}
    assert attr.skipped == 2  # nvidia7 names no GPU NVML shows (said), and job 102's IDX 2 on it is refused


@pytest.mark.parametrize("minors", [[0, 1, 2, 3], [3, 1, 0, 2]], ids=["0123", "3102"])
def test_autodetect_alone_numbers_every_gpu_as_nvml_does(minors: list[int], tmp_path: Path) -> None:
    got, attr = _attributed(minors, "AutoDetect=nvml\n", {0: "100", 3: "103"}, tmp_path)
    assert got == {0: ["100"], 1: [], 2: [], 3: ["103"]} and attr.skipped == 0 and attr.unmapped == 0


@pytest.mark.parametrize(("file", "minor"), [
    ("/dev/nvidia0", 0), ("/dev/nvidia15", 15), ("/dev/nvidia1234567", 1234567), ("/dev/nvidiactl", None),
    ("/dev/nvidia-caps/nvidia-cap21", None), ("/dev/dri/card0", None), ("/dev/nvidia", None), ("", None),
    ("/dev/nvidia\u0663", None), ("/dev/nvidia12345678", None), ("/dev/nvidia0\x00", None),
])  # fmt: skip
def test_a_file_names_a_minor_number_or_none(file: str, minor: int | None) -> None:
    assert minor_of(file) == minor


@pytest.mark.parametrize(("name", "major", "minor", "want"), [
    ("gpu-a", 195, 6, 6),  # a name that says nothing (a udev link): its minor
    ("nvidia2", 195, 0, 0),  # the device, not its name
    ("nvidia-cap1", 237, 1, None),  # nvidia-caps: a capability's minor, no GPU's
    ("nvidia3", 237, 3, None),
    ("card0", 226, 0, None),  # a DRM card
    ("nvidiactl", 195, 255, None),
    ("nvidia-modeset", 195, 254, None),
    ("nvidia253", 195, 253, 253),
])  # fmt: skip
def test_a_character_device_names_its_minor_only_of_nvidias_major(name: str, major: int, minor: int,
                                                                  want: int | None, tmp_path: Path) -> None:  # fmt: skip
    dev = tmp_path / name
    os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
    assert minor_of(str(dev)) == want


def test_a_stand_in_names_the_minor_its_name_says(tmp_path: Path) -> None:
    (tmp_path / "nvidia3").write_text("")  # a stand-in (no device): its name
    assert minor_of(str(tmp_path / "nvidia3")) == 3


@pytest.mark.parametrize(("files", "held", "want"), [
    (["nvidia9", "nvidia[0-1]"], {0: "100", 1: "101", 2: "102"}, {0: ["101"], 1: ["102"], 2: [], 3: []}),
    (["dri/card0", "nvidia2"], {0: "100", 1: "101"}, {0: [], 1: [], 2: ["101"], 3: []}),
    (["nvidia0"], {0: "100", 1: "101", 5: "105"}, {0: ["100"], 1: [], 2: [], 3: []}),
])  # fmt: skip
def test_an_idx_naming_no_gpu_nvml_shows_is_refused_and_counted(files: list[str], held: dict[int, str],
                                                               want: dict[int, list[str]], tmp_path: Path) -> None:  # fmt: skip
    conf = "".join(f"Name=gpu File=/dev/{f}\n" for f in files)
    got, attr = _attributed([0, 1, 2, 3], conf, held, tmp_path)
    assert got == want and attr.skipped >= len(held) - sum(map(len, want.values()))


UNKNOWABLE = {
    "missing": None,
    "include": "Include /etc/slurm/gres-gpu.conf\n",
    "multiple files": "Name=gpu MultipleFiles=/dev/nvidia[0-1]\n",
    "no gpu here": "NodeName=other Name=gpu File=/dev/nvidia[0-3]\n",
    "hostile nodename": "NodeName=n[0-99999999] Name=gpu File=/dev/nvidia0\n",
    "not utf-8": b"Name=gpu File=/dev/nvidia\xff\n",
    "quoted value": 'Name=gpu File="/dev/nvidia0 /dev/nvidia1"\n',
    "too big": "#" * (1 << 20) + "\n",
    "more files than a node holds": "Name=gpu File=/dev/nvidia[0-99999]\n",
    "more files than a node holds, autodetect": "AutoDetect=nvml\nName=gpu File=/dev/nvidia[0-8193]\n",
}


@pytest.mark.parametrize("conf", UNKNOWABLE.values(), ids=UNKNOWABLE.keys())
def test_a_gres_conf_whose_order_cannot_be_known_is_said_and_counted(
    conf: str | bytes | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing to place IDX by: read as NVML indices (what it did before), said once and counted
    each refresh, never a traceback; a mapping learnt before is kept instead."""
    path = tmp_path / "gres.conf"
    if isinstance(conf, bytes):
        path.write_bytes(conf)
    elif conf is not None:
        path.write_text(conf)
    attr = SlurmAttribution(NODE, cli=_cli({0: "100", 2: "102"}), gres_conf=path)
    NvmlSource(
        NODE, "c", 10, nvml=FakeNvml([FakeGpu(f"GPU-{i}", minor=3 - i) for i in range(4)]), attribution=attr
    )
    with caplog.at_level(logging.WARNING):
        attr.refresh()
        attr.refresh()
    assert [a.id for a in attr(0, "GPU-0")] == ["100"] and [a.id for a in attr(2, "GPU-2")] == ["102"]
    assert attr.unmapped == 2
    said = [r.getMessage() for r in caplog.records if "gres.conf" in r.getMessage()]
    assert len(said) == 1 and "unverified" in said[0], said

    path.unlink(missing_ok=True)
    path.write_text("Name=gpu File=/dev/nvidia[0-3]\n")  # learnt: IDX 0 is minor 0, GPU 3
    attr.refresh()
    if conf is None:
        path.unlink()
    elif isinstance(conf, bytes):
        path.write_bytes(conf)
    else:
        path.write_text(conf)
    attr.refresh()  # unknowable again: the learnt mapping is kept
    assert [a.id for a in attr(3, "GPU-3")] == ["100"] and [a.id for a in attr(1, "GPU-1")] == ["102"]
    assert attr(0, "GPU-0") == () and attr.unmapped == 2


def test_gres_conf_is_read_as_slurm_reads_it() -> None:
    text = (
        "# a comment\n"
        "AutoDetect=off\n"
        "NodeName=vm[1-2],gpu9 Name=gpu File=/dev/nvidia3  # ours (vm1 and vm2)\n"
        "nodename=vm2 NAME=gpu TYPE=A100 FILE=/dev/nvidia[0-1] Cores=0-7\n"
        "NodeName=vm3 Name=gpu File=/dev/nvidia2\n"
        "Name=gpu \\\n  File=/dev/nvidia5\n"
        "Name=nic File=/dev/mlx5_0\n"
        "Name=mps Count=100 File=/dev/nvidia3\n"
        "Name=gpu Count=2\n"
    )
    assert parse_gres_conf(text, "vm2") == GresConf(
        files=(("", "/dev/nvidia3"), ("A100", "/dev/nvidia0"), ("A100", "/dev/nvidia1"), ("", "/dev/nvidia5"))
    )
    assert parse_gres_conf(text, "vm3").files == (("", "/dev/nvidia2"), ("", "/dev/nvidia5"))
    assert parse_gres_conf("NodeName=vm9 AutoDetect=nvml\n", "vm9").autodetect
    assert not parse_gres_conf("NodeName=vm8 AutoDetect=nvml\n", "vm9").autodetect
    assert parse_gres_conf("\x00\x1b[31m" * 1000, "vm").problems


@pytest.mark.parametrize("eq", ["=", " = ", "\t=", "=  "], ids=repr)
@pytest.mark.parametrize("quote", [False, True], ids=["bare", "quoted"])
@pytest.mark.parametrize("sep", [" ", "\t", "  \t "], ids=repr)
def test_gres_conf_key_values_are_read_in_slurms_own_syntax(eq: str, quote: bool, sep: str) -> None:
    """parse_config.c's KEY_VALUE_REGEX: spaces around ``=``, values quoted or bare (the real
    slurmd's numbering of such lines: test_each_job_is_charged_the_gpu_slurmd_gave_it)."""

    def kv(k: str, v: str) -> str:
        return f'{k}{eq}"{v}"' if quote else f"{k}{eq}{v}"

    text = "\n".join(
        sep.join([kv("NodeName", n), kv("Name", "gpu"), kv("Type", "a100"), kv("File", f)])
        for n, f in [(NODE, "/dev/nvidia[2-3]"), ("other", "/dev/nvidia9"), (NODE, "/dev/nvidia0")]
    )
    assert parse_gres_conf(text, NODE) == GresConf(
        files=(("a100", "/dev/nvidia2"), ("a100", "/dev/nvidia3"), ("a100", "/dev/nvidia0"))
    )


# (global AutoDetect line, this node's AutoDetect line, another node's) → on for this node,
# by gres.conf(5): "node-specific AutoDetects will trump the global AutoDetect", set once per
# node, wherever the lines stand; None: no such line
AUTODETECT = [
    (g, n, o, n if n is not None else g if g is not None else "off")
    for g in (None, "nvml", "off", "NVML")
    for n in (None, "nvml", "off", "Off")
    for o in (None, "nvml", "off")
]


@pytest.mark.parametrize("global_first", [True, False], ids=["global first", "global last"])
@pytest.mark.parametrize(("glob", "mine", "other", "want"), AUTODETECT, ids=lambda v: str(v))
def test_a_node_specific_autodetect_trumps_the_global_one(
    glob: str | None, mine: str | None, other: str | None, want: str, global_first: bool
) -> None:
    lines = [f"NodeName={NODE}9 AutoDetect={other} Name=gpu File=/dev/nvidia9"] if other else []
    node = [f"NodeName={NODE} AutoDetect={mine} Name=gpu File=/dev/nvidia[2-3]"] if mine else []
    node.append(f"NodeName={NODE} Name=gpu File=/dev/nvidia0")
    head = [f"AutoDetect={glob}"] if glob else []
    text = "\n".join([*head, *lines, *node] if global_first else [*lines, *node, *head])
    conf = parse_gres_conf(text, NODE)
    assert conf.autodetect == (want.lower() != "off") and not conf.problems


@pytest.mark.parametrize("minors", MINORS, ids=lambda m: "".join(map(str, m)))
def test_a_node_with_autodetect_off_numbers_its_gpus_in_file_order(minors: list[int], tmp_path: Path) -> None:
    """gres.conf(5)'s own example: a global AutoDetect=nvml, unset for this node; slurmd then
    numbers its GPUs in File= order (nvidia2, nvidia3, nvidia0), not NVML's."""
    conf = f"AutoDetect=nvml\nNodeName={NODE} AutoDetect=off Name=gpu File=/dev/nvidia[2-3],/dev/nvidia0\n"
    got, attr = _attributed(minors, conf, {0: "100", 1: "101", 2: "102"}, tmp_path)
    want = {i: [] for i in range(4)} | {minors.index(m): [str(100 + k)] for k, m in enumerate([2, 3, 0])}
    assert got == want and attr.skipped == 0 and attr.unmapped == 0


def test_typed_records_follow_the_nodes_gres_order(tmp_path: Path) -> None:
    """slurmctld numbers a node's typed GPUs type by type in its ``Gres=`` order (measured on
    22.05: tests/test_slurm_mig.py), each type's in gres.conf order."""
    conf = "Name=gpu Type=a100 File=/dev/nvidia2\nName=gpu Type=h100 File=/dev/nvidia0\nName=gpu Type=a100 File=/dev/nvidia3\n"
    got, attr = _attributed(
        [3, 1, 0, 2], conf, {0: "100", 1: "101", 2: "102"}, tmp_path, "gpu:h100:1,gpu:a100:2"
    )
    # IDX 0: h100 (nvidia0: NVML 2); IDX 1, 2: a100 nvidia2 (NVML 3), nvidia3 (NVML 0)
    assert got == {0: ["102"], 1: [], 2: ["100"], 3: ["101"]} and attr.skipped == 0


@pytest.mark.parametrize(("node_gres", "named"), [
    ("gpu:4", [2, 0, 3]),  # untyped: slurmd takes the records as they come (_match_type, no type)
    ("gpu:A100:2,gpu:H100:1", [2, 3, 0]),  # types matched without case
    ("gpu:h100:1,gpu:a100:1", [0, 2]),  # as many of each as the node counts: nvidia3 holds no place
])  # fmt: skip
def test_typed_records_take_their_places_as_slurmd_merges_them(node_gres: str, named: list[int],
                                                               tmp_path: Path) -> None:  # fmt: skip
    conf = "Name=gpu Type=a100 File=/dev/nvidia2\nName=gpu Type=h100 File=/dev/nvidia0\nName=gpu Type=a100 File=/dev/nvidia3\n"
    minors = [3, 1, 0, 2]
    held = {i: str(100 + i) for i in range(len(named))}
    got, _ = _attributed(minors, conf, held, tmp_path, node_gres)
    assert got == {i: [] for i in range(4)} | {minors.index(m): [str(100 + k)] for k, m in enumerate(named)}


def _slurmd_numbering(c: SlurmCluster) -> list[int]:
    """The minor number of each gres bitmap position, in slurmd's own words (its log with
    ``DebugFlags=Gres``: ``gpu device number N(<path>):c 195:N``, in bitmap order)."""
    text = (c.dir / "log" / "slurmd.log").read_text()
    return [int(m) for m in re.findall(r"gpu device number \d+\(\S+\):c 195:(\d+)", text)]


@pytest.mark.integration
@pytest.mark.parametrize(("files", "gpus", "minors", "line"), [
    (["nvidia[2-3]", "nvidia0"], 3, [3, 1, 0, 2], "NodeName={node} Name=gpu File={file}"),  # a subset, a range,
    (["nvidia[3,1]", "nvidia0", "nvidia2"], 4, [0, 1, 2, 3], "NodeName={node} Name=gpu File={file}"),  # reordered
    # Slurm's own key=value syntax (parse_config.c): spaces around =, quoted values, keys in any case
    (["nvidia2", "nvidia[0-1]"], 3, [1, 2, 0], 'NodeName = {node}  name=gpu FILE = "{file}"'),
    (["nvidia3", "nvidia1"], 2, [3, 1, 0, 2], 'NodeName="{node}"\tName="gpu" File="{file}" Cores="0-3"'),
])  # fmt: skip
def test_each_job_is_charged_the_gpu_slurmd_gave_it(files: list[str], gpus: int, minors: list[int], line: str,
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the real slurmd: each running job's IDX (``scontrol show job -d``) → the minor number
    slurmd numbered at that position → the GPU NVML gives that minor; the agent must charge
    each job exactly that GPU."""
    if not available():
        pytest.fail("Slurm is not installed (scripts/test.sh installs slurm-wlm and munge)")
    c = SlurmCluster(tmp_path / "slurm", gpus=gpus, gpu_files=files, gpu_line=line)
    c.start()
    jobs: list[str] = []
    try:
        monkeypatch.setenv("SLURM_CONF", c.env["SLURM_CONF"])
        numbering = _slurmd_numbering(c)
        assert len(numbering) == gpus, numbering
        jobs = [c.sbatch(1, f"j{k}") for k in range(gpus - 1)]
        deadline = time.monotonic() + 30
        while c.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").split() != sorted(jobs, key=int):
            assert time.monotonic() < deadline, c.run("squeue")
            time.sleep(0.3)
        want: dict[int, list[str]] = {i: [] for i in range(len(minors))}
        for block in c.run("scontrol", "show", "job", "-d").split("JobId=")[1:]:
            (idx,) = re.findall(r"GRES=gpu:1\(IDX:(\d+)\)", block)
            want[minors.index(numbering[int(idx)])].append(block.split()[0])
        attr = SlurmAttribution(c.node, gres_conf=c.dir / "gres.conf")
        gpu_rows = [FakeGpu(f"GPU-{i}", minor=m) for i, m in enumerate(minors)]
        NvmlSource(c.node, "c", 10, nvml=FakeNvml(gpu_rows), attribution=attr)
        attr.refresh()
        assert {i: [a.id for a in attr(i, f"GPU-{i}")] for i in range(len(minors))} == want
        assert attr.skipped == 0 and attr.unmapped == 0
    finally:
        for j in jobs:
            c.run("scancel", j)
        deadline = time.monotonic() + 30  # their steps gone before slurmd is: none left behind
        while c.run("squeue", "-h", "-o", "%i") and time.monotonic() < deadline:
            time.sleep(0.3)
        c.stop()


@pytest.mark.parametrize(("argv", "env", "want"), [
    (["--slurm"], None, Path("/etc/slurm/gres.conf")),
    (["--slurm"], "/opt/slurm/etc/slurm.conf", Path("/opt/slurm/etc/gres.conf")),
    (["--slurm", "--slurm-gres-conf", "/x/g.conf"], "/opt/slurm/etc/slurm.conf", Path("/x/g.conf")),
    ([], "/opt/slurm/etc/slurm.conf", None),
])  # fmt: skip
def test_the_agent_reads_the_gres_conf_beside_slurm_conf(
    argv: list[str], env: str | None, want: Path | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuslo.app.cli import _node_options, build_parser

    if env is None:
        monkeypatch.delenv("SLURM_CONF", raising=False)
    else:
        monkeypatch.setenv("SLURM_CONF", env)
    a = build_parser().parse_args(["agent", "--source", "nvml", "--node", NODE, *argv])
    assert _node_options(a).slurm_gres_conf == want

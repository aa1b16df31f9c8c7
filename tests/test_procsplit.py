"""Shared GPUs split by what their holders' processes did: cgroup → holder, NVML's process
lists and per-process utilization (fake NVML with pynvml's own structs and errors), the split
itself, and the NVML source end to end.

Expected values are worked out by hand from the definitions in agent/procsplit.py: a holder's
activity_share = S × (its processes' smUtil) / (all holders' processes' smUtil), S = Σ share."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from gpuslo.agent.base import StaticAttribution
from gpuslo.agent.cgroup import MAX_CGROUP_BYTES, CgroupHolder, PodDirectory, ProcCgroups, holder_of_cgroup
from gpuslo.agent.nvml import NvmlSource
from gpuslo.agent.nvml_procs import NvmlProcesses, ProcView
from gpuslo.agent.procsplit import CgroupHolders, SplitStats, split
from gpuslo.wire import Allocation, GpuSampleBatch, decode, encode
from tests.fake_nvml import FakeGpu, FakeMig, FakeNvml, FakeProc, FakeProcs

UID_A = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
UID_B = "11111111-2222-3333-4444-555555555555"
STATIC = "d41d8cd98f00b204e9800998ecf8427e"  # a static pod's UID: its config hash
CID = "a" * 64
T = 1_800_000_000.0


# ---------------------------------------------------------------------------- cgroup layouts
LAYOUTS = [
    # Kubernetes, systemd driver, cgroup v2, containerd / CRI-O / docker
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/"
     f"cri-containerd-{CID}.scope\n", CgroupHolder("k8s", UID_A)),
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_B.replace('-', '_')}.slice/"
     f"crio-{CID}.scope\n", CgroupHolder("k8s", UID_B)),
    (f"0::/kubepods.slice/kubepods-pod{UID_A.replace('-', '_')}.slice/docker-{CID}.scope\n",  # guaranteed
     CgroupHolder("k8s", UID_A)),
    # kind / nested kubelets: kubepods under the kubelet's own slice
    (f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/"
     f"kubelet-kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
     CgroupHolder("k8s", UID_A)),
    # Kubernetes, cgroupfs driver, cgroup v1 (one line per hierarchy, all the same pod)
    (f"12:memory:/kubepods/burstable/pod{UID_A}/{CID}\n11:devices:/kubepods/burstable/pod{UID_A}/{CID}\n"
     "10:rdma:/\n1:name=systemd:/kubepods/burstable/pod" + UID_A + "/" + CID + "\n", CgroupHolder("k8s", UID_A)),
    (f"4:cpu,cpuacct:/kubepods/pod{UID_B}/{CID}\n", CgroupHolder("k8s", UID_B)),  # guaranteed
    (f"0::/kubepods/besteffort/pod{STATIC}/{CID}\n", CgroupHolder("k8s", STATIC)),  # static pod
    # seen from inside the agent's own cgroup namespace
    (f"0::/../../kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
     CgroupHolder("k8s", UID_A)),
    # Slurm: cgroup v1, v1 with a per-node prefix, cgroup v2
    ("7:devices:/slurm/uid_1000/job_4242/step_0/task_0\n6:memory:/slurm/uid_1000/job_4242/step_0/task_0\n",
     CgroupHolder("slurm", "4242")),
    ("7:devices:/slurm_gpu-node-3/uid_0/job_17/step_batch/task_0\n", CgroupHolder("slurm", "17")),
    ("0::/system.slice/slurmstepd.scope/job_99/step_0/user/task_0\n", CgroupHolder("slurm", "99")),
    ("0::/system.slice/slurmstepd.scope/job_007/step_extern\n", CgroupHolder("slurm", "7")),
    # Slurm v2 built with --enable-multiple-slurmd: the scope is <node>_slurmstepd.scope (Slurm's
    # cgroup_v2 page; a node name with a dash, as a real one reads), under system.slice or, with
    # IgnoreSystemd in a container sharing the host's cgroup namespace, under it twice
    ("0::/system.slice/gx10-ac12_slurmstepd.scope/job_12/step_batch/user/task_0\n", CgroupHolder("slurm", "12")),
    ("0::/system.slice/system.slice/localhost_slurmstepd.scope/job_3/step_0/user/task_1\n",
     CgroupHolder("slurm", "3")),
    ("0::/system.slice/gpu-node-3_slurmstepd.scope/system\n", None),  # that slurmstepd itself
    # hybrid: v1 controllers name the job, the unified line slurmd's service
    ("13:misc:/\n12:memory:/slurm/uid_0/job_5/step_0/task_0\n1:name=systemd:/system.slice/slurmd.service\n"
     "0::/system.slice/slurmd.service\n", CgroupHolder("slurm", "5")),
    # nobody's: the host, system services, the slurmstepd itself, the kubelet
    ("0::/\n", None),
    ("0::/system.slice/sshd.service\n", None),
    ("0::/system.slice/slurmstepd.scope/system\n", None),
    ("0::/kubepods.slice\n", None),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
]  # fmt: skip


@pytest.mark.parametrize(("text", "holder"), LAYOUTS)
def test_cgroup_layouts(text: str, holder: CgroupHolder | None) -> None:
    assert holder_of_cgroup(text) == holder


HOSTILE = [
    # a pod that may make cgroups below its own names another pod there: the kubelet's wins
    (f"0::/kubepods/burstable/pod{UID_A}/{CID}/kubepods/burstable/pod{UID_B}/x\n", CgroupHolder("k8s", UID_A)),
    # a job that names a pod below its own cgroup: still the job
    (f"0::/system.slice/slurmstepd.scope/job_5/step_0/kubepods/pod{UID_B}/x\n", CgroupHolder("slurm", "5")),
    # and a pod that names a job below its own
    (f"0::/kubepods/pod{UID_A}/{CID}/slurm/uid_0/job_6/step_0\n", CgroupHolder("k8s", UID_A)),
    # two hierarchies naming two holders: trusted for neither
    (f"12:memory:/kubepods/pod{UID_A}/{CID}\n11:devices:/kubepods/pod{UID_B}/{CID}\n", None),
    ("0::/slurm/uid_1/job_1/step_0\n1:name=systemd:/slurm/uid_1/job_2/step_0\n", None),
    # not UIDs: upper case, too short, too long, hex with a stray letter
    (f"0::/kubepods/pod{UID_A.upper()}/{CID}\n", None),
    ("0::/kubepods/pod0f1e2d3c/x\n", None),
    (f"0::/kubepods/pod{UID_A}0/{CID}\n", None),
    ("0::/kubepods/podzf1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/x\n", None),
    # a job id that no Slurm gives (over 20 digits), and job_ without digits
    ("0::/slurm/uid_0/job_" + "9" * 21 + "/step_0\n", None),
    ("0::/slurm/uid_0/job_/step_0\n", None),
    # digits Slurm never writes (Arabic-Indic, fullwidth): no job 42, no uid
    ("0::/slurm/uid_0/job_\u0664\u0662/step_0\n", None),
    ("0::/system.slice/slurmstepd.scope/job_\uff14\uff12/step_0\n", None),
    ("0::/slurm/uid_\u0660/job_42/step_0\n", None),
    # a user's own subtree (systemd delegates user@<uid>.service to them): whatever they name there
    # is theirs, not a job's or a pod's
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/slurm/uid_0/job_77/step_0\n", None),
    ("0::/user.slice/user-1000.slice/user@1000.service/x/system.slice/slurmstepd.scope/job_77/step_0\n", None),
    (f"0::/user.slice/user-1000.slice/user@1000.service/kubepods/burstable/pod{UID_A}/{CID}\n", None),
    ("0::/user.slice/user-1000.slice/user@1000.service/n_slurmstepd.scope/job_77/step_0\n", None),
    # ... while a job's own process keeps its job whatever it names below
    ("0::/system.slice/slurmstepd.scope/job_5/step_0/user@1000.service/slurm/uid_0/job_77\n",
     CgroupHolder("slurm", "5")),
    # no colons, control characters, NUL, quotes and backslashes, an endless line
    ("garbage without colons\n", None),
    ("0::/kubepods/pod\x00\x1b[31m'\"\\\n", None),
    ("0::" + "/a" * 100_000 + "\n", None),
    # longer than PATH_MAX: nobody's
    ("0::" + "/kubepods" * 7000 + "/pod" * 100 + "\n", None),
    (f"0::/kubepods/pod{UID_A}/" + "x" * 5000 + "\n", None),
    ("", None),
]  # fmt: skip


@pytest.mark.parametrize(("text", "holder"), HOSTILE)
def test_hostile_cgroup_contents(text: str, holder: CgroupHolder | None) -> None:
    assert holder_of_cgroup(text) == holder


def _proc(tmp: Path, pid: int, text: str | bytes) -> None:
    (tmp / str(pid)).mkdir(parents=True, exist_ok=True)
    (tmp / str(pid) / "cgroup").write_bytes(text if isinstance(text, bytes) else text.encode())


def test_proc_tree_read_once_per_tick_and_faults_counted(tmp_path: Path) -> None:
    """A fake /proc: pids read from their cgroup files; a pid gone (exited since NVML listed
    it) or not a pid has no holder; a file that changes (pid reused) is read again next tick
    only; bytes that are not UTF-8 read as nobody's; a huge file is read to the limit."""
    _proc(tmp_path, 100, f"0::/kubepods/pod{UID_A}/{CID}\n")
    _proc(tmp_path, 200, b"0::/slurm/uid_0/job_\xff\xfe/step_0\n")
    _proc(tmp_path, 300, b"0::/" + b"x" * (MAX_CGROUP_BYTES * 2) + b"/slurm/uid_0/job_1/step_0\n")
    c = ProcCgroups(tmp_path)
    assert c(100) == CgroupHolder("k8s", UID_A)
    _proc(tmp_path, 100, "0::/slurm/uid_0/job_8/step_0\n")
    assert c(100) == CgroupHolder("k8s", UID_A)  # same tick: cached
    c.new_tick()
    assert c(100) == CgroupHolder("slurm", "8")
    assert (c(200), c(300)) == (None, None)
    assert c.unreadable == 0
    assert c(999) is None and c.unreadable == 1  # gone
    assert c(0) is None and c(-1) is None and c(2**40) is None and c.unreadable == 1


def _filler(n: int) -> str:
    """A cgroup v1 line of exactly ``n`` characters (newline included) that names nobody."""
    return "2:cpu:/" + "y" * (n - len("2:cpu:/") - 1) + "\n"


@pytest.mark.parametrize("cut", [1, 3, 5, 6, 7, 8, 9, 12])
def test_a_line_cut_at_the_read_limit_names_nobody(tmp_path: Path, cut: int) -> None:
    """A file longer than the limit is read that far: its last line, cut anywhere in or after
    the holder's segment, must not name another holder (``job_12`` of ``job_1234``); whole
    lines before the cut still count, and a file that ends at the limit with its newline is
    read whole."""
    line = "7:devices:/slurm/uid_0/job_1234/step_0\n"
    tail = line[: line.index("job_") + cut]
    head = _filler(4000) * ((MAX_CGROUP_BYTES - len(tail)) // 4000 - 1)
    head += _filler(MAX_CGROUP_BYTES - len(tail) - len(head))
    assert len(head + tail) == MAX_CGROUP_BYTES
    _proc(tmp_path, 100, head + line + "9:pids:/\n")
    whole = "0::/slurm/uid_0/job_77/step_0\n"
    _proc(tmp_path, 101, _filler(MAX_CGROUP_BYTES - len(whole)) + whole)  # ends at the limit, whole
    _proc(tmp_path, 102, whole + head[len(whole) :] + line)  # the cut line is not the holder's
    c = ProcCgroups(tmp_path)
    assert c(100) is None
    assert (c(101), c(102)) == (CgroupHolder("slurm", "77"), CgroupHolder("slurm", "77"))
    assert c.unreadable == 0


def test_pod_directory(tmp_path: Path) -> None:
    """UID → namespace/name from /var/log/pods/<ns>_<name>_<uid>; other entries ignored; an
    unknown UID relists once per tick; a directory that cannot be listed is counted."""
    for d in (f"ml_infer-a_{UID_A}", f"kube-system_etcd.node-1_{STATIC}", "junk", f"BAD_x_{UID_B}",
              f"a_b_c_{UID_B}", f"ns_name_{UID_B}x"):  # fmt: skip
        (tmp_path / d).mkdir()
    pods = PodDirectory(tmp_path)
    assert pods(UID_A) == "ml/infer-a" and pods(STATIC) == "kube-system/etcd.node-1"
    assert pods(UID_B) is None
    (tmp_path / f"team_train_{UID_B}").mkdir()
    assert pods(UID_B) is None  # listed this tick already
    pods.new_tick()
    assert pods(UID_B) == "team/train"
    gone = PodDirectory(tmp_path / "missing")
    assert gone(UID_A) is None and gone.failures == 1


# ---------------------------------------------------------------------------- the split
def _pods(*names: str) -> tuple[Allocation, ...]:
    return tuple(Allocation(scheduler="k8s", id=n, name=n, share=1.0 / len(names)) for n in names)


def _holders(mapping: dict[int, str]) -> object:
    return lambda pid: ("k8s", mapping[pid]) if pid in mapping else None


def test_sole_and_none() -> None:
    one = _pods("a/x")
    assert split((), None, lambda _p: None) == ()
    assert [a.share_source for a in split(one, ProcView({1: 5}, {1: 50.0}), lambda _p: ("k8s", "a/x"))] == [
        "sole"
    ]


def test_measured_busy_and_idle_holder() -> None:
    """Pods a and b time-slice a GPU; a's two processes ran at 40 % and 20 % SM, b has a
    process that ran nothing and c none at all; a host process (pid 9) ran 50 %. On paper:
    S = 1; a = 60/60 = 1, b = c = 0; the host process takes no part. Framebuffer: a 3 GiB,
    b 1 GiB, c 0 → 0.75, 0.25, 0."""
    allocs = _pods("a/x", "b/y", "c/z")
    view = ProcView({1: 2 << 30, 2: 1 << 30, 3: 1 << 30, 9: 5 << 30}, {1: 40.0, 2: 20.0, 3: 0.0, 9: 50.0})
    stats = SplitStats()
    out = split(allocs, view, _holders({1: "a/x", 2: "a/x", 3: "b/y"}), stats)  # type: ignore[arg-type]
    assert [a.share_source for a in out] == ["measured"] * 3
    assert [a.activity_share for a in out] == pytest.approx([1.0, 0.0, 0.0])
    assert [a.fb_share for a in out] == pytest.approx([0.75, 0.25, 0.0])
    assert [a.share for a in out] == [a.share for a in allocs]  # what was handed out stays
    assert (stats.measured, stats.unmapped) == (1, 1)


def test_measured_in_proportion_and_over_held_shares() -> None:
    """Two jobs hold 0.3 and 0.3 of a GPU (fractional scheduler; 0.4 unallocated), SM 30 and
    10: S = 0.6 → 0.45 and 0.15 (Σ = Σ share)."""
    allocs = (
        Allocation(scheduler="slurm", id="1", share=0.3),
        Allocation(scheduler="slurm", id="2", share=0.3),
    )
    view = ProcView({11: 0, 12: 0}, {11: 30.0, 12: 10.0})
    out = split(allocs, view, lambda pid: ("slurm", {11: "1", 12: "2"}[pid]))
    assert [a.activity_share for a in out] == pytest.approx([0.45, 0.15])
    assert [a.fb_share for a in out] == [None, None]  # no memory figures
    assert sum(a.activity_share or 0 for a in out) == pytest.approx(sum(a.share for a in out))


@pytest.mark.parametrize("n", [2, 3, 7, 64])
def test_measured_split_sums_to_one(n: int) -> None:
    allocs = _pods(*[f"ns/p{i}" for i in range(n)])
    view = ProcView({i: 1 for i in range(n)}, {i: float(i % 3) * 33.3 + 0.1 for i in range(n)})
    out = split(allocs, view, _holders({i: f"ns/p{i}" for i in range(n)}))  # type: ignore[arg-type]
    total = sum(a.activity_share or 0 for a in out)
    assert total == pytest.approx(1.0) and total <= 1.0
    assert all(0 <= (a.activity_share or 0) <= 1 for a in out)
    GpuSampleBatch(source="n", boot_id="b", seq=0, cluster="c", ts=T, node="n", interval_s=10.0,
                   gpus=({"index": 0, "uuid": "GPU-0", "allocations": out},))  # fmt: skip  # the wire takes it


def test_processes_only_split() -> None:
    """No utilization figure (MIG, old driver): a holds a process, b none → a 1, b 0."""
    out = split(_pods("a/x", "b/y"), ProcView({1: 0}, None), _holders({1: "a/x"}))  # type: ignore[arg-type]
    assert [(a.share_source, a.activity_share) for a in out] == [("processes", 1.0), ("processes", 0.0)]


@pytest.mark.parametrize(
    ("view", "mapping"),
    [
        (None, {}),  # NVML could not say
        (ProcView({}, {}), {}),  # no process at all
        (ProcView({1: 0, 2: 0}, None), {1: "a/x", 2: "b/y"}),  # both have one, no utilization
        (ProcView({1: 0, 2: 0}, {}), {1: "a/x", 2: "b/y"}),  # no sample since the last tick
        (ProcView({1: 0, 2: 0}, {1: 0.0, 2: 0.0}), {1: "a/x", 2: "b/y"}),  # none ran a kernel
        (ProcView({7: 0}, {7: 90.0}), {}),  # only a host process worked
    ],
)
def test_equal_fallback_is_flagged(view: ProcView | None, mapping: dict[int, str]) -> None:
    out = split(_pods("a/x", "b/y"), view, _holders(mapping))  # type: ignore[arg-type]
    assert [(a.share_source, a.activity_share) for a in out] == [("equal", None), ("equal", None)]


# ---------------------------------------------------------------------------- NVML reads
def _gpu_with(uuid: str = "GPU-0", **kw: object) -> tuple[FakeNvml, FakeProcs]:
    fake = FakeNvml([FakeGpu(uuid, **kw)])  # type: ignore[arg-type]
    procs = fake.processes.setdefault(uuid, FakeProcs())
    return fake, procs


def _handle(fake: FakeNvml) -> object:
    return fake.nvmlDeviceGetHandleByIndex(0)


def test_process_lists_merge_and_memory() -> None:
    """A process in the compute and graphics lists counts once with its larger figure; an MPS
    client counts; a figure the driver cannot give (WDDM: NVML_VALUE_NOT_AVAILABLE → None)
    is 0."""
    fake, p = _gpu_with()
    p.procs = [
        FakeProc(1, 100),
        FakeProc(1, 300, kind="graphics"),
        FakeProc(2, 50, kind="mps"),
        FakeProc(3, None),
    ]
    view = NvmlProcesses(fake).read("GPU-0", _handle(fake))
    assert view is not None and view.fb_bytes == {1: 300, 2: 50, 3: 0}


def test_utilization_last_seen_semantics() -> None:
    """Each call passes the newest timeStamp seen: a sample counts once; NOT_FOUND (nothing
    newer) is an answer (nobody ran), not an error; several samples of a pid are averaged."""
    fake, p = _gpu_with()
    p.procs = [FakeProc(1), FakeProc(2)]
    p.samples = [(1, 1_000, 40), (1, 2_000, 60), (2, 1_500, 10)]
    r = NvmlProcesses(fake)
    first = r.read("GPU-0", _handle(fake))
    assert first is not None and first.sm == {1: 50.0, 2: 10.0}
    second = r.read("GPU-0", _handle(fake))
    assert second is not None and second.sm == {}  # NOT_FOUND
    p.samples.append((2, 3_000, 70))
    third = r.read("GPU-0", _handle(fake))
    assert third is not None and third.sm == {2: 70.0}
    assert r.stats.errors == 0 and r.stats.unsupported == 0


def test_old_driver_falls_back_to_process_utilization() -> None:
    """No nvmlDeviceGetProcessesUtilizationInfo in the driver (FunctionNotFound): the older
    nvmlDeviceGetProcessUtilization answers, and the newer is not asked again."""
    fake, p = _gpu_with()
    p.utilization_info = False
    p.procs, p.samples = [FakeProc(1)], [(1, 10, 30)]
    r = NvmlProcesses(fake)
    for _ in range(3):
        r.read("GPU-0", _handle(fake))
    g = fake.gpus[0]
    assert (
        g.calls["nvmlDeviceGetProcessesUtilizationInfo"] == 1
        and g.calls["nvmlDeviceGetProcessUtilization"] == 3
    )
    assert r.stats.unsupported == 1


@pytest.mark.parametrize(
    ("fn", "code", "fb_none", "sm_none"),
    [
        ("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_UNKNOWN, True, True),
        ("nvmlDeviceGetMPSComputeRunningProcesses", pynvml.NVML_ERROR_NO_PERMISSION, True, True),
        ("nvmlDeviceGetProcessesUtilizationInfo", pynvml.NVML_ERROR_UNKNOWN, False, True),
        ("nvmlDeviceGetProcessesUtilizationInfo", pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, False, True),
        ("nvmlDeviceGetProcessUtilization", pynvml.NVML_ERROR_UNKNOWN, False, False),  # the newer answers
    ],
)
def test_nvml_errors_make_figures_unknown(fn: str, code: int, fb_none: bool, sm_none: bool) -> None:
    """A failing list makes the whole view unknown (a partial list would make a holder look
    idle); a failing utilization call makes only utilization unknown; never a traceback."""
    fake, p = _gpu_with()
    p.procs, p.samples, p.errors = [FakeProc(1)], [(1, 10, 30)], {fn: code}
    r = NvmlProcesses(fake)
    view = r.read("GPU-0", _handle(fake))
    assert (view is None) == fb_none
    if view is not None:
        assert (view.sm is None) == sm_none
    assert r.stats.errors == (0 if not fb_none and not sm_none else 1)


def test_not_supported_everywhere_and_lost_gpu() -> None:
    fake, _ = _gpu_with(unsupported={"nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                                     "nvmlDeviceGetMPSComputeRunningProcesses"})  # fmt: skip
    r = NvmlProcesses(fake)
    assert r.read("GPU-0", _handle(fake)) is None and r.stats.unsupported == 3
    assert r.read("GPU-0", _handle(fake)) is None and r.stats.unsupported == 3  # not asked again
    lost, _ = _gpu_with()
    h = _handle(lost)  # a handle taken while it was there: the GPU falls off the bus after
    lost.gpus[0].lost = True
    assert NvmlProcesses(lost).read("GPU-0", h) is None


# ---------------------------------------------------------------------------- end to end
def _node(tmp: Path) -> Path:
    proc = tmp / "proc"
    _proc(proc, 101, f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_A.replace('-', '_')}"
                     f".slice/cri-containerd-{CID}.scope\n")  # fmt: skip
    _proc(proc, 102, f"12:devices:/kubepods/besteffort/pod{UID_B}/{CID}\n")
    _proc(proc, 7, "0::/system.slice/nvidia-persistenced.service\n")
    (tmp / "pods" / f"ml_busy_{UID_A}").mkdir(parents=True)
    (tmp / "pods" / f"ml_idle_{UID_B}").mkdir(parents=True)
    return tmp


def _source(tmp: Path, fake: FakeNvml, holders: dict[str, tuple[Allocation, ...]]) -> NvmlSource:
    of = CgroupHolders(ProcCgroups(tmp / "proc"), PodDirectory(tmp / "pods"))
    return NvmlSource("node-1", "prod", 10.0, nvml=fake, boot_id="b", holder_of=of,
                      attribution=StaticAttribution(lambda i, uuid: holders.get(uuid, ())))  # fmt: skip


def _batch(msgs: list[object]) -> GpuSampleBatch:
    b = next(m for m in msgs if isinstance(m, GpuSampleBatch))
    assert decode(encode(b)) == b
    return b


def test_time_sliced_gpu_busy_and_idle_pod(tmp_path: Path) -> None:
    """Two pods time-slice GPU-0 (PodResources: ml/busy and ml/idle, 1/2 each): busy's process
    ran 80 % SM, idle's sat with 2 GiB allocated; a host daemon (3 % SM, 1 GiB) is nobody's.
    On paper: busy gets all the activity (80/80), idle 0; the holders' framebuffer is busy
    6 GiB, idle 2 GiB → 0.75, 0.25. GPU-1 has one pod: sole. On the next tick no new sample
    (NOT_FOUND) and both have a process: equal, flagged."""
    _node(tmp_path)
    fake = FakeNvml([FakeGpu("GPU-0"), FakeGpu("GPU-1")])
    fake.processes["GPU-0"] = FakeProcs(procs=[FakeProc(101, 6 << 30), FakeProc(102, 2 << 30), FakeProc(7, 1 << 30)],
                                        samples=[(101, 5_000, 80), (7, 5_000, 3)])  # fmt: skip
    shared = tuple(
        Allocation(scheduler="k8s", id=f"ml/{n}", name=f"ml/{n}", share=0.5) for n in ("busy", "idle")
    )
    one = (Allocation(scheduler="k8s", id="ml/busy", name="ml/busy"),)
    src = _source(tmp_path, fake, {"GPU-0": shared, "GPU-1": one})
    rows = {g.uuid: g for g in _batch(src.collect(T)).gpus}
    busy, idle = rows["GPU-0"].allocations
    assert (busy.share_source, busy.activity_share, busy.fb_share) == ("measured", 1.0, 0.75)
    assert (idle.share_source, idle.activity_share, idle.fb_share) == ("measured", 0.0, 0.25)
    assert (busy.share, idle.share) == (0.5, 0.5)
    assert [a.share_source for a in rows["GPU-1"].allocations] == ["sole"]
    assert "nvmlDeviceGetComputeRunningProcesses" not in fake.gpus[1].calls  # a sole holder costs no call
    assert src.split_stats.unmapped == 1  # the host daemon
    again = {g.uuid: g for g in _batch(src.collect(T + 10)).gpus}["GPU-0"].allocations
    assert [(a.share_source, a.activity_share) for a in again] == [("equal", None), ("equal", None)]


def test_slurm_jobs_on_mps_mig_instance(tmp_path: Path) -> None:
    """Two Slurm jobs share a MIG instance through MPS: NVML has no per-process utilization
    there (NOT_SUPPORTED), the process list shows job 41's client only → job 41 gets it all."""
    _proc(tmp_path / "proc", 500, "0::/system.slice/slurmstepd.scope/job_41/step_0/user/task_0\n")
    gi = FakeMig("MIG-1", gi=1, gi_slices=3, ci_slices=3)
    fake = FakeNvml([FakeGpu("GPU-m", mig=[gi], mig_capable=True)])
    fake.processes["MIG-1"] = FakeProcs(procs=[FakeProc(500, 1 << 30, kind="mps", gi=1, ci=0)])
    jobs = tuple(Allocation(scheduler="slurm", id=j, share=0.5) for j in ("41", "42"))
    src = _source(tmp_path, fake, {"MIG-1": jobs})
    mig = next(g for g in _batch(src.collect(T)).gpus if g.uuid == "MIG-1")
    assert [(a.id, a.share_source, a.activity_share) for a in mig.allocations] == [
        ("41", "processes", 1.0), ("42", "processes", 0.0)]  # fmt: skip


@pytest.mark.parametrize("fault", ["list", "lost", "no-proc", "no-pods"])
def test_faults_give_equal_split_never_a_traceback(tmp_path: Path, fault: str) -> None:
    _node(tmp_path)
    fake = FakeNvml([FakeGpu("GPU-0")])
    fake.processes["GPU-0"] = FakeProcs(procs=[FakeProc(101), FakeProc(102)], samples=[(101, 5, 80)])
    if fault == "list":
        fake.processes["GPU-0"].errors = {"nvmlDeviceGetGraphicsRunningProcesses": pynvml.NVML_ERROR_UNKNOWN}
    shared = _pods("ml/busy", "ml/idle")
    src = _source(tmp_path, fake, {"GPU-0": shared})
    if fault == "lost":
        fake.gpus[0].lost = True
    if fault == "no-proc":
        src.holder_of = CgroupHolders(ProcCgroups(tmp_path / "nothing"), PodDirectory(tmp_path / "pods"))
    if fault == "no-pods":
        src.holder_of = CgroupHolders(ProcCgroups(tmp_path / "proc"), PodDirectory(tmp_path / "nothing"))
    row = _batch(src.collect(T)).gpus[0]
    assert [(a.share_source, a.activity_share) for a in row.allocations] == [("equal", None)] * 2
    assert row.healthy == (fault != "lost")


def test_without_a_proc_mapping_the_split_is_equal_and_flagged() -> None:
    fake = FakeNvml([FakeGpu("GPU-0")])
    fake.processes["GPU-0"] = FakeProcs(procs=[FakeProc(1)], samples=[(1, 5, 80)])
    src = NvmlSource("n", "c", 10.0, nvml=fake, boot_id="b",
                     attribution=StaticAttribution(lambda i, u: _pods("a/x", "b/y")))  # fmt: skip
    row = _batch(src.collect(T)).gpus[0]
    assert [a.share_source for a in row.allocations] == ["equal", "equal"]
    assert "nvmlDeviceGetComputeRunningProcesses" not in fake.gpus[0].calls


def test_node_agent_wires_the_split_and_counts_it(tmp_path: Path) -> None:
    """``gpuslo agent --source nvml --k8s-pod-resources ... --proc-root P --pod-log-dir D``: the
    NVML source maps pids through P and D; its counters reach /metrics' extra counts. With
    ``--proc-root ''`` there is no mapping (equal split, flagged)."""
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from gpuslo.app.cli import _node_options, build_parser

    _node(tmp_path)
    argv = ["agent", "--source", "nvml", "--node", "n1", "--k8s-pod-resources", str(tmp_path / "no.sock"),
            "--proc-root", str(tmp_path / "proc"), "--pod-log-dir", str(tmp_path / "pods")]  # fmt: skip
    opts: NodeOptions = _node_options(build_parser().parse_args(argv))
    fake = FakeNvml([FakeGpu("GPU-0")])
    agent = node_agent(opts, nvml=fake)
    src = agent.gpu
    assert isinstance(src, NvmlSource) and isinstance(src.holder_of, CgroupHolders)
    assert (src.holder_of(101), src.holder_of(102), src.holder_of(7)) == (
        ("k8s", "ml/busy"),
        ("k8s", "ml/idle"),
        None,
    )
    assert agent.extra is not None
    counts = agent.extra()
    assert {k for k in counts if "shared" in k or "process" in k} == {
        "gpuslo_agent_shared_rows_measured", "gpuslo_agent_shared_rows_by_processes",
        "gpuslo_agent_shared_rows_equal", "gpuslo_agent_processes_unattributed",
        "gpuslo_agent_process_lookup_failures"}  # fmt: skip
    assert {"gpuslo_agent_rows_oversubscribed", "gpuslo_agent_rows_holders_cut"} <= counts.keys()
    off = node_agent(
        _node_options(build_parser().parse_args([*argv, "--proc-root", ""])), nvml=FakeNvml([FakeGpu("G")])
    )
    assert isinstance(off.gpu, NvmlSource) and off.gpu.holder_of is None


def test_a_holder_named_twice_is_one_holder() -> None:
    """Job 5 listed twice in a mapping file (1/3 each), job 6 once (1/3); only job 5 ran (60 %
    SM). On paper: S = 1, all of it job 5's, split over its two equal entries: 1/2 each; job 6 0."""
    allocs = tuple(Allocation(scheduler="slurm", id=j, share=1 / 3) for j in ("5", "5", "6"))
    out = split(allocs, ProcView({1: 0}, {1: 60.0}), lambda pid: ("slurm", "5"))
    assert [a.activity_share for a in out] == pytest.approx([0.5, 0.5, 0.0])


def test_clock_going_back_does_not_blind_the_utilization() -> None:
    """NVML's samples carry CPU timestamps (µs). After the host's clock goes back an hour the
    new samples are older than the newest seen: they would never count again; the reader
    starts from NVML's buffer instead."""
    now = [T]
    fake, p = _gpu_with()
    p.procs, p.samples = [FakeProc(1)], [(1, int(T * 1e6), 40)]
    r = NvmlProcesses(fake, clock=lambda: now[0])
    assert r.read("GPU-0", _handle(fake)).sm == {1: 40.0}  # type: ignore[union-attr]
    now[0] = T - 3600
    p.samples = [(1, int((T - 3590) * 1e6), 70)]  # the buffer after the jump
    assert r.read("GPU-0", _handle(fake)).sm == {1: 70.0}  # type: ignore[union-attr]
    assert r.read("GPU-0", _handle(fake)).sm == {}  # type: ignore[union-attr]  # and counts it once


@pytest.mark.parametrize("n", [2, 3, 63, 64, 65, 200])
@pytest.mark.parametrize("shares", ["whole", "thirds", "mixed", "tiny"])
@pytest.mark.parametrize("measured", [False, True])
def test_holders_that_do_not_fit_a_gpu_are_made_to(n: int, shares: str, measured: bool) -> None:
    """Whatever an attribution names on one GPU (n holders, each holding all of it, a third, a
    mix, or tiny parts), the row the split makes is one the wire takes: at most 64 holders,
    shares adding up to at most 1, each holder's part of the others as named; counted."""
    share = {"whole": lambda k: 1.0, "thirds": lambda k: 1 / 3, "mixed": lambda k: (k % 7 + 1) / 7,
             "tiny": lambda k: 1e-3}[shares]  # fmt: skip
    allocs = tuple(Allocation(scheduler="slurm", id=str(k), share=share(k)) for k in range(n))
    view = ProcView(
        fb_bytes={100 + k: 1 << 20 for k in range(n)}, sm={100 + k: float(k % 5) for k in range(n)}
    )
    stats = SplitStats()
    out = split(allocs, view if measured else None, lambda pid: ("slurm", str(pid - 100)), stats)
    sample = _sample(out)
    assert decode(encode(sample)) == sample  # the wire takes it
    total = sum(a.share for a in allocs)
    assert len(out) == min(n, 64) and stats.cut == (n > 64)
    kept = sorted(allocs, key=lambda a: -a.share)[:64] if n > 64 else list(allocs)
    kept_total = sum(a.share for a in kept)
    assert stats.oversubscribed == (kept_total > 1 + 1e-6)
    scale = 1 / kept_total if kept_total > 1 + 1e-6 else 1.0
    by_id = {a.id: a.share for a in kept}
    for a in out:  # each holder keeps its part of the others
        assert a.share == pytest.approx(by_id[a.id] * scale, rel=1e-9)
    assert sum(a.share for a in out) <= 1.0 + 1e-9
    if total <= 1 + 1e-6 and n <= 64:
        assert [a.share for a in out] == [a.share for a in allocs]  # what fits is left as it is


def _sample(allocs: tuple[Allocation, ...]) -> GpuSampleBatch:
    from gpuslo.wire import GpuSample

    return GpuSampleBatch(source="n", boot_id="b", seq=0, cluster="c", ts=1.8e9, node="n", interval_s=10.0,
                          gpus=(GpuSample(index=0, uuid="G", allocations=allocs),))  # fmt: skip


def test_one_gpu_over_held_costs_the_node_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Two jobs given GPU 0 (each all of it), 70 on GPU 1: both rows are sent, scaled and cut,
    GPU 2's holder as it is; counted per row, said once per GPU (it was the whole batch refused,
    every tick: the node's telemetry lost)."""
    holders = {
        "GPU-0": tuple(Allocation(scheduler="slurm", id=j, share=1.0) for j in ("1", "2")),
        "GPU-1": tuple(Allocation(scheduler="slurm", id=str(j), share=1.0) for j in range(70)),
        "GPU-2": (Allocation(scheduler="slurm", id="9", share=1.0),),
    }
    fake = FakeNvml([FakeGpu("GPU-0"), FakeGpu("GPU-1"), FakeGpu("GPU-2")])
    src = NvmlSource("node-1", "prod", 10.0, nvml=fake, boot_id="b",
                     attribution=StaticAttribution(lambda i, uuid: holders.get(uuid, ())))  # fmt: skip
    with caplog.at_level("WARNING"):
        for tick in range(3):
            batch = src.collect(1.8e9 + 10 * tick)[0]
            assert isinstance(batch, GpuSampleBatch) and decode(encode(batch)) == batch
    rows = {g.uuid: g.allocations for g in batch.gpus}
    assert [(a.id, a.share) for a in rows["GPU-0"]] == [("1", 0.5), ("2", 0.5)]
    assert len(rows["GPU-1"]) == 64 and sum(a.share for a in rows["GPU-1"]) == pytest.approx(1.0)
    assert [(a.id, a.share, a.share_source) for a in rows["GPU-2"]] == [("9", 1.0, "sole")]
    assert (src.split_stats.oversubscribed, src.split_stats.cut) == (6, 3)  # 2 rows a tick; 1 cut
    said = [r.getMessage() for r in caplog.records if "attribution names" in r.getMessage()]
    assert len(said) == 2 and "GPU-0" in said[0] and "GPU-1" in said[1], said

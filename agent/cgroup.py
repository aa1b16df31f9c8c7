"""A process's holder (a Kubernetes pod or a Slurm job) from its cgroup.

``/proc/PID/cgroup`` has one ``hierarchy:controllers:path`` line per hierarchy (cgroup v1)
or the single ``0::path`` line (v2). The path names the holder in every layout the kubelet
and slurmd make:

- Kubernetes, systemd cgroup driver: ``…/kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid with _ for ->.slice/cri-containerd-<id>.scope`` (``crio-``,
  ``docker-``; guaranteed pods have no QoS level: ``kubepods-pod<uid>.slice``);
- Kubernetes, cgroupfs driver: ``/kubepods/burstable/pod<uid>/<container id>``
  (``/kubepods/pod<uid>/…`` for guaranteed pods);
- Slurm, cgroup v1: ``/slurm/uid_<uid>/job_<id>/step_<step>/…`` (``slurm_<node>/`` where
  several slurmd share a host);
- Slurm, cgroup v2: ``/system.slice/slurmstepd.scope/job_<id>/step_<step>/…``
  (``<node>_slurmstepd.scope`` where Slurm is built with ``--enable-multiple-slurmd``; Slurm's
  cgroup_v2 page; any slice above it, as ``CgroupSlice`` or a containerised slurmd makes it).

A path seen from inside another cgroup namespace starts ``/../..``; only the named parts
count, so it reads the same. Nothing below ``user@<uid>.service`` names a holder: that is the
subtree systemd delegates to an unprivileged user (``Delegate=yes``), who may make any cgroup
there, ``slurm/uid_0/job_7`` or ``kubepods/pod<uid>`` included. Job ids and uids are ASCII
digits, as Slurm writes them (a path's other digits, ``٤٢``, name nobody). A pod UID is 36 characters (8-4-4-4-12 hex), or for a static
pod the 32 hex digits of its config hash.

The kubelet's PodResources API names pods by namespace/name, not UID: :class:`PodDirectory`
reads the UID → namespace/name map from the kubelet's pod log directories
(``/var/log/pods/<namespace>_<name>_<uid>``; namespaces and pod names are DNS labels and
subdomains, which have no ``_``, so the split is unambiguous).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_CGROUP_BYTES = 64 * 1024  # far above any real file: a longer one is read this far, its cut line dropped
MAX_LINE = 4096  # PATH_MAX: no cgroup the kernel shows is longer; a longer line is nobody's
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
# path segments (each matched whole, once: linear in the line, whatever it holds)
_KUBEPODS = re.compile(r"(?:[^/]*-)?kubepods(?:[-.][^/]*)?")  # kubepods, kubepods.slice, kubelet-kubepods-…
_POD = re.compile(rf"(?:[^/]*-)?pod({_UID})(?:\.slice)?")  # pod<uid>, kubepods-burstable-pod<uid>.slice
_SLURM_ROOT = re.compile(r"slurm[^/]*")  # slurm, slurm_<node>
_STEPD_SCOPE = re.compile(r"(?:[^/]+_)?slurmstepd\.scope")  # slurmstepd.scope, <node>_slurmstepd.scope
_UID_DIR = re.compile(r"uid_[0-9]+")
_JOB = re.compile(r"job_([0-9]{1,20})")
_USER_MANAGER = re.compile(r"user@[0-9]+\.service")  # systemd's per-user manager: delegated to the user
_LOG_DIR = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)_([a-z0-9]([-.a-z0-9]*[a-z0-9])?)_({_UID})$")


@dataclass(frozen=True, slots=True)
class CgroupHolder:
    """Who a process belongs to: ``k8s`` and a pod UID (dashes), or ``slurm`` and a job id."""

    scheduler: str
    key: str


def holder_of_cgroup(text: str) -> CgroupHolder | None:
    """The holder named by the contents of a ``/proc/PID/cgroup`` file; None for a process
    outside any pod or job (the host's, a system service), or when the lines name two
    different holders (a file nobody should trust)."""
    found: set[CgroupHolder] = set()
    for line in text.splitlines():
        if len(line) > MAX_LINE:
            continue
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if (h := _holder_of_path(parts[2].split("/"))) is not None:
            found.add(h)
    return found.pop() if len(found) == 1 else None


def _holder_of_path(segs: list[str]) -> CgroupHolder | None:
    """The holder the kubelet's or slurmd's segments name. The one nearest the root counts: a
    holder that may create cgroups below its own cannot pass for another by naming one there,
    nor can a user in the subtree systemd delegates to them."""
    for i, seg in enumerate(segs):
        if _USER_MANAGER.fullmatch(seg):
            return None
        if _KUBEPODS.fullmatch(seg):
            for s in segs[i:]:
                if (m := _POD.fullmatch(s)) is not None:
                    return CgroupHolder("k8s", m.group(1).replace("_", "-"))
            return None
        job = None
        if _STEPD_SCOPE.fullmatch(seg) and i + 1 < len(segs):
            job = _JOB.fullmatch(segs[i + 1])
        elif _SLURM_ROOT.fullmatch(seg) and i + 2 < len(segs) and _UID_DIR.fullmatch(segs[i + 1]):
            job = _JOB.fullmatch(segs[i + 2])
        if job is not None:
            return CgroupHolder("slurm", str(int(job.group(1))))
    return None


class ProcCgroups:
    """pid → holder by reading ``<proc_root>/<pid>/cgroup`` (``proc_root``: the host's /proc,
    e.g. ``/proc`` with ``hostPID: true`` or a hostPath mount at ``/host/proc``). Each pid is
    read once per tick (:meth:`new_tick` forgets); a pid that is gone or unreadable has no
    holder and is counted."""

    def __init__(self, proc_root: str | Path = "/proc") -> None:
        self.proc_root = Path(proc_root)
        self.unreadable = 0
        self._cache: dict[int, CgroupHolder | None] = {}
        self._logged = False

    def new_tick(self) -> None:
        self._cache.clear()  # pids are reused: never keep a mapping across ticks

    def __call__(self, pid: int) -> CgroupHolder | None:
        if pid in self._cache:
            return self._cache[pid]
        self._cache[pid] = h = self._read(pid)
        return h

    def _read(self, pid: int) -> CgroupHolder | None:
        if not 0 < pid < 2**31:
            return None
        try:
            with open(self.proc_root / str(pid) / "cgroup", "rb") as f:
                raw = f.read(MAX_CGROUP_BYTES)
        except OSError as exc:  # exited since NVML listed it, or /proc not the host's
            self.unreadable += 1
            if not self._logged:
                self._logged = True
                log.warning("cannot read %s/%d/cgroup: %s (is the host's /proc mounted and the agent "
                            "in the host's pid namespace? logged once; counted)", self.proc_root, pid, exc)  # fmt: skip
            return None
        if len(raw) == MAX_CGROUP_BYTES and not raw.endswith(b"\n"):
            # cut at the limit: the last line's path is a prefix of its own (``job_12`` of
            # ``job_1234``), which would name another holder; only whole lines count
            raw = raw[: raw.rfind(b"\n") + 1]
        return holder_of_cgroup(raw.decode("utf-8", "replace"))


class PodDirectory:
    """Pod UID → ``namespace/name`` from the kubelet's pod log directories (``root``, default
    ``/var/log/pods``). Listed again when a UID is not known, at most once per tick."""

    def __init__(
        self, root: str | Path = "/var/log/pods", listdir: Callable[[Path], list[str]] | None = None
    ) -> None:
        self.root = Path(root)
        self._listdir = listdir or (lambda p: os.listdir(p))
        self._names: dict[str, str] = {}
        self._listed_this_tick = False
        self.failures = 0

    def new_tick(self) -> None:
        self._listed_this_tick = False

    def __call__(self, uid: str) -> str | None:
        if uid not in self._names and not self._listed_this_tick:
            self._listed_this_tick = True
            self._relist()
        return self._names.get(uid)

    def _relist(self) -> None:
        try:
            entries = self._listdir(self.root)
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("cannot list the kubelet's pod log directory %s: %s (pods' processes are "
                            "not mapped to pods; logged once, counted)", self.root, exc)  # fmt: skip
            return
        names: dict[str, str] = {}
        for e in entries:
            m = _LOG_DIR.match(e)
            if m is not None:
                names[m.group(5).replace("_", "-")] = f"{m.group(1)}/{m.group(3)}"
        self._names = names

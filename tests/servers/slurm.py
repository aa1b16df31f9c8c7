"""A real one-node Slurm cluster (Debian slurm-wlm 22.05 + munge) for the integration
tests: munged, slurmctld and slurmd as root on free ports, 16 declared CPUs, 4 GPUs as
gres whose ``File=`` entries are empty files standing in for /dev/nvidia[0-3].

With ``devices``, the node's GPU gres are typed records in that order, one gres.conf line
each (``Type=h100`` for a whole GPU, ``Type=<profile>`` for a MIG device, whose ``File=``
is a fake ``nvidia-caps/nvidia-cap<minor>``), as Slurm's AutoDetect=nvml would list them.

With ``nodes`` > 1, several simulated GPU nodes (``gpunode1`` … ``gpunodeN``, ``gpus`` each):
one slurmd per node on this host, started with ``-N <name>``, each on its own ``Port=`` with
its own spool, pid and log files (Slurm's ``%n``) and its own fake device files. ``scheduler``
is the ``SchedulerType`` (``sched/backfill``, Slurm's default, or ``sched/builtin``: strict
priority order); ``scheduler_parameters`` the ``SchedulerParameters`` line (none by default).

``nics`` adds that many ``nic`` gres (a gres that is no GPU, with device files of its own) and
``shards`` ``shard`` gres on some GPUs (GPU position → shards on it), to the one-node cluster
without typed devices.

``gpu_files``: the one-node cluster's gres.conf GPU lines, one ``File=`` each (under the
cluster's dev/, Slurm's hostlist form: ``nvidia[2-3]``), in that order, ``gpus`` of them in all;
the stand-ins ``dev/nvidia0`` … ``dev/nvidia7`` are then character devices of NVIDIA's major
(195) and minor N, as the driver's are (slurmd only stats them), and slurmd logs with
``DebugFlags=Gres`` each device it numbered, in its bitmap's order (``gpu device number
N(<path>):c 195:N``)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

from tests.servers.ports import free_port
from tests.servers.tool import run_tool


def available() -> bool:
    return all(shutil.which(x) for x in ("slurmctld", "slurmd", "munged", "mungekey", "squeue"))


class SlurmCluster:
    def __init__(self, workdir: Path, gpus: int = 4, devices: list[tuple[str, str]] | None = None,
                 type_order: list[str] | None = None, nodes: int = 1, scheduler: str = "sched/backfill",
                 scheduler_parameters: str = "", nics: int = 0,
                 shards: dict[int, int] | None = None, gpu_files: list[str] | None = None,
                 gpu_line: str = "NodeName={node} Name=gpu File={file}") -> None:  # fmt: skip
        """``devices``: (gres type, device file name under the cluster's dev/) per gres record;
        ``type_order``: the order of the types in the node's ``Gres=`` (default: as they come);
        ``gpu_line``: how each of ``gpu_files``' gres.conf lines is written ({node}, {file})."""
        if nodes > 1 and devices:
            raise ValueError("typed devices are for the one-node cluster")
        if (nics or shards) and (nodes > 1 or devices):
            raise ValueError("nics and shards are for the one-node cluster without typed devices")
        if gpu_files and (nodes > 1 or devices or nics or shards):
            raise ValueError("gpu_files are for the one-node cluster of untyped GPUs")
        self.gpu_files = gpu_files
        self.gpu_line = gpu_line
        self.nics = nics
        self.shards = shards or {}
        self.dir = workdir
        self.type_order = type_order
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host] if nodes == 1 else [f"gpunode{i}" for i in range(1, nodes + 1)]
        self.node = self.nodes[0]
        self.scheduler = scheduler
        self.scheduler_parameters = scheduler_parameters
        self.devices = devices
        self.gpus = len(devices) if devices else gpus
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = dict(os.environ, SLURM_CONF=str(workdir / "slurm.conf"))

    def start(self, timeout_s: float = 60.0) -> None:
        d = self.dir
        for sub in ("dev", "state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for name in self._device_files():
            (d / "dev" / name).parent.mkdir(parents=True, exist_ok=True)
            if self.gpu_files:
                (d / "dev" / name).unlink(missing_ok=True)
                os.mknod(d / "dev" / name, 0o600 | stat.S_IFCHR, os.makedev(195, int(name[len("nvidia") :])))
            else:
                (d / "dev" / name).touch()
        run_tool(["mungekey", "--create", f"--keyfile={d}/munge.key", "--force"])
        os.chmod(d / "munge.key", 0o600)
        self._spawn(["munged", "--foreground", "--force", f"--socket={d}/munge.sock", f"--key-file={d}/munge.key",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge.seed"])  # fmt: skip
        self._wait(lambda: (d / "munge.sock").exists(), timeout_s, "munged")
        (d / "slurm.conf").write_text(self._slurm_conf())
        (d / "gres.conf").write_text(self._gres_conf())
        self._spawn(["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")])
        for n in self.nodes:
            self._spawn(["slurmd", "-D", "-f", str(d / "slurm.conf")] + (["-N", n] if self.multi else []))
        self._wait(self._idle, timeout_s, "slurmd to register as idle")

    @property
    def multi(self) -> bool:
        return self.nodes != [self.host]

    def _slurm_conf(self) -> str:
        d = self.dir
        sched = f"SchedulerParameters={self.scheduler_parameters}\n" if self.scheduler_parameters else ""
        if self.multi:  # one slurmd per node: its own port and files
            daemon = f"SlurmdSpoolDir={d}/spool/%n\nSlurmdPidFile={d}/slurmd-%n.pid\nSlurmdLogFile={d}/log/slurmd-%n.log\n"
            nodes = "".join(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=16 "
                            f"RealMemory=4000 Gres={self._node_gres()} State=UNKNOWN\n" for n in self.nodes)  # fmt: skip
        else:
            daemon = (
                f"SlurmdSpoolDir={d}/spool\nSlurmdPidFile={d}/slurmd.pid\nSlurmdLogFile={d}/log/slurmd.log\n"
            )
            nodes = f"NodeName={self.node} CPUs=16 RealMemory=4000 Gres={self._node_gres()} State=UNKNOWN\n"
        return f"""ClusterName=gpuslo
SlurmctldHost={self.host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/log/slurmctld.log
{daemon}ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType={self.scheduler}
{sched}SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes={self._gres_types()}
SlurmdParameters=config_overrides
{"DebugFlags=Gres" + chr(10) + "SlurmdDebug=verbose" + chr(10) if self.gpu_files else ""}MinJobAge=600
{nodes}PartitionName=gpu Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""

    def _gres_types(self) -> str:
        return ",".join(["gpu", *(["nic"] if self.nics else []), *(["shard"] if self.shards else [])])

    def _device_files(self) -> list[str]:
        if self.gpu_files:
            return [f"nvidia{i}" for i in range(8)]
        if self.devices:
            return [f for _, f in self.devices]
        nics = [f"nic{i}" for i in range(self.nics)]
        sub = [f"{n}/" for n in self.nodes] if self.multi else [""]
        return [f"{s}nvidia{i}" for s in sub for i in range(self.gpus)] + nics

    def _node_gres(self) -> str:
        if not self.devices:
            extra = (f",nic:{self.nics}" if self.nics else "") + (
                f",shard:{sum(self.shards.values())}" if self.shards else ""
            )
            return f"gpu:{self.gpus}{extra}"
        counts: dict[str, int] = {}
        for t, _ in self.devices:
            counts[t] = counts.get(t, 0) + 1
        return ",".join(f"gpu:{t}:{counts[t]}" for t in self.type_order or counts)

    def _gres_conf(self) -> str:
        d = self.dir
        if self.gpu_files:
            return "".join(
                self.gpu_line.format(node=self.node, file=f"{d}/dev/{f}") + "\n" for f in self.gpu_files
            )
        if not self.devices:
            sub = {n: f"{n}/" if self.multi else "" for n in self.nodes}
            extra = (
                f"NodeName={self.node} Name=nic File={d}/dev/nic[0-{self.nics - 1}]\n" if self.nics else ""
            )
            extra += "".join(f"NodeName={self.node} Name=shard Count={n} File={d}/dev/nvidia{g}\n"
                             for g, n in sorted(self.shards.items()))  # fmt: skip
            return (
                "".join(
                    f"NodeName={n} Name=gpu File={d}/dev/{sub[n]}nvidia[0-{self.gpus - 1}]\n"
                    for n in self.nodes
                )
                + extra
            )
        return "".join(f"NodeName={self.node} Name=gpu Type={t} File={d}/dev/{f}\n" for t, f in self.devices)

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{argv[0]}.out", "ab")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )

    def _wait(self, ok: object, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():  # type: ignore[operator]
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-1500:] for p in (self.dir / "log").iterdir())
                raise RuntimeError(f"timed out waiting for {what}:\n{logs}")
            time.sleep(0.3)

    def _idle(self) -> bool:
        r = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=self.env, check=False
        )
        return r.returncode == 0 and sorted(r.stdout.split()) == sorted(
            [*self.nodes, *["idle"] * len(self.nodes)]
        )

    def run(self, *argv: str) -> str:
        return run_tool(argv, env=self.env, timeout=30)

    def sbatch(self, gpus: int | str, name: str, account: str = "research", nodes: int = 1, wrap: str = "sleep 600",
               time_min: int | None = None, gres: str | None = None) -> str:  # fmt: skip
        """``gpus``: a count per node, or a typed request (``1g.10gb:1``), or with ``gres=`` the
        whole ``--gres`` (``gpu:1,nic:1``, ``shard:1``); ``time_min``: the job's time limit
        (``--time``, whole minutes: Slurm keeps no seconds)."""
        limit = [f"--time={time_min}"] if time_min is not None else []
        want = gres if gres is not None else f"gpu:{gpus}"
        out = self.run("sbatch", "--parsable", "-A", account, "-J", name, f"--gres={want}", "-N", str(nodes),
                       *limit, f"--output={self.dir}/log/slurm-%j.out", "--wrap", wrap)  # fmt: skip
        return out.strip().split(";")[0]

    def probe(self) -> str:
        """A GPU-less job that runs at once (see ``probed``); its id."""
        out = self.run("sbatch", "--parsable", "-J", "probe", "-N", "1", f"--output={self.dir}/log/slurm-%j.out",
                       "--wrap", "true")  # fmt: skip
        return out.strip().split(";")[0]

    def probed(self, job: str) -> bool:
        """The probe job ran and every node is idle again: the scheduler has made its passes (a
        fresh slurmctld may start its first job a few seconds late) and nothing is completing."""
        out = self.run("scontrol", "show", "job", "-o", job)
        return "JobState=COMPLETED" in out and self._idle()

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs.clear()


def bitmap(text: str) -> list[int]:
    """Slurm's bitmap text (``0,2-3``) → positions, read by the tests apart from the code under test."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out

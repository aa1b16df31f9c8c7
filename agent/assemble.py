"""A node agent put together from its options: the GPU source (NVML, or an existing
dcgm-exporter) with its attribution (Slurm jobs or Kubernetes pods), the node's pool, the
scheduler heartbeat, latency scrapes; the sink (Kafka through the disk spool, or JSON
lines); the runner on the wall clock with the agent's own ``/metrics``.

The CLI parses flags into :class:`NodeOptions` and reports :class:`SetupError` as it
likes; nothing here prints or exits."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuslo.agent.base import Attribution, Sink, Source
from gpuslo.agent.pool import DEFAULT_NODE_POOL_LABELS, K8sNodePool, NodePool
from gpuslo.agent.runner import Clock, Runner, WallClock
from gpuslo.wire import Message
from gpuslo.wire.dcgm_names import DEFAULT_GENERATION, GENERATIONS

if TYPE_CHECKING:
    from gpuslo.agent.k8s_watch import KubeApi
    from gpuslo.agent.procsplit import CgroupHolders
    from gpuslo.agent.scrape import LatencyTarget
    from gpuslo.core.metrics_http import MetricsServer
    from gpuslo.core.proc import Children
    from gpuslo.core.settings import ServiceConfig

log = logging.getLogger(__name__)

Extra = Callable[[], dict[str, float]]


class SetupError(Exception):
    """The agent cannot be put together (no NVML, a sink it cannot open); the message says why."""


@dataclass(frozen=True)
class NodeOptions:
    """What a node agent is made of (``gpuslo agent --source nvml|dcgm|latency``)."""

    source: str  # nvml, dcgm or latency
    node: str
    cluster: str
    interval_s: float
    pool: str = ""  # explicit: wins over the scheduler's
    pool_labels: tuple[str, ...] = ()
    slurm: bool = False
    hpc_job_mapping_dir: Path | None = None
    # the node's gres.conf: where Slurm's gres IDX are placed on NVML's GPUs (None: IDX = index)
    slurm_gres_conf: Path | None = None
    # squeue/sinfo asked of slurmctld at most once per this many seconds (0: every tick), their
    # answers shared by the attribution and the heartbeat (agent.slurm.Answers)
    slurm_refresh_s: float = 0.0
    k8s_pod_resources: str | None = None
    k8s_api: bool = False  # an API server was named: the Node's pool label is read from it
    k8s_resource_slices: bool = False  # DRA: resolve claim devices through this node's ResourceSlices
    dcgm_url: str = "http://localhost:9400/metrics"
    dcgm_node: str | None = None  # dcgm: the node name, else the exporter's hostname (or Hostname) label
    dcgm_mig_slices: int = 7
    latency: tuple[LatencyTarget, ...] = ()
    # shared GPUs split by their holders' processes: the host's /proc (None: equal split) and
    # the kubelet's pod log directories (pod UID → namespace/name), agent.procsplit
    proc_root: Path | None = Path("/proc")
    pod_log_dir: Path = Path("/var/log/pods")


@dataclass
class NodeAgent:
    """The sources of one node; ``gpu`` is the GPU source among them (None: latency only)."""

    sources: list[Source]
    gpu: Source | None = None
    extra: Extra | None = None
    ngpus: int = 0
    notes: list[str] = field(default_factory=list)  # what the operator should know (printed by the CLI)
    closers: list[Callable[[], None]] = field(default_factory=list)  # background watchers to stop at exit


def attribution_for(
    o: NodeOptions, stop: threading.Event | None = None, children: Children | None = None
) -> Attribution | None:
    """Slurm jobs (``squeue --json``, or dcgm-exporter's HPC job mapping directory) or
    Kubernetes pods (the kubelet's PodResources socket); None without either. ``stop``: the
    run's stop (ends a tick's wait for an answer); ``children``: the run's child processes
    (Slurm's commands, killed when the run ends)."""
    if o.slurm or o.hpc_job_mapping_dir:
        from gpuslo.agent.inflight import WAIT_SHARE
        from gpuslo.agent.slurm import Answers, SlurmAttribution, SlurmCli

        # a slurmctld slow to answer must not hold the tick (the samples not taken are capacity lost)
        return SlurmAttribution(o.node, cli=SlurmCli(answers=Answers(o.slurm_refresh_s), children=children),
                                mapping_dir=o.hpc_job_mapping_dir, gres_conf=o.slurm_gres_conf,
                                wait_s=WAIT_SHARE * o.interval_s, stop=stop)  # fmt: skip
    if o.k8s_pod_resources:
        from gpuslo.agent.inflight import WAIT_SHARE
        from gpuslo.agent.k8s import PodResourcesAttribution

        # a kubelet slow to answer must not hold the tick (the samples not taken are capacity lost)
        return PodResourcesAttribution(o.k8s_pod_resources, wait_s=WAIT_SHARE * o.interval_s, stop=stop)
    return None


def process_holders(o: NodeOptions, attribution: Attribution | None) -> CgroupHolders | None:
    """pid → holder for the split of shared GPUs (None without an attribution or a /proc)."""
    if attribution is None or o.proc_root is None:
        return None
    from gpuslo.agent.cgroup import PodDirectory, ProcCgroups
    from gpuslo.agent.procsplit import CgroupHolders

    pods = PodDirectory(o.pod_log_dir) if o.k8s_pod_resources else None
    return CgroupHolders(ProcCgroups(o.proc_root), pods)


def _nvml_source(
    o: NodeOptions, pool: NodePool, attribution: Attribution | None, nvml: Any
) -> tuple[Source, Extra, int]:
    import pynvml

    from gpuslo.agent.nvml import NvmlSource

    holders = process_holders(o, attribution)
    try:
        src = NvmlSource(node=o.node, cluster=o.cluster, interval_s=o.interval_s, nvml=nvml, pool=pool,
                         attribution=attribution, holder_of=holders)  # fmt: skip
    except pynvml.NVMLError as exc:
        raise SetupError(f"cannot start NVML on {o.node}: {exc} (is the NVIDIA driver installed and "
                         "/dev/nvidia* visible to this process?)") from None  # fmt: skip

    def extra() -> dict[str, float]:
        split, procs = src.split_stats, src.procs.stats
        out: dict[str, float] = {
            "gpuslo_agent_fields_unsupported": src.stats.unsupported + procs.unsupported,
            "gpuslo_agent_nvml_errors": src.stats.errors + procs.errors,
            "gpuslo_agent_gpus_lost": src.stats.lost,
            "gpuslo_agent_shared_rows_measured": split.measured,
            "gpuslo_agent_shared_rows_by_processes": split.by_processes,
            "gpuslo_agent_shared_rows_equal": split.equal,
            "gpuslo_agent_processes_unattributed": split.unmapped,
            "gpuslo_agent_rows_oversubscribed": split.oversubscribed,
            "gpuslo_agent_rows_holders_cut": split.cut,
        }
        if holders is not None:
            pods = holders.pods.failures if holders.pods is not None else 0
            out["gpuslo_agent_process_lookup_failures"] = holders.cgroups.unreadable + pods
        return out

    return src, extra, len(src.gpus)


def _dcgm_source(o: NodeOptions, pool: NodePool) -> tuple[Source, Extra, int]:
    from gpuslo.agent.scrape import DcgmExporterSource

    src = DcgmExporterSource(o.dcgm_url, o.cluster, o.interval_s, node=o.dcgm_node, pool=pool,
                             mig_slices=o.dcgm_mig_slices)  # fmt: skip
    return src, lambda: {"gpuslo_agent_scrape_failures": src.stats.failures,
                         "gpuslo_agent_scrape_ignored_series": src.stats.ignored_series,
                         "gpuslo_agent_scrape_dropped_values": src.stats.dropped,
                         "gpuslo_agent_scrape_refused_series": src.stats.refused}, 0  # fmt: skip


def node_agent(
    o: NodeOptions, kube_api: Callable[[], KubeApi | None] = lambda: None, nvml: Any = None,
    stop: threading.Event | None = None, children: Children | None = None,
) -> NodeAgent:  # fmt: skip
    """The sources of a node agent. ``kube_api``: the API server for the Node's pool label
    (asked only when the pool comes from Kubernetes; None outside a cluster). ``nvml``: the
    NVML module (default pynvml). ``stop``: the run's stop, which ends every wait of a tick for
    a slow dependency's answer (:class:`~gpuslo.agent.inflight.InFlight`); ``children``: the
    run's child processes (:class:`~gpuslo.core.proc.Children`, closed by the caller when the
    run ends: a Slurm command still running is killed then)."""
    agent = NodeAgent(sources=[])
    pool = NodePool(o.pool)
    if o.source in ("nvml", "dcgm"):
        # dcgm-exporter attributes from its own labels; only the NVML source takes ours
        attribution = attribution_for(o, stop, children) if o.source == "nvml" else None
        if o.k8s_resource_slices:
            _k8s_resource_slices(o, attribution, kube_api, agent)
        if not o.pool and not o.slurm and (o.k8s_pod_resources or o.k8s_api):
            _k8s_node_pool(o, pool, kube_api, agent.notes)
        src, agent.extra, agent.ngpus = (
            _nvml_source(o, pool, attribution, nvml) if o.source == "nvml" else _dcgm_source(o, pool)
        )
        agent.extra = _with_attribution_counts(agent.extra, attribution)
        if o.slurm or o.hpc_job_mapping_dir:
            from gpuslo.agent.inflight import WAIT_SHARE
            from gpuslo.agent.slurm import Answers, SlurmAttribution, SlurmCli, SlurmNodeSource

            # the attribution's answers: one sinfo a period for both
            answers = attribution.cli.answers if isinstance(attribution, SlurmAttribution) else None
            cli = SlurmCli(answers=answers or Answers(o.slurm_refresh_s), children=children)
            node = SlurmNodeSource(o.node, o.cluster, o.interval_s, agent.ngpus, cli=cli, pool=pool,
                                   wait_s=WAIT_SHARE * o.interval_s, stop=stop)  # fmt: skip
            agent.sources.append(node)
            before = agent.extra
            agent.extra = lambda: {**before(), "gpuslo_agent_slurm_node_slow": node.slow,
                                   "gpuslo_agent_slurm_node_failures": node.cli.failures}  # fmt: skip
        agent.sources.append(src)  # any place in the list: the sources that stamp the pool learn it
        agent.gpu = src
    if o.latency:
        from gpuslo.agent.scrape import LatencySource

        try:
            agent.sources.append(LatencySource(list(o.latency), o.cluster, f"{o.node}-latency"))
        except ValueError as exc:  # a unit it does not know, a target given twice
            raise SetupError(str(exc)) from None
    return agent


def _with_attribution_counts(extra: Extra, attribution: Attribution | None) -> Extra:
    from gpuslo.agent.k8s import PodResourcesAttribution
    from gpuslo.agent.slurm import SlurmAttribution

    if isinstance(attribution, SlurmAttribution):  # squeue jobs (and mapping files) it could not read
        slurm = attribution
        return lambda: {**extra(), "gpuslo_agent_slurm_jobs_skipped": slurm.skipped,
                        "gpuslo_agent_slurm_gres_unmapped": slurm.unmapped,
                        "gpuslo_agent_slurm_slow": slurm.slow,
                        "gpuslo_agent_slurm_failures": slurm.cli.failures}  # fmt: skip
    if not isinstance(attribution, PodResourcesAttribution):
        return extra
    a = attribution
    # with --k8s-resource-slices: watch lines of this node's ResourceSlices that were not events
    dra: Callable[[], dict[str, float]] = (
        (lambda: {"gpuslo_agent_dra_watch_bad_lines": a.resolve.bad_lines})  # type: ignore[union-attr]
        if hasattr(a.resolve, "bad_lines") else dict
    )  # fmt: skip
    return lambda: {**extra(), "gpuslo_agent_pod_resources_failures": a.failures,
                    "gpuslo_agent_pod_resources_slow": a.slow, "gpuslo_agent_dra_devices_unresolved": a.unresolved_seen, **dra()}  # fmt: skip


def _k8s_resource_slices(
    o: NodeOptions, attribution: Attribution | None, kube_api: Callable[[], KubeApi | None], agent: NodeAgent
) -> None:
    """DRA: this node's ResourceSlices watched (a thread of their own), resolving the claim
    devices PodResources names to GPU and MIG UUIDs."""
    from gpuslo.agent.dra import ResourceSliceIndex
    from gpuslo.agent.k8s import PodResourcesAttribution

    if not isinstance(attribution, PodResourcesAttribution):
        agent.notes.append("--k8s-resource-slices needs --source nvml with --k8s-pod-resources; ignored")
        return
    api = kube_api()
    if api is None:
        agent.notes.append("no API server: DRA claim devices stay unattributed; give --k8s-api")
        return
    index = ResourceSliceIndex(api, o.node)
    try:  # listed before the first tick: the devices of running pods resolve from the start
        index.sync_once()
    except Exception as exc:  # contained: the watch thread retries (a 403 says what it needs)
        agent.notes.append(f"this node's ResourceSlices not listed yet ({exc}); retrying in the background")
    index.start()
    attribution.resolve = index
    agent.closers.append(index.close)


def _k8s_node_pool(
    o: NodeOptions, pool: NodePool, kube_api: Callable[[], KubeApi | None], notes: list[str]
) -> K8sNodePool | None:
    """The learner that keeps ``pool`` at the Node's pool label, attached to it (none
    outside a cluster)."""
    api = kube_api()
    if api is None:
        notes.append("the node's pool stays unknown; give --pool")
        return None
    return K8sNodePool(pool, api, o.node, o.pool_labels or DEFAULT_NODE_POOL_LABELS)


def sample_once(src: Source, interval_s: float, sleep: Callable[[float], None] = time.sleep) -> list[Message]:
    """``agent --once``: two samples (GPM profiling metrics need two), the second returned."""
    src.collect(time.time())
    sleep(min(1.0, interval_s))
    return src.collect(time.time())


def kafka_sink(settings: ServiceConfig) -> Sink:
    """Kafka through the disk spool (raises :class:`~gpuslo.agent.spool.SpoolError` for a
    spool directory it cannot use)."""
    from gpuslo.agent.kafka_sink import KafkaSink

    return KafkaSink(settings.kafka, settings.spool, settings.producer)


class WallClockAgent:
    """Sources and a sink on the runner, ticking on the wall clock at whole multiples of
    ``interval_s``; with :meth:`serve_metrics`, the agent's own ``/metrics``."""

    def __init__(self, sources: Sequence[Source], sink: Sink, interval_s: float, extra: Extra | None = None,
                 clock: Clock | None = None, metrics: Sequence[Any] = ()) -> None:  # fmt: skip
        self.sources = list(sources)
        self.sink = sink
        self.extra = extra
        self.metrics = list(metrics)  # prometheus collectors of sources that keep their own (Kueue's)
        self.runner = Runner(self.sources, sink, clock or WallClock(), interval_s)
        self.server: MetricsServer | None = None

    def serve_metrics(self, port: int, addr: str, names: str = DEFAULT_GENERATION) -> None:
        """Serve ``/metrics`` on ``addr:port`` (OSError when it cannot), in the dcgm-exporter
        generation ``names`` (``gpuslo.wire.dcgm_names.GENERATIONS``; ValueError for another)."""
        from gpuslo.agent.exporter import AgentCollector, TapSink, registry_with
        from gpuslo.core.metrics_http import MetricsServer

        generation = next((g for g in GENERATIONS if g == names), None)
        if generation is None:
            raise ValueError(f"--dcgm-names {names!r}: allowed {', '.join(GENERATIONS)}")
        collector = AgentCollector(
            stats=lambda: self.runner.stats,
            spool=getattr(self.sink, "spool_stats", None),  # the Kafka sink's, under its lock
            topics_missing=getattr(self.sink, "missing_topics", None),  # the Kafka sink's
            extra=self.extra,
            names=generation,
            driver=self._driver,
        )
        old = self.runner  # nothing ran yet: the same runner, its sink tapped for /metrics
        self.runner = Runner(self.sources, TapSink(self.sink, collector), old.clock, old.interval_s)
        self.server = MetricsServer(port, addr, registry_with(collector, *self.metrics)).start()

    def _driver(self) -> str:
        """The driver version the GPU source read (NVML, or the exporter's label row); "" if none."""
        return next((d for s in self.sources if isinstance(d := getattr(s, "driver", ""), str) and d), "")

    def run(self, stop: threading.Event, ticks: int | None = None, flush_timeout_s: float = 60.0) -> bool:
        """Tick until ``stop`` is set (or ``ticks`` are done), then flush and close; True when
        everything was delivered within ``flush_timeout_s``."""
        interval = self.runner.interval_s
        start = float(int(self.runner.clock.now() // interval + 1) * interval)
        try:
            self.runner.run(start, ticks=ticks, stop=stop)
            return self.sink.flush(timeout_s=flush_timeout_s)
        finally:
            self.close()

    def close(self) -> None:
        self.sink.close()
        for s in self.sources:
            s.close()
        if self.server is not None:  # served until everything is flushed and closed
            self.server.close()
            self.server = None

"""The agent's own ``/metrics`` (prometheus-client): the last sampled values under
dcgm-exporter's names and labels, and the agent's health.

Which dcgm-exporter it sounds like is the operator's choice (``names``, ``--dcgm-names``), from
the one table of :mod:`gpuslo.wire.dcgm_names`: ``dcgm48`` (the default, as dcgm-exporter 4.10:
DCGM 4.8 names and units, the ``hostname`` label, ``DCGM_FI_SYSTEM_DRIVER_VERSION``), ``dcgm47``
(as dcgm-exporter 4.9: the same, with the profiling byte rates under their DCGM 4.7 names) or
``classic`` (as dcgm-exporter up to 4.8.2: the catalogue's names and units, ``Hostname``,
``DCGM_FI_DRIVER_VERSION``), so that dashboards written for either keep working.

Per GPU: every ``DCGM_FI_*`` field of the last batch as a gauge labelled ``gpu``, ``UUID``,
``device`` (nvidiaN), ``modelName``, the node (``hostname``/``Hostname``), ``GPU_I_PROFILE`` and
``GPU_I_ID`` (a MIG instance's profile and GPU-instance id, as dcgm-exporter names them; empty
for a whole GPU), the driver version when the source knows it, and, when the GPU is held, the
holder: ``hpc_job`` (Slurm, as dcgm-exporter's HPC job mapping) or ``namespace``/``pod``
(Kubernetes). The ``DCGM_FI_*`` counters keep dcgm-exporter's exact names (no ``_total``
suffix), so they are exposed as gauges, as dcgm-exporter exposes them; existing dashboards and
alerts written for dcgm-exporter read them unchanged.

The agent's own health: its cumulative counts (ticks, send failures, source errors, the spool's
accepted, delivered, dropped and refused records, the sources' error counts) are counters named
``..._total``, as client_python's own collectors name theirs, so ``rate()`` and ``increase()``
apply and a restart reads as a counter reset; levels (the spool's records and bytes, a GPU's
health, the age of the last sample) are gauges.

A GPU held by several jobs or pods has its series once per holder (as dcgm-exporter writes
them); a node's batch not renewed for :data:`STALE_INTERVALS` intervals leaves the page
(:func:`_stale`). The page as a whole is checked by :class:`CheckedPage`: valid exposition
whatever the values, a failing collector costing its own families only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gpuslo.agent.base import SendResult, Sink
from gpuslo.agent.runner import RunnerStats
from gpuslo.agent.spool import SpoolStats
from gpuslo.wire import BY_NAME, GpuSample, GpuSampleBatch, Message
from gpuslo.wire.dcgm_names import (
    DEFAULT_GENERATION,
    DRIVER_LABEL,
    GENERATIONS,
    HOSTNAME_LABEL,
    Generation,
    from_catalogue,
)


def _uuid_label(g: GpuSample, parents: dict[int, str]) -> str:
    """dcgm-exporter's ``UUID``: the GPU's, for a MIG instance its parent GPU's (the instance is
    told by ``GPU_I_ID``): the instance's own UUID made a page whose MIG series no dashboard or
    join written for dcgm-exporter (``UUID``, ``GPU_I_ID``) found. The parent's UUID is its row's
    in the batch, else the prefix of the scrape source's ``GPU-…::mig-N``, else the instance's."""
    if g.mig is None:
        return g.uuid
    return parents.get(g.index) or g.uuid.partition("::mig-")[0] or g.uuid


def labels_of(names: Generation) -> list[str]:
    """The label names of a GPU series in generation ``names``; the first seven name the GPU
    (or MIG instance), the last three its holder."""
    return ["gpu", "UUID", "device", "modelName", HOSTNAME_LABEL[names], "GPU_I_PROFILE", "GPU_I_ID",
            "hpc_job", "namespace", "pod"]  # fmt: skip


log = logging.getLogger(__name__)

LABELS = labels_of(DEFAULT_GENERATION)
_GPU_LABELS = 7  # the ones naming the GPU (or MIG instance), without its holder


class AgentCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], RunnerStats] | None = None,
        spool: Callable[[], SpoolStats] | None = None,
        extra: Callable[[], dict[str, float]] | None = None,
        topics_missing: Callable[[], Sequence[str]] | None = None,
        names: Generation = DEFAULT_GENERATION,
        driver: Callable[[], str] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``extra``: a source's own cumulative counts, name (without ``_total``) → count.
        ``names``: the dcgm-exporter generation spoken. ``driver``: the driver version the
        GPU source read ("" while unknown: no driver label). ``monotonic``: the clock that
        tells how long ago a node's batch came (:data:`STALE_INTERVALS`). ``topics_missing``: the
        Kafka topics the broker said it does not have (the Kafka sink's)."""
        if names not in GENERATIONS:
            raise ValueError(f"dcgm names {names!r}: allowed {', '.join(GENERATIONS)}")
        self.names: Generation = names
        self._driver = driver
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._last: dict[str, tuple[GpuSampleBatch, float]] = {}  # node → its last batch, when; newest last
        self._stats = stats
        self._spool = spool
        self._extra = extra
        self._topics_missing = topics_missing

    def observe(self, msgs: Sequence[Message]) -> None:
        with self._lock:
            for m in msgs:
                if isinstance(m, GpuSampleBatch):
                    self._last.pop(m.node, None)
                    self._last[m.node] = (m, self._monotonic())

    def collect(self) -> Iterator[Any]:
        mono = self._monotonic()
        with self._lock:
            newest = next(reversed(self._last), None)
            for node, (b, at) in list(self._last.items()):  # a node no longer sampled: forgotten
                if node != newest and _stale(b, mono - at):
                    del self._last[node]
            batches = [(b, _stale(b, mono - at)) for b, at in self._last.values()]
        fams: dict[str, GaugeMetricFamily] = {}
        driver = self._driver() if self._driver is not None else ""
        gpu_labels = labels_of(self.names)
        series_labels = gpu_labels + ([DRIVER_LABEL[self.names]] if driver else [])
        up = GaugeMetricFamily(
            "gpuslo_agent_gpu_healthy",
            "1 if the GPU answered NVML at the last sample",
            labels=gpu_labels[:_GPU_LABELS],
        )
        for b, stale in batches:
            if stale:  # its source stopped sending (failed, gone): no figures rather than old ones
                continue
            parents = {g.index: g.uuid for g in b.gpus if g.mig is None}
            for g in b.gpus:
                mig = ("", "") if g.mig is None else (g.mig.profile, str(g.mig.gi))
                gpu = [str(g.index), _uuid_label(g, parents), f"nvidia{g.index}", g.model, b.node, *mig]
                up.add_metric(gpu, 1.0 if g.healthy else 0.0)
                own = [driver] if driver else []
                series = [gpu + list(h) + own for h in _holders(g)]
                for field, value in g.fields.items():
                    name, v = from_catalogue(field, value, self.names)
                    fam = fams.get(name)
                    if fam is None:
                        fam = fams[name] = GaugeMetricFamily(name, _help(field, name), labels=series_labels)
                    for labels in series:
                        fam.add_metric(labels, v)
        yield from fams.values()
        yield up
        if batches:
            age = GaugeMetricFamily(
                "gpuslo_agent_last_sample_age_seconds",
                "Seconds since the last GPU sample",
                labels=[HOSTNAME_LABEL[self.names]],
            )
            now = time.time()
            for b, _ in batches:
                age.add_metric([b.node], max(0.0, now - b.ts))
            yield age
        if self._stats is not None:
            s = self._stats()
            yield CounterMetricFamily("gpuslo_agent_ticks", "Sampling ticks done", value=s.ticks)
            yield CounterMetricFamily(
                "gpuslo_agent_ticks_missed", "Tick times passed over after a stall", value=s.ticks_missed
            )
            yield CounterMetricFamily(
                "gpuslo_agent_clock_set_back",
                "Times the clock went back behind the last tick (ticking started again from it)",
                value=s.clock_set_back,
            )
            yield CounterMetricFamily(
                "gpuslo_agent_send_failures", "Messages a sink failed to accept", value=s.send_failures
            )
            errs = CounterMetricFamily(
                "gpuslo_agent_source_errors", "Failed collections per source", labels=["source"]
            )
            for src, n in dict(s.source_errors).items():  # a copy: the runner's thread adds sources
                errs.add_metric([src], n)
            yield errs
        if self._spool is not None:
            yield from _spool_metrics(self._spool())
        if self._topics_missing is not None:
            yield GaugeMetricFamily(
                "gpuslo_agent_kafka_topics_missing",
                "Kafka topics the broker answered it does not have: the spool's drain waits at the first "
                "record for one (make them: gpuslo topics --create)",
                value=len(self._topics_missing()),
            )
        if self._extra is not None:
            for name, v in self._extra().items():
                yield CounterMetricFamily(name, name.replace("_", " "), value=v)


#: a node's batch not renewed for this many of its intervals (and :data:`STALE_MIN_S`) is no
#: longer shown: its source stopped sending (an exporter down, a source failing every tick, a
#: node renamed). Its age stays on the page while it is the newest batch; an older node's is
#: forgotten.
STALE_INTERVALS = 3
STALE_MIN_S = 60.0


def _stale(b: GpuSampleBatch, since_s: float) -> bool:
    return since_s > max(STALE_INTERVALS * b.interval_s, STALE_MIN_S)


def _holders(g: GpuSample) -> list[tuple[str, str, str]]:
    """The (``hpc_job``, ``namespace``, ``pod``) of each holder of the GPU, once each, as
    dcgm-exporter writes a held GPU's series: once per job (its HPC job mapping) or pod (a
    time-sliced GPU), with the same figures; ``("", "", "")`` for a GPU no one holds."""
    out: dict[tuple[str, str, str], None] = {}
    for a in g.allocations:
        if a.scheduler == "slurm":
            out[(a.id, "", "")] = None
        else:
            ns, _, pod = a.name.partition("/")
            out[("", ns, pod)] = None
    return list(out) or [("", "", "")]


_UNIT_OF = {  # the unit a renamed series is in, by the name's unit word (DCGM's naming standard)
    "_HERTZ": "Hz",
    "_JOULES_TOTAL": "J",
    "_BYTES": "B",
    "_RATIO": "ratio",
}


def _help(field: str, name: str) -> str:
    """The catalogue's help text with the unit of the series as named (``Hz`` for a clock in
    DCGM 4.7's names, ``MHz`` in the classic ones)."""
    f = BY_NAME[field]
    unit = f.unit
    if name != field:
        unit = next((u for suffix, u in _UNIT_OF.items() if name.endswith(suffix)), f.unit)
    return f"{f.help} ({unit})."


def _spool_metrics(st: SpoolStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The spool's accounting; ``accepted == delivered + records + dropped`` (both reasons) always."""
    yield GaugeMetricFamily(
        "gpuslo_agent_spool_records", "Records waiting in the disk spool", value=st.pending
    )
    yield GaugeMetricFamily("gpuslo_agent_spool_bytes", "Bytes of the disk spool", value=st.bytes)
    yield CounterMetricFamily(
        "gpuslo_agent_spool_accepted_records", "Records the spool took since the agent started "
        "(those found on disk at start included)", value=st.accepted)  # fmt: skip
    yield CounterMetricFamily(
        "gpuslo_agent_spool_delivered_records",
        "Records acknowledged by Kafka and drained",
        value=st.delivered,
    )
    dropped = CounterMetricFamily(
        "gpuslo_agent_spool_dropped_records",
        "Records dropped by the spool: at its byte or age bound, lost to corrupt data on disk, or "
        "rejected by the broker for what they are (too large)",
        labels=["reason"],
    )
    dropped.add_metric(["bound"], st.dropped_bound)
    dropped.add_metric(["corrupt"], st.dropped_corrupt)
    dropped.add_metric(["rejected"], st.dropped_rejected)
    yield dropped
    yield CounterMetricFamily(
        "gpuslo_agent_spool_refused_records",
        "Records the spool could not write (disk full, I/O error): never accepted, reported to the caller",
        value=st.refused,
    )
    yield CounterMetricFamily(
        "gpuslo_agent_spool_read_failures",
        "Reads of the spool that failed for now (out of file descriptors or memory): the drain waited, "
        "the records kept",
        value=st.read_failures,
    )


class TapSink(Sink):
    """Passes everything to ``inner`` and shows the last batches on /metrics."""

    def __init__(self, inner: Sink, collector: AgentCollector) -> None:
        self.inner = inner
        self.collector = collector

    def send(self, msgs: Sequence[Message]) -> SendResult:
        self.collector.observe(msgs)
        return self.inner.send(msgs)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self.inner.flush(timeout_s)

    def close(self) -> None:
        self.inner.close()


def registry_with(collector: AgentCollector, *more: Collector) -> CollectorRegistry:
    """The agent's metrics, and those of sources that keep their own (Kueue's pending ages), as
    one page that is always valid exposition (:class:`CheckedPage`)."""
    reg = CollectorRegistry()
    reg.register(CheckedPage([collector, *more]))
    return reg


class CheckedPage(Collector):
    """The collectors of one ``/metrics`` page, checked as a whole each scrape, so that no value
    from outside and no collector makes the page invalid or takes it down (a 500 fails
    Prometheus' scrape and the DaemonSet's liveness probe alike, which restarts the agent):

    - a collector that raises loses its own families only (``reason="collector"``);
    - a family whose name another family on the page already exposes (``x`` and the counter
      ``x``'s ``x_total``), or a series written twice (the same name and labels), is left out
      (``reason="duplicate"``): Prometheus and OpenMetrics parsers refuse the page otherwise;
    - a label value that is not Unicode text UTF-8 can carry (a lone surrogate, as JSON's
      ``"\\udc80"`` decodes) has each such code point replaced by U+FFFD
      (``reason="utf8"``): encoding it failed the whole page.

    Each is counted in ``gpuslo_agent_metrics_problems_total{reason}`` and logged once per
    family (or collector) and reason."""

    def __init__(self, collectors: Sequence[Collector]) -> None:
        self.collectors = list(collectors)
        self.problems = {"collector": 0, "duplicate": 0, "utf8": 0}
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # scrapes run in threads of their own

    def collect(self) -> Iterator[Metric]:
        names: set[str] = set()  # every name a family on the page exposes
        for c in self.collectors:
            try:
                fams = list(c.collect())
            except Exception as exc:
                self._problem("collector", type(c).__name__, f"{type(exc).__name__}: {exc}")
                continue
            for fam in fams:
                exposed = {fam.name, *(s.name for s in fam.samples)}
                exposed.add(fam.name + "_total" if fam.type == "counter" else fam.name)
                if exposed & names:
                    self._problem("duplicate", fam.name, "another family on the page exposes the name")
                    continue
                names |= exposed
                fam.samples = self._samples(fam)
                yield fam
        with self._lock:
            problems = dict(self.problems)
        fam = CounterMetricFamily(
            "gpuslo_agent_metrics_problems",
            "Things left out of /metrics or changed so that the page stays valid: a collector that "
            "failed, a duplicate family or series, a label value UTF-8 cannot carry",
            labels=["reason"],
        )
        for reason, n in problems.items():
            fam.add_metric([reason], n)
        yield fam

    def _samples(self, fam: Metric) -> list[Sample]:
        out: list[Sample] = []
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for s in fam.samples:
            if not all(v.isascii() for v in s.labels.values()):
                labels = {k: _text(v) for k, v in s.labels.items()}
                if labels != s.labels:
                    self._problem("utf8", fam.name, "a label value is not valid Unicode text")
                    s = s._replace(labels=labels)
            key = (s.name, tuple(sorted(s.labels.items())))
            if key in seen:
                self._problem("duplicate", fam.name, f"a series written twice ({len(s.labels)} labels)")
                continue
            seen.add(key)
            out.append(s)
        return out

    def _problem(self, reason: str, what: str, detail: str) -> None:
        with self._lock:
            self.problems[reason] += 1
            if (reason, what) in self._logged or len(self._logged) >= _LOGGED_MAX:
                return
            self._logged.add((reason, what))
        log.warning("/metrics: %s left out or changed (%s: %s); counted, logged once", what, reason, detail)


_LOGGED_MAX = 1000  # distinct (reason, family) pairs logged; past it, only counted


def _text(v: str) -> str:
    """``v`` with each code point UTF-8 cannot carry (a surrogate) as U+FFFD."""
    try:
        v.encode()
        return v
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in v)

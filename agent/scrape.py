"""Sources that scrape Prometheus text endpoints: an existing dcgm-exporter, and the
latency histograms of inference servers (vLLM, Triton, anything with a histogram).

Scrape trouble (connection refused, HTTP error, unparsable text) is logged once per kind,
counted, and yields no messages for that tick: it never raises into the sampling loop.
"""

from __future__ import annotations

import io
import logging
import math
import re
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from annotated_types import Le
from prometheus_client.parser import text_fd_to_metric_families
from pydantic import BaseModel, TypeAdapter, ValidationError

from gpuslo.agent.base import Sequencer, Source
from gpuslo.agent.pool import NodePool, pool_at
from gpuslo.core.http import read_url
from gpuslo.wire import BY_NAME, Allocation, GpuSample, GpuSampleBatch, LatencyDelta, Message, MigInstance
from gpuslo.wire.bounds import MAX_ALLOCATIONS
from gpuslo.wire.dcgm_names import DRIVER_LABELS, HOSTNAME_LABELS, to_catalogue
from gpuslo.wire.models import Name, ShareSource

log = logging.getLogger(__name__)

Fetch = Callable[[str, float], str]
# a label value that is an id: a decimal as dcgm-exporter writes one (ASCII digits, no sign, no
# space, no leading zero, at most 4 digits); int() took ' 1', '1_0' (10), '01' (GPU 1 again), '١'
# and '²' (isdigit() is true for both; int() raises on the second)
_ID = re.compile(r"0|[1-9][0-9]{0,3}", re.ASCII)
_NODE = TypeAdapter(Name)  # the wire's node name: a Hostname label it refuses is not the node's


def _le(model: type[BaseModel], name: str) -> int:
    """The upper bound the wire's ``model`` sets on its integer field ``name``."""
    most = next(m.le for m in model.model_fields[name].metadata if isinstance(m, Le))
    assert isinstance(most, int), (model, name)
    return most


_MAX_GPU, _MAX_GI = _le(GpuSample, "index"), _le(MigInstance, "gi")  # 1023, 255
IGNORED_NAMES_MAX = 256  # names of ignored series remembered (and logged once each); the rest only counted


# the most a scrape reads: a dcgm-exporter's page is some 10 KiB a GPU (a few MiB on the largest
# node with every pod of a time-sliced GPU); past this the endpoint is not one, and the agent,
# which runs on every GPU node, must not hold it in memory
MAX_BODY_BYTES = 16 * 2**20


def http_get(url: str, timeout_s: float, max_bytes: int = MAX_BODY_BYTES) -> str:
    """The body at ``url``, read whole within ``timeout_s`` (not only each read: the sources
    share one sampling loop, and a scrape that never ended stopped the node's GPU samples too)
    and at most ``max_bytes`` long; an OSError (TimeoutError for the time) otherwise, which the
    scrape counts as a failure."""
    body = read_url(url, timeout_s, max_bytes)
    return body.decode("utf-8", errors="replace")


@dataclass
class ScrapeStats:
    scrapes: int = 0
    failures: int = 0
    ignored: set[str] = field(default_factory=set)  # DCGM_FI_* names no generation gives a catalogue field
    ignored_series: int = 0  # their series, every scrape (the names kept: the first IGNORED_NAMES_MAX)
    dropped: int = 0  # values outside their plausible range
    refused: int = 0  # series whose labels the wire refuses (GPU index, UUID, names too long)
    resets: int = 0  # counter resets seen (latency)


# how many of a page's lines are parsed between two looks at the parse's deadline
LINES_PER_CHECK = 256


def _lines_until(text: str, deadline: float, clock: Callable[[], float], timeout_s: float) -> Iterator[str]:
    """The page's lines, a TimeoutError once ``clock()`` passes ``deadline``: prometheus_client's
    parser takes some 75-165 µs a series here, so a page at MAX_BODY_BYTES parsed for 5-33 s
    and stalled the node's one sampling loop past its ticks (a fetch was bounded, its parse not)."""
    for k, line in enumerate(io.StringIO(text)):
        if k % LINES_PER_CHECK == 0 and clock() > deadline:
            raise TimeoutError(
                f"the page was not parsed within the scrape's {timeout_s:g} s "
                f"(stopped at line {k + 1}, {len(text)} characters)"
            )
        yield line


class _Scraper:
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, fetch: Fetch, timeout_s: float) -> None:
        self.fetch = fetch
        self.timeout_s = timeout_s
        self.stats = ScrapeStats()
        self._logged: set[str] = set()

    def scrape(self, url: str) -> list[Any] | None:
        """The page's metric families, fetched within ``timeout_s`` and parsed within as long
        again (each its own budget: a slow exporter's page is not refused for the time its fetch
        took); None (counted, logged once a kind) when either fails or takes longer."""
        self.stats.scrapes += 1
        try:
            text = self.fetch(url, self.timeout_s)
            lines = _lines_until(text, self.clock() + self.timeout_s, self.clock, self.timeout_s)
            return list(text_fd_to_metric_families(lines))  # type: ignore[arg-type]  # any iterable of lines
        except Exception as exc:  # network, HTTP, parse: contained
            self.stats.failures += 1
            key = f"{url} {type(exc).__name__}"
            if key not in self._logged:
                self._logged.add(key)
                log.warning(
                    "scrape of %s failed: %s: %s (logged once; counted)", url, type(exc).__name__, exc
                )
            return None


class DcgmExporterSource(Source, _Scraper):
    """Map an existing dcgm-exporter's ``/metrics`` to the same wire fields (for clusters
    that already run DCGM). Attribution from its labels: ``hpc_job`` → Slurm job,
    ``namespace``/``pod`` → Kubernetes pod.

    Both generations of names: the classic ones (up to 4.8.x) and DCGM 4.7's (4.9.0 on, with
    their units converted back to the catalogue's: Hz → MHz, J → mJ, ratio → %, bytes → MiB),
    from the one table of :mod:`gpuslo.wire.dcgm_names`; the node from ``Hostname`` or
    ``hostname``; the driver version (``driver``) from ``DCGM_FI_DRIVER_VERSION`` or
    ``DCGM_FI_SYSTEM_DRIVER_VERSION``. A ``DCGM_FI_*`` name no generation gives a catalogue
    field is ignored, logged once and counted (``stats.ignored``).

    MIG: series with a ``GPU_I_ID`` label are one MIG instance each (``GPU_I_PROFILE`` such as
    ``3g.40gb`` gives its slices; ``mig_slices`` is the GPU's, 7 on A100/H100, 4 on A30); the
    GPU's own series (no ``GPU_I_ID``) stand for what no instance holds.

    One bad series costs that series, never the node's other GPUs: a ``gpu`` or ``GPU_I_ID`` that
    is not an id the wire holds (ASCII digits as dcgm-exporter writes them, at most 1023 and 255:
    never clamped, which made two instances one), a series written twice with another value (the
    first kept, as Prometheus keeps it), a row whose names the wire refuses: each is skipped,
    counted (``stats.refused``) and logged once. A ``Hostname`` the wire refuses as a node name is
    not the node (counted once a scrape): another series' label or ``unknown`` is, as with none.
    A batch the wire still refuses (a ``node`` over its bound) is a failed scrape (``stats.failures``)."""

    name = "dcgm-exporter"

    def __init__(
        self,
        url: str,
        cluster: str,
        interval_s: float,
        node: str | None = None,
        pool: str | NodePool = "",  # a NodePool: learnt at each collect (agent.pool)
        fetch: Fetch = http_get,
        timeout_s: float = 5.0,
        boot_id: str | None = None,
        mig_slices: int = 7,
    ) -> None:
        _Scraper.__init__(self, fetch, timeout_s)
        self.url, self.cluster, self.interval_s, self.node, self.pool = url, cluster, interval_s, node, pool
        self.mig_slices = mig_slices
        self.seq = Sequencer(node or url, boot_id or uuidlib.uuid4().hex[:12])
        self.driver = ""  # the driver version the exporter's label row names ("" until seen)

    def collect(self, now: float) -> list[Message]:
        pool = pool_at(self.pool, now)  # learnt for this tick, whoever asked first
        fams = self.scrape(self.url)
        if fams is None:
            return []
        gpus: dict[tuple[int, int | None], dict[str, Any]] = {}
        seen: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}  # series → its first value
        node = self.node
        bad_nodes: set[str] = set()  # node label values the wire refuses (counted once a scrape)
        for fam in fams:
            for s in fam.samples:
                sname = _exposed_name(fam, s.name)
                if not sname.startswith("DCGM_FI_"):
                    continue
                hit = to_catalogue(sname, s.value)
                if hit is None:
                    self.stats.ignored_series += 1
                    if sname not in self.stats.ignored and len(self.stats.ignored) < IGNORED_NAMES_MAX:
                        self.stats.ignored.add(sname)
                        log.info("dcgm-exporter metric %s is not in the field catalogue; ignored", sname)
                    continue
                # a series written twice: the first value kept, as Prometheus keeps it (a second
                # value at the same time is its "duplicate sample for timestamp", refused); the
                # same value again adds nothing
                series = (sname, frozenset(s.labels.items()))
                if series in seen:
                    if not _same(seen[series], s.value):
                        self._malformed(
                            f"{sname} written twice", f"{seen[series]:g}, then {s.value:g}: the first kept"
                        )
                    continue
                seen[series] = s.value
                name, value = hit
                idx = _label_id(s.labels.get("gpu", ""), _MAX_GPU)
                if idx is None:
                    self._malformed("gpu label", f"{s.labels.get('gpu', '')[:64]!r} is not a GPU index")
                    continue
                gi: int | None = None
                if s.labels.get("GPU_I_ID", ""):  # never clamped: 300 and 400 were both instance 255
                    gi = _label_id(s.labels["GPU_I_ID"], _MAX_GI)
                    if gi is None:
                        self._malformed(
                            "GPU_I_ID label", f"{s.labels['GPU_I_ID'][:64]!r} is not a MIG instance id"
                        )
                        continue
                if not BY_NAME[name].plausible(value):
                    self.stats.dropped += 1
                    continue
                g = gpus.setdefault(
                    (idx, gi), {"fields": {}, "labels": s.labels, "renamed": set(), "holders": {}}
                )
                holder = _holder(s.labels)
                if holder is not None:  # a shared GPU: one series per pod, the same figures
                    g["holders"].setdefault(holder, None)
                # an exporter giving a field under both its names: the newer name's value, whatever
                # the order of the lines (the same field id, or its base-unit twin: never summed)
                renamed = sname != name
                if renamed or name not in g["renamed"]:
                    g["fields"][name] = value
                    if renamed:
                        g["renamed"].add(name)
                if node is None:
                    node = self._node_label(s.labels, bad_nodes)
                self.driver = next((s.labels[k][:256] for k in DRIVER_LABELS if s.labels.get(k)), self.driver)
        if bad_nodes:
            self.stats.refused += 1
        if not gpus:
            return []
        samples: list[GpuSample] = []
        for idx in sorted({i for i, _ in gpus}):
            keys = [k for k in sorted(gpus, key=_order) if k[0] == idx and k[1] is not None]
            # the GPU's slices: mig_slices, or more when its instances hold more (a mig_slices
            # set for another model): the rows of one GPU never stand for more than that GPU
            slices = max(self.mig_slices, sum(_slices(gpus[k]["labels"]) for k in keys))
            made = [
                self._checked(
                    idx,
                    gpus[k]["labels"],
                    gpus[k]["fields"],
                    gi=k[1],
                    slices=slices,
                    holders=gpus[k]["holders"],
                )
                for k in keys
            ]
            instances = [x for x in made if x is not None]
            rest = max(0.0, 1.0 - sum(x.fraction for x in instances)) if instances else 1.0
            own = gpus.get((idx, None))
            whole: GpuSample | None = None
            if own is not None:
                whole = self._checked(
                    idx, own["labels"], own["fields"], fraction=rest, holders=own["holders"]
                )
            elif rest > 0:  # no series of the GPU itself: its unpartitioned part, named as its instances
                first = gpus[keys[0]]["labels"]
                lab = {k: v for k, v in first.items() if k in ("UUID", "modelName", *HOSTNAME_LABELS)}
                whole = self._checked(idx, lab, {}, fraction=rest)
            samples += ([whole] if whole is not None else []) + instances
        if not samples:
            return []
        try:
            return [GpuSampleBatch(source=self.seq.source, boot_id=self.seq.boot_id, seq=self.seq.next(),
                                   cluster=self.cluster, ts=now, node=node or "unknown", pool=pool,
                                   interval_s=self.interval_s, gpus=tuple(samples))]  # fmt: skip
        except ValidationError as exc:  # what no series holds (a --node the wire refuses): this scrape
            self.stats.failures += 1
            err = exc.errors(include_url=False)[0]
            key = f"batch {'.'.join(str(x) for x in err['loc'])}"
            if key not in self._logged and len(self._logged) < IGNORED_NAMES_MAX:
                self._logged.add(key)
                log.error("dcgm-exporter scrape of %s sent nothing: the wire refuses its batch (%s: %s); "
                          "counted as a failed scrape, logged once", self.url, key[6:], err["msg"])  # fmt: skip
            return []

    def _malformed(self, what: str, detail: str) -> None:
        """A series whose labels (or repeat) the wire cannot take as they are: skipped, counted
        (``stats.refused``) and logged once per ``what``; the scrape's other series still count."""
        self.stats.refused += 1
        key = f"malformed {what}"
        if key not in self._logged and len(self._logged) < IGNORED_NAMES_MAX:
            self._logged.add(key)
            log.warning("dcgm-exporter series refused (%s: %s); counted, logged once", what, detail)

    def _node_label(self, lab: dict[str, str], bad: set[str]) -> str | None:
        """The node a series names (``Hostname`` or ``hostname``), if the wire takes it as a node
        name; one it refuses (over 256 characters) is added to ``bad`` and logged once: the node
        is then another series' label, or ``unknown`` as with none (``--node`` names it)."""
        for k in HOSTNAME_LABELS:
            v = lab.get(k, "")
            if not v or v in bad:
                continue
            try:
                return _NODE.validate_python(v)
            except ValidationError as exc:
                bad.add(v)
                if "node label" not in self._logged:
                    self._logged.add("node label")
                    log.warning("dcgm-exporter's %s label (%d characters) is not a node name the wire takes (%s); "
                                "not the node: counted, logged once (--node names it)",
                                k, len(v), exc.errors(include_url=False)[0]["msg"])  # fmt: skip
        return None

    def _checked(
        self,
        idx: int,
        lab: dict[str, str],
        fields: dict[str, float],
        fraction: float | None = None,
        gi: int | None = None,
        slices: int = 0,
        holders: dict[tuple[str, str, str], None] | None = None,
    ) -> GpuSample | None:
        """:meth:`_sample`, or None for labels the wire refuses (a UUID, model, job or pod name
        longer than its column, a GPU index past the wire's bound): that row is counted
        (``stats.refused``) and logged once per reason, the scrape's other GPUs still sent.
        Raising, it lost the whole scrape, every tick."""
        try:
            return self._sample(idx, lab, fields, fraction=fraction, gi=gi, slices=slices, holders=holders)
        except ValidationError as exc:
            self.stats.refused += 1
            err = exc.errors(include_url=False)[0]
            key = f"refused {exc.title} {'.'.join(str(x) for x in err['loc'])}"
            if key not in self._logged and len(self._logged) < IGNORED_NAMES_MAX:
                self._logged.add(key)
                log.warning("dcgm-exporter series of GPU %d refused (%s %s: %s); counted, logged once",
                            idx, exc.title, ".".join(str(x) for x in err["loc"]), err["msg"])  # fmt: skip
            return None

    def _sample(
        self,
        idx: int,
        lab: dict[str, str],
        fields: dict[str, float],
        fraction: float | None = None,
        gi: int | None = None,
        slices: int = 0,
        holders: dict[tuple[str, str, str], None] | None = None,
    ) -> GpuSample:
        """The row of GPU ``idx`` (``gi`` None), or of its MIG instance ``gi``."""
        allocs = self._allocations(idx, list(holders or {}))
        uuid = lab.get("UUID") or f"gpu{idx}"
        if gi is None:
            return GpuSample(index=idx, uuid=uuid, model=lab.get("modelName", ""), fields=fields, allocations=allocs,
                             fraction=1.0 if fraction is None else fraction)  # fmt: skip
        profile = lab.get("GPU_I_PROFILE", "")
        return GpuSample(index=idx, uuid=f"{uuid}::mig-{gi}", model=lab.get("modelName", ""), fields=fields,
                         allocations=allocs, fraction=min(1.0, _slices(lab) / max(slices, self.mig_slices)),
                         mig=MigInstance(gi=gi, profile=profile[:256]))  # fmt: skip

    def _allocations(self, idx: int, holders: list[tuple[str, str, str]]) -> tuple[Allocation, ...]:
        """The GPU's holders from its series' labels. One holder holds the whole GPU; a GPU shared
        by time-slicing (dcgm-exporter writes each of its series once per pod, with the same
        figures) is split equally among its pods, as the NVML source does with no process view
        (``share_source="equal"``). Past the wire's bound of holders, the first ones are kept
        and the rest counted (``stats.refused``) and logged once."""
        if len(holders) > MAX_ALLOCATIONS:
            self.stats.refused += len(holders) - MAX_ALLOCATIONS
            key = f"holders of GPU {idx}"
            if key not in self._logged and len(self._logged) < IGNORED_NAMES_MAX:
                self._logged.add(key)
                log.warning("dcgm-exporter names %d holders of GPU %d; the first %d kept, the rest counted",
                            len(holders), idx, MAX_ALLOCATIONS)  # fmt: skip
            holders = holders[:MAX_ALLOCATIONS]
        if len(holders) == 1:
            return (_allocation(holders[0], 1.0, ""),)
        return tuple(_allocation(h, 1.0 / len(holders), "equal") for h in holders)


def _holder(lab: dict[str, str]) -> tuple[str, str, str] | None:
    """(scheduler, id, queue) of the holder a series names: ``hpc_job`` a Slurm job, else
    ``namespace``/``pod`` a Kubernetes pod; None for a series naming no holder."""
    if lab.get("hpc_job"):
        return ("slurm", lab["hpc_job"], "")
    if lab.get("pod"):
        ns = lab.get("namespace", "")
        return ("k8s", f"{ns}/{lab['pod']}", ns)
    return None


def _allocation(holder: tuple[str, str, str], share: float, source: ShareSource) -> Allocation:
    scheduler, ident, queue = holder
    if scheduler == "slurm":
        return Allocation(scheduler="slurm", id=ident, share=share, share_source=source)
    return Allocation(scheduler="k8s", id=ident, name=ident, queue=queue, share=share, share_source=source)


def _exposed_name(fam: Any, name: str) -> str:
    """The name as the exporter wrote it. dcgm-exporter declares some fields ``counter``
    (``# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter``) and writes them without a
    ``_total`` suffix; prometheus_client's parser hands those samples out as ``NAME_total``,
    which no catalogue name is: the family's own name is the field's."""
    if fam.type == "counter" and name == fam.name + "_total":
        return str(fam.name)
    return name


def _slices(lab: dict[str, str]) -> int:
    """The GPU slices of a MIG instance from its profile (``3g.40gb``: 3; unknown: 1). ASCII
    digits, at most 4 (``\\d+`` took '٣g.' and ran int() into its 4,300-digit limit)."""
    m = re.match(r"([1-9][0-9]{0,3})g\.", lab.get("GPU_I_PROFILE", ""), re.ASCII)
    return int(m.group(1)) if m else 1


def _label_id(value: str, most: int) -> int | None:
    """A label value as an id from 0 to ``most`` (the wire's bound), or None: never clamped
    (two ids past the bound would become one) and never read loosely (see ``_ID``)."""
    if not _ID.fullmatch(value):
        return None
    n = int(value)
    return n if n <= most else None


def _bound(le: str) -> float | None:
    """A histogram bucket's ``le`` as a bound: a finite number at least 0, or +Inf; None for
    anything else (none, text, NaN, a negative bound, a number that overflows to infinity)."""
    try:
        v = float(le)
    except ValueError:
        return None
    if v == math.inf:
        return v if le.strip().lstrip("+").lower() in ("inf", "infinity") else None
    return v if math.isfinite(v) and v >= 0 else None


def _same(a: float, b: float) -> bool:
    """The same sample value (NaN as NaN: a series written twice with NaN is no conflict)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def _order(key: tuple[int, int | None]) -> tuple[int, int]:
    """GPUs by index, each GPU's own row (``None``) before its MIG instances by id."""
    return key[0], -1 if key[1] is None else key[1]


@dataclass(frozen=True)
class LatencyTarget:
    url: str
    service: str
    metric: str  # histogram family name, without _bucket
    unit: str = "s"  # of the histogram's values and `le` bounds: s, ms or us
    match: tuple[tuple[str, str], ...] = ()  # only series with these label values


_Key = tuple[str, str, tuple[tuple[str, str], ...]]


def _key(t: LatencyTarget) -> _Key:
    """A target's identity: its url, its service and the labels it matches (one server may
    serve two models, each matched to a service of its own, or to one service)."""
    return (t.url, t.service, t.match)


def _target_sequencers(targets: Sequence[LatencyTarget], source: str, boot_id: str) -> dict[_Key, Sequencer]:
    """Each target's own ``source`` (by its url and service). The store keeps one latency row per
    (cluster, service, source, ts), and every target of a tick is stamped with the tick's time:
    two replicas of one service scraped by one agent under one source replaced each other's
    rows (one replica's requests counted). A service's only target keeps ``source``; its
    targets, where it has several, are ``source#1``, ``source#2``... in the order given. A target
    given twice (the same url, service and labels) is an error: its requests would count twice."""
    seen: set[_Key] = set()
    for t in targets:
        if _key(t) in seen:
            raise ValueError(f"latency target {t.url} for service {t.service!r} given twice: "
                             "its requests would count twice")  # fmt: skip
        seen.add(_key(t))
    per_service: dict[str, int] = {}
    for t in targets:
        per_service[t.service] = per_service.get(t.service, 0) + 1
    out: dict[_Key, Sequencer] = {}
    nth: dict[str, int] = {}
    for t in targets:
        nth[t.service] = nth.get(t.service, 0) + 1
        own = source if per_service[t.service] == 1 else f"{source}#{nth[t.service]}"
        out[_key(t)] = Sequencer(own, boot_id)
    return out


# Defaults for common inference servers (histogram family, unit)
VLLM = ("vllm:e2e_request_latency_seconds", "s")
TRITON = ("nv_inference_first_response_histogram_ms", "ms")

_TO_MS = {"s": 1000.0, "ms": 1.0, "us": 0.001}


class LatencySource(Source, _Scraper):
    """Histogram bucket deltas per service since the previous scrape. A bucket that went
    down means the server restarted (counter reset): the new values are the delta, as
    Prometheus' ``increase`` assumes. The first scrape only sets the baseline."""

    name = "latency"

    def __init__(
        self,
        targets: Sequence[LatencyTarget],
        cluster: str,
        source: str,
        fetch: Fetch = http_get,
        timeout_s: float = 5.0,
        boot_id: str | None = None,
    ) -> None:
        _Scraper.__init__(self, fetch, timeout_s)
        for t in targets:
            if t.unit not in _TO_MS:
                raise ValueError(f"latency target {t.url}: unit {t.unit!r} (allowed: s, ms, us)")
        self.targets = list(targets)
        self.cluster = cluster
        self.seqs = _target_sequencers(self.targets, source, boot_id or uuidlib.uuid4().hex[:12])
        self._prev: dict[_Key, tuple[float, tuple[float, ...], tuple[float, ...], float]] = {}

    def _read(
        self, t: LatencyTarget, fams: list[Any]
    ) -> tuple[tuple[float, ...], tuple[float, ...], float] | None:
        """(bounds in ms, cumulative counts incl. +Inf, sum in ms) summed over matching series."""
        fam = next((f for f in fams if f.name == t.metric), None)
        if fam is None:
            return None
        per_le: dict[float, float] = {}
        total_sum = 0.0
        want = dict(t.match)
        for s in fam.samples:
            if any(s.labels.get(k) != v for k, v in want.items()):
                continue
            if not s.name.endswith(("_bucket", "_sum")):
                continue
            # a count is finite and never negative, a bound a number (+Inf the last): a series
            # that is neither is refused here, never raised (it lost every target's deltas)
            if not (math.isfinite(s.value) and s.value >= 0):
                self._refuse(t, f"{s.name} value {s.value!r}")
                continue
            if s.name.endswith("_sum"):
                total_sum += s.value
                continue
            le = _bound(s.labels.get("le", ""))
            if le is None:
                self._refuse(t, f"{s.name} le {s.labels.get('le', '')[:64]!r}")
                continue
            per_le[le] = per_le.get(le, 0.0) + s.value
        if math.inf not in per_le:
            return None
        les = sorted(per_le)
        scale = _TO_MS[t.unit]
        bounds = tuple(le * scale for le in les if le != math.inf)
        return bounds, tuple(per_le[le] for le in les), total_sum * scale

    def _refuse(self, t: LatencyTarget, what: str) -> None:
        """A series of ``t``'s histogram no delta can come from: counted (``stats.refused``),
        logged once per target and kind; the target's other series and the other targets go on."""
        self.stats.refused += 1
        key = f"refused {t.url} {t.service} {what.split(' ', 2)[1]}"
        if key not in self._logged and len(self._logged) < IGNORED_NAMES_MAX:
            self._logged.add(key)
            log.warning("%s (%s): series refused, %s; counted, logged once", t.url, t.service, what)

    def collect(self, now: float) -> list[Message]:
        """Each target's delta; a page several targets read (one server, two models or two
        histograms) fetched and parsed once a tick: once per target, a server that hung held the
        node's one sampling loop a whole timeout per target, and its targets' counts were read
        at different instants."""
        out: list[Message] = []
        pages: dict[str, list[Any] | None] = {}
        for t in self.targets:
            try:
                if t.url not in pages:
                    pages[t.url] = self.scrape(t.url)
                delta = self._delta(t, now, pages[t.url])
            except ValidationError as exc:  # a delta the wire refuses: this target's, this tick
                self.stats.failures += 1
                err = exc.errors(include_url=False)[0]
                key = f"refused {t.url} {t.service} delta"
                if key not in self._logged and len(self._logged) < IGNORED_NAMES_MAX:
                    self._logged.add(key)
                    log.warning("%s (%s): the wire refuses its delta (%s: %s); counted as a failed "
                                "scrape, logged once", t.url, t.service,
                                ".".join(str(x) for x in err["loc"]) or "delta", err["msg"])  # fmt: skip
                continue
            if delta is not None:
                out.append(delta)
        return out

    def _delta(self, t: LatencyTarget, now: float, fams: list[Any] | None) -> LatencyDelta | None:
        """``t``'s delta since its previous scrape (``fams``, its page's families); None for none
        (a baseline, a failed scrape)."""
        if fams is None:
            return None
        cur = self._read(t, fams)
        if cur is None:
            self.stats.failures += 1
            log.debug("%s: no histogram %s", t.url, t.metric)
            return None
        bounds, cum, total = cur
        key = _key(t)
        prev = self._prev.get(key)
        self._prev[key] = (now, bounds, cum, total)
        if prev is None or prev[1] != bounds:
            return None  # baseline (first scrape, or the buckets changed)
        _, _, pcum, ptotal = prev
        if any(c < p for c, p in zip(cum, pcum, strict=True)) or total < ptotal:
            self.stats.resets += 1
            dcum, dsum = cum, total  # restarted: everything counted since the restart
        else:
            dcum = tuple(c - p for c, p in zip(cum, pcum, strict=True))
            dsum = total - ptotal
        counts = [round(dcum[0])] + [round(dcum[i] - dcum[i - 1]) for i in range(1, len(dcum))]
        if any(c < 0 for c in counts):  # scraped mid-update: skip rather than guess
            return None
        seq = self.seqs[key]
        return LatencyDelta(source=seq.source, boot_id=seq.boot_id, seq=seq.next(), cluster=self.cluster,
                            ts=now, service=t.service, interval_s=max(1e-3, now - prev[0]), bounds_ms=bounds,
                            counts=tuple(counts), sum_ms=max(0.0, dsum))  # fmt: skip

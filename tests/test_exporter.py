from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gpuslo.agent.base import StaticAttribution
from gpuslo.agent.exporter import AgentCollector, registry_with
from gpuslo.agent.nvml import NvmlSource
from gpuslo.agent.runner import RunnerStats
from gpuslo.agent.spool import SpoolStats
from gpuslo.wire import BY_NAME, Allocation, GpuSample, GpuSampleBatch, MigInstance
from gpuslo.wire.dcgm_names import READ
from tests import hostile
from tests.fake_nvml import FakeGpu, FakeNvml


def test_metrics_use_dcgm_exporter_names_and_labels_both_ways() -> None:
    fake = FakeNvml(
        [FakeGpu("GPU-a", gpm_pct={pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 50.0}), FakeGpu("GPU-b")]
    )
    held = (Allocation(scheduler="slurm", id="4242", share=1.0),)
    src = NvmlSource(
        "node-7", "prod", 10, nvml=fake, attribution=StaticAttribution(lambda i, u: held if i == 0 else ())
    )
    src.collect(1_790_000_000.0)
    msgs = src.collect(1_790_000_010.0)
    batch = next(m for m in msgs if isinstance(m, GpuSampleBatch))
    col = AgentCollector(
        names="classic",
        stats=lambda: RunnerStats(ticks=2, source_errors={"nvml": 1}),
        spool=lambda: SpoolStats(
            accepted=10,
            delivered=5,
            pending=3,
            dropped_bound=1,
            dropped_corrupt=1,
            refused=4,
            bytes=900,
            dropped_rejected=2,
        ),
    )
    col.observe(msgs)
    text = generate_latest(registry_with(col)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    exposed = {n for n in fams if n.startswith("DCGM_FI_")}
    sampled = {name for g in batch.gpus for name in g.fields}
    assert exposed == sampled  # everything sampled is exposed, nothing else
    assert exposed <= set(BY_NAME)  # and all of it is catalogued
    util = {s.labels["gpu"]: s for s in fams["DCGM_FI_DEV_GPU_UTIL"].samples}
    assert util["0"].labels == {"gpu": "0", "UUID": "GPU-a", "device": "nvidia0", "modelName": "NVIDIA H100 80GB HBM3",
                                "Hostname": "node-7", "GPU_I_PROFILE": "", "GPU_I_ID": "", "hpc_job": "4242",
                                "namespace": "", "pod": ""}  # fmt: skip
    assert util["0"].value == 50.0 and util["1"].labels["hpc_job"] == ""
    assert fams["DCGM_FI_PROF_GR_ENGINE_ACTIVE"].samples[0].value == 0.5

    health = {s.name: s.value for f in fams.values() if f.name.startswith("gpuslo_agent") for s in f.samples}
    assert health["gpuslo_agent_spool_records"] == 3 and health["gpuslo_agent_spool_bytes"] == 900
    assert (
        health["gpuslo_agent_spool_accepted_records_total"] == 10
        and health["gpuslo_agent_spool_delivered_records_total"] == 5
    )
    assert health["gpuslo_agent_spool_refused_records_total"] == 4
    dropped = {s.labels["reason"]: s.value for s in fams["gpuslo_agent_spool_dropped_records"].samples}
    assert dropped == {"bound": 1, "corrupt": 1, "rejected": 2}
    assert health["gpuslo_agent_ticks_total"] == 2
    assert health["gpuslo_agent_send_failures_total"] == 0
    assert {s.labels["source"]: s.value for s in fams["gpuslo_agent_source_errors"].samples} == {"nvml": 1}


def test_mig_instances_carry_dcgm_exporters_instance_labels() -> None:
    from tests.fake_nvml import FakeMig

    mig = FakeMig("MIG-x", gi=3, gi_slices=1, ci_slices=1, memory_mb=10 * 1024)
    src = NvmlSource("node-8", "prod", 10, nvml=FakeNvml([FakeGpu("GPU-m", mig=[mig])]))
    col = AgentCollector(stats=lambda: RunnerStats(ticks=1), spool=None, names="classic")
    col.observe(src.collect(1_790_000_000.0))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry_with(col)).decode())}
    # as dcgm-exporter labels an instance (gpu_collector.go toMetric: UUID is the device's, the
    # instance is GPU_I_ID): a dashboard or join on (UUID, GPU_I_ID) finds it
    (fb,) = [s for s in fams["DCGM_FI_DEV_FB_TOTAL"].samples if s.labels["GPU_I_ID"] == "3"]
    assert (fb.labels["UUID"], fb.labels["GPU_I_PROFILE"], fb.labels["gpu"], fb.value) == (
        "GPU-m",
        "1g.10gb",
        "0",
        10240.0,
    )


# the agent's own cumulative counts (README: "the agent's own metrics"), and its levels
COUNTERS = {
    "gpuslo_agent_ticks",
    "gpuslo_agent_ticks_missed",
    "gpuslo_agent_clock_set_back",
    "gpuslo_agent_send_failures",
    "gpuslo_agent_source_errors",
    "gpuslo_agent_spool_accepted_records",
    "gpuslo_agent_spool_delivered_records",
    "gpuslo_agent_spool_dropped_records",
    "gpuslo_agent_spool_refused_records",
    "gpuslo_agent_spool_read_failures",
    "gpuslo_agent_nvml_errors",
    "gpuslo_agent_metrics_problems",
}
GAUGES = {
    "gpuslo_agent_gpu_healthy",
    "gpuslo_agent_last_sample_age_seconds",
    "gpuslo_agent_spool_records",
    "gpuslo_agent_spool_bytes",
}


def test_cumulative_counts_are_counters_named_total_and_dcgm_fields_stay_gauges() -> None:
    src = NvmlSource("node-7", "prod", 10, nvml=FakeNvml([FakeGpu("GPU-a")]))
    col = AgentCollector(
        stats=lambda: RunnerStats(ticks=7, send_failures=3, source_errors={"nvml": 2}, ticks_missed=4),
        spool=lambda: SpoolStats(
            accepted=9, delivered=4, pending=5, dropped_bound=0, dropped_corrupt=0, refused=0, bytes=10
        ),
        extra=lambda: {"gpuslo_agent_nvml_errors": 6},
    )
    col.observe(src.collect(1_790_000_000.0))
    text = generate_latest(registry_with(col)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {n: f.type for n, f in fams.items() if n.startswith("gpuslo_agent")}
    assert kinds == {n: "counter" for n in COUNTERS} | {n: "gauge" for n in GAUGES}
    for n in COUNTERS:  # every sample of a counter is NAME_total, as client_python writes its own
        assert {s.name for s in fams[n].samples} == {n + "_total"}, n
        assert f"# TYPE {n}_total counter" in text.splitlines(), n
    values = {s.name: s.value for n in COUNTERS for s in fams[n].samples if "reason" not in s.labels}
    assert values["gpuslo_agent_ticks_total"] == 7 and values["gpuslo_agent_send_failures_total"] == 3
    assert values["gpuslo_agent_ticks_missed_total"] == 4
    assert values["gpuslo_agent_source_errors_total"] == 2 and values["gpuslo_agent_nvml_errors_total"] == 6
    dcgm = {n: f for n, f in fams.items() if n.startswith("DCGM_FI_")}
    assert dcgm and all(f.type == "gauge" for f in dcgm.values())  # dcgm-exporter's types and names
    assert all(s.name in READ for f in dcgm.values() for s in f.samples)  # a name of the table's
    assert (
        BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].kind == "counter"
        and "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL" in dcgm  # the default generation's name of it
    )


# ---------------------------------------------------------------------------- a hostile page
T = 1_790_000_000.0


def _batch(node: str, *gpus: GpuSample, interval_s: float = 10.0, seq: int = 1) -> GpuSampleBatch:
    return GpuSampleBatch(source=node, boot_id="b", seq=seq, cluster="c", ts=T, node=node, interval_s=interval_s,
                          gpus=gpus)  # fmt: skip


def _lint(text: bytes) -> list[str]:
    """promtool's complaints about a text-format page, less the lint of dcgm-exporter's own
    label names (``UUID``, ``modelName``: camelCase, as dcgm-exporter writes them)."""
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    lines = (p.stdout + p.stderr).decode(errors="replace").splitlines()
    return [line for line in lines if "should be written in 'snake_case'" not in line]


def _both(reg: CollectorRegistry) -> tuple[dict[str, Any], dict[str, Any]]:
    """The page in the text format (checked by promtool) and in OpenMetrics, each parsed by
    prometheus-client's own parser for it: family name → family."""
    text = generate_latest(reg)
    if shutil.which("promtool"):
        assert _lint(text) == []
    om = openmetrics_latest(reg).decode()
    return (
        {f.name: f for f in text_string_to_metric_families(text.decode())},
        {f.name: f for f in om_families(om)},
    )


def test_hostile_names_in_every_label_keep_the_page_valid_and_read_back() -> None:
    """Every name the wire takes (tests/hostile.py: each ASCII code point, quotes, backslashes,
    newlines, NUL, UTF-8 of every length, the longest) in every label a GPU series carries: the
    node, the UUID, the model, the MIG profile, a Slurm job, a pod's namespace and name, the
    driver. The page is valid text exposition (promtool) and OpenMetrics, and each value reads
    back as it was."""
    names = hostile.names()
    batches = [
        _batch(s, GpuSample(index=0, uuid=s, model=s, fraction=0.5, fields={"DCGM_FI_DEV_GPU_UTIL": float(i % 100)},
                            mig=MigInstance(gi=1, profile=s),
                            allocations=(Allocation(scheduler="slurm", id=s, share=0.5),
                                         Allocation(scheduler="k8s", id="u", name=f"{s}/{s}"[:256], share=0.5))))
        for i, s in enumerate(names)
    ]  # fmt: skip
    col = AgentCollector(
        driver=lambda: names[7], stats=lambda: RunnerStats(source_errors=dict.fromkeys(names, 1))
    )
    col.observe(batches)
    for fams in _both(registry_with(col)):
        got = {(s.labels["hostname"], s.labels["UUID"], s.labels["modelName"], s.labels["GPU_I_PROFILE"],
                s.labels["hpc_job"], s.labels["namespace"], s.labels["pod"], s.labels["DCGM_FI_SYSTEM_DRIVER_VERSION"],
                s.value) for s in fams["DCGM_FI_DEV_GPU_UTIL_RATIO"].samples}  # fmt: skip
        want = set()
        for i, s in enumerate(names):
            ns, _, pod = f"{s}/{s}"[:256].partition("/")
            want |= {
                (s, s, s, s, s, "", "", names[7], (i % 100) / 100),
                (s, s, s, s, "", ns, pod, names[7], (i % 100) / 100),
            }
        assert got == want
        assert {s.labels["source"] for s in fams["gpuslo_agent_source_errors"].samples} == set(names)


def test_a_label_value_utf8_cannot_carry_is_replaced_not_the_page_lost() -> None:
    """A lone surrogate (JSON's ``"\\udc80"`` decodes to one: a Kueue queue or namespace name
    from the API server, a driver string) failed the whole page's UTF-8 encoding: every scrape a
    500, and the DaemonSet's liveness probe on /metrics restarting the agent."""
    from gpuslo.agent.kueue import PendingGauge

    class Workloads:
        skipped = 0

        def pending(self, now: float) -> dict[tuple[str, str], tuple[int, float]]:
            return {("team-\udc80/lq", "cq-\ud800x"): (2, 5.0), ("ok/lq", "cq"): (1, 1.0)}

    col = AgentCollector(driver=lambda: "580.\udcff")
    col.observe([_batch("n1", GpuSample(index=0, uuid="GPU-a", fields={"DCGM_FI_DEV_GPU_UTIL": 40.0}))])
    reg = registry_with(col, PendingGauge(Workloads()))  # type: ignore[arg-type]
    for fams in _both(reg):
        (util,) = fams["DCGM_FI_DEV_GPU_UTIL_RATIO"].samples
        assert util.labels["DCGM_FI_SYSTEM_DRIVER_VERSION"] == "580.\ufffd" and util.value == 0.4
        pending = {(s.labels["local_queue"], s.labels["cluster_queue"]): s.value
                   for s in fams["gpuslo_kueue_pending_workloads"].samples}  # fmt: skip
        assert pending == {("team-\ufffd/lq", "cq-\ufffdx"): 2, ("ok/lq", "cq"): 1}
        problems = {s.labels["reason"]: s.value for s in fams["gpuslo_agent_metrics_problems"].samples}
        assert problems["utf8"] > 0 and problems["collector"] == problems["duplicate"] == 0


@pytest.mark.parametrize("holders", [1, 2, 3, 16])
def test_a_shared_gpu_has_one_series_per_holder_as_dcgm_exporter_writes_it(holders: int) -> None:
    """dcgm-exporter writes a held GPU's series once per holder (its HPC job mapping: once per
    job of the GPU's mapping file; a time-sliced GPU: once per pod), with the same figures. The
    last holder alone was shown: the other jobs' and pods' dashboards and alerts saw nothing. Two
    holders the labels cannot tell apart (a namespace/pod cut at the wire's 256 characters) are
    one series, never a duplicate that fails the whole scrape."""
    jobs = tuple(Allocation(scheduler="slurm", id=str(100 + i), share=1 / holders) for i in range(holders))
    ns = "n" * 63
    pods = [("p" * 200) + f"{i:053d}" for i in range(holders)]  # the same first 192 characters: cut alike
    cut = tuple(Allocation(scheduler="k8s", id=f"u{i}", name=f"{ns}/{p}"[:256], share=1 / holders)
                for i, p in enumerate(pods))  # fmt: skip
    named = tuple(
        Allocation(scheduler="k8s", id=f"v{i}", name=f"team/pod-{i}", share=1 / holders)
        for i in range(holders)
    )
    col = AgentCollector()
    col.observe([_batch("n1", GpuSample(index=0, uuid="GPU-a", fields={"DCGM_FI_DEV_GPU_TEMP": 50.0}, allocations=jobs),
                        GpuSample(index=1, uuid="GPU-b", fields={"DCGM_FI_DEV_GPU_TEMP": 51.0}, allocations=cut),
                        GpuSample(index=2, uuid="GPU-c", fields={"DCGM_FI_DEV_GPU_TEMP": 52.0}, allocations=named),
                        GpuSample(index=3, uuid="GPU-d", fields={"DCGM_FI_DEV_GPU_TEMP": 53.0}))])  # fmt: skip
    for fams in _both(registry_with(col)):
        got = sorted((s.labels["gpu"], s.labels["hpc_job"], s.labels["namespace"], s.labels["pod"], s.value)
                     for s in fams["DCGM_FI_DEV_GPU_TEMP_CELSIUS"].samples)  # fmt: skip
        want = sorted([("0", str(100 + i), "", "", 50.0) for i in range(holders)]
                      + [("1", "", ns, ("p" * 192), 51.0)]
                      + [("2", "", "team", f"pod-{i}", 52.0) for i in range(holders)] + [("3", "", "", "", 53.0)])  # fmt: skip
        assert got == want
        assert len(fams["gpuslo_agent_gpu_healthy"].samples) == 4  # one per GPU, whoever holds it


def test_a_batch_no_longer_renewed_is_withdrawn_and_an_old_node_forgotten() -> None:
    """A source that stopped sending (an exporter down, NVML failing every tick) left its last
    figures on the page for ever: GPU utilization, temperature, health and the pods holding the
    GPUs as they were hours ago. A node name that changed (a dcgm-exporter's ``Hostname`` is its
    pod's name unless told the node's) left the old node's series for ever beside the new ones."""
    from gpuslo.agent.exporter import STALE_INTERVALS, STALE_MIN_S

    now = [0.0]
    col = AgentCollector(monotonic=lambda: now[0])
    held = (Allocation(scheduler="k8s", id="u", name="ns/pod"),)
    col.observe([_batch("old-name", GpuSample(index=0, uuid="GPU-a", fields={"DCGM_FI_DEV_GPU_UTIL": 90.0},
                                              allocations=held), interval_s=15.0)])  # fmt: skip

    def page() -> tuple[set[str], set[str], set[str]]:
        fams = {
            f.name: f for f in text_string_to_metric_families(generate_latest(registry_with(col)).decode())
        }
        util = {
            s.labels["hostname"]
            for s in fams.get("DCGM_FI_DEV_GPU_UTIL_RATIO", Metric("x", "", "gauge")).samples
        }
        up = {s.labels["hostname"] for s in fams["gpuslo_agent_gpu_healthy"].samples}
        age = {s.labels["hostname"] for s in fams["gpuslo_agent_last_sample_age_seconds"].samples}
        return util, up, age

    bound = max(STALE_INTERVALS * 15.0, STALE_MIN_S)
    now[0] = bound  # renewed just in time: shown
    assert page() == ({"old-name"}, {"old-name"}, {"old-name"})
    now[0] = bound + 0.5  # not renewed: withdrawn; its age stays, for the alert on it
    assert page() == (set(), set(), {"old-name"})
    col.observe([_batch("new-name", GpuSample(index=0, uuid="GPU-a", fields={"DCGM_FI_DEV_GPU_UTIL": 10.0}),
                        interval_s=15.0)])  # fmt: skip
    assert page() == ({"new-name"}, {"new-name"}, {"new-name"})  # the old node forgotten
    col.observe([_batch("old-name", GpuSample(index=0, uuid="GPU-a"), interval_s=15.0)])
    now[0] += 1.0
    # both fresh again (the old one with no field)
    assert page() == ({"new-name"}, {"new-name", "old-name"}, {"new-name", "old-name"})


class _Failing(Collector):
    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("gpuslo_half_done", "a family before the failure", value=1)
        raise RuntimeError("dictionary changed size during iteration")


class _Twice(Collector):
    """A collector of another source's: a family the agent's page has already, and a series twice."""

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily("gpuslo_agent_ticks", "again", value=99)
        yield GaugeMetricFamily(
            "gpuslo_agent_ticks_total", "a gauge under the counter's sample name", value=98
        )
        fam = GaugeMetricFamily("gpuslo_other", "a series written twice", labels=["x"])
        fam.add_metric(["a"], 1)
        fam.add_metric(["a"], 2)
        fam.add_metric(["b"], 3)
        yield fam


def test_a_failing_collector_or_a_duplicate_costs_its_own_families_not_the_page() -> None:
    """A collector that raised (a source's counts read while its thread changed them) failed the
    whole page with a 500; a family two collectors expose (``k8s-events --kueue`` showed the
    skipped workloads as the counter ``gpuslo_kueue_skipped_workloads`` and again as a gauge of
    the same name: OpenMetrics parsers refuse the page) or a series written twice made it
    invalid. Each is left out, counted and the rest served."""
    col = AgentCollector(stats=lambda: RunnerStats(ticks=7))
    col.observe([_batch("n1", GpuSample(index=0, uuid="GPU-a", fields={"DCGM_FI_DEV_GPU_UTIL": 40.0}))])
    for fams in _both(registry_with(col, _Failing(), _Twice())):
        assert "gpuslo_half_done" not in fams  # a failed collector's families: none of them
        assert [(s.name, s.value) for s in fams["gpuslo_agent_ticks"].samples] == [
            ("gpuslo_agent_ticks_total", 7)
        ]
        assert "gpuslo_agent_ticks_total" not in fams
        assert [(s.labels, s.value) for s in fams["gpuslo_other"].samples] == [
            ({"x": "a"}, 1),
            ({"x": "b"}, 3),
        ]
        assert fams["DCGM_FI_DEV_GPU_UTIL_RATIO"].samples[0].value == 0.4
        problems = {s.labels["reason"]: s.value for s in fams["gpuslo_agent_metrics_problems"].samples}
        assert problems["collector"] >= 1 and problems["duplicate"] >= 3


def test_kueue_pods_and_workloads_page_is_valid_openmetrics() -> None:
    """The page of ``k8s-events --kueue`` as the CLI builds it: the collectors' counts and
    Kueue's pending gauge, each family once."""
    from gpuslo.agent.kueue import PendingGauge

    class Workloads:
        skipped = 3

        def pending(self, now: float) -> dict[tuple[str, str], tuple[int, float]]:
            return {("ns/lq", "cq"): (1, 5.0)}

    counts = {"gpuslo_k8s_skipped_pods": 0, "gpuslo_k8s_watch_bad_lines": 0, "gpuslo_kueue_skipped_workloads": 3,
              "gpuslo_kueue_watch_bad_lines": 0}  # fmt: skip
    reg = registry_with(AgentCollector(extra=lambda: counts), PendingGauge(Workloads()))  # type: ignore[arg-type]
    om = openmetrics_latest(reg).decode()
    fams = {f.name: f for f in om_families(om)}  # "Clashing name" before
    assert fams["gpuslo_kueue_skipped_workloads"].type == "counter"
    assert [s.value for s in fams["gpuslo_kueue_skipped_workloads"].samples] == [3]
    assert {s.labels["reason"]: s.value for s in fams["gpuslo_agent_metrics_problems"].samples}[
        "duplicate"
    ] == 0


def test_two_compute_instances_of_one_gpu_instance_are_one_series_and_a_counted_duplicate() -> None:
    """dcgm-exporter's labels tell GPU instances apart, not compute instances: two of one GPU
    instance would write one series twice (an invalid page). The first is shown, the second
    counted, and the page stays valid."""
    from tests.fake_nvml import FakeMig

    migs = [
        FakeMig("MIG-a", gi=1, ci=0, gi_slices=2, ci_slices=1),
        FakeMig("MIG-b", gi=1, ci=1, gi_slices=2, ci_slices=1),
    ]
    src = NvmlSource("node-8", "prod", 10, nvml=FakeNvml([FakeGpu("GPU-m", mig=migs)]))
    col = AgentCollector(stats=lambda: RunnerStats(ticks=1), spool=None, names="classic")
    col.observe(src.collect(1_790_000_000.0))
    text = generate_latest(registry_with(col)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    fb = [s for s in fams["DCGM_FI_DEV_FB_TOTAL"].samples if s.labels["GPU_I_ID"] == "1"]
    assert len(fb) == 1 and fb[0].labels["UUID"] == "GPU-m"
    problems = {s.labels["reason"]: s.value for s in fams["gpuslo_agent_metrics_problems"].samples}
    assert problems.get("duplicate", 0) >= 1, problems

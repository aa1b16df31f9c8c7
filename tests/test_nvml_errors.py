"""Every NVML call the GPU source makes, failed with every NVML error code (pynvml's own classes,
raised as pynvml raises them) on one GPU of three: the agent starts, the other GPUs' rows are
what a fault-free node sends, and the failure is counted on /metrics. The calls swept are those
the fake saw the source make (at start, at a tick), not a list kept by hand."""

from __future__ import annotations

import pynvml
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuslo.agent.assemble import NodeAgent, NodeOptions, node_agent
from gpuslo.agent.base import StaticAttribution
from gpuslo.agent.exporter import AgentCollector, registry_with
from gpuslo.agent.nvml import GPM_METRICS, NvmlSource
from gpuslo.wire import Allocation, GpuSample, GpuSampleBatch, HealthEvent, Message
from tests.fake_nvml import FakeGpu, FakeMig, FakeNvml, FakeProc, FakeProcs

T = 1_790_000_000.0
CODES = sorted((n, getattr(pynvml, n)) for n in dir(pynvml) if n.startswith("NVML_ERROR_"))
LOST = pynvml.NVML_ERROR_GPU_IS_LOST
UNSUPPORTED = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
# read after the fields (agent.nvml_procs): a GPU lost there is an error of that tick's split, and
# the next tick's first field read finds it lost
PROCESS_CALLS = {f"nvmlDevice{k}" for k in ("GetComputeRunningProcesses", "GetGraphicsRunningProcesses",
                 "GetMPSComputeRunningProcesses", "GetProcessesUtilizationInfo", "GetProcessUtilization")}  # fmt: skip
TWO = (Allocation(scheduler="slurm", id="1", share=0.5), Allocation(scheduler="slurm", id="2", share=0.5))


def _fake() -> FakeNvml:
    """Three H100s with every GPM metric, NVLink, and two jobs' processes on each (so that the
    process calls are made)."""
    pct = {getattr(pynvml, a): 10.0 + k for k, (a, _) in enumerate(GPM_METRICS)}
    fake = FakeNvml([FakeGpu(f"GPU-{i}", util=10 + i, gpm_pct=dict(pct), nvlink_links=2) for i in range(3)])
    for g in fake.gpus:
        fake.processes[g.uuid] = FakeProcs(
            procs=[FakeProc(100), FakeProc(200)], samples=[(100, 5, 30), (200, 6, 10)]
        )
    return fake


def _agent(fake: FakeNvml) -> tuple[NodeAgent, NvmlSource]:
    agent = node_agent(NodeOptions(source="nvml", node="n1", cluster="c", interval_s=10.0, proc_root=None),
                       nvml=fake)  # fmt: skip
    src = agent.gpu
    assert isinstance(src, NvmlSource)
    # two holders on every GPU, each process its own holder: the split reads the processes
    src.attribution = StaticAttribution(lambda i, u: TWO)
    src.holder_of = lambda pid: TWO[0] if pid == 100 else TWO[1]
    return agent, src


def _metrics(agent: NodeAgent) -> dict[str, float]:
    assert agent.extra is not None
    text = generate_latest(registry_with(AgentCollector(extra=agent.extra))).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _counted(m: dict[str, float]) -> tuple[float, float, float]:
    return (m["gpuslo_agent_nvml_errors_total"], m["gpuslo_agent_fields_unsupported_total"],
            m["gpuslo_agent_gpus_lost_total"])  # fmt: skip


def _rows(msgs: list[Message]) -> dict[int, GpuSample]:
    (b,) = [m for m in msgs if isinstance(m, GpuSampleBatch)]
    return {g.index: g for g in b.gpus}


def _ticks(src: NvmlSource, n: int, k0: int = 0) -> list[list[Message]]:
    return [src.collect(T + 10 * (k0 + k)) for k in range(n)]


def _reference(ticks: int) -> tuple[list[list[Message]], tuple[float, float, float], dict[str, int]]:
    """A fault-free node: what it sends, counts, and which NVML calls each GPU saw at start."""
    fake = _fake()
    agent, src = _agent(fake)
    at_start = dict(fake.gpus[1].calls)
    out = _ticks(src, ticks)
    return out, _counted(_metrics(agent)), at_start


REF_OUT, REF_COUNTED, START_CALLS = _reference(3)


def _tick_calls() -> list[str]:
    fake = _fake()
    _, src = _agent(fake)
    before = dict(fake.gpus[1].calls)
    _ticks(src, 3)
    return sorted(fn for fn, n in fake.gpus[1].calls.items() if n > before.get(fn, 0))


def _same_as_reference(got: list[Message], ref: list[Message], indices: tuple[int, ...]) -> None:
    rows, want = _rows(got), _rows(ref)
    for i in indices:
        assert rows[i].healthy and rows[i].fields == want[i].fields, i
        assert rows[i].allocations == want[i].allocations, i


def test_the_reference_reads_everything_it_sweeps() -> None:
    """The sweep means something only if the fault-free node reads every kind of call: fields,
    NVLink, GPM metrics, processes and their utilization."""
    calls = _tick_calls()
    for fn in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetFieldValues", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
               "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetProcessesUtilizationInfo"):  # fmt: skip
        assert fn in calls, fn
    f = _rows(REF_OUT[-1])[1].fields
    assert (
        f["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == pytest.approx(0.10) and "DCGM_FI_PROF_NVLINK_TX_BYTES" not in f
    )
    assert {"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName"} <= set(START_CALLS)


@pytest.mark.parametrize("fn", sorted(START_CALLS))
@pytest.mark.parametrize(("name", "code"), CODES, ids=[n for n, _ in CODES])
def test_a_call_at_start_failing_on_one_gpu_never_stops_the_agent(fn: str, name: str, code: int) -> None:
    fake = _fake()
    fake.gpus[1].errors[fn] = code
    agent, src = _agent(fake)  # starts: one GPU's trouble is not the node's
    out = _ticks(src, 3)
    _same_as_reference(out[-1], REF_OUT[-1], (0, 2))
    errors, unsupported, lost = _counted(_metrics(agent))
    if fn == "nvmlDeviceGetMigMode" and code in UNSUPPORTED:
        assert (errors, unsupported, lost) == REF_COUNTED  # what a GPU without MIG answers: nothing to count
    elif code == LOST and fn in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName"):
        assert lost == REF_COUNTED[2] + 1
        events = [m for t in out for m in t if isinstance(m, HealthEvent)]
        assert [(e.event, e.gpu, e.fatal) for e in events] == [("gpu_lost", 1, True)]  # once
    else:
        assert errors + unsupported > REF_COUNTED[0] + REF_COUNTED[1], (errors, unsupported, REF_COUNTED)
    if fn in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName"):
        assert 1 not in _rows(out[-1])  # no handle or no name: no row of it
        fake.gpus[1].errors.clear()  # the driver answers again: sampled from the next tick
        rows = _rows(src.collect(T + 100))
        assert sorted(rows) == [0, 1, 2] and rows[1].uuid == "GPU-1" and rows[1].healthy


@pytest.mark.parametrize("fn", _tick_calls())
@pytest.mark.parametrize(("name", "code"), CODES, ids=[n for n, _ in CODES])
def test_a_call_at_a_tick_failing_on_one_gpu_costs_only_that_value_and_is_counted(
    fn: str, name: str, code: int
) -> None:
    fake = _fake()
    agent, src = _agent(fake)
    _ticks(src, 1)
    fake.gpus[1].errors[fn] = code
    out = _ticks(src, 2, k0=1)
    _same_as_reference(out[-1], REF_OUT[-1], (0, 2))
    errors, unsupported, lost = _counted(_metrics(agent))
    if code == LOST and fn not in PROCESS_CALLS:
        assert lost == REF_COUNTED[2] + 1 and not _rows(out[-1])[1].healthy
    elif code == pynvml.NVML_ERROR_NOT_FOUND and fn in (
        "nvmlDeviceGetProcessesUtilizationInfo",
        "nvmlDeviceGetProcessUtilization",
    ):
        pass  # no sample newer than the last one: a measurement (nobody ran a kernel), not a failure
    else:
        assert errors + unsupported > REF_COUNTED[0] + REF_COUNTED[1], (errors, unsupported, REF_COUNTED)
    # every GPM sample NVML allocated is freed but the one each GPU keeps for the next tick
    assert fake.gpm_samples_live <= 3, fake.gpm_samples_live


@pytest.mark.parametrize("fn", ["nvmlGpmSampleAlloc", "nvmlGpmSampleFree", "nvmlEventSetWait_v2"])
@pytest.mark.parametrize(("name", "code"), CODES, ids=[n for n, _ in CODES])
def test_a_call_of_no_one_gpu_failing_costs_no_gpu_its_other_fields(fn: str, name: str, code: int) -> None:
    fake = _fake()
    agent, src = _agent(fake)
    _ticks(src, 1)
    fake.errors[fn] = code
    out = _ticks(src, 2, k0=1)
    rows, want = _rows(out[-1]), _rows(REF_OUT[-1])
    gpm = {f for _, f in GPM_METRICS}
    for i in (0, 1, 2):
        assert {k: v for k, v in rows[i].fields.items() if k not in gpm} == {
            k: v for k, v in want[i].fields.items() if k not in gpm
        }
    counted = _counted(_metrics(agent))
    if fn == "nvmlEventSetWait_v2" and code == pynvml.NVML_ERROR_TIMEOUT:
        assert counted == REF_COUNTED  # nothing queued: NVML's answer to a wait of 0 ms
    else:
        assert sum(counted) > sum(REF_COUNTED)


def test_gpm_the_device_refuses_is_counted_once_and_not_asked_again() -> None:
    """NOT_SUPPORTED from nvmlGpmSampleGet (profiling off, a VM): counted once, not every tick, and
    the sample NVML allocated for it freed."""
    fake = _fake()
    _, src = _agent(fake)
    fake.gpus[1].errors["nvmlGpmSampleGet"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    before = src.stats.unsupported
    _ticks(src, 5)
    assert src.stats.unsupported == before + 1 and src.stats.errors == 0
    assert fake.gpus[1].calls["nvmlGpmSampleGet"] == 1
    assert fake.gpm_samples_live == 2  # the two other GPUs' last samples


def test_a_gpm_metric_the_device_refuses_is_counted_once() -> None:
    fake = _fake()
    fp64 = pynvml.NVML_GPM_METRIC_FP64_UTIL
    del fake.gpus[1].gpm_pct[fp64]  # NOT_SUPPORTED for that metric, in its nvmlReturn
    _, src = _agent(fake)
    before = src.stats.unsupported
    out = _ticks(src, 4)
    assert "DCGM_FI_PROF_PIPE_FP64_ACTIVE" not in _rows(out[-1])[1].fields
    assert "DCGM_FI_PROF_PIPE_FP64_ACTIVE" in _rows(out[-1])[0].fields
    assert src.stats.unsupported == before + 1


def test_an_xid_of_a_device_the_source_does_not_know_is_never_put_on_gpu_0() -> None:
    """A fatal XID takes its GPU out of capacity: one whose device is not among the opened GPUs
    (GPU 1 could not be opened) is dropped and counted, never reported as GPU 0's."""
    fake = _fake()
    fake.gpus[1].errors["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_UNKNOWN
    _, src = _agent(fake)
    errors = src.stats.errors
    fake.registered.add(1)  # whatever NVML delivers: an event of a device the source did not open
    fake.xids += [(1, 79), (2, 13)]
    ev = [m for m in src.collect(T) if isinstance(m, HealthEvent)]
    assert [(e.gpu, e.uuid, e.code) for e in ev] == [(2, "GPU-2", 13)]
    assert src.stats.errors == errors + 1


def test_an_xid_code_past_the_wire_bound_never_costs_the_tick() -> None:
    fake = _fake()
    _, src = _agent(fake)
    fake.xids += [(0, 2**32), (0, 48)]
    out = src.collect(T)
    assert sorted(_rows(out)) == [0, 1, 2]
    assert [(e.gpu, e.code) for e in out if isinstance(e, HealthEvent)] == [(0, 48)]


@pytest.mark.parametrize(
    ("name", "code"), [(n, c) for n, c in CODES if c not in UNSUPPORTED], ids=lambda x: str(x)
)
def test_a_link_whose_counter_fails_costs_that_tick_only_and_is_counted(name: str, code: int) -> None:
    """nvmlDeviceGetFieldValues succeeds, one link's value carries an error in its nvmlReturn. (Every
    value failing at once, e.g. TIMEOUT, was taken for "no NVLink" and NVLink never read again; one
    link failing made a sum without it: no rate, then a spike of its whole counter.)"""
    fake = _fake()
    g = fake.gpus[1]
    g.nvlink_tx_kib, g.nvlink_rx_kib, g.nvlink_ts_us = 1000, 500, 5_000_000
    _, src = _agent(fake)
    src.collect(T)
    for links in ({1}, {0, 1}):  # one link, then every link of the GPU's two
        errors, lost = src.stats.errors, src.stats.lost
        g.nvlink_returns = dict.fromkeys(links, code)
        g.nvlink_tx_kib += 100
        g.nvlink_ts_us += 10_000_000
        rows = _rows(src.collect(T + 10))
        if code == LOST:
            assert src.stats.lost == lost + 1 and not rows[1].healthy
            return
        assert src.stats.errors == errors + 1
        assert "DCGM_FI_PROF_NVLINK_TX_BYTES" not in rows[1].fields
        assert "nvlink" not in src.gpus[1].unsupported  # asked again
        g.nvlink_returns = {}
        g.nvlink_tx_kib += 100
        g.nvlink_ts_us += 10_000_000
        f = _rows(src.collect(T + 20)).get(1)
        assert f is not None
        # from the last good reading: 2 links x 200 KiB over 20 s
        assert f.fields["DCGM_FI_PROF_NVLINK_TX_BYTES"] == 2 * 200 * 1024 / 20


TRANSIENT = [(n, c) for n, c in CODES if c not in UNSUPPORTED and c != LOST]


@pytest.mark.parametrize(
    "fn", ["nvmlGpmQueryDeviceSupport", "nvmlDeviceRegisterEvents", "nvmlEventSetCreate"]
)
@pytest.mark.parametrize(("name", "code"), TRANSIENT, ids=[n for n, _ in TRANSIENT])
def test_a_setup_step_failing_for_a_while_is_asked_again_and_counted_once(
    fn: str, name: str, code: int
) -> None:
    """GPM support and XID events, refused at start by an error that is not "not supported": the
    GPU got no GPM (activity from utilization.gpu) or no XID events until the agent restarted."""
    fake = _fake()
    target = fake.errors if fn == "nvmlEventSetCreate" else fake.gpus[1].errors
    target[fn] = code
    agent, src = _agent(fake)
    errors = src.stats.errors
    for k in range(3):
        src.collect(T + 10 * k)
    assert src.stats.errors == errors  # counted at start, once
    assert _counted(_metrics(agent))[0] >= REF_COUNTED[0] + 1
    del target[fn]
    out = _ticks(src, 2, k0=3)
    assert _rows(out[-1])[1].fields == _rows(REF_OUT[-1])[1].fields  # GPM metrics too
    fake.xids.append((1, 48))
    ev = [m for m in src.collect(T + 50) if isinstance(m, HealthEvent)]
    assert [(e.gpu, e.code, e.fatal) for e in ev] == [(1, 48, True)]


def test_nvml_strings_that_are_not_utf8_are_read_not_fatal() -> None:
    """A driver version, board name or UUID in bytes that are not UTF-8 stopped the source at
    start (UnicodeDecodeError: no agent on that node). Read with U+FFFD where the bytes fail;
    the rows are sent and the page is served."""
    bad = b"NVIDIA H100 \xff\xfe 80GB"
    fake = FakeNvml([FakeGpu("GPU-0", name=bad), FakeGpu("GPU-1", driver=b"580.\xc3")])  # type: ignore[arg-type]
    fake.gpus[0].driver = b"580.\xc3"
    agent, src = _agent(fake)
    batch = next(m for m in src.collect(T) if isinstance(m, GpuSampleBatch))
    assert [g.model for g in batch.gpus] == ["NVIDIA H100 \ufffd\ufffd 80GB", "NVIDIA H100 80GB HBM3"]
    assert agent.extra is not None
    m = _metrics(agent)
    assert m, "the page is served"


def test_every_nvml_string_is_read_as_pynvml_returns_it() -> None:
    """pynvml (nvidia-ml-py, which the agent requires) decodes the C strings of
    ``nvmlDeviceGetUUID``, ``nvmlDeviceGetName`` and ``nvmlSystemGetDriverVersion`` itself,
    strictly (its ``convertStrBytes``, which the fake applies as pynvml does): bytes that are not
    UTF-8 raised UnicodeDecodeError from inside pynvml, so decoding the result with U+FFFD came
    too late and the source still did not start. Swept over each string: a GPU's UUID and name, a
    MIG device's UUID, the driver version, and a GPU-instance profile's name (a ctypes field)."""
    gpu_uuid, mig_uuid = b"GPU-\xff1", b"MIG-\xc3"
    fake = FakeNvml([
        FakeGpu("GPU-0", name=b"H100 \xfe"),  # type: ignore[arg-type]
        FakeGpu(gpu_uuid, mig_capable=True, mig=[FakeMig(mig_uuid, gi=1, profile_name=b"MIG 1g.10gb\xff")]),  # type: ignore[arg-type]
    ])  # fmt: skip
    fake.gpus[0].driver = b"580.\xc3"
    agent, src = _agent(fake)
    batch = next(m for m in src.collect(T) if isinstance(m, GpuSampleBatch))
    got = [(g.uuid, g.model, g.mig.profile if g.mig else None) for g in batch.gpus]
    assert got == [
        ("GPU-0", "H100 \ufffd", None),
        ("GPU-\ufffd1", "NVIDIA H100 80GB HBM3", None),
        ("MIG-\ufffd", "NVIDIA H100 80GB HBM3", "1g.10gb\ufffd"),
    ]
    assert agent.extra is not None
    assert _metrics(agent), "the page is served"

"""dcgm-exporter and inference-server histograms, scraped over real HTTP from a local server."""

from __future__ import annotations

import http.server
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.scrape import DcgmExporterSource, LatencySource, LatencyTarget
from gpuslo.wire import BY_NAME, GpuSampleBatch, LatencyDelta, decode, encode
from tests.trickle import Trickle

T = 1_790_000_000.0


class Endpoint:
    """Serves whatever text ``body`` holds at /metrics (and 500 when ``fail``)."""

    def __init__(self) -> None:
        self.body = ""
        self.fail = False
        self.requests = 0
        ep = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ep.requests += 1
                if ep.fail:
                    self.send_error(500)
                    return
                data = ep.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    ep = Endpoint()
    yield ep
    ep.server.shutdown()


DATA = Path(__file__).parent / "data" / "dcgm-exporter"  # recorded from dcgm-exporter 3.6.1 (README there)
DCGM_TEXT = (DATA / "3.6.1-whole-gpus.txt").read_text()
DCGM_MIG_TEXT = (DATA / "3.6.1-mig.txt").read_text()
UUID0, UUID1 = "GPU-7e3a3f0d-6a21-4d52-9a4e-0b1d9c1f2a10", "GPU-c4b2e9a1-3f5e-4c6d-8e7f-1a2b3c4d5e6f"


def test_dcgm_exporter_maps_fields_labels_and_holders(endpoint: Endpoint) -> None:
    endpoint.body = DCGM_TEXT
    src = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b")
    (b,) = src.collect(T)
    assert isinstance(b, GpuSampleBatch) and b.node == "n1"
    g0, g1 = b.gpus
    assert (g0.uuid, g0.model, g1.uuid) == (UUID0, "NVIDIA H100 80GB HBM3", UUID1)
    assert g0.fields == {
        "DCGM_FI_DEV_GPU_UTIL": 87.0,
        "DCGM_FI_DEV_POWER_USAGE": 612.5,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.91,
    }
    assert g1.fields == {"DCGM_FI_DEV_GPU_UTIL": 3.0}  # the negative power reading was dropped
    assert src.stats.dropped == 1
    assert [(a.scheduler, a.id) for a in g0.allocations] == [("slurm", "777")]
    assert [(a.scheduler, a.id, a.queue) for a in g1.allocations] == [("k8s", "team-a/train-0", "team-a")]
    assert src.stats.ignored == {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"}
    assert decode(encode(b)) == b
    assert set(g0.fields) <= set(BY_NAME)


def test_dcgm_exporter_4x_hostname_label_names_the_node(endpoint: Endpoint) -> None:
    """dcgm-exporter from 4.8.3 on names the node label ``hostname`` (NVIDIA/dcgm-exporter#655):
    its recording (tests/data/dcgm-exporter/README.md) has no ``Hostname`` at all."""
    endpoint.body = (DATA / "4.8.3-whole-gpus.txt").read_text()
    assert 'Hostname="' not in endpoint.body and 'hostname="n1"' in endpoint.body
    (b,) = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b").collect(T)
    assert isinstance(b, GpuSampleBatch) and b.node == "n1" and len(b.gpus) == 2


def test_dcgm_exporter_mig_instances(endpoint: Endpoint) -> None:
    """A GPU with a 3g.40gb instance held by a pod and a free 1g.10gb one: three rows for it
    (its own with the power reading and the 3 unused slices, and one per instance), each with
    its fraction; a whole GPU beside it."""
    endpoint.body = DCGM_MIG_TEXT
    (b,) = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b").collect(T)
    assert isinstance(b, GpuSampleBatch) and b.node == "n2"
    rows = {(g.index, g.mig.gi if g.mig else None): g for g in b.gpus}
    assert set(rows) == {(0, None), (0, 1), (0, 9), (1, None)}
    own, big, small = rows[(0, None)], rows[(0, 1)], rows[(0, 9)]
    assert own.fields == {"DCGM_FI_DEV_POWER_USAGE": 250.0} and own.fraction == pytest.approx(3 / 7)
    assert (big.fraction, big.mig.profile) == (pytest.approx(3 / 7), "3g.40gb")  # type: ignore[union-attr]
    assert big.fields == {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.62, "DCGM_FI_DEV_FB_USED": 20480.0}
    assert [a.id for a in big.allocations] == ["ml/infer-0"] and small.allocations == ()
    assert small.fraction == pytest.approx(1 / 7) and rows[(1, None)].fraction == 1.0
    assert len({g.uuid for g in b.gpus}) == 4
    assert decode(encode(b)) == b
    a30 = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b", mig_slices=4).collect(T)[0]
    assert isinstance(a30, GpuSampleBatch)
    assert sorted(g.fraction for g in a30.gpus if g.index == 0) == pytest.approx([0.0, 0.25, 0.75])
    # mig_slices set too low for this GPU (2 where its instances hold 3 + 1 slices): the
    # instances share the GPU by their slices, 3/4 and 1/4, and never stand for more than it
    low = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b", mig_slices=2).collect(T)[0]
    assert isinstance(low, GpuSampleBatch)
    assert sorted(g.fraction for g in low.gpus if g.index == 0) == pytest.approx([0.0, 0.25, 0.75])


def test_scrape_failure_is_contained_and_counted(
    endpoint: Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint.fail = True
    src = DcgmExporterSource(endpoint.url, "prod", 15.0)
    assert src.collect(T) == [] and src.collect(T + 15) == []
    assert src.stats.failures == 2
    assert caplog.text.count("scrape of") == 1  # logged once


def hist(counts_by_le: dict[str, float], total_sum: float, name: str = "vllm:e2e_request_latency_seconds",
         model: str = "m") -> str:  # fmt: skip
    lines = [f"# TYPE {name} histogram"]
    for le, c in counts_by_le.items():
        lines.append(f'{name}_bucket{{le="{le}",model_name="{model}"}} {c}')
    lines.append(f'{name}_sum{{model_name="{model}"}} {total_sum}')
    lines.append(f'{name}_count{{model_name="{model}"}} {counts_by_le["+Inf"]}')
    return "\n".join(lines) + "\n"


def test_latency_deltas_across_a_counter_reset(endpoint: Endpoint) -> None:
    src = LatencySource(
        [LatencyTarget(endpoint.url, "chat", "vllm:e2e_request_latency_seconds", "s")], "prod", "n1"
    )
    endpoint.body = hist({"0.001": 10, "0.005": 90, "0.01": 95, "+Inf": 100}, 0.4)
    assert src.collect(T) == []  # baseline
    endpoint.body = hist({"0.001": 15, "0.005": 140, "0.01": 150, "+Inf": 160}, 0.7)
    (d,) = src.collect(T + 10)
    assert isinstance(d, LatencyDelta)
    assert d.bounds_ms == (1.0, 5.0, 10.0)  # seconds → ms
    assert d.counts == (5, 45, 5, 5)  # non-cumulative: 5 ≤1 ms, 45 in (1,5], 5 in (5,10], 5 above
    assert d.sum_ms == pytest.approx(300.0) and d.interval_s == pytest.approx(10.0)
    endpoint.body = hist({"0.001": 2, "0.005": 3, "0.01": 3, "+Inf": 4}, 0.02)  # the server restarted
    (d,) = src.collect(T + 20)
    assert d.counts == (2, 1, 0, 1) and src.stats.resets == 1
    endpoint.body = hist({"0.001": 2, "0.005": 3, "0.01": 3, "+Inf": 4}, 0.02)  # no traffic
    (d,) = src.collect(T + 30)
    assert d.counts == (0, 0, 0, 0)
    assert decode(encode(d)) == d


def test_latency_sums_series_and_filters_labels(endpoint: Endpoint) -> None:
    t = LatencyTarget(
        endpoint.url, "triton-a", "nv_inference_first_response_histogram_ms", "ms", (("model_name", "a"),)
    )
    src = LatencySource([t], "prod", "n1")
    name = "nv_inference_first_response_histogram_ms"
    endpoint.body = (
        hist({"5": 1, "+Inf": 1}, 2, name, "a")
        + hist({"5": 100, "+Inf": 100}, 200, name, "b").split("\n", 1)[1]
    )
    src.collect(T)
    endpoint.body = (
        hist({"5": 4, "+Inf": 6}, 40, name, "a")
        + hist({"5": 900, "+Inf": 900}, 2000, name, "b").split("\n", 1)[1]
    )
    (d,) = src.collect(T + 10)
    assert d.bounds_ms == (5.0,) and d.counts == (3, 2)  # only model a


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_cli_dcgm_and_latency_agent(endpoint: Endpoint, tmp_path: object) -> None:
    from gpuslo.app.cli import main

    lat = Endpoint()
    try:
        endpoint.body = DCGM_TEXT
        lat.body = hist({"0.001": 1, "0.005": 2, "+Inf": 2}, 0.003)
        out = Path(str(tmp_path)) / "out.jsonl"
        rc = main(["agent", "--source", "dcgm", "--dcgm-url", endpoint.url, "--latency", f"{lat.url}=chat",
                   "--ticks", "3", "--interval-s", "1", "--metrics-port", "0", "--out", str(out)])  # fmt: skip
        assert rc == 0
        msgs = [decode(line) for line in out.read_bytes().splitlines()]
        assert sum(isinstance(m, GpuSampleBatch) for m in msgs) == 3
        assert any(
            isinstance(m, LatencyDelta) and m.service == "chat" for m in msgs
        )  # from the 2nd scrape on
    finally:
        lat.server.shutdown()


def test_metrics_port_in_use_is_a_clear_error(endpoint: Endpoint, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from gpuslo.app.cli import EXIT_ERROR, main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["agent", "--source", "dcgm", "--dcgm-url", endpoint.url, "--ticks", "1", "--interval-s", "1",
                   "--metrics-addr", "127.0.0.1", "--metrics-port", str(port)])  # fmt: skip
    assert rc == EXIT_ERROR
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in capsys.readouterr().err


def _shared(pods: list[str], job: str = "") -> str:
    """dcgm-exporter's text for GPU 0 shared by time-slicing: each series written once per pod
    (its ``--kubernetes`` mapping), with the same figures; GPU 1 unshared."""
    lab = 'gpu="{g}",UUID="GPU-{g}",device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="n1"'
    out = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for p in pods:
        out.append(f'DCGM_FI_DEV_GPU_UTIL{{{lab.format(g=0)},container="c",namespace="ns",pod="{p}"}} 60')
    extra = f',hpc_job="{job}"' if job else ""
    out.append(f"DCGM_FI_DEV_GPU_UTIL{{{lab.format(g=1)}{extra}}} 5")
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_a_shared_gpu_is_split_equally_among_its_pods(endpoint: Endpoint, n: int) -> None:
    """Every pod of a time-sliced GPU holds 1/n of it (the first pod alone held all of it)."""
    pods = [f"p{i}" for i in range(n)]
    endpoint.body = _shared(pods, job="42")
    (b,) = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b").collect(T)
    assert isinstance(b, GpuSampleBatch)
    g0, g1 = b.gpus
    assert [a.id for a in g0.allocations] == [f"ns/{p}" for p in pods]
    assert all(a.share == pytest.approx(1 / n) for a in g0.allocations)
    assert {a.share_source for a in g0.allocations} == ({""} if n == 1 else {"equal"})
    assert g0.fields == {"DCGM_FI_DEV_GPU_UTIL": 60.0}  # one GPU's figures, not n of them
    assert [(a.scheduler, a.id, a.share) for a in g1.allocations] == [("slurm", "42", 1.0)]
    assert decode(encode(b)) == b


def test_a_pod_written_twice_holds_its_share_once(endpoint: Endpoint) -> None:
    endpoint.body = _shared(["a", "b", "a"])
    (b,) = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b").collect(T)
    assert isinstance(b, GpuSampleBatch)
    assert [(a.id, a.share) for a in b.gpus[0].allocations] == [("ns/a", 0.5), ("ns/b", 0.5)]


def test_more_holders_than_the_wire_allows_keeps_the_gpu_and_counts_the_rest(endpoint: Endpoint) -> None:
    endpoint.body = _shared([f"p{i}" for i in range(70)])
    src = DcgmExporterSource(endpoint.url, "prod", 15.0, boot_id="b")
    (b,) = src.collect(T)
    assert isinstance(b, GpuSampleBatch)
    assert len(b.gpus[0].allocations) == 64 and src.stats.refused == 6
    assert sum(a.share for a in b.gpus[0].allocations) == pytest.approx(1.0)


# ---------------------------------------------------------------- hostile labels
# one recorded series of the MIG recording's instance 9 (1g.10gb), to be written again with hostile labels
MIG9 = next(x for x in DCGM_MIG_TEXT.splitlines() if 'GPU_I_ID="9"' in x)
MIG_ROWS = {(0, None): 3 / 7, (0, 1): 3 / 7, (0, 9): 1 / 7, (1, None): 1.0}  # the recording's rows


def _collect(text: str, **kw: object) -> tuple[list[object], DcgmExporterSource]:
    src = DcgmExporterSource(
        "http://exporter/metrics", "prod", 15.0, fetch=lambda u, t: text, boot_id="b", **kw
    )  # type: ignore[arg-type]
    return list(src.collect(T)), src


def _rows(b: GpuSampleBatch) -> dict[tuple[int, int | None], float]:
    return {(g.index, g.mig.gi if g.mig else None): g.fraction for g in b.gpus}


@pytest.mark.parametrize(
    "gi",
    ["x", "\u00b2", "\u0663", "\u0661", "-1", " 1", "1 ", "+1", "1_0", "01", "00", "1.0", "0x1", "1e2",
     "256", "300", "65535", "99999", "1" * 5000, "\u200b1", "\\n"],
)  # fmt: skip
def test_a_malformed_mig_instance_id_costs_its_series_not_the_scrape(
    gi: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``GPU_I_ID`` that is not an id the wire holds: a non-digit was the GPU's own row a second
    time ('GPU 0 appears more than once'), '²' passed isdigit() and raised in int(), '٣' became
    instance 3, '01' a second instance 1, 256 and over were clamped into instance 255. The series
    is refused and counted, once; the GPU's other rows and the other GPU are the recording's."""
    bad = MIG9.replace('GPU_I_ID="9"', f'GPU_I_ID="{gi}"').replace(" 0.000000", " 0.5")
    msgs, src = _collect(DCGM_MIG_TEXT + bad + "\n")
    (b,) = msgs
    assert isinstance(b, GpuSampleBatch) and b.node == "n2"
    assert _rows(b) == pytest.approx(MIG_ROWS)
    assert src.stats.refused == 1 and src.stats.failures == 0
    assert decode(encode(b)) == b
    src.collect(T + 15)
    assert src.stats.refused == 2 and caplog.text.count("GPU_I_ID label") == 1  # logged once


@pytest.mark.parametrize("ids", [("300", "400"), ("255", "256"), ("256", "1" * 300)])
def test_mig_instance_ids_past_the_wire_are_never_clamped_into_one(ids: tuple[str, str]) -> None:
    """Two instances past the wire's 255 were both clamped to 255: one key, the batch refused."""
    text = DCGM_MIG_TEXT + "".join(MIG9.replace('GPU_I_ID="9"', f'GPU_I_ID="{i}"') + "\n" for i in ids)
    (b,), src = _collect(text)
    assert isinstance(b, GpuSampleBatch)
    want = dict(MIG_ROWS)
    if ids[0] == "255":  # an id the wire holds, an instance of its own (1 slice of 7)
        want[(0, 255)], want[(0, None)] = 1 / 7, 2 / 7
    assert _rows(b) == pytest.approx(want)
    assert src.stats.refused == sum(int(i) > 255 for i in ids)


@pytest.mark.parametrize("profile", ["1" * 5000 + "g.10gb", "\u0663g.40gb", "0g.1gb", "\u00b2g.10gb"])
def test_a_hostile_mig_profile_is_one_slice(profile: str) -> None:
    """The slices of a profile are ASCII digits: '٣g.' was 3 slices, and 5,000 digits raised out of
    int() (Python's 4,300-digit limit) and lost the scrape. Unknown: 1 slice, as before."""
    text = DCGM_MIG_TEXT.replace('GPU_I_PROFILE="1g.10gb"', f'GPU_I_PROFILE="{profile}"')
    (b,), src = _collect(text)
    assert isinstance(b, GpuSampleBatch)
    assert _rows(b) == pytest.approx(MIG_ROWS) and src.stats.refused == 0


@pytest.mark.parametrize(
    ("first", "again", "kept", "refused", "dropped"),
    [("50", "99", 50.0, 1, 0), ("99", "50", 99.0, 1, 0), ("50", "50", 50.0, 0, 0), ("50", "50.0", 50.0, 0, 0),
     ("50", "-5", 50.0, 1, 0), ("50", "NaN", 50.0, 1, 0), ("NaN", "50", None, 1, 1), ("NaN", "NaN", None, 0, 1),
     ("-5", "50", None, 1, 1)],
)  # fmt: skip
def test_a_series_written_twice_keeps_its_first_value(
    first: str, again: str, kept: float | None, refused: int, dropped: int
) -> None:
    """Prometheus keeps a series' first sample of a scrape and refuses a second with another value
    ('duplicate sample for timestamp'); the same value again is no conflict. The last one won,
    silently. The same rule for a MIG instance's series."""
    lab = 'gpu="0",UUID="GPU-0",Hostname="n1"'
    other = 'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-1",Hostname="n1"} 7\n'
    for extra in ("", ',GPU_I_ID="1",GPU_I_PROFILE="1g.10gb"'):
        text = f"DCGM_FI_DEV_GPU_UTIL{{{lab}{extra}}} {first}\n{other}DCGM_FI_DEV_GPU_UTIL{{{lab}{extra}}} {again}\n"
        (b,), src = _collect(text)
        assert isinstance(b, GpuSampleBatch)
        rows = {(g.index, g.mig is not None): g.fields.get("DCGM_FI_DEV_GPU_UTIL") for g in b.gpus}
        assert rows.get((0, extra != "")) == kept and rows[(1, False)] == 7.0, extra  # none: no row
        assert (src.stats.refused, src.stats.dropped) == (refused, dropped), extra


@pytest.mark.parametrize("label", ["Hostname", "hostname"])
@pytest.mark.parametrize("host", ["h" * 257, "h" * 5000, "\u00e9" * 257])
def test_a_node_label_the_wire_refuses_is_not_the_node(
    label: str, host: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``Hostname`` over the wire's 256 characters made the batch invalid: every GPU of the node
    lost, every tick. It is not the node: another series' label is, else ``unknown`` as with no
    label at all; counted once a scrape and logged once; every GPU is sent."""
    text = DCGM_TEXT.replace('Hostname="n1"', f'{label}="{host}"')
    (b,), src = _collect(text)
    assert isinstance(b, GpuSampleBatch)
    assert b.node == "unknown" and [g.uuid for g in b.gpus] == [UUID0, UUID1] and src.stats.refused == 1
    src.collect(T + 15)
    assert src.stats.refused == 2 and caplog.text.count("not a node name the wire takes") == 1
    # one series naming the node as the wire takes it: that is the node, wherever it comes
    (b,), src = _collect(text + 'DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="' + UUID1 + '",Hostname="n1"} 40\n')
    assert isinstance(b, GpuSampleBatch) and b.node == "n1" and src.stats.refused == 1
    # --node names the node: the label is not asked
    (b,), src = _collect(text, node="n7")
    assert isinstance(b, GpuSampleBatch) and b.node == "n7" and src.stats.refused == 0


def test_a_batch_the_wire_still_refuses_is_a_failed_scrape_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What no series holds (a ``node`` given over the wire's bound): the scrape sends nothing,
    counted as a failed scrape and logged once, and the sampling loop goes on."""
    src = DcgmExporterSource(
        "http://exporter/metrics", "prod", 15.0, node="n" * 257, fetch=lambda u, t: DCGM_TEXT
    )
    assert src.collect(T) == [] and src.collect(T + 15) == []
    assert src.stats.failures == 2 and caplog.text.count("the wire refuses its batch") == 1


BAD_HISTOGRAMS = {
    "a bucket without le": 'h_bucket{x="1"} 1\nh_bucket{le="+Inf"} 2\nh_sum 1\n',
    "an le that is text": 'h_bucket{le="abc"} 1\nh_bucket{le="+Inf"} 2\nh_sum 1\n',
    "an le that is NaN": 'h_bucket{le="NaN"} 1\nh_bucket{le="+Inf"} 2\nh_sum 1\n',
    "a negative le": 'h_bucket{le="-1"} 1\nh_bucket{le="+Inf"} 2\nh_sum 1\n',
    "an le past a double": 'h_bucket{le="1e400"} 1\nh_bucket{le="+Inf"} 2\nh_sum 1\n',
    "NaN counts": 'h_bucket{le="1"} NaN\nh_bucket{le="+Inf"} NaN\nh_sum 1\n',
    "infinite counts": 'h_bucket{le="1"} +Inf\nh_bucket{le="+Inf"} +Inf\nh_sum 1\n',
}


@pytest.mark.parametrize("what", sorted(BAD_HISTOGRAMS))
def test_a_malformed_histogram_costs_its_target_not_the_others(
    what: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A histogram series no delta can come from (a bucket with no ``le``, an ``le`` that is no
    bound, counts that are NaN or infinite) raised out of ``collect`` (KeyError, ValueError, a
    ValidationError of the delta): every target's deltas lost, every tick, the runner logging a
    traceback. It is refused and counted; the other targets' deltas are sent."""
    good = "# TYPE h histogram\n" + 'h_bucket{le="1"} %d\nh_bucket{le="+Inf"} %d\nh_sum %d\n'
    n = {"good": 0}

    def fetch(url: str, timeout_s: float) -> str:
        if url == "bad":
            return "# TYPE h histogram\n" + BAD_HISTOGRAMS[what]
        n["good"] += 1
        return good % (n["good"], 2 * n["good"], n["good"])

    src = LatencySource([LatencyTarget("bad", "bad", "h"), LatencyTarget("good", "good", "h")], "prod", "n1",
                        fetch=fetch)  # fmt: skip
    assert src.collect(T) == []  # baselines
    for k in (1, 2):
        (d,) = src.collect(T + 10 * k)
        assert isinstance(d, LatencyDelta) and d.service == "good" and d.counts == (1, 1)
    assert src.stats.refused >= 2 and src.stats.failures >= 2
    assert caplog.text.count("series refused") == 1 and "Traceback" not in caplog.text


def test_a_scrape_that_never_ends_fails_within_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """An exporter that trickles its body kept each read under the socket timeout and the scrape
    going for ever; the sources share the agent's one sampling loop, so the node's GPU samples
    stopped with it. A scrape is read whole within its timeout, or fails, counted."""
    server = Trickle(status="200 OK")
    try:
        src = LatencySource([LatencyTarget(server.url, "chat", "h")], "prod", "n1", timeout_s=0.5)
        result: list[object] = []
        th = threading.Thread(target=lambda: result.append(src.collect(T)), daemon=True)
        th.start()
        th.join(10)
        assert not th.is_alive() and result == [[]]
        assert src.stats.failures == 1 and "TimeoutError" in caplog.text
    finally:
        server.close()


def test_a_body_past_the_bound_is_a_failed_scrape(endpoint: Endpoint) -> None:
    """A body longer than ``max_bytes`` is read no further and fails the scrape: the agent, on
    every GPU node, never holds an endpoint's endless page in memory."""
    from gpuslo.agent.scrape import http_get

    endpoint.body = "# x\n" * 1000
    assert http_get(endpoint.url, 5.0, max_bytes=4000) == endpoint.body
    with pytest.raises(OSError, match="longer than 3999 bytes"):
        http_get(endpoint.url, 5.0, max_bytes=3999)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_every_replica_of_a_service_counts(replicas: int, store: Any) -> None:
    """Two replicas of one service scraped by one agent: every target of a tick is stamped with
    the tick's time, and the store keeps one latency row per (cluster, service, source, ts), so
    under one source the replicas replaced each other's rows (one replica's requests counted).
    Each target has a source of its own where its service has several; every request counts,
    replayed or not."""
    from gpuslo.ingest.writer import write

    name = "vllm:e2e_request_latency_seconds"
    pages = {f"http://r{i}/metrics": hist({"0.005": 0, "+Inf": 0}, 0.0) for i in range(replicas)}
    targets = [LatencyTarget(u, "chat", name, "s") for u in pages]
    targets.append(LatencyTarget("http://other/metrics", "embed", name, "s"))  # one target: its own source
    pages["http://other/metrics"] = pages["http://r0/metrics"]
    src = LatencySource(targets, "prod", "n1", fetch=lambda url, _t: pages[url])
    assert src.collect(T) == []  # the baselines
    sent = []
    for k in range(1, 4):
        for i, u in enumerate(pages):
            pages[u] = hist({"0.005": 10 * k * (i + 1), "+Inf": 12 * k * (i + 1)}, 0.1 * k)
        sent += src.collect(T + 10 * k)
    assert len(sent) == 3 * (replicas + 1)
    assert {d.source for d in sent if d.service == "embed"} == {"n1"}
    write(store, sent)
    write(store, sent)  # a replay replaces, never adds
    (row,) = store.query(
        "SELECT sum(arraySum(counts)) AS n, count() AS rows FROM latency FINAL WHERE service = 'chat'"
    )
    assert row["rows"] == 3 * replicas
    assert row["n"] == sum(d.counts[0] + d.counts[1] for d in sent if d.service == "chat")


def test_a_latency_target_given_twice_is_refused() -> None:
    t = LatencyTarget("http://r0/metrics", "chat", "h", "s")
    with pytest.raises(ValueError, match="given twice"):
        LatencySource([t, t], "prod", "n1")
    other = LatencyTarget("http://r0/metrics", "chat", "h", "s", (("model_name", "b"),))  # other labels
    assert len(LatencySource([t, other], "prod", "n1").seqs) == 2


@pytest.mark.parametrize("node_len", [240, 247, 248, 249, 253])
@pytest.mark.parametrize("replicas", [1, 2, 12])
def test_a_long_node_name_still_sends_every_replica(node_len: int, replicas: int, store: Any) -> None:
    """A node name up to Kubernetes' 253 characters: its latency source ``NODE-latency`` (and
    ``#k`` for a service's several targets) passed the wire's 256 and every delta of the node
    was refused (a failed scrape each tick, the service's latency lost). A source too long is
    cut and told apart by a hash of the whole: every replica sends, each under its own source."""
    from gpuslo.ingest.writer import write

    name = "vllm:e2e_request_latency_seconds"
    node = ("n" * node_len)[:-2] + "-x"
    pages = {f"http://r{i}/metrics": hist({"0.005": 0, "+Inf": 0}, 0.0) for i in range(replicas)}
    src = LatencySource([LatencyTarget(u, "chat", name, "s") for u in pages], "prod", f"{node}-latency",
                        fetch=lambda url, _t: pages[url])  # fmt: skip
    assert src.collect(T) == []
    for i, u in enumerate(pages):
        pages[u] = hist({"0.005": 10 * (i + 1), "+Inf": 12 * (i + 1)}, 0.1)
    sent = src.collect(T + 10)
    assert src.stats.failures == 0 and len(sent) == replicas
    assert len({d.source for d in sent}) == replicas and all(len(d.source) <= 256 for d in sent)
    again = LatencySource(src.targets, "prod", f"{node}-latency", fetch=lambda url, _t: pages[url])
    assert [s.source for s in again.seqs.values()] == [s.source for s in src.seqs.values()]  # at every start
    write(store, sent)
    (row,) = store.query("SELECT sum(arraySum(counts)) AS n FROM latency FINAL WHERE service = 'chat'")
    assert row["n"] == sum(12 * (i + 1) for i in range(replicas))


def _page(lines: int) -> str:
    """A valid dcgm-exporter page of ``lines`` (at least 3) lines: series of a family the source
    ignores, then GPU 0's."""
    head = [f'go_goroutines{{i="{k}"}} {k}' for k in range(lines - 3)]
    gpu = ["# TYPE DCGM_FI_DEV_GPU_UTIL gauge", 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-0",Hostname="n1"} 42']
    return "\n".join(["# TYPE go_goroutines gauge", *head, *gpu]) + "\n"


@pytest.mark.parametrize("lines", [3, 255, 256, 257, 512, 513, 4000])
@pytest.mark.parametrize("late_from_call", [1, 2, 3, 4, 1000])
def test_a_page_not_parsed_within_the_scrapes_timeout_is_a_failed_scrape(
    lines: int, late_from_call: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The fetch was bounded by ``timeout_s``, the parse not: a page at the body's bound (16 MiB,
    200,000 series) took some 33 s in prometheus_client's parser and stalled the node's one
    sampling loop. The parse has a deadline of its own now (``timeout_s`` from the page's
    arrival), looked at every LINES_PER_CHECK lines: a clock past it (from the
    ``late_from_call``-th look; the first is the deadline's own reading) fails the scrape,
    counted and said, as a slow fetch does."""
    from gpuslo.agent import scrape

    calls = 0

    def clock() -> float:
        nonlocal calls
        calls += 1
        return 100.0 if calls >= late_from_call else 0.0

    src = DcgmExporterSource("http://x/metrics", "prod", 15.0, fetch=lambda u, t: _page(lines), boot_id="b")
    src.clock = clock  # type: ignore[method-assign]
    got = src.collect(T)
    looks = 1 + math.ceil(lines / scrape.LINES_PER_CHECK)  # the deadline's reading, then every 256 lines
    # (late from the first call: the deadline itself read at 100, no look is past it)
    if 1 < late_from_call <= looks:
        assert got == [] and src.stats.failures == 1
        assert "not parsed within the scrape's 5 s" in caplog.text
    else:
        (b,) = got
        assert [(g.index, g.fields["DCGM_FI_DEV_GPU_UTIL"]) for g in b.gpus] == [(0, 42.0)]  # type: ignore[attr-defined]
        assert src.stats.failures == 0


def test_a_fetch_that_used_the_whole_timeout_still_has_its_parse() -> None:
    """The parse has a budget of its own, read after the fetch: a slow exporter whose page came
    just inside ``timeout_s`` is parsed (a deadline shared with the fetch refused it at its first
    look, however quick the parse), and one whose parse then takes over ``timeout_s`` is not."""
    now = [0.0]

    def fetch(url: str, timeout_s: float) -> str:
        now[0] += timeout_s - 0.001
        return _page(600)

    def clock() -> float:  # each look 10 ms after the last: a quick parse, not a free one
        now[0] += 0.01
        return now[0]

    src = DcgmExporterSource("http://x/metrics", "prod", 15.0, fetch=fetch, boot_id="b", timeout_s=2.0)
    src.clock = clock  # type: ignore[method-assign]
    (b,) = src.collect(T)
    assert src.stats.failures == 0 and len(b.gpus) == 1  # type: ignore[attr-defined]
    ticks = iter([0.0, 1.0, 2.5])  # the parse's deadline read at 0, then looks at 1 and 2.5

    def parse_clock() -> float:
        return now[0] + next(ticks, 2.5)

    src.clock = parse_clock  # type: ignore[method-assign]
    assert src.collect(T + 15) == [] and src.stats.failures == 1


E2E, TTFT = "vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"


def _two_models(k: int) -> str:
    """One vLLM server's page serving models a and b, two histograms each; counts grow with k."""
    return "".join(
        hist({"0.1": n, "+Inf": 2 * n}, n, name, model).split("\n", 1)[1]
        if i
        else hist({"0.1": n, "+Inf": 2 * n}, n, name, model)
        for name in (E2E, TTFT)
        for i, (model, n) in enumerate([("a", 10 * k), ("b", 100 * k)])
    )


@pytest.mark.parametrize("targets", [1, 2, 3, 4])
@pytest.mark.parametrize("other", [False, True], ids=["one server", "and another"])
def test_a_page_several_targets_read_is_fetched_once_a_tick(
    endpoint: Endpoint, targets: int, other: bool
) -> None:
    """One server, two models or two histograms (each target its own service): its page was
    fetched and parsed once per target each tick, and a server that hung held the node's one
    sampling loop a whole timeout per target. Fetched once a tick, each target's delta read
    from it; the other server's page once too."""
    all_targets = [
        LatencyTarget(endpoint.url, f"s-{name}-{model}", name, "s", (("model_name", model),))
        for name in (E2E, TTFT)
        for model in ("a", "b")
    ][:targets]
    second = Endpoint()
    try:
        if other:
            all_targets.append(LatencyTarget(second.url, "other", E2E, "s"))
            second.body = hist({"0.1": 1, "+Inf": 1}, 1)
        src = LatencySource(all_targets, "prod", "n1")
        endpoint.body = _two_models(1)
        assert src.collect(T) == []
        assert (endpoint.requests, second.requests) == (1, int(other))
        endpoint.body = _two_models(3)
        second.body = hist({"0.1": 2, "+Inf": 3}, 2)
        got = {d.service: d.counts for d in src.collect(T + 10)}  # type: ignore[attr-defined]
        assert (endpoint.requests, second.requests) == (2, 2 * int(other))
        want = {f"s-{name}-{m}": (20 * n, 20 * n) for name in (E2E, TTFT) for m, n in [("a", 1), ("b", 10)]}
        assert got == {t.service: want.get(t.service, (1, 1)) for t in all_targets}
        endpoint.fail = True  # a failed page: one failed scrape a tick, its targets none
        assert [d.service for d in src.collect(T + 20)] == ["other"] * other  # type: ignore[attr-defined]
        assert src.stats.failures == 1 and endpoint.requests == 3
    finally:
        second.server.shutdown()


def test_a_hung_server_of_several_targets_costs_one_timeout_a_tick(caplog: pytest.LogCaptureFixture) -> None:
    """Three targets on a server that trickles its page for ever: one timed-out scrape a tick
    (each target's own held the sampling loop three timeouts)."""
    server = Trickle(status="200 OK")
    try:
        targets = [LatencyTarget(server.url, f"s{k}", E2E, "s", (("model_name", str(k)),)) for k in range(3)]
        src = LatencySource(targets, "prod", "n1", timeout_s=0.3)
        assert src.collect(T) == []
        assert (src.stats.scrapes, src.stats.failures) == (1, 1) and "TimeoutError" in caplog.text
    finally:
        server.close()

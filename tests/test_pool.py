"""The node's pool: the pure parts (the real schedulers are in test_slurm.py and
test_k8s_control_plane.py)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.assemble import NodeOptions, node_agent, sample_once
from gpuslo.agent.base import Source, StaticAttribution
from gpuslo.agent.k8s_watch import Forbidden
from gpuslo.agent.nvml import NvmlSource
from gpuslo.agent.pool import (
    DEFAULT_NODE_POOL_LABELS,
    K8sNodePool,
    NodePool,
    join_partitions,
    pool_from_labels,
)
from gpuslo.agent.scrape import DcgmExporterSource
from gpuslo.agent.slurm import SlurmCli, SlurmNodeSource
from gpuslo.app.cli import build_parser
from gpuslo.wire import GpuSampleBatch, Message, NodeHeartbeat
from tests.fake_nvml import FakeGpu, FakeNvml


def test_join_partitions_edges() -> None:
    assert join_partitions([]) == ""
    assert join_partitions(["gpu", "debug", "gpu", " "]) == "debug,gpu"
    long = [f"p{i:03d}" + "x" * 60 for i in range(10)]
    got = join_partitions(long)
    assert len(got) <= 256 and got.split(",") == sorted(long)[: len(got.split(","))]  # whole names only


def test_first_label_that_is_set_wins() -> None:
    keys = DEFAULT_NODE_POOL_LABELS
    assert pool_from_labels({}, keys) is None
    assert pool_from_labels({"agentpool": "", "karpenter.sh/nodepool": "k"}, keys) == "k"
    assert pool_from_labels({"karpenter.sh/nodepool": "k", "cloud.google.com/gke-nodepool": "g"}, keys) == "g"
    assert pool_from_labels({"agentpool": 3}, keys) is None  # not a string: not a pool


def test_help_lists_exactly_the_default_labels() -> None:
    action = next(a for a in build_parser()._subparsers._group_actions[0].choices["agent"]._actions  # type: ignore[union-attr]
                  if "--pool-label" in a.option_strings)  # fmt: skip
    listed = action.help.split("default: ", 1)[1].rstrip(")").split(", ")  # type: ignore[union-attr]
    assert tuple(listed) == DEFAULT_NODE_POOL_LABELS


class _Api:
    """Fails as KubeApi does: Forbidden for 401/403, HTTPError otherwise, URLError when down."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    def get_node(self, name: str) -> dict[str, Any]:
        self.calls += 1
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a  # type: ignore[no-any-return]


def test_k8s_pool_keeps_the_last_value_through_trouble(caplog: pytest.LogCaptureFixture) -> None:
    pool = NodePool()
    api = _Api({"metadata": {"labels": {"eks.amazonaws.com/nodegroup": "ng1"}}},
               urllib.error.URLError("connection refused"), urllib.error.URLError("again"),
               Forbidden("403 on /api/v1/nodes/n1"), {"metadata": {}}, {"metadata": {"labels": {"agentpool": "np2"}}})  # fmt: skip
    src = K8sNodePool(pool, api, "n1", refresh_s=10)  # type: ignore[arg-type]
    for t in range(0, 60, 5):  # refreshes at 0, 10, 20, 30, 40, 50
        pool.at(float(t))
        pool.at(float(t))  # a second reader in the tick asks nothing
        if t == 0:
            assert pool() == "ng1"
        if t == 40:
            assert pool() == "ng1"  # through refused, 403 and a node without labels
    assert api.calls == 6 and pool() == "np2" and src.failures == 3
    assert caplog.text.count("cannot read Node n1") == 2  # once per kind of failure
    assert NodePool("explicit")() == "explicit"
    explicit = NodePool("mine")
    explicit.learn("theirs", "test")
    assert explicit() == "mine"


# ---------------------------------------------------------------- the order of the source list
# The GPU batch and the heartbeat of a tick carry the pool learnt in that tick, with the GPU
# source anywhere in the list; one sinfo per tick serves the heartbeat and the pool.

T = 1_790_000_000.0
DCGM_TEXT = (Path(__file__).parent / "data" / "dcgm-exporter" / "3.6.1-whole-gpus.txt").read_text()
# sinfo's partitions of n1 per tick (None: sinfo fails) and the pool each tick must carry:
# sorted and ','-joined (README, the node's pool), the last value kept through a failure
PARTITIONS: list[list[str] | None] = [["gpu"], ["gpu", "debug"], None, ["batch"]]
SLURM_POOLS = ["gpu", "debug,gpu", "debug,gpu", "batch"]


class _Sinfo:
    """``run`` for a real SlurmCli: sinfo's JSON for the tick's partitions, or the error a
    failing command raises; counts the calls."""

    def __init__(self, answers: list[list[str] | None]) -> None:
        self.answers, self.tick, self.calls = answers, 0, 0

    def __call__(self, argv: Sequence[str]) -> str:
        assert list(argv) == ["sinfo", "--json"]
        self.calls += 1
        parts = self.answers[self.tick]
        if parts is None:
            raise subprocess.CalledProcessError(
                1, list(argv), stderr="slurm_load_partitions: Unable to contact slurm controller"
            )
        return json.dumps({"nodes": [{"name": "n0", "partitions": ["other"]},
                                     {"name": "n1", "state": "IDLE", "state_flags": [], "partitions": parts}]})  # fmt: skip


def _gpu_source(kind: str, pool: NodePool) -> Source:
    if kind == "nvml":
        return NvmlSource("n1", "c", 10.0, nvml=FakeNvml([FakeGpu("GPU-a")]), pool=pool, boot_id="b")
    return DcgmExporterSource(
        "http://dcgm/metrics", "c", 10.0, node="n1", pool=pool, fetch=lambda u, t: DCGM_TEXT
    )


def _tick(sources: Sequence[Source], now: float) -> tuple[list[str], list[str]]:
    """The pools of the tick's GPU batches and heartbeats."""
    msgs = [m for s in sources for m in s.collect(now)]
    return ([m.pool for m in msgs if isinstance(m, GpuSampleBatch)],
            [m.pool for m in msgs if isinstance(m, NodeHeartbeat)])  # fmt: skip


@pytest.mark.parametrize("gpu_first", [True, False])
@pytest.mark.parametrize("kind", ["nvml", "dcgm"])
def test_slurm_pool_is_this_ticks_in_either_order(gpu_first: bool, kind: str) -> None:
    pool = NodePool()
    sinfo = _Sinfo(PARTITIONS)
    beat = SlurmNodeSource("n1", "c", 10.0, 1, cli=SlurmCli(run=sinfo), boot_id="b", pool=pool)
    gpu = _gpu_source(kind, pool)
    sources = [gpu, beat] if gpu_first else [beat, gpu]
    for i, want in enumerate(SLURM_POOLS):
        sinfo.tick = i
        batches, beats = _tick(sources, T + 10 * i)
        assert batches == [want]
        assert beats == ([] if PARTITIONS[i] is None else [want])  # no heartbeat without sinfo
        assert sinfo.calls == i + 1  # one sinfo per tick, whoever asked first


@pytest.mark.parametrize("gpu_first", [True, False])
def test_explicit_pool_wins_in_either_order_with_one_sinfo_per_tick(gpu_first: bool) -> None:
    pool = NodePool("mine")
    sinfo = _Sinfo(PARTITIONS)
    beat = SlurmNodeSource("n1", "c", 10.0, 1, cli=SlurmCli(run=sinfo), boot_id="b", pool=pool)
    gpu = _gpu_source("nvml", pool)
    sources = [gpu, beat] if gpu_first else [beat, gpu]
    for i in range(len(PARTITIONS)):
        sinfo.tick = i
        batches, beats = _tick(sources, T + 10 * i)
        assert batches == ["mine"] and beats == ([] if PARTITIONS[i] is None else ["mine"])
        assert sinfo.calls == i + 1


class Quiet(Source):
    """Another source of the node (latency scrapes, say): emits nothing here."""

    name = "quiet"

    def collect(self, now: float) -> list[Message]:
        return []


def _labelled(value: str) -> dict[str, Any]:
    return {"metadata": {"labels": {"cloud.google.com/gke-nodepool": value}}}


@pytest.mark.parametrize("gpu_first", [True, False])
@pytest.mark.parametrize("kind", ["nvml", "dcgm"])
def test_k8s_pool_is_this_ticks_in_either_order(gpu_first: bool, kind: str) -> None:
    pool = NodePool()
    api = _Api(_labelled("a"), urllib.error.URLError("connection refused"), _labelled("b"))
    K8sNodePool(pool, api, "n1", refresh_s=10)  # type: ignore[arg-type]  # attaches itself
    other = Quiet()  # any other source of the node, before or after the GPU source
    gpu = _gpu_source(kind, pool)
    sources = [gpu, other] if gpu_first else [other, gpu]
    for i, want in enumerate(["a", "a", "b"]):  # the Node read at every tick (refresh_s = interval)
        assert _tick(sources, T + 10 * i)[0] == [want]
        assert api.calls == i + 1


def test_a_learner_that_raises_keeps_the_last_pool(caplog: pytest.LogCaptureFixture) -> None:
    pool = NodePool()
    answers: list[str | Exception] = ["p1", RuntimeError("bug"), RuntimeError("bug"), "p2"]

    def learner(now: float) -> None:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        pool.learn(a, "test")

    pool.attach(learner)
    assert [pool.at(t) for t in (1.0, 1.0, 2.0, 3.0, 4.0)] == ["p1", "p1", "p1", "p1", "p2"]
    assert pool.failures == 2 and caplog.text.count("learning the pool failed") == 1


@pytest.mark.parametrize("reverse", [False, True])
def test_the_assembled_agent_works_in_reversed_order(tmp_path: Path, reverse: bool) -> None:
    base = NodeOptions(source="nvml", node="n1", cluster="c", interval_s=10.0)
    slurm = node_agent(NodeOptions(**{**base.__dict__, "hpc_job_mapping_dir": tmp_path}),
                       nvml=FakeNvml([FakeGpu("GPU-a")]))  # fmt: skip
    beat = next(s for s in slurm.sources if isinstance(s, SlurmNodeSource))
    sinfo = _Sinfo(PARTITIONS)
    beat.cli = SlurmCli(run=sinfo)
    api = _Api(_labelled("a"), _labelled("b"))
    k8s = node_agent(NodeOptions(**{**base.__dict__, "k8s_api": True}), kube_api=lambda: api,  # type: ignore[arg-type,return-value]
                     nvml=FakeNvml([FakeGpu("GPU-a")]))  # fmt: skip
    k8s.sources.append(Quiet())  # another source, so that the reversal moves the GPU source
    assert len(slurm.sources) == len(k8s.sources) == 2
    if reverse:
        slurm.sources.reverse()
        k8s.sources.reverse()
    for i, want in enumerate(SLURM_POOLS):
        sinfo.tick = i
        assert _tick(slurm.sources, T + 10 * i) == ([want], [] if PARTITIONS[i] is None else [want])
        assert sinfo.calls == i + 1
    # the Node is read at the first tick, then every refresh_s (300 s)
    assert [_tick(k8s.sources, T + 10 * i)[0] for i in range(2)] == [["a"], ["a"]]
    assert [_tick(k8s.sources, T + 300 + 10 * i)[0] for i in range(2)] == [["b"], ["b"]]
    assert api.calls == 2


def test_once_samples_the_gpu_source_alone_with_the_pool_learnt() -> None:
    """``agent --once`` collects the GPU source only: its batch still carries the pool."""
    agent = node_agent(NodeOptions(source="nvml", node="n1", cluster="c", interval_s=10.0, slurm=True),
                       nvml=FakeNvml([FakeGpu("GPU-a")]))  # fmt: skip
    beat = next(s for s in agent.sources if isinstance(s, SlurmNodeSource))
    sinfo = _Sinfo([["gpu", "debug"]])
    beat.cli = SlurmCli(run=sinfo)
    assert isinstance(agent.gpu, NvmlSource) and agent.gpu.attribution is not None
    agent.gpu.attribution = StaticAttribution(lambda i, u: ())  # no squeue here
    (batch,) = [
        m for m in sample_once(agent.gpu, 10.0, sleep=lambda s: None) if isinstance(m, GpuSampleBatch)
    ]
    assert batch.pool == "debug,gpu" and 1 <= sinfo.calls <= 2  # one per sample (two distinct clock reads)

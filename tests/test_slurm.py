"""Slurm attribution, node state and scheduler events on a real slurmctld + slurmd."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.base import Device
from gpuslo.agent.slurm import (
    MAX_GPUS_PER_NODE,
    Answers,
    Malformed,
    SlurmAttribution,
    SlurmCli,
    SlurmEventCollector,
    SlurmNodeSource,
    expand_hostlist,
    gpu_shape,
    gpus_per_node,
    parse_idx,
)
from gpuslo.wire import NodeHeartbeat, SchedulerEvent, decode, encode
from gpuslo.wire.bounds import MAX_ALLOCATIONS, MAX_ASSIGNED_NODES
from tests.servers.slurm import SlurmCluster, available, bitmap


def test_parsers() -> None:
    assert parse_idx("gpu:2(IDX:0-1)") == [0, 1]
    assert parse_idx("gpu:a100:4(IDX:0,2-3,7)") == [0, 2, 3, 7]
    assert parse_idx("gpu:0") == []
    assert expand_hostlist("gpu[01-03,07],cpu9") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu9"]


# gres_detail as slurmctld 22.05 wrote it (squeue --json; tests/servers/slurm.py with nics=2 and
# shards on GPUs 2-3): every gres the job holds has its IDX, in its own gres's positions
RECORDED_GRES_DETAIL = [
    ("gpu:1(IDX:0)", [0]),
    ("gpu:1(IDX:1),nic:1(IDX:0)", [1]),  # nic 0 is no GPU: GPU 0 is another job's
    ("nic:1(IDX:1)", []),  # a job without a GPU holds none
    ("gpu:2(IDX:1-2),nic:1(IDX:1)", [1, 2]),
    ("shard:1(IDX:2)", [2]),  # shards on GPUs 2-3 only: the IDX is the GPU's position
]
GRES_DETAIL_EDGES = [
    ("nic:2(IDX:0-1),gpu:nvidia_a100_3g.20gb:1(IDX:4)", [4]),  # a typed GPU after another gres
    ("fpga:1(IDX:3),gpu:a100:3(IDX:0,2-3)", [0, 2, 3]),  # an IDX bitmap's commas inside its parentheses
    ("mps:50(IDX:1)", [1]),
    ("gpu(CNT:2)", []),  # allocated without a bitmap: no device named
    ("gpu:0(IDX:)", []),
    ("gpu:0", []),
    ("", []),
    ("nic:1(IDX:0-3)", []),
    ("gpunic:1(IDX:0)", []),  # a gres whose name starts like gpu's
    ("xgpu:1(IDX:0),gpu_x:1(IDX:1)", []),
]


@pytest.mark.parametrize(("detail", "idx"), RECORDED_GRES_DETAIL + GRES_DETAIL_EDGES)
def test_only_the_gpu_gres_idx_name_gpus(detail: str, idx: list[int]) -> None:
    problems: list[str] = []
    assert parse_idx(detail, problems) == idx and problems == []


@pytest.mark.parametrize("detail", [
    "shard:2(1/4,0/4)",  # Slurm 23.02+'s shared gres form: not read yet, said
    "gpu:2(IDX:0-1",  # cut
    "gpu:1(IDX:N/A)",
    "gpu:1(IDX:\u0663)",  # a digit Slurm never writes
    "gpu:2(IDX:0-99999999999)",
    "gpu:2(IDX:3-2)",
])  # fmt: skip
def test_a_gpu_gres_entry_it_cannot_read_is_a_problem_said(detail: str) -> None:
    problems: list[str] = []
    assert parse_idx(detail, problems) == [] and len(problems) == 1


def test_command_failure_is_contained(tmp_path: Path) -> None:
    def boom(argv: object) -> str:
        raise FileNotFoundError("squeue")

    cli = SlurmCli(run=boom)
    assert SlurmEventCollector("c", tmp_path / "s.json", cli).collect(1.0) == []
    assert cli.failures == 1


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if not available():
        pytest.fail("Slurm is not installed (scripts/test.sh installs slurm-wlm and munge)")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _scontrol_idx(slurm: SlurmCluster) -> dict[int, str]:
    """GPU index → job id, read independently from `scontrol show job -d`'s text."""
    out: dict[int, str] = {}
    job = ""
    for line in slurm.run("scontrol", "show", "job", "-d").splitlines():
        m = re.search(r"JobId=(\d+)", line)
        if m:
            job = m.group(1)
        m = re.search(r"GRES=\S*\(IDX:([0-9,\-]+)\)", line)
        if m:
            for g in bitmap(m.group(1)):
                out[g] = job
    return out


def _wait_state(slurm: SlurmCluster, job: str, state: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while slurm.run("squeue", "-h", "-j", job, "-o", "%T").strip() != state:
        assert time.monotonic() < deadline, f"job {job} never reached {state}"
        time.sleep(0.3)


@pytest.mark.integration
def test_attribution_events_and_node_state(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    a = slurm.sbatch(2, "train-a")
    b = slurm.sbatch(1, "train-b")
    c = slurm.sbatch(2, "train-c")  # 3 of 4 GPUs taken: pends for Resources
    d = slurm.sbatch(1, "train-d")  # behind c: pends for Priority
    _wait_state(slurm, a, "RUNNING")
    _wait_state(slurm, b, "RUNNING")
    t0 = time.time()

    attr = SlurmAttribution(slurm.node)
    attr.refresh()
    ours = {g: attr(g, "")[0].id for g in range(slurm.gpus) if attr(g, "")}
    assert ours == _scontrol_idx(slurm)
    assert sorted(ours.values()) == sorted([a, a, b])
    held = attr(next(g for g, j in ours.items() if j == a), "")[0]
    assert (held.user, held.account, held.queue, held.name) == ("root", "research", "gpu", "train-a")

    state = tmp_path / "collector.json"
    col = SlurmEventCollector("gpuslo", state)
    first = [m for m in col.collect(t0) if isinstance(m, SchedulerEvent)]
    kinds = {(e.request_id, e.event) for e in first}
    assert {(j, "submit") for j in (a, b, c, d)} <= kinds
    assert {(a, "start"), (b, "start")} <= kinds
    reasons = {e.request_id: e.reason for e in first if e.event == "pending_reason"}
    assert reasons == {c: "Resources", d: "Priority"}
    assert all(decode(encode(e)) == e for e in first)
    assert next(e for e in first if e.request_id == c and e.event == "submit").gpus_per_node == 2.0

    slurm.run("scancel", d)  # cancelled while pending
    slurm.run("scancel", a)  # ends running: c can start
    _wait_state(slurm, c, "RUNNING")
    again = SlurmEventCollector("gpuslo", state)  # a restarted collector
    second = [
        (e.request_id, e.event, e.reason) for e in again.collect(time.time()) if isinstance(e, SchedulerEvent)
    ]
    assert (d, "cancel", "CANCELLED") in second
    assert (a, "end", "CANCELLED") in second
    assert (c, "start", "") in second
    assert not [x for x in second if x[1] == "submit"]  # nothing sent twice across the restart
    assert again.collect(time.time()) == []  # and nothing new: nothing sent

    node = SlurmNodeSource(slurm.node, "gpuslo", 10.0, slurm.gpus)
    (hb,) = node.collect(time.time())
    assert isinstance(hb, NodeHeartbeat) and hb.schedulable and hb.pool == "gpu"
    slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=maintenance")
    try:
        (hb,) = node.collect(time.time())
        assert not hb.schedulable and hb.reason == "maintenance" and "drain" in hb.state
    finally:
        slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=resume")
    for j in (b, c):
        slurm.run("scancel", j)


@pytest.mark.integration
def test_a_jobs_other_gres_never_name_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a node with NICs as gres and shards on GPUs 2-3, slurmctld writes each job's IDX of
    every gres it holds (``gpu:1(IDX:1),nic:1(IDX:0)``): GPU 0 went to the NIC's job as well as
    its own (two holders at 0.5), a NIC-only job held a GPU. Each GPU row must carry the jobs
    ``scontrol show job -d`` gives that GPU (its gpu and shard entries), no other."""
    if not available():
        pytest.fail("Slurm is not installed (scripts/test.sh installs slurm-wlm and munge)")
    c = SlurmCluster(tmp_path / "slurm", nics=2, shards={2: 2, 3: 2})
    c.start()
    jobs: list[str] = []
    try:
        monkeypatch.setenv("SLURM_CONF", c.env["SLURM_CONF"])
        for gres, name in (("gpu:1", "a"), ("gpu:1,nic:1", "b"), ("nic:1", "c"), ("shard:1", "d")):
            jobs.append(c.sbatch(0, name, gres=gres))
        for j in jobs:
            _wait_state(c, j, "RUNNING")
        gpus: dict[int, set[str]] = {}
        nics: dict[str, set[int]] = {}
        for block in c.run("scontrol", "show", "job", "-d").split("JobId=")[1:]:
            job = block.split()[0]
            (gres,) = re.findall(r"\bGRES=(\S*)", block)
            for name, idx in re.findall(r"(gpu|shard|nic)(?::[^,(]*)?\(IDX:([0-9,\-]+)\)", gres):
                for g in bitmap(idx):
                    if name == "nic":
                        nics.setdefault(job, set()).add(g)
                    else:
                        gpus.setdefault(g, set()).add(job)
        # the case in point: a NIC's position that is another job's GPU's, and a job with no GPU
        assert any(g in gpus and job not in gpus[g] for job, idx in nics.items() for g in idx), (gpus, nics)
        assert not any(jobs[2] in held for held in gpus.values())
        attr = SlurmAttribution(c.node)
        attr.refresh()
        ours = {g: {a.id for a in attr(g, "")} for g in range(c.gpus) if attr(g, "")}
        assert ours == gpus and attr.skipped == 0
        assert all(a.share == 1.0 for g in ours for a in attr(g, ""))
    finally:
        for j in jobs:
            c.run("scancel", j)
        c.stop()


@pytest.mark.integration
def test_cli_slurm_collector_prints_events(slurm: SlurmCluster, tmp_path: Path) -> None:
    import subprocess
    import sys

    j = slurm.sbatch(1, "cli-job")
    exe = str(Path(sys.executable).with_name("gpuslo"))
    r = subprocess.run([exe, "agent", "--source", "slurm-events", "--cluster", "gpuslo", "--ticks", "1", "--interval-s", "1", "--metrics-port", "0",
                        "--state-file", str(tmp_path / "state.json")], capture_output=True, text=True, env=slurm.env,
                       timeout=60, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    events = [decode(line) for line in r.stdout.splitlines()]
    assert any(isinstance(e, SchedulerEvent) and e.request_id == j and e.event == "submit" for e in events)
    slurm.run("scancel", j)


@pytest.mark.integration
def test_a_gpu_request_without_a_count_asks_one(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmctld writes ``--gres=gpu`` as ``gres:gpu`` (no count): one GPU a node, as Slurm gives
    it. It was read as none: the job was no GPU request, its wait never a starvation."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    out = slurm.run("sbatch", "--parsable", "-J", "one-gpu", "--gres=gpu", "-N", "1", "--hold",
                    f"--output={slurm.dir}/log/slurm-%j.out", "--wrap", "sleep 60")  # fmt: skip
    j = out.strip().split(";")[0]
    try:
        col = SlurmEventCollector("gpuslo", tmp_path / "s.json")
        got = [e for e in col.collect(time.time()) if isinstance(e, SchedulerEvent) and e.request_id == j]
        assert got and {e.gpus_per_node for e in got} == {1.0}, got
    finally:
        slurm.run("scancel", j)


@pytest.mark.integration
def test_job_that_left_the_queue_unobserved_ends_with_its_identity(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collector was down past MinJobAge: a job it saw running is gone from squeue. It ends
    at its last sighting, still carrying the name, owner and size it had (an older state file
    without them loads too)."""
    import json

    state = tmp_path / "state.json"
    state.write_text(json.dumps({
        "990001": {"emitted": ["submit", "start"], "started": True, "last_seen": 1_790_000_000.0, "reason": "",
                   "job": {"name": "gone-job", "user_name": "alice", "account": "research", "partition": "gpu",
                           "node_count": 1, "tres_per_node": "gres/gpu:3"}},
        "990002": {"emitted": ["submit"], "started": False, "last_seen": 1_790_000_100.0, "reason": "Priority"},
    }))  # fmt: skip
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    events = {e.request_id: e for e in SlurmEventCollector("gpuslo", state).collect(time.time())
              if isinstance(e, SchedulerEvent) and e.request_id.startswith("9900")}  # fmt: skip
    gone = events["990001"]
    assert (gone.event, gone.ts, gone.reason) == ("end", 1_790_000_000.0, "UNOBSERVED")
    assert (gone.name, gone.user, gone.account, gone.queue, gone.gpus_per_node) == (
        "gone-job",
        "alice",
        "research",
        "gpu",
        3.0,
    )
    assert (events["990002"].event, events["990002"].name) == ("end", "")
    assert "990001" not in json.loads(state.read_text())


def _sinfo_partitions(slurm: SlurmCluster) -> str:
    """The node's partitions read independently, from sinfo's text output (the default one
    is marked with ``*``): sorted and joined with ``,`` as docs/agent.md defines the pool."""
    out = slurm.run("sinfo", "-h", "-N", "-n", slurm.node, "-o", "%P")
    return ",".join(sorted({p.strip().rstrip("*") for p in out.split()}))


def _agent_pools(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> set[str]:
    """`gpuslo agent --source dcgm --slurm` for two ticks: the pools of its GPU batches and
    heartbeats."""
    from gpuslo.app.cli import main
    from gpuslo.wire import GpuSampleBatch
    from tests.test_scrape import DCGM_TEXT, Endpoint

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    ep = Endpoint()
    ep.body = DCGM_TEXT
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.jsonl"
    try:
        rc = main(["agent", "--source", "dcgm", "--dcgm-url", ep.url, "--slurm", "--node", slurm.node, "--ticks",
                   "2", "--interval-s", "1", "--metrics-port", "0", "--out", str(out), *extra])  # fmt: skip
    finally:
        ep.server.shutdown()
    assert rc == 0
    msgs = [decode(line) for line in out.read_bytes().splitlines()]
    batches = [m for m in msgs if isinstance(m, GpuSampleBatch)]
    beats = [m for m in msgs if isinstance(m, NodeHeartbeat)]
    assert len(batches) == 2 and len(beats) == 2
    return {m.pool for m in batches + beats}


@pytest.mark.integration
def test_agent_fills_the_pool_from_the_nodes_partitions(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --pool: every GPU batch and heartbeat carries the node's partition from sinfo; a node
    in two partitions carries both, sorted and joined; an explicit --pool wins."""
    assert _sinfo_partitions(slurm) == "gpu"
    assert _agent_pools(slurm, tmp_path, monkeypatch) == {"gpu"}
    slurm.run("scontrol", "create", "PartitionName=debug", f"Nodes={slurm.node}", "State=UP")
    try:
        assert _sinfo_partitions(slurm) == "debug,gpu"
        assert _agent_pools(slurm, tmp_path, monkeypatch) == {"debug,gpu"}
        assert _agent_pools(slurm, tmp_path, monkeypatch, "--pool", "mine") == {"mine"}
    finally:
        slurm.run("scontrol", "delete", "PartitionName=debug")
    assert _agent_pools(slurm, tmp_path, monkeypatch) == {"gpu"}


@pytest.mark.integration
def test_assembled_agent_in_reversed_order_carries_each_ticks_partitions(
    slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU source first in the list: its batch and the heartbeat of a tick carry that
    tick's partitions (changed between the ticks), from one real sinfo per tick."""
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from gpuslo.wire import GpuSampleBatch
    from tests.test_scrape import DCGM_TEXT, Endpoint

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    ep = Endpoint()
    ep.body = DCGM_TEXT
    agent = node_agent(NodeOptions(source="dcgm", node=slurm.node, cluster="c", interval_s=1.0, slurm=True,
                                   dcgm_url=ep.url, dcgm_node=slurm.node))  # fmt: skip
    beat = next(s for s in agent.sources if isinstance(s, SlurmNodeSource))
    real, sinfos = beat.cli._run, []
    beat.cli._run = lambda argv: (sinfos.append(argv[0]), real(argv))[1]  # type: ignore[method-assign]
    agent.sources.reverse()
    assert agent.sources[0] is agent.gpu

    T0 = time.time()

    def tick(now: float) -> set[str]:
        msgs = [m for s in agent.sources for m in s.collect(now)]
        assert len([m for m in msgs if isinstance(m, GpuSampleBatch | NodeHeartbeat)]) == 2
        return {m.pool for m in msgs if isinstance(m, GpuSampleBatch | NodeHeartbeat)}

    try:
        assert tick(T0) == {_sinfo_partitions(slurm)} == {"gpu"}
        slurm.run("scontrol", "create", "PartitionName=debug", f"Nodes={slurm.node}", "State=UP")
        try:
            assert tick(T0 + 1) == {_sinfo_partitions(slurm)} == {"debug,gpu"}
        finally:
            slurm.run("scontrol", "delete", "PartitionName=debug")
        assert tick(T0 + 2) == {"gpu"}
    finally:
        ep.server.shutdown()
    assert sinfos == ["sinfo"] * 3


# ---------------------------------------------------------------- hostile squeue answers (unit)

GOOD = {"job_id": 100, "job_state": "PENDING", "name": "a", "user_name": "u", "account": "acc", "partition": "gpu",
        "submit_time": 1_796_428_800, "state_reason": "Resources", "tres_per_node": "gres/gpu:8", "node_count": 1}  # fmt: skip
NOW = 1_796_430_000.0


def _without(key: str, **kw: object) -> dict[str, object]:
    return {k: v for k, v in {**GOOD, **kw}.items() if k != key}


# one job the collector cannot read or the wire cannot carry, each beside GOOD
HOSTILE_JOBS = {
    "not-an-object": "garbage",
    "a-number": 7,
    "null": None,
    "no-job_id": _without("job_id"),
    "job_id-null": dict(GOOD, job_id=None),
    "job_id-empty": dict(GOOD, job_id=""),
    "job_id-257": dict(GOOD, job_id="9" * 257),
    "job_id-list": dict(GOOD, job_id=[1]),
    "job_id-bool": dict(GOOD, job_id=True),
    "submit-negative": dict(GOOD, job_id=201, submit_time=-5),
    "submit-ms": dict(GOOD, job_id=202, submit_time=1_796_428_800_000),
    "submit-string": dict(GOOD, job_id=203, submit_time="2026-12-05T00:00:00"),
    "submit-number-object-negative": dict(GOOD, job_id=204, submit_time={"set": True, "number": -5}),
    "submit-number-object-string": dict(GOOD, job_id=205, submit_time={"set": True, "number": "x"}),
    "submit-nan": dict(GOOD, job_id=206, submit_time=float("nan")),
    "node_count-string": dict(GOOD, job_id=207, node_count="x"),
    "node_count-1e9": dict(GOOD, job_id=208, node_count=10**9),
    "node_count-fraction": dict(GOOD, job_id=209, node_count=1.5),
    "gpus-1e20": dict(GOOD, job_id=210, tres_per_node="gres/gpu:a100:1e20"),
    "gpus-20-digits": dict(GOOD, job_id=211, tres_per_node="gres/gpu:99999999999999999999"),
    "gpus-past-a-node": dict(GOOD, job_id=212, tres_per_node="gres/gpu:1025"),
    "name-surrogate": dict(GOOD, job_id=213, name="\ud800x\u202e"),
    "user-object": dict(GOOD, job_id=214, user_name={"x": 1}),
    "state-object": dict(GOOD, job_id=215, job_state={"x": 1}),
    # running: its start names its nodes
    "resources-string": dict(GOOD, job_id=216, job_state="RUNNING", job_resources="x"),
    "allocated-node-strings": dict(GOOD, job_id=217, job_state="RUNNING", job_resources={"allocated_nodes": ["n1"]}),
    "hostlist-letters": dict(GOOD, job_id=218, job_state="RUNNING", nodes="n[a-b]"),
    "hostlist-huge": dict(GOOD, job_id=219, job_state="RUNNING", nodes="n[0-9999999]"),
}  # fmt: skip


def _collector(tmp_path: Path, answers: list[list[object]]) -> SlurmEventCollector:
    """A collector whose squeue answers each of ``answers`` in turn (the last one for ever)."""

    def run(argv: object) -> str:
        return json.dumps({"jobs": answers.pop(0) if len(answers) > 1 else answers[0]})

    return SlurmEventCollector("c", tmp_path / "state.json", cli=SlurmCli(run=run))


def _events(msgs: list[object]) -> list[tuple[str, str, float]]:
    return [(m.event, m.request_id, m.ts) for m in msgs if isinstance(m, SchedulerEvent)]


@pytest.mark.parametrize("bad", HOSTILE_JOBS.values(), ids=HOSTILE_JOBS.keys())
def test_a_hostile_job_is_skipped_and_counted_every_other_goes_on(
    tmp_path: Path, bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    col = _collector(tmp_path, [[GOOD, bad]])
    with caplog.at_level(logging.WARNING):
        first = col.collect(NOW)
    assert _events(first) == [("submit", "100", 1_796_428_800.0), ("pending_reason", "100", NOW)]
    assert col.skipped == 1 and "skipped" in caplog.text
    for m in first:  # what is returned is what the wire carries
        assert decode(encode(m)) == m
    saved = json.loads((tmp_path / "state.json").read_text())
    assert list(saved) == ["100"]  # nothing of the bad job was marked sent
    logged = caplog.text.count("skipped")
    assert col.collect(NOW + 10) == []  # read again, skipped again: counted, not logged again
    assert col.skipped == 2 and caplog.text.count("skipped") == logged


@pytest.mark.parametrize("chars", [1, 10, 200, 249, 250, 251, 255, 256])
@pytest.mark.parametrize("requeues", [1, 9, 65_535])
def test_a_job_id_is_followed_through_its_requeues_or_refused_at_once(
    tmp_path: Path, chars: int, requeues: int
) -> None:
    """Its requests are ``ID`` then ``ID#N``: a job id the wire held alone but not with ``#N``
    (251 to 256 characters) was followed until its first requeue, then refused at every tick, so
    its first run never ended (nor did the wait after it start). Each job is either followed
    through every requeue, or refused from its first sighting."""
    jid = "9" * chars
    run = dict(GOOD, job_id=jid, job_state="RUNNING", start_time=NOW - 60, end_time=NOW + 3600, restart_cnt=0,
               job_resources={}, nodes="n1")  # fmt: skip
    again = dict(GOOD, job_id=jid, job_state="PENDING", submit_time=NOW + 5, restart_cnt=requeues)
    col = _collector(tmp_path, [[run], [again]])
    got = [_events(col.collect(NOW + k)) for k in (0, 10, 20)]
    fits = len(f"{jid}#{requeues + 1}") <= 256 and len(f"{jid}#65536") <= 256  # the wire's request_id
    if fits:
        assert [e[:2] for e in got[0]] == [("submit", jid), ("start", jid)]
        assert [e[:2] for e in got[1]] == [("preempt", jid), ("submit", f"{jid}#{requeues + 1}"),
                                           ("pending_reason", f"{jid}#{requeues + 1}")]  # fmt: skip
        assert col.skipped == 0
    else:
        assert got == [[], [], []] and col.skipped == 3


def test_events_are_marked_sent_only_with_the_events_returned(tmp_path: Path) -> None:
    """A bad job beside a good one, then the good one alone: the good one's events come once,
    at the first tick (they were once marked sent in a tick that raised, and lost)."""
    col = _collector(tmp_path, [[GOOD, HOSTILE_JOBS["submit-negative"]], [GOOD]])
    got = _events(col.collect(NOW)) + _events(col.collect(NOW + 10)) + _events(col.collect(NOW + 20))
    assert got == [("submit", "100", 1_796_428_800.0), ("pending_reason", "100", NOW)]


def test_a_known_job_that_turns_unreadable_is_kept_and_ends_as_last_seen(tmp_path: Path) -> None:
    run = dict(GOOD, job_state="RUNNING", start_time=1_796_429_000, job_resources={"allocated_nodes": [{"nodename": "n1"}]})  # fmt: skip
    col = _collector(tmp_path, [[run], [dict(run, node_count="x")], []])
    assert [e[0] for e in _events(col.collect(NOW))] == ["submit", "start"]
    assert col.collect(NOW + 10) == [] and col.skipped == 1  # still queued: no UNOBSERVED end
    (end,) = col.collect(NOW + 20)
    assert isinstance(end, SchedulerEvent)
    assert (end.event, end.reason, end.ts, end.gpus_per_node) == ("end", "UNOBSERVED", NOW, 8.0)


@pytest.mark.parametrize("record", [
    {"emitted": ["submit"], "last_seen": NOW, "job": {"node_count": "x"}},
    {"emitted": ["submit"], "last_seen": NOW, "job": {"name": "\ud800"}},
    {"emitted": ["submit"], "last_seen": NOW, "job": {"tres_per_node": "gres/gpu:a100:1e20"}},
    {"emitted": ["submit"], "last_seen": -5.0},
    {"emitted": ["submit"], "last_seen": 0.0},
], ids=["node_count", "name", "gpus", "last_seen-negative", "last_seen-unset"])  # fmt: skip
def test_a_gone_job_whose_record_cannot_be_sent_never_wedges_later_ticks(
    tmp_path: Path, record: object
) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"300": record}, ensure_ascii=True))
    col = _collector(tmp_path, [[GOOD]])
    assert [e[:2] for e in _events(col.collect(NOW))] == [("submit", "100"), ("pending_reason", "100")]
    assert col.skipped == 1 and "300" not in col.jobs  # forgotten: counted once, never again
    assert col.collect(NOW + 10) == [] and col.skipped == 1


# Slurm 23.02+ (OpenAPI v0.0.39+): numbers that may be unset or infinite are objects, the state
# a list of the base state and its flags
@pytest.mark.parametrize(("fields", "expected"), [
    ({"submit_time": {"set": True, "infinite": False, "number": 1_796_428_800}}, [("submit", 1_796_428_800.0)]),
    ({"submit_time": {"set": False, "infinite": False, "number": 0}}, [("submit", NOW)]),
    ({"submit_time": {"set": True, "infinite": True, "number": 0}}, [("submit", NOW)]),
    ({"job_state": ["PENDING"], "node_count": {"set": True, "infinite": False, "number": 2}}, [("submit", 1_796_428_800.0)]),
    ({"job_state": ["RUNNING"], "start_time": {"set": True, "infinite": False, "number": 1_796_429_000},
      "nodes": "n[1-2]", "node_count": {"set": True, "infinite": False, "number": 2}},
     [("submit", 1_796_428_800.0), ("start", 1_796_429_000.0)]),
    ({"job_state": ["COMPLETED", "COMPLETING"]}, [("submit", 1_796_428_800.0), ("start", NOW)]),
    ({"job_state": ["CANCELLED"], "end_time": {"set": True, "infinite": False, "number": 1_796_429_500}},
     [("submit", 1_796_428_800.0), ("cancel", 1_796_429_500.0)]),
])  # fmt: skip
def test_slurm_2302_number_objects_and_state_lists(
    tmp_path: Path, fields: dict[str, object], expected: list[tuple[str, float]]
) -> None:
    col = _collector(tmp_path, [[dict(GOOD, **fields)]])
    got = [m for m in col.collect(NOW) if isinstance(m, SchedulerEvent) and m.event != "pending_reason"]
    assert [(m.event, m.ts) for m in got] == expected and col.skipped == 0
    nodes = fields.get("node_count")
    assert {m.nodes for m in got} == {nodes["number"] if isinstance(nodes, dict) else 1}
    starts = [m.assigned_nodes for m in got if m.event == "start"]
    assert starts in ([], [()], [("n1", "n2")])


@pytest.mark.parametrize(("tres", "gpus"), [
    ("gres/gpu:8", 8.0), ("gres/gpu:a100:2", 2.0), ("gres:gpu:4", 4.0), ("gres/gpu:8,gres/shard:1", 8.0),
    ("", 0.0), (None, 0.0), ("cpu=4", 0.0), (f"gres/gpu:{MAX_GPUS_PER_NODE}", float(MAX_GPUS_PER_NODE)),
    # as slurmctld 22.05 writes --gres=gpu, --gres=gpu:h100, --gres=gpu:h100:1 (recorded here)
    ("gres:gpu", 1.0), ("gres:gpu:h100", 1.0), ("gres:gpu:h100:1", 1.0), ("gres:gpu:3g.40gb", 3 / 7),
    # MIG profiles as gres types: their part of a GPU (a free instance counts so in capacity)
    ("gres/gpu:1g.10gb:2", 2 / 7), ("gres/gpu:1g.6gb:1", 1 / 4), ("gres/gpu:7g.80gb:1", 1.0),
    ("gres/gpu:1g.10gb+me:1", 1 / 7), ("gres/gpu:9g.99gb:1", 1.0),
    ("gres/gpu=2", 2.0), ("gres:gpumem:4", 0.0), ("cpu=4,gres:gpu", 1.0), ("gres:gpu,gres:shard:2", 1.0),
])  # fmt: skip
def test_gpus_per_node(tres: object, gpus: float) -> None:
    assert gpus_per_node({"tres_per_node": tres}) == gpus


# The GPU fields of eight held jobs in slurmctld 22.05's ``squeue --json`` (recorded from the
# harness's cluster, two nodes of 4 GPUs), each with the shape it asks: (GPUs per node, nodes)
RECORDED_GPU_ASKS = [
    ("--gpus=3", {"node_count": 1, "tasks": 1, "sockets_per_node": None, "tres_per_job": "gres:gpu:3",
                  "tres_per_node": "", "tres_per_socket": "", "tres_per_task": ""}, (3.0, 1)),
    ("--gpus-per-task=2 -n 2", {"node_count": 1, "tasks": 2, "sockets_per_node": None, "tres_per_job": "",
                                "tres_per_node": "", "tres_per_socket": "", "tres_per_task": "gres:gpu:2"}, (4.0, 1)),
    ("--gpus-per-node=2 -N 1", {"node_count": 1, "tasks": 1, "sockets_per_node": None, "tres_per_job": "",
                                "tres_per_node": "gres:gpu:2", "tres_per_socket": "", "tres_per_task": ""}, (2.0, 1)),
    ("--gres=gpu:2", {"node_count": 1, "tasks": 1, "sockets_per_node": None, "tres_per_job": "",
                      "tres_per_node": "gres:gpu:2", "tres_per_socket": "", "tres_per_task": ""}, (2.0, 1)),
    ("--gpus=h100:2", {"node_count": 1, "tasks": 1, "sockets_per_node": None, "tres_per_job": "gres:gpu:h100:2",
                       "tres_per_node": "", "tres_per_socket": "", "tres_per_task": ""}, (2.0, 1)),
    ("--gpus-per-socket=1 --sockets-per-node=1", {"node_count": 1, "tasks": 1, "sockets_per_node": 1,
                                                  "tres_per_job": "", "tres_per_node": "",
                                                  "tres_per_socket": "gres:gpu:1", "tres_per_task": ""}, (1.0, 1)),
    ("--gpus=2 --gres=gpu:1", {"node_count": 2, "tasks": 2, "sockets_per_node": None, "tres_per_job": "gres:gpu:2",
                               "tres_per_node": "gres:gpu:1", "tres_per_socket": "", "tres_per_task": ""}, (1.0, 2)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("asked", "fields", "shape"), RECORDED_GPU_ASKS, ids=[a for a, _, _ in RECORDED_GPU_ASKS]
)
def test_every_way_of_asking_for_gpus_has_its_shape(
    asked: str, fields: dict[str, object], shape: object
) -> None:
    """``--gpus``, ``--gpus-per-task`` and ``--gpus-per-socket`` were read as asking no GPU (only
    ``tres_per_node`` was read): such a job's wait was never a starvation incident."""
    assert gpu_shape(fields) == shape


@pytest.mark.parametrize(("total", "nodes", "shape"), [
    (8, 1, (8.0, 1)), (8, 2, (4.0, 2)), (3, 2, (1.5, 2)), (10, 3, (10 / 3, 3)), (1, 2, (1.0, 1)), (3, 8, (1.0, 3)),
    (99_999, 100_000, (1.0, 99_999)), (MAX_GPUS_PER_NODE * 7, 7, (float(MAX_GPUS_PER_NODE), 7)),
])  # fmt: skip
def test_a_job_wide_count_spreads_over_its_nodes(total: int, nodes: int, shape: tuple[float, int]) -> None:
    """N GPUs over k nodes: N/k each (the total stays N), or one on each of N nodes when N < k;
    the same count asked per task, times the tasks."""
    assert gpu_shape({"tres_per_job": f"gres/gpu:{total}", "node_count": nodes}) == shape
    g, k = shape
    assert g * k == pytest.approx(total)
    if total % 2 == 0 and total // 2 <= MAX_GPUS_PER_NODE:  # a task runs on one node
        assert (
            gpu_shape({"tres_per_task": f"gres:gpu:{total // 2}", "tasks": 2, "node_count": nodes}) == shape
        )
        assert gpu_shape({"tres_per_task": f"gres:gpu:{total // 2}", "tasks": {"set": True, "number": 2},
                          "node_count": {"set": True, "number": nodes}}) == shape  # fmt: skip


@pytest.mark.parametrize("fields", [
    {"tres_per_job": f"gres/gpu:{MAX_GPUS_PER_NODE + 1}", "node_count": 1},
    {"tres_per_job": "gres/gpu:100000", "node_count": 100_000},
    {"tres_per_task": "gres/gpu:2", "tasks": 10**15, "node_count": 1},
    {"tres_per_task": "gres/gpu:2", "tasks": 1.5},
    {"tres_per_task": "gres/gpu:2", "tasks": -2},
    {"tres_per_task": "gres/gpu:2", "tasks": "2"},
    {"tres_per_task": "gres/gpu:2", "tasks": float("nan")},
    {"tres_per_socket": "gres/gpu:2", "sockets_per_node": MAX_GPUS_PER_NODE},
    {"tres_per_socket": "gres/gpu:2", "sockets_per_node": 0.5},
    {"tres_per_job": 8},
    {"tres_per_job": "gres/gpu:-1"},
    {"tres_per_node": "gres/gpu:1.5"},
    {"tres_per_node": "gres/gpu:1e3"},
    {"tres_per_node": "gres/gpu:123456"},
    {"tres_per_node": "cpu=1," * 1000 + "gres/gpu:1"},
])  # fmt: skip
def test_a_gpu_ask_no_node_holds_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(Malformed):
        gpu_shape(fields)


def test_a_long_tres_list_is_read_whole() -> None:
    """A GPU request after 300 characters of other TRES (the wire's 256 cut it off: no GPUs)."""
    assert gpu_shape({"tres_per_node": "license/x:1," * 25 + "gres/gpu:4"}) == (4.0, 1)


@pytest.mark.integration
def test_every_way_of_asking_for_gpus_is_a_gpu_request(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held jobs asking GPUs each of Slurm's ways carry their shape in the collector's events.
    (``--gpus=1 -N 2`` sbatch refuses: "--gpus < -N"; gpu_shape reads such an answer as one GPU
    on each of N nodes.)"""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    asks = {
        ("--gpus=3", "-N", "1"): (3.0, 1),
        ("--gpus=3", "-N", "2"): (1.5, 2),
        ("--gpus-per-task=2", "-n", "2", "-N", "1"): (4.0, 1),
        ("--gpus-per-node=2", "-N", "2"): (2.0, 2),
        ("--gpus-per-socket=1", "--sockets-per-node=1"): (1.0, 1),
    }
    ids: dict[str, tuple[str, ...]] = {}
    try:
        for args in asks:
            out = slurm.run("sbatch", "--parsable", "--hold", *args, f"--output={slurm.dir}/log/slurm-%j.out",
                            "--wrap", "sleep 60")  # fmt: skip
            ids[out.strip().split(";")[0]] = args
        col = SlurmEventCollector("gpuslo", tmp_path / "s.json")
        got = {e.request_id: (e.gpus_per_node, e.nodes) for e in col.collect(time.time())
               if isinstance(e, SchedulerEvent) and e.request_id in ids}  # fmt: skip
        assert {ids[j]: shape for j, shape in got.items()} == asks
    finally:
        for j in ids:
            slurm.run("scancel", j)


def test_the_gpu_bound_is_the_wires() -> None:
    SchedulerEvent.model_validate(dict(_EVENT, gpus_per_node=MAX_GPUS_PER_NODE))
    with pytest.raises(ValueError, match="1024"):
        SchedulerEvent.model_validate(dict(_EVENT, gpus_per_node=MAX_GPUS_PER_NODE + 1))


_EVENT = {"source": "s", "boot_id": "b", "seq": 0, "cluster": "c", "ts": NOW, "scheduler": "slurm", "event": "submit",
          "request_id": "1"}  # fmt: skip


@pytest.mark.parametrize("answer", [{"jobs": 5}, {"jobs": "abc"}, {"jobs": {"1": {}}}, [1], "x", 3])
def test_squeue_answer_of_another_shape_is_a_counted_failure(tmp_path: Path, answer: object) -> None:
    cli = SlurmCli(run=lambda argv: json.dumps(answer))
    assert cli.jobs() is None and cli.failures == 1
    assert SlurmEventCollector("c", tmp_path / "s.json", cli).collect(NOW) == []
    assert SlurmAttribution("n1", cli=cli).refresh() is None  # keeps the last mapping


@pytest.mark.parametrize("text", [
    "n[0-9999999]", f"n[0-{MAX_ASSIGNED_NODES}]", "n[a-b]", "n[3-1]", "n[1-]", "n[-1]", "n[1-2-3]", "n[x]",
    "n[" + "0" * 300 + "]", "x" * 300 + "[1-2]", ",".join(f"m[1-{MAX_ASSIGNED_NODES // 2}]" for _ in range(3)),
])  # fmt: skip
def test_expand_hostlist_refuses_what_it_cannot_hold(text: str) -> None:
    with pytest.raises(ValueError, match="hostlist"):  # counted before any name is built
        expand_hostlist(text)


@pytest.mark.parametrize("text", ["n[1-2", "n]1[", "n[1-2]]", "n[[1-2]]", "r[1-1000]n[1-1000]", "n[١-٣]"])
def test_expand_hostlist_refuses_unpaired_brackets_and_products_past_the_bound(text: str) -> None:
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(text)


@pytest.mark.parametrize(("text", "names"), [
    ("n[08-10],m7", ["n08", "n09", "n10", "m7"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),  # a suffix: it was a third node named "-ib"
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b[1-2]c,d", ["a", "b1c", "b2c", "d"]),
    ("gpu[01-02,05]-x[0-1],cpu", ["gpu01-x0", "gpu01-x1", "gpu02-x0", "gpu02-x1", "gpu05-x0", "gpu05-x1", "cpu"]),
    ("", []),
])  # fmt: skip
def test_expand_hostlist_reads_slurms_forms(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


def test_expand_hostlist_up_to_the_bound() -> None:
    assert len(expand_hostlist(f"n[1-{MAX_ASSIGNED_NODES}]")) == MAX_ASSIGNED_NODES


# ---------------------------------------------------------------- attribution from hostile squeue

RUNNING = {"job_id": 1, "job_state": "RUNNING", "name": "a", "user_name": "u", "account": "acc", "partition": "gpu",
           "job_resources": {"allocated_nodes": [{"nodename": "n1"}]}, "gres_detail": ["gpu:h100:2(IDX:0-1)"]}  # fmt: skip


def _holders(
    jobs: list[object], ngpus: int = 8
) -> tuple[dict[int, list[tuple[str, float]]], SlurmAttribution]:
    """Each GPU of an NVML source (fake) attributed from ``jobs``: its (job, share) holders; the
    batch is validated and round-tripped through the wire."""
    from gpuslo.agent.nvml import NvmlSource
    from gpuslo.wire import GpuSampleBatch
    from tests.fake_nvml import FakeGpu, FakeNvml

    attr = SlurmAttribution("n1", cli=SlurmCli(run=lambda argv: json.dumps({"jobs": jobs})))
    src = NvmlSource(
        "n1", "c", 10, nvml=FakeNvml([FakeGpu(f"GPU-{i}") for i in range(ngpus)]), attribution=attr
    )
    (b, *_) = src.collect(NOW)
    assert isinstance(b, GpuSampleBatch) and decode(encode(b)) == b
    return {g.index: [(a.id, a.share) for a in g.allocations] for g in b.gpus if g.allocations}, attr


HOSTILE_RUNNING = {
    "not-an-object": "garbage",
    "resources-list-of-strings": dict(RUNNING, job_id=2, job_resources=["x"]),
    "resources-string": dict(RUNNING, job_id=2, job_resources="x"),
    "allocated-node-strings": dict(RUNNING, job_id=2, job_resources={"allocated_nodes": ["n1"]}),
    "allocated-nodes-object": dict(RUNNING, job_id=2, job_resources={"allocated_nodes": {"0": {"nodename": "n1"}}}),
    "gres_detail-string": dict(RUNNING, job_id=2, gres_detail="gpu:2(IDX:2-3)"),
    "gres_detail-number": dict(RUNNING, job_id=2, gres_detail=[5]),
    "no-job_id": {k: v for k, v in dict(RUNNING, gres_detail=["gpu:1(IDX:4)"]).items() if k != "job_id"},
    "name-surrogate": dict(RUNNING, job_id=2, name="\ud800", gres_detail=["gpu:1(IDX:4)"]),
    "state-number": dict(RUNNING, job_id=2, job_state=5),
    "hostlist-letters": {k: v for k, v in dict(RUNNING, job_id=2, nodes="n[a-b]").items() if k != "job_resources"},
    "hostlist-huge": {k: v for k, v in dict(RUNNING, job_id=2, nodes="n[0-99999999]").items() if k != "job_resources"},
}  # fmt: skip


@pytest.mark.parametrize("bad", HOSTILE_RUNNING.values(), ids=HOSTILE_RUNNING.keys())
def test_attribution_skips_and_counts_a_hostile_job_only(bad: object) -> None:
    held, attr = _holders([RUNNING, bad])
    assert held == {0: [("1", 1.0)], 1: [("1", 1.0)]} and attr.skipped == 1


@pytest.mark.parametrize(("state", "held"), [
    (["RUNNING"], True), (["RUNNING", "CONFIGURING"], True), (["COMPLETED", "COMPLETING"], True), (["SUSPENDED"], True),
    (["PENDING"], False), (["COMPLETED"], False), ([], False), ("running", True),
])  # fmt: skip
def test_attribution_reads_slurm_2302_state_lists(state: object, held: bool) -> None:
    got, attr = _holders([dict(RUNNING, job_state=state)])
    assert got == ({0: [("1", 1.0)], 1: [("1", 1.0)]} if held else {}) and attr.skipped == 0


@pytest.mark.parametrize("n", [2, 3, 7, MAX_ALLOCATIONS, MAX_ALLOCATIONS + 1, 200])
def test_jobs_naming_one_gpu_share_it_within_the_wires_bound(n: int) -> None:
    jobs = [dict(RUNNING, job_id=100 + i, gres_detail=["gpu:1(IDX:6)"]) for i in range(n)]
    held, attr = _holders([RUNNING, *jobs])
    kept = min(n, MAX_ALLOCATIONS)
    assert held[6] == [(str(100 + i), 1 / kept) for i in range(kept)]  # the first ones, in squeue's order
    assert held[0] == [("1", 1.0)] and attr.skipped == n - kept


@pytest.mark.parametrize("gres", ["gpu:2(IDX:5,5)", "gpu:2(IDX:5-5,5)", "gpu:1(IDX:5),gpu:1(IDX:5)"])
def test_an_idx_listed_twice_holds_the_gpu_once(gres: str) -> None:
    held, attr = _holders([dict(RUNNING, gres_detail=[gres])])
    assert held == {5: [("1", 1.0)]} and attr.skipped == 0


@pytest.mark.parametrize(("gres", "held_idx", "skipped"), [
    (["gpu:1(IDX:3),nic:1(IDX:0)"], [3], 0),
    (["nic:2(IDX:0-1)"], [], 0),
    (["gpu:1(IDX:3),shard:2(1/4,0/4)"], [3], 1),  # 23.02+'s shared form: said, the GPU placed
    (["gpu:2(IDX:3,N/A)"], [3], 1),
    (["gpu:2(IDX:3-2),gpu:1(IDX:4)"], [4], 1),
])  # fmt: skip
def test_a_jobs_gres_beside_its_gpus_are_read_or_counted(gres: list[str], held_idx: list[int], skipped: int,
                                                         caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    with caplog.at_level(logging.WARNING):
        held, attr = _holders([dict(RUNNING, job_id=7, gres_detail=gres)])
        assert held == {g: [("7", 1.0)] for g in held_idx} and attr.skipped == skipped
        logged = len(caplog.records)
        attr.refresh()  # read again: counted again, not logged again
    assert attr.skipped == 2 * skipped and len(caplog.records) == logged


@pytest.mark.parametrize("ngpus", [1, 4, 8])
@pytest.mark.parametrize("past", [0, 1, 2, 100, 8000])  # 8000 + 8: still an IDX (MAX_IDX)
def test_an_idx_past_the_gpus_nvml_shows_is_counted(ngpus: int, past: int) -> None:
    """A gres.conf declaring more GPUs than NVML shows (a GPU gone from the bus, a wrong
    File= list): the job's IDX that names no row is counted and said, as under MIG, and its
    other GPUs are placed."""
    far = ngpus + past
    held, attr = _holders(
        [dict(RUNNING, job_id=7, gres_detail=[f"gpu:2(IDX:{ngpus - 1},{far})"])], ngpus=ngpus
    )
    assert held == {ngpus - 1: [("7", 1.0)]} and attr.skipped == 1


def test_a_job_listed_twice_holds_its_gpus_once() -> None:
    held, _ = _holders([RUNNING, RUNNING])
    assert held == {0: [("1", 1.0)], 1: [("1", 1.0)]}


@pytest.mark.parametrize("tres", ["gres/gpu:a100:1e20", "gres/gpu:99999999999999999999", f"gres/gpu:{MAX_GPUS_PER_NODE + 1}",
                                  "gres/gpu:a100:-1", "gres/gpu:a100:1.5", "gres/gpu:a100:x", "gres/gpu:a:b:1",
                                  ["gres/gpu:1"]])  # fmt: skip
def test_gpus_per_node_refuses_what_no_node_holds(tres: object) -> None:
    with pytest.raises(Malformed):
        gpus_per_node({"tres_per_node": tres})


def test_what_is_skipped_is_on_metrics(tmp_path: Path) -> None:
    """The counts of what was skipped reach the agent's /metrics: the node agent's attribution
    (squeue jobs it could not read) and the cluster collector's (job sightings, state files)."""
    from gpuslo.agent.assemble import _with_attribution_counts

    attr = SlurmAttribution(
        "n1", cli=SlurmCli(run=lambda argv: json.dumps({"jobs": [RUNNING, dict(RUNNING, job_id=[])]}))
    )
    attr.refresh()
    assert attr.skipped == 1
    assert _with_attribution_counts(lambda: {"a": 1.0}, attr)() == {
        "a": 1.0,
        "gpuslo_agent_slurm_jobs_skipped": 1,
        "gpuslo_agent_slurm_gres_unmapped": 0,
        "gpuslo_agent_slurm_slow": 0,
        "gpuslo_agent_slurm_failures": 0,
    }
    jobs = [dict(job_id=7, job_state="PENDING", submit_time=-5, name="j", user_name="u", account="a",
                 partition="p", tres_per_node="gres/gpu:1", node_count=1, state_reason="Resources")]  # fmt: skip
    col = SlurmEventCollector("c", tmp_path / "s.json", SlurmCli(run=lambda argv: json.dumps({"jobs": jobs})))
    col.collect(1.8e9)
    assert col.counts() == {"gpuslo_slurm_skipped_jobs": 1, "gpuslo_slurm_state_save_failures": 0,
                            "gpuslo_slurm_command_failures": 0}  # fmt: skip


def _sightings(tmp_path: Path, sightings: list[dict[str, object]], state: str = "state.json") -> list[tuple]:
    """The collector's events over ``sightings`` of one job, one tick each, 60 s apart."""
    answer: dict[str, object] = {}
    col = SlurmEventCollector(
        "c", tmp_path / state, cli=SlurmCli(run=lambda argv: json.dumps({"jobs": [answer]}))
    )
    out = []
    for i, job in enumerate(sightings):
        answer.clear()
        answer.update(job)
        out += [(e.request_id, e.event, e.ts, e.reason) for e in col.collect(NOW + 60 * i)
                if isinstance(e, SchedulerEvent)]  # fmt: skip
    return out


SUB, RUN1, REQ, RUN2, DONE = 1_796_428_800, 1_796_429_000, 1_796_429_500, 1_796_429_700, 1_796_429_900
REQUEUED_JOB = [  # a job's sightings through a requeue, as slurmctld 22.05 wrote them (recorded, times shifted)
    dict(GOOD, job_state="PENDING", submit_time=SUB, state_reason="Resources", start_time=0, restart_cnt=0),
    dict(GOOD, job_state="RUNNING", submit_time=SUB, state_reason="None", start_time=RUN1, restart_cnt=0),
    # requeued: its run still cleaning up, the count already raised, the old submit time and a far end
    dict(GOOD, job_state="COMPLETING", submit_time=SUB, state_reason="None", start_time=RUN1, restart_cnt=1,
         end_time=6_091_542_943),
    dict(GOOD, job_state="PENDING", submit_time=REQ, state_reason="BeginTime", start_time=REQ + 121, restart_cnt=1,
         end_time=6_091_543_064),
    dict(GOOD, job_state="RUNNING", submit_time=REQ, state_reason="None", start_time=RUN2, restart_cnt=1),
    dict(GOOD, job_state="COMPLETED", submit_time=REQ, state_reason="None", start_time=RUN2, end_time=DONE,
         restart_cnt=1),
]  # fmt: skip


def test_a_requeued_job_waits_again_as_a_new_request(tmp_path: Path) -> None:
    """A requeued job (node failure, preemption by requeue, scontrol requeue) went back to PENDING
    under the same id: its second wait was never a request (the first start closed it), so a
    requeued job starving for hours was no incident. Its run now ends at the requeue
    (``preempt``), and the wait after it is request ``ID#2``, submitted at the requeue."""
    assert _sightings(tmp_path, REQUEUED_JOB) == [
        ("100", "submit", SUB, ""),
        ("100", "pending_reason", NOW, "Resources"),
        ("100", "start", RUN1, ""),
        ("100", "preempt", REQ, "REQUEUED"),
        ("100#2", "submit", REQ, ""),
        ("100#2", "pending_reason", NOW + 180, "BeginTime"),
        ("100#2", "start", RUN2, ""),
        ("100#2", "end", DONE, "COMPLETED"),
    ]


@pytest.mark.parametrize("first", range(1, len(REQUEUED_JOB)))
def test_a_requeue_seen_at_any_point_gives_each_run_its_request(tmp_path: Path, first: int) -> None:
    """The collector started (or restarted without its state) at any sighting of the requeue, or
    missed some sightings: every event names the run it belongs to, none is sent twice, and a
    job first seen after its requeue starts at its current attempt."""
    both = _sightings(tmp_path, REQUEUED_JOB)
    seen = _sightings(tmp_path, REQUEUED_JOB[first:], state="late.json")
    assert len(seen) == len(set(seen))
    for rid, event, ts, reason in seen:
        if event != "pending_reason":  # said when seen
            assert (rid, event, ts, reason) in both or (event, reason) == ("submit", "")
    attempts = {rid for rid, *_ in seen}
    assert attempts == ({"100#2"} if first >= 2 else {"100", "100#2"})
    # and skipping sightings in the middle (the collector down for a while)
    for gap in range(1, len(REQUEUED_JOB) - 1):
        got = _sightings(tmp_path, [REQUEUED_JOB[0], *REQUEUED_JOB[gap + 1 :]], state=f"gap{gap}.json")
        assert len(got) == len(set(got))
        ends = [(rid, e) for rid, e, *_ in got if e in ("preempt", "end", "cancel")]
        assert ends == [("100", "preempt" if gap < 1 else "end"), ("100#2", "end")], (gap, got)


@pytest.mark.parametrize("count", [-1, 1.5, 65_536, "1", float("inf")])
def test_a_restart_count_that_is_none_skips_the_job(tmp_path: Path, count: object) -> None:
    col = SlurmEventCollector("c", tmp_path / "s.json",
                              cli=SlurmCli(run=lambda argv: json.dumps({"jobs": [dict(GOOD, restart_cnt=count)]})))  # fmt: skip
    assert col.collect(NOW) == [] and col.skipped == 1


def test_a_requeued_job_left_unobserved_ends_as_its_attempt(tmp_path: Path) -> None:
    """Gone from squeue while waiting after its requeue: the end names the attempt that waited."""
    got = _sightings(tmp_path, [*REQUEUED_JOB[:4], {"job_id": 999, "job_state": "PENDING"}])
    assert got[-1][:2] == ("100#2", "end") and got[-1][3] == "UNOBSERVED"


@pytest.mark.integration
def test_a_job_requeued_on_a_real_slurmctld_waits_as_its_second_attempt(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scontrol requeue`` of a running job: the collector ends its run (``preempt``) and follows
    the wait after it as ``ID#2``, submitted at the requeue time slurmctld gives (read back from
    ``scontrol show job``)."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    j = slurm.run("sbatch", "--parsable", "--gres=gpu:1", "--requeue", f"--output={slurm.dir}/log/slurm-%j.out",
                  "--wrap", "sleep 300").strip().split(";")[0]  # fmt: skip
    col = SlurmEventCollector("gpuslo", tmp_path / "s.json")
    events: list[SchedulerEvent] = []
    try:
        _wait_state(slurm, j, "RUNNING")
        events += [
            e
            for e in col.collect(time.time())
            if isinstance(e, SchedulerEvent) and e.request_id.startswith(j)
        ]
        slurm.run("scontrol", "requeue", j)
        _wait_state(slurm, j, "PENDING")
        events += [
            e
            for e in col.collect(time.time())
            if isinstance(e, SchedulerEvent) and e.request_id.startswith(j)
        ]
        text = slurm.run("scontrol", "show", "job", j)
        m = re.search(r"SubmitTime=(\S+)", text)
        assert m and re.search(r"Restarts=1\b", text), text
        import datetime as dt

        requeued_at = dt.datetime.fromisoformat(
            m.group(1)
        ).timestamp()  # slurmctld's local time, as this process's
    finally:
        slurm.run("scancel", j)
    got = [(e.request_id, e.event) for e in events if e.event != "pending_reason"]
    assert got == [(j, "submit"), (j, "start"), (j, "preempt"), (f"{j}#2", "submit")], events
    assert [
        e.ts
        for e in events
        if (e.event in ("preempt", "submit") and e.request_id == f"{j}#2") or e.event == "preempt"
    ] == [requeued_at, requeued_at]


@pytest.mark.integration
def test_array_tasks_and_het_components_are_asked_of_slurm_for_their_own_id(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gpuslo job 123_4`` / ``123+1``: squeue --json (what the agent records) names each array
    task and het component by its own job id, which is not what squeue's text, sacct or a user
    shows; the name is asked of the real slurmctld for that id."""
    from gpuslo.agent.slurm import raw_job_id

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    arr = slurm.run("sbatch", "--parsable", "--array=0-2", "-J", "arr", f"--output={slurm.dir}/log/slurm-%j.out",
                    "--wrap", "sleep 600").strip()  # fmt: skip
    script = tmp_path / "het.sh"
    script.write_text("#!/bin/sh\n#SBATCH -J het\n#SBATCH hetjob\n#SBATCH -J het\nsleep 600\n")
    het = (
        slurm.run("sbatch", "--parsable", f"--output={slurm.dir}/log/slurm-%j.out", str(script))
        .strip()
        .split(";")[0]
    )
    try:
        own: dict[str, str] = {}  # Slurm's names → job_id, as squeue --json gives them
        deadline = time.monotonic() + 30
        while len(own) < 5:  # an array's tasks are records of their own once they start
            assert time.monotonic() < deadline, (own, slurm.run("squeue"))
            time.sleep(0.3)
            for j in json.loads(slurm.run("squeue", "--json"))["jobs"]:
                if str(j["array_job_id"]) == arr and j.get("array_task_id") is not None:
                    own[f"{arr}_{j['array_task_id']}"] = str(j["job_id"])
                if str(j["het_job_id"]) == het:
                    own[f"{het}+{j['het_job_offset']}"] = str(j["job_id"])
        assert len(set(own.values())) == 5, own
        assert any(name != f"{arr}_{raw}" and raw != name.split("_")[0] for name, raw in own.items())
        for name, raw in own.items():
            assert raw_job_id(name) == (raw, f"{name} is job {raw}")
            assert raw_job_id(f"{name}#2")[0] == f"{raw}#2"
        assert raw_job_id(arr) == (arr, "")  # a plain id is given back, Slurm not asked
        with pytest.raises(ValueError, match=r"sacct -X -n -o JobIDRaw -j 999999_1"):
            raw_job_id("999999_1")  # no such job: scontrol refuses it, sacct has no accounting here
    finally:
        slurm.run("scancel", arr, het)


class _Gated:
    """A Slurm command's runner that answers at once while ``open``, and otherwise holds the call
    until opened (as a slurmctld that took the RPC and answers late): each call answers what
    ``answer`` holds when it returns."""

    def __init__(self, answer: str) -> None:
        import threading

        self.answer = answer
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls += 1
        if not self.gate.wait(60):  # (bounded: a test that fails never hangs the suite)
            raise subprocess.TimeoutExpired(list(argv), 60)
        return self.answer


@pytest.mark.parametrize("late", ["new jobs", "a failure", "garbage"])
def test_a_slurmctld_slow_to_answer_never_holds_the_tick(late: str) -> None:
    """``squeue --json`` ran on the tick with its 15 s timeout: a slurmctld that took the call and
    answered late held every tick of the GPU source that long (at a 10 s interval every other
    sample never taken). With ``wait_s`` the call runs off the tick, one at a time: the tick
    waits at most ``wait_s``, the last mapping stands meanwhile (counted slow, not failed), and
    the late answer is taken at the next tick after it came; a failed or unreadable one keeps the
    last mapping, as on the tick."""
    from gpuslo.agent.base import Device

    run = _Gated(json.dumps({"jobs": [RUNNING]}))
    attr = SlurmAttribution("n1", cli=SlurmCli(run=run), wait_s=2.0)
    attr.bind([Device(index=i, uuid=f"GPU-{i}") for i in range(4)])
    attr.refresh()  # answered within wait_s: job 1 on GPUs 0-1
    assert [a.id for a in attr(0, "GPU-0")] == ["1"] and attr.slow == 0
    run.gate.clear()  # slurmctld stops answering
    for k in range(1, 4):
        attr.refresh()
        assert attr.slow == k and run.calls == 2  # one call in flight, not one a tick
        assert [a.id for a in attr(0, "GPU-0")] == ["1"]  # the last mapping stands
    if late == "new jobs":
        run.answer = json.dumps({"jobs": [dict(RUNNING, job_id=2, gres_detail=["gpu:h100:1(IDX:3)"])]})
    elif late == "a failure":
        run.answer = "Unable to contact slurm controller"  # not JSON: the command's answer refused
    else:
        run.answer = json.dumps({"jobs": "x"})
    run.gate.set()
    attr.refresh()  # the late answer, taken
    assert attr.slow == 3
    if late == "new jobs":
        assert attr(0, "GPU-0") == () and [a.id for a in attr(3, "GPU-3")] == ["2"]
    else:
        assert [a.id for a in attr(0, "GPU-0")] == ["1"] and attr.cli.failures == 1
    from gpuslo.agent.assemble import _with_attribution_counts

    assert _with_attribution_counts(dict, attr)()["gpuslo_agent_slurm_slow"] == 3


def test_a_slow_sinfo_sends_the_nodes_last_state_and_a_failed_one_none() -> None:
    """The node's heartbeat asked ``sinfo --json`` on the tick too: with ``wait_s`` a late answer
    leaves the last one standing (the node's state as last known, at this tick), and an answer
    that failed sends no heartbeat, as on the tick."""
    node = {"name": "n1", "state": "IDLE", "state_flags": [], "partitions": ["gpu"], "reason": ""}
    run = _Gated(json.dumps({"nodes": [node]}))
    src = SlurmNodeSource("n1", "c", 10.0, 4, cli=SlurmCli(run=run), boot_id="b", wait_s=2.0)
    (b,) = src.collect(NOW)
    assert isinstance(b, NodeHeartbeat) and b.schedulable and src.slow == 0
    run.gate.clear()
    run.answer = json.dumps({"nodes": [dict(node, state="DOWN")]})
    (b,) = src.collect(NOW + 10)  # late: the last state stands
    assert b.ts == NOW + 10 and b.schedulable and src.slow == 1
    run.gate.set()
    (b,) = src.collect(NOW + 20)  # the late answer, taken
    assert not b.schedulable and b.state == "down"
    run.gate.clear()
    run.answer = "not json"
    assert [m.ts for m in src.collect(NOW + 30)] == [NOW + 30]  # late again: the last (down) state
    run.gate.set()
    assert src.collect(NOW + 40) == []  # it failed: no heartbeat
    assert src.slow == 2


def test_the_first_answer_of_slurmctld_is_waited_for_whole() -> None:
    """There is no last mapping or state before the first answer: it is waited for whole (the
    command's own timeout bounds it), so the agent's first ticks attribute and beat as before."""
    import threading

    from gpuslo.agent.base import Device

    jobs = _Gated(json.dumps({"jobs": [RUNNING]}))
    node = {"name": "n1", "state": "IDLE", "state_flags": [], "partitions": ["gpu"], "reason": ""}
    nodes = _Gated(json.dumps({"nodes": [node]}))
    for g in (jobs, nodes):
        g.gate.clear()
        threading.Timer(0.3, g.gate.set).start()  # answers after many wait_s
    attr = SlurmAttribution("n1", cli=SlurmCli(run=jobs), wait_s=0.01)
    attr.bind([Device(index=i, uuid=f"GPU-{i}") for i in range(2)])
    attr.refresh()
    assert [a.id for a in attr(1, "GPU-1")] == ["1"] and attr.slow == 0
    src = SlurmNodeSource("n1", "c", 10.0, 2, cli=SlurmCli(run=nodes), boot_id="b", wait_s=0.01)
    assert [m.ts for m in src.collect(NOW)] == [NOW] and src.slow == 0


class _Threads:
    """A Slurm command's runner that records the thread each command ran on, answering
    ``squeue --json`` (job 1 on gres IDX 2) and ``sinfo --json`` (the node with ``gres``)."""

    def __init__(self, gres: str) -> None:
        self.gres = gres
        self.ran: list[tuple[str, object]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        import threading

        self.ran.append((argv[0], threading.current_thread()))
        if argv[0] == "squeue":
            return json.dumps({"jobs": [dict(RUNNING, gres_detail=["gpu:1(IDX:2)"])]})
        node = dict(name="n1", state="IDLE", state_flags=[], partitions=["gpu"], reason="", gres=self.gres)
        return json.dumps({"nodes": [node]})


_H100 = "NVIDIA H100 80GB HBM3"
_MIG_ROWS = [Device(0, "GPU-0", _H100, minor=0), Device(1, "GPU-1", _H100, minor=1),
             Device(1, "MIG-1-1", _H100, 1, 0, "3g.40gb", 1), Device(2, "GPU-2", _H100, minor=2),
             Device(3, "GPU-3", _H100, minor=3)]  # fmt: skip
# (gres.conf, the node's Gres= in sinfo, the rows, the row IDX 2 names): every way the attribution
# reads Slurm, each path by which it asks sinfo as well as squeue
_LAYOUTS = {
    "no gres.conf": (None, "gpu:4", None, "GPU-2"),
    "untyped gres.conf": ("Name=gpu File=/dev/nvidia[0-3]\n", "gpu:4", None, "GPU-2"),
    "one type": ("Name=gpu Type=h100 File=/dev/nvidia[0-3]\n", "gpu:h100:4", None, "GPU-2"),
    "two types": ("Name=gpu Type=a100 File=/dev/nvidia[2-3]\nName=gpu Type=h100 File=/dev/nvidia[0-1]\n",
                  "gpu:h100:2,gpu:a100:2", None, "GPU-2"),  # IDX 2: the first a100, nvidia2
    "two types, node order": ("Name=gpu Type=a100 File=/dev/nvidia[2-3]\nName=gpu Type=h100 File=/dev/nvidia[0-1]\n",
                              "gpu:a100:2,gpu:h100:2", None, "GPU-0"),  # IDX 2: the first h100, nvidia0
    "MIG": (None, "gpu:h100:3,gpu:3g.40gb:1", _MIG_ROWS, "GPU-3"),
}  # fmt: skip


def _bound_attribution(
    tmp_path: Path,
    run: Callable[[Sequence[str]], str],
    conf: str | None,
    rows: list[Device] | None,
    wait_s: float,
) -> SlurmAttribution:
    """node n1's attribution through ``run``, with ``conf`` as its gres.conf (None: none), bound to
    ``rows`` (default: four GPUs whose minors are their indexes)."""
    path = None
    if conf is not None:
        path = tmp_path / "gres.conf"
        path.write_text(conf)
    attr = SlurmAttribution("n1", cli=SlurmCli(run=run), gres_conf=path, wait_s=wait_s)
    attr.bind(rows or [Device(i, f"GPU-{i}", minor=i) for i in range(4)])
    return attr


@pytest.mark.parametrize(("conf", "gres", "rows", "row"), _LAYOUTS.values(), ids=_LAYOUTS.keys())
def test_no_slurm_command_runs_on_the_tick_whatever_the_layout(conf: str | None, gres: str,
                                                               rows: list[Device] | None, row: str,
                                                               tmp_path: Path) -> None:  # fmt: skip
    """With ``wait_s`` every Slurm command the attribution asks (``squeue``, and ``sinfo`` for a
    MIG node's gres order or a gres.conf of several GPU types) runs off the tick's thread: one
    asked on it held the tick up to the command's 15 s timeout whenever slurmctld was slow (the
    typed gres.conf's ``sinfo`` did, every tick). The answers are still the ones used."""
    import threading

    run = _Threads(gres)
    attr = _bound_attribution(tmp_path, run, conf, rows, wait_s=60.0)
    for _ in range(3):
        attr.refresh()
        got = {d.uuid: [a.id for a in attr(d.index, d.uuid)] for d in attr._devices}
        assert {u for u, held in got.items() if held} == {row} and attr.skipped == 0 and attr.unmapped == 0
    on_tick = [cmd for cmd, t in run.ran if t is threading.current_thread()]
    assert on_tick == [] and {c for c, _ in run.ran} >= {"squeue"}, run.ran
    src = SlurmNodeSource("n1", "c", 10.0, 4, cli=SlurmCli(run=run), boot_id="b", wait_s=60.0)
    run.ran.clear()
    for k in range(3):
        (b,) = src.collect(NOW + 10 * k)
        assert isinstance(b, NodeHeartbeat) and b.schedulable
    assert [c for c, _ in run.ran] == ["sinfo"] * 3
    assert all(t is not threading.current_thread() for _, t in run.ran)


@pytest.mark.integration
def test_a_stopped_slurmctld_holds_no_tick_and_its_stale_answers_end(tmp_path: Path) -> None:
    """On the real slurmctld, stopped (SIGSTOP: it holds the connections it took and answers
    nothing, as a slurmctld stuck in a long RPC does), on a node whose gres.conf has two GPU
    types (its IDX order needs ``sinfo`` too): no Slurm command runs on the tick's thread, the
    last mapping and node state stand meanwhile (counted slow), the heartbeat's stale state ends
    when the command's timeout ends the call (then no heartbeat, not a stale one), and once
    slurmctld answers again a job that ended leaves its GPU."""
    import signal
    import threading

    from gpuslo.agent.nvml import NvmlSource
    from tests.fake_nvml import FakeGpu, FakeNvml

    if not available():
        pytest.fail("Slurm is not installed (scripts/test.sh installs slurm-wlm and munge)")
    c = SlurmCluster(tmp_path / "slurm", devices=[("h100", "nvidia0"), ("a100", "nvidia1")])
    c.start()
    ran: list[tuple[str, threading.Thread]] = []

    def run(argv: Sequence[str]) -> str:  # as SlurmCli runs a command, on a shorter timeout
        ran.append((argv[0], threading.current_thread()))
        done = subprocess.run(list(argv), capture_output=True, text=True, env=c.env, timeout=8, check=True)
        return done.stdout

    ctld = next(p for p in c.procs if p.args[0] == "slurmctld")
    j = ""
    try:
        j = c.sbatch("a100:1", "typed")
        _wait_state(c, j, "RUNNING")
        attr = SlurmAttribution(c.node, cli=SlurmCli(run=run), gres_conf=c.dir / "gres.conf", wait_s=0.1)
        gpus = FakeNvml([FakeGpu("GPU-0", minor=0), FakeGpu("GPU-1", minor=1)])
        NvmlSource(c.node, "c", 10, nvml=gpus, attribution=attr)
        node = SlurmNodeSource(c.node, "c", 10.0, 2, cli=SlurmCli(run=run), boot_id="b", wait_s=0.1)
        attr.refresh()  # IDX 1 (Gres=gpu:h100:1,gpu:a100:1): the a100, nvidia1, NVML's GPU 1
        assert [a.id for a in attr(1, "GPU-1")] == [j] and attr(0, "GPU-0") == ()
        (b,) = node.collect(NOW)
        assert isinstance(b, NodeHeartbeat) and b.schedulable
        ctld.send_signal(signal.SIGSTOP)
        try:
            for k in range(1, 4):
                attr.refresh()
                assert [cmd for cmd, t in ran if t is threading.current_thread()] == []  # none on the tick
                assert [a.id for a in attr(1, "GPU-1")] == [j]  # the last mapping stands
                assert len(node.collect(NOW + 10 * k)) == 1  # the last state stands
            assert attr.slow >= 3 and node.slow >= 3
            deadline = time.monotonic() + 60  # the call's 8 s timeout ends the stale state
            k = 4
            while node.collect(NOW + 10 * k):
                assert time.monotonic() < deadline, "the stale node state never ended"
                k += 1
                time.sleep(0.2)
            assert node.cli.failures == 1
        finally:
            ctld.send_signal(signal.SIGCONT)
        c.run("scancel", j)
        deadline = time.monotonic() + 30
        while attr(1, "GPU-1") != ():  # its end seen at the first answer after it
            assert time.monotonic() < deadline, "the ended job kept its GPU"
            attr.refresh()
            time.sleep(0.2)
        assert [cmd for cmd, t in ran if t is threading.current_thread()] == []
        assert {cmd for cmd, _ in ran} == {"squeue", "sinfo"}
    finally:
        ctld.send_signal(signal.SIGCONT)
        if j:
            c.run("scancel", j)
        deadline = time.monotonic() + 30  # its step gone before slurmd is: none left behind
        while c.run("squeue", "-h", "-o", "%i") and time.monotonic() < deadline:
            time.sleep(0.3)
        c.stop()


_DATA = Path(__file__).parent / "data" / "slurm"


@pytest.mark.parametrize("reader", ["attribution", "MIG order", "typed gres.conf", "heartbeat", "collector"])
@pytest.mark.parametrize("wait_s", [None, 60.0])
def test_an_answer_that_reports_slurmctld_unreachable_is_a_failure(reader: str, wait_s: float | None,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """Slurm 22.05's ``squeue --json`` and ``sinfo --json`` exit 0 when slurmctld cannot be
    reached (connection refused, or taken and not answered past ``MessageTimeout``: as a slurmctld
    slow to answer is seen once the call ends), their failure in ``errors`` and an empty list
    (recorded: tests/data/slurm). Read as an answer, every GPU of the node was free (the job
    holding it dropped), and the cluster collector ended every job it followed
    (``UNOBSERVED``) and forgot it. Every reader must take it as the failure it is: the last
    mapping, order and state kept as for a command that failed, counted."""
    down = {c: (_DATA / f"{c}-json-controller-unreachable.json").read_text() for c in ("squeue", "sinfo")}
    up = {"squeue": json.dumps({"jobs": [dict(RUNNING, gres_detail=["gpu:1(IDX:2)"])]}), "sinfo": ""}
    answers = up

    def run(argv: Sequence[str]) -> str:
        if argv[0] == "sinfo":
            return down["sinfo"] if answers is down else _Threads(gres)(argv)
        return answers[argv[0]]

    gres = {"MIG order": "gpu:h100:3,gpu:3g.40gb:1", "typed gres.conf": "gpu:h100:2,gpu:a100:2"}.get(
        reader, "gpu:4"
    )
    cli = SlurmCli(run=run)
    if reader == "collector":
        pending = dict(RUNNING, job_state="PENDING", job_id=7, submit_time=NOW - 5, state_reason="Resources",
                       tres_per_node="gres/gpu:1", node_count=1)  # fmt: skip
        up["squeue"] = json.dumps({"jobs": [pending]})
        col = SlurmEventCollector("c", tmp_path / "s.json", cli)
        assert "submit" in [e.event for e in col.collect(NOW) if isinstance(e, SchedulerEvent)]
        answers = down
        assert col.collect(NOW + 10) == [] and col.counts()["gpuslo_slurm_command_failures"] == 1  # no end
        answers = up
        assert col.collect(NOW + 20) == [] and cli.failures == 1  # nor a second submit
        return
    if reader == "heartbeat":
        src = SlurmNodeSource("n1", "c", 10.0, 4, cli=cli, boot_id="b", wait_s=wait_s)
        assert len(src.collect(NOW)) == 1
        answers = down
        assert src.collect(NOW + 10) == [] and cli.failures == 1  # failed: no heartbeat, counted
        return
    conf = "Name=gpu Type=a100 File=/dev/nvidia[2-3]\nName=gpu Type=h100 File=/dev/nvidia[0-1]\n"
    path = tmp_path / "gres.conf"
    path.write_text(conf)
    attr = SlurmAttribution(
        "n1", cli=cli, gres_conf=path if reader == "typed gres.conf" else None, wait_s=wait_s
    )
    attr.bind(_MIG_ROWS if reader == "MIG order" else [Device(i, f"GPU-{i}", minor=i) for i in range(4)])

    def held() -> dict[str, list[str]]:
        return {d.uuid: [a.id for a in attr(d.index, d.uuid)] for d in attr._devices if attr(d.index, d.uuid)}

    attr.refresh()
    before = held()
    assert len(before) == 1 and attr.skipped == 0 and attr.unmapped == 0
    answers = down
    for _ in range(3):
        attr.refresh()
        assert held() == before and attr.skipped == 0 and attr.unmapped == 0  # the last mapping stands
    assert cli.failures >= 1


@pytest.mark.integration
def test_a_stopped_slurmctld_is_a_failure_not_an_empty_queue(slurm: SlurmCluster, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The real slurmctld stopped (SIGSTOP: it took the connection and answers nothing) past
    ``MessageTimeout``: ``squeue --json`` exits 0 with its failure in ``errors`` and no job. The
    node's GPU stays its job's, the heartbeat is not sent (a failure, not a node sinfo does not
    list), and the cluster collector neither ends the running job nor starts it again after."""
    import signal
    import threading

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    j = slurm.sbatch(1, "held")
    ctld = next(p for p in slurm.procs if p.args[0] == "slurmctld")
    try:
        _wait_state(slurm, j, "RUNNING")
        attr = SlurmAttribution(slurm.node, wait_s=0.1)
        attr.bind([Device(i, f"GPU-{i}") for i in range(4)])
        attr.refresh()
        (gpu,) = [i for i in range(4) if [a.id for a in attr(i, f"GPU-{i}")] == [j]]
        col = SlurmEventCollector("c", tmp_path / "s.json", SlurmCli())
        assert "start" in [e.event for e in col.collect(time.time()) if isinstance(e, SchedulerEvent)]
        node = SlurmNodeSource(slurm.node, "c", 10.0, 4, boot_id="b", wait_s=0.1)
        assert len(node.collect(NOW)) == 1
        ctld.send_signal(signal.SIGSTOP)
        said: list[subprocess.CompletedProcess[str]] = []
        raw = threading.Thread(target=lambda: said.append(subprocess.run(
            ["squeue", "--json"], capture_output=True, text=True, env=slurm.env, timeout=60)))  # fmt: skip
        raw.start()
        attr.refresh()  # its squeue (and the heartbeat's sinfo) in flight meanwhile
        node.collect(NOW + 10)
        assert col.collect(time.time()) == [] and col.cli.failures == 1  # no end of the running job
        raw.join()
        assert said[0].returncode == 0 and json.loads(said[0].stdout)["jobs"] == []  # what Slurm says
        assert json.loads(said[0].stdout)["errors"]
        deadline, k = time.monotonic() + 30, 2
        while attr.cli.failures == 0 or node.collect(NOW + 10 * k) != []:  # the calls in flight, taken
            assert time.monotonic() < deadline, "the calls in flight never ended"
            attr.refresh()
            k += 1
            time.sleep(0.1)
        assert node.cli.failures == 1
        assert [a.id for a in attr(gpu, f"GPU-{gpu}")] == [j]  # the failed answer kept the mapping
        ctld.send_signal(signal.SIGCONT)
        assert [e.event for e in col.collect(time.time()) if isinstance(e, SchedulerEvent)] == []
    finally:
        ctld.send_signal(signal.SIGCONT)
        slurm.run("scancel", j)


def _slurm_children(parent: int) -> list[int]:
    """The squeue and sinfo processes whose parent is ``parent``, read from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except OSError:  # not a process (/proc/net/stat is a directory), or one that ended
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if comm in ("squeue", "sinfo") and int(rest[1]) == parent and rest[0] != "Z":
            out.append(int(d.name))
    return out


def _first_slurm_children(parent: int, alive: Callable[[], bool]) -> list[int]:
    """The first squeue or sinfo ``parent`` starts (2 minutes at most, while ``alive()``)."""
    deadline = time.monotonic() + 120
    while not (kids := _slurm_children(parent)):
        assert alive() and time.monotonic() < deadline, "the agent never asked Slurm"
        time.sleep(0.05)
    return kids


def _agent_argv(slurm: SlurmCluster, out: Path) -> list[str]:
    return ["agent", "--source", "dcgm", "--slurm", "--dcgm-url", "http://127.0.0.1:9/metrics", "--node",
            slurm.node, "--interval-s", "2", "--metrics-port", "0", "--out", str(out)]  # fmt: skip


@pytest.mark.integration
def test_an_agent_stopped_while_slurmctld_answers_nothing_leaves_no_slurm_command(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """The real slurmctld stopped (SIGSTOP: its ``sinfo`` hangs up to ``MessageTimeout``), the
    agent asking it off the tick: SIGTERM ends the agent, and its ``sinfo`` with it. It was left
    running on the agent's thread, an orphan on the node holding a slurmctld RPC."""
    import signal

    ctld = next(p for p in slurm.procs if p.args[0] == "slurmctld")
    kids: list[int] = []
    ctld.send_signal(signal.SIGSTOP)
    p = subprocess.Popen([sys.executable, "-m", "gpuslo", *_agent_argv(slurm, tmp_path / "out.jsonl")],
                         env=slurm.env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        kids = _first_slurm_children(p.pid, lambda: p.poll() is None)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) in (0, 1), p.stderr.read() if p.stderr else ""
        for k in kids:
            with pytest.raises(ProcessLookupError):
                os.kill(k, 0)  # killed and reaped by the agent before it exited
    finally:
        ctld.send_signal(signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)


def _agent_run_stopped_in_process(slurm: SlurmCluster, tmp_path: Path) -> tuple[int, list[int], bool]:
    """``gpuslo agent --slurm`` run in this process (``cli.main``) against the stopped slurmctld,
    stopped by SIGTERM to this process once its ``sinfo`` runs: (exit code, the Slurm commands
    it had started, whether SIGTERM's and SIGINT's handlers were put back as they were)."""
    import signal
    import threading

    from gpuslo.app.cli import main

    ctld = next(p for p in slurm.procs if p.args[0] == "slurmctld")
    kids: list[int] = []
    done = threading.Event()

    def stopper() -> None:  # SIGTERM once a Slurm command runs (the run's handler is set by then)
        try:
            kids.extend(_first_slurm_children(os.getpid(), lambda: not done.is_set()))
        finally:  # found or not, the run is ended (a SIGTERM after it hits the test's own handler)
            os.kill(os.getpid(), signal.SIGTERM)

    terms: list[int] = []
    own = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))  # never the default: exit
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    t = threading.Thread(target=stopper, daemon=True)
    ctld.send_signal(signal.SIGSTOP)
    try:
        t.start()
        rc = main(_agent_argv(slurm, tmp_path / "out.jsonl"))
    finally:
        done.set()
        t.join(130)
        ctld.send_signal(signal.SIGCONT)
        after = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, own)
        signal.signal(signal.SIGINT, before[signal.SIGINT])
    assert kids, "the agent never asked Slurm"
    return rc, kids, after == before


@pytest.mark.integration
def test_a_run_in_a_process_ends_its_slurm_commands_when_it_ends(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent run inside a process (an embedding program, a test): its ``sinfo`` on the
    agent's thread ends with the run, killed and reaped, not with the process; and the signal
    handlers the run set are put back as they were."""
    import signal

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    rc, kids, handlers_back = _agent_run_stopped_in_process(slurm, tmp_path)
    try:
        assert rc in (0, 1)
        for k in kids:
            with pytest.raises(ProcessLookupError):
                os.kill(k, 0)
        # its SIGTERM handler, which set the ended run's stop, was left to the process
        assert handlers_back, "the run's SIGTERM/SIGINT handlers outlived it"
    finally:
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)


@pytest.mark.integration
def test_a_stopped_run_leaves_the_next_runs_waits_alone(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped by SIGTERM, then another in the same process (``gpuslo demo`` after an
    agent run, or a test): the second's first ``sinfo`` answer is waited for whole. The stop was
    a module-wide event, set and never cleared: every wait of the next run ended at once, its
    heartbeat not sent and its attribution empty until an answer happened to come between ticks."""
    import signal

    from gpuslo.agent.assemble import NodeOptions, node_agent

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    _, kids, _ = _agent_run_stopped_in_process(slurm, tmp_path)
    for k in kids:  # (those of a run that leaves them: not this test's concern)
        with contextlib.suppress(ProcessLookupError):
            os.kill(k, signal.SIGKILL)
    opts = NodeOptions(source="dcgm", node=slurm.node, cluster="c", interval_s=10.0, slurm=True)
    agent = node_agent(opts)
    (node,) = [s for s in agent.sources if isinstance(s, SlurmNodeSource)]
    me = node.sinfo(NOW)  # the first answer, waited for whole (the command's own 15 s at most)
    assert me is not None and me["name"] == slurm.node
    assert node.slow == 0 and node.cli.failures == 0


def test_slurm_command_failures_reach_the_agents_metrics(tmp_path: Path) -> None:
    """A squeue or sinfo that fails keeps the node's last mapping and sends no heartbeat: the
    failures were counted only inside the agent (logged once), so a GPU attributed to a job long
    gone, or a node whose heartbeats stopped, showed nothing on /metrics. Both counts are there,
    and documented."""
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from gpuslo.agent.nvml import NvmlSource
    from tests.fake_nvml import FakeGpu, FakeNvml

    opts = NodeOptions(source="nvml", node="n1", cluster="c", interval_s=10.0, slurm=True)
    agent = node_agent(opts, nvml=FakeNvml([FakeGpu(f"GPU-{i}") for i in range(2)]))
    (node,) = [s for s in agent.sources if isinstance(s, SlurmNodeSource)]
    assert isinstance(agent.gpu, NvmlSource) and isinstance(agent.gpu.attribution, SlurmAttribution)
    down = {c: (_DATA / f"{c}-json-controller-unreachable.json").read_text() for c in ("squeue", "sinfo")}
    node.cli = SlurmCli(run=lambda argv: down[argv[0]])
    agent.gpu.attribution.cli = SlurmCli(run=lambda argv: "not json")
    assert agent.extra is not None
    for k in range(3):
        for s in agent.sources:
            s.collect(NOW + 10 * k)
    got = agent.extra()
    assert got["gpuslo_agent_slurm_failures"] == 3 and got["gpuslo_agent_slurm_node_failures"] == 3
    doc = (Path(__file__).parents[1] / "docs" / "agent.md").read_text()
    for name in [n for n in got if n.startswith("gpuslo_agent_slurm_")]:
        assert f"`{name}_total`" in doc, name


@pytest.mark.parametrize(("conf", "gres", "rows", "row"), _LAYOUTS.values(), ids=_LAYOUTS.keys())
def test_a_late_refresh_counts_once_however_many_commands_it_asks(conf: str | None, gres: str,
                                                                   rows: list[Device] | None, row: str,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """``gpuslo_agent_slurm_slow_total`` counts refreshes that kept the last mapping: one whose
    ``sinfo`` (a MIG node's order, a typed gres.conf's ``Gres=``) and ``squeue`` were both late
    counted twice (and its tick waited twice ``wait_s``). Once one command of a refresh is late,
    the others are looked at, not waited for; the refresh counts once."""
    import threading

    gate = threading.Event()
    gate.set()
    answer = _Threads(gres)

    def run(argv: Sequence[str]) -> str:
        if not gate.wait(60):  # (bounded: a test that fails never hangs the suite)
            raise subprocess.TimeoutExpired(list(argv), 60)
        return answer(argv)

    attr = _bound_attribution(tmp_path, run, conf, rows, wait_s=0.01)

    def held() -> set[str]:
        return {d.uuid for d in attr._devices if attr(d.index, d.uuid)}

    attr.refresh()
    assert held() == {row} and attr.slow == 0
    gate.clear()  # slurmctld stops answering: each of its commands in flight, late
    for k in range(1, 4):
        attr.refresh()
        assert held() == {row} and attr.slow == k
    gate.set()
    deadline = time.monotonic() + 30
    while True:  # until a refresh has every answer: the late ones taken, the mapping theirs
        before = attr.slow
        attr.refresh()
        if attr.slow == before:
            break
        assert time.monotonic() < deadline, "the late answers were never taken"
    assert held() == {row} and attr.skipped == 0 and attr.unmapped == 0


def test_a_node_sinfo_does_not_list_is_said_once_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    """A ``--node`` that is not the name Slurm knows the node by (or a node taken out of
    slurm.conf) sends no heartbeat: it was logged at every tick (86,400 lines a day at a 1 s
    interval), as was every slurmctld outage, whose answer listed no node. Said once while it
    lasts, and again if it comes back."""
    node = {"name": "n1", "state": "IDLE", "state_flags": [], "partitions": ["gpu"], "reason": ""}
    listed = {"nodes": [dict(node, name="other")]}
    src = SlurmNodeSource("n1", "c", 10.0, 4, cli=SlurmCli(run=lambda argv: json.dumps(listed)), boot_id="b")
    said = []
    for k, nodes in enumerate([[], [], [], [node], [node], [], []]):
        listed["nodes"] = [dict(node, name="other"), *nodes]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpuslo.agent.slurm"):
            got = src.collect(NOW + 10 * k)
        assert len(got) == len(nodes)
        said.append(sum("is not in sinfo" in r.getMessage() for r in caplog.records))
    assert said == [1, 0, 0, 0, 0, 1, 0]


# ---------------------------------------------------------------------------- slurmctld's load
def test_answers_are_asked_once_a_period_and_a_failure_is_not_kept() -> None:
    """Slurm 22.05's --json ignores every filter (checked on slurmctld 22.05: ``-w NODE`` and
    ``--states`` change nothing): each ask is the whole cluster's list, from every node. With a
    period, one ask a period; a failed ask is asked again at once; 0 asks every time."""
    now = [1000.0]
    asked: list[int] = []

    def ask(answer: list[Any] | None) -> Any:
        return lambda: (asked.append(1), answer)[1]

    a = Answers(30.0, clock=lambda: now[0])
    key = ("squeue", "--json")
    assert a.get(key, ask([1])) == [1]
    for dt in (0.0, 10.0, 29.999):
        now[0] = 1000.0 + dt
        assert a.get(key, ask([2])) == [1]  # kept
    assert len(asked) == 1 and a.asked == 1
    now[0] = 1030.0
    assert a.get(key, ask(None)) is None  # a failure: not kept, the last answer not given either
    assert a.get(key, ask([3])) == [3] and len(asked) == 3
    assert a.get(("sinfo", "--json"), ask([4])) == [4]  # each command its own
    every = Answers(0.0, clock=lambda: now[0])
    for k in range(3):
        assert every.get(key, ask([k])) == [k]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and >= 0"):
            Answers(bad)


@pytest.mark.parametrize("back_s", [0.001, 1.0, 29.0, 31.0, 86400.0])
def test_an_answer_kept_before_the_clock_went_back_is_not_kept_on(back_s: float) -> None:
    """Answers' clock may be injected (a wall clock set back): an answer kept at 1000 read as
    younger than the period until the clock came back past 1000, however far it went back (a
    day: a day of one node list). An answer from the future is asked again, then kept as before."""
    now = [1000.0]
    asked: list[int] = []
    a = Answers(30.0, clock=lambda: now[0])
    key = ("sinfo", "--json")
    assert a.get(key, lambda: (asked.append(1), [1])[1]) == [1]
    now[0] = 1000.0 - back_s
    assert a.get(key, lambda: (asked.append(1), [2])[1]) == [2] and len(asked) == 2
    assert a.get(key, lambda: (asked.append(1), [3])[1]) == [2] and len(asked) == 2  # kept from then on


def test_two_users_asking_at_once_get_one_ask() -> None:
    import threading

    gate = threading.Event()
    asked: list[int] = []

    def ask() -> list[Any]:
        asked.append(1)
        gate.wait(30)
        return ["the answer"]

    a = Answers(60.0)
    got: list[Any] = []
    users = [threading.Thread(target=lambda: got.append(a.get(("sinfo", "--json"), ask))) for _ in range(2)]
    for u in users:
        u.start()
    threading.Event().wait(0.2)
    gate.set()
    for u in users:
        u.join(30)
    assert got == [["the answer"], ["the answer"]] and asked == [1]


def test_the_attribution_and_the_heartbeat_share_one_answer_a_period(tmp_path: Path) -> None:
    """The node agent's attribution and heartbeat ask through one :class:`Answers`: over ten ticks
    at a 10 s interval with ``--slurm-refresh-s 60``, squeue and sinfo each asked twice (a MIG
    node's attribution asks sinfo too: once for both), the mapping and the heartbeats as every
    tick's asks gave them."""
    run = _Threads("gpu:h100:3,gpu:3g.40gb:1")
    now = [0.0]
    answers = Answers(60.0, clock=lambda: now[0])
    attr = SlurmAttribution("n1", cli=SlurmCli(run=run, answers=answers))
    attr.bind(_MIG_ROWS)
    node = SlurmNodeSource("n1", "c", 10.0, 4, cli=SlurmCli(run=run, answers=answers), boot_id="b")
    for k in range(10):
        now[0] = 10.0 * k
        attr.refresh()
        assert [a.id for a in attr(3, "GPU-3")] == ["1"]  # IDX 2 (the MIG row in between): GPU-3
        (hb,) = node.collect(NOW + 10 * k)
        assert isinstance(hb, NodeHeartbeat) and hb.schedulable
    assert sorted(cmd for cmd, _t in run.ran) == ["sinfo", "sinfo", "squeue", "squeue"]
    assert answers.asked == 4


def test_slurm_refresh_s_is_checked_and_reaches_the_agent() -> None:
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from tests.fake_nvml import FakeGpu, FakeNvml

    for bad in ("-1", "nan", "inf", "3601", "x"):
        done = subprocess.run([sys.executable, "-m", "gpuslo", "agent", "--slurm", "--slurm-refresh-s", bad,
                               "--once"], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and "--slurm-refresh-s" in done.stderr, done.stderr
    o = NodeOptions(source="nvml", node="n1", cluster="c", interval_s=10.0, slurm=True, slurm_refresh_s=45.0)
    agent = node_agent(o, nvml=FakeNvml([FakeGpu("GPU-0", minor=0)]))
    attr = agent.gpu.attribution  # type: ignore[union-attr]
    (node,) = [s for s in agent.sources if isinstance(s, SlurmNodeSource)]
    assert attr.cli.answers is node.cli.answers and node.cli.answers.period_s == 45.0

"""Slurm attribution, node state and scheduler events on a real slurmctld + slurmd."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslo.agent.slurm import (
    SlurmAttribution,
    SlurmCli,
    SlurmEventCollector,
    SlurmNodeSource,
    expand_hostlist,
    parse_idx,
)
from gpuslo.wire import NodeHeartbeat, SchedulerEvent, decode, encode
from tests.servers.slurm import SlurmCluster, available


def test_parsers() -> None:
    assert parse_idx("gpu:2(IDX:0-1)") == [0, 1]
    assert parse_idx("gpu:a100:4(IDX:0,2-3,7)") == [0, 2, 3, 7]
    assert parse_idx("gpu:0") == []
    assert expand_hostlist("gpu[01-03,07],cpu9") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu9"]


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
            for g in parse_idx(f"IDX:{m.group(1)}"):
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

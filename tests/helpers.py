"""Small builders for wire messages with hand-chosen values."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuslo.wire import (
    Allocation,
    GpuSample,
    GpuSampleBatch,
    LatencyDelta,
    NodeHeartbeat,
    SchedulerEvent,
)

if TYPE_CHECKING:
    from gpuslo.agent.sim.fleet import SimConfig

T0 = float(int(__import__("time").time() // 86400) * 86400 - 86400)  # yesterday 00:00 UTC: inside retention
_seq = iter(range(10**9))


def env(source: str = "n1", ts: float = T0, cluster: str = "c1") -> dict[str, Any]:
    return {"source": source, "boot_id": "b1", "seq": next(_seq), "cluster": cluster, "ts": ts}


def gpu(
    index: int,
    activity: float | None = 0.0,
    allocs: tuple[tuple[str, float], ...] = (),
    healthy: bool = True,
    user: str = "u",
    queue: str = "q",
) -> GpuSample:
    fields = {} if activity is None else {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": activity}
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        healthy=healthy,
        fields=fields if healthy else {},
        allocations=tuple(
            Allocation(scheduler="slurm", id=j, user=user, account="acct", queue=queue, share=s)
            for j, s in allocs
        ),
    )


def batch(
    node: str,
    ts: float,
    gpus: list[GpuSample],
    interval_s: float = 10.0,
    pool: str = "p",
    cluster: str = "c1",
) -> GpuSampleBatch:
    return GpuSampleBatch(
        **env(node, ts, cluster), node=node, pool=pool, interval_s=interval_s, gpus=tuple(gpus)
    )


def heartbeat(
    node: str,
    ts: float,
    schedulable: bool,
    interval_s: float = 10.0,
    pool: str = "p",
    cluster: str = "c1",
    gpus: int = 8,
) -> NodeHeartbeat:
    return NodeHeartbeat(
        **env(node, ts, cluster),
        node=node,
        pool=pool,
        interval_s=interval_s,
        schedulable=schedulable,
        state="idle" if schedulable else "drain",
        gpus=gpus,
    )


def sched(
    event: str,
    rid: str,
    ts: float,
    gpn: float = 1.0,
    nodes: int = 1,
    queue: str = "q",
    pool: str = "",
    cluster: str = "c1",
) -> SchedulerEvent:
    return SchedulerEvent(
        **env("collector", ts, cluster),
        scheduler="slurm",
        event=event,
        request_id=rid,  # type: ignore[arg-type]
        queue=queue,
        pool=pool,
        gpus_per_node=gpn,
        nodes=nodes,
        user="u",
        account="a",
    )


BOUNDS = (1.0, 2.5, 5.0, 10.0)


def latency(
    ts: float,
    good: int,
    bad: int,
    service: str = "svc",
    bounds: tuple[float, ...] = BOUNDS,
    interval_s: float = 60.0,
) -> LatencyDelta:
    """``good`` requests in the 2.5 ms bucket, ``bad`` in the 10 ms bucket (threshold 5 ms)."""
    counts = [0] * (len(bounds) + 1)
    counts[1] = good
    counts[3 if len(bounds) > 3 else -1] = bad
    return LatencyDelta(
        **env("scraper", ts),
        service=service,
        interval_s=interval_s,
        bounds_ms=bounds,
        counts=tuple(counts),
        sum_ms=2.0 * good + 8.0 * bad,
    )


def short_sim(**kw: Any) -> SimConfig:
    """The simulator's 12-hour scenario compressed into 4 hours for the fast tier: every event of
    it still happens (a node drained for an hour, an XID, the latency degraded for an hour, long
    enough for a page and a ticket), each a shorter while. The 12-hour runs are integration tests."""
    from gpuslo.agent.sim.fleet import SimConfig

    args: dict[str, Any] = {
        "hours": 4.0,
        "drain_hours": (1.0, 2.0),
        "xid_at_hour": 3.0,
        "degrade_hours": (1.5, 2.5),
    }
    return SimConfig(**{**args, **kw})


def cli_actions() -> list[Any]:
    """Every argparse action of ``gpuslo``'s parser, its subcommands' too (tests that sweep the
    CLI's flags)."""
    import argparse

    from gpuslo.app.cli import build_parser

    def walk(p: argparse.ArgumentParser) -> list[argparse.Action]:
        out: list[argparse.Action] = []
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                for sub in act.choices.values():
                    out += walk(sub)
            else:
                out.append(act)
        return out

    return walk(build_parser())

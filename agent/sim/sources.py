"""Agent sources reading the simulated fleet: one per node, one cluster-level scheduler
collector, one latency scraper. They see the fleet only as an agent would see a node."""

from __future__ import annotations

import threading
from typing import Any

from gpuslo.agent.base import Sequencer, Source
from gpuslo.agent.runner import WallClock
from gpuslo.agent.sim.fleet import Fleet, Job, power_w
from gpuslo.agent.sim.latency import LatencyModel
from gpuslo.wire import (
    Allocation,
    GpuSample,
    GpuSampleBatch,
    HealthEvent,
    LatencyDelta,
    Message,
    NodeHeartbeat,
    SchedulerEvent,
)

GPU_MODEL = "NVIDIA H100 80GB HBM3"
FB_TOTAL_MIB = 81559.0


def fb_used_mib(holders: list[tuple[Job, float]], now: float) -> float:
    """A GPU's framebuffer used: the driver's 600 MiB, and each holder's working set (all of it
    while computing, 40 % before, e.g. while loading data, or when it sits idle)."""
    return 600.0 + sum(j.mem_mib * (1.0 if j.activity(now) > 0 else 0.4) for j, _ in holders)


class SimNodeSource(Source):
    def __init__(self, fleet: Fleet, node: int) -> None:
        self.fleet = fleet
        self.node = node
        self.name = fleet.node_names[node]
        self.seq = Sequencer(self.name, f"sim-{fleet.cfg.seed}")

    def _env(self, now: float) -> dict[str, Any]:
        return {
            "source": self.seq.source,
            "boot_id": self.seq.boot_id,
            "seq": self.seq.next(),
            "cluster": self.fleet.cfg.cluster,
            "ts": now,
        }

    def _gpu(self, g: int) -> GpuSample:
        """GPU ``g`` of this node as NVML would report it now (its energy counter advanced)."""
        f, cfg, n = self.fleet, self.fleet.cfg, self.node
        uuid = f.uuids[n][g]
        if not f.healthy[n][g]:
            return GpuSample(index=g, uuid=uuid, model=GPU_MODEL, healthy=False)
        holders = f.gpu_jobs[n][g]
        a = f.gpu_activity(n, g)
        share = sum(s for _, s in holders)
        power = power_w(a)  # now; the counter is the energy drawn up to now (the fleet integrates it)
        fb_used = min(FB_TOTAL_MIB, fb_used_mib(holders, f.now))
        fields = {
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": a,
            "DCGM_FI_DEV_GPU_UTIL": float(round(a * 100.0)),
            "DCGM_FI_PROF_SM_ACTIVE": a * 0.92,
            "DCGM_FI_PROF_SM_OCCUPANCY": a * 0.5,
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": a * 0.6,
            "DCGM_FI_PROF_DRAM_ACTIVE": a * 0.4,
            "DCGM_FI_DEV_FB_TOTAL": FB_TOTAL_MIB,
            "DCGM_FI_DEV_FB_USED": fb_used,
            "DCGM_FI_DEV_FB_FREE": FB_TOTAL_MIB - fb_used,
            "DCGM_FI_DEV_POWER_USAGE": power,
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": f.energy_j[n][g] * 1000.0,
            "DCGM_FI_DEV_GPU_TEMP": 30.0 + 45.0 * a,
            "DCGM_FI_DEV_MEMORY_TEMP": 35.0 + 40.0 * a,
            "DCGM_FI_DEV_SM_CLOCK": 1980.0 if share > 0 else 345.0,
            "DCGM_FI_DEV_MEM_CLOCK": 2619.0,
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0.0,
        }
        allocs = tuple(
            Allocation(
                scheduler="slurm",
                id=j.id,
                name=f"job-{j.id}",
                user=j.user,
                account=j.account,
                queue=cfg.pool,
                share=s,
            )
            for j, s in holders
        )
        return GpuSample(index=g, uuid=uuid, model=GPU_MODEL, fields=fields, allocations=allocs)

    def collect(self, now: float) -> list[Message]:
        f, cfg, n = self.fleet, self.fleet.cfg, self.node
        gpus = [self._gpu(g) for g in range(cfg.gpus_per_node)]
        sched = f.schedulable[n]
        busy = any(f.gpu_jobs[n][g] for g in range(cfg.gpus_per_node))
        state = ("mixed" if busy else "idle") if sched else ("draining" if busy else "drained")
        out: list[Message] = [
            GpuSampleBatch(
                **self._env(now), node=self.name, pool=cfg.pool, interval_s=cfg.interval_s, gpus=tuple(gpus)
            ),
            NodeHeartbeat(
                **self._env(now),
                node=self.name,
                pool=cfg.pool,
                interval_s=cfg.interval_s,
                schedulable=sched,
                state=state,
                reason=f.node_state_reason[n],
                gpus=cfg.gpus_per_node,
            ),
        ]
        return out


class SimHealthSource(Source):
    """XID events for the whole simulated fleet (each real node agent reports its own)."""

    name = "sim-health"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.seq = Sequencer("sim-health", f"sim-{fleet.cfg.seed}")

    def collect(self, now: float) -> list[Message]:
        f = self.fleet
        return [
            HealthEvent(
                source=self.seq.source,
                boot_id=self.seq.boot_id,
                seq=self.seq.next(),
                cluster=f.cfg.cluster,
                ts=h.ts,
                node=f.node_names[h.node],
                gpu=h.gpu,
                uuid=f.uuids[h.node][h.gpu],
                event=h.event,
                code=h.code,
                fatal=h.fatal,
                message=h.message,
            )
            for h in f.take_health_events()
        ]


class SimSchedulerSource(Source):
    """The cluster-level scheduler collector (one per cluster, not per node)."""

    name = "sim-scheduler"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.seq = Sequencer("sim-scheduler", f"sim-{fleet.cfg.seed}")

    def collect(self, now: float) -> list[Message]:
        cfg = self.fleet.cfg
        out: list[Message] = []
        for e in self.fleet.take_sched_events():
            j = e.job
            out.append(
                SchedulerEvent(
                    source=self.seq.source,
                    boot_id=self.seq.boot_id,
                    seq=self.seq.next(),
                    cluster=cfg.cluster,
                    ts=e.ts,
                    scheduler="slurm",
                    event=e.event,
                    request_id=j.id,
                    name=f"job-{j.id}",
                    user=j.user,
                    account=j.account,
                    queue=cfg.pool,
                    pool=cfg.pool,
                    gpus_per_node=j.gpn,
                    nodes=j.nodes,
                    reason=e.reason,
                    assigned_nodes=e.nodes,
                )
            )
        return out


class SimLatencySource(Source):
    """Histogram deltas of the simulated inference service; also records them as truth."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.model = LatencyModel(fleet.cfg)
        self.name = f"sim-latency-{fleet.cfg.service}"
        self.seq = Sequencer(self.name, f"sim-{fleet.cfg.seed}")

    def collect(self, now: float) -> list[Message]:
        cfg = self.fleet.cfg
        if now <= cfg.start_ts:
            return []
        counts, sum_ms = self.model.draw(now, cfg.interval_s)
        self.fleet.truth.latency_ticks.append((now, counts))
        return [
            LatencyDelta(
                source=self.seq.source,
                boot_id=self.seq.boot_id,
                seq=self.seq.next(),
                cluster=cfg.cluster,
                ts=now,
                service=cfg.service,
                interval_s=cfg.interval_s,
                bounds_ms=cfg.bounds_ms,
                counts=counts,
                sum_ms=sum_ms,
            )
        ]


class SimClock:
    """Accelerated clock: sleeping until ``t`` advances the simulated fleet to ``t``."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def now(self) -> float:
        return self.fleet.now

    def sleep_until(self, t: float, stop: threading.Event) -> None:
        self.fleet.advance_to(t)


class RealtimeSimClock(WallClock):
    """The wall clock driving the simulated fleet: a tick waits for its wall-clock time, then
    the fleet advances to it (``agent --source sim --realtime``)."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__()
        self.fleet = fleet

    def sleep_until(self, t: float, stop: threading.Event) -> None:
        super().sleep_until(t, stop)
        if not stop.is_set():
            self.fleet.advance_to(t)


def sim_sources(fleet: Fleet) -> list[Source]:
    return [
        *(SimNodeSource(fleet, n) for n in range(fleet.cfg.nodes)),
        SimSchedulerSource(fleet),
        SimHealthSource(fleet),
        SimLatencySource(fleet),
    ]

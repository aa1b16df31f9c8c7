"""The per-job report and the right-sizing advice on the demo's store, against the simulator's own
account of its jobs (agent/sim/fleet.py: each job's placement, start, end, setup phase, activity
level and framebuffer working set), for the jobs whose GPUs stayed in capacity all along."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslo.agent.sim.fleet import Fleet, Job, SimConfig
from gpuslo.agent.sim.sources import FB_TOTAL_MIB
from gpuslo.app.embedded import DemoResult, sim_config_for
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules import jobreport as jr
from gpuslo.rules import rightsize as rs
from gpuslo.rules.config import example

pytestmark = pytest.mark.integration  # slow (over 0.7 s): the demo's store, many reports


def _fleet(sim: SimConfig) -> Fleet:
    """The run again, from its seed (the fleet's jobs do not depend on the sampling)."""
    f = Fleet(sim_config_for(example(), sim))
    f.finish()
    return f


def _clean(f: Fleet, j: Job) -> bool:
    """A whole-GPU job alone on its GPUs, on no drained node and no GPU that fell off the bus."""
    c = f.cfg
    if j.start is None or j.end is None or j.state != "done" or j.gpn < 1 or j.nodes != 1:
        return False
    drained = c.drain_node % c.nodes if c.drain_node is not None else None
    d0, d1 = c.start_ts + c.drain_hours[0] * 3600, c.start_ts + c.drain_hours[1] * 3600
    for n, g, _ in j.placement:
        if n == drained and j.start < d1 and j.end > d0:
            return False
        if c.xid_at_hour is not None and (n, g) == (0, min(3, c.gpus_per_node - 1)):
            return False
    return True


def _truth(f: Fleet, j: Job) -> dict[str, Any]:
    """The job's numbers from the simulator's own state. Computing after its setup phase (unless it
    is one of the idle jobs) at its level, its working set in memory then (40 % of it before)."""
    assert j.start is not None and j.end is not None
    dur = j.end - j.start
    computes = not j.idle and j.setup_s < dur
    idle_s = dur if not computes else j.setup_s
    return {
        "held_s": dur * j.gpus, "idle_s": idle_s * j.gpus, "wait_s": j.start - j.submit,
        "peak_act": j.level if computes else 0.0,
        "peak_fb": min(FB_TOTAL_MIB, 600.0 + j.mem_mib * (1.0 if computes else 0.4)),
    }  # fmt: skip


def _rule(model: rs.GpuModel, peak_fb: float, peak_act: float, headroom: float) -> rs.Profile | None:
    """The rule of docs/operations.md, written out again: the smallest slice (by the part of the GPU
    it takes) below a whole GPU whose memory, less the headroom, holds the peak, and whose SMs hold
    the peak activity."""
    fits = [p for p in model.profiles if p.fraction < 1 and peak_fb <= (1 - headroom) * p.memory_mib
            and peak_act <= p.compute + 1e-6]  # fmt: skip
    return min(fits, key=lambda p: (p.fraction, p.memory, p.compute), default=None)


def test_job_reports_match_the_simulators_jobs(short_demo: tuple[SimConfig, DemoResult, Path]) -> None:
    sim, res, _ = short_demo
    f = _fleet(sim)
    jobs = [j for j in f.jobs.values() if _clean(f, j)]
    assert len(jobs) >= 4, "the scenario has whole-GPU jobs to check"
    store = ChdbStore(res.store_dir)
    try:
        cfg = example()
        for j in jobs:
            t = _truth(f, j)
            r = jr.report(store, cfg, jr.resolve(store, j.id))
            # the samples see a job from the first tick at or after its start to the tick at or after
            # its end: at most one 10 s interval off at each end, on each GPU
            slack = 2 * sim.interval_s * j.gpus / 3600
            assert len(r.gpus) == j.gpus, j.id
            assert r.held_gpu_hours == pytest.approx(t["held_s"] / 3600, abs=slack), j.id
            assert r.idle_gpu_hours == pytest.approx(t["idle_s"] / 3600, abs=slack), j.id
            assert r.wait_s == pytest.approx(t["wait_s"], abs=1e-3), j.id
            assert {g.node for g in r.gpus} == {f.node_names[n] for n, _, _ in j.placement}
            assert {g.uuid for g in r.gpus} == {f.uuids[n][g] for n, g, _ in j.placement}
            assert r.peak_fb_mib == pytest.approx(t["peak_fb"], abs=0.1), j.id
            assert max(g.peak_activity or 0 for g in r.gpus) == pytest.approx(t["peak_act"], abs=1e-6), j.id
            a = r.rightsize
            assert a is not None
            if j.gpus > 1:
                assert a.profile is None and (a.reason or "").startswith("multi-GPU")
                continue
            model = rs.model_for("NVIDIA H100 80GB HBM3")
            assert model is not None
            want = _rule(model, t["peak_fb"], t["peak_act"], rs.DEFAULT_HEADROOM)
            assert a.profile == (want.name if want else None), j.id
            if want is not None:
                assert a.give_back_gpu_hours == pytest.approx(
                    t["held_s"] / 3600 * (1 - want.fraction), abs=slack
                )
        # the demo's advice is the same function's, over the whole run
        assert res.rightsize is not None
        assert res.rightsize.jobs == tuple(rs.job_advice(store, sim.start_ts, sim.end_ts))
        # starved jobs: the report's incident is the simulator's
        truth = {i["request_id"]: i["cause"] for i in res.truth["starvation_incidents"]}
        for rid in list(truth)[:3]:
            r = jr.report(store, cfg, jr.resolve(store, rid))
            assert r.starvation is not None and r.starvation.cause == truth[rid], rid
    finally:
        store.close()

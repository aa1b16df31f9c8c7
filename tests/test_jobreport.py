"""The per-job report (rules/jobreport.py) and the MIG right-sizing advice (rules/rightsize.py) on
small fleets whose every expected value is worked out by hand in the comments, from the metric
definitions (docs/metrics.md) and the rule (docs/operations.md, "MIG right-sizing"), never from the SQL."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import jobreport as jr
from gpuslo.rules import rightsize as rs
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import summary
from gpuslo.rules.model import to_json
from gpuslo.wire import Allocation, GpuSample, MigInstance, SchedulerEvent
from tests import helpers as h
from tests.helpers import T0

H100 = "NVIDIA H100 80GB HBM3"
FB_H100 = 81559.0  # MiB an H100 80GB reports
N = 360  # one hour of 10 s samples


def hours(x: float) -> Any:
    """GPU-hours as the report rounds them (4 places)."""
    return pytest.approx(x, abs=5e-5)


def gpu(index: int, act: float | None, fb: float | None, holders: tuple[tuple[str, float], ...] = (),
        model: str = H100, fb_total: float | None = FB_H100, **kw: Any) -> GpuSample:  # fmt: skip
    fields: dict[str, float] = {}
    if act is not None:
        fields["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] = act
    if fb is not None:
        fields["DCGM_FI_DEV_FB_USED"] = fb
    if fb_total is not None:
        fields["DCGM_FI_DEV_FB_TOTAL"] = fb_total
    allocs = tuple(Allocation(scheduler="slurm", id=j, name=f"job-{j}", user="ann", account="acct", queue="q",
                              share=s) for j, s in holders)  # fmt: skip
    return GpuSample(index=index, uuid=kw.pop("uuid", f"GPU-{index}"), model=model, fields=fields,
                     allocations=allocs, **kw)  # fmt: skip


def ev(event: str, rid: str, ts: float, reason: str = "", gpn: float = 1.0, cluster: str = "c1",
       scheduler: str = "slurm", name: str = "") -> SchedulerEvent:  # fmt: skip
    return SchedulerEvent(**h.env("collector", ts, cluster), scheduler=scheduler, event=event,  # type: ignore[arg-type]
                          request_id=rid, name=name or f"job-{rid}", user="ann", account="acct", queue="q",
                          pool="p", gpus_per_node=gpn, nodes=1, reason=reason)  # fmt: skip


def one_job(store: ChdbStore, job: str = "j", cfg: RulesConfig | None = None, **kw: Any) -> jr.JobReport:
    c = cfg or RulesConfig()
    return jr.report(store, c, jr.resolve(store, job, **kw))


# ---------------------------------------------------------------------------- the report
@pytest.mark.integration  # slow (over 0.7 s)
def test_a_job_on_two_gpus_with_one_idle(store: ChdbStore) -> None:
    # Job j holds GPUs 0 and 1 of n1 for one hour [T0, T0+1h): GPU 0 at activity 0.5 with 3,000 MiB,
    # GPU 1 at 0 with 500 MiB. Held 2 GPU-h; active 0.5 x 1 h = 0.5 GPU-h; idle (activity < 0.05):
    # GPU 1's hour, 1.0 GPU-h; idle share 1/2. Two GPUs: no MIG advice.
    msgs: list[Any] = [ev("submit", "j", T0), ev("start", "j", T0), ev("end", "j", T0 + 3600, "COMPLETED")]
    for k in range(N):
        msgs.append(
            h.batch(
                "n1", T0 + 10 * k, [gpu(0, 0.5, 3000.0, (("j", 1.0),)), gpu(1, 0.0, 500.0, (("j", 1.0),))]
            )
        )
    write(store, msgs)
    r = one_job(store)
    assert (r.from_, r.to) == (T0, T0 + 3600)
    assert [(g.node, g.gpu, g.uuid) for g in r.gpus] == [("n1", 0, "GPU-0"), ("n1", 1, "GPU-1")]
    assert r.held_gpu_hours == pytest.approx(2.0)
    assert r.active_gpu_hours == pytest.approx(0.5)
    assert r.idle_gpu_hours == pytest.approx(1.0)
    assert r.idle_share == pytest.approx(0.5)
    assert [g.idle_share for g in r.gpus] == [pytest.approx(0.0), pytest.approx(1.0)]
    assert r.peak_fb_mib == 3000.0 and r.wait_s == 0.0 and r.starvation is None
    assert r.rightsize is not None and r.rightsize.profile is None
    assert r.rightsize.reason is not None and r.rightsize.reason.startswith("multi-GPU job (2 GPUs)")
    assert any(n.startswith("1 of its 2 GPUs showed no activity") and "GPU 1 on n1" in n for n in r.notes)
    assert any("peak 2.9 GiB of 79.6 GiB" in n for n in r.notes)  # 3,000 MiB of 81,559 MiB
    # the time series: 60 buckets of 60 s, GPU 0 at 0.5 in each
    assert r.bucket_s == 60 and len(r.gpus[0].series) == 60
    assert {p.activity for p in r.gpus[0].series} == {0.5}
    # the engine's own per-holder numbers for the same window (rules eval's top idle) agree
    s = summary(store, RulesConfig(), T0, T0 + 3600)
    assert [(x.id, x.allocated_gpu_hours, x.idle_gpu_hours) for x in s.top_idle] == [("j", 2.0, 1.0)]
    js = to_json(r)
    assert js["from"] == T0 and js["gpus"][0]["series"][0] == {
        "t": T0,
        "activity": 0.5,
        "fb_used_mib": 3000.0,
    }


@pytest.mark.integration  # slow (over 0.7 s)
@pytest.mark.parametrize(("min_idle_s", "idle_s"), [(0.0, 390.0), (60.0, 300.0), (301.0, 0.0)])
def test_a_short_pause_below_min_idle_s_is_not_idle(
    store: ChdbStore, min_idle_s: float, idle_s: float
) -> None:
    # One GPU, one hour at activity 0.5 but for three 30 s pauses (samples 60-62, 120-122, 180-182)
    # and one 300 s pause (samples 240-269). Every idle sample counts without min_idle_s: 90 + 300
    # = 390 s; with 60 s only the 300 s run counts; with 301 s none does.
    idle = {*range(60, 63), *range(120, 123), *range(180, 183), *range(240, 270)}
    msgs: list[Any] = [ev("submit", "j", T0), ev("start", "j", T0), ev("end", "j", T0 + 3600)]
    msgs += [
        h.batch("n1", T0 + 10 * k, [gpu(0, 0.0 if k in idle else 0.5, 1000.0, (("j", 1.0),))])
        for k in range(N)
    ]
    write(store, msgs)
    r = one_job(store, cfg=RulesConfig(min_idle_s=min_idle_s))
    assert r.idle_gpu_hours == hours(idle_s / 3600)
    assert r.idle_share == pytest.approx(idle_s / 3600, abs=1e-6)
    assert r.min_idle_s == min_idle_s


@pytest.mark.integration  # slow (over 0.7 s)
def test_a_starved_job_shows_the_engines_incident_and_cause(store: ChdbStore) -> None:
    # n1 has one GPU, held by job "big" over [T0, T0+1200). Job s asks for 1 GPU at T0+10, the
    # scheduler says Resources, it starts at T0+1200 when big ends and runs to T0+1800. Threshold
    # 600 s: the incident opens at T0+610; the snapshot then: 1 GPU, fully held, 0 free < 1 asked:
    # cause capacity. It waited 1,190 s, closed by its start.
    msgs: list[Any] = [ev("submit", "big", T0), ev("start", "big", T0), ev("end", "big", T0 + 1200),
                       ev("submit", "s", T0 + 10), ev("pending_reason", "s", T0 + 10, "Resources"),
                       ev("start", "s", T0 + 1200), ev("end", "s", T0 + 1800)]  # fmt: skip
    for k in range(180):
        who = "big" if k < 120 else "s"
        msgs.append(h.batch("n1", T0 + 10 * k, [gpu(0, 0.9, 60000.0, ((who, 1.0),))]))
    write(store, msgs)
    r = one_job(store, "s")
    assert r.wait_s == pytest.approx(1190.0)
    i = r.starvation
    assert i is not None and (i.cause, i.opened, i.closed, i.closed_by, i.reason) == (
        "capacity",
        T0 + 610,
        T0 + 1200,
        "start",
        "Resources",
    )
    assert i.free_gpus_at_open == 0.0
    assert (r.from_, r.to) == (T0 + 1200, T0 + 1800) and r.held_gpu_hours == hours(600 / 3600)
    assert any(n.startswith("It starved: waited 20 min; cause capacity") for n in r.notes)
    assert one_job(store, "big").starvation is None  # started at once


@pytest.mark.integration  # slow (over 0.7 s)
def test_a_job_on_a_shared_gpu(store: ChdbStore) -> None:
    # GPU 0 held by a (0.5) and b (0.5) for an hour, activity 0.25 (the GPU's), 15,000 MiB used
    # (both jobs'). a: held 0.5 GPU-h, active 0.5 x 0.25 = 0.125 GPU-h, none idle. MIG: a held half a
    # GPU; slices below f = 1/2 that hold 15,000 MiB (x 1/0.9 headroom: 16,667 MiB) and activity
    # 0.25: 1g.10gb (9,537 MiB) no; 1g.20gb (19,073 MiB, compute 1/7 < 0.25) no; 2g.20gb (19,073 MiB,
    # compute 2/7 >= 0.25, f = 2/7) yes. Give back 0.5 - 2/7 x 1 h = 3/14 GPU-h.
    msgs = [h.batch("n1", T0 + 10 * k, [gpu(0, 0.25, 15000.0, (("a", 0.5), ("b", 0.5)))]) for k in range(N)]
    write(store, msgs)
    r = one_job(store, "a")
    assert r.scheduler == "slurm" and r.request_id is None  # only GPU samples name it (their scheduler)
    assert (r.from_, r.to) == (T0, T0 + 3600)
    g = r.gpus[0]
    assert (g.share, g.shared) == (0.5, True)
    assert r.held_gpu_hours == pytest.approx(0.5) and r.active_gpu_hours == pytest.approx(0.125)
    assert r.idle_gpu_hours == 0.0
    a = r.rightsize
    assert a is not None and (a.profile, a.slice_fraction) == ("2g.20gb", pytest.approx(2 / 7, abs=1e-6))
    assert a.give_back_gpu_hours == pytest.approx(3 / 14, abs=1e-4)
    assert any(n.startswith("A GPU was shared with other jobs") for n in r.notes)
    assert any("would have fitted a MIG 2g.20gb slice" in n for n in r.notes)
    # the memory note compares with the half GPU held: 15,000 MiB of 40,780 is over a quarter: none
    assert not any(n.startswith("Memory far below") for n in r.notes)


@pytest.mark.integration  # slow (over 0.7 s)
def test_a_job_on_a_mig_instance(store: ChdbStore) -> None:
    # An H100 in MIG mode: its own row (fraction 4/7, no holder) and a 3g.40gb instance (3/7) held
    # by m for an hour, instance activity 0.2, 5,000 MiB used. Held 3/7 GPU-h; active 3/7 x 0.2.
    # MIG: activity as a fraction of the GPU 0.2 x 3/7 = 0.0857 <= 1/7, 5,000 <= 0.9 x 9,537 MiB:
    # 1g.10gb (f 1/7) < 3/7 held: give back 3/7 - 1/7 = 2/7 GPU-h.
    inst = MigInstance(gi=2, ci=0, profile="3g.40gb")
    msgs = [h.batch("n1", T0 + 10 * k, [
        gpu(0, None, None, fb_total=None, fraction=4 / 7, uuid="GPU-m"),
        gpu(0, 0.2, 5000.0, (("m", 1.0),), fb_total=40192.0, fraction=3 / 7, mig=inst, uuid="MIG-1"),
    ]) for k in range(N)]  # fmt: skip
    write(store, msgs)
    r = one_job(store, "m")
    assert [(g.uuid, g.mig_gi, g.mig_profile) for g in r.gpus] == [("MIG-1", 2, "3g.40gb")]
    assert r.held_gpu_hours == hours(3 / 7)
    assert r.active_gpu_hours == hours(3 / 7 * 0.2)
    a = r.rightsize
    assert a is not None and (a.profile, a.mig_profile) == ("1g.10gb", "3g.40gb")
    assert a.peak_activity == pytest.approx(0.2 * 3 / 7, abs=1e-6)
    assert a.give_back_gpu_hours == pytest.approx(2 / 7, abs=1e-4)


@pytest.mark.integration  # slow (over 0.7 s)
def test_unknown_ambiguous_and_hostile_ids(store: ChdbStore) -> None:
    from tests.hostile import SEQUENCES, UNICODE

    hostile = [*SEQUENCES, *UNICODE, "ns/pod-" + "x" * 240]
    msgs: list[Any] = [h.batch("n1", T0 + 10 * k, [gpu(i, 0.5, 1000.0, ((hid, 1.0),)) for i, hid in enumerate(hostile)])
                       for k in range(3)]  # fmt: skip
    # "7" on two clusters; a pod name used by two pods (two UIDs) over time
    msgs += [ev("submit", "7", T0, cluster="c1"), ev("submit", "7", T0, cluster="c2")]
    msgs += [
        ev("submit", "uid-1", T0, scheduler="k8s", name="ns/web"),
        ev("end", "uid-1", T0 + 3000, scheduler="k8s", name="ns/web"),
        ev("submit", "uid-2", T0 + 7200, scheduler="k8s", name="ns/web"),
    ]
    write(store, msgs)
    for hid in hostile:  # each found as itself, and only itself
        ref = jr.resolve(store, hid)
        assert (ref.holder_id, ref.first_sample, ref.last_sample) == (hid, T0, T0 + 30)
    for hid in (SEQUENCES[0], "q\\", UNICODE[4], hostile[-1]):  # the whole report, for a few
        r = one_job(store, hid)
        assert r.id == hid and len(r.gpus) == 1 and r.gpus[0].gpu == hostile.index(hid)
    with pytest.raises(jr.JobLookupError, match="no job 'nope'"):
        jr.resolve(store, "nope")
    # a window after its last sample (T0+20, standing for 10 s) holds none of it
    assert jr.resolve(store, hostile[0], frm=T0 + 29, to=T0 + 60).holder_id == hostile[0]
    with pytest.raises(jr.JobLookupError, match=r"between .* UTC"):
        jr.resolve(store, hostile[0], frm=T0 + 30, to=T0 + 60)
    with pytest.raises(jr.JobLookupError, match="empty"):
        jr.resolve(store, "")
    with pytest.raises(jr.JobLookupError, match="257 characters"):
        jr.resolve(store, "x" * 257)
    with pytest.raises(jr.JobLookupError, match="2 jobs answer to '7'") as e:
        jr.resolve(store, "7")
    assert sorted(m.cluster for m in e.value.matches) == ["c1", "c2"]
    assert jr.resolve(store, "7", cluster="c2").cluster == "c2"
    with pytest.raises(jr.JobLookupError, match="2 jobs answer to 'ns/web'") as e:
        jr.resolve(store, "ns/web")
    assert "uid-1" in str(e.value) and "uid-2" in str(e.value)
    assert jr.resolve(store, "uid-2").request_id == "uid-2"  # the UID names one
    assert jr.resolve(store, "ns/web", frm=T0 + 3600, to=T0 + 9000).request_id == "uid-2"  # so does a window


@pytest.mark.integration  # slow (over 0.7 s)
def test_a_pending_job_and_a_job_without_samples(store: ChdbStore) -> None:
    # p: submitted at T0, never started; the store's newest data is a sample at T0+900 (+10 s):
    # waiting 910 s so far, an incident opened at T0+600 (no node seen before it: capacity).
    write(store, [ev("submit", "p", T0), h.batch("n1", T0 + 900, [gpu(0, 0.0, 500.0)])])
    r = one_job(store, "p")
    assert r.gpus == () and r.started is None and r.wait_s == pytest.approx(910.0)
    assert r.starvation is not None and r.starvation.closed is None
    assert r.notes[0] == "No GPU samples: the job has not started (it is still pending)."
    assert r.rightsize is None


# ---------------------------------------------------------------------------- the MIG rule
_CACHE: dict[tuple[int, float], dict[str, rs.JobAdvice]] = {}


def _advice(store: ChdbStore, job: str, headroom: float = rs.DEFAULT_HEADROOM) -> rs.JobAdvice:
    """One job's advice (every job's is read once per store and headroom)."""
    key = (id(store), headroom)
    if key not in _CACHE:
        _CACHE[key] = {a.id: a for a in rs.job_advice(store, T0, T0 + 600, headroom=headroom)}
    return _CACHE[key][job]


@pytest.mark.integration  # slow (over 0.7 s)
def test_the_rule_at_its_boundaries(store: ChdbStore) -> None:
    _CACHE.clear()  # this store's advice only
    # H100 80GB: 1g.10gb has 1/8 of 80 GB = 1e10 B = 9,536.7431640625 MiB, exactly; 1g.20gb twice that.
    one_g = 80e9 / 8 / 2**20
    assert one_g == 9536.7431640625
    a30_1g = 24e9 / 4 / 2**20  # A30 1g.6gb: 1/4 of 24 GB
    cases = {  # job: (GPU model, FB total, peak activity, peak FB)
        "at-0": (H100, FB_H100, 0.1, one_g),  # headroom 0: exactly at 1g.10gb's memory fits
        "over-0": (H100, FB_H100, 0.1, one_g + 0.01),  # just over: the next, 1g.20gb
        "at-half": (H100, FB_H100, 0.1, one_g / 2),  # headroom 0.5: half of it, exactly, fits
        "over-half": (H100, FB_H100, 0.1, one_g / 2 + 0.01),
        "a30-at": ("NVIDIA A30", 24258.0, 0.25, 1000.0),  # activity exactly 1g.6gb's 1/4 of the SMs
        "a30-over": ("NVIDIA A30", 24258.0, 0.2501, 1000.0),  # over: 2g.12gb
        "a30-fb": ("NVIDIA A30", 24258.0, 0.1, a30_1g),  # memory exactly 1g.6gb's (headroom 0)
        "full": (H100, FB_H100, 0.9, 70000.0),  # needs the whole GPU: no smaller slice
        "l40s": ("NVIDIA L40S", 46068.0, 0.0, 100.0),  # no MIG
        "nomodel": ("", FB_H100, 0.0, 100.0),
        "liar": (H100, 97871.0, 0.0, 100.0),  # says 80 GB, reports 95.6 GiB (an H100 96GB)
        "nofb": (H100, None, 0.0, None),
        "noact": (H100, FB_H100, None, 100.0),
    }
    msgs = []
    for k in range(60):
        rows = [gpu(i, act, fb, ((job, 1.0),), model=model, fb_total=tot)
                for i, (job, (model, tot, act, fb)) in enumerate(cases.items())]  # fmt: skip
        msgs.append(h.batch("n1", T0 + 10 * k, rows))
    write(store, msgs)
    assert _advice(store, "at-0", 0.0).profile == "1g.10gb"
    assert rs.job_advice(store, T0, T0 + 600, job="at-0", headroom=0.0) == [_advice(store, "at-0", 0.0)]
    assert _advice(store, "over-0", 0.0).profile == "1g.20gb"
    assert _advice(store, "at-half", 0.5).profile == "1g.10gb"
    assert _advice(store, "over-half", 0.5).profile == "1g.20gb"
    assert _advice(store, "at-0").profile == "1g.20gb"  # the default 10 % headroom: 8,583 MiB < peak
    assert _advice(store, "a30-at").profile == "1g.6gb"
    assert _advice(store, "a30-over").profile == "2g.12gb"
    assert _advice(store, "a30-fb", 0.0).profile == "1g.6gb"
    # held 600 s of a whole GPU; give back 600 s x (1 - f): 1g.10gb 6/7, 1g.6gb 3/4 of 1/6 GPU-h
    assert _advice(store, "at-0", 0.0).give_back_gpu_hours == pytest.approx(1 / 6 * 6 / 7, abs=1e-4)
    assert _advice(store, "a30-at").give_back_gpu_hours == pytest.approx(1 / 6 * 3 / 4, abs=1e-4)
    reasons = {j: _advice(store, j).reason for j in ("full", "l40s", "nomodel", "liar", "nofb", "noact")}
    assert reasons == {
        "full": "no smaller MIG profile holds its peak memory and activity",
        "l40s": "no MIG profiles listed for GPU model NVIDIA L40S",
        "nomodel": "the samples name no GPU model",
        "liar": "GPU model NVIDIA H100 80GB HBM3 reports 95.6 GiB, not the H100 80GB the name suggests",
        "nofb": "no framebuffer samples (DCGM_FI_DEV_FB_USED)",
        "noact": "no activity samples",
    }
    assert all(_advice(store, j).give_back_gpu_hours == 0.0 for j in reasons)
    # per account: the advised jobs and their GPU-hours, summed
    rz = rs.rightsizing(store, T0, T0 + 600)
    assert rz.jobs_advised == 7 and len(rz.jobs) == len(cases)
    # at the default headroom: at-0 and over-0 1g.20gb, at-half and over-half 1g.10gb, a30-at 1g.6gb,
    # a30-over and a30-fb (5,722 MiB > 0.9 x 5,722) 2g.12gb
    assert {(a.profile, a.jobs) for a in rz.accounts} == {("1g.20gb", 2), ("1g.10gb", 2), ("1g.6gb", 1),
                                                          ("2g.12gb", 2)}  # fmt: skip
    assert rz.give_back_gpu_hours == pytest.approx(sum(a.give_back_gpu_hours for a in rz.accounts))


@pytest.mark.integration  # slow (over 0.7 s)
@pytest.mark.parametrize("dim", ["account", "user", "queue"])
def test_an_id_used_by_two_owners_is_two_jobs_to_right_size(store: ChdbStore, dim: str) -> None:
    """Job id 7 of one owner for 30 min on GPU0 (peak 5,000 MiB: 1g.10gb holds it), then job id
    7 of another owner (differing in ``dim``) for 30 min (peak 70,000 MiB: no slice). They were
    one job (grouped by id, any owner): the advice went by the second's peak, to either owner.
    Each is now judged on its own rows: the first gives back 6/7 of its half GPU-hour."""
    owner = {"account": "A", "user": "x", "queue": "q"}

    def sample(k: int) -> Any:
        o = {**owner, dim: owner[dim] + ("2" if k >= 30 else "")}
        a = Allocation(scheduler="slurm", id="7", share=1.0, **o)
        fields = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.1, "DCGM_FI_DEV_FB_USED": 5000.0 if k < 30 else 70000.0,
                  "DCGM_FI_DEV_FB_TOTAL": FB_H100}  # fmt: skip
        return h.batch("n1", T0 + 60 * k, [GpuSample(index=0, uuid="GPU-0", model=H100, fields=fields,
                                                     allocations=(a,))], interval_s=60.0)  # fmt: skip

    write(store, [sample(k) for k in range(60)])
    jobs = {getattr(j, dim): j for j in rs.job_advice(store, T0, T0 + 3600)}
    first, second = jobs[owner[dim]], jobs[owner[dim] + "2"]
    assert (first.id, first.profile, first.peak_fb_mib, first.held_gpu_hours) == ("7", "1g.10gb", 5000.0, 0.5)
    assert first.give_back_gpu_hours == pytest.approx(0.5 * 6 / 7, abs=1e-4)
    assert (second.id, second.profile, second.peak_fb_mib, second.held_gpu_hours) == ("7", None, 70000.0, 0.5)
    assert [(a.jobs, a.profile) for a in rs.rightsizing(store, T0, T0 + 3600).accounts] == [(1, "1g.10gb")]


def test_the_profile_table_is_nvidias() -> None:
    # the documented profiles (NVIDIA MIG User Guide, "Supported MIG Profiles"), by name
    names = {m.name: [p.name for p in m.profiles] for m in rs.models()}
    assert names["H100 80GB"] == ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    assert names["A100 40GB"] == ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    assert names["H200 141GB"] == ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert names["A30 24GB"] == ["1g.6gb", "2g.12gb", "4g.24gb"]
    for m in rs.models():
        for p in m.profiles:  # the name says its compute slices and (rounded) memory
            g, mem = p.name.split("g.")
            slices = 4 if m.name.startswith("A30") else 7
            assert p.compute == pytest.approx(int(g) / slices)
            assert abs(p.memory * m.memory_gb - float(mem.removesuffix("gb"))) <= 0.6, (m.name, p.name)
    # NVML / DCGM model names (as the drivers report them) to tables
    for name, table in [("NVIDIA H100 80GB HBM3", "H100 80GB"), ("NVIDIA H100 PCIe", "H100 80GB"),
                        ("NVIDIA H100 NVL", "H100 94GB"), ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
                        ("NVIDIA A100-SXM4-80GB", "A100 80GB"), ("NVIDIA A100 80GB PCIe", "A100 80GB"),
                        ("NVIDIA H200", "H200 141GB"), ("NVIDIA H200 NVL", "H200 141GB"), ("NVIDIA A30", "A30 24GB"),
                        ("NVIDIA B200", "B200 180GB")]:  # fmt: skip
        m = rs.model_for(name)
        assert m is not None and m.name == table, name
    for name in ("NVIDIA L40S", "Tesla V100-SXM2-32GB", "NVIDIA GH200 480GB", "NVIDIA A10", ""):
        assert rs.model_for(name) is None, name


@pytest.mark.integration  # slow (over 0.7 s)
def test_a_pod_by_its_name_or_its_uid(store: ChdbStore) -> None:
    # The pod collector names a pod by its UID with name namespace/pod; the node agent's PodResources
    # attribution by namespace/pod. Pod team/pod-0 (UID u-9): submitted T0, started T0+60, GPU samples
    # from T0+60 for 10 minutes at activity 0.4: waited 60 s, held 1/6 GPU-h.
    pod = Allocation(scheduler="k8s", id="team/pod-0", name="team/pod-0", account="team", queue="team")
    msgs: list[Any] = [ev("submit", "u-9", T0, scheduler="k8s", name="team/pod-0"),
                       ev("start", "u-9", T0 + 60, scheduler="k8s", name="team/pod-0")]  # fmt: skip
    for k in range(60):
        g = GpuSample(index=0, uuid="GPU-0", model=H100, allocations=(pod,),
                      fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.4, "DCGM_FI_DEV_FB_USED": 9000.0})  # fmt: skip
        msgs.append(h.batch("n1", T0 + 60 + 10 * k, [g]))
    write(store, msgs)
    by_name, by_uid = jr.resolve(store, "team/pod-0"), jr.resolve(store, "u-9")
    assert by_name == by_uid
    assert (by_name.scheduler, by_name.request_id, by_name.holder_id) == ("k8s", "u-9", "team/pod-0")
    r = jr.report(store, RulesConfig(), by_name)
    assert (
        r.wait_s == 60.0
        and r.held_gpu_hours == hours(600 / 3600)
        and r.active_gpu_hours == hours(0.4 * 600 / 3600)
    )
    assert r.to == T0 + 660  # still running: to its last sample's end


@pytest.mark.integration  # slow (over 0.7 s)
def test_the_jobs_energy_is_its_share_of_each_gpus_measured_and_estimated(store: ChdbStore) -> None:
    # Job je for one hour on node n9. GPU 0: shared half and half with job other, activity 0.5,
    # POWER_USAGE 300 W and no energy counter: every interval estimated from power, je's half =
    # 300 W x 3600 s x 0.5 = 540,000 J = 0.15 kWh (none idle). GPU 1: je alone, activity 0, an
    # energy counter rising 1,000,000 mJ per 10 s (100 W) and POWER_USAGE 100 W: 359 intervals
    # measured by the counter and the last one (no next sample) estimated, 100 W x 3600 s =
    # 0.1 kWh, all of it idle; estimated 100 W x 10 s = 1,000 J. Total 0.25 kWh; idle 0.1 kWh;
    # estimated 541,000 J = 0.150278 kWh. No grid intensity in the default config: no carbon.
    msgs: list[Any] = [ev("submit", "je", T0), ev("start", "je", T0), ev("end", "je", T0 + 3600, "COMPLETED")]
    shared = tuple(Allocation(scheduler="slurm", id=j, name=f"job-{j}", user="ann", account="acct", queue="q",
                              share=0.5) for j in ("je", "other"))  # fmt: skip
    mine = (
        Allocation(
            scheduler="slurm", id="je", name="job-je", user="ann", account="acct", queue="q", share=1.0
        ),
    )
    for k in range(N):
        g0 = GpuSample(index=0, uuid="GPU-e0", model=H100, allocations=shared,
                       fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.5, "DCGM_FI_DEV_POWER_USAGE": 300.0})  # fmt: skip
        g1 = GpuSample(index=1, uuid="GPU-e1", model=H100, allocations=mine,
                       fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0, "DCGM_FI_DEV_POWER_USAGE": 100.0,
                               "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 5e9 + 1e6 * k})  # fmt: skip
        msgs.append(h.batch("n9", T0 + 10 * k, [g0, g1]))
    write(store, msgs)
    r = one_job(store, "je")
    assert r.energy is not None
    assert r.energy.kwh == pytest.approx(0.25, abs=1e-6)
    assert r.energy.idle_kwh == pytest.approx(0.1, abs=1e-6)
    assert r.energy.estimated_kwh == pytest.approx(541_000 / 3.6e6, abs=1e-6)
    assert r.energy.co2_g == 0.0
    assert to_json(r)["energy"]["kwh"] == pytest.approx(0.25, abs=1e-6)


def test_a_requeued_slurm_job_is_one_job_over_its_runs(store: ChdbStore) -> None:
    """A requeued Slurm job's runs are requests ``ID`` and ``ID#2`` (agent/slurm.py); asked by its
    id, the report is one job: submitted at the first submit, started at the first start, ended
    at its last run's end (not the requeue's ``preempt``), over the GPU samples of both runs.
    Hand-worked: run 1 [T0+10, T0+300) on GPU 0, requeued at T0+300, run 2 [T0+900, T0+1200)."""
    msgs: list[Any] = [
        ev("submit", "77", T0), ev("start", "77", T0 + 10), ev("preempt", "77", T0 + 300, "REQUEUED"),
        ev("submit", "77#2", T0 + 300), ev("pending_reason", "77#2", T0 + 300, "BeginTime"),
        ev("start", "77#2", T0 + 900), ev("end", "77#2", T0 + 1200, "COMPLETED"),
        ev("submit", "770", T0), ev("submit", "77x#2", T0),  # ids that start alike are other jobs
    ]  # fmt: skip
    for t in [*range(10, 300, 10), *range(900, 1200, 10)]:
        msgs.append(h.batch("n1", T0 + t, [gpu(0, 0.5, 1000.0, (("77", 1.0),))]))
    write(store, msgs)
    ref = jr.resolve(store, "77")
    assert (ref.request_id, ref.submitted, ref.started, ref.ended, ref.end_reason) == (
        "77",
        T0,
        T0 + 10,
        T0 + 1200,
        "COMPLETED",
    )
    r = jr.report(store, RulesConfig(), ref)
    assert r.held_gpu_hours == hours((290 + 300) / 3600)
    # its second run's request names the whole job too
    assert jr.resolve(store, "77#2") == ref


def test_an_evicted_kueue_workload_is_one_job_over_its_admissions(store: ChdbStore) -> None:
    """A Kueue Workload evicted and admitted again is requests ``UID`` and ``UID#2``
    (agent/kueue.py), as a requeued Slurm job is ``ID`` and ``ID#2``: one job here, asked by its
    UID, by either request, or by its namespace/name; its evictions' ``preempt`` is not its end.
    They were two jobs, and asked by its UID the report showed the first admission alone."""
    k = {"scheduler": "kueue", "name": "team-a/train-1"}
    write(store, [
        ev("submit", "wl-uid", T0, **k), ev("start", "wl-uid", T0 + 60, **k),
        ev("preempt", "wl-uid", T0 + 600, "Preempted", **k),
        ev("submit", "wl-uid#2", T0 + 600, **k), ev("start", "wl-uid#2", T0 + 900, **k),
        ev("preempt", "wl-uid#2", T0 + 1000, "PodsReadyTimeout", **k),
        ev("submit", "wl-uid#3", T0 + 1000, **k), ev("start", "wl-uid#3", T0 + 1100, **k),
        ev("end", "wl-uid#3", T0 + 2000, "Finished", **k),
        ev("submit", "wl-uid2", T0, scheduler="kueue", name="team-a/other"),  # an id that starts alike
    ])  # fmt: skip
    want = ("kueue", "wl-uid", T0, T0 + 60, T0 + 2000, "end", "Finished")
    for asked in ("wl-uid", "wl-uid#2", "wl-uid#3", "team-a/train-1"):
        ref = jr.resolve(store, asked)
        got = (
            ref.scheduler,
            ref.request_id,
            ref.submitted,
            ref.started,
            ref.ended,
            ref.end_event,
            ref.end_reason,
        )
        assert got == want, asked
    # waiting again after its second eviction: not ended
    write(store, [ev("submit", "wl-b", T0, **{**k, "name": "team-a/b"}),
                  ev("preempt", "wl-b", T0 + 100, "Preempted", **{**k, "name": "team-a/b"}),
                  ev("submit", "wl-b#2", T0 + 100, **{**k, "name": "team-a/b"})])  # fmt: skip
    ref = jr.resolve(store, "team-a/b")
    assert (ref.request_id, ref.submitted, ref.ended) == ("wl-b", T0, None)


@pytest.mark.parametrize("runs", [2, 10, 11])
@pytest.mark.parametrize("last", ["pending", "running", "COMPLETED"])
def test_a_requeued_job_has_ended_only_when_its_last_run_has(store: ChdbStore, runs: int, last: str) -> None:
    """A run requeued before it was seen running ends with ``end`` REQUEUED (agent/slurm.py), not
    ``preempt``: the report took the job's latest end of any run, so a job waiting or running
    again read as ended at its requeue. Ended is its last run's end (by run number: #10 after #9),
    or none while that run waits or runs."""
    msgs: list[Any] = [ev("submit", "88", T0)]
    for k in range(1, runs):  # run k requeued at T0 + 100k, unseen running
        rid = "88" if k == 1 else f"88#{k}"
        msgs += [ev("end", rid, T0 + 100 * k, "REQUEUED"), ev("submit", f"88#{k + 1}", T0 + 100 * k)]
    final, t = f"88#{runs}", T0 + 100 * runs
    if last != "pending":
        msgs.append(ev("start", final, t + 10))
    if last == "COMPLETED":
        msgs.append(ev("end", final, t + 50, "COMPLETED"))
    write(store, msgs)
    ref = jr.resolve(store, "88")
    assert ref.request_id == "88" and ref.submitted == T0
    assert ref.started == (None if last == "pending" else t + 10)
    want = (t + 50, "end", "COMPLETED") if last == "COMPLETED" else (None, None, None)
    assert (ref.ended, ref.end_event, ref.end_reason) == want


@pytest.mark.parametrize("scheduler", ["slurm", "kueue"])
def test_a_later_runs_request_names_the_one_job_that_had_it(store: ChdbStore, scheduler: str) -> None:
    """Asked by ``ID#2`` (a later run's request), the job is the one that had that request: the
    same id in another cluster, never requeued there, is another job (it made the lookup
    ambiguous). An id with a ``#`` that no request had (``ID#``, ``ID#0``, ``ID#x``, ``ID#02``,
    ``ID#2#2``) names no job: it answered with the job ``ID`` whatever followed the ``#``."""
    k = {"scheduler": scheduler}
    write(store, [
        ev("submit", "91", T0, **k), ev("preempt", "91", T0 + 100, "Preempted", **k),
        ev("submit", "91#2", T0 + 100, **k), ev("start", "91#2", T0 + 200, **k),
        ev("end", "91#2", T0 + 300, "COMPLETED", **k),
        ev("submit", "91", T0 + 50, cluster="c2", **k), ev("start", "91", T0 + 60, cluster="c2", **k),
    ])  # fmt: skip
    ref = jr.resolve(store, "91#2")
    assert (ref.cluster, ref.request_id, ref.submitted, ref.ended) == ("c1", "91", T0, T0 + 300)
    with pytest.raises(jr.JobLookupError, match="2 jobs answer to '91'"):  # the id itself: both
        jr.resolve(store, "91")
    assert [jr.resolve(store, "91", cluster=c).submitted for c in ("c1", "c2")] == [T0, T0 + 50]
    for odd in ("91#", "91#0", "91#x", "91#02", "91#2#2", "91#3"):
        with pytest.raises(jr.JobLookupError, match=f"no job '{odd}'"):
            jr.resolve(store, odd)


# run layouts of one job j: (node, GPU index, MIG gi or None, first sample's offset in seconds, samples)
# per run, 10 s
# samples, activity 0.05 and 1,000 MiB on an H100 (1g.10gb holds it: f = 1/7 of a GPU held whole,
# 1/7 of the SMs x the instance's fraction on MIG). "at once": the most of them held at one time.
_RUNS: dict[str, tuple[tuple[str, int, int | None, int, int], ...]] = {
    "one GPU": (("n1", 0, None, 0, 60),),
    "requeued to another GPU": (("n1", 0, None, 0, 30), ("n1", 3, None, 1200, 30)),
    "requeued to another node": (("n1", 0, None, 0, 30), ("n2", 0, None, 1200, 30)),
    "back to back, no gap": (("n1", 0, None, 0, 30), ("n1", 1, None, 300, 30)),
    "three runs, three GPUs": (("n1", 0, None, 0, 20), ("n1", 1, None, 400, 20), ("n2", 5, None, 800, 20)),
    "requeued to another MIG instance": (("n1", 0, 1, 0, 30), ("n1", 0, 2, 300, 30)),
    "two GPUs at once": (("n1", 0, None, 0, 60), ("n1", 1, None, 0, 60)),
    "second GPU for the last sample": (("n1", 0, None, 0, 60), ("n1", 1, None, 590, 1)),
    "two nodes at once, out of phase": (("n1", 0, None, 0, 60), ("n2", 0, None, 5, 60)),
    # the rule reads each GPU's first to last sample: back on a GPU it had left, it held both
    "back to the GPU it left": (("n1", 0, None, 0, 30), ("n1", 1, None, 1200, 30), ("n1", 0, None, 2400, 30)),
}


@pytest.mark.parametrize("layout", list(_RUNS))
def test_a_job_is_multi_gpu_only_when_it_held_several_gpus_at_once(store: ChdbStore, layout: str) -> None:
    """A requeued job that ran on another GPU (or node, or MIG instance) each run holds one GPU at
    a time, and is judged for a slice over its runs: it was refused as a 'multi-GPU job (2 GPUs)',
    counting every GPU it ever held. The expected values are worked out from the layout here."""
    runs = _RUNS[layout]
    mig_frac = 3 / 7  # a 3g.40gb instance
    msgs: list[Any] = []
    for node, index, gi, first, n in runs:
        for k in range(n):
            t = T0 + first + 10 * k
            if gi is None:
                row = gpu(index, 0.05, 1000.0, (("j", 1.0),), uuid=f"GPU-{node}-{index}")
            else:
                row = gpu(index, 0.05, 1000.0, (("j", 1.0),), fb_total=40192.0, fraction=mig_frac,
                          mig=MigInstance(gi=gi, ci=0, profile="3g.40gb"), uuid=f"MIG-{gi}")  # fmt: skip
            msgs.append(h.batch(node, t, [row]))
    write(store, msgs)
    # the most GPUs whose spans (first sample to the end of the last, over its runs) overlap at once
    ends: dict[tuple[str, int, int | None], list[float]] = {}
    for node, index, gi, first, n in runs:
        ends.setdefault((node, index, gi), []).extend([T0 + first, T0 + first + 10 * n])
    spans = [(min(e), max(e)) for e in ends.values()]
    at_once = max(sum(a <= s < b for a, b in spans) for s, _ in spans)
    held_s = sum((mig_frac if gi is not None else 1.0) * 10 * n for _, _, gi, _, n in runs)
    time_s = sum(10 * n for *_, n in runs)
    (a,) = rs.job_advice(store, T0, T0 + 7200)
    assert a.gpus == at_once
    assert a.held_gpu_hours == hours(held_s / 3600)
    if at_once > 1:
        assert (
            a.profile is None
            and a.reason == f"multi-GPU job ({at_once} GPUs): one process uses one MIG instance"
        )
        assert a.give_back_gpu_hours == 0.0
    else:
        assert (a.profile, a.reason) == ("1g.10gb", None)
        assert a.give_back_gpu_hours == hours((held_s - time_s / 7) / 3600)
    # the dashboard's per-account query agrees
    (row,) = store.query(
        rs.ACCOUNT_SUMMARY, {"from": T0, "to": T0 + 7200, "cluster": "", "job": "", "headroom": 0.1}
    )
    assert (row["jobs"], row["would_fit"]) == (1, int(at_once == 1))


@pytest.mark.parametrize(
    ("frm", "to", "want"),
    [
        (599, 1200, ["c1", "c2"]),  # c2's job's last second is in it
        (600, 1200, ["c1"]),  # c2's job ended at 600: [0, 600) does not meet [600, 1200)
        (600, 601, ["c1"]),
        (0, 600, ["c2"]),  # c1's job starts at 600: not in [0, 600)
        (0, 601, ["c1", "c2"]),
        (1200, 1300, ["c3"]),  # c3's job: no length, at 1200, the window's first instant
        (1100, 1200, ["c1"]),  # ... and not in a window ending at it
        (1190, 1199, ["c1"]),
        (1300, 1400, []),
        (1200, 1200.5, ["c3"]),
    ],
)
def test_a_job_is_in_a_window_when_its_half_open_life_meets_it(
    store: ChdbStore, frm: float, to: float, want: list[str]
) -> None:
    """Job 5 in three clusters: c2's ran [T0, T0+600) with 10 s samples, c1's [T0+600, T0+1200),
    c3's started and ended at T0+1200 (no samples). Asked in [frm, to), the jobs whose life
    [start, end) meets it answer (an instant for c3's). A job ended at ``frm`` answered too."""
    msgs: list[Any] = []
    for c, a, b in (("c2", 0, 600), ("c1", 600, 1200), ("c3", 1200, 1200)):
        msgs += [ev("submit", "5", T0 + a, cluster=c), ev("start", "5", T0 + a, cluster=c)]
        msgs += [ev("end", "5", T0 + b, "COMPLETED", cluster=c)]
        msgs += [
            h.batch("n1", T0 + t, [gpu(0, 0.5, 1000.0, (("5", 1.0),))], cluster=c) for t in range(a, b, 10)
        ]
    write(store, msgs)
    if not want:
        with pytest.raises(jr.JobLookupError, match="no job '5'"):
            jr.resolve(store, "5", frm=T0 + frm, to=T0 + to)
    elif len(want) == 1:
        assert jr.resolve(store, "5", frm=T0 + frm, to=T0 + to).cluster == want[0]
    else:
        with pytest.raises(jr.JobLookupError, match="2 jobs answer to '5'") as e:
            jr.resolve(store, "5", frm=T0 + frm, to=T0 + to)
        assert sorted(m.cluster for m in e.value.matches) == want


@pytest.mark.parametrize(
    "case",
    ["samples only", "submit, no start seen", "submit and start", "pending", "pending, id used before"],
)
def test_a_job_seen_only_on_its_gpus_has_run_there(store: ChdbStore, case: str) -> None:
    """Job 6's GPU samples: 10 s from T0 to T0+600 (none when pending); its events as the case
    says; another node's sample at T0+1 day is the cluster's newest data. A job its samples show
    running has started, its start seen or not: its window ends at its last sample and its wait at
    its first. It went to the cluster's newest data (a day, 1,441 s buckets, one point) and a
    job running since T0 had waited a day. Only a job neither started nor on a GPU is pending."""
    events = {
        "samples only": [],
        "submit, no start seen": [ev("submit", "6", T0 - 120)],
        "submit and start": [ev("submit", "6", T0 - 120), ev("start", "6", T0 - 30)],
        "pending": [ev("submit", "6", T0 - 120)],
        "pending, id used before": [ev("submit", "6", T0 + 900)],  # its samples are an earlier job's
    }[case]
    samples = [] if case == "pending" else [h.batch("n1", T0 + t, [gpu(0, 0.5, 1000.0, (("6", 1.0),))])
                                            for t in range(0, 600, 10)]  # fmt: skip
    write(store, [*events, *samples, h.batch("n9", T0 + 86400, [gpu(0, 0.0, 0.0)])])
    r = one_job(store, "6")
    newest = T0 + 86410
    lo, hi, wait = {
        "samples only": (T0, T0 + 600, None),
        "submit, no start seen": (T0 - 120, T0 + 600, 120.0),
        "submit and start": (T0 - 30, T0 + 600, 90.0),
        "pending": (T0 - 120, newest, newest - (T0 - 120)),
        "pending, id used before": (T0 + 900, newest, newest - (T0 + 900)),
    }[case]
    assert (r.from_, r.to, r.wait_s) == (lo, hi, wait)
    assert r.bucket_s == max(10, -(-(hi - lo) // 60))
    running = case in ("samples only", "submit, no start seen", "submit and start")
    assert r.held_gpu_hours == hours(600 / 3600 if running else 0.0)
    if running:  # one point per bucket holding a sample: 60 of them for the 10-minute job's own window
        want = sorted({int((T0 + s - lo) // r.bucket_s) for s in range(0, 600, 10)})
        assert [round((p.t - lo) / r.bucket_s) for p in r.gpus[0].series] == want


@pytest.mark.parametrize("second", [0, 1200])
def test_an_idle_gpu_of_a_job_that_held_one_at_a_time_asks_for_no_fewer(
    store: ChdbStore, second: int
) -> None:
    """Job j on GPU 0 (activity 0.5) for 300 s from T0, and on GPU 3 (activity 0) for 300 s from
    T0 + ``second``: at once (0), two GPUs, one unused: ask for fewer; one after the other (1200, a
    requeue), one GPU at a time: asking for fewer GPUs was the note's advice all the same."""
    msgs: list[Any] = [h.batch("n1", T0 + t, [gpu(0, 0.5, 1000.0, (("j", 1.0),))]) for t in range(0, 300, 10)]
    msgs += [h.batch("n1", T0 + second + t, [gpu(3, 0.0, 1000.0, (("j", 1.0),))]) for t in range(0, 300, 10)]
    write(store, msgs)
    r = one_job(store)
    (note,) = [n for n in r.notes if n.startswith("1 of its 2 GPUs showed no activity")]
    assert "GPU 3 on n1" in note
    if second == 0:
        assert note.endswith("Request fewer GPUs, or check that the code uses all of them.")
    else:
        assert note.endswith("It held one at a time (a run on each): check why those runs left theirs idle.")


@pytest.mark.parametrize("width", [0.001, 0.5, 1.0, 2.5])
def test_a_window_given_is_the_reports_however_short(store: ChdbStore, width: float) -> None:
    """Job j on a whole GPU, 10 s samples from T0 for an hour; asked over [T0+600, T0+600+width):
    held ``width`` GPU-seconds. A window under a second was widened to one (the 1 s a job of no
    length gets), and held what that second did."""
    write(store, [h.batch("n1", T0 + t, [gpu(0, 0.5, 1000.0, (("j", 1.0),))]) for t in range(0, 3600, 10)])
    frm, to = T0 + 600, T0 + 600 + width
    r = jr.report(store, RulesConfig(), jr.resolve(store, "j", frm=frm, to=to), frm, to)
    assert (r.from_, r.to) == (frm, to)
    assert r.held_gpu_hours == round(width / 3600, 4) and r.active_gpu_hours == round(width * 0.5 / 3600, 4)
    assert r.gpus[0].held_gpu_hours == round(width / 3600, 4)


def test_a_window_with_one_end_is_said_as_one(store: ChdbStore) -> None:
    """Job 8 ran [T0, T0+600); asked after it or before it with one end of the window given, the
    refusal says that end (it said "between 2026-11-30 00:10 and - UTC")."""
    write(store, [ev("submit", "8", T0), ev("start", "8", T0), ev("end", "8", T0 + 600, "COMPLETED")])
    at = jr._at(T0 + 600)
    with pytest.raises(jr.JobLookupError, match=f"no job '8' from {at} UTC on: ") as e:
        jr.resolve(store, "8", frm=T0 + 600)
    assert " - " not in str(e.value).split(":")[0]
    with pytest.raises(jr.JobLookupError, match=f"no job '8' before {jr._at(T0)} UTC: "):
        jr.resolve(store, "8", to=T0)
    with pytest.raises(jr.JobLookupError, match=f"no job '8' between {at} and {jr._at(T0 + 700)} UTC: "):
        jr.resolve(store, "8", frm=T0 + 600, to=T0 + 700)
    assert jr.resolve(store, "8", frm=T0 + 599).request_id == "8"


@pytest.mark.parametrize("starved", ["none", "first run", "after the requeue", "both"])
def test_a_requeued_job_that_starved_in_any_run_shows_the_engines_incident(
    store: ChdbStore, starved: str
) -> None:
    """Job 79: run 1 submitted at T0, run 2 (79#2) submitted at its requeue; each waits 60 s, or
    3,600 s where the case says it starved (the default threshold is 600 s; no GPU is free: the
    one GPU is another job's meanwhile, cause capacity). The report showed only the first run's
    incident: a job that starved after its requeue read as one that never did."""
    w1 = 3600 if starved in ("first run", "both") else 60
    w2 = 3600 if starved in ("after the requeue", "both") else 60
    s1, r1 = T0, T0 + w1  # run 1: submitted, started; requeued 300 s later
    s2 = r1 + 300
    r2 = s2 + w2
    msgs: list[Any] = [
        ev("submit", "79", s1), ev("pending_reason", "79", s1, "Resources"), ev("start", "79", r1),
        ev("preempt", "79", s2, "REQUEUED"), ev("submit", "79#2", s2), ev("pending_reason", "79#2", s2, "Resources"),
        ev("start", "79#2", r2), ev("end", "79#2", r2 + 300, "COMPLETED"),
    ]  # fmt: skip
    for t in range(int(s1), int(r2 + 300), 10):  # one GPU: job 79's while it runs, another's otherwise
        holder = "79" if r1 <= t < s2 or r2 <= t else "other"
        msgs.append(h.batch("n1", t, [gpu(0, 0.5, 1000.0, ((holder, 1.0),))]))
    write(store, msgs)
    # the engine's own incidents over the whole time, for the job's requests
    eng = [
        i
        for i in summary(store, RulesConfig(), T0, r2 + 300).starvation_incidents
        if i.request_id.startswith("79")
    ]
    want = {"none": [], "first run": ["79"], "after the requeue": ["79#2"], "both": ["79", "79#2"]}[starved]
    assert sorted(i.request_id for i in eng) == want
    r = one_job(store, "79")
    assert r.wait_s == w1  # the first run's wait, as before
    if not want:
        assert r.starvation is None and not any(n.startswith("It starved") for n in r.notes)
        return
    # the run that waited longest (the first on a tie), with its own wait
    (longest,) = [i for i in eng if i.request_id == ("79#2" if starved == "after the requeue" else "79")]
    assert r.starvation is not None
    assert (r.starvation.request_id, r.starvation.opened, r.starvation.cause) == (
        longest.request_id, longest.opened, "capacity")  # fmt: skip
    assert r.starvation.wait_s == 3600.0
    (note,) = [n for n in r.notes if n.startswith("It starved")]
    after = " after its requeue (request 79#2)" if longest.request_id == "79#2" else ""
    assert note.startswith(f"It starved{after}: waited 60 min; cause capacity")


@pytest.mark.parametrize("dim", ["user", "account", "queue"])
def test_an_id_its_samples_name_with_two_owners_is_two_jobs_to_report(store: ChdbStore, dim: str) -> None:
    """Slurm id 7, no scheduler events: one owner's job on GPU 0 for [T0, T0+1800) at activity 0.5,
    then another owner's (differing in ``dim``: the controller's state reset) for [T0+1800,
    T0+3600) at 0. rules.rightsize judges them as two jobs; the report merged them into one, under
    either owner, with the other's advice. Asked by id, the two are listed; a window picks one."""
    owner = {"user": "ann", "account": "acct", "queue": "q"}

    def sample(t: float, second: bool) -> Any:
        o = {**owner, dim: owner[dim] + ("2" if second else "")}
        a = Allocation(scheduler="slurm", id="7", name="j7", share=1.0, **o)
        fields = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0 if second else 0.5, "DCGM_FI_DEV_FB_USED": 1000.0,
                  "DCGM_FI_DEV_FB_TOTAL": FB_H100}  # fmt: skip
        return h.batch(
            "n1", t, [GpuSample(index=0, uuid="GPU-0", model=H100, fields=fields, allocations=(a,))]
        )

    write(store, [sample(T0 + t, t >= 1800) for t in range(0, 3600, 10)])
    with pytest.raises(jr.JobLookupError, match="2 jobs answer to '7'") as e:
        jr.resolve(store, "7")
    assert [(getattr(m, dim), m.first_sample, m.last_sample) for m in e.value.matches] == [
        (owner[dim], T0, T0 + 1800), (owner[dim] + "2", T0 + 1800, T0 + 3600)]  # fmt: skip
    for frm, to, who, idle in ((T0, T0 + 1800, owner[dim], 0.0), (T0 + 1800, None, owner[dim] + "2", 0.5)):
        ref = jr.resolve(store, "7", frm=frm, to=to)
        r = jr.report(store, RulesConfig(), ref, frm, to)
        assert (getattr(r, dim), r.from_, r.to) == (who, frm, T0 + 1800 if to else T0 + 3600)
        assert (r.held_gpu_hours, r.idle_gpu_hours) == (hours(0.5), hours(idle))
        assert r.rightsize is not None and getattr(r.rightsize, dim) == who
    # with the scheduler's events, the id is one request: one job, whoever its samples name
    write(store, [ev("submit", "7", T0), ev("start", "7", T0), ev("end", "7", T0 + 3600, "COMPLETED")])
    ref = jr.resolve(store, "7")
    assert (ref.request_id, ref.first_sample, ref.last_sample) == ("7", T0, T0 + 3600)


@pytest.mark.integration  # a rollup refresh and many chDB queries
def test_the_advice_and_a_job_report_refuse_a_window_whose_raw_rows_are_gone(
    store: ChdbStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The minute rollups outlive the raw rows (retention): the advice and a job's report over a
    window whose raw rows were dropped answered over what was left, exit 0 (a two-hour job held
    one GPU-hour; its advice gave back half of what it would have). Job j holds GPU 0 of n1 for
    two hours at activity 0.2 with 1,000 MiB (a slice fits it), sampled every 10 s; GPU 1 idle.
    With every raw row there no window is refused, rollups refreshed or not; once the first
    hour's rows are deleted, every window with a whole minute in that hour is refused (said why:
    the GPU-hours each side holds), the others answered as before."""
    from gpuslo.app.cli import main
    from gpuslo.rules import rollup
    from gpuslo.rules.rawcover import RawRowsGone

    two = 2 * 3600.0
    msgs: list[Any] = [ev("submit", "j", T0), ev("start", "j", T0), ev("end", "j", T0 + two, "COMPLETED")]
    msgs += [
        h.batch("n1", T0 + 10 * k, [gpu(0, 0.2, 1000.0, (("j", 1.0),)), gpu(1, 0.0, 10.0)])
        for k in range(2 * N)
    ]
    write(store, msgs)
    windows = [(T0, T0 + two), (T0 + 17.5, T0 + 59.5), (T0 + 0.25, T0 + 3601.0), (T0 + 3600, T0 + two),
               (T0 + 3600 - 30, T0 + 3600 + 90), (T0 + 3600 - 59, T0 + two)]  # fmt: skip

    def held(frm: float, to: float) -> float:
        z = rs.rightsizing(store, frm, to)
        (j,) = z.jobs
        assert j.profile is not None, j  # the slice fits: the advice is made
        return j.held_gpu_hours

    for refreshed in (False, True):  # all raw rows there: answered whatever the edges
        if refreshed:
            rollup.refresh(store)
        for frm, to in windows:
            assert held(frm, to) == hours((to - frm) / 3600)
        assert one_job(store).held_gpu_hours == hours(2.0)
    store.execute("DELETE FROM gpu_samples WHERE ts < toDateTime64({t:Float64}, 3, 'UTC')", {"t": T0 + 3600})
    for frm, to in windows:
        lo = math.ceil(frm / 60) * 60  # the first whole minute: a window of none is not compared
        if lo + 60 > to:
            continue
        if lo < T0 + 3600:
            with pytest.raises(
                RawRowsGone, match=r"in cluster 'c1'.*they give [\d.]+ GPU-h.*rollups.*advice"
            ):
                rs.rightsizing(store, frm, to)
        else:  # (the raw rows gone in a partial minute at its start are not seen: 30 s of one)
            assert held(frm, to) == hours((to - max(frm, T0 + 3600)) / 3600)
    with pytest.raises(RawRowsGone, match=r"they give 2\.000000 GPU-h.*rollups.* 4\.000000.*a job's report"):
        one_job(store)  # its life, both hours: the raw rows give 2 GPU-h of the 4 (two GPUs)
    assert jr.report(
        store, RulesConfig(), jr.resolve(store, "j"), T0 + 3600, T0 + two
    ).held_gpu_hours == hours(1.0)
    # the commands: exit 2, the reason on stderr, nothing on stdout
    store.close()
    base = ["--store", str(tmp_path / "store")]
    for argv in (["rightsize", *base, "--from", str(T0), "--to", str(T0 + two)], ["job", "j", *base]):
        assert main(argv) == 2, argv
        io = capsys.readouterr()
        assert "raw GPU samples of part of the window are gone" in io.err and io.out == "", argv
    assert main(["job", "j", *base, "--from", str(T0 + 3600)]) == 0

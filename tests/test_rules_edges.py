"""The four numbers at the edges of issue 11: nodes without a pool, samples longer than an hour,
state sent only on change, samples coarser than a minute. Every expected value is worked out
by hand in the comments from the definitions in docs/metrics.md, and each case is evaluated over raw
rows and over the rollups (after a refresh): both must give it."""

from __future__ import annotations

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import rollup
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import summary
from gpuslo.rules.model import Summary
from tests import helpers as h
from tests.helpers import T0

H = 3600.0
D = 86400.0
B = T0 - 4 * D  # a base far enough back that three days of samples end before now


def _both(
    store: ChdbStore,
    frm: float,
    to: float,
    cfg: RulesConfig | None = None,
    overlap_s: float = rollup.OVERLAP_S,
) -> list[Summary]:
    """The summary over raw rows and over the rollups (refreshed first; ``overlap_s`` 0: only
    the marks of rows written since the last refresh, as for rows arriving late)."""
    rollup.refresh(store, overlap_s=overlap_s)
    c = cfg or RulesConfig()
    out = [summary(store, c, frm, to, source="raw"), summary(store, c, frm, to, source="rollup")]
    assert [s.window.over for s in out] == ["raw rows", "rollups"]
    return out


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_node_without_a_pool_is_counted_once(store: ChdbStore) -> None:
    # Node a: pool "p", one GPU, free. Node b: no pool, one GPU held by job j. Both idle
    # (activity 0), sampled every 60 s over [B, B+1h). Capacity 2 GPUs x 1 h = 2.0 GPU-h;
    # allocated 1.0 GPU-h, CUR 1/2 = 0.5; allocated-idle b's hour = 1.0, unallocated a's = 1.0.
    msgs: list[object] = []
    for k in range(60):
        t = B + 60 * k
        msgs.append(h.batch("a", t, [h.gpu(0, 0.0)], interval_s=60, pool="p"))
        msgs.append(h.batch("b", t, [h.gpu(0, 0.0, (("j", 1.0),))], interval_s=60, pool=""))
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B, B + H):
        assert s.capacity_gpu_hours == pytest.approx(2.0)
        assert s.cur_allocation == pytest.approx(0.5)
        assert s.idle_allocated_gpu_hours == pytest.approx(1.0)
        assert s.idle_unallocated_gpu_hours == pytest.approx(1.0)
        assert s.idle_pct_of_capacity == pytest.approx(100.0)
        # the pool list names pools: p alone, 1 GPU-h, CUR 0
        assert [(p.pool, p.capacity_gpu_hours, p.cur_allocation) for p in s.pools] == [("p", 1.0, 0.0)]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_no_pool_anywhere_counts_once(store: ChdbStore) -> None:
    # Two nodes without a pool, one GPU each, one allocated: 2.0 GPU-h, CUR 0.5, 1.0 idle each way.
    msgs: list[object] = []
    for k in range(60):
        t = B + 60 * k
        msgs.append(h.batch("a", t, [h.gpu(0, 0.0)], interval_s=60, pool=""))
        msgs.append(h.batch("b", t, [h.gpu(0, 0.0, (("j", 1.0),))], interval_s=60, pool=""))
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B, B + H):
        assert (s.capacity_gpu_hours, s.cur_allocation) == (pytest.approx(2.0), pytest.approx(0.5))
        assert s.idle_allocated_gpu_hours == pytest.approx(1.0)
        assert s.idle_unallocated_gpu_hours == pytest.approx(1.0)
        assert s.pools == ()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_match_on_the_empty_pool_selects_the_nodes_without_one(store: ChdbStore) -> None:
    # Same fleet as above (a in p, b without a pool): match.pool [""] keeps b alone:
    # 1.0 GPU-h, CUR 1.0; match.pool ["p"] keeps a alone: 1.0 GPU-h, CUR 0.
    msgs: list[object] = []
    for k in range(60):
        t = B + 60 * k
        msgs.append(h.batch("a", t, [h.gpu(0, 0.0)], interval_s=60, pool="p"))
        msgs.append(h.batch("b", t, [h.gpu(0, 0.0, (("j", 1.0),))], interval_s=60, pool=""))
    write(store, msgs)  # type: ignore[arg-type]
    for pools, cap, cur in (((""), 1.0, 1.0), (("p"), 1.0, 0.0)):
        cfg = RulesConfig.model_validate({"match": {"pool": [pools]}})
        for s in _both(store, B, B + H, cfg):
            assert (s.capacity_gpu_hours, s.cur_allocation) == (pytest.approx(cap), pytest.approx(cur))


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("interval", [7200.0, 86400.0])
def test_a_sample_longer_than_an_hour_counts_at_a_window_start(store: ChdbStore, interval: float) -> None:
    # One GPU, one sample at B covering [B, B+interval). Window [B+4000, B+7200): 3200 s of it,
    # 3200/3600 = 0.8889 GPU-h, whatever the interval (>= 7200). Window [B+interval-60, B+interval+60):
    # its last 60 s. The minute windows of the rollups: [B+3960, B+7200) gives 3240 s = 0.9 GPU-h.
    write(store, [h.batch("n", B, [h.gpu(0, 0.0)], interval_s=interval)])  # type: ignore[list-item]
    raw = summary(store, RulesConfig(), B + 4000, B + 7200)
    assert raw.capacity_gpu_hours == pytest.approx(3200 / 3600, abs=1e-4)
    for s in _both(store, B + 3960, B + 7200):
        assert s.capacity_gpu_hours == pytest.approx(0.9)
    for s in _both(store, B + interval - 60, B + interval + 60):
        assert s.capacity_gpu_hours == pytest.approx(60 / 3600, abs=1e-4)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_node_state_holds_until_the_next_heartbeat_however_old(store: ChdbStore) -> None:
    # One heartbeat schedulable:false at B, then hourly samples of one GPU for three days and
    # no other heartbeat: the node is drained all along. [B, B+3d) -> 0; [B+2d, B+3d) -> 0.
    # A heartbeat schedulable:true at B+2d+12h (sent on the change): [B+2d, B+3d) -> 12 GPU-h.
    msgs: list[object] = [h.heartbeat("n", B, False, interval_s=H, gpus=1)]
    msgs += [h.batch("n", B + H * k, [h.gpu(0, 0.0)], interval_s=H) for k in range(72)]
    write(store, msgs)  # type: ignore[arg-type]
    for frm in (B, B + 2 * D):
        for s in _both(store, frm, B + 3 * D):
            assert s.capacity_gpu_hours == 0
    # the heartbeats arrive after the samples were rolled up: they re-roll the minutes they reach
    write(store, [h.heartbeat("n", B + 2 * D + 12 * H, True, interval_s=H, gpus=1)])  # type: ignore[list-item]
    for s in _both(store, B + 2 * D, B + 3 * D, overlap_s=0):
        assert s.capacity_gpu_hours == pytest.approx(12.0)
    # drained again from B+2d+18h: 6 GPU-h; and a schedulable:true sent at B-1d, before the first
    # drain, changes nothing after it
    write(store, [h.heartbeat("n", B + 2 * D + 18 * H, False, interval_s=H, gpus=1)])  # type: ignore[list-item]
    write(store, [h.heartbeat("n", B - D, True, interval_s=H, gpus=1)])  # type: ignore[list-item]
    for s in _both(store, B + 2 * D, B + 3 * D, overlap_s=0):
        assert s.capacity_gpu_hours == pytest.approx(6.0)
    # a heartbeat at B+1d (schedulable) sent late: from B+1d the node is schedulable until the
    # drain at B+2d+18h (the true at B+2d+12h changes nothing): [B, B+3d) = 24 + 18 = 42 GPU-h
    write(store, [h.heartbeat("n", B + D, True, interval_s=H, gpus=1)])  # type: ignore[list-item]
    for s in _both(store, B, B + 3 * D, overlap_s=0):
        assert s.capacity_gpu_hours == pytest.approx(42.0)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_coarse_samples_give_the_raw_cur_and_cause_over_rollups(store: ChdbStore) -> None:
    # One node, 8 GPUs, sampled every 300 s from B to B+1h; GPU0 is held by a job in the first
    # sample only ([B, B+300)). Window [B+120, B+1800) (whole minutes, not on samples):
    # capacity 8 x 1680 = 13440 GPU-s; allocated 300 - 120 = 180 GPU-s; CUR 180/13440 = 0.013393.
    # A pod asks for 1 GPU at B+1190 and pends: it opens at B+1790 (threshold 600). The latest
    # sample at or before then is B+1500, 290 s old < 2 x 300: 8 GPUs free, one node fits
    # 1 GPU, yet it waits: cause policy, 8 free.
    msgs: list[object] = []
    for k in range(12):
        gpus = [h.gpu(i, 0.0, (("j", 1.0),) if (i == 0 and k == 0) else ()) for i in range(8)]
        msgs.append(h.batch("n", B + 300 * k, gpus, interval_s=300))
    msgs.append(h.sched("submit", "pod", B + 1190))
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B + 120, B + 1800):
        assert s.capacity_gpu_hours == pytest.approx(13440 / 3600, abs=1e-4)  # rounded to 4 places
        assert s.cur_allocation == pytest.approx(180 / 13440, abs=1e-6)  # 0.013393
        (inc,) = s.starvation_incidents
        assert (inc.opened, inc.cause, inc.free_gpus_at_open) == (B + 1790, "policy", 8.0)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_stale_snapshot_is_no_snapshot(store: ChdbStore) -> None:
    # Samples every 300 s at B .. B+300 only; the pod submitted at B+700 opens at B+1300: the
    # latest sample (B+300) is 1000 s old >= 600: no capacity is known, cause capacity, 0 free.
    # Another pod opening at B+890 sees the B+300 sample 590 s old (< 600): policy, 8 free.
    msgs: list[object] = [h.batch("n", B + 300 * k, [h.gpu(i, 0.0) for i in range(8)], interval_s=300)
                          for k in range(2)]  # fmt: skip
    msgs += [h.sched("submit", "late", B + 700), h.sched("submit", "early", B + 290)]
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B, B + 1800):
        got = {i.request_id: (i.opened, i.cause, i.free_gpus_at_open) for i in s.starvation_incidents}
        assert got == {"early": (B + 890, "policy", 8.0), "late": (B + 1300, "capacity", 0.0)}


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_snapshot_older_than_an_hour_still_counts(store: ChdbStore) -> None:
    # Hourly samples: one at B (8 free GPUs), the next would be at B+3600 but never came. A pod
    # submitted at B+5400 opens at B+6000, inside the window [B+6000-60... ) that starts after
    # the sample by more than an hour: the sample is 6000 s old < 2 x 3600: policy, 8 free.
    msgs: list[object] = [h.batch("n", B, [h.gpu(i, 0.0) for i in range(8)], interval_s=H)]
    msgs.append(h.sched("submit", "pod", B + 5400))
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B + 5940, B + 6060):
        ((inc),) = s.starvation_incidents
        assert (inc.opened, inc.cause, inc.free_gpus_at_open) == (B + 6000, "policy", 8.0)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_drain_sent_long_ago_makes_the_snapshot_unschedulable(store: ChdbStore) -> None:
    # The node was drained at B-3d (one heartbeat) and sends samples every 60 s from B: its
    # 8 free GPUs are not schedulable. A pod submitted at B+60 opens at B+660: 0 free, capacity.
    msgs: list[object] = [h.heartbeat("n", B - 3 * D, False, gpus=8)]
    msgs += [h.batch("n", B + 60 * k, [h.gpu(i, 0.0) for i in range(8)], interval_s=60) for k in range(20)]
    msgs.append(h.sched("submit", "pod", B + 60))
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B, B + 1200):
        ((inc),) = s.starvation_incidents
        assert (inc.cause, inc.free_gpus_at_open) == ("capacity", 0.0)
        assert s.capacity_gpu_hours == 0


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_node_in_several_partitions_hosts_requests_of_each(store: ChdbStore) -> None:
    # The agent reports a node in partitions debug and gpu as pool "debug,gpu" (sorted, joined
    # with ','; Slurm forbids ',' in partition names). Node n: 8 free GPUs sampled every 60 s.
    # Node m: pool "other", 8 free GPUs. A job asking 4 GPUs in partition gpu pends from B+60
    # and opens at B+660: only n may host it (8 free there, it fits): cause policy, 8 free.
    # A job submitted to partitions "gpu,x" (Slurm's -p gpu,x) may run on n too: policy, 8.
    # A job asking 12 GPUs in partition debug: 8 free on n < 12: capacity.
    msgs: list[object] = []
    for k in range(30):
        msgs.append(
            h.batch("n", B + 60 * k, [h.gpu(i, 0.0) for i in range(8)], interval_s=60, pool="debug,gpu")
        )
        msgs.append(h.batch("m", B + 60 * k, [h.gpu(i, 0.0) for i in range(8)], interval_s=60, pool="other"))
    msgs += [
        h.sched("submit", "in-gpu", B + 60, gpn=4, pool="gpu"),
        h.sched("submit", "in-gpu-or-x", B + 60, gpn=4, pool="gpu,x"),
        h.sched("submit", "too-big", B + 60, gpn=12, pool="debug"),
    ]
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B, B + 1800):
        got = {i.request_id: (i.cause, i.free_gpus_at_open) for i in s.starvation_incidents}
        assert got == {
            "in-gpu": ("policy", 8.0),
            "in-gpu-or-x": ("policy", 8.0),
            "too-big": ("capacity", 8.0),
        }


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_node_that_changed_pool_is_in_the_snapshot_once_and_of_its_pool_then(store: ChdbStore) -> None:
    # Node a: 1 free GPU sampled every 60 s, in pool p over [B, B+30m), then in pool q over
    # [B+30m, B+1h). Requests submitted at B+40m open at B+50m (threshold 600 s); the
    # snapshot then is a's sample at B+50m: pool q, 1 free GPU.
    # - "any" (no pool), 2 GPUs on one node: a counts once, 1 free < 2: capacity, 1 free.
    # - "in-p", 1 GPU in pool p: a is not in p at B+50m, p has no GPU then: capacity, 0 free.
    # - "in-q", 1 GPU in pool q: a hosts it, 1 free: policy, 1 free.
    msgs: list[object] = []
    for k in range(60):
        msgs.append(h.batch("a", B + 60 * k, [h.gpu(0, 0.0)], interval_s=60, pool="p" if k < 30 else "q"))
    msgs += [
        h.sched("submit", "any", B + 2400, gpn=2, pool=""),
        h.sched("submit", "in-p", B + 2400, gpn=1, pool="p"),
        h.sched("submit", "in-q", B + 2400, gpn=1, pool="q"),
    ]
    write(store, msgs)  # type: ignore[arg-type]
    for s in _both(store, B, B + H):
        got = {i.request_id: (i.cause, i.free_gpus_at_open) for i in s.starvation_incidents}
        assert got == {"any": ("capacity", 1.0), "in-p": ("capacity", 0.0), "in-q": ("policy", 1.0)}, s.window


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_sample_replaced_after_its_minutes_were_rolled_up_leaves_nothing_of_itself(
    store: ChdbStore,
) -> None:
    # A row with the natural key of a stored one replaces it (the latest ingest wins). Node n, one
    # GPU idle, sampled every 60 s at B+50+60k (k < 10), held by job j1: 600 GPU-s, all j1's.
    # Rolled up, then (each refresh taking only the marks written since the last: overlap 0):
    # - the sample at B+50 comes again held by j2: j1 holds 540 s, j2 60 s (j1 must lose the
    #   minutes of that sample, not keep them beside j2);
    # - the sample at B+170 comes again with a 5 s interval: it covered [B+170, B+230), now
    #   [B+170, B+175): 545 s in all; the minute [B+180, B+240) it no longer reaches must lose
    #   its 50 s though the new sample marks only [B+170, B+180);
    # - the last sample, at B+590, comes again with a 5 s interval: its minute [B+600, B+660)
    #   has nothing left (490 s in all).
    # A latency delta at B+30 (90 good, 10 bad, bounds 1/2.5/5/10) comes again with other bounds
    # (2.5/5/10: 50 good, 50 bad): the window holds those 100 requests, SLI 0.5, not 200.
    cfg = RulesConfig.model_validate(
        {"slos": [{"name": "s", "service": "svc", "objective": 0.99, "threshold_ms": 5,
                   "buckets_ms": [1, 2.5, 5, 10], "min_requests": 1}]}
    )  # fmt: skip
    first = [h.batch("n", B + 50 + 60 * k, [h.gpu(0, 0.0, (("j1", 1.0),))], interval_s=60) for k in range(10)]
    write(store, first)  # type: ignore[arg-type]
    write(store, [h.latency(B + 30, 90, 10)])  # type: ignore[list-item]
    for s in _both(store, B, B + H, cfg):
        assert s.capacity_gpu_hours == pytest.approx(600 / H, abs=1e-4)
    write(store, [h.batch("n", B + 50, [h.gpu(0, 0.0, (("j2", 1.0),))], interval_s=60)])  # type: ignore[list-item]
    write(store, [h.batch("n", B + 170, [h.gpu(0, 0.0, (("j1", 1.0),))], interval_s=5)])  # type: ignore[list-item]
    write(store, [h.batch("n", B + 590, [h.gpu(0, 0.0, (("j1", 1.0),))], interval_s=5)])  # type: ignore[list-item]
    write(store, [h.latency(B + 30, 50, 50, bounds=(2.5, 5.0, 10.0))])  # type: ignore[list-item]
    for frm, to in ((B, B + H), (B - 12 * H, B + 13 * H)):  # minutes alone; whole hours from the hourly tier
        for s in _both(store, frm, to, cfg, overlap_s=0):
            assert s.capacity_gpu_hours == pytest.approx(490 / H, abs=1e-4)
            assert s.idle_allocated_gpu_hours == pytest.approx(490 / H, abs=1e-4)
            assert {x.id: x.allocated_gpu_hours for x in s.top_idle} == {
                "j1": pytest.approx(430 / H, abs=1e-4),
                "j2": pytest.approx(60 / H, abs=1e-4),
            }
            assert [(x.account, x.allocated_gpu_hours) for x in s.fair_share] == [
                ("acct", pytest.approx(490 / H, abs=1e-4))
            ]
            assert [(x.total, x.good, x.sli) for x in s.slos] == [(100, 50, 0.5)]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_late_drain_takes_its_holders_out_of_the_rolled_up_minutes(store: ChdbStore) -> None:
    # Node n, one idle GPU held by j1, sampled every 60 s over [B, B+1h): rolled up. Then a drain
    # sent late at B+30m: [B+30m, B+1h) is outside capacity, and allocation outside capacity does
    # not count (docs/metrics.md): 0.5 GPU-h of capacity, and j1 (account acct) holds 0.5 GPU-h,
    # not the hour it held before the drain was known.
    held = [h.batch("n", B + 60 * k, [h.gpu(0, 0.0, (("j1", 1.0),))], interval_s=60) for k in range(60)]
    write(store, held)  # type: ignore[arg-type]
    rollup.refresh(store)
    write(store, [h.heartbeat("n", B + 1800, False, interval_s=60, gpus=1)])  # type: ignore[list-item]
    for frm, to in ((B, B + H), (B - 12 * H, B + 13 * H)):
        for s in _both(store, frm, to, overlap_s=0):
            assert s.capacity_gpu_hours == pytest.approx(0.5)
            assert [(x.id, x.allocated_gpu_hours, x.idle_gpu_hours) for x in s.top_idle] == [("j1", 0.5, 0.5)]
            assert [(x.account, x.allocated_gpu_hours) for x in s.fair_share] == [("acct", 0.5)]


def _run(
    node: str, start: float, intervals: list[tuple[float, int]], allocs: tuple[tuple[str, float], ...] = ()
) -> tuple[list[object], float]:
    """Idle samples of one GPU from ``start``, ``n`` of each ``(interval, n)`` back to back (each
    sample covers [ts, ts + interval)); and where the last one ends."""
    out: list[object] = []
    t = start
    for iv, n in intervals:
        for _ in range(n):
            out.append(h.batch(node, t, [h.gpu(0, 0.0, allocs)], interval_s=iv))
            t += iv
    return out, t


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    ("first", "then"), [(60.0, 1.0), (1.0, 60.0), (10.0, 300.0), (300.0, 10.0), (5.0, 5.0)]
)
@pytest.mark.parametrize("hole", ["none", "within", "past"])
def test_a_run_is_broken_by_a_gap_past_twice_the_interval_of_the_sample_before_it(
    store: ChdbStore, first: float, then: float, hole: str
) -> None:
    # docs/metrics.md: "gaps over twice the interval break a run", the gap bound of the energy
    # rule: the next sample at most 2 x interval_s *of the sample before it* later. One GPU idle,
    # held by j1: 600 s of samples every `first` s, then (after a hole of `first` - 1 s, `first` + 1 s
    # past the end of the last one, or none) 300 s of samples every `then` s. The sampling rate
    # changing without a hole is one run of 900 s; a hole of `first` + 1 s breaks it (the next sample
    # 2 x `first` + 1 s after the last one started), one of `first` - 1 s does not. Which of the two
    # intervals the bound takes decided it before: a 60 s -> 1 s change broke every run, a 1 s -> 300 s
    # hole of 301 s bridged one.
    a, end = _run("n", B, [(first, int(600 / first))], (("j1", 1.0),))
    gap = {"none": 0.0, "within": first - 1, "past": first + 1}[hole]
    b, _ = _run("n", end + gap, [(then, int(300 / then))], (("j1", 1.0),))
    write(store, a + b)  # type: ignore[arg-type]
    whole = hole != "past"
    for min_idle, want in (
        (899.0, 900.0 if whole else 0.0),
        (599.0, 900.0 if whole else 600.0),
        (299.0, 900.0),
    ):
        s = summary(
            store, RulesConfig.model_validate({"min_idle_s": min_idle}), B - H, B + 2 * H, source="raw"
        )
        assert s.idle_allocated_gpu_hours == pytest.approx(want / H, abs=1e-4), (min_idle, want)
        assert [(x.id, x.idle_gpu_hours) for x in s.top_idle] == [("j1", pytest.approx(want / H, abs=1e-4))]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_run_past_the_window_end_with_holes_in_it_is_judged_whole(store: ChdbStore) -> None:
    # docs/metrics.md: "a run crossing the window's edges is judged whole". One GPU idle, held by
    # j1: ten 10 s samples in the window's last 100 s, then 300 s samples at its end and 600 s
    # later (a hole of 300 s: twice the interval of the sample before it, the same run). The run
    # holds 100 + 300 + 300 = 700 s of samples: with min_idle_s 600 the window's 100 s are idle.
    # The runs were found on samples up to min_idle_s past the window only, here 400 s of them
    # (a run's samples may cover as little as half its time): judged too short, the 100 s were not.
    a, end = _run("n", B + H - 100, [(10.0, 10)], (("j1", 1.0),))
    b, _ = _run("n", end, [(300.0, 1)], (("j1", 1.0),))
    c, _ = _run("n", end + 600, [(300.0, 1)], (("j1", 1.0),))
    write(store, a + b + c)  # type: ignore[arg-type]
    s = summary(store, RulesConfig.model_validate({"min_idle_s": 600}), B, B + H, source="raw")
    assert s.idle_allocated_gpu_hours == pytest.approx(100 / H, abs=1e-4)
    assert [(x.id, x.idle_gpu_hours) for x in s.top_idle] == [("j1", pytest.approx(100 / H, abs=1e-4))]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize(
    ("min_idle", "before", "last"),
    [
        # 300 s samples every 600 s (a gap of twice the interval: one run) from well before the
        # window, then a 150 s sample at its start: a run of 300 x 300 + 150 s. Those of the 100,000 s
        # before the window cover 166 x 300 = 49,800 s of it: with the first one left out only 2 x
        # min_idle_s back, the run was judged 49,950 s, under min_idle_s 50,000.
        (50_000.0, [(B + D - 600 * k, 300.0) for k in range(300, 0, -1)], 150.0),
        # one sample of a day (the wire's longest) ending 1 s before the window, then a 10 s one at
        # its start: a run of a day and 10 s; the day's sample starts a day and a second before
        # the window, past a day's look-back: the run was judged 10 s, under min_idle_s 100.
        (100.0, [(B + D - D - 1, D)], 10.0),
    ],
)
def test_a_run_before_the_window_start_with_holes_in_it_is_judged_whole(
    store: ChdbStore, min_idle: float, before: list[tuple[float, float]], last: float
) -> None:
    # docs/metrics.md: "a run crossing the window's edges is judged whole". A sample before the
    # window may start up to twice the interval of the one before it later: the last one left out
    # of the look-back may reach up to twice its interval towards the window, and the samples
    # after it cover as little as half of what is left. One GPU idle, held by j1, then active.
    frm = B + D
    idle = (("j1", 1.0),)
    msgs: list[object] = [h.batch("n", t, [h.gpu(0, 0.0, idle)], interval_s=iv) for t, iv in before]
    msgs.append(h.batch("n", frm, [h.gpu(0, 0.0, idle)], interval_s=last))
    msgs.append(h.batch("n", frm + last, [h.gpu(0, 0.9, idle)], interval_s=60.0))
    write(store, msgs)  # type: ignore[arg-type]
    s = summary(store, RulesConfig.model_validate({"min_idle_s": min_idle}), frm, frm + H, source="raw")
    assert s.idle_allocated_gpu_hours == pytest.approx(last / H, abs=1e-4)
    assert [(x.id, x.idle_gpu_hours) for x in s.top_idle] == [("j1", pytest.approx(last / H, abs=1e-4))]


@pytest.mark.parametrize(
    ("total", "nodes"), [(10, 3), (7, 3), (100, 7), (99_999, 7), (1024 * 97, 97), (5, 5)]
)
def test_a_whole_request_spread_unevenly_stays_whole(total: int, nodes: int) -> None:
    """``--gpus=10 -N 3`` is 10/3 GPUs per node, a Float32 in the store: the incident's GPUs were
    9.99999976 (per node × nodes); they are the 10 asked."""
    import struct

    from gpuslo.rules.evaluate import _gpus, whole_gpus

    per_node = struct.unpack("f", struct.pack("f", total / nodes))[0]
    assert _gpus(per_node, nodes) == float(total)
    assert whole_gpus(0.1) == 0.1 and whole_gpus(2.5) == 2.5  # a fractional share stays what it is
    f32_tenth = struct.unpack("f", struct.pack("f", 0.1))[0]
    assert whole_gpus(f32_tenth) == f32_tenth


@pytest.mark.integration
def test_no_scheduler_event_is_no_starvation_data_not_zero_incidents(store: ChdbStore) -> None:
    """GPU samples but no collector (no scheduler event of the cluster at or before the window's
    end): the starvation numbers were 0, as if no request had waited. They are no data: the
    summary says so, its text and rule_results (None) too; from the first event on, counted,
    over raw rows and rollups alike, per cluster."""
    from gpuslo.app.text import summary as text_summary
    from gpuslo.rules.results import rows

    write(store, [h.batch("n1", T0 + 10 * k, [h.gpu(0, 0.5)]) for k in range(60)])
    for s in _both(store, T0, T0 + 600):
        assert s.scheduler_events_seen is False and not s.starvation_incidents
        assert "no data" in text_summary(s)
        got = {(r[0], r[3]): r[4] for r in rows(s, T0 + 600, 600) if r[0].startswith("starvation")}
        assert got and set(got.values()) == {None}, got
    write(store, [h.sched("submit", "1", T0 + 300, cluster="c2")])  # another cluster's collector
    assert summary(store, RulesConfig(), T0, T0 + 600, cluster="c1").scheduler_events_seen is False
    assert summary(store, RulesConfig(), T0, T0 + 600).scheduler_events_seen is True
    write(store, [h.sched("submit", "2", T0 + 700)])  # after the window: still none at its end
    assert summary(store, RulesConfig(), T0, T0 + 600, cluster="c1").scheduler_events_seen is False
    write(store, [h.sched("submit", "3", T0 + 100)])
    for s in _both(store, T0, T0 + 600):
        assert s.scheduler_events_seen is True
        got = {(r[0], r[3]): r[4] for r in rows(s, T0 + 600, 600) if r[0].startswith("starvation")}
        assert None not in got.values(), got

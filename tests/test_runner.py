"""The agent's loop: stopping it, sinks that fail, and the GPU source refreshing its own
attribution (no order of the source list is a contract)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpuslo.agent.base import SendResult, Sink, Source
from gpuslo.agent.nvml import NvmlSource
from gpuslo.agent.runner import Runner, WallClock
from gpuslo.agent.slurm import SlurmAttribution
from gpuslo.wire import Allocation, GpuSampleBatch, Message, NodeHeartbeat
from tests.fake_nvml import FakeGpu, FakeNvml

T = 1_790_000_000.0


class Beats(Source):
    """One heartbeat per tick; sets ``ticked`` after each."""

    name = "beats"

    def __init__(self) -> None:
        self.n = 0
        self.ticked = threading.Event()

    def collect(self, now: float) -> list[Message]:
        self.n += 1
        self.ticked.set()
        return [NodeHeartbeat(source="n1", boot_id="b", seq=self.n, cluster="c", ts=now, node="n1",
                              interval_s=10.0, schedulable=True, gpus=8)]  # fmt: skip


class Keep(Sink):
    def __init__(self) -> None:
        self.got: list[Message] = []

    def send(self, msgs: Sequence[Message]) -> SendResult:
        self.got.extend(msgs)
        return SendResult(sent=len(msgs))


class Raises(Sink):
    def __init__(self) -> None:
        self.calls = 0

    def send(self, msgs: Sequence[Message]) -> SendResult:
        self.calls += 1
        raise ConnectionError("broker gone")


class Refuses(Sink):
    def send(self, msgs: Sequence[Message]) -> SendResult:
        return SendResult(sent=0, failed=len(msgs), error="full")


class FrozenTime:
    """A wall clock that never reaches the next tick: only a stop ends a wait."""

    def __init__(self, t: float) -> None:
        self.t = t
        self.waits = 0

    def __call__(self) -> float:
        self.waits += 1
        return self.t


class OnTime:
    """A clock that is at each tick's time as soon as it is waited for: a loop never late."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float, stop: threading.Event) -> None:
        self.t = max(self.t, t)


def test_stop_ends_a_run_waiting_for_its_next_tick() -> None:
    """The clock stands still one interval before the second tick: the run can only end by
    the stop, and it does so without another tick."""
    src = Beats()
    clock = WallClock(time_fn=FrozenTime(T + 5.0))
    runner = Runner([src], Keep(), clock, 10.0)
    done: list[int] = []
    th = threading.Thread(target=lambda: done.append(runner.run(T)))  # tick 0 at T is due at once
    th.start()
    assert src.ticked.wait(60)  # the first tick happened; the run now waits for T + 10
    runner.stop()
    th.join(60)
    assert not th.is_alive() and done == [1] and runner.stats.ticks == 1 and src.n == 1


def test_the_callers_stop_event_is_the_runners() -> None:
    src = Beats()
    stop = threading.Event()
    runner = Runner([src], Keep(), WallClock(time_fn=FrozenTime(T + 5.0)), 10.0)
    th = threading.Thread(target=runner.run, args=(T,), kwargs={"stop": stop})
    th.start()
    assert src.ticked.wait(60)
    stop.set()  # a signal handler's event
    th.join(60)
    assert not th.is_alive() and runner.stats.ticks == 1
    again = threading.Event()
    again.set()
    assert runner.run(T, stop=again) == 0  # set before it starts: no tick at all


def test_a_run_with_ticks_ends_by_itself() -> None:
    src = Beats()
    runner = Runner([src], Keep(), OnTime(), 10.0)  # every tick due at once
    assert runner.run(T, ticks=3) == 3 and src.n == 3


def test_a_sink_that_raises_on_every_send_costs_no_tick_and_no_other_sinks_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good, bad, full = Keep(), Raises(), Refuses()
    src = Beats()
    runner = Runner([src], [bad, good, full], OnTime(), 10.0)
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.runner"):
        assert runner.run(T, ticks=5) == 5
    assert bad.calls == 5 and len(good.got) == 5 and [m.seq for m in good.got] == [1, 2, 3, 4, 5]
    assert runner.stats.ticks == 5
    assert runner.stats.send_failures == 10  # 5 raised + 5 refused
    assert runner.stats.messages == 5  # what the good sink took
    assert caplog.text.count("sink raised") == 1  # once per exception type, not per tick
    assert caplog.text.count("sink failed to send") == 2  # one outage each for the two failing sinks


class Other(Source):
    """Any other source of the node, before or after the GPU source."""

    name = "other"

    def collect(self, now: float) -> list[Message]:
        return []


@pytest.mark.parametrize("gpu_first", [True, False])
def test_the_gpu_source_refreshes_its_attribution_before_it_samples(tmp_path: Path, gpu_first: bool) -> None:
    """dcgm-exporter's HPC job mapping (one file per GPU index, job ids as lines): the holder
    written before a tick is the holder in that tick's batch, whatever the list order, and
    with no scheduler source in the list at all."""
    attr = SlurmAttribution("node-1", mapping_dir=tmp_path)
    gpu = NvmlSource(
        "node-1", "prod", 10.0, nvml=FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")]), attribution=attr
    )
    sources: list[Source] = [gpu, Other()] if gpu_first else [Other(), gpu]
    sink = Keep()
    runner = Runner(sources, sink, OnTime(), 10.0)
    seen = []
    for job in ("77", "78", None):
        if job is None:
            (tmp_path / "1").unlink()
        else:
            (tmp_path / "1").write_text(f"{job}\n")
        runner.tick(T + 10 * len(seen))
        b = next(m for m in reversed(sink.got) if isinstance(m, GpuSampleBatch))
        seen.append([tuple(a.id for a in g.allocations) for g in b.gpus])
    assert seen == [[(), ("77",)], [(), ("78",)], [(), ()]]


class Flaky:
    """An attribution whose refresh raises after the first one."""

    def __init__(self) -> None:
        self.refreshes = 0

    def refresh(self) -> None:
        self.refreshes += 1
        if self.refreshes > 1:
            raise RuntimeError("scheduler gone")

    def __call__(self, index: int, uuid: str) -> tuple[Allocation, ...]:
        return (Allocation(scheduler="slurm", id="9", share=1.0),) if index == 0 else ()


def test_an_attribution_that_raises_keeps_the_gpus_sampled(caplog: pytest.LogCaptureFixture) -> None:
    attr = Flaky()
    gpu = NvmlSource("node-1", "prod", 10.0, nvml=FakeNvml([FakeGpu("GPU-a")]), attribution=attr)
    with caplog.at_level(logging.ERROR, logger="gpuslo.agent.nvml"):
        batches = [gpu.collect(T + 10 * k)[0] for k in range(3)]
    assert attr.refreshes == 3 and gpu.stats.attribution_failures == 2
    assert all(isinstance(b, GpuSampleBatch) and b.gpus[0].allocations[0].id == "9" for b in batches)
    assert caplog.text.count("attribution refresh failed") == 1


def test_realtime_sim_agent_ticks_on_the_wall_clock(tmp_path: Path) -> None:
    from gpuslo.app.cli import main
    from gpuslo.wire import decode

    out = tmp_path / "o.jsonl"
    argv = ["agent", "--source", "sim", "--realtime", "--ticks", "2", "--interval-s", "1", "--nodes", "1",
            "--gpus", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    batches = [m for m in map(decode, out.read_bytes().splitlines()) if isinstance(m, GpuSampleBatch)]
    assert len(batches) == 2 and batches[1].ts - batches[0].ts == 1.0 and batches[0].ts % 1 == 0


def test_sigterm_stops_a_waiting_agent_at_once(tmp_path: Path) -> None:
    """The next tick is an hour away: only the stop event can end the wait (the process
    flushes, closes and exits 0 with what it sampled)."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "o.jsonl"
    exe = Path(sys.executable).with_name("gpuslo")
    p = subprocess.Popen([str(exe), "agent", "--source", "sim", "--realtime", "--interval-s", "3600", "--nodes", "1",
                          "--out", str(out)], stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        while not out.exists() or not out.read_bytes():  # the first tick (due at once) was written
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            threading.Event().wait(0.05)
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert out.read_bytes().endswith(b"\n")


def test_a_runner_without_a_sink_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one sink"):
        Runner([Beats()], [], WallClock(), 10.0)
    for bad in (0.0, -10.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite interval"):
            Runner([Beats()], Keep(), WallClock(), bad)


def test_a_sink_that_empties_the_batch_takes_nothing_from_the_next() -> None:
    class Clears(Sink):
        def send(self, msgs: Sequence[Message]) -> SendResult:
            if isinstance(msgs, list):
                msgs.clear()
            return SendResult(sent=0)

    good = Keep()
    runner = Runner([Beats()], [Clears(), good], WallClock(), 10.0)
    runner.tick(T)
    assert len(good.got) == 1


def test_the_assembled_node_agent_gives_the_attribution_to_the_gpu_source(tmp_path: Path) -> None:
    from gpuslo.agent.assemble import NodeOptions, node_agent
    from gpuslo.agent.k8s import PodResourcesAttribution
    from gpuslo.agent.scrape import DcgmExporterSource
    from gpuslo.agent.slurm import SlurmNodeSource

    fake = FakeNvml([FakeGpu("GPU-a")])
    base = NodeOptions(source="nvml", node="n1", cluster="c", interval_s=10.0)
    slurm = node_agent(NodeOptions(**{**base.__dict__, "hpc_job_mapping_dir": tmp_path}), nvml=fake)
    assert [type(s) for s in slurm.sources] == [SlurmNodeSource, NvmlSource] and slurm.gpu is slurm.sources[1]
    assert isinstance(slurm.gpu, NvmlSource) and isinstance(slurm.gpu.attribution, SlurmAttribution)
    assert slurm.gpu.attribution.mapping_dir == tmp_path
    asked: list[bool] = []
    k8s = node_agent(NodeOptions(**{**base.__dict__, "k8s_pod_resources": str(tmp_path / "kubelet.sock")}),
                     kube_api=lambda: asked.append(True), nvml=fake)  # type: ignore[func-returns-value]  # fmt: skip
    assert [type(s) for s in k8s.sources] == [NvmlSource] and asked == [True]
    assert isinstance(k8s.gpu, NvmlSource) and isinstance(k8s.gpu.attribution, PodResourcesAttribution)
    assert k8s.notes == ["the node's pool stays unknown; give --pool"]
    dcgm = node_agent(NodeOptions(**{**base.__dict__, "source": "dcgm", "slurm": True}))
    assert [type(s) for s in dcgm.sources] == [SlurmNodeSource, DcgmExporterSource]
    plain = node_agent(base, nvml=fake)
    assert isinstance(plain.gpu, NvmlSource) and plain.gpu.attribution is None


def test_a_stop_before_a_run_with_the_callers_event_is_not_lost() -> None:
    """stop() first, then run(stop=event): the stop is final, so the run does no tick, and the
    caller's event (the one stop() sets from then on) says so too."""
    src = Beats()
    runner = Runner([src], Keep(), OnTime(), 10.0)
    runner.stop()
    stop = threading.Event()
    assert runner.run(T, ticks=3, stop=stop) == 0 and src.n == 0 and stop.is_set()


def test_a_second_run_while_one_runs_is_refused() -> None:
    """Two loops over the same sources would sample each twice per tick, from two threads."""
    src = Beats()
    runner = Runner([src], Keep(), WallClock(time_fn=FrozenTime(T + 5.0)), 10.0)
    th = threading.Thread(target=runner.run, args=(T,))
    th.start()
    assert src.ticked.wait(60)
    with pytest.raises(RuntimeError, match="already running"):
        runner.run(T)
    runner.stop()
    th.join(60)
    assert not th.is_alive() and src.n == 1
    assert runner.run(T) == 0  # stopped for good, not refused


def test_keyboard_interrupt_in_a_sink_stops_the_run() -> None:
    """Containment is for failures, not for a request to stop: BaseException goes through."""

    class Interrupted(Sink):
        def send(self, msgs: Sequence[Message]) -> SendResult:
            raise KeyboardInterrupt

    good = Keep()
    runner = Runner([Beats()], [Interrupted(), good], OnTime(), 10.0)
    with pytest.raises(KeyboardInterrupt):
        runner.run(T, ticks=3)
    assert runner.stats.ticks == 0 and good.got == []


class Stalls(OnTime):
    """On time, but the tick at ``at`` takes ``stall_s`` (a hang, a suspended host)."""

    def __init__(self, at: float, stall_s: float) -> None:
        super().__init__()
        self.at, self.stall_s = at, stall_s

    def sleep_until(self, t: float, stop: threading.Event) -> None:
        super().sleep_until(t, stop)
        if t == self.at:
            self.t += self.stall_s  # the clock moves on while the tick runs


@pytest.mark.parametrize(
    ("stall_s", "missed"),
    [(5.0, 0), (10.0, 0), (19.999, 0), (20.0, 1), (29.999, 1), (30.0, 2), (3600.0, 359)],
)
def test_after_a_stall_the_missed_ticks_stay_gaps_not_a_burst_of_old_times(
    stall_s: float, missed: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Interval 10 s, the tick at T+10 ends ``stall_s`` later, at T+10+stall_s: a slot the clock
    has passed by a whole interval or more is passed over (on paper: the slots T+20, T+30, ...
    up to T+stall_s; stall_s 20 -> T+20, 3600 -> the 359 of T+20 .. T+3600), and the next tick
    is the first slot still due; no tick stamps what it reads now with a time long gone."""
    src = Beats()
    sink = Keep()
    runner = Runner([src], sink, Stalls(T + 10.0, stall_s), 10.0)
    with caplog.at_level(logging.WARNING, logger="gpuslo.agent.runner"):
        assert runner.run(T, ticks=4) == 4
    want = [T, T + 10.0] + [T + 10.0 * (2 + missed + i) for i in range(2)]
    assert [m.ts for m in sink.got] == want
    assert runner.stats.ticks_missed == missed and runner.stats.ticks == 4
    assert caplog.text.count("ticks passed over") == (1 if missed else 0)


class SetBack:
    """A wall clock that runs (a tenth of a second a tenth of a second), and goes back
    ``by_s`` once it passes ``at``."""

    def __init__(self, t: float, at: float, by_s: float) -> None:
        self.t, self.at, self.by_s = t, at, by_s
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            self.t += 0.1
            if self.at and self.t >= self.at:
                self.t -= self.by_s
                self.at = 0.0
            return self.t


@pytest.mark.parametrize("by_s", [2.0, 600.0, 3600.0, 86_400.0])
@pytest.mark.parametrize("during", ["wait", "tick"])
def test_a_clock_set_back_does_not_stop_the_sampling(by_s: float, during: str) -> None:
    """The wall clock set back while the loop waits for a tick, or while a tick runs: the loop
    ticks again from the clock within a tick or so (it waited as long as the clock went back: an
    hour set back, a node silent for an hour), counted. Set back less than an interval, it stays
    ahead of the last tick: the wait is that much longer, nothing else."""
    at = T + 10.05 if during == "wait" else T + 10.0
    fake = SetBack(T - 0.1, at, by_s)
    src, got = Beats(), Keep()
    runner = Runner([src], got, WallClock(time_fn=fake, step_s=0.0001), 10.0)
    stop = threading.Event()
    th = threading.Thread(target=runner.run, args=(T,), kwargs={"ticks": 4, "stop": stop})
    th.start()
    th.join(30)
    stop.set()
    assert not th.is_alive() and src.n == 4, (src.n, runner.stats)
    stamps = [m.ts - T for m in got.got]
    if by_s > 10.0:  # ticking again from the clock, an interval apart: not waiting for T + 20
        assert runner.stats.clock_set_back == 1
        back = stamps.index(min(stamps))
        assert stamps[back] < 10.0 - by_s + 1.0 and stamps[back + 1 :] == pytest.approx(
            [stamps[back] + 10.0 * (i + 1) for i in range(len(stamps) - back - 1)]
        ), stamps
    else:
        assert runner.stats.clock_set_back == 0 and stamps == [0.0, 10.0, 20.0, 30.0]


def test_a_clock_set_back_less_than_to_the_last_tick_only_delays_the_next() -> None:
    """A tick takes 3 s; the clock goes back 3.5 s while the loop waits for the next one (behind
    where the wait began, still after the last tick): the next tick waits for its time, never
    taken early stamped ahead of the clock (it was: stamped T + 20 at clock T + 10.5)."""
    fake = SetBack(T - 0.1, T + 14.0, 3.5)
    taken: list[tuple[float, float]] = []

    class Slow(Beats):
        def collect(self, now: float) -> list[Message]:
            taken.append((now - T, fake() - T))
            with fake.lock:
                fake.t += 3.0
            return super().collect(now)

    runner = Runner([Slow()], Keep(), WallClock(time_fn=fake, step_s=0.0001), 10.0)
    assert runner.run(T, ticks=4) == 4
    assert [round(s, 6) for s, _ in taken] == [0.0, 10.0, 20.0, 30.0]
    assert all(clock >= stamp for stamp, clock in taken), taken
    assert runner.stats.clock_set_back == 0

"""The whole pipeline in one process: simulated fleet → agents → in-process bus →
ingest → embedded ClickHouse (chDB) → rules → summary and dashboards.

One process because chDB holds its data directory exclusively."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.agent.sim.run import run_fleet, ticks
from gpuslo.agent.sim.truth import WindowPair
from gpuslo.agent.sim.truth import idle_holders as truth_idle_holders
from gpuslo.agent.sim.truth import slo_alerts as truth_slo_alerts
from gpuslo.agent.sim.truth import summary as truth_summary
from gpuslo.agent.sinks import BusSink
from gpuslo.app.whatif import demo_whatif, fleet_config
from gpuslo.core.bus import Bus
from gpuslo.core.fileio import write_outputs
from gpuslo.dashboards.generate import write as write_dashboards
from gpuslo.dashboards.report import render as render_report
from gpuslo.ingest.pipeline import Ingestor, IngestReport
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import Raw
from gpuslo.rules import chargeback, energy
from gpuslo.rules.alerts import Notifier
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import summary as rules_summary
from gpuslo.rules.model import Summary, to_json
from gpuslo.rules.reclaim_round import demo_rounds
from gpuslo.rules.rightsize import Rightsizing, rightsizing
from gpuslo.rules.service import RulesService
from gpuslo.rules.tables import SCHEMA

log = logging.getLogger(__name__)

MARKER = ".gpuslo-demo-store"
OUT_MARKER = ".gpuslo-demo"


class BusConsumer:
    """Drains the bus through the ingest pipeline (what the Kafka consumer does in production)."""

    def __init__(self, bus: Bus, ingestor: Ingestor) -> None:
        self.bus = bus
        self.ingestor = ingestor
        self.report = IngestReport()
        self._offset = 0

    def pump(self) -> None:
        while len(self.bus):
            records = self.bus.poll()
            items = []
            for topic, value in records:
                items.append(Raw(f"bus:{topic}:{self._offset}", value, topic, 0, self._offset))
                self._offset += 1
            # the refused dead-lettered; transient or fatal: raised (the demo stops and says why)
            self.report.merge(self.ingestor.ingest_or_isolate(items))
            self.ingestor.store.flush_marks()  # no offsets here to hold back: marked as it lands


@dataclass
class DemoResult:
    summary: Summary
    truth: dict[str, Any]  # the simulator's own numbers (agent.sim.truth.summary)
    store_dir: Path
    dashboards: list[Path]
    ingest: IngestReport
    seconds: float
    report: Path
    reclaim: dict[str, Any] | None = None  # the reclaim loop's notices and dry-run decisions at the end
    chargeback: chargeback.Bill | None = None  # with a price sheet in the rules config
    energy: dict[str, Any] = field(default_factory=dict)  # rules.energy.summary_json
    rightsize: Rightsizing | None = None  # the MIG right-sizing advice for the run (rules/rightsize.py)
    whatif: dict[str, Any] | None = None  # the what-if table's entries (gpuslo/app/whatif.py demo_whatif)

    def to_json(self) -> dict[str, Any]:
        """The JSON of ``demo --json``: the summary, and the simulator's truth as ``ground_truth``;
        ``energy`` holds the measured energy beside the simulator's, ``chargeback`` the bill, ``rightsize``
        the MIG right-sizing advice, ``whatif`` the recorded queue replayed under other policies."""
        bill = None if self.chargeback is None else self.chargeback.to_json()
        nrg = {"measured": self.energy, "ground_truth": self.truth.get("energy")}
        return {**to_json(self.summary), "reclaim": self.reclaim, "ground_truth": self.truth, "energy": nrg,
                "chargeback": bill, "rightsize": to_json(self.rightsize), "whatif": self.whatif}  # fmt: skip


def prepare_store_dir(path: Path) -> None:
    """The demo owns its store directory: it wipes one it created before, and refuses
    to touch a non-empty directory it did not create."""
    if path.exists() and any(path.iterdir()):
        if not (path / MARKER).exists():
            raise SystemExit(
                f"gpuslo demo: {path} is not empty and was not created by the demo; choose another --out"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("created by gpuslo demo; deleted and recreated on the next run\n")


def prepare_out_dir(path: Path, force: bool = False) -> None:
    """The demo writes its store, dashboards and report into ``path``: only into a directory
    that is new, empty, or one it made before (it leaves a marker), unless ``force``."""
    if path.exists() and not path.is_dir():
        raise SystemExit(f"gpuslo demo: {path} exists and is not a directory; choose another --out")
    if path.exists() and any(path.iterdir()) and not (path / OUT_MARKER).exists() and not force:
        raise SystemExit(
            f"gpuslo demo: {path} is not empty and was not created by the demo: its files would be "
            "overwritten; choose another --out (or give --force)"
        )
    path.mkdir(parents=True, exist_ok=True)
    (path / OUT_MARKER).write_text("created by gpuslo demo; its files are rewritten on the next run\n")


def sim_config_for(rules: RulesConfig, base: SimConfig) -> SimConfig:
    """The simulator uses the same idle and starvation thresholds as the rules it is checked against."""
    return replace(
        base, idle_threshold=rules.idle_threshold, starvation_threshold_s=rules.starvation.threshold_s
    )


def run_demo(
    sim: SimConfig,
    rules: RulesConfig,
    out_dir: Path,
    progress: Callable[[int, int], None] | None = None,
    pump_every_ticks: int = 360,
    force: bool = False,
) -> DemoResult:
    t0 = time.monotonic()
    prepare_out_dir(out_dir, force)
    sim = sim_config_for(rules, sim)
    store_dir = out_dir / "store"
    prepare_store_dir(store_dir)
    store = ChdbStore(store_dir)
    try:
        store.migrate(SCHEMA)
        bus = Bus()
        consumer = BusConsumer(bus, Ingestor(store))
        n = ticks(sim)

        def on_tick(k: int) -> None:
            if k % pump_every_ticks == 0:
                consumer.pump()
            if progress is not None:
                progress(k, n)

        fleet = run_fleet(sim, BusSink(bus), on_tick=on_tick)
        consumer.pump()
        result = rules_summary(store, rules, sim.start_ts, sim.end_ts)
        # what `rules run` would have written every hour (the same service's rounds): the
        # rollups refreshed, the hourly results; then what is firing at the end of the run,
        # recorded (no receivers in the demo: nothing is sent)
        service = RulesService(rules, lambda: store, window_s=3600.0, source="auto",
                               notifier=Notifier(out_dir / "alerts-outbox.jsonl"), actors={})  # fmt: skip
        service.refresh()
        first = (int(sim.start_ts) // 3600 + 1) * 3600
        for t in range(first, int(sim.end_ts) + 1, 3600):
            service.evaluate(t)
        rounds = [*range(first, int(sim.end_ts), 3600), sim.end_ts]  # hourly, and at the end
        notices, reclaimed = demo_rounds(store, rules, rounds)  # dry-run: the demo never acts
        service.alert(result, sim.end_ts, notices)
        # the bill carries the energy it priced (the same figures; one query each, not two)
        bill = (
            None if rules.chargeback is None else chargeback.compute(store, rules, sim.start_ts, sim.end_ts)
        )
        measured_energy = bill.energy if bill else energy.summary_json(store, rules, sim.start_ts, sim.end_ts)
        wcfg = fleet_config(rules, sim.user_gpu_limit, sim.reserve_after_s)
        whatif = demo_whatif(store, sim.start_ts, sim.end_ts, sim.gpus_per_node, wcfg)
        report = out_dir / "report.html"
        page = render_report(store, rules, sim.start_ts, sim.end_ts, bill=bill, whatif=whatif)
        write_outputs({report: page.encode("utf-8")})
        advice = rightsizing(store, sim.start_ts, sim.end_ts)
    finally:
        store.close()
    truth_alerts: list[dict[str, Any]] = []
    for slo in rules.slos:
        if slo.service != sim.service:
            continue
        pairs = [WindowPair(w.severity, w.long, w.short, w.long_s, w.short_s, w.factor) for w in slo.windows]
        truth_alerts += truth_slo_alerts(
            fleet, slo.threshold_ms, slo.objective, pairs, slo.min_requests, rules.eval_step_s
        )
    truth = {
        **truth_summary(fleet, truth_alerts),
        **truth_idle_holders(fleet, rules.reclaim.threshold_for, rounds),
    }
    dashboards = write_dashboards(rules, out_dir / "dashboards")
    return DemoResult(
        result, truth, store_dir, dashboards, consumer.report, time.monotonic() - t0, report, reclaimed,
        bill, measured_energy, advice, whatif,
    )  # fmt: skip


class Progress:
    """A one-line progress display on a terminal; silent elsewhere unless forced."""

    def __init__(self, stream: TextIO = sys.stderr, label: str = "simulating") -> None:
        self.stream = stream
        self.label = label
        self.tty = stream.isatty()
        self._last = -1.0
        self._t0 = time.monotonic()

    def __call__(self, k: int, n: int) -> None:
        pct = 100.0 * k / n
        if self.tty:
            if pct - self._last >= 0.5 or k == n:
                bar = "#" * int(pct / 4)
                self.stream.write(
                    f"\r{self.label} [{bar:<25}] {pct:5.1f}% {time.monotonic() - self._t0:5.1f}s"
                )
                self.stream.flush()
                self._last = pct
            if k == n:
                self.stream.write("\n")
        elif pct - self._last >= 25 or k == n:
            self.stream.write(f"{self.label}: {pct:.0f}% ({time.monotonic() - self._t0:.1f}s)\n")
            self._last = pct

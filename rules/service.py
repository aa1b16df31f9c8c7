"""The rules service: every round, refresh the rollups, evaluate the last window, write the
results to ``rule_results``, step the alerts (queued to the receivers' outboxes, never
waited on); around the rounds, the store opened lazily and reopened after a transient
failure. ``gpuslo rules run`` runs :meth:`RulesService.run`; the embedded stack runs the
same rounds over the hours of its simulated day."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from gpuslo.core.proc import Children
from gpuslo.ingest.store import Store, StoreError
from gpuslo.rules import rawcover, results, rollup
from gpuslo.rules.actions import Actor, default_actors
from gpuslo.rules.alerts import Alert, AlertState, Engine, Notifier, alerts_from_summary, unjudged
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.evaluate import PartFailure, Source, run_part, summary
from gpuslo.rules.model import Summary, to_json
from gpuslo.rules.reclaim import IdleHolder
from gpuslo.rules.reclaim_round import decide, held_notices, judge
from gpuslo.rules.tables import SCHEMA

log = logging.getLogger(__name__)


def wall_clock() -> float:
    return time.time()


class RulesService:
    """Rounds of evaluation over ``[to - window_s, to)``, ``to`` on the last whole minute.

    ``open_store``: called when the service has no store (at the first round, and after a
    transient failure closed it). ``notifier``: the alert receivers; without one no alert is
    stepped. ``flush_s``: after each round, wait up to this long for the deliveries (a
    one-shot run); None: never wait."""

    def __init__(self, cfg: RulesConfig, open_store: Callable[[], Store], *, window_s: float = 3600.0,
                 source: Source = "auto", notifier: Notifier | None = None, resend_s: float = 60.0,
                 flush_s: float | None = None, clock: Callable[[], float] | None = None,
                 actors: Mapping[str, Actor] | None = None, children: Children | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        # the reclaim action's, by scheduler (Slurm's commands run as ``children``: the run's)
        self.actors = default_actors(cfg, children) if actors is None else actors
        self.open_store = open_store
        self.window_s = window_s
        self.source: Source = source
        self.notifier = notifier
        self.resend_s = resend_s
        self.flush_s = flush_s
        self.clock = clock or wall_clock
        self.store: Store | None = None
        self.engine: Engine | None = None
        self.every_s = 0.0  # the rounds' interval (run's): no alert is re-sent sooner
        self._traced: set[str] = set()  # the parts' failures logged with their traceback (once each)

    def connect(self) -> Store:
        """The store, opened (and migrated) when there is none."""
        if self.store is None:
            store = self.open_store()
            try:
                store.migrate(SCHEMA)
                self.engine = self._engine(store)
            except BaseException:
                store.close()
                raise
            self.store = store
        return self.store

    def _engine(self, store: Store) -> Engine | None:
        if self.notifier is None:
            return None
        return Engine(AlertState(store), self.notifier, resend_s=self.resend_s, every_s=self.every_s)

    def refresh(self) -> rollup.RefreshReport | None:
        """The rollups brought up to date (None when evaluating over the raw rows only)."""
        return rollup.refresh(self.connect()) if self.source != "raw" else None

    def evaluate(
        self, to: float, failed: dict[str, PartFailure] | None = None, source: Source | None = None
    ) -> Summary:
        """The summary of ``[to - window_s, to)``, written to ``rule_results`` at ``to``. With
        ``failed``, a part that fails (a query of one SLO, of the incidents; the write of the
        results) is recorded there and the rest still evaluated (:func:`run_part`)."""
        store = self.connect()
        src = source or self.source
        s = summary(store, self.cfg, to - self.window_s, to, source=src, failed=failed, traced=self._traced)
        run_part(store, failed, "rule_results", None, lambda: results.write(store, s, to, self.window_s),
                 self._traced)  # fmt: skip
        return s

    def alert(self, s: Summary, now: float, extra: Sequence[Alert] = ()) -> dict[str, Any] | None:
        """The alerts firing in ``s`` stepped through the engine (state written, notifications
        queued); None without receivers."""
        self.connect()
        if self.engine is None:
            return None
        out = self.engine.step([*alerts_from_summary(s), *extra], now, keep=unjudged(s))
        if self.flush_s is not None and self.notifier is not None:
            self.notifier.flush(self.flush_s)  # a bounded try at the deliveries before reporting them
            out["receivers"] = self.notifier.stats()
        return out

    def round(self) -> dict[str, Any]:
        """One round at the clock's now: refresh, evaluate, write, alert; the summary with
        ``evaluated_at``, ``rollup_refresh`` and ``alerting`` added (its JSON form, as ``rules
        run`` prints it). Each part fails alone: a refresh that fails (a memory limit, a bug met
        by its data) is reported (``rollup_refresh.error``) and the round evaluated over the raw
        rows (the rollups are behind); a part of the evaluation that fails (one SLO, the
        incidents, the results' write) is reported in ``errors`` and the rest still evaluated
        and alerted on, the alerts it would judge kept as they were (:func:`unjudged`). A fatal
        StoreError is raised, and so is a transient one where the store answers nothing (it is
        gone: the store is reopened at the next round), and any failure to open the store or to
        step the alerts; after a round with a transient one among its parts' the store is
        reopened too."""
        store = self.connect()
        failed: dict[str, PartFailure] = {}
        refreshed = run_part(store, failed, "rollup_refresh", None, self.refresh, self._traced)
        now = self.clock()
        to = float(int(now // 60) * 60)
        # the rollups behind (their refresh failed): this round over the raw rows, which they summarize,
        # unless those are gone from part of the window (:meth:`_fallback`)
        evaluated = self.evaluate(
            to, failed, self._fallback(store, to, failed) if "rollup_refresh" in failed else None
        )
        s: dict[str, Any] = to_json(evaluated)
        if refreshed is not None:
            s["rollup_refresh"] = {"node_minutes": refreshed.node_minutes, "seconds": round(refreshed.seconds, 3),
                                   "service_minutes": refreshed.service_minutes}  # fmt: skip
        elif "rollup_refresh" in failed:
            s["rollup_refresh"] = {"error": failed["rollup_refresh"].error}
        judged = self.judge(now, failed)
        alerting = self.alert(evaluated, now, judged.notices)
        told = set(alerting.pop("sent", [])) if alerting is not None else set()  # queued to the receivers
        if judged.error is not None:
            s["reclaim"] = {"error": judged.error}
        elif self.cfg.reclaim.enabled:  # the notices went (or not) first: the grace periods count from them
            s["reclaim"] = self.decide(judged.holders, judged.notices, now, told, failed)
        if alerting is not None:
            s["alerting"] = alerting
        if failed:
            s["errors"] = {part: f.error for part, f in failed.items()}
            if any(f.transient for f in failed.values()):
                self._drop_store()  # a transient store error: a new connection at the next round
        return {"evaluated_at": to, **s}

    def _fallback(self, store: Store, to: float, failed: dict[str, PartFailure]) -> Source:
        """The source of a round whose rollup refresh failed: the raw rows, which the rollups
        summarize; but where the raw rows of part of the window are gone (past the retention, or
        deleted: :func:`rules.rawcover.check`) and the rollups can answer it, the rollups as they
        are, behind by the minutes since their last refresh (the raw rows left gave a fleet, an SLO's
        traffic, a fraction of the window's, as if whole: a burn resolved, CUR and idle GPU-hours
        cut). A failed check (``raw_rows_cover``) leaves the raw rows."""
        frm = to - self.window_s
        c = self.cfg
        if (
            self.source == "raw"
            or rollup.usable(c.idle_threshold, frm, to, c.eval_step_s, c.min_idle_s) is not None
        ):
            return "raw"

        def gone() -> bool:
            try:
                rawcover.check(store, frm, to, "", "the round", keep=lambda x: c.match.ok("cluster", x))
            except rawcover.RawRowsGone as exc:
                log.warning("rules round over the rollups as they are (their refresh failed): %s", exc)
                return True
            return False

        return "rollup" if run_part(store, failed, "raw_rows_cover", False, gone, self._traced) else "raw"

    def judge(self, now: float, failed: dict[str, PartFailure] | None = None) -> _Judged:
        """The reclaim loop's holders and notices (:func:`judge`; none with the loop off). Its
        failure is contained as a part of the round's is (:func:`run_part`, recorded in ``failed``
        as ``reclaim``): logged, reported in the summary, and the notices firing before are kept as
        they are (neither resolved nor re-sent), so the SLO alerts of the round still go out (a
        transient store error of its query, a memory limit met by its holders, failed the whole
        round before: no alert fired or resolved). A fatal store error, or a store that answers
        nothing, is raised."""
        store = self.connect()
        errors: dict[str, PartFailure] = {} if failed is None else failed
        got = run_part(store, errors, "reclaim", None, lambda: judge(store, self.cfg, now), self._traced)
        if got is None:
            return _Judged([], held_notices(self.engine, self.cfg), errors["reclaim"].error)
        return _Judged(*got)

    def decide(
        self, holders: list[IdleHolder], out: list[Alert], now: float, told: set[str],
        failed: dict[str, PartFailure] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The action's decisions (:func:`decide`), contained as :meth:`judge` is
        (``reclaim_actions`` in ``failed``)."""
        store = self.connect()
        errors: dict[str, PartFailure] = {} if failed is None else failed
        got = run_part(store, errors, "reclaim_actions", None,
                       lambda: decide(store, self.cfg, self.actors, holders, out, now, told), self._traced)  # fmt: skip
        if got is None:
            return {"notices": [{"labels": a.labels, "annotations": a.annotations} for a in out],
                    "actions": [], "error": errors["reclaim_actions"].error}  # fmt: skip
        return cast(dict[str, Any], got)

    def run(self, stop: threading.Event, every_s: float, emit: Callable[[dict[str, Any]], None],
            once: bool = False) -> bool:  # fmt: skip
        """Rounds every ``every_s`` until ``stop`` is set (one with ``once``), each summary
        passed to ``emit``. A transient store failure is logged, the store closed and opened
        again at the next round; a fatal one (credentials, database, schema) is raised for the
        supervisor. Any other failure of a round (a bug met by its data) is contained like a
        transient one: logged (its traceback once per kind), the next round tries again.
        True when the last round succeeded."""
        ok = True
        logged: set[str] = set()
        self.every_s = 0.0 if once else every_s
        if self.engine is not None:
            self.engine.every_s = self.every_s
        while not stop.is_set():
            try:
                s = self.round()
            except StoreError as exc:
                ok = False
                if exc.fatal:
                    raise
                log.warning("rules evaluation failed: %s", _first_line(exc))
                if exc.retriable:  # reconnect on the next round
                    self._drop_store()
            except Exception as exc:  # contained: one round's bug must not end the alerting
                ok = False
                kind = type(exc).__name__
                log.warning("rules round failed: %s: %s", kind, _first_line(exc), exc_info=kind not in logged)
                logged.add(kind)
            else:
                ok = "errors" not in s  # a round with a part failed is reported, and not a success
                emit(s)
            if once:
                break
            stop.wait(every_s)
        return ok

    def _drop_store(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store = None
        self.engine = None

    def close(self) -> None:
        """Close the store (if this service opened it) and stop the receivers' workers."""
        self._drop_store()
        if self.notifier is not None:
            self.notifier.close()


@dataclass(frozen=True)
class _Judged:
    """The reclaim loop's judgement of a round: the idle holders and their notices; or, where
    it failed (``error``), no holder and the notices firing before, kept as they are."""

    holders: list[IdleHolder]
    notices: list[Alert]
    error: str | None = None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]

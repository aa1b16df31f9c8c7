"""One round of the idle-reclaim loop, as the rules service and the demo run it: the idle
holders at ``now`` and their notices (:func:`judge`; stepped with the other alerts by the
caller), then the action's decisions (:func:`decide`, recorded in ``reclaim_actions``), which
count each holder's grace period from the first round its notice went to the receivers."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from gpuslo.ingest.store import Store
from gpuslo.rules.actions import ActionLog, Actor, Reclaimer
from gpuslo.rules.alerts import Alert, Engine
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.reclaim import ALERTNAME, IdleHolder, idle_holders, notices


def judge(
    store: Store, cfg: RulesConfig, now: float, cluster: str = ""
) -> tuple[list[IdleHolder], list[Alert]]:
    """The holders idle beyond their threshold at ``now`` and their notices (none with the loop off)."""
    if not cfg.reclaim.enabled:
        return [], []
    holders = idle_holders(store, cfg, now, cluster)
    return holders, notices(cfg, holders)


def decide(store: Store, cfg: RulesConfig, actors: Mapping[str, Actor], holders: Sequence[IdleHolder],
           out: Sequence[Alert], now: float, told: Collection[str] | None) -> dict[str, Any]:  # fmt: skip
    """The action's decisions on ``holders`` at ``now`` and the round's JSON (``out``: their
    notices, in the holders' order). ``told``: the fingerprints of the notices the engine queued
    to the receivers this round (None: all of them), recorded as ``noticed`` first; a grace
    period counts from the first round a notice of the idle run went."""
    reclaimer = Reclaimer(cfg, ActionLog(store), actors)
    reclaimer.noticed(
        [h for h, a in zip(holders, out, strict=True) if told is None or a.fingerprint in told], now
    )
    actions = reclaimer.step(holders, now)
    return {
        "notices": [{"labels": a.labels, "annotations": a.annotations} for a in out],
        "actions": [{k: r[k] for k in ("at", "cluster", "scheduler", "job", "queue", "user", "action", "mode",
                                       "outcome", "reason", "attempt")} for r in actions],
    }  # fmt: skip


def reclaim_round(store: Store, cfg: RulesConfig, actors: Mapping[str, Actor], now: float,
                  cluster: str = "", sent: bool = True) -> tuple[list[Alert], dict[str, Any] | None]:  # fmt: skip
    """(the notices, their JSON with the decisions) at ``now``, the notices taken as sent this
    round (``sent``); ([], None) with the loop off."""
    if not cfg.reclaim.enabled:
        return [], None
    holders, out = judge(store, cfg, now, cluster)
    return out, decide(store, cfg, actors, holders, out, now, None if sent else ())


def dry_run_round(store: Store, cfg: RulesConfig, now: float) -> tuple[list[Alert], dict[str, Any] | None]:
    """:func:`reclaim_round` that never acts: an action ``on`` is taken as ``dry-run`` (the demo's)."""
    act = cfg.reclaim.action
    if act.mode == "on":
        dry = cfg.reclaim.model_copy(update={"action": act.model_copy(update={"mode": "dry-run"})})
        cfg = cfg.model_copy(update={"reclaim": dry})
    return reclaim_round(store, cfg, {}, now)


def demo_rounds(
    store: Store, cfg: RulesConfig, times: Sequence[float]
) -> tuple[list[Alert], dict[str, Any] | None]:
    """The demo's rounds (dry-run) at ``times``: the notices of the last, and per round the jobs
    noticed; every decision of the rounds."""
    if not cfg.reclaim.enabled:
        return [], None
    rounds, actions = [], []
    notices: list[Alert] = []
    last: dict[str, Any] = {}
    for t in map(float, times):
        notices, out = dry_run_round(store, cfg, t)
        last = out or {}
        rounds.append(
            {"at": t, "jobs": sorted(a.labels["job"] for a in notices), "notices": last.get("notices", [])}
        )
        actions += last.get("actions", [])
    return notices, {"notices": last.get("notices", []), "actions": actions, "rounds": rounds}


def held_notices(engine: Engine | None, cfg: RulesConfig) -> list[Alert]:
    """The notices firing now, as they are (for a round whose judgement failed: kept, not resolved)."""
    if engine is None:
        return []
    return [Alert(dict(r["labels"]), dict(r["annotations"]), resend_s=cfg.reclaim.resend_s)
            for r in engine.state.firing().values() if r["alertname"] == ALERTNAME]  # fmt: skip

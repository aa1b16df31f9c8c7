"""Alert lifecycle and delivery.

Each evaluation turns the rules' state at ``now`` into a set of active alerts (SLO burn
conditions, open starvation incidents). Compared with the persisted state (table
``alert_state`` in the store, keyed by the alert's fingerprint), that gives transitions:
new → firing (notify), still firing (re-notify every ``resend_s`` so Alertmanager keeps
it), gone → resolved (notify with ``endsAt``). State is written to the store before
notifications are queued, so a restarted engine neither pages twice nor forgets a
resolve.

Notifications go through an outbox file (JSON lines, appended, rewritten atomically after
a delivery round): undelivered ones are retried with backoff and survive restarts; every
failure is counted and logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ingest.store import Store

log = logging.getLogger(__name__)

ALERT_STATE_DDL = """CREATE TABLE IF NOT EXISTS alert_state
(
    fingerprint String,
    alertname LowCardinality(String),
    labels Map(String, String),
    annotations Map(String, String),
    state LowCardinality(String),
    started_at DateTime64(3, 'UTC'),
    ended_at Nullable(DateTime64(3, 'UTC')),
    last_sent_at DateTime64(3, 'UTC'),
    updated_at DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY fingerprint"""


def fingerprint(labels: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Alert:
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


class AlertState:
    def __init__(self, store: Store) -> None:
        self.store = store
        store.execute(ALERT_STATE_DDL)

    def firing(self) -> dict[str, dict[str, Any]]:
        rows = self.store.query(
            "SELECT fingerprint, alertname, labels, annotations, toFloat64(started_at) AS started, "
            "toFloat64(last_sent_at) AS last_sent FROM alert_state FINAL WHERE state = 'firing'"
        )
        return {r["fingerprint"]: r for r in rows}

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        cols: dict[str, list[Any]] = {k: [] for k in ("fingerprint", "alertname", "labels", "annotations", "state",
                                                       "started_at", "ended_at", "last_sent_at", "updated_at")}  # fmt: skip
        for r in rows:
            for k in cols:
                v = r.get(k)
                if k in ("labels", "annotations"):
                    v = list((v or {}).items())
                cols[k].append(v)
        self.store.insert("alert_state", cols)


class Outbox:
    """Undelivered notifications on disk: (target, payload) JSON lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, target: str, payload: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"target": target, "payload": payload}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def pending(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            return []

    def replace(self, items: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(i) + "\n" for i in items))
        os.replace(tmp, self.path)


Post = Callable[[str, bytes, float], int]


def http_post(url: str, body: bytes, timeout_s: float) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return int(r.status)


class Notifier:
    """Delivers to Alertmanager (``/api/v2/alerts``) and/or a Slack-compatible webhook."""

    def __init__(self, outbox: Path, alertmanager: str | None = None, webhook: str | None = None,
                 post: Post = http_post, timeout_s: float = 5.0, generator_url: str = "") -> None:  # fmt: skip
        self.outbox = Outbox(outbox)
        self.alertmanager = alertmanager.rstrip("/") if alertmanager else None
        self.webhook = webhook
        self.post = post
        self.timeout_s = timeout_s
        self.generator_url = generator_url
        self.sent = 0
        self.failures = 0
        self._backoff_s = 0.0
        self._next_try = 0.0

    @property
    def has_targets(self) -> bool:
        return bool(self.alertmanager or self.webhook)

    def queue(self, alerts: Sequence[tuple[Alert, float, float | None]]) -> None:
        """(alert, startsAt, endsAt or None while firing)."""
        if not alerts:
            return
        if self.alertmanager:
            payload = [
                {"labels": a.labels, "annotations": a.annotations, "startsAt": _iso(s), "generatorURL": self.generator_url,
                 **({"endsAt": _iso(e)} if e is not None else {})}
                for a, s, e in alerts
            ]  # fmt: skip
            self.outbox.add(self.alertmanager + "/api/v2/alerts", payload)
        if self.webhook:
            lines = [
                f"{'RESOLVED' if e is not None else 'FIRING'} [{a.labels.get('severity', '')}] {a.labels.get('alertname')}"
                f" {a.labels.get('slo', a.labels.get('queue', ''))} {a.annotations.get('summary', '')}"
                for a, s, e in alerts
            ]
            self.outbox.add(self.webhook, {"text": "\n".join(lines)})

    def deliver(self, now: float | None = None) -> int:
        """Try everything in the outbox once (respecting backoff); returns what is left."""
        now = time.monotonic() if now is None else now
        items = self.outbox.pending()
        if not items or now < self._next_try:
            return len(items)
        left = []
        for i, item in enumerate(items):
            try:
                status = self.post(item["target"], json.dumps(item["payload"]).encode(), self.timeout_s)
                if status >= 300:
                    raise urllib.error.HTTPError(item["target"], status, "rejected", None, None)  # type: ignore[arg-type]
                self.sent += 1
            except (OSError, urllib.error.URLError, ValueError) as exc:
                self.failures += 1
                if self._backoff_s == 0.0:
                    log.warning(
                        "alert delivery to %s failed (%s); kept in the outbox and retried",
                        item["target"],
                        exc,
                    )
                self._backoff_s = min(300.0, max(1.0, self._backoff_s * 2))
                self._next_try = now + self._backoff_s
                left = items[i:]  # keep order: stop at the first failure
                break
        else:
            self._backoff_s = 0.0
        self.outbox.replace(left)
        return len(left)


@dataclass
class Engine:
    """One evaluation step: active alerts in, transitions persisted and notified."""

    state: AlertState
    notifier: Notifier
    resend_s: float = 60.0

    def step(self, active: Sequence[Alert], now: float) -> dict[str, int]:
        firing = self.state.firing()
        by_fp = {a.fingerprint: a for a in active}
        # with no receiver nothing is sent: record the state, not a delivery, so that an
        # engine with receivers later sends these at once
        sent_at = now if self.notifier.has_targets else 0.0
        rows: list[dict[str, Any]] = []
        out: list[tuple[Alert, float, float | None]] = []
        new = resent = resolved = 0
        for fp, a in by_fp.items():
            old = firing.get(fp)
            if old is None:
                new += 1
                started = now
            elif now - float(old["last_sent"]) >= self.resend_s:
                resent += 1
                started = float(old["started"])
            else:
                continue
            out.append((a, started, None))
            rows.append({"fingerprint": fp, "alertname": a.labels.get("alertname", ""), "labels": a.labels,
                         "annotations": a.annotations, "state": "firing", "started_at": started, "ended_at": None,
                         "last_sent_at": sent_at, "updated_at": now})  # fmt: skip
        for fp, old in firing.items():
            if fp in by_fp:
                continue
            resolved += 1
            a = Alert(dict(old["labels"]), dict(old["annotations"]))
            out.append((a, float(old["started"]), now))
            rows.append({"fingerprint": fp, "alertname": old["alertname"], "labels": a.labels, "annotations": a.annotations,
                         "state": "resolved", "started_at": float(old["started"]), "ended_at": now, "last_sent_at": sent_at,
                         "updated_at": now})  # fmt: skip
        self.state.write(rows)  # first the state: a crash after this neither re-pages nor forgets
        self.notifier.queue(out)
        left = self.notifier.deliver()
        return {"new": new, "resent": resent, "resolved": resolved, "undelivered": left}


def alerts_from_summary(summary: dict[str, Any], starvation_page: bool = False) -> list[Alert]:
    """The alerts firing at the end of an evaluated window: SLO burn alerts still open
    (``ended`` is None) and open starvation incidents (ticket, or page if asked)."""
    out = []
    budget = {s["slo"]: s.get("budget_remaining") for s in summary.get("slos", [])}
    for a in summary.get("slo_alerts", []):
        if a.get("ended") is not None:
            continue
        b = budget.get(a["slo"])
        out.append(Alert(
            {"alertname": "GpusloSLOBurn", "severity": a["severity"], "slo": a["slo"], "service": a["service"],
             "window": f"{a['long_window']}/{a['short_window']}"},
            {"summary": f"{a['slo']}: error budget burning {a['peak_burn_long']:.1f}x over {a['long_window']} "
                        f"and {a['peak_burn_short']:.1f}x over {a['short_window']} (threshold {a['factor']:g}x)",
             "burn_long": f"{a['peak_burn_long']:.3f}", "burn_short": f"{a['peak_burn_short']:.3f}",
             "budget_remaining": "" if b is None else f"{b:.4f}"},
        ))  # fmt: skip
    for i in summary.get("starvation_incidents", []):
        if i.get("closed") is not None:
            continue
        out.append(Alert(
            {"alertname": "GpusloStarvation", "severity": "page" if starvation_page else "ticket",
             "cluster": i["cluster"], "queue": i["queue"], "request": str(i["request_id"]), "cause": i["cause"]},
            {"summary": f"{i['gpus']:g} GPUs for {i['user'] or i['account'] or i['request_id']} pending "
                        f"{(i['wait_s'] or 0) / 60:.0f} min in {i['queue']} ({i['cause']})"},
        ))  # fmt: skip
    return out

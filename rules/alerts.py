"""Alert lifecycle and delivery.

Each evaluation turns the rules' state at ``now`` into a set of active alerts (SLO burn
conditions, open starvation incidents). Compared with the persisted state (table
``alert_state`` in the store, keyed by the alert's fingerprint), that gives transitions:
new → firing (notify), still firing (re-notify every ``resend_s``; each firing notification
to Alertmanager carries an ``endsAt`` 4 re-send intervals ahead, so that Alertmanager neither
resolves it by its ``resolve_timeout`` meanwhile nor keeps it for ever if the engine stops),
gone → resolved (notify with ``endsAt``). The transitions are queued to every receiver's
outbox (fsynced) before the state is written to the store: a crash between the two, or
outboxes none of which could be written (a full disk), leave the state as it was, so the next
step derives the same transitions and queues them again. A restarted engine never forgets a
resolve or a page; what a receiver already took may go to it twice (at least once). Where some
outboxes took a step's notifications and others could not, the state is written (the others
are not sent the same again at every step) and the failing receivers' loss is logged, counted.

Notifications go to each receiver's own on-disk outbox and are delivered by that
receiver's worker thread (:mod:`rules.delivery`): transient failures are retried with
backoff and survive restarts, permanent ones are reported and counted, and one receiver's
trouble never delays another or the evaluation.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import time
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuslo.ingest.store import Store
from gpuslo.rules.delivery import Policy, ReceiverQueue, Worker
from gpuslo.rules.model import Incident, SloAlert, Summary, why_not_evaluable, why_windows_unjudged
from gpuslo.rules.outbox import Outbox, secure_dir
from gpuslo.rules.receivers import Post, Receiver, http_post

log = logging.getLogger(__name__)


def fingerprint(labels: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Alert:
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    resend_s: float | None = None  # its own repeat interval (the reclaim notices'); None: the engine's
    hold_s: float | None = None  # firing: how long Alertmanager holds it (endsAt); None: 4 re-sends

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


class AlertState:
    def __init__(self, store: Store) -> None:
        self.store = store  # its table is in the store's schema (rules/tables.py ALERT_STATE)

    def firing(self) -> dict[str, dict[str, Any]]:
        rows = self.store.query(
            "SELECT fingerprint, alertname, labels, annotations, toFloat64(started_at) AS started, "
            "toFloat64(last_sent_at) AS last_sent FROM alert_state FINAL WHERE state = 'firing'"
        )
        return {r["fingerprint"]: r for r in rows}

    def latest(self) -> float:
        """The newest ``updated_at`` of any row (0 with none): the version a new row must pass
        to replace it (ReplacingMergeTree keeps the greatest), whatever the clock did since."""
        rows = self.store.query("SELECT toFloat64(max(updated_at)) AS v FROM alert_state")
        return float(rows[0]["v"] or 0.0) if rows else 0.0

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


def _claim_legacy_outbox(outbox: Path) -> Path | None:
    """The single outbox file of earlier versions (``{"target": URL, "payload"}`` lines, the
    URL in clear), at ``outbox`` itself (given explicitly) or beside it (the old default,
    ``alerts-outbox.jsonl``), renamed aside so that the directory can take its path; a claim
    left by a crash during the move is taken up again. Only a file that reads as such an outbox
    is taken: another file at ``outbox`` is an error (a mistaken ``--outbox`` once turned an
    operator's file into an empty directory), one beside it is left alone."""
    claimed = outbox.with_name(outbox.name + ".migrating")
    for p in (outbox, outbox.with_name(outbox.name + ".jsonl")):
        if p.is_file() and not claimed.exists():
            if not _reads_as_legacy_outbox(p):
                if p == outbox:
                    raise OSError(errno.EEXIST, "is a file, not an alert outbox of an earlier version; "
                                                "give a directory (or a path that does not exist yet)")  # fmt: skip
                continue
            os.replace(p, claimed)
    return claimed if claimed.is_file() else None


LEGACY_OUTBOX_MAX_BYTES = 256 * 2**20  # an earlier version's outbox held at most 10,000 notifications


def _reads_as_legacy_outbox(path: Path) -> bool:
    """Every line an object with ``target`` and ``payload`` (a last line torn by a crash, and
    blank ones, aside); empty counts (an outbox with nothing pending)."""
    try:
        if path.stat().st_size > LEGACY_OUTBOX_MAX_BYTES:
            return False
        lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()]
    except OSError:
        return False
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and i > 0:  # torn by a crash
                continue
            return False
        if not isinstance(rec, dict) or "target" not in rec or "payload" not in rec:
            return False
    return True


def _legacy_records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _lock_dir(directory: Path) -> int:
    """One process per outbox directory: two engines appending to the same outboxes would
    each send the other's notifications (OSError EBUSY when another holds it)."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(
            errno.EBUSY, "in use by another process (one `rules run` per outbox directory)"
        ) from None
    return fd


WEBHOOK_TEXT_MAX = 3500  # characters per webhook message (Slack truncates or refuses longer ones)
# a firing alert tells Alertmanager it ends this many re-send intervals ahead, as Prometheus does:
# re-sent before that, it stays firing whatever Alertmanager's resolve_timeout (5 min by default,
# less than the reclaim notices' 4 h); never re-sent (the engine stopped), it resolves then
FIRING_HOLD_RESENDS = 4
# the least hold where the evaluations' cadence is unknown (``rules run --once`` from a
# scheduler: each run a new engine) and no earlier send of the alert tells it
UNKNOWN_CADENCE_HOLD_S = 3600.0


# Slack's mrkdwn reads these three as markup: they must be sent as entities (Slack, "Formatting
# text for app surfaces": escaping text); a name holding `<!channel>` otherwise pinged everyone,
# `<https://...|text>` showed a link, and `a < b & c` lost text
_SLACK_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def webhook_text(text: str, limit: int) -> str:
    """``text`` (alert labels and annotations: configured names, scheduler queues and users) as
    one line of literal text in a Slack-compatible message: ``&``, ``<``, ``>`` escaped, line
    breaks and other control characters as blanks (one line per alert), cut at ``limit``
    characters as sent (never inside an entity)."""
    out: list[str] = []
    size = 0
    for c in text:
        t = _SLACK_ESCAPES.get(c) or (" " if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c)
        if size + len(t) > limit:
            break
        out.append(t)
        size += len(t)
    return "".join(out)


@dataclass(frozen=True)
class Queued:
    """What :meth:`Notifier.deliver` did: notifications appended to the outboxes, those no
    outbox took (its file could not be written: a full disk), and the receivers whose outbox
    took every one of the step's notifications (a webhook's may be several messages)."""

    queued: int
    failed: int
    whole: int = 0


def outbox_file(directory: Path, receiver: Receiver) -> Path:
    return directory / f"{receiver.name}.jsonl"


class Notifier:
    """Formats notifications for each receiver (Alertmanager ``/api/v2/alerts``, or a
    Slack-compatible webhook) and hands them to that receiver's queue and worker
    (:mod:`rules.delivery`). :meth:`queue` only appends to the outboxes: it never waits on a
    receiver."""

    def __init__(self, outbox: Path, receivers: Sequence[Receiver] = (), post: Post = http_post,
                 policy: Policy | None = None, generator_url: str = "", start: bool = True) -> None:  # fmt: skip
        self.outbox_dir = outbox
        self.policy = policy or Policy()
        self.generator_url = generator_url
        self.receivers = tuple(dict((r.name, r) for r in receivers).values())  # the same URL twice: once
        self.queues: dict[str, ReceiverQueue] = {}
        self.workers: dict[str, Worker] = {}
        self._lock_fd: int | None = None
        if not self.receivers:
            return
        legacy_file = _claim_legacy_outbox(outbox)
        legacy = _legacy_records(legacy_file) if legacy_file else []
        secure_dir(outbox)
        self._lock_fd = _lock_dir(outbox)
        moved = 0
        for r in self.receivers:
            ob = Outbox(outbox_file(outbox, r), self.policy.max_pending)
            self.queues[r.name] = ReceiverQueue(r, ob, self.policy, post)
            for rec in legacy:
                if rec.get("target") in (r.url, r.url.rstrip("/") + "/api/v2/alerts"):
                    moved += self.queues[r.name].put(rec.get("payload"))
            if len(ob):
                log.warning("alert outbox of %s (%s): %d notification(s) pending from before; sending them",
                            r.name, r.redacted, len(ob))  # fmt: skip
        if legacy_file is not None:  # moved (durably): only now the old file goes
            legacy_file.unlink()
            log.warning("alert outbox %s of an earlier version (one file, URLs in clear): %d of %d notification(s) "
                        "moved to the receivers' outboxes in %s, the rest had no configured receiver",
                        legacy_file, moved, len(legacy), outbox)  # fmt: skip
        self._report_orphans()
        self.workers = {name: Worker(q) for name, q in self.queues.items()}
        if start:
            for w in self.workers.values():
                w.start()

    def _report_orphans(self) -> None:
        known = {outbox_file(self.outbox_dir, r).name for r in self.receivers}
        for f in sorted(self.outbox_dir.glob("*.jsonl")):
            if f.name not in known and f.stat().st_size:
                log.warning("alert outbox %s belongs to a receiver no longer configured; left in place", f)

    @property
    def has_targets(self) -> bool:
        return bool(self.receivers)

    def payloads(self, receiver: Receiver, alerts: Sequence[tuple[Alert, float, float | None]],
                 now: float | None = None) -> list[Any]:  # fmt: skip
        """The notifications for ``receiver``: Alertmanager takes every alert in one POST (a
        firing one with ``endsAt`` ``FIRING_HOLD_RESENDS`` × its ``resend_s`` after ``now``, when
        both are known); a webhook message holds at most ``WEBHOOK_TEXT_MAX`` characters (Slack
        answers 400 ``msg_too_long`` beyond its limit: a permanent failure), so many alerts are split."""
        if receiver.kind == "alertmanager":
            return [[
                {"labels": a.labels, "annotations": a.annotations, "startsAt": _iso(s), "generatorURL": self.generator_url,
                 **({"endsAt": _iso(end)} if (end := _ends_at(a, s, e, now)) is not None else {})}
                for a, s, e in alerts
            ]]  # fmt: skip
        lines = [
            webhook_text(
                f"{'RESOLVED' if e is not None else 'FIRING'} [{a.labels.get('severity', '')}] {a.labels.get('alertname')}"
                f" {a.labels.get('slo', a.labels.get('queue', ''))} {a.annotations.get('summary', '')}",
                WEBHOOK_TEXT_MAX,
            )
            for a, s, e in alerts
        ]
        chunks: list[list[str]] = [[]]
        size = 0
        for line in lines:
            if chunks[-1] and size + 1 + len(line) > WEBHOOK_TEXT_MAX:
                chunks.append([])
                size = 0
            chunks[-1].append(line)
            size += len(line) + 1
        return [{"text": "\n".join(c)} for c in chunks]

    def queue(self, alerts: Sequence[tuple[Alert, float, float | None]], now: float | None = None) -> int:
        """(alert, startsAt, endsAt or None while firing); the number of notifications queued."""
        return self.deliver(alerts, now).queued

    def deliver(
        self, alerts: Sequence[tuple[Alert, float, float | None]], now: float | None = None
    ) -> Queued:
        """:meth:`queue`, saying also how many notifications no outbox took and how many
        receivers took all of theirs."""
        queued = failed = whole = 0
        if not alerts:
            return Queued(0, 0)
        for r in self.receivers:
            took = [self.queues[r.name].put(payload) for payload in self.payloads(r, alerts, now)]
            queued += sum(took)
            failed += len(took) - sum(took)
            whole += all(took)
            if r.name in self.workers:
                self.workers[r.name].wake()
        return Queued(queued, failed, whole)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {name: {"receiver": q.receiver.redacted, **q.snapshot()} for name, q in self.queues.items()}

    def flush(self, timeout_s: float) -> bool:
        """Wait until every receiver is idle (empty, or backing off after a failure) or
        ``timeout_s`` passed; True when all are idle. For ``rules run --once``."""
        deadline = time.monotonic() + timeout_s
        while not all(w.idle for w in self.workers.values()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the workers; an attempt still in flight after ``wait_s`` is abandoned (its
        notification stays in the outbox and goes again at the next start)."""
        for w in self.workers.values():
            w.stop()
        end = time.monotonic() + min(wait_s, self.policy.deadline_s + 1.0)
        for w in self.workers.values():
            w.join(max(0.0, end - time.monotonic()))
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the directory's lock
            self._lock_fd = None


@dataclass
class Engine:
    """One evaluation step: active alerts in, transitions persisted and notified."""

    state: AlertState
    notifier: Notifier
    resend_s: float = 60.0
    every_s: float = (
        0.0  # the evaluation interval (0: unknown): an alert is re-sent no sooner than its next step
    )
    _last_step: float | None = field(default=None, repr=False)

    def _hold(self, a: Alert, old: dict[str, Any] | None, now: float) -> float:
        """How long Alertmanager holds a firing notification (its ``endsAt``): four times the
        longest of its re-send interval, the evaluation interval, the time since this engine's
        last step and since the alert's last send (a slow round, a scheduler's ``--once`` runs),
        and at least an hour where the cadence is unknown. Shorter, Alertmanager resolved a
        firing alert between two runs and it fired again at the next (a flap each run)."""
        gaps = [a.resend_s or self.resend_s, self.every_s]
        if self._last_step is not None and now > self._last_step:
            gaps.append(now - self._last_step)
        if old is not None and 0 < float(old["last_sent"]) < now:
            gaps.append(now - float(old["last_sent"]))
        hold = FIRING_HOLD_RESENDS * max(gaps)
        return hold if self.every_s > 0 else max(hold, UNKNOWN_CADENCE_HOLD_S)

    def step(
        self, active: Sequence[Alert], now: float, keep: Sequence[Mapping[str, str]] = ()
    ) -> dict[str, Any]:
        """``active``: what fires now; the rest of what fired resolves, except an alert whose
        labels hold every label of one of ``keep`` (what this evaluation could not judge, such as
        the burn alerts of an SLO not evaluable now): it stays as it was, re-sent as due."""
        firing = self.state.firing()
        active = [*active]
        fps = {a.fingerprint for a in active}
        for fp, was in firing.items():
            labels = dict(was["labels"])
            if fp not in fps and any(all(labels.get(k) == v for k, v in m.items()) for m in keep):
                active.append(Alert(labels, dict(was["annotations"])))
        by_fp = {a.fingerprint: replace(a, resend_s=max(a.resend_s or self.resend_s, self.every_s))
                 for a in active}  # fmt: skip
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
            elif now - float(old["last_sent"]) >= (a.resend_s or self.resend_s) or now < float(
                old["last_sent"]
            ):
                resent += 1
                started = float(old["started"])
            else:
                continue
            out.append((replace(a, hold_s=self._hold(a, old, now)), started, None))
            rows.append({"fingerprint": fp, "alertname": a.labels.get("alertname", ""), "labels": a.labels,
                         "annotations": a.annotations, "state": "firing", "started_at": started, "ended_at": None,
                         "last_sent_at": sent_at, "updated_at": now})  # fmt: skip
        for fp, old in firing.items():
            if fp in by_fp:
                continue
            resolved += 1
            a = Alert(dict(old["labels"]), dict(old["annotations"]))
            started = float(old["started"])
            ended = max(now, started)  # a clock stepped back: Alertmanager refuses an end before the start
            out.append((a, started, ended))
            rows.append({"fingerprint": fp, "alertname": old["alertname"], "labels": a.labels, "annotations": a.annotations,
                         "state": "resolved", "started_at": started, "ended_at": ended, "last_sent_at": sent_at,
                         "updated_at": now})  # fmt: skip
        # first the outboxes (appended, fsynced; delivered by each receiver's worker), then the
        # state: a crash between the two queues the same transitions again at the next step (a
        # receiver may get one twice), never loses one; a notification no outbox took leaves the
        # state as it was, for the next step to queue again
        q = self.notifier.deliver(out, now)
        self._last_step = now
        # a clock set back would write versions older than the rows they replace, and lose
        # (1.5 ms past the newest: the column keeps whole milliseconds, cut, not rounded: + 0.001
        # in floating point landed just short of the next one and tied with the newest)
        version = max(now, self.state.latest() + 0.0015) if rows else now
        recorded = not q.failed or q.whole > 0
        if not recorded:  # no receiver took the whole step (a full disk): all of it again next step
            log.error("%d alert notification(s) could not be queued (no receiver's outbox took them all); the "
                      "alerts' state is left as it was, so the next evaluation queues them again", q.failed)  # fmt: skip
        else:
            # a receiver took every transition: recorded, so that it is not sent the same again
            # at every step; the receivers whose outbox failed lost some (logged, counted)
            self.state.write([{**r, "updated_at": version} for r in rows])
        sent = (
            sorted(a.fingerprint for a, _, e in out if e is None)
            if recorded and self.notifier.has_targets
            else []
        )
        return {"new": new, "resent": resent, "resolved": resolved, "queued": q.queued, "unqueued": q.failed,
                "recorded": recorded, "sent": sent, "receivers": self.notifier.stats()}  # fmt: skip


def _ends_at(a: Alert, started: float, ended: float | None, now: float | None) -> float | None:
    """The ``endsAt`` Alertmanager gets: the end of a resolved alert; a firing one's hold
    (``hold_s``, else ``FIRING_HOLD_RESENDS`` re-sends) past ``now``, never from before its
    start (a clock set back: Alertmanager refuses an end before the start)."""
    if ended is not None:
        return ended
    if now is None:
        return None
    hold = a.hold_s or (FIRING_HOLD_RESENDS * a.resend_s if a.resend_s else 0.0)
    return max(now, started) + hold if hold else None


def alerts_from_summary(summary: Summary, starvation_page: bool = False) -> list[Alert]:
    """The alerts firing at the end of an evaluated window: SLO burn alerts still open
    (``ended`` is None), open starvation incidents (ticket, or page if asked), and a ticket per
    SLO not evaluable (:func:`not_evaluable`; its burn alerts are kept: :func:`unjudged`)."""
    budget = {s.slo: s.budget_remaining for s in summary.slos}
    # a window pair not judged now neither fires nor resolves: its alert stays as it was (unjudged)
    skip = {(s.slo, w) for s in summary.slos for w in s.unjudged_windows}
    out = [_burn_alert(a, budget.get(a.slo)) for a in summary.slo_alerts
           if a.ended is None and (a.slo, f"{a.long_window}/{a.short_window}") not in skip]  # fmt: skip
    sev = "page" if starvation_page else "ticket"
    out += [_starvation_alert(i, sev) for i in summary.starvation_incidents if i.closed is None]
    return out + not_evaluable(summary)


def not_evaluable(summary: Summary) -> list[Alert]:
    """A ticket for each SLO the evaluation cannot judge (:func:`~gpuslo.rules.model.why_not_evaluable`:
    a service redeployed with other buckets, whose histograms stopped or never came), or only in
    part (:func:`~gpuslo.rules.model.why_windows_unjudged`: rows too seldom for a short window), naming why."""
    labels = {"alertname": "GpusloSLONotEvaluable", "severity": "ticket"}
    to = summary.window.to
    return [
        Alert({**labels, "slo": s.slo, "service": s.service}, {"summary": f"{s.slo}: {why}"[:1000]})
        for s in summary.slos
        if (why := why_not_evaluable(s, to) or why_windows_unjudged(s))
    ]


def unjudged(summary: Summary) -> list[dict[str, str]]:
    """The firing alerts this evaluation cannot judge (``Engine.step``'s ``keep``): the burn
    alerts of an SLO not evaluable now, and those of its window pairs not judged now (its rows too
    seldom for their short window: ``unjudged_windows``). They resolved, so a page went quiet
    because the service's histograms changed or stopped, not because its budget stopped burning
    (or, every interval of a service's rows, fired and resolved again); and, where the
    evaluation of the starvation incidents failed (``summary.errors``), the open incidents' alerts
    (they resolved, and paged again at the next evaluation that worked)."""
    to = summary.window.to
    keep = [{"alertname": "GpusloSLOBurn", "slo": s.slo} for s in summary.slos if why_not_evaluable(s, to)]
    keep += [{"alertname": "GpusloSLOBurn", "slo": s.slo, "window": w} for s in summary.slos
             if not why_not_evaluable(s, to) for w in s.unjudged_windows]  # fmt: skip
    return keep + ([{"alertname": "GpusloStarvation"}] if "starvation" in summary.errors else [])


def _burn_alert(a: SloAlert, budget: float | None) -> Alert:
    return Alert(
        {"alertname": "GpusloSLOBurn", "severity": a.severity, "slo": a.slo, "service": a.service,
         "window": f"{a.long_window}/{a.short_window}"},
        {"summary": f"{a.slo}: error budget burning {a.peak_burn_long:.1f}x over {a.long_window} "
                    f"and {a.peak_burn_short:.1f}x over {a.short_window} (threshold {a.factor:g}x)",
         "burn_long": f"{a.peak_burn_long:.3f}", "burn_short": f"{a.peak_burn_short:.3f}",
         "budget_remaining": "" if budget is None else f"{budget:.4f}"},
    )  # fmt: skip


def _starvation_alert(i: Incident, severity: str) -> Alert:
    return Alert(
        {"alertname": "GpusloStarvation", "severity": severity,
         "cluster": i.cluster, "queue": i.queue, "request": str(i.request_id), "cause": i.cause},
        {"summary": f"{i.gpus:g} GPUs for {i.user or i.account or i.request_id} pending "
                    f"{(i.wait_s or 0) / 60:.0f} min in {i.queue} ({i.cause})"},
    )  # fmt: skip

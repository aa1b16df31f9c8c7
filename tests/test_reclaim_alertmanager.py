"""Idle-holder notices through the alert engine to a real Alertmanager, routed by ``user`` with
the routing example of docs/alerting.md, and to a webhook; re-sent at ``reclaim.resend_s``,
resolved when the job is active again."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.alerts import AlertState, Engine, Notifier
from gpuslo.rules.config import parse
from gpuslo.rules.receivers import Receiver
from gpuslo.rules.reclaim_round import reclaim_round
from tests.reclaim_fleet import ACTIVE, IDLE, Holder, batches
from tests.servers import receivers as rx
from tests.servers.alertmanager import Alertmanager
from tests.test_alerts import FAST, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _routing_example(alice_url: str) -> str:
    """The Alertmanager configuration of docs/alerting.md (its routing example), alice's
    receiver pointed at a local webhook."""
    doc = (ROOT / "docs/alerting.md").read_text()
    text = doc[doc.index("**Routing by user or team.**") :]
    block = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert block is not None
    return block.group(1).replace("http://127.0.0.1:9/alice", alice_url)


def test_notices_reach_alertmanager_routed_by_user_and_resolve(
    store: ChdbStore, tmp_path: Path, make_alertmanager: Callable[..., Alertmanager]
) -> None:
    alice_hook, slack = rx.Receiver(), rx.Receiver()
    am = make_alertmanager(tmp_path / "am", _routing_example(alice_hook.url + "/alice"))
    am.start()
    try:
        now = time.time() - 120  # Alertmanager honours startsAt/endsAt literally: keep them past
        b = now - 3600
        cfg = parse({"reclaim": {"enabled": True, "idle_after_s": 600, "resend_s": 900,
                                 "report_url": "https://grafana.example/d/job?var-job={job}"}})  # fmt: skip
        write(store, batches("n1", [
            Holder("11", (0,), lambda t: IDLE, user="alice"),
            Holder("12", (1, 2), lambda t: IDLE, user="bob", account="vision"),
            Holder("13", (3,), lambda t: ACTIVE, user="carol"),
        ], b, now))  # fmt: skip
        am_r, hook_r = Receiver.parse("alertmanager", am.url), Receiver.parse("webhook", slack.url)
        n = Notifier(tmp_path / "outbox", [am_r, hook_r], policy=FAST)
        eng = Engine(AlertState(store), n, resend_s=60)
        notices, _ = reclaim_round(store, cfg, {}, now)
        assert eng.step(notices, now)["new"] == 2
        wait_for(lambda: len(am.alerts()) == 2)
        got = {a["labels"]["job"]: a for a in am.alerts()}
        assert {j: [r["name"] for r in a["receivers"]] for j, a in got.items()} == {
            "11": ["alice"],
            "12": ["ml-team"],
        }
        assert got["11"]["labels"]["user"] == "alice" and got["11"]["labels"]["account"] == "research"
        # bob's 2 GPUs idle all hour, read back 600 + 1800 (default grace) + 600 = 3000 s: at
        # least 2 x 3000 s = 1.6667 GPU-hours
        assert got["12"]["annotations"]["idle_gpu_hours"] == "1.6667"
        assert (
            got["12"]["annotations"]["at_least"] == "true"
            and "at least 0.8 h" in got["12"]["annotations"]["summary"]
        )
        assert got["12"]["annotations"]["report"] == "https://grafana.example/d/job?var-job=12"
        # Alertmanager's route sent alice's to her webhook, with the labels
        wait_for(lambda: alice_hook.posts())
        sent = json.loads(alice_hook.posts()[0].body)
        assert [a["labels"]["job"] for a in sent["alerts"]] == ["11"] and sent["receiver"] == "alice"
        # the chat webhook: one line per notice
        wait_for(lambda: slack.posts())
        text = json.loads(slack.posts()[0].body)["text"]
        assert "FIRING [ticket] GpusloIdleHolder gpu job 11 of alice in gpu: 1 GPU(s) idle" in text
        # within resend_s (900 s, not the engine's 60 s): nothing re-sent; after it: re-sent
        write(store, batches("n1", [Holder("11", (0,), lambda t: IDLE, user="alice"),
                                    Holder("12", (1, 2), lambda t: IDLE, user="bob", account="vision")],
                             now, now + 60))  # fmt: skip
        assert eng.step(reclaim_round(store, cfg, {}, now + 60)[0], now + 60)["resent"] == 0
        # bob's job becomes active: resolved; alice's still idle
        write(store, batches("n1", [Holder("11", (0,), lambda t: IDLE, user="alice"),
                                    Holder("12", (1, 2), lambda t: ACTIVE, user="bob", account="vision")],
                             now + 60, now + 120))  # fmt: skip
        r = eng.step(reclaim_round(store, cfg, {}, now + 120)[0], now + 120)
        assert (r["resolved"], r["resent"]) == (1, 0)
        wait_for(
            lambda: {a["labels"]["job"] for a in am.alerts() if a["status"]["state"] == "active"} == {"11"}
        )
        n.close()
    finally:
        am.stop()

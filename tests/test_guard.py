"""The traffic guard (min_requests) is visible: when and how long a burn condition was held
back, in the summary (JSON and text), rule_results, the report; and the firing minutes of
each alert and severity. Expected values worked out by hand below."""

from __future__ import annotations

import json

import pytest

from gpuslo.app.text import summary as text_summary
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import results
from gpuslo.rules.config import BurnWindow, RulesConfig, Slo
from gpuslo.rules.evaluate import summary
from gpuslo.rules.model import SeverityMinutes, to_json
from tests import helpers as h
from tests.helpers import T0

# objective 0.99, one page pair 10m/5m with factor 2.16 (budget_percent 0.05 of a 30-day period:
# 0.05 / 100 × 2,592,000 s / 600 s), min_requests 300. Deltas of 100 requests,
# all bad (burn 100 in any window that has requests), at T0 + 60 k for k = 1..20; steps every
# 60 s at T0 + 60 j. Short window (t - 5m, t]: 100 * min(j, 5) requests for j <= 20, then
# 100 * (25 - j) for j = 21..24, none after; the long window has requests until j = 29.
# Burning (both windows have requests, so burn 100 > 2.16): j = 1..24.
# Firing (short window >= 300): j = 3..22, 20 steps: one alert from T0+180 to T0+1380, 20 min.
# Held back (burning, short < 300): j = 1, 2 (100, 200 requests) and j = 23, 24 (200, 100):
# [T0+60, T0+180) and [T0+1380, T0+1500), 2 min each, at most 200 requests in the short window.
SLO = Slo(name="guarded", service="svc", threshold_ms=5.0, min_requests=300,
          windows=(BurnWindow(severity="page", long="10m", short="5m", budget_percent=0.05),))  # fmt: skip
CFG = RulesConfig(slos=(SLO,))


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_held_back_intervals_and_firing_minutes_by_hand(store: ChdbStore) -> None:
    write(store, [h.latency(T0 + 60 * k, 0, 100) for k in range(1, 21)])
    s = summary(store, CFG, T0, T0 + 1800)
    assert [(a.started, a.ended, a.firing_minutes) for a in s.slo_alerts] == [(T0 + 180, T0 + 1380, 20.0)]
    assert [(x.started, x.ended, x.minutes, x.max_short_requests) for x in s.slo_held_back] == [
        (T0 + 60, T0 + 180, 2.0, 200),
        (T0 + 1380, T0 + 1500, 2.0, 200),
    ]
    assert s.slo_minutes == {"guarded": {"page": SeverityMinutes(firing_minutes=20.0, held_back_minutes=4.0)}}
    js = json.loads(json.dumps(to_json(s)))  # what rules eval --json prints
    assert js["slo_held_back"][0]["minutes"] == 2.0
    # every key of the nested objects, in order
    assert list(js["slo_held_back"][0]) == ["slo", "service", "severity", "long_window", "short_window", "factor",
                                            "started", "ended", "minutes", "min_requests", "max_short_requests"]  # fmt: skip
    assert list(js["slo_alerts"][0]) == ["slo", "service", "severity", "long_window", "short_window", "factor",
                                         "started", "ended", "peak_burn_long", "peak_burn_short", "firing_minutes"]  # fmt: skip
    assert list(js["slos"][0]) == ["slo", "service", "objective", "threshold_ms", "total", "good", "sli", "burn",
                                   "budget_remaining", "p99_ms", "error", "last_data_at", "no_data_since", "never_seen",
                                   "no_data_after_s", "unjudged_windows"]  # fmt: skip
    assert js["slo_minutes"] == {"guarded": {"page": {"firing_minutes": 20.0, "held_back_minutes": 4.0}}}
    text = text_summary(s)
    assert "Held back by the traffic guard (2 intervals, 4 min; no alert fired)" in text
    assert "200 < 300" in text
    assert "Minutes firing per severity (guarded): page 20" in text
    rows = {(r[0], r[3]): r[4] for r in results.rows(s, T0 + 1800, 1800)}
    assert rows[("slo_firing_minutes", "slo=guarded,severity=page")] == 20.0
    assert rows[("slo_held_back_minutes", "slo=guarded,severity=page")] == 4.0


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_without_the_guard_the_held_minutes_fire(store: ChdbStore) -> None:
    # min_requests 0: every burning step fires, j = 1..24: 24 minutes, nothing held back
    write(store, [h.latency(T0 + 60 * k, 0, 100) for k in range(1, 21)])
    cfg = RulesConfig(slos=(SLO.model_copy(update={"min_requests": 0}),))
    s = summary(store, cfg, T0, T0 + 1800)
    assert [(a.started, a.ended, a.firing_minutes) for a in s.slo_alerts] == [(T0 + 60, T0 + 1500, 24.0)]
    assert s.slo_held_back == ()
    assert "Held back" not in text_summary(s)


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("step_s", [60, 300])
def test_minutes_per_severity_count_each_minute_once(store: ChdbStore, step_s: int) -> None:
    # two page pairs that both fire over the same steps: the severity fired as long as one pair
    # did, not twice that. With 5-min steps the same data gives steps j = 1..6 at T0+300 j.
    write(store, [h.latency(T0 + 60 * k, 0, 100) for k in range(1, 21)])
    pairs = (
        BurnWindow(severity="page", long="10m", short="5m", budget_percent=0.05),  # factor 2.16
        BurnWindow(severity="page", long="20m", short="5m", budget_percent=0.05),
    )  # factor 1.08; fmt: skip
    cfg = RulesConfig(
        eval_step_s=step_s, slos=(SLO.model_copy(update={"min_requests": 0, "windows": pairs}),)
    )
    s = summary(store, cfg, T0, T0 + 1800)
    per_alert = sum(a.firing_minutes for a in s.slo_alerts)
    union = s.slo_minutes["guarded"]["page"].firing_minutes
    # by hand, 60 s steps: pair 1 burns j = 1..24 (24 min); pair 2 (long 20m) j = 1..24 too
    # (the short window limits both): union 24 min, per alert 48. 300 s steps: short window
    # (t-5m, t] at t = T0+300 j holds deltas k in (5(j-1), 5j]: j = 1..4 (k up to 20): 4 steps.
    expect = {60: (24.0, 48.0), 300: (20.0, 40.0)}[step_s]
    assert (union, per_alert) == expect

"""The exported Prometheus rules and gpuslo's own engine, fed the same burn scenario, fire
the same alerts at the same evaluation times (promtool test rules, real Prometheus engine)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.config import RulesConfig, Slo
from gpuslo.rules.evaluate import slo_alerts
from gpuslo.rules.prometheus import metric_name, render
from tests import helpers as h
from tests.helpers import T0

SLO = Slo(name="chat-p99", service="chat", objective=0.99, threshold_ms=5, min_requests=100,
          prometheus_metric="chat_request_latency_seconds", prometheus_unit="s")  # fmt: skip
CFG = RulesConfig(slos=(SLO,))
MINUTES = 240


def scenario() -> list[tuple[int, int]]:
    """(good, bad) per minute 1..MINUTES: good, then 25 % bad for an hour, then good."""
    return [(750, 250) if 101 <= i <= 160 else (1000, 0) for i in range(1, MINUTES + 1)]


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    return exe


def test_exported_rules_pass_promtool_check(tmp_path: Path) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text(render(CFG))
    r = subprocess.run([promtool(), "check", "rules", str(p)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    # 7 ratios, 4 increases, 7 judgeable, 4 burn alerts, not evaluable
    assert "SUCCESS: 23 rules found" in r.stdout


# Worked by hand from the README's definitions (burn_w = (1 - good_w/total_w) / (1 - objective),
# factor = budget share x period / long window, rules/burn_windows.yaml) for scenario(): every
# minute has 1000 requests, minutes 101..160 a quarter of them bad. A window of n minutes ending
# at minute m (promtool: the counters at m and at m - n; before minute 1 everything is 0) holds k
# bad minutes, so burn = 0.25 k / n / 0.01 = 25 k / n, where a window
# longer than the data so far holds n = m minutes (3 d, 1 d and 6 h here; 2 h until minute 120).
# An alert fires at m while both windows burn above the factor (min_requests 100: every short
# window has at least 5000 requests).
#   30 d, page 1h/5m, 14.4:   1 h: k = m - 100 (m <= 160) > 0.576 * 60 = 34.56 -> m >= 135, and
#                             k = 220 - m (m > 160) >= 35 -> m <= 185;  5 m: k >= 3 -> 103..162
#   30 d, page 6h/30m, 6:     6 h (n = m): m - 100 > 0.24 m -> m >= 132; 60 > 0.24 m to 240;
#                             30 m: k >= 8 -> 108..182
#   30 d, ticket 1d/2h, 3:    1 d: m - 100 > 0.12 m -> m >= 114;  2 h: the same while n = m
#                             (m <= 120), then k >= 15 (to 265)
#   30 d, ticket 3d/6h, 1:    both n = m: m - 100 > 0.04 m -> m >= 105
#   7 d, page 1h/5m, 13.44:   1 h: k >= 33 -> 133..187;  5 m: k >= 3 -> 103..162
#   7 d, page 6h/30m, 3.5:    6 h: m - 100 > 0.14 m -> m >= 117;  30 m: k >= 5 -> 105..185
#   7 d, ticket 1d/2h, 1.4:   1 d: m - 100 > 0.056 m -> m >= 106;  2 h: the same while n = m
#   7 d, ticket 3d/6h, 0.98:  m - 100 > 0.0392 m -> m >= 105
# (severity, long/short window, factor) -> the first and last minute it fires (MINUTES: still firing)
FIRES = {
    30: {("page", "1h/5m", "14.4"): (135, 162), ("page", "6h/30m", "6"): (132, 182),
         ("ticket", "1d/2h", "3"): (114, MINUTES), ("ticket", "3d/6h", "1"): (105, MINUTES)},
    7: {("page", "1h/5m", "13.44"): (133, 162), ("page", "6h/30m", "3.5"): (117, 185),
        ("ticket", "1d/2h", "1.4"): (106, MINUTES), ("ticket", "3d/6h", "0.98"): (105, MINUTES)},
}  # fmt: skip
MINUTES_OF = {"5m": 5, "30m": 30, "1h": 60, "2h": 120, "6h": 360, "1d": 1440, "3d": 4320}


def burn_by_hand(m: int, window: str) -> float:
    """25 k / n of the table above, counted from scenario() (not from the engine)."""
    lo = max(1, m - MINUTES_OF[window] + 1)
    mins = scenario()[lo - 1 : m]
    bad, total = sum(b for _g, b in mins), sum(g + b for g, b in mins)
    return (bad / total) / (1 - 0.99)


def test_the_hand_worked_firing_intervals_agree_with_the_burn_counted_from_the_scenario() -> None:
    """The two derivations above agree at every minute (and no evaluation time is a tie)."""
    for period_d, fires in FIRES.items():
        for (_sev, pair, factor), (first, last) in fires.items():
            long_w, short_w = pair.split("/")
            for m in range(1, MINUTES + 1):
                bl, bs = burn_by_hand(m, long_w), burn_by_hand(m, short_w)
                assert abs(bl - float(factor)) > 1e-6 and abs(bs - float(factor)) > 1e-6, (period_d, pair, m)
                assert (bl > float(factor) and bs > float(factor)) == (first <= m <= last), (
                    period_d,
                    pair,
                    m,
                )


def chat(bucket: list[str], count: list[str]) -> dict[str, list[str]]:
    """chat's histogram: its 5 ms bucket and its count."""
    return {
        'chat_request_latency_seconds_bucket{le="0.005"}': bucket,
        "chat_request_latency_seconds_count": count,
    }


def promtool_test(tmp_path: Path, rules: str, series: dict[str, list[str]],
                  alert_tests: list[dict[str, Any]]) -> None:  # fmt: skip
    """``promtool test rules`` of ``rules`` over ``series`` (a value a minute, ``_`` for none),
    expecting ``alert_tests``: fails with promtool's words."""
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": k, "values": " ".join(v)} for k, v in series.items()],
            "alert_rule_test": alert_tests,
        }],
    }  # fmt: skip
    (tmp_path / "rules.yaml").write_text(rules)
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    r = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


@pytest.mark.integration
@pytest.mark.parametrize("period_d", [30, 7])
def test_promtool_and_gpuslo_fire_the_same_alerts(store: ChdbStore, tmp_path: Path, period_d: int) -> None:
    """Both engines, fed scenario(), fire exactly the hand-worked intervals of FIRES, also for a
    7-day SLO, whose factors (13.44, 3.5, 1.4, 0.98) differ from the 30-day ones."""
    slo = Slo.model_validate({**SLO.model_dump(exclude={"windows"}), "period_d": period_d})
    cfg = RulesConfig(slos=(slo,))
    assert {(w.severity, f"{w.long}/{w.short}", f"{w.factor:g}") for w in slo.windows} == set(FIRES[period_d])
    mins = scenario()
    write(store, [h.latency(T0 + 60 * i, g, b, service="chat") for i, (g, b) in enumerate(mins, start=1)])  # type: ignore[arg-type]
    # gpuslo: one alert per window pair, from its first firing minute to the first one after
    got = {(a.severity, f"{a.long_window}/{a.short_window}", f"{a.factor:g}"): (a.started, a.ended)
           for a in slo_alerts(store, slo, T0, T0 + 60 * MINUTES)}  # fmt: skip
    want = {k: (T0 + 60 * first, None if last == MINUTES else T0 + 60 * (last + 1))
            for k, (first, last) in FIRES[period_d].items()}  # fmt: skip
    assert got == want
    # promtool: evaluated every 5 minutes, the alerts of the pairs whose interval holds the minute
    firing = {
        m: [{"severity": sev, "window": pair, "factor": factor}
            for (sev, pair, factor), (first, last) in FIRES[period_d].items() if first <= m <= last]
        for m in range(10, MINUTES + 1, 5)
    }  # fmt: skip
    assert any(firing.values()) and not all(firing.values())  # the scenario both fires and resolves

    good_cum = bad_cum = 0
    bucket, count = ["0"], ["0"]
    for g, b in mins:
        good_cum += g
        bad_cum += b
        bucket.append(str(good_cum))
        count.append(str(good_cum + bad_cum))
    promtool_test(tmp_path, render(cfg), chat(bucket, count), [
        {"eval_time": f"{m}m", "alertname": "GpusloSLOBurn", "exp_alerts": [
            {"exp_labels": {"severity": a["severity"], "slo": "chat-p99", "service": "chat", "window": a["window"]},
             "exp_annotations": {"summary": f"chat-p99: error budget burning faster than {a['factor']}x over "
                                            f"{a['window'].split('/')[0]} and {a['window'].split('/')[1]}"}}
            for a in alerts
        ]}
        for m, alerts in firing.items()
    ])  # fmt: skip


HOSTILE_NAMES = [
    'x",slo=~".*',
    'back\\slash"} or vector(1) #',
    "a{{ .Foo",
    '{{ printf "%s" 1 }}',
    "tab\there",
    "p99 ✓ café",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_an_slo_named_anything_exports_rules_that_fire_for_it(tmp_path: Path, name: str) -> None:
    """The SLO's name went into PromQL matchers and into alert labels and annotations (Go
    templates) as it was: a name with ``"`` or ``\\`` made rules promtool refuses, or worse, valid
    ones whose matcher read series their recording rules never wrote (``x",slo=~".*``: the alert
    never fired), and ``{{`` broke the templates (or ran in them). Whatever the name and service,
    the rules pass promtool and fire for the SLO, with its name as their label."""
    service = "9" + name  # a service whose default metric name starts with a digit, too
    slo = Slo.model_validate({**SLO.model_dump(exclude={"windows", "prometheus_metric"}), "name": name,
                              "service": service, "prometheus_selector": 'model="a\\"b"'})  # fmt: skip
    (tmp_path / "rules.yaml").write_text(render(RulesConfig(slos=(slo,))))
    r = subprocess.run([promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       check=False)  # fmt: skip
    assert r.returncode == 0 and "SUCCESS: 23 rules found" in r.stdout, r.stdout + r.stderr
    metric = metric_name(service)
    sel = 'model="a\\"b"'
    bad = [str(60 * i) for i in range(0, 61)]  # every request slow: every window pair burns
    series = {f'{metric}_bucket{{le="0.005",{sel}}}': ["0"] * 61, f"{metric}_count{{{sel}}}": bad}
    promtool_test(tmp_path, render(RulesConfig(slos=(slo,))), series, [
        {"eval_time": "60m", "alertname": "GpusloSLOBurn", "exp_alerts": [
            {"exp_labels": {"severity": sev, "slo": name, "service": service, "window": win},
             "exp_annotations": {"summary": f"{name}: error budget burning faster than {f}x over "
                                            f"{win.split('/')[0]} and {win.split('/')[1]}"}}
            for sev, win, f in (("page", "1h/5m", "14.4"), ("page", "6h/30m", "6"),
                                ("ticket", "1d/2h", "3"), ("ticket", "3d/6h", "1"))
        ]}])  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prometheus_metric", "foo{bar"),
        ("prometheus_metric", "9lives"),
        ("prometheus_metric", 'x{a="1"}'),
        ("prometheus_selector", 'a="x"}) or vector(1) or foo{b=""'),
        ("prometheus_selector", 'a="x" b="y"'),
        ("prometheus_selector", "a=x"),
        ("prometheus_selector", 'a="\\q"'),  # an escape PromQL has not: a parse error
        ("prometheus_selector", 'a="\\\'"'),  # \' in a double-quoted string: the same
        ("prometheus_selector", 'a="\\400"'),  # past \377: no code point
    ],
)
def test_a_metric_or_selector_that_is_no_promql_is_refused_at_load(
    tmp_path: Path, key: str, value: str
) -> None:
    """``prometheus_metric`` and ``prometheus_selector`` went into the exported rules as they
    were: rules Prometheus refuses (or another expression) from a config gpuslo accepted. The
    config is refused at load, naming the key."""
    from gpuslo.rules.config import ConfigError, load

    p = tmp_path / "rules.yaml"
    p.write_text(yaml.safe_dump({"slos": [{"name": "s", "service": "svc", "threshold_ms": 5, key: value}]}))
    with pytest.raises(ConfigError, match=key):
        load(p)


def test_a_selector_with_promql_escapes_is_taken_and_passes_promtool(tmp_path: Path) -> None:
    """Every escape PromQL's lexer takes in a quoted string (the string's own quote, \\, \\n,
    octal, \\x, \\u, \\U) is a matcher the config takes, and the rules it makes pass promtool."""
    sel = "a=\"\\x41\\u00e9\\101\\U0001F600\\\\\\n\\\"\", b!~'\\'x', c=~`\\d+`"
    slo = Slo.model_validate({"name": "s", "service": "svc", "threshold_ms": 5, "prometheus_selector": sel})
    (tmp_path / "rules.yaml").write_text(render(RulesConfig(slos=(slo,))))
    r = subprocess.run([promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("unit", ["s", "ms", "us"])
def test_the_exported_le_is_the_bucket_a_client_library_exposes(unit: str) -> None:
    """The threshold's bucket as prometheus_client exposes it for that bound (written in the
    histogram's unit as a decimal: 9 ms is 0.009 s). ``9 * 0.001`` is 0.009000000000000001 in
    floating point: an ``le`` no series has, and rules that never fired. A whole bound is
    matched as Go's client writes it (``5``) and as the Python client does (``5.0``): the rules
    matched ``5`` alone, and never fired for a Python service under Prometheus 2."""
    import re
    from decimal import Decimal

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    scale = {"s": Decimal("0.001"), "ms": Decimal(1), "us": Decimal(1000)}[unit]
    for text in ["9", "0.9", "1.3", "4.1", "0.3", "2.5", "5", "12.5", "33.333", "0.01", "0.0123", "1e-05",
                 "250", "1000", "123456", "1234567", "1e9"]:  # fmt: skip
        bound = Decimal(text) * scale
        slo = Slo(name="x", service="svc", threshold_ms=float(text), prometheus_unit=unit)
        rules = yaml.safe_load(render(RulesConfig(slos=(slo,))))["groups"][0]["rules"]
        ((op, value),) = set(re.findall(r'le(=~?)"([^"]*)"', " ".join(r["expr"] for r in rules)))
        reg = CollectorRegistry()
        Histogram("lat", "latency", registry=reg, buckets=[float(bound)]).observe(0)
        (exposed,) = (le for le in re.findall(r'le="([^"]*)"', generate_latest(reg).decode()) if le != "+Inf")
        go = exposed.removesuffix(".0") if "e" not in exposed else exposed  # client_golang's spelling
        for spelling in {exposed, go}:  # Python's (and Java's) and Go's: the matcher takes both
            took = value == spelling if op == "=" else re.fullmatch(value, spelling) is not None
            assert took, (text, unit, op, value, spelling)
        assert op == "=" or re.fullmatch(value, exposed + "0") is None  # anchored: no other bucket


@pytest.mark.parametrize("le", ["250", "250.0"])
def test_a_python_services_whole_bucket_is_read_by_the_exported_rules(tmp_path: Path, le: str) -> None:
    """A 250 ms threshold of a histogram in ms, exposed as ``le="250.0"`` (prometheus_client,
    vLLM) or ``le="250"`` (client_golang): promtool computes the error ratio from either (every
    request fast: 0; a bucket the matcher misses leaves no sample at all)."""
    slo = Slo(name="x", service="svc", threshold_ms=250, prometheus_unit="ms", prometheus_metric="lat_ms")
    (tmp_path / "rules.yaml").write_text(render(RulesConfig(slos=(slo,))))
    good = count = " ".join(str(40 * i) for i in range(0, 61))
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": f'lat_ms_bucket{{le="{le}"}}', "values": good},
                             {"series": "lat_ms_count", "values": count}],
            "promql_expr_test": [{"expr": 'slo:sli_error:ratio_rate5m{slo="x"}', "eval_time": "30m",
                                  "exp_samples": [{"labels": 'slo:sli_error:ratio_rate5m{slo="x",service="svc"}',
                                                   "value": 0}]}],
        }],
    }  # fmt: skip
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    r = subprocess.run([promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       check=False)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def _burn_alert(sev: str, win: str, factor: str) -> dict[str, Any]:
    return {"exp_labels": {"severity": sev, "slo": "chat-p99", "service": "chat", "window": win},
            "exp_annotations": {"summary": f"chat-p99: error budget burning faster than {factor}x over "
                                           f"{win.split('/')[0]} and {win.split('/')[1]}"}}  # fmt: skip


def test_exported_burn_alerts_outlive_a_stopped_histogram_and_no_data_is_a_ticket(tmp_path: Path) -> None:
    """As gpuslo's engine does (tests/test_alerts_unjudged.py): when the service's histogram
    series stop while pages fire, the pages stay (Prometheus had nothing left to rate, and they
    resolved as if the budget had stopped burning) and GpusloSLONotEvaluable fires; when the
    series come back, both are judged again.

    Worked by hand: every request bad, minutes 0..60 (600 a minute: a minute's requests pass the
    traffic guard of 100, so the pages are not held back while the short window empties); no
    sample 61..99; from 100 every request good. At 30: all four pairs burn (ratio 1). At 90 the 5 m and 30 m windows hold
    no sample: 1h/5m and 6h/30m are kept as they were (firing); 1d/2h and 3d/6h still read their
    short windows' samples and burn; no sample for 5 m: the ticket. At 130 every short window
    reads samples again: 1h/5m's long hour (70, 130] and 6h/30m's short half hour are all good
    (not firing); 2 h (10, 130]: bad 6600→36000 of 6600→54000 counted, 0.62 > 0.03; 6 h and
    longer: 36000 of 54000, 0.67 > 0.06: 1d/2h and 3d/6h fire; samples again: no ticket."""
    count = (
        [str(600 * m) for m in range(0, 61)]
        + ["_"] * 39
        + [str(36000 + 600 * (m - 100)) for m in range(100, 141)]
    )
    bucket = ["0"] * 61 + ["_"] * 39 + [str(600 * (m - 100)) for m in range(100, 141)]
    ticket = {"exp_labels": {"severity": "ticket", "slo": "chat-p99", "service": "chat"},
              "exp_annotations": {"summary": "chat-p99: no latency histogram of service chat for 5m: its scrape, its "
                                             "exporter or the service is down; its burn alerts are kept as they were"}}  # fmt: skip
    every = [
        ("page", "1h/5m", "14.4"),
        ("page", "6h/30m", "6"),
        ("ticket", "1d/2h", "3"),
        ("ticket", "3d/6h", "1"),
    ]
    promtool_test(tmp_path, render(CFG), chat(bucket, count), [
        {"eval_time": "30m", "alertname": "GpusloSLOBurn", "exp_alerts": [_burn_alert(*a) for a in every]},
        {"eval_time": "30m", "alertname": "GpusloSLONotEvaluable", "exp_alerts": []},
        {"eval_time": "90m", "alertname": "GpusloSLOBurn", "exp_alerts": [_burn_alert(*a) for a in every]},
        {"eval_time": "90m", "alertname": "GpusloSLONotEvaluable", "exp_alerts": [ticket]},
        {"eval_time": "130m", "alertname": "GpusloSLOBurn", "exp_alerts": [_burn_alert(*a) for a in every[2:]]},
        {"eval_time": "130m", "alertname": "GpusloSLONotEvaluable", "exp_alerts": []},
    ])  # fmt: skip


NO_COUNT = ("chat-p99: no latency histogram of service chat for 5m: its scrape, its exporter or the service is "
            "down; its burn alerts are kept as they were")  # fmt: skip
NO_BUCKET = ("chat-p99: no bucket le=0.005 in the latency histogram of service chat for 5m while it is scraped: "
             "threshold_ms 5 is not a bucket bound (a service redeployed with other buckets?); its burn alerts "
             "are kept as they were")  # fmt: skip


@pytest.mark.parametrize("firing", [True, False])
@pytest.mark.parametrize("gone", ["every series", "the threshold's bucket"])
def test_exported_burn_alerts_are_kept_whatever_makes_the_slo_unjudgeable(
    tmp_path: Path, gone: str, firing: bool
) -> None:
    """gpuslo's engine cannot judge an SLO whose histogram stopped or whose threshold is no
    bucket bound any more (a service redeployed with other buckets: its ``le`` series stops, its
    count goes on): it keeps the burn alerts as they were and raises GpusloSLONotEvaluable. The
    export kept them only while the count had no increase: when the bucket went, the 5 m and 30 m
    pages resolved and no ticket said why; and the windows' ratios of the bucket's older samples
    over the count's newer ones (0.15 at 65 min for every request fast) fired pages for an SLO
    not burning. An alert that was not firing is not started by the gap.

    Minutes 0..60: 600 requests a minute, every one slow (``firing``) or every one fast; 61..99:
    no sample of any series, or of ``le="0.005"`` alone (``le="0.01"`` in its place). At 90 the
    5 m and 30 m windows have no ratio (kept as at 60); the 2 h and 6 h ones still read samples of
    minutes 0..60 (burning as before)."""
    before = ["0" if firing else str(600 * m) for m in range(0, 61)]
    count = [str(600 * m) for m in range(0, 61)]
    if gone == "every series":
        series = {'chat_request_latency_seconds_bucket{le="0.005"}': before + ["_"] * 39,
                  "chat_request_latency_seconds_count": count + ["_"] * 39}  # fmt: skip
    else:
        series = {'chat_request_latency_seconds_bucket{le="0.005"}': before + ["_"] * 39,
                  'chat_request_latency_seconds_bucket{le="0.01"}': ["_"] * 61 + [str(600 * m) for m in range(61, 100)],
                  "chat_request_latency_seconds_count": count + [str(600 * m) for m in range(61, 100)]}  # fmt: skip
    every = [
        ("page", "1h/5m", "14.4"),
        ("page", "6h/30m", "6"),
        ("ticket", "1d/2h", "3"),
        ("ticket", "3d/6h", "1"),
    ]
    burns = [_burn_alert(*a) for a in every] if firing else []
    ticket = {"exp_labels": {"severity": "ticket", "slo": "chat-p99", "service": "chat"},
              "exp_annotations": {"summary": NO_COUNT if gone == "every series" else NO_BUCKET}}  # fmt: skip
    promtool_test(tmp_path, render(CFG), series, [
        {"eval_time": "30m", "alertname": "GpusloSLOBurn", "exp_alerts": burns},
        {"eval_time": "30m", "alertname": "GpusloSLONotEvaluable", "exp_alerts": []},
        # just after: the windows read the bucket's samples to 60 and the count's to 65
        {"eval_time": "65m", "alertname": "GpusloSLOBurn", "exp_alerts": burns},
        {"eval_time": "65m", "alertname": "GpusloSLONotEvaluable", "exp_alerts": []},
        {"eval_time": "90m", "alertname": "GpusloSLOBurn", "exp_alerts": burns},
        {"eval_time": "90m", "alertname": "GpusloSLONotEvaluable", "exp_alerts": [ticket]},
    ])  # fmt: skip


# the objectives' edges: many nines (1 - objective in floating point lost its digits to
# cancellation: 15 nines exported a budget of 9.992007222e-16, not 1e-15), more digits than
# `:.10g` kept, and objectives near 0 (every window's factor below the highest burn, 1 / (1 - o))
OBJECTIVES = [0.5, 0.99, 0.999, 0.99999, 0.9999999999, 0.999999999999999, 0.123456789012345, 1e-9, 5e-324]
LOW = ({"severity": "page", "long": "1h", "short": "5m", "budget_percent": 0.1},)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_exported_burn_thresholds_hold_the_objectives_budget_exactly(
    tmp_path: Path, objective: float
) -> None:
    import re
    from decimal import Decimal

    windows = LOW if objective < 0.9 else ()
    slo = Slo.model_validate({"name": "a", "service": "chat", "objective": objective, "threshold_ms": 5,
                              "windows": windows})  # fmt: skip
    text = render(RulesConfig(slos=(slo,)))
    got = re.findall(r"\(([0-9.e+-]+) \* ([0-9.e+-]+)\)", text)
    assert len(got) == 2 * len(slo.windows)
    for factor, budget in got:
        # the decimal the objective is written as, its budget exact (independent of floating point)
        assert Decimal(budget) == 1 - Decimal(repr(objective)), (objective, budget)
        assert float(factor) in {w.factor for w in slo.windows}
    p = tmp_path / "rules.yaml"
    p.write_text(text)
    r = subprocess.run([promtool(), "check", "rules", str(p)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_exported_rules_over_a_histogram_scraped_less_often_than_the_short_window(tmp_path: Path) -> None:
    """What the exported rules do with a histogram Prometheus scrapes every 10 min (docs/metrics.md,
    rows less often than the shortest window): ``rate`` needs two samples in its range, so the 5 m
    window never has a ratio and the 1h/5m page is never judged (kept as it was: not firing), as
    gpuslo's engine leaves such a pair; the 30 m and longer windows hold 3 or more samples and
    fire. Unlike the engine, whose ticket waits twice the rows' interval, the exported ticket
    (``absent_over_time`` over no_data_s, 5 m) fires whenever the last scrape is more than 5 m
    old and goes at the next: the rules cannot know Prometheus's scrape interval.

    Every request bad, 6,000 a scrape; samples at minutes 0, 10, ..., 180."""
    count = [str(600 * m) if m % 10 == 0 else "_" for m in range(181)]
    bucket = ["0" if m % 10 == 0 else "_" for m in range(181)]
    judged = [("page", "6h/30m", "6"), ("ticket", "1d/2h", "3"), ("ticket", "3d/6h", "1")]
    ticket = {"exp_labels": {"severity": "ticket", "slo": "chat-p99", "service": "chat"},
              "exp_annotations": {"summary": NO_COUNT}}  # fmt: skip
    tests = []
    for minute in (120, 123, 125, 126, 129, 130, 134, 136):
        tests += [
            {"eval_time": f"{minute}m", "alertname": "GpusloSLOBurn", "exp_alerts": [_burn_alert(*a) for a in judged]},
            {"eval_time": f"{minute}m", "alertname": "GpusloSLONotEvaluable",
             "exp_alerts": [ticket] if minute % 10 > 5 else []},
        ]  # fmt: skip
    promtool_test(tmp_path, render(CFG), chat(bucket, count), tests)

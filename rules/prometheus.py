"""Export the SLOs as Prometheus recording and alerting rules (Sloth's layout), for teams
that scrape the inference servers with Prometheus: the same windows, factors and traffic
guard as gpuslo's own engine, so both fire at the same evaluation times (a test runs the
same burn scenario through promtool and through gpuslo)."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

import yaml

from gpuslo.rules.config import RulesConfig, Slo

_SCALE = {"s": -3, "ms": 0, "us": 3}  # threshold_ms → the histogram's unit, as a power of ten


def promql_string(value: str) -> str:
    """``value`` as a PromQL string literal: double-quoted, ``"`` and ``\\`` escaped, control
    characters as ``\\uXXXX`` (Go's escapes, which PromQL reads). Every configured string
    that reaches an expression goes through here: an SLO named ``x",slo=~".*`` made a matcher
    of its own, and the alert read series its recording rules never wrote (it never fired)."""
    return json.dumps(value, ensure_ascii=False)


def template_text(value: str) -> str:
    """``value`` as literal text of a Go template: Prometheus expands an alerting rule's labels
    and annotations as templates, so an SLO named ``a{{ .Foo`` broke the rule (promtool: unclosed
    action) and ``{{ ... }}`` in a name would run. Each ``{{`` is written as an action printing it."""
    return '{{ "{{" }}'.join(value.split("{{"))


def metric_name(service: str) -> str:
    """The default histogram of ``service``: its name with every character a metric name cannot
    hold as ``_``, and ``_`` before a leading digit (``9svc`` is no metric name: a parse error)."""
    base = re.sub(r"[^a-zA-Z0-9_:]", "_", service)
    return ("_" + base if base[:1].isdigit() else base) + "_request_latency_seconds"


def _dur(seconds: int) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % n == 0:
            return f"{seconds // n}{unit}"
    return f"{seconds}s"


def _le(slo: Slo) -> str:
    """The ``le`` label of the threshold's bucket as the client libraries write it: the
    threshold scaled in decimal (9 ms in seconds is 0.009; ``9 * 0.001`` in floating point is
    0.009000000000000001, a bucket no series has: the rules never fired), in Go's shortest
    ``%g`` (client_golang's ``strconv.FormatFloat(v, 'g', -1, 64)``, client_python's
    ``floatToGoString``): ``0.005``, ``250``, ``1e-05``, ``1e+06``."""
    return go_float(Decimal(repr(slo.threshold_ms)).scaleb(_SCALE[slo.prometheus_unit]))


def le_spellings(slo: Slo) -> tuple[str, ...]:
    """Every way a client library writes the threshold's ``le``: Go's (:func:`_le`; client_golang,
    and Prometheus 3, which rewrites every ``le`` so), and where it is a whole number below 1e6,
    with ``.0`` (client_python's ``floatToGoString`` and Java's ``Double.toString``: vLLM's ``250.0``,
    which Prometheus 2 keeps as written). A rule matching ``le="250"`` alone read no series of such
    a service: it never fired."""
    go = _le(slo)
    return (go, f"{go}.0") if go.isdigit() else (go,)


def le_matcher(slo: Slo) -> str:
    """The PromQL matcher of the threshold's bucket: ``le="X"``, or ``le=~"X|X[.]0"`` where the
    libraries differ (:func:`le_spellings`; a regex matcher is anchored, and ``[.]`` is a dot)."""
    spellings = le_spellings(slo)
    if len(spellings) == 1:
        return f"le={promql_string(spellings[0])}"
    return f"le=~{promql_string('|'.join(x.replace('.', '[.]').replace('+', '[+]') for x in spellings))}"


def go_float(v: Decimal) -> str:
    """A positive finite number as Go's ``strconv.FormatFloat(v, 'g', -1, 64)`` writes it:
    the exponent form below 1e-4 and from 1e+06 on (at least two exponent digits)."""
    t = v.normalize().as_tuple()
    digits = "".join(map(str, t.digits))
    dp = len(digits) + int(t.exponent)  # where the point goes
    if dp - 1 < -4 or dp - 1 >= 6:
        mant = digits[0] + (f".{digits[1:]}" if len(digits) > 1 else "")
        return f"{mant}e{'-' if dp - 1 < 0 else '+'}{abs(dp - 1):02d}"
    if dp <= 0:
        return "0." + "0" * -dp + digits
    return digits + "0" * (dp - len(digits)) if dp >= len(digits) else f"{digits[:dp]}.{digits[dp:]}"


def rule_groups(cfg: RulesConfig) -> dict[str, Any]:
    groups = []
    for slo in cfg.slos:
        metric = slo.prometheus_metric or metric_name(slo.service)  # the config checks the given one
        sel = f",{slo.prometheus_selector}" if slo.prometheus_selector else ""
        lengths = sorted({w.long_s for w in slo.windows} | {w.short_s for w in slo.windows})
        labels = {"slo": slo.name, "service": slo.service}
        m = f"{{slo={promql_string(slo.name)}}}"
        count = f"{metric}_count{{{sel.lstrip(',')}}}"
        bucket = f"{metric}_bucket{{{le_matcher(slo)}{sel}}}"
        recording = (
            [
                {
                    "record": f"slo:sli_error:ratio_rate{_dur(w)}",
                    "expr": (
                        f"1 - (sum(rate({metric}_bucket{{{le_matcher(slo)}{sel}}}[{_dur(w)}]))"
                        f" / sum(rate({metric}_count{{{sel.lstrip(',')}}}[{_dur(w)}])))"
                    ),
                    "labels": dict(labels),
                }
                for w in lengths
            ]
            + [
                {
                    "record": f"slo:requests:increase{_dur(w)}",
                    "expr": f"sum(increase({metric}_count{{{sel.lstrip(',')}}}[{_dur(w)}]))",
                    "labels": dict(labels),
                }
                for w in sorted({w.short_s for w in slo.windows})
            ]
            + [
                # the window can be judged: it has a ratio, read from as many samples of the
                # threshold's bucket as of the count (gpuslo's engine refuses an SLO whose rows lack
                # the threshold's bound). A bucket that stopped while the count went on (a service
                # redeployed with other buckets) left a ratio of the bucket's older samples over the
                # count's newer ones: a page fired for an SLO that was not burning
                {
                    "record": f"slo:judgeable{_dur(w)}",
                    "expr": (
                        f"(sum(count_over_time({bucket}[{_dur(w)}])) == sum(count_over_time({count}[{_dur(w)}])))"
                        f" and on () slo:sli_error:ratio_rate{_dur(w)}{m}"
                    ),
                    "labels": dict(labels),
                }
                for w in lengths
            ]
        )
        # the budget as the decimal the objective was written as (repr round-trips): 1 - objective in
        # floating point lost its digits to cancellation (0.999999999999999 gave 9.992007222e-16, not
        # 1e-15: the threshold 0.08 % low; ten nines 1.000000083e-10)
        budget = go_float(Decimal(1) - Decimal(repr(slo.objective)))
        alerts = []
        for w in slo.windows:
            lw, sw = _dur(w.long_s), _dur(w.short_s)
            # the engine's own factor to the last bit (repr round-trips; `:g` would cut 0.9333…)
            f = repr(w.factor)
            # judged only while both windows can be (slo:judgeable); else the alert stays as the
            # previous evaluation left it, as gpuslo's engine keeps the burn alerts of an SLO it
            # cannot judge: without it a page resolved when the service's scrape died (no ratio)
            # or its buckets changed, as if the budget had stopped burning, and one not firing
            # could start on a ratio of mismatched samples. A quiet service's ratio is NaN, not
            # absent: judged (no burn), as in the engine
            judged = f"slo:judgeable{lw}{m} and on () slo:judgeable{sw}{m}"
            firing = (
                f'ALERTS{{alertname="GpusloSLOBurn",alertstate="firing",slo={promql_string(slo.name)},'
                f"severity={promql_string(w.severity)},window={promql_string(f'{w.long}/{w.short}')}}}"
            )
            alerts.append(
                {
                    "alert": "GpusloSLOBurn",
                    "expr": (
                        f"((slo:sli_error:ratio_rate{lw}{m} > ({f} * {budget}))"
                        f" and (slo:sli_error:ratio_rate{sw}{m} > ({f} * {budget}))"
                        f" and (slo:requests:increase{sw}{m} >= {slo.min_requests}) and on () ({judged}))"
                        f" or (max without (alertname, alertstate) ({firing}) unless on () ({judged}))"
                    ),
                    # an alerting rule's labels and annotations are templates (a recording rule's are not)
                    "labels": {
                        "severity": w.severity,
                        "slo": template_text(slo.name),
                        "window": template_text(f"{w.long}/{w.short}"),
                    },
                    "annotations": {
                        "summary": template_text(
                            f"{slo.name}: error budget burning faster than {w.factor:g}x over {w.long} and {w.short}"
                        ),
                    },
                }
            )
        # the engine's GpusloSLONotEvaluable: for no data, no sample of the histogram's count for
        # no_data_s (a series that never existed too: Prometheus cannot tell the two apart), value
        # 1; for a threshold that is no bucket bound (its other reason), no sample of the
        # threshold's bucket for no_data_s while the count has samples, value 2. One rule (two
        # with the same labels are duplicates to promtool and Alertmanager); its summary says which
        nd = _dur(slo.stale_after_s)
        no_data = template_text(
            f"{slo.name}: no latency histogram of service {slo.service} for {nd}: its scrape, its exporter or "
            "the service is down; its burn alerts are kept as they were"
        )
        no_bucket = template_text(
            f"{slo.name}: no bucket le={_le(slo)} in the latency histogram of service {slo.service} for {nd} while "
            f"it is scraped: threshold_ms {slo.threshold_ms:g} is not a bucket bound (a service redeployed with "
            "other buckets?); its burn alerts are kept as they were"
        )
        alerts.append(
            {
                "alert": "GpusloSLONotEvaluable",
                "expr": (
                    f"absent_over_time({count}[{nd}])"
                    f" or (2 * max without (le) (absent_over_time({bucket}[{nd}]))"
                    f" and on () count_over_time({count}[{nd}]))"
                ),
                "labels": {
                    "severity": "ticket",
                    "slo": template_text(slo.name),
                    "service": template_text(slo.service),
                },
                "annotations": {
                    "summary": f"{{{{ if eq $value 2.0 }}}}{no_bucket}{{{{ else }}}}{no_data}{{{{ end }}}}"
                },
            }
        )
        # one group: rules in a group run in order, so the alerts read this evaluation's ratios
        # (separate groups run concurrently and could read the previous evaluation's)
        groups.append({"name": f"gpuslo-slo-{slo.name}", "rules": recording + alerts})
    return {"groups": groups}


def render(cfg: RulesConfig) -> str:
    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return "# Generated by `gpuslo rules export-prometheus`; do not edit.\n" + yaml.dump(
        rule_groups(cfg), Dumper=_NoAliases, sort_keys=False, width=200
    )

"""``gpuslo``: one command, a subcommand per part of the pipeline.

Exit codes: 0 success; 1 partial (some input rejected, the rest landed); 2 usage or
configuration error, or nothing could be done (for ``ingest --file``: no line landed).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from gpuslo.app.argtypes import (
    bind_addr,
    http_url,
    label_key,
    name_arg,
    node_arg,
    path_arg,
    text_arg,
    utf8_text,
)
from gpuslo.app.flag_rules import SOURCES

EXIT_OK, EXIT_PARTIAL, EXIT_ERROR = 0, 1, 2


#: Times the CLI takes: 1970-01-01 .. the last time the wire accepts (2106-01-01).
TIME_MIN, TIME_MAX = 0.0, 4_291_747_200.0


# what writing standard output to a file or device can meet (a full disk, a quota, a file size
# limit, a failing device)
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


# a leap second (RFC 3339 allows :60): the time up to its seconds, and what follows them
_LEAP_SECOND = re.compile(r"(.*[T ]\d\d:\d\d):60([.,]\d+)?(.*)")
# a date whose year ISO-8601 has without an expansion agreed on: year 0, or more than 4 digits
_YEAR_OUT = re.compile(r"\s*(?:0000|[+-]?\d{5,})-")


def parse_time(text: str) -> float:
    """ISO-8601 (a time without zone is UTC) or epoch seconds, finite and in
    [1970-01-01, 2106-01-01]. RFC 3339's lower-case ``t`` and ``z`` are its upper-case ones
    (``2026-01-01t00:00:00z`` was refused); a leap second (``23:59:60``) is the second after
    ``23:59:59``, as POSIX time counts it (the next minute's first: epoch seconds have no leap
    seconds)."""
    epoch = True
    try:
        t = float(text)
    except ValueError:
        epoch = False
        iso = text.strip().upper()  # ISO-8601's letters: T, Z, W
        if iso.endswith("Z"):  # a date alone (2026-01-01Z) too
            iso = iso[:-1] + "+00:00"
        leap = 0.0
        if (m := _LEAP_SECOND.fullmatch(iso)) is not None:
            iso, leap = f"{m[1]}:59{m[2] or ''}{m[3]}", 1.0
        try:
            dt = datetime.fromisoformat(iso)
        except ValueError:
            if _YEAR_OUT.match(text):
                raise argparse.ArgumentTypeError(
                    f"{text!r} is not a time between 1970-01-01 and 2106-01-01 (its year is out of range)"
                ) from None
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither epoch seconds nor ISO-8601 (e.g. 2026-11-28T00:00:00Z)"
            ) from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        t = dt.timestamp() + leap
    if not TIME_MIN <= t <= TIME_MAX:  # NaN fails too
        # epoch milliseconds given as seconds (an ISO date past 2106, e.g. 9999-01-01, is no such slip)
        hint = " (milliseconds? give epoch seconds)" if epoch and TIME_MIN <= t / 1000 <= TIME_MAX else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time between 1970-01-01 and 2106-01-01 (epoch seconds {TIME_MIN:.0f}.."
            f"{TIME_MAX:.0f}){hint}"
        )
    return t


def seconds(lo: float, hi: float, lo_in: bool = False) -> Any:
    """An argparse type: a finite number in (lo, hi], or [lo, hi] with ``lo_in`` (durations: NaN
    and inf refused)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (lo <= v if lo_in else lo < v) or not v <= hi:  # NaN fails too
            opening = "[" if lo_in else "("
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number in {opening}{lo:g}, {hi:g}]")
        return v + 0.0  # no negative zero

    return parse


def integer(lo: int, hi: int) -> Any:
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer in [{lo}, {hi}]")
        return v

    return parse


PORT = integer(0, 65535)


def _other_kind(
    exc: Exception, keys: Sequence[str], own: Sequence[str], kind: str, label: str, flags: str
) -> str:
    """``exc``'s message (a config's refusal, a line per problem: ``FILE: key.path: why``), and
    a last line for the top-level keys of the document that are the other kind of config's
    (``keys``, ``label``; this kind's are ``own``): with none of this kind's beside them, the file is that
    ``kind`` (a service config given as a rules config, or the other way round: each refused key read
    "Extra inputs are not permitted", and nothing said which file it wanted), which ``flags``
    take; with some, those keys belong in that other file. A misspelt key beside them changes
    neither (it left the line out), and a file of this kind with one stray key of the other is
    not said to be the other kind (it was)."""
    from gpuslo.core.yamlfile import top_keys

    message = str(exc)
    found = top_keys(exc)
    other = sorted(k for k in found if k in keys and k not in own)
    if not other:
        return message
    if any(k in own for k in found):
        return f"{message}\n{', '.join(other)}: {label}, not this file's: give them in {kind} ({flags})"
    return f"{message}\n{', '.join(other)}: {label}: that file is {kind}, which {flags}"


def _rules_config(path: str | None) -> Any:
    from gpuslo.core.settings import ServiceConfig
    from gpuslo.rules.config import ConfigError, RulesConfig, example, load

    try:
        return example() if path is None else load(path)
    except ConfigError as exc:
        why = _other_kind(
            exc,
            list(ServiceConfig.model_fields),
            list(RulesConfig.model_fields),
            "a service config",
            "a service config's sections",
            "the commands reading a store take as --service-config (agent and ingest as --config); "
            "--config here takes a rules config (rules/example.yaml)",
        )
        raise SystemExit(f"gpuslo: bad rules config:\n{why}") from None


def _sim_config(a: argparse.Namespace) -> Any:
    from gpuslo.agent.sim.fleet import SimConfig

    kw: dict[str, Any] = {
        "nodes": a.nodes,
        "gpus_per_node": a.gpus,
        "hours": a.hours,
        "interval_s": a.interval_s,
        "seed": a.seed,
        "cluster": a.cluster,
    }
    if a.start is not None:
        kw["start_ts"] = a.start
    from gpuslo.wire.models import Name

    # the simulated agents' cluster, checked as the wire checks it: --cluster "" made every batch
    # one the wire refuses (a traceback per node, nothing ingested, exit 0)
    _wire_name(a.cmd, "--cluster", a.cluster, Name)
    for k, lo, hi in SIM_BOUNDS:
        flag = f"--{k.replace('_per_node', '').replace('_', '-')}"
        if kw[k] < lo:
            raise SystemExit(f"gpuslo: {flag} must be >= {lo}")
        if kw[k] > hi:
            raise SystemExit(f"gpuslo: {flag} must be <= {hi}")
    _sim_span(a.start, a.hours, getattr(a, "hours_said", None))
    return SimConfig(**kw)


def _sim_span(start: float | None, hours: float, said: str | None = None) -> None:
    """The simulated samples' times lie where the wire takes them (2000-01-01 .. 2106-01-01):
    ``demo --start 20260101`` (epoch seconds: 1970-08-23) ingested nothing and reported an empty
    fleet, exit 0; ``agent --start 0``, or a start whose hours run past 2106, was a
    ValidationError traceback."""
    from gpuslo.wire.bounds import TS_MAX, TS_MIN

    if start is None:
        return
    end = start + hours * 3600.0  # the last sample is before it
    if start < TS_MIN or end > TS_MAX:
        raise SystemExit(
            f"gpuslo: --start {_utc(start)} with {said or f'--hours {hours:g}'}: the simulated fleet's samples must lie "
            f"between {_utc(TS_MIN)} and {_utc(TS_MAX)} (the times the wire takes)"
        )


#: the simulated fleet's flags: (key, lowest, highest). A GPU's index on the wire is at most
#: 1023 (--gpus 100000: a ValidationError traceback, still running after a minute); the seed is
#: numpy's, a non-negative integer (--seed -5: a ValueError traceback); --nodes 10**11 filled
#: memory before the first sample
SIM_BOUNDS: tuple[tuple[str, float, float], ...] = (
    ("nodes", 1, 100_000),
    ("gpus_per_node", 1, 1024),
    ("hours", 0.01, 24 * 400),
    ("interval_s", 1, 86_400),
    ("seed", 0, 2**64 - 1),
)


def _add_sim_args(p: argparse.ArgumentParser, hours: float | None, hours_help: str) -> None:
    g = p.add_argument_group("simulated fleet")
    g.add_argument("--nodes", type=int, default=4, help="simulated nodes")
    g.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    g.add_argument(
        "--hours", type=seconds(0, 24 * 400), default=hours, help=f"simulated hours ({hours_help})"
    )
    g.add_argument(
        "--interval-s", type=seconds(0, 86_400), default=10.0, help="sampling interval (simulated seconds)"
    )
    g.add_argument("--seed", type=int, default=1, help="random seed (the same seed, the same fleet)")
    g.add_argument("--cluster", type=utf8_text, default="sim", help="the cluster name its messages carry")
    g.add_argument(
        "--start", type=parse_time, default=None, help="simulated start (default: yesterday 00:00 UTC)"
    )


# ---------------------------------------------------------------------------- demo
def cmd_demo(a: argparse.Namespace) -> int:
    from gpuslo.app import text
    from gpuslo.app.embedded import Progress, run_demo

    rules = _rules_config(a.config)
    sim = _sim_config(a)
    from gpuslo.ingest.store import StoreError

    progress = None if a.quiet else Progress(sys.stderr)
    try:
        res = run_demo(sim, rules, Path(a.out), progress=progress, force=a.force)
    except StoreError as exc:
        print(
            f"gpuslo demo: the embedded store failed ({exc.failure.value}): {_first_line(exc)}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if a.json:
        print(json.dumps(res.to_json(), indent=2, sort_keys=True))
    else:
        print(text.summary(res.summary, res.truth))
        print()
        print(text.reclaim(res.reclaim, res.truth))
        print()
        from gpuslo.app.chargeback import demo_text

        print(demo_text(res))
        from gpuslo.app.whatif import demo_text as whatif_text

        print(whatif_text(res.whatif))
        print()
        print(
            f"store:      {res.store_dir}  (gpuslo rules eval --store {res.store_dir} "
            f"--from {sim.start_ts:.0f} --to {sim.end_ts:.0f})"
        )
        for p in res.dashboards:
            print(f"dashboard:  {p}")
        print(f"report:     {res.report}")
        from gpuslo.app.jobtext import demo_lines

        for line in demo_lines(res, sim):
            print(line)
        print(
            f"ingested:   {res.ingest.received} messages, {sum(res.ingest.written.values())} rows, "
            f"{res.ingest.n_rejected} rejected, in {res.seconds:.1f} s"
        )
    return EXIT_OK


# ---------------------------------------------------------------------------- agent
def _service_config(a: argparse.Namespace) -> Any:
    from gpuslo.core.settings import ClickHouseSettings, SettingsError, host_port, load

    # read once per run, by main(): a config given as a pipe (``--config <(...)``) reads once
    loaded = getattr(a, "loaded_service_config", None)
    try:
        if isinstance(loaded, SettingsError):
            raise loaded
        cfg = loaded if loaded is not None else load(getattr(a, "service_config", None))
    except SettingsError as exc:
        from gpuslo.core.settings import ServiceConfig
        from gpuslo.rules.config import RulesConfig

        why = _other_kind(
            exc,
            list(RulesConfig.model_fields),
            list(ServiceConfig.model_fields),
            "a rules config",
            "a rules config's keys",
            "the rules, report, chargeback, whatif, job and demo commands take as --config; a service "
            "config holds kafka, producer, spool, clickhouse and ingest (gpuslo/core/settings.py)",
        )
        raise SystemExit(f"gpuslo: bad service config:\n{why}") from None
    _kafka_from_config(a)
    upd: dict[str, Any] = {}
    if getattr(a, "kafka", None) and a.kafka != "-":  # "-": the config's bootstrap servers
        upd["kafka"] = _with(cfg.kafka, "--kafka", bootstrap_servers=a.kafka.split(","))
    if getattr(a, "spool_dir", None):
        upd["spool"] = _with(cfg.spool, "--spool-dir", directory=a.spool_dir)
    if getattr(a, "clickhouse", None):
        try:  # as the Kafka servers are read: [::1]:9000 for an IPv6 address, "host:" refused
            host, port = host_port(a.clickhouse)
        except ValueError as exc:
            raise SystemExit(f"gpuslo: --clickhouse: {exc}") from None
        ch = cfg.clickhouse or ClickHouseSettings()
        upd["clickhouse"] = _with(ch, "--clickhouse", host=host, **({"port": port} if port else {}))
    if getattr(a, "group", None):
        upd["ingest"] = _with(cfg.ingest, "--group", group_id=a.group)
    if getattr(a, "metrics_port", None) is not None:
        upd["ingest"] = _with(upd.get("ingest", cfg.ingest), "--metrics-port", metrics_port=a.metrics_port)
    return cfg.model_copy(update=upd) if upd else cfg


def _kafka_from_config(a: argparse.Namespace) -> None:
    """``--kafka -`` takes the bootstrap servers from ``--config``: without one it took the
    defaults' localhost:9092 (``agent --kafka -`` spooled for it and exited 1)."""
    if getattr(a, "kafka", None) == "-" and not getattr(a, "service_config", None):
        raise SystemExit(f"gpuslo {a.cmd}: --kafka - takes the bootstrap servers from --config, and none is "
                         "given: give --config, or the servers (host:port[,host:port])")  # fmt: skip


def _with(section: Any, flag: str, **changes: Any) -> Any:
    """``section`` of the service config with a flag's values, checked by the section's own model
    (``model_copy`` takes them unchecked: a port 99999 or ``host:x`` came out as a traceback)."""
    from pydantic import ValidationError

    try:
        return type(section).model_validate({**section.model_dump(), **changes})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise SystemExit(f"gpuslo: {flag}: {where}: {err['msg']} (got {err['input']!r})") from None


def _open_store(a: argparse.Namespace, cfg: Any) -> Any:
    """The ClickHouse server when one is configured (--clickhouse or the config's section), else chDB at --store."""
    from gpuslo.ingest.connect import open_store

    return open_store(cfg.clickhouse, a.store)


def _server_named(a: argparse.Namespace, prog: str, cfg: Any, config_flag: str | None) -> bool:
    """Whether the store is a ClickHouse server (``--clickhouse``, or the clickhouse section of
    the service config), refusing what that leaves unread: ``--store`` typed beside a server (the
    directory was never opened), and, where the service config is read for that section alone
    (``config_flag``), a config without one (it was read and ignored; before, it also let chDB
    make a store in any directory, the reading commands' check skipped)."""
    server = cfg.clickhouse is not None
    where = "--clickhouse" if a.clickhouse else "the service config's clickhouse section"
    if server and "--store" in getattr(a, "typed", ()):
        raise SystemExit(f"gpuslo {prog}: --store (the embedded store's directory) would be ignored: the store is "
                         f"the ClickHouse server of {where}; give one of them")  # fmt: skip
    # the file's own section (cfg has --clickhouse's): --clickhouse H beside a config without one
    # left the file read and ignored as well
    loaded = getattr(a, "loaded_service_config", cfg)
    if config_flag and getattr(a, "service_config", None) and getattr(loaded, "clickhouse", None) is None:
        raise SystemExit(f"gpuslo {prog}: {config_flag} {a.service_config} names no ClickHouse server (no clickhouse "
                         "section), the only part of it read here: it would be ignored, the store being "
                         f"{'--clickhouse' if a.clickhouse else '--store'}")  # fmt: skip
    return server


def _wire_names(a: argparse.Namespace) -> None:
    """The names an agent puts on every message, checked as the wire checks them: a --node of
    300 characters made every batch one the wire refuses, each tick, after a clean start."""
    from gpuslo.wire.models import Label, Name

    for flag, value, kind in (
        ("--node", a.node, Name),
        ("--cluster", a.cluster, Name),
        ("--pool", a.pool, Label),
    ):
        if value is None or (kind is Label and value == ""):
            continue
        _wire_name("agent", flag, value, kind)


def _wire_name(cmd: str, flag: str, value: str, kind: Any) -> None:
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(kind).validate_python(value)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise SystemExit(f"gpuslo {cmd}: {flag}: {err['msg']} (got {len(value)} characters)") from None


def cmd_agent(a: argparse.Namespace) -> int:
    from gpuslo.app.flag_rules import refusals

    if a.source not in SOURCES:
        print(f"gpuslo agent: unknown source {a.source!r} (available: {', '.join(SOURCES)})", file=sys.stderr)
        return EXIT_ERROR
    _wire_names(a)
    # a flag this run would ignore is refused, naming it (gpuslo/app/flag_rules.py: AGENT)
    if why := refusals(a.source, a.typed):
        raise SystemExit("\n".join(f"gpuslo agent: {w}" for w in why))
    _kafka_from_config(a)
    if a.source in ("nvml", "dcgm", "latency"):
        return _agent_node(a)
    if a.source in ("slurm-events", "k8s-events"):
        return _agent_cluster_events(a)
    return _agent_sim(a)


def _agent_sim(a: argparse.Namespace) -> int:
    """The simulated fleet, as fast as it goes or (--realtime) on the wall clock."""
    from gpuslo.agent.sim.run import run_fleet, run_fleet_realtime
    from gpuslo.agent.sinks import JsonLinesSink

    if a.hours is None:  # not given: an hour as fast as it goes, a month on the wall clock
        a.hours = 24.0 * 30 if a.realtime else 1.0
        a.hours_said = f"--hours {a.hours:g} (the default{' with --realtime' if a.realtime else ''})"
    if a.realtime and a.start is None:
        a.start = float(int(time.time() // a.interval_s) * a.interval_s)
    sim = _sim_config(a)
    out: IO[bytes] | None = None
    if a.kafka:
        sink = _kafka_sink(a)
    else:
        out = sys.stdout.buffer if a.out in (None, "-") else _open_out(a.out, "wb")
        sink = JsonLinesSink(out)
    stop = _stop_on_sigterm()
    try:
        if a.realtime:
            run_fleet_realtime(sim, sink, stop, a.ticks or None)
        else:
            run_fleet(sim, sink)
        delivered = sink.flush(timeout_s=a.flush_timeout_s)
        failed = getattr(sink, "send_failures", 0)
        if failed:
            print(
                f"gpuslo agent: {failed} messages could not be sent (see the warning above)", file=sys.stderr
            )
            return EXIT_PARTIAL
        if not delivered:
            print(f"gpuslo agent: not everything was delivered within {a.flush_timeout_s:g} s; "
                  "the rest stays in the spool for the next start", file=sys.stderr)  # fmt: skip
            return EXIT_PARTIAL
        return EXIT_OK
    finally:
        sink.close()
        if out is not None and out is not sys.stdout.buffer:
            out.close()


def _kafka_sink(a: argparse.Namespace) -> Any:
    """The Kafka sink through the disk spool; a spool directory it cannot use, or a producer codec
    this installation lacks, is a clear error."""
    from gpuslo.agent.assemble import kafka_sink
    from gpuslo.agent.spool import SpoolError
    from gpuslo.core.settings import SettingsError

    try:
        return kafka_sink(_service_config(a))
    except SpoolError as exc:
        print(f"gpuslo agent: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None
    except SettingsError as exc:  # a codec not installed, a password or TLS file that does not resolve
        where = a.service_config or "(the defaults)"
        print(f"gpuslo agent: bad service config {where}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def _open_out(path: str, mode: str) -> IO[bytes]:
    try:
        return open(path, mode)
    except OSError as exc:
        print(f"gpuslo agent: cannot open --out {path}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def _sink_for(a: argparse.Namespace) -> Any:
    """Kafka through the disk spool with --kafka, else JSON lines to --out or stdout."""
    from gpuslo.agent.sinks import JsonLinesSink

    if a.kafka:
        return _kafka_sink(a)
    if a.out in (None, "-"):
        return JsonLinesSink(sys.stdout.buffer)
    try:
        return JsonLinesSink(a.out)
    except OSError as exc:
        print(f"gpuslo agent: cannot open --out {a.out}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def _run_on_wall_clock(
    a: argparse.Namespace, sources: list[Any], extra: Any = None, metrics: Any = (),
    stop: threading.Event | None = None,
) -> int:  # fmt: skip
    """Tick every --interval-s on the wall clock until SIGTERM (or --ticks), with /metrics.
    ``stop``: the run's, set by SIGTERM from here on (the sources' waits for a slurmctld or
    kubelet end with it), else one made here."""
    from gpuslo.agent.assemble import WallClockAgent

    agent = WallClockAgent(sources, _sink_for(a), a.interval_s, extra, metrics=metrics)
    stop = _stop_on_sigterm(stop)
    if a.metrics_port:
        try:
            agent.serve_metrics(a.metrics_port, a.metrics_addr, names=a.dcgm_names)
        except OSError as exc:
            agent.close()
            print(f"gpuslo agent: cannot serve /metrics on {a.metrics_addr}:{a.metrics_port}: {exc.strerror or exc} "
                  "(choose another --metrics-port, or 0 for none)", file=sys.stderr)  # fmt: skip
            return EXIT_ERROR
    delivered = agent.run(stop, ticks=a.ticks or None, flush_timeout_s=a.flush_timeout_s)
    if agent.runner.stats.send_failures:
        print(f"gpuslo agent: {agent.runner.stats.send_failures} messages could not be sent (see the warning "
              "above)", file=sys.stderr)  # fmt: skip
        return EXIT_PARTIAL
    return EXIT_OK if delivered else EXIT_PARTIAL


def _latency_targets(specs: list[str]) -> list[Any]:
    """``URL=SERVICE[:METRIC[:UNIT]]``; the metric defaults to vLLM's end-to-end histogram."""
    from gpuslo.agent.scrape import VLLM, LatencyTarget

    out = []
    for spec in specs:
        url, sep, rest = spec.rpartition("=")
        if not sep or not url or not rest:
            raise SystemExit(f"gpuslo agent: --latency {spec!r}: expected URL=SERVICE[:METRIC[:UNIT]]")
        try:
            http_url(url)
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"gpuslo agent: --latency {spec[:200]!r}: {exc}") from None
        parts = rest.split(":")
        # metric names may contain ':' (vllm:...): the unit is the last part when it is a unit
        unit = VLLM[1]
        if len(parts) > 2 and parts[-1] in ("s", "ms", "us"):
            unit = parts.pop()
        service = parts[0]
        metric = ":".join(parts[1:]) or VLLM[0]
        # the service as the wire checks it, and a metric name Prometheus' text can hold: a
        # service of 300 characters, or not UTF-8, made every scrape a batch the wire refuses
        # (counted, the agent running on), and a metric no family can be named never matched
        from gpuslo.wire.models import Name

        _wire_name("agent", f"--latency {spec[:200]!r}: the service", service, Name)
        if not _METRIC_NAME.fullmatch(metric):
            raise SystemExit(f"gpuslo agent: --latency {spec[:200]!r}: {metric[:200]!r} is no Prometheus metric "
                             "name ([a-zA-Z_:][a-zA-Z0-9_:]*)")  # fmt: skip
        out.append(LatencyTarget(url, service, metric, unit))
    return out


# a Prometheus metric name (the text exposition format's; a histogram's family, without _bucket)
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _gres_conf(a: argparse.Namespace) -> Path | None:
    """The gres.conf the agent places Slurm's gres IDX with: ``--slurm-gres-conf``, else with
    ``--slurm`` the one beside ``$SLURM_CONF`` (Slurm keeps them together), else
    /etc/slurm/gres.conf."""
    if a.slurm_gres_conf is not None:
        return Path(a.slurm_gres_conf)
    if not a.slurm:
        return None
    return Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf").parent / "gres.conf"


def _node_options(a: argparse.Namespace) -> Any:
    import socket

    from gpuslo.agent.assemble import NodeOptions

    if a.source == "latency" and not a.latency:
        raise SystemExit("gpuslo agent: --source latency needs at least one --latency URL=SERVICE")
    return NodeOptions(
        source=a.source, node=a.node or socket.gethostname().split(".")[0], cluster=a.cluster,
        interval_s=a.interval_s, pool=a.pool, pool_labels=tuple(a.pool_label), slurm=a.slurm,
        hpc_job_mapping_dir=Path(a.hpc_job_mapping_dir) if a.hpc_job_mapping_dir else None,
        slurm_gres_conf=_gres_conf(a), slurm_refresh_s=a.slurm_refresh_s,
        k8s_pod_resources=a.k8s_pod_resources, k8s_api=bool(a.k8s_api), k8s_resource_slices=a.k8s_resource_slices,
        dcgm_url=a.dcgm_url, dcgm_node=a.node,
        dcgm_mig_slices=a.dcgm_mig_slices, latency=tuple(_latency_targets(a.latency)),
        proc_root=Path(a.proc_root) if a.proc_root else None, pod_log_dir=Path(a.pod_log_dir),
    )  # fmt: skip


def _agent_node(a: argparse.Namespace) -> int:
    """The node agent: NVML on real GPUs, or an existing dcgm-exporter; plus latency scrapes."""
    from gpuslo.agent.assemble import SetupError, node_agent, sample_once
    from gpuslo.agent.nvml import NvmlSource

    opts = _node_options(a)
    apis: list[Any] = []

    def kube_api() -> Any:  # asked at most once (the pool and the ResourceSlices share it)
        if not apis:
            apis.append(_kube_api(a))
        return apis[0]

    # the run's stop, given to the sources (set by SIGTERM once the run ticks): a tick waiting for
    # a slurmctld or kubelet's answer waits no more; Slurm's commands are the run's children
    stop = threading.Event()
    try:
        agent = node_agent(opts, kube_api=kube_api, stop=stop, children=a.children)
    except SetupError as exc:
        print(f"gpuslo agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    for note in agent.notes:
        print(f"gpuslo agent: {note}", file=sys.stderr)
    if a.once and agent.gpu is not None:
        src = agent.gpu
        for m in sample_once(src, a.interval_s):
            sys.stdout.write(m.model_dump_json(indent=2 if a.print else None) + "\n")
        if isinstance(src, NvmlSource):
            st = src.stats
            print(f"nvml: {len(src.gpus)} GPUs; unsupported fields {st.unsupported}, errors {st.errors}, "
                  f"lost {st.lost}", file=sys.stderr)  # fmt: skip
        src.close()
        for close in agent.closers:
            close()
        return EXIT_OK
    try:
        return _run_on_wall_clock(a, agent.sources, agent.extra, stop=stop)
    finally:
        for close in agent.closers:
            close()


def _kube_api(a: argparse.Namespace) -> Any:
    """The API server from --k8s-api (with --k8s-token-file, --k8s-ca-file), else in-cluster;
    None when not inside a pod (the message is printed)."""
    from gpuslo.agent.k8s_watch import KubeApi

    if a.k8s_api:
        from gpuslo.core.fileio import NotARegularFile, read_regular
        from gpuslo.core.settings import MAX_SECRET_BYTES

        try:
            raw = read_regular(a.k8s_token_file, MAX_SECRET_BYTES, pipes=True) if a.k8s_token_file else None
            token = raw.decode("utf-8").strip() if raw is not None else None
        except (OSError, UnicodeDecodeError) as exc:
            why = str(exc) if isinstance(exc, NotARegularFile | UnicodeDecodeError) else exc.strerror
            print(f"gpuslo agent: cannot read --k8s-token-file {a.k8s_token_file}: {why}", file=sys.stderr)
            raise SystemExit(EXIT_ERROR) from None
        try:  # the CA bundle is loaded here: missing, a directory, or no certificate in it
            return KubeApi(a.k8s_api, token, a.k8s_ca_file)
        except (OSError, ssl.SSLError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            print(f"gpuslo agent: cannot use --k8s-ca-file {a.k8s_ca_file}: {why}", file=sys.stderr)
            raise SystemExit(EXIT_ERROR) from None
    try:
        return KubeApi.in_cluster()
    except (KeyError, OSError) as exc:
        print(f"gpuslo agent: not inside a Kubernetes pod ({exc}); give --k8s-api", file=sys.stderr)
        return None


def _agent_cluster_events(a: argparse.Namespace) -> int:
    """A cluster-level scheduler collector (run one per cluster): Slurm or Kubernetes."""
    col: Any
    extra = None
    if a.source == "slurm-events":
        from gpuslo.agent.slurm import SlurmCli, SlurmEventCollector

        col = SlurmEventCollector(a.cluster, Path(a.state_file), cli=SlurmCli(children=a.children))
        extra = col.counts
    else:
        from gpuslo.agent.k8s_watch import K8sPodCollector

        api = _kube_api(a)
        if api is None:
            return EXIT_ERROR
        if a.kueue:
            return _kueue_and_pods(a, api)
        col = K8sPodCollector(a.cluster, api, Path(a.state_file), dra=_dra_view(a, api))
        col.start()
        extra = col.counts
    return _run_on_wall_clock(a, [col], extra)


def _dra_view(a: argparse.Namespace, api: Any) -> Any:
    """GPUs requested through ResourceClaims (resource.k8s.io/v1), unless --no-k8s-dra."""
    if a.no_k8s_dra:
        return None
    from gpuslo.agent.dra import DEFAULT_GPU_CLASSES, DraView, parse_gpu_class

    try:
        classes = tuple(parse_gpu_class(c) for c in a.dra_gpu_class) or DEFAULT_GPU_CLASSES
    except ValueError as exc:
        raise SystemExit(f"gpuslo agent: --dra-gpu-class {exc}") from None
    return DraView(api, classes)


def _kueue_and_pods(a: argparse.Namespace, api: Any) -> int:
    """k8s-events --kueue: Kueue's Workloads (their own state file beside the pods'), and the pods
    Kueue does not manage; the pending-age gauge per LocalQueue/ClusterQueue on /metrics."""
    from gpuslo.agent.k8s_watch import K8sPodCollector
    from gpuslo.agent.kueue import KUEUE_POD_LABELS, KueueWorkloadCollector, PendingGauge

    state = Path(a.state_file)
    pods = K8sPodCollector(a.cluster, api, state, skip_labels=KUEUE_POD_LABELS, dra=_dra_view(a, api))
    wls = KueueWorkloadCollector(a.cluster, api, state.with_name(state.stem + ".kueue.json"))
    pods.start()
    wls.start()

    def counts() -> dict[str, float]:
        return {**pods.counts(), "gpuslo_kueue_skipped_workloads": wls.skipped,
                "gpuslo_kueue_watch_bad_lines": wls.bad_lines}  # fmt: skip

    return _run_on_wall_clock(a, [pods, wls], counts, metrics=(PendingGauge(wls),))


# A second SIGTERM/SIGINT this soon after the first is the same request: GNU ``timeout`` sends
# its signal to the command and then to its own process group (the command again), and a
# terminal's Ctrl-C reaches every process of the foreground group; both were read as "again"
# and ended ``timeout 600 gpuslo ingest ...`` at once, without writing and committing.
SAME_STOP_S = 1.0


def _stop_on_sigterm(stop: threading.Event | None = None) -> threading.Event:
    """The run's stop: ``stop`` (else a new event) set by SIGTERM or SIGINT from now on (graceful
    stop: flush, commit, close). Another one, ``SAME_STOP_S`` or more after the first, ends the
    process at once, by that signal, its child commands killed first: the graceful end may wait
    for a broker that is down (the agent's ``--flush-timeout-s``, 60 s), and a second Ctrl-C did
    nothing. Nothing is lost by it: the spool, the uncommitted offsets and the outbox are on disk
    for the next start. The handlers are the run's: :func:`main` puts the ones before it back
    when it ends."""
    if stop is None:
        stop = threading.Event()
    first: list[float] = []  # when the first one came (monotonic)

    def handler(signum: int, frame: Any) -> None:
        if first and time.monotonic() - first[0] >= SAME_STOP_S:
            from gpuslo.core.proc import kill_all_now

            name = signal.Signals(signum).name
            os.write(2, f"gpuslo: {name} again: ending now, without the graceful end\n".encode())
            kill_all_now()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not first:
            first.append(time.monotonic())
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    return stop


# ---------------------------------------------------------------------------- ingest
def cmd_ingest(a: argparse.Namespace) -> int:
    """Exit 0: every line landed (replays of a line already taken included); 1: some landed,
    some were rejected (each one is in ``dead_letters``); 2: nothing landed, or a usage,
    input or store error."""
    from gpuslo.ingest.schema import MAX_TTL_DAYS

    if a.retention_days is not None and not 1 <= a.retention_days <= MAX_TTL_DAYS:
        print(f"gpuslo ingest: --retention-days must be 1..{MAX_TTL_DAYS}", file=sys.stderr)
        return EXIT_ERROR
    if a.kafka:
        return _ingest_kafka(a)
    if a.file is None:
        print(
            "gpuslo ingest: give --file PATH (JSON lines, '-' for stdin) or --kafka BOOTSTRAP",
            file=sys.stderr,
        )
        return EXIT_ERROR
    from gpuslo.ingest.jsonlines import open_input

    opened = open_input(a.file)
    if isinstance(opened, str):
        print(f"gpuslo ingest: {opened}", file=sys.stderr)
        return EXIT_ERROR
    fh, name = opened
    try:
        return _ingest_file(a, fh, name)
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


def _ingest_file(a: argparse.Namespace, fh: IO[bytes], name: str) -> int:
    from gpuslo.ingest.jsonlines import batches
    from gpuslo.ingest.pipeline import Ingestor, IngestReport, upgrade
    from gpuslo.ingest.store import ChdbStore, StoreError
    from gpuslo.rules.tables import SCHEMA

    try:
        cfg = _service_config(a)
        store = _open_store(a, cfg) if _server_named(a, "ingest", cfg, "--config") else ChdbStore(a.store)
    except StoreError as exc:
        print(f"gpuslo ingest: {exc}", file=sys.stderr)
        return EXIT_ERROR
    total = IngestReport(keep=a.max_report)
    try:
        store.migrate(SCHEMA)
        days = upgrade(store, a.retention_days, schema=SCHEMA)
        ing = Ingestor(store, retention_days=days, report_keep=a.max_report, dedup_window=a.dedup_window)
        for batch in batches(fh, name, a.max_line_bytes):
            total.merge(ing.ingest_or_isolate(batch))  # transient or fatal: raised, stop, say so
            store.flush_marks()  # a batch landed is marked for the rollups, whatever stops the next
    except StoreError as exc:
        print(f"gpuslo ingest: {str(exc).splitlines()[0]}", file=sys.stderr)
        print(
            f"gpuslo ingest: stopped after {total.received} lines ({total.accepted} landed); "
            "ingesting the file again is safe (replays replace themselves)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    finally:
        store.close()
    _print_report(total)
    if total.accepted == 0:
        return EXIT_ERROR
    return EXIT_PARTIAL if total.n_rejected else EXIT_OK


def _print_report(total: Any) -> None:
    for origin, reason in total.rejected:
        print(f"rejected {origin}: {reason}", file=sys.stderr)
    for origin, what in total.warnings:
        print(f"warning  {origin}: {what}", file=sys.stderr)
    hidden = total.n_rejected - len(total.rejected) + total.n_warnings - len(total.warnings)
    if hidden:
        print(f"... {hidden} more (all rejected lines are in the dead_letters table)", file=sys.stderr)
    rows = sum(total.written.values())
    per_table = ", ".join(f"{t} {n}" for t, n in sorted(total.written.items()) if n)
    print(
        f"ingested {total.accepted} of {total.received} messages ({rows} rows{': ' if per_table else ''}"
        f"{per_table}); rejected {total.n_rejected}; replays dropped {total.duplicates}; "
        f"warnings {total.n_warnings}",
        file=sys.stderr,
    )


def _ingest_kafka(a: argparse.Namespace) -> int:
    from gpuslo.core.kafka_errors import explain
    from gpuslo.core.metrics_http import MetricsServer
    from gpuslo.core.settings import SettingsError
    from gpuslo.ingest.connect import open_when_ready
    from gpuslo.ingest.kafka_consumer import KafkaIngest, ReadingStopped, StoppedStarting
    from gpuslo.ingest.pipeline import upgrade
    from gpuslo.ingest.store import StoreError
    from gpuslo.rules.tables import SCHEMA

    cfg = _service_config(a)
    _server_named(a, "ingest", cfg, None)  # the config's kafka and ingest sections are read
    # --metrics-port 0 typed is the table's; this is the config's ingest.metrics_port 0
    if "--metrics-addr" in getattr(a, "typed", ()) and not cfg.ingest.metrics_port:
        raise SystemExit(f"gpuslo ingest: --metrics-addr (serves /metrics while it consumes) would be ignored: "
                         f"--config {a.service_config} turns /metrics off (ingest.metrics_port 0); give --metrics-port")  # fmt: skip
    try:  # the password and the TLS files resolve now: at connect they read as a broker down
        cfg.kafka.client_kwargs()
    except SettingsError as exc:
        print(
            f"gpuslo ingest: bad service config {a.service_config or '(the defaults)'}: {exc}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    stop = _stop_on_sigterm()

    def prepare(store: Any) -> None:
        store.migrate(SCHEMA)
        upgrade(store, a.retention_days, schema=SCHEMA)  # the retention the consumer honours is read back

    def on_retry(exc: StoreError, wait_s: float) -> None:
        print(
            f"gpuslo ingest: store not ready ({_first_line(exc)}); retrying in {wait_s:g} s", file=sys.stderr
        )

    try:
        store = open_when_ready(lambda: _open_store(a, cfg), prepare, stop, cfg.ingest.retry_initial_s,
                                cfg.ingest.retry_max_s, on_retry)  # fmt: skip
    except StoreError as exc:  # credentials, database, schema: waiting will not fix it
        print(f"gpuslo ingest: cannot use the store: {_first_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    if store is None:
        return EXIT_ERROR
    after_write = None
    if a.kill_after_write:  # fault injection for the crash tests: die between insert and commit

        def after_write(n: int) -> None:
            if n >= a.kill_after_write:
                os.kill(os.getpid(), signal.SIGKILL)

    try:
        ing = KafkaIngest(cfg.kafka, cfg.ingest, store, after_write=after_write, dedup_window=a.dedup_window,
                          stop_event=stop)  # fmt: skip
    except StoppedStarting as exc:  # SIGTERM while Kafka did not answer: nothing read, nothing lost
        store.close()
        print(f"gpuslo ingest: {exc}", file=sys.stderr)
        return EXIT_OK
    except Exception as exc:  # kafka-python: no broker, authentication, TLS
        store.close()
        print(f"gpuslo ingest: {explain(cfg.kafka, exc)}", file=sys.stderr)
        return EXIT_ERROR
    server = None
    if cfg.ingest.metrics_port:
        try:
            server = MetricsServer(cfg.ingest.metrics_port, a.metrics_addr, ing.registry).start()
        except OSError as exc:  # the port taken, an address not this host's
            try:
                ing.close()  # leaves the group it joined
            finally:
                store.close()
            print(f"gpuslo ingest: cannot serve /metrics on {a.metrics_addr}:{cfg.ingest.metrics_port}: "
                  f"{exc.strerror or exc} (choose another --metrics-port, or 0 for none)", file=sys.stderr)  # fmt: skip
            return EXIT_ERROR
    try:
        ing.run(idle_exit_s=a.idle_exit_s)
    except StoreError as exc:  # fatal: nothing after the last committed batch was committed
        print(
            f"gpuslo ingest: stopped, nothing more committed (the next start re-reads): {_first_line(exc)}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except ReadingStopped as exc:  # unreadable records, Kafka refused: what was read before is committed
        print(f"gpuslo ingest: stopped (the next start reads from there): {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        store.close()
        if server is not None:
            server.close()
    return EXIT_OK


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# ---------------------------------------------------------------------------- rules
def store_dir_problem(path: str | Path) -> str | None:
    """Why ``path`` is not an embedded store a reading command may open (None: it is one). A
    command that only reads (rules eval, report, chargeback, job, rightsize) never makes a store:
    opened, chDB would create one (``data/``, ``metadata/``, ``store/``) in any directory given,
    a home directory included, and answer for it as for an empty fleet."""
    p = Path(path)
    if not p.is_dir():
        return f"{path}: no such store directory"
    if not (p / "metadata").is_dir():
        return f"{path}: not a gpuslo store (no metadata/ in it; the store is the directory `gpuslo demo` or `gpuslo ingest` wrote)"
    return None


def write_out(path: str | Path, text: str, prog: str, flag: str = "--out") -> bool:
    """Write an output file the user named (a page, rules), always UTF-8 (the pages declare it;
    the locale's encoding is ASCII under POSIX without UTF-8 mode), whole or not at all
    (core.fileio.write_outputs: a full disk left a truncated page behind); a path that is a
    directory, in a missing or read-only one, or a full disk: one line on stderr, False, and a
    file that was there is as it was."""
    from gpuslo.core.fileio import write_outputs

    try:
        write_outputs({str(path): text.encode("utf-8")})
    except OSError as exc:
        print(f"gpuslo {prog}: cannot write {flag} {path}: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True


def _on_window(a: argparse.Namespace, prog: str, fn: Any, one_line: bool = False) -> tuple[int, Any]:
    """Check --from/--to (where given), open the store (chDB at --store, or the ClickHouse
    server), run ``fn(store, rules_config)``; (exit code, result). A refusal (a store error, its
    first line only with ``one_line``, or a ValueError ``fn`` raises: the rollups cannot answer
    the window, an unknown or ambiguous job) is said on stderr and exits 2."""
    from gpuslo.app.text import terminal_safe
    from gpuslo.ingest.store import ChdbStore, StoreError
    from gpuslo.rules.tables import SCHEMA

    frm, to = getattr(a, "frm", None), getattr(a, "to", None)
    if frm is not None and to is not None and to <= frm:
        print(f"gpuslo {prog}: --to must be after --from", file=sys.stderr)
        return EXIT_ERROR, None
    cfg = _rules_config(getattr(a, "config", None))  # a bad config first: named whatever the store
    svc = _service_config(a)
    server = _server_named(a, prog, svc, "--service-config")
    problem = None if server else store_dir_problem(a.store)
    if problem:
        print(f"gpuslo {prog}: {problem}", file=sys.stderr)
        return EXIT_ERROR, None
    try:
        store = _open_store(a, svc) if server else ChdbStore(a.store)
        try:
            store.migrate(SCHEMA)
            cluster = getattr(a, "cluster", "") or ""
            if cluster and prog != "job" and not _has_cluster(store, cluster):  # job says it its way
                known = ", ".join(repr(c) for c in _clusters(store)) or "none"
                print(f"gpuslo {prog}: no data of --cluster {terminal_safe(repr(cluster))} in the store "
                      f"(its clusters: {terminal_safe(known)})", file=sys.stderr)  # fmt: skip
                return EXIT_ERROR, None
            if (
                prog != "job"
                and frm is not None
                and to is not None
                and (empty := _empty_window(store, frm, to, cluster, prog))
            ):
                print(f"gpuslo {prog}: {empty}", file=sys.stderr)
                return EXIT_ERROR, None
            return EXIT_OK, fn(store, cfg)
        finally:
            store.close()
    except StoreError as exc:  # its text may quote the data (a name, a value the server refused)
        print(
            f"gpuslo {prog}: {terminal_safe(str(exc).splitlines()[0] if one_line else exc.reason)}",
            file=sys.stderr,
        )
        return EXIT_ERROR, None
    except ValueError as exc:  # the rollups cannot answer this window; a job unknown or ambiguous
        print(f"gpuslo {prog}: {terminal_safe(str(exc))}", file=sys.stderr)  # names from the store in it
        return EXIT_ERROR, None


# the tables a cluster's data is in (raw rows, and the rollups that outlive them)
_CLUSTER_TABLES = (
    "gpu_samples",
    "node_heartbeats",
    "sched_events",
    "latency",
    "gpu_rollup_1m",
    "latency_rollup_1m",
)


def _has_cluster(store: Any, cluster: str) -> bool:
    """Whether any row of the store names ``cluster`` (each table's first key column: a lookup)."""
    union = " UNION ALL ".join(
        f"SELECT 1 AS x FROM (SELECT cluster FROM {t} WHERE cluster = {{c:String}} LIMIT 1)"
        for t in _CLUSTER_TABLES
    )
    return bool(store.query(f"SELECT count() AS n FROM ({union})", {"c": cluster})[0]["n"])


# each table with rows that stand for a window: its time column, for how long after it a row
# stands (SQL, seconds), and what else a row must hold: a GPU sample or heartbeat until it is
# 2 x its interval old (the starvation snapshot's rule; rules/sql.py SNAP_LOOKBACK_S bounds it),
# a minute rollup its minute (a sample marks every minute of [ts, ts + 2 x interval_s):
# rules/rollup.py), the others as far as the longest a sample may stand (a request pending, a
# burn window's rows before it)
_WINDOW_TABLES = {
    "gpu_samples": ("ts", "2 * interval_s", "1"),
    "node_heartbeats": ("ts", "2 * interval_s", "1"),
    "sched_events": ("ts", "{span:Float64}", "1"),
    "latency": ("ts", "{span:Float64}", "1"),
    "gpu_rollup_1m": ("minute", "60", "1"),
    "latency_rollup_1m": ("minute_end", "{span:Float64}", "1"),
}
# the GPU capacity the bill, the right-sizing and the replay read: a sample for its interval
# (rules/sql.py CAPACITY_SAMPLES), a minute rollup where it holds capacity (a minute a sample's
# snapshot only reaches holds none): a window past the last sample's interval was a bill of 0.00
_CAPACITY = {"gpu_samples": ("ts", "interval_s", "1"), "gpu_rollup_1m": ("minute", "60", "capacity_s > 0")}
# the tables each command answers from (every one for rules eval and report): a window with rows
# of the others only (a scraper's latency rows, a scheduler's events) was a bill of 0.00
_COMMAND_TABLES = {
    "chargeback": _CAPACITY,  # the rollups: RawRowsGone says why the raw rows' window is not billed
    "rightsize": {"gpu_samples": _CAPACITY["gpu_samples"]},  # raw samples only (their memory)
    "whatif": {"gpu_samples": _CAPACITY["gpu_samples"], "sched_events": _WINDOW_TABLES["sched_events"]},
}


def window_rows_query(prog: str) -> str:
    """SQL: how many of ``prog``'s tables hold a row in or standing for ``[frm, to)`` (each
    scan stops at its first row); parameters ``lo`` (``frm`` less SNAP_LOOKBACK_S, the furthest
    any row stands), ``frm``, ``to``, ``c`` (the cluster, '' every one) and ``span``."""
    union = " UNION ALL ".join(
        f"SELECT 1 AS x FROM (SELECT 1 FROM {t} WHERE ({{c:String}} = '' OR cluster = {{c:String}}) "
        f"AND {col} >= toDateTime64({{lo:Float64}}, 3, 'UTC') AND {col} < toDateTime64({{to:Float64}}, 3, 'UTC') "
        f"AND toFloat64({col}) + {span} > {{frm:Float64}} AND {cond} LIMIT 1)"
        for t, (col, span, cond) in _COMMAND_TABLES.get(prog, _WINDOW_TABLES).items()
    )
    return f"SELECT count() AS n FROM ({union})"


def _empty_window(store: Any, frm: float, to: float, cluster: str, prog: str = "") -> str | None:
    """Why the window ``[frm, to)`` holds nothing ``prog`` answers from (None: it holds rows):
    no row of its tables (``_COMMAND_TABLES``; every table for rules eval and report) in the
    window or standing for part of it (a sample stands for the time after it until it is 2 x its
    interval old; for the GPU capacity the bill reads, for its interval). A window with no data (a year mistyped, a month before the fleet reported, a
    day after it stopped) was answered as an idle fleet: a bill of 0.00, CUR "-" and zero idle
    hours, exit 0."""
    from gpuslo.app.text import terminal_safe
    from gpuslo.rules.sql import SNAP_LOOKBACK_S

    p = {"lo": frm - SNAP_LOOKBACK_S, "frm": frm, "to": to, "c": cluster, "span": SNAP_LOOKBACK_S}
    if store.query(window_rows_query(prog), p)[0]["n"]:
        return None
    held = store.query(
        "SELECT count() AS n, min(ts) AS lo, max(ts) AS hi FROM gpu_samples "
        "WHERE {c:String} = '' OR cluster = {c:String}",
        {"c": cluster},
    )[0]
    where = f" of --cluster {terminal_safe(repr(cluster))}" if cluster else ""
    span = (
        f"its GPU samples{where} run from {_utc(held['lo'])} to {_utc(held['hi'])}"
        if held["n"]
        else f"it holds no GPU samples{where}"
    )
    return f"no data in the window {_utc(frm)} → {_utc(to)} in the store ({span}): nothing to answer for"


def _utc(t: Any) -> str:
    """A time from the store (a datetime) or the command line (epoch seconds), to the second."""
    from gpuslo.app.text import ts

    return ts(t.timestamp() if isinstance(t, datetime) else float(t), seconds=True) + " UTC"


def _clusters(store: Any, most: int = 20) -> list[str]:
    """Some clusters the store holds (for the message naming a --cluster it does not)."""
    union = " UNION ALL ".join(f"SELECT DISTINCT cluster FROM {t}" for t in _CLUSTER_TABLES)
    rows = store.query(f"SELECT DISTINCT cluster FROM ({union}) ORDER BY cluster LIMIT {int(most)}")
    return [str(r["cluster"]) for r in rows]


def cmd_rules_eval(a: argparse.Namespace) -> int:
    from gpuslo.app import text
    from gpuslo.rules.evaluate import summary
    from gpuslo.rules.model import Summary, to_json

    def run(store: Any, cfg: Any) -> Summary:
        if a.source != "raw":
            from gpuslo.rules import rollup

            rollup.refresh(store)  # idempotent; cheap when nothing is new
        return summary(store, cfg, a.frm, a.to, a.cluster, source=a.source)

    rc, s = _on_window(a, "rules eval", run)
    if rc == EXIT_OK:
        print(
            json.dumps(to_json(s), indent=2, sort_keys=True)
            if a.json
            else text.terminal_safe(text.summary(s))
        )
    return rc


def cmd_rules_run(a: argparse.Namespace) -> int:
    """The rules service (rules/service.py): every ``--every-s``, refresh the rollups, evaluate
    the last ``--window-s`` (ending on the last whole minute), write the results to
    ``rule_results``, deliver alerts, and print the summary as one JSON line."""
    from gpuslo.ingest.store import StoreError
    from gpuslo.rules import rollup
    from gpuslo.rules.service import RulesService

    cfg = _rules_config(a.config)
    # every round's window is [to - window, to) with `to` on a whole minute: one check for all
    why_not = rollup.usable(cfg.idle_threshold, 0.0, a.window_s, cfg.eval_step_s, cfg.min_idle_s)
    if a.source == "rollup" and why_not is not None:
        print(f"gpuslo rules run: cannot evaluate over the rollups: {why_not} (use --source auto or raw)",
              file=sys.stderr)  # fmt: skip
        return EXIT_ERROR
    svc_cfg = _service_config(a)
    _server_named(a, "rules run", svc_cfg, "--service-config")
    stop = _stop_on_sigterm()
    service = RulesService(cfg, lambda: _open_store(a, svc_cfg), window_s=a.window_s, source=a.source,
                           notifier=_notifier(a), resend_s=a.resend_s,
                           flush_s=2 * a.delivery_deadline_s + 1 if a.once else None,
                           children=a.children)  # fmt: skip
    try:
        ok = service.run(stop, a.every_s, lambda s: print(json.dumps(s, sort_keys=True), flush=True), a.once)
    except StoreError as exc:  # fatal: credentials, database, schema: let the supervisor restart us
        print(f"gpuslo rules run: cannot use the store: {_first_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        service.close()
    return EXIT_ERROR if a.once and not ok else EXIT_OK  # --once: non-zero when the round failed


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < v < 1e9):  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, not {text!r}")
    return v


def _notifier(a: argparse.Namespace) -> Any:
    """The alert receivers of ``rules run`` (flags, URL files, environment), their URLs'
    secrets added to the log redaction, and their delivery workers started; None without
    receivers."""
    from gpuslo.core.settings import redact_logs
    from gpuslo.rules.alerts import Notifier
    from gpuslo.rules.delivery import Policy
    from gpuslo.rules.receivers import Kind, ReceiverError, from_sources

    log = logging.getLogger(__name__)
    receivers = []
    kinds: tuple[Kind, ...] = ("alertmanager", "webhook")
    try:
        for kind in kinds:
            found, warnings = from_sources(
                kind, getattr(a, kind), getattr(a, f"{kind}_url_file"), dict(os.environ)
            )
            redact_logs([x for r in found for x in r.secrets()])
            receivers += found
            for w in warnings:
                log.warning("%s", w)
    except ReceiverError as exc:
        raise SystemExit(f"gpuslo rules run: {exc}") from None
    if not receivers:
        return None
    policy = Policy(deadline_s=a.delivery_deadline_s, max_age_s=a.outbox_max_age_s)
    try:
        return Notifier(Path(a.outbox), receivers, policy=policy)
    except OSError as exc:
        raise SystemExit(f"gpuslo rules run: alert outbox {a.outbox}: {exc.strerror}") from None


def cmd_rules_export_prometheus(a: argparse.Namespace) -> int:
    from gpuslo.rules.prometheus import render

    text = render(_rules_config(a.config))
    if a.out in (None, "-"):
        sys.stdout.write(text)
    else:
        if not write_out(a.out, text, "rules export-prometheus"):
            return EXIT_ERROR
        print(a.out)
    return EXIT_OK


def cmd_dashboards(a: argparse.Namespace) -> int:
    from gpuslo.dashboards.generate import write

    try:
        paths = write(_rules_config(a.config), a.out)
    except OSError as exc:
        print(f"gpuslo dashboards: cannot write --out {a.out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    for p in paths:
        print(p)
    return EXIT_OK


def cmd_report(a: argparse.Namespace) -> int:
    from gpuslo.dashboards.report import render

    rc, page = _on_window(a, "report", lambda store, cfg: render(store, cfg, a.frm, a.to, a.cluster))
    if rc == EXIT_OK:
        if not write_out(a.out, page, "report"):
            return EXIT_ERROR
        print(a.out)
    return rc


def cmd_schema(a: argparse.Namespace) -> int:
    from gpuslo.ingest import cluster
    from gpuslo.rules.tables import SCHEMA

    if a.cluster is None:
        sys.stdout.write(SCHEMA.render())
        return EXIT_OK
    try:
        sys.stdout.write(cluster.render(SCHEMA, a.cluster))
    except ValueError as exc:
        print(f"gpuslo schema: --cluster: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


# ---------------------------------------------------------------------------- main
def _add_store_args(p: argparse.ArgumentParser) -> None:
    """Where the data is: chDB at --store, or a ClickHouse server."""
    p.add_argument("--store", type=path_arg, default="gpuslo-data", help="embedded store directory")
    p.add_argument("--clickhouse", type=text_arg, help="ClickHouse server host[:port] instead of --store")
    p.add_argument("--service-config", type=path_arg, help="service config YAML (its clickhouse section)")


def _add_window_args(p: argparse.ArgumentParser) -> None:
    """A window [from, to) of one or every cluster, and the rules config."""
    _add_store_args(p)
    p.add_argument("--from", dest="frm", type=parse_time, required=True, help="ISO-8601 or epoch seconds")
    p.add_argument("--to", type=parse_time, required=True, help="ISO-8601 or epoch seconds (exclusive)")
    p.add_argument(
        "--cluster", type=name_arg, default="", help="one cluster, its exact name ('' or absent: all)"
    )
    p.add_argument("--config", type=path_arg, help="rules config YAML (default: the shipped example)")


def _add_demo(sub: Any, common: argparse.ArgumentParser) -> None:
    d = sub.add_parser("demo", parents=[common], help="run the whole pipeline embedded on a simulated fleet")
    _add_sim_args(d, hours=12.0, hours_help="default 12")
    d.add_argument("--config", type=path_arg, help="rules config YAML (default: the shipped example)")
    d.add_argument(
        "--out", type=path_arg, default="gpuslo-demo", help="directory for the store and dashboards"
    )
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument(
        "--force", action="store_true", help="write into a non-empty --out the demo did not create"
    )
    d.add_argument("--quiet", action="store_true", help="no progress display")
    d.set_defaults(func=cmd_demo)


def _add_agent(sub: Any, common: argparse.ArgumentParser) -> None:
    ag = sub.add_parser("agent", parents=[common], help="run an agent: to Kafka (--kafka) or as JSON lines")
    ag.add_argument("--source", default="sim", help=", ".join(SOURCES))
    ag.add_argument(
        "--out", type=path_arg, help="JSON-lines file when not sending to Kafka (default: stdout)"
    )
    ag.add_argument(
        "--kafka",
        type=text_arg,
        help="bootstrap servers host:port[,host:port]: send to Kafka through the disk spool",
    )
    ag.add_argument(
        "--config", type=path_arg, dest="service_config", help="service config YAML (kafka, producer, spool)"
    )
    ag.add_argument("--spool-dir", type=path_arg, help="spool directory (overrides the config)")
    ag.add_argument(
        "--realtime", action="store_true", help="sample on the wall clock instead of as fast as possible"
    )
    ag.add_argument(
        "--ticks",
        type=integer(0, 10**9),
        default=0,
        help="stop after this many wall-clock ticks, 0 for no limit (the simulated fleet: with --realtime)",
    )
    ag.add_argument(
        "--flush-timeout-s",
        type=seconds(-1e-9, 86_400),
        default=60.0,
        help="at the end, wait this long for delivery",
    )
    ag.add_argument(
        "--once",
        action="store_true",
        help="nvml, dcgm: sample the GPUs once, print the messages as JSON, exit",
    )
    ag.add_argument("--print", action="store_true", help="with --once: indented JSON")

    _add_agent_node_args(ag)
    _add_agent_scrape_args(ag)
    _add_sim_args(ag, hours=None, hours_help="default 1; with --realtime 720, a month")
    ag.set_defaults(func=cmd_agent)


def _add_agent_node_args(ag: argparse.ArgumentParser) -> None:
    """The node: its name and pool, attribution (Slurm, Kubernetes), the cluster collectors."""
    ag.add_argument(
        "--node", type=node_arg, help="node name, as its scheduler knows it (default: the host name)"
    )
    ag.add_argument("--pool", type=utf8_text, default="",
                    help="partition / node pool this node serves (default: from the scheduler: with --slurm the "
                    "node's partitions from sinfo, sorted and joined with ','; on Kubernetes, with "
                    "--k8s-pod-resources or --k8s-api, the Node's first --pool-label)")  # fmt: skip
    ag.add_argument("--pool-label", action="append", type=label_key, default=[], metavar="KEY",
                    help="Kubernetes Node label naming its pool, tried in order (repeatable; default: "
                    "cloud.google.com/gke-nodepool, eks.amazonaws.com/nodegroup, kubernetes.azure.com/agentpool, "
                    "agentpool, karpenter.sh/nodepool)")  # fmt: skip
    ag.add_argument(
        "--slurm",
        action="store_true",
        help="nvml: attribute GPUs to Slurm jobs (squeue --json) and report the node's state",
    )
    ag.add_argument(
        "--slurm-gres-conf",
        type=path_arg,
        help="nvml --slurm: the node's gres.conf, whose File= order places Slurm's gres IDX on NVML's GPUs "
        "(default: gres.conf beside $SLURM_CONF, else /etc/slurm/gres.conf)",
    )
    ag.add_argument(
        "--slurm-refresh-s",
        type=seconds(0, 3600, lo_in=True),
        default=0.0,
        metavar="S",
        help="--slurm: ask slurmctld (squeue --json, sinfo --json) at most once per S seconds, the answers "
        "shared by the job attribution and the node's heartbeat (default 0: every tick). Slurm 22.05's --json "
        "ignores every filter: each ask is the whole cluster's job or node list; on a large cluster give "
        "30 or more (a job's end then seen up to S late)",
    )
    ag.add_argument(
        "--hpc-job-mapping-dir",
        type=path_arg,
        help="nvml: attribute GPUs from dcgm-exporter's HPC job mapping directory",
    )
    ag.add_argument(
        "--k8s-pod-resources",
        type=path_arg,
        nargs="?",
        const="/var/lib/kubelet/pod-resources/kubelet.sock",
        help="nvml: attribute GPUs to pods through the kubelet PodResources socket",
    )
    ag.add_argument("--k8s-resource-slices", action="store_true",
                    help="nvml with --k8s-pod-resources: resolve DRA claim devices to GPU/MIG UUIDs through this "
                    "node's ResourceSlices (watched; needs get/list/watch on resourceslices)")  # fmt: skip
    ag.add_argument(
        "--no-k8s-dra",
        action="store_true",
        help="k8s-events: count only device-plugin GPUs, not those requested through ResourceClaims",
    )
    ag.add_argument("--dra-gpu-class", action="append", default=[], metavar="NAME[=DRIVER[:TYPE]]",
                    help="k8s-events: a DeviceClass whose devices are GPUs, with its driver and the device 'type' "
                    "attribute it selects (repeatable; default: gpu.nvidia.com=gpu.nvidia.com:gpu and "
                    "mig.nvidia.com=gpu.nvidia.com:mig, the NVIDIA DRA driver's classes)")  # fmt: skip
    ag.add_argument("--proc-root", default="/proc",
                    help="nvml: the host's /proc, to split shared GPUs by their holders' processes (their "
                    "cgroups name the pod or job); '' turns the split off (equal split)")  # fmt: skip
    ag.add_argument("--pod-log-dir", type=path_arg, default="/var/log/pods",
                    help="nvml with --k8s-pod-resources: the kubelet's pod log directories, <ns>_<pod>_<uid> "
                    "(pod UID -> namespace/name for the split of shared GPUs)")  # fmt: skip
    ag.add_argument(
        "--state-file",
        type=path_arg,
        default="/var/lib/gpuslo/slurm-collector.json",
        help="slurm-events, k8s-events: emitted-event state",
    )
    ag.add_argument("--kueue", action="store_true",
                    help="k8s-events: also follow Kueue Workloads (kueue.x-k8s.io/v1beta2); their pods count once, "
                    "through the Workload")  # fmt: skip
    ag.add_argument(
        "--k8s-api", type=http_url, help="k8s-events: API server URL (default: in-cluster service account)"
    )
    ag.add_argument(
        "--k8s-token-file", type=path_arg, help="k8s-events with --k8s-api: file holding a bearer token"
    )
    ag.add_argument(
        "--k8s-ca-file",
        type=path_arg,
        help="k8s-events with --k8s-api: CA bundle for the API server's certificate",
    )


def _add_agent_scrape_args(ag: argparse.ArgumentParser) -> None:
    """dcgm-exporter and latency scrapes, the agent's own /metrics."""
    from gpuslo.wire.dcgm_names import DEFAULT_GENERATION, GENERATIONS

    ag.add_argument(
        "--dcgm-url",
        type=http_url,
        default="http://localhost:9400/metrics",
        help="dcgm: the dcgm-exporter to scrape",
    )
    ag.add_argument("--dcgm-mig-slices", type=int, default=7, choices=range(1, 9), metavar="N",
                    help="dcgm: MIG slices of one GPU (7 on A100/H100/H200, 4 on A30)")  # fmt: skip
    ag.add_argument(
        "--latency",
        type=utf8_text,
        action="append",
        default=[],
        metavar="URL=SERVICE[:METRIC[:UNIT]]",
        help="scrape an inference server's latency histogram (repeatable; default metric: vLLM's)",
    )
    ag.add_argument("--metrics-port", type=PORT, default=9400, help="nvml: Prometheus /metrics port (0: off)")
    ag.add_argument("--dcgm-names", choices=GENERATIONS, default=DEFAULT_GENERATION,
                    help="the dcgm-exporter generation /metrics speaks: dcgm48 (default; as dcgm-exporter 4.10: "
                    "DCGM 4.8 names and units, the hostname label), dcgm47 (as dcgm-exporter 4.9: DCGM 4.7's) "
                    "or classic (as dcgm-exporter up to 4.8.2: "
                    "classic names and units, the Hostname label), for dashboards written for either")  # fmt: skip
    ag.add_argument("--metrics-addr", type=bind_addr, default="127.0.0.1",
                    help="address for /metrics (default 127.0.0.1, loopback only: it names GPUs, jobs and pods; "
                    "give 0.0.0.0 where Prometheus scrapes the node or the pod IP, as the DaemonSet and "
                    "the systemd unit do)")  # fmt: skip


def _add_ingest(sub: Any, common: argparse.ArgumentParser) -> None:
    ig = sub.add_parser(
        "ingest", parents=[common], help="load wire messages into a store, from Kafka or a file"
    )
    ig.add_argument("--file", type=path_arg, help="JSON-lines file of wire messages ('-' for stdin)")
    ig.add_argument(
        "--kafka", type=text_arg, help="bootstrap servers: consume the wire topics as a consumer group"
    )
    ig.add_argument(
        "--config",
        type=path_arg,
        dest="service_config",
        help="service config YAML (kafka, clickhouse, ingest)",
    )
    ig.add_argument(
        "--store",
        type=path_arg,
        default="gpuslo-data",
        help="embedded store directory (when no ClickHouse server)",
    )
    ig.add_argument(
        "--clickhouse",
        type=text_arg,
        help="ClickHouse server host[:port] (native protocol) instead of --store",
    )
    ig.add_argument("--group", type=text_arg, help="consumer group id")
    ig.add_argument("--metrics-port", type=PORT, help="Prometheus /metrics port (0: off)")
    ig.add_argument("--metrics-addr", type=bind_addr, default="127.0.0.1",
                    help="address for /metrics (default 127.0.0.1, loopback only; 0.0.0.0 where Prometheus scrapes it "
                    "from elsewhere, as docker-compose.yml does)")  # fmt: skip
    ig.add_argument(
        "--idle-exit-s", type=seconds(0, 1e7), help="exit after this long without messages (batch backfills)"
    )
    ig.add_argument("--kill-after-write", type=int, default=0, help=argparse.SUPPRESS)
    ig.add_argument(
        "--max-report",
        type=integer(0, 1_000_000),
        default=50,
        help="rejected/warning lines to keep and print (the rest are counted)",
    )
    # a line is read whole into memory: a bound a file read can take (--max-line-bytes 1e22 was
    # an OverflowError traceback from readline), and so is each of the others
    ig.add_argument(
        "--max-line-bytes",
        type=integer(1024, 1 << 30),
        default=4 * 2**20,
        help="longest line taken (default 4194304, 4 MiB); a longer one is a dead letter",
    )
    ig.add_argument(
        "--dedup-window",
        type=integer(0, 10_000_000),
        default=250_000,
        help="message ids remembered to tell a replay (dropped) from a different message reusing an id "
        "(dead letter); about 190 B each",
    )
    ig.add_argument(
        "--retention-days",
        type=int,
        help="set the store's retention (TTL of the raw tables) before ingesting, e.g. to backfill history "
        "(default: keep the store's, 400 days for a new one)",
    )
    ig.set_defaults(func=cmd_ingest)


def _add_rules(sub: Any, common: argparse.ArgumentParser) -> None:
    r = sub.add_parser("rules", parents=[common], help="evaluate rules")
    rsub = r.add_subparsers(dest="rules_cmd", required=True)
    ev = rsub.add_parser("eval", parents=[common], help="the four numbers for a window")
    _add_window_args(ev)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--source", choices=("raw", "rollup", "auto"), default="raw",
                    help="raw rows, or the per-minute rollups (refreshed first); auto: rollups when possible")  # fmt: skip
    ev.set_defaults(func=cmd_rules_eval)

    _add_rules_run(rsub, common)
    rx = rsub.add_parser(
        "export-prometheus", parents=[common], help="the SLOs as Prometheus recording and alerting rules"
    )
    rx.add_argument("--config", type=path_arg, help="rules config YAML (default: the shipped example)")
    rx.add_argument("--out", type=path_arg, help="file (default: stdout)")
    rx.set_defaults(func=cmd_rules_export_prometheus)


def _add_rules_run(rsub: Any, common: argparse.ArgumentParser) -> None:
    rr = rsub.add_parser(
        "run", parents=[common], help="evaluate the last window every interval; print JSON lines"
    )
    _add_store_args(rr)
    rr.add_argument("--config", type=path_arg, help="rules config YAML (default: the shipped example)")
    rr.add_argument(
        "--window-s", type=seconds(0, 366 * 86_400), default=3600.0, help="evaluate [now - window, now)"
    )
    rr.add_argument("--every-s", type=seconds(0, 86_400), default=60.0, help="evaluation interval")
    rr.add_argument("--once", action="store_true", help="evaluate once and exit")
    rr.add_argument("--source", choices=("auto", "rollup", "raw"), default="auto",
                    help="evaluate over the per-minute rollups (auto: when the config allows) or the raw rows")  # fmt: skip
    _add_receiver_args(rr)
    rr.set_defaults(func=cmd_rules_run)


def _add_receiver_args(rr: argparse.ArgumentParser) -> None:
    # receivers: each has its own outbox and worker; a URL (credentials in user:password@, a
    # Slack hook's token in its path) is a secret: prefer the file or the environment to a flag
    rr.add_argument("--alertmanager", action="append", metavar="URL",
                    help="Alertmanager base URL (alerts go to its /api/v2/alerts); repeatable; also $GPUSLO_ALERTMANAGER_URL")  # fmt: skip
    rr.add_argument("--alertmanager-url-file", type=path_arg, action="append", metavar="FILE",
                    help="file with Alertmanager URL(s), one per line (keeps them out of ps)")  # fmt: skip
    rr.add_argument("--webhook", action="append", metavar="URL",
                    help="Slack-compatible webhook URL; repeatable; also $GPUSLO_WEBHOOK_URL")  # fmt: skip
    rr.add_argument("--webhook-url-file", type=path_arg, action="append", metavar="FILE",
                    help="file with webhook URL(s), one per line (keeps them out of ps)")  # fmt: skip
    rr.add_argument("--outbox", type=path_arg, default="/var/lib/gpuslo/alerts-outbox",
                    help="directory of the receivers' outboxes (0700; one 0600 file per receiver)")  # fmt: skip
    rr.add_argument("--delivery-deadline-s", type=_positive, default=10.0,
                    help="total time one delivery attempt may take (connect, send, answer)")  # fmt: skip
    rr.add_argument("--outbox-max-age-s", type=_positive, default=86400.0,
                    help="drop (and count) a notification still undelivered after this long")  # fmt: skip
    rr.add_argument(
        "--resend-s", type=seconds(0, 7 * 86_400), default=60.0, help="re-send firing alerts this often"
    )


def _add_dashboards_report_schema(sub: Any, common: argparse.ArgumentParser) -> None:
    db = sub.add_parser("dashboards", parents=[common], help="Grafana dashboards")
    dsub = db.add_subparsers(dest="dash_cmd", required=True)
    gen = dsub.add_parser("generate", parents=[common], help="write the dashboards as Grafana JSON")
    gen.add_argument(
        "--out", type=path_arg, default="dashboards/generated", help="directory for the JSON files"
    )
    gen.add_argument("--config", type=path_arg, help="rules config YAML (default: the shipped example)")
    gen.set_defaults(func=cmd_dashboards)

    rp = sub.add_parser("report", parents=[common], help="a self-contained HTML report of the four numbers")
    _add_window_args(rp)
    rp.add_argument("--out", type=path_arg, default="gpuslo-report.html", help="the HTML file")
    rp.set_defaults(func=cmd_report)

    sc = sub.add_parser("schema", parents=[common], help="print the ClickHouse DDL")
    sc.add_argument(
        "--cluster",  # checked as a cluster name (an empty one too) by ingest.cluster
        metavar="NAME",
        help="the DDL for a ClickHouse cluster of that remote_servers name: ON CLUSTER, Replicated "
        "local tables and Distributed tables over them (docs/deployment.md)",
    )
    sc.set_defaults(func=cmd_schema)


def _default_text(d: Any) -> str:
    """A default as --help shows it: a whole float without its ``.0`` (60, not 60.0), any other
    as Python writes it back exactly (``%g`` gave 2592000.0 as 2.592e+06 and 1234567.0 as
    1.23457e+06, another number)."""
    if isinstance(d, float):
        return str(int(d)) if d.is_integer() and abs(d) < 1e16 else repr(d)
    return str(d)


class _DefaultsFormatter(argparse.HelpFormatter):
    """An option's help ends with its default where it has one (not None, a flag's False, or an
    empty text) and the help does not say it already: `rules run --help` gave no default for
    --every-s, --window-s, --outbox or --resend-s, nor `ingest --help` for --store."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        d = action.default
        if (
            text == argparse.SUPPRESS
            or not action.option_strings
            or d is None
            or d is False
            or d is argparse.SUPPRESS
            or d in ("", (), [])
            or "default" in (text or "")
        ):
            return text
        shown = _default_text(d).replace("%", "%%")
        return f"default: {shown}" if text is None else f"{text} (default: {shown})"


class _Parser(argparse.ArgumentParser):
    """Every parser of the CLI, subcommands' included (argparse makes them of the root's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="gpuslo",
        description="GPU telemetry and SLO observability: CUR, idle GPU time, starvation incidents, latency SLO burn.",
        epilog="Exit codes: 0 success; 1 partial (some input rejected, the rest landed); 2 usage or configuration "
        "error, or nothing could be done.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging"
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    from gpuslo.app.chargeback import add_parser as _add_chargeback
    from gpuslo.app.topics import add_parser as _add_topics
    from gpuslo.app.whatif import add_parser as _add_whatif

    for add in (
        _add_demo,
        _add_agent,
        _add_ingest,
        _add_rules,
        _add_dashboards_report_schema,
        _add_chargeback,
        _add_whatif,
        _add_topics,
    ):
        add(sub, common)
    from gpuslo.app.jobcmd import add_commands as add_job_commands  # job, rightsize

    add_job_commands(sub, common)
    return p


class OneLineLibraryErrors(logging.Filter):
    """The records of the named libraries' loggers with their exception on the message's line
    (``...: ConnectionResetError: [Errno 104] Connection reset by peer``), not as a traceback:
    kafka-python logs a broker that restarts under the consumer with one, which read as a crash
    of gpuslo's own. ``-v`` keeps the tracebacks."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or not _of(record.name, self.prefixes):
            return True
        exc = record.exc_info[1]
        if exc is not None:
            text = str(exc).splitlines()[0] if str(exc) else ""
            try:
                msg = record.getMessage()
            except Exception:  # a bad format string: as the handler would print it
                msg = f"{record.msg} {record.args!r}"
            record.msg, record.args = f"{msg}: {type(exc).__name__}" + (f": {text}" if text else ""), None
        record.exc_info, record.exc_text = None, None
        return True


def _of(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether logger ``name`` is one of ``prefixes`` or below one (``kafka``, ``kafka.net``;
    not ``kafkaesque``)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class RepeatedLibraryLogs(logging.Filter):
    """A record of the named libraries' loggers that says again what one said less than
    ``every_s`` ago (the same logger, level and text, durations aside) is held back; the next one
    after that says how many were. kafka-python logs each try to reach a broker that is down or
    whose name does not resolve in four or five lines, some 80 lines in 36 s, for as long as
    it lasts; gpuslo says once that Kafka is unavailable. ``-v`` keeps every one.

    Only a duration and the client's own port are ignored (``backoff 0.45 secs``, ``waiting 1.72
    secs``, ``(100 ms)``, ``[10.0.0.1:9092<-51234]``: the
    numbers kafka-python's repeats differ by, recorded against brokers down and unresolvable):
    with every number ignored, ``DNS lookup failed for kafka2:9092`` was held back as a repeat of
    ``kafka1:9092``'s, and so were another node id, partition, address or error code. One
    filter may sit on several handlers: a record is judged once (the second handler dropped
    every record the first had shown)."""

    _NUMBERS = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?=\s?(?:ms|s|secs?|seconds)\b)")
    # the client's own ephemeral port in kafka-python's transport lines (``[10.0.0.1:9092<-51234]``):
    # a new one each try, so a broker that closed every connection (a wrong SASL password) was
    # a new text each second, 2 lines a try, never held back
    _LOCAL_PORT = re.compile(r"(?<=<-)\d+(?=\])")
    _JUDGED = "_gpuslo_repeat_shown"

    def __init__(
        self, prefixes: tuple[str, ...], every_s: float = 60.0, clock: Any = time.monotonic, keys: int = 1024
    ) -> None:
        super().__init__()
        self.prefixes, self.every_s, self.clock, self.keys = prefixes, every_s, clock, keys
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (last shown, held since)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        judged: bool | None = getattr(record, self._JUDGED, None)
        if judged is not None:
            return judged
        shown = self._judge(record)
        setattr(record, self._JUDGED, shown)
        return shown

    def _judge(self, record: logging.LogRecord) -> bool:
        if not _of(record.name, self.prefixes):
            return True
        try:
            text = record.getMessage()
        except Exception:  # a bad format string: the handler says so
            return True
        key = (record.name, record.levelno, self._LOCAL_PORT.sub("#", self._NUMBERS.sub("#", text)))
        now = self.clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.every_s:
                self._seen[key] = (seen[0], seen[1] + 1)
                return False
            if len(self._seen) >= self.keys and key not in self._seen:
                self._seen.clear()  # bounded: a library that logs ever new texts
            self._seen[key] = (now, 0)
        if seen is not None and seen[1]:
            record.msg, record.args = (
                f"{text} ({seen[1]} more like it held back in {now - seen[0]:.0f} s)",
                None,
            )
        return True


def _refused(a: argparse.Namespace, argv: Sequence[str] | None) -> str | None:
    """Why the command refuses flags it would ignore (None: it reads every one): the flags typed,
    in ``a.typed``, against the command's table in gpuslo/app/flag_rules.py (another command's
    store flags: ``--store`` beside ``--clickhouse``). The agent's are checked by ``cmd_agent``,
    per --source, once the source is known."""
    from gpuslo.app.flag_rules import ANY, BY_COMMAND, RECEIVERS, STORE, refusals, typed

    path = (a.cmd, *([a.rules_cmd] if a.cmd == "rules" else []))
    if path not in BY_COMMAND and not hasattr(a, "store"):  # nothing to check: no second parse
        return None
    rules = BY_COMMAND.get(path, STORE)  # another command's store flags: --store beside a server
    a.typed = typed(build_parser(), argv, path, rules)
    if path == ("agent",):
        return None
    if path == ("rules", "run"):  # a receiver named by the environment counts as one typed
        from gpuslo.rules.receivers import urls_in

        a.typed |= {r for r in RECEIVERS if r.startswith("$") and urls_in(os.environ.get(r[1:], ""))}
    why = refusals(ANY[0], a.typed, rules)
    return "\n".join(f"gpuslo {' '.join(path)}: {w}" for w in why) or None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if refused := _refused(args, argv):
        print(refused, file=sys.stderr)
        return EXIT_ERROR
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kafka-python's DEBUG log dumps protocol bytes, SASL credentials included: never below INFO
    logging.getLogger("kafka").setLevel(max(logging.INFO, logging.getLogger().level))
    if not args.verbose:  # a broker restarting is logged by kafka-python with a traceback
        repeats = RepeatedLibraryLogs(("kafka",))  # and one that is down, every few seconds
        for h in logging.getLogger().handlers:
            h.addFilter(OneLineLibraryErrors(("kafka",)))
            h.addFilter(repeats)
    # clickhouse-driver logs every failed reconnect with a traceback; the store classifies and
    # reports the failure itself (one line), so the driver's own account is for -v only
    if not args.verbose:
        logging.getLogger("clickhouse_driver").setLevel(logging.ERROR)
    if getattr(args, "service_config", None):
        from gpuslo.core.settings import SettingsError, load, redact_logs

        # the file is read here, once (a pipe gives its text once; a FIFO without a writer would
        # wait twice), and the command takes it from args
        try:
            args.loaded_service_config = load(args.service_config)
            secrets = args.loaded_service_config.secrets()
        except SettingsError as exc:
            args.loaded_service_config = exc  # reported properly when the command asks for it
            secrets = []
        redact_logs(secrets)
    # every child process the command starts (Slurm's commands) is this run's: killed, with
    # whatever it forked, and reaped when the command ends, by any path (gpuslo.core.proc)
    from gpuslo.core.proc import Children

    args.children = Children()
    # the stop is the run's too: the SIGTERM/SIGINT handlers a command installs (_stop_on_sigterm)
    # are put back as they were when it ends (a later run in the process, or its embedder, kept
    # a handler that set the finished run's stop and ended nothing)
    handlers = _signal_handlers()
    _children_end_first(handlers)
    try:
        return _run_command(args)
    finally:
        args.children.close()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _signal_handlers() -> dict[int, Any]:
    """SIGTERM's, SIGINT's and SIGHUP's handlers now, to put back (none off the main thread,
    where they cannot be set, or for one not set from Python)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    now = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    return {s: h for s, h in now.items() if h is not None}


def _children_end_first(handlers: dict[int, Any]) -> None:
    """SIGTERM and SIGHUP at their default (a command that does not stop gracefully: ``gpuslo
    job``, the agent's setup) end the process at once, no ``finally`` run: the child commands
    are killed first (every run's, :func:`gpuslo.core.proc.kill_all_now`), then it ends by the
    signal as before. They run in sessions of their own, out of reach of a signal to gpuslo's
    group (``timeout``, a shell's job control, a closed terminal): a ``gpuslo job`` killed by
    ``timeout`` left its hung ``scontrol`` running. ``handlers``: the ones now (none off the
    main thread)."""
    from gpuslo.core.proc import kill_all_now

    def end(signum: int, frame: Any) -> None:
        kill_all_now()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if handlers.get(signum) == signal.SIG_DFL:
            signal.signal(signum, end)


def _run_command(args: argparse.Namespace) -> int:
    try:
        rc: int = args.func(args)
        sys.stdout.flush()  # what it printed is written now: a failure is said here, not at exit
    except BrokenPipeError:  # the reader of stdout went away (`gpuslo rules run | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        print("gpuslo: standard output was closed by its reader; stopped", file=sys.stderr)
        return EXIT_PARTIAL
    except OSError as exc:
        # stdout on a full disk or a failing device (`gpuslo chargeback --json > bill.json`): a
        # traceback from print, or Python's "Exception ignored" at exit (exit 120) for a short
        # output. An error naming a file is the command's own (each says those itself).
        if exc.filename is not None or exc.errno not in _OUTPUT_ERRNOS:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        print(f"gpuslo: cannot write standard output: {exc.strerror}; stopped", file=sys.stderr)
        return EXIT_PARTIAL
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            raise
        # a refusal with its reason (a bad option or config): exit 2 like argparse's own, never
        # Python's 1 for a message, which is this CLI's "ran, but not everything was delivered"
        print(exc.code, file=sys.stderr)
        return EXIT_ERROR
    return rc


if __name__ == "__main__":
    sys.exit(main())

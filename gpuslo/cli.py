"""``gpuslo``: one command, a subcommand per part of the pipeline.

Exit codes: 0 success; 1 partial (some input rejected, the rest landed); 2 usage or
configuration error, or nothing could be done.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ingest.writer import Raw

EXIT_OK, EXIT_PARTIAL, EXIT_ERROR = 0, 1, 2


def parse_time(text: str) -> float:
    """ISO-8601 (a time without zone is UTC) or epoch seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither epoch seconds nor ISO-8601 (e.g. 2026-11-28T00:00:00Z)"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _rules_config(path: str | None) -> Any:
    from rules.config import ConfigError, example, load

    try:
        return example() if path is None else load(path)
    except ConfigError as exc:
        raise SystemExit(f"gpuslo: bad rules config:\n{exc}") from None


def _sim_config(a: argparse.Namespace) -> Any:
    from agent.sim.fleet import SimConfig

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
    for k, lo in (("nodes", 1), ("gpus_per_node", 1), ("hours", 0.01), ("interval_s", 1)):
        if kw[k] < lo:
            raise SystemExit(f"gpuslo: --{k.replace('_per_node', '').replace('_', '-')} must be >= {lo}")
    return SimConfig(**kw)


def _add_sim_args(p: argparse.ArgumentParser, hours: float) -> None:
    g = p.add_argument_group("simulated fleet")
    g.add_argument("--nodes", type=int, default=4)
    g.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    g.add_argument("--hours", type=float, default=hours, help="simulated hours")
    g.add_argument("--interval-s", type=float, default=10.0, help="sampling interval (simulated seconds)")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--cluster", default="sim")
    g.add_argument(
        "--start", type=parse_time, default=None, help="simulated start (default: yesterday 00:00 UTC)"
    )


# ---------------------------------------------------------------------------- demo
def cmd_demo(a: argparse.Namespace) -> int:
    from gpuslo import text
    from gpuslo.embedded import Progress, run_demo

    rules = _rules_config(a.config)
    sim = _sim_config(a)
    progress = None if a.quiet else Progress(sys.stderr)
    res = run_demo(sim, rules, Path(a.out), progress=progress)
    if a.json:
        print(json.dumps(res.summary, indent=2, sort_keys=True))
    else:
        print(text.summary(res.summary))
        print()
        print(
            f"store:      {res.store_dir}  (gpuslo rules eval --store {res.store_dir} "
            f"--from {sim.start_ts:.0f} --to {sim.end_ts:.0f})"
        )
        for p in res.dashboards:
            print(f"dashboard:  {p}")
        print(
            f"ingested:   {res.ingest.received} messages, {sum(res.ingest.written.values())} rows, "
            f"{len(res.ingest.rejected)} rejected, in {res.seconds:.1f} s"
        )
    return EXIT_OK


# ---------------------------------------------------------------------------- agent
def cmd_agent(a: argparse.Namespace) -> int:
    from agent.sim.run import run_fleet
    from agent.sinks import JsonLinesSink

    if a.source != "sim":
        print(
            f"gpuslo agent: source {a.source!r} is not available in this version (available: sim)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    sim = _sim_config(a)
    out: IO[bytes] = sys.stdout.buffer if a.out in (None, "-") else open(a.out, "wb")  # noqa: SIM115
    try:
        sink = JsonLinesSink(out)
        run_fleet(sim, sink)
        sink.close()
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    return EXIT_OK


# ---------------------------------------------------------------------------- ingest
def _lines(path: str, chunk: int = 20_000) -> Iterator[list[Raw]]:
    from ingest.writer import Raw

    fh: IO[bytes] = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    name = "stdin" if path == "-" else path
    try:
        batch: list[Raw] = []
        for n, line in enumerate(fh, start=1):
            raw = line.rstrip(b"\r\n")
            if not raw.strip():
                continue
            batch.append(Raw(f"{name}:{n}", raw, offset=n))
            if len(batch) >= chunk:
                yield batch
                batch = []
        if batch:
            yield batch
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


def cmd_ingest(a: argparse.Namespace) -> int:
    from ingest.pipeline import Ingestor, IngestReport
    from ingest.store import ChdbStore, StoreError

    if a.file is None:
        print("gpuslo ingest: give --file PATH (JSON lines, '-' for stdin)", file=sys.stderr)
        return EXIT_ERROR
    if a.file != "-" and not Path(a.file).is_file():
        print(f"gpuslo ingest: {a.file}: no such file", file=sys.stderr)
        return EXIT_ERROR
    try:
        store = ChdbStore(a.store)
        store.migrate()
    except StoreError as exc:
        print(f"gpuslo ingest: {exc}", file=sys.stderr)
        return EXIT_ERROR
    total = IngestReport()
    ing = Ingestor(store)
    try:
        for batch in _lines(a.file):
            total.merge(ing.ingest(batch))
    finally:
        store.close()
    for origin, reason in total.rejected[: a.max_report]:
        print(f"rejected {origin}: {reason}", file=sys.stderr)
    for origin, what in total.warnings[: a.max_report]:
        print(f"warning  {origin}: {what}", file=sys.stderr)
    hidden = max(0, len(total.rejected) - a.max_report) + max(0, len(total.warnings) - a.max_report)
    if hidden:
        print(f"... {hidden} more (all rejected lines are in the dead_letters table)", file=sys.stderr)
    rows = sum(total.written.values())
    print(
        f"ingested {total.accepted} of {total.received} messages ({rows} rows: "
        + ", ".join(f"{t} {n}" for t, n in sorted(total.written.items()))
        + f"); rejected {len(total.rejected)}; warnings {len(total.warnings)}",
        file=sys.stderr,
    )
    if total.received == 0:
        return EXIT_ERROR
    return EXIT_PARTIAL if total.rejected else EXIT_OK


# ---------------------------------------------------------------------------- rules
def cmd_rules_eval(a: argparse.Namespace) -> int:
    from gpuslo import text
    from ingest.store import ChdbStore, StoreError
    from rules.evaluate import summary

    if a.to <= a.frm:
        print("gpuslo rules eval: --to must be after --from", file=sys.stderr)
        return EXIT_ERROR
    if not Path(a.store).is_dir():
        print(f"gpuslo rules eval: {a.store}: no such store directory", file=sys.stderr)
        return EXIT_ERROR
    cfg = _rules_config(a.config)
    try:
        store = ChdbStore(a.store)
    except StoreError as exc:
        print(f"gpuslo rules eval: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        store.migrate()
        s = summary(store, cfg, a.frm, a.to, a.cluster)
    except StoreError as exc:
        print(f"gpuslo rules eval: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        store.close()
    print(json.dumps(s, indent=2, sort_keys=True) if a.json else text.summary(s))
    return EXIT_OK


def cmd_dashboards(a: argparse.Namespace) -> int:
    from dashboards.generate import write

    for p in write(_rules_config(a.config), a.out):
        print(p)
    return EXIT_OK


def cmd_schema(a: argparse.Namespace) -> int:
    from ingest.schema import render

    sys.stdout.write(render())
    return EXIT_OK


# ---------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuslo", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="run the whole pipeline embedded on a simulated fleet")
    _add_sim_args(d, hours=12.0)
    d.add_argument("--config", help="rules config YAML (default: the shipped example)")
    d.add_argument("--out", default="gpuslo-demo", help="directory for the store and dashboards")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument("--quiet", action="store_true", help="no progress display")
    d.set_defaults(func=cmd_demo)

    ag = sub.add_parser("agent", help="run an agent; writes wire messages as JSON lines")
    ag.add_argument("--source", default="sim", help="sim (nvml, dcgm, slurm, k8s: later)")
    ag.add_argument("--out", help="JSON-lines file (default: stdout)")
    _add_sim_args(ag, hours=1.0)
    ag.set_defaults(func=cmd_agent)

    ig = sub.add_parser("ingest", help="load wire messages into a store")
    ig.add_argument("--file", help="JSON-lines file of wire messages ('-' for stdin)")
    ig.add_argument("--store", default="gpuslo-data", help="embedded store directory")
    ig.add_argument("--max-report", type=int, default=50, help="rejected/warning lines to print")
    ig.set_defaults(func=cmd_ingest)

    r = sub.add_parser("rules", help="evaluate rules")
    rsub = r.add_subparsers(dest="rules_cmd", required=True)
    ev = rsub.add_parser("eval", help="the four numbers for a window")
    ev.add_argument("--store", default="gpuslo-data")
    ev.add_argument("--from", dest="frm", type=parse_time, required=True, help="ISO-8601 or epoch seconds")
    ev.add_argument("--to", type=parse_time, required=True, help="ISO-8601 or epoch seconds (exclusive)")
    ev.add_argument("--cluster", default="", help="one cluster (default: all)")
    ev.add_argument("--config", help="rules config YAML (default: the shipped example)")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_rules_eval)

    db = sub.add_parser("dashboards", help="Grafana dashboards")
    dsub = db.add_subparsers(dest="dash_cmd", required=True)
    gen = dsub.add_parser("generate", help="write the dashboards as Grafana JSON")
    gen.add_argument("--out", default="dashboards/generated")
    gen.add_argument("--config", help="rules config YAML (default: the shipped example)")
    gen.set_defaults(func=cmd_dashboards)

    sc = sub.add_parser("schema", help="print the ClickHouse DDL")
    sc.set_defaults(func=cmd_schema)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())

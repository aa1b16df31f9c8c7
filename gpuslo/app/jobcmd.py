"""``gpuslo job ID`` (the per-job report for its owner) and ``gpuslo rightsize`` (MIG right-sizing
advice per account), registered on the CLI by :func:`add_commands`.

Exit codes as the CLI's: 0 done; 2 a usage or store error, an unknown job, or an id that names
several jobs (the message lists them)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpuslo.app.argtypes import name_arg, path_arg, utf8_text

EXIT_OK, EXIT_ERROR = 0, 2


def _with_store(a: argparse.Namespace, prog: str, fn: Any) -> tuple[int, Any]:
    """Open the store as ``rules eval`` does and run ``fn(store, rules_config)``; (exit code,
    result). Refusals (an unknown or ambiguous job: a ValueError) are one line on stderr."""
    from gpuslo.app.cli import _on_window

    return _on_window(a, prog, fn, one_line=True)


def cmd_job(a: argparse.Namespace) -> int:
    from gpuslo.app import jobtext
    from gpuslo.app.text import terminal_safe
    from gpuslo.rules import jobreport
    from gpuslo.rules.model import to_json

    def run(store: Any, cfg: Any) -> Any:
        from gpuslo.agent.slurm import SlurmCli, raw_job_id

        # 123_4, 123+1: recorded by the task's own job id (scontrol and sacct: the run's children)
        ident, note = raw_job_id(a.id, SlurmCli(children=a.children))
        if note:
            print(f"gpuslo job: {note}", file=sys.stderr)
        ref = jobreport.resolve(store, ident, a.cluster, a.frm, a.to)
        return jobreport.report(store, cfg, ref, a.frm, a.to, headroom=_or_default(a.headroom))

    rc, rep = _with_store(a, "job", run)
    if rc != EXIT_OK:
        return rc
    if a.html:
        from gpuslo.app.cli import write_out
        from gpuslo.dashboards.jobpage import render

        if not write_out(a.html, render(rep), "job", "--html"):
            return EXIT_ERROR
    if a.json:
        print(json.dumps(to_json(rep), indent=2, sort_keys=True))
    else:
        print(terminal_safe(jobtext.report(rep)))
        if a.html:
            print(f"\nhtml: {a.html}")
    return EXIT_OK


def cmd_rightsize(a: argparse.Namespace) -> int:
    from gpuslo.app import jobtext
    from gpuslo.app.text import terminal_safe
    from gpuslo.rules.model import to_json
    from gpuslo.rules.rightsize import rightsizing

    rc, rz = _with_store(
        a, "rightsize", lambda store, cfg: rightsizing(store, a.frm, a.to, a.cluster, _or_default(a.headroom))
    )
    if rc == EXIT_OK:
        print(
            json.dumps(to_json(rz), indent=2, sort_keys=True)
            if a.json
            else terminal_safe(jobtext.rightsizing(rz))
        )
    return rc


def _or_default(headroom: float | None) -> float:
    from gpuslo.rules.rightsize import DEFAULT_HEADROOM

    return DEFAULT_HEADROOM if headroom is None else headroom


def _headroom(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1)")
    return v


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    from gpuslo.app.cli import _add_store_args, parse_time
    # nothing from rules/ or ingest/ here: the parser is built in an agent-only install too

    j = sub.add_parser("job", parents=[common], help="a per-job efficiency report for the job's owner")
    j.add_argument("id", type=utf8_text, help="a Slurm job id (an array task 123_4 or het component 123+1 is asked of "
                   "scontrol/sacct for its own id), or a pod's namespace/name (or its UID)")  # fmt: skip
    _add_store_args(j)
    j.add_argument("--from", dest="frm", type=parse_time, help="window start (default: the job's start)")
    j.add_argument("--to", type=parse_time, help="window end, exclusive (default: the job's end)")
    j.add_argument(
        "--cluster", type=name_arg, default="", help="the job's cluster, when the id is used in several"
    )
    j.add_argument(
        "--config",
        type=path_arg,
        help="rules config YAML (idle threshold, min_idle_s, starvation thresholds)",
    )
    j.add_argument("--json", action="store_true", help="the report as JSON (time series included)")
    j.add_argument(
        "--html", type=path_arg, metavar="FILE", help="also write the report as a self-contained HTML page"
    )
    j.add_argument("--headroom", type=_headroom, default=None,
                   help="MIG advice: memory headroom, a fraction of the profile's memory (default 0.1)")  # fmt: skip
    j.set_defaults(func=cmd_job)

    r = sub.add_parser("rightsize", parents=[common], help="MIG right-sizing advice per account for a window")
    _add_store_args(r)
    r.add_argument("--from", dest="frm", type=parse_time, required=True, help="ISO-8601 or epoch seconds")
    r.add_argument("--to", type=parse_time, required=True, help="ISO-8601 or epoch seconds (exclusive)")
    r.add_argument(
        "--cluster", type=name_arg, default="", help="one cluster, its exact name ('' or absent: all)"
    )
    # no --config: the advice reads no rules config (it was taken, checked and never read)
    r.add_argument("--json", action="store_true")
    r.add_argument("--headroom", type=_headroom, default=None,
                   help="memory headroom, a fraction of the profile's memory (default 0.1)")  # fmt: skip
    r.set_defaults(func=cmd_rightsize)

"""Which of ``gpuslo agent``'s flags each ``--source`` reads, and which flags need or rule out
another: a flag that the run would ignore is refused (exit 2, naming it), never ignored.

One table, ``RULES``, holds it: a flag added to the agent without a row here fails the tests,
and a row names the sources that read the flag, the flags without which it means nothing
(``needs``: one of them must be given too) and those that make it mean nothing (``not_with``).
Each refusal came from a run that looked right and did something else: ``gpuslo agent --node
gpu01 --slurm --kafka ...`` without ``--source`` sent the simulated fleet to that Kafka (exit 0),
``--source slurm-events --dcgm-url ...`` scraped nothing, ``--source latency --once`` ran for
ever, ``--config service.yaml`` without ``--kafka`` wrote JSON lines to stdout, ``--kafka ...
--out f`` sent to Kafka and left ``f`` unwritten.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

SIM = "sim"
NODE = ("nvml", "dcgm", "latency")  # an agent on one node
GPU = ("nvml", "dcgm")  # a node agent with a GPU source
COLLECTORS = ("slurm-events", "k8s-events")  # one per cluster
SOURCES = (SIM, *NODE, *COLLECTORS)
WALL_CLOCK = (*NODE, *COLLECTORS)  # those that tick on the wall clock until stopped

_KIND = {
    SIM: "the simulated fleet",
    "nvml": "an agent on a node",
    "dcgm": "an agent on a node",
    "latency": "an agent on a node",
    "slurm-events": "a cluster collector",
    "k8s-events": "a cluster collector",
}


@dataclass(frozen=True)
class Rule:
    """Where a flag means something: ``sources`` read it; with ``needs``, only when one of those
    flags is given too (on ``needs_on``'s sources; default all); never with a ``not_with`` flag
    (one in ``not_with_on``: on those sources only), unless an ``unless`` flag gives it its use back."""

    sources: tuple[str, ...]
    needs: tuple[str, ...] = ()
    needs_on: tuple[str, ...] = SOURCES
    not_with: tuple[str, ...] = ()
    not_with_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unless: tuple[str, ...] = ()
    why: str = ""  # what the flag does, for the message of a refusal by needs or not_with
    hint: str = ""  # what to give instead, for the message of a refusal by source


_SLURM = ("--slurm", "--hpc-job-mapping-dir")  # a Slurm attribution (squeue or the mapping files)
_ATTRIBUTION = (*_SLURM, "--k8s-pod-resources")

#: option string -> where it is read; the flags every source reads (``--cluster``, ``--interval-s``
#: and the common ones of every subcommand) are here as read by all
RULES: dict[str, Rule] = {
    # where the messages go
    "--out": Rule(SOURCES, not_with=("--kafka", "--once"), why="the JSON-lines file"),
    "--kafka": Rule(SOURCES, not_with=("--once",), why="sends to Kafka"),
    "--config": Rule(
        SOURCES, needs=("--kafka",), why="names the Kafka, producer and spool; --kafka - takes its servers"
    ),
    "--spool-dir": Rule(SOURCES, needs=("--kafka",), why="the disk spool in front of Kafka"),
    "--flush-timeout-s": Rule(SOURCES, needs=("--kafka",), why="bounds the wait for Kafka at the end"),
    # how it runs
    "--cluster": Rule(SOURCES),
    "--interval-s": Rule(SOURCES),
    "--realtime": Rule(SOURCES, not_with=("--once",), why="ticks on the wall clock"),
    "--ticks": Rule(
        SOURCES,
        needs=("--realtime",),
        needs_on=(SIM,),
        not_with=("--once",),
        why="stops after that many wall-clock ticks",
    ),
    "--once": Rule(GPU),
    "--print": Rule(GPU, needs=("--once",), why="indents --once's JSON"),
    # the simulated fleet
    "--nodes": Rule((SIM,)),
    "--gpus": Rule((SIM,)),
    "--hours": Rule((SIM,)),
    "--seed": Rule((SIM,)),
    "--start": Rule((SIM,)),
    # the node
    "--node": Rule(NODE),
    "--pool": Rule(GPU),
    "--pool-label": Rule(
        GPU,
        needs=("--k8s-pod-resources", "--k8s-api"),
        not_with=("--pool", "--slurm"),
        why="names the Kubernetes Node label the pool is read from",
    ),
    "--slurm": Rule(GPU),
    # the HPC job mapping's files name NVML indices: with them squeue (and its gres IDX) is not read
    "--slurm-gres-conf": Rule(
        ("nvml",),
        needs=("--slurm",),
        not_with=("--hpc-job-mapping-dir",),
        why="places Slurm's gres IDX on NVML's GPUs",
    ),
    "--slurm-refresh-s": Rule(GPU, needs=_SLURM, why="spaces the asks of slurmctld"),
    # dcgm-exporter attributes from its own labels (its own --hpc-job-mapping-dir)
    "--hpc-job-mapping-dir": Rule(
        ("nvml",), hint="dcgm-exporter reads its own; --slurm gives the node's Slurm state and pool"
    ),
    # with --slurm the jobs are Slurm's and so is the pool (nvml: a mapping dir's jobs, the Node's pool);
    # dcgm-exporter attributes pods itself: there it reads only the Node's pool, which --pool replaces
    "--k8s-pod-resources": Rule(
        GPU,
        not_with=("--slurm", "--pool"),
        not_with_on={"--pool": ("dcgm",)},
        why="nvml: attributes GPUs to pods; nvml, dcgm: reads the Node's pool",
    ),
    "--k8s-resource-slices": Rule(
        ("nvml",),
        needs=("--k8s-pod-resources",),
        not_with=_SLURM,
        why="resolves the DRA devices PodResources names",
    ),
    "--proc-root": Rule(("nvml",), needs=_ATTRIBUTION, why="splits shared GPUs among their jobs or pods"),
    # a pod's name only matches the pods PodResources attributes (with a Slurm attribution: jobs)
    "--pod-log-dir": Rule(
        ("nvml",),
        needs=("--k8s-pod-resources",),
        not_with=("--proc-root ''", *_SLURM),
        why="names the pods of shared GPUs",
    ),
    # on a node: the Node's pool label (not read with --slurm or --pool) and the ResourceSlices
    "--k8s-api": Rule(
        (*GPU, "k8s-events"),
        not_with=("--slurm", "--pool"),
        unless=("--k8s-resource-slices",),
        why="reads the Node's pool label; nvml with --k8s-resource-slices: its ResourceSlices",
    ),
    "--k8s-token-file": Rule((*GPU, "k8s-events"), needs=("--k8s-api",), why="the token for --k8s-api"),
    "--k8s-ca-file": Rule((*GPU, "k8s-events"), needs=("--k8s-api",), why="the CA bundle for --k8s-api"),
    # the cluster collectors
    "--state-file": Rule(COLLECTORS),
    "--kueue": Rule(("k8s-events",)),
    "--no-k8s-dra": Rule(("k8s-events",)),
    "--dra-gpu-class": Rule(("k8s-events",), not_with=("--no-k8s-dra",), why="names the GPUs of claims"),
    # scrapes and the agent's own /metrics
    "--dcgm-url": Rule(("dcgm",)),
    "--dcgm-mig-slices": Rule(("dcgm",)),
    "--latency": Rule(NODE, not_with=("--once",), why="scrapes latency each tick"),
    "--metrics-port": Rule(WALL_CLOCK, not_with=("--once",), why="serves /metrics while it runs"),
    "--metrics-addr": Rule(
        WALL_CLOCK, not_with=("--once", "--metrics-port 0"), why="serves /metrics while it runs"
    ),
    "--dcgm-names": Rule(
        GPU, not_with=("--once", "--metrics-port 0"), why="names the GPU series of /metrics"
    ),
}

#: a value that means "none": given, it asks for nothing another flag could conflict with
#: (``--metrics-port 0`` turns /metrics off, as ``--once`` has it anyway; ``--proc-root ''`` the
#: split by processes, which only an attribution does; ``--pool ''`` is no pool of one's own, the
#: scheduler's read as without it: ``--pool "$POOL"`` with none set refused ``--k8s-api``, which
#: then reads the pool); it is given as "FLAG VALUE", which only the flags it makes meaningless
#: name in their ``not_with`` (``--metrics-addr``: ``--metrics-port 0``)
_OFF: dict[str, object] = {"--metrics-port": 0, "--proc-root": "", "--pool": ""}


#: an option's (dest, first option string, default)
Flag = tuple[str, str, object]


def flags_of(p: argparse.ArgumentParser) -> tuple[Flag, ...]:
    """The options of ``p`` that ``RULES`` governs."""
    return tuple((x.dest, x.option_strings[0], x.default) for x in p._actions
                 if x.option_strings and x.option_strings[0] in RULES)  # fmt: skip


def typed(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The dests of the agent's options typed in ``argv`` (``parser``: the whole CLI's, made for
    this; argv parsed by it before), whatever their value: parsed again with every default of the
    agent's options suppressed, what is left was typed. A flag typed with its default value
    (``--source slurm-events --dcgm-url http://localhost:9400/metrics``) is as ignored as any."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for act in sub.choices["agent"]._actions:
        if act.option_strings:
            act.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def given_flags(a: argparse.Namespace, flags: tuple[Flag, ...], typed: set[str]) -> set[str]:
    """Those of ``flags`` whose dest is ``typed``; one given its "off" value as "FLAG VALUE"
    (``--metrics-port 0``)."""
    return {
        f"{flag} {shlex.quote(str(value))}" if flag in _OFF and (value := getattr(a, dest)) == _OFF[flag] else flag
        for dest, flag, _default in flags if dest in typed
    }  # fmt: skip


def refusals(source: str, given: set[str]) -> list[str]:
    """Why each flag of ``given`` means nothing with ``--source source`` (empty: the run reads
    every one)."""
    out = []
    for flag in sorted(given & RULES.keys(), key=list(RULES).index):
        rule = RULES[flag]
        hint = f" ({rule.hint})" if rule.hint else ""
        if source not in rule.sources and _KIND[source] in {_KIND[s] for s in rule.sources}:  # nvml's to dcgm
            out.append(
                f"{flag}: for --source {_or(rule.sources)} only; --source {source} would ignore it{hint}"
            )
        elif source not in rule.sources:
            out.append(f"{flag}: for {_kinds(rule.sources)} (--source {_or(rule.sources)}) only; --source "
                       f"{source}{', the default,' if source == SIM else ''} is {_KIND[source]} and would ignore it{hint}")  # fmt: skip
        elif rule.needs and source in rule.needs_on and not given & set(rule.needs):
            out.append(
                f"{flag} ({rule.why}) is read only with {_or(rule.needs)}; without, it would be ignored"
            )
        elif (clash := _clashes(rule, source, given)) and not (given & set(rule.unless)):
            out.append(f"{flag} ({rule.why}) would be ignored with {clash[0]}: give one of them")
    return out


def _clashes(rule: Rule, source: str, given: set[str]) -> list[str]:
    """The flags of ``given`` that rule out ``rule``'s on ``source``: each read there, and on a
    source it rules the flag out on."""
    return [
        f
        for f in rule.not_with
        if f in given
        and source in RULES[f.split(" ")[0]].sources
        and source in rule.not_with_on.get(f, SOURCES)
    ]


def _or(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _kinds(sources: tuple[str, ...]) -> str:
    kinds = list(dict.fromkeys(_KIND[s] for s in sources))
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def markdown_table() -> str:
    """``RULES`` as docs/agent.md shows it (a test keeps the page equal to this)."""
    rows = ["| flag | read by `--source` | only with one of | never with |", "|---|---|---|---|"]
    for flag, r in RULES.items():
        by = "every source" if r.sources == SOURCES else ", ".join(f"`{s}`" for s in r.sources)
        needs = ", ".join(f"`{n}`" for n in r.needs)
        if needs and r.needs_on != SOURCES:
            needs += f" (with {', '.join(f'`{s}`' for s in r.needs_on)})"
        never = ", ".join(
            f"`{n}`"
            + (f" (with {', '.join(f'`{s}`' for s in r.not_with_on[n])})" if n in r.not_with_on else "")
            for n in r.not_with
        )
        if r.unless:
            never += f" (unless {', '.join(f'`{u}`' for u in r.unless)})"
        rows.append(f"| `{flag}` | {by} | {needs} | {never} |")
    return "\n".join(rows)

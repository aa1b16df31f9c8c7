"""Which flags each run of a command reads, and which flags need or rule out another: a flag
the run would ignore is refused (exit 2, naming it), never ignored.

One table per command holds it (``AGENT``: per ``--source``; ``INGEST``; ``RULES_RUN``): a flag
added to one of them without a row fails the tests, and a row names the sources (modes) that
read the flag, the flags without which it means nothing (``needs``: one of them must be given
too) and those that make it mean nothing (``not_with``). Each refusal came from a run that
looked right and did something else: ``gpuslo agent --node gpu01 --slurm --kafka ...`` without
``--source`` sent the simulated fleet to that Kafka (exit 0), ``--source slurm-events --dcgm-url
...`` scraped nothing, ``--source latency --once`` ran for ever, ``--config service.yaml``
without ``--kafka`` wrote JSON lines to stdout, ``--kafka ... --out f`` sent to Kafka and left
``f`` unwritten; ``ingest --file F --group g --metrics-port 9466`` took both and read neither;
``rules run --outbox DIR`` with no receiver delivered nothing and said nothing.
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
    flags is given too (on ``needs_on``'s sources; default all); never with a ``not_with`` flag,
    or flags joined by "+" given together (one in ``not_with_on``: on those sources only), unless
    an ``unless`` flag gives it its use back."""

    sources: tuple[str, ...]
    needs: tuple[str, ...] = ()
    needs_on: tuple[str, ...] | None = None  # None: every source
    not_with: tuple[str, ...] = ()
    not_with_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unless: tuple[str, ...] = ()
    why: str = ""  # what the flag does, for the message of a refusal by needs or not_with
    hint: str = ""  # what to give instead, for the message of a refusal by source


_SLURM = ("--slurm", "--hpc-job-mapping-dir")  # a Slurm attribution (squeue or the mapping files)
_ATTRIBUTION = (*_SLURM, "--k8s-pod-resources")

#: the agent's: option string -> where it is read; the flags every source reads (``--cluster``,
#: ``--interval-s``) are here as read by all
AGENT: dict[str, Rule] = {
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
        # nvml with the HPC job mapping: its jobs are the attribution, --pool the pool
        not_with=("--slurm", "--pool", "--hpc-job-mapping-dir+--pool"),
        not_with_on={"--pool": ("dcgm",), "--hpc-job-mapping-dir+--pool": ("nvml",)},
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

#: the one "source" of a command whose runs differ by their flags alone
ANY = ("*",)

#: where the store is: chDB's directory, or a ClickHouse server (``--clickhouse``; a config naming
#: one is checked where it is read, gpuslo/app/cli.py ``_server_named``)
STORE = {
    "--store": Rule(ANY, not_with=("--clickhouse",), why="the embedded store's directory"),
    "--clickhouse": Rule(ANY),
}

#: ``gpuslo ingest``: from a JSON-lines file (--file) or as a Kafka consumer group (--kafka)
INGEST: dict[str, Rule] = {
    "--file": Rule(ANY, not_with=("--kafka",), why="the JSON-lines file to read"),
    "--kafka": Rule(ANY),
    "--config": Rule(ANY),  # the kafka and ingest sections with --kafka, clickhouse with either
    **STORE,
    "--group": Rule(ANY, needs=("--kafka",), why="the consumer group"),
    "--metrics-port": Rule(ANY, needs=("--kafka",), why="serves /metrics while it consumes"),
    "--metrics-addr": Rule(
        ANY, needs=("--kafka",), not_with=("--metrics-port 0",), why="serves /metrics while it consumes"
    ),
    "--idle-exit-s": Rule(
        ANY, needs=("--kafka",), why="ends a consumer that has waited that long for messages"
    ),
    "--kill-after-write": Rule(ANY, needs=("--kafka",), why="the crash tests' hook between write and commit"),
    "--max-report": Rule(ANY, not_with=("--kafka",), why="the rejected lines a file's report prints"),
    "--max-line-bytes": Rule(ANY, not_with=("--kafka",), why="the longest line of a file"),
    "--dedup-window": Rule(ANY),
    "--retention-days": Rule(ANY),
}

#: ``rules run``'s receivers: a flag, a URL file or the environment (``$GPUSLO_..._URL``, counted
#: as typed where it names a URL)
RECEIVERS = ("--alertmanager", "--webhook", "--alertmanager-url-file", "--webhook-url-file",
             "$GPUSLO_ALERTMANAGER_URL", "$GPUSLO_WEBHOOK_URL")  # fmt: skip

#: ``gpuslo rules run``: every --every-s, or --once; alerts delivered where a receiver is given
RULES_RUN: dict[str, Rule] = {
    **STORE,
    "--service-config": Rule(ANY),  # its clickhouse section, checked where it is read
    "--config": Rule(ANY),
    "--window-s": Rule(ANY),
    "--every-s": Rule(ANY, not_with=("--once",), why="the time between rounds"),
    "--once": Rule(ANY),
    "--source": Rule(ANY),
    **{r: Rule(ANY) for r in RECEIVERS if r.startswith("--")},
    "--outbox": Rule(ANY, needs=RECEIVERS, why="holds the alerts not yet delivered"),
    "--delivery-deadline-s": Rule(ANY, needs=RECEIVERS, why="bounds an alert's delivery"),
    "--outbox-max-age-s": Rule(ANY, needs=RECEIVERS, why="drops alerts undelivered that long"),
    "--resend-s": Rule(ANY, needs=RECEIVERS, why="re-sends a firing alert"),
}

#: the subcommand (its path) -> its table
BY_COMMAND: dict[tuple[str, ...], dict[str, Rule]] = {
    ("agent",): AGENT,
    ("ingest",): INGEST,
    ("rules", "run"): RULES_RUN,
}


#: a value that means "none": given, it asks for nothing another flag could conflict with
#: (``--metrics-port 0`` turns /metrics off, as ``--once`` has it anyway; ``--proc-root ''`` the
#: split by processes, which only an attribution does; ``--pool ''`` is no pool of one's own, the
#: scheduler's read as without it: ``--pool "$POOL"`` with none set refused ``--k8s-api``, which
#: then reads the pool); it is given as "FLAG VALUE", which only the flags it makes meaningless
#: name in their ``not_with`` (``--metrics-addr``: ``--metrics-port 0``)
_OFF: dict[str, object] = {"--metrics-port": 0, "--proc-root": "", "--pool": ""}


def typed(parser: argparse.ArgumentParser, argv: Sequence[str] | None, path: tuple[str, ...],
          rules: dict[str, Rule]) -> set[str]:  # fmt: skip
    """The flags of ``rules`` typed in ``argv`` for the subcommand ``path`` (``parser``: the whole
    CLI's, made for this; ``argv`` parsed by one before), whatever their value: parsed again with
    every default of that subcommand's options suppressed, what is left was typed (a flag typed
    with its default value, ``--source slurm-events --dcgm-url http://localhost:9400/metrics``,
    is as ignored as any). One typed with its "off" value is given as "FLAG VALUE"."""
    p = parser
    for name in path:
        (sub,) = (x for x in p._actions if isinstance(x, argparse._SubParsersAction))
        p = sub.choices[name]
    flags = {}
    for act in p._actions:
        if act.option_strings:
            act.default = argparse.SUPPRESS
            if act.option_strings[0] in rules:
                flags[act.dest] = act.option_strings[0]
    seen = vars(parser.parse_args(argv))
    return {
        f"{flag} {shlex.quote(str(seen[dest]))}" if flag in _OFF and seen[dest] == _OFF[flag] else flag
        for dest, flag in flags.items() if dest in seen
    }  # fmt: skip


def refusals(source: str, given: set[str], rules: dict[str, Rule] | None = None) -> list[str]:
    """Why each flag of ``given`` means nothing with ``--source source`` (empty: the run reads
    every one); ``rules``: the command's table (default the agent's; another command's has the
    one source ``ANY``)."""
    rules = AGENT if rules is None else rules
    out = []
    for flag in sorted(given & rules.keys(), key=list(rules).index):
        rule = rules[flag]
        hint = f" ({rule.hint})" if rule.hint else ""
        if source not in rule.sources and _KIND[source] in {_KIND[s] for s in rule.sources}:  # nvml's to dcgm
            out.append(
                f"{flag}: for --source {_or(rule.sources)} only; --source {source} would ignore it{hint}"
            )
        elif source not in rule.sources:
            out.append(f"{flag}: for {_kinds(rule.sources)} (--source {_or(rule.sources)}) only; --source "
                       f"{source}{', the default,' if source == SIM else ''} is {_KIND[source]} and would ignore it{hint}")  # fmt: skip
        elif rule.needs and source in (rule.needs_on or (source,)) and not given & set(rule.needs):
            out.append(
                f"{flag} ({rule.why}) is read only with {_or(rule.needs)}; without, it would be ignored"
            )
        elif (clash := _clashes(rule, source, given, rules)) and not (given & set(rule.unless)):
            out.append(f"{flag} ({rule.why}) would be ignored with {clash[0]}: give one of them")
    return out


def _clashes(rule: Rule, source: str, given: set[str], rules: dict[str, Rule]) -> list[str]:
    """The flags of ``given`` that rule out ``rule``'s on ``source``: each read there, and on a
    source it rules the flag out on."""
    return [
        f.replace("+", " and ")
        for f in rule.not_with
        if all(part in given and source in rules[part.split(" ")[0]].sources for part in f.split("+"))
        and source in rule.not_with_on.get(f, (source,))
    ]


def _or(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _kinds(sources: tuple[str, ...]) -> str:
    kinds = list(dict.fromkeys(_KIND[s] for s in sources))
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def markdown_table() -> str:
    """``AGENT`` as docs/agent.md shows it (a test keeps the page equal to this)."""
    rows = ["| flag | read by `--source` | only with one of | never with |", "|---|---|---|---|"]
    for flag, r in AGENT.items():
        by = "every source" if r.sources == SOURCES else ", ".join(f"`{s}`" for s in r.sources)
        needs = ", ".join(f"`{n}`" for n in r.needs)
        if needs and r.needs_on is not None:
            needs += f" (with {', '.join(f'`{s}`' for s in r.needs_on)})"
        never = ", ".join(
            " + ".join(f"`{part}`" for part in n.split("+"))
            + (f" (with {', '.join(f'`{s}`' for s in r.not_with_on[n])})" if n in r.not_with_on else "")
            for n in r.not_with
        )
        if r.unless:
            never += f" (unless {', '.join(f'`{u}`' for u in r.unless)})"
        rows.append(f"| `{flag}` | {by} | {needs} | {never} |")
    return "\n".join(rows)

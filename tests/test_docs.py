"""The README is a newcomer's first screen with a map into docs/, every link in it and in docs/ lands,
and the repository root holds only what belongs there."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FIRST_SCREEN_LINES = 60
SETUP_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[all]' && .venv/bin/gpuslo demo",
    "bash scripts/test.sh",
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ROOT_FILES = {
    ".dockerignore",
    ".gitignore",
    "Dockerfile",
    "README.md",
    "constraints.txt",
    "docker-compose.yml",
    "pyproject.toml",
}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def test_first_screen_has_the_setup_commands_and_the_map() -> None:
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN_LINES])
    for command in SETUP_COMMANDS:
        assert f"\n{command}\n" in first, f"set-up command not on the README's first screen: {command}"
    assert "## What the demo shows" in first
    assert "## Where to go next" in first


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {t.split("#", 1)[0] for t in LINK.findall((ROOT / "README.md").read_text())}
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert pages, "no docs/ pages"
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"
    for must in ("docs/benchmarks.md", "docs/verification.md"):
        assert must in pages


def test_the_readme_says_what_is_verified_against_fakes() -> None:
    text = (ROOT / "README.md").read_text()
    assert "verified against fakes" in text
    assert "not run on a GPU" in text


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_lands(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.name}: {broken}"


def test_slug_follows_github() -> None:
    # GitHub's own anchors for these headings (read off the rendered page)
    assert _slug("The demo's options and JSON") == "the-demos-options-and-json"
    assert _slug("The node agent on real GPUs (NVML)") == "the-node-agent-on-real-gpus-nvml"
    assert _slug("Replaying real data: `ingest --file` and `rules eval`") == (
        "replaying-real-data-ingest---file-and-rules-eval"
    )


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_no_stray_files_are_committed() -> None:
    tracked = _tracked()
    at_root = {f for f in tracked if "/" not in f}
    assert at_root - ROOT_FILES == set(), (
        f"unexpected files at the repository root: {sorted(at_root - ROOT_FILES)}"
    )
    job_outputs = [f for f in tracked if re.search(r"(^|/)slurm-\d+\.out$", f)]
    assert not job_outputs, f"Slurm job outputs committed: {job_outputs}"


def test_slurm_jobs_write_into_the_cluster_directory() -> None:
    """sbatch writes slurm-%j.out into its working directory (the checkout) unless told where: every
    sbatch call of the tests names an --output under the cluster's own directory."""
    calls = []
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r'"sbatch"', text):
            call = text[m.start() : text.find(")", text.find('"--wrap"', m.start()))]
            calls.append((path.name, call))
    calls = [(name, call) for name, call in calls if name != "test_docs.py"]
    assert calls, "no sbatch call found in the tests"
    for name, call in calls:
        assert re.search(r"--output=\{(?:self|slurm)\.dir\}/", call), (
            f"{name}: sbatch without --output in the cluster directory"
        )


# --- what the pages say against what the code does ---------------------------------------------------

SPAN = re.compile(r"`([^`\n]+)`")


def _between(text: str, start: str, end: str) -> str:
    """The text from ``start`` (included) to the first ``end`` after it."""
    i = text.index(start)
    return text[i : text.index(end, i + len(start))]


def _spans(text: str) -> set[str]:
    return set(SPAN.findall(text))


def _json_keys(cls: type) -> set[str]:
    """The top-level keys ``rules.model.to_json`` writes for a result dataclass."""
    from dataclasses import fields

    from gpuslo.rules.model import SKIP

    return {k for f in fields(cls) if (k := f.metadata.get("json", f.name)) != SKIP}


def _demo_json_extras() -> set[str]:
    """The keys ``demo --json`` adds to the summary's (``DemoResult.to_json`` on an empty summary)."""
    from dataclasses import make_dataclass
    from types import SimpleNamespace

    from gpuslo.app.embedded import DemoResult

    empty = make_dataclass("Empty", [])()
    stub = SimpleNamespace(
        summary=empty, truth={}, chargeback=None, energy={}, rightsize=None, reclaim=None, whatif=None
    )
    return set(DemoResult.to_json(stub))  # type: ignore[arg-type]


def _documented_json() -> list[tuple[str, set[str], str]]:
    """(what, the keys the code writes, the docs' text that must name each)."""
    from gpuslo.rules.jobreport import JobReport
    from gpuslo.rules.model import Summary

    ops = (DOCS / "operations.md").read_text()
    return [
        (
            "rules eval --json",
            _json_keys(Summary),
            _between(ops, "`rules eval --json` prints", "field by field"),
        ),
        ("demo --json", _demo_json_extras(), _between(ops, "## The demo's options and JSON", "\n## ")),
        ("job --json", _json_keys(JobReport), _between(ops, "- The JSON carries every figure", "\n\n")),
    ]


@pytest.mark.parametrize("what", ["rules eval --json", "demo --json", "job --json"])
def test_every_json_key_a_command_prints_is_documented(what: str) -> None:
    """docs/operations.md names every top-level key of the JSON these commands print (it listed
    neither `window`, `capacity_gpu_hours` nor `reclaim`, and told `rules eval --json` had the demo's
    `energy` and `chargeback`)."""
    (keys, text) = next((k, t) for w, k, t in _documented_json() if w == what)
    assert keys, what
    missing = keys - _spans(text)
    assert not missing, f"{what}: keys the docs do not name: {sorted(missing)}"


def test_every_demo_option_is_documented() -> None:
    """docs/operations.md names every option of the demo (it left out --cluster and --quiet)."""
    from gpuslo.app.cli import build_parser

    demo = next(
        a.choices["demo"] for a in build_parser()._actions if isinstance(getattr(a, "choices", None), dict)
    )
    options = {s for a in demo._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    options -= {"--verbose"}  # every command's
    text = _between((DOCS / "operations.md").read_text(), "## The demo's options and JSON", "\n## ")
    missing = options - {word for span in _spans(text) for word in span.split()}
    assert not missing, f"demo options docs/operations.md does not name: {sorted(missing)}"


def test_every_wire_field_is_documented() -> None:
    """docs/wire-format.md names every field of every kind, and of a GPU row, a holder and a MIG
    instance (it left out a GPU row's `fraction` and `mig`, which the agent writes for MIG)."""
    from gpuslo.wire import models as w

    text = (DOCS / "wire-format.md").read_text()
    per_kind = {m.group(1): m.group(0) for m in re.finditer(r"(?ms)^- `(\w+)`.*?(?=^- `|^\S)", text)}
    envelope = set(_spans(_between(text, "Every message has the envelope", "Unknown keys")))

    wanted: dict[str, tuple[type, ...]] = {
        "gpu_samples": (w.GpuSampleBatch,),
        "heartbeat": (w.NodeHeartbeat,),
        "sched_event": (w.SchedulerEvent,),
        "latency": (w.LatencyDelta,),
        "health": (w.HealthEvent,),
    }
    missing = []
    for kind, models in wanted.items():
        assert kind in per_kind, f"no bullet for {kind}"
        named = _spans(per_kind[kind]) | {
            x.strip() for s in re.findall(r"`\{([^}`]*)\}`", per_kind[kind]) for x in s.split(",")
        }
        named |= {x.split(":")[0].strip() for x in list(named)}  # `{scheduler: "slurm"|"k8s", id, ...}`
        if kind == "gpu_samples":
            models = (*models, w.GpuSample, w.Allocation, w.MigInstance)
        for model in models:
            for name in set(model.model_fields) - envelope:
                if name not in named:
                    missing.append(f"{kind}: {model.__name__}.{name}")
    assert not missing, f"wire fields docs/wire-format.md does not name: {missing}"


def test_every_json_example_of_the_wire_page_decodes() -> None:
    from gpuslo.wire.codec import decode

    blocks = re.findall(r"```json\n(.*?)```", (DOCS / "wire-format.md").read_text(), re.S)
    assert blocks
    for block in blocks:
        for line in block.splitlines():
            decode(line.encode())  # raises on a message the ingest would dead-letter


REPO_FILE = re.compile(
    r"(?<![\w./-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_-]+\.(?:py|md|yaml|yml|sql|sh|json|service|txt|xml|toml))\b"
)


def test_every_repository_file_named_exists() -> None:
    """A file of this repository named in the README, docs/, deploy/ or the compose file exists
    (deploy/compose/service.yaml pointed at gpuslo/settings.py, which is gpuslo/core/settings.py)."""
    tops = {p.name for p in ROOT.iterdir()}
    pages = [
        *_pages(),
        *sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file()),
        ROOT / "docker-compose.yml",
    ]
    broken = []
    for page in pages:
        for m in REPO_FILE.finditer(page.read_text()):
            path = m.group(1)
            if path.split("/")[0] in tops and not (ROOT / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {path}")
    assert not broken, broken


def _fenced_sh_after(page: Path, heading: str) -> list[list[str]]:
    """The commands of the first ```sh block after ``heading``: one argv each, comments dropped."""
    import shlex

    text = page.read_text()
    block = re.search(r"```sh\n(.*?)```", text[text.index(heading) :], re.S)
    assert block, heading
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.integration  # the agent, the ingest and rules eval on chDB, each in its own process
def test_the_replay_example_runs_as_written(tmp_path: Path) -> None:
    """docs/operations.md's replay (agent → file → ingest → rules eval), run word for word: its
    window must hold what the agent wrote (without --start the fleet was yesterday's, and the
    rules eval of the page's fixed window was refused: no data in the window, exit 2)."""
    import json

    commands = _fenced_sh_after(DOCS / "operations.md", "## Replaying real data")
    assert [c[:3] for c in commands] == [
        ["gpuslo", "agent", "--source"],
        ["gpuslo", "ingest", "--file"],
        ["gpuslo", "rules", "eval"],
    ]
    gpuslo = _gpuslo()
    for argv in commands:
        r = subprocess.run(
            [*gpuslo, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
        )
        assert r.returncode == 0, (argv, r.stderr)
    assert json.loads(r.stdout)["capacity_gpu_hours"] > 0


def _gpuslo() -> list[str]:
    import sys

    exe = Path(sys.executable).with_name("gpuslo")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gpuslo"]


@pytest.mark.integration  # the whole 12-hour demo, about 20 s
def test_the_readme_shows_the_demos_own_output(tmp_path: Path) -> None:
    """The README's demo output is what the command it names prints, line for line but the
    ingest's time (it lacked the header line, the right-size lines and the paths at the end, and
    showed a chargeback figure, 49.978, whose column did not add up to its total)."""
    import shlex

    text = (ROOT / "README.md").read_text()
    m = re.search(r"Output of `(gpuslo demo[^`]*)`.*?\n```\n(.*?)```", text, re.S)
    assert m, "no demo output in the README"
    argv = shlex.split(m.group(1))
    assert "--start" in argv  # without it the dates are yesterday's: no fixed output to show
    r = subprocess.run(
        [*_gpuslo(), *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert r.returncode == 0, r.stderr

    def timeless(s: str) -> list[str]:
        return re.sub(r"(?m)^(ingested: .*), in [0-9.]+ s$", r"\1", s).splitlines()

    assert timeless(r.stdout) == timeless(m.group(2))


def test_the_docs_name_every_dashboard() -> None:
    """operations.md names each dashboard the generator writes, and verification.md counts them
    (both had five: the Chargeback and energy dashboard was left out)."""
    from gpuslo.dashboards.generate import VIEWS

    titles = {title.removeprefix("gpuslo / ") for title, *_ in VIEWS.values()} | {"Fleet overview"}
    listed = _between((DOCS / "operations.md").read_text(), "`gpuslo dashboards generate", "\n- ")
    assert {t for t in titles if f"**{t}**" not in listed} == set()
    counts = re.findall(r"\((\d+) dashboards\)", (DOCS / "verification.md").read_text())
    assert counts and {int(n) for n in counts} == {len(titles)}, counts


FENCED = re.compile(r"(?ms)^```[^\n]*\n(.*?)^```")
METRIC_KIND = re.compile(
    r'\b(Counter|CounterMetricFamily|Gauge|GaugeMetricFamily|Histogram|Summary)\(\s*"(gpuslo_\w+)"'
)
# the counts the agent, the collectors and the ingest hand their exporters as {name: value}: counters
METRIC_COUNT = re.compile(r'"(gpuslo_\w+)"\s*:|\["(gpuslo_\w+)"\]\s*=')


def _served_metric_names() -> set[str]:
    """Every series name gpuslo's own /metrics pages can show, as the exposition writes it: a
    counter's with ``_total``, a histogram's with its ``_bucket``, ``_sum`` and ``_count``."""
    served: set[str] = set()
    for top in ("agent", "ingest", "rules", "gpuslo/app", "gpuslo/core"):
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            for kind, name in METRIC_KIND.findall(text):
                if kind.startswith("Counter"):
                    served.add(name.removesuffix("_total") + "_total")
                elif kind == "Histogram":
                    served |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                else:
                    served.add(name)
            served |= {(a or b) + "_total" for a, b in METRIC_COUNT.findall(text)}
    return served


def _expand(name: str) -> list[str]:
    """``a_{b,c}_d`` as ``a_b_d`` and ``a_c_d``."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[: m.start()] + alt + name[m.end() :])]


def test_every_metric_name_in_the_docs_is_served() -> None:
    """A gpuslo_* series the README or docs/ name is one gpuslo's /metrics serves, spelt as
    Prometheus shows it (deployment.md said `gpuslo_ingest_commit_errors`, a counter served as
    `gpuslo_ingest_commit_errors_total`: an alert on the name as written matches nothing)."""
    served = _served_metric_names()
    assert {
        "gpuslo_ingest_lag_messages",
        "gpuslo_agent_ticks_total",
        "gpuslo_ingest_batch_seconds_count",
    } <= served
    unknown = set()
    for page in _pages():
        text = page.read_text()
        # inline spans and fenced blocks (a PromQL or alert-rule example is the text most copied;
        # only the spans were read: a ```promql block naming no served series passed)
        for span in SPAN.findall(text) + FENCED.findall(text):
            for token in re.findall(r"gpuslo_[a-z0-9_]*(?:\{[a-z_,]+\}[a-z0-9_]+)*", span):
                for name in _expand(token):
                    if not name.endswith("_") and name not in served:  # `gpuslo_agent_spool_`: a prefix
                        unknown.add(f"{page.name}: {name}")
    assert not unknown, sorted(unknown)


def test_served_metric_names_follow_the_exposition() -> None:
    """The names above are the ones prometheus_client writes (the ingest's own registry)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gpuslo.ingest.kafka_consumer import IngestMetrics

    registry = CollectorRegistry()
    metrics = IngestMetrics(registry)
    metrics.commit_errors.inc()
    metrics.lag.labels("t", "0").set(1)
    metrics.batch_seconds.observe(0.1)
    text = generate_latest(registry).decode()
    shown = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    shown = {n for n in shown if not n.endswith("_created")}
    assert shown and shown <= _served_metric_names(), shown - _served_metric_names()


def test_every_dashboard_link_shown_opens_a_generated_dashboard() -> None:
    """A Grafana link the docs or the example config show (`/d/UID?var-NAME=...`) names a
    dashboard gpuslo generates and its variables (the reclaim example's report_url opened
    `gpuslo-job`, which no generator writes: the per-job view is the Workloads dashboard's `job`)."""
    import json

    boards = {}
    for path in sorted((ROOT / "dashboards/generated").glob("*.json")):
        d = json.loads(path.read_text())
        boards[d["uid"]] = {v["name"] for v in d["templating"]["list"]}
    assert "gpuslo-workloads" in boards
    files = [*_pages(), ROOT / "rules/example.yaml", *sorted((ROOT / "deploy").rglob("*.y*ml"))]
    wrong = []
    for path in files:
        for uid, query in re.findall(r"/d/([A-Za-z0-9_-]+)(\?[^\s\"'`)]*)?", path.read_text()):
            names = set(re.findall(r"[?&]var-([A-Za-z0-9_]+)=", query or ""))
            if uid not in boards or names - boards[uid]:
                wrong.append(f"{path.relative_to(ROOT)}: /d/{uid}{query}")
    assert not wrong, wrong


def test_every_gpuslo_command_in_a_shell_block_runs_past_its_flag_checks() -> None:
    """Each `gpuslo ...` line of a ```sh block in the README and docs/ (`[...]` options taken as
    given; a line eliding flags with `...` left out) parses and is not refused for a flag its run
    would ignore: test_deploy checks the agent's alone, wherever shown."""
    import contextlib
    import io
    import shlex

    from gpuslo.app.cli import _refused, build_parser
    from gpuslo.app.flag_rules import AGENT, refusals, typed

    checked, bad = 0, []
    for page in _pages():
        # every shell block, not ```sh alone (a ```bash block with a flag gpuslo refuses passed);
        # a ```console block's commands are its "$ " lines
        for lang, block in re.findall(r"```(sh|bash|shell|console|zsh)\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if lang == "console":
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                words = shlex.split(line, comments=True)
                starts = [i for i, w in enumerate(words) if w == "gpuslo" or w.endswith("/gpuslo")]
                if not starts or "..." in words:
                    continue
                argv = words[starts[0] + 1 :]
                argv = [w.strip("[]") for w in (argv[: argv.index("|")] if "|" in argv else argv)]
                argv = [w for w in argv if w]
                err = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err):
                        a = build_parser().parse_args(argv)
                except SystemExit:
                    bad.append(f"{page.name}: {line.strip()}: {err.getvalue().strip()}")
                    continue
                checked += 1
                why = _refused(a, argv) or (
                    argv[0] == "agent" and refusals(a.source, typed(build_parser(), argv, ("agent",), AGENT))
                )
                if why:
                    bad.append(f"{page.name}: {line.strip()}: {why}")
    assert checked >= 25 and not bad, (checked, bad)


def test_the_rules_count_the_alerting_page_gives_is_the_exports() -> None:
    """alerting.md says what promtool finds in the example config's export; promtool counts the
    record and alert rules of every group."""
    import yaml

    from gpuslo.rules.config import example
    from gpuslo.rules.prometheus import render

    said = re.search(r'"SUCCESS: (\d+) rules found"', (DOCS / "alerting.md").read_text())
    assert said
    groups = yaml.safe_load(render(example()))["groups"]
    assert int(said.group(1)) == sum(len(g["rules"]) for g in groups)


# an inline span that the page wraps over lines, its white space made single spaces
WRAPPED_SPAN = re.compile(r"`([^`]+)`")


def _wrapped_spans(text: str) -> list[str]:
    return [" ".join(s.split()) for s in WRAPPED_SPAN.findall(FENCED.sub("", text))]


def _said_as(quoted: str, line: str) -> bool:
    """``quoted`` is ``line``, or its pieces around each ``...`` are, in order."""
    at = 0
    for piece in quoted.split("..."):
        found = line.find(piece.strip(), at)
        if found < 0:
            return False
        at = found + len(piece.strip())
    return True


def _topic_watch_what(path: Path) -> str:
    """What the file's ``TopicWatch(...)`` says waits on a missing topic (its last argument)."""
    import ast

    calls = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "TopicWatch"
    ]
    assert len(calls) == 1 and isinstance(calls[0].args[-1], ast.Constant), path
    what = calls[0].args[-1].value
    assert isinstance(what, str)
    return what


def test_the_missing_topic_lines_deployment_quotes_are_the_agents_and_the_ingests() -> None:
    """deployment.md quotes what the agent and the ingest log for a topic the broker lacks; each
    quote is the line the watch writes with the words the agent's and the ingest's own watch pass
    it (it quoted '(gpuslo topics --create ...)' and 'once per topic' where topics missing
    together share one line)."""
    from gpuslo.core.settings import Topics
    from gpuslo.core.topic_watch import TopicWatch

    spans = _wrapped_spans((DOCS / "deployment.md").read_text())
    quotes = [s for s in spans if "has no topic" in s]
    agent = TopicWatch(None, list, "HOST:PORT", _topic_watch_what(ROOT / "agent/kafka_sink.py"))
    ingest = TopicWatch(None, list, "HOST:PORT", _topic_watch_what(ROOT / "ingest/kafka_consumer.py"))
    five = sorted(Topics().all())  # the defaults: what a new broker lacks
    lines = [
        agent.words(["gpuslo.gpu_samples"]),
        agent.words(["gpuslo.gpu_samples", "gpuslo.heartbeats", "gpuslo.latency"]),
        ingest.words(five),
    ]
    assert len(quotes) == 3, quotes
    for quote in quotes:
        assert any(_said_as(quote, line) for line in lines), (quote, lines)
    assert quotes[0] == lines[0]  # the one quoted whole


def test_a_topic_coming_back_is_logged_as_deployment_quotes_it(caplog: pytest.LogCaptureFixture) -> None:
    """The line a topic made at last gives (at INFO: deployment.md says it shows only with -v)."""
    import logging

    from gpuslo.core.topic_watch import MISSING_AFTER_S, TopicWatch

    class Cluster:
        def __init__(self) -> None:
            self.has: set[str] = set()

        def add_listener(self, fn: object) -> None: ...

        def remove_listener(self, fn: object) -> None: ...

        def partitions_for_topic(self, topic: str) -> set[int] | None:
            return {0} if topic in self.has else None

    class Producer:
        _metadata = Cluster()

    now = [0.0]
    cluster = Producer._metadata
    watch = TopicWatch(Producer(), lambda: ["gpuslo.latency"], "HOST:PORT", "w", clock=lambda: now[0])
    watch.seen(cluster)
    now[0] = MISSING_AFTER_S
    assert watch.check() == ["gpuslo.latency"]
    cluster.has.add("gpuslo.latency")
    watch.seen(cluster)
    with caplog.at_level(logging.INFO, logger="gpuslo.core.topic_watch"):
        assert watch.check() == []
    back = [r for r in caplog.records if "is there now" in r.getMessage()]
    assert [r.levelno for r in back] == [logging.INFO]
    spans = _wrapped_spans((DOCS / "deployment.md").read_text())
    assert back[0].getMessage() in spans


def test_the_second_signal_line_deployment_quotes_is_the_clis() -> None:
    text = " ".join((DOCS / "deployment.md").read_text().split())
    quoted = re.search(r"`(gpuslo: SIGTERM again: [^`]*)`", text)
    assert quoted
    assert quoted.group(1).replace("SIGTERM", "{name}") + "\\n" in (ROOT / "gpuslo/app/cli.py").read_text()


def test_the_topics_section_names_every_flag_of_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    """operations.md's `gpuslo topics` section and `gpuslo topics --help`: the same flags, the
    same --timeout-s default and bounds."""
    from gpuslo.app.cli import main
    from gpuslo.app.topics import DEFAULT_TIMEOUT_S

    with pytest.raises(SystemExit):
        main(["topics", "--help"])
    helped = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out)) - {"--help", "--verbose"}
    section = _between((DOCS / "operations.md").read_text(), "## Kafka topics: `gpuslo topics`", "\n## ")
    section = re.sub(r"`kafka-[^`]*`", "", section)  # Kafka's own tools' flags
    said = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", section))
    assert helped == said, helped ^ said
    assert f"`--timeout-s` (default {DEFAULT_TIMEOUT_S:g}; more than 0, at most 3600)" in section
    with pytest.raises(SystemExit):
        main(["topics", "--timeout-s", "3601"])
    main_err = capsys.readouterr().err
    assert "(0, 3600]" in main_err

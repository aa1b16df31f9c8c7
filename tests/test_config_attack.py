"""Every numeric key of the config files, at the edges of its type, through the loader and
through the real CLI: refused at start with the file and the key named, exit 2, never a
traceback or a value that fails later (a timeout of ``.inf`` or 1e300 was an OverflowError in
the agent's Kafka sink and the ingest's store connection; ``true`` was read as 1).

The keys are derived from the models (every int, float and Decimal leaf, inside optional
sections, lists and mappings too), not listed by hand: a key added later is swept as well."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from gpuslo.core.settings import ServiceConfig, SettingsError
from gpuslo.core.settings import load as load_settings
from gpuslo.rules.config import EXAMPLE_FILE, ConfigError, RulesConfig
from gpuslo.rules.config import load as load_rules

ROOT = Path(__file__).resolve().parents[1]
Path_ = tuple[str | int, ...]


def _strip(tp: Any) -> Any:
    return _strip(get_args(tp)[0]) if get_origin(tp) is Annotated else tp


def _arms(tp: Any) -> tuple[Any, ...]:
    tp = _strip(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return tuple(_strip(a) for a in get_args(tp) if a is not type(None))
    return (tp,)


def _is_number(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, int | float | Decimal) and not issubclass(tp, bool)


def numeric_leaves(model: type[BaseModel], prefix: Path_ = ()) -> Iterator[tuple[Path_, type]]:
    """(path, number type) of every numeric leaf: a list's element is index 0, a mapping's
    value the key ``q``."""
    for name, field in model.model_fields.items():
        if field.exclude:  # derived, never a user's key (a window's period_s)
            continue
        for arm in _arms(field.annotation):
            yield from _leaves_of(arm, (*prefix, name))


def _leaves_of(tp: Any, path: Path_) -> Iterator[tuple[Path_, type]]:
    if _is_number(tp):
        yield path, tp
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        yield from numeric_leaves(tp, path)
    elif get_origin(tp) in (tuple, list):
        for arm in _arms(get_args(tp)[0]):
            yield from _leaves_of(arm, (*path, 0))
    elif get_origin(tp) is dict:
        for arm in _arms(get_args(tp)[1]):
            yield from _leaves_of(arm, (*path, "q"))


def with_value(base: dict[str, Any], path: Path_, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    cur: Any = doc
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(key, int):
            cur = cur[key]
        else:
            if not isinstance(cur.get(key), dict | list):
                cur[key] = [{}] if isinstance(nxt, int) else {}
            cur = cur[key]
    if isinstance(path[-1], int):
        cur[:] = [value]
    else:
        cur[path[-1]] = value
    return doc


def field_path(path: Path_) -> str:
    """The dotted key as the messages name it, up to the list or mapping that holds the leaf
    (a boolean in one is reported at the list or mapping, with the place in the message)."""
    keys = list(path[:-1]) if path[-1] == "q" or isinstance(path[-1], int) else list(path)
    return ".".join(str(k) for k in keys)


# a rules config with every optional section present, so that every leaf has a place
RULES_BASE: dict[str, Any] = yaml.safe_load(EXAMPLE_FILE.read_text())
RULES_BASE["slos"][0]["windows"] = [{"severity": "page", "long": "1h", "short": "5m", "budget_percent": 2}]
RULES_BASE["whatif"] = {"limits": {"user_gpus": 4, "account_gpus": 8}, "first_fit": {"reserve_after_s": 60}}
SERVICE_BASE: dict[str, Any] = {"clickhouse": {"host": "localhost"}}

SERVICE_LEAVES = list(numeric_leaves(ServiceConfig))
RULES_LEAVES = list(numeric_leaves(RulesConfig))

# refused in every numeric key: the booleans (read as 1 and 0) and the non-finite floats
EVERYWHERE = [True, False, math.nan, math.inf, -math.inf]
# refused in every key of the service config: the numbers no timeout, size or count can be
HUGE = [1e308, 10**30]


def test_the_sweep_finds_the_keys_it_must() -> None:
    """The derivation reaches into optional sections, lists and mappings (a sweep over nothing
    passes)."""
    svc = {field_path(p) for p, _ in SERVICE_LEAVES}
    assert {"producer.flush_timeout_s", "ingest.retry_max_s", "clickhouse.connect_timeout_s",
            "spool.max_age_s", "producer.linger_ms"} <= svc  # fmt: skip
    rules = {field_path(p) for p, _ in RULES_LEAVES}
    assert {"idle_threshold", "slos.0.buckets_ms", "slos.0.windows.0.budget_percent",
            "starvation.queue_threshold_s", "grid_intensity.clusters", "chargeback.per_gpu_hour",
            "whatif.limits.user_gpus", "reclaim.action.max_attempts"} <= rules  # fmt: skip
    # counted by hand: producer 5, spool 2, clickhouse 3, ingest 11; top level 4, starvation 2,
    # an SLO 6 and its window 1, reclaim 8, grid 2, chargeback 3, whatif 12
    assert (len(SERVICE_LEAVES), len(RULES_LEAVES)) == (21, 38)


def _refused(load: Any, error: type[Exception], tmp_path: Path, doc: dict[str, Any], key: str) -> str:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(doc))
    with pytest.raises(error) as exc:
        load(f)
    text = str(exc.value)
    assert f"{f}: {key}" in text, text
    return text


@pytest.mark.parametrize("value", EVERYWHERE + HUGE, ids=repr)
def test_every_numeric_service_key_refuses_the_edges_of_its_type(value: Any, tmp_path: Path) -> None:
    for path, _ in SERVICE_LEAVES:
        _refused(
            load_settings, SettingsError, tmp_path, with_value(SERVICE_BASE, path, value), field_path(path)
        )


@pytest.mark.parametrize("value", EVERYWHERE, ids=repr)
def test_every_numeric_rules_key_refuses_booleans_and_non_finite_numbers(value: Any, tmp_path: Path) -> None:
    load_rules(_write(tmp_path / "base.yaml", RULES_BASE))  # the base itself is good
    for path, _ in RULES_LEAVES:
        _refused(load_rules, ConfigError, tmp_path, with_value(RULES_BASE, path, value), field_path(path))


def test_a_number_in_a_number_key_is_still_taken(tmp_path: Path) -> None:
    """The refusal is of booleans, not of numbers: ints where floats go, and 1 and 0."""
    cfg = load_rules(_write(tmp_path / "r.yaml", {**RULES_BASE, "idle_threshold": 1, "min_idle_s": 0}))
    assert (cfg.idle_threshold, cfg.min_idle_s) == (1.0, 0.0)
    svc = load_settings(
        _write(tmp_path / "s.yaml", {"producer": {"linger_ms": 0, "flush_timeout_s": 86_400}})
    )
    assert (svc.producer.linger_ms, svc.producer.flush_timeout_s) == (0, 86_400.0)


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def _cli(*argv: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuslo", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False, **kw)  # fmt: skip


def _all_at(base: dict[str, Any], leaves: list[tuple[Path_, type]], value: Any) -> dict[str, Any]:
    doc = base
    for path, _ in leaves:
        doc = with_value(doc, path, value)
    return doc


@pytest.mark.integration
@pytest.mark.parametrize("value", EVERYWHERE + HUGE, ids=repr)
def test_the_cli_refuses_a_service_config_with_exit_2_naming_every_key(value: Any, tmp_path: Path) -> None:
    """One file with every numeric key at the value, through ``gpuslo ingest --config``: exit 2,
    every key named, no traceback."""
    (tmp_path / "in.jsonl").write_bytes(b"")
    f = _write(tmp_path / "svc.yaml", _all_at(SERVICE_BASE, SERVICE_LEAVES, value))
    r = _cli(
        "ingest", "--file", str(tmp_path / "in.jsonl"), "--store", str(tmp_path / "st"), "--config", str(f)
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "bad service config" in r.stderr
    for path, _ in SERVICE_LEAVES:
        assert f"{f}: {field_path(path)}" in r.stderr, (path, r.stderr)


@pytest.mark.integration
@pytest.mark.parametrize("value", [True, math.inf], ids=repr)
def test_the_cli_refuses_a_rules_config_with_exit_2_naming_every_key(value: Any, tmp_path: Path) -> None:
    f = _write(tmp_path / "rules.yaml", _all_at(RULES_BASE, RULES_LEAVES, value))
    r = _cli("rules", "export-prometheus", "--config", str(f))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "bad rules config" in r.stderr
    for path, _ in RULES_LEAVES:
        assert f"{f}: {field_path(path)}" in r.stderr, (path, r.stderr)


def test_the_retry_delays_are_in_order(tmp_path: Path) -> None:
    f = _write(tmp_path / "s.yaml", {"ingest": {"retry_initial_s": 60, "retry_max_s": 30}})
    with pytest.raises(SettingsError, match="retry_initial_s 60 is above retry_max_s 30"):
        load_settings(f)


@pytest.mark.integration
@pytest.mark.parametrize(
    "argv",
    [
        ["ingest", "--file", "IN", "--config", "CFG"],  # no --store: the config names the server
        ["rules", "eval", "--from", "0", "--to", "60", "--service-config", "CFG"],
    ],
    ids=["ingest", "rules-eval"],
)
def test_a_service_config_given_as_a_pipe_is_read_once(argv: list[str], tmp_path: Path) -> None:
    """``--config <(...)``: the CLI read the file twice (once for the log redaction's secrets,
    once for the command), and a pipe gives its text once: "a pipe that gave nothing", exit 2.
    The same run with the text in a regular file is the reference."""
    (tmp_path / "in.jsonl").write_bytes(b"")
    text = "clickhouse: {host: 127.0.0.1, port: 1, connect_timeout_s: 0.5}\n"
    regular = tmp_path / "svc.yaml"
    regular.write_text(text)

    def run(cfg: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        words = {"IN": str(tmp_path / "in.jsonl"), "CFG": cfg}
        return _cli(*[words.get(w, w) for w in argv], **kw)

    ref = run(str(regular))
    r_fd, w_fd = os.pipe()
    os.write(w_fd, text.encode())
    os.close(w_fd)
    try:
        got = run(f"/dev/fd/{r_fd}", pass_fds=(r_fd,))
    finally:
        os.close(r_fd)
    assert "pipe" not in got.stderr and "Traceback" not in got.stderr, got.stderr
    assert "127.0.0.1:1" in ref.stderr  # the reference reached the configured server
    assert (got.returncode, got.stderr.replace(f"/dev/fd/{r_fd}", "F")) == (
        ref.returncode,
        ref.stderr.replace(str(regular), "F"),
    )


def _wire_max_gpus() -> int:
    """GPUs per node the wire can name: a GPU's index bound (from the model) plus one."""
    from gpuslo.wire.models import GpuSample

    (le,) = [m.le for m in GpuSample.model_fields["index"].metadata if hasattr(m, "le")]
    return int(le) + 1


# (flag, the first value refused below, the first refused above); each flag's own bounds
SIM_FLAGS = [
    ("--nodes", "0", "100001"),
    ("--gpus", "0", str(_wire_max_gpus() + 1)),
    ("--seed", "-1", str(2**64)),
    ("--hours", "0.001", "9601"),
    ("--interval-s", "0.5", "86401"),
]


@pytest.mark.integration
@pytest.mark.parametrize(("flag", "below", "above"), SIM_FLAGS, ids=[f for f, *_ in SIM_FLAGS])
@pytest.mark.parametrize("command", ["agent", "demo"])
def test_every_simulated_fleet_flag_refuses_values_outside_its_range(
    command: str, flag: str, below: str, above: str, tmp_path: Path
) -> None:
    """``--gpus 100000`` ran with a ValidationError traceback (the wire's GPU index is at most
    1023), ``--seed -5`` ended in numpy's ValueError traceback, ``--nodes 10**11`` filled memory."""
    for value in (below, above, "nan", "inf"):
        short = [] if flag == "--hours" else ["--hours", "0.01"]
        r = _cli(command, flag, value, *short, "--out", str(tmp_path / "o"), *(
            ["--quiet"] if command == "demo" else []))  # fmt: skip
        assert r.returncode == 2, (flag, value, r.stderr)
        assert "Traceback" not in r.stderr and flag in r.stderr, (flag, value, r.stderr)
        assert not (tmp_path / "o").exists()


@pytest.mark.integration
def test_the_simulated_fleet_takes_the_highest_gpu_count_the_wire_names(tmp_path: Path) -> None:
    n = _wire_max_gpus()
    r = _cli("agent", "--gpus", str(n), "--nodes", "1", "--hours", "0.01", "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 0, r.stderr
    batches = [m for m in map(__import__("json").loads, (tmp_path / "o.jsonl").read_text().splitlines())
               if m.get("kind") == "gpu_samples"]  # fmt: skip
    assert max(g["index"] for b in batches for g in b["gpus"]) == n - 1


@pytest.mark.integration
@pytest.mark.parametrize("where", ["flag", "file", "env"])
def test_a_receiver_url_urlsplit_refuses_is_one_line_and_exit_2(where: str, tmp_path: Path) -> None:
    """``--alertmanager http://[::1`` (a bracket that does not close): urlsplit raised its own
    ValueError, a traceback and exit 1, from a flag, a URL file or the environment alike."""
    url = "http://[::1:9093"
    (tmp_path / "urls").write_text(url + "\n")
    (tmp_path / "urls").chmod(0o600)
    args = {"flag": ["--alertmanager", url], "file": ["--alertmanager-url-file", str(tmp_path / "urls")],
            "env": []}[where]  # fmt: skip
    env = {**os.environ, "GPUSLO_ALERTMANAGER_URL": url} if where == "env" else None
    r = _cli("rules", "run", "--once", "--store", str(tmp_path / "st"), "--outbox", str(tmp_path / "ob"),
             *args, env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "alertmanager URL: Invalid IPv6 URL" in r.stderr, r.stderr
    assert not (tmp_path / "st").exists()  # refused before the store is opened


# URLs no scrape or watch can use: no scheme, another scheme, no host, a bracket that does not
# close, a port that is no number, whitespace and control characters inside
BAD_URLS = ["notaurl", "ftp://h/metrics", "http:///metrics", "http://[::1/metrics", "http://h:port/metrics",
            "http://h/me trics", "http://h/\x01"]  # fmt: skip


#: (the flag, an agent run that reads it): URL, OUT and STATE filled in by the test
_URL_FLAG_RUNS = [
    ("--dcgm-url", ["--source", "dcgm", "--node", "n1", "--once", "--dcgm-url", "URL"]),
    ("--latency", ["--source", "latency", "--node", "n1", "--ticks", "1", "--metrics-port", "0", "--out", "OUT",
                   "--latency", "URL=svc"]),
    ("--k8s-api", ["--source", "k8s-events", "--ticks", "1", "--metrics-port", "0", "--out", "OUT",
                   "--state-file", "STATE", "--k8s-api", "URL"]),
]  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(
    ("flag", "argv"),
    _URL_FLAG_RUNS,
    ids=["dcgm-url", "latency", "k8s-api"],
)
def test_every_url_flag_of_the_agent_refuses_a_url_it_could_never_use(
    flag: str, argv: list[str], tmp_path: Path
) -> None:
    """``--dcgm-url notaurl --once`` exited 0 with no samples (a warning per scrape);
    ``--k8s-api notaurl`` retried its watches for ever; ``--latency http://[x=svc`` likewise."""
    for url in BAD_URLS:
        at = {"URL": url, "OUT": str(tmp_path / "o.jsonl"), "STATE": str(tmp_path / "state.json")}
        words = [at.get(w, w.replace("URL", url)) for w in argv]
        r = _cli("agent", "--cluster", "c", *words, timeout=60)
        assert r.returncode == 2, (url, r.stderr)
        assert "Traceback" not in r.stderr and flag in r.stderr, (url, r.stderr)
        assert not (tmp_path / "o.jsonl").exists(), url


def _options() -> Iterator[tuple[str, Any]]:
    """(option, action) of every subcommand's options."""
    from tests.helpers import cli_actions

    for act in cli_actions():
        for o in act.option_strings:
            yield o, act


# plain int options whose range is checked after parsing, each with its own message (the
# simulated fleet's SIM_BOUNDS, the store's TTL, the what-if's added GPUs); --kill-after-write
# is a hidden fault injection for the crash tests
CHECKED_AFTER_PARSING = {"--nodes", "--gpus", "--seed", "--retention-days", "--add-gpus", "--gpus-per-node",
                         "--kill-after-write"}  # fmt: skip


def test_no_numeric_option_is_left_without_its_range() -> None:
    """A plain ``int`` or ``float`` option takes any size and NaN (``--max-line-bytes 1e22`` was an
    OverflowError traceback): each takes a bounded type, has choices, or is checked after parsing."""
    plain = {o for o, act in _options() if act.type in (int, float) and act.choices is None}
    assert plain - CHECKED_AFTER_PARSING == set()
    assert CHECKED_AFTER_PARSING - plain == set()  # the list names no option that is gone


@pytest.mark.integration
@pytest.mark.parametrize("flag", ["--max-line-bytes", "--max-report", "--dedup-window"])
def test_the_ingest_file_limits_refuse_values_outside_their_range(flag: str, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_bytes(b"")
    for value in ("-1", str(10**22), "nan", "1.5", "0x10"):
        r = _cli("ingest", "--file", str(tmp_path / "in.jsonl"), "--store", str(tmp_path / "st"), flag, value)
        assert r.returncode == 2, (value, r.stderr)
        assert "Traceback" not in r.stderr and flag in r.stderr, (value, r.stderr)
        assert not (tmp_path / "st").exists()


# Kafka client settings that cannot resolve: a password variable not set, a password file or a
# TLS file that is missing or a directory (key named in the message, after the file)
UNRESOLVABLE = [
    ("sasl-env", "security_protocol: SASL_PLAINTEXT, sasl_mechanism: PLAIN, sasl_username: u, "
                 "sasl_password_env: GPUSLO_TEST_SURELY_UNSET", "kafka.sasl_password"),
    ("sasl-file", "security_protocol: SASL_PLAINTEXT, sasl_mechanism: PLAIN, sasl_username: u, "
                  "sasl_password_file: {tmp}/missing", "kafka.sasl_password"),
    ("ca-missing", "security_protocol: SSL, ssl_cafile: {tmp}/missing.pem", "kafka.ssl_cafile"),
    ("ca-directory", "security_protocol: SSL, ssl_cafile: {tmp}", "kafka.ssl_cafile"),
    ("ca-no-certificate", "security_protocol: SSL, ssl_cafile: {tmp}/svc.yaml", "kafka.ssl_cafile"),
    ("cert-missing", "security_protocol: SSL, ssl_certfile: {tmp}/c.pem, ssl_keyfile: {tmp}/k.pem",
     "kafka.ssl_certfile"),
]  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(("case", "kafka", "key"), UNRESOLVABLE, ids=[c for c, *_ in UNRESOLVABLE])
@pytest.mark.parametrize("command", ["agent", "ingest"])
def test_kafka_credentials_and_tls_files_that_do_not_resolve_fail_the_start(
    command: str, case: str, kafka: str, key: str, tmp_path: Path
) -> None:
    """They were found when the client connected, and read as a broker that was down: the agent
    spooled and retried ("Kafka unavailable ... spooling to disk"), exit 1 after its flush; the
    ingest said "no Kafka broker reachable". No broker runs at 127.0.0.1:1: exit 2 must come
    from the config, at once."""
    f = tmp_path / "svc.yaml"
    f.write_text("kafka: {" + kafka.replace("{tmp}", str(tmp_path)) + "}\n")
    argv = {"agent": ["--hours", "0.01", "--spool-dir", str(tmp_path / "spool"), "--flush-timeout-s", "1"],
            "ingest": ["--idle-exit-s", "1", "--metrics-port", "0"]}[command]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "GPUSLO_TEST_SURELY_UNSET"}
    r = _cli(command, "--kafka", "127.0.0.1:1", "--config", str(f), *argv, env=env, timeout=90)
    assert r.returncode == 2, r.stderr
    assert f"bad service config {f}: {key}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "unavailable" not in r.stderr and "reachable" not in r.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    "ca", ["missing.pem", ".", "svc.yaml"], ids=["missing", "directory", "no-certificate"]
)
@pytest.mark.parametrize(
    "argv",
    [
        ["ingest", "--file", "IN", "--config", "CFG"],
        ["ingest", "--kafka", "127.0.0.1:1", "--idle-exit-s", "1", "--metrics-port", "0", "--config", "CFG"],
        ["rules", "run", "--once", "--service-config", "CFG"],
    ],
    ids=["ingest-file", "ingest-kafka", "rules-run"],
)
def test_a_clickhouse_ca_file_that_is_not_there_is_fatal_not_a_network_error(
    argv: list[str], ca: str, tmp_path: Path
) -> None:
    """clickhouse-driver opened ``ca_certs`` when it connected; "No such file or directory" was
    classified a transient network error, and ``ingest --kafka`` retried it for ever."""
    (tmp_path / "in.jsonl").write_bytes(b"")
    f = tmp_path / "svc.yaml"
    f.write_text(f"clickhouse: {{host: 127.0.0.1, port: 1, secure: true, ca_certs: {tmp_path / ca}}}\n")
    words = {"IN": str(tmp_path / "in.jsonl"), "CFG": str(f), "OB": str(tmp_path / "ob")}
    r = _cli(*[words.get(w, w) for w in argv], timeout=60)
    assert r.returncode == 2, r.stderr
    assert "clickhouse.ca_certs: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert ("is no CA bundle" if ca == "svc.yaml" else "cannot read") in r.stderr, r.stderr
    assert "retrying" not in r.stderr


# keys that do not read as what they are: every control character (C0, DEL, C1), format
# characters (zero width space, right-to-left override, BOM), a key with spaces around it, an
# empty key; each between two letters, and the controls alone too
HOSTILE_KEYS = sorted(
    {f"a{c}b" for c in [*map(chr, range(32)), *map(chr, range(127, 160)), "\u200b", "\u202e", "\ufeff"]}
    | {chr(c) for c in range(32)}
    | {" idle_threshold", "idle_threshold ", ""}
)


def _no_control(text: str) -> None:
    import unicodedata

    bad = {c for c in text if c != "\n" and unicodedata.category(c)[0] == "C"}
    assert not bad, sorted(map(ascii, bad))


@pytest.mark.integration
@pytest.mark.parametrize("command", ["rules", "service"])
def test_a_refused_key_is_named_visibly_and_writes_no_control_character(command: str, tmp_path: Path) -> None:
    """A key with an escape sequence wrote it raw to the terminal (ESC ] 0 ; retitled it,
    ESC [ 2 J cleared it), and ``idle_threshold`` with a zero width space or a trailing space
    read as the right key refused. Each hostile key, unknown at the top level and as a
    mapping's key with a bad value, is named by its escapes; nothing raw reaches stderr."""
    doc: dict[str, Any] = {k: 1 for k in HOSTILE_KEYS}
    if command == "rules":
        doc["starvation"] = {"queue_threshold_s": {k: -1 for k in HOSTILE_KEYS}}
        dup = "x\x1b[2Jy"  # a message that quotes a value: duplicate SLO names
        (tmp_path / "dup.yaml").write_text(yaml.safe_dump(
            {"slos": [{"name": dup, "service": "s", "threshold_ms": 5}] * 2}))  # fmt: skip
        r = _cli("rules", "export-prometheus", "--config", str(tmp_path / "dup.yaml"))
        assert r.returncode == 2 and "duplicate SLO names: x\\x1b[2Jy" in r.stderr, r.stderr
        _no_control(r.stderr)
    f = _write(tmp_path / "c.yaml", doc)
    r = (_cli("rules", "export-prometheus", "--config", str(f)) if command == "rules"
         else _cli("ingest", "--file", str(f), "--store", str(tmp_path / "st"), "--config", str(f)))  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    _no_control(r.stderr)
    for k in HOSTILE_KEYS:
        assert f"{f}: {k!a}: Extra inputs are not permitted" in r.stderr, ascii(k)
        if command == "rules":
            assert f"{f}: starvation.queue_threshold_s.{k!a}: Input should be greater than 0" in r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("ca", ["missing", "directory", "not-pem", "empty"])
@pytest.mark.parametrize("source", ["k8s-events", "nvml"])
def test_a_k8s_ca_file_that_holds_no_certificate_is_one_line_and_exit_2(
    source: str, ca: str, tmp_path: Path
) -> None:
    """KubeApi loads the bundle when it is made: FileNotFoundError, IsADirectoryError or
    ssl.SSLError (no certificate) came out as a traceback, exit 1."""
    path = {"missing": tmp_path / "none.pem", "directory": tmp_path, "not-pem": tmp_path / "x.pem",
            "empty": tmp_path / "e.pem"}[ca]  # fmt: skip
    (tmp_path / "x.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    (tmp_path / "e.pem").write_text("")
    extra = (["--node", "n1", "--k8s-pod-resources", str(tmp_path / "kubelet.sock")] if source == "nvml"
             else ["--state-file", str(tmp_path / "state.json")])  # fmt: skip
    r = _cli("agent", "--source", source, "--cluster", "c", "--ticks", "1", "--metrics-port", "0",
             "--k8s-api", "https://127.0.0.1:1", "--k8s-ca-file", str(path), *extra, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"cannot use --k8s-ca-file {path}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def path_leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The key of every path in the model (a Path arm), nested models walked."""
    for name, field in model.model_fields.items():
        for arm in _arms(field.annotation):
            if isinstance(arm, type) and issubclass(arm, BaseModel):
                yield from path_leaves(arm, (*prefix, name))
            elif arm is Path:
                yield (*prefix, name)


SERVICE_PATHS = list(path_leaves(ServiceConfig))


@pytest.mark.parametrize("value", ["", " ", "\t", "a\0b", "\0"])
def test_every_path_of_the_service_config_refuses_an_empty_or_nul_one(value: str, tmp_path: Path) -> None:
    """A path key given empty was read as the current directory (``spool.directory: ''`` put
    the agent's spool wherever it was started), one with a NUL was a ValueError traceback where
    it was first opened: each is refused at load, naming its key."""
    assert {("spool", "directory"), ("kafka", "ssl_cafile"), ("clickhouse", "password_file")} <= set(
        SERVICE_PATHS
    )
    for key in SERVICE_PATHS:
        doc = with_value(SERVICE_BASE, key, value)
        with pytest.raises(SettingsError, match=rf"{'.'.join(key)}[\s\S]*(empty or blank path|NUL)"):
            _load_service(doc, tmp_path)
    # a path with a space in it is still one
    assert _load_service(
        with_value(SERVICE_BASE, ("spool", "directory"), " a b"), tmp_path
    ).spool.directory == Path(" a b")


def _load_service(doc: dict[str, Any], tmp_path: Path) -> ServiceConfig:
    f = tmp_path / "service.yaml"
    f.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return load_settings(f)


def test_an_agent_given_an_empty_spool_directory_spools_nowhere(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("spool:\n  directory: ''\n")
    work = tmp_path / "cwd"
    work.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "gpuslo", "agent", "--source", "sim", "--hours", "0.01", "--kafka", "127.0.0.1:1",
         "--config", str(conf), "--flush-timeout-s", "1"],
        cwd=work, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert p.returncode != 0 and "spool.directory" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert list(work.iterdir()) == []  # no spool made where it was started

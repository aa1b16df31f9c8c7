"""Rules config at its edges: burn factors derived per SLO period, non-finite numbers,
files that are not UTF-8 or nested too deep, and load work linear in the file's size."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from gpuslo.core.settings import SettingsError
from gpuslo.core.settings import load as load_settings
from gpuslo.rules.config import ConfigError, Slo, load, parse
from gpuslo.rules.prometheus import render

BASE: dict[str, Any] = {"name": "s", "service": "svc", "threshold_ms": 5}


def factors(**kw: Any) -> list[tuple[str, str, str, float]]:
    s = Slo.model_validate({**BASE, **kw})
    return [(w.severity, w.long, w.short, w.factor) for w in s.windows]


# expected factors by hand: factor = budget share × period / long window
#   30 d = 720 h: 0.02·720/1 = 14.4, 0.05·720/6 = 6, 0.10·720/24 = 3, 0.10·720/72 = 1
#   28 d = 672 h: 0.02·672 = 13.44, 0.05·672/6 = 5.6, 0.10·672/24 = 2.8, 0.10·672/72 = 0.9333…
#   7 d = 168 h (Sloth's 7 d shares 8, 12.5, 20, 42 %): 13.44, 3.5, 1.4, 0.98
#   90 d = 2160 h (not catalogued: the 30 d shares): 43.2, 18, 9, 3
@pytest.mark.parametrize(
    ("period_d", "expected"),
    [(30, [14.4, 6, 3, 1]), (28, [13.44, 5.6, 2.8, 67.2 / 72]), (7, [13.44, 3.5, 1.4, 0.98]),
     (90, [43.2, 18, 9, 3])],
)  # fmt: skip
def test_burn_factors_derive_from_the_budget_share_and_the_period(
    period_d: int, expected: list[float]
) -> None:
    got = factors(period_d=period_d)
    assert [(s, lw, sw) for s, lw, sw, _ in got] == [
        ("page", "1h", "5m"), ("page", "6h", "30m"), ("ticket", "1d", "2h"), ("ticket", "3d", "6h")]  # fmt: skip
    assert [f for *_, f in got] == pytest.approx(expected, rel=1e-12)
    if period_d == 30:  # the workbook's figures to the last bit (they are printed and exported)
        assert [f for *_, f in got] == [14.4, 6.0, 3.0, 1.0]


def test_a_7_day_slo_pages_at_its_own_budget_not_at_30_day_factors() -> None:
    """Before the fix every period got 14.4/6/3/1; a 7 d SLO's page now sits at 13.44 (8 % of
    its budget in 1 h), and the Prometheus export carries the same factor."""
    assert factors(period_d=7)[0][3] == pytest.approx(13.44)
    assert factors(period_d=7) != factors(period_d=30)
    rules = render(parse({"slos": [{**BASE, "period_d": 7}]}))
    assert "> (13.44 * 0.01)" in rules and "> (3.5 * 0.01)" in rules and "> (0.98 * 0.01)" in rules
    rules28 = render(parse({"slos": [{**BASE, "period_d": 28}]}))
    assert f"> ({67.2 / 72!r} * 0.01)" in rules28  # not a rounded 0.933333


def test_custom_windows_get_factors_for_their_period() -> None:
    # 14 d = 336 h; 5 % in 2 h: 0.05·336/2 = 8.4
    got = factors(
        period_d=14, windows=[{"severity": "page", "long": "2h", "short": "10m", "budget_percent": 5}]
    )
    assert got == [("page", "2h", "10m", pytest.approx(8.4))]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"period_d": 2}, r"window 3d/6h \(ticket\): the long window is longer than the SLO period \(2 d\)"),
        ({"period_d": 1}, r"window 1d/2h .* longer than the SLO period \(1 d\)|window 3d/6h"),
        # objective 0.9: all requests slow burn 10×, below the 1 h page's 14.4
        ({"objective": 0.9}, r"window 1h/5m \(page\) can never fire: its factor 14.4 .* highest possible burn 10"),
        # 17 nines are the float 1.0: "less than 1" alone read as wrong
        ({"objective": 0.99999999999999999}, r"objective 1.0 is not below 1: 1 leaves no error budget .* at most 16"),
        ({"objective": 1}, r"objective 1 is not below 1"),
        ({"objective": 1.5}, r"objective 1.5 is not below 1"),
        ({"windows": [{"severity": "page", "long": "1h", "short": "5m", "factor": 14.4}]},
         r"factor is derived, not configured: give budget_percent"),
        ({"windows": [{"severity": "page", "long": "1h", "short": "5m", "budget_percent": 2, "period_s": 60}]},
         r"period_s is not a window key"),
        ({"windows": [{"severity": "page", "long": "1h", "short": "5m", "budget_percent": 0}]}, r"budget_percent"),
        ({"windows": [{"severity": "page", "long": "1h", "short": "5m", "budget_percent": 101}]}, r"budget_percent"),
    ],
)  # fmt: skip
def test_periods_and_windows_that_make_no_sense_are_refused_with_a_reason(
    kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        parse({"slos": [{**BASE, **kw}]}, "rules.yaml")


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", ".Inf"])
@pytest.mark.parametrize(
    "template",
    ["slos: [{{name: s, service: v, threshold_ms: {v}}}]",
     "slos: [{{name: s, service: v, threshold_ms: 5, buckets_ms: [1, 5, {v}]}}]",
     "slos: [{{name: s, service: v, threshold_ms: 5, objective: {v}}}]",
     "slos: [{{name: s, service: v, threshold_ms: 5, windows: [{{severity: page, long: 1h, short: 5m, "
     "budget_percent: {v}}}]}}]",
     "starvation: {{threshold_s: {v}}}",
     "starvation: {{queue_threshold_s: {{gpu: {v}}}}}",
     "idle_threshold: {v}", "min_idle_s: {v}", "cur_target: {v}"],
)  # fmt: skip
def test_non_finite_numbers_are_refused(tmp_path: Path, template: str, value: str) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text(template.format(v=value) + "\n")
    with pytest.raises(ConfigError, match=r"rules.yaml: "):
        load(p)


def test_sixteen_nines_are_an_objective() -> None:
    (slo,) = parse({"slos": [{**BASE, "objective": 0.9999999999999999}]}, "rules.yaml").slos
    assert 0 < 1 - slo.objective < 1e-15


def test_inf_threshold_no_longer_exports_le_inf(tmp_path: Path) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text("slos: [{name: s, service: v, threshold_ms: .inf}]\n")
    with pytest.raises(ConfigError, match=r"slos.0.threshold_ms: Input should be a finite number"):
        load(p)


@pytest.mark.parametrize("loader", ["rules", "service"])
@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"slos: []\nname: caf\xe9\n", r"not UTF-8 text \(byte 18, line 2: b'\\xe9'\); save the file as UTF-8"),
        (b"\xff\xfes\x00l\x00", r"not UTF-8 text \(byte 0, line 1"),
        (b"[" * 20_000 + b"]" * 20_000, r"not valid YAML: .*(nesting depth|nested too deeply)"),
        (b"a:\n" + b"".join(b"  " * i + b"b:\n" for i in range(1, 1500)), r"not valid YAML: .*(nesting depth|nested too deeply)"),
        (b"a: [1, 2\n", r"not valid YAML: .*line"),
    ],
)  # fmt: skip
def test_unreadable_yaml_is_a_message_naming_the_file(
    tmp_path: Path, loader: str, content: bytes, match: str
) -> None:
    p = tmp_path / "conf.yaml"
    p.write_bytes(content)
    err = ConfigError if loader == "rules" else SettingsError
    with pytest.raises(err, match=r"(?s)conf.yaml: " + match):
        load(p) if loader == "rules" else load_settings(p)


def test_a_directory_or_missing_file_is_a_message(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read"):
        load(tmp_path)
    with pytest.raises(ConfigError, match=r"no.yaml: cannot read: No such file"):
        load(tmp_path / "no.yaml")


@pytest.mark.parametrize("loader", ["rules", "service"])
@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory", "too_big", "dangling_link"])
def test_a_config_that_is_no_regular_file_or_too_big_is_a_message(
    tmp_path: Path, loader: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--config and --service-config name any path: a device (/dev/zero filled memory into a
    MemoryError traceback), a FIFO no one writes (blocked for ever), a directory, a file past the
    bound, a link to nothing: one message, nothing read past the bound."""
    import os

    from gpuslo.core import fileio
    from gpuslo.core.yamlfile import MAX_CONFIG_BYTES

    monkeypatch.setattr(fileio, "PIPE_WAIT_S", 0.2)  # a FIFO no one writes: waited for, then refused

    p = tmp_path / "conf.yaml"
    if kind == "dev_zero":
        p.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    elif kind == "too_big":
        p.write_bytes(b"# " + b"x" * MAX_CONFIG_BYTES + b"\n")
    else:
        p.symlink_to(tmp_path / "gone")
    err = ConfigError if loader == "rules" else SettingsError
    why = {"too_big": "larger than", "dangling_link": "No such file", "fifo": "a pipe that gave nothing"}.get(
        kind, "not a regular file"
    )
    with pytest.raises(err, match=f"conf.yaml.*{why}"):
        load(p) if loader == "rules" else load_settings(p)


def test_utf8_with_a_bom_loads(tmp_path: Path) -> None:
    p = tmp_path / "rules.yaml"
    p.write_bytes("\ufeffslos: [{name: café, service: v, threshold_ms: 5}]\n".encode())
    assert load(p).slos[0].name == "café"


def test_cli_reports_a_non_utf8_rules_file_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuslo.app.cli import EXIT_ERROR, main

    p = tmp_path / "rules.yaml"
    p.write_bytes(b"cur_target: 0.8 # \xe9t\xe9\n")
    assert main(["rules", "export-prometheus", "--config", str(p)]) == EXIT_ERROR
    assert re.search(r"bad rules config:\n.*rules.yaml: not UTF-8 text", capsys.readouterr().err)


def _config_text(n: int) -> str:
    lines = ["slos:"] + [
        f"  - {{name: s{i}, service: svc{i % 7}, threshold_ms: 5, buckets_ms: [1, 5, 10], period_d: {(7, 28, 30, 90)[i % 4]}}}"
        for i in range(n)
    ]
    return "\n".join(lines) + "\n"


def _work(fn: Any) -> int:
    """Python-level work of ``fn()``: function calls and executed lines, counted by a tracer
    (deterministic, unlike a clock)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_large_config_loads_with_work_linear_in_its_size(tmp_path: Path) -> None:
    """A 14 MB config took 74 s: the burn-window file was parsed again for every SLO (1.5 ms
    each), the duplicate-name check was quadratic, and PyYAML's pure-Python parser was used.
    The work per SLO must not grow with the number of SLOs."""
    small, big = tmp_path / "small.yaml", tmp_path / "big.yaml"
    small.write_text(_config_text(250))
    big.write_text(_config_text(1000))
    load(small)  # warm the (cached) window catalogue
    w_small, w_big = _work(lambda: load(small)), _work(lambda: load(big))
    assert w_big <= 4.4 * w_small, (w_small, w_big)
    # and the catalogue file is parsed once per process, not once per SLO
    from gpuslo.rules import config

    before = config.window_catalog.cache_info().misses
    load(big)
    assert config.window_catalog.cache_info().misses == before


def test_duplicate_names_are_found_in_one_pass() -> None:
    with pytest.raises(ConfigError, match=r"duplicate SLO names: a, b$"):
        parse({"slos": [{**BASE, "name": n} for n in ("a", "b", "c", "b", "a", "a")]})


def test_a_dumped_config_loads_again_with_the_same_factors() -> None:
    cfg = parse({"slos": [{**BASE, "period_d": 7}]})
    again = parse(cfg.model_dump())
    assert again == cfg and [w.factor for w in again.slos[0].windows] == pytest.approx(
        [13.44, 3.5, 1.4, 0.98]
    )


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory", "too_big", "not_utf8", "missing"])
def test_a_secret_file_that_is_no_secret_is_a_message(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A *_file secret (a mounted Secret): a device, a FIFO, a directory, a file past 1 MiB, bytes
    that are not UTF-8 or no file are one message, never a traceback or memory filled."""
    import os

    from gpuslo.core import fileio
    from gpuslo.core.settings import MAX_SECRET_BYTES, resolve_secret

    monkeypatch.setattr(fileio, "PIPE_WAIT_S", 0.2)

    p = tmp_path / "secret"
    {"dev_zero": lambda: p.symlink_to("/dev/zero"), "fifo": lambda: os.mkfifo(p), "directory": p.mkdir,
     "too_big": lambda: p.write_bytes(b"x" * (MAX_SECRET_BYTES + 1)), "not_utf8": lambda: p.write_bytes(b"\xff\n"),
     "missing": lambda: None}[kind]()  # fmt: skip
    with pytest.raises(SettingsError, match=r"password: "):
        resolve_secret(None, None, p, "password")
    p2 = tmp_path / "ok"
    p2.write_text("hunter2\n")
    assert resolve_secret(None, None, p2, "password") == "hunter2"


@pytest.mark.parametrize("loader", ["rules", "service"])
def test_a_config_handed_through_a_pipe_is_read(tmp_path: Path, loader: str) -> None:
    """``--config <(...)`` and ``--config /dev/stdin``: a pipe with a writer is read to its end."""
    import os
    import threading

    p = tmp_path / "conf.fifo"
    os.mkfifo(p)
    text = b"slos: [{name: s, service: v, threshold_ms: 5}]\n" if loader == "rules" else b"kafka: {}\n"

    def write() -> None:
        with open(p, "wb") as f:  # blocks until the reader opens it
            f.write(text)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    got = load(p) if loader == "rules" else load_settings(p)
    t.join(5)
    assert (got.slos[0].name == "s") if loader == "rules" else got is not None


@pytest.mark.parametrize("loader", ["rules", "service"])
@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("cur_target: 0.5\ncur_target: 0.9\n", "cur_target", 2),
        ("slos:\n  - {name: a, service: s, threshold_ms: 5}\nslos:\n  - {name: b, service: s, threshold_ms: 5}\n",
         "slos", 3),
        ("starvation:\n  threshold_s: 60\n  threshold_s: 600\n", "threshold_s", 3),
        ("kafka:\n  bootstrap: a:9092\n  bootstrap: b:9092\n", "bootstrap", 3),
    ],
)  # fmt: skip
def test_a_key_written_twice_is_an_error_not_the_last_one(
    tmp_path: Path, loader: str, text: str, key: str, line: int
) -> None:
    """YAML forbids a key twice in one mapping; PyYAML kept the last one silently: ``slos:``
    written twice dropped the first SLOs with nothing said, a threshold set twice took whichever
    came last. Either config is refused, naming the file, the key and its line."""
    p = tmp_path / "conf.yaml"
    p.write_text(text)
    err = ConfigError if loader == "rules" else SettingsError
    with pytest.raises(err, match=rf"(?s)conf.yaml: not valid YAML: .*the key '{key}' twice.*line {line}"):
        load(p) if loader == "rules" else load_settings(p)


def test_a_merged_key_may_still_be_overridden() -> None:
    """A merge (``<<: *base``) and a key of the mapping's own are no duplicate: the own one wins."""
    from gpuslo.core.yamlfile import parse_text

    text = "base: &base {threshold_s: 60, queue_threshold_s: {debug: 30}}\nstarvation: {<<: *base, threshold_s: 600}\n"
    data = parse_text(text, "conf.yaml", ConfigError)
    assert data["starvation"] == {"threshold_s": 600, "queue_threshold_s": {"debug": 30}}


def test_a_base_with_a_merge_of_its_own_may_be_merged_before_it_is_read() -> None:
    """An anchored mapping that merges another and overrides one of its keys, merged in turn by a
    mapping that is read before it (PyYAML reads nested mappings after their siblings): merging it
    flattened its keys in place (the merged ones and its own), and the check of its keys, when it
    was read in turn, took the merged key for its own written twice: a valid config refused."""
    from gpuslo.core.yamlfile import parse_text

    text = (
        "x: &x {threshold_s: 60}\n"
        "a:\n  inner: &n\n    <<: *x\n    threshold_s: 600\n"
        "starvation:\n  <<: *n\n  queue_threshold_s: {debug: 30}\n"
    )
    data = parse_text(text, "conf.yaml", ConfigError)
    assert data["a"]["inner"] == {"threshold_s": 600}
    assert data["starvation"] == {"threshold_s": 600, "queue_threshold_s": {"debug": 30}}
    with pytest.raises(ConfigError, match=r"the key 'k' twice \(the first at line 3\)"):
        parse_text(
            "x: &x {k: 1}\na:\n  inner: &n {<<: *x, k: 2,\n   k: 3}\nb: {<<: *n}\n", "conf.yaml", ConfigError
        )


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        # a merged mapping with a merge and an override of its own: its override, not the merged value
        ("b: &b {<<: {k: 0}, k: 1}\ny: {<<: *b}\n", {"k": 1}),
        ("b: &b {<<: {k: 0}, k: 1}\nx: {<<: *b, k: 5}\ny: {<<: *b}\n", {"k": 1}),
        # of a list of merged mappings the first wins, a long key (a distinct string) as a short one
        (
            "d: &d {threshold_seconds: 1}\no: &o {threshold_seconds: 2}\ny: {<<: [*d, *o]}\n",
            {"threshold_seconds": 1},
        ),
    ],
)
def test_a_merge_of_a_merged_mapping_takes_its_overrides(doc: str, want: dict[str, int]) -> None:
    from gpuslo.core.yamlfile import parse_text

    assert parse_text(doc, "f", ValueError)["y"] == want

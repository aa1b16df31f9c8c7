"""The small things written once (issue 13 item 6): the plausible range of a catalogued field
(gpuslo/wire/fields.py ``Field.plausible``), exponential backoff (gpuslo/core/backoff.py), a file
replaced whole (gpuslo/core/fileio.py ``replace_file``) and a YAML file read into a model with
every error named (gpuslo/core/yamlfile.py ``load_model``)."""

from __future__ import annotations

import errno
import math
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gpuslo.core import fileio, settings
from gpuslo.core.backoff import Backoff
from gpuslo.core.fileio import replace_file
from gpuslo.core.yamlfile import load_model
from gpuslo.rules import config
from gpuslo.wire.fields import FIELDS
from gpuslo.wire.models import GpuSample

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- plausible range
@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_plausible_is_the_closed_range_and_the_wire_agrees(f: Any) -> None:
    assert math.isfinite(f.lo) and math.isfinite(f.hi) and f.lo < f.hi  # so NaN and inf fail
    inside = (f.lo, f.hi, (f.lo + f.hi) / 2)
    outside = (math.nextafter(f.lo, -math.inf), math.nextafter(f.hi, math.inf), math.nan, math.inf, -math.inf)
    assert [f.plausible(v) for v in inside] == [True] * 3
    assert [f.plausible(v) for v in outside] == [False] * 5
    for v in inside:
        GpuSample(index=0, uuid="GPU-0", fields={f.name: v})
    for v in outside:
        with pytest.raises(ValidationError, match="outside plausible range"):
            GpuSample(index=0, uuid="GPU-0", fields={f.name: v})


# ----------------------------------------------------------------------------- backoff
def test_backoff_doubles_from_initial_to_the_cap_and_resets() -> None:
    b = Backoff(0.5, 30.0)
    assert not b.failing and b.delay_s == 0.0
    assert [b.fail() for _ in range(9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert b.failing
    b.reset()
    assert not b.failing
    assert [b.fail(), b.fail()] == [0.5, 1.0]  # no jitter: the same every time


def test_backoff_never_waits_longer_than_the_cap() -> None:
    b = Backoff(10.0, 3.0)  # an initial delay above the cap is capped too
    assert [b.fail(), b.fail()] == [3.0, 3.0]


@pytest.mark.parametrize(("initial", "cap"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (math.nan, 1.0)])
def test_backoff_refuses_delays_that_would_spin(initial: float, cap: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        Backoff(initial, cap)


# ----------------------------------------------------------------------------- replace_file
def test_replace_file_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    replace_file(p, b"one")
    replace_file(p, b"two")
    assert p.read_bytes() == b"two"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]


def test_a_write_failing_midway_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "state.json"
    p.write_bytes(b"old content")
    real_write = os.write

    def short_then_full(fd: int, data: Any) -> int:  # a disk with a few blocks left
        if len(data) > 3:
            return real_write(fd, bytes(data[:3]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "write", short_then_full)
    with pytest.raises(OSError, match="No space"):
        replace_file(p, b"new content, longer", durable=True)
    assert p.read_bytes() == b"old content"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]


def test_a_crash_before_the_rename_leaves_the_old_file(tmp_path: Path) -> None:
    """A real process killed (os._exit, no cleanup) after writing the temporary, before the
    rename: the old file is whole; the next replace overwrites the temporary it left."""
    p = tmp_path / "state.json"
    p.write_bytes(b"old")
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from gpuslo.core import fileio\n"
        "fileio.os.replace = lambda *a: os._exit(9)\n"
        "fileio.replace_file(Path(sys.argv[1]), b'new' * 1000, durable=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(p)], cwd=ROOT, capture_output=True, timeout=60, check=False
    )
    assert out.returncode == 9, out.stderr
    assert p.read_bytes() == b"old"
    assert (tmp_path / "state.json.tmp").read_bytes() == b"new" * 1000  # it died with the copy written
    replace_file(p, b"after")
    assert p.read_bytes() == b"after"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]


def test_durable_fsyncs_the_file_before_and_the_directory_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "outbox.jsonl"
    p.write_bytes(b"old")
    seen: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        seen.append("dir" if stat.S_ISDIR(st.st_mode) else f"file:{st.st_size}")
        real_fsync(fd)

    def replace(a: Any, b: Any) -> None:
        seen.append("rename")
        real_replace(a, b)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    monkeypatch.setattr(fileio.os, "replace", replace)
    replace_file(p, b"12345", durable=True)
    assert seen == ["file:5", "rename", "dir"]
    seen.clear()
    replace_file(p, b"x")  # not durable: the rename only (the agent's state files)
    assert seen == ["rename"]


def test_mode_is_set_even_on_a_temporary_left_with_another(tmp_path: Path) -> None:
    p = tmp_path / "outbox.jsonl"
    (tmp_path / "outbox.jsonl.tmp").write_bytes(b"left by an older version")
    os.chmod(tmp_path / "outbox.jsonl.tmp", 0o644)
    replace_file(p, b"new", mode=0o600)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert p.read_bytes() == b"new"


def test_a_full_disk_a_read_only_one_and_a_directory_in_the_way_leave_the_old_state(tmp_path: Path) -> None:
    """Real faults: a tmpfs with too few blocks left (ENOSPC part way), the same mounted
    read-only (EROFS), and the path a directory: OSError each time, the old content and no
    temporary left."""
    from tests.fs import tmpfs

    with tmpfs(tmp_path / "small", "64k") as d:
        p = d / "state.json"
        replace_file(p, b"old")
        with pytest.raises(OSError) as ei:
            replace_file(p, b"x" * 2**20, durable=True)
        assert ei.value.errno == errno.ENOSPC
        assert p.read_bytes() == b"old" and sorted(x.name for x in d.iterdir()) == ["state.json"]
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as d, pytest.raises(OSError) as ei:
        replace_file(d / "state.json", b"new")
    assert ei.value.errno == errno.EROFS
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "dir.json" / "inside").write_bytes(b"kept")
    with pytest.raises(OSError):
        replace_file(tmp_path / "dir.json", b"new")
    assert (tmp_path / "dir.json" / "inside").read_bytes() == b"kept"
    assert not (tmp_path / "dir.json.tmp").exists()


def test_a_temporary_that_is_a_link_is_replaced_not_followed(tmp_path: Path) -> None:
    """Someone who may write the directory links ``<name>.tmp`` to another file: the link is
    what goes, the file it names is neither truncated nor written."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    p = tmp_path / "state.json"
    (tmp_path / "state.json.tmp").symlink_to(victim)
    replace_file(p, b"new")
    assert victim.read_bytes() == b"precious"
    assert p.read_bytes() == b"new" and not p.is_symlink()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json", "victim"]


# ----------------------------------------------------------------------------- YAML into a model
def test_load_model_names_the_file_and_every_bad_key(tmp_path: Path) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text("idle_threshold: 7\nnope: 1\n")
    with pytest.raises(config.ConfigError) as e:
        load_model(p, config.RulesConfig, config.ConfigError)
    lines = str(e.value).splitlines()
    assert len(lines) == 2
    assert all(line.startswith(f"{p}: ") for line in lines)
    assert {line.split(": ")[1] for line in lines} == {"idle_threshold", "nope"}


@pytest.mark.parametrize("text", ["", "# only a comment\n", "null\n"])
def test_an_empty_file_is_the_defaults(tmp_path: Path, text: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    assert settings.load(p) == settings.ServiceConfig()
    assert config.load(p) == config.RulesConfig()


@pytest.mark.parametrize("text", ["[]\n", "0\n", "''\n", "- a\n"])
def test_a_document_that_is_not_a_mapping_is_an_error_not_the_defaults(tmp_path: Path, text: str) -> None:
    # (the service config took a falsy document, ``[]`` or ``0``, for the defaults before)
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(settings.SettingsError, match=f"^{p}: <root>: "):
        settings.load(p)
    with pytest.raises(config.ConfigError, match=f"^{p}: <root>: "):
        config.load(p)


# YAML 1.2's core schema (spec 1.2.2, 10.3.2), plus the YAML 1.1 forms PyYAML read as numbers
_YAML_12 = [
    ("0", 0),
    ("0o7", 7),
    ("0x3A", 58),
    ("-19", -19),
    ("+12", 12),
    ("0.", 0.0),
    ("-0.0", -0.0),
    (".5", 0.5),
    ("+12e03", 12000.0),
    ("-2E+05", -200000.0),
    ("1e3", 1000.0),
    ("010", 10),
    ("0777", 777),
    ("08", 8),
    ("0600", 600),  # decimal: YAML 1.1 read 8, 511 and 384
    ("1:30", "1:30"),
    ("12:30:00", "12:30:00"),  # text: YAML 1.1 read base 60 (90, 45000)
    ("0b101", "0b101"),
    ("1_000", "1_000"),
    ("1_0.5", "1_0.5"),
    ("2026-12-07", "2026-12-07"),
    ("0o8", "0o8"),
    ("-0x1", "-0x1"),
    ("1e", "1e"),
    ("1.2.3", "1.2.3"),
    (".", "."),
    ("+", "+"),
    ("'010'", "010"),
    ("!!int 1_000", 1000),
    ("!!float 1", 1.0),
]


@pytest.mark.parametrize(("text", "value"), _YAML_12, ids=[t for t, _ in _YAML_12])
def test_a_plain_scalar_is_a_number_as_yaml_1_2_says(text: str, value: Any) -> None:
    from gpuslo.core.yamlfile import parse_text

    got = parse_text(f"a: {text}\n", "<t>", ValueError)["a"]
    assert got == value and type(got) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, got) == math.copysign(1, value)  # -0.0 keeps its sign


@pytest.mark.parametrize("text", [".inf", ".Inf", "+.INF", "-.inf", "-.Inf", "-.INF", ".nan", ".NaN", ".NAN"])
def test_infinities_and_nan_in_every_spelling(text: str) -> None:
    from gpuslo.core.yamlfile import parse_text

    got = parse_text(f"a: {text}\n", "<t>", ValueError)["a"]
    want = float(text.lower().lstrip("+").replace(".", ""))
    assert math.isnan(got) if math.isnan(want) else got == want


def test_every_number_python_writes_reads_back_as_itself() -> None:
    """A sweep of the dimension: integers (with leading zeros too) and floats as ``repr`` writes
    them (exponents with and without a sign, subnormals, the largest), each read as itself."""
    import random

    from gpuslo.core.yamlfile import parse_text

    rnd = random.Random(35)
    ints = [0, 1, -1, 7, 8, 9, 10, 59, 60, 511, 2**63, -(2**63)] + [
        rnd.randrange(-(10**12), 10**12) for _ in range(300)
    ]
    for n in ints:
        assert parse_text(f"a: {n}\n", "<t>", ValueError)["a"] == n
        if n >= 0:
            assert parse_text(f"a: {n:012d}\n", "<t>", ValueError)["a"] == n  # leading zeros: decimal
    floats = [0.1, 1e16, 1e-7, 5e-324, 1.7976931348623157e308, -2.5e-3]
    floats += [rnd.uniform(-1e6, 1e6) for _ in range(200)] + [rnd.lognormvariate(0, 60) for _ in range(200)]
    for x in floats:
        got = parse_text(f"a: {x!r}\n", "<t>", ValueError)["a"]
        assert type(got) is float and got == x, (x, got)


def test_a_number_that_yaml_1_1_misread_reaches_the_config_as_written(tmp_path: Path) -> None:
    """``threshold_s: 0600`` was 384 s (octal), ``1:30`` 90 (base 60); a name ``12:30`` was
    45000, refused as "not a valid string". Now 600, a refusal naming the key, and the name."""
    p = tmp_path / "rules.yaml"
    p.write_text("starvation:\n  threshold_s: 0600\n  queue_threshold_s: {debug: 010, 12:30: 60}\n")
    cfg = load_model(p, config.RulesConfig, config.ConfigError)
    assert cfg.starvation.threshold_s == 600 and cfg.starvation.queue_threshold_s == {
        "debug": 10,
        "12:30": 60,
    }
    p.write_text("starvation:\n  threshold_s: 1:30\n")
    with pytest.raises(config.ConfigError, match=r"starvation\.threshold_s: .*number"):
        load_model(p, config.RulesConfig, config.ConfigError)
    s = tmp_path / "service.yaml"
    s.write_text("ingest:\n  commit_interval_s: 010\n")
    assert settings.load(s).ingest.commit_interval_s == 10.0  # was 8.0


def test_a_hand_written_tag_that_is_no_number_is_a_message() -> None:
    from gpuslo.core.yamlfile import parse_text

    for text, why in (("!!int xx", "'xx' is not an integer"), ("!!float abc", "'abc' is not a number")):
        with pytest.raises(ValueError, match=f"^<t>: not valid YAML: {why}"):
            parse_text(f"a: {text}\n", "<t>", ValueError)


# a value the file holds that is no number, boolean or name as written: each one a message
# naming the file (a traceback, or a value other than the one written, before)
_HOSTILE_SCALARS = [
    ("1" * 100_000, "is an integer of more than 4,300 digits"),  # int() refused it as "not an integer"
    ("-" + "9" * 4301, "is an integer of more than 4,300 digits"),
    ("0x" + "F" * 5000, "is an integer of more than 4,300 digits"),  # was read: str() of it failed later
    ("1e99999", "out of a number's range"),  # was inf
    ("-1e400", "out of a number's range"),
    ("1e-99999", "out of a number's range"),  # was 0.0
    ("!!int ١٢", "is not an integer"),  # int() read Arabic-Indic digits: 12
    ("!!float ١٢", "is not a number"),
    ("!!int ' 12 '", "is not an integer"),
    ('!!int "12\\n"', "is not an integer"),
    ("!!float infinity", "is not a number"),
    ("!!float nan", "is not a number"),
    ("!!bool maybe", "is not a boolean"),  # a KeyError traceback
    ('!!bool ""', "is not a boolean"),
    ("!!bool yes", "is not a boolean"),  # YAML 1.1's word
    ("!!null x", "is not null"),  # was None: the x dropped
    ("!!timestamp xyz", "could not determine a constructor"),  # an AttributeError traceback
    ("!!timestamp 2026-13-45", "could not determine a constructor"),  # a ValueError traceback
    ("!!timestamp 2026-12-07", "could not determine a constructor"),
    ("!!binary '***'", "could not determine a constructor"),  # was b'' silently
    ("!!set {a}", "could not determine a constructor"),
    ("!!omap [a: 1]", "could not determine a constructor"),
    ("!!pairs [a: 1]", "could not determine a constructor"),
    ("!!python/tuple [1]", "could not determine a constructor"),
    ("!!python/object/apply:os.system [true]", "could not determine a constructor"),
]


@pytest.mark.parametrize(("text", "why"), _HOSTILE_SCALARS, ids=[t[:30] for t, _ in _HOSTILE_SCALARS])
def test_a_hostile_scalar_is_a_message_naming_the_file(tmp_path: Path, text: str, why: str) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text(f"starvation:\n  threshold_s: {text}\n")
    with pytest.raises(config.ConfigError) as info:
        load_model(p, config.RulesConfig, config.ConfigError)
    message = str(info.value)
    assert message.startswith(f"{p}: not valid YAML: ") and why in message, message
    assert len(message) < 400  # the value is quoted short, never whole


@pytest.mark.parametrize("text", ["0", "-0", "0x1F", "0o17", "010", "1e3", "-2E+05", "5e-324", "1_000"])
def test_every_form_yaml_1_2_gives_a_number_still_reads(text: str) -> None:
    """The refusals above take nothing YAML 1.2 reads as a number (``!!`` forms included)."""
    from gpuslo.core.yamlfile import parse_text

    plain = parse_text(f"a: {text}\n", "<t>", ValueError)["a"]
    assert isinstance(plain, int | float) == (text != "1_000")  # 1_000 is text in YAML 1.2
    tag = "!!int" if isinstance(plain, int) or text == "1_000" else "!!float"
    assert parse_text(f"a: {tag} {text}\n", "<t>", ValueError)["a"] == (1000 if text == "1_000" else plain)


def test_a_number_or_boolean_key_is_the_name_written(tmp_path: Path) -> None:
    """A Slurm partition named ``2024`` or ``0600`` is that name: as a number key it was refused
    as "not a valid string" naming ``600`` (not the ``0600`` written), and ``010`` and ``10``
    were one key; an anchored number used as a value stays a number."""
    from gpuslo.core.yamlfile import parse_text

    p = tmp_path / "rules.yaml"
    p.write_text("starvation:\n  queue_threshold_s: {2024: 60, 0600: 120, 010: 1, 10: 2, 1e3: 3, true: 4}\n")
    cfg = load_model(p, config.RulesConfig, config.ConfigError)
    assert cfg.starvation.queue_threshold_s == {
        "2024": 60,
        "0600": 120,
        "010": 1,
        "10": 2,
        "1e3": 3,
        "true": 4,
    }
    assert parse_text("a: {&k 0x1F: 1}\nb: *k\n", "<t>", ValueError) == {"a": {"0x1F": 1}, "b": 31}


def test_a_number_key_written_twice_as_text_is_refused() -> None:
    from gpuslo.core.yamlfile import parse_text

    with pytest.raises(ValueError, match="found the key '1' twice"):
        parse_text("c: {'1': 1, 1: 2}\n", "<t>", ValueError)


def test_a_number_where_a_name_goes_says_to_quote_it(tmp_path: Path) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text("match:\n  queue: [gpu, 0600]\n")
    with pytest.raises(
        config.ConfigError,
        match=r"^\S+: match\.queue\.1: Input should be a valid string \(unquoted digits are a number in YAML: quote",
    ):
        load_model(p, config.RulesConfig, config.ConfigError)


@pytest.mark.parametrize("version", ["1.1"])
def test_a_yaml_1_1_document_is_refused_not_read_as_1_2(tmp_path: Path, version: str) -> None:
    """``%YAML 1.1`` says ``0600`` is octal 384: reading it as 600 was a number other than the
    one the author meant, without a word."""
    p = tmp_path / "rules.yaml"
    p.write_text(f"%YAML {version}\n---\nstarvation:\n  threshold_s: 0600\n")
    with pytest.raises(config.ConfigError, match=rf"^{p}: the document says %YAML {version}; .*YAML 1\.2"):
        load_model(p, config.RulesConfig, config.ConfigError)
    p.write_text("%YAML 1.2\n---\nstarvation:\n  threshold_s: 0600\n")
    assert load_model(p, config.RulesConfig, config.ConfigError).starvation.threshold_s == 600


def test_files_are_replaced_whole_only_through_replace_file() -> None:
    """The class, not the four copies: no other ``os.replace`` in the code but the one in
    core/fileio.py and the claim of the pre-release outbox (a rename of a file as it is)."""
    import ast

    allowed = {ROOT / "gpuslo/core/fileio.py", ROOT / "rules/alerts.py"}
    files = {
        p.resolve()
        for d in ("agent", "ingest", "rules", "dashboards", "gpuslo")
        for p in (ROOT / d).rglob("*.py")
    }
    found = set()
    for p in sorted(files - allowed):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            f = n.func if isinstance(n, ast.Call) else None
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "replace"
                and isinstance(f.value, ast.Name)
                and f.value.id == "os"
            ):
                found.add(f"{p.relative_to(ROOT)}:{n.lineno}")
    assert {p.relative_to(ROOT).as_posix() for p in files} >= {
        "agent/kueue.py",
        "rules/outbox.py",
        "agent/spool.py",
    }
    assert found == set()

"""``prometheus_selector``'s matchers are checked at config load as Prometheus reads them, with the
real ``promtool`` (Prometheus 2.42, Go's ``regexp``) as the oracle: every text the config takes
loads in Prometheus, and every text Prometheus refuses the config refuses too, over a hand-made
corpus of Go's syntax edges and a seeded sweep of random texts from its tokens.

Before: the config checked the matchers' grammar only, so a regex Python's ``re`` takes and Go's
refuses (``(?=x)``, ``\\1``, ``\\Z``), a ``__name__`` matcher or a ``\\ud800`` escape made an
exported rules file Prometheus refused whole (every SLO's alerts gone, not just this one's)."""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuslo.rules.promql_regex import UNICODE_CLASSES, selector_problem
from tests.test_prometheus_export import promtool

# regex texts on Go's edges (each written raw, in back quotes: the regex is the text)
CORPUS = [
    "", "a", "(?=x)", "(?!x)", "(?<=x)", "(?<!x)", "a\\1", "(?P<n>a)(?P=n)", "x\\Z", "(?>a)", "a*+", "a{1001}",
    "(?x)a b", "\\u00e9", "(?i)a", "(?U)a*", "[[:alpha:]]", "\\pL", "a{,3}", "\\0", "(?a)x", "\\N{DASH}",
    "(?<name>a)", "x**", "\\z", "\\Q.\\E", "(?s:.)", "\\cA", "(?P<1a>x)", "a)|(b", "((a{1000}){1000})",
    "(a{100}){11}", "(a{1000}){2}", "(?:(?:(?:a{10}){10}){10}){2}", "(?:(?:(?:a{10}){10}){10})", "a{1000}b{1000}",
    "\\p{Greek}", "\\p{greek}", "\\p{Zanabazar_Square}", "\\p{Yezidi}", "\\p{Vithkuqi}", "\\p{Lc}", "\\p{LC}",
    "\\p{L&}", "\\p{^L}", "\\pN", "\\pZ", "\\p{Any}", "\\p{Assigned}", "\\p{ASCII}", "[[:word:]]", "[[:foo:]]",
    "[a-\\d]", "[]a]", "[^]", "[^]a]", "[]", "x{2}{3}", "x{2}*", "x*?", "x??", "x+?+", "x*??", "(?i-)x", "(?-)x",
    "(?)x", "(?i-i:x)", "[\\b]", "\\8", "\\18", "\\17", "\\177", "\\400", "\\x{110000}", "\\x{10FFFF}", "\\x{}",
    "\\xg0", "\\x4", "\\x41", "(?P<a>x)(?P<a>y)", "()", "(|)", "|", "^*", "$+", "\\b*", "(?i)*", "a(?i)*",
    "\\Qabc", "\\Qa)b\\E", "a\\\\", "a\\", "(?:a", "[[:^alpha:]]", "[[:alpha:]", "[a-]", "[-a]", "[a-b-c]",
    "[\\d-z]", "[\\pL-z]", "[[:alpha:]-z]", "x{1001,}", "x{0,1001}", "x{2,1}", "x{01}", "x{1,01}", "x{99999999999}",
    "x{1000,}", "\\pLx", "\\p", "\\p{", "\\p{}", "\\p{^}", "\\P{^Greek}", "\\_", "\\é", "\\ ", "\\-",
    "(?i)(?m)(?s)(?U)x", "(?imsU-imsU:x)", "(?--i)x", "(?i-m-s)x", "[\\Q]\\E]", "[\\x{41}-\\x{5a}]", "[z-a]",
    "[\\x{5a}-\\x{41}]", "(?P<é>x)", "(?P<>x)", "(?P<a", "(?P<", "(?P=a)", "(?#c)", "(a{600}){0}",
    "(a{600}){2,}", "(a{600}){1,}", "(a{600}){0,1}", "[\\p{L}]{1000}", "(?i)[\\p{L}]{1000}", "\\C", "\\A\\b\\B",
    "{", "{1}", "a{1", "a{1,", "a{1,2", "a{}", "}", "]", "[", "(", ")", "*", "a||b", "(*)", "(|*)", "\\Q\\E*",
    "é+", "日本{2}", "[é-ë]", "\\x{1F600}", "(?P<a_1>x)", ".*", "[^\\n]", "[\\n-\\r]", "\\t\\v\\f\\a\\r",
    "\\e", "\\g", "\\k<a>", "\\R", "\\h", "\\X", "\\G", "\\K", "\\o{12}", "\\+\\?\\.", "\\#\\%\\@\\:", "\\=", "\\<",
    "\\s\\S\\w\\W\\d\\D",
]  # fmt: skip

# string literals of other quotes: PromQL's own escapes (bytes, code points) before the regex
LITERALS = [
    r'"\xff"', r'"\377"', r'"\303\251"', r'"\xc3\xa9"', r'"\ud800"', r'"\U0000d800"', r'"\U0010FFFF"',
    r'"\u00e9+"', r'"\x41{2}"', r"'\''", r'"\x00"', r'"\000"', r'"a\nb"', r'"\\"', r'"\\d+"', r'"\\1"',
    r'"\\\\"', r"'\\Z'", r'"\"(?=\""', r'"\xe6\x97\xa5"', r'"\xe6\x97"',
]  # fmt: skip

_TOKENS = [
    "a", "b", "é", ".", "^", "$", "|", "(", ")", "(?:", "(?i)", "(?i:", "(?P<n>", "(?P<m>", "(?=", "(?<", "(?#",
    "*", "+", "?", "*?", "{2}", "{2,}", "{1,3}", "{3,1}", "{1001}", "{,3}", "{", "}", "[", "]", "[^", "-", ":",
    "[:alpha:]", "[:nope:]", "\\", "\\d", "\\b", "\\B", "\\Q", "\\E", "\\z", "\\Z", "\\A", "\\pL", "\\p{Greek}",
    "\\p{greek}", "\\x41", "\\x{41}", "\\x4", "\\1", "\\0", "\\07", "\\n", "\\.", "\\_", "\\é", "\\C", "(a{40})",
    "[a-z]", "[\\d", "[[:^word:]", "[\\pL", "\\P{^Han}", "-]", "[]", "[^]", "[\\]]", "\\Q]", "(?-s:", "(?i-", "\\x{",
    "{0}", "{1000}", "(?:a{40}){30}", "\\377", "\\400", "[é-a]", "$*", "\\pN{2}",
]  # fmt: skip


def _sweep(n: int, seed: int = 20261206) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "".join(rng.choice(_TOKENS) for _ in range(rng.randint(1, 8)))
        if "`" not in text:
            out.append(text)
    return out


def _refused_by_promtool(tmp_path: Path, literals: list[str]) -> set[int]:
    """The indexes of ``literals`` whose matcher ``foo{a=~LIT}`` promtool refuses (one run)."""
    rules = [{"record": f"r{i}", "expr": f"foo{{a=~{lit}}}"} for i, lit in enumerate(literals)]
    p = tmp_path / "rules.yaml"
    p.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": rules}]}, allow_unicode=True), encoding="utf-8"
    )
    r = subprocess.run([promtool(), "check", "rules", str(p)], capture_output=True, check=False)
    out = (r.stdout + r.stderr).decode("utf-8", "backslashreplace")
    refused = {int(m) - 1 for m in re.findall(r'group "g", rule (\d+), "r\d+"', out)}
    assert r.returncode == (1 if refused else 0), out[-2000:]
    assert refused or "SUCCESS" in out, out[-2000:]
    return refused


def _differences(tmp_path: Path, literals: list[str]) -> list[str]:
    refused = _refused_by_promtool(tmp_path, literals)
    wrong = []
    for i, lit in enumerate(literals):
        ours = selector_problem(f"a=~{lit}")
        if (ours is not None) != (i in refused):
            wrong.append(
                f"{lit}: promtool {'refuses' if i in refused else 'takes'} it, gpuslo: {ours or 'takes it'}"
            )
    return wrong


def test_the_check_agrees_with_promtool_on_go_syntax_edges(tmp_path: Path) -> None:
    literals = [f"`{t}`" for t in CORPUS] + LITERALS
    assert _differences(tmp_path, literals) == []


def test_the_check_agrees_with_promtool_on_a_sweep_of_random_texts(tmp_path: Path) -> None:
    literals = [f"`{t}`" for t in _sweep(3000)]
    refused = _refused_by_promtool(tmp_path, literals)
    assert 0.2 * len(literals) < len(refused) < 0.9 * len(literals)  # the sweep reaches both sides
    assert _differences(tmp_path, literals) == []


def test_every_unicode_class_name_it_takes_is_one_prometheus_knows(tmp_path: Path) -> None:
    """The names are written out (Python has no script table): each one must load in Prometheus,
    and a name spelt in other case, which only newer Go versions take, is refused."""
    names = sorted(UNICODE_CLASSES)
    assert _refused_by_promtool(tmp_path, [f"`\\p{{{n}}}`" for n in names]) == set()
    assert all(selector_problem(f"a=~`\\p{{{n.lower()}}}`") for n in names if n != n.lower())


@pytest.mark.parametrize(
    ("selector", "says"),
    [
        ('route=~"/v1/(?!health).*"', "Perl syntax"),  # a lookahead: Python's re takes it
        ('route=~"a\\\\1"', "invalid escape"),  # a backreference
        ('route=~"x\\\\Z"', "invalid escape"),
        ('model="a", route=~"(?<v>x)"', "Perl syntax"),  # Go before 1.22
        ('route=~"\\xff"', "UTF-8"),  # PromQL's \x is a byte
        ('model="\\ud800"', "code point"),  # a surrogate: a parse error, whatever the operator
        ('__name__="other"', "__name__"),  # the metric named twice: a parse error
        ('le="0.5"', "le"),  # the rules choose the bucket themselves
    ],
)
def test_a_selector_prometheus_refuses_is_refused_at_load(tmp_path: Path, selector: str, says: str) -> None:
    from gpuslo.rules.config import ConfigError, load

    p = tmp_path / "rules.yaml"
    slo = {"name": "s", "service": "svc", "threshold_ms": 5, "prometheus_selector": selector}
    p.write_text(yaml.safe_dump({"slos": [slo]}), encoding="utf-8")
    with pytest.raises(ConfigError, match="prometheus_selector") as e:
        load(p)
    assert says in str(e.value)


def test_a_selector_of_go_syntax_exports_rules_promtool_takes(tmp_path: Path) -> None:
    """What Go takes and Python's ``re`` refuses (a capture name starting with a digit, ``\\z``,
    POSIX classes, ``\\pL``) is taken, and the exported rules load."""
    from gpuslo.rules.config import RulesConfig, Slo
    from gpuslo.rules.prometheus import render

    sel = 'route=~"(?P<1v>/v1)[[:alpha:]]+\\\\z", model!~`\\pL{2,}`, zone!="a"'
    slo = Slo.model_validate({"name": "s", "service": "svc", "threshold_ms": 5, "prometheus_selector": sel})
    (tmp_path / "rules.yaml").write_text(render(RulesConfig(slos=(slo,))), encoding="utf-8")
    r = subprocess.run([promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_deep_or_long_texts_are_judged_without_a_traceback() -> None:
    """Nesting past what any Go version takes is refused by name; a long flat text is taken."""
    assert "nests too deeply" in (selector_problem(f"a=~`{'(' * 2000}a{')' * 2000}`") or "")
    assert "nests too deeply" in (
        selector_problem(f"a=~`{'(a*)' * 1 + '(' * 400 + 'a*' + ')*' * 400}`") or ""
    )
    assert selector_problem(f"a=~`{'a|' * 20000}b`") is None

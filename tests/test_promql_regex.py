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
    # escaped as the exported file is (written raw, U+0085 and U+2028 would be YAML line breaks)
    p.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": rules}]}, width=200), encoding="utf-8")
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
    """Unbalanced nesting is refused by name; a long flat text is taken."""
    assert "missing closing )" in (selector_problem(f"a=~`{'(' * 50_000}a`") or "")
    assert "nests too deeply" in (selector_problem(f"a=~`{'(' * 2000}a{')' * 2000}`") or "")
    assert selector_problem(f"a=~`{'a|' * 20000}b`") is None
    assert selector_problem(f"a=~`{'(?:' * 20000}a{')' * 20000}`") is None  # Go merges them: flat


def _chain(n: int, cls: str = "a") -> str:
    """``ab|aab|aaab|…``: Go factors the common prefixes out, one level deeper for each."""
    return "|".join(cls * i + "b" for i in range(1, n + 1))


# texts on either side of Go's limits on the tree it parses: its height (1000 levels: captures,
# alternations, concatenations, repeats, and what factoring the alternatives adds), its size
# (the instructions it compiles to: each {n} copies its operand) and its runes (each \pL is a table)
LIMITS = [
    "(a|bc" * 330 + ")" * 330, "(a|bc" * 340 + ")" * 340,  # 3 levels each: refused past 333
    "(?:a|bc" * 498 + ")" * 498, "(bc" * 498 + ")" * 498, "(?:bc" * 498 + ")*" * 498,
    "(a*)" + "(" * 498 + "a*" + ")*" * 498, "(a*)" + "(" * 499 + "a*" + ")*" * 499,
    _chain(400), _chain(520), _chain(400, "[ab]"), f"({_chain(500)})", "(?i)" + _chain(520).upper(),
    "(?:" + "a" * 3000 + "){1000}", "(?:" + "a" * 3400 + "){1000}",  # size: 3,355,443 at most
    "(?:x{1000})" * 3000, "(?:x{1000})" * 3400, "[a-z]{1000}" * 3000, "(?:ab){500}" * 3400,
    "\\pL" * 30_000, "[\\pL]" * 30_000, "(?i)" + "\\pL" * 1600,  # runes: 33,554,432 at most
]  # fmt: skip


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_gos_limits_on_the_parsed_tree_agree_with_promtool(tmp_path: Path) -> None:
    """Before: the check counted groups and repeats (at most 500) and knew no size: a text Go
    refuses whole (``(a|bc(a|bc(…)))`` 340 deep, a long alternation of common prefixes, a 3,400
    character literal repeated 1000 times) was taken, and the exported rules file refused."""
    assert _differences(tmp_path, [f"`{t}`" for t in LIMITS]) == []


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_deep_random_texts_promtool_refuses_are_refused(tmp_path: Path) -> None:
    """Past a few hundred levels the check is an upper bound of Go's tree (it may refuse a text
    Go takes, never take one Go refuses): nestings of every kind of group, alternation and repeat
    on both sides of 1000 levels."""
    rng = random.Random(20261207)
    opens = [
        "(",
        "(?:",
        "(?i:",
        "(?P<x>",
        "(a|",
        "(?:a|",
        "(ab|ac|",
        "(?:x|xy|",
        "a(",
        "(?:[ab]|[ab]c|",
        "(\\pL|",
    ]
    closes = [")", ")*", ")+", ")?", "|b)", ")c", "|)", "){0,1}", "){1}", ")"]
    texts = []
    for _ in range(300):
        n = rng.randint(250, 700)
        pairs = [(rng.choice(opens), rng.choice(closes)) for _ in range(n)]
        texts.append("".join(o for o, _ in pairs) + "z" + "".join(c for _, c in reversed(pairs)))
    refused = _refused_by_promtool(tmp_path, [f"`{t}`" for t in texts])
    assert 0 < len(refused) < len(texts)
    taken = [texts[i][:80] for i in sorted(refused) if selector_problem(f"a=~`{texts[i]}`") is None]
    assert taken == []


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_no_unicode_class_holds_more_runes_than_the_check_counts(tmp_path: Path) -> None:
    """The check counts each Unicode class as CLASS_RUNES runes; as many of any one class, negated
    or case-folded, as that allows must load (Go refuses past MAX_RUNES)."""
    from gpuslo.rules.promql_regex import CLASS_RUNES, MAX_RUNES

    n = MAX_RUNES // CLASS_RUNES
    texts = [
        t for name in sorted(UNICODE_CLASSES) for t in (f"(?i)\\p{{{name}}}" * n, f"(?i)\\P{{{name}}}" * n)
    ]
    assert all(selector_problem(f"a=~`{t}`") is None for t in texts)
    assert _refused_by_promtool(tmp_path, [f"`{t}`" for t in texts]) == set()


_SPACES = [
    " ",
    "\t",
    "\n",
    "\r",
    "\v",
    "\f",
    "\x1c",
    "\x85",
    "\xa0",
    "\u1680",
    "\u2000",
    "\u2028",
    "\u3000",
    "\ufeff",
]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_white_space_and_replacement_characters_in_a_selector_agree_with_promtool(tmp_path: Path) -> None:
    """PromQL skips only space, tab, newline and carriage return; Python's ``\\s`` (the config's
    grammar) took U+00A0, U+2028, \\v… around the matchers, and a selector of only such was taken
    as empty, each one an exported file Prometheus refused. A U+FFFD written as itself is refused
    by PromQL's lexer (it is what Go's decoder says for invalid UTF-8), in any quotes."""
    from gpuslo.rules.config import RulesConfig, Slo
    from gpuslo.rules.prometheus import render

    sels = [
        sel
        for w in _SPACES
        for sel in (f'{w}a="b"', f'a{w}="b"', f'a={w}"b"', f'a="b"{w}', f'a="b",{w}c="d"', f'a="b"{w},c="d"',
                    f'a="b",{w}', w, f'a="{w}"' if w != "\n" else 'a="\\n"', f"a=`{w}`")
    ] + ['a="\ufffd"', "a='x\ufffd'", 'a=~`\ufffd+`', 'a="\\ufffd"', 'a=~`\\x{fffd}`', 'a=~"\\xef\\xbf\\xbd"']  # fmt: skip
    rules = [{"record": f"r{i}", "expr": f'x_bucket{{le="1",{sel}}}'} for i, sel in enumerate(sels)]
    p = tmp_path / "sel.yaml"
    p.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": rules}]}, width=200), encoding="utf-8")
    r = subprocess.run([promtool(), "check", "rules", str(p)], capture_output=True, text=True, check=False)
    refused = {int(m) - 1 for m in re.findall(r'group "g", rule (\d+), "r\d+"', r.stdout + r.stderr)}
    assert 0 < len(refused) < len(sels)
    taken: list[Slo] = []
    wrong = []
    for i, sel in enumerate(sels):
        slo = {"name": f"s{i}", "service": "svc", "threshold_ms": 5, "prometheus_selector": sel}
        try:
            taken.append(Slo.model_validate(slo))
            ours = "takes"
        except ValueError:
            ours = "refuses"
        if (ours == "refuses") != (i in refused):
            wrong.append(f"{sel!r}: promtool {'refuses' if i in refused else 'takes'}, gpuslo {ours}")
    assert wrong == []
    (tmp_path / "rules.yaml").write_text(render(RulesConfig(slos=tuple(taken))), encoding="utf-8")
    r = subprocess.run([promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

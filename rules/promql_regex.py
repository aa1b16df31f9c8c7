"""The label matchers of ``prometheus_selector`` as Prometheus reads them, checked at config load.

Prometheus compiles a ``=~``/``!~`` matcher's text with Go's ``regexp`` (RE2's syntax, Perl flags),
alone and anchored as ``^(?:…)$``. The config checked only the matchers' grammar, so a regex Go
refuses (a lookahead, a backreference, ``\\Z``, ``\\u00e9``, ``(?x)``, all of which Python's ``re``
takes), a ``__name__`` matcher or a ``\\ud800`` escape made an exported rules file Prometheus refused
whole: every SLO's alerts, not just the one, were gone until someone read its log.

This module is a checker written from Go's documented syntax, not a regex engine: it walks the text
as Go's parser does and names the first part Go would refuse. Where Prometheus versions differ (Go
1.22 took ``(?<name>…)``; newer ones take ``\\p{…}`` names in any case, and ``\\p{Assigned}``), it
refuses what the oldest supported one (2.42, whose ``promtool`` the tests use as the oracle)
refuses, so the rules load on every version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_REPEAT = 1000  # Go's maxRepeat: a {n,m} count, and the product of nested ones
# Go's limits on the tree it parses (regexp/syntax since Go 1.19.2, so in every supported Prometheus):
MAX_HEIGHT = 1000  # maxHeight: levels of the tree (a capture, an alternation, a concatenation, a repeat)
MAX_SIZE = (128 << 20) // 40  # maxSize: the instructions it would compile to ({n} copies its operand)
MAX_RUNES = (128 << 20) // 4  # maxRunes: the runes of its literals and classes' ranges
# the most runes one class item can add (a Unicode class, or a range case-folded under (?i)): \pL
# is about 1,300 in Go's tables; the test checks every name Prometheus knows against promtool
CLASS_RUNES = 20_000
_SMALL_CLASS_RUNES = 64  # \d \s \w and a POSIX class ([[:punct:]] is 4 ranges)

# the escapes PromQL's lexer takes in a double- or single-quoted string, besides the string's quote
_STRING_ESCAPE = re.compile(
    r"\\(?:([abfnrtv\\'\"])|([0-3][0-7]{2})|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))"
)
# the white space PromQL's lexer skips (its isSpace): Python's \s also takes \v, \f, U+00A0, U+2028…
PROMQL_SPACE_CHARS = " \t\n\r"
PROMQL_SPACE = "[ \t\n\r]"
_C_ESCAPES = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "\\": 92, "'": 39, '"': 34}
_MATCHER = re.compile(
    rf"""{PROMQL_SPACE}*([a-zA-Z_][a-zA-Z0-9_]*){PROMQL_SPACE}*(=~|!~|!=|=){PROMQL_SPACE}*"""
    rf"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`){PROMQL_SPACE}*(,|$)"""
)


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# POSIX classes inside brackets (``[[:alpha:]]``, ``[[:^alpha:]]``)
_POSIX = _words("alnum alpha ascii blank cntrl digit graph lower print punct space upper word xdigit")
# \p{…} names Go's unicode tables hold (Unicode 13, Prometheus 2.42's Go), written exactly so
_CATEGORIES = _words(
    "C Cc Cf Co Cs L Ll Lm Lo Lt Lu M Mc Me Mn N Nd Nl No P Pc Pd Pe Pf Pi Po Ps S Sc Sk Sm So Z Zl Zp Zs Any"
)
_SCRIPTS = _words(
    """Adlam Ahom Anatolian_Hieroglyphs Arabic Armenian Avestan Balinese Bamum Bassa_Vah Batak
    Bengali Bhaiksuki Bopomofo Brahmi Braille Buginese Buhid Canadian_Aboriginal Carian
    Caucasian_Albanian Chakma Cham Cherokee Chorasmian Common Coptic Cuneiform Cypriot Cyrillic
    Deseret Devanagari Dives_Akuru Dogra Duployan Egyptian_Hieroglyphs Elbasan Elymaic Ethiopic
    Georgian Glagolitic Gothic Grantha Greek Gujarati Gunjala_Gondi Gurmukhi Han Hangul
    Hanifi_Rohingya Hanunoo Hatran Hebrew Hiragana Imperial_Aramaic Inherited Inscriptional_Pahlavi
    Inscriptional_Parthian Javanese Kaithi Kannada Katakana Kayah_Li Kharoshthi Khitan_Small_Script
    Khmer Khojki Khudawadi Lao Latin Lepcha Limbu Linear_A Linear_B Lisu Lycian Lydian Mahajani
    Makasar Malayalam Mandaic Manichaean Marchen Masaram_Gondi Medefaidrin Meetei_Mayek
    Mende_Kikakui Meroitic_Cursive Meroitic_Hieroglyphs Miao Modi Mongolian Mro Multani Myanmar
    Nabataean Nandinagari New_Tai_Lue Newa Nko Nushu Nyiakeng_Puachue_Hmong Ogham Ol_Chiki
    Old_Hungarian Old_Italic Old_North_Arabian Old_Permic Old_Persian Old_Sogdian
    Old_South_Arabian Old_Turkic Oriya Osage Osmanya Pahawh_Hmong Palmyrene Pau_Cin_Hau Phags_Pa
    Phoenician Psalter_Pahlavi Rejang Runic Samaritan Saurashtra Sharada Shavian Siddham
    SignWriting Sinhala Sogdian Sora_Sompeng Soyombo Sundanese Syloti_Nagri Syriac Tagalog
    Tagbanwa Tai_Le Tai_Tham Tai_Viet Takri Tamil Tangut Telugu Thaana Thai Tibetan Tifinagh
    Tirhuta Ugaritic Vai Wancho Warang_Citi Yezidi Yi Zanabazar_Square"""
)
UNICODE_CLASSES = _CATEGORIES | _SCRIPTS
_PERL_CLASSES = frozenset("dDsSwW")
_WORD = re.compile(r"[A-Za-z0-9_]+")


class RegexError(ValueError):
    """A regex Go's ``regexp`` refuses; the message names the part, as Go's error does."""


@dataclass(frozen=True, slots=True)
class Matcher:
    name: str
    op: str
    value: bytes  # the string literal's value: PromQL's \x and octal escapes are bytes


def matchers(selector: str) -> list[Matcher]:
    """The matchers of ``name="v", name=~'re', …`` (the caller has checked the grammar), each
    value unquoted as PromQL's lexer does. Raises :class:`RegexError` for an escape naming no code
    point (``\\ud800``: a surrogate), which Prometheus refuses as a parse error."""
    out: list[Matcher] = []
    pos = 0
    text = selector.strip(PROMQL_SPACE_CHARS)
    while pos < len(text):
        m = _MATCHER.match(text, pos)
        if m is None:
            raise RegexError(f"not a label matcher at {text[pos : pos + 40]!r}")
        name, op, lit, _ = m.groups()
        out.append(Matcher(name, op, unquote(lit)))
        pos = m.end()
    return out


def unquote(literal: str) -> bytes:
    """A PromQL string literal's value as bytes: back quotes raw; in ``"…"`` and ``'…'`` the
    escapes of Go's ``strconv.UnquoteChar`` (``\\x`` and octal as one byte each, ``\\u``/``\\U``
    as UTF-8, a surrogate or a code point past U+10FFFF refused)."""
    body = literal[1:-1]
    if literal[0] == "`":
        return body.encode("utf-8", "surrogatepass")
    out = bytearray()
    pos = 0
    for m in _STRING_ESCAPE.finditer(body):
        out += body[pos : m.start()].encode("utf-8", "surrogatepass")
        pos = m.end()
        c, octal, hex2, u4, u8 = m.groups()
        if c is not None:
            out.append(_C_ESCAPES[c])
        elif octal is not None:
            out.append(int(octal, 8))
        elif hex2 is not None:
            out.append(int(hex2, 16))
        else:
            cp = int(u4 or u8, 16)
            if 0xD800 <= cp <= 0xDFFF or cp > 0x10FFFF:
                raise RegexError(f"{m.group(0)!r} is not a Unicode code point (Prometheus: a parse error)")
            out += chr(cp).encode()
    out += body[pos:].encode("utf-8", "surrogatepass")
    return bytes(out)


def check_regex(value: bytes) -> None:
    """Raise :class:`RegexError` where Prometheus's Go ``regexp`` refuses ``value`` as the text
    of a ``=~``/``!~`` matcher: the text alone, then anchored as Prometheus compiles it."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RegexError(f"invalid UTF-8 at byte {e.start} (\\x and octal escapes are bytes)") from None
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        raise RegexError("invalid UTF-8 (a surrogate)")
    _Parser(text).parse()
    _Parser(f"^(?:{text})$").parse()


@dataclass(frozen=True, slots=True)
class _Node:
    """A parsed piece, kept only as far as Go's limits need, each an upper bound of what Go's parser
    finds (its simplifications, such as merging literals, only make its tree smaller)."""

    height: int = 1  # levels of Go's tree: a capture, alternation, concatenation or repeat is one
    size: int = 1  # Go's calcSize: the instructions it compiles to
    product: int = 1  # the largest product of nested {n,m} counts on a path down (Go's repeatIsValid)
    # what Go's factoring of alternatives may take from its front: a literal's case-folded text,
    # _ANY (a class, or a fixed repeat: it may equal another), or _NEVER (a capture, a repeat, ^)
    lead: str = "_ANY"
    # a concatenation or alternation of a group that captures nothing, which Go merges into the
    # one it stands in ("cat", "alt"), with its pieces (its alternatives' most) and alternatives
    flat: str = ""
    pieces: int = 1
    alts: int = 1


_ANY, _NEVER = "_ANY", "_NEVER"


def _literal(ch: str) -> _Node:
    return _Node(lead=ch.casefold())  # (?i) folds a literal to its case orbit's rune


def _own(node: _Node, flat: str) -> int:
    """``node``'s height where it stands in a ``flat`` node of Go's (which takes its pieces)."""
    return node.height - 1 if node.flat == flat else node.height


def _concat(nodes: list[_Node]) -> _Node:
    if len(nodes) == 1:
        return nodes[0]
    if not nodes:
        return _Node()  # an empty match
    return _Node(
        1 + max(_own(n, "cat") for n in nodes),
        sum(n.size for n in nodes),
        max(n.product for n in nodes),
        nodes[0].lead,
        "cat",
        sum(n.pieces if n.flat == "cat" else 1 for n in nodes),
    )


def _may_share(a: str, b: str) -> bool:
    """Whether Go's factoring may join two neighbouring alternatives that start with these."""
    return _NEVER not in (a, b) and (_ANY in (a, b) or a == b)


def _alternate(alts: list[list[_Node]]) -> _Node:
    """The alternation of ``alts``. Go factors the common leading pieces of neighbouring
    alternatives out (``ab|ac`` is ``a(?:b|c)``), a concatenation and an alternation deeper at each
    piece it strips: at most as many levels as an alternative has pieces, and as a run of
    neighbours that may share their first piece has alternatives but one."""
    subs = [_concat(alt) if alt else _Node(lead=_NEVER) for alt in alts]
    if len(subs) == 1:
        return subs[0]
    run = longest = 0
    prev = _NEVER
    for n in subs:
        many = n.alts if n.flat == "alt" else 1  # Go takes a merged alternation's alternatives
        run = run + many if _may_share(prev, n.lead) else many
        longest, prev = max(longest, run), n.lead
    pieces = max(n.pieces if n.flat else 1 for n in subs)
    return _Node(
        1 + 2 * min(longest - 1, pieces) + max(_own(n, "alt") for n in subs),
        sum(n.size for n in subs) + len(subs) - 1,
        max(n.product for n in subs),
        _ANY,
        "alt",
        pieces,
        sum(n.alts if n.flat == "alt" else 1 for n in subs),
    )


@dataclass(slots=True)
class _Group:
    capture: bool = False
    alts: list[list[_Node]] = field(default_factory=lambda: [[]])


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.groups: list[_Group] = [_Group()]
        self.runes = 0  # Go's numRunes, an upper bound

    def fail(self, what: str, part: str) -> RegexError:
        return RegexError(f"{what}: `{part}`")

    def parse(self) -> None:
        s = self.s
        last_repeat = -1  # where the previous piece's repeat operator started, or -1
        while self.i < len(s):
            start = self.i
            c = s[self.i]
            repeat = -1
            if c == "(":
                if s.startswith("(?", self.i):
                    self.perl_group()
                else:
                    self.open(capture=True)
                    self.i += 1
            elif c == "|":
                self.groups[-1].alts.append([])
                self.i += 1
            elif c == ")":
                self.close()
                self.i += 1
            elif c in "*+?":
                self.i += 1
                self.repeat(start, last_repeat, None)
                repeat = start
            elif c == "{":
                parsed = self.counts(self.i)
                if parsed is None:
                    self.piece(_literal(c))  # not a repeat: a literal {
                    self.i += 1
                else:
                    lo, hi, end = parsed
                    if lo < 0 or lo > MAX_REPEAT or hi > MAX_REPEAT or (hi >= 0 and lo > hi):
                        raise self.fail("invalid repeat count", s[start:end])
                    self.i = end
                    self.repeat(start, last_repeat, (lo, hi))
                    repeat = start
            elif c == "[":
                self.piece(runes=self.char_class())
            elif c == "\\":
                self.escape_piece()
            else:
                self.piece(_literal(c) if c not in ".^$" else _Node(lead=_ANY if c == "." else _NEVER))
                self.i += 1
            last_repeat = repeat
        if len(self.groups) != 1:
            raise self.fail("missing closing )", s)
        self.limits(_alternate(self.groups[0].alts))

    def limits(self, node: _Node) -> None:
        """Go's limits on the whole tree (a part's are within the whole's)."""
        if node.height > MAX_HEIGHT:
            raise RegexError(
                f"expression nests too deeply (Go's regexp takes at most {MAX_HEIGHT} levels of groups, "
                "alternations and repeats)"
            )
        if node.size > MAX_SIZE or self.runes > MAX_RUNES:
            raise RegexError(
                "expression too large for Go's regexp (each {n} copies what it repeats, and each "
                "Unicode class is a table of ranges)"
            )

    # the parse stack
    def piece(self, node: _Node | None = None, runes: int = 1) -> None:
        """Add a piece (a class where ``node`` is None); ``runes``: what its literal or class adds
        to Go's count of runes."""
        self.runes += runes
        self.groups[-1].alts[-1].append(node or _Node())

    def open(self, capture: bool) -> None:
        self.groups.append(_Group(capture))

    def close(self) -> None:
        if len(self.groups) == 1:
            raise self.fail("unexpected )", self.s)
        g = self.groups.pop()
        node = _alternate(g.alts)
        if g.capture:
            node = _Node(node.height + 1, node.size + 2, node.product, _NEVER)  # not flat
        self.limits(node)  # each part as it closes: the numbers stay small
        self.piece(node, runes=0)

    def repeat(self, start: int, last_repeat: int, counts: tuple[int, int] | None) -> None:
        s = self.s
        op = s[start]
        if self.i < len(s) and s[self.i] == "?":  # non-greedy
            self.i += 1
        if last_repeat >= 0:
            raise self.fail("invalid nested repetition operator", s[last_repeat : self.i])
        alt = self.groups[-1].alts[-1]
        if not alt:
            raise self.fail("missing argument to repetition operator", s[start : self.i])
        sub = alt[-1]
        if counts is None:  # Go's calcSize: x* 2 more, x+ and x? 1 more
            alt[-1] = _Node(sub.height + 1, sub.size + (2 if op == "*" else 1), sub.product, _NEVER)
            return
        lo, hi = counts
        count = hi if hi >= 0 else lo
        unbounded = 2 + sub.size if lo == 0 else 1 + lo * sub.size  # x* or xxx+
        size = unbounded if hi < 0 else hi * sub.size + (hi - lo)  # x{2,5}: xx(x(x(x)?)?)?
        product = 1 if count == 0 else count * sub.product
        node = _Node(sub.height + 1, max(size, 1), product, _ANY if lo == hi else _NEVER)
        # Go checks the product of nested counts where this one is 2 or more
        if (lo >= 2 or hi >= 2) and node.product > MAX_REPEAT:
            raise self.fail("invalid repeat count", s[start : self.i])
        alt[-1] = node

    @staticmethod
    def _int(s: str, i: int) -> tuple[int, int] | None:
        """A decimal at ``i`` without a leading zero (Go takes none: ``{01}`` is literal text);
        -1 for one too big."""
        j = i
        while j < len(s) and s[j].isascii() and s[j].isdigit():
            j += 1
        if j == i or (s[i] == "0" and j - i > 1):
            return None
        return (int(s[i:j]) if j - i <= 8 else -1), j

    def counts(self, i: int) -> tuple[int, int, int] | None:
        """``{n}``, ``{n,}`` (max -1) or ``{n,m}`` at ``i``: (min, max, end), min -1 where a count
        is too big; None where it is no repeat (Go then reads ``{`` as a literal)."""
        s = self.s
        first = self._int(s, i + 1)
        if first is None:
            return None
        lo, j = first
        if j >= len(s):
            return None
        if s[j] != ",":
            hi = lo
        else:
            j += 1
            if j >= len(s):
                return None
            if s[j] == "}":
                hi = -1
            else:
                second = self._int(s, j)
                if second is None:
                    return None
                hi, j = second
                if hi < 0:
                    lo = -1
        if j >= len(s) or s[j] != "}":
            return None
        return lo, hi, j + 1

    def perl_group(self) -> None:
        """``(?P<name>``, ``(?flags)``, ``(?flags:``; Go's other ``(?`` forms (lookarounds,
        ``(?#``, ``(?>``, ``(?P=``) are refused, and so is ``(?<name>`` (Go before 1.22)."""
        s, start = self.s, self.i
        if s.startswith("(?P<", start):
            end = s.find(">", start)
            if end < 0:
                raise self.fail("invalid named capture", s[start:])
            name = s[start + 4 : end]
            if not _WORD.fullmatch(name):
                raise self.fail("invalid named capture", s[start : end + 1])
            self.open(capture=True)
            self.i = end + 1
            return
        j = start + 2
        negated = saw = False
        while j < len(s):
            c = s[j]
            j += 1
            if c in "imsU":
                saw = True
            elif c == "-" and not negated:
                negated, saw = True, False
            elif c in ":)":
                if negated and not saw:
                    break
                if c == ":":
                    self.open(capture=False)
                self.i = j
                return
            else:
                break
        raise self.fail("invalid or unsupported Perl syntax", s[start:j])

    def escape_piece(self) -> None:
        s, i = self.s, self.i
        nxt = s[i + 1] if i + 1 < len(s) else ""
        if nxt in ("A", "b", "B", "z"):
            self.piece(_Node(lead=_NEVER))
            self.i += 2
        elif nxt == "C":
            raise self.fail("invalid escape sequence", s[i : i + 2])
        elif nxt == "Q":
            end = s.find("\\E", i + 2)
            for ch in s[i + 2 : end if end >= 0 else len(s)]:
                self.piece(_literal(ch))
            self.i = len(s) if end < 0 else end + 2
        elif nxt in ("p", "P"):
            self.i = self.unicode_class(i)
            self.piece(runes=CLASS_RUNES)
        elif nxt and nxt in _PERL_CLASSES:
            self.piece(runes=_SMALL_CLASS_RUNES)
            self.i += 2
        else:
            self.i = self.single_escape(i)
            self.piece(_literal(chr(_escape_value(s[i : self.i]))))

    def unicode_class(self, i: int) -> int:
        """``\\pL`` or ``\\p{Name}`` / ``\\p{^Name}`` at ``i``; the index after it."""
        s = self.s
        if i + 2 >= len(s):
            raise self.fail("invalid character class range", s[i:])
        if s[i + 2] != "{":
            seq, name, end = s[i : i + 3], s[i + 2], i + 3
        else:
            close = s.find("}", i)
            if close < 0:
                raise self.fail("invalid character class range", s[i:])
            seq, name, end = s[i : close + 1], s[i + 3 : close], close + 1
        if name.startswith("^"):
            name = name[1:]
        if name not in UNICODE_CLASSES:
            raise self.fail("invalid character class range", seq)
        return end

    def single_escape(self, i: int) -> int:
        """An ordinary escape at ``i`` (a punctuation character, octal, ``\\x``, ``\\a\\f\\n\\r\\t\\v``);
        the index after it."""
        s = self.s
        if i + 1 >= len(s):
            raise self.fail("trailing backslash at end of expression", "")
        c = s[i + 1]
        j = i + 2
        if c.isascii() and not c.isalnum():
            return j
        if c in "01234567":
            if c != "0" and not (j < len(s) and s[j] in "01234567"):  # \1: a backreference
                raise self.fail("invalid escape sequence", s[i:j])
            for _ in range(2):
                if j < len(s) and s[j] in "01234567":
                    j += 1
            return j
        if c == "x":
            if j < len(s) and s[j] == "{":
                close = s.find("}", j)
                digits = s[j + 1 : close] if close >= 0 else ""
                if (
                    close < 0
                    or not digits
                    or not re.fullmatch(r"[0-9a-fA-F]+", digits)
                    or int(digits, 16) > 0x10FFFF
                ):
                    raise self.fail("invalid escape sequence", s[i : (close if close >= 0 else len(s))])
                return close + 1
            if re.fullmatch(r"[0-9a-fA-F]{2}", s[j : j + 2]):
                return j + 2
            raise self.fail("invalid escape sequence", s[i : j + 2])
        if c in "afnrtv":
            return j
        raise self.fail("invalid escape sequence", s[i:j])

    def char_class(self) -> int:
        """``[...]`` at ``self.i``: ``]`` first is a literal, ranges checked, POSIX and Unicode
        classes named, escapes as outside but for the assertions (``[\\b]`` is refused). Returns
        an upper bound of the runes Go's class holds."""
        s, start = self.s, self.i
        runes = 2  # a negation adds a range
        i = start + 1
        if i < len(s) and s[i] == "^":
            i += 1
        first = True
        while i >= len(s) or s[i] != "]" or first:
            if i >= len(s):
                raise self.fail("missing closing ]", s[start:])
            first = False
            if s.startswith("[:", i):
                end = s.find(":]", i + 2)
                if end >= 0:
                    name = s[i + 2 : end]
                    if name.removeprefix("^") not in _POSIX:
                        raise self.fail("invalid character class range", s[i : end + 2])
                    i = end + 2
                    runes += _SMALL_CLASS_RUNES
                    continue
            if s.startswith(("\\p", "\\P"), i):
                i = self.unicode_class(i)
                runes += CLASS_RUNES
                continue
            if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in _PERL_CLASSES:
                i += 2
                runes += _SMALL_CLASS_RUNES
                continue
            lo, i = self.class_char(i, start)
            hi = lo
            if i + 1 < len(s) and s[i] == "-" and s[i + 1] != "]":
                hi, end = self.class_char(i + 1, start)
                if hi < lo:
                    raise self.fail("invalid character class range", s[i - 1 : end])
                i = end
            runes += _range_runes(lo, hi)
        self.i = i + 1
        return runes

    def class_char(self, i: int, start: int) -> tuple[int, int]:
        """One character of a class at ``i`` (an escape or a literal): its code point and the
        index after it."""
        s = self.s
        if i >= len(s):
            raise self.fail("missing closing ]", s[start:])
        if s[i] != "\\":
            return ord(s[i]), i + 1
        end = self.single_escape(i)
        return _escape_value(s[i:end]), end


_MIN_FOLD, _MAX_FOLD = 0x41, 0x1E943  # the code points case folding can change (Go's minFold, maxFold)


def _range_runes(lo: int, hi: int) -> int:
    """The most runes Go's class can hold for the range ``lo-hi``: a range of 2, and under ``(?i)``
    each letter with the others of its case orbit (at most 4) as ranges of their own."""
    if lo <= _MIN_FOLD and hi >= _MAX_FOLD:
        return 2
    return 2 + 8 * max(0, min(hi, _MAX_FOLD) - max(lo, _MIN_FOLD) + 1)


def _escape_value(esc: str) -> int:
    """The code point of an ordinary escape :meth:`_Parser.single_escape` accepted."""
    c = esc[1]
    if c in "01234567":
        return int(esc[1:], 8)
    if c == "x":
        return int(esc[2:].strip("{}"), 16)
    return {"a": 7, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}.get(c, ord(c))


def selector_problem(selector: str) -> str | None:
    """Why Prometheus would refuse ``selector`` (a list of matchers by the config's grammar), or
    None: a string escape naming no code point, a regex Go's ``regexp`` refuses, a matcher on
    ``__name__`` (the exported expressions name the metric) or ``le`` (the rules choose buckets).
    A U+FFFD character written as itself is refused too: Go's decoder returns that rune for a byte
    that is no UTF-8, and PromQL's lexer refuses it for one, in any quotes."""
    if "\ufffd" in selector:
        return "a U+FFFD character, which PromQL's lexer reads as invalid UTF-8: write it as \\ufffd"
    try:
        for m in matchers(selector):
            where = f"{m.name}{m.op}"
            if m.name in ("__name__", "le"):
                return f"{where}: the exported rules set {m.name} themselves; match other labels"
            if m.op in ("=~", "!~"):
                try:
                    check_regex(m.value)
                except RegexError as e:
                    return f"{where}: Prometheus's regexp (Go's RE2 syntax) refuses it: {e}"
    except RegexError as e:
        return str(e)
    return None

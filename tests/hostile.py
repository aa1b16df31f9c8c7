"""Hostile strings, derived systematically rather than picked: every ASCII code point
(control characters, quotes, backslash, SQL and Grafana metacharacters) alone and inside a
name, the sequences that break a quoted literal or a comment, UTF-8 of every length, and
the longest names the wire allows and beyond. Used for every path a value takes into SQL."""

from __future__ import annotations

# sequences that end a literal, start a comment, or look like an escape / a variable / a macro
SEQUENCES = (
    "' = '') OR 1=1 --",
    "o'brien",
    "bob's-llm",
    "q\\",
    "\\",
    "\\'",
    "''",
    "\\\\'",
    "'; DROP TABLE gpu_samples; --",
    "x' OR 'x'='x",
    "*/ OR 1=1 /*",
    "lab\\tx",
    "lab\\x00",
    "%27",
    "%",
    "%%5C",
    "${cluster}",
    "$cluster",
    "$__all",
    "$__conditionalAll(1=1, $cluster)",
    "{cluster:String}",
    "a,b",
    "(x)",
    " leading and trailing ",
)
# UTF-8 of 2, 3 and 4 bytes; right-to-left override, zero width, BOM, line separator
UNICODE = ("é", "ünïcødé", "中文集群", "😀🚀", "\u202eevil", "a\u200bb", "\ufeffbom", "a\u2028b")
MAX_NAME = 256  # gpuslo.wire Name / Label max_length


def ascii_names() -> list[str]:
    """Each of the 128 ASCII code points alone and between two letters."""
    out = []
    for c in range(128):
        out.append(chr(c))
        out.append(f"a{chr(c)}b")
    return out


def corpus(long: bool = True) -> list[str]:
    out = [*ascii_names(), *SEQUENCES, *UNICODE]
    if long:
        # 40 kB: a few of them fit in one query (ClickHouse's max_query_size is 256 KiB)
        out += ["n" * MAX_NAME, ("'\\" * MAX_NAME)[:MAX_NAME], "é" * 20_000 + "\\"]
    return list(dict.fromkeys(out))  # unique, in order


def names() -> list[str]:
    """The corpus entries the wire accepts as a name (1 to 256 characters)."""
    return [s for s in corpus() if 1 <= len(s) <= MAX_NAME]


# the code points escaping treats apart (quote and backslash get a backslash, controls become
# \xHH, the rest stays) and a character of the variable syntax, for the fast tier
SPECIAL = "'\\\x00\n\x7f{"


def few_names() -> list[str]:
    """A fast-tier sample of :func:`names` with one member of each class it derives: one
    code point of each escaping rule alone and inside a name, every sequence, UTF-8 of every length and the longest
    names. The whole of :func:`names` is used by the integration tier."""
    out = [*SPECIAL, *(f"a{c}b" for c in SPECIAL), *SEQUENCES, *UNICODE[:4], "n" * MAX_NAME]
    out.append(("'\\" * MAX_NAME)[:MAX_NAME])
    assert set(out) <= set(names())
    return list(dict.fromkeys(out))


def byte_strings() -> list[bytes]:
    """Bytes a ``String`` column holds (a dead letter's raw message as it came): every byte
    alone and between two letters, each way UTF-8 breaks (a continuation byte with no lead, a
    sequence cut short, an overlong form, a surrogate, a code point past U+10FFFF, a lead byte
    UTF-8 never uses), and valid UTF-8 of every length among them."""
    broken = [b"\x80", b"\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc0\x80", b"\xc1\xbf",
              b"\xe0\x80\x80", b"\xf0\x80\x80\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80",
              b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xfe", b"\xff", b"\xff\xfe{}"]  # fmt: skip
    out = [bytes([c]) for c in range(256)] + [b"a" + bytes([c]) + b"b" for c in range(256)]
    out += broken + [b"ok " + x + b" \xc3\xa9" for x in broken]
    out += [u.encode() for u in UNICODE] + [b"", b"\x00" * 3, b"\xff" * 4096]
    return list(dict.fromkeys(out))


def as_read(value: bytes) -> str | bytes:
    """What a store gives back for ``value`` read from a ``String``: the text where it is
    UTF-8, else the bytes as stored (clickhouse-driver's meaning)."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value

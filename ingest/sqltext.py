"""The one way a value becomes SQL text: every string that reaches ClickHouse (chDB query
parameters, the server store's bound parameters, constants the dashboard generator writes)
is escaped by :func:`escape`.

ClickHouse reads a backslash as an escape both inside a quoted literal and in the
"Escaped" text form it parses ``{name:Type}`` parameter values from, so quote doubling
(``''``) alone is not enough: ``x\\`` would swallow the closing quote. :func:`escape`
writes the backslash and the quote as ``\\\\`` and ``\\'`` and every control character
(C0, DEL) as ``\\xHH``, which both forms read back to the same bytes; everything else
(UTF-8 text included) stays as it is.

Queries are assembled from fragments by :func:`fill` (``{name}`` slots, filled with SQL text)
and :func:`inline` (ClickHouse's own ``{name:Type}`` query parameters, replaced by SQL text
where no parameter can be sent, as in a Grafana panel). Both substitute in one pass, so a
fragment's text is never searched again, and neither looks inside a string literal or a comment (a later
pass over a filled query does not take a value's ``{x}`` for a slot), and raise :class:`TemplateError`, not ``assert``
(which ``python -O`` removes), on a slot given no text, a text given no slot, or a slot left.
A fragment is SQL, never a value: a value goes in as :func:`literal` (or as a query parameter).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

_SPECIAL = re.compile(r"[\\'\x00-\x1f\x7f]")


def _one(m: re.Match[str]) -> str:
    c = m.group(0)
    if c in "\\'":
        return "\\" + c
    return f"\\x{ord(c):02x}"


class NotText(ValueError):
    """A string that is not Unicode text (it holds a lone surrogate: Python's stand-in for a
    byte that is not UTF-8, from a command-line argument, a file name or the environment):
    no query can carry it."""


def escape(text: str) -> str:
    """The body of a ClickHouse string literal (also a valid Escaped-format value). A string that
    is not UTF-8 text raises :class:`NotText` (chDB said "Unable to cast Python instance of type
    <class 'str'> to C++ type"; the server's driver, UnicodeEncodeError)."""
    if not isinstance(text, str):
        raise TypeError(f"escape() takes a string, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = re.sub(r"\\udc([89a-f][0-9a-f])", r"\\x\1", repr(text[:200]))
        raise NotText(
            f"{shown} is not UTF-8 text (a \\xNN is a byte that is not): no query can hold it"
        ) from None
    return _SPECIAL.sub(_one, text)


def quote(text: str) -> str:
    """A ClickHouse string literal: ``'`` + :func:`escape` + ``'``."""
    return "'" + escape(text) + "'"


def literal(v: Any) -> str:
    """A SQL literal of a Python value: strings quoted, numbers as numbers, lists as arrays."""
    if isinstance(v, str):
        return quote(v)
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, (list, tuple)):
        return array(v)
    raise TypeError(f"unsupported SQL value {v!r}")


def array(values: Sequence[Any]) -> str:
    return "[" + ", ".join(literal(x) for x in values) + "]"


def param_text(v: Any) -> str:
    """A ``{name:Type}`` query parameter's value in the text form ClickHouse parses it from:
    a scalar in the Escaped form (a string escaped, not quoted), an array as its literal."""
    if isinstance(v, str):
        return escape(v)
    return literal(v)


# ``{name}``: a fragment slot. ClickHouse's query parameters ``{name:Type}`` have a colon, so
# the two never match each other's pattern; Grafana's variables ``${name}``, ``${name:format}``
# are neither.
# What a query's text holds that is not SQL to fill: a string literal, a quoted identifier, a
# comment (``-- the node's pool`` holds a quote that would open a literal). SKIP is matched
# first and kept as it is (the name group is None), so a value's text (an SLO's service written
# by literal()) is never taken for a slot or a parameter, in any later pass; the server store
# binds parameters past the same SKIP.
SKIP = r"'(?:[^'\\]|\\.)*'|`(?:[^`\\]|\\.)*`|--[^\n]*|/\*.*?\*/|"
SLOT = re.compile(SKIP + r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}", re.DOTALL)
PARAM = re.compile(SKIP + r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*:[^{}]+)\}", re.DOTALL)


def _names(pattern: re.Pattern[str], template: str) -> set[str]:
    """The slot or parameter names of ``template``, outside its literals and comments."""
    return {m.group(1) for m in pattern.finditer(template) if m.group(1) is not None}


class TemplateError(ValueError):
    """A query template and the fragments given for it do not match."""


def slots(template: str) -> frozenset[str]:
    """The names of the ``{name}`` slots of ``template``."""
    return frozenset(_names(SLOT, template))


def _substitute(
    template: str,
    pattern: re.Pattern[str],
    parts: Mapping[str, str],
    optional: Mapping[str, str],
    keep: Collection[str],
) -> str:
    for name, text in (*parts.items(), *optional.items()):
        if not isinstance(text, str):
            raise TypeError(
                f"fragment {name!r} must be SQL text (a value goes in as literal()), not {type(text).__name__}"
            )
    found = _names(pattern, template)
    unused = sorted(set(parts) - found)
    if unused:
        raise TemplateError(f"no slot for {', '.join(unused)} in the query: {template.strip()[:120]!r}")
    left = sorted(found - set(parts) - set(optional) - set(keep))
    if left:
        raise TemplateError(f"no text for {', '.join(left)} in the query: {template.strip()[:120]!r}")
    given = {**optional, **parts}
    return pattern.sub(
        lambda m: m.group(0) if m.group(1) is None else given.get(m.group(1), m.group(0)), template
    )


def fill(
    template: str, /, *, keep: Collection[str] = (), optional: Mapping[str, str] | None = None, **parts: str
) -> str:
    """``template`` with each ``{name}`` slot replaced by ``parts[name]`` (SQL text).

    Every part must have a slot, and every slot a part, but for the slots named in ``keep``
    (left for a later :func:`fill`) and the parts in ``optional`` (used where there is a slot)."""
    return _substitute(template, SLOT, parts, optional or {}, keep)


def inline(
    query: str, /, consts: Mapping[str, str] | None = None, *, optional: Mapping[str, str] | None = None
) -> str:
    """``query`` with each ClickHouse parameter ``{name:Type}`` replaced by SQL text: ``consts``
    maps ``name:Type`` to it (each must be used), ``optional`` too (used where it appears). A
    parameter left over is an error; a value goes in as :func:`literal`."""
    return _substitute(query, PARAM, consts or {}, optional or {}, ())

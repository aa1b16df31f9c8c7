"""The one way a value becomes SQL text: every string that reaches ClickHouse (chDB query
parameters, the server store's bound parameters, constants the dashboard generator writes)
is escaped by :func:`escape`.

ClickHouse reads a backslash as an escape both inside a quoted literal and in the
"Escaped" text form it parses ``{name:Type}`` parameter values from, so quote doubling
(``''``) alone is not enough: ``x\\`` would swallow the closing quote. :func:`escape`
writes the backslash and the quote as ``\\\\`` and ``\\'`` and every control character
(C0, DEL) as ``\\xHH``, which both forms read back to the same bytes; everything else
(UTF-8 text included) stays as it is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

_SPECIAL = re.compile(r"[\\'\x00-\x1f\x7f]")


def _one(m: re.Match[str]) -> str:
    c = m.group(0)
    if c in "\\'":
        return "\\" + c
    return f"\\x{ord(c):02x}"


def escape(text: str) -> str:
    """The body of a ClickHouse string literal (also a valid Escaped-format value)."""
    if not isinstance(text, str):
        raise TypeError(f"escape() takes a string, not {type(text).__name__}")
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

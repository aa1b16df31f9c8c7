"""Slurm's hostlist syntax (``node[01-03,07]``), as its node lists and gres.conf's ``File=``
(``/dev/nvidia[0-3]``) write it."""

from __future__ import annotations

import itertools
import re

from gpuslo.wire.bounds import MAX_ASSIGNED_NODES


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax → names: ``node[01-03,07],gpu9``, a suffix after a bracket
    (``n[1-2]-ib``: n1-ib, n2-ib; it was a third node named ``-ib``) and several brackets in one
    name (``r[1-2]n[1-2]``: each with each, in order). ValueError for a range that is not one
    (``n[a-b]``, ``n[3-1]``), brackets that do not pair, a name longer than the wire's 256
    characters or more than ``MAX_ASSIGNED_NODES`` names (counted before any is built: a hostile
    ``n[0-99999999]`` must not build a huge list)."""
    out: list[str] = []
    for entry in _top_level(text):
        choices = []
        total = 1
        for part in re.split(r"(\[[^\[\]]*\])", entry):
            if part.startswith("[") and part.endswith("]"):
                choices.append(_hostlist_range(part[1:-1], text))
            elif "[" in part or "]" in part:
                raise ValueError(f"hostlist {text[:100]!r}: brackets that do not pair")
            else:
                choices.append([part])
            total *= len(choices[-1])
            if len(out) + total > MAX_ASSIGNED_NODES:
                raise ValueError(f"hostlist {text[:100]!r} names more than {MAX_ASSIGNED_NODES} nodes")
        if sum(max(map(len, c)) for c in choices) > 256:
            raise ValueError(f"hostlist {text[:100]!r}: a name longer than 256 characters")
        out += ["".join(names) for names in itertools.product(*choices)]
    return [x for x in out if x]


def _top_level(text: str) -> list[str]:
    """``text`` cut at its commas outside brackets."""
    out, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(text[start:k])
            start = k + 1
    return [*out, text[start:]]


def _hostlist_range(body: str, text: str) -> list[str]:
    """A bracket's numbers (``01-03,07``), zero-padded as written; at most MAX_ASSIGNED_NODES."""
    out: list[str] = []
    for r in body.split(","):
        a, dash, b = r.partition("-")
        if (
            not (a.isascii() and a.isdigit())
            or (dash and not (b.isascii() and b.isdigit()))
            or max(len(a), len(b)) > 256
        ):
            raise ValueError(f"hostlist {text[:100]!r}: range {r[:50]!r} unreadable")
        lo, hi = int(a), int(b or a)
        if hi < lo or len(out) + hi - lo + 1 > MAX_ASSIGNED_NODES:
            raise ValueError(
                f"hostlist {text[:100]!r}: range {r[:50]!r} reversed or past {MAX_ASSIGNED_NODES} nodes"
            )
        out += [f"{i:0{len(a)}d}" for i in range(lo, hi + 1)]
    return out

"""The order in which the test files start: the longest first, so that no long file is left to
run alone at the end while the other workers have finished (pytest-xdist's ``--dist loadfile``
hands out whole files in collection order; scripts/test.sh turns off its own reordering, which
sorts by the number of tests, not by their time).

``tests/durations.json`` holds each file's seconds from one run of the suite (the sum of its
tests' setup, call and teardown, from pytest's JUnit XML); a file missing there starts after
every timed one, in collection order. Refresh it after a file's time changes much:
``python -m tests.ordering JUNIT.xml`` (from a run with ``--junitxml=JUNIT.xml``).
Only the order changes: each file's tests stay together and in their own order.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, TypeVar

DURATIONS = Path(__file__).with_name("durations.json")


class _Item(Protocol):
    @property
    def nodeid(self) -> str: ...


T = TypeVar("T", bound=_Item)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def weights(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds by test file (``tests/test_x.py``); nothing where the table is missing or unreadable
    (the order is then collection order: only the balance suffers)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(k): float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def longest_first(items: Sequence[T], seconds: dict[str, float]) -> list[T]:
    """``items`` with whole files ordered by ``seconds``, the longest first (a stable sort: ties and
    untimed files keep collection order, each file's tests keep theirs)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(file_of(item.nodeid), i)
    return sorted(items, key=lambda it: (-seconds.get(file_of(it.nodeid), 0.0), first[file_of(it.nodeid)]))


def from_junit(xml_path: Path) -> dict[str, float]:
    """Seconds by test file from a JUnit XML report of the whole suite."""
    per: Counter[str] = Counter()
    for case in ET.parse(xml_path).iter("testcase"):
        module = (case.get("classname") or "").split(".")
        if len(module) < 2 or module[0] != "tests":
            continue
        per[f"tests/{module[1]}.py"] += float(case.get("time") or 0.0)
    return {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))}


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.ordering JUNIT.xml", file=sys.stderr)
        return 2
    try:
        table = from_junit(Path(argv[0]))
    except (OSError, ET.ParseError) as exc:
        print(f"tests.ordering: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 1
    DURATIONS.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s, written to {DURATIONS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

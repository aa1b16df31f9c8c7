"""The suite's file order (tests/ordering.py): the longest files first, each file whole."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tests.ordering import DURATIONS, from_junit, longest_first, main, weights

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Item:
    nodeid: str


def _items(*ids: str) -> list[Item]:
    return [Item(i) for i in ids]


def test_longest_files_first_each_whole_and_in_its_own_order() -> None:
    items = _items("tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/c.py::t1[x]",
                   "tests/c.py::t1[y]", "tests/d.py::T::t", "tests/e.py::t")  # fmt: skip
    got = [i.nodeid for i in longest_first(items, {"tests/c.py": 50.0, "tests/a.py": 5.0, "tests/e.py": 5.0})]
    assert got == ["tests/c.py::t1[x]", "tests/c.py::t1[y]", "tests/a.py::t1", "tests/a.py::t2",
                   "tests/e.py::t", "tests/b.py::t1", "tests/d.py::T::t"]  # fmt: skip
    # no table: collection order, untouched
    assert longest_first(items, {}) == items


def test_an_unreadable_table_is_no_table(tmp_path: Path) -> None:
    for text in ("", "{", "[1, 2]", '{"tests/a.py": "x", "tests/b.py": true, "tests/c.py": 3}'):
        p = tmp_path / "d.json"
        p.write_text(text)
        assert weights(p) == ({"tests/c.py": 3.0} if text.startswith('{"') else {})
    assert weights(tmp_path / "missing.json") == {}


def test_the_table_is_read_from_junit_xml(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="1.25"/>'
        '<testcase classname="tests.test_a.TestX" name="t2" time="2.5"/>'
        '<testcase classname="tests.test_b" name="t" time="10"/>'
        '<testcase classname="other" name="t" time="99"/>'
        "</testsuite></testsuites>"
    )
    assert from_junit(xml) == {"tests/test_b.py": 10.0, "tests/test_a.py": 3.8}
    assert list(from_junit(xml)) == ["tests/test_b.py", "tests/test_a.py"]
    assert main([str(tmp_path / "absent.xml")]) == 1
    assert main([]) == 2


def test_the_committed_table_names_only_files_that_exist() -> None:
    """A renamed or deleted file left in the table would let its successor start last: refresh
    the table (python -m tests.ordering JUNIT.xml) when this fails."""
    table = json.loads(DURATIONS.read_text())
    assert table, "tests/durations.json is empty"
    missing = sorted(f for f in table if not (ROOT / f).is_file())
    assert not missing, f"tests/durations.json names files that are gone: {missing}"

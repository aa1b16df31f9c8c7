"""The suite's file order (tests/ordering.py): the longest files first, each file whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

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


@pytest.mark.integration
def test_stepwise_resumes_at_the_failure_in_the_order_the_tests_ran(tmp_path: Path) -> None:
    """``pytest --sw`` skips the tests before the last failure: the reorder ran after stepwise's,
    so a file collected before that failure and never run (its failing test too) was skipped as
    passed, a green run. The suite's own hook orders them first (tryfirst)."""
    (tmp_path / "conftest.py").write_text(
        "import tests.ordering as o\nfrom tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
        "o.weights = lambda path=None: {'test_z.py': 100.0}\n"
    )
    (tmp_path / "test_a.py").write_text("def test_a():\n    assert 0, 'a never ran'\n")
    (tmp_path / "test_z.py").write_text(
        f"import os\ndef test_z():\n    assert os.path.exists({str(tmp_path / 'ok')!r})\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "--sw", "-p", "no:xdist", "-p", "no:randomly"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip

    first = run()
    assert first.returncode != 0 and "test_z.py::test_z" in first.stdout, first.stdout
    (tmp_path / "ok").touch()
    second = run()
    assert second.returncode != 0 and "a never ran" in second.stdout, second.stdout

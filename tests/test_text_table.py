"""The terminal tables (``gpuslo.app.text.table``): names from the data keep the columns aligned."""

from __future__ import annotations

import pytest

from gpuslo.app.text import table, terminal_safe, width


def _second_column_starts(out: str) -> list[int]:
    """Screen column where each line's second cell (one character in these tables) starts."""
    return [width(line) - 1 for line in out.split("\n")]


@pytest.mark.parametrize(
    ("name", "shown", "cols"),
    [
        ("plain", "plain", 5),
        ("job\x1b[2Jx", "job\\x1b[2Jx", 11),  # ESC escaped: 4 characters on screen, not 1
        ("a\u202eb", "a\\u202eb", 8),  # a right-to-left override, escaped
        ("训练", "训练", 4),  # two wide characters
        ("cafe\u0301", "cafe\u0301", 4),  # a combining accent takes no column
        ("two\nlines", "two\\nlines", 10),
        ("tab\there", "tab\\there", 9),
    ],
)
def test_a_cell_is_escaped_and_padded_by_its_screen_width(name: str, shown: str, cols: int) -> None:
    out = table([[name, "1"], ["x", "2"]], ["job", "n"])
    lines = out.split("\n")
    assert len(lines) == 4, out  # header, rule, two rows: a newline in a name makes no row
    assert lines[2].startswith(shown)
    assert width(shown) == cols
    w = max(cols, 3)  # the column is as wide as its widest cell ("job" is 3)
    assert lines[1].split("  ")[0] == "-" * w
    assert _second_column_starts(out)[:1] + _second_column_starts(out)[2:] == [w + 2] * 3
    assert lines[0].endswith("n") and lines[2].endswith("1") and lines[3].endswith("2")


def test_escaping_after_the_table_changes_nothing() -> None:
    """The CLI escapes what it prints; a table made safe already is left as it is (so the
    padding measured here is the padding shown)."""
    out = table([["\x07bell", "\x9bcsi"]], ["a", "b"])
    assert terminal_safe(out) == out


def test_width_of_edge_characters() -> None:
    assert width("") == 0
    assert width("\uff21") == 2  # FULLWIDTH LATIN A
    assert width("e\u0301\u200d") == 1  # combining mark and zero-width joiner

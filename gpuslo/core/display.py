"""How values are shown to a person, on the terminal and on the HTML pages alike: names from
the data with their invisible controls made visible, and percentages rounded without claiming a
bound they do not reach, and amounts that are not 0 never shown as 0."""

from __future__ import annotations

import math
import re

# C0 and C1 controls but newline and tab, DEL, and the bidirectional overrides and isolates
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """``text`` with every control character (ESC, BEL, NUL ...) and bidirectional override or
    isolate escaped as ``\\xNN`` / ``\\uNNNN``. Names come from the data (a Slurm job name is its
    user's to choose): on a terminal ``sbatch -J $'\\e]0;...\\a'`` would retitle, clear or
    recolour the reader's terminal; on a page or a terminal U+202E reverses what follows it (the
    rest of the line: the date after a cluster name, the column after a user's), and a NUL is
    dropped or replaced by the browser (the name shown is not the name)."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


MORE_PLACES = 3  # how many more decimals pct() may use to keep a value off 0 % and 100 %


def pct(x: float | None, places: int = 1, none: str = "–") -> str:
    """``x`` (a fraction) as a percentage to ``places`` decimals, ``none`` for no value (None,
    NaN, infinite). A value that is not 0 or 1 is never shown as "0.0 %" or "100.0 %": it gets
    up to MORE_PLACES more decimals (an SLI of 0.99995 is "99.995 %", not "100.0 %", a breach of
    a 99.99 % objective that read as perfect), and beyond them is shown as a bound ("< 0.0001 %",
    "> 99.9999 %"); and never as "-0.0 %"."""
    if x is None or not math.isfinite(x):
        return none
    v = 100 * x + 0.0  # + 0.0: no negative zero
    edge = 100.0 if v > 50 else 0.0  # the bound v may round to
    for p in range(places, places + MORE_PLACES + 1):
        text = f"{v:.{p}f}"
        if float(text) != edge or v == edge:
            return f"{text} %"
    step = 10.0**-p
    return f"< {edge + step:.{p}f} %" if v > edge else f"> {edge - step:.{p}f} %"


def amount(x: float | None, places: int = 1, none: str = "–", grouping: bool = False) -> str:
    """``x`` (GPU-hours, kWh, ...) to ``places`` decimals, ``none`` for no value; a value that is
    not 0 is never shown as "0.0": it gets up to MORE_PLACES more decimals (0.04 GPU-hours of
    idle is "0.04", not a "0.0" that reads as none), beyond them a bound ("< 0.0001"); never
    "-0.0". ``grouping``: thousands separated by commas."""
    if x is None or not math.isfinite(x):
        return none
    v = x + 0.0
    sep = "," if grouping else ""
    for p in range(places, places + MORE_PLACES + 1):
        text = f"{v:{sep}.{p}f}"
        if float(text.replace(",", "")) != 0.0 or v == 0.0:
            return text
    step = 10.0**-p
    return f"< {step:.{p}f}" if v > 0 else f"> -{step:.{p}f}"


def hms(s: float | None, none: str = "–") -> str:
    """A duration as Slurm writes one (``[D-]HH:MM:SS``), ``none`` for no value: a wait of 20 s
    is ``00:00:20``, not a "0 min" that reads as none."""
    if s is None or not math.isfinite(s):
        return none
    t = round(s)
    d, rem = divmod(t, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    return (f"{d}-" if d else "") + f"{h:02d}:{m:02d}:{sec:02d}"

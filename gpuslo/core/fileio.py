"""Whole writes to a file descriptor.

``os.write`` and ``os.pwrite`` may write less than asked without an error: a disk with a few
blocks left takes part of a write and refuses the rest only at the next call. A caller that
ignores the count leaves a torn record behind and believes it whole. Every write of a file
the project owns goes through these two, which write everything or raise ``OSError``.
"""

from __future__ import annotations

import os


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the descriptor's position, or raise ``OSError``."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # never for a regular file, but a loop must not spin
            raise OSError(0, "write made no progress")
        view = view[n:]


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``, or raise ``OSError``."""
    view, at = memoryview(data), offset
    while view:
        n = os.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(0, "write made no progress")
        view, at = view[n:], at + n


# What reading back a state file of our own may raise when it is missing parts, damaged or of
# another shape (a directory, JSON of the wrong type, nesting too deep): its owner starts
# afresh and logs it, never stops.
UNREADABLE_STATE: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TypeError,
    AttributeError,
    RecursionError,
)

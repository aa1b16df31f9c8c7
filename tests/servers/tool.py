"""Running a server's command-line tool (a formatter, a key maker, a client) from the test harness:
when it fails, the error says what it printed, never only ``returned non-zero exit status 1``."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence


class ToolFailed(RuntimeError):
    """A tool exited non-zero or ran past its time; the message holds its command, exit status and
    the tails of what it wrote to stdout and stderr."""

    def __init__(self, argv: Sequence[str], why: str, stdout: str, stderr: str) -> None:
        self.argv = list(argv)
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(
            f"{' '.join(self.argv)}: {why}\n--- stderr (tail) ---\n{stderr[-3000:]}"
            f"\n--- stdout (tail) ---\n{stdout[-1500:]}"
        )


def _text(b: str | bytes | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


def run_tool(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 120.0) -> str:
    """Runs ``argv`` to completion (``timeout`` seconds at most) and returns its stdout; raises
    :class:`ToolFailed` with what it printed when it exits non-zero or runs too long."""
    try:
        r = subprocess.run(
            list(argv), capture_output=True, text=True, env=dict(env) if env is not None else None,
            timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise ToolFailed(argv, f"still running after {timeout} s", _text(e.stdout), _text(e.stderr)) from None
    if r.returncode != 0:
        raise ToolFailed(argv, f"exited with status {r.returncode}", r.stdout, r.stderr)
    return r.stdout

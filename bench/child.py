"""A benchmark's step in a child process of its own (a clean heap for its peak RSS, a hard
bound on its time): what it printed last as its JSON line, or what went wrong."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any


def peak_rss_mb() -> float:
    """This process's own peak resident set so far, MB: Linux's ``VmHWM``, which a new program
    starts afresh. (``ru_maxrss`` does not: it keeps the peak of the process that started this one
    across ``exec``, so a child's figure read the parent's wherever the parent had been bigger.)
    ``ru_maxrss`` where there is no ``/proc``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_child(module: str, args: list[str], timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """``python -m MODULE ARGS`` bounded by ``timeout_s``: its last line's JSON (None if it did
    not end in time, or failed) and what went wrong."""
    cmd = [sys.executable, "-m", module, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None, f"stopped after {timeout_s:g} s"
    if done.returncode != 0:
        return None, f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]), ""
    except (IndexError, ValueError):
        return None, f"no JSON line at the end of its output: {done.stdout.strip()[-300:]!r}"

"""A real, tiny file system for fault tests: a tmpfs of a given size mounted by the test
(root only; the test is skipped with the reason where mounting is not permitted)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                         capture_output=True, text=True, check=False)  # fmt: skip
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip() or out.returncode}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)

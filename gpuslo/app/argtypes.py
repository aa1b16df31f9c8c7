"""Argument types the commands share (no imports beyond argparse: every command parses them)."""

from __future__ import annotations

import argparse


def path_arg(text: str) -> str:
    """A path the user names: an empty one is refused (``--config ""`` was read as no --config,
    the shipped example; ``--csv ""`` wrote nothing, exit 0)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text

"""Reading wire messages as JSON lines (``gpuslo ingest --file``, what ``gpuslo agent --out``
writes): batches bounded in lines and bytes, a line over the limit a dead letter."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from gpuslo.ingest.writer import Raw

#: What a file saved as "UTF-8 with BOM" begins with (Windows tools write it): its first line
#: was a dead letter, "BOM is not supported"
BOM = b"\xef\xbb\xbf"
#: ``ingest --file`` reads batches of at most this many lines and bytes.
CHUNK_LINES, CHUNK_BYTES = 20_000, 16 * 2**20


def batches(
    fh: IO[bytes], name: str, max_line: int, chunk: int = CHUNK_LINES, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[list[Raw]]:
    """Batches of lines, bounded in count and bytes. A line longer than ``max_line`` bytes
    is never held whole: its first KiB becomes a dead letter with the reason, the rest is
    skipped."""
    batch: list[Raw] = []
    size = 0
    n = 0
    while line := fh.readline(max_line + 1 + (len(BOM) if n == 0 else 0)):
        n += 1
        if n == 1 and line.startswith(BOM):  # a text editor's or PowerShell's UTF-8 signature
            line = line[len(BOM) :]  # (JSON parsers may ignore it, RFC 8259 8.1; orjson refuses it)
        if len(line) - line.endswith(b"\n") > max_line:  # its bytes before the newline
            batch.append(_too_long(fh, line, f"{name}:{n}", n, max_line))
        else:
            raw = line.rstrip(b"\r\n")
            if not raw.strip():
                continue
            batch.append(Raw(f"{name}:{n}", raw, offset=n))
            size += len(raw)
        if len(batch) >= chunk or size >= chunk_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _too_long(fh: IO[bytes], line: bytes, origin: str, n: int, max_line: int) -> Raw:
    """The dead letter of a line over the limit (its first KiB); the rest of it is read past."""
    head, size_of_line = line[:1024], len(line) - line.endswith(b"\n")
    if not line.endswith(b"\n"):  # (the first line, read with room for a signature, may be whole)
        while (more := fh.readline(2**20)) and not more.endswith(b"\n"):
            size_of_line += len(more)
        size_of_line += len(more) - more.endswith(b"\n")  # bytes before the newline
    reason = f"line of {size_of_line} bytes is over the limit of {max_line} (--max-line-bytes)"
    return Raw(origin, head, offset=n, refused=reason)


#: What a compressed file begins with (no UTF-8 text does: each holds a byte that cannot start a
#: character, or, for bzip2, a block's magic after its header), and the command that gives its text.
COMPRESSED = (
    (re.compile(re.escape(b"\x1f\x8b")), "gzip", "zcat"),
    (re.compile(re.escape(b"\x28\xb5\x2f\xfd")), "zstd", "zstdcat"),
    (re.compile(b"BZh[1-9](?:" + re.escape(b"\x31\x41\x59\x26\x53\x59") + b"|"
                + re.escape(b"\x17\x72\x45\x38\x50\x90") + b")"), "bzip2", "bzcat"),
    (re.compile(re.escape(b"\xfd7zXZ\x00")), "xz", "xzcat"),
)  # fmt: skip


def text_name(path: str) -> str:
    r"""A file name as text the store can hold (each line's origin, in ``dead_letters``): a name
    is bytes, and one that is not UTF-8 (``caf\xe9.jsonl`` from a Latin-1 system) reaches Python
    with lone surrogates, which no UTF-8 column takes (the first dead letter of such a file was a
    UnicodeEncodeError traceback); its bytes that are not UTF-8 are written ``\xNN``."""
    try:
        raw = os.fsencode(path)  # the name's own bytes (surrogateescape)
    except UnicodeEncodeError:  # a surrogate no byte gave (a name built in Python, not the OS)
        return path.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def open_input(path: str) -> tuple[IO[bytes], str] | str:
    """The file to read (a regular file, a FIFO, a character device or stdin, ``-``) and its
    name, or why not (a regular file that is compressed: its every line would be a dead letter
    for bytes that are not UTF-8)."""
    if path == "-":
        return sys.stdin.buffer, "stdin"
    p = Path(path)
    if p.is_dir():
        return f"{path}: is a directory (give a JSON-lines file, or '-' for stdin)"
    if not p.exists():
        return f"{path}: no such file"
    try:
        if p.is_file():  # (a FIFO's first bytes are not there to look at twice)
            with open(p, "rb") as fh:
                head = fh.read(10)
            for magic, kind, cat in COMPRESSED:
                if magic.match(head):
                    return (
                        f"{path}: is {kind}-compressed: give its text ({cat} {path} | gpuslo ingest --file -)"
                    )
        return open(p, "rb"), text_name(path)
    except OSError as exc:
        return f"{path}: cannot read it: {exc.strerror or exc}"

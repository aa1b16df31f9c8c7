"""Bytes <-> messages. JSON (one object per message; the same bytes are one line of a
JSON-lines replay file). The choice is measured by ``python -m bench encode``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from gpuslo.wire.bounds import TS_MAX, TS_MIN
from gpuslo.wire.models import KINDS, WIRE_VERSION, Message

_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


class WireError(ValueError):
    """A message that cannot be accepted; ``reason`` is short and meant for a dead-letter row."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode(msg: Message) -> bytes:
    """Absent optional parts (``mig`` of a whole GPU) are left out rather than sent as null."""
    return msg.__pydantic_serializer__.to_json(msg, exclude_none=True)


def decode(raw: bytes | str) -> Message:
    """Validate one message. Raises :class:`WireError` with a reason; never guesses.

    Strict: the wire is a machine contract, so no coercion (``"yes"`` is not a boolean,
    ``"10"`` is not a number); an integer is accepted where a float is expected, as JSON
    does not tell them apart."""
    try:
        return _ADAPTER.validate_json(raw, strict=True)
    except ValidationError as exc:
        raise WireError(_explain(raw, exc)) from None


def _explain(raw: bytes | str, exc: ValidationError) -> str:
    if isinstance(raw, bytes | bytearray):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:  # (orjson would say "surrogates not allowed" of any)
            return f"not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} ({e.reason})"
    try:
        obj: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return f"not JSON: {e}"
    if not isinstance(obj, dict):
        return f"not a JSON object: {type(obj).__name__}"
    v = obj.get("v", WIRE_VERSION)  # absent: the models' default, the one version
    if type(v) is not int or v != WIRE_VERSION:  # true and 1.0 are equal to 1, and no version
        return f"unsupported wire version {v!r} (supported: {WIRE_VERSION})"
    kind = obj.get("kind")
    if kind not in KINDS:
        return f"unknown kind {kind!r} (known: {', '.join(KINDS)})"
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        loc = ".".join(str(p) for p in err["loc"][1:]) or "<root>"
        parts.append(f"{loc}: {err['msg']}{_hint(loc, err.get('input'))}")
    more = exc.error_count() - len(parts)
    return f"invalid {kind}: " + "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _hint(loc: str, value: Any) -> str:
    """Say what an out-of-range time most likely is."""
    if loc != "ts" or isinstance(value, bool) or not isinstance(value, (int, float)):
        return ""
    if TS_MIN <= value / 1000 <= TS_MAX:
        at = datetime.fromtimestamp(value / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return (
            f" ({value!r} looks like milliseconds: as seconds it would be {at}; the wire takes epoch seconds)"
        )
    if TS_MIN <= value / 1e6 <= TS_MAX:
        return f" ({value!r} looks like microseconds; the wire takes epoch seconds)"
    if value > TS_MAX:
        return " (the store's time columns end in 2106)"
    return ""

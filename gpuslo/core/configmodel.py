"""The base of every model a user's config file is read into (the service config, the rules
config and its ``reclaim:`` and ``whatif:`` sections): frozen, unknown keys rejected, every
float finite, and no boolean where a number goes.

pydantic's lax mode reads ``true`` as 1 and ``false`` as 0 for an int, a float or a Decimal:
``idle_threshold: true`` made every sample idle, ``min_requests: false`` let 0 requests page,
``linger_ms: true`` was 1 ms, all without a word. A boolean is refused in every numeric field,
inside lists, tuples and mappings of numbers too (``buckets_ms: [1, true]``,
``queue_threshold_s: {debug: true}``).
"""

from __future__ import annotations

import types
from decimal import Decimal
from functools import cache
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_NUMBERS = (int, float, Decimal)


@cache
def _numeric(tp: Any) -> bool:
    """Whether a value of type ``tp`` may be a number (and no boolean): a number type, or a
    union with one and without ``bool``."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _numeric(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        arms = get_args(tp)
        return bool not in arms and any(_numeric(a) for a in arms)
    return isinstance(tp, type) and issubclass(tp, _NUMBERS) and not issubclass(tp, bool)


def bool_where_number(tp: Any, value: Any, where: str = "") -> str | None:
    """The place (``''`` for the value itself, ``[2]`` or ``['debug']`` within it) of a boolean
    given where ``tp`` takes a number; None when there is none."""
    origin = get_origin(tp)
    if origin is Annotated:
        return bool_where_number(get_args(tp)[0], value, where)
    if isinstance(value, bool):
        return where if _numeric(tp) else None
    args = get_args(tp)
    if origin is Union or origin is types.UnionType:
        for arm in args:  # the first arm that finds one (an arm of another shape finds none)
            found = bool_where_number(arm, value, where)
            if found is not None:
                return found
        return None
    if origin in (tuple, list, set, frozenset) and isinstance(value, list | tuple):
        items = args[:1] * len(value) if origin is not tuple or (len(args) == 2 and args[1] is ...) else args
        for i, (item_tp, item) in enumerate(zip(items, value, strict=False)):
            found = bool_where_number(item_tp, item, f"{where}[{i}]")
            if found is not None:
                return found
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        for k, item in value.items():
            found = bool_where_number(args[1], item, f"{where}[{k!r}]")
            if found is not None:
                return found
    return None


class ConfigModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        where = bool_where_number(field.annotation, value)
        if where is not None:
            raise ValueError(f"{where + ': ' if where else ''}a number is wanted, not a boolean (true/false)")
        return value

"""Reading a user's YAML file: every way it can be wrong is a message naming the file, never
a traceback (not UTF-8, not YAML, nested too deep, unreadable).

libyaml (PyYAML's C loader) is used when present: it parses about four times faster than the
pure-Python loader and refuses nesting deeper than 1,000 levels with a clean error; without
it the pure-Python loader's ``RecursionError`` is turned into the same kind of message.
The cycle collector is paused while a document is built (it found nothing to free and took
about half of a large config's load).
"""

from __future__ import annotations

import gc
import math
import re
import unicodedata
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gpuslo.core.fileio import NotARegularFile, read_regular

M = TypeVar("M", bound=BaseModel)

# the safe loaders only: no Python object construction from a user's file
_SAFE: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_BOOL = "tag:yaml.org,2002:bool"
_MERGE = "tag:yaml.org,2002:merge"
_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_NULL = "tag:yaml.org,2002:null"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"


class _Loader(_SAFE):  # type: ignore[misc,valid-type]
    """The safe loader with YAML 1.2's booleans and numbers (below): ``true`` and ``false`` alone. YAML 1.1 (PyYAML)
    also reads ``on``/``off``/``yes``/``no`` unquoted as booleans: ``mode: on`` reached a field of
    words as ``True``, and ``mode: yes`` could be taken for ``on``. A boolean field still takes
    those words (the models read ``"yes"`` as true), a field of words gets the word written.

    A key written twice in one mapping is an error (YAML forbids it; PyYAML kept the last one
    silently: ``slos:`` given twice dropped the first list of SLOs, a threshold set twice took
    whichever came last). A merge (``<<: *base``) may still be overridden by a key of its own."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            self._unique_keys(node)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # a mapping merged into another is flattened in place (its merges replaced by the keys
        # they bring) when that one is read, which may come first: its own keys are checked here,
        # before, never the flattened ones (a merged key and its override are no duplicate)
        # PyYAML 6.0.4 keeps a merged key's first pair by the identity of its text: a merged
        # mapping flattened before (its merged key, then its own override) gave the merged value,
        # and of ``<<: [*a, *b]`` a long key (a distinct string) took b's. Here the first merged
        # mapping wins, a key of the mapping's own over all, and a flattened mapping holds each
        # key once (the pair construct_mapping keeps: the last).
        self._unique_keys(node)
        merged: list[list[tuple[yaml.Node, yaml.Node]]] = []
        own: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE:
                if key_node.tag == "tag:yaml.org,2002:value":
                    key_node.tag = "tag:yaml.org,2002:str"
                own.append((key_node, value_node))
                continue
            subs = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for sub in subs:
                if not isinstance(sub, yaml.MappingNode):
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"expected a mapping or list of mappings for merging, but found {sub.id}", sub.start_mark,
                    )  # fmt: skip
                self.flatten_mapping(sub)
                merged.append(sub.value)
        if not merged:
            return
        pairs = [pair for sub in reversed(merged) for pair in sub] + own
        last: dict[Any, int] = {}
        for i, (key_node, _) in enumerate(pairs):
            try:
                last[self.construct_object(key_node, deep=True)] = i
            except TypeError:  # unhashable: the loader's own error says so
                last[object()] = i
        node.value = [pairs[i] for i in sorted(last.values())]

    def _unique_keys(self, node: yaml.MappingNode) -> None:
        """A key written twice among ``node``'s own keys raises; each mapping is checked once,
        at its first sight, before any flattening. A plain key that reads as a number or a
        boolean is first made the text written (:func:`_text_keys`)."""
        checked: set[int] = self.__dict__.setdefault("_checked", set())
        if id(node) in checked:
            return
        checked.add(id(node))
        _text_keys(node)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                again = key in seen
            except TypeError:  # unhashable: the loader's own error says so
                continue
            if again:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the key {str(key)[:100]!r} twice (the first at line {_first_line(node, key, self)})",
                    key_node.start_mark,
                )  # fmt: skip
            seen.add(key)


_KEY_AS_TEXT = frozenset({_INT, _FLOAT, _BOOL})


def _text_keys(node: yaml.MappingNode) -> None:
    """Each plain key of ``node`` that reads as a number or a boolean is the text written: every
    key of a config is a name (a Slurm partition ``2024`` or ``0600``, a queue ``1e3``), and as a
    number it was refused as "not a valid string" naming ``600``, not the ``0600`` written, and
    ``0600`` and ``600`` were one key. The key's node is replaced, not retagged: an anchored
    scalar may also be a value, which stays a number."""
    for i, (key_node, value_node) in enumerate(node.value):
        if (
            isinstance(key_node, yaml.ScalarNode) and not key_node.style and key_node.tag in _KEY_AS_TEXT
        ):  # plain: None, or "" from libyaml
            text = yaml.ScalarNode(
                _STR, key_node.value, key_node.start_mark, key_node.end_mark, key_node.style
            )
            node.value[i] = (text, value_node)


def _first_line(node: yaml.MappingNode, key: Any, loader: Any) -> int:
    """The line (1-based) of ``key``'s first occurrence in ``node``."""
    for key_node, _ in node.value:
        if key_node.tag != _MERGE and loader.construct_object(key_node, deep=True) == key:
            return int(key_node.start_mark.line) + 1
    return 0


# YAML 1.2's core schema for what a plain scalar is: true/false, and numbers written as numbers.
# YAML 1.1 (PyYAML) read ``010`` and ``0777`` as octal (8, 511), ``1:30`` and ``12:30:00`` as
# base 60 (90, 45000), ``0b101`` as binary, ``1_000`` as 1000 and ``2026-12-07`` as a date, and
# ``1e3`` as text (no dot): a threshold written ``0600`` was taken as 384 s, silently. Here
# ``010`` is 10, ``1e3`` is 1000.0, ``0o17`` and ``0x1F`` are octal and hex, and the rest is
# text, which a number field refuses, naming the key (``1:30``: write 90).
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_12 = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_BOOL_12 = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_NULL_12 = ("", "~", "null", "Null", "NULL")
# Python's int() refuses a decimal of more than 4,300 digits (and str() an integer that long):
# every integer is held to that, in any base (a hex key of 5,000 digits failed the message naming it)
_MAX_DIGITS = 4300
_SPACE = re.compile(r"\s")
_INT_LIMIT = 10**_MAX_DIGITS


def _written(loader: yaml.SafeLoader, node: yaml.ScalarNode, what: str) -> str:
    """The scalar's text, ASCII with no space: an explicit tag takes YAML 1.2's forms (and
    ``_`` between digits), not all that Python's int() and float() read (``!!int ' 12 '``,
    ``!!int ١٢``, ``!!float infinity`` were 12, 12 and inf)."""
    text = str(loader.construct_scalar(node))
    if not text.isascii() or _SPACE.search(text):
        raise yaml.constructor.ConstructorError(None, None, f"{_short(text)} is not {what}", node.start_mark)
    return text


def _short(text: str) -> str:
    return repr(text) if len(text) <= 50 else f"{text[:40]!r}... ({len(text):,} characters)"


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 integer: decimal (leading zeros are decimal), ``0o`` octal, ``0x`` hex. An
    ``!!int`` written by hand that is none of these is the loader's error, not a traceback."""
    text = _written(loader, node, "an integer")
    try:
        if text[:2] in ("0o", "0x"):
            value = int(text[2:], 8 if text[1] == "o" else 16)
        elif len(text.lstrip("+-")) > _MAX_DIGITS and text.lstrip("+-").replace("_", "").isdigit():
            value = _INT_LIMIT  # int() would refuse it: "Exceeds the limit (4300 digits)"
        else:
            value = int(text, 10)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{_short(text)} is not an integer", node.start_mark
        ) from None
    if abs(value) >= _INT_LIMIT:
        raise yaml.constructor.ConstructorError(
            None, None, f"{_short(text)} is an integer of more than {_MAX_DIGITS:,} digits", node.start_mark
        )
    return value


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    """A YAML 1.2 float (``.inf``, ``-.inf`` and ``.nan`` in any of their three spellings). A
    finite number too large for a float is refused, not read as infinity (``1e99999``), and one
    too small, not as 0 (``1e-400``)."""
    text = _written(loader, node, "a number")
    special = text.lower().lstrip("+")
    if special in (".inf", "-.inf", ".nan"):
        return float(special.replace(".", ""))
    if not _FLOAT_12.match(text.replace("_", "")):
        raise yaml.constructor.ConstructorError(
            None, None, f"{_short(text)} is not a number", node.start_mark
        )
    try:
        value = float(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{_short(text)} is not a number", node.start_mark
        ) from None
    mantissa = re.split("[eE]", text)[0]
    if math.isinf(value) or (value == 0 and mantissa.strip("+-.0_")):
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"{_short(text)} is out of a number's range (about 1e-308 to 1.8e308)",
            node.start_mark,
        )
    return value


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    """``!!bool`` of YAML 1.2's words only (``!!bool maybe`` was a KeyError traceback, ``!!bool
    yes`` true as YAML 1.1 read it)."""
    text = str(loader.construct_scalar(node))
    if text not in _BOOL_12:
        raise yaml.constructor.ConstructorError(
            None, None, f"{_short(text)} is not a boolean (true or false)", node.start_mark
        )
    return _BOOL_12[text]


def _construct_null(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> None:
    """``!!null`` of YAML 1.2's forms only (``!!null x`` dropped the ``x``)."""
    text = str(loader.construct_scalar(node))
    if text not in _NULL_12:
        raise yaml.constructor.ConstructorError(None, None, f"{_short(text)} is not null", node.start_mark)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT, _TIMESTAMP)]
    for first, resolvers in _SAFE.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(f"^(?:{'|'.join(_BOOL_12)})$"), list("tTfF"))
_Loader.add_implicit_resolver(_INT, _INT_12, list("-+0123456789"))  # before the float: ``1`` is both
_Loader.add_implicit_resolver(_FLOAT, _FLOAT_12, list("-+.0123456789"))
# what a config holds: text, numbers, booleans, null, lists and mappings. The rest of the safe
# loader's tags are refused as unknown (no field takes them, and their constructors raised
# tracebacks: ``!!timestamp xyz`` an AttributeError, ``!!timestamp 2026-13-45`` a ValueError;
# ``!!binary '***'`` was b'' silently)
_Loader.yaml_constructors = {
    tag: fn for tag, fn in _SAFE.yaml_constructors.items()
    if tag in (_STR, "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map", None)
}  # fmt: skip
_Loader.add_constructor(_INT, _construct_int)
_Loader.add_constructor(_FLOAT, _construct_float)
_Loader.add_constructor(_BOOL, _construct_bool)
_Loader.add_constructor(_NULL, _construct_null)
_LOADER: type[yaml.SafeLoader] = _Loader


def _yaml_12(text: str, origin: str, error: type[Exception]) -> None:
    """A document that says ``%YAML 1.1`` (or 1.0) is refused: its author meant YAML 1.1's
    numbers and booleans (``0600`` octal 384, ``on`` true), which this loader does not read;
    it read them as YAML 1.2's without a word. ``%YAML 1.2`` and no directive are read."""
    for event in yaml.parse(text, Loader=_SAFE):
        if isinstance(event, yaml.DocumentStartEvent):
            if event.version is not None and event.version < (1, 2):
                raise error(
                    f"{origin}: the document says %YAML {event.version[0]}.{event.version[1]}; config files are "
                    "read as YAML 1.2 (0600 is 600, not octal 384; on/yes/no are words): remove the directive "
                    "and check such values, or write %YAML 1.2"
                )
            return


def parse_text(text: str, origin: str, error: type[Exception]) -> Any:
    """``text`` as YAML; a problem raises ``error`` with ``origin`` in its message."""
    paused = gc.isenabled()
    gc.disable()  # the parse builds millions of objects and frees none: the cycle collector only slows it
    try:
        if "%YAML" in text:
            _yaml_12(text, origin, error)
        return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        detail = str(exc).replace('"<unicode string>"', origin)
        raise error(f"{origin}: not valid YAML: {detail}") from None
    except RecursionError:
        raise error(f"{origin}: not valid YAML: nested too deeply") from None
    finally:
        if paused:
            gc.enable()


#: the largest config file read (a rules config of many SLOs and price sheets is kilobytes)
MAX_CONFIG_BYTES = 16 << 20


def load_file(path: str | Path, error: type[Exception]) -> Any:
    """The YAML document in ``path`` (UTF-8; a BOM is accepted); ``error`` on any problem. A
    regular file of at most ``MAX_CONFIG_BYTES`` (``--config /dev/zero`` filled memory into a
    MemoryError traceback, a FIFO blocked for ever)."""
    p = Path(path)
    try:
        raw = read_regular(p, MAX_CONFIG_BYTES, pipes=True)
    except NotARegularFile as exc:
        raise error(f"cannot read: {exc}") from None
    except OSError as exc:
        raise error(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{p}: not UTF-8 text (byte {exc.start}, line {line}: {raw[exc.start : exc.start + 1]!r}); "
            "save the file as UTF-8"
        ) from None
    return parse_text(text, str(p), error)


def key_text(key: Any) -> str:
    """A key of the file as a message names it: as written when it is plain text, else quoted
    with its escapes (``'idle_threshold\\u200b'``, ``''``, ``' x'``): a key with control
    characters wrote them to the terminal raw (an escape sequence retitled or cleared it), and
    one with an invisible character or a trailing space read as the right key refused."""
    text = str(key)
    plain = all(c == " " or unicodedata.category(c)[0] not in "CZ" for c in text)
    if text and plain and text == text.strip():
        return text
    return ascii(text)


def visible(text: str) -> str:
    """``text`` with each control or format character as its escape (a message may quote a
    value of the file: ``duplicate SLO names: ...`` wrote them raw)."""
    return "".join(ascii(c)[1:-1] if unicodedata.category(c)[0] == "C" else c for c in text)


def _quote_hint(error: Any) -> str:
    """For a number where text goes (``queue: [2024, 0600]``): YAML reads unquoted digits as a
    number (``0600`` as 600), so the message says to quote the name."""
    value = error.get("input")
    if error.get("type") == "string_type" and isinstance(value, int | float) and not isinstance(value, bool):
        return " (unquoted digits are a number in YAML: quote text written in digits, '0600' not 0600)"
    return ""


def validate(model: type[M], data: Any, origin: str, error: type[Exception]) -> M:
    """``data`` as a ``model``; every problem one line ``origin: key.path: message``, raised
    together as ``error``. An empty document (``None``) is the model's defaults."""
    try:
        return model.model_validate({} if data is None else data)
    except ValidationError as exc:
        keys = tuple(str(k) for k in data) if isinstance(data, dict) else ()
        lines = [
            f"{origin}: {'.'.join(key_text(x) for x in e['loc']) or '<root>'}: {visible(e['msg'])}{_quote_hint(e)}"
            for e in exc.errors(include_url=False)
        ]
        refusal = error("\n".join(lines))
        refusal.top_keys = keys  # type: ignore[attr-defined]  # the document's own (cli: which kind of file)
        raise refusal from None


def top_keys(exc: Exception) -> tuple[str, ...]:
    """The top-level keys of the document ``exc`` (raised by :func:`validate`) refused; ``()``
    for another error."""
    keys: tuple[str, ...] = getattr(exc, "top_keys", ())
    return keys


def load_model(path: str | Path, model: type[M], error: type[Exception]) -> M:
    """The YAML file ``path`` as a ``model`` (:func:`load_file`, then :func:`validate`)."""
    return validate(model, load_file(path, error), str(path), error)

"""A ClickHouse server reached with clickhouse-driver (native protocol).

The same DDL and the same ``{name:Type}`` SQL as the embedded store: parameters are
bound as typed literals (``CAST(literal AS Type)``) here, escaped by ingest.sqltext (the one
escaping function of both stores), because the native protocol driver substitutes
client-side."""

from __future__ import annotations

import contextlib
import gc
import itertools
import numbers
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, date, datetime
from typing import Any

from gpuslo.core.settings import ClickHouseSettings, SettingsError, ca_bundle
from gpuslo.ingest.failures import Failure, StoreError, classify_code, code_name
from gpuslo.ingest.schema import Schema, column_types
from gpuslo.ingest.sqltext import SKIP, literal
from gpuslo.ingest.store import Row, Store

# a parameter, or a quoted string / identifier / comment to step over (sqltext.SKIP: text inside
# a literal is never a parameter, and a quote in a comment opens no literal)
_PARAM = re.compile(SKIP + r"\{(\w+):([^{}]+)\}", re.S)


def classify(exc: BaseException) -> tuple[Failure, int | None]:
    """The class of a clickhouse-driver failure: the network and the server's own code."""
    from clickhouse_driver import errors

    code = getattr(exc, "code", None)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return Failure.FATAL, None  # a certificate we do not trust will not become trusted
    # the connection, not the data: the network, or a connection left mid-query (code -1)
    if isinstance(exc, (OSError, EOFError, errors.NetworkError, errors.SocketTimeoutError,
                        errors.PartiallyConsumedQueryError)):  # fmt: skip
        return Failure.TRANSIENT, code
    if isinstance(exc, errors.Error) and isinstance(code, int):
        return classify_code(code), code
    return Failure.REFUSED, None  # building the columns (a value the driver cannot encode)


def _describe(exc: BaseException) -> str:
    """One line: the driver's message without its stack trace."""
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split("Stack trace:")[0].split())[:1000]


def bind(sql: str, params: Mapping[str, Any] | None) -> str:
    """Replace ``{name:Type}`` by ``CAST(literal AS Type)``; a missing parameter is an error."""
    if not params:
        return sql

    def one(m: re.Match[str]) -> str:
        name, typ = m.group(1), m.group(2)
        if name is None:  # a literal: as it is
            return m.group(0)
        if name not in params:
            raise StoreError(f"query parameter {name!r} is not given")
        try:
            return f"CAST({literal(params[name])} AS {typ})"
        except (TypeError, ValueError) as exc:  # a value no literal writes; text that is not UTF-8
            raise StoreError(f"query parameter {name!r}: {exc}") from None

    return _PARAM.sub(one, sql)


_pause_lock = threading.Lock()
_paused = 0  # writers inside collector_paused()
_was_enabled = True  # the collector's state when the first of them came in


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a batch is turned into Python values and sent.

    The driver takes a column as a Python list (a list per row for an Array column): a batch of
    40,000 GPU rows is some 800,000 new objects, none in a cycle, all freed by reference counting
    once the insert returns. Made with the collector on, they set off young collections and, as
    they pile up, full ones over the whole heap: 22 % of an ingest process's CPU into the server
    (``bench scaleout`` counts the collector's time per process). Re-enabled as it was found."""
    global _paused, _was_enabled
    with _pause_lock:  # several threads may write at once: the first in pauses, the last out restores
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _pause_lock:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                gc.enable()


# What clickhouse-driver takes for a column of each type (its columns' ``py_types``): a column of
# the server whose type takes none of the values the store sends no longer matches the schema (its
# type was changed). The driver would refuse every value (``TYPE_MISMATCH``, or an AttributeError
# of its own), and refused values are isolated message by message: every message of every batch
# would become a dead letter. Types not listed here are not checked.
_TAKES: tuple[tuple[re.Pattern[str], tuple[type, ...]], ...] = (
    (re.compile(r"U?Int(?:8|16|32|64|128|256)|Bool"), (numbers.Integral,)),  # numpy's integers too
    (re.compile(r"Float(?:32|64)"), (numbers.Real,)),
    (re.compile(r"String|FixedString\(\d+\)"), (str, bytes)),
    (re.compile(r"DateTime(?:64)?(?:\(.*\))?"), (datetime,)),
    (re.compile(r"Date(?:32)?"), (date,)),
)
_WRAPPED = re.compile(r"(?:LowCardinality|Nullable)\((.*)\)")
_ARRAY = re.compile(r"Array\((.*)\)")
MISFIT_LOOK = 64


def _nullable(typ: str) -> bool:
    lc = re.fullmatch(r"LowCardinality\((.*)\)", typ)
    return (lc.group(1) if lc else typ).startswith("Nullable(")


def misfit(typ: str, values: Iterable[Any]) -> str | None:
    """The Python type of the values that a column of type ``typ`` cannot take, judged by the
    first value that tells (not None; in an array, its first element) among the first
    ``MISFIT_LOOK`` (an insert's hot path: a column of NULLs is not read through); None where
    they fit or none tells."""
    while m := _WRAPPED.fullmatch(typ):
        typ = m.group(1)
    present = (v for v in itertools.islice(values, MISFIT_LOOK) if v is not None)
    first = next(present, None)
    if first is None:
        return None
    if m := _ARRAY.fullmatch(typ):
        if not isinstance(first, (list, tuple)):
            return type(first).__name__
        elements = (x for v in itertools.chain([first], present) if isinstance(v, (list, tuple)) for x in v)
        inner = misfit(m.group(1), elements)
        return None if inner is None else f"array of {inner}"
    for pattern, takes in _TAKES:
        if pattern.fullmatch(typ):
            return None if isinstance(first, takes) else type(first).__name__
    return None


def _default_client(**kw: Any) -> Any:
    from clickhouse_driver import Client

    return Client(**kw)


class ClickHouseStore(Store):
    """The database is a connection parameter (never ``USE``: the driver would keep the text
    after it, quotes included, as the database it names on every reconnect)."""

    def __init__(
        self, settings: ClickHouseSettings, client_factory: Callable[..., Any] = _default_client
    ) -> None:
        self.settings = settings
        self._factory = client_factory
        self._client = self._connect(settings.database)
        self._types: dict[str, dict[str, str]] = {}
        self._interrupted = threading.Event()  # interrupt(): the failure it causes is TRANSIENT

    def _connect(self, database: str) -> Any:
        """A client (it connects on first use, and again after a failure) on ``database``."""
        s = self.settings
        try:
            password = s.password_value()
            # a CA file that is not there: the driver's "No such file or directory" was a
            # transient network error, retried for ever
            ca = None if s.ca_certs is None else ca_bundle(s.ca_certs, "clickhouse.ca_certs")
        except SettingsError as exc:  # the password's env variable or file is missing
            raise StoreError(f"ClickHouse {s.host}:{s.port}: {exc}", Failure.FATAL) from None
        kw: dict[str, Any] = {
            "host": s.host,
            "port": s.port,
            "database": database,
            "user": s.user,
            "password": password,
            "secure": s.secure,
            "verify": s.verify,
            "connect_timeout": s.connect_timeout_s,
            "send_receive_timeout": s.send_receive_timeout_s,
            "sync_request_timeout": min(5.0, s.send_receive_timeout_s),  # the ping before a query
            "settings": {"use_numpy": False},
        }
        if ca is not None:
            kw["ca_certs"] = str(ca)
        return self._factory(**kw)

    def _exec(self, sql: str, *args: Any, client: Any = None, **kw: Any) -> Any:
        try:
            got = (client or self._client).execute(sql, *args, **kw)
        except Exception as exc:  # network, server, auth: classified here, once
            failure, code = classify(exc)
            if self._interrupted.is_set():  # cut by interrupt() (whatever the driver made of it)
                failure = Failure.TRANSIENT
            raise StoreError(
                f"ClickHouse {self.settings.host}:{self.settings.port} ({failure.value}, "
                f"{code_name(code) if code is not None else type(exc).__name__}): {_describe(exc)}",
                failure,
                code,
            ) from exc
        self._interrupted.clear()
        return got

    def interrupt(self) -> None:
        """Shut the connection's socket down under the operation waiting on it (from another
        thread): its read ends at once, the driver raises and reconnects at the next operation.
        The socket only: the driver's own state is left to the thread that runs the operation."""
        self._interrupted.set()
        sock = getattr(getattr(self._client, "connection", None), "socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def create_database(self) -> None:
        """Over a connection that names no database (the user's default on the server): the
        store's own connection cannot be opened until its database exists."""
        boot = self._connect("")
        try:
            self._exec(f"CREATE DATABASE IF NOT EXISTS `{self.settings.database}`", client=boot)
        finally:
            boot.disconnect()

    def migrate(self, schema: Schema) -> None:
        self.create_database()
        super().migrate(schema)

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self._exec(bind(sql, params))

    def _column_types(self, table: str) -> dict[str, str]:
        t = self._types.get(table)
        if t is None:
            rows = self._exec(
                "SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
                {"db": self.settings.database, "t": table},
            )
            t = {name: typ for name, typ in rows}
            if not t:
                raise StoreError(
                    f"ClickHouse {self.settings.host}:{self.settings.port}: no table {table!r} in database "
                    f"{self.settings.database!r} (run migrate first)",
                    Failure.FATAL,
                )
            self._check_nulls(table, t)
            self._types[table] = t
        return t

    def _check_nulls(self, table: str, types: Mapping[str, str]) -> None:
        """A column that the ingest's schema makes Nullable and the server's table does not (a
        table made by hand): every message without a value for it is refused (a GPU without one
        DCGM field: all of its messages), one by one, each a dead letter. The table does not match
        the schema: FATAL, found when its types are read (the first write to it)."""
        try:
            want = column_types(table)
        except KeyError:  # not one of the ingest's tables
            return
        lost = [c for c, typ in want.items() if c in types and _nullable(typ) and not _nullable(types[c])]
        if lost:
            more = f" (and {len(lost) - 1} more: {', '.join(lost[1:4])}...)" if len(lost) > 1 else ""
            raise StoreError(
                f"ClickHouse {self.settings.host}:{self.settings.port}: column {lost[0]!r} of "
                f"{self.settings.database}.{table} is {types[lost[0]]} on the server, the schema's "
                f"{want[lost[0]]}{more}: a message without a value for it cannot be written (the table "
                "does not match the schema; make it from gpuslo's DDL)",
                Failure.FATAL,
            )

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        if not columns:
            return 0
        types = self._column_types(table)
        with collector_paused():
            try:
                cols = [self._values(types.get(name, ""), values) for name, values in columns.items()]
            except (TypeError, ValueError, OverflowError, OSError) as exc:  # a value no column can hold
                raise StoreError(
                    f"cannot build a columnar batch for {table}: {exc}", Failure.REFUSED
                ) from exc
            n = len(cols[0])
            if n == 0:
                return 0
            for name, values in zip(columns, cols, strict=True):
                if name in types and (bad := misfit(types[name], values)) is not None:
                    del self._types[table]  # read again by the next try (the table repaired)
                    raise StoreError(
                        f"ClickHouse {self.settings.host}:{self.settings.port}: column {name!r} of "
                        f"{self.settings.database}.{table} is {types[name]} on the server, which cannot "
                        f"hold the {bad} values written to it: the table does not match the schema "
                        "(its type was changed); every message would be refused",
                        Failure.FATAL,
                    )
            names = ", ".join(f"`{c}`" for c in columns)
            try:
                self._exec(
                    f"INSERT INTO `{self.settings.database}`.`{table}` ({names}) VALUES", cols, columnar=True
                )
            except StoreError as exc:
                if not exc.retriable:  # the table may have changed under us: its types are read again
                    self._types.pop(table, None)
                raise
            del cols  # freed by reference counting before the collector runs again
        return n

    @staticmethod
    def _values(typ: str, values: Any) -> list[Any]:
        if hasattr(values, "to_pylist"):  # an Arrow column from the writer
            values = values.to_pylist()
        if typ.startswith("DateTime"):
            return [datetime.fromtimestamp(v, UTC) for v in values]
        return list(values)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        rows, cols = self._exec(bind(sql, params), with_column_types=True)
        names = [c[0] for c in cols]
        return [dict(zip(names, r, strict=True)) for r in rows]

    def query_columns(
        self, sql: str, params: Mapping[str, Any] | None = None, names: Sequence[str] | None = None
    ) -> dict[str, list[Any]]:
        data, cols = self._exec(bind(sql, params), with_column_types=True, columnar=True)
        got = [c[0] for c in cols]
        values = data if data else [[] for _ in got]
        return {n: list(v) for n, v in zip(got, values, strict=True) if names is None or n in names}

    def close(self) -> None:
        self._client.disconnect()

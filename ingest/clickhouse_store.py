"""A ClickHouse server reached with clickhouse-driver (native protocol).

The same DDL and the same ``{name:Type}`` SQL as the embedded store: parameters are
bound as typed literals (``CAST(literal AS Type)``) here, escaped by ingest.sqltext (the one
escaping function of both stores), because the native protocol driver substitutes
client-side."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from gpuslo.settings import ClickHouseSettings
from ingest.sqltext import literal
from ingest.store import Row, Store, StoreError

# a parameter, or a quoted string / identifier to step over: text inside a literal is never a parameter
_PARAM = re.compile(r"'(?:[^'\\]|\\.)*'|`(?:[^`\\]|\\.)*`|\{(\w+):([^{}]+)\}", re.S)
# server error codes worth waiting out: memory, too many parts, timeouts, readonly replica, shutdown
_TRANSIENT_CODES = {159, 160, 164, 202, 203, 209, 210, 241, 242, 252, 285, 319, 425, 999}


def _retriable(exc: Exception) -> bool:
    from clickhouse_driver import errors

    if isinstance(exc, (OSError, EOFError, errors.NetworkError, errors.SocketTimeoutError)):
        return True
    code = getattr(exc, "code", None)
    return isinstance(exc, errors.ServerException) and code in _TRANSIENT_CODES


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
        except TypeError as exc:
            raise StoreError(f"query parameter {name!r}: {exc}") from None

    return _PARAM.sub(one, sql)


class ClickHouseStore(Store):
    def __init__(self, settings: ClickHouseSettings, client: Any = None) -> None:
        self.settings = settings
        if client is None:
            from clickhouse_driver import Client

            kw: dict[str, Any] = {
                "host": settings.host,
                "port": settings.port,
                "user": settings.user,
                "password": settings.password_value(),
                "secure": settings.secure,
                "verify": settings.verify,
                "connect_timeout": settings.connect_timeout_s,
                "settings": {"use_numpy": False},
            }
            if settings.ca_certs is not None:
                kw["ca_certs"] = str(settings.ca_certs)
            client = Client(**kw)
        self._client = client
        self._types: dict[str, dict[str, str]] = {}

    def _exec(self, sql: str, *args: Any, **kw: Any) -> Any:
        try:
            return self._client.execute(sql, *args, **kw)
        except Exception as exc:  # network, server, auth: one error type for the callers' retry
            raise StoreError(
                f"ClickHouse {self.settings.host}:{self.settings.port}: {type(exc).__name__}: {exc}",
                retriable=_retriable(exc),
            ) from exc

    def migrate(self) -> None:
        db = self.settings.database
        self._exec(f"CREATE DATABASE IF NOT EXISTS `{db}`")
        self._client.execute(f"USE `{db}`")
        super().migrate()

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
            self._types[table] = t
        return t

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]]) -> int:
        if not columns:
            return 0
        types = self._column_types(table)
        cols = []
        for name, values in columns.items():
            if hasattr(values, "to_pylist"):  # an Arrow column from the writer
                values = values.to_pylist()
            if types.get(name, "").startswith("DateTime"):
                values = [datetime.fromtimestamp(v, UTC) for v in values]
            cols.append(list(values))
        n = len(cols[0])
        if n == 0:
            return 0
        names = ", ".join(f"`{c}`" for c in columns)
        self._exec(f"INSERT INTO `{self.settings.database}`.`{table}` ({names}) VALUES", cols, columnar=True)
        return n

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        rows, cols = self._exec(bind(sql, params), with_column_types=True)
        names = [c[0] for c in cols]
        return [dict(zip(names, r, strict=True)) for r in rows]

    def close(self) -> None:
        self._client.disconnect()

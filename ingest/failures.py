"""What a failed store operation means for the caller, decided once, where it is seen.

Every store (chDB in-process, a ClickHouse server over the native protocol) raises
:class:`StoreError` with one of three classes, and the callers act on the class only:

- ``TRANSIENT``: the store is unreachable, overloaded or restarting; the same write may
  succeed later. Retry with backoff, commit nothing, pause consumption.
- ``REFUSED``: the store refused this data (a value it cannot parse or hold). Isolate the
  message and dead-letter it; the rest of the batch is written.
- ``FATAL``: the deployment is wrong (credentials, a missing database or table, a schema
  the SQL does not match). Retrying cannot help and isolating would dead-letter every
  message: stop with a non-zero exit and let the supervisor restart the process.

The server codes are ClickHouse's ``ErrorCodes`` (the same numbers in chDB's messages).
"""

from __future__ import annotations

import enum
import re

__all__ = ["Failure", "StoreError", "classify_code", "code_in_text", "code_name"]


class Failure(enum.Enum):
    TRANSIENT = "transient"
    REFUSED = "refused"
    FATAL = "fatal"


class StoreError(RuntimeError):
    """A failed store operation with its class (see the module doc)."""

    def __init__(self, message: str, failure: Failure = Failure.REFUSED, code: int | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.code = code

    @property
    def retriable(self) -> bool:
        """The same operation may succeed later (``TRANSIENT``)."""
        return self.failure is Failure.TRANSIENT

    @property
    def fatal(self) -> bool:
        return self.failure is Failure.FATAL

    @property
    def reason(self) -> str:
        """The message without the context a store appends to it for the logs, after a line
        starting with ``-- `` (the query's SQL, the table an insert was for): what a command
        says to its user (a store whose files went away mid-command was 30 lines of SQL)."""
        return str(self).split("\n-- ", 1)[0]


# ClickHouse ErrorCodes.cpp: code -> (name, class). Data as data: a code not listed here is
# REFUSED when it comes with a query (the server understood us and said no to the data).
CODES: dict[int, tuple[str, Failure]] = {
    # the server or the network between: wait it out
    23: ("CANNOT_READ_FROM_ISTREAM", Failure.TRANSIENT),
    24: ("CANNOT_WRITE_TO_OSTREAM", Failure.TRANSIENT),
    32: ("ATTEMPT_TO_READ_AFTER_EOF", Failure.TRANSIENT),
    159: ("TIMEOUT_EXCEEDED", Failure.TRANSIENT),
    160: ("TOO_SLOW", Failure.TRANSIENT),
    173: ("CANNOT_ALLOCATE_MEMORY", Failure.TRANSIENT),
    201: ("QUOTA_EXCEEDED", Failure.TRANSIENT),
    202: ("TOO_MANY_SIMULTANEOUS_QUERIES", Failure.TRANSIENT),
    203: ("NO_FREE_CONNECTION", Failure.TRANSIENT),
    209: ("SOCKET_TIMEOUT", Failure.TRANSIENT),
    210: ("NETWORK_ERROR", Failure.TRANSIENT),
    225: ("NO_ZOOKEEPER", Failure.TRANSIENT),
    236: ("ABORTED", Failure.TRANSIENT),
    241: ("MEMORY_LIMIT_EXCEEDED", Failure.TRANSIENT),
    242: ("TABLE_IS_READ_ONLY", Failure.TRANSIENT),
    243: ("NOT_ENOUGH_SPACE", Failure.TRANSIENT),
    252: ("TOO_MANY_PARTS", Failure.TRANSIENT),
    279: ("ALL_CONNECTION_TRIES_FAILED", Failure.TRANSIENT),
    285: ("TOO_FEW_LIVE_REPLICAS", Failure.TRANSIENT),
    319: ("UNKNOWN_STATUS_OF_INSERT", Failure.TRANSIENT),
    373: ("SESSION_IS_LOCKED", Failure.TRANSIENT),
    394: ("QUERY_WAS_CANCELLED", Failure.TRANSIENT),
    425: ("SYSTEM_ERROR", Failure.TRANSIENT),
    439: ("CANNOT_SCHEDULE_TASK", Failure.TRANSIENT),
    999: ("KEEPER_EXCEPTION", Failure.TRANSIENT),
    # the server's own files (a full or failing disk, a file system remounted read-only:
    # errno 28 on an insert is code 75 on 18.16), sockets and protocol state: not the data
    40: ("CHECKSUM_DOESNT_MATCH", Failure.TRANSIENT),  # a block corrupted in transit or on disk
    74: ("CANNOT_READ_FROM_FILE_DESCRIPTOR", Failure.TRANSIENT),
    75: ("CANNOT_WRITE_TO_FILE_DESCRIPTOR", Failure.TRANSIENT),
    76: ("CANNOT_OPEN_FILE", Failure.TRANSIENT),
    77: ("CANNOT_CLOSE_FILE", Failure.TRANSIENT),
    87: ("CANNOT_SEEK_THROUGH_FILE", Failure.TRANSIENT),
    88: ("CANNOT_TRUNCATE_FILE", Failure.TRANSIENT),
    95: ("CANNOT_READ_FROM_SOCKET", Failure.TRANSIENT),
    96: ("CANNOT_WRITE_TO_SOCKET", Failure.TRANSIENT),
    100: ("UNKNOWN_PACKET_FROM_SERVER", Failure.TRANSIENT),
    102: ("UNEXPECTED_PACKET_FROM_SERVER", Failure.TRANSIENT),
    172: ("CANNOT_CREATE_DIRECTORY", Failure.TRANSIENT),
    204: ("CANNOT_FSYNC", Failure.TRANSIENT),
    214: ("CANNOT_STATVFS", Failure.TRANSIENT),
    1000: ("POCO_EXCEPTION", Failure.TRANSIENT),  # Poco's file and network errors ("File is read-only")
    # the deployment: credentials, database, schema, a server too old for the SQL
    8: ("THERE_IS_NO_COLUMN", Failure.FATAL),
    10: ("NOT_FOUND_COLUMN_IN_BLOCK", Failure.FATAL),
    16: ("NO_SUCH_COLUMN_IN_TABLE", Failure.FATAL),
    46: ("UNKNOWN_FUNCTION", Failure.FATAL),
    47: ("UNKNOWN_IDENTIFIER", Failure.FATAL),
    48: ("NOT_IMPLEMENTED", Failure.FATAL),
    50: ("UNKNOWN_TYPE", Failure.FATAL),
    60: ("UNKNOWN_TABLE", Failure.FATAL),
    62: ("SYNTAX_ERROR", Failure.FATAL),
    73: ("UNKNOWN_FORMAT", Failure.FATAL),
    81: ("UNKNOWN_DATABASE", Failure.FATAL),
    115: ("UNKNOWN_SETTING", Failure.FATAL),
    164: ("READONLY", Failure.FATAL),
    192: ("UNKNOWN_USER", Failure.FATAL),
    193: ("WRONG_PASSWORD", Failure.FATAL),
    194: ("REQUIRED_PASSWORD", Failure.FATAL),
    195: ("IP_ADDRESS_NOT_ALLOWED", Failure.FATAL),
    291: ("DATABASE_ACCESS_DENIED", Failure.FATAL),
    497: ("ACCESS_DENIED", Failure.FATAL),
    516: ("AUTHENTICATION_FAILED", Failure.FATAL),
    # the data (listed for the reader; any other code is REFUSED as well)
    6: ("CANNOT_PARSE_TEXT", Failure.REFUSED),
    27: ("CANNOT_PARSE_INPUT_ASSERTION_FAILED", Failure.REFUSED),
    41: ("CANNOT_PARSE_DATETIME", Failure.REFUSED),
    53: ("TYPE_MISMATCH", Failure.REFUSED),
    69: ("ARGUMENT_OUT_OF_BOUND", Failure.REFUSED),
    70: ("CANNOT_CONVERT_TYPE", Failure.REFUSED),
    72: ("CANNOT_PARSE_NUMBER", Failure.REFUSED),
    117: ("INCORRECT_DATA", Failure.REFUSED),
    131: ("TOO_LARGE_STRING_SIZE", Failure.REFUSED),
    190: ("SIZES_OF_ARRAYS_DONT_MATCH", Failure.REFUSED),
    321: ("VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE", Failure.REFUSED),
    349: ("CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN", Failure.REFUSED),
}

_CODE = re.compile(r"\bCode:\s*(\d+)")


def classify_code(code: int | None) -> Failure:
    """The class of a ClickHouse error code; an unknown code is the data refused."""
    if code is None:
        return Failure.REFUSED
    entry = CODES.get(code)
    return entry[1] if entry is not None else Failure.REFUSED


def code_in_text(text: str) -> int | None:
    """The ``Code: N`` of a ClickHouse exception message (chDB raises text only)."""
    m = _CODE.search(text)
    return int(m.group(1)) if m else None


def code_name(code: int | None) -> str:
    if code is None:
        return "no code"
    entry = CODES.get(code)
    return f"code {code}" + (f" {entry[0]}" if entry else "")

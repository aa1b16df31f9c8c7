"""The value ranges of the store's column types, as the wire needs them.

Every numeric field of a wire message is bounded by the column it lands in: a value the
store cannot hold is refused by the model with a reason, never discovered by an overflow
while the ingest builds its columns. The wire does not import the ingest (it sits below
it), so the ranges live here and ``tests/test_bounds.py`` walks every numeric field of every
model to its column in ``ingest/schema.py`` and checks that the model's bounds fit the
column's type: a new field or column cannot forget.
"""

from __future__ import annotations

#: Integer column types: (min, max).
INT_RANGES: dict[str, tuple[int, int]] = {
    "UInt8": (0, 2**8 - 1),
    "UInt16": (0, 2**16 - 1),
    "UInt32": (0, 2**32 - 1),
    "UInt64": (0, 2**64 - 1),
    "Int16": (-(2**15), 2**15 - 1),
    "Int32": (-(2**31), 2**31 - 1),
    "Int64": (-(2**63), 2**63 - 1),
}
UINT32_MAX = INT_RANGES["UInt32"][1]
UINT64_MAX = INT_RANGES["UInt64"][1]

#: The largest finite Float32 (the bound of a Float32 column).
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest positive normal Float32: the least value a field that must be positive (a share,
#: an interval, a MIG instance's fraction) may take, as its Float32 column stores anything much
#: smaller as 0 (a share of 1e-46 was stored as 0, and a holder's activity on what it holds,
#: activity x activity_share / share, read 0 / 0: NaN active GPU-hours in the job report).
FLOAT32_MIN_POSITIVE = 1.1754943508222875e-38

#: ``DateTime`` (32-bit seconds) ends 2106-02-07T06:28:15Z. Raw rows are ``DateTime64(3)``,
#: but the rollups key them by a ``DateTime`` minute, so a message time must leave room for
#: its interval and the next minute before that end.
DATETIME_MAX = 2**32 - 1
#: ``Date`` (16-bit days since 1970) ends 2149-06-06: partitions and TTLs are computed as dates.
DATE_MAX_DAYS = 2**16 - 1

#: Message times: 2000-01-01 .. 2106-01-01 (anything outside is a unit error or garbage).
TS_MIN = 946_684_800.0
TS_MAX = 4_291_747_200.0

#: Lengths of the lists a message carries (a message is at most a node's tick).
MAX_GPU_ROWS = 1024  # rows of one gpu_samples message: GPUs and their MIG instances
MAX_ALLOCATIONS = 64  # holders of one GPU
MAX_BUCKETS = 1024  # finite histogram bounds of one latency message
MAX_COUNT = 10**12  # requests in one histogram bucket: the sum over MAX_BUCKETS + 1 fits UInt64
MAX_ASSIGNED_NODES = 100_000

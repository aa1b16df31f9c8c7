"""The wire schema: what crosses Kafka between agents, collectors and the ingest."""

from gpuslo.wire.codec import WireError, decode, encode
from gpuslo.wire.fields import ACTIVITY_FIELD, BY_NAME, FIELDS, UTIL_FIELD, Field, activity
from gpuslo.wire.models import (
    KINDS,
    MAX_INTERVAL_S,
    SHARE_SOURCES,
    WIRE_VERSION,
    Allocation,
    GpuSample,
    GpuSampleBatch,
    HealthEvent,
    LatencyDelta,
    Message,
    MigInstance,
    NodeHeartbeat,
    SchedulerEvent,
)

__all__ = [
    "ACTIVITY_FIELD",
    "BY_NAME",
    "FIELDS",
    "KINDS",
    "MAX_INTERVAL_S",
    "SHARE_SOURCES",
    "UTIL_FIELD",
    "WIRE_VERSION",
    "Allocation",
    "Field",
    "GpuSample",
    "GpuSampleBatch",
    "HealthEvent",
    "LatencyDelta",
    "Message",
    "MigInstance",
    "NodeHeartbeat",
    "SchedulerEvent",
    "WireError",
    "activity",
    "decode",
    "encode",
]

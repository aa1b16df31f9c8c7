from __future__ import annotations

import re

import orjson
import pytest

from gpuslo.agent.sim.fleet import Fleet, SimConfig
from gpuslo.agent.sim.sources import sim_sources
from gpuslo.ingest.schema import INGEST_SCHEMA
from gpuslo.wire import FIELDS, KINDS, GpuSampleBatch, WireError, decode, encode
from tests import helpers as h


def all_kinds() -> list[object]:
    return [
        h.batch("n1", h.T0, [h.gpu(0, 0.5, (("7", 0.5), ("8", 0.25))), h.gpu(1, None, healthy=False)]),
        h.heartbeat("n1", h.T0, True),
        h.sched("submit", "7", h.T0, gpn=0.5),
        h.latency(h.T0, 10, 1),
        __import__("gpuslo.wire", fromlist=["HealthEvent"]).HealthEvent(
            **h.env(), node="n1", gpu=3, event="xid", code=79, fatal=True, message="fell off the bus"
        ),
    ]


@pytest.mark.parametrize("msg", all_kinds(), ids=lambda m: m.kind)  # type: ignore[attr-defined]
def test_round_trip_every_kind(msg: object) -> None:
    raw = encode(msg)  # type: ignore[arg-type]
    assert b"\n" not in raw  # one message = one JSON line
    assert decode(raw) == msg
    assert orjson.loads(raw)["v"] == 1


def test_every_kind_is_covered() -> None:
    assert sorted(m.kind for m in all_kinds()) == sorted(KINDS)  # type: ignore[attr-defined]


def _mutate(raw: bytes, path: list[object], value: object) -> bytes:
    obj = orjson.loads(raw)
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return orjson.dumps(obj)


GOOD = encode(h.batch("n1", h.T0, [h.gpu(0, 0.5, (("7", 1.0),))]))


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", r"^not JSON"),
        (
            GOOD.replace(b'"n1"', b'"n\xff1"', 1),
            r"^not UTF-8: byte 0xff at offset \d+ \(invalid start byte\)",
        ),
        (GOOD.replace(b'"n1"', b'"n\xed\xa0\x801"', 1), r"^not UTF-8: byte 0xed at offset"),  # a surrogate
        (b"[1, 2]", r"^not a JSON object: list"),
        (_mutate(GOOD, ["v"], 2), r"^unsupported wire version 2 \(supported: 1\)"),
        (_mutate(GOOD, ["v"], "1"), r"^unsupported wire version '1'"),
        (_mutate(GOOD, ["v"], True), r"^unsupported wire version True"),  # equal to 1 in Python
        (_mutate(GOOD, ["v"], 1.0), r"^unsupported wire version 1\.0"),
        (_mutate(GOOD, ["v"], None), r"^unsupported wire version None"),
        (_mutate(GOOD, ["kind"], "gpu_sample"), r"^unknown kind 'gpu_sample'"),
        (_mutate(GOOD, ["gpus", 0, "fields", "DCGM_FI_DEV_POWER_USAGE"], -5.0), r"POWER_USAGE=-5.0 outside"),
        (
            _mutate(GOOD, ["gpus", 0, "fields", "DCGM_FI_DEV_GPU_UTIL"], 1e12),
            r"GPU_UTIL=1000000000000.0 outside",
        ),
        (
            _mutate(GOOD, ["gpus", 0, "fields", "DCGM_FI_DEV_NOT_A_FIELD"], 1.0),
            r"unknown field 'DCGM_FI_DEV_NOT_A_FIELD'",
        ),
        (
            _mutate(GOOD, ["gpus", 0, "allocations", 0, "share"], 1.5),
            r"share: Input should be less than or equal to 1",
        ),
        (_mutate(GOOD, ["ts"], h.T0 * 1000), r"^invalid gpu_samples: ts:"),  # milliseconds, not seconds
        (_mutate(GOOD, ["interval_s"], 0), r"interval_s"),
        (_mutate(GOOD, ["surprise"], 1), r"surprise: Extra inputs are not permitted"),
    ],
)
def test_rejections_name_the_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(WireError) as ei:
        decode(raw)
    assert re.search(reason, ei.value.reason), ei.value.reason


def test_allocations_on_one_gpu_cannot_exceed_one_gpu() -> None:
    with pytest.raises(ValueError, match=r"hold 1\.5 > 1 GPU"):
        h.gpu(0, 0.1, (("a", 1.0), ("b", 0.5)))


def test_the_rows_of_one_gpu_cannot_stand_for_more_than_one_gpu() -> None:
    # Capacity counts a row's fraction of its physical GPU; the rows of one GPU (its MIG
    # instances and the device row) add up to at most 1: two 4g instances of 7 slices
    # (8/7), or a whole device row next to an instance (1 + 3/7), would be capacity no GPU has.
    from gpuslo.wire import GpuSample, MigInstance

    def mig(gi: int, frac: float) -> GpuSample:
        return GpuSample(index=0, uuid=f"MIG-{gi}", fraction=frac, mig=MigInstance(gi=gi, profile="4g.40gb"))

    for rows in ([mig(1, 4 / 7), mig(2, 4 / 7)], [GpuSample(index=0, uuid="GPU-0"), mig(1, 3 / 7)]):
        with pytest.raises(ValueError, match=r"rows of GPU 0 stand for 1\.1?[0-9]* > 1 GPU"):
            h.batch("n", h.T0, rows)
    # what the agent sends for a partitioned GPU: 3/7 + 4/7 (+ the device row's 0) = 1: accepted
    ok = [GpuSample(index=0, uuid="GPU-0", fraction=0.0), mig(1, 3 / 7), mig(2, 4 / 7)]
    assert len(h.batch("n", h.T0, [*ok, GpuSample(index=1, uuid="GPU-1")]).gpus) == 4


@pytest.mark.parametrize(
    ("bounds", "counts", "msg"),
    [
        ((1.0, 5.0), (1, 2), "expected len"),
        ((5.0, 1.0), (1, 2, 3), "strictly increasing"),
        ((), (1,), "empty"),
    ],
)
def test_latency_histogram_shape(bounds: tuple[float, ...], counts: tuple[int, ...], msg: str) -> None:
    from gpuslo.wire import LatencyDelta

    with pytest.raises(ValueError, match=msg):
        LatencyDelta(**h.env(), service="s", interval_s=10, bounds_ms=bounds, counts=counts)


def test_catalogue_and_schema_agree_both_ways() -> None:
    ddl_fields = set(re.findall(r"\b(DCGM_FI_\w+) ", INGEST_SCHEMA.render()))
    assert ddl_fields == {f.name for f in FIELDS}


def test_simulator_emits_only_catalogued_fields_and_valid_messages() -> None:
    cfg = SimConfig(nodes=2, gpus_per_node=4, hours=0.5, seed=5)
    fleet = Fleet(cfg)
    sources = sim_sources(fleet)
    seen: set[str] = set()
    kinds: set[str] = set()
    for k in range(0, 180, 10):
        t = cfg.start_ts + k * cfg.interval_s
        fleet.advance_to(t)
        for s in sources:
            for m in s.collect(t):
                kinds.add(m.kind)
                assert decode(encode(m)) == m
                if isinstance(m, GpuSampleBatch):
                    for g in m.gpus:
                        seen |= set(g.fields)
    assert seen <= {f.name for f in FIELDS}
    assert {"gpu_samples", "heartbeat", "sched_event", "latency"} <= kinds

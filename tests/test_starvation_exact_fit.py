"""A request for exactly what is free: the store keeps shares, GPU fractions and requests as
Float32, so 0.4 of a GPU whose holder has 0.6 reads 0.40000001 against 0.39999998 free, and 30
pods of 0.1 read 3.0000000447 GPUs against 3 free. The cause must be the definition's
(docs/metrics.md: ``capacity`` only when fewer GPUs are free than requested; ``fragmentation``
when fewer nodes than requested can host ``gpus_per_node``), over raw rows, the minute tier's
sweep and the starvation tier alike. The expected causes are worked out here in exact fractions
from the definition, not from the SQL."""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction as F

import pytest

from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules import evaluate, rollup
from gpuslo.rules.config import RulesConfig
from gpuslo.rules.tables import SCHEMA
from tests import helpers as h
from tests.helpers import T0

THR = 600.0
S0 = T0 + 2 * 3600  # the first sample; every request is submitted 100 s later
OPENED = S0 + 100 + THR

# (holders' shares of each node's GPUs, one tuple of GPUs per node; GPUs per pod; pods)
Case = tuple[tuple[tuple[F, ...], ...], F, int]


def _cases() -> list[Case]:
    out: list[Case] = []
    # one GPU held k/n: a request for exactly the rest fits (policy); a hundredth more does not
    for n in range(2, 11):
        for k in range(1, n):
            rest = 1 - F(k, n)
            out += [(((F(k, n),),), rest, 1), (((F(k, n),),), rest + F(1, 100), 1)]
    # three nodes with one whole GPU free each: 3 GPUs in pods of 3/p
    for pods in (3, 6, 7, 9, 30, 300):
        out.append((((F(1), F(0)),) * 3, F(3, pods), pods))
        out.append((((F(1), F(0)),) * 3, F(3, pods) + F(1, 1000), pods))
    # two GPUs, each with 1 - 1/3 free, and a request of 2/3 over two pods (fits each GPU exactly)
    for n in (3, 5, 7):
        out.append((((F(1, n),), (F(1, n),)), 1 - F(1, n), 2))
    # requests of a millionth of a GPU and less: on a GPU held whole, none fits (capacity)
    for tiny in (F(1, 10**6), F(1, 10**7), F(1, 10**9)):
        out += [(((F(1),),), tiny, 1), (((F(1), F(0)),), tiny, 1)]
    return out


def _cause(nodes: tuple[tuple[F, ...], ...], gpn: F, pods: int) -> str:
    """docs/metrics.md's cause, in exact arithmetic."""
    free = sum((1 - s for gpus in nodes for s in gpus), F(0))
    if free < pods * gpn:
        return "capacity"
    if gpn >= 1:
        fitting = sum(1 for gpus in nodes if sum(1 for s in gpus if s == 0) >= gpn)
    else:
        fitting = sum(1 for gpus in nodes if max(1 - s for s in gpus) >= gpn)
    return "fragmentation" if fitting < pods else "policy"


CASES = _cases()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path_factory.mktemp("exact") / "store")
    s.migrate(SCHEMA)
    msgs: list[object] = []
    for c, (nodes, gpn, pods) in enumerate(CASES):
        pool = f"p{c}"
        for k, gpus in enumerate(nodes):
            for t in (0, 300, 600, 900):  # the sample at 600 stands for the openings at 700
                gs = [h.gpu(i, 0.1, (("j", float(sh)),) if sh else ()) for i, sh in enumerate(gpus)]
                msgs.append(h.batch(f"{pool}n{k}", S0 + t, gs, interval_s=300, pool=pool))
        msgs.append(h.sched("submit", f"r{c}", S0 + 100, gpn=float(gpn), nodes=pods, pool=pool))
    write(s, msgs)  # type: ignore[arg-type]
    rollup.refresh(s)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.integration  # a refresh and three rounds of chDB (over 0.7 s)
@pytest.mark.parametrize("over", ["raw", "tier", "sweep"])
def test_a_request_for_exactly_what_is_free_is_no_capacity_shortfall(
    store: ChdbStore, over: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = RulesConfig()
    cfg = cfg.model_copy(update={"starvation": cfg.starvation.model_copy(update={"threshold_s": THR})})
    if over == "sweep":
        monkeypatch.setattr(evaluate, "steps_built", lambda _s: False)
    rows = evaluate.starvation(store, OPENED - 60, OPENED + 60, cfg, "c1", rollup=over != "raw")
    got = {r["request_id"]: r["cause"] for r in rows}
    want = {f"r{c}": _cause(*case) for c, case in enumerate(CASES)}
    assert got == want
    assert set(want.values()) == {"capacity", "fragmentation", "policy"}  # every cause is met


# requests from a billionth of a GPU to the wire's largest (100,000 nodes x 1,024), fractional too
REQUESTED = [F(1, 10**9), F(1, 10**7), F(1, 10**6), F(3, 10), F(1), F(7), *(F(10**k) for k in range(2, 9)),
             F(100_000 * 3, 10), F(100_000 * 1024)]  # fmt: skip


@pytest.mark.integration  # the module's store (a refresh: over 0.7 s)
def test_the_tolerance_of_free_gpus_is_never_a_gpu_nor_all_of_a_request(store: ChdbStore) -> None:
    """Free and requested GPUs are equal within the Float32 rounding of the request, never
    within a whole GPU (10^-6 per GPU requested made 999,999 free GPUs enough for 1,000,000) nor
    within all of a request (a request of 10^-7 GPU was enough with nothing free, and fitted a
    node with nothing free). The shared tests of the raw, sweep and tier queries, over values."""
    from gpuslo.rules.sql import enough_free, fits_shape

    def enough(free: str, requested: str) -> bool:
        return bool(store.query(f"SELECT {enough_free(free, requested)} AS ok")[0]["ok"])

    def fits(shape: str, gpn: str) -> bool:
        return bool(store.query(f"SELECT {fits_shape(shape, gpn)} AS ok")[0]["ok"])

    for r in REQUESTED:
        req = f"toFloat64(toFloat32({float(r)!r}))"  # as the store holds it
        exact = f"toFloat64({float(r)!r})"
        assert enough(exact, req), r  # exactly what is requested is free
        assert not enough("0", req), r  # nothing free
        if r >= 1:
            assert not enough(f"{float(r - 1)!r}", req), r  # a whole GPU short
        elif r > F(2, 10**9):  # (a node's shape is its largest free part + 1e-9: sql.py's snap_rows)
            empty, one = "1e-9", f"{float(r)!r} + 1e-9"  # a node held whole; one with that much free
            assert not fits(empty, req) and fits(one, req), r

"""The ingest takes a run of vectorised batches (a pack's, or consecutive JSON batches on the
fast path) at once when none of them is an exception; otherwise batch by batch. Differential:
over any sequence of calls, taking runs at once must give exactly what taking every batch on
its own gives: the same rows, replays, rejections (reasons and dead letters), out-of-order
warnings, and the same remembered ids and stream ends afterwards (so later calls agree too).

The calls mix packs and JSON messages from a few streams, with ids reused (replays when the
content is the same, conflicts when it is not), timestamps out of order within and across
calls, batches past retention, a call sent again under the same origins (a retry), and a
dedup window small enough to forget ids mid-run."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslo.ingest.pipeline import Ingestor
from gpuslo.ingest.writer import Raw
from gpuslo.wire import encode
from gpuslo.wire import pack as P
from tests.helpers import T0
from tests.test_fastpath import _batch, _ColumnsOnly, _rows

NOW = T0 + 3600

# one batch: (node, boot, seq, ts offset); content is a function of all four, so the same
# four are a replay and the same (node, boot, seq) with another ts is a conflict
_BATCH = st.tuples(
    st.sampled_from(["n1", "n2", "n3"]),
    st.sampled_from(["b1", "b2"]),
    st.integers(0, 15),
    st.one_of(st.integers(-5, 60), st.just(-40 * 86400)),  # the last: past retention
)
_UNIT = st.tuples(st.booleans(), st.lists(_BATCH, min_size=1, max_size=20))  # (packed?, batches)
_CALL = st.lists(_UNIT, min_size=1, max_size=4)


def _json(node: str, boot: str, seq: int, dt: int) -> bytes:
    b = _batch(seq, T0 + dt, node=node).model_copy(update={"boot_id": boot})
    return encode(b)


def _items(call: list[tuple[bool, list[Any]]], tag: str) -> list[Raw]:
    out: list[Raw] = []
    for u, (as_pack, batches) in enumerate(call):
        raws = [_json(*b) for b in batches]
        if as_pack:
            value, took = P.pack(raws)
            if took:
                out.append(Raw(f"{tag}/{u}", value, "t", 0, u))
            out += [Raw(f"{tag}/{u}/{i}", r, "t", 0, u) for i, r in enumerate(raws) if i not in took]
        else:
            out += [Raw(f"{tag}/{u}/{i}", r, "t", 0, u) for i, r in enumerate(raws)]
    return out


def _outcome(p: Any) -> tuple[Any, ...]:
    rep = p.report
    return (
        {t: _rows(c) for t, c in p.columns.items()},
        rep.received,
        rep.duplicates,
        rep.vectorised,
        rep.rejected,
        rep.warnings,
        [(d[1].origin, d[1].value, d[2]) for d in p.dead],
    )


def _state(ing: Ingestor) -> tuple[Any, ...]:
    return list(ing._ids._d.items()), dict(ing._last)


class _OneByOne(Ingestor):
    def _take_run(self, *args: Any, **kwargs: Any) -> bool:
        return False


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(st.tuples(_CALL, st.booleans()), min_size=1, max_size=4), window=st.sampled_from([5, 1000])
)
def test_runs_taken_at_once_give_what_one_by_one_gives(calls: list[Any], window: int) -> None:
    differential(calls, window, _ColumnsOnly)


def differential(calls: list[Any], window: int, store: Any) -> list[Any]:
    """The calls (each maybe sent twice: a retry under the same origins) through an ingest
    taking runs and one taking batch by batch, each on its own ``store()``: same outcome and
    same state after every call. Returns the runs' prepared calls."""
    runs = Ingestor(store(), clock=lambda: NOW, dedup_window=window)
    single = _OneByOne(store(), clock=lambda: NOW, dedup_window=window)
    out = []
    for n, (call, again) in enumerate(calls):
        items = _items(call, f"c{n}")
        for _ in range(1 + again):
            a = runs.prepare(items)
            assert _outcome(a) == _outcome(single.prepare(items))
            assert _state(runs) == _state(single)
            out.append(a)
    return out


def test_a_clean_pack_is_taken_as_one_run() -> None:
    """The case the runs are for: a node's backlog, new ids in order, taken without the
    batch-by-batch path (which would make an item per batch)."""
    seen: list[int] = []

    class Counting(Ingestor):
        def _take_one(self, pos: int, *args: Any) -> None:
            seen.append(pos)
            super()._take_one(pos, *args)

    ing = Counting(_ColumnsOnly(), clock=lambda: NOW)
    value, took = P.pack([_json("n1", "b1", s, s) for s in range(50)])
    assert len(took) == 50
    p = ing.prepare([Raw("t/0/0", value, "t", 0, 0)])
    assert seen == [] and p.report.received == 50 and p.report.rejected == []
    assert len(p.columns["gpu_samples"]["ts"]) == 50 * 7
    again = ing.prepare([Raw("t/0/1", value, "t", 0, 1)])  # replayed from elsewhere: one by one
    assert again.report.duplicates == 50 and len(seen) == 50


def test_two_threads_never_check_and_take_ids_at_once() -> None:
    """The Kafka consumer prepares the next batch while its writer thread may isolate a refused
    one (which prepares it again): one call's checks and takes of the shared ids and stream
    ends must not interleave with another's. Thread A is held inside its admission; thread
    B's call must not reach its own admission until A's is done."""
    import threading

    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    class Held(Ingestor):
        def _take_run(self, p0: int, n: int, *args: Any) -> bool:
            name = threading.current_thread().name
            order.append(f"{name} in")
            if name == "A":
                inside.set()
                release.wait(10)
            ok = super()._take_run(p0, n, *args)
            order.append(f"{name} out")
            return ok

    ing = Held(_ColumnsOnly(), clock=lambda: NOW)
    pack_a = P.pack([_json("n1", "b1", s, s) for s in range(10)])[0]
    pack_b = P.pack([_json("n2", "b1", s, s) for s in range(10)])[0]
    a = threading.Thread(target=ing.prepare, args=([Raw("t/0/0", pack_a)],), name="A")
    b = threading.Thread(target=ing.prepare, args=([Raw("t/0/1", pack_b)],), name="B")
    a.start()
    assert inside.wait(10)
    b.start()
    b.join(0.3)  # B decodes its pack, then waits for A's admission to end
    assert order == ["A in"]
    release.set()
    a.join(10)
    b.join(10)
    assert order == ["A in", "A out", "B in", "B out"]

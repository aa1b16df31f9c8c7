"""Attacks on the run admission, the packs read together and the commit retry."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.errors import CommitFailedError, KafkaConnectionError, KafkaTimeoutError
from kafka.structs import TopicPartition

from gpuslo.core.backoff import Backoff
from gpuslo.ingest.kafka_consumer import KafkaIngest
from gpuslo.ingest.pipeline import Ingestor
from tests.test_fastpath import _ColumnsOnly
from tests.test_ingest_commits import TOPIC, Consumer, Recording, _ingest, written_commit_failed
from tests.test_ingest_runs import _CALL, NOW, differential

BAD_SEQ = 7


class _Refusing(_ColumnsOnly):
    """A column no batch of seq BAD_SEQ can go into (a value its column cannot hold)."""

    def prepare_columns(self, table: str, columns: Mapping[str, Any]) -> Any:
        seq = columns.get("seq")
        if seq is not None and BAD_SEQ in (seq.to_pylist() if hasattr(seq, "to_pylist") else list(seq)):
            raise ValueError(f"seq {BAD_SEQ} cannot be stored")
        return super().prepare_columns(table, columns)


@settings(max_examples=100, deadline=None)
@given(
    calls=st.lists(st.tuples(_CALL, st.booleans()), min_size=1, max_size=3), window=st.sampled_from([5, 1000])
)
def test_runs_with_batches_refused_at_build_give_what_one_by_one_gives(calls: list[Any], window: int) -> None:
    for a in differential(calls, window, _Refusing):
        for _, item, _ in a.dead:
            assert item.value  # a pack's batch dead-lettered with its JSON


# ---------------------------------------------------------------- commits


class _Regaining(Consumer):
    """kafka-python's consumer as far as a partition lost and given back goes: ``committed``
    is the group's commit (another member's included)."""

    def __init__(self, partitions: int) -> None:
        super().__init__(partitions)
        del self.committed  # the base class's record of commits: here the method below

    def committed(self, tp: Any, metadata: bool = False, timeout_ms: Any = None) -> int | None:
        if timeout_ms is None:  # kafka-python retries a coordinator that is away for ever
            self.violations.append(f"committed({tp}) without a timeout")
        return self.group.get(tp)

    @property
    def group(self) -> dict[Any, int]:
        return self.__dict__.setdefault("_group", {})

    def commit(self, offsets: dict[Any, Any], timeout_ms: Any = None) -> None:
        """As a broker takes it: any offset, lower than the last one too (the base class's
        asserts would be swallowed by the ingest's handling of a failed commit)."""
        self.attempts += 1
        if self.down is not None:
            raise self.down
        self.history.append({tp: o.offset for tp, o in offsets.items()})
        for tp, o in offsets.items():
            self.group[tp] = o.offset

    def lose_and_regain(self, p: int, other_commits: int | None) -> None:
        """Partition ``p`` revoked (the member kicked out of the group, or a rebalance), read by
        another member which commits ``other_commits``, then given back."""
        tp = TopicPartition(TOPIC, p)
        self.owned.discard(tp)
        self.listener.on_partitions_revoked({tp})
        if other_commits is not None:
            self.group[tp] = other_commits
            self.next[p] = other_commits
        self.owned.add(tp)
        self.listener.on_partitions_assigned({tp})


def test_a_left_over_commit_never_moves_back_the_commit_of_the_member_that_had_the_partition() -> None:
    """The commit of partition 1 fails (kicked out of the group: CommitFailedError); the
    partition goes to another member, which reads on and commits 10; a later rebalance gives
    it back before the next poll returns. The left-over offset (3) must not be committed over
    the other member's 10: the group would re-read 3..10 after the next restart."""
    c = _Regaining(2)
    c.script = [{0: 3, 1: 3}]
    ing = written_commit_failed(c, CommitFailedError("member kicked out of the group"))
    real_poll = c.poll

    def poll(timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        c.lose_and_regain(1, other_commits=10)  # both rebalances inside the one poll
        c.poll = real_poll  # type: ignore[method-assign]
        return real_poll(timeout_ms, max_records)

    c.poll = poll  # type: ignore[method-assign]
    c.script = [{0: 1}]
    for _ in range(3):
        ing.step()  # the Consumer asserts that no commit moves an offset backwards
    ing.close()
    assert c.group[TopicPartition(TOPIC, 1)] == 10, c.history
    assert not c.violations, c.violations


def test_a_left_over_commit_of_a_partition_given_back_untouched_is_still_made() -> None:
    """Given back with nobody's commit since: the left-over commit is still ours to make."""
    c = _Regaining(2)
    c.script = [{0: 3, 1: 3}]
    ing = written_commit_failed(c)
    c.lose_and_regain(1, other_commits=None)
    c.script = [{}]
    ing.step()
    ing.close()
    assert c.group == {TopicPartition(TOPIC, 0): 3, TopicPartition(TOPIC, 1): 3}
    assert not c.violations, c.violations


def _regained_unreadable(fails: int) -> tuple[_Regaining, KafkaIngest, list[int]]:
    """Partition 1's batch written while the broker was away (its commit failed), then lost and
    given back, and the next ``fails`` reads of the group's commit of it failing (the
    coordinator not known yet); the count is the returned list's one item."""
    c = _Regaining(2)
    c.script = [{0: 3, 1: 3}]
    ing = written_commit_failed(c)
    c.lose_and_regain(1, other_commits=None)
    real_committed = c.committed
    left = [fails]

    def committed(tp: Any, metadata: bool = False, timeout_ms: Any = None) -> int | None:
        if left[0]:
            left[0] -= 1
            raise KafkaTimeoutError("coordinator not available")
        return real_committed(tp, metadata, timeout_ms)

    c.committed = committed  # type: ignore[method-assign]
    return c, ing, left


def test_a_left_over_commit_waits_while_the_group_commit_of_a_regained_partition_cannot_be_read() -> None:
    """The broker away: the batch's commit fails, the group loses and gives back partition 1,
    and reading the group's commit of it fails too (the coordinator not known yet). The
    left-over offset must wait, not vanish: partition 1 reads nothing more, so nothing else
    would ever commit it (seen on the real broker: tests/test_ingest_faults.py's restart left
    a partition uncommitted). Once the group's commit can be read, ours is made."""
    c, ing, _ = _regained_unreadable(2)  # the next two reads of the group's commit fail
    c.script = [{0: 1}]
    ing.step()  # partition 0's record read and written
    ing.step()  # idle: its commit made; partition 1's waits (the group's commit of it unreadable)
    assert c.group.get(TopicPartition(TOPIC, 0)) == 4 and TopicPartition(TOPIC, 1) not in c.group, c.history
    for _ in range(3):  # idle steps: one more failed read, then the commit (the backoff is 0.1 ms)
        time.sleep(0.01)
        ing.step()
    assert c.group == {TopicPartition(TOPIC, 0): 4, TopicPartition(TOPIC, 1): 3}, c.history
    ing.close()
    assert not c.violations, c.violations


def test_a_left_over_commit_of_a_regained_partition_unreadable_until_close_is_made_at_close() -> None:
    """The same, with the group's commit unreadable until the ingest stops: close() tries once more."""
    c, ing, left = _regained_unreadable(10**9)
    c.script = [{}]
    ing.step()
    assert TopicPartition(TOPIC, 1) not in c.group
    left[0] = 0  # readable from now on
    ing.close()
    assert c.group == {TopicPartition(TOPIC, 0): 3, TopicPartition(TOPIC, 1): 3}, c.history
    assert not c.violations, c.violations


def test_one_commit_that_fails_twice_over_steps_the_backoff_once() -> None:
    """The group's commit of a regained partition unreadable and the commit of the others
    failing too, in one call: one failed try, one step of the backoff (it was doubled twice)."""
    c, ing, _ = _regained_unreadable(10**9)
    ing._commit_backoff = Backoff(1.0, 100.0)
    c.down = KafkaConnectionError("111 ECONNREFUSED")
    ing._commit([])
    assert ing._commit_backoff.delay_s == 1.0
    assert 0.5 < ing._commit_again_at - time.monotonic() <= 1.0
    c.down = None
    ing._commit_again_at = 0.0
    ing._commit([])  # partition 0's commit made; partition 1's still waits: the second step
    assert c.group == {TopicPartition(TOPIC, 0): 3} and ing._commit_backoff.delay_s == 2.0


def test_a_batch_written_while_its_partition_was_lost_and_given_back_does_not_move_the_commit_back() -> None:
    """The rebalances are heard while the batch is written (kafka-python calls the listener
    in the paused poll of a store outage): the batch's commit comes after another member's
    commit of the partition, further on, and must not undo it."""
    c = _Regaining(2)
    c.script = [{0: 3, 1: 3}]
    ing = _ingest(c, Recording())
    ing._after_write = lambda n: c.lose_and_regain(1, other_commits=10) if n == 1 else None
    for _ in range(3):
        ing.step()
    ing.close()
    assert c.group == {TopicPartition(TOPIC, 0): 3, TopicPartition(TOPIC, 1): 10}, c.history
    assert not c.violations, c.violations


def test_a_packed_batch_refused_at_build_is_dead_lettered_with_its_own_json() -> None:
    """Two packs in one call, the first with a batch the fast path's checks send to the models
    (its JSON slot sits among the pack's batches), the second with a batch no column can
    hold: its dead letter is that batch's JSON, not a neighbour's."""
    import orjson

    from gpuslo.ingest.writer import Raw
    from gpuslo.wire import encode
    from gpuslo.wire import pack as P
    from tests.helpers import T0
    from tests.test_fastpath import _batch

    a = [encode(_batch(s, T0 + s, node="n1")) for s in range(4)]
    a[1] = a[1].replace(b'"share":0.25', b'"share":0.75', 1)  # 1.25 GPUs: the models refuse it
    b = [encode(_batch(s, T0 + s, node="n2")) for s in range(5, 9)]
    va, ta = P.pack(a)
    vb, tb = P.pack(b)
    assert ta == [0, 1, 2, 3] and tb == [0, 1, 2, 3]
    for fast in (True, False):
        ing = Ingestor(_Refusing(), clock=lambda: NOW, fast_path=fast)
        p = ing.prepare([Raw("t/0/0", va, "t", 0, 0), Raw("t/0/1", vb, "t", 0, 1)])
        dead = {d[1].origin: orjson.loads(d[1].value) for d in p.dead}
        assert set(dead) == {"t/0/0#1", "t/0/1#2"}, (fast, p.report.rejected)
        assert (dead["t/0/1#2"]["node"], dead["t/0/1#2"]["seq"]) == ("n2", BAD_SEQ)
        assert (dead["t/0/0#1"]["node"], dead["t/0/0#1"]["seq"]) == ("n1", 1)


def test_every_commit_below_the_group_commit_of_a_regained_partition_is_dropped() -> None:
    """kafka-python keeps a partition's position when a rebalance gives it back at once: this
    member reads on from its own position, below the 10 the other member committed meanwhile.
    No commit of ours may land below 10 (not the first after the regain only); once ours
    passes 10 it is made."""
    c = _Regaining(1)
    tp = TopicPartition(TOPIC, 0)
    c.script = [{0: 3}]
    ing = _ingest(c, Recording())
    ing.step()
    ing.step()
    assert c.group == {tp: 3}
    c.owned.discard(tp)
    c.listener.on_partitions_revoked({tp})
    c.group[tp] = 10  # the other member's commit; our position stays at 3
    c.owned.add(tp)
    c.listener.on_partitions_assigned({tp})
    for n in (2, 2, 2, 3):  # offsets 3..4, 5..6, 7..8, then 9..11
        c.script = [{0: n}]
        ing.step()
        ing.step()
        assert all(h[tp] >= 10 for h in c.history[1:]), c.history
    ing.close()
    assert c.group == {tp: 12} and c.history[-1] == {tp: 12}
    assert not c.violations, c.violations


def test_a_decoding_bug_in_a_batch_never_lets_a_later_batch_commit_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch cut from the records read (by ``batch_bytes``) whose decoding raises (a bug: a
    bad message is dead-lettered, never raised) is out of the pending records and unwritten:
    close(), on the way out of run(), must not write and commit the records after it, which
    would commit past it (found by this round's attack: offset 5 committed, 2 and 3 unwritten)."""

    class Big(Consumer):
        def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
            got = super().poll(timeout_ms, max_records)
            for recs in got.values():
                for r in recs:
                    r.value = b"x" * 600_000  # two a batch (batch_bytes 1 MiB)
            return got

    c = Big(1)
    c.script = [{0: 5}]
    ing = _ingest(c, Recording())
    ing.settings = ing.settings.model_copy(update={"batch_bytes": 1 << 20})
    real, calls = ing.ingestor.prepare, [0]

    def prepare(items: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("decoder bug")
        return real(items)

    monkeypatch.setattr(ing.ingestor, "prepare", prepare)
    ing.step()  # records 0..4 read; 0, 1 handed over; 2..4 wait
    with pytest.raises(RuntimeError):
        ing.step()  # 2, 3 taken from the pending records; their decoding raises
    ing.close()
    got = c.committed.get(TopicPartition(TOPIC, 0), 0)
    assert got <= 2, f"offset {got} committed: records 2, 3 never written ({c.history})"
    assert not c.violations, c.violations

"""The dedup window's keys: a run of ids (or a pack's batch origins) keyed in one array
operation must give exactly the key each gets on its own, for every value the wire allows,
or a replay taken at once would be missed (or a retry refused) when it comes one by one."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gpuslo.ingest.pipeline import _M, _Ids, ident_key, ident_keys, origin_key, origin_keys

_SEQ = st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 1, 2**31, 2**32, 2**62, 2**63 - 1]))
_NAME = st.text(min_size=0, max_size=40)


@given(st.lists(st.tuples(_NAME, _NAME, _SEQ), min_size=1, max_size=50))
def test_ident_keys_are_ident_key(ids: list[tuple[str, str, int]]) -> None:
    hashes = np.array([hash((s, b)) & _M for s, b, _ in ids], dtype=np.uint64)
    seqs = np.array([q for _, _, q in ids], dtype=np.int64)
    assert ident_keys(hashes, seqs).tolist() == [ident_key(*i) for i in ids]


@given(_NAME, _NAME, st.lists(_SEQ, min_size=2, max_size=200, unique=True))
def test_one_streams_ids_never_share_a_key(source: str, boot: str, seqs: list[int]) -> None:
    assert len({ident_key(source, boot, q) for q in seqs}) == len(seqs)


def test_a_negative_seq_is_keyed_as_the_array_path_keys_it() -> None:
    # the models refuse seq < 0, but a key is a function of any int: both paths agree
    h = np.array([hash(("s", "b")) & _M], dtype=np.uint64)
    for q in (-1, -(2**63)):
        assert ident_keys(h, np.array([q], dtype=np.int64)).tolist() == [ident_key("s", "b", q)]


@given(st.text(max_size=30), st.lists(st.integers(0, 10**18 - 1), min_size=1, max_size=50))
def test_origin_keys_are_origin_key(base: str, ks: list[int]) -> None:
    assert origin_keys(base, np.array(ks, dtype=np.int64)).tolist() == [origin_key(f"{base}#{k}") for k in ks]


@given(st.text(max_size=40))
def test_origin_key_is_a_key_of_any_string(origin: str) -> None:
    assert 0 <= origin_key(origin) <= _M


def test_origins_that_merely_look_like_a_packs_batch() -> None:
    # a suffix that is not the canonical decimal of a batch number is hashed whole, not parsed,
    # so no two of these strings are keyed as one
    odd = ["t/0/5#01", "t/0/5#1", "t/0/5#", "t/0/5#+1", "t/0/5#١", "t/0/5#" + "9" * 19, "t/0/5#1#2", "t/0/5"]
    assert len({origin_key(o) for o in odd}) == len(odd)
    assert origin_key("t/0/5#01") == hash("t/0/5#01") & _M
    assert origin_key("t/0/5#" + "9" * 5000) == hash("t/0/5#" + "9" * 5000) & _M  # no int() of it
    assert origin_key("a#b#7") == origin_keys("a#b", np.array([7])).tolist()[0]


def test_put_all_is_put_of_each() -> None:
    one, many = _Ids(10), _Ids(10)
    ids = [("s", "b", q) for q in range(12)]
    origins = [f"t/0/3#{k}" for k in range(12)]
    for i, o in zip(ids, origins, strict=True):
        one.put(i, 1000 + i[2], o)
    many.put_all(
        [ident_key(*i) for i in ids], [1000 + i[2] for i in ids], origin_keys("t/0/3", np.arange(12)).tolist()
    )
    assert list(one._d.items()) == list(many._d.items())  # the oldest two forgotten by both
    assert many.lookup(("s", "b", 11), 1011, "t/0/3#11") == "again"
    assert many.lookup(("s", "b", 11), 1011, "t/0/4#11") == "replay"
    assert many.lookup(("s", "b", 11), 7, "t/0/4#11") == "conflict"
    assert many.lookup(("s", "b", 1), 1001, "t/0/3#1") == "new"  # out of the window
    many.forget(("s", "b", 11), "t/0/9#11")  # another origin's: kept
    assert many.lookup(("s", "b", 11), 1011, "t/0/3#11") == "again"
    many.forget(("s", "b", 11), "t/0/3#11")
    assert many.lookup(("s", "b", 11), 1011, "t/0/3#11") == "new"


def test_a_seqs_key_is_salted_per_process() -> None:
    # a sender choosing seq cannot aim at another stream's key, even with Python's hash fixed
    code = "from gpuslo.ingest.pipeline import ident_key; print(ident_key('s', 'b', 7))"
    env = {"PYTHONHASHSEED": "0", "PATH": ""}
    got = {
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(3)
    }
    assert len(got) == 3


def test_seqs_equal_modulo_pythons_int_hash_are_distinct_ids() -> None:
    # the former key, hash((source, boot_id, seq)), hashed ints modulo 2**61-1: seq 3 and
    # 2**63-1 were one id, and the second message a dead letter as a "conflicting message"
    pairs = [(3, 2**63 - 1), (4, 2**63), (0, 2**61 - 1), (1, 2**62 - 1 + 2**61)]
    for a, b in pairs:
        assert ident_key("s", "b", a) != ident_key("s", "b", b)
    ids = _Ids(10)
    ids.put(("s", "b", 3), 1, "t/0/0")
    assert ids.lookup(("s", "b", 2**63 - 1), 2, "t/0/1") == "new"


def test_a_message_whose_seq_shares_pythons_int_hash_is_written() -> None:
    from gpuslo.ingest.pipeline import Ingestor
    from gpuslo.ingest.writer import Raw
    from gpuslo.wire import encode
    from tests.test_fastpath import _batch, _ColumnsOnly
    from tests.test_ingest_runs import NOW

    msgs = [encode(_batch(seq, NOW - 60 + i)) for i, seq in enumerate((3, 2**63 - 1))]
    p = Ingestor(_ColumnsOnly(), clock=lambda: NOW).prepare(
        [Raw(f"t/0/{i}", m, "t", 0, i) for i, m in enumerate(msgs)]
    )
    assert p.report.rejected == [] and p.report.duplicates == 0
    assert sorted(set(p.columns["gpu_samples"]["seq"].to_pylist())) == [3, 2**63 - 1]

"""What if (rules/whatif.py, docs/whatif.md): schedules computed on paper for small queues under
each policy, the numbers of a replay from their definitions, the loader against a chDB store
written through the normal ingest path (the identity: the producing policy gives back the
recorded starts; recorded CUR = the rules engine's), hostile inputs at the CLI, and the
invariants on random queues."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslo.app.cli import main
from gpuslo.ingest.store import ChdbStore
from gpuslo.ingest.writer import write
from gpuslo.rules.config import ConfigError, RulesConfig, parse
from gpuslo.rules.evaluate import summary
from gpuslo.rules.whatif import (
    RECORDED,
    Capacity,
    Node,
    PolicyError,
    Request,
    compare,
    load,
    parse_policy,
    replay,
)
from gpuslo.rules.whatif_metrics import allocated_s, capacity_s, percentile, summarise
from tests import helpers as h
from tests.helpers import T0


def req(rid: str, submit: float, gpus: float, run_s: float, **kw: Any) -> Request:
    return Request(
        request_id=rid,
        scheduler=kw.pop("scheduler", "slurm"),
        cluster="c1",
        queue=kw.pop("queue", "q"),
        account=kw.pop("account", "a"),
        user=kw.pop("user", "u"),
        submit=submit,
        nodes=kw.pop("nodes", 1),
        gpus_per_node=gpus,
        run_s=run_s,
        **kw,
    )


def fleet(*gpus: float, frm: float = 0.0, to: float = 100_000.0) -> Capacity:
    return Capacity(frm, to, tuple(Node(f"n{i + 1}", "", ((frm, to, float(g)),)) for i, g in enumerate(gpus)))


def starts(
    requests: list[Request], cap: Capacity, policy: str, cfg: RulesConfig | None = None
) -> dict[str, Any]:
    rep = replay(requests, cap, parse_policy(policy), cfg)
    return {o.request.request_id: o.start for o in rep.outcomes}


# ---------------------------------------------------------------------------- policies on paper
# One node of 8 GPUs. A holds 4 from 0 to 100. B (8 GPUs) at 10 cannot start until A ends. C (4,
# 50 s) at 20 fits at once; D (4, 500 s) at 30 fits after C ends at 70.
BLOCKER = [req("A", 0, 4, 100), req("B", 10, 8, 100), req("C", 20, 4, 50), req("D", 30, 4, 500)]


def test_fifo_waits_behind_the_head_of_line_blocker() -> None:
    # strict order: B at 100 (A ends), then C and D together at 200 (B ends)
    assert starts(BLOCKER, fleet(8), "fifo") == {"A": 0, "B": 100, "C": 200, "D": 200}


def test_backfill_goes_around_the_blocker_without_delaying_it() -> None:
    # B's reservation is 100. C (20 + 50 = 70 <= 100) back-fills; D (30 + 500 > 100) would hold
    # 4 GPUs past 100, where B needs all 8 (no spare GPUs then): it waits; B at 100, D after B.
    rep = replay(BLOCKER, fleet(8), parse_policy("backfill"))
    got = {o.request.request_id: o.start for o in rep.outcomes}
    assert got == {"A": 0, "B": 100, "C": 20, "D": 200}
    assert rep.reservations == {"B": 100, "D": 200}


def test_first_fit_starts_whatever_fits_and_starves_the_big_one() -> None:
    # C at 20 (ends 70), D at 70 (ends 570): B waits for 8 free GPUs until 570
    assert starts(BLOCKER, fleet(8), "first-fit") == {"A": 0, "B": 570, "C": 20, "D": 70}


def test_backfill_uses_the_spare_gpus_at_the_reservation() -> None:
    """Two nodes of 8. A (4 GPUs) takes n1 (pack: a tie, by name), X (8) takes n2. B (8 GPUs)
    at 10 is the head: its reservation is n2 at 100 (X's end), leaving n1's 4 spare GPUs then.
    D (4 GPUs, 2000 s) at 30 ends long after 100 but fits in those spare GPUs: it back-fills on
    n1. E (4 GPUs) at 40 fits nowhere now; at 100 B takes n2; E starts on n2 when B ends, 200."""
    reqs = [
        req("A", 0, 4, 1000),  # n1: 4 of 8 until 1000
        req("X", 0, 8, 100),  # n2: all 8 until 100
        req("B", 10, 8, 100),  # reservation: n2 at 100
        req("D", 30, 4, 2000),  # past 100, but on n1's 4 spare GPUs: not needed by B
        req("E", 40, 4, 2000),  # past 100 and only n2 could host it then: waits
    ]
    got = starts(reqs, fleet(8, 8), "backfill")
    # D starts at 30 on n1; E's only place would be n2 after 100 (B's): it starts when B ends
    assert got == {"A": 0, "X": 0, "B": 100, "D": 30, "E": 200}


def test_fairshare_puts_the_account_that_used_less_first() -> None:
    """One node of 8 GPUs. x holds it 0-1000; x2 (x) at 10 and y1 (y) at 20 both want all 8.
    At 1000 (the priorities are recomputed every 300 s; the pass at 1000 is the first due since
    0): x's usage is 8 GPUs x 1000 s decayed a little, y's none; normalised 1 and 0; shares
    equal (0.5): fairshare factors 2^(-1/0.5) = 0.25 and 2^0 = 1. Priorities: x2 = 1000 x
    990/604800 + 10000 x 0.25 = 2501.6; y1 = 1000 x 980/604800 + 10000 = 10001.6: y1 first."""
    reqs = [
        req("x1", 0, 8, 1000, account="x"),
        req("x2", 10, 8, 100, account="x"),
        req("y1", 20, 8, 100, account="y"),
    ]
    assert starts(reqs, fleet(8), "fairshare") == {"x1": 0, "y1": 1000, "x2": 1100}
    assert starts(reqs, fleet(8), "fifo") == {"x1": 0, "x2": 1000, "y1": 1100}
    # with no weight on fair share, the age alone orders them: arrival order
    cfg = parse({"whatif": {"fairshare": {"weight_fairshare": 0}}})
    assert starts(reqs, fleet(8), "fairshare", cfg) == {"x1": 0, "x2": 1000, "y1": 1100}
    # x's share 100 times y's: 2^(-1/(100/101)) = 0.4966 for x, still 1 for y: y1 first again
    cfg = parse({"whatif": {"fairshare": {"shares": {"x": 100, "y": 1}}}})
    assert starts(reqs, fleet(8), "fairshare", cfg)["y1"] == 1000


def test_fairshare_a_new_arrival_of_an_account_that_used_nothing_goes_first() -> None:
    """One node of 8 GPUs, accounts b and c. b0 holds it 0-400; b1 (b) waits from 1. At 400 the
    priorities are recomputed: b used everything, c nothing: normalised 1 and 0, shares 1/2
    each: factors 2^(-1/0.5) = 0.25 and 1. b1 starts at 400 (alone); b2 (b) at 405 waits;
    c0 (c) at 410 gets priority 10000 (age 0) against b2's 2500 + a little: it starts first when
    b1 ends at 500, b2 after it at 510. (A new arrival placed among the done entries at the
    queue's front was once lost: it never started.)"""
    reqs = [
        req("b0", 0, 8, 400, account="b"),
        req("b1", 1, 8, 100, account="b"),
        req("b2", 405, 8, 100, account="b"),
        req("c0", 410, 8, 10, account="c"),
    ]
    assert starts(reqs, fleet(8), "fairshare") == {"b0": 0, "b1": 400, "b2": 510, "c0": 500}
    assert starts(reqs, fleet(8), "fifo") == {"b0": 0, "b1": 400, "b2": 500, "c0": 600}


def test_a_gang_waits_for_two_whole_nodes() -> None:
    """Two nodes of 8. A holds 4 on n1 0-100. B wants 2 nodes x 8 at 10: as a gang it waits
    until both are free at 100; C (4 GPUs, 1000 s) at 20 would hold n1 past B's reservation:
    it waits too (B at 100-150, C at 150). Without +gang B takes n2 at 10 and n1 at 100: the
    same start, but n2's 8 GPUs are held doing nothing for 90 s (more allocated GPU-seconds)."""
    reqs = [req("A", 0, 4, 100), req("B", 10, 8, 50, nodes=2), req("C", 20, 4, 1000)]
    cap = fleet(8, 8, to=2000)
    gang = replay(reqs, cap, parse_policy("backfill+gang"))
    assert {o.request.request_id: (o.start, o.nodes) for o in gang.outcomes} == {
        "A": (0, ("n1",)),
        "B": (100, ("n1", "n2")),
        "C": (150, ("n1",)),
    }
    loose = replay(reqs, cap, parse_policy("backfill"))
    b = next(o for o in loose.outcomes if o.request.request_id == "B")
    assert b.start == 100 and sorted(b.holdings) == [("n1", 100, 150), ("n2", 10, 150)]
    # allocated: A 4 x 100, B 2 x 8 x 50, C 4 x 1000 (to 1150) = 400 + 800 + 4000; loose + 8 x 90
    assert allocated_s(gang)[0] == 5200
    assert allocated_s(loose)[0] == 5200 + 720


def test_spread_fragments_and_a_two_node_request_waits() -> None:
    """Three nodes of 8. A and B (4 GPUs each, 1000 s) at 0 and 1, then C (2 nodes x 8) at 2.
    pack: A and B share n1; n2 and n3 host C at once. spread: A on n1, B on n2 (the most free
    first): one whole node left (n3), C waits until A ends at 1000 and takes n1 and n3; its incident at
    2 + 600 is fragmentation (16 GPUs free in all, one node fits)."""
    reqs = [req("A", 0, 4, 1000), req("B", 1, 4, 1000), req("C", 2, 8, 100, nodes=2)]
    cap = fleet(8, 8, 8, to=5000)
    pack = replay(reqs, cap, parse_policy("fifo+gang:pack"))
    assert {o.request.request_id: (o.start, o.nodes) for o in pack.outcomes} == {
        "A": (0, ("n1",)),
        "B": (1, ("n1",)),
        "C": (2, ("n2", "n3")),
    }
    assert pack.incidents == ()
    spread = replay(reqs, cap, parse_policy("fifo+gang:spread"))
    assert {o.request.request_id: (o.start, o.nodes) for o in spread.outcomes} == {
        "A": (0, ("n1",)),
        "B": (1, ("n2",)),
        "C": (1000, ("n1", "n3")),
    }
    (inc,) = spread.incidents
    assert (inc.request_id, inc.opened, inc.cause, inc.free_gpus, inc.fitting_nodes) == (
        "C",
        602,
        "fragmentation",
        16,
        1,
    )


def test_a_drained_node_takes_no_new_work_and_its_running_job_is_outside_capacity() -> None:
    """n1 (8 GPUs) is drained from 500 to 800. A (8 GPUs, 100 s) at 450 runs through the drain
    to 550; B (8 GPUs) at 460 can start only when the node is back, at 800. Capacity: 8 x 500 +
    8 x 1200 = 13,600 GPU-s in [0, 2000); allocated: A's 50 s before the drain (its 50 s in the
    drain are outside capacity) = 400, B's 100 s = 800: CUR 1200 / 13600."""
    cap = Capacity(0, 2000, (Node("n1", "", ((0, 500, 8), (800, 2000, 8))),))
    reqs = [req("A", 450, 8, 100), req("B", 460, 8, 100)]
    for policy in ("fifo", "first-fit", "backfill", "fairshare"):
        rep = replay(reqs, cap, parse_policy(policy))
        assert {o.request.request_id: o.start for o in rep.outcomes} == {"A": 450, "B": 800}, policy
        s = summarise(rep, RulesConfig().whatif.fairshare)
        assert capacity_s(cap) == 13600
        assert s["cur_allocation"] == pytest.approx(1200 / 13600, abs=1e-12)
        assert s["idle_unallocated_gpu_hours"] == pytest.approx((13600 - 1200) / 3600, abs=1e-12)
        assert s["wait_p50_s"] == 0 and s["wait_p99_s"] == 340


def test_added_gpus_start_what_waited() -> None:
    reqs = [req("A", 0, 8, 100), req("B", 0, 8, 100)]
    cap = fleet(8, to=1000)
    assert starts(reqs, cap, "fifo") == {"A": 0, "B": 100}
    more = cap.with_added(8, 8, "H200")
    rep = replay(reqs, more, parse_policy("fifo"))
    assert {o.request.request_id: (o.start, o.nodes) for o in rep.outcomes} == {
        "A": (0, ("n1",)),
        "B": (0, ("whatif-added-0",)),
    }
    # 16 GPUs x 1000 s of capacity, 1600 GPU-s allocated
    s = summarise(rep, RulesConfig().whatif.fairshare)
    assert s["capacity_gpu_hours"] == pytest.approx(16000 / 3600) and s["cur_allocation"] == pytest.approx(
        0.1
    )
    # 10 GPUs in nodes of 4: 4, 4 and 2
    assert [n.max_gpus for n in cap.with_added(10, 4).nodes[1:]] == [4, 4, 2]


def test_requests_from_before_the_window() -> None:
    """The window is [1000, 3000). R (running since 500, recorded on n1 to 1500) keeps its node
    and end; P (submitted at 800, still pending at 1000) is queued at 1000 in submit order ahead
    of N (1200); O (ended before 1000) is not in the replay."""
    cap = fleet(8, frm=1000, to=3000)
    reqs = [
        req("O", 100, 8, 300, recorded_start=200, recorded_nodes=("n1",)),
        req("R", 400, 8, 1000, recorded_start=500, recorded_nodes=("n1",)),
        req("P", 800, 8, 100),
        req("N", 1200, 8, 100),
    ]
    rep = replay(reqs, cap, parse_policy("fifo"))
    got = {o.request.request_id: (o.start, o.carried) for o in rep.outcomes}
    assert got == {"R": (500, "running"), "P": (1500, "pending"), "N": (1600, "")}
    s = summarise(rep, RulesConfig().whatif.fairshare)
    # only N was submitted in the window: its wait is the only one counted
    assert (s["requests"], s["wait_p50_s"]) == (1, 400)
    # allocated in the window: R 1000-1500, P 1500-1600, N 1600-1700 = 8 x 700
    assert s["allocated_gpu_hours"] == pytest.approx(8 * 700 / 3600)


def test_never_started_withdrawn_and_zero_gpu_requests() -> None:
    """L (16 GPUs per node, nodes of 8) can never start: it never blocks fifo, and its incident
    says capacity (16 > 8 free); W is cancelled while pending at 400 (it leaves the queue); Z
    asks for no GPU (not replayed); U is still waiting at the end: its wait counts as 1000 - 200."""
    cap = fleet(8, to=1000)
    reqs = [
        req("A", 0, 8, 500),
        req("L", 10, 16, 10),
        req("W", 20, 8, math.inf, withdrawn=400),
        req("Z", 30, 0, 10),
        req("B", 40, 8, 600),
        req("U", 200, 8, 10),
    ]
    rep = replay(reqs, cap, parse_policy("fifo"))
    got = {o.request.request_id: o.start for o in rep.outcomes}
    assert got == {"A": 0, "L": None, "W": None, "B": 500, "U": None}
    assert rep.never_fit == ("L",) and rep.skipped == ("Z",)
    causes = {i.request_id: i.cause for i in rep.incidents}
    # L opens at 610, U at 800, both while B holds the node (500-1100); B waited 460 s (< 600);
    # W left the queue at 400, before its opening at 620
    assert causes == {"L": "capacity", "U": "capacity"}
    s = summarise(rep, RulesConfig().whatif.fairshare)
    assert s["not_started"] == 3 and s["requests"] == 5
    assert (s["assumed_run_requests"], s["assumed_run_gpu_hours"]) == (0, 0)
    # with 16 more GPUs W starts at once and holds 8 GPUs until it left, 20 to 400: assumed
    more = summarise(
        replay(reqs, cap.with_added(16, 8), parse_policy("fifo")), RulesConfig().whatif.fairshare
    )
    assert more["assumed_run_requests"] == 1
    assert more["assumed_run_gpu_hours"] == pytest.approx(8 * (400 - 20) / 3600)
    # waits: A 0, W 380 (until it left), B 460, U 800 and L 990 (until the end): nearest rank,
    # p50 the 3rd of 5, p99 the 5th
    assert (s["wait_p50_s"], s["wait_p99_s"]) == (460, 990)


def test_recorded_replay_places_as_recorded() -> None:
    reqs = [
        req("A", 0, 4, 100, recorded_start=5, recorded_nodes=("n2",)),
        req("B", 0, 8, 100, recorded_start=700, recorded_nodes=("n1",)),
    ]
    rep = replay(reqs, fleet(8, 8, to=1000), RECORDED)
    assert {o.request.request_id: (o.start, o.nodes) for o in rep.outcomes} == {
        "A": (5, ("n2",)),
        "B": (700, ("n1",)),
    }
    (inc,) = rep.incidents
    assert (inc.request_id, inc.cause) == ("B", "policy")  # opened at 600 with n1 free: policy


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile([5], 0.99) == 5


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("fifo", "fifo:pack"),
        ("backfill+gang:spread", "backfill+gang:spread"),
        (" FairShare+GANG ", "fairshare+gang:pack"),
        ("first-fit:spread", "first-fit:spread"),
    ],
)
def test_policy_names(text: str, name: str) -> None:
    assert parse_policy(text).name == name


@pytest.mark.parametrize(
    "text",
    [
        "",
        "lifo",
        "fifo+gnag",
        "fifo:stack",
        "backfill:",
        "+gang",
        "fifo\x1b[2J",
        "fifo+gang+gang",
        "fifo+gang+gang:spread",
    ],
)
def test_unknown_policies_are_refused(text: str) -> None:
    with pytest.raises(PolicyError):
        parse_policy(text)


@pytest.mark.parametrize(
    "text",
    [
        "x" * 100_000,
        "fifo+" + "g" * 100_000,
        "fifo:" + "p" * 100_000,
        "\n" * 50_000,
        "fifo+gang:" + "\u202e" * 9_999,
    ],
)
def test_a_refused_policy_is_named_in_one_short_line(text: str) -> None:
    """A hostile --policy (or config) text: the error quotes a bounded, escaped part of it, never
    the whole (a 100 KB flag gave a 100 KB message)."""
    with pytest.raises(PolicyError) as e:
        parse_policy(text)
    msg = str(e.value)
    assert "\n" not in msg and "\u202e" not in msg and len(msg) < 400, msg[:400]
    assert f"({len(text)} characters)" in msg


@pytest.mark.parametrize(
    ("conf", "key"),
    [
        ({"whatif": {"fairshare": {"half_life_s": -1}}}, "half_life_s"),
        ({"whatif": {"fairshare": {"shares": {"a": 0}}}}, "shares"),
        ({"whatif": {"fairshare": {"discipline": "lottery"}}}, "discipline"),
        ({"whatif": {"backfill": {"max_job_test": 0}}}, "max_job_test"),
        ({"whatif": {"fairshare": {"weight_age": float("inf")}}}, "weight_age"),
        ({"whatif": {"bogus": 1}}, "bogus"),
    ],
)
def test_bad_whatif_config_names_the_key(conf: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse(conf)


def test_names_from_the_data_reach_the_terminal_escaped() -> None:
    """A queue and an account named with terminal escapes: the table prints them escaped."""
    from gpuslo.app.text import terminal_safe
    from gpuslo.app.whatif import table
    from gpuslo.rules.whatif import Window

    evil = "A\x1b]0;pwned\x07\x1b[2J\u202e"
    reqs = [req("1", 0, 8, 100, queue=evil, account=evil), req("2", 0, 8, 100)]
    res = compare(Window(tuple(reqs), fleet(8, to=1000), "c1"), [parse_policy("fifo")])
    out = terminal_safe(table(res))
    assert "A\\x1b]0;pwned" in out and "\x1b" not in out and "\u202e" not in out
    assert res["recorded"]["accounts"][0]["account"] == evil  # JSON keeps it as it is


def test_a_start_before_its_submit_and_repeated_nodes_from_the_store() -> None:
    from gpuslo.rules.whatif_load import request_of

    row = {"request_id": "9", "scheduler": "slurm", "cluster": "c", "queue": "q", "account": "a", "user": "u",
           "submitted": 100.5, "nodes": 2, "gpus_per_node": 4.0, "started": 100.0, "ended": 90.0,
           "pool": "", "assigned": ["n1", "n1", "n2"]}  # fmt: skip
    r = request_of(row)
    assert (r.submit, r.recorded_start, r.run_s, r.recorded_nodes) == (100.0, 100.0, 0.0, ("n1", "n2"))
    never = request_of({**row, "started": None, "ended": 300.0, "assigned": []})
    assert (never.submit, never.withdrawn, never.run_s, never.recorded_start) == (
        100.5,
        300.0,
        math.inf,
        None,
    )


# ---------------------------------------------------------------------------- invariants
@st.composite
def queues(draw: st.DrawFn) -> tuple[Capacity, list[Request]]:
    gpus = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3))
    cap = fleet(*gpus, to=5000)
    reqs = []
    for k in range(draw(st.integers(0, 14))):
        nodes = draw(st.integers(1, len(gpus)))
        g = draw(st.sampled_from([0.5, 1, 2, 3, 4, 8]))
        reqs.append(
            req(
                f"r{k}",
                draw(st.integers(0, 600)),
                g,
                draw(st.integers(1, 900)),
                nodes=nodes,
                account=draw(st.sampled_from("xyz")),
            )
        )
    return cap, reqs


def _overlaps_ok(rep: Any, cap: Capacity) -> None:
    limit = {n.name: n.max_gpus for n in cap.nodes}
    for name in limit:
        evs = []
        for o in rep.outcomes:
            for node, a, b in o.holdings:
                if node == name and b > a:
                    evs += [(a, 1, o.request.gpus_per_node), (b, 0, -o.request.gpus_per_node)]
        held = 0.0
        for _, _, d in sorted(evs):
            held += d
            assert held <= limit[name] + 1e-9, (name, held)


@settings(max_examples=50, deadline=None)  # the fast tier keeps it under a second
@given(q=queues(), policy=st.sampled_from(["fifo", "first-fit", "backfill", "fairshare"]),
       gang=st.booleans(), place=st.sampled_from(["pack", "spread"]))  # fmt: skip
def test_invariants_on_random_queues(
    q: tuple[Capacity, list[Request]], policy: str, gang: bool, place: str
) -> None:
    cap, reqs = q
    pol = parse_policy(f"{policy}{'+gang' if gang else ''}:{place}")
    rep = replay(reqs, cap, pol)
    assert rep == replay(reqs, cap, pol)  # deterministic
    _overlaps_ok(rep, cap)
    by = {o.request.request_id: o for o in rep.outcomes}
    for o in rep.outcomes:
        if o.start is not None:
            assert o.start >= o.request.submit
            assert len(o.nodes) == o.request.nodes  # every part, on distinct nodes
            assert all(a >= o.request.submit for _, a, _ in o.holdings)
    if policy == "fifo":
        order = sorted(reqs, key=lambda r: r.submit)  # stable: input order on ties
        got = [
            by[r.request_id].start for r in order if r.request_id not in rep.never_fit and r.gpus_per_node > 0
        ]
        # strict order: once one has not started, none behind it has
        seen_none = False
        last = -math.inf
        for s in got:
            if s is None:
                seen_none = True
                continue
            assert not seen_none and s >= last
            last = s
    if policy == "backfill":
        # no head starts later than the reservation it got when it became head (perfect
        # estimates, no capacity change)
        for rid, t in rep.reservations.items():
            s = by[rid].start
            assert (s is not None and s <= t + 1e-9) or math.isinf(t) or t >= cap.to, (rid, s, t)


@pytest.mark.parametrize("policy", ["fifo+gang", "first-fit+gang", "backfill+gang", "fairshare+gang:spread"])
def test_every_request_starts_on_a_long_enough_horizon(policy: str) -> None:
    """400 requests on 3 nodes (long queues: the queue is compacted and re-sorted many times):
    with the horizon past the sum of all run times, every gang request that fits starts, under
    every policy, and no node is ever over-allocated (a request lost from the queue once
    stayed unstarted here)."""
    import random

    rnd = random.Random(7)
    reqs = []
    for k in range(400):
        g, n = rnd.choice([1, 2, 4, 8]), rnd.choice([1, 1, 1, 2])
        reqs.append(
            req(f"r{k}", rnd.uniform(0, 5000), g, rnd.uniform(1, 300), nodes=n, account=rnd.choice("xyz"))
        )
    cap = fleet(8, 8, 4, to=5000 + sum(r.run_s for r in reqs) + 1)
    rep = replay(reqs, cap, parse_policy(policy))
    assert [o.request.request_id for o in rep.outcomes if o.start is None] == []
    _overlaps_ok(rep, cap)


@pytest.mark.parametrize(
    "policy", ["first-fit", "backfill", "backfill+gang:spread", "fairshare", "fairshare+gang"]
)
def test_the_shortcuts_give_the_answers_of_full_passes(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass after submits only tries the new requests, and a pass stops once every pending
    shape has failed: on a long queue (drains included) the starts, nodes and incidents are
    those of full passes over the whole queue every time."""
    import random

    from gpuslo.rules import whatif_engine as eng

    rnd = random.Random(3)
    reqs = []
    for k in range(600):
        g, n = rnd.choice([0.5, 1, 2, 4, 8]), rnd.choice([1, 1, 1, 2, 3])
        reqs.append(
            req(f"r{k}", rnd.uniform(0, 20_000), g, rnd.uniform(1, 900), nodes=n, account=rnd.choice("xyzw"))
        )
    nodes = [Node(f"n{i}", "a" if i % 2 else "b", ((0, 6000, 8.0), (8000, 40_000, 8.0)) if i == 3 else ((0, 40_000, 8.0),))
             for i in range(6)]  # fmt: skip
    cap = Capacity(0, 40_000, tuple(nodes))
    fast = replay(reqs, cap, parse_policy(policy))
    monkeypatch.setattr(eng._Sim, "_only_new_to_try", lambda self: False)
    monkeypatch.setattr(eng._Sim, "_all_failed", lambda self, fail: False)
    orig = eng._Sim.schedule

    def full(self: Any, now: float) -> None:
        self.released = True  # every pass over the whole queue
        orig(self, now)

    monkeypatch.setattr(eng._Sim, "schedule", full)
    slow = replay(reqs, cap, parse_policy(policy))
    assert fast.outcomes == slow.outcomes and fast.incidents == slow.incidents
    # the queue did move (fairshare without +gang deadlocks after about 100: partial placements
    # of multi-node requests end up holding every GPU, docs/whatif.md)
    assert sum(o.start is not None for o in fast.outcomes) >= 100


@settings(max_examples=40, deadline=None)
@given(q=queues(), policy=st.sampled_from(["fifo+gang", "first-fit+gang", "backfill+gang", "backfill+gang:spread"]),
       cut=st.integers(0, 1500))  # fmt: skip
def test_identity_a_schedule_replayed_under_its_own_policy(
    q: tuple[Capacity, list[Request]], policy: str, cut: int
) -> None:
    """A schedule produced by a policy, taken as the record: the recorded column's numbers are
    the policy's (one metric code path, the same starvation causes), and replaying a window that
    starts later (running requests kept as recorded, pending ones queued at its start) gives the
    same starts for the requests submitted in it."""
    import dataclasses

    cap, reqs = q
    pol = parse_policy(policy)
    full = replay(reqs, cap, pol)
    by = {o.request.request_id: o for o in full.outcomes}
    rec = [
        dataclasses.replace(r, recorded_start=by[r.request_id].start, recorded_nodes=by[r.request_id].nodes)
        if r.request_id in by and by[r.request_id].start is not None
        else r
        for r in reqs
    ]
    fs = RulesConfig().whatif.fairshare
    a, b = summarise(full, fs), summarise(replay(rec, cap, RECORDED), fs)
    for k in ("cur_allocation", "idle_unallocated_gpu_hours", "wait_p50_s", "wait_p99_s", "queues",
              "starvation_incidents", "starvation_by_cause", "accounts"):  # fmt: skip
        assert a[k] == b[k], k
    later = Capacity(float(cut), cap.to, cap.nodes)
    part = replay(rec, later, pol)
    for o in part.outcomes:
        if o.request.submit >= cut:
            assert (o.start, o.nodes) == (by[o.request.request_id].start, by[o.request.request_id].nodes)


# ---------------------------------------------------------------------------- through the store
HOUR = 3600.0


def _recorded_fleet(c: str = "c1") -> list[Any]:
    """A schedule produced by fifo+gang:pack, on paper: n1 and n2 (8 GPUs each), a sample per
    GPU every 60 s over [T0, T0 + 1800), heartbeats schedulable. R1 (8 GPUs) at T0 runs 600 s on
    n1; R2 (2 x 8) at T0 + 60 waits for n1, starts at T0 + 600 on both, runs 600 s; R3 (4 GPUs)
    at T0 + 120 waits behind R2 (fifo), starts at T0 + 1200 on n1 (pack: ties by name), 300 s."""
    sched = [
        ("R1", 0, 8.0, 1, 0, 600, ("n1",)),
        ("R2", 60, 8.0, 2, 600, 1200, ("n1", "n2")),
        ("R3", 120, 4.0, 1, 1200, 1500, ("n1",)),
    ]
    msgs: list[Any] = []
    for rid, sub, g, n, s, e, nodes in sched:
        msgs.append(h.sched("submit", rid, T0 + sub, gpn=g, nodes=n, cluster=c))
        start = h.sched("start", rid, T0 + s, gpn=g, nodes=n, cluster=c)
        msgs.append(start.model_copy(update={"assigned_nodes": nodes}))
        msgs.append(h.sched("end", rid, T0 + e, gpn=g, nodes=n, cluster=c))
    for node in ("n1", "n2"):
        msgs.append(h.heartbeat(node, T0, True, interval_s=60, pool="", cluster=c))
        for k in range(30):
            t = k * 60
            gs = []
            for i in range(8):
                held = [rid for rid, _, g, _, s, e, nodes in sched if node in nodes and s <= t < e and i < g]
                gs.append(h.gpu(i, allocs=tuple((rid, 1.0) for rid in held)))
            msgs.append(h.batch(node, T0 + t, gs, interval_s=60, pool="", cluster=c))
    return msgs


@pytest.mark.integration  # chDB
def test_identity_through_the_store(store: ChdbStore) -> None:
    write(store, _recorded_fleet())
    cfg = RulesConfig()
    win = load(store, T0, T0 + 1800, "", cfg)
    assert [(r.request_id, r.recorded_start, r.run_s, r.recorded_nodes) for r in win.requests] == [
        ("R1", T0, 600, ("n1",)),
        ("R2", T0 + 600, 600, ("n1", "n2")),
        ("R3", T0 + 1200, 300, ("n1",)),
    ]
    assert [(n.name, n.spans) for n in win.capacity.nodes] == [
        ("n1", ((T0, T0 + 1800, 8.0),)),
        ("n2", ((T0, T0 + 1800, 8.0),)),
    ]
    res = compare(win, [parse_policy("fifo+gang")], cfg)
    rec, fifo = res["recorded"], res["policies"][0]
    assert [(s["request_id"], s["start"], s["nodes"]) for s in fifo["starts"]] == [
        (s["request_id"], s["start"], s["nodes"]) for s in rec["starts"]
    ]
    for k in (
        "cur_allocation",
        "idle_unallocated_gpu_hours",
        "wait_p50_s",
        "wait_p99_s",
        "starvation_incidents",
    ):
        assert fifo[k] == rec[k], k
    # allocated: R1 8 x 600 + R2 16 x 600 + R3 4 x 300 = 15,600 of 16 x 1800 = 28,800
    assert rec["cur_allocation"] == pytest.approx(15600 / 28800, abs=1e-12)
    # the rules engine over the same samples says the same (starts and ends on sample times)
    s = summary(store, cfg, T0, T0 + 1800, "")
    assert s.cur_allocation == pytest.approx(rec["cur_allocation"], abs=5e-7)  # the summary keeps 6 digits
    # R2 waited 540 s, R3 1080 s: with the 600 s threshold R3's incident opens at T0 + 720 while
    # n1 and n2 are held by R2 (nothing free): capacity; the rule's cause is the same
    assert rec["starvation_by_cause"] == {"capacity": 1, "fragmentation": 0, "policy": 0}
    assert [(i.request_id, i.cause) for i in s.starvation_incidents] == [("R3", "capacity")]
    # back-fill: R2's reservation is T0 + 600 (n1 free then); R3 (300 s) on the idle n2 ends at
    # T0 + 420, before it: it back-fills at once
    bf = compare(win, [parse_policy("backfill+gang")], cfg)["policies"][0]
    assert {x["request_id"]: x["start"] for x in bf["starts"]} == {"R1": T0, "R2": T0 + 600, "R3": T0 + 120}


@pytest.mark.integration  # chDB
@pytest.mark.parametrize(
    ("submit", "start", "lookback_s"),
    [(None, 0.0, 30 * 86400.0), (-1000.0, -50.0, 100.0)],
    ids=["submit-lost", "submit-before-the-lookback"],
)
def test_a_start_whose_submit_the_record_lacks_still_holds_its_gpus(
    store: ChdbStore, submit: float | None, start: float, lookback_s: float
) -> None:
    """S (8 GPUs on n2, ends at T0 + 300) has a start but no submit in what is read: lost, or
    older than the lookback. It is taken as submitted at its start (no wait) and holds n2 under
    every policy: recorded allocation (15,600 + 8 x 300) / 28,800 GPU-s = 0.625; it was dropped
    (0.5417, n2 free to every policy)."""
    msgs = _recorded_fleet()
    if submit is not None:
        msgs.append(h.sched("submit", "S", T0 + submit, gpn=8.0))
    msgs.append(h.sched("start", "S", T0 + start, gpn=8.0).model_copy(update={"assigned_nodes": ("n2",)}))
    msgs.append(h.sched("end", "S", T0 + 300, gpn=8.0))
    write(store, msgs)
    cfg = RulesConfig().model_copy(
        update={"whatif": RulesConfig().whatif.model_copy(update={"lookback_s": lookback_s})}
    )
    win = load(store, T0, T0 + 1800, "", cfg)
    s = next(r for r in win.requests if r.request_id == "S")
    assert (s.submit, s.recorded_start, s.run_s, s.recorded_nodes, s.gpus_per_node, s.nodes) == (
        T0 + start, T0 + start, 300 - start, ("n2",), 8.0, 1
    )  # fmt: skip
    res = compare(win, [parse_policy("fifo+gang")], cfg)
    assert res["recorded"]["cur_allocation"] == pytest.approx(18000 / 28800, abs=1e-12)
    by = {x["request_id"]: x["start"] for x in res["policies"][0]["starts"]}
    assert by["S"] == T0 + start  # on n2 from its start (running at the window's start, or no wait)


def _cli_store(tmp_path: Path, msgs: list[Any]) -> str:
    s = ChdbStore(tmp_path / "store")
    from gpuslo.rules.tables import SCHEMA

    s.migrate(SCHEMA)
    write(s, msgs)
    s.close()
    return str(tmp_path / "store")


@pytest.mark.integration  # chDB
def test_cli_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _cli_store(tmp_path, _recorded_fleet())
    base = ["whatif", "--store", path, "--from", str(T0), "--to", str(T0 + 1800)]
    assert main([*base, "--policy", "fifo+gang", "--policy", "backfill+gang:spread", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in out["policies"]] == ["fifo+gang:pack", "backfill+gang:spread"]
    for e in [out["recorded"], *out["policies"]]:
        for k in ("policy", "cur_allocation", "idle_unallocated_gpu_hours", "wait_p50_s", "wait_p95_s",
                  "wait_p99_s", "starvation_incidents", "starvation_by_cause", "queues", "accounts", "starts"):  # fmt: skip
            assert k in e, k
    assert main([*base, "--add-gpus", "8", "--gpus-per-node", "8", "--gpu-model", "H200"]) == 0
    text = capsys.readouterr().out
    assert (
        "Allocation CUR" in text
        and "recorded" in text
        and "backfill+gang:pack" in text
        and "8 more GPUs" in text
    )
    # an empty window: no requests, no capacity
    assert (
        main(
            ["whatif", "--store", path, "--from", str(T0 + 10 * HOUR), "--to", str(T0 + 11 * HOUR), "--json"]
        )
        == 0
    )
    empty = json.loads(capsys.readouterr().out)
    assert empty["recorded"]["requests"] == 0 and empty["recorded"]["cur_allocation"] is None


@pytest.mark.integration  # chDB
@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--policy", "lifo"], "unknown policy 'lifo'"),
        (["--add-gpus", "8"], "--add-gpus and --gpus-per-node go together"),
        (["--add-gpus", "0", "--gpus-per-node", "8"], "--add-gpus must be"),
        (["--add-gpus", "8", "--gpus-per-node", "2000"], "--gpus-per-node must be"),
        (["--add-gpus", "100000", "--gpus-per-node", "1"], "more than 10000 nodes"),
        (["--add-gpus", "-3", "--gpus-per-node", "8"], "--add-gpus must be"),
        (["--add-gpus", "-1"], "--add-gpus must be"),  # alone: its range first, not its partner
        (["--add-gpus", "0"], "--add-gpus must be"),
        (["--add-gpus", "99999999999999999999"], "--add-gpus must be"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be"),
        (["--gpus-per-node", "8"], "--add-gpus and --gpus-per-node go together"),
        (["--to", "0"], "--to must be after --from"),
        (["--config", "BAD"], "half_life_s"),
    ],
)
def test_cli_refusals_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    path = _cli_store(tmp_path, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("whatif:\n  fairshare:\n    half_life_s: -5\n")
    extra = [str(bad) if x == "BAD" else x for x in extra]
    args = ["whatif", "--store", path, "--from", str(T0), "--to", str(T0 + HOUR), *extra]
    if "--to" in extra:
        args = ["whatif", "--store", path, "--from", str(T0), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err


def test_the_json_has_no_nan_or_infinity_at_any_depth() -> None:
    from gpuslo.app.whatif import _json_safe

    x = {"a": math.nan, "b": [math.inf, {"c": (-math.inf, 1.5, (math.nan,))}], "d": ("x", 2)}
    text = json.dumps(_json_safe(x), allow_nan=False)  # raises on a NaN or infinity left
    assert json.loads(text) == {"a": None, "b": [None, {"c": [None, 1.5, [None]]}], "d": ["x", 2]}


def test_cli_bad_times_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("yesterday", "nan", "1e30"):
        with pytest.raises(SystemExit) as e:
            main(["whatif", "--store", "x", "--from", bad, "--to", "1"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--from" in err and "Traceback" not in err


@pytest.mark.parametrize(("text", "hint"), [("9999-01-01", False), ("2200-06-01T00:00:00Z", False),
                                            ("1795996800000", True), ("1795996800000.5", True)])  # fmt: skip
def test_the_milliseconds_hint_only_for_epoch_numbers(
    capsys: pytest.CaptureFixture[str], text: str, hint: bool
) -> None:
    """Epoch milliseconds given as seconds get the hint; an ISO date past 2106 is no such slip
    (9999-01-01 is 253,370,764,800 s: a thousandth of it is in range, and was hinted)."""
    with pytest.raises(SystemExit):
        main(["whatif", "--store", "x", "--from", text, "--to", "1"])
    err = capsys.readouterr().err
    assert "is not a time between" in err and ("milliseconds?" in err) is hint, err


@pytest.mark.integration  # chDB
def test_two_clusters_need_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _cli_store(tmp_path, _recorded_fleet("c1") + _recorded_fleet("c2"))
    base = ["whatif", "--store", path, "--from", str(T0), "--to", str(T0 + 1800), "--json"]
    assert main(base) == 2
    assert "name one with --cluster" in capsys.readouterr().err
    assert main([*base, "--cluster", "c2"]) == 0
    assert json.loads(capsys.readouterr().out)["recorded"]["requests"] == 3


@pytest.mark.integration  # chDB
@pytest.mark.parametrize(
    ("evil", "shown"), [("c\x1b[2J\u202e", "c\\x1b[2J\\u202e"), (" \t", "' \\t'"), ("a\nb", "'a\\nb'")]
)
def test_a_refusal_naming_the_stores_clusters_reaches_the_terminal_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], evil: str, shown: str
) -> None:
    """The refusal lists the window's clusters, names from the store: printed escaped (an ESC
    sequence clearing the screen, a bidi override, a tab or a newline: the refusal is one line),
    like every name in the table."""
    path = _cli_store(tmp_path, _recorded_fleet(evil) + _recorded_fleet("c2"))
    assert main(["whatif", "--store", path, "--from", str(T0), "--to", str(T0 + 1800)]) == 2
    err = capsys.readouterr().err
    assert "name one with --cluster" in err and shown in err, err
    assert not set(evil) - set(shown) & set(err.rstrip("\n")), err  # none of its controls raw
    assert err.count("\n") == 1, err


@pytest.mark.integration  # chDB
def test_the_added_gpus_model_is_one_escaped_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _cli_store(tmp_path, _recorded_fleet())
    model = "a\nb\t\x1b[2J"
    base = ["whatif", "--store", path, "--from", str(T0), "--to", str(T0 + 1800)]
    assert main([*base, "--add-gpus", "8", "--gpus-per-node", "8", "--gpu-model", model]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "8 more GPUs" in x)
    assert "a\\nb\\t\\x1b[2J" in line and "\x1b" not in out and "\t" not in out, line

"""The what-if replay: an event-driven simulation of one scheduling policy over recorded
requests and capacity (docs/whatif.md has the exact rules). Pure Python, deterministic: the
same input gives the same starts, ties broken by submit time, then by input order, then by node
name.

Events (a heap, ordered by time, then kind): ends and capacity changes first, then
withdrawals, submits and recorded starts; then one scheduling pass for that time; then the
starvation openings of that time, judged on the state after the pass (a request that starts at
its opening is not an incident, as in the rule: it must wait *longer* than its threshold).

Free GPUs are kept per node and, for each pool a request may name, in buckets by free amount,
so that finding nodes that fit is a walk over a few buckets rather than over the nodes. Within
one pass resources only shrink, so a shape (pool, GPUs per node, parts, gang) that did not fit
is not tried again in that pass. EASY back-fill computes each head's reservation once and keeps
it while nothing unplanned happens (a capacity change, an end before its estimate, a start
ahead of the head); it tries at most ``backfill.max_job_test`` requests behind the head per pass.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from gpuslo.rules.whatif_config import WhatIf
from gpuslo.rules.whatif_model import EPS, Capacity, Incident, Outcome, Policy, Replay, Request

# pool, GPUs per node, parts still to place, all-or-nothing, the nodes it holds parts on (a
# request that holds some may not use those: it fails or fits on its own, its shape is its own)
_Shape = tuple[str, float, int, bool, tuple[int, ...]]

# event kinds, in the order they are handled at one time
_END, _CAP, _WITHDRAW, _SUBMIT, _RSTART = 0, 1, 2, 3, 4
_LN2 = math.log(2)


def _pools(text: str) -> frozenset[str]:
    return frozenset(text.split(","))


@dataclass(slots=True)
class _Class:
    """The nodes a request naming one pool may use, bucketed by free GPUs."""

    members: list[int]
    buckets: dict[float, set[int]] = field(default_factory=dict)
    max_gpus: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _State:
    placed: list[int] = field(default_factory=list)  # node index per part
    placed_at: list[float] = field(default_factory=list)
    start: float | None = None
    end: float = math.inf  # when it releases its GPUs
    est_end: float = math.inf  # what a back-fill scheduler expects
    pending: bool = False
    done: bool = False  # ended, or withdrawn
    holdings: list[tuple[int, float, float]] = field(default_factory=list)
    carried: str = ""


def _free_key(x: float) -> float:
    return round(x, 9)


def _free_in(c: _Class) -> float:
    """The free GPUs of a pool's nodes, from its buckets (a running float sum would drift over a
    month of adds and subtracts and flip ``free < requested`` at equality)."""
    return math.fsum(key * len(b) for key, b in c.buckets.items())


class _Sim:
    def __init__(
        self,
        requests: Sequence[Request],
        capacity: Capacity,
        policy: Policy,
        config: WhatIf,
        threshold_for: Callable[[str, str, str], float],
    ) -> None:
        self.reqs = list(requests)
        self.cap_in = capacity
        self.policy = policy
        self.cfg = config
        self.threshold_for = threshold_for
        self.frm, self.to = capacity.frm, capacity.to
        nodes = sorted(capacity.nodes, key=lambda n: n.name)
        self.names = [n.name for n in nodes]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.node_pools = [_pools(n.pool) for n in nodes]
        self.node_max = [n.max_gpus for n in nodes]
        self.cap = [0.0] * len(nodes)
        self.used = [0.0] * len(nodes)
        self.classes: dict[str, _Class] = {}
        self.node_classes: list[list[_Class]] = [[] for _ in nodes]
        self.total_free = 0.0
        self.st = [_State() for _ in self.reqs]
        self.heap: list[tuple[float, int, int, int, float]] = []
        self.opens: list[tuple[float, int]] = []
        self.seq = 0
        self.queue: list[int] = []
        self.qstart = 0  # the queue's entries before it are done
        self.dead = 0
        self.key: dict[int, tuple[float, float, int]] = {}
        self.running: dict[int, None] = {}
        self.ends: list[tuple[float, int]] = []  # (estimated end, request) of the started, sorted
        self.shapes: dict[_Shape, int] = {}  # the pending requests' shapes
        self.version = 0
        self.last_head = -1  # the head of the last back-fill pass
        self.placements = 0
        self.shadow: tuple[int, int, float, dict[int, float]] | None = None
        self.reservations: dict[str, float] = {}
        self.incidents: list[Incident] = []
        self.never_fit: list[str] = []
        self.skipped: list[str] = []
        # fair share
        self.usage: dict[str, float] = {}
        self.rate: dict[str, float] = {}
        self.usage_t: dict[str, float] = {}
        self.fs_factor: dict[str, float] = {}
        self.accounts = sorted({r.account for r in self.reqs})
        self.shape0: list[_Shape] = [
            (r.pool, r.gpus_per_node, r.nodes, policy.gang or r.nodes == 1, ()) for r in self.reqs
        ]
        self.last_calc = -math.inf
        self.limits = config.limits
        self.held_by: dict[tuple[str, str], float] = {}  # ("user"|"account", name) -> GPUs held
        self.reserve_after = config.first_fit.reserve_after_s
        self._limited = config.limits.user_gpus is not None or config.limits.account_gpus is not None
        self.new_since_pass: list[int] = []
        self.released = True
        for i, n in enumerate(nodes):
            for t0, t1, g in n.spans:
                a, b = max(t0, self.frm), min(t1, self.to)
                if b > a:
                    self._push(a, _CAP, i, g)
                    self._push(b, _CAP, i, -g)

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, who: int, value: float = 0.0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, who, value))

    def _class(self, pool: str) -> _Class:
        c = self.classes.get(pool)
        if c is None:
            want = _pools(pool)
            members = [i for i, p in enumerate(self.node_pools) if pool == "" or p & want]
            c = _Class(members, max_gpus=sorted((self.node_max[i] for i in members), reverse=True))
            for i in members:
                self.node_classes[i].append(c)
                self._bucket_add(c, i, self.cap[i] - self.used[i])
            self.classes[pool] = c
        return c

    def _bucket_add(self, c: _Class, i: int, free: float) -> None:
        if free > EPS:
            c.buckets.setdefault(_free_key(free), set()).add(i)

    def _bucket_remove(self, c: _Class, i: int, free: float) -> None:
        if free > EPS:
            k = _free_key(free)
            b = c.buckets[k]
            b.discard(i)
            if not b:
                del c.buckets[k]

    def _change(self, i: int, d_cap: float = 0.0, d_used: float = 0.0) -> None:
        old = self.cap[i] - self.used[i]
        self.cap[i] += d_cap
        self.used[i] += d_used
        new = self.cap[i] - self.used[i]
        if abs(new) < EPS:
            new = 0.0
            self.cap[i] = self.used[i]
        for c in self.node_classes[i]:
            self._bucket_remove(c, i, old)
            self._bucket_add(c, i, new)
        self.total_free += max(new, 0.0) - max(old, 0.0)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        pol = self.policy
        for i in sorted(range(len(self.reqs)), key=lambda j: (self.reqs[j].submit, j)):
            r = self.reqs[i]
            if not r.gpus_per_node > 0 or r.nodes < 1:
                self.skipped.append(r.request_id)
                self.st[i].done = True
                continue
            rs, re_ = r.recorded_start, r.recorded_end
            c = self._class(r.pool)
            if rs is not None and rs < self.frm:
                if re_ is not None and re_ > self.frm:  # running at the start: as recorded
                    self.st[i].carried = "running"
                    self._push(self.frm, _RSTART, i)
                else:
                    self.st[i].done = True  # over before the window
                continue
            if r.withdrawn is not None and r.withdrawn <= self.frm:
                self.st[i].done = True
                continue
            if r.submit >= self.to:
                self.st[i].done = True
                continue
            at = max(r.submit, self.frm)
            if r.submit < self.frm:
                self.st[i].carried = "pending"
            opened = r.submit + self.threshold_for(r.queue, r.scheduler, r.account)
            if self.frm <= opened < self.to:
                self.opens.append((opened, i))
            if pol.order == "recorded":
                if rs is not None and rs < self.to:
                    self._push(rs, _RSTART, i)
                elif r.withdrawn is not None and r.withdrawn < self.to:
                    self._push(r.withdrawn, _WITHDRAW, i)  # it left: no incident opens after
                continue
            if (
                len(c.max_gpus) < r.nodes
                or c.max_gpus[r.nodes - 1] + EPS < r.gpus_per_node
                or (self._limited and self._over_alone(r))
            ):
                self.never_fit.append(r.request_id)  # no set of its pool's nodes could ever host it
                continue
            self._push(at, _SUBMIT, i)
            if r.withdrawn is not None and r.withdrawn < self.to:
                self._push(r.withdrawn, _WITHDRAW, i)
        self.opens.sort()

    def _over_alone(self, r: Request) -> bool:
        """More GPUs than its user's or account's limit on its own: it can never start."""
        g, lim = r.nodes * r.gpus_per_node, self.limits
        return any(cap is not None and g > cap + EPS for cap in (lim.user_gpus, lim.account_gpus))

    # ------------------------------------------------------------------ placement
    def _remaining(self, i: int) -> int:
        return self.reqs[i].nodes - len(self.st[i].placed)

    def _choose(self, i: int, k: int, allow: dict[int, float] | None = None) -> list[int]:
        """Up to ``k`` nodes that can host a part of request ``i`` now (not ones it holds),
        in placement order: pack (least free first), spread (most free first), then name; or first
        (name order)."""
        r = self.reqs[i]
        g = r.gpus_per_node
        c = self._class(r.pool)
        own = self.st[i].placed
        out: list[int] = []
        if self.policy.placement == "first":  # the nodes in name order (Slurm's node order)
            for n in c.members:
                free = self.cap[n] - self.used[n]
                if free + EPS < g or n in own or (allow is not None and allow.get(n, math.inf) + EPS < g):
                    continue
                out.append(n)
                if len(out) == k:
                    break
            return out
        keys = sorted(c.buckets, reverse=self.policy.placement == "spread")
        for key in keys:
            if key + EPS < g:
                continue
            for n in sorted(c.buckets[key]):
                if n in own:
                    continue
                if allow is not None and allow.get(n, math.inf) + EPS < g:
                    continue
                out.append(n)
                if len(out) == k:
                    return out
        return out

    def _hold(self, r: Request, gpus: float) -> None:
        if not self._limited:
            return
        for key in (("user", r.user), ("account", r.account)):
            self.held_by[key] = self.held_by.get(key, 0.0) + gpus

    def _over(self, i: int, gpus: float) -> bool:
        """Holding ``gpus`` more would take request ``i``'s user or account over its limit."""
        r, lim = self.reqs[i], self.limits
        for kind, name, cap in (("user", r.user, lim.user_gpus), ("account", r.account, lim.account_gpus)):
            if cap is not None and self.held_by.get((kind, name), 0.0) + gpus > cap + EPS:
                return True
        return False

    def _held(self, i: int) -> bool:
        """Request ``i`` is held back by a limit now: skipped, not blocking (as Slurm's QOS)."""
        return self._limited and self._over(i, self._remaining(i) * self.reqs[i].gpus_per_node)

    def _place(self, i: int, nodes: list[int], now: float) -> None:
        r, s = self.reqs[i], self.st[i]
        self._count_shape(i, -1)
        for n in nodes:
            s.placed.append(n)
            s.placed_at.append(now)
            self._change(n, d_used=r.gpus_per_node)
        self._hold(r, r.gpus_per_node * len(nodes))
        self._account(r.account, now, r.gpus_per_node * len(nodes))
        self.running[i] = None
        if len(s.placed) >= r.nodes:
            self._started(i, now)
        else:
            self._count_shape(i, 1)

    def _started(self, i: int, now: float) -> None:
        r, s = self.reqs[i], self.st[i]
        s.start = now
        end = now + r.run_s
        if r.withdrawn is not None and r.withdrawn > now:
            end = min(end, r.withdrawn)
        s.end = end
        lim = r.time_limit_s if self.cfg.backfill.use_time_limits and r.time_limit_s else None
        s.est_end = now + lim if lim is not None else end
        if math.isfinite(s.est_end):
            bisect.insort(self.ends, (s.est_end, i))
        if s.pending:
            s.pending = False
            self.dead += 1
        if end < self.to:
            self._push(end, _END, i)

    def _release(self, i: int, now: float) -> None:
        r, s = self.reqs[i], self.st[i]
        for n, t0 in zip(s.placed, s.placed_at, strict=True):
            self._change(n, d_used=-r.gpus_per_node)
            s.holdings.append((n, t0, now))
        self._hold(r, -r.gpus_per_node * len(s.placed))
        self._account(r.account, now, -r.gpus_per_node * len(s.placed))
        s.placed, s.placed_at = [], []
        self.running.pop(i, None)
        if s.start is not None and math.isfinite(s.est_end):
            k = bisect.bisect_left(self.ends, (s.est_end, i))
            if k < len(self.ends) and self.ends[k] == (s.est_end, i):
                del self.ends[k]
        if now + EPS < s.est_end:
            self.version += 1  # earlier than a back-fill scheduler planned
        s.done = True

    def _shape(self, i: int) -> _Shape:
        r = self.reqs[i]
        s = self.st[i]
        return (
            r.pool,
            r.gpus_per_node,
            self._remaining(i),
            self.policy.gang or r.nodes == 1,
            tuple(s.placed),
        )

    def _count_shape(self, i: int, d: int) -> None:
        sh = self._shape(i)
        n = self.shapes.get(sh, 0) + d
        if n > 0:
            self.shapes[sh] = n
        else:
            self.shapes.pop(sh, None)

    def _all_failed(self, fail: set[_Shape]) -> bool:
        """Every shape still pending has failed in this pass: nothing more can start in it."""
        return self.shapes.keys() <= fail

    def _try(self, i: int, now: float, fail: set[_Shape]) -> bool:
        """Place what fits of request ``i`` now (all of it, for a gang or a one-node request);
        True if it has started."""
        r = self.reqs[i]
        shape = self._shape(i)
        k, gang = shape[2], shape[3]
        if shape in fail or self.total_free + EPS < r.gpus_per_node:
            return False
        nodes = self._choose(i, k)
        if (gang and len(nodes) < k) or not nodes:
            fail.add(shape)
            return False
        self._place(i, nodes, now)
        self.placements += 1
        if len(nodes) < k:
            fail.add(shape)
        return self.st[i].start is not None

    # ------------------------------------------------------------------ queue
    def _enqueue(self, i: int, now: float) -> None:
        s = self.st[i]
        s.pending = True
        self._count_shape(i, 1)
        if self.policy.order == "fairshare":
            self.key[i] = self._priority_key(i, now)
            bisect.insort(
                self.queue, i, lo=self.qstart, key=self.key.__getitem__
            )  # all before qstart are done
        else:
            self.queue.append(i)  # submits arrive in time order (ties: input order)

    def _live(self) -> Iterator[int]:
        q, st = self.queue, self.st
        k = self.qstart
        while k < len(q) and not st[q[k]].pending:  # the done ones at the front: skipped once
            k += 1
        self.qstart = k
        for j in range(k, len(q)):
            i = q[j]
            if st[i].pending:
                yield i

    def _compact(self) -> None:
        if self.dead > 64 and self.dead * 2 > len(self.queue):
            self.queue = [i for i in self.queue if self.st[i].pending]
            self.dead = 0
            self.qstart = 0

    # ------------------------------------------------------------------ fair share
    def _account(self, account: str, now: float, d_rate: float) -> None:
        if self.policy.order != "fairshare":
            return
        self._decay(account, now)
        self.rate[account] = self.rate.get(account, 0.0) + d_rate

    def _decay(self, account: str, now: float) -> None:
        h = self.cfg.fairshare.half_life_s
        t = self.usage_t.get(account, now)
        u, rate = self.usage.get(account, 0.0), self.rate.get(account, 0.0)
        d = 2.0 ** (-(now - t) / h)
        self.usage[account] = u * d + rate * h / _LN2 * (1 - d)
        self.usage_t[account] = now

    def _recalc(self, now: float) -> None:
        fs = self.cfg.fairshare
        accounts = self.accounts
        for a in accounts:
            self._decay(a, now)
        total_u = sum(self.usage.get(a, 0.0) for a in accounts)
        shares = {a: fs.shares.get(a, fs.default_share) for a in accounts}
        total_s = sum(shares.values())
        for a in accounts:
            u = self.usage.get(a, 0.0) / total_u if total_u > 0 else 0.0
            self.fs_factor[a] = 2.0 ** (-u / (shares[a] / total_s))
        self.last_calc = now
        for i in self.queue:
            if self.st[i].pending:
                self.key[i] = self._priority_key(i, now)
        self.queue = sorted(self._live(), key=self.key.__getitem__)
        self.dead = 0
        self.qstart = 0  # (a new order keeps the head's reservation: it is cached per head)

    def _priority_key(self, i: int, now: float) -> tuple[float, float, int]:
        fs = self.cfg.fairshare
        r = self.reqs[i]
        age = min(1.0, max(0.0, now - r.submit) / fs.max_age_s)
        prio = fs.weight_age * age + fs.weight_fairshare * self.fs_factor.get(r.account, 1.0)
        return (-prio, r.submit, i)

    # ------------------------------------------------------------------ passes
    def _discipline(self) -> str:
        o = self.policy.order
        if o == "fairshare":
            return self.cfg.fairshare.discipline
        return {"fifo": "strict", "first-fit": "first-fit", "backfill": "backfill"}.get(o, "none")

    def schedule(self, now: float) -> None:
        if self.policy.order == "recorded":
            return
        if self.policy.order == "fairshare" and now - self.last_calc >= self.cfg.fairshare.calc_period_s:
            self._recalc(now)
            self.released = True
        d = self._discipline()
        limited = self._limited
        self.total_free = _free_in(self._class(""))  # exact again at each pass (the running sum drifts)
        fail: set[_Shape] = set()
        self.xfail: set[_Shape] = set()
        if d == "strict":
            for i in self._live():
                if limited and self._held(i):
                    continue
                if not self._try(i, now, fail):
                    break
        elif d == "first-fit":
            self._first_fit(now, fail)
        else:
            self._backfill(now, fail)
        self.released = False
        self.new_since_pass = []
        self._compact()

    def _first_fit(self, now: float, fail: set[_Shape]) -> None:
        """Every request that fits starts, in order; with ``first_fit.reserve_after_s`` one pending
        that long that cannot start blocks the rest of the pass (every pass then scans the queue
        from its front: a request may have come of age without any event)."""
        reserve = self.reserve_after if self.policy.order == "first-fit" else None
        limited = self._limited
        todo = (
            self._live()
            if self.released or reserve is not None
            else iter([i for i in self.new_since_pass if self.st[i].pending])
        )
        for i in todo:
            if self.total_free < EPS and reserve is None:
                break
            if limited and self._held(i):
                continue
            n_fail = len(fail)
            started = self._try(i, now, fail)
            if not started and reserve is not None and now - self.reqs[i].submit >= reserve:
                break  # the starving request's reservation: nothing behind it starts
            if len(fail) > n_fail and self._all_failed(fail):
                break

    def _backfill(self, now: float, fail: set[_Shape]) -> None:
        limited = self._limited
        if not self.released and self._only_new_to_try():
            self._backfill_new(now, fail)
            return
        live = self._live()
        head = -1
        before = self.placements
        for i in live:
            if limited and self._held(i):
                continue
            if not self._try(i, now, fail):
                head = i
                break
        if self.placements != before:
            self.version += 1  # a start ahead of the head, or a part of it: its reservation moves
        if head < 0:
            return
        t_res, extra = self._reservation(head, now)
        self.reservations.setdefault(self.reqs[head].request_id, t_res)
        self.last_head = head
        bound = self.cfg.backfill.max_job_test
        tested = 0
        for j in live:
            if tested >= bound or self.total_free < EPS:
                break
            tested += 1
            if limited and self._held(j):
                continue
            if self._candidate(j, now, t_res, extra, fail):
                break

    def _candidate(
        self, j: int, now: float, t_res: float, extra: dict[int, float], fail: set[_Shape]
    ) -> bool:
        """Try request ``j`` behind the head; True when nothing more can start in this pass."""
        sh = self._shape(j) if self.st[j].placed else self.shape0[j]
        if sh in fail or (sh in self.xfail and self._estimate(j, now) > t_res + EPS):
            return False  # the fast way out, the most common one: a shape already seen not to fit
        n_fail = len(fail)
        self._backfill_one(j, now, t_res, extra, fail)
        return len(fail) > n_fail and self._all_failed(fail)

    def _only_new_to_try(self) -> bool:
        """Since the last pass only submits came (nothing ended, no capacity came back, the
        head and its reservation stand): every request tried then would fail again (the same
        free GPUs, the same spare ones, a later end), so a full pass would start at most some of
        the new ones. True when each new one is behind the head and within the scan's bound."""
        head = self.last_head
        if (
            head < 0
            or not self.st[head].pending
            or self.shadow is None
            or self.shadow[:2] != (head, self.version)
        ):
            return False
        bound = self.cfg.backfill.max_job_test
        for i in self.new_since_pass:
            if not self.st[i].pending:
                continue
            if self.policy.order == "fairshare":
                if self.key[i] <= self.key[head]:
                    return False  # ahead of the head: a new order
                pos = bisect.bisect_left(self.queue, self.key[i], lo=self.qstart, key=self.key.__getitem__)
            else:
                pos = (
                    len(self.queue) - 1 - self.queue[::-1].index(i)
                    if len(self.new_since_pass) > 1
                    else len(self.queue) - 1
                )
            if pos - self.qstart > bound:  # (an upper bound of its place among the pending)
                return False
        return True

    def _backfill_new(self, now: float, fail: set[_Shape]) -> None:
        if self.shadow is None:  # (_only_new_to_try said it stands)
            return
        _, _, t_res, extra = self.shadow
        new = sorted((i for i in self.new_since_pass if self.st[i].pending), key=self._order_of)
        limited = self._limited
        for j in new:
            if self.total_free < EPS:
                break
            if not (limited and self._held(j)) and self._candidate(j, now, t_res, extra, fail):
                break

    def _order_of(self, i: int) -> tuple[float, float, int]:
        return self.key[i] if self.policy.order == "fairshare" else (0.0, self.reqs[i].submit, i)

    def _backfill_one(
        self,
        j: int,
        now: float,
        t_res: float,
        extra: dict[int, float],
        fail: set[_Shape],
    ) -> None:
        r = self.reqs[j]
        k = self._remaining(j)
        gang = self.policy.gang or r.nodes == 1
        shape = self._shape(j)
        if shape in fail or self.total_free + EPS < r.gpus_per_node:
            return
        est = self._estimate(j, now)
        nodes: list[int] = []
        if est <= t_res + EPS:  # it ends before the reservation: any free GPUs will do
            nodes = self._choose(j, k)
            if len(nodes) < k and (gang or not nodes):
                fail.add(shape)
                return
        if len(nodes) < k:  # it would hold GPUs past the reservation: only those the head leaves
            if shape in self.xfail:
                return
            nodes = self._choose(j, k, allow=extra)
            if len(nodes) < k and (gang or not nodes):
                self.xfail.add(shape)  # the spare GPUs only shrink within a pass
                return
            for n in nodes:
                if n in extra:
                    extra[n] -= r.gpus_per_node
        self._place(j, nodes, now)

    def _estimate(self, j: int, now: float) -> float:
        """When request ``j`` would end if it started now, as a back-fill scheduler estimates it."""
        r = self.reqs[j]
        lim = r.time_limit_s if self.cfg.backfill.use_time_limits and r.time_limit_s else None
        if lim is not None:
            return now + lim
        est = now + r.run_s
        return min(est, r.withdrawn) if r.withdrawn is not None else est

    def _reservation(self, head: int, now: float) -> tuple[float, dict[int, float]]:
        """When the head could start if every running request ended as estimated (its shadow
        time), and the GPUs per node it leaves free then (those back-fill may use past it)."""
        if self.shadow is not None and self.shadow[:2] == (head, self.version):
            return self.shadow[2], self.shadow[3]
        r = self.reqs[head]
        g, k = r.gpus_per_node, self._remaining(head)
        c = self._class(r.pool)
        own = set(self.st[head].placed)
        free = {n: self.cap[n] - self.used[n] for n in c.members if n not in own}
        fit = sum(1 for v in free.values() if v + EPS >= g)
        t_res = now if fit >= k else math.inf
        ends, idx = self.ends, 0  # the started requests by estimated end: walked only as far as needed
        while fit < k and idx < len(ends):
            t = ends[idx][0]
            while idx < len(ends) and ends[idx][0] == t:
                q = ends[idx][1]
                gq = self.reqs[q].gpus_per_node
                for n in self.st[q].placed:
                    if n in free:
                        before = free[n] + EPS >= g
                        free[n] += gq
                        if not before and free[n] + EPS >= g:
                            fit += 1
                idx += 1
            if fit >= k:
                t_res = max(t, now)
        extra = dict(free)
        if math.isfinite(t_res):
            place = self.policy.placement
            order = sorted(
                free, key=lambda n: (0.0 if place == "first" else free[n] if place == "pack" else -free[n], n)
            )
            chosen = [n for n in order if free[n] + EPS >= g][:k]
            for n in chosen:
                extra[n] -= g
        else:
            extra = {}
        self.shadow = (head, self.version, t_res, extra)
        return t_res, extra

    # ------------------------------------------------------------------ openings
    def _open(self, i: int, now: float) -> None:
        s = self.st[i]
        if s.start is not None or s.done:
            return
        r = self.reqs[i]
        k = self._remaining(i)
        c = self._class(r.pool)
        g = r.gpus_per_node
        # the pool's buckets, less the nodes it already holds a part on (it needs others)
        own = [max(self.cap[n] - self.used[n], 0.0) for n in s.placed]
        free = max(0.0, _free_in(c) - sum(own))
        fitting = sum(len(b) for key, b in c.buckets.items() if key + EPS >= g) - sum(
            1 for f in own if f + EPS >= g
        )
        if free + EPS < k * r.gpus_per_node:
            cause = "capacity"
        elif fitting < k:
            cause = "fragmentation"
        else:
            cause = "policy"
        self.incidents.append(Incident(r.request_id, r.scheduler, r.queue, now, cause, free, fitting))

    # ------------------------------------------------------------------ the loop
    def _handle(self, t: float, kind: int, i: int, value: float) -> None:
        if kind == _CAP:
            self._change(i, d_cap=value)
            self.version += 1
            self.released = self.released or value > 0
        elif kind == _END:
            s = self.st[i]
            if not s.done and s.end == t:
                self._release(i, t)
                self.released = True
        elif kind == _WITHDRAW:
            s = self.st[i]
            if self.policy.order == "recorded":
                s.done = s.done or s.start is None
            elif s.pending and s.start is None:
                self._count_shape(i, -1)
                s.pending = False
                self.dead += 1
                if s.placed:  # parts placed, not all: they go too
                    self._release(i, t)
                s.done = True
                self.released = True  # the head may have changed
        elif kind == _SUBMIT:
            self._enqueue(i, t)
            self.new_since_pass.append(i)
        elif kind == _RSTART:
            self._recorded_start(i, t)

    def _recorded_start(self, i: int, t: float) -> None:
        r = self.reqs[i]
        nodes = [self.index[n] for n in r.recorded_nodes if n in self.index][: r.nodes]
        if not r.recorded_nodes:
            nodes = self._choose(i, r.nodes)
        s = self.st[i]
        for n in nodes:
            s.placed.append(n)
            s.placed_at.append(t)
            self._change(n, d_used=r.gpus_per_node)
        self._hold(r, r.gpus_per_node * len(nodes))
        self._account(r.account, t, r.gpus_per_node * len(nodes))
        self.running[i] = None
        s.start = r.recorded_start
        s.end = r.recorded_end if r.recorded_end is not None else math.inf
        s.est_end = s.end
        if math.isfinite(s.est_end):
            bisect.insort(self.ends, (s.est_end, i))
        if s.end < self.to:
            self._push(max(s.end, t), _END, i)
        self.version += 1

    def run(self) -> None:
        self.setup()
        oi = 0
        while self.heap or oi < len(self.opens):
            t_ev = self.heap[0][0] if self.heap else math.inf
            t_open = self.opens[oi][0] if oi < len(self.opens) else math.inf
            if t_open < t_ev:  # openings at a time with no event: judged on the state as it is
                self._open(self.opens[oi][1], t_open)
                oi += 1
                continue
            t = t_ev
            if t >= self.to:
                break
            while self.heap and self.heap[0][0] == t:
                _, kind, _, i, value = heapq.heappop(self.heap)
                self._handle(t, kind, i, value)
            self.schedule(t)
            while oi < len(self.opens) and self.opens[oi][0] == t:
                self._open(self.opens[oi][1], t)
                oi += 1
        for s in self.st:
            for n, t0 in zip(s.placed, s.placed_at, strict=True):
                s.holdings.append((n, t0, max(t0, self.to)))

    def result(self) -> Replay:
        outs = []
        skipped = set(self.skipped)
        for r, s in zip(self.reqs, self.st, strict=True):
            if r.request_id in skipped:
                continue
            placed = [self.names[n] for n, _, _ in s.holdings]
            start = s.start if s.start is not None and s.start < self.to else None
            if start is None and not s.carried and not (self.frm <= r.submit < self.to):
                continue
            outs.append(
                Outcome(
                    r,
                    start,
                    tuple(dict.fromkeys(placed)) if start is not None else (),
                    tuple((self.names[n], a, b) for n, a, b in s.holdings),
                    s.carried,
                )
            )
        return Replay(
            self.policy,
            self.frm,
            self.to,
            tuple(outs),
            tuple(self.incidents),
            self.cap_in,
            dict(self.reservations),
            tuple(self.never_fit),
            tuple(self.skipped),
        )


def simulate(
    requests: Sequence[Request],
    capacity: Capacity,
    policy: Policy,
    config: WhatIf,
    threshold_for: Callable[[str, str, str], float],
) -> Replay:
    sim = _Sim(requests, capacity, policy, config, threshold_for)
    sim.run()
    return sim.result()

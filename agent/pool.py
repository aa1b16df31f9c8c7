"""The pool a node serves (a Slurm partition, a Kubernetes node pool), from its scheduler.

``pool`` is what the rules group capacity by; an agent that sends none puts its node in
the cluster's pool-less remainder. So the agent fills it where the scheduler knows it:

- Slurm: the node's partitions from ``sinfo --json``. A node in several partitions gets
  their names sorted and joined with ``,`` (``debug,gpu``): one pool per node, so
  per-pool GPU-seconds still add up to the cluster's; Slurm writes partition lists the
  same way and forbids ``,`` in a partition name, so the list splits back unambiguously.
- Kubernetes: a label of the Node object; the first of ``--pool-label`` (repeatable) that
  the node carries, by default the node-pool labels of GKE, EKS, AKS and Karpenter.

An explicit ``--pool`` always wins. Until the scheduler has answered, and when it fails,
the last known value is kept (''  before the first answer); trouble is logged once and
counted.

The pool is brought up to date by whoever reads it: :meth:`NodePool.at` runs the pool's
learners (the Slurm heartbeat source's ``sinfo``, :class:`K8sNodePool`) at most once per
tick, so the GPU batch and the heartbeat of a tick carry the pool learnt in that tick
whatever the order of the agent's source list.
"""

from __future__ import annotations

import logging
import urllib.error
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuslo.agent.k8s_watch import KubeApi

log = logging.getLogger(__name__)

DEFAULT_NODE_POOL_LABELS = (
    "cloud.google.com/gke-nodepool",  # GKE
    "eks.amazonaws.com/nodegroup",  # EKS managed node groups
    "kubernetes.azure.com/agentpool",  # AKS
    "agentpool",  # AKS, the older unqualified label
    "karpenter.sh/nodepool",  # Karpenter (v1beta1 and later)
)
MAX_POOL = 256  # the wire's label bound

Learner = Callable[[float], None]
"""Brings a :class:`NodePool` up to date for the tick at ``now`` (by calling its
:meth:`~NodePool.learn`, or not: the last value stays); contains its own trouble."""


def join_partitions(parts: Iterable[object]) -> str:
    """Sorted, distinct, ``,``-joined; past the wire's bound, whole names only."""
    names = sorted({str(p).strip() for p in parts if str(p).strip()})
    out = ""
    for n in names:
        nxt = f"{out},{n}" if out else n
        if len(nxt) > MAX_POOL:
            log.warning("node partitions %s exceed %d characters; pool keeps %r", names, MAX_POOL, out)
            break
        out = nxt
    return out


def pool_from_labels(labels: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    """The value of the first of ``keys`` that is set (non-empty), else None."""
    for k in keys:
        v = labels.get(k)
        if isinstance(v, str) and v.strip():
            return v.strip()[:MAX_POOL]
    return None


class NodePool:
    """The pool of one node, shared by the sources that stamp it (heartbeats and GPU
    batches). Read it with :meth:`at` in a source's ``collect``: that runs the learners
    first, once per tick, so every reader of a tick sees the value learnt in that tick, in
    any order of the source list. Calling it gives the value known now, learning nothing."""

    def __init__(self, explicit: str = "") -> None:
        self.explicit = explicit
        self.discovered = ""
        self.failures = 0  # learner calls that raised (the last value is kept)
        self._learners: list[Learner] = []
        self._asked: float | None = None  # the tick the learners last ran for

    def __call__(self) -> str:
        return self.explicit or self.discovered

    def attach(self, learner: Learner) -> None:
        """Add a learner; several run in the order attached (the last to learn wins)."""
        self._learners.append(learner)

    def at(self, now: float) -> str:
        """The pool of the tick at ``now``: the learners run on the first call for a ``now``
        (never with an explicit pool, which always wins), later calls for it only read."""
        if not self.explicit and now != self._asked:
            self._asked = now
            for learner in self._learners:
                self._run(learner, now)
        return self()

    def _run(self, learner: Learner, now: float) -> None:
        try:
            learner(now)
        except Exception:  # contained: a learner's bug never costs the readers' messages
            self.failures += 1
            if self.failures == 1:
                log.exception("learning the pool failed; keeping %r (further failures counted)", self())

    def learn(self, value: str, source: str) -> None:
        if value != self.discovered:
            if not self.explicit:
                log.info("pool of this node from %s: %r (was %r)", source, value, self.discovered)
            self.discovered = value


class K8sNodePool:
    """The learner of a :class:`NodePool` from this node's labels (``GET /api/v1/nodes/NAME``):
    attaches itself to ``pool``; asks at the first tick and then every ``refresh_s``. Needs
    ``get`` on ``nodes``."""

    def __init__(self, pool: NodePool, api: KubeApi, node: str,
                 labels: Sequence[str] = DEFAULT_NODE_POOL_LABELS, refresh_s: float = 300.0) -> None:  # fmt: skip
        self.pool, self.api, self.node, self.labels, self.refresh_s = (
            pool,
            api,
            node,
            tuple(labels),
            refresh_s,
        )
        self.failures = 0
        self._next = float("-inf")
        self._logged: set[str] = set()
        pool.attach(self)

    def refresh(self) -> None:
        try:
            node = self.api.get_node(self.node)
        except Exception as exc:  # contained: API down, 403, 404, bad JSON; the last value stays
            self.failures += 1
            self._once(type(exc).__name__, "cannot read Node %s for its pool label: %s (logged once; counted)",
                       self.node, _why(exc))  # fmt: skip
            return
        labels = (node.get("metadata") or {}).get("labels") or {}
        value = pool_from_labels(labels if isinstance(labels, dict) else {}, self.labels)
        if value is None:
            self._once("no label", "Node %s carries none of the pool labels %s; its pool stays %r",
                       self.node, ", ".join(self.labels), self.pool())  # fmt: skip
            return
        self.pool.learn(value, f"Node label of {self.node}")

    def __call__(self, now: float) -> None:
        """The pool's learner: :meth:`refresh` when ``refresh_s`` has passed since the last."""
        if now >= self._next:
            self._next = now + self.refresh_s
            self.refresh()

    def _once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)


def pool_at(pool: str | NodePool, now: float) -> str:
    """A source's ``pool`` (a fixed string, or the node's :class:`NodePool`) for the tick at ``now``."""
    return pool if isinstance(pool, str) else pool.at(now)


def _why(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"

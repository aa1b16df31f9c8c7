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
"""

from __future__ import annotations

import logging
import urllib.error
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpuslo.agent.base import Source
from gpuslo.wire import Message

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
    batches read the same value in the same tick). Call it for the value."""

    def __init__(self, explicit: str = "") -> None:
        self.explicit = explicit
        self.discovered = ""

    def __call__(self) -> str:
        return self.explicit or self.discovered

    def learn(self, value: str, source: str) -> None:
        if value != self.discovered:
            if not self.explicit:
                log.info("pool of this node from %s: %r (was %r)", source, value, self.discovered)
            self.discovered = value


class K8sNodePool(Source):
    """Refreshes a :class:`NodePool` from this node's labels (``GET /api/v1/nodes/NAME``),
    at start and then every ``refresh_s``; emits nothing. Needs ``get`` on ``nodes``."""

    name = "k8s-node-pool"

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

    def collect(self, now: float) -> list[Message]:
        if now >= self._next:
            self._next = now + self.refresh_s
            self.refresh()
        return []

    def _once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)


def _why(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"

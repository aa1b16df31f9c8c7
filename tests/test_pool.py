"""The node's pool: the pure parts (the real schedulers are in test_slurm.py and
test_k8s_control_plane.py)."""

from __future__ import annotations

import urllib.error
from typing import Any

import pytest

from gpuslo.agent.k8s_watch import Forbidden
from gpuslo.agent.pool import (
    DEFAULT_NODE_POOL_LABELS,
    K8sNodePool,
    NodePool,
    join_partitions,
    pool_from_labels,
)
from gpuslo.app.cli import build_parser


def test_join_partitions_edges() -> None:
    assert join_partitions([]) == ""
    assert join_partitions(["gpu", "debug", "gpu", " "]) == "debug,gpu"
    long = [f"p{i:03d}" + "x" * 60 for i in range(10)]
    got = join_partitions(long)
    assert len(got) <= 256 and got.split(",") == sorted(long)[: len(got.split(","))]  # whole names only


def test_first_label_that_is_set_wins() -> None:
    keys = DEFAULT_NODE_POOL_LABELS
    assert pool_from_labels({}, keys) is None
    assert pool_from_labels({"agentpool": "", "karpenter.sh/nodepool": "k"}, keys) == "k"
    assert pool_from_labels({"karpenter.sh/nodepool": "k", "cloud.google.com/gke-nodepool": "g"}, keys) == "g"
    assert pool_from_labels({"agentpool": 3}, keys) is None  # not a string: not a pool


def test_help_lists_exactly_the_default_labels() -> None:
    action = next(a for a in build_parser()._subparsers._group_actions[0].choices["agent"]._actions  # type: ignore[union-attr]
                  if "--pool-label" in a.option_strings)  # fmt: skip
    listed = action.help.split("default: ", 1)[1].rstrip(")").split(", ")  # type: ignore[union-attr]
    assert tuple(listed) == DEFAULT_NODE_POOL_LABELS


class _Api:
    """Fails as KubeApi does: Forbidden for 401/403, HTTPError otherwise, URLError when down."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    def get_node(self, name: str) -> dict[str, Any]:
        self.calls += 1
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a  # type: ignore[no-any-return]


def test_k8s_pool_keeps_the_last_value_through_trouble(caplog: pytest.LogCaptureFixture) -> None:
    pool = NodePool()
    api = _Api({"metadata": {"labels": {"eks.amazonaws.com/nodegroup": "ng1"}}},
               urllib.error.URLError("connection refused"), urllib.error.URLError("again"),
               Forbidden("403 on /api/v1/nodes/n1"), {"metadata": {}}, {"metadata": {"labels": {"agentpool": "np2"}}})  # fmt: skip
    src = K8sNodePool(pool, api, "n1", refresh_s=10)  # type: ignore[arg-type]
    for t in range(0, 60, 5):  # refreshes at 0, 10, 20, 30, 40, 50
        assert src.collect(float(t)) == []
        if t == 0:
            assert pool() == "ng1"
        if t == 40:
            assert pool() == "ng1"  # through refused, 403 and a node without labels
    assert api.calls == 6 and pool() == "np2" and src.failures == 3
    assert caplog.text.count("cannot read Node n1") == 2  # once per kind of failure
    assert NodePool("explicit")() == "explicit"
    explicit = NodePool("mine")
    explicit.learn("theirs", "test")
    assert explicit() == "mine"

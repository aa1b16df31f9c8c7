"""Pod shapes with GPUs in init containers and sidecars, and the GPUs each asks, as the
scheduler counts a pod's request: per resource, the containers' sum plus the sidecars' (init
containers with ``restartPolicy: Always``), or the most one init container needs beside the
sidecars started before it, whichever is more. The table is checked against the real
kube-scheduler (tests/test_k8s_control_plane.py: a node with that many GPUs takes the pod, one
with one fewer leaves it Unschedulable); the unit tests read the collectors' requests against it.
"""

from __future__ import annotations

from typing import Any

#: (case, [(kind, GPUs)], GPUs the pod asks): kind "init", "sidecar" or "main", in spec order
SHAPES: list[tuple[str, list[tuple[str, int]], int]] = [
    ("main-only", [("main", 2)], 2),
    ("init-more-than-main", [("init", 3), ("main", 1)], 3),
    ("init-less-than-main", [("init", 1), ("main", 2)], 2),
    ("init-only", [("init", 2), ("main", 0)], 2),
    ("two-inits", [("init", 2), ("init", 3), ("main", 1)], 3),
    ("sidecar-adds", [("sidecar", 1), ("main", 2)], 3),
    ("sidecar-before-init", [("sidecar", 1), ("init", 2), ("main", 1)], 3),
    ("init-before-sidecar", [("init", 2), ("sidecar", 1), ("main", 1)], 2),
    ("two-sidecars-then-init", [("sidecar", 1), ("sidecar", 1), ("init", 2), ("main", 0)], 4),
]


def pod_spec(parts: list[tuple[str, int]]) -> dict[str, Any]:
    """A pod spec of those containers (a container asking 0 GPUs asks none)."""

    def container(i: int, kind: str, gpus: int) -> dict[str, Any]:
        c: dict[str, Any] = {"name": f"{kind}-{i}", "image": "registry.invalid/infer:1"}
        if gpus:
            c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
        if kind == "sidecar":
            c["restartPolicy"] = "Always"
        return c

    init = [container(i, k, g) for i, (k, g) in enumerate(parts) if k != "main"]
    main = [container(i, k, g) for i, (k, g) in enumerate(parts) if k == "main"]
    return {"initContainers": init, "containers": main, "terminationGracePeriodSeconds": 0}

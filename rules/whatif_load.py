"""The what-if replay's input, read from the store once per window (the simulation reads no
SQL): the requests from ``sched_events`` and each node's capacity over time from the GPU
samples, as the rules define capacity (rules/sql.py ``CAPACITY_SAMPLES``: present, healthy,
schedulable per the latest heartbeat). docs/whatif.md says what is read and what is assumed."""

from __future__ import annotations

import math
from typing import Any

from gpuslo.ingest.sqltext import fill
from gpuslo.ingest.store import Store
from gpuslo.rules import sql
from gpuslo.rules.whatif_model import Capacity, Node, PolicyError, Request

# the schedulers whose requests hold GPUs (a Kueue Workload's GPUs are held by its pods)
SCHEDULERS = ("slurm", "k8s")

# A request's first submit gives its queue, pool, owner, shape and submit time; one whose submit
# the record lacks (lost, or before the lookback) but whose start it has is taken as submitted at
# its start, its fields from that start (else its GPUs would look free to every policy)
_FROM = "if(countIf(event = 'submit') > 0, argMinIf({c}, ts, event = 'submit'), argMinIf({c}, ts, event = 'start'))"
REQUESTS = fill(
    """
SELECT cluster, scheduler, request_id,
    {queue} AS queue, {pool} AS pool, {user} AS user, {account} AS account,
    {gpus_per_node} AS gpus_per_node, {nodes} AS nodes,
    if(countIf(event = 'submit') > 0, minIf(toFloat64(ts), event = 'submit'),
       minIf(toFloat64(ts), event = 'start')) AS submitted,
    if(countIf(event = 'start') > 0, minIf(toFloat64(ts), event = 'start'), NULL) AS started,
    argMinIf(assigned_nodes, ts, event = 'start') AS assigned,
    if(countIf(event IN ('end', 'preempt', 'cancel')) > 0,
       minIf(toFloat64(ts), event IN ('end', 'preempt', 'cancel')), NULL) AS ended
FROM sched_events FINAL
WHERE ts >= toDateTime64({from:Float64} - {lookback:Float64}, 3, 'UTC')
  AND ({cluster:String} = '' OR cluster = {cluster:String})
  AND scheduler IN ('slurm', 'k8s')
GROUP BY cluster, scheduler, request_id
HAVING countIf(event IN ('submit', 'start')) > 0 AND submitted < {to:Float64}
   AND (ended IS NULL OR ended > {from:Float64})
ORDER BY submitted, cluster, scheduler, request_id
""",
    queue=fill(_FROM, c="queue"),
    pool=fill(_FROM, c="pool"),
    user=fill(_FROM, c="user"),
    account=fill(_FROM, c="account"),
    gpus_per_node=fill(_FROM, c="gpus_per_node"),
    nodes=fill(_FROM, c="nodes"),
)

# each node's runs of samples with the same capacity GPUs, back to back (a gap, or a change of
# the count or the pool, starts a new run): a month of 10 s samples comes back as a few rows
CAPACITY_RUNS = fill(
    """
SELECT cluster, node, pool, any(model) AS model, min(t) AS t0, max(t + iv) AS t1, any(gpus) AS gpus
FROM
(
    SELECT *, sum(brk) OVER (PARTITION BY cluster, node ORDER BY t ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS run
    FROM
    (
        SELECT *,
            if(row_number() OVER w = 1
               OR gpus != lagInFrame(gpus, 1) OVER w
               OR pool != lagInFrame(pool, 1) OVER w
               OR t > lagInFrame(t + iv, 1) OVER w + 1e-6, 1, 0) AS brk
        FROM
        (
            SELECT cluster, node, max(pool) AS pool, any(model) AS model, toFloat64(ts) AS t,
                max(interval_s) AS iv, sum(cap_w) AS gpus
            FROM ({samples})
            GROUP BY cluster, node, ts
        )
        WINDOW w AS (PARTITION BY cluster, node ORDER BY t ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
    )
)
GROUP BY cluster, node, pool, run
ORDER BY cluster, node, t0
SETTINGS join_use_nulls = 1
""",
    samples=sql.CAPACITY_SAMPLES,
)


def _params(frm: float, to: float, cluster: str, lookback_s: float) -> dict[str, Any]:
    return {"from": frm, "to": to, "cluster": cluster, "lookback": lookback_s}


def request_of(row: dict[str, Any]) -> Request:
    submit = float(row["submitted"])
    start = row["started"]
    ended = row["ended"]
    run_s = math.inf
    withdrawn = None
    if start is not None:
        start = float(start)
        submit = min(submit, start)  # a start recorded before its submit (clocks apart): no wait
        if ended is not None:
            run_s = max(0.0, float(ended) - start)
    elif ended is not None:
        withdrawn = max(submit, float(ended))
    return Request(
        request_id=str(row["request_id"]),
        scheduler=str(row["scheduler"]),
        cluster=str(row["cluster"]),
        queue=str(row["queue"]),
        account=str(row["account"]),
        user=str(row["user"]),
        submit=submit,
        nodes=int(row["nodes"]),
        gpus_per_node=float(row["gpus_per_node"]),
        run_s=run_s,
        recorded_start=start,
        pool=str(row["pool"]),
        recorded_nodes=tuple(dict.fromkeys(str(n) for n in row["assigned"] or ())),  # each node once
        withdrawn=withdrawn,
    )


def load_requests(
    store: Store, frm: float, to: float, cluster: str = "", lookback_s: float = 30 * 86400
) -> list[Request]:
    return [request_of(r) for r in store.query(REQUESTS, _params(frm, to, cluster, lookback_s))]


def load_capacity(store: Store, frm: float, to: float, cluster: str = "") -> Capacity:
    rows = store.query(CAPACITY_RUNS, _params(frm, to, cluster, 0.0))
    clusters = sorted({str(r["cluster"]) for r in rows})
    if len(clusters) > 1:
        raise PolicyError(
            f"the window holds {len(clusters)} clusters ({', '.join(repr(c) for c in clusters[:5])}): name one with --cluster "
            "(a replay places requests on their own cluster's nodes)"
        )
    spans: dict[str, list[tuple[float, float, float]]] = {}
    pools: dict[str, str] = {}
    models: dict[str, str] = {}
    for r in rows:
        node = str(r["node"])
        a, b, g = max(float(r["t0"]), frm), min(float(r["t1"]), to), float(r["gpus"])
        pools[node] = str(r["pool"])  # the latest run's pool stands for the node
        models.setdefault(node, str(r["model"] or ""))
        if b > a and g > 0:
            spans.setdefault(node, []).append((a, b, g))
    nodes = []
    for name in sorted(pools):
        ss = sorted(spans.get(name, []))
        clipped = [(a, min(b, ss[k + 1][0]) if k + 1 < len(ss) else b, g) for k, (a, b, g) in enumerate(ss)]
        nodes.append(Node(name, pools[name], tuple(x for x in clipped if x[1] > x[0]), models[name]))
    return Capacity(frm, to, tuple(nodes))

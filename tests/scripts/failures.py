"""Failures during an epoch on a fake multi-node cluster (``ray.cluster_utils.Cluster``).

Prints one JSON line per scenario: rows delivered, whether every row arrived
exactly once, and evidence that the victim had been running partitions.

    python tests/scripts/failures.py
"""
from __future__ import annotations

import json
import os
import signal
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

import numpy as np
import ray
from ray.cluster_utils import Cluster

N, PARTS = 300, 30
NODE_WAIT_S = 300  # a removed node is marked dead by the GCS's health checks: seconds on a loaded machine


def _live_node_ids() -> set:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def replace_node(cluster: Cluster, gone) -> None:
    """Wait until the GCS has marked the removed node ``gone`` dead, then add a replacement and
    wait until it has joined: waiting on the cluster's own state, not on a clock (Ray's
    ``wait_for_nodes`` alone gives up after 30 s, and counts a dead node not yet marked as live)."""
    deadline = time.monotonic() + NODE_WAIT_S
    while gone is not None and gone in _live_node_ids():
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {gone} still alive {NODE_WAIT_S} s after its removal")
        time.sleep(0.2)
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes(timeout=NODE_WAIT_S)


def tag(batch: dict) -> dict:
    """Slow work that records the node and process that did it."""
    time.sleep(0.15)
    n = len(batch["id"])
    ctx = ray.get_runtime_context()
    return {"id": batch["id"], "node": np.array([ctx.get_node_id()] * n), "pid": np.full(n, os.getpid()),
            "pad": np.zeros((n, 50_000), np.uint8)}  # big enough to live in the object store


class Tagger:
    """The same, in an actor pool."""

    def __call__(self, batch: dict) -> dict:
        return tag(batch)


def run(ds, on_batch) -> dict:
    ids, nodes, pids = [], set(), set()
    for i, b in enumerate(ds.iter_batches(10)):
        ids.extend(int(x) for x in b["id"])
        nodes.update(b["node"].tolist())
        pids.update(int(p) for p in b["pid"])
        on_batch(i, b)
    return {"rows": len(ids), "exactly_once": sorted(ids) == list(range(N)), "nodes": sorted(nodes),
            "pids": sorted(pids)}


def main() -> None:
    import sbloader

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes(timeout=NODE_WAIT_S)
    sbloader.init(address=cluster.address)

    # 1-2. a CPU node removed mid-epoch: the worker node that made the latest batch
    removed: dict = {}

    def remove_node(i, b):
        if i >= 6 and not removed:
            by_id = {n.node_id: n for n in cluster.worker_nodes}
            node_id = next((x for x in b["node"].tolist() if x in by_id), None)
            if node_id is not None:
                removed["node"] = node_id
                cluster.remove_node(by_id[node_id])

    for scenario, ds in (
        ("node_removed_tasks", lambda: sbloader.range(N, num_partitions=PARTS).map_batches(tag)),
        ("node_removed_actors", lambda: sbloader.range(N, num_partitions=PARTS).map_batches(
            Tagger, concurrency=(2, 2), num_cpus=1)),
    ):
        removed.clear()
        out = run(ds(), remove_node)
        out.update(scenario=scenario, victim_ran=removed.get("node") in out["nodes"], victim=removed.get("node"))
        print(json.dumps(out), flush=True)
        replace_node(cluster, removed.get("node"))  # a replacement for the next scenario

    # 3. an actor of the pool killed mid-epoch (Ray restarts it; its calls re-run)
    killed: dict = {}

    def kill_actor(i, b):
        if i == 5 and not killed:
            from sbloader.distributed.naming import NAMESPACE  # noqa: F401  (import check only)

            pid = int(b["pid"][0])
            killed["pid"] = pid
            os.kill(pid, signal.SIGKILL)

    ds = sbloader.range(N, num_partitions=PARTS).map_batches(Tagger, concurrency=(2, 2), num_cpus=1)
    out = run(ds, kill_actor)
    out.update(scenario="actor_killed", victim_ran=killed.get("pid") in out["pids"],
               victim_pid=killed.get("pid"))
    print(json.dumps(out), flush=True)

    # 4. a task's worker process killed mid-epoch (Ray retries the task)
    killed.clear()

    def kill_worker(i, b):
        if i == 5 and not killed:
            pid = int(b["pid"][0])
            killed["pid"] = pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    out = run(sbloader.range(N, num_partitions=PARTS).map_batches(tag), kill_worker)
    out.update(scenario="worker_killed", victim_ran=killed.get("pid") in out["pids"], victim_pid=killed.get("pid"))
    print(json.dumps(out), flush=True)
    sbloader.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()

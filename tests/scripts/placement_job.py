"""Placement on a fake two-node cluster: which nodes ran the preprocessing.

The driver (the "trainer") joins a Cluster whose head node is its own node. Prints
one JSON line per scenario with the node ids found in the blocks' provenance.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

import ray
from ray.cluster_utils import Cluster


def ident(batch: dict) -> dict:
    return batch


def main() -> None:
    import sbloader
    from sbloader.loaders.batching import iter_blocks

    head_cpus = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus})
    worker = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    sbloader.init(address=cluster.address)
    trainer = ray.get_runtime_context().get_node_id()
    for name, allow in (("default", False), ("allow_trainer_node", True)):
        ds = sbloader.range(400, num_partitions=40).map_batches(ident)
        nodes = {m.node_id for _, m in iter_blocks(ds.execute(allow_trainer_node=allow))}
        print(json.dumps({"scenario": name, "head_cpus": head_cpus, "trainer": trainer,
                          "worker": worker.node_id, "nodes": sorted(nodes)}), flush=True)
    # the drop-in's worker actors follow the same policy
    # the pool's placement (local_start=False: no first batches from processes forked on the trainer's node)
    loader = sbloader.DataLoader(NodeTagged(64), batch_size=8, num_workers=2, local_start=False)
    nodes = sorted({n for batch in loader for n in batch["node"]})
    print(json.dumps({"scenario": "dataloader", "head_cpus": head_cpus, "trainer": trainer,
                      "worker": worker.node_id, "nodes": nodes}), flush=True)
    sbloader.shutdown()
    cluster.shutdown()


class NodeTagged:
    """A map-style dataset whose samples name the node that loaded them."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "node": ray.get_runtime_context().get_node_id()}


if __name__ == "__main__":
    main()

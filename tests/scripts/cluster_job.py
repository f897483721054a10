"""A torchrun rank of a native pipeline on a cluster started with ``ray start`` (``tests/e2e/test_ray_cluster.py``).

    RAY_ADDRESS=127.0.0.1:PORT torchrun ... cluster_job.py --out DIR [--rows 480] [--delay 0.05] [--epochs 2]

Each row carries the node that produced it. Rank 0 touches ``DIR/started`` after its
first batch (the test may then kill a node). Each rank writes ``DIR/rank{R}.json``:
per epoch, the ids and the producing nodes of its rows.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def tag(batch: dict, delay: float) -> dict:
    import ray

    time.sleep(delay)
    node = ray.get_runtime_context().get_node_id()
    return {"id": batch["id"], "node": np.array([node] * len(batch["id"]))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=480)
    p.add_argument("--partitions", type=int, default=24)
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    import sbloader

    rank = int(os.environ.get("RANK", "0"))
    ds = sbloader.range(args.rows, num_partitions=args.partitions).map_batches(tag, batch_size=10,
                                                                              fn_kwargs={"delay": args.delay})
    # both "machines" of the test are one: without this the reads keep off the node the ranks run on
    loader = ds.to_dataloader(batch_size=8, shuffle=True, seed=3, allow_trainer_node=True)
    log: dict = {"epochs": [], "info": None}
    for _ in range(args.epochs):
        ids, nodes = [], []
        for batch in loader:
            ids += [int(i) for i in batch["id"]]
            nodes += [str(n) for n in batch["node"]]
            if rank == 0 and not os.path.exists(os.path.join(args.out, "started")):
                import ray

                with open(os.path.join(args.out, "started"), "w") as f:
                    f.write(ray.get_runtime_context().get_node_id())
        log["epochs"].append({"ids": ids, "nodes": sorted(set(nodes))})
    info = sbloader.init()
    log["info"] = {"address": info.address, "embedded": info.embedded}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()

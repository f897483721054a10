"""A torchrun rank that survives the loss of a CPU node (``tests/e2e/test_ray_cluster.py``, issue #35).

    RAY_ADDRESS=127.0.0.1:PORT torchrun ... node_loss_job.py --out DIR --mode dropin|native [--rows 480]

Every sample carries the node that produced it (its provenance). Each rank appends one
JSON line per batch to ``DIR/progress{R}.jsonl`` (epoch, ids, producing nodes, time), so
the test can pick the node to kill by what the job says it ran, and writes
``DIR/rank{R}.json`` at the end: per epoch, the ids, the producing nodes and the
loader's ``stats()`` text.
"""
from __future__ import annotations

import argparse
import json
import os
import time



def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("dropin", "native"), required=True)
    p.add_argument("--rows", type=int, default=480)
    p.add_argument("--delay", type=float, default=0.03, help="seconds per sample")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--cpus", type=float, default=2.0, help="CPUs per worker actor / read task")
    args = p.parse_args()
    import sbloader
    from sbloader.datagen import NodeTaggedIds, node_tag

    rank = int(os.environ.get("RANK", "0"))
    if args.mode == "dropin":
        loader = sbloader.DataLoader(NodeTaggedIds(args.rows, args.delay), batch_size=8, shuffle=True, num_workers=2,
                                     worker_num_cpus=args.cpus, persistent_workers=True)
    else:
        ds = sbloader.range(args.rows, num_partitions=args.rows // 8).map_batches(
            node_tag, num_cpus=args.cpus, fn_kwargs={"delay": args.delay, "payload": 0})
        loader = ds.to_dataloader(batch_size=8, shuffle=True, seed=0)
    log: dict = {"epochs": []}
    progress = open(os.path.join(args.out, f"progress{rank}.jsonl"), "a", buffering=1)
    for epoch in range(args.epochs):
        ids, nodes = [], []
        for batch in loader:
            got = [int(i) for i in batch["id"]]
            where = [str(n) for n in batch["node"]]
            ids += got
            nodes += where
            progress.write(json.dumps({"epoch": epoch, "ids": got, "nodes": where, "t": time.time()}) + "\n")
        log["epochs"].append({"ids": ids, "nodes": sorted(set(nodes)), "stats": str(loader.stats())})
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()

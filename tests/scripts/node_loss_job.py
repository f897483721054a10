"""A torchrun rank that survives the loss of a CPU node (``tests/e2e/test_ray_cluster.py``, issue #35).

    RAY_ADDRESS=127.0.0.1:PORT torchrun ... node_loss_job.py --out DIR --mode dropin|iter|native [--rows 480]

Every sample carries the node that produced it (its provenance). Each rank appends one
JSON line per batch to ``DIR/progress{R}.jsonl`` (epoch, ids, producing nodes, time), so
the test can pick the node to kill by what the job says it ran, and writes
``DIR/rank{R}.json`` at the end: per epoch, the ids, the producing nodes and the
loader's ``stats()`` text.

``--mode iter``: an ``IterableDataset`` split across the ranks (``split=True``), one shard per
worker (shard ``w`` has the ids ``w, w + 2, ...``); a shard appends ``{"shard", "node", "t"}``
to ``DIR/shards.jsonl`` once it yielded its last sample, so the test knows which node holds
the block of a shard no rank has fetched. ``--hold-at N``: after its ``N``-th batch of epoch 0
a rank waits until ``DIR/go`` exists (the test kills a node meanwhile).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def _tagged_stream(n: int, delay: float, out: str):
    from torch.utils.data import IterableDataset, get_worker_info

    from sbloader.datagen import _ray_node

    class TaggedStream(IterableDataset):
        """Ids ``0 .. n-1`` as a stream sharded over the loader's workers, each sample tagged with its node."""

        def __iter__(self):
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
            node = _ray_node()
            for i in range(wid, n, nw):
                time.sleep(delay)
                yield {"id": i, "node": node, "x": np.zeros(4096, np.float32)}
            with open(os.path.join(out, "shards.jsonl"), "a") as f:
                f.write(json.dumps({"shard": wid, "node": node, "t": time.time()}) + "\n")

    return TaggedStream()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("dropin", "iter", "native"), required=True)
    p.add_argument("--rows", type=int, default=480)
    p.add_argument("--delay", type=float, default=0.03, help="seconds per sample")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--cpus", type=float, default=2.0, help="CPUs per worker actor / read task")
    p.add_argument("--hold-at", type=int, default=0, help="after this batch of epoch 0, wait for DIR/go")
    args = p.parse_args()
    import sbloader
    from sbloader.datagen import NodeTaggedIds, node_tag

    rank = int(os.environ.get("RANK", "0"))
    if args.mode == "dropin":
        loader = sbloader.DataLoader(NodeTaggedIds(args.rows, args.delay), batch_size=8, shuffle=True, num_workers=2,
                                     worker_num_cpus=args.cpus, persistent_workers=True)
    elif args.mode == "iter":
        loader = sbloader.DataLoader(_tagged_stream(args.rows, args.delay, args.out), batch_size=8, num_workers=2,
                                     split=True, worker_num_cpus=args.cpus, persistent_workers=True)
    else:
        ds = sbloader.range(args.rows, num_partitions=args.rows // 8).map_batches(
            node_tag, num_cpus=args.cpus, fn_kwargs={"delay": args.delay, "payload": 0})
        loader = ds.to_dataloader(batch_size=8, shuffle=True, seed=0)
    log: dict = {"epochs": []}
    progress = open(os.path.join(args.out, f"progress{rank}.jsonl"), "a", buffering=1)
    for epoch in range(args.epochs):
        ids, nodes = [], []
        for step, batch in enumerate(loader, 1):
            got = [int(i) for i in batch["id"]]
            where = [str(n) for n in batch["node"]]
            ids += got
            nodes += where
            progress.write(json.dumps({"epoch": epoch, "ids": got, "nodes": where, "t": time.time()}) + "\n")
            if epoch == 0 and step == args.hold_at:
                while not os.path.exists(os.path.join(args.out, "go")):
                    time.sleep(0.1)
        log["epochs"].append({"ids": ids, "nodes": sorted(set(nodes)), "stats": str(loader.stats())})
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()

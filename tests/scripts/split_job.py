"""A torchrun job that logs, per rank, the sample ids of every batch it receives.

    torchrun --nproc-per-node=N tests/scripts/split_job.py --out DIR [--n 103] [--epochs 2] ...
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.data import Dataset, DistributedSampler

import sbloader


class Ids(Dataset):
    """Sample ``i`` is ``{"id": i, "x": a small tensor}``; optional per-sample delay."""

    def __init__(self, n: int, delay: float = 0.0, straggler: int = -1, straggler_s: float = 0.0,
                 payload: int = 16) -> None:
        self.n, self.delay, self.straggler, self.straggler_s, self.payload = n, delay, straggler, straggler_s, payload

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay:
            time.sleep(self.delay)
        if i == self.straggler:
            time.sleep(self.straggler_s)
        return {"id": i, "x": torch.full((self.payload,), float(i))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=103)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shuffle", type=int, default=1)
    p.add_argument("--drop-last", type=int, default=0)
    p.add_argument("--in-order", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--distributed-sampler", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--straggler", type=int, default=-1)
    p.add_argument("--straggler-s", type=float, default=0.0)
    p.add_argument("--payload", type=int, default=16)
    p.add_argument("--two-loaders", type=int, default=0)
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds = Ids(args.n, straggler=args.straggler, straggler_s=args.straggler_s, payload=args.payload)
    kwargs = dict(batch_size=args.batch_size, num_workers=args.workers, drop_last=bool(args.drop_last),
                  in_order=bool(args.in_order), seed=args.seed, persistent_workers=True)
    sampler = None
    if args.distributed_sampler:
        sampler = DistributedSampler(ds, shuffle=bool(args.shuffle), seed=args.seed or 0)
        loader = sbloader.DataLoader(ds, sampler=sampler, **kwargs)
    else:
        loader = sbloader.DataLoader(ds, shuffle=bool(args.shuffle), **kwargs)
    loaders = [loader]
    if args.two_loaders:
        loaders.append(sbloader.DataLoader(ds, shuffle=False, **kwargs))
    log = {"rank": rank, "world": world, "len": len(loader), "epochs": [], "pid": os.getpid()}
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches = []
        for li, ld in enumerate(loaders):
            for batch in ld:
                ids = batch["id"].tolist()
                pad = batch.get("sbloader_padding")
                batches.append({"loader": li, "ids": ids,
                                "pad": pad.tolist() if pad is not None else [False] * len(ids)})
                if rank == args.slow_rank:
                    time.sleep(args.slow_s)
        log["epochs"].append(batches)
    import ray

    from sbloader.coordinator import NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE] if hasattr(ray.util, "list_named_actors") else []
    log["coordinators"] = sorted(names)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()

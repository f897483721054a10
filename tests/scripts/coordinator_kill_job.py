"""A torchrun job whose rank 0 SIGKILLs the process of its split coordinator mid-epoch (issue #46).

    torchrun --standalone --nproc-per-node=2 coordinator_kill_job.py --out DIR [--mode native|dropin]
        [--rows 480] [--kill-at 6] [--epochs 2]

Only the coordinator actor's process dies (its pid from ``process_info``; its node and
every other process live on). The ranks step in lockstep (a gloo barrier ends every
step, as DDP's all-reduce does), so every rank is mid-epoch when it dies. Each rank
writes ``DIR/rank{R}.json``: per epoch the ids of its batches and the loader's
``stats()`` text; rank 0 also the killed pid and the pid of the coordinator in use at
the end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import _hang_dump
import sbloader


def payload(batch: dict) -> dict:
    """A native map: each row gets 16 KiB (a block of 8 rows lives in the object store, owned
    by the coordinator, and is lost with it), after a short delay."""
    time.sleep(0.01 * len(batch["id"]))
    return {"id": batch["id"], "x": np.zeros((len(batch["id"]), 4096), np.float32)}


class Ids(Dataset):
    """Map-style: sample ``i`` is ``{"id": i, "x": 16 KiB}``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        time.sleep(0.01)
        return {"id": i, "x": torch.zeros(4096)}


def coordinator_of(loader, mode: str) -> object:
    """The loader's split coordinator handle (the one in use now)."""
    return loader._coordinator if mode == "native" else loader._carry.coordinator


def find_coordinator(loader, mode: str) -> object:
    """The loader's coordinator, found (or created) on this thread."""
    return loader._split_coordinator() if mode == "native" else loader._coordinator()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("native", "dropin"), default="native")
    p.add_argument("--rows", type=int, default=480)
    p.add_argument("--kill-at", type=int, default=6, help="rank 0 kills the coordinator after this many batches")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    _hang_dump.arm()
    import ray

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    if args.mode == "native":
        ds = sbloader.range(args.rows, rows_per_partition=8).map_batches(payload)
        loader = ds.to_dataloader(batch_size=8, shuffle=True, seed=0)
    else:
        loader = sbloader.DataLoader(Ids(args.rows), batch_size=8, shuffle=True, num_workers=2, seed=0,
                                     persistent_workers=True)
    log: dict = {"rank": rank, "len": len(loader), "epochs": []}
    for epoch in range(args.epochs):
        ids = []
        for step, batch in enumerate(loader, start=1):
            ids.append([int(i) for i in batch["id"]])
            if rank == 0 and epoch == 0 and step == args.kill_at:
                deadline = time.monotonic() + 60  # the first batches may be made locally while it is found
                while coordinator_of(loader, args.mode) is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                # not found by the background yet: ask here, as the loader itself does at the handover
                # (its error, if the lookup failed, is raised here instead of an AttributeError on None)
                handle = coordinator_of(loader, args.mode) or find_coordinator(loader, args.mode)
                info = ray.get(handle.process_info.remote())
                os.kill(info["pid"], signal.SIGKILL)  # the actor's process only: its node lives on
                log["killed_pid"] = info["pid"]
            dist.barrier()
        log["epochs"].append({"batches": ids, "stats": str(loader.stats())})
    log["final_pid"] = ray.get(coordinator_of(loader, args.mode).process_info.remote())["pid"]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A torchrun job that checkpoints its loader and may SIGKILL itself, for resume tests.

Each rank appends, per step, the ids of its batch to ``OUT/run{R}.rank{r}.jsonl``;
rank 0 saves ``{"step", "epoch", "loader"}`` to ``CKPT`` every ``--ckpt-every``
steps (JSON, atomically). ``--kill-at S`` makes rank 0 SIGKILL the whole job
(torchrun and every rank) at step S. With an existing CKPT the job resumes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from torch.utils.data import Dataset

import sbloader


class Ids(Dataset):
    """Sample i is its id plus a random augmentation drawn from the seeded RNGs."""

    def __init__(self, n: int, max_delay: float) -> None:
        self.n, self.max_delay = n, max_delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.max_delay:
            time.sleep(int.from_bytes(os.urandom(2), "little") / 65535 * self.max_delay)
        return {"id": i, "aug": torch.rand(1).item()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--n", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--in-order", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    loader = sbloader.DataLoader(Ids(args.n, args.max_delay), batch_size=args.batch_size, shuffle=True,
                                 num_workers=args.workers, persistent_workers=True, seed=args.seed,
                                 in_order=bool(args.in_order), dataset_id="ids")
    step = 0
    if os.path.exists(args.ckpt):
        with open(args.ckpt) as f:
            ckpt = json.load(f)
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
    log = open(os.path.join(args.out, f"run{args.attempt}.rank{rank}.jsonl"), "a", buffering=1)
    for batch in loader:
        step += 1
        log.write(json.dumps({"step": step, "ids": batch["id"].tolist(), "aug": batch["aug"].tolist()}) + "\n")
        if step % args.ckpt_every == 0:
            state = loader.state_dict()
            if rank == 0:
                tmp = args.ckpt + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({"step": step, "loader": state}, f)
                os.replace(tmp, args.ckpt)
        if rank == 0 and step == args.kill_at:  # the whole job: torchrun's group, then ours
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            os.killpg(os.getpgid(0), signal.SIGKILL)
    log.close()


if __name__ == "__main__":
    main()

"""A torchrun job that checkpoints its loader and may SIGKILL itself, for resume tests.

``--loader dropin`` (the default) loads a map-style Dataset with ``sbloader.DataLoader``;
``--loader native`` the same ids through ``sbloader.range(...).map_batches(...).to_dataloader``.

Each rank appends, per step, the ids of its batch to ``OUT/run{R}.rank{r}.jsonl``
(with the augmentation values and, when the batch has padding rows, the padding
mask as ``pad``); rank 0 saves ``{"step", "loader"}`` to ``CKPT`` every
``--ckpt-every`` steps (JSON, atomically) and appends every state it saves to
``CKPT.history.jsonl``. ``--kill-at S`` makes rank 0 SIGKILL the whole job
(torchrun and every rank: each rank runs in a session of its own, so each writes
its process group to ``OUT/run{R}.rank{r}.pgid``) at step S. With an existing
CKPT the job resumes.

With ``--sync 1`` (the default) the ranks step in lockstep, as DDP's all-reduce
makes them: a gloo barrier ends every step, so when rank 0 checkpoints at step
k every rank has logged its step k (the state records every rank's first k
batches as consumed).
"""
from __future__ import annotations

import argparse
import glob
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


def kill_job(out: str, attempt: int) -> None:
    """SIGKILL the whole job: torchrun's group first (so it cannot react), every other rank's, then ours."""
    own = os.getpgid(0)
    groups = [os.getpgid(os.getppid())]
    for path in glob.glob(os.path.join(out, f"run{attempt}.rank*.pgid")):
        with open(path) as f:
            groups.append(int(f.read()))
    for g in dict.fromkeys(groups):
        if g != own:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.killpg(own, signal.SIGKILL)


def delayed_aug(batch: dict) -> dict:
    """A native pipeline's map: the same random delays, an augmentation from the seeded RNG."""
    import numpy as np

    for _ in range(len(batch["id"])):
        time.sleep(int.from_bytes(os.urandom(2), "little") / 65535 * float(os.environ.get("RESUME_MAX_DELAY", "0")))
    return {"id": batch["id"], "aug": np.random.random(len(batch["id"]))}


def native_loader(args: argparse.Namespace):
    """The same epoch through a native pipeline: ids in partitions of 10, a shuffle window of 3."""
    os.environ["RESUME_MAX_DELAY"] = str(args.max_delay)  # Ray's workers inherit it
    ds = sbloader.range(args.n, rows_per_partition=10).map_batches(delayed_aug)
    return ds.to_dataloader(args.batch_size, shuffle=True, seed=args.seed, shuffle_window=3,
                            deterministic=bool(args.in_order), persistent_workers=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--n", "--samples", dest="n", type=int, default=240)  # --samples: torchrun takes --n for its own
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--in-order", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--sync", type=int, default=1)
    p.add_argument("--loader", choices=["dropin", "native"], default="dropin")
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    if args.sync:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    if args.loader == "native":
        loader = native_loader(args)
    else:
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
    # torchrun starts every rank in a session of its own: rank 0 needs each rank's group to kill the job
    with open(os.path.join(args.out, f"run{args.attempt}.rank{rank}.pgid"), "w") as f:
        f.write(str(os.getpgid(0)))
    for batch in loader:
        step += 1
        entry = {"step": step, "ids": batch["id"].tolist(), "aug": batch["aug"].tolist(), "t": round(time.time(), 3)}
        if "sbloader_padding" in batch:
            entry["pad"] = batch["sbloader_padding"].tolist()
        log.write(json.dumps(entry) + "\n")
        if args.sync:
            dist.barrier()
        if step % args.ckpt_every == 0:
            state = loader.state_dict()
            if rank == 0:
                tmp = args.ckpt + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({"step": step, "loader": state}, f)
                os.replace(tmp, args.ckpt)
                with open(args.ckpt + ".history.jsonl", "a") as f:
                    f.write(json.dumps({"attempt": args.attempt, "step": step, "loader": state}) + "\n")
        if rank == 0 and step == args.kill_at:
            kill_job(args.out, args.attempt)
    log.close()
    if args.sync:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

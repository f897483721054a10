"""What the checkpointing torchrun jobs (``resume_job.py``, ``rank_restart_job.py``) share:
the dataset of ids, the two loaders over it, their arguments, and the checkpoint of
``{"step", "loader"}`` that rank 0 saves and every rank loads.

``--loader dropin`` loads the map-style :class:`Ids` with ``sbloader.DataLoader``;
``--loader native`` the same ids through ``sbloader.range(...).map_batches(...).to_dataloader``.
"""
from __future__ import annotations

import argparse
import json
import os
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


def add_job_args(p: argparse.ArgumentParser, n: int, max_delay: float) -> None:
    """The arguments both jobs take: ``--out``, ``--ckpt``, ``--loader``, ``--samples`` (default ``n``),
    ``--batch-size``, ``--ckpt-every``, ``--max-delay`` (default ``max_delay``), ``--seed``."""
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--loader", choices=["dropin", "native"], default="dropin")
    p.add_argument("--n", "--samples", dest="n", type=int, default=n)  # --samples: torchrun takes --n for its own
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--max-delay", type=float, default=max_delay)
    p.add_argument("--seed", type=int, default=7)


def make_loader(args: argparse.Namespace, workers: int, **dropin):
    """The loader ``--loader`` names, over ``args.n`` ids: the native one (``args.in_order``:
    deterministic), or the drop-in with ``workers`` workers (``dropin``: more of its arguments)."""
    if args.loader == "native":
        return native_loader(args)
    return sbloader.DataLoader(Ids(args.n, args.max_delay), batch_size=args.batch_size, shuffle=True,
                               num_workers=workers, persistent_workers=True, seed=args.seed, dataset_id="ids",
                               **dropin)


def load_checkpoint(loader, ckpt: str) -> int:
    """Load the loader's state from ``ckpt`` when it exists; the step it was saved at (0: none)."""
    if not os.path.exists(ckpt):
        return 0
    with open(ckpt) as f:
        saved = json.load(f)
    loader.load_state_dict(saved["loader"])
    return saved["step"]


def save_checkpoint(ckpt: str, step: int, state: dict) -> None:
    """Write ``{"step", "loader": state}`` to ``ckpt`` atomically (a kill mid-write leaves the old one)."""
    with open(ckpt + ".tmp", "w") as f:
        json.dump({"step": step, "loader": state}, f)
    os.replace(ckpt + ".tmp", ckpt)

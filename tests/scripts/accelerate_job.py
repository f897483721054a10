"""Hugging Face Accelerate with the drop-in: ``accelerate launch --num_processes 2 accelerate_job.py OUT``.

    accelerate_job.py OUT [--plain-first] [--mix] [--stop-at STEP] [--resume DIR]

The loader goes through ``accelerator.prepare(loader)``; each process writes
``OUT/rank{R}.json`` (per epoch, the ids it got, and the loader's type). ``--mix``:
the loader reads ``sbloader.mix`` of two sources (ids from 0 and from 1000, weights
2:1, 96 samples per epoch), registered with ``accelerator.register_for_checkpointing``;
``--stop-at``: at that step of epoch 0, ``accelerator.save_state(OUT/ckpt)`` and a hard
exit (a preemption); ``--resume``: ``accelerator.load_state(DIR)``, then the rest of
epoch 0 and epoch 1. ``--plain-first``: before the loader the other arguments name, the plain
loader (no ``--mix``, no stop) runs its two epochs in the same processes and each writes
``OUT/rank{R}-plain.json`` (one launch for what were two: a launch and its Ray cost more than the epochs).
"""
from __future__ import annotations

import json
import os
import sys

import torch


class Ids(torch.utils.data.Dataset):
    """Sample ``i`` is its id (``offset + i``)."""

    def __init__(self, n: int = 96, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return self.offset + i


def main() -> None:
    from accelerate import Accelerator

    import sbloader

    out, args = sys.argv[1], sys.argv[2:]
    stop_at = int(args[args.index("--stop-at") + 1]) if "--stop-at" in args else None
    resume = args[args.index("--resume") + 1] if "--resume" in args else None
    accelerator = Accelerator(cpu=True)
    if "--plain-first" in args:
        plain = accelerator.prepare(sbloader.DataLoader(Ids(), batch_size=8, shuffle=True, num_workers=2))
        _epochs(accelerator, plain, os.path.join(out, f"rank{accelerator.process_index}-plain.json"), None)
    if "--mix" in args:
        mixed = sbloader.mix({"a": Ids(60, 0), "b": Ids(30, 1000)}, weights={"a": 2, "b": 1}, seed=5)
        loader = accelerator.prepare(sbloader.DataLoader(mixed, batch_size=8, shuffle=True, num_samples=96))
        accelerator.register_for_checkpointing(loader)
    else:
        loader = accelerator.prepare(sbloader.DataLoader(Ids(), batch_size=8, shuffle=True, num_workers=2))
    if resume is not None:
        accelerator.load_state(resume)
    name = os.path.join(out, f"rank{accelerator.process_index}{'-resumed' if resume else ''}.json")
    _epochs(accelerator, loader, name, stop_at, os.path.join(out, "ckpt"))


def _epochs(accelerator, loader, name: str, stop_at, ckpt: str = "") -> None:
    """Two epochs of ``loader``, their ids written to ``name``; at step ``stop_at`` of epoch 0 (None:
    never), ``save_state(ckpt)``, the ids so far written, and a hard exit."""
    epochs: list = []
    for _ in range(2):
        epochs.append([])
        for step, batch in enumerate(loader):
            epochs[-1] += [int(i) for i in batch]
            if stop_at is not None and step == stop_at:
                accelerator.save_state(ckpt)
                accelerator.wait_for_everyone()
                with open(name, "w") as f:
                    json.dump({"epochs": epochs, "type": type(loader).__name__}, f)
                os._exit(0)  # a preemption right after the checkpoint
    with open(name, "w") as f:
        json.dump({"epochs": epochs, "type": type(loader).__name__}, f)

if __name__ == "__main__":
    main()

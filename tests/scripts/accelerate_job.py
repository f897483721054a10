"""Hugging Face Accelerate with the drop-in: ``accelerate launch --num_processes 2 accelerate_job.py OUT``.

The loader goes through ``accelerator.prepare(loader)``; each process writes
``OUT/rank{R}.json`` (per epoch, the ids it got).
"""
from __future__ import annotations

import json
import os
import sys

import torch


class Ids(torch.utils.data.Dataset):
    """Sample ``i`` is its id."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> int:
        return i


def main() -> None:
    from accelerate import Accelerator

    import sbloader

    out = sys.argv[1]
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(sbloader.DataLoader(Ids(), batch_size=8, shuffle=True, num_workers=2))
    epochs = [[int(i) for batch in loader for i in batch] for _ in range(2)]
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"epochs": epochs, "type": type(loader).__name__}, f)


if __name__ == "__main__":
    main()

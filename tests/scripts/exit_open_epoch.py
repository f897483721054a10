"""Exit with an epoch still open (``tests/unit/test_exit.py``).

    python exit_open_epoch.py OUT [loader]

An epoch whose fetch thread is still making batches of torch tensors when the script
ends (as a trainer that stops mid-epoch, or one whose framework keeps an iterator to
the end). Its producer writes to ``OUT`` whether the interpreter was already
finalizing when it was closed, and an exit hook that runs after sbloader's writes
which sbloader threads were still running. ``loader``: a drop-in DataLoader on local
workers instead of a bare epoch.
"""
from __future__ import annotations

import atexit
import json
import sys
import threading

import torch

OUT = sys.argv[1]
REPORT: dict = {}


def _last() -> None:  # registered before any epoch: runs after sbloader's own exit hook
    REPORT["running"] = sorted(t.name for t in threading.enumerate() if t.name == "sbloader-fetch" and t.is_alive())
    with open(OUT, "w") as f:
        json.dump(REPORT, f)


atexit.register(_last)

from sbloader.loaders.epoch import Delivery, EpochIterator  # noqa: E402


def produce():
    try:
        while True:
            yield Delivery({"x": torch.zeros(64), "parts": [torch.ones(3) for _ in range(16)]})
    finally:
        REPORT["closed"] = "while finalizing" if sys.is_finalizing() else "before finalizing"


if len(sys.argv) > 2 and sys.argv[2] == "loader":
    import sbloader

    class Ds(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((64,), float(i)), "parts": [torch.zeros(3) for _ in range(8)]}

    it = iter(sbloader.DataLoader(Ds(), batch_size=8, num_workers=2))
    REPORT["closed"] = "n/a"
else:
    it = EpochIterator(produce(), ahead=2)
next(it)
next(it)

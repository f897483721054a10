"""Exit with an epoch still open (``tests/unit/test_exit.py``).

    python exit_open_epoch.py OUT [loader|starting]

An epoch whose fetch thread is still making batches of torch tensors when the script
ends (as a trainer that stops mid-epoch, or one whose framework keeps an iterator to
the end). Its producer writes to ``OUT`` whether the interpreter was already
finalizing when it was closed, and an exit hook that runs after sbloader's writes
which sbloader threads were still running. ``loader``: a drop-in DataLoader on local
workers instead of a bare epoch. ``starting``: a drop-in's whole (short) epoch ends on the
local workers while Ray and the pool's actors still start in the background; the script
ends at once (a thread inside Ray's start when the interpreter finalizes aborts the
process: "FATAL: exception not rethrown", or a segfault).
"""
from __future__ import annotations

import atexit
import json
import sys
import threading

import torch

OUT = sys.argv[1]
REPORT: dict = {}


WATCHED = ("sbloader-fetch", "sbloader-ray-start", "sbloader-pool-prestart")


def _last() -> None:  # registered before any epoch: runs after sbloader's own exit hook
    REPORT["running"] = sorted(t.name for t in threading.enumerate() if t.name in WATCHED and t.is_alive())
    ray = sys.modules.get("ray")
    REPORT["ray_up"] = bool(ray is not None and ray.is_initialized())
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


MODE = sys.argv[2] if len(sys.argv) > 2 else "epoch"
if MODE in ("loader", "starting"):
    import sbloader

    class Ds(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((64,), float(i)), "parts": [torch.zeros(3) for _ in range(8)]}

    REPORT["closed"] = "n/a"
    if MODE == "starting":
        loader = sbloader.DataLoader(Ds(), batch_size=8, num_workers=2, sampler=range(64))
        assert sum(len(b["x"]) for b in loader) == 64
        REPORT["started_at_exit"] = any(t.name == "sbloader-ray-start" and t.is_alive() for t in threading.enumerate())
        sys.exit(0)
    it = iter(sbloader.DataLoader(Ds(), batch_size=8, num_workers=2))
else:
    it = EpochIterator(produce(), ahead=2)
next(it)
next(it)

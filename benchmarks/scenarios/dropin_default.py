"""The drop-in ``sbloader.DataLoader`` with the arguments a user copies from torch
(a map-style Dataset that decodes and crops JPEGs, ``batch_size``, ``shuffle``,
``num_workers``), against torch's DataLoader with the same arguments; then both with
``persistent_workers=True``. A new iterator per epoch; images/s over all epochs and
the time to the first batch of the first and of later epochs."""
from __future__ import annotations

import gc
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import batch_len, epochs, jpeg_paths

ORDER = 10
TITLE = "Drop-in DataLoader, default arguments, vs torch"
PARAMS = {"images": 1024, "batch_size": 64, "num_workers": 2, "epochs": 3, "rounds": 3}
QUICK = {"images": 256, "epochs": 2, "rounds": 3}
CONTENDERS = ("sbloader", "torch", "sbloader persistent", "torch persistent")


def plan(**p: Any) -> Plan:
    """Four contenders, ``rounds`` rounds of ``epochs`` epochs each."""
    return Plan(list(CONTENDERS), p["rounds"], notes=f"{p['images']} JPEGs, {p['epochs']} epochs per round")


def run(**p: Any) -> Outcome:
    """Build each loader once per round, iterate ``epochs`` epochs."""
    import torch

    import sbloader
    from benchmarks._image_workload import ImageFolderDataset

    ds = ImageFolderDataset(jpeg_paths(p["images"]))
    args = {"batch_size": p["batch_size"], "shuffle": True, "num_workers": p["num_workers"]}

    def contender(cls: Any, persistent: bool):
        def go() -> dict[str, float]:
            loader = cls(ds, **args, **({"persistent_workers": True} if persistent else {}))
            try:
                return epochs(lambda: iter(loader), batch_len, p["epochs"])
            finally:
                del loader
                gc.collect()  # a persistent loader's workers go now, not in a later contender's run

        return go

    trials = run_interleaved({
        "sbloader": contender(sbloader.DataLoader, False),
        "torch": contender(torch.utils.data.DataLoader, False),
        "sbloader persistent": contender(sbloader.DataLoader, True),
        "torch persistent": contender(torch.utils.data.DataLoader, True),
    }, p["rounds"])
    return Outcome(trials, "items_per_s", "images/s", baseline="torch",
                   extra=("first_batch_epoch1_s", "first_batch_later_s"),
                   notes=[f"same arguments for both: {args}; sbloader's embedded Ray starts in the first round "
                          "(its start is in that round's first epoch)"])

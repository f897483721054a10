"""An ``IterableDataset`` (JPEG decode + random-resized crop, each worker reading its share of the
files by ``get_worker_info()``) under torch's default loader arguments, one loader iterated for
3 epochs with a simulated training step: sbloader's drop-in (local workers first, then the pool,
each shard in segments round after round) against torch's DataLoader, interleaved."""
from __future__ import annotations

from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import jpeg_paths
from .loader_per_epoch import train

ORDER = 13
TITLE = "An IterableDataset, one loader for 3 epochs, 50 ms step, vs torch"
PARAMS = {"images": 1500, "batch_size": 32, "num_workers": 2, "epochs": 3, "step_ms": 50, "rounds": 3}
QUICK = {"images": 384, "rounds": 3}
CONTENDERS = ("sbloader IterableDataset", "torch IterableDataset")


def plan(**p: Any) -> Plan:
    """Two contenders, ``rounds`` rounds of ``epochs`` epochs each."""
    return Plan(list(CONTENDERS), p["rounds"],
                notes=f"{p['images']} JPEGs, batch {p['batch_size']}, {p['num_workers']} workers, "
                      f"{p['epochs']} epochs, {p['step_ms']} ms step")


def run(**p: Any) -> Outcome:
    """Each contender ``rounds`` times, interleaved."""
    import torch

    import sbloader
    from benchmarks._image_stream import ImageStream

    ds = ImageStream(jpeg_paths(p["images"]))
    args = {"batch_size": p["batch_size"], "num_workers": p["num_workers"]}
    step_s = p["step_ms"] / 1000.0

    def contender(cls: Any):
        return lambda: train(lambda: cls(ds, **args), False, p["epochs"], step_s)

    ours, theirs = CONTENDERS
    trials = run_interleaved({ours: contender(sbloader.DataLoader), theirs: contender(torch.utils.data.DataLoader)},
                             p["rounds"])
    return Outcome(trials, "items_per_s", "images/s", baseline=theirs,
                   extra=("first_batch_epoch1_s", "first_batch_later_s", "wall_s"),
                   notes=[f"same arguments for both: {args}, a {p['step_ms']} ms sleep per batch",
                          "an IterableDataset's shards run on sbloader's pool in segments of 8 batches (2 and 4 "
                          "in the first two rounds), the next made while the loop consumes one"])

"""A training loop as users write it, with torch's default loader arguments (``batch_size``,
``shuffle`` and ``num_workers`` set, everything else left alone: ``persistent_workers=False``):
a JPEG decode + random-resized-crop Dataset, a simulated training step (``step_ms`` of sleep
per batch: the CPU is free, as while a GPU trains). Two ways to hold the loader: a **new
loader built inside the epoch loop** each epoch, and **one loader** iterated for every epoch.
sbloader's drop-in against torch's DataLoader with the same arguments, interleaved; images/s
over all epochs (start-up included: each run is a fresh loader, in a process where the
other contenders ran before) and the time to each epoch's first batch."""
from __future__ import annotations

import gc
import time
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import batch_len, jpeg_paths

ORDER = 11
TITLE = "A new loader per epoch, 50 ms step, vs torch"
PARAMS = {"images": 1500, "batch_size": 32, "num_workers": 2, "epochs": 3, "step_ms": 50, "rounds": 3}
QUICK = {"images": 384, "rounds": 3}
PER_EPOCH = True  # one_loader.py: the same loop with one loader


def contenders(per_epoch: bool) -> tuple:
    """The two contenders' names."""
    hold = "new loader per epoch" if per_epoch else "one loader"
    return (f"sbloader {hold}", f"torch {hold}")


def plan(**p: Any) -> Plan:
    """Two contenders, ``rounds`` rounds of ``epochs`` epochs each."""
    return Plan(list(contenders(PER_EPOCH)), p["rounds"],
                notes=f"{p['images']} JPEGs, batch {p['batch_size']}, {p['num_workers']} workers, "
                      f"{p['epochs']} epochs, {p['step_ms']} ms step")


def train(make_loader: Any, per_epoch: bool, n_epochs: int, step_s: float) -> dict[str, float]:
    """``n_epochs`` epochs of a loop that sleeps ``step_s`` per batch; the loader built once or per epoch."""
    t0 = time.perf_counter()
    loader = None if per_epoch else make_loader()
    firsts, items = [], 0
    for _ in range(n_epochs):
        if per_epoch:
            loader = make_loader()
        t = time.perf_counter()
        first = None
        for batch in loader:
            if first is None:
                first = time.perf_counter() - t
            items += batch_len(batch)
            time.sleep(step_s)
        firsts.append(first if first is not None else float("nan"))
    wall = time.perf_counter() - t0
    del loader
    gc.collect()
    later = sorted(firsts[1:]) or [float("nan")]
    return {"items_per_s": items / wall, "first_batch_epoch1_s": firsts[0],
            "first_batch_later_s": later[len(later) // 2], "wall_s": wall}


def run(**p: Any) -> Outcome:
    """Each contender ``rounds`` times, interleaved."""
    return run_holding(PER_EPOCH, **p)


def run_holding(per_epoch: bool, **p: Any) -> Outcome:
    """sbloader and torch, the loader built per epoch or once, ``rounds`` times each, interleaved."""
    import torch

    import sbloader
    from benchmarks._image_workload import ImageFolderDataset

    ds = ImageFolderDataset(jpeg_paths(p["images"]))
    args = {"batch_size": p["batch_size"], "shuffle": True, "num_workers": p["num_workers"]}
    step_s = p["step_ms"] / 1000.0

    def contender(cls: Any):
        return lambda: train(lambda: cls(ds, **args), per_epoch, p["epochs"], step_s)

    ours, theirs = contenders(per_epoch)
    trials = run_interleaved({ours: contender(sbloader.DataLoader), theirs: contender(torch.utils.data.DataLoader)},
                             p["rounds"])
    return Outcome(trials, "items_per_s", "images/s", baseline=theirs,
                   extra=("first_batch_epoch1_s", "first_batch_later_s", "wall_s"),
                   notes=[f"same arguments for both: {args}, a {p['step_ms']} ms sleep per batch",
                          "sbloader's embedded Ray starts in its first run (in the background: its first "
                          "batches come from local worker processes)"])

"""Resuming mid-epoch, as a restarted training script does: a new loader object, its
state restored, then the first batch. sbloader's drop-in ``DataLoader`` with
``load_state_dict(sd)`` (a state taken after ``at`` batches) against torch's
DataLoader with the same arguments skipping ``at`` batches (what a torch user without
a stateful loader does), and a fresh sbloader loader with no state (the cold start
alone). Seconds from the new loader to its first batch of the rest of the epoch."""
from __future__ import annotations

import gc
import time
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import jpeg_paths, missing_peers

ORDER = 70
TITLE = "Resume mid-epoch: time to the first batch"
PARAMS = {"images": 1024, "batch_size": 32, "at": 24, "num_workers": 2, "rounds": 3}
QUICK = {"images": 512, "at": 12, "rounds": 3}
CONTENDERS = ("sbloader load_state_dict", "torch skip", "sbloader cold start")
PEERS = {"torchdata StatefulDataLoader": "torchdata"}


def plan(**p: Any) -> Plan:
    """Three contenders, a new loader per run."""
    if p["at"] * p["batch_size"] >= p["images"]:
        raise ValueError(f"at={p['at']} batches of {p['batch_size']} is past the epoch of {p['images']} images")
    skipped = missing_peers(PEERS)
    return Plan(list(CONTENDERS) + [k for k in PEERS if k not in skipped], p["rounds"], skipped,
                f"resume after {p['at']} of {p['images'] // p['batch_size']} batches")


def run(**p: Any) -> Outcome:
    """Take one state after ``at`` batches, then time each contender's new loader."""
    import torch

    import sbloader
    from benchmarks._image_workload import ImageFolderDataset

    ds = ImageFolderDataset(jpeg_paths(p["images"]))
    args = {"batch_size": p["batch_size"], "shuffle": True, "num_workers": p["num_workers"]}
    first = sbloader.DataLoader(ds, **args)
    it = iter(first)
    for _ in range(p["at"]):
        next(it)
    sd = first.state_dict()
    del it, first
    gc.collect()

    def sbl(state: Any):
        def go() -> dict:
            t0 = time.perf_counter()
            loader = sbloader.DataLoader(ds, **args)
            if state is not None:
                loader.load_state_dict(state)
            t1 = time.perf_counter()
            next(iter(loader))
            t2 = time.perf_counter()
            del loader
            gc.collect()
            return {"resume_first_batch_s": t2 - t0, "load_state_s": t1 - t0}
        return go

    def torch_skip() -> dict:
        t0 = time.perf_counter()
        it = iter(torch.utils.data.DataLoader(ds, **args))
        for _ in range(p["at"]):
            next(it)
        next(it)
        return {"resume_first_batch_s": time.perf_counter() - t0, "load_state_s": 0.0}

    contenders = {"sbloader load_state_dict": sbl(sd), "torch skip": torch_skip, "sbloader cold start": sbl(None)}
    skipped = missing_peers(PEERS)
    if not skipped:  # torchdata's StatefulDataLoader: a state after ``at`` batches, restored in a new loader
        from torchdata.stateful_dataloader import StatefulDataLoader

        it = iter(src := StatefulDataLoader(ds, **args))
        for _ in range(p["at"]):
            next(it)
        tsd = src.state_dict()
        del it, src

        def stateful() -> dict:
            t0 = time.perf_counter()
            loader = StatefulDataLoader(ds, **args)
            loader.load_state_dict(tsd)
            t1 = time.perf_counter()
            next(iter(loader))
            return {"resume_first_batch_s": time.perf_counter() - t0, "load_state_s": t1 - t0}

        contenders["torchdata StatefulDataLoader"] = stateful
    trials = run_interleaved(contenders, p["rounds"])
    return Outcome(trials, "resume_first_batch_s", "s", higher_is_better=False, baseline="torch skip",
                   extra=("load_state_s",), skipped=skipped,
                   notes=[f"{p['images']} JPEGs (decode + crop per item), batches of {p['batch_size']}, "
                          f"{p['num_workers']} workers; the state was taken after {p['at']} batches; sbloader's "
                          "embedded Ray was up before the rounds (a restarted script also pays its start: see the "
                          "first-run section)"])

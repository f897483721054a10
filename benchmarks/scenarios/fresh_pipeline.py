"""A new pipeline every epoch, as a script that builds its loader inside the epoch loop
does: ``read_images(paths, decode=False).map_batches(f).to_dataloader(64, shuffle=True)``
with ``f`` a function, against the same with ``f`` a callable class (which sbloader runs
in actors, started with each new pipeline). Images/s of the epoch, start-up included,
and the time to its first batch, both from the pipeline's construction."""
from __future__ import annotations

import gc
from typing import Any

import numpy as np

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import batch_len, built_epoch, jpeg_paths

ORDER = 20
TITLE = "A fresh pipeline per epoch: a callable class vs a function"
PARAMS = {"images": 1024, "rounds": 3}
QUICK = {"images": 256, "rounds": 3}


def plan(**p: Any) -> Plan:
    """Two contenders, one new pipeline and one epoch per run."""
    return Plan(["function", "callable class"], p["rounds"], notes=f"{p['images']} JPEGs")


def decode_batch(batch: dict) -> dict:
    """The function: window decode, crop, flip, CHW (sbloader's transform)."""
    from benchmarks import _image_workload as w

    return w.sbl_decode_files_window_batch(batch)


class DecodeBatch:
    """The same work as a callable class (state built once per actor, as users write one)."""

    def __init__(self) -> None:
        from benchmarks import _image_workload as w

        self.w = w
        self.scratch = np.zeros(1)  # state a user would keep: a model, a tokenizer, ...

    def __call__(self, batch: dict) -> dict:
        return self.w.sbl_decode_files_window_batch(batch)


def run(**p: Any) -> Outcome:
    """A pipeline built, iterated for one epoch and dropped per run."""
    import sbloader
    from benchmarks import _image_workload as w

    paths = jpeg_paths(p["images"])
    sbloader.init(num_cpus=2)

    def contender(fn: Any):
        def go() -> dict:
            r = built_epoch(lambda: sbloader.read_images(paths, decode=False).map_batches(fn)
                            .to_dataloader(w.BATCH, shuffle=True), batch_len)
            gc.collect()
            return r
        return go

    contender(decode_batch)()  # warm-up: Ray's workers, imports, the page cache
    trials = run_interleaved({"function": contender(decode_batch), "callable class": contender(DecodeBatch)},
                             p["rounds"])
    return Outcome(trials, "images_per_s", "images/s", baseline="function", extra=("first_batch_s", "epoch_s"),
                   notes=["embedded Ray with num_cpus=2, started before the rounds; each run builds its pipeline "
                          "anew (no persistent workers)"])

"""Where the drop-in's workers stack a batch (ported from ``bench_collate.py``): private
memory (the default; the batch leaves its actor by a copy anyway) against torch's
shared-memory stacking (``default_collate`` under ``get_worker_info()``, as in torch's
worker processes; ``_image_workload.shm_stacking_collate``). The image workload
(decode + random-resized-crop 224 + flip, batches of 64, the consumer only counting)
through two drop-in loaders with persistent workers that differ only in that; the
embedded Ray declares 2x the cores as logical CPUs so both pools exist, one loader
runs at a time. Images/s and CPU µs per image by process class."""
from __future__ import annotations

import os
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import epoch_contenders, jpeg_paths

ORDER = 230
REPORT = False
TITLE = "Drop-in workers: where a batch is stacked"
PARAMS = {"images": 2048, "rounds": 8}
QUICK = {"images": 512, "rounds": 3}
NAMES = ("drop-in (private stacking)", "drop-in, torch's shared-memory stacking")


def plan(**p: Any) -> Plan:
    """Two drop-in loaders, one epoch per run after a warm epoch each."""
    return Plan(list(NAMES), p["rounds"], notes=f"{p['images']} JPEGs")


def run(**p: Any) -> Outcome:
    """Both loaders built at once (persistent workers), then interleaved epochs."""
    import sbloader
    from benchmarks import _image_workload as w

    paths = jpeg_paths(p["images"])
    cores = os.cpu_count() or 2
    sbloader.init(num_cpus=2 * cores)
    kw = {"batch_size": w.BATCH, "shuffle": True, "num_workers": cores, "persistent_workers": True}
    loaders = {NAMES[0]: sbloader.DataLoader(w.ImageFolderDataset(paths), **kw),
               NAMES[1]: sbloader.DataLoader(w.ImageFolderDataset(paths), collate_fn=w.shm_stacking_collate, **kw)}

    skipped: dict = {}  # a loader whose warm-up epoch failed, with why
    trials = run_interleaved(epoch_contenders({k: (lambda ld=ld: iter(ld)) for k, ld in loaders.items()}, skipped),
                             p["rounds"], by_class=True)
    classes = ("trainer", "workers", "raylet")
    for t in trials.trials:
        for c in classes:
            t.metrics[f"{c}_cpu_us_per_image"] = 1e6 * t.metrics.get(f"cpu_s_{c}", 0.0) / p["images"]
    return Outcome(trials, "images_per_s", "images/s", baseline=NAMES[1], skipped=skipped,
                   extra=tuple(f"{c}_cpu_us_per_image" for c in classes),
                   notes=[f"{cores} persistent workers per loader; CPU by process class from CPU-tick sampling"])

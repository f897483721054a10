"""What the same-node shared-memory hand-off saves (ported from ``bench_handoff.py``):
sbloader with the final blocks handed over through the consumer's shared-memory slots
(the default) and through Ray's object store (``SBLOADER_SLOT_HANDOFF=0``, read when an
epoch's executor starts), side by side; the image workload (decode + random-resized-crop
224 + flip, batches of 64, the consumer only counting); the native pipeline's rounds
first, then the drop-in's (persistent workers: they hold every CPU while the loader
lives), each beside the function alone in ``Pool(cores)``. One epoch per run after a
warm epoch of each; images/s and CPU µs per image by process class."""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

from benchmarks.harness import Outcome, Plan, Trials, paired_ratios, ratio_words, run_interleaved

from ._common import batch_len, jpeg_paths, time_epoch

ORDER = 250
REPORT = False
TITLE = "The shared-memory hand-off: sbloader with and without it"
PARAMS = {"images": 2048, "rounds": 5}
QUICK = {"images": 512, "rounds": 3}
PHASES = ("pipeline", "drop-in")
CLASSES = ("trainer", "workers", "raylet", "gcs", "ray_daemons")


def plan(**p: Any) -> Plan:
    """Per phase: the function alone in processes, slots, object store."""
    return Plan([f"{ph}{s}" for ph in PHASES for s in (" processes", ", slots", ", object store")], p["rounds"])


def run(**p: Any) -> Outcome:
    """The pipeline's interleaved rounds, then the drop-in's."""
    import sbloader
    from benchmarks import _image_workload as w

    paths = jpeg_paths(p["images"])
    cores = os.cpu_count() or 2
    chunks = [paths[i:i + w.BATCH] for i in range(0, len(paths), w.BATCH)]
    pool = mp.get_context("spawn").Pool(cores)
    sbloader.init()

    def epoch(loader: Any, slots: bool):
        def go() -> dict:
            os.environ["SBLOADER_SLOT_HANDOFF"] = "1" if slots else "0"
            r = time_epoch(lambda: iter(loader), batch_len)
            st = loader.stats()
            return {"images_per_s": r["items"] / r["epoch_s"],
                    "slot_blocks": float(st.slot_blocks) if st is not None else float("nan")}
        return go

    def alone() -> dict:
        r = time_epoch(lambda: pool.imap_unordered(w.preprocess_paths, chunks), batch_len)
        return {"images_per_s": r["items"] / r["epoch_s"]}

    out, notes = Trials(), []
    for ph in PHASES:
        loader = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_window_batch)
                  .to_dataloader(w.BATCH, shuffle=True) if ph == "pipeline" else
                  sbloader.DataLoader(w.ImageFolderDataset(paths), batch_size=w.BATCH, shuffle=True,
                                      num_workers=cores, persistent_workers=True))
        cs = {f"{ph} processes": alone, f"{ph}, slots": epoch(loader, True), f"{ph}, object store": epoch(loader, False)}
        for name, fn in cs.items():  # warm: workers started, block sizes known, slots' pages touched
            fn()
        t = run_interleaved(cs, p["rounds"], by_class=True)
        out.trials += t.trials
        out.rounds_planned, out.rounds_run = t.rounds_planned, t.rounds_run
        rs = sorted(paired_ratios(t, "images_per_s", f"{ph}, slots", f"{ph}, object store"))
        if rs:
            quiet = all(x.load["quiet"] for x in t.trials)
            notes.append(f"{ph}: slots against object store, same round: "
                         + ratio_words(rs[len(rs) // 2], "object store", quiet, f"min {rs[0]:.3f}, max {rs[-1]:.3f}"))
        del loader
    os.environ.pop("SBLOADER_SLOT_HANDOFF", None)
    pool.close()
    for t in out.trials:
        for c in CLASSES:
            t.metrics[f"{c}_cpu_us_per_image"] = 1e6 * t.metrics.get(f"cpu_s_{c}", 0.0) / p["images"]
    return Outcome(out, "images_per_s", "images/s", extra=("slot_blocks",) + tuple(f"{c}_cpu_us_per_image"
                                                                                    for c in CLASSES),
                   notes=notes + [f"`processes`: the function alone in Pool({cores}) in the same rounds"])

"""Decode only the crop window (issue #29; ported from ``bench_crop_decode.py``):
sbloader before (whole decode) and after (window decode), the Pillow ceiling and the
window function alone in ``multiprocessing.Pool(2)``, torch's DataLoader (2 persistent
workers, whole decode), DALI CPU where installed. Read a JPEG, random-resized-crop
224 (scale 0.08–1), flip, uint8 CHW, batches of 64; one epoch per run after a warm-up
epoch each; images/s and CPU ms per image of the whole process tree. Beside them: the
function alone in this process (CPU ms per image) and the window decode's PSNR against
the whole decode on the same crop."""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Callable

import numpy as np

from benchmarks.harness import Outcome, Plan, run_interleaved, summarize

from ._common import epoch_contenders, jpeg_paths, missing_peers, start_peers

ORDER = 220
REPORT = False
TITLE = "Decode only the crop window: sbloader before/after, the Pillow ceiling, torch, DALI CPU"
PARAMS = {"images": 2048, "rounds": 3}
QUICK = {"images": 384, "rounds": 3}
CEILING = "Pillow ceiling (whole decode, Pool(2))"
BASE = (CEILING, "window function, Pool(2)", "torch DataLoader(2)", "sbloader before (whole decode)",
        "sbloader after (window decode)")


def plan(**p: Any) -> Plan:
    """Five contenders and DALI CPU where installed."""
    skipped = missing_peers({"DALI CPU": "nvidia.dali"})
    return Plan(list(BASE) + ([] if skipped else ["DALI CPU"]), p["rounds"], skipped)


def quality(paths: list[str]) -> dict:
    """PSNR of the window decode against the whole decode on the same crop (same seed per image)."""
    from benchmarks._image_workload import SIZE, T

    psnrs = []
    for i, x in enumerate(paths):
        a = np.asarray(T.decode_random_resized_crop(x, SIZE, np.random.default_rng(i))).astype(np.float64)
        b = np.asarray(T.decode_random_resized_crop(x, SIZE, np.random.default_rng(i), exact=True))
        mse = float(((a - b) ** 2).mean())
        psnrs.append(99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse))
    arr = np.array(psnrs)
    return {"mean_psnr_db": float(arr.mean()), "worst_psnr_db": float(arr.min()), "identical": int((arr == 99).sum())}


def function_cpu_ms(paths: list[str], exact: bool, seed: int) -> float:
    """CPU ms per image of the function alone in this process."""
    from benchmarks._image_workload import load_file

    rng, t = np.random.default_rng(seed), time.process_time()
    for x in paths:
        load_file(x, rng, exact)
    return (time.process_time() - t) * 1e3 / len(paths)


def run(**p: Any) -> Outcome:
    """Build every contender, warm each up, then interleave one epoch per run."""
    import torch

    import sbloader
    from benchmarks import _image_workload as w

    paths = jpeg_paths(p["images"])
    q = quality(paths)
    sbloader.init(num_cpus=2)
    chunks = [paths[i:i + w.BATCH] for i in range(0, len(paths), w.BATCH)]
    pool = mp.get_context("spawn").Pool(2)
    tl = torch.utils.data.DataLoader(w.ImageFolderDataset(paths, exact=True), batch_size=w.BATCH, shuffle=True,
                                     num_workers=2, persistent_workers=True)
    before = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_exact_batch)
              .to_dataloader(w.BATCH, shuffle=True, seed=0))
    after = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_window_batch)
             .to_dataloader(w.BATCH, shuffle=True, seed=0))
    makers: dict[str, Callable[[], Any]] = dict(zip(BASE, (
        lambda: pool.imap_unordered(w.preprocess_paths_exact, chunks),
        lambda: pool.imap_unordered(w.preprocess_paths, chunks),
        lambda: iter(tl), lambda: iter(before), lambda: iter(after))))
    skipped = missing_peers({"DALI CPU": "nvidia.dali"})
    from ._peers import dali_epochs

    makers.update(start_peers({"DALI CPU": dali_epochs}, skipped, paths, 2))
    torch.set_num_threads(1)
    fn_ms: dict[str, list] = {"whole": [], "window": []}

    def alone(r: int) -> None:  # the function alone, once per round, outside the measured runs
        for k in fn_ms:
            fn_ms[k].append(function_cpu_ms(paths, k == "whole", r))

    trials = run_interleaved(epoch_contenders(makers, skipped), p["rounds"], before_round=alone)
    for t in trials.trials:
        t.metrics["cpu_ms_per_image"] = 1e3 * t.metrics["cpu_s"] / p["images"]
    pool.close()
    s = {k: summarize(v) for k, v in fn_ms.items()}
    return Outcome(trials, "images_per_s", "images/s", baseline=CEILING, extra=("cpu_ms_per_image",),
                   skipped=skipped, raw={"quality": q, "function_cpu_ms": fn_ms},
                   notes=[f"the function alone in this process (CPU ms per image): whole decode "
                          f"{s['whole']['median']:.3f}, window decode {s['window']['median']:.3f} (medians over rounds)",
                          f"window vs whole decode on the same crop: mean PSNR {q['mean_psnr_db']:.1f} dB (identical "
                          f"images count 99 dB; {q['identical']} identical), worst {q['worst_psnr_db']:.1f} dB"])

"""Decode only the crop window (issue #29): sbloader before and after, the Pillow ceiling, torch, DALI CPU.

Workload: read a JPEG, random-resized-crop (scale (0.08, 1), ratio (3/4, 4/3)) to
224x224, random flip, uint8 CHW, batches of 64, over the generated JPEGs of
``bench_images.py`` (320x240 to 640x480, quality 90; 2,048 by default).

Contenders, each one epoch per round, interleaved (the order reversed every other
round), all with 2 processes or threads doing the work (the machine has 2 cores):

- ``Pillow ceiling``: the function alone (whole Pillow decode, crop, flip:
  ``decode_crop_flip(exact=True)``) in ``multiprocessing.Pool(2)`` over 64-image chunks;
- ``window function, Pool(2)``: the same with the window decode (the new ceiling);
- ``torch DataLoader(2)``: a map-style Dataset doing the whole-decode work,
  ``num_workers=2, persistent_workers=True``;
- ``DALI CPU``: ``readers.file`` + ``decoders.image_random_crop`` (which decodes only
  the crop window) + antialiased ``resize`` + ``flip`` + ``transpose``, ``device_id=None``,
  2 threads (``pip install --no-deps nvidia-dali-cuda120 nvidia-nvimgcodec-cu12`` and its
  pure-Python deps: the ``bench`` extra); skipped, with the reason in the results,
  where it does not import or run;
- ``sbloader before``: ``read_images(paths, decode=False).map_batches(decode_crop_flip
  exact=True).to_dataloader(64, shuffle=True)``;
- ``sbloader after``: the same with the window decode (``decode_crop_flip``'s default).

CPU ms per image = CPU time of this process and all its descendants (pool processes,
torch's workers, DALI's threads, Ray's daemons and workers) over the epoch / images.
The machine's other load: the busy share of all CPUs (``/proc/stat``) not taken by
this process tree, per run, and ``os.getloadavg()`` at each round's start.

Run: ``python benchmarks/bench_crop_decode.py [--rounds 3] [--images 2048]``.
Writes ``benchmarks/results/crop_decode.json`` and ``crop_decode.md``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402

h.ray_worker_env()
import _image_workload as w  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402

NAME = "crop_decode"
BATCH = w.BATCH
CORES = 2
#: Above this median share of the machine taken by other processes, images/s are not judged
#: (the contenders get unequal shares of a busy machine); CPU per image still is.
NOISY = 0.10


def tree_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and every live descendant."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for c in me.children(recursive=True):
        try:
            ct = c.cpu_times()
            total += ct.user + ct.system + ct.children_user + ct.children_system
        except psutil.Error:
            pass
    return total


def run_epoch(make_iter: Callable[[], Any], count: Callable[[Any], int]) -> dict:
    """One epoch: images/s, CPU ms per image of the tree, the other processes' CPU share."""
    busy0, tot0 = h.machine_busy_ticks()
    cpu0, t0 = tree_cpu_s(), time.perf_counter()
    n = 0
    for b in make_iter():
        n += count(b)
    wall = time.perf_counter() - t0
    cpu = tree_cpu_s() - cpu0
    busy1, tot1 = h.machine_busy_ticks()
    machine_busy_s = (busy1 - busy0) / h.CLK_TCK
    all_cpu_s = (tot1 - tot0) / h.CLK_TCK
    other = max(machine_busy_s - cpu, 0.0) / all_cpu_s if all_cpu_s else 0.0
    return {"images": n, "wall_s": wall, "images_per_s": n / wall, "cpu_ms_per_image": cpu * 1e3 / n,
            "other_cpu_share": other}


def function_cpu_ms(paths: list[str], exact: bool, seed: int) -> float:
    """CPU ms per image of the function alone in this process (torch on one thread): the
    figure a busy machine disturbs least."""
    rng = np.random.default_rng(seed)
    t = time.process_time()
    for p in paths:
        w.load_file_as(p, rng, exact)
    return (time.process_time() - t) * 1e3 / len(paths)


def quality(paths: list[str]) -> dict:
    """PSNR of the window decode against the whole decode on the same crop (the same seed
    per image), over the benchmark's images, and how many took each path."""
    from sbloader.sources import jpeg_window

    jpeg_window.reset_counters()
    psnrs = []
    for i, p in enumerate(paths):
        a = w.T.decode_random_resized_crop(p, w.SIZE, np.random.default_rng(i))
        a = np.asarray(a).astype(np.float64)
        b = w.T.decode_random_resized_crop(p, w.SIZE, np.random.default_rng(i), exact=True)
        b = np.asarray(b)
        mse = float(((a - b) ** 2).mean())
        psnrs.append(99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse))
    arr = np.array(psnrs)
    differ = arr[arr < 99.0]
    return {"mean_psnr_db": float(arr.mean()), "worst_psnr_db": float(arr.min()),
            "mean_psnr_db_of_differing": float(differ.mean()) if len(differ) else None,
            "identical": int((arr == 99.0).sum()), "images": len(paths), "paths": jpeg_window.counters(),
            "note": "identical images count as 99 dB in the mean"}


class Dali:
    """DALI's CPU pipeline, built once; one epoch per call."""

    def __init__(self, paths: list[str]) -> None:
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=BATCH, num_threads=CORES, device_id=None, seed=0)
        def pipe() -> Any:
            jpegs, labels = fn.readers.file(files=paths, labels=[w.label_of(p) for p in paths],
                                            random_shuffle=True, name="r")
            imgs = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                 random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                                 num_attempts=10)
            imgs = fn.resize(imgs, resize_x=w.SIZE, resize_y=w.SIZE, antialias=True)
            imgs = fn.flip(imgs, horizontal=fn.random.coin_flip())
            return fn.transpose(imgs, perm=[2, 0, 1]), labels

        self.pipe = pipe()
        self.pipe.build()
        self.batches = -(-len(paths) // BATCH)
        self.last = len(paths) - (self.batches - 1) * BATCH

    def epoch(self) -> Any:
        for i in range(self.batches):
            imgs, _ = self.pipe.run()
            a = imgs.as_array()
            yield a if i + 1 < self.batches else a[: self.last]


def build(paths: list[str], skip_dali: bool) -> tuple[dict[str, Callable[[], Any]], dict[str, str], list]:
    """The contenders (name -> iterator factory), the skipped ones with why, and what to close."""
    import torch
    from torch.utils.data import DataLoader

    import sbloader

    chunks = [paths[i:i + BATCH] for i in range(0, len(paths), BATCH)]
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(CORES)
    pool.map(w.preprocess_paths_exact, chunks[:CORES])
    pool.map(w.preprocess_paths_window, chunks[:CORES])
    tl = DataLoader(w.ExactImageFolderDataset(paths), batch_size=BATCH, shuffle=True, num_workers=CORES,
                    persistent_workers=True)
    before = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_exact_batch)
              .to_dataloader(BATCH, shuffle=True, seed=0))
    after = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_window_batch)
             .to_dataloader(BATCH, shuffle=True, seed=0))
    contenders: dict[str, Callable[[], Any]] = {
        "Pillow ceiling (whole decode, Pool(2))": lambda: pool.imap_unordered(w.preprocess_paths_exact, chunks),
        "window function, Pool(2)": lambda: pool.imap_unordered(w.preprocess_paths_window, chunks),
        "torch DataLoader(2)": lambda: iter(tl),
        "sbloader before (whole decode)": lambda: iter(before),
        "sbloader after (window decode)": lambda: iter(after),
    }
    skipped: dict[str, str] = {}
    if skip_dali:
        skipped["DALI CPU"] = "--no-dali"
    else:
        try:
            dali = Dali(paths)
            next(iter(dali.epoch()))  # runs: the codec library loads
            dali = Dali(paths)
            contenders["DALI CPU"] = dali.epoch
        except Exception as e:  # not installed, or its codec library missing
            skipped["DALI CPU"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
    torch.set_num_threads(1)
    return contenders, skipped, [pool, tl, before, after]


def count_of(b: Any) -> int:
    """Images in a batch, whatever the loader's shape."""
    if isinstance(b, dict):
        return len(b["image"])
    if isinstance(b, (list, tuple)):
        return len(b[0])
    return len(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--no-dali", action="store_true", help="leave DALI out")
    ap.add_argument("--out", default=NAME)
    args = ap.parse_args()
    from bench_images import make_data

    import sbloader

    paths, _, _ = make_data(Path("/tmp/sbloader_bench_images"), args.images)
    paths = paths[: args.images]
    for p in paths:  # the page cache
        Path(p).read_bytes()
    q = quality(paths)
    print(f"quality: {q}", flush=True)
    sbloader.init(num_cpus=CORES)
    contenders, skipped, _keep = build(paths, args.no_dali)
    for name, make in contenders.items():  # warm-up epoch (start-up, Ray workers, imports)
        run_epoch(make, count_of)
    runs: dict[str, list[dict]] = {k: [] for k in contenders}
    fn_ms: dict[str, list[float]] = {"whole decode": [], "window decode": []}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg())
        for k in (fn_ms if r % 2 == 0 else reversed(list(fn_ms))):
            fn_ms[k].append(function_cpu_ms(paths, k == "whole decode", r))
        print(f"round {r + 1}: function alone: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in fn_ms.items()), flush=True)
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            res = run_epoch(contenders[name], count_of)
            runs[name].append(res)
            print(f"round {r + 1}: {name}: {res['images_per_s']:.0f} images/s, {res['cpu_ms_per_image']:.2f} ms CPU/image, "
                  f"others {100 * res['other_cpu_share']:.0f}%", flush=True)
    report(args, paths, runs, skipped, loads, fn_ms, q)


def report(args: argparse.Namespace, paths: list[str], runs: dict[str, list[dict]], skipped: dict[str, str],
           loads: list, fn_ms: dict[str, list[float]], q: dict) -> None:
    """Write the JSON and the Markdown."""
    ceiling = "Pillow ceiling (whole decode, Pool(2))"
    dali = "DALI CPU"

    def ratio(a: str, b: str, key: str) -> Optional[dict]:
        if a not in runs or b not in runs:
            return None
        return h.summarize([x[key] / y[key] for x, y in zip(runs[a], runs[b])])

    rows = []
    for name, rs in runs.items():
        rate = ratio(name, ceiling, "images_per_s")
        cpu = ratio(name, ceiling, "cpu_ms_per_image")
        rows.append({
            "contender": name,
            "images/s": h.fmt_range(h.summarize([x["images_per_s"] for x in rs]), "{:.0f}"),
            "x ceiling": h.fmt_range(rate, "{:.2f}"),
            "CPU ms/image": h.fmt_range(h.summarize([x["cpu_ms_per_image"] for x in rs]), "{:.2f}"),
            "CPU x ceiling": h.fmt_range(cpu, "{:.2f}"),
            "others' CPU": h.fmt_range(h.summarize([100 * x["other_cpu_share"] for x in rs]), "{:.0f}%"),
        })
    after = "sbloader after (window decode)"
    before = "sbloader before (whole decode)"
    targets = {
        "sbloader after >= 1.15x the Pillow ceiling (images/s)": ratio(after, ceiling, "images_per_s"),
        "sbloader after >= 1.05x DALI CPU (images/s)": ratio(after, dali, "images_per_s"),
        "sbloader after CPU/image <= 0.85x the ceiling's": ratio(after, ceiling, "cpu_ms_per_image"),
        "sbloader after CPU/image / DALI CPU's": ratio(after, dali, "cpu_ms_per_image"),
        "sbloader after / before (images/s)": ratio(after, before, "images_per_s"),
        "sbloader after / before (CPU/image)": ratio(after, before, "cpu_ms_per_image"),
    }
    limits = {"sbloader after >= 1.15x the Pillow ceiling (images/s)": (1.15, True),
              "sbloader after >= 1.05x DALI CPU (images/s)": (1.05, True),
              "sbloader after CPU/image <= 0.85x the ceiling's": (0.85, False)}
    others = h.median([x["other_cpu_share"] for rs in runs.values() for x in rs]) or 0.0
    trows = []
    for k, s in targets.items():
        verdict = "–"
        if s is not None and k in limits:
            lim, above = limits[k]
            verdict = "met" if (s["median"] >= lim if above else s["median"] <= lim) else "NOT met"
            if "images/s" in k and others > NOISY:
                verdict += f" (not judged: other processes took {100 * others:.0f}% of the CPU)"
        trows.append({"target": k, "median (min–max)": h.fmt_range(s, "{:.2f}") if s else "n/a (skipped)",
                      "verdict": verdict})
    md = [
        f"{len(paths)} generated JPEGs (320x240 to 640x480, quality 90), random-resized-crop 224 + flip, "
        f"uint8 CHW, batches of {BATCH}, 2 workers/processes/threads; {args.rounds} interleaved rounds after one "
        "warm-up epoch each; median (min–max). Ratios are taken within each round. CPU = this process tree "
        "(workers, Ray daemons, DALI threads) per image. Others' CPU: share of the machine's CPU taken by other "
        "processes during the run (the machine is shared).",
        "",
        h.markdown_table(rows, ["contender", "images/s", "x ceiling", "CPU ms/image", "CPU x ceiling", "others' CPU"]),
        "",
        h.markdown_table(trows, ["target", "median (min–max)", "verdict"]),
        "",
        "The function alone in this process, torch on one thread (process CPU ms per image, decode + crop + flip + CHW): "
        f"whole decode {h.fmt_range(h.summarize(fn_ms['whole decode']), '{:.3f}')}, window decode "
        f"{h.fmt_range(h.summarize(fn_ms['window decode']), '{:.3f}')}; window / whole in the same round "
        + h.fmt_range(h.summarize([a / b for a, b in zip(fn_ms["window decode"], fn_ms["whole decode"])]), "{:.2f}")
        + ".",
        "",
        f"Quality over the {q['images']} images, the window decode against the whole decode on the same crop: "
        f"mean PSNR {q['mean_psnr_db']:.1f} dB (identical images counted as 99 dB; {q['identical']} identical; "
        f"over the others alone {q['mean_psnr_db_of_differing'] or 0:.1f} dB), "
        f"worst {q['worst_psnr_db']:.1f} dB (targets: mean >= 38, worst >= 32); paths taken: {q['paths']}.",
        "",
        "Load average (1, 5, 15 min) at each round's start: " + "; ".join(
            ", ".join(f"{v:.2f}" for v in la) for la in loads),
    ]
    for k, why in skipped.items():
        md += ["", f"**{k} skipped**: {why}"]
    payload = {"images": len(paths), "rounds": args.rounds, "runs": runs, "skipped": skipped,
               "function_cpu_ms_per_image": fn_ms, "quality": q,
               "loadavg_per_round": loads, "targets": targets}
    h.publish(args.out, payload, "\n".join(md), title="Decode only the crop window: sbloader before/after, "
              "the Pillow ceiling, torch, DALI CPU")


if __name__ == "__main__":
    main()

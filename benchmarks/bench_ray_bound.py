"""How close can a loader built on Ray tasks and its object store come to the ceiling?

The image workload of ``bench_images.py`` (``read_images(decode=False)`` +
decode, random-resized-crop 224, flip; 64 images per partition), measured four
ways side by side, interleaved per round (BENCHMARKING.md):

- ``two processes``: the function alone in N spawned processes, each over its
  share of the files (what the ceiling assumes: N x one process);
- ``in Ray, no store``: N Ray tasks, each looping over its share of the
  partitions through sbloader's own read + map path, keeping nothing (what Ray's
  worker processes cost without any hand-off);
- ``in Ray, put``: the same, each block ``ray.put`` into the object store and held
  (the hand-off's cost in the worker, no scheduling and no consumer);
- ``sbloader``: the real pipeline, ``to_dataloader(64, shuffle=True)``, one epoch
  per round (a new iterator), the consumer only counting;
- ``sbloader, PSS sampled`` / ``sbloader, PSS + store sampled``: the same epoch
  while the benchmark harness samples the process tree's PSS (and Ray's
  object-store stats) every 0.25 s, as ``bench_images.py`` did in its throughput
  runs before 2026-11-22: what that measuring costs the pipeline.

The gap between ``in Ray, put`` and ``two processes`` bounds what any design that
stores blocks in Ray's object store can reach here, whatever its scheduling. Since
the same-node hand-off (``sbloader/_executor/handoff.py``) sbloader's blocks made on
the trainer's node skip the object store, so ``sbloader`` may pass ``in Ray, put``;
what it still pays over ``in Ray, no store`` is task scheduling, the trainer, the
raylet and the copy into the slot (the ``handoff`` scenario compares it with the object
store side by side).

Run: ``python benchmarks/bench_ray_bound.py [--rounds 3] [--quick] [--out NAME]``.
Writes ``benchmarks/results/ray_bound.json`` and ``ray_bound.md``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _harness as h  # noqa: E402

h.ray_worker_env()
import _image_workload as w  # noqa: E402

BATCH = 64


def _proc_loop(paths: list, barrier: Any, q: Any) -> None:
    sys.path.insert(0, str(HERE))
    import _image_workload as wl

    wl.preprocess_paths(paths[:BATCH])  # warm
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(paths), BATCH):
        wl.preprocess_paths(paths[i:i + BATCH])
    q.put((time.perf_counter() - t0, time.process_time() - c0, len(paths)))


def processes(paths: list, n: int) -> dict:
    """The function alone in ``n`` processes side by side: images/s and CPU µs per image."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(n), ctx.Queue()
    chunk = len(paths) // n
    ps = [ctx.Process(target=_proc_loop, args=(paths[k * chunk:(k + 1) * chunk], barrier, q)) for k in range(n)]
    for p in ps:
        p.start()
    res = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return {"images_s": sum(r[2] for r in res) / max(r[0] for r in res),
            "cpu_us": sum(r[1] for r in res) / sum(r[2] for r in res) * 1e6}


def _ray_loop(paths: list, lo: int, hi: int, put: bool) -> tuple:
    import ray

    sys.path.insert(0, str(HERE))
    import _image_workload as wl  # noqa: F401  (the map function's module)
    import sbloader
    from sbloader.executor.tasks import EpochInfo, apply_ops, read_partition

    ds = sbloader.read_images(paths, decode=False).map_batches(wl.sbl_decode_files_batch)
    src, ops = ds._source, ds._ops
    parts = src.partitions(0, 0)
    rs, info = (src.reader(), src.shared()), EpochInfo(0, 123, True)
    block, _ = read_partition(rs, parts[lo], info, "read")  # warm
    apply_ops(ops, block, info, parts[lo].id)
    held, n = [], 0
    t0, c0 = time.perf_counter(), time.process_time()
    for p in parts[lo:hi]:
        block, _ = read_partition(rs, p, info, "read")
        block, _ = apply_ops(ops, block, info, p.id)
        n += len(block["image"])
        if put:
            held.append(ray.put(block))
    return time.perf_counter() - t0, time.process_time() - c0, n


def in_ray(paths: list, n: int, put: bool) -> dict:
    """sbloader's read + map path looped inside ``n`` Ray tasks side by side."""
    import ray

    loop = ray.remote(num_cpus=1)(_ray_loop)
    parts = len(paths) // BATCH
    per = parts // n
    res = ray.get([loop.remote(paths, k * per, (k + 1) * per, put) for k in range(n)])
    return {"images_s": sum(r[2] for r in res) / max(r[0] for r in res),
            "cpu_us": sum(r[1] for r in res) / sum(r[2] for r in res) * 1e6}


def pipeline(loader: Any) -> dict:
    """One epoch of the real pipeline, the consumer only counting."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(len(b["image"]) for b in loader)
    return {"images_s": n / (time.perf_counter() - t0), "trainer_cpu_us": (time.process_time() - c0) / n * 1e6}


def sampled(loader: Any, store: bool) -> dict:
    """One epoch of the pipeline under the harness's PSS (and object-store) sampling every 0.25 s."""
    with h.measure("sampled", object_store=store) as m:
        out = pipeline(loader)
    out["sampler_cpu_s"] = m.result.sampler_cpu_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1,024 images")
    ap.add_argument("--out", default="ray_bound", help="results name under benchmarks/results/")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.images = 2, 1024
    from bench_images import make_data

    import sbloader

    paths, _, _ = make_data(Path("/tmp/sbloader_bench_images"), args.images)
    cores = os.cpu_count() or 2
    sbloader.init()
    loader = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_batch)
              .to_dataloader(BATCH, shuffle=True))
    pipeline(loader)  # warm: workers started, estimates known
    in_ray(paths, cores, False)
    contenders = {
        f"{cores} processes": lambda: processes(paths, cores),
        "in Ray, no store": lambda: in_ray(paths, cores, False),
        "in Ray, put": lambda: in_ray(paths, cores, True),
        "sbloader": lambda: pipeline(loader),
        "sbloader, PSS sampled": lambda: sampled(loader, False),
        "sbloader, PSS + store sampled": lambda: sampled(loader, True),
    }
    runs = h.interleave(contenders, args.rounds, before_round=lambda: h.wait_quiet(timeout_s=10))
    base = runs[f"{cores} processes"]
    rows, summary = [], {}
    for name, rs in runs.items():
        ips = h.summarize([r["images_s"] for r in rs])
        frac = h.summarize([r["images_s"] / b["images_s"] for r, b in zip(rs, base)])
        cpu = h.summarize([r.get("cpu_us") for r in rs])
        summary[name] = {"images_s": ips, "x_processes": frac, "cpu_us": cpu}
        rows.append({"contender": name, "images/s": h.fmt_range(ips, "{:.0f}"),
                     f"x {cores} processes (same round)": h.fmt_range(frac, "{:.2f}"),
                     "CPU µs/image in the loop's processes": h.fmt_range(cpu, "{:.0f}")})
    md = [
        f"{args.images} generated JPEGs, decode + random-resized-crop 224 + flip, {BATCH} per partition; "
        f"{args.rounds} interleaved rounds, median (min–max). `x {cores} processes` divides by the "
        f"`{cores} processes` run of the same round. CPU µs/image counts only the looping processes "
        "(not the raylet, not the trainer; `–` for the pipeline, whose CPU by process `images.md` reports). "
        "The sampled rows run the pipeline while the harness reads the tree's PSS (and Ray's store stats) "
        "every 0.25 s.",
        "",
        h.markdown_table(rows),
    ]
    h.write_results(args.out, {"rounds": args.rounds, "images": args.images, "summary": summary, "raw": runs},
                    "\n".join(md), title="Ray's bound: the function alone, inside Ray workers, and the pipeline")
    print("\n".join(md))


if __name__ == "__main__":
    main()

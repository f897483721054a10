"""Executor overhead: sbloader's streaming executor against the function alone.

Workload: ``sbloader.from_items(range(N))`` -> ``map_batches(cpu_bound)`` ->
``iter_batches(64)``, where ``cpu_bound`` spends ~1 ms of single-threaded NumPy
per row and returns a 3x128x128 uint8 image per row (48 KiB), like a decode +
augment step. Contenders, interleaved per round (BENCHMARKING.md):

- ``single``: the function alone in this process, 64 rows per call;
- ``pool2``: ``multiprocessing.Pool(nproc).imap`` over 64-row chunks (spawned and
  warmed before the timing, closed after);
- ``sbloader``: the pipeline with default partitions (a new iterator per round);
- ``sbloader-64``: the same with 64-row partitions (one block per batch: shows the
  per-block overhead).

The ceiling is ``single``'s rows/s x nproc, taken in the same round; every
contender is reported as a fraction of it. Also measured: the embedded Ray's
start-up and first (cold) epoch, and its idle footprint (PSS summed over all Ray
processes, the process count, CPU % over ~10 s) right after start-up and after a
pipeline ran.

Run: ``python benchmarks/bench_executor.py [--quick]``. Writes
``benchmarks/results/executor.json`` and ``executor.md``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

BATCH = 64
SIDE = 128
RAY_CLASSES = ("workers", "raylet", "gcs", "ray_daemons", "other")


def cpu_bound(batch: dict, iters: int = 36) -> dict:
    """~1 ms of single-threaded NumPy per row; returns one 3x128x128 uint8 image per row."""
    ids = batch["item"]
    out = np.empty((len(ids), 3, SIDE, SIDE), np.uint8)
    for i, seed in enumerate(ids):
        x = np.random.default_rng(int(seed)).random(3 * SIDE * SIDE, dtype=np.float32)
        for _ in range(iters):
            np.sin(x, out=x)
            x *= 3.0
        out[i] = (x.reshape(3, SIDE, SIDE) * 40 + 128).astype(np.uint8)
    return {"image": out}


def _chunk(ids: np.ndarray) -> dict:
    return cpu_bound({"item": ids})


# ----- contenders -----------------------------------------------------------

def run_single(ids: np.ndarray) -> h.Result:
    with h.measure("single", tree=h.ProcTree(ray=False)) as m:
        batches = (cpu_bound({"item": ids[s:s + BATCH]}) for s in range(0, len(ids), BATCH))
        for out in m.watch(batches):
            m.add_items(len(out["image"]))
    return m.result


def run_pool(ids: np.ndarray, processes: int) -> h.Result:
    """``Pool.imap`` over 64-row chunks; the pool is started (spawn) and warmed outside the timing."""
    chunks = [ids[s:s + BATCH] for s in range(0, len(ids), BATCH)]
    with mp.get_context("spawn").Pool(processes) as pool:  # no fork of a process running Ray's threads
        pool.map(_chunk, [ids[:2]] * processes)
        with h.measure("pool", tree=h.ProcTree(ray=False)) as m:
            for out in m.watch(lambda: pool.imap(_chunk, chunks)):
                m.add_items(len(out["image"]))
    return m.result


def run_sbloader(label: str, make_ds: Callable[[], Any], object_store: bool = True) -> h.Result:
    ds = make_ds()
    with h.measure(label, object_store=object_store) as m:
        for b in m.watch(lambda: ds.iter_batches(BATCH)):
            m.add_items(len(b["image"]))
    st = ds.stats()
    if st is not None:
        m.result.extra["executor"] = {
            "first_block_s": st.first_block_s,
            "wall_s": st.wall_s,
            "stall_s": st.stall_s,
            "peak_held_bytes": st.peak_held_bytes,
            "memory_budget": st.memory_budget,
            "blocks": [o.blocks for o in st.operators],
            "task_s": [round(o.task_s, 3) for o in st.operators],
        }
    return m.result


def idle_footprint(seconds: float) -> dict[str, Any]:
    """PSS and processes of Ray (the trainer excluded) and CPU % over ``seconds`` idle."""
    snap = h.snapshot(keep=lambda pid: pid == os.getpid() or h.is_ray_process(pid))
    with h.measure("idle", interval_s=1.0) as m:
        time.sleep(seconds)
    r = m.result
    ray_cpu = sum(v for k, v in r.cpu_s_by_class.items() if k != "trainer")
    ray = {k: v for k, v in snap["by_class"].items() if k != "trainer"}
    return {
        "seconds": round(r.wall_s, 2),
        "ray_pss_bytes": sum(v["pss_bytes"] for v in ray.values()),
        "ray_processes": sum(v["processes"] for v in ray.values()),
        "trainer_pss_bytes": snap["by_class"].get("trainer", {}).get("pss_bytes", 0),
        "by_class": snap["by_class"],
        "processes": snap["processes_detail"],
        "ray_cpu_pct_of_one_core": round(100 * ray_cpu / r.wall_s, 2),
        "cpu_s_by_class": r.cpu_s_by_class,
        "outside_cpu_frac": r.outside_cpu_frac,
    }


# ----- report -----------------------------------------------------------------

def _per_row_us(res: list[h.Result], cls: str) -> dict:
    return h.summarize([r.cpu_s_by_class.get(cls, 0.0) / r.items * 1e6 for r in res if r.items])


def report(args: argparse.Namespace, cores: int, startup: dict, runs: dict[str, list[h.Result]],
           idle: dict[str, dict]) -> tuple[dict, str]:
    single = runs["single"]
    ceiling = [r.items_per_s * cores for r in single]
    summary = {}
    rows = []
    for name, res in runs.items():
        frac = h.summarize([r.items_per_s / c for r, c in zip(res, ceiling)])
        s = {
            "rows_per_s": h.summarize([r.items_per_s for r in res]),
            "fraction_of_ceiling": frac,
            "first_batch_s": h.summarize([r.first_item_s for r in res]),
            "peak_pss_bytes": h.summarize([r.peak_pss_bytes for r in res]),
            "peak_object_store_bytes": h.summarize([r.peak_object_store_bytes for r in res]),
            "outside_cpu_frac": h.summarize([r.outside_cpu_frac for r in res]),
            "cpu_us_per_row": {c: _per_row_us(res, c) for c in h.CLASSES},
        }
        summary[name] = s
        cpu = s["cpu_us_per_row"]
        rows.append({
            "contender": name,
            "rows/s": h.fmt_range(s["rows_per_s"], "{:.0f}"),
            "x ceiling": h.fmt_range(frac, "{:.2f}"),
            "first batch ms": h.fmt_range(s["first_batch_s"], "{:.0f}", 1e3),
            "peak PSS MiB": h.fmt_range(s["peak_pss_bytes"], "{:.0f}", 2**-20),
            "peak store MiB": h.fmt_range(s["peak_object_store_bytes"], "{:.0f}", 2**-20),
            "CPU µs/row trainer": h.fmt_range(cpu["trainer"], "{:.0f}"),
            "workers": h.fmt_range(cpu["workers"], "{:.0f}"),
            "raylet": h.fmt_range(cpu["raylet"], "{:.0f}"),
            "gcs": h.fmt_range(cpu["gcs"], "{:.0f}"),
            "daemons": h.fmt_range(cpu["ray_daemons"], "{:.0f}"),
            "outside CPU %": h.fmt_range(s["outside_cpu_frac"], "{:.1f}", 100),
        })
    ceil_s = h.summarize(ceiling)
    noisy = {n: v["outside_cpu_frac"]["median"] for n, v in summary.items() if v["outside_cpu_frac"]["median"] > 0.05}
    warn = ([f"**Disturbed run:** other processes took more than 5% of the CPU (median) during "
             f"{', '.join(f'{n} ({100 * f:.0f}%)' for n, f in noisy.items())}; trust the ratios "
             "taken side by side over the absolute rates.", ""] if noisy else [])
    md = [
        f"Workload: `from_items(range({args.rows}))` -> `map_batches(cpu_bound)` -> `iter_batches({BATCH})`; "
        f"`cpu_bound` = ~1 ms of single-threaded NumPy per row, one 3x{SIDE}x{SIDE} uint8 image (48 KiB) out. "
        f"{args.rounds} interleaved rounds (single, pool{cores}, sbloader, sbloader-64), median (min–max); "
        f"each round waits (up to 10 s) for a quiet machine and is re-run once (neither with --quick) when processes outside the tree took >5% of the CPU; the attempt with the fewest disturbed runs is kept.",
        "",
        *warn,
        f"**Ceiling** = single-process rows/s x {cores} cores = {h.fmt_range(ceil_s, '{:.0f}')} rows/s "
        f"({h.fmt_range(h.summarize([1e3 / r.items_per_s for r in single]), '{:.2f}')} ms of CPU per row).",
        "",
        h.markdown_table(rows),
        "",
        "- `sbloader`: default partitions; `sbloader-64`: `rows_per_partition=64` (one block per batch). "
        "A new iterator per round; the embedded Ray stays up between rounds, as in training.",
        "- CPU µs/row by process class from /proc/<pid>/stat deltas; `trainer` is this process "
        "(the samplers' own CPU taken out), `workers` are Ray workers or the Pool's processes.",
        "- PSS is summed over the process tree. For `single`/`pool` the embedded Ray (idle meanwhile) is "
        "left out of the tree, so its idle CPU counts as outside CPU there.",
        "",
        "## Start-up (first epoch after `sbloader.init()`)",
        "",
        f"- `sbloader.init()`: {startup['init_s']:.2f} s; first epoch (default partitions): first batch "
        f"{startup['cold'].first_item_s:.2f} s after creating the iterator, "
        f"{startup['cold'].items_per_s:.0f} rows/s over the epoch.",
        "",
        "## Embedded Ray at idle",
        "",
        h.markdown_table([
            {"when": k, "Ray PSS MiB": h.mib(v["ray_pss_bytes"]), "Ray processes": v["ray_processes"],
             "Ray CPU % of a core": v["ray_cpu_pct_of_one_core"], "seconds": v["seconds"],
             "trainer PSS MiB": h.mib(v["trainer_pss_bytes"]),
             "outside CPU %": f"{100 * v['outside_cpu_frac']:.1f}"}
            for k, v in idle.items()
        ], ["when", "Ray PSS MiB", "Ray processes", "Ray CPU % of a core", "seconds", "trainer PSS MiB",
            "outside CPU %"]),
        "",
        "Ray processes after the pipeline ran:",
        "",
        h.markdown_table(
            [{"class": p["class"], "PSS MiB": p["pss_mib"], "process": p["cmd"][:60]}
             for p in idle["after a pipeline"]["processes"] if p["class"] != "trainer"],
            ["class", "PSS MiB", "process"]),
    ]
    payload = {
        "args": vars(args),
        "ceiling_rows_per_s": ceil_s,
        "summary": summary,
        "startup": {"init_s": startup["init_s"], "cold_epoch": startup["cold"].as_dict()},
        "idle": idle,
        "runs": {k: [r.as_dict() for r in v] for k, v in runs.items()},
    }
    return payload, "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: under a minute")
    p.add_argument("--rows", type=int, default=None, help="rows per epoch (default 6000; quick 1200)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=None, help="idle window (default 10; quick 3)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray")
    p.add_argument("--out", default="executor", help="results name under benchmarks/results/")
    args = p.parse_args()
    args.rows = args.rows or (1200 if args.quick else 6000)
    args.idle_s = args.idle_s or (3.0 if args.quick else 10.0)
    cores = len(os.sched_getaffinity(0))
    ids = np.arange(args.rows, dtype=np.int64)
    machine = h.machine_info()
    import torch  # noqa: F401  - a trainer has it imported: not part of any timing here

    import sbloader

    t = time.perf_counter()
    sbloader.init(num_cpus=args.num_cpus)
    init_s = time.perf_counter() - t
    time.sleep(2.0)  # let the prestarted workers finish starting
    idle = {"after start-up": idle_footprint(args.idle_s)}
    print(f"init {init_s:.2f}s; idle Ray {h.mib(idle['after start-up']['ray_pss_bytes'])} MiB "
          f"in {idle['after start-up']['ray_processes']} processes", flush=True)

    items = ids.tolist()
    make_default = lambda: sbloader.from_items(items).map_batches(cpu_bound)  # noqa: E731
    make_64 = lambda: sbloader.from_items(items, rows_per_partition=BATCH).map_batches(cpu_bound)  # noqa: E731
    cold = run_sbloader("sbloader-cold", make_default)
    print(f"cold epoch: first batch {cold.first_item_s:.2f}s, {cold.items_per_s:.0f} rows/s", flush=True)

    contenders = {
        "single": lambda: run_single(ids),
        f"pool{cores}": lambda: run_pool(ids, cores),
        "sbloader": lambda: run_sbloader("sbloader", make_default),
        "sbloader-64": lambda: run_sbloader("sbloader-64", make_64),
    }
    runs = h.interleave(
        contenders, args.rounds, accept=h.quiet, max_retries=0 if args.quick else 1,
        before_round=None if args.quick else (lambda: h.wait_quiet(timeout_s=10.0)),
        on_result=lambda n, r, res: print(
            f"round {r}: {n:12s} {res.items_per_s:8.0f} rows/s  first {1e3 * res.first_item_s:6.0f} ms  "
            f"outside CPU {100 * res.outside_cpu_frac:4.1f}%", flush=True),
    )
    time.sleep(1.0)
    idle["after a pipeline"] = idle_footprint(args.idle_s)

    payload, md = report(args, cores, {"init_s": init_s, "cold": cold}, runs, idle)
    payload["machine"] = machine
    h.publish(args.out, payload, md, title="sbloader executor vs the function alone")


if __name__ == "__main__":
    main()

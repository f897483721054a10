"""Memory as the dataset grows (issue #7 item 3): streaming against a bulk baseline.

Workload: ``sbloader.range(rows, rows_per_partition=64).map_batches(make_rows)``,
where ``make_rows`` returns 32 KiB of uint8 per row: one 2 MiB block per 64-row
partition, cheap to make (a fill), so the producer outruns the consumer and only
the executor's budget holds it back. The consumer takes batches of 64 rows,
touches every one (a strided sum) and sleeps 5 ms per batch (a step slower than
the producer). Dataset sizes: 1x, 4x, 16x = 50, 200, 800 MiB of produced blocks
(32, 128, 512 MiB with ``--quick``); then, full runs only, one more child runs the
64 MiB-budget stream alone over 3,200 MiB (a check that its small growth stops).

Contenders (a fresh child process with its own embedded Ray, 2 CPUs and a 2 GiB
object store, per round and size; the five run in turn in it):

- ``streaming (budget 16 MiB)`` and ``streaming (budget 64 MiB)``:
  ``ds.to_dataloader(64, memory_budget=...)``;
- ``bulk: list of batches``: ``batches = list(ds.to_dataloader(64,
  memory_budget=64 MiB))``, then consume them (materialised in the trainer);
- ``streaming (default budget)``: ``ds.to_dataloader(64)`` with no budget: the
  default, a quarter of the object store (512 MiB here);
- ``bulk: all blocks in the object store``: the same executor with a budget of the
  whole store; every block's ref is taken first (the whole stage materialised in
  the store, as ``ray.get`` of all blocks would), then each block is fetched,
  consumed and released.

Measured (``_harness.measure``): peak object-store bytes from Ray's own
accounting (the raylet's store stats, sampled every 0.1 s) and peak PSS summed
over the whole process tree (trainer, raylet, GCS, daemons, workers; the store's
shared pages count in the processes that map them), sampled every 0.1 s. The store's shared pages stay resident
once touched, so the order in a child runs from the smallest expected
store footprint to the largest (above), and every size gets a fresh child.

Run: ``python benchmarks/bench_memory.py [--quick]``. Writes
``benchmarks/results/memory.json``, ``memory.md`` and ``memory.png``.
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

# glibc raises its mmap threshold after a large block is freed, after which freed
# batches stay in the heap and the trainer's PSS would carry one contender's peak
# into the next: fix the threshold (set before the process starts; re-exec below).
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _gitstate  # noqa: E402
import _harness as h  # noqa: E402

h.ray_worker_env()  # Ray workers import make_rows from this module (by reference, not by value)

NAME = "memory"
BATCH = 64
ROW_BYTES = 32 * 1024
BLOCK_BYTES = BATCH * ROW_BYTES  # 2 MiB
STORE_BYTES = 2 * 2**30
BUDGET_BYTES = 64 * 2**20
SMALL_BUDGET_BYTES = 16 * 2**20
CONSUME_S = 0.005
LONG_CONTENDER = "streaming-64MiB"
CONTENDERS = ("streaming-16MiB", "streaming-64MiB", "bulk-list", "streaming-default", "bulk-store")
DISPLAY = {
    "streaming-16MiB": "streaming (budget 16 MiB)",
    "streaming-64MiB": "streaming (budget 64 MiB)",
    "bulk-list": "bulk: list of batches, then consume",
    "streaming-default": "streaming (default budget = store/4)",
    "bulk-store": "bulk: all blocks in the object store, then consume",
}


def make_rows(batch: dict) -> dict:
    """32 KiB of uint8 per row (a fill with the row's id)."""
    ids = batch["id"]
    x = np.empty((len(ids), ROW_BYTES), np.uint8)
    x[:] = (ids % 251).astype(np.uint8)[:, None]
    return {"x": x}


def touch(x: Any) -> int:
    """Read every row (a strided sum over the batch)."""
    return int(x[:, ::4096].sum())


def consume(x: Any) -> None:
    touch(x)
    time.sleep(CONSUME_S)


# ----- contenders (in the child) ---------------------------------------------------------

def make_ds(rows: int) -> Any:
    import bench_memory  # this file as a module: the workers import make_rows from it

    import sbloader

    return sbloader.range(rows, rows_per_partition=BATCH).map_batches(bench_memory.make_rows)


def run_contender(name: str, rows: int) -> h.Result:
    import ray

    ds = make_ds(rows)
    extra: dict[str, Any] = {}
    with h.measure(name, object_store=True, interval_s=0.1, store_interval_s=0.1) as m:
        if name.startswith("streaming"):
            budget = {"streaming-16MiB": SMALL_BUDGET_BYTES, "streaming-64MiB": BUDGET_BYTES}.get(name)
            loader = ds.to_dataloader(BATCH, memory_budget=budget)
            for b in m.watch(lambda: iter(loader)):
                consume(b["x"])
                m.add_items(len(b["x"]))
            st = loader.stats()
        elif name == "bulk-list":
            loader = ds.to_dataloader(BATCH, memory_budget=BUDGET_BYTES)
            batches = list(loader)
            m.mark_first()
            extra["materialised_s"] = time.perf_counter() - m._t0
            for b in batches:
                consume(b["x"])
                m.add_items(len(b["x"]))
            del batches, b
            st = loader.stats()
        else:  # bulk-store
            ex = ds.execute(memory_budget=STORE_BYTES, prefetch_blocks=1)
            items = []
            while True:
                it = ex.get_next()
                if it is None:
                    break
                items.append(it)
            m.mark_first()
            extra["materialised_s"] = time.perf_counter() - m._t0
            for it in items:
                block = ray.get(it.ref)
                consume(block["x"])
                m.add_items(len(block["x"]))
                del block
                ex.release(it.meta.nbytes)
            st = ex.stats()
            ex.shutdown()
            del items
    if st is not None:
        extra.update(peak_held_bytes=st.peak_held_bytes, memory_budget=st.memory_budget)
    m.result.extra.update(extra)
    return m.result


def child(rows: int, conn: Any, names: tuple = CONTENDERS) -> None:
    """One size: a fresh embedded Ray, the contenders in turn, results back over the pipe."""
    try:
        import torch

        torch.set_num_threads(1)
        import sbloader

        sbloader.init(num_cpus=2, object_store_memory=STORE_BYTES)
        # workers started, functions shipped, the tensor path warm: not measured
        for b in make_ds(BATCH * 8).to_dataloader(BATCH, memory_budget=BUDGET_BYTES):
            consume(b["x"])
        del b
        time.sleep(1.0)
        out = {"idle": h.snapshot()["pss_bytes"], "runs": {}}
        for name in names:
            gc.collect()
            time.sleep(0.5)  # releases reach the raylet
            out["runs"][name] = run_contender(name, rows).as_dict()
        conn.send(out)
    except BaseException:
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


def run_size(rows: int, timeout_s: float = 300.0, names: tuple = CONTENDERS) -> dict:
    ctx = mp.get_context("spawn")
    parent, c = ctx.Pipe()
    p = ctx.Process(target=child, args=(rows, c, names), name="bench-memory-child")
    p.start()
    c.close()
    if not parent.poll(timeout_s):
        p.kill()  # the child we started (its embedded Ray stops with it: the raylet watches its driver)
        p.join()
        raise RuntimeError(f"child for {rows} rows timed out")
    msg = parent.recv()
    p.join(60)
    if "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


# ----- report --------------------------------------------------------------------------

def default_store_bytes() -> Optional[int]:
    """The object store an embedded Ray would get here by default (Ray's own rule: 30% of the
    available memory, capped by /dev/shm), from MemAvailable now."""
    try:
        from ray._private.utils import resolve_object_store_memory

        avail = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
        return int(resolve_object_store_memory(avail))
    except Exception:
        return None


def report(args: argparse.Namespace, sizes: list[int], runs: dict, idle: dict,
           long: Optional[dict]) -> tuple[dict, str]:
    summary: dict[str, Any] = {}
    rows = []
    for name in CONTENDERS:
        summary[name] = {}
        for mib in sizes:
            res = runs[(name, mib)]
            s = {
                "peak_object_store_bytes": h.summarize([r["peak_object_store_bytes"] for r in res]),
                "peak_pss_bytes": h.summarize([r["peak_pss_bytes"] for r in res]),
                "peak_pss_trainer_bytes": h.summarize([r["peak_pss_by_class"].get("trainer", 0) for r in res]),
                "peak_pss_ray_bytes": h.summarize([r["peak_pss_bytes"] - r["peak_pss_by_class"].get("trainer", 0)
                                                   for r in res]),
                "peak_held_bytes": h.summarize([r["extra"].get("peak_held_bytes") for r in res]),
                "rows_per_s": h.summarize([r["items_per_s"] for r in res]),
                "wall_s": h.summarize([r["wall_s"] for r in res]),
                "outside_cpu_frac": h.summarize([r["outside_cpu_frac"] for r in res]),
            }
            summary[name][mib] = s
            rows.append({
                "contender": DISPLAY[name], "dataset MiB": mib,
                "peak store MiB": h.fmt_range(s["peak_object_store_bytes"], "{:.0f}", 2**-20),
                "peak PSS MiB (tree)": h.fmt_range(s["peak_pss_bytes"], "{:.0f}", 2**-20),
                "of which trainer": h.fmt_range(s["peak_pss_trainer_bytes"], "{:.0f}", 2**-20),
                "Ray's processes": h.fmt_range(s["peak_pss_ray_bytes"], "{:.0f}", 2**-20),
                "executor's peak held MiB": h.fmt_range(s["peak_held_bytes"], "{:.0f}", 2**-20),
                "MiB/s": h.fmt_range(s["rows_per_s"], "{:.0f}", ROW_BYTES / 2**20),
                "outside CPU %": h.fmt_range(s["outside_cpu_frac"], "{:.0f}", 100),
            })
    lo, hi = sizes[0], sizes[-1]
    mid = sizes[1] if len(sizes) > 2 else lo

    def slope(name: str, key: str, a_size: int) -> dict:
        """MiB of peak memory per MiB of dataset, from ``a_size`` to the largest size (per round)."""
        return h.summarize([(b[key] - a[key]) / ((hi - a_size) * 2**20)
                            for a, b in zip(runs[(name, a_size)], runs[(name, hi)])])

    targets = []
    budgets = {"streaming-16MiB": SMALL_BUDGET_BYTES, "streaming-64MiB": BUDGET_BYTES}
    for name in ("streaming-16MiB", "streaming-64MiB", "streaming-default"):
        for key, what in (("peak_object_store_bytes", "peak store"), ("peak_pss_bytes", "peak PSS")):
            g, g_all = slope(name, key, mid), slope(name, key, lo)
            ok = g["median"] is not None and g["median"] <= 0.05
            targets.append({"target": f"{DISPLAY[name]}: {what} flat from {mid} to {hi} MiB "
                                      "(grows ≤ 0.05 MiB per MiB of dataset)",
                            "figure": f"{h.fmt_range(g, '{:.3f}')} MiB/MiB (from {lo} MiB: "
                                      f"{h.fmt_range(g_all, '{:.3f}')})",
                            "verdict": "**pass**" if ok else "**FAIL**"})
        if name in budgets:
            top = h.summarize([r["peak_object_store_bytes"] for s in sizes for r in runs[(name, s)]])
            targets.append({"target": f"{DISPLAY[name]}: peak store ≤ the budget at every size",
                            "figure": f"max {top['max'] / 2**20:.1f} MiB (budget {budgets[name] // 2**20} MiB)",
                            "verdict": "**pass**" if top["max"] <= budgets[name] else "**FAIL**"})
    for name, key, what in (("bulk-store", "peak_object_store_bytes", "peak store"),
                            ("bulk-store", "peak_pss_bytes", "peak PSS"),
                            ("bulk-list", "peak_pss_bytes", "peak PSS")):
        g = slope(name, key, lo)
        ok = g["median"] is not None and g["median"] >= 0.5
        targets.append({"target": f"{DISPLAY[name]}: {what} grows with the dataset (≥ 0.5 MiB per MiB, "
                                  f"{lo} to {hi} MiB)",
                        "figure": f"{h.fmt_range(g, '{:.3f}')} MiB/MiB", "verdict": "**yes**" if ok else "no"})
    md = [
        f"Workload: `sbloader.range(rows, rows_per_partition={BATCH}).map_batches(make_rows)`, 32 KiB of uint8 per "
        f"row (a fill), so one {BLOCK_BYTES // 2**20} MiB block per partition; the consumer takes batches of {BATCH} rows, "
        f"touches each (strided sum) and sleeps {1e3 * CONSUME_S:.0f} ms per batch, slower than the producer, so the "
        f"budget is what holds the pipeline back. Sizes {', '.join(str(s) for s in sizes)} MiB of produced blocks. "
        f"{args.rounds} round(s); per round and size a fresh child process with its own embedded Ray (2 CPUs, "
        f"{STORE_BYTES // 2**30} GiB object store) runs the five contenders in turn; median (min–max) over rounds.",
        "",
        "## Targets",
        "",
        h.markdown_table(targets, ["target", "figure", "verdict"]),
        "",
        "## Figures",
        "",
        h.markdown_table(rows),
        "",
        "- Peak store = Ray's own accounting of the object store's used bytes (the raylet's store stats), sampled every "
        "0.1 s; peak PSS = summed over the whole process tree (trainer, raylet, GCS, Ray daemons, workers), sampled "
        "every 0.1 s (at the peak: the trainer, and Ray's processes, whose PSS carries the object store's shared "
        "pages). Store pages stay resident once touched, after their objects are freed, so each size gets a "
        "fresh Ray and the contenders run in order of their expected store footprint.",
        f"- Flat = the peak grows by at most 0.05 MiB per MiB of dataset from {mid} to {hi} MiB, sizes above every "
        f"explicit budget (at {lo} MiB a pipeline with a budget larger than the dataset holds at most the dataset; "
        "the slope from there is shown too). The idle Ray and the trainer's own ~0.6 GiB are in every PSS figure, "
        "so a ratio of peaks says little; a bulk contender grows ~1 MiB per MiB.",
        f"- Idle child before the first contender (embedded Ray, workers started): PSS "
        f"{h.fmt_range(h.summarize(list(idle.values())), '{:.0f}', 2**-20)} MiB.",
        f"- `streaming (default budget)`: `to_dataloader()` with no `memory_budget` gets a quarter of the object store "
        f"({STORE_BYTES // 4 // 2**20} MiB with the {STORE_BYTES // 2**30} GiB store set here; with the store an embedded "
        f"Ray gets by default on this machine now, ~{(default_store_bytes() or 0) / 2**30:.1f} GiB, the default budget "
        f"would be ~{(default_store_bytes() or 0) / 4 / 2**30:.1f} GiB, more than the largest dataset here); "
        "the executor also keeps at most `prefetch_blocks` + 2 x its task slots blocks ahead of the consumer "
        "(`blocks_ahead_cap`), so a producer faster than the consumer does not fill that budget: flat at every size.",
        "- Throughput at the largest size: " + ", ".join(
            f"{DISPLAY[n]} {h.fmt_range(summary[n][hi]['rows_per_s'], '{:.0f}', ROW_BYTES / 2**20)} MiB/s"
            for n in ("streaming-16MiB", "streaming-64MiB", "streaming-default"))
        + f". The consumer alone could take {BLOCK_BYTES / 2**20 / CONSUME_S:.0f} MiB/s. The executor counts a released "
        "block against the budget for another 0.25 s (`_FREE_LAG_S`, while the raylet frees it), so a budget B caps "
        "the pipeline at B / 0.25 s whatever the consumer does: 64 MiB/s for 16 MiB, 256 MiB/s for 64 MiB.",
        "- `bulk: list of batches` keeps the store small (streamed with the 64 MiB budget) and grows the trainer; "
        "`bulk: all blocks in the object store` grows the store. Trainer processes run with "
        "`MALLOC_MMAP_THRESHOLD_=131072` so that freed batches return to the OS between contenders.",
    ]
    if long is not None:
        r = long["runs"][LONG_CONTENDER]
        ref = runs[(LONG_CONTENDER, hi)]
        md += [
            "",
            f"## A longer dataset: {args.long_mib} MiB, {DISPLAY[LONG_CONTENDER]} only (one run)",
            "",
            f"Does the streaming pipeline's small PSS growth with the dataset keep going? One more child runs "
            f"{DISPLAY[LONG_CONTENDER]} over {args.long_mib} MiB ({args.long_mib // (BLOCK_BYTES // 2**20)} blocks): "
            f"peak store {h.mib(r['peak_object_store_bytes'])} MiB, peak PSS {h.mib(r['peak_pss_bytes'])} MiB "
            f"(trainer {h.mib(r['peak_pss_by_class'].get('trainer', 0))} MiB), {r['wall_s']:.1f} s, outside CPU "
            f"{100 * r['outside_cpu_frac']:.0f}%; at {hi} MiB the median was "
            f"{h.mib(statistics.median(x['peak_pss_bytes'] for x in ref))} MiB: "
            f"{(r['peak_pss_bytes'] - statistics.median(x['peak_pss_bytes'] for x in ref)) / ((args.long_mib - hi) * 2**20):.3f} "
            "MiB of PSS per MiB of dataset beyond it.",
        ]
    payload = {"args": vars(args), "sizes_mib": sizes, "long": long, "summary": {k: {str(m): v for m, v in d.items()}
                                                                   for k, d in summary.items()},
               "targets": targets, "idle_pss_bytes": idle,
               "runs": {f"{k[0]}@{k[1]}": v for k, v in runs.items()}}
    return payload, "\n".join(md)


def plot(sizes: list[int], summary: dict, path: Path, long: Optional[dict] = None,
         long_mib: int = 0, idle_bytes: Optional[float] = None) -> Optional[Path]:
    plt = h.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"streaming-16MiB": "o-", "streaming-64MiB": "D-", "streaming-default": "s-", "bulk-store": "^--", "bulk-list": "v--"}
    for ax, key, title in ((axes[0], "peak_object_store_bytes", "peak object-store bytes (Ray's accounting)"),
                           (axes[1], "peak_pss_bytes", "peak PSS, whole process tree")):
        for name in CONTENDERS:
            med = [summary[name][s][key]["median"] / 2**20 for s in sizes]
            lo = [summary[name][s][key]["min"] / 2**20 for s in sizes]
            hi = [summary[name][s][key]["max"] / 2**20 for s in sizes]
            ax.errorbar(sizes, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                        fmt=styles[name], capsize=3, label=DISPLAY[name])
        xs = sizes
        if long is not None:
            ax.plot([long_mib], [long["runs"][LONG_CONTENDER][key] / 2**20], "*", ms=11, color="C1",
                    label=f"{DISPLAY[LONG_CONTENDER]}, {long_mib} MiB (one run)")
            xs = sizes + [long_mib]
        if key == "peak_object_store_bytes":
            ax.plot(xs, xs, color="grey", lw=1, ls=":", label="dataset size")
            ax.set_yscale("log", base=2)
        elif idle_bytes:
            ax.plot(xs, [idle_bytes / 2**20 + x for x in xs], color="grey", lw=1, ls=":",
                    label="idle child's PSS + dataset size")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(s) for s in xs])
        ax.set_xlabel("dataset: MiB of produced blocks")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("sbloader: streaming vs bulk as the dataset grows (2 cores, 2 GiB object store)")
    return h.save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="32, 128, 512 MiB, 1 round (about 2 minutes)")
    p.add_argument("--sizes", default=None, help="dataset sizes in MiB (default 50,200,800; quick 32,128,512)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 1)")
    p.add_argument("--quiet-timeout", type=float, default=None, help="wait for a quiet machine, s (default 10; quick 3)")
    p.add_argument("--long-mib", type=int, default=None,
                   help="one more size for the 64 MiB-budget stream only (default 3200; quick 0 = none)")
    p.add_argument("--out", default=NAME)
    args = p.parse_args()
    args.sizes = args.sizes or ("32,128,512" if args.quick else "50,200,800")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.long_mib = args.long_mib if args.long_mib is not None else (0 if args.quick else 3200)
    args.quiet_timeout = args.quiet_timeout if args.quiet_timeout is not None else (3.0 if args.quick else 10.0)
    sizes = [int(s) for s in args.sizes.split(",")]
    machine = h.machine_info()
    git_state = _gitstate.git_state()
    t0 = time.monotonic()
    runs: dict[tuple[str, int], list[dict]] = {(n, s): [] for n in CONTENDERS for s in sizes}
    idle: dict[str, int] = {}
    long = None
    for rnd in range(args.rounds):
        for mib in sizes:
            busy = h.wait_quiet(timeout_s=args.quiet_timeout)
            rows = mib * 2**20 // ROW_BYTES
            got = run_size(rows)
            idle[f"{rnd}@{mib}"] = got["idle"]
            for name, r in got["runs"].items():
                r["extra"]["busy_before"] = busy
                runs[(name, mib)].append(r)
                print(f"round {rnd} {mib:4d} MiB {name:18s} store {h.mib(r['peak_object_store_bytes']):>5} MiB  "
                      f"PSS {h.mib(r['peak_pss_bytes']):>5} MiB  {r['wall_s']:5.1f}s  "
                      f"outside CPU {100 * r['outside_cpu_frac']:3.0f}%", flush=True)
    if args.long_mib:
        h.wait_quiet(timeout_s=args.quiet_timeout)
        long = run_size(args.long_mib * 2**20 // ROW_BYTES, names=(LONG_CONTENDER,))
        r = long["runs"][LONG_CONTENDER]
        print(f"long {args.long_mib} MiB {LONG_CONTENDER}: store {h.mib(r['peak_object_store_bytes'])} MiB  "
              f"PSS {h.mib(r['peak_pss_bytes'])} MiB  {r['wall_s']:.1f}s", flush=True)
    payload, md = report(args, sizes, runs, idle, long)
    payload["machine"] = machine
    payload["total_wall_s"] = time.monotonic() - t0
    payload["git"] = git_state
    png = plot(sizes, {k: {int(m): v for m, v in d.items()} for k, d in payload["summary"].items()},
               h.RESULTS_DIR / f"{args.out}.png", long, args.long_mib,
               h.median(idle.values()))
    h.publish(args.out, payload, md, title="Memory as the dataset grows: streaming vs bulk", png=png, alt="memory")


if __name__ == "__main__":
    if any(os.environ.get(k) != v for k, v in _MALLOC_ENV.items()):
        os.environ.update(_MALLOC_ENV)
        os.execv(sys.executable, [sys.executable] + sys.argv)
    main()

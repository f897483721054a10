"""What the same-node shared-memory hand-off saves: sbloader with and without it, side by side.

The image workload of ``bench_images.py`` (decode + random-resized-crop 224 + flip,
batches of 64, the consumer only counting, so the CPU is free), run by sbloader's
native pipeline (``read_images(decode=False)`` + decode, ``to_dataloader``) and by
its drop-in ``DataLoader`` (persistent workers), each with the final blocks handed
over through the consumer's shared-memory slots (the default) and through Ray's
object store (``SBLOADER_SLOT_HANDOFF=0``), interleaved per round (BENCHMARKING.md),
plus the function alone in N processes for scale. The pipeline's rounds run first,
then the drop-in's (its persistent workers hold every CPU while it lives). One epoch
per run, a new iterator each time, after a warm epoch of each loader.

CPU µs/image is split by process class (trainer, Ray workers, raylet, GCS, other Ray
daemons) from the harness's CPU-tick sampling (no PSS during these runs).

Run: ``python benchmarks/bench_handoff.py [--rounds 5] [--quick] [--out NAME]``.
Writes ``benchmarks/results/handoff.json`` and ``handoff.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _harness as h  # noqa: E402

h.ray_worker_env()
import _image_workload as w  # noqa: E402

BATCH = 64
CLASSES = ("trainer", "workers", "raylet", "gcs", "ray_daemons")


def epoch(loader: Any, images: Callable[[Any], Any], slots: bool, label: str) -> h.Result:
    """One epoch of ``loader`` with the hand-off on or off, measured (CPU ticks only)."""
    os.environ["SBLOADER_SLOT_HANDOFF"] = "1" if slots else "0"  # read when the epoch's executor starts
    with h.measure(label, pss=False) as m:
        for b in m.watch(lambda: iter(loader)):
            m.add_items(len(images(b)))
    from sbloader.executor.handoff import consumer_arena

    stats = loader.stats() if hasattr(loader, "stats") else loader.stats()
    m.result.extra["slot_blocks"] = stats.slot_blocks
    arena = consumer_arena()
    m.result.extra["slots_touched"] = arena.touched if arena is not None else 0
    return m.result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1,024 images")
    ap.add_argument("--out", default="handoff", help="results name under benchmarks/results/")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.images = 2, 1024
    from bench_images import make_data
    from bench_ray_bound import processes

    import sbloader

    paths, _, _ = make_data(Path("/tmp/sbloader_bench_images"), args.images)
    cores = os.cpu_count() or 2
    sbloader.init()
    pipe = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_batch)
            .to_dataloader(BATCH, shuffle=True))
    procs = f"{cores} processes"
    runs: dict[str, list] = {}
    base: dict[str, list] = {}
    # Two phases, each interleaved on its own: the drop-in's persistent workers hold
    # every CPU, so the pipeline's tasks could not run while that loader lives.
    for phase in ("pipeline", "drop-in"):
        if phase == "pipeline":
            loader, images = pipe, (lambda b: b["image"])
        else:
            loader = sbloader.DataLoader(w.ImageFolderDataset(paths), batch_size=BATCH, shuffle=True,
                                         num_workers=cores, persistent_workers=True)
            images = (lambda b: b[0])
        contenders: dict[str, Callable[[], Any]] = {
            procs: lambda: processes(paths, cores),
            f"{phase}, slots": lambda ld=loader, im=images, p=phase: epoch(ld, im, True, f"{p}, slots"),
            f"{phase}, object store": lambda ld=loader, im=images, p=phase: epoch(ld, im, False, f"{p}, object store"),
        }
        for name, fn in contenders.items():  # warm: workers started, block sizes known, slots' pages touched
            if name != procs:
                fn()
        got = h.interleave(contenders, args.rounds, before_round=lambda: h.wait_quiet(timeout_s=10))
        base[phase] = [r["images_s"] for r in got.pop(procs)]
        runs.update(got)
    rows, summary = [], {"processes_images_s": {k: h.summarize(v) for k, v in base.items()}}
    for name, rs in runs.items():
        kind = name.split(",")[0]
        slots, store = f"{kind}, slots", f"{kind}, object store"
        ips = [r.items_per_s for r in rs]
        cpu = {c: h.summarize([r.cpu_s_by_class.get(c, 0.0) / r.items * 1e6 for r in rs]) for c in CLASSES}
        gain = (h.summarize([a.items_per_s / b.items_per_s for a, b in zip(rs, runs[store])])
                if name == slots else None)
        summary[name] = {"images_s": h.summarize(ips),
                         "x_processes": h.summarize([a / b for a, b in zip(ips, base[kind])]),
                         "slots_over_store": gain, "cpu_us": cpu,
                         "slot_blocks": [r.extra["slot_blocks"] for r in rs],
                         "slots_touched": [r.extra["slots_touched"] for r in rs],
                         "outside_cpu_frac": [r.outside_cpu_frac for r in rs]}
        row = {"contender": name, "images/s": h.fmt_range(summary[name]["images_s"], "{:.0f}"),
               f"x {cores} processes (same round)": h.fmt_range(summary[name]["x_processes"], "{:.2f}"),
               "slots / object store (same round)": h.fmt_range(gain, "{:.3f}") if gain else "–"}
        for c in CLASSES:
            row[f"{c} CPU µs/image"] = h.fmt_range(cpu[c], "{:.0f}")
        row["blocks from slots"] = f"{min(summary[name]['slot_blocks'])}–{max(summary[name]['slot_blocks'])}"
        row["slots touched"] = f"{max(summary[name]['slots_touched'])}" if gain else "–"
        rows.append(row)
    md = [
        f"{args.images} generated JPEGs, decode + random-resized-crop 224 + flip, batches of {BATCH}, the consumer "
        f"only counting (CPU free); {args.rounds} interleaved rounds after a warm epoch of each loader, median "
        f"(min–max). The pipeline's rounds run first, then the drop-in's (its persistent workers hold every "
        f"CPU). `x {cores} processes` divides by the function alone in {cores} processes in the same round "
        f"({', '.join(k + ' phase ' + h.fmt_range(v, '{:.0f}') for k, v in summary['processes_images_s'].items())} "
        "images/s). `slots` hands each final block over "
        "in the consumer's shared-memory slots; `object store` is the same loader with "
        "`SBLOADER_SLOT_HANDOFF=0`. CPU by process class from CPU-tick sampling. `slots touched` = the "
        "process's slots lent at least once by then (their pages are memory the process keeps; both "
        "loaders share the one arena).",
        "",
        h.markdown_table(rows),
    ]
    h.write_results(args.out, {"rounds": args.rounds, "images": args.images, "summary": summary,
                               "raw": {k: [r.as_dict() for r in v] for k, v in runs.items()},
                               "processes": base},
                    "\n".join(md), title="The shared-memory hand-off: sbloader with and without it")
    print("\n".join(md))


if __name__ == "__main__":
    main()

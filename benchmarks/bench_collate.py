"""Where the drop-in's workers stack a batch: private memory against torch's shared memory.

torch's ``default_collate``, run under ``get_worker_info()`` (as in torch's worker
processes, and in sbloader's drop-in actors, which set it), stacks every tensor of a
batch into a fresh shared-memory segment, for torch's pipe to the main process. The
drop-in's batches leave their actor by a copy into a slot or Ray's object store
anyway, so its actors stack in private memory (``sbloader/_loader_worker.py``). This
runs the image workload of ``bench_images.py`` (decode + random-resized-crop 224 +
flip, batches of 64, the consumer only counting) through two drop-in loaders that
differ only in that: the default, and one whose ``collate_fn`` stacks as torch's
workers do (``_image_workload.shm_stacking_collate``), interleaved per round after a
warm epoch of each. Both loaders keep their actors (``persistent_workers=True``); the
embedded Ray declares 2x the cores as logical CPUs so both pools exist, and only one
loader runs at a time.

Run: ``python benchmarks/bench_collate.py [--rounds 8] [--out NAME]``.
Writes ``benchmarks/results/collate.json`` and ``collate.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _harness as h  # noqa: E402

h.ray_worker_env()
import _image_workload as w  # noqa: E402

BATCH = 64
CLASSES = ("trainer", "workers", "raylet")


def epoch(loader: Any, label: str) -> h.Result:
    """One epoch of ``loader``, measured (CPU ticks only)."""
    with h.measure(label, pss=False) as m:
        for b in m.watch(lambda: iter(loader)):
            m.add_items(len(b[0]))
    return m.result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--out", default="collate", help="results name under benchmarks/results/")
    args = ap.parse_args()
    from bench_images import make_data

    import sbloader

    paths, _, _ = make_data(Path("/tmp/sbloader_bench_images"), args.images)
    cores = os.cpu_count() or 2
    sbloader.init(num_cpus=2 * cores)
    loaders = {
        "drop-in (private stacking)": sbloader.DataLoader(
            w.ImageFolderDataset(paths), batch_size=BATCH, shuffle=True, num_workers=cores, persistent_workers=True),
        "drop-in, torch's shared-memory stacking": sbloader.DataLoader(
            w.ImageFolderDataset(paths), batch_size=BATCH, shuffle=True, num_workers=cores, persistent_workers=True,
            collate_fn=w.shm_stacking_collate),
    }
    contenders = {name: (lambda ld=ld, n=name: epoch(ld, n)) for name, ld in loaders.items()}
    for fn in contenders.values():  # warm: actors started
        fn()
    runs = h.interleave(contenders, args.rounds, before_round=lambda: h.wait_quiet(timeout_s=10))
    ref, other = list(runs)
    gain = h.summarize([a.items_per_s / b.items_per_s for a, b in zip(runs[ref], runs[other])])
    summary: dict[str, Any] = {"private_over_shared": gain}
    rows = []
    for name, rs in runs.items():
        cpu = {c: h.summarize([r.cpu_s_by_class.get(c, 0.0) / r.items * 1e6 for r in rs]) for c in CLASSES}
        summary[name] = {"images_s": h.summarize([r.items_per_s for r in rs]), "cpu_us": cpu,
                         "outside_cpu_frac": [r.outside_cpu_frac for r in rs]}
        row = {"loader": name, "images/s": h.fmt_range(summary[name]["images_s"], "{:.0f}")}
        row.update({f"{c} CPU µs/image": h.fmt_range(cpu[c], "{:.0f}") for c in CLASSES})
        rows.append(row)
    md = [
        f"{args.images} generated JPEGs, decode + random-resized-crop 224 + flip, batches of {BATCH}, the consumer "
        f"only counting; {cores} persistent workers per loader; {args.rounds} interleaved rounds after a warm "
        f"epoch of each, median (min–max). **Private stacking / torch's shared-memory stacking, same round: "
        f"{h.fmt_range(gain, '{:.3f}')}.** CPU by process class from CPU-tick sampling.",
        "",
        h.markdown_table(rows),
    ]
    h.write_results(args.out, {"rounds": args.rounds, "images": args.images, "summary": summary,
                               "raw": {k: [r.as_dict() for r in v] for k, v in runs.items()}},
                    "\n".join(md), title="Drop-in workers: where a batch is stacked")
    print("\n".join(md))


if __name__ == "__main__":
    main()

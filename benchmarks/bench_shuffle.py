"""What shuffle=True that mixes the whole dataset costs (issue #17): before and after, side by side.

The image workload of ``bench_images.py`` (JPEG decode, random-resized-crop 224,
flip, batches of 64; 2,048 generated JPEGs of 320x240 to 640x480, and the same
images in Parquet files of 128 rows in row groups of 64), through the two native
pipelines with ``shuffle=True``, the CPU free (the consumer only counts), in one
process and one embedded Ray, interleaved (A B B A ...: the order's bias cancels):

- folder, before: each partition the same run of 64 files of the sorted listing
  every epoch, only their order and rows shuffled (what ``shuffle=True`` did up to
  ``ddd17a3``; here a subclass of ``ImageSource`` that ignores the epoch's draw);
- folder, after: ``read_images(folder, decode=False).map_batches(decode_crop_flip)
  .to_dataloader(64, shuffle=True)``: each partition's files drawn from the epoch seed;
- parquet, before: ``shuffle_window=1`` (batches cut from one row group at a time:
  the old behaviour, the same code otherwise);
- parquet, after: the default ``shuffle_window`` (8 row groups per batch).

The folder is listed sorted, class by class, as a user's ImageFolder (so the mixing
shows: distinct labels per batch against torch's ``DataLoader(shuffle=True)``);
the Parquet rows have label ``i % 10``, so each row group mixes labels already (the
label-sorted case is in ``tests/test_shuffle.py``).

Also the Parquet read amplification at the default window: the bytes the
pipeline's Ray workers read from files during an epoch (``rchar`` in
``/proc/<pid>/io``) over the bytes of the Parquet files, and the rows its read
stage produced over the dataset's rows. The same ``rchar`` ratio for the folder
epoch (every file read once) shows what the meter counts besides the data.

A cross-version run (two processes, each its own Ray and sbloader checkout) gave
the same verdicts but ±15% noise on this machine; one process is what this
script measures.

Run: ``python benchmarks/bench_shuffle.py [--rounds 10] [--quick]``.
Writes ``benchmarks/results/shuffle.json`` and ``shuffle.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402

h.ray_worker_env()
import _image_workload as w  # noqa: E402

NAME = "shuffle"
BATCH = 64
CONTENDERS = ("folder/before", "folder/after", "parquet/before", "parquet/after")


def _worker_rchar(root_pid: int) -> int:
    """``rchar`` summed over the processes below ``root_pid`` (bytes their read() calls returned)."""
    total = 0
    for pid in h.descendants([root_pid]) - {root_pid}:
        try:
            with open(f"/proc/{pid}/io") as f:
                for line in f:
                    if line.startswith("rchar:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def make_loaders(folder: str, parquet: str) -> dict[str, Any]:
    """The four contenders' loaders."""
    import sbloader
    from sbloader.sources.images import ImageSource

    class FixedRuns(ImageSource):
        """``read_images`` as before the mixing shuffle: partitions never drawn from the epoch seed."""

        def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list:
            return super().partitions(epoch, epoch_seed, False)

    def folder_loader(fixed: bool) -> Any:
        ds = sbloader.read_images(folder, decode=False)
        if fixed:
            ds.source.__class__ = FixedRuns
        return ds.map_batches(w.sbl_decode_files_batch).to_dataloader(BATCH, shuffle=True)

    def parquet_loader(window: int | None) -> Any:
        ds = sbloader.read_parquet(parquet, columns=["image", "label"]).map_batches(w.sbl_decode_batch)
        return ds.to_dataloader(BATCH, shuffle=True, shuffle_window=window)

    return {"folder/before": folder_loader(True), "folder/after": folder_loader(False),
            "parquet/before": parquet_loader(1), "parquet/after": parquet_loader(None)}


def run_epoch(loader: Any) -> dict:
    """One epoch (a new iterator): images/s, the first batch's wait, labels per batch, bytes read."""
    import numpy as np

    io0 = _worker_rchar(os.getpid())
    b0 = h.machine_busy_ticks()
    t0 = time.perf_counter()
    first, images, labels = None, 0, []
    for b in loader:
        if first is None:
            first = time.perf_counter() - t0
        images += len(b["image"])
        labels.append(len(set(np.asarray(b["label"]).tolist())))
    wall = time.perf_counter() - t0
    b1 = h.machine_busy_ticks()
    st = loader.stats()
    return {"images": images, "wall_s": wall, "first_s": first, "images_per_s": images / wall,
            "distinct_labels": float(np.mean(labels)), "rchar": _worker_rchar(os.getpid()) - io0,
            "read_rows": st.operators[0].rows if st is not None else None,
            "machine_busy_frac": round((b1[0] - b0[0]) / max(1, b1[1] - b0[1]), 4)}


def torch_distinct(labels: list[int], epochs: int = 3) -> float:
    """Mean distinct labels per batch of torch's ``DataLoader(shuffle=True)`` over ``labels``."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(labels, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    return float(np.mean([len(set(b.tolist())) for _ in range(epochs) for b in loader]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="512 images, 3 rounds")
    args = ap.parse_args()
    from bench_images import make_data  # the same generated data as bench_images

    import pyarrow.parquet as pq

    import sbloader

    n = 512 if args.quick else 2048
    rounds = 3 if args.quick else args.rounds
    data_root = HERE / "results" / "tmp" / "images"
    paths, parquet, files = make_data(data_root, n)
    folder = str(data_root / "jpeg")  # listed sorted: class by class, as a user's ImageFolder
    bytes_of = {"folder": sum(os.path.getsize(p) for p in paths), "parquet": sum(os.path.getsize(f) for f in files)}
    sbloader.init()
    loaders = make_loaders(folder, parquet)
    runs: dict[str, list] = {c: [] for c in CONTENDERS}
    first: dict[str, dict] = {}
    for r in range(rounds + 1):  # round 0: each loader's first epoch, kept apart
        for pipeline in ("folder", "parquet"):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for version in order:
                name = f"{pipeline}/{version}"
                busy = h.wait_quiet()
                res = run_epoch(loaders[name])
                res["machine_busy_before"] = round(busy, 4)
                if r:
                    runs[name].append(res)
                else:
                    first[name] = res
                print(f"round {r} {name:15s} {res['images_per_s']:7.1f} images/s, labels/batch "
                      f"{res['distinct_labels']:.2f}, rchar/bytes {res['rchar'] / bytes_of[pipeline]:.3f}", flush=True)
    labels = {"folder": [w.label_of(p) for p in paths],
              "parquet": [int(x) for f in files for x in pq.read_table(f, columns=["label"])["label"].to_pylist()]}
    summary: dict[str, Any] = {}
    rows = []
    for pipeline in ("folder", "parquet"):
        before, after = runs[f"{pipeline}/before"], runs[f"{pipeline}/after"]
        s = {v: {k: h.summarize([x[k] for x in rs]) for k in ("images_per_s", "distinct_labels", "first_s")}
             for v, rs in (("before", before), ("after", after))}
        s["after_over_before"] = h.summarize([a["images_per_s"] / b["images_per_s"] for a, b in zip(after, before)])
        s["rchar_over_data_bytes"] = h.summarize([x["rchar"] / bytes_of[pipeline] for x in after])
        s["read_rows_over_rows"] = h.summarize([x["read_rows"] / n for x in after if x["read_rows"] is not None])
        s["torch_distinct_labels"] = torch_distinct(labels[pipeline])
        summary[pipeline] = s
        rows.append({"pipeline": pipeline,
                     "before images/s": h.fmt_range(s["before"]["images_per_s"], "{:.0f}"),
                     "after images/s": h.fmt_range(s["after"]["images_per_s"], "{:.0f}"),
                     "after / before (paired)": h.fmt_range(s["after_over_before"], "{:.3f}"),
                     "labels/batch before": h.fmt_range(s["before"]["distinct_labels"], "{:.2f}"),
                     "after": h.fmt_range(s["after"]["distinct_labels"], "{:.2f}"),
                     "torch": f"{s['torch_distinct_labels']:.2f}",
                     "first batch s before / after": f"{h.fmt_range(s['before']['first_s'], '{:.2f}')} / "
                                                    f"{h.fmt_range(s['after']['first_s'], '{:.2f}')}",
                     "bytes read / data bytes": h.fmt_range(s["rchar_over_data_bytes"], "{:.3f}"),
                     "rows read / rows": h.fmt_range(s["read_rows_over_rows"], "{:.3f}")})
    payload = {"images": n, "rounds": rounds, "data_bytes": bytes_of, "summary": summary,
               "first_epochs": first, "runs": runs}
    md = [f"{n} images, {rounds} rounds of the four contenders interleaved (A B B A), CPU free, one process and "
          "one embedded Ray. Medians (min–max); `after / before` pairs the two runs of each round.", "",
          h.markdown_table(rows)]
    h.write_results(NAME, payload, "\n".join(md) + "\n", title="shuffle=True that mixes: before and after")


if __name__ == "__main__":
    main()

"""Read + decode throughput from WebDataset shards: sbloader, webdataset's WebLoader, Ray Data, and the
same images from a folder (issue #21).

Workload: generated img2dataset-style shards (``sbloader.datagen.write_webdataset_shards``:
``00000.tar`` ... with ``<key>.jpg`` (256x256, img2dataset's default size), ``.txt``,
``.json`` per sample), and the same JPEGs written one file per image into a folder.
Each contender reads one epoch, decoding every JPEG to an ``HxWx3`` ``uint8`` array
and the caption to a str, in batches of 64; the consumer only counts. Contenders,
interleaved in each round (A B C ... A B C ...), a fresh iterator each epoch (its
start-up included):

- ``sbloader wds``: ``sbloader.read_webdataset(shards).iter_batches(64)`` (partitions of
  64 samples, the default, decoded in the read tasks); ``sbloader wds 256``: partitions
  of 256 samples (``samples_per_partition=256``).
- ``webdataset WebLoader``: ``wds.WebLoader(wds.WebDataset(shards).decode("rgb8")
  .to_tuple("jpg", "txt").batched(64), num_workers=2, batch_size=None)`` (webdataset's
  own loader: torch's DataLoader over worker processes, shards split between workers).
- ``Ray Data wds``: ``ray.data.read_webdataset(shards)`` (its default decoder: Pillow to
  NumPy) ``.iter_batches(batch_size=64)``.
- ``sbloader folder``: ``sbloader.read_images(folder).iter_batches(64)`` (same JPEGs).
- ``torch folder``: torch's ``DataLoader(num_workers=2)`` over the files, Pillow decode.

The ceiling: decoding the same JPEGs alone in this process (Pillow, as webdataset's
``rgb8``), per core, times the 2 cores. One embedded Ray (``sbloader.init(num_cpus=2)``)
serves sbloader and Ray Data; it idles during the other contenders. Machine load
(``os.getloadavg``) and the CPU other processes took during each run are recorded.

Run: ``python benchmarks/bench_webdataset.py [--images 2048] [--rounds 3]`` (under
``flock /tmp/sbloader_bench.lock``). Writes ``benchmarks/results/webdataset.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _harness as h  # noqa: E402

BATCH = 64
SIDE = 256


def write_data(root: Path, n: int, per_shard: int) -> tuple[list[str], list[str]]:
    """The shards and the folder of the same JPEGs (kept between runs under ``root``)."""
    import tarfile

    from sbloader.datagen import write_webdataset_shards

    shards = write_webdataset_shards(str(root / f"shards-{n}-{per_shard}"), n, samples_per_shard=per_shard,
                                     min_size=(SIDE, SIDE), max_size=(SIDE, SIDE))
    folder = root / f"folder-{n}-{per_shard}"
    if not folder.exists():
        tmp = root / f".tmp-folder-{os.getpid()}"
        tmp.mkdir(parents=True)
        for shard in shards:
            with tarfile.open(shard) as tf:
                for m in tf.getmembers():
                    if m.name.endswith((".jpg", ".txt")):
                        (tmp / m.name).write_bytes(tf.extractfile(m).read())
        tmp.rename(folder)
    files = sorted(str(p) for p in folder.glob("*.jpg"))
    assert len(files) == n
    return shards, files


def _pil_rgb(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


class FolderDataset:
    """torch's map-style dataset over the folder: (image HxWx3 uint8, caption)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple:
        path = self.files[i]
        with open(path, "rb") as f:
            img = _pil_rgb(f.read())
        with open(path[:-4] + ".txt", encoding="utf-8") as f:
            return img, f.read()


def contenders(shards: list[str], files: list[str]) -> dict[str, Callable[[], Iterator[int]]]:
    """name -> a factory of an epoch's iterator of batch sizes."""
    import ray.data
    import torch.utils.data
    import webdataset as wds

    import sbloader

    def sbl_wds() -> Iterator[int]:
        for b in sbloader.read_webdataset(shards).iter_batches(BATCH):
            assert b["jpg"].shape[1:] == (SIDE, SIDE, 3)
            yield len(b["jpg"])

    def sbl_wds_256() -> Iterator[int]:
        for b in sbloader.read_webdataset(shards, samples_per_partition=256).iter_batches(BATCH):
            yield len(b["jpg"])

    def sbl_folder() -> Iterator[int]:
        for b in sbloader.read_images(files).iter_batches(BATCH):
            yield len(b["image"])

    def wds_loader() -> Iterator[int]:
        ds = wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode("rgb8").to_tuple("jpg", "txt") \
            .batched(BATCH, partial=True)
        for images, _ in wds.WebLoader(ds, batch_size=None, num_workers=2):
            yield len(images)

    def raydata_wds() -> Iterator[int]:
        for b in ray.data.read_webdataset(shards).iter_batches(batch_size=BATCH):
            yield len(b["jpg"])

    def torch_folder() -> Iterator[int]:
        dl = torch.utils.data.DataLoader(FolderDataset(files), batch_size=BATCH, num_workers=2)
        for images, _ in dl:
            yield len(images)

    return {"sbloader wds": sbl_wds, "sbloader wds 256": sbl_wds_256, "webdataset WebLoader": wds_loader,
            "Ray Data wds": raydata_wds,
            "sbloader folder": sbl_folder, "torch folder": torch_folder}


def run_epoch(name: str, make: Callable[[], Iterator[int]], n: int) -> dict:
    """One epoch: images/s over the whole epoch (start-up included) and time to the first batch."""
    load = os.getloadavg()
    with h.measure(name, pss=False) as m:
        for k in m.watch(make):
            m.add_items(k)
    r = m.result
    if r.items != n:
        raise RuntimeError(f"{name} read {r.items} images of {n}")
    return {"images_per_s": r.items_per_s, "first_batch_s": r.first_item_s, "wall_s": r.wall_s,
            "cpu_s_by_class": r.cpu_s_by_class, "outside_cpu_frac": r.outside_cpu_frac,
            "machine_cpu_frac": r.machine_cpu_frac, "loadavg_1m_before": load[0]}


def ceiling(files: list[str]) -> dict:
    """Decode alone (Pillow to RGB, as webdataset's ``rgb8``), per core, times the cores (2)."""
    datas = [Path(f).read_bytes() for f in files[:256]]
    ms = h.cpu_ms_per_item(lambda xs: [_pil_rgb(d) for d in xs], datas, batch=32, batches=6)
    return {"decode_cpu_ms_per_image": ms, "cores": 2, "ceiling_images_per_s": 2 * 1000.0 / ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--per-shard", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "sbloader_bench_wds"))
    ap.add_argument("--out", default="webdataset")
    args = ap.parse_args()
    h.ray_worker_env()
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    shards, files = write_data(Path(args.data), args.images, args.per_shard)
    import ray.data

    import sbloader

    sbloader.init(num_cpus=2)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    cal = [ceiling(files)]
    makers = contenders(shards, files)
    for name, make in makers.items():  # warm: page cache, imports, Ray's worker pool
        run_epoch(name, make, args.images)
    runs = h.interleave({name: (lambda nm=name, mk=make: run_epoch(nm, mk, args.images))
                         for name, make in makers.items()}, args.rounds,
                        before_round=lambda: cal.append(ceiling(files)) or h.wait_quiet(timeout_s=10),
                        on_result=lambda nm, r, res: print(f"round {r} {nm}: {res['images_per_s']:.0f} images/s",
                                                           flush=True))
    sbloader.shutdown()
    ceil = h.median(c["ceiling_images_per_s"] for c in cal)
    base = runs["webdataset WebLoader"]
    rows, summary = [], {}
    for name, rs in runs.items():
        ips = h.summarize([r["images_per_s"] for r in rs])
        ratio = h.summarize([r["images_per_s"] / b["images_per_s"] for r, b in zip(rs, base)])
        first = h.summarize([r["first_batch_s"] for r in rs])
        outside = h.summarize([r["outside_cpu_frac"] for r in rs])
        # CPU per image of every process of ours (trainer, workers, Ray): less sensitive to
        # other processes than the wall time is
        cpu = h.summarize([1e3 * sum(r["cpu_s_by_class"].values()) / args.images for r in rs])
        summary[name] = {"images_per_s": ips, "vs_webloader": ratio, "first_batch_s": first, "cpu_ms_per_image": cpu,
                         "of_ceiling": ips["median"] / ceil, "outside_cpu_frac": outside}
        rows.append({"contender": name, "images/s": h.fmt_range(ips, "{:.0f}"),
                     "x WebLoader (same round)": h.fmt_range(ratio, "{:.2f}"),
                     "of the ceiling": f"{ips['median'] / ceil:.2f}",
                     "first batch s": h.fmt_range(first, "{:.2f}"),
                     "CPU ms per image (ours)": h.fmt_range(cpu, "{:.2f}"),
                     "other processes' CPU": h.fmt_range(outside, "{:.0%}")})
    loads = [r["loadavg_1m_before"] for rs in runs.values() for r in rs]
    md = [
        f"One epoch of {args.images} generated img2dataset-style samples ({SIDE}x{SIDE} JPEG + caption + json; "
        f"{len(shards)} shards of {args.per_shard}), read and decoded to `HxWx3 uint8` + str, batches of {BATCH}, "
        f"consumer idle; a fresh iterator per epoch (start-up included). {args.rounds} interleaved rounds after "
        "one warm-up epoch each; median (min-max). `x WebLoader` is the ratio to webdataset's own WebLoader "
        "(num_workers=2) in the same round. Ceiling: Pillow decode alone "
        f"{h.median(c['decode_cpu_ms_per_image'] for c in cal):.2f} ms of CPU per image, x 2 cores = "
        f"{ceil:.0f} images/s. One embedded Ray (2 CPUs) serves sbloader and Ray Data.",
        "",
        h.markdown_table(rows),
        "",
        f"Machine load (1-min load average before each run): median {h.median(loads):.1f}, "
        f"min {min(loads):.1f}, max {max(loads):.1f} on {os.cpu_count()} cores: the machine was shared; "
        "`other processes' CPU` is the share of the machine's CPU that processes outside the benchmark took "
        "during each run. Ratios from the same round are the figures to read; `CPU ms per image` (every "
        "process of the benchmark's tree: trainer, DataLoader workers, Ray's workers and daemons) depends "
        "less on the others' load than the wall time does.",
    ]
    h.publish(args.out, {"args": vars(args), "ceiling": cal, "summary": summary, "runs": runs},
              "\n".join(md), title="WebDataset shards: read + decode throughput (sbloader, webdataset, Ray Data)")


if __name__ == "__main__":
    main()

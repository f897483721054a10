"""The main job (for now): a streaming pipeline over generated JPEGs on the embedded Ray.

Decodes, random-resized-crops to 224 and flips every image on Ray workers, streams
batches of 64 into this process under a memory budget, and prints throughput and
per-operator statistics.

    python3 trainers/pipeline_demo.py [--images 1000] [--epochs 2]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

import sbloader
from sbloader.datagen import write_jpeg_folder
from sbloader.transforms import random_flip, random_resized_crop, to_chw


def augment(batch: dict) -> dict:
    """Random-resized-crop to 224, random flip, CHW uint8; seeded per partition."""
    rng = sbloader.get_context().rng
    from PIL import Image

    out = [to_chw(random_flip(np.asarray(random_resized_crop(Image.fromarray(img), 224, rng)), rng))
           for img in batch["image"]]
    return {"image": np.stack(out), "label": np.array([int(os.path.basename(os.path.dirname(p))[6:]) for p in batch["path"]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "sbloader-demo-jpegs"))
    args = parser.parse_args()

    print(f"generating {args.images} JPEGs in {args.data} ...", flush=True)
    write_jpeg_folder(args.data, args.images)
    sbloader.init()
    ds = sbloader.read_images(args.data).map_batches(augment)
    loader = ds.to_dataloader(batch_size=args.batch_size, shuffle=True, memory_budget=256 * 2**20)
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        n = 0
        first = None
        for batch in loader:
            if first is None:
                first = time.perf_counter() - t0
            n += len(batch["label"])
        dt = time.perf_counter() - t0
        print(f"epoch {epoch}: {n} images in {dt:.2f}s = {n / dt:.0f} images/s, first batch after {first:.2f}s")
        print(loader.stats())
    sbloader.shutdown()


if __name__ == "__main__":
    main()

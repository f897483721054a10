"""One side of the ``shuffle_window`` scenario: a process that imports whichever sbloader
``PYTHONPATH`` names (the tree before issue #39, or this one), starts its embedded Ray
once, and runs one shuffled epoch of a label-sorted Parquet file of images per request.

Requests and replies are JSON lines on stdin/stdout: ``{"seed", "window", "budget"}`` ->
images/s, distinct labels per full batch, time to the first batch, the executor's
counted peak of object-store bytes, its budget, and the ``stats()`` shuffle line.
Not a scenario (leading underscore); run by ``shuffle_window.py``.
"""
from __future__ import annotations

import io
import json
import sys
import time

import numpy as np


def decode(batch: dict) -> dict:
    """JPEG bytes -> 64x64 RGB ``uint8`` (Pillow), the label kept."""
    from PIL import Image

    out = np.empty((len(batch["image"]), 64, 64, 3), np.uint8)
    for i, data in enumerate(batch["image"]):
        img = Image.open(io.BytesIO(data))
        img.draft("RGB", (64, 64))
        out[i] = np.asarray(img.convert("RGB").resize((64, 64)))
    return {"image": out, "label": np.asarray(batch["label"])}


def epoch(sbloader, path: str, req: dict) -> dict:
    """One shuffled epoch (a new loader, as a user iterates it) and what it measured."""
    kw = {} if req.get("window") is None else {"shuffle_window": req["window"]}
    if req.get("budget"):
        kw["memory_budget"] = int(req["budget"])
    loader = (sbloader.read_parquet(path, columns=["image", "label"]).map_batches(decode)
              .to_dataloader(64, shuffle=True, seed=int(req["seed"]), **kw))
    t0 = time.perf_counter()
    first, images, labels = None, 0, []
    for b in loader:
        if first is None:
            first = time.perf_counter() - t0
        lab = np.asarray(b["label"])
        images += len(lab)
        if len(lab) == 64:
            labels.append(len(np.unique(lab)))
    wall = time.perf_counter() - t0
    st = loader.stats()
    return {"images_per_s": images / wall, "labels_per_batch": float(np.mean(labels)), "first_batch_s": first,
            "peak_held_mib": st.peak_held_bytes / 2**20, "budget_mib": st.memory_budget / 2**20,
            "images": images, "note": getattr(st, "shuffle_note", "")}


def main() -> None:
    import warnings

    warnings.simplefilter("ignore")  # the narrowed-window warning goes to stats() here
    import sbloader

    path = sys.argv[1]
    sbloader.init()
    print(json.dumps({"ready": sbloader.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            reply = epoch(sbloader, path, req)
        except Exception as e:  # noqa: BLE001 - the scenario records it
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    sbloader.shutdown()


if __name__ == "__main__":
    main()

"""The JPEG workload of ``bench_split.py`` and ``bench_scaleout.py``.

Per image: read the file, JPEG decode, random-resized-crop to 224x224, random
flip, uint8 CHW (``sbloader.transforms.decode_crop_flip``); batches of 64; the
images are ``sbloader.datagen.write_jpeg_folder``'s (ImageFolder layout, the
label is the class folder's number). Importable by Ray's workers (the benchmarks
put this folder on ``PYTHONPATH``).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

SIZE = 224
BATCH = 64

_RNGS: dict[int, np.random.Generator] = {}


def process_rng() -> np.random.Generator:
    """One generator per process."""
    pid = os.getpid()
    rng = _RNGS.get(pid)
    if rng is None:
        rng = _RNGS[pid] = np.random.default_rng([pid, int.from_bytes(os.urandom(4), "little")])
    return rng


def label_of(path: str) -> int:
    """The class index of ``.../class_007/0000123.jpg``."""
    return int(os.path.basename(os.path.dirname(str(path))).rsplit("_", 1)[1])


def load_file(path: str, rng: np.random.Generator) -> np.ndarray:
    """Read one JPEG and augment it: ``3x224x224`` uint8."""
    from sbloader.transforms import decode_crop_flip

    with open(path, "rb") as f:
        data = f.read()
    return decode_crop_flip(data, SIZE, rng)


def preprocess_paths(paths: Sequence[str]) -> dict[str, np.ndarray]:
    """The function alone (the ceiling): one batch, stacked images and labels."""
    rng = process_rng()
    return {"image": np.stack([load_file(p, rng) for p in paths]),
            "label": np.array([label_of(p) for p in paths], dtype=np.int64)}


class ImageFolderDataset:
    """A map-style Dataset as users write one: ``(image tensor, label)`` per index."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        p = self.paths[i]
        return torch.from_numpy(load_file(p, process_rng())), label_of(p)


def sbl_crop_flip_batch(batch: dict) -> dict:
    """``sbloader.read_images(paths).map_batches(this)``: crop and flip the decoded images."""
    import sbloader
    from PIL import Image
    from sbloader import transforms as T

    rng = sbloader.get_context().rng
    out = []
    for a in batch["image"]:
        img = T.random_resized_crop(Image.fromarray(a), SIZE, rng)
        out.append(T.to_chw(T.random_flip(np.asarray(img), rng)))
    return {"image": np.stack(out), "label": np.array([label_of(p) for p in batch["path"]], dtype=np.int64)}

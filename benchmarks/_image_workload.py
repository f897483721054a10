"""The JPEG crop workload (one module for every scenario that reads JPEGs), importable by
every contender's processes.

JPEG decode, random-resized-crop to 224x224, random flip, uint8 CHW, batches of 64:
``sbloader/transforms.py``'s ``decode_crop_flip`` (or, after a reader that already
decoded, the same crop and flip on the decoded array).

Only NumPy and Pillow are imported here: ``sbloader/transforms.py`` is loaded from
its file, so torch's workers, the Pool's processes and Ray Data's workers do not
import the ``sbloader`` package (and Ray) just for the transforms. Only the
sbloader-native functions import ``sbloader`` (for ``get_context().rng``).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

SIZE = 224
BATCH = 64


def _load_transforms() -> Any:
    path = Path(__file__).resolve().parents[1] / "sbloader" / "transforms.py"
    spec = importlib.util.spec_from_file_location("_sbloader_transforms_for_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


T = _load_transforms()

_RNGS: dict[int, np.random.Generator] = {}


def process_rng() -> np.random.Generator:
    """One generator per process (torch workers, Pool processes, Ray Data workers)."""
    pid = os.getpid()
    rng = _RNGS.get(pid)
    if rng is None:
        rng = _RNGS[pid] = np.random.default_rng([pid, int.from_bytes(os.urandom(4), "little")])
    return rng


def label_of(path: str) -> int:
    """The class index of an ImageFolder path ``.../class_007/0000123.jpg``."""
    return int(os.path.basename(os.path.dirname(str(path))).rsplit("_", 1)[1])


def load_file(path: str, rng: np.random.Generator, exact: bool = False) -> np.ndarray:
    """Read one JPEG and apply the augmentation: ``3x224x224`` uint8; the window decode, or
    with ``exact=True`` the whole Pillow decode (before #29)."""
    with open(path, "rb") as f:
        data = f.read()
    return T.decode_crop_flip(data, SIZE, rng, exact=exact)


def crop_flip(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The augmentation on an already decoded ``HxWx3`` array (after ``read_images``)."""
    img = Image.fromarray(arr)
    out = np.asarray(T.random_resized_crop(img, SIZE, rng))
    return T.to_chw(T.random_flip(out, rng))


def labels_of(paths: Sequence[str]) -> np.ndarray:
    """The class indices of a batch's paths."""
    return np.array([label_of(p) for p in paths], dtype=np.int64)


# ----- the function alone (ceiling) and the Pool --------------------------------

def preprocess_paths(paths: Sequence[str], exact: bool = False) -> dict[str, np.ndarray]:
    """One batch as every loader delivers it: stacked images and labels (the function alone)."""
    rng = process_rng()
    return {"image": np.stack([load_file(p, rng, exact) for p in paths]), "label": labels_of(paths)}


def preprocess_paths_exact(paths: Sequence[str]) -> dict[str, np.ndarray]:
    """The function alone, whole decode (the Pillow ceiling)."""
    return preprocess_paths(paths, True)


# ----- torch map-style Dataset (torch's DataLoader and sbloader's drop-in) ----------

class ImageFolderDataset:
    """A map-style Dataset as users write one: ``(image tensor, label)`` per index; ``exact=True``:
    the whole Pillow decode, as before #29."""

    def __init__(self, paths: Sequence[str], exact: bool = False) -> None:
        self.paths, self.exact = list(paths), exact

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        p = self.paths[i]
        return torch.from_numpy(load_file(p, process_rng(), self.exact)), label_of(p)


def shm_stacking_collate(samples: Sequence[Any]) -> Any:
    """``default_collate`` as torch's own workers run it, for sbloader's drop-in workers:
    tensors stacked into a fresh shared-memory segment per batch (``bench_collate.py``
    compares it with the private stacking the drop-in's workers do)."""
    import torch
    from torch.utils.data import default_collate
    from torch.utils.data._utils import collate

    fn_map = collate.default_collate_fn_map
    saved = fn_map[torch.Tensor]
    fn_map[torch.Tensor] = collate.collate_tensor_fn
    try:
        return default_collate(samples)
    finally:
        fn_map[torch.Tensor] = saved


# ----- sbloader native pipelines: ``read_images(..., decode=False).map_batches(f)`` --------

def _sbl_batch(batch: dict, exact: bool) -> dict:
    import sbloader

    rng = sbloader.get_context().rng
    return {"image": np.stack([T.decode_crop_flip(b, SIZE, rng, exact=exact) for b in batch["image"]]),
            "label": labels_of(batch["path"])}


def sbl_decode_files_window_batch(batch: dict) -> dict:
    """Decode (the crop window only, #29), crop, flip in one pass."""
    return _sbl_batch(batch, False)


def sbl_decode_files_exact_batch(batch: dict) -> dict:
    """The same before #29: whole decode, crop, flip."""
    return _sbl_batch(batch, True)

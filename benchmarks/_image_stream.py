"""The JPEG workload as an ``IterableDataset`` (imports torch: load it where torch is wanted)."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from benchmarks._image_workload import label_of, load_file, process_rng


class ImageStream(IterableDataset):
    """An ``IterableDataset`` as users write one over files: worker ``w`` of ``n`` reads every
    ``n``-th path from ``w`` (``get_worker_info()``), yielding ``(image tensor, label)``."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __iter__(self) -> Any:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for p in self.paths[w::n]:
            yield torch.from_numpy(load_file(p, process_rng())), label_of(p)

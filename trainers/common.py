"""Pieces shared by the training scripts: process group, image dataset, checkpoints."""
from __future__ import annotations

import os
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.utils.data import Dataset

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join torchrun's process group (gloo on CPU, NCCL on GPU); a world of one otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def barrier() -> None:
    """A barrier when running distributed."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class ImageFolderDataset(Dataset):
    """A map-style dataset of ``root/<class>/<file>.jpg``, opened with PIL, as users write them.

    Args:
        root: the folder.
        size: output side after random-resized-crop.
        train: random crop and flip (else a centre resize).
    """

    def __init__(self, root: str, size: int = 64, train: bool = True) -> None:
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.samples = [(os.path.join(root, c, f), i) for i, c in enumerate(self.classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]
        self.size, self.train = size, train

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as img:
            img = img.convert("RGB")
            img.draft("RGB", (self.size * 2, self.size * 2))
            if self.train:
                w, h = img.size
                s = random.uniform(0.35, 1.0)
                cw, ch = max(8, int(w * s)), max(8, int(h * s))
                left, top = random.randint(0, w - cw), random.randint(0, h - ch)
                img = img.resize((self.size, self.size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
                if random.random() < 0.5:
                    img = img.transpose(Image.FLIP_LEFT_RIGHT)
            else:
                img = img.resize((self.size, self.size), Image.BILINEAR)
            x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
        return x, label


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW to normalised float."""
    return (x.float() / 255.0 - MEAN.to(x.device)) / STD.to(x.device)


def save_checkpoint(path: str, **state: Any) -> None:
    """Write a checkpoint atomically (rename), so a kill never leaves half a file."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> Optional[dict]:
    """The checkpoint at ``path``, or None if there is none."""
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)

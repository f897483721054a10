"""The encoder stage: a small VAE encoder and a small text encoder, behind one callable class
(:class:`SDEncoders`, an actor pool in the pipeline, in the trainer for the torch baseline)."""
from __future__ import annotations

import json
import os
import time
import warnings
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from sd.data import PAD


class VAEEncoder(nn.Module):
    """A VAE-style conv encoder: ``(B, 3, H, W)`` in ``[-1, 1]`` -> mean and log-variance ``(B, C, H/8, W/8)``."""

    def __init__(self, latent_channels: int = 4, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1)]
        ch = width
        for mult in (1, 2, 2):  # three stride-2 convs: /8
            layers += [nn.GroupNorm(8, ch), nn.SiLU(), nn.Conv2d(ch, width * mult, 3, 2, 1)]
            ch = width * mult
        layers += [nn.GroupNorm(8, ch), nn.SiLU(), nn.Conv2d(ch, 2 * latent_channels, 3, 1, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, logvar = self.net(x).chunk(2, dim=1)
        return mean, logvar


class TextEncoder(nn.Module):
    """Token + position embedding and a tiny pre-norm transformer: ``(B, L)`` ids -> ``(B, L, D)``."""

    def __init__(self, vocab: int, max_tokens: int, dim: int = 64, heads: int = 4, layers: int = 1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(max_tokens, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = tokens != PAD
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        x = self.norm(self.blocks(x, src_key_padding_mask=~mask))
        return x * mask.unsqueeze(-1), mask


def weights_checksum(*modules: nn.Module) -> float:
    """Sum of every parameter (float64): equal sums mean (almost surely) equal weights."""
    return float(sum(p.detach().double().sum().item() for m in modules for p in m.parameters()))


class SDEncoders:
    """The encoder stage: images -> VAE latents, tokens -> text embeddings.

    In the pipeline it is a callable class in an actor pool (constructed once per
    actor); the torch baseline builds one in the trainer and calls :meth:`encode`.
    Weights are random but built from ``seed`` (in a forked RNG), so every actor and
    every process holds the same encoders.

    Args:
        vocab: tokenizer vocabulary.
        max_tokens: tokens per caption.
        latent_channels: VAE latent channels.
        text_dim: text embedding width.
        seed: the weights' seed.
        device: where to run (default: CUDA when this process sees a GPU, else CPU).
        log_path: append one JSON line per construction here (pid, actor index,
            device, weights checksum), to count constructions.
        where: ``"actor"`` (pool) or ``"trainer"`` (baseline), for the log.
    """

    #: Latents are the VAE mean times this (SD's 0.18215 is for its trained VAE; 1 for random weights).
    latent_scale = 1.0

    def __init__(self, *, vocab: int = 4096, max_tokens: int = 16, latent_channels: int = 4, text_dim: int = 64,
                 seed: int = 1234, device: Optional[str] = None, log_path: Optional[str] = None,
                 where: str = "actor") -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.vae = VAEEncoder(latent_channels)
            self.text = TextEncoder(vocab, max_tokens, text_dim)
        for m in (self.vae, self.text):
            m.to(self.device).eval().requires_grad_(False)
        self.checksum = weights_checksum(self.vae, self.text)
        self.pid = os.getpid()
        if log_path:
            from sbloader.core.context import actor_info

            info = actor_info()
            line = json.dumps({"pid": self.pid, "where": where, "device": str(self.device),
                               "actor_index": info[0] if info else None, "checksum": self.checksum,
                               "time": time.time()})
            with open(log_path, "a", encoding="utf-8") as f:  # one short append per construction
                f.write(line + "\n")

    def encode(self, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``(B, 3, H, W)`` uint8 images and ``(B, L)`` ids -> latents, text embeddings and mask (on the device)."""
        with torch.inference_mode():
            x = images.to(self.device, non_blocking=True).float().div_(127.5).sub_(1.0)
            mean, _ = self.vae(x)
            emb, mask = self.text(tokens.to(self.device, non_blocking=True))
        return {"latents": mean * self.latent_scale, "text_emb": emb, "text_mask": mask}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A pipeline batch (``id``, ``image``, ``tokens``) -> NumPy ``latents``, ``text_emb``, ``text_mask``."""
        with warnings.catch_warnings():  # read-only object-store buffers; encode() never writes to them
            warnings.simplefilter("ignore", UserWarning)
            images, tokens = torch.from_numpy(batch["image"]), torch.from_numpy(batch["tokens"])
        out = self.encode(images, tokens)
        n = len(batch["id"])
        return {"id": batch["id"],
                "latents": out["latents"].float().cpu().numpy(),
                "text_emb": out["text_emb"].float().cpu().numpy(),
                "text_mask": out["text_mask"].cpu().numpy(),
                "encoder_pid": np.full(n, self.pid, dtype=np.int64)}

"""The denoiser (a small text-conditioned UNet over latents) and the DDPM objective it is trained with."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

#: Latents are ``H/8 x W/8``, and the UNet halves them once more.
DOWNSAMPLE = 8


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps: ``(B,)`` -> ``(B, dim)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


class ResBlock(nn.Module):
    """A residual conv block with the conditioning vector added after the first conv."""

    def __init__(self, cin: int, cout: int, cond_dim: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.cond = nn.Linear(cond_dim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.cond(F.silu(c))[:, :, None, None]
        return self.conv2(F.silu(self.norm2(h))) + self.skip(x)


class CrossAttention(nn.Module):
    """Image positions attend to the text tokens (padding masked out); residual."""

    def __init__(self, channels: int, context_dim: int, heads: int = 4) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, channels)
        self.attn = nn.MultiheadAttention(channels, heads, kdim=context_dim, vdim=context_dim, batch_first=True)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q = self.norm(x).flatten(2).transpose(1, 2)
        out, _ = self.attn(q, context, context, key_padding_mask=~mask, need_weights=False)
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class TinyUNet(nn.Module):
    """A two-level UNet over latents, conditioned on the timestep and the text.

    The timestep embedding plus the pooled text embedding conditions every ResBlock;
    cross-attention to the text tokens runs at both resolutions.
    """

    def __init__(self, latent_channels: int = 4, base: int = 32, text_dim: int = 64) -> None:
        super().__init__()
        cond = 4 * base
        self.base = base
        self.time_mlp = nn.Sequential(nn.Linear(base, cond), nn.SiLU(), nn.Linear(cond, cond))
        self.text_pool = nn.Linear(text_dim, cond)
        self.conv_in = nn.Conv2d(latent_channels, base, 3, 1, 1)
        self.down_block, self.down_attn = ResBlock(base, base, cond), CrossAttention(base, text_dim)
        self.down = nn.Conv2d(base, 2 * base, 3, 2, 1)
        self.mid1, self.mid_attn = ResBlock(2 * base, 2 * base, cond), CrossAttention(2 * base, text_dim)
        self.mid2 = ResBlock(2 * base, 2 * base, cond)
        self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(2 * base, base, 3, 1, 1))
        self.up_block, self.up_attn = ResBlock(2 * base, base, cond), CrossAttention(base, text_dim)
        self.out = nn.Sequential(nn.GroupNorm(8, base), nn.SiLU(), nn.Conv2d(base, latent_channels, 3, 1, 1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Predict the noise in ``x`` (``(B, C, h, w)``) at timesteps ``t`` given the text."""
        m = mask.unsqueeze(-1).to(context.dtype)
        pooled = (context * m).sum(1) / m.sum(1).clamp(min=1.0)
        c = self.time_mlp(timestep_embedding(t, self.base)) + self.text_pool(pooled)
        h1 = self.down_attn(self.down_block(self.conv_in(x), c), context, mask)
        h = self.mid2(self.mid_attn(self.mid1(self.down(h1), c), context, mask), c)
        h = self.up_attn(self.up_block(torch.cat([self.up(h), h1], dim=1), c), context, mask)
        return self.out(h)


class DDPM:
    """The linear-beta DDPM forward process (``T`` steps) and its noise-prediction loss."""

    def __init__(self, steps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                 device: Optional[torch.device] = None) -> None:
        betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64)
        self.steps = steps
        self.alphas_cumprod = torch.cumprod(1.0 - betas, 0).float().to(device)

    def loss(self, model: nn.Module, x0: torch.Tensor, context: torch.Tensor, mask: torch.Tensor,
             generator: torch.Generator, cond_drop: float = 0.0) -> torch.Tensor:
        """MSE between the noise added at a random timestep and the model's prediction.

        With probability ``cond_drop`` a sample's text is dropped (only its start
        token kept, embedding zeroed), for classifier-free guidance.
        """
        b, dev = x0.shape[0], x0.device
        t = torch.randint(0, self.steps, (b,), generator=generator, device=dev)
        noise = torch.randn(x0.shape, generator=generator, device=dev)
        drop = torch.rand(b, generator=generator, device=dev) < cond_drop
        context = context.masked_fill(drop[:, None, None], 0.0)
        mask = mask & ~drop[:, None]
        mask[:, 0] = True
        abar = self.alphas_cumprod[t].view(b, 1, 1, 1)
        xt = abar.sqrt() * x0 + (1.0 - abar).sqrt() * noise
        return F.mse_loss(model(xt, t, context, mask), noise)


def step_generator(seed: int, rank: int, step: int, device: torch.device) -> torch.Generator:
    """The RNG of one training step (timesteps, noise, dropped captions): from ``(seed, rank, step)``."""
    value = int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0]) & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(value)

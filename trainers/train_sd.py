"""Train a small Stable-Diffusion-style latent denoiser on generated images and captions.

    python3 trainers/train_sd.py --images 64 --steps 4                 # one process, sbloader
    python3 trainers/train_sd.py --images 64 --steps 4 --loader torch  # torch's DataLoader baseline
    torchrun --standalone --nproc-per-node=2 trainers/train_sd.py --images 64 --steps 4
    ... --resume                                                       # continue from the latest checkpoint

The data is a Parquet file of JPEG bytes and captions (``sbloader.datagen.write_image_parquet``,
written once per set of parameters). Two loaders feed the same trainer:

``--loader sbloader`` (the pipeline)
    ``read_parquet`` -> ``map_batches(preprocess)`` on CPU tasks (decode, resize the shorter
    side, random crop, flip, tokenize the caption) -> ``map_batches(SDEncoders,
    concurrency=(1, N))``: an actor pool (``num_gpus`` when CUDA is there) that builds a
    small VAE encoder and a small text encoder once per actor, from a fixed seed so every
    actor holds the same weights, and turns each batch into latents ``(4, H/8, W/8)`` and
    text embeddings ``(L, D)`` -> ``to_dataloader`` streams ready batches into each rank
    (per-rank partition split under torchrun, equal batch counts).

``--loader torch`` (the single-node baseline)
    torch's ``DataLoader`` over a map-style Dataset that reads the Parquet rows and
    decodes/augments/tokenizes in ``--workers`` processes; the same encoders run in the
    trainer process on the collated batch.

The denoiser is a small UNet (ResNet blocks conditioned on a timestep embedding plus the
pooled text embedding, cross-attention to the text tokens) trained with the DDPM
noise-prediction loss under DDP (gloo on CPU, NCCL on GPU). Checkpoints
``<ckpt-dir>/step_<step>.pt``, every ``--ckpt-every`` steps and at the last step, hold
the model, the optimiser and the loader's position (``loader.state_dict()``, called on
every rank, saved by rank 0); ``--resume`` continues from the latest one at its step.
Rank 0 shows a progress bar and prints the throughput (samples/s) and the loader's stall
fraction at the end: the share of the training loop spent waiting for the next batch
(for the baseline that wait includes encoding it in the trainer).

The embedded Ray gets enough logical CPUs for every rank's encoder pool at full size
plus two decode tasks (``--ray-cpus`` overrides): otherwise, on a small machine, the
pools could hold every CPU while they wait for decoded input.

Randomness is a function of ``--seed`` only: augmentations come from the partition's
seeded context (sbloader) or from ``(seed, epoch, index)`` (torch), and the diffusion
noise of each step from ``(seed, rank, step)``, so a resumed run repeats an
uninterrupted one (sbloader with ``--deterministic``, the default).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
import zlib
from collections import OrderedDict
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import barrier, load_checkpoint, save_checkpoint, setup_distributed  # noqa: E402

#: Token id of padding (0) and of the start token every caption begins with (1).
PAD, BOS = 0, 1
#: Latents are ``H/8 x W/8``, and the UNet halves them once more.
DOWNSAMPLE = 8
CKPT_PREFIX = "step_"


# =====================================================================================
# Data: generation, augmentation, tokenizer (shared by both loaders)
# =====================================================================================


def dataset_path(args: argparse.Namespace) -> str:
    """The Parquet file for these parameters (under ``--data``)."""
    root = args.data or os.path.join(tempfile.gettempdir(), "sbloader-sd-data")
    return os.path.join(root, f"sd-{args.images}-s{args.size}-g{args.rows_per_group}-seed{args.seed}.parquet")


def write_dataset(path: str, args: argparse.Namespace) -> str:
    """Write the generated images + captions once (atomically); later calls reuse the file."""
    from sbloader.datagen import write_image_parquet

    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    s = args.size
    write_image_parquet(tmp, args.images, seed=args.seed, captions=True, rows_per_group=args.rows_per_group,
                        min_size=(s * 3 // 2, s * 5 // 4), max_size=(s * 5 // 2, s * 2))
    os.replace(tmp, path)
    return path


def tokenize(captions: Sequence[str], max_tokens: int, vocab: int) -> np.ndarray:
    """A hashed word tokenizer: ``[BOS, crc32(word) % (vocab - 2) + 2, ..., PAD...]``.

    Args:
        captions: the texts.
        max_tokens: tokens per caption (longer captions are truncated).
        vocab: vocabulary size (ids ``0..vocab-1``; 0 pads, 1 starts).

    Returns:
        ``(len(captions), max_tokens)`` int64 ids.
    """
    out = np.full((len(captions), max_tokens), PAD, dtype=np.int64)
    for i, text in enumerate(captions):
        words = str(text).lower().split()[: max_tokens - 1]
        out[i, 0] = BOS
        for j, w in enumerate(words, start=1):
            out[i, j] = 2 + zlib.crc32(w.encode("utf-8")) % (vocab - 2)
    return out


def resize_crop_flip(data: bytes, size: int, rng: np.random.Generator) -> np.ndarray:
    """Decode a JPEG, resize its shorter side to ``size``, random-crop ``size x size``, flip; CHW uint8."""
    from PIL import Image

    from sbloader.transforms import decode, random_flip, to_chw

    img = decode(data, draft=(size, size))
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = int(rng.integers(0, nw - size + 1)), int(rng.integers(0, nh - size + 1))
    arr = np.asarray(img)[top:top + size, left:left + size]
    return to_chw(random_flip(arr, rng))


def preprocess(batch: dict[str, np.ndarray], *, size: int, max_tokens: int, vocab: int) -> dict[str, np.ndarray]:
    """The pipeline's CPU stage: decode/resize/crop/flip every image and tokenize every caption.

    Randomness comes from ``sbloader.get_context().rng`` (seeded per epoch and
    partition), so a replayed partition gives the same crops.
    """
    import sbloader

    rng = sbloader.get_context().rng
    images = [resize_crop_flip(b, size, rng) for b in batch["image"]]
    return {"id": np.asarray(batch["id"], dtype=np.int64),
            "image": np.stack(images) if images else np.empty((0, 3, size, size), np.uint8),
            "tokens": tokenize(batch["caption"], max_tokens, vocab)}


class ParquetCaptionDataset(torch.utils.data.Dataset):
    """The baseline's map-style dataset: one Parquet row -> augmented image, tokens and id.

    Keys are ``(epoch, index)`` pairs (see :class:`EpochSampler`), so the augmentation of
    a row depends only on ``(seed, epoch, index)``, never on which worker loads it.
    Row groups are read on demand and the last few kept per worker process.

    Args:
        path: the Parquet file.
        size: output side.
        max_tokens: tokens per caption.
        vocab: tokenizer vocabulary.
        seed: augmentation seed.
        cache_row_groups: row groups kept in memory per worker.
    """

    def __init__(self, path: str, size: int, max_tokens: int, vocab: int, seed: int,
                 cache_row_groups: int = 8) -> None:
        import pyarrow.parquet as pq

        md = pq.read_metadata(path)
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        self.starts = np.cumsum([0] + sizes)
        self.path, self.size, self.max_tokens, self.vocab, self.seed = path, size, max_tokens, vocab, seed
        self.cache_row_groups = cache_row_groups
        self._file: Any = None
        self._cache: OrderedDict[int, tuple[list, list, list]] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _row_group(self, rg: int) -> tuple[list, list, list]:
        if rg in self._cache:
            self._cache.move_to_end(rg)
            return self._cache[rg]
        import pyarrow.parquet as pq

        if self._file is None:  # opened in the process that reads (each worker its own)
            self._file = pq.ParquetFile(self.path)
        t = self._file.read_row_group(rg, columns=["id", "image", "caption"])
        rows = (t.column("id").to_pylist(), t.column("image").to_pylist(), t.column("caption").to_pylist())
        self._cache[rg] = rows
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return rows

    def __getitem__(self, key: Any) -> dict[str, Any]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} rows of {self.path!r}")
        rg = int(np.searchsorted(self.starts, index, side="right") - 1)
        ids, images, captions = self._row_group(rg)
        i = index - int(self.starts[rg])
        rng = np.random.default_rng([self.seed, epoch, index])
        return {"id": int(ids[i]),
                "image": torch.from_numpy(resize_crop_flip(images[i], self.size, rng)),
                "tokens": torch.from_numpy(tokenize([captions[i]], self.max_tokens, self.vocab)[0])}


class EpochSampler(torch.utils.data.Sampler):
    """``DistributedSampler(shuffle=True, drop_last=True)``'s split, yielding ``(epoch, index)`` keys.

    The permutation derives from ``(seed, epoch)``; ``skip`` leaves out the first
    samples of this rank's share (a resumed epoch).

    Args:
        n: dataset length.
        rank: this rank.
        world: number of ranks.
        seed: shuffle seed.
    """

    def __init__(self, n: int, rank: int, world: int, seed: int) -> None:
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.per_rank = n // world
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The epoch the next iteration yields, leaving out its first ``skip`` samples."""
        self.epoch, self.skip = epoch, skip

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g)[: self.per_rank * self.world].tolist()
        for index in order[self.rank::self.world][self.skip:]:
            yield self.epoch, index

    def __len__(self) -> int:
        return max(0, self.per_rank - self.skip)


# =====================================================================================
# Encoders: a small VAE encoder and a small text encoder, one callable class
# =====================================================================================


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


# =====================================================================================
# The denoiser and the DDPM objective
# =====================================================================================


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


# =====================================================================================
# The two loaders behind one interface
# =====================================================================================


class BatchSource:
    """Endless encoded batches (dicts with ``latents``, ``text_emb``, ``text_mask``, ``id``, ``encoder_pid``).

    Attributes:
        epoch: the epoch being read.
        encode_s: seconds the trainer process spent encoding (torch baseline only).
    """

    kind = ""
    epoch = 0
    encode_s = 0.0

    def batches(self) -> Iterator[dict]:
        """Batches across epochs, from the loaded position on; closing it stops the loader."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The position of the training loop (every rank must call it at the same step)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (before :meth:`batches`)."""
        raise NotImplementedError

    def summary(self) -> dict:
        """Loader-specific figures for the metrics file."""
        return {}

    def describe_stalls(self) -> Optional[str]:
        """The loader's own stall report, if it has one."""
        return None


class PipelineSource(BatchSource):
    """``--loader sbloader``: read_parquet -> preprocess (CPU tasks) -> SDEncoders (actor pool) -> to_dataloader."""

    kind = "sbloader"

    def __init__(self, args: argparse.Namespace, path: str, device: torch.device) -> None:
        import sbloader

        cuda = torch.cuda.is_available()
        encoder_kwargs = dict(vocab=args.vocab, max_tokens=args.max_tokens, text_dim=args.text_dim,
                              seed=args.encoder_seed, log_path=args.encoder_log)
        self.dataset = (
            sbloader.read_parquet(path, columns=["id", "image", "caption"])
            .map_batches(preprocess, num_cpus=1,
                         fn_kwargs=dict(size=args.size, max_tokens=args.max_tokens, vocab=args.vocab))
            .map_batches(SDEncoders, batch_size=args.encode_batch, concurrency=(1, args.encoder_actors),
                         num_cpus=args.encoder_cpus, num_gpus=args.encoder_gpus if cuda else None,
                         fn_constructor_kwargs=encoder_kwargs)
        )
        self.loader = self.dataset.to_dataloader(
            batch_size=args.batch_size, shuffle=True, seed=args.seed, drop_last=True,
            deterministic=args.deterministic, pin_memory=device.type == "cuda",
            persistent_workers=True,  # the encoders are built once, not once per epoch
            memory_budget=args.memory_budget_mb * 2**20 if args.memory_budget_mb else None)
        self.epoch_stats: list[dict] = []

    def _record(self) -> None:
        st = self.loader.stats()
        if st is None:
            return
        pool = [o for o in st.operators if "SDEncoders" in o.name]
        self.epoch_stats.append({"epoch": self.epoch, "actors_created": pool[0].actors_created if pool else 0,
                                 "encoder_tasks": pool[0].tasks if pool else 0})

    def batches(self) -> Iterator[dict]:
        empty = 0  # a resumed epoch that was all consumed gives no batch once; twice in a row is an error
        while True:
            it = iter(self.loader)
            got = 0
            try:
                for batch in it:
                    got += 1
                    yield batch
            finally:
                it.close()
                self._record()
            empty = 0 if got else empty + 1
            if empty > 1:
                raise RuntimeError("two epochs in a row gave no batch: the rows per rank cannot fill --batch-size")
            self.epoch += 1

    def state_dict(self) -> dict:
        return {"kind": self.kind, "epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.epoch = int(state["loader"]["epoch"])

    def summary(self) -> dict:
        return {"actors_created": sum(e["actors_created"] for e in self.epoch_stats), "epochs": self.epoch_stats}

    def describe_stalls(self) -> Optional[str]:
        s = self.loader.stall_stats()
        return f"sbloader's own stall instrument (last epoch): {s}" if s is not None else None


class TorchSource(BatchSource):
    """``--loader torch``: torch's DataLoader (decode/augment in workers) + the encoders in this process."""

    kind = "torch"

    def __init__(self, args: argparse.Namespace, path: str, rank: int, world: int, device: torch.device) -> None:
        from torch.utils.data import DataLoader

        self.dataset = ParquetCaptionDataset(path, args.size, args.max_tokens, args.vocab, args.seed)
        self.sampler = EpochSampler(len(self.dataset), rank, world, args.seed)
        self.world, self.batch_size = world, args.batch_size
        self.loader = DataLoader(self.dataset, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=args.workers, persistent_workers=args.workers > 0,
                                 pin_memory=device.type == "cuda", drop_last=True)
        self.encoders = SDEncoders(vocab=args.vocab, max_tokens=args.max_tokens, text_dim=args.text_dim,
                                   seed=args.encoder_seed, device=str(device), log_path=args.encoder_log,
                                   where="trainer")
        self.batch_in_epoch = 0

    def batches(self) -> Iterator[dict]:
        while True:
            self.sampler.set_epoch(self.epoch, skip=self.batch_in_epoch * self.batch_size)
            got = 0
            for batch in self.loader:
                t0 = time.perf_counter()
                out = self.encoders.encode(batch["image"], batch["tokens"])
                if out["latents"].is_cuda:
                    torch.cuda.synchronize()
                self.encode_s += time.perf_counter() - t0
                out["id"] = batch["id"]
                out["encoder_pid"] = torch.full((len(batch["id"]),), self.encoders.pid, dtype=torch.int64)
                self.batch_in_epoch += 1
                got += 1
                yield out
            if got == 0 and self.batch_in_epoch == 0:
                raise RuntimeError(f"an epoch gave no batch: {len(self.dataset)} rows over {self.world} rank(s) "
                                   f"is below --batch-size {self.batch_size} per rank")
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"kind": self.kind, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "world": self.world, "batch_size": self.batch_size, "rows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("world", self.world), ("batch_size", self.batch_size), ("rows", len(self.dataset))):
            if state.get(key) != mine:
                raise ValueError(f"the torch loader's checkpointed position needs the same {key}: "
                                 f"found {state.get(key)!r}, expected {mine!r} (sbloader resumes on any world size)")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])


# =====================================================================================
# Checkpoints
# =====================================================================================


def checkpoint_files(ckpt_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint in ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        if name.startswith(CKPT_PREFIX) and name.endswith(".pt") and name[len(CKPT_PREFIX):-3].isdigit():
            out.append((int(name[len(CKPT_PREFIX):-3]), os.path.join(ckpt_dir, name)))
    return sorted(out)


def write_checkpoint(ckpt_dir: str, step: int, keep: int, **state: Any) -> str:
    """Save ``step_<step>.pt`` atomically and keep the newest ``keep`` checkpoints."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"{CKPT_PREFIX}{step:08d}.pt")
    save_checkpoint(path, step=step, **state)
    for _, old in checkpoint_files(ckpt_dir)[:-keep]:
        os.remove(old)
    return path


# =====================================================================================
# Training
# =====================================================================================


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (validated)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loader", choices=["sbloader", "torch"], default="sbloader")
    p.add_argument("--images", type=int, default=256, help="generated image/caption rows")
    p.add_argument("--size", type=int, default=64, help="training resolution (a multiple of 16)")
    p.add_argument("--rows-per-group", type=int, default=16, help="Parquet row group size (= partition size)")
    p.add_argument("--data", default=None, help="folder of the generated Parquet (default: a temp folder)")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--steps", type=int, default=40, help="total optimizer steps (a resumed run counts on)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--base", type=int, default=32, help="UNet width")
    p.add_argument("--cond-drop", type=float, default=0.1, help="caption dropout for classifier-free guidance")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--text-dim", type=int, default=64)
    p.add_argument("--encoder-seed", type=int, default=1234, help="seed of the (random) encoder weights")
    p.add_argument("--encode-batch", type=int, default=16, help="rows per encoder call (sbloader)")
    p.add_argument("--encoder-actors", type=int, default=2, help="max encoder actors per rank (sbloader)")
    p.add_argument("--encoder-cpus", type=float, default=1.0, help="CPUs per encoder actor (sbloader)")
    p.add_argument("--encoder-gpus", type=float, default=0.5, help="GPUs per encoder actor when CUDA is there")
    p.add_argument("--ray-cpus", type=int, default=None,
                   help="logical CPUs of the embedded Ray (default: enough for every rank's full encoder "
                        "pool plus two decode tasks, at least the machine's cores)")
    p.add_argument("--memory-budget-mb", type=int, default=0, help="sbloader object-store budget (0: default)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="sbloader's fixed delivery order (resume repeats an uninterrupted run)")
    p.add_argument("--workers", type=int, default=2, help="torch DataLoader workers (--loader torch)")
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "sbloader-sd-ckpt"))
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--keep-ckpts", type=int, default=3)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encoder-log", default=None, help="append one JSON line per encoder construction here")
    p.add_argument("--metrics-dir", default=None, help="write rank<r>.json (losses, shapes, timings) here")
    args = p.parse_args(argv)
    for name in ("images", "size", "rows_per_group", "batch_size", "steps", "base", "max_tokens", "text_dim",
                 "encode_batch", "encoder_actors", "ckpt_every", "keep_ckpts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, found {getattr(args, name)}")
    if args.size % (2 * DOWNSAMPLE):
        p.error(f"--size must be a multiple of {2 * DOWNSAMPLE} (latents are /8, the UNet halves them), "
                f"found {args.size}")
    if args.vocab < 3:
        p.error(f"--vocab must be >= 3 (pad, start and one word id), found {args.vocab}")
    if args.base % 8 or args.text_dim % 4:
        p.error(f"--base must be a multiple of 8 and --text-dim of 4, found {args.base}, {args.text_dim}")
    if not 0.0 <= args.cond_drop < 1.0:
        p.error(f"--cond-drop must be in [0, 1), found {args.cond_drop}")
    if args.encoder_cpus <= 0 or args.workers < 0:
        p.error("--encoder-cpus must be > 0 and --workers >= 0")
    return args


def ray_cpus(args: argparse.Namespace, world: int) -> int:
    """Logical CPUs for the embedded Ray: every rank's encoder pool at full size must leave
    room for decode tasks, or the pools could hold every CPU while they wait for input."""
    need = world * args.encoder_actors * args.encoder_cpus + 2
    return args.ray_cpus or max(os.cpu_count() or 1, math.ceil(need))


def latest_checkpoint(args: argparse.Namespace) -> tuple[str, dict]:
    """The newest checkpoint in ``--ckpt-dir``, checked against ``--loader``.

    Raises:
        FileNotFoundError: there is no checkpoint.
        ValueError: it was written by the other loader, or is not this script's.
    """
    found = checkpoint_files(args.ckpt_dir)
    if not found:
        raise FileNotFoundError(f"--resume: no checkpoint {CKPT_PREFIX}<step>.pt in {args.ckpt_dir!r}")
    path = found[-1][1]
    ckpt = load_checkpoint(path)
    missing = [k for k in ("step", "model", "opt", "loader_state") if k not in (ckpt or {})]
    if missing:
        raise ValueError(f"{path!r} is not a train_sd.py checkpoint: it lacks {missing}")
    kind = ckpt["loader_state"].get("kind")
    if kind != args.loader:
        raise ValueError(f"{path!r} was written with --loader {kind}, found --loader {args.loader}: "
                         f"resume with --loader {kind}, or start a new --ckpt-dir")
    return path, ckpt


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device,
          resume: Optional[tuple[str, dict]] = None, source: Optional[BatchSource] = None) -> dict[str, Any]:
    """Build the loader and the model, train to ``--steps`` and return the run's figures (per rank).

    Args:
        args: the options.
        rank: this rank.
        world: number of ranks.
        device: the trainer's device.
        resume: ``(path, checkpoint)`` to continue from (see :func:`latest_checkpoint`).
        source: batches from this instead of the loader ``--loader`` names (a benchmark's
            own loader, or one of the two wrapped to time each step).
    """
    path = dataset_path(args)
    if rank == 0:
        write_dataset(path, args)
    barrier()
    if args.images // world < args.batch_size:
        raise ValueError(f"--images {args.images} over {world} rank(s) cannot fill one batch of "
                         f"--batch-size {args.batch_size} per rank")
    if source is not None:
        pass
    elif args.loader == "sbloader":
        source = PipelineSource(args, path, device)
    else:
        source = TorchSource(args, path, rank, world, device)

    torch.manual_seed(args.seed)
    model = TinyUNet(base=args.base, text_dim=args.text_dim).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddpm = DDPM(device=device)

    step = start_step = 0
    if resume is not None:
        ckpt_path, ckpt = resume
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        source.load_state_dict(ckpt["loader_state"])
        step = start_step = int(ckpt["step"])
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}, epoch {source.epoch}", flush=True)

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=step, unit="step", disable=None, desc=f"train_sd [{args.loader}]")
    losses: dict[int, float] = {}
    ids: dict[int, list[int]] = {}
    shapes: Optional[dict] = None
    pids: set[int] = set()
    wait_s = 0.0
    first_batch_s: Optional[float] = None
    batches = source.batches()
    t_start = time.perf_counter()
    try:
        while step < args.steps:
            t0 = time.perf_counter()
            batch = next(batches)
            wait_s += time.perf_counter() - t0
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - t_start
            if shapes is None:
                shapes = {k: {"shape": list(batch[k].shape), "dtype": str(batch[k].dtype)}
                          for k in ("latents", "text_emb", "text_mask")}
            pids.update(int(p) for p in batch["encoder_pid"].unique())
            x0 = batch["latents"].to(device, non_blocking=True).float()
            context = batch["text_emb"].to(device, non_blocking=True).float()
            mask = batch["text_mask"].to(device, non_blocking=True).bool()
            loss = ddpm.loss(ddp, x0, context, mask, step_generator(args.seed, rank, step, device), args.cond_drop)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            losses[step] = float(loss.detach())
            ids[step] = [int(i) for i in batch["id"]]
            if bar is not None:
                bar.update(1)
                bar.set_postfix(epoch=source.epoch, loss=f"{losses[step]:.4f}")
            if step % args.ckpt_every == 0 or step == args.steps:
                loader_state = source.state_dict()  # every rank at the same step records the same state
                if rank == 0:
                    write_checkpoint(args.ckpt_dir, step, args.keep_ckpts, model=model.state_dict(),
                                     opt=opt.state_dict(), loader_state=loader_state, epoch=source.epoch,
                                     args=vars(args))
    finally:
        batches.close()
    wall = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    done = step - start_step
    samples = done * args.batch_size * world
    stall = wait_s / wall if wall > 0 else 0.0  # the baseline encodes inside next(): wait_s includes it
    steady = None
    if done > 1 and first_batch_s is not None and wall > first_batch_s:
        steady = (done - 1) * args.batch_size * world / (wall - first_batch_s)
    return {"rank": rank, "world": world, "loader": args.loader, "device": str(device), "start_step": start_step,
            "step": step, "steps_run": done, "samples": samples, "wall_s": wall, "first_batch_s": first_batch_s,
            "samples_per_s": samples / wall if wall > 0 else 0.0, "steady_samples_per_s": steady,
            "wait_s": wait_s, "encode_in_trainer_s": source.encode_s, "stall_fraction": stall,
            "losses": {str(k): v for k, v in losses.items()}, "ids": {str(k): v for k, v in ids.items()},
            "shapes": shapes, "encoder_pids": sorted(pids), "epoch": source.epoch,
            "loader_summary": source.summary(), "loader_stalls": source.describe_stalls()}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the trainer (one process, or one rank under torchrun)."""
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    resume = latest_checkpoint(args) if args.resume else None  # fails before Ray starts
    use_ray = args.loader == "sbloader"
    if use_ray:
        import sbloader

        sbloader.init(num_cpus=ray_cpus(args, world))
    try:
        r = train(args, rank, world, device, resume)
        if args.metrics_dir:
            os.makedirs(args.metrics_dir, exist_ok=True)
            with open(os.path.join(args.metrics_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
                json.dump(r, f)
        barrier()
    finally:
        if use_ray:
            sbloader.shutdown()  # under torchrun, local rank 0 waits for the others to leave
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0 and r["steps_run"] == 0:
        print(f"[{args.loader}] already at step {r['step']} of --steps {args.steps}: nothing to train", flush=True)
    elif rank == 0:
        steady = f", {r['steady_samples_per_s']:.1f} after the first batch" if r["steady_samples_per_s"] else ""
        last = r["losses"].get(str(r["step"]))
        print(f"[{args.loader}] {r['steps_run']} steps (to step {r['step']}), {r['samples']} samples on {world} "
              f"rank(s) in {r['wall_s']:.2f}s = {r['samples_per_s']:.1f} samples/s{steady}; first batch after "
              f"{r['first_batch_s']:.2f}s; last loss {last if last is None else f'{last:.4f}'}", flush=True)
        print(f"[{args.loader}] stall fraction (rank 0): {r['stall_fraction']:.1%} of the loop "
              f"(waiting for batches {r['wait_s']:.2f}s, of which encoding in the trainer "
              f"{r['encode_in_trainer_s']:.2f}s); "
              f"latents {r['shapes']['latents']['shape'] if r['shapes'] else None}, "
              f"text_emb {r['shapes']['text_emb']['shape'] if r['shapes'] else None}", flush=True)
        if r["loader_stalls"]:
            print(f"[{args.loader}] {r['loader_stalls']}", flush=True)
    return r


if __name__ == "__main__":
    main()

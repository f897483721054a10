"""Train a tiny 3D-conv video classifier on clips of generated videos.

    python3 trainers/train_video.py --videos 8 --steps 5        # one process
    torchrun --standalone --nproc-per-node=2 trainers/train_video.py --videos 8 --steps 5

Videos are generated once (``sbloader.datagen.write_video_folder``: drifting
gradients, libx264 when PyAV has it, else mpeg4); video ``i`` has label
``i % classes``. ``sbloader.read_videos`` cuts them into frame ranges, decodes
clips on Ray workers (seeking to the keyframe before each range), and
``ds.to_dataloader(batch_size=..., shuffle=True)`` streams ready batches of
``uint8`` clips into this process, which only normalises them and trains.

Under torchrun every rank builds the same pipeline; ``ds.to_dataloader`` runs it
once for the job (on its split coordinator) and every rank cuts its batches from
it, the same number on every rank, each drawn from several videos at once under
``shuffle=True`` (a rank left without rows in the last round gets a repeated row
marked ``batch["sbloader_padding"]``, which this trainer leaves out of the loss);
the ranks share the job's embedded Ray. Every rank runs exactly ``--steps`` steps
(cycling epochs). Prints clips/s and frames/s per rank.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import barrier, setup_distributed  # noqa: E402

import sbloader  # noqa: E402
from sbloader.datagen import write_video_folder  # noqa: E402

_INDEX = re.compile(r"video_(\d+)\.\w+$")
PADDING = "sbloader_padding"  # rows a shorter rank share repeats under torchrun


class TinyVideoNet(nn.Module):
    """A tiny 3D-conv classifier (randomly initialised): two strided 3D convs, global pooling, a linear head.

    Args:
        classes: number of classes.
        width: channels of the first conv.
    """

    def __init__(self, classes: int, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(3, width, kernel_size=(3, 5, 5), stride=(1, 2, 2), padding=(1, 2, 2), bias=False),
            nn.BatchNorm3d(width), nn.ReLU(inplace=True),
            nn.Conv3d(width, 2 * width, kernel_size=3, stride=2, padding=1, bias=False),
            nn.BatchNorm3d(2 * width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool3d(1),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, 3, T, H, W)`` float clips; returns ``(B, classes)`` logits."""
        return self.head(self.features(x).flatten(1))


def clips_to_input(clip: torch.Tensor) -> torch.Tensor:
    """``(B, T, H, W, 3)`` uint8 clips to ``(B, 3, T, H, W)`` floats in ``[-1, 1]``."""
    return clip.permute(0, 4, 1, 2, 3).float().div_(127.5).sub_(1.0)


def labels_from_paths(paths: Sequence[str], classes: int) -> torch.Tensor:
    """Label of each row: the index in its file name ``video_<i>.<ext>``, modulo ``classes``."""
    out = []
    for p in paths:
        m = _INDEX.search(str(p))
        if m is None:
            raise ValueError(f"cannot derive a label from {str(p)!r}: expected a name like video_00003.mp4")
        out.append(int(m.group(1)) % classes)
    return torch.tensor(out, dtype=torch.long)


def default_codec() -> str:
    """libx264 when PyAV's FFmpeg has it (what real datasets use), else mpeg4."""
    import av

    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=8, help="generated videos")
    p.add_argument("--frames", type=int, default=64, help="frames per video")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--height", type=int, default=96)
    p.add_argument("--codec", default=None, help="libx264 or mpeg4 (default: libx264 when available)")
    p.add_argument("--clip-len", type=int, default=8)
    p.add_argument("--frame-stride", type=int, default=1)
    p.add_argument("--frames-per-partition", type=int, default=32)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="folder of the generated videos (default: a temp folder)")
    args = p.parse_args(argv)
    for name in ("videos", "frames", "clip_len", "frame_stride", "frames_per_partition", "classes",
                 "batch_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, found {getattr(args, name)}")
    return args


def train(args: argparse.Namespace, rank: int = 0, world: int = 1, device: Optional[torch.device] = None) -> dict[str, Any]:
    """Generate the videos, build the pipeline and train ``args.steps`` steps.

    Starts the embedded Ray if none is running (never stops it).

    Returns:
        Steps, clips and frames seen, wall seconds, throughput and the last loss.
    """
    device = device or torch.device("cpu")
    codec = args.codec or default_codec()
    data = args.data or os.path.join(
        tempfile.gettempdir(),
        f"sbloader-videos-{args.videos}x{args.frames}-{args.width}x{args.height}-{codec}-s{args.seed}")
    if rank == 0:
        write_video_folder(data, args.videos, seed=args.seed, frames=args.frames, width=args.width,
                           height=args.height, codec=codec, gop_size=16)
    barrier()
    paths = sorted(os.path.join(data, f) for f in os.listdir(data) if _INDEX.search(f))[:args.videos]
    ds = sbloader.read_videos(paths, clip_len=args.clip_len, frame_stride=args.frame_stride,
                              frames_per_partition=args.frames_per_partition)
    if not ds.num_rows():
        raise ValueError(f"no clip of {args.clip_len}x{args.frame_stride} frames fits in {args.frames} frames; "
                         f"lower --clip-len or --frame-stride, or raise --frames")
    if ds.num_partitions() < world:
        raise ValueError(f"{ds.num_partitions()} partitions for {world} ranks: every rank needs one; "
                         f"add --videos or lower --frames-per-partition")
    # The same seed on every rank: the ranks split one epoch plan.
    loader = ds.to_dataloader(batch_size=args.batch_size, shuffle=True, seed=args.seed)

    torch.manual_seed(args.seed)
    model = TinyVideoNet(args.classes).to(device)
    if world > 1:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    step = clips = 0
    loss_value = float("nan")
    t0 = time.perf_counter()
    first_batch_s = None
    while step < args.steps:
        for batch in loader:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - t0
            x = clips_to_input(batch["clip"].to(device))
            y = labels_from_paths(batch["path"], args.classes).to(device)
            real = ~batch[PADDING].to(device) if PADDING in batch else torch.ones_like(y, dtype=torch.bool)
            loss = (loss_fn(model(x), y) * real).sum() / real.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_value = float(loss.detach())
            clips += int(real.sum())
            step += 1
            if step >= args.steps:
                break
    wall = time.perf_counter() - t0
    frames = clips * args.clip_len
    return {"steps": step, "clips": clips, "frames": frames, "wall_s": wall, "first_batch_s": first_batch_s,
            "clips_per_s": clips / wall, "frames_per_s": frames / wall, "loss": loss_value,
            "partitions": ds.num_partitions(), "codec": codec}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the trainer (one process, or one rank under torchrun)."""
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    sbloader.init()
    try:
        r = train(args, rank, world, device)
    finally:
        sbloader.shutdown()  # under torchrun, local rank 0 waits for the others to leave
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    print(f"rank {rank}/{world}: {r['steps']} steps, {r['clips']} clips ({r['frames']} frames, {r['codec']}, "
          f"{r['partitions']} partitions) in {r['wall_s']:.2f}s = {r['clips_per_s']:.1f} clips/s, "
          f"{r['frames_per_s']:.0f} frames/s (first batch after {r['first_batch_s']:.2f}s), "
          f"last loss {r['loss']:.3f}", flush=True)
    return r


if __name__ == "__main__":
    main()

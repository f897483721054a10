"""The command line: options, the embedded Ray's size, and :func:`main` (one process, or one rank under torchrun)."""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from typing import Any, Optional, Sequence

import torch.distributed as dist

import sd
from common import barrier, setup_distributed
from sd.checkpoints import latest_checkpoint
from sd.denoiser import DOWNSAMPLE
from sd.loop import train


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (validated)."""
    p = argparse.ArgumentParser(description=sd.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loader", choices=["sbloader", "torch"], default="sbloader")
    p.add_argument("--images", type=int, default=256, help="generated image/caption rows")
    p.add_argument("--size", type=int, default=64, help="training resolution (a multiple of 16)")
    p.add_argument("--rows-per-group", type=int, default=16, help="Parquet row group size (= partition size)")
    p.add_argument("--data", default=None, help="folder of the generated data (default: a temp folder)")
    p.add_argument("--format", choices=["parquet", "webdataset"], default="parquet",
                   help="what the data is generated as and read from: one Parquet file, or WebDataset shards "
                        "laid out as img2dataset writes them (jpg + txt + json per sample; --loader sbloader)")
    p.add_argument("--samples-per-shard", type=int, default=64, help="samples per WebDataset shard")
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
    for name in ("images", "size", "rows_per_group", "samples_per_shard", "batch_size", "steps", "base", "max_tokens", "text_dim",
                 "encode_batch", "encoder_actors", "ckpt_every", "keep_ckpts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, found {getattr(args, name)}")
    if args.size % (2 * DOWNSAMPLE):
        p.error(f"--size must be a multiple of {2 * DOWNSAMPLE} (latents are /8, the UNet halves them), "
                f"found {args.size}")
    if args.format == "webdataset" and args.loader != "sbloader":
        p.error("--format webdataset needs --loader sbloader (the torch baseline reads the Parquet file)")
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

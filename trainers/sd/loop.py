"""The training loop: one rank's run from its loader's batches to the run's figures."""
from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common import barrier
from sd.checkpoints import write_checkpoint
from sd.data import dataset_path, write_dataset
from sd.denoiser import DDPM, TinyUNet, step_generator
from sd.sources import BatchSource, PipelineSource, TorchSource


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

"""Train a small ResNet-style CNN on a generated image set, with DDP under torchrun.

    python3 trainers/train_classifier.py                        # one process
    torchrun --standalone --nproc-per-node=2 trainers/train_classifier.py
    ... --loader torch                                          # torch's DataLoader, for comparison
    ... --resume                                                # continue from the last checkpoint

Preprocessing (PIL decode, random crop, flip) runs on Ray workers through
``sbloader.DataLoader``; each rank receives ready batches through the split
coordinator. Checkpoints every ``--ckpt-every`` steps hold the model, the optimiser
and the loader's state.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ImageFolderDataset, barrier, load_checkpoint, normalize,  # noqa: E402
                    save_checkpoint, setup_distributed)


class Block(nn.Module):
    """A residual block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    """A small ResNet-style classifier (randomly initialised)."""

    def __init__(self, classes: int, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "sbloader-classifier-jpegs"))
    p.add_argument("--images", type=int, default=800)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    p.add_argument("--loader", choices=["sbloader", "torch"], default="sbloader")
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "sbloader-classifier-ckpt"))
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.ckpt_every < 1:
        p.error(f"--ckpt-every must be a positive number of steps, found {args.ckpt_every}")

    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)
    if rank == 0:
        from sbloader.datagen import write_jpeg_folder

        write_jpeg_folder(args.data, args.images, num_classes=args.classes)
    barrier()
    dataset = ImageFolderDataset(args.data, size=args.size)
    if args.loader == "sbloader":
        import sbloader

        loader = sbloader.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                     persistent_workers=True, pin_memory=device.type == "cuda", drop_last=True,
                                     dataset_id="classifier-jpegs")
    else:
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(dataset) if world > 1 else None
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler,
                            num_workers=args.workers, persistent_workers=args.workers > 0,
                            pin_memory=device.type == "cuda", drop_last=True)

    model = SmallResNet(len(dataset.classes)).to(device)
    if world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    step, start_epoch = 0, 0
    if args.resume and (ckpt := load_checkpoint(ckpt_path)) is not None:
        (model.module if world > 1 else model).load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, start_epoch = ckpt["step"], ckpt["epoch"]
        if ckpt.get("loader") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(ckpt["loader"])
            # a checkpoint on an epoch's last step holds that epoch's empty remainder (torchdata's
            # StatefulDataLoader convention): training goes on with the next epoch
            start_epoch = ckpt["loader"]["epoch"] + (1 if ckpt["loader"].get("empty_remainder") else 0)
        elif step % len(loader) == 0:
            # no loader state (torch's DataLoader): a checkpoint on an epoch's last step starts the
            # next epoch, not that one again (a mid-epoch checkpoint restarts its epoch)
            start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed at step {step}, epoch {start_epoch}")

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.epochs * len(loader), initial=step, unit="step", disable=None)
    t0 = time.perf_counter()
    seen = 0
    loss = None  # stays None when a resumed run has no step left to do
    done = bool(args.max_steps and step >= args.max_steps)  # a checkpoint at or past --max-steps
    for epoch in range(start_epoch, args.epochs):
        if done:
            break
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = normalize(x.to(device, non_blocking=True)), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            seen += len(y) * world
            if bar is not None:
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
            if step % args.ckpt_every == 0:
                loader_state = loader.state_dict() if hasattr(loader, "state_dict") else None
                if rank == 0:
                    save_checkpoint(ckpt_path, model=(model.module if world > 1 else model).state_dict(),
                                    opt=opt.state_dict(), step=step, epoch=epoch, loader=loader_state)
            if args.max_steps and step >= args.max_steps:
                done = True
                break
    if bar is not None:
        bar.close()
        dt = time.perf_counter() - t0
        last = f"last loss {loss.item():.3f}" if loss is not None else "no step left to train"
        print(f"trained {step} steps, {seen} samples in {dt:.1f}s ({seen / dt:.0f} samples/s), {last}")
        stalls = getattr(loader, "stall_stats", lambda: None)()
        if stalls is not None:
            print(f"loader (rank 0, last epoch): {stalls}")
    barrier()


if __name__ == "__main__":
    main()

"""A torchrun job that checkpoints its loader and may SIGKILL itself, for resume tests.

``--loader dropin`` (the default) loads a map-style Dataset with ``sbloader.DataLoader``;
``--loader native`` the same ids through ``sbloader.range(...).map_batches(...).to_dataloader``.

Each rank appends, per step, the ids of its batch to ``OUT/run{R}.rank{r}.jsonl``
(with the augmentation values and, when the batch has padding rows, the padding
mask as ``pad``); rank 0 saves ``{"step", "loader"}`` to ``CKPT`` every
``--ckpt-every`` steps (JSON, atomically) and appends every state it saves to
``CKPT.history.jsonl``. ``--kill-at S`` makes rank 0 SIGKILL the whole job
(torchrun and every rank: each rank runs in a session of its own, so each writes
its process group to ``OUT/run{R}.rank{r}.pgid``) at step S. With an existing
CKPT the job resumes.

With ``--sync 1`` (the default) the ranks step in lockstep, as DDP's all-reduce
makes them: a gloo barrier ends every step, so when rank 0 checkpoints at step
k every rank has logged its step k (the state records every rank's first k
batches as consumed).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import time

import _hang_dump
from _job_common import add_job_args, load_checkpoint, make_loader, save_checkpoint


def kill_job(out: str, attempt: int) -> None:
    """SIGKILL the whole job: torchrun's group first (so it cannot react), every other rank's, then ours."""
    own = os.getpgid(0)
    groups = [os.getpgid(os.getppid())]
    for path in glob.glob(os.path.join(out, f"run{attempt}.rank*.pgid")):
        with open(path) as f:
            groups.append(int(f.read()))
    for g in dict.fromkeys(groups):
        if g != own:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.killpg(own, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    add_job_args(p, n=240, max_delay=0.01)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--in-order", type=int, default=0)
    p.add_argument("--sync", type=int, default=1)
    args = p.parse_args()
    _hang_dump.arm()

    rank = int(os.environ["RANK"])
    if args.sync:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    loader = make_loader(args, args.workers, in_order=bool(args.in_order))
    step = load_checkpoint(loader, args.ckpt)
    log = open(os.path.join(args.out, f"run{args.attempt}.rank{rank}.jsonl"), "a", buffering=1)
    # torchrun starts every rank in a session of its own: rank 0 needs each rank's group to kill the job
    with open(os.path.join(args.out, f"run{args.attempt}.rank{rank}.pgid"), "w") as f:
        f.write(str(os.getpgid(0)))
    for batch in loader:
        step += 1
        entry = {"step": step, "ids": batch["id"].tolist(), "aug": batch["aug"].tolist(), "t": round(time.time(), 3)}
        if "sbloader_padding" in batch:
            entry["pad"] = batch["sbloader_padding"].tolist()
        log.write(json.dumps(entry) + "\n")
        if args.sync:
            dist.barrier()
        if step % args.ckpt_every == 0:
            state = loader.state_dict()
            if rank == 0:
                save_checkpoint(args.ckpt, step, state)
                with open(args.ckpt + ".history.jsonl", "a") as f:
                    f.write(json.dumps({"attempt": args.attempt, "step": step, "loader": state}) + "\n")
        if rank == 0 and step == args.kill_at:
            kill_job(args.out, args.attempt)
    log.close()
    if args.sync:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

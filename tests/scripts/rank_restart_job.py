"""A torchrun job one of whose ranks SIGKILLs itself, alone, once; torchrun restarts the job (issue #46).

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 rank_restart_job.py --out DIR --ckpt FILE
        [--loader dropin|native] [--die-rank 1] [--die-at 10] [--ckpt-every 3]

The ranks step in lockstep (a gloo barrier ends every step, as DDP's all-reduce does);
rank 0 saves ``{"step", "loader"}`` to FILE after every ``--ckpt-every`` steps, and every
rank waits at a second barrier until it is saved (a checkpoint is collective). In the
first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank ``--die-rank`` SIGKILLs its own
process at step ``--die-at``, after logging it and before that step's barrier; torchrun
stops the other rank and starts the job again, which loads FILE. Each rank appends one
JSON line per step to ``DIR/attempt{A}.rank{R}.jsonl``: ``{"step", "ids"}``. The loaders
are those of ``resume_job.py`` (``_job_common.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import torch.distributed as dist

import _hang_dump
from _job_common import add_job_args, load_checkpoint, make_loader, save_checkpoint


def main() -> None:
    p = argparse.ArgumentParser()
    add_job_args(p, n=160, max_delay=0.0)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--die-at", type=int, default=10)
    args = p.parse_args()
    _hang_dump.arm()
    args.in_order = 0
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun's agent keeps one store across restarts and the workers' keys are not prefixed by
    # attempt: gloo would read the dead attempt's addresses ("Connection refused"). As DDP jobs
    # that restart do, prefix them (sbloader prefixes its own keys by restart count too).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    loader = make_loader(args, workers=2)
    step = load_checkpoint(loader, args.ckpt)
    log = open(os.path.join(args.out, f"attempt{attempt}.rank{rank}.jsonl"), "a", buffering=1)
    for batch in loader:
        step += 1
        log.write(json.dumps({"step": step, "ids": [int(i) for i in batch["id"]]}) + "\n")
        if attempt == 0 and rank == args.die_rank and step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # this rank alone; torchrun restarts the job
        dist.barrier()
        if step % args.ckpt_every == 0:
            state = loader.state_dict()
            if rank == 0:
                save_checkpoint(args.ckpt, step, state)
            # every rank waits for the save, as a trainer's collective checkpoint makes it: else rank 1 could
            # reach its death at step 10 while rank 0 still wrote step 9's, and a loaded machine resumed from 6
            dist.barrier()
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

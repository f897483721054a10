"""A torchrun job one of whose ranks SIGKILLs itself, alone, once; torchrun restarts the job (issue #46).

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 rank_restart_job.py --out DIR --ckpt FILE
        [--loader dropin|native] [--die-rank 1] [--die-at 10] [--ckpt-every 3]

The ranks step in lockstep (a gloo barrier ends every step, as DDP's all-reduce does);
rank 0 saves ``{"step", "loader"}`` to FILE after every ``--ckpt-every`` steps. In the
first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank ``--die-rank`` SIGKILLs its own
process at step ``--die-at``, after logging it and before that step's barrier; torchrun
stops the other rank and starts the job again, which loads FILE. Each rank appends one
JSON line per step to ``DIR/attempt{A}.rank{R}.jsonl``: ``{"step", "ids"}``. The loaders
are those of ``resume_job.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import torch.distributed as dist

import sbloader
from resume_job import Ids, native_loader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--loader", choices=["dropin", "native"], default="dropin")
    p.add_argument("--n", "--samples", dest="n", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--die-at", type=int, default=10)
    p.add_argument("--max-delay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    args.in_order = 0
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun's agent keeps one store across restarts and the workers' keys are not prefixed by
    # attempt: gloo would read the dead attempt's addresses ("Connection refused"). As DDP jobs
    # that restart do, prefix them (sbloader prefixes its own keys by restart count too).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    if args.loader == "native":
        loader = native_loader(args)
    else:
        loader = sbloader.DataLoader(Ids(args.n, args.max_delay), batch_size=args.batch_size, shuffle=True,
                                     num_workers=2, persistent_workers=True, seed=args.seed, dataset_id="ids")
    step = 0
    if os.path.exists(args.ckpt):
        with open(args.ckpt) as f:
            ckpt = json.load(f)
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
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
                with open(args.ckpt + ".tmp", "w") as f:
                    json.dump({"step": step, "loader": state}, f)
                os.replace(args.ckpt + ".tmp", args.ckpt)
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A torchrun job that logs, per rank, the sample ids of every batch it receives.

    torchrun --nproc-per-node=N tests/scripts/split_job.py --out DIR [--rows 103] [--epochs 2] ...
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Optional

import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, get_worker_info

import _hang_dump
import sbloader


def arrived(out: str, ranks: list) -> int:
    """Batches the training loops of ``ranks`` have taken so far (the whole lines of ``OUT/arrived{R}.txt``)."""
    n = 0
    for r in ranks:
        path = os.path.join(out, f"arrived{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                n += sum(1 for line in f if line.endswith("\n"))
    return n


def wait_for_arrivals(out: str, ranks: list, count: int, timeout_s: float) -> dict:
    """Wait until ``ranks`` took ``count`` batches (or ``timeout_s`` passed): how it ended and the count then."""
    deadline = time.monotonic() + timeout_s
    while (n := arrived(out, ranks)) < count:
        if time.monotonic() > deadline:
            return {"released_by": "timeout", "arrived": n, "wanted": count}
        time.sleep(0.05)
    return {"released_by": "count", "arrived": n, "wanted": count}


class Ids(Dataset):
    """Sample ``i`` is ``{"id": i, "x": a small tensor}``; optional per-sample delay.

    The ``straggler`` sample sleeps ``straggler_s``; with ``hold_dir`` it is held instead until the
    ranks' training loops took ``hold_count`` batches (``OUT/arrived{R}.txt``), ``straggler_s`` at
    most, and says which ended the hold in ``hold_dir/straggler.json``."""

    def __init__(self, n: int, delay: float = 0.0, straggler: int = -1, straggler_s: float = 0.0,
                 payload: int = 16, hold_dir: str = "", hold_count: int = 0, world: int = 1) -> None:
        self.n, self.delay, self.straggler, self.straggler_s, self.payload = n, delay, straggler, straggler_s, payload
        self.hold_dir, self.hold_count, self.world = hold_dir, hold_count, world

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay:
            time.sleep(self.delay)
        if i == self.straggler and self.hold_dir:
            hold = wait_for_arrivals(self.hold_dir, list(range(self.world)), self.hold_count, self.straggler_s)
            path = os.path.join(self.hold_dir, "straggler.json")
            if not os.path.exists(path):  # the first hold only (a retried read is not held again)
                with open(path + ".tmp", "w") as f:
                    json.dump(hold, f)
                os.replace(path + ".tmp", path)
        elif i == self.straggler:
            time.sleep(self.straggler_s)
        return {"id": i, "x": torch.full((self.payload,), float(i))}


class FilteredIds(IterableDataset):
    """``{"id": i, "x": ...}`` for ``i < n`` except the multiples of 7 (the loader cannot know the
    total), sharded over the loader's workers by ``get_worker_info()``, as under torch."""

    def __init__(self, n: int, payload: int = 16) -> None:
        self.n, self.payload = n, payload

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            if i % 7:
                yield {"id": i, "x": torch.full((self.payload,), float(i))}


def _coordinator_info(loader: sbloader.DataLoader) -> dict:
    """The loader's coordinator process: pid and RSS (bytes)."""
    import ray

    return ray.get(loader._carry.coordinator.process_info.remote())


def job_coordinators(own_ids: list) -> list:
    """The names of the named actors in this job's namespace(s): every ``sbloader-*`` namespace that
    holds one of this job's coordinators (``own_ids``, actor ids). Other jobs on a shared cluster
    (each a namespace of its own) are left out; an extra coordinator of this job is listed."""
    import ray

    from sbloader.distributed.naming import NAMESPACE

    entries = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if str(a.get("namespace")).startswith(NAMESPACE)]
    ours = set()
    for a in entries:
        try:
            if ray.get_actor(a["name"], namespace=a["namespace"])._actor_id.hex() in own_ids:
                ours.add(a["namespace"])
        except ValueError:  # gone meanwhile
            continue
        except AssertionError:  # another job's actor still being created: Ray has no class for it yet
            continue  # (Ray 2.60: "Expected str or bytes, got <class 'NoneType'>"; the CI saw it once)
    return sorted(a["name"] for a in entries if a["namespace"] in ours)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", default="",
                   help="a JSON list of [name, [arguments]]: run each in turn in this job (its logs in OUT/name), "
                        "each after the first with a job id of its own (its own coordinators' namespace)")
    # --rows: torchrun's own parser rejects "--n" after the script (ambiguous prefix of its options).
    p.add_argument("--n", "--rows", dest="n", type=int, default=103)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shuffle", type=int, default=1)
    p.add_argument("--drop-last", type=int, default=0)
    p.add_argument("--in-order", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--distributed-sampler", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--step-s", type=float, default=0.0, help="seconds each other rank spends per batch")
    p.add_argument("--straggler", type=int, default=-1)
    p.add_argument("--straggler-s", type=float, default=0.0)
    p.add_argument("--straggler-release-after", type=int, default=0,
                   help="hold the straggler sample until the ranks took this many batches (straggler-s at most)")
    p.add_argument("--pace-slow-rank", type=int, default=0,
                   help="the slow rank takes its batch k+1 once the other ranks took 2(k+1) batches of their "
                        "epochs (slow-s at most per wait; each wait's end logged as 'pace'), instead of sleeping")
    p.add_argument("--payload", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=0.0, help="seconds a worker spends per sample")
    p.add_argument("--two-loaders", type=int, default=0)
    p.add_argument("--after-kill-s", type=float, default=0.0,
                   help="rank 0 sleeps this long after killing the coordinator")
    p.add_argument("--kill-coordinator-at", type=int, default=-1,
                   help="rank 0 kills the coordinator actor after this many batches of epoch 0")
    p.add_argument("--worker-cpus", type=float, default=1.0)
    p.add_argument("--sampler-drop-last", type=int, default=0)
    p.add_argument("--rss", type=int, default=0, help="log the coordinator's pid and RSS at start and end")
    p.add_argument("--break-after", type=int, default=-1,
                   help="every rank leaves epoch 0 after this many batches (a step limit)")
    p.add_argument("--iterable", type=int, default=0,
                   help="an IterableDataset (FilteredIds) with split=True: len(loader) is logged as None")
    return p


def main() -> None:
    p = _parser()
    args = p.parse_args()
    _hang_dump.arm()
    if not args.scenarios:
        run(args)
        return
    for k, (name, argv) in enumerate(json.loads(args.scenarios)):
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        # one torchrun job for several scenarios (the process starts are most of a small job's cost); each
        # later scenario is a job of its own to sbloader, as a separate torchrun job would be
        run(p.parse_args(["--out", out, *map(str, argv)]),
            job_id=None if k == 0 else f"{os.environ.get('TORCHELASTIC_RUN_ID', 'split')}-{name}")
        gc.collect()  # the scenario's loaders dropped: their coordinators retire, their pools' CPUs free


def run(args: argparse.Namespace, job_id: Optional[str] = None) -> None:
    """One scenario: its loaders' epochs, each rank's log in ``args.out``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds = Ids(args.n, delay=args.sample_s, straggler=args.straggler, straggler_s=args.straggler_s,
             payload=args.payload, hold_dir=args.out if args.straggler_release_after > 0 else "",
             hold_count=args.straggler_release_after, world=world)
    count_arrivals = args.straggler_release_after > 0 or args.pace_slow_rank
    others = [r for r in range(world) if r != args.slow_rank]
    kwargs = dict(batch_size=args.batch_size, num_workers=args.workers, drop_last=bool(args.drop_last),
                  in_order=bool(args.in_order), seed=args.seed, persistent_workers=True,
                  worker_num_cpus=args.worker_cpus)
    if job_id is not None:
        kwargs["job_id"] = job_id
    sampler = None
    if args.iterable:
        loader = sbloader.DataLoader(FilteredIds(args.n, args.payload), split=True, **kwargs)
    elif args.distributed_sampler:  # as a DDP script does: a process group, then the sampler
        import torch.distributed as dist

        dist.init_process_group("gloo")
        sampler = DistributedSampler(ds, shuffle=bool(args.shuffle), seed=args.seed or 0,
                                     drop_last=bool(args.sampler_drop_last))
        loader = sbloader.DataLoader(ds, sampler=sampler, **kwargs)
    else:
        loader = sbloader.DataLoader(ds, shuffle=bool(args.shuffle), **kwargs)
    loaders = [loader]
    if args.two_loaders:
        loaders.append(sbloader.DataLoader(ds, shuffle=False, **kwargs))
    try:
        length = len(loader)
    except TypeError:  # an IterableDataset split by the coordinator: unknown until the end
        length = None
    log = {"rank": rank, "world": world, "len": length, "epochs": [], "pid": os.getpid(),
           "t_start": time.time(), "pace": []}
    taken = 0  # batches of loader 0 this rank took, every epoch
    rss = []
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches = []
        for li, ld in enumerate(loaders):
            for batch in ld:
                t = time.time()  # arrival of the batch in the training loop
                ids = batch["id"].tolist()
                pad = batch.get("sbloader_padding")
                batches.append({"loader": li, "ids": ids, "t": t,
                                "pad": pad.tolist() if pad is not None else [False] * len(ids)})
                if args.rss and li == 0 and not rss:
                    rss.append(_coordinator_info(ld))
                if rank == 0 and epoch == 0 and li == 0 and len(batches) == args.kill_coordinator_at:
                    import ray

                    ray.kill(ld._carry.coordinator, no_restart=True)
                    log["killed_coordinator"] = ld._carry.coordinator._actor_id.hex()
                    # let the other ranks notice first: the rebuild must not depend on
                    # which rank reports first (their unseeded samplers drew other orders)
                    time.sleep(args.after_kill_s)
                if li == 0:
                    taken += 1
                if count_arrivals and li == 0:
                    with open(os.path.join(args.out, f"arrived{rank}.txt"), "a") as f:
                        f.write(f"{ids[0]}\n")
                if rank == args.slow_rank and args.pace_slow_rank:
                    total = length * args.epochs * len(others)  # every batch the other ranks take
                    log["pace"].append(wait_for_arrivals(args.out, others, min(2 * (taken + 1), total), args.slow_s))
                elif rank == args.slow_rank:
                    time.sleep(args.slow_s)
                elif args.step_s:
                    time.sleep(args.step_s)
                if epoch == 0 and len(batches) == args.break_after:
                    break
        log["epochs"].append(batches)
    log["t_end"] = time.time()
    log["wall_s"] = log["t_end"] - log["t_start"]
    if args.rss:
        rss.append(_coordinator_info(loader))
        log["coordinator_info"] = rss
    import ray

    log["coordinator_ids"] = [ld._carry.coordinator._actor_id.hex() for ld in loaders]
    log["coordinators"] = job_coordinators(log["coordinator_ids"])
    # Epochs the first loader's coordinator still holds (it drops an epoch once every
    # rank left it); waits a little for the other ranks' last calls to land.
    deadline = time.monotonic() + 10
    while True:
        held = [e for e in range(args.epochs) if ray.get(loader._carry.coordinator.delivery_log.remote(e))]
        if not held or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    log["held_epochs"] = held
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
    if sampler is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()

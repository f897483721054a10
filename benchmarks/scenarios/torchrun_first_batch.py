"""A torchrun job's first batch: ``torchrun --standalone --nproc-per-node=2`` (fresh processes),
each rank importing the loader and taking the first batches of ``DataLoader(list(range(rows)),
batch_size=32, shuffle=True, num_workers=2)``. sbloader's drop-in (the split coordinator; its
embedded Ray starts in the job) with ``seed=0`` and the split's local start (each rank's first
batches from its own forked workers, issue #44), the same without it
(``SBLOADER_SPLIT_LOCAL_BATCHES=0``: the coordinator's from the first batch), and unseeded (each
rank's shuffle is its own draw, so the ranks wait for rank 0's at the coordinator), against
torch's DataLoader over a ``DistributedSampler``; and a native pipeline's ``to_dataloader(32, shuffle=True,
seed=0)`` with and without its split local start; an ``IterableDataset`` of the same ids split by the
coordinator (``split=True``: each rank's first batches from its own worker shards on forked workers, then
the coordinator's, each shard in segments) against torch's over the same stream sharded by rank. The figure: the
job's first step, the slowest rank's seconds from its import to its first batch (DDP's first
step waits for every rank); the whole epoch's seconds beside it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, Outcome, Plan, run_interleaved

ORDER = 6
TITLE = "torchrun, 2 ranks: import to the job's first batch"
PARAMS = {"rows": 20000, "rounds": 3, "leave_out": []}
QUICK = {"rows": 4000, "rounds": 3,  # report --quick: 2 rounds in its share
         "leave_out": ["sbloader unseeded", "sbloader native seed=0, no local start", "sbloader IterableDataset, split",
                       "torch IterableDataset, sharded by rank"]}
SCRIPT = """
import json, os, sys, time
t0 = time.perf_counter()
kind, out = sys.argv[1], sys.argv[2]
if kind == "torch":
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler
    dist.init_process_group("gloo")
    data = list(range({rows}))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, shuffle=True), num_workers=2)
elif kind == "native":
    import sbloader
    loader = sbloader.range({rows}, rows_per_partition=500).to_dataloader(32, shuffle=True, seed=0)
elif kind.endswith("_iter"):
    from torch.utils.data import IterableDataset, get_worker_info
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    class Stream(IterableDataset):
        def __init__(self, by_rank):
            self.by_rank = by_rank
        def __iter__(self):
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
            if self.by_rank:  # torch: each rank reads its own share, as a user shards a stream by rank
                wid, nw = rank * nw + wid, ws * nw
            return iter(range(wid, {rows}, nw))
    if kind == "torch_iter":
        from torch.utils.data import DataLoader
        loader = DataLoader(Stream(True), batch_size=32, num_workers=2)
    else:
        import sbloader
        loader = sbloader.DataLoader(Stream(False), batch_size=32, num_workers=2, split=True)
else:
    import sbloader
    seed = 0 if kind == "sbloader_seed" else None
    loader = sbloader.DataLoader(list(range({rows})), batch_size=32, shuffle=True, num_workers=2, seed=seed)
first, n = None, 0
for batch in loader:
    if first is None:
        first = time.perf_counter() - t0
    n += len(batch["id"]) if kind == "native" else len(batch)
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
    json.dump({{"first_batch_s": first, "epoch_s": time.perf_counter() - t0, "rows": n}}, f)
"""
CONTENDERS = {"sbloader seed=0": ("sbloader_seed", {}),
              "sbloader seed=0, no local start": ("sbloader_seed", {"SBLOADER_SPLIT_LOCAL_BATCHES": "0"}),
              "sbloader unseeded": ("sbloader", {}), "torch": ("torch", {}),
              "sbloader native seed=0": ("native", {}),
              "sbloader native seed=0, no local start": ("native", {"SBLOADER_SPLIT_LOCAL_BATCHES": "0"}),
              "sbloader IterableDataset, split": ("sbloader_iter", {}),
              "torch IterableDataset, sharded by rank": ("torch_iter", {})}


def plan(**p: Any) -> Plan:
    """The contenders (``leave_out=`` names some not to run), a fresh torchrun job per run."""
    return Plan([n for n in CONTENDERS if n not in p["leave_out"]], p["rounds"],
                notes=f"2 ranks, {p['rows']} rows, batch 32, 2 workers per rank; "
                      "no RAY_ADDRESS: the job's embedded Ray starts")


def job(kind: str, env_extra: dict, rows: int) -> dict[str, float]:
    """One torchrun job; the slowest rank's first batch and epoch, and the job's life."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory() as out:
        script = Path(out) / "job.py"
        script.write_text(SCRIPT.format(rows=rows))
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(script), kind, out], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        life = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"{kind}: exit status {r.returncode}: {r.stderr.strip()[-400:]}")
        ranks = [json.loads((Path(out) / f"rank{i}.json").read_text()) for i in range(2)]
    if sum(x["rows"] for x in ranks) < rows:
        raise RuntimeError(f"{kind}: the ranks took {[x['rows'] for x in ranks]} rows of {rows}")
    return {"first_batch_s": max(x["first_batch_s"] for x in ranks), "epoch_s": max(x["epoch_s"] for x in ranks),
            "job_s": life}


def run(**p: Any) -> Outcome:
    """``rounds`` jobs per contender, interleaved."""
    trials = run_interleaved({name: (lambda k=kind, e=extra: job(k, e, p["rows"]))
                              for name, (kind, extra) in CONTENDERS.items() if name not in p["leave_out"]},
                             p["rounds"])
    return Outcome(trials, "first_batch_s", "s", higher_is_better=False, baseline="torch",
                   extra=("epoch_s", "job_s"),
                   notes=["the slowest rank's import → first batch (DDP's first step waits for every rank); "
                          "job_s includes torchrun's start and the ranks' exit"])

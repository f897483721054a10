"""Driving ``_node_loss_job.py`` on a ``_cluster.Cluster`` from outside: launch, watch, kill, measure.

Shared by the ``node_loss`` scenario (recovery at 25/50/75% of an epoch) and
``tests/soak/fault_soak.py`` (random kill points).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.harness import ROOT


def progress(out: Path) -> list[dict]:
    """Every rank's JSON lines so far (``start`` lines and one per batch)."""
    lines = []
    for f in sorted(Path(out).glob("progress*.jsonl")):
        lines += [json.loads(x) for x in f.read_text().splitlines() if x.strip().endswith("}")]
    return lines


def batches(out: Path) -> list[dict]:
    """The batch lines so far."""
    return [b for b in progress(out) if "step" in b]


def torchrun(cluster: object, out: Path, path: str, nproc: int, rows: int, epochs: int, *extra: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node=nproc`` of the job, joined to the cluster with
    ``RAY_ADDRESS``; its output goes to ``OUT/output.txt``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "benchmarks.scenarios._node_loss_job", "--out", str(out), "--path", path,
           "--rows", str(rows), "--epochs", str(epochs), "--data-root", str(Path(out).parent), *extra]
    log = open(Path(out) / "output.txt", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(cluster.env, RAY_ADDRESS=cluster.address), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait(proc: subprocess.Popen, timeout: float) -> int:
    """The job's exit code; -9 when it ran past ``timeout`` (then its process group is killed)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return -9


def victim(nodes: dict, seen: list, rng: random.Random) -> str:
    """The CPU node (of ``nodes``) that made most of the batches ``seen``; a drawn one before any."""
    ran: dict[str, int] = {}
    for b in seen:
        for n in b.get("nodes", ()):
            if n in nodes:
                ran[n] = ran.get(n, 0) + 1
    return max(ran, key=lambda n: ran[n]) if ran else rng.choice(sorted(nodes))


def recovery(out: Path, t_kill: float) -> Optional[float]:
    """Kill -> the next batch on every rank (the slowest rank's first batch after it); None when
    some rank had no batch after it."""
    seen = batches(out)
    after: dict[int, float] = {}
    for b in seen:
        if b["t"] > t_kill:
            after[b["rank"]] = min(after.get(b["rank"], b["t"]), b["t"])
    if not after or set(after) != {b["rank"] for b in seen}:
        return None
    return round(max(after.values()) - t_kill, 2)


def counts_per_rank(out: Path, epoch: int) -> dict:
    """Batches each rank took in ``epoch``."""
    counts: dict[int, int] = {}
    for b in batches(out):
        if b["epoch"] == epoch:
            counts[b["rank"]] = counts.get(b["rank"], 0) + 1
    return counts

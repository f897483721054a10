"""Run chains of ``resume_job.py`` torchrun jobs and account for every sample.

A chain is a list of legs ``(nproc, kill_at)``: each leg is a torchrun job of
``nproc`` ranks that resumes from the checkpoint file (if any) and SIGKILLs the
whole job at global step ``kill_at`` (-1: runs to the end of the epoch). What a
killed leg *committed* is what its ranks logged at steps up to the checkpoint
it left behind (the one the next leg loads); a leg that finished commits
everything it logged. Padding rows (repeats marked by the loader) never count.
Exactly-once resume means the committed ids of the chain are the epoch, each
once. Used by tests/test_resume.py and benchmarks/soak_resume.py.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "resume_job.py"


class JobError(RuntimeError):
    """A leg failed (not by its own SIGKILL) or hung."""


@dataclass
class Leg:
    nproc: int
    kill_at: int
    returncode: int
    seconds: float
    start_step: int  # the checkpoint step it resumed from
    ckpt_step: int  # the checkpoint step it left behind
    steps: dict  # rank -> list of log entries
    output: str

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    def committed(self) -> list:
        """Ids this leg committed (real rows only)."""
        limit = self.ckpt_step if self.killed else float("inf")
        return [i for rank in sorted(self.steps) for e in self.steps[rank] if e["step"] <= limit
                for i in real_ids(e)]


@dataclass
class Chain:
    out: Path
    legs: list = field(default_factory=list)
    n: int = 240

    @property
    def ckpt(self) -> Path:
        return self.out / "ckpt.json"

    def committed(self) -> list:
        return [i for leg in self.legs for i in leg.committed()]

    def lost(self) -> list:
        return sorted(set(range(self.n)) - set(self.committed()))

    def duplicated(self) -> dict:
        """id -> times committed, for ids committed more than once."""
        return {i: c for i, c in collections.Counter(self.committed()).items() if c > 1}

    @property
    def finished(self) -> bool:
        return bool(self.legs) and not self.legs[-1].killed


def real_ids(entry: dict) -> list:
    pad = entry.get("pad") or [False] * len(entry["ids"])
    return [i for i, p in zip(entry["ids"], pad) if not p]


def read_steps(out: Path, attempt: int, nproc: int) -> dict:
    steps = {}
    for r in range(nproc):
        path = out / f"run{attempt}.rank{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        # a SIGKILL can cut the last line short: only whole lines count (never one at or before a checkpoint)
        steps[r] = [json.loads(s) for s in lines if s.endswith("}")]
    return steps


def ckpt_step(ckpt: Path) -> int:
    return json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0


def checkpoints(ckpt: Path) -> list:
    """Every state the chain saved, oldest first."""
    hist = Path(str(ckpt) + ".history.jsonl")
    return [json.loads(s) for s in hist.read_text().splitlines()] if hist.exists() else []


def run_leg(out: Path, ckpt: Path, nproc: int, attempt: int, kill_at: int = -1, timeout: float = 180.0,
            cluster_env: Optional[dict] = None, **flags) -> Leg:
    """One torchrun job of ``resume_job.py``; raises JobError unless it finished or killed itself.

    ``cluster_env``: the environment of a ``ray start`` cluster to join (``RAY_ADDRESS`` in it);
    None: the job starts its own embedded Ray."""
    if cluster_env is not None:
        env = dict(cluster_env)
        assert env.get("RAY_ADDRESS"), "cluster_env names no RAY_ADDRESS"
    else:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # the job starts its own embedded Ray
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # tests/scripts on the path: the loader's workers import the job's dataset and map (_job_common.py)
    path = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), str(REPO)] + ([path] if path else []))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(SCRIPT), "--out", str(out), "--ckpt", str(ckpt), "--attempt", str(attempt),
           "--kill-at", str(kill_at)]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    start = ckpt_step(ckpt)
    log_path = out / f"run{attempt}.output.txt"
    t0 = time.monotonic()
    # The job SIGKILLs its own process group: keep it out of ours. Its output goes to a file,
    # not a pipe: Ray's workers outlive a SIGKILLed job for a while and would hold a pipe open.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise JobError(f"leg {attempt} ({nproc} ranks, kill at {kill_at}) did not end within {timeout:.0f} s; "
                           f"output tail:\n{log_path.read_text()[-4000:]}") from None
    output = log_path.read_text()
    seconds = time.monotonic() - t0
    if proc.returncode not in (0, -signal.SIGKILL) or (proc.returncode != 0 and kill_at < 0):
        raise JobError(f"leg {attempt} ({' '.join(cmd[3:])}) failed with exit code {proc.returncode}; "
                       f"output tail:\n{output[-4000:]}")
    return Leg(nproc, kill_at, proc.returncode, seconds, start, ckpt_step(ckpt),
               read_steps(out, attempt, nproc), output)


def run_chain(out: Path, legs: list, n: int = 240, timeout: float = 180.0, cluster_env: Optional[dict] = None,
              **flags) -> Chain:
    """Run legs ``[(nproc, kill_at), ...]`` in ``out`` (one checkpoint file); stop once one finishes.
    ``cluster_env``: as :func:`run_leg`'s."""
    out.mkdir(parents=True, exist_ok=True)
    chain = Chain(out, n=n)
    for attempt, (nproc, kill_at) in enumerate(legs):
        chain.legs.append(run_leg(out, chain.ckpt, nproc, attempt, kill_at, timeout, cluster_env, samples=n,
                                  **flags))
        if not chain.legs[-1].killed:
            break
    return chain


def per_rank_ids(leg: Leg, after: int = 0) -> dict:
    """rank -> ids (padding included) of the leg's steps after ``after``, in step order."""
    return {r: [e["ids"] for e in entries if e["step"] > after] for r, entries in leg.steps.items()}


def per_rank_augs(leg: Leg, after: int = 0) -> dict:
    return {r: [e["aug"] for e in entries if e["step"] > after] for r, entries in leg.steps.items()}


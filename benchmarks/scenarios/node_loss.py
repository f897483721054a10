"""Losing a node mid-epoch on a real cluster (``ray start`` head + a second node on this
machine, as docs/multinode.md sets one up): a driver joins with ``RAY_ADDRESS`` and runs
one epoch of ``sbloader.range(rows).map_batches(f).to_dataloader(8, shuffle=True)``; the
second node's raylet and its workers are killed (SIGKILL) after ``kill_after`` batches.
The figure is the rest of the epoch from the kill on (from the same batch in the run
without a loss), beside the longest wait for a batch after it, the epoch's time and
whether every row came exactly once."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Optional

from benchmarks.harness import CLK_TCK, ROOT, Outcome, Plan, _read_stat, run_interleaved

ORDER = 60
TITLE = "Node loss mid-epoch on a ray start cluster: recovery time"
PARAMS = {"rows": 960, "partitions": 48, "delay": 0.05, "kill_after": 20, "timeout_s": 120, "rounds": 3}
QUICK = {"rows": 480, "partitions": 24, "kill_after": 10, "timeout_s": 90, "rounds": 2}


def plan(**p: Any) -> Plan:
    """A cluster per round: the run without a loss, then the run that loses node 2."""
    if p["kill_after"] * 8 >= p["rows"]:
        raise ValueError(f"kill_after={p['kill_after']} batches of 8 is past the epoch of {p['rows']} rows")
    return Plan(["no loss", "node 2 lost"], p["rounds"], notes="a new 2-node cluster per round")


def _cpu_s(pids: set) -> float:
    return sum((_read_stat(x) or (0, 0))[1] for x in pids) / CLK_TCK


def epoch(cluster: Any, p: dict, kill: bool) -> dict:
    """One driver run; kills node 2 after ``kill_after`` batches when ``kill``."""
    cmd = [sys.executable, "-m", "benchmarks.scenarios._node_loss_job", "--rows", str(p["rows"]),
           "--partitions", str(p["partitions"]), "--delay", str(p["delay"])]
    daemons = cluster.daemons()
    cpu0, kids0 = _cpu_s(daemons), resource.getrusage(resource.RUSAGE_CHILDREN)
    job = subprocess.Popen(cmd, cwd=ROOT, env=dict(cluster.env, RAY_ADDRESS=cluster.address), stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    times, ids, t_kill, start, done = [], [], None, None, False
    deadline = time.monotonic() + p["timeout_s"]
    try:
        for line in job.stdout:
            rec = json.loads(line)
            if "start" in rec:
                start = rec["start"]
            elif rec.get("done"):
                done = True
            else:
                times.append(rec["t"])
                ids += rec["ids"]
                if len(times) == p["kill_after"]:
                    t_kill = time.time()
                    if kill:
                        cluster.kill_node2()
            if time.monotonic() > deadline:
                break
    finally:
        job.kill()
        job.wait()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = _cpu_s(cluster.daemons() & daemons) - cpu0 + (kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime)
    if not done:
        raise RuntimeError(f"the epoch did not finish within {p['timeout_s']} s ({len(ids)} of {p['rows']} rows, "
                           f"{len(times)} batches)")
    return {"rest_s": times[-1] - t_kill, "stall_s": _stall(times, t_kill), "epoch_s": times[-1] - start,
            "exactly_once": float(
        sorted(ids) == list(range(p["rows"]))), "cpu_s": cpu}


def _stall(times: list, t_kill: Optional[float]) -> float:
    """The longest wait for a batch from ``t_kill`` on."""
    after = [t_kill] + [t for t in times if t > t_kill] if t_kill else times
    return max((b - a for a, b in zip(after, after[1:])), default=float("nan"))


def run(**p: Any) -> Outcome:
    """A new cluster per round (node 2 is gone after the loss run)."""
    from ._cluster import Cluster

    state: dict = {}

    def new_cluster(r: int) -> None:  # outside the measured runs: a ray start takes tens of seconds here
        if "c" in state:
            state.pop("c").stop()
        state["c"] = Cluster()

    try:
        trials = run_interleaved({"no loss": lambda: epoch(state["c"], p, kill=False),
                                  "node 2 lost": lambda: epoch(state["c"], p, kill=True)}, p["rounds"],
                                 rotate=False, before_round=new_cluster)
    finally:
        if "c" in state:
            state.pop("c").stop()
    diffs = sorted(a.metrics["rest_s"] - b.metrics["rest_s"] for a in trials.of("node 2 lost")
                   for b in trials.of("no loss") if a.round == b.round and not (a.error or b.error))
    notes = ([f"recovery cost (the rest of the epoch after the kill, lost minus no loss, same round): median "
              f"{diffs[len(diffs) // 2]:.1f} s (min {diffs[0]:.1f}, max {diffs[-1]:.1f})"] if diffs else [])
    return Outcome(trials, "rest_s", "s", higher_is_better=False, baseline="no loss",
                   extra=("stall_s", "epoch_s", "exactly_once"),
                   notes=notes + [f"{p['rows']} rows in {p['partitions']} partitions, {p['delay'] * 1000:.0f} ms of (sleeping) work "
                          f"per 10 rows, batches of 8; 2 logical CPUs per node on this {os.cpu_count()}-core machine",
                          "CPU of a run: the cluster's daemons and workers plus the driver process",
                          "exactly_once: 1 when every row came once in the epoch"])

"""A CPU node lost mid-epoch under a 2-rank torchrun job on a ``ray start`` cluster: how long
until every rank has its next batch, and what the loss costs the epoch.

The cluster of docs/multinode.md's quick start on this machine (``_cluster.py``): a head
with 1 CPU where the ranks train, two CPU nodes of 2 CPUs joined with ``ray start
--address``, each with its own log directory. One epoch of 480 samples (20 ms of sleeping
work each), batches of 8 (30 a rank), through the drop-in (a map-style dataset) or a
native pipeline (a function); the node that made most batches so far is SIGKILLed (every
process of it) after 25, 50 or 75% of the epoch's batches, beside a run without a loss in
the same round. Recovery: kill → the next batch on every rank. Slowdown: the epoch's wall
time (first rank's start to the last batch) over the same round's run without a loss.
The lost node is replaced between runs, outside the measurement. Ported from
``bench_node_loss.py`` (issue #35) onto the harness (issue #46).
"""
from __future__ import annotations

import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._fault_driver import batches, counts_per_rank, progress, recovery, torchrun, victim, wait

ORDER = 60
TITLE = "A CPU node lost mid-epoch under torchrun: recovery time and the epoch's slowdown"
PARAMS = {"modes": ["dropin", "native"], "at": [0.25, 0.5, 0.75], "rows": 480, "rounds": 3, "timeout_s": 300}
QUICK = {"modes": ["native"], "at": [0.5], "rounds": 2}
PATH = {"dropin": "dropin-map", "native": "native-fn"}


def _names(p: dict) -> list[str]:
    return [f"{m} {'no loss' if a is None else f'at {round(a * 100)}%'}" for m in p["modes"] for a in [None] + list(p["at"])]


def plan(**p: Any) -> Plan:
    """Per mode: a run without a loss, then one per kill point; one cluster for every run."""
    if not set(p["modes"]) <= set(PATH) or not all(0 < a < 1 for a in p["at"]):
        raise ValueError(f"modes must be among {sorted(PATH)} and each 'at' a fraction in (0, 1): {p}")
    return Plan(_names(p), p["rounds"], notes="one cluster; the lost node is replaced between runs")


def epoch(cluster: Any, p: dict, mode: str, at: Any) -> dict:
    """One 2-rank job of one epoch; kills the busiest CPU node after ``at`` of its batches."""
    while len(cluster.nodes) < 2:  # a node lost by the last run: replaced before this one starts
        cluster.add_node(2)
    out = Path(tempfile.mkdtemp(prefix="nl", dir="/tmp"))
    per_epoch = p["rows"] // 8
    proc = torchrun(cluster, out, PATH[mode], 2, p["rows"], 1)
    t_kill = None
    if at is not None:
        deadline = time.monotonic() + p["timeout_s"]
        while len(batches(out)) < int(at * per_epoch):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job ended or stalled before {at:.0%} of its epoch "
                                   f"({len(batches(out))} batches)")
            time.sleep(0.02)
        node = victim(cluster.nodes, batches(out), random.Random(0))
        t_kill = time.time()
        cluster.kill_node(node)
    rc = wait(proc, p["timeout_s"])
    seen = batches(out)
    ids = sorted(i for b in seen for i in b["ids"])
    counts = counts_per_rank(out, 0)
    if rc != 0 or ids != list(range(p["rows"])) or len(set(counts.values())) != 1:
        raise RuntimeError(f"exit {rc}; {len(ids)} ids ({len(set(ids))} distinct) of {p['rows']}; batches per "
                           f"rank {counts}; output: {(out / 'output.txt').read_text(errors='replace')[-600:]}")
    start = min(b["t"] for b in progress(out) if b.get("start"))
    rec = recovery(out, t_kill) if t_kill is not None else None
    lost = sum("lost node" in line for line in (out / "output.txt").read_text(errors="replace").splitlines())
    return {"epoch_s": round(max(b["t"] for b in seen) - start, 3), "recovery_s": math.nan if rec is None else rec,
            "exactly_once": 1.0, "lost_node_lines": float(lost)}


def run(**p: Any) -> Outcome:
    """Every contender on one cluster, interleaved by round."""
    from ._cluster import Cluster, cluster_tree

    cluster = Cluster(head_cpus=1, nodes=(2, 2))
    fns = {}
    for m in p["modes"]:
        for a in [None] + list(p["at"]):
            fns[_names({"modes": [m], "at": [a] if a is not None else []})[-1]] = \
                (lambda m=m, a=a: epoch(cluster, p, m, a))
    try:
        trials = run_interleaved(fns, p["rounds"], rotate=False, tree=cluster_tree(cluster))
    finally:
        cluster.stop()
    notes = []
    for m in p["modes"]:
        for a in p["at"]:
            name = _names({"modes": [m], "at": [a]})[-1]
            pairs = [(t.metrics["epoch_s"], b.metrics["epoch_s"]) for t in trials.of(name)
                     for b in trials.of(f"{m} no loss") if t.round == b.round and not (t.error or b.error)]
            if pairs:
                ratios = sorted(x / y for x, y in pairs)
                notes.append(f"{name}: the epoch took {ratios[len(ratios) // 2]:.2f}x the run without a loss "
                             f"(median of {len(ratios)} rounds, same round)")
    return Outcome(trials, "recovery_s", "s", higher_is_better=False, baseline=None,
                   extra=("epoch_s", "exactly_once", "lost_node_lines"),
                   notes=notes + [f"{p['rows']} samples of 20 ms (sleeping) work, batches of 8, 2 ranks; head 1 CPU, "
                                  "two CPU nodes of 2 logical CPUs on one machine",
                                  "recovery_s: kill → the next batch on every rank; nan for the runs without a loss",
                                  "lost_node_lines: 'lost node' lines in the job's output (one per event expected)"])

"""Recovery from a CPU node lost mid-epoch on a `ray start` cluster (issue #35).

    python3 -m benchmarks.bench_node_loss [--modes dropin native] [--at 0.25 0.5 0.75]

The cluster of ``tests/e2e/test_ray_cluster.py`` (127.0.0.1: a head with 1 CPU where two
torchrun ranks train, two CPU nodes of 2 CPUs); ``tests/scripts/node_loss_job.py``, one
epoch of 480 samples at 0.03 s each, batches of 8 (30 a rank). Per mode, one run without a
kill (the baseline), then one run per fraction of the epoch at which the node that
produced most batches so far is SIGKILLed (every process of it). Nothing is added back:
the survivors take the lost node's share.

Figures, per run: the recovery time, the longest wait for a batch on any rank from the
kill on (the gap that spans the node's death, from the last batch before it); the
epoch's wall time (first to last batch over both ranks) and its ratio to the baseline's.
Writes ``benchmarks/results/node_loss.{json,md}`` with the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import test_ray_cluster as rc  # noqa: E402  (the cluster harness of the e2e tests)

BATCHES = 60  # both ranks, one epoch


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def one_run(mode: str, at: float | None) -> dict:
    c = rc.Cluster(head_cpus=1, nodes=(2, 2))
    out = Path(tempfile.mkdtemp(prefix="nl", dir="/tmp"))
    load0 = _loadavg()
    try:
        procs = rc._torchrun(c, out, "--mode", mode, "--epochs", "1", script=rc.NODE_LOSS_JOB)
        killed_at, victim = None, None
        if at is not None:
            while len(rc._progress(out)) < int(at * BATCHES):
                assert all(p.poll() is None for p in procs), "a rank exited early"
                time.sleep(0.05)
            ran: dict[str, int] = {}
            for b in rc._progress(out):
                for n in b["nodes"]:
                    ran[n] = ran.get(n, 0) + 1
            victim = max((n for n in ran if n in c.node_raylets), key=lambda n: ran[n])
            c.kill_node(victim)
            killed_at = time.time()
        rcs = []
        for p in procs:
            p.communicate(timeout=600)
            rcs.append(p.returncode)
    finally:
        c.stop()
    lines = rc._progress(out)
    ts = sorted(b["t"] for b in lines)
    res = {"mode": mode, "at": at, "rcs": rcs, "batches": len(lines), "epoch_s": ts[-1] - ts[0],
           "load_before": load0, "load_after": _loadavg()}
    if killed_at is not None:
        gaps = []
        for r in range(2):
            rt = [json.loads(x)["t"] for x in (out / f"progress{r}.jsonl").read_text().splitlines()]
            before = [t for t in rt if t <= killed_at]
            after = [t for t in rt if t > killed_at]
            if after:
                gaps.append(max([after[0] - (before[-1] if before else killed_at)] +
                                [b - a for a, b in zip(after, after[1:])]))
        res["recovery_s"] = max(gaps) if gaps else None
        res["first_after_kill_s"] = min(t for t in ts if t > killed_at) - killed_at
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", nargs="+", default=["dropin", "native"])
    p.add_argument("--at", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "node_loss"))
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    runs = []
    for mode in args.modes:
        base = one_run(mode, None)
        runs.append(base)
        print(json.dumps(base), flush=True)
        for at in args.at:
            r = one_run(mode, at)
            r["slowdown"] = r["epoch_s"] / base["epoch_s"]
            runs.append(r)
            print(json.dumps(r), flush=True)
    Path(args.out + ".json").write_text(json.dumps(runs, indent=1))
    rows = ["| mode | killed at | ranks' exit | batches | recovery (longest wait for a batch) s | epoch s | "
            "epoch / baseline | load before → after |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rec = f"{r['recovery_s']:.1f}" if r.get("recovery_s") is not None else "-"
        when = "no kill" if r["at"] is None else f"{r['at']:.0%}"
        rows.append(f"| {r['mode']} | {when} | {r['rcs']} | "
                    f"{r['batches']} | {rec} | {r['epoch_s']:.1f} | {r.get('slowdown', 1.0):.2f} | "
                    f"{r['load_before']} → {r['load_after']} |")
    cmd = "python3 -m benchmarks.bench_node_loss " + " ".join(sys.argv[1:])
    Path(args.out + ".md").write_text(
        "# A CPU node lost mid-epoch: recovery (issue #35)\n\n"
        f"`{cmd}` on {os.cpu_count()} cores (one machine standing for three nodes; see the module's "
        "docstring). One run per row.\n\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()

"""Twenty random kills, nothing lost: a fault soak on a real cluster (issue #46). Not collected by pytest.

    PYTHONPATH=$PWD python3 tests/soak/fault_soak.py [--seed 46] [--out tests/soak/results] [--only K ...]

A ``ray start`` cluster on 127.0.0.1 (``benchmarks/scenarios/_cluster.py``): a head with 1
CPU where the ranks train, three CPU nodes of 2 CPUs joined with ``ray start --address``,
each with its own log directory. Each run is a 2-rank ``torchrun`` job
(``benchmarks/scenarios/_node_loss_job.py``, 480 samples, batches of 8, 2 epochs) over
one path (the drop-in: map-style with and without ``persistent_workers``, an
``IterableDataset``; native: a function, a callable-class pool, a read of Parquet files)
and kills CPU nodes (SIGKILL of every process of the node) at points drawn from the seed:

- ``random``: one node at a uniformly drawn batch of epochs 0–1 (both ranks' batches counted);
- ``first-second``: one node within the first second of epoch 0 (uniform in 0–1 s);
- ``last-batch``: one node when the last batch of epoch 0 (or 1) arrives on a rank;
- ``two-nodes``: two nodes at two drawn batches of one epoch;
- ``resume``: the job stops at a drawn step of epoch 0 with a checkpoint, a 1-rank job
  resumes it (another world size) and a node dies at a drawn batch of that resume;
- ``join``: a node starts joining and another dies at the same moment.

The victim is the CPU node that made most batches so far (by the samples' provenance),
or a drawn one before any batch. Every run must exit 0 with every sample exactly once per
epoch and equal batch counts per rank. Recovery time: from the kill to the next batch on
every rank (the slowest rank's first batch after it). The machine's load is recorded
before and after each run. Writes ``OUT/fault_soak.{json,md}``. Killed nodes are replaced
between runs (not measured).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.scenarios._cluster import Cluster  # noqa: E402
from benchmarks.scenarios._fault_driver import batches, counts_per_rank, progress, recovery, torchrun, victim  # noqa: E402
from benchmarks.scenarios._fault_driver import wait as wait_job  # noqa: E402
from benchmarks.scenarios._node_loss_job import PATHS  # noqa: E402

ROWS, BATCH, EPOCHS, NODES, NODE_CPUS = 480, 8, 2, 3, 2
PER_EPOCH = ROWS // BATCH  # batches of one epoch over both ranks
JOB_TIMEOUT_S = 420


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def schedule(seed: int) -> list[dict]:
    """The runs, drawn from ``seed``: 20 kill points over every path."""
    rng = random.Random(seed)
    runs = [{"kind": "random", "path": p, "kills": [rng.randrange(0, EPOCHS * PER_EPOCH)]}
            for p in PATHS + tuple(rng.sample(PATHS, 2))]
    runs += [{"kind": "first-second", "path": p, "kills": [("t", round(rng.uniform(0, 1), 3))]}
             for p in rng.sample(PATHS, 2)]
    runs += [{"kind": "last-batch", "path": p, "kills": [e * PER_EPOCH + PER_EPOCH - 2]}  # one batch left
             for e, p in enumerate(rng.sample(PATHS, 2))]
    for p in rng.sample(PATHS, 2):
        e = rng.randrange(EPOCHS)
        runs.append({"kind": "two-nodes", "path": p,
                     "kills": sorted(e * PER_EPOCH + k for k in rng.sample(range(PER_EPOCH), 2))})
    for p in ("dropin-map", "native-fn"):  # resume: 2 ranks stop at a drawn step, 1 rank resumes
        stop = rng.randrange(5, PER_EPOCH // 2 - 5)
        runs.append({"kind": "resume", "path": p, "stop_at": stop,
                     "kills": [rng.randrange(0, PER_EPOCH - 2 * stop + PER_EPOCH)]})
    runs += [{"kind": "join", "path": p, "kills": [rng.randrange(0, EPOCHS * PER_EPOCH)]}
             for p in rng.sample(PATHS, 2)]
    for k, r in enumerate(runs):
        r["run"] = k
    return runs


def drive(cluster: Cluster, out: Path, proc: subprocess.Popen, kills: list, run: dict,
          rng: random.Random) -> list[dict]:
    """Watch the job's progress, kill at each trigger; the kills made."""
    done, made, joining = list(kills), [], None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while done and proc.poll() is None and time.monotonic() < deadline:
        seen = batches(out)
        starts = [b["t"] for b in progress(out) if b.get("start")]
        k = done[0]
        hit = (starts and time.time() >= min(starts) + k[1]) if isinstance(k, tuple) else len(seen) > k
        if hit:
            node = victim(cluster.nodes, seen, rng)
            if run["kind"] == "join":
                joining = cluster.start_node(NODE_CPUS)
            t = time.time()
            cluster.kill_node(node)
            made.append({"trigger": k if not isinstance(k, tuple) else f"{k[1]} s", "t": t, "node": node[:12],
                         "batches_before": len(seen)})
            done.pop(0)
        time.sleep(0.02)
    run["joining"] = joining
    return made


def check(outs: list, run: dict) -> list[str]:
    """What went wrong (empty: exactly once per epoch, equal counts per rank)."""
    problems = []
    # a resumed run: the first leg committed what its ranks took up to its checkpoint (all it ran)
    taken = [b for out in outs for b in batches(out)]
    for e in range(EPOCHS):
        ids = sorted(i for b in taken if b["epoch"] == e for i in b["ids"])
        if ids != list(range(ROWS)):
            problems.append(f"epoch {e}: {len(ids)} ids, {len(set(ids))} distinct")
        for out in outs:
            counts = counts_per_rank(out, e)
            if len(set(counts.values())) > 1:
                problems.append(f"epoch {e}: unequal batch counts per rank {counts}")
    return problems


def one(cluster: Cluster, run: dict, seed: int, root: Path) -> dict:
    rng = random.Random(seed * 1000 + run["run"])
    out = root / f"run{run['run']:02d}"
    out.mkdir(parents=True)
    load0, t0 = loadavg(), time.time()
    if run["kind"] == "resume":
        ckpt = out / "ckpt.json"
        rcs = [wait_job(torchrun(cluster, out, run["path"], 2, ROWS, EPOCHS, "--stop-at", str(run["stop_at"]),
                                 "--ckpt", str(ckpt)), JOB_TIMEOUT_S)]
        out2 = root / f"run{run['run']:02d}b"
        out2.mkdir()
        proc = torchrun(cluster, out2, run["path"], 1, ROWS, EPOCHS, "--resume", str(ckpt))
        kills = drive(cluster, out2, proc, run["kills"], run, rng)
        rcs.append(wait_job(proc, JOB_TIMEOUT_S))
        outs = [out, out2]
    else:
        proc = torchrun(cluster, out, run["path"], 2, ROWS, EPOCHS)
        kills = drive(cluster, out, proc, run["kills"], run, rng)
        rcs, outs = [wait_job(proc, JOB_TIMEOUT_S)], [out]
    joining = run.pop("joining", None)
    if joining is not None:  # the node that joined while another died: it stays for the next runs
        cluster.joined(joining)
    problems = [f"exit {rc}" for rc in rcs if rc != 0] + check(outs, run)
    if len(kills) < len(run["kills"]):
        problems.append(f"only {len(kills)} of {len(run['kills'])} kills made (the job ended first)")
    lost_lines = sum(1 for o in outs for line in (o / "output.txt").read_text(errors="replace").splitlines()
                     if "lost node" in line)
    for k in kills:
        k["recovery_s"] = recovery(outs[-1], k["t"])
        k["t_s"] = round(k.pop("t") - t0, 2)
    return {**{k: v for k, v in run.items()}, "kills_made": kills, "seconds": round(time.time() - t0, 1),
            "load_before": load0, "load_after": loadavg(), "lost_node_lines": lost_lines,
            "result": "ok" if not problems else "; ".join(problems)}


def restore(cluster: Cluster) -> None:
    """Back to NODES CPU nodes (the joining ones counted once they joined)."""
    while len(cluster.nodes) < NODES:
        cluster.add_node(NODE_CPUS)


def markdown(report: dict) -> str:
    lines = [f"# Fault soak: {report['kills']} kills on a `ray start` cluster (seed {report['seed']})", "",
             f"Command: `{report['command']}`. Commit {report['commit']}. {report['started']} → {report['ended']}.",
             "", f"**Load: the machine was shared and loaded (load average {report['load_min']}–{report['load_max']} "
             f"on {os.cpu_count()} cores over the soak). Recovery times are under that load, not quiet figures.**",
             "", f"Runs ok: {report['ok']} of {len(report['runs'])}; kills made: {report['kills']}.", "",
             "| run | kind | path | kill (trigger → time since start) | node | recovery s | lost-node lines | "
             "load before/after | result |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        ks = "<br>".join(f"{k['trigger']} → {k['t_s']} s" for k in r["kills_made"]) or "none"
        nodes = "<br>".join(k["node"] for k in r["kills_made"])
        rec = "<br>".join("–" if k["recovery_s"] is None else str(k["recovery_s"]) for k in r["kills_made"])
        lines.append(f"| {r['run']} | {r['kind']}{' stop ' + str(r['stop_at']) if r.get('stop_at') else ''} | "
                     f"{r['path']} | {ks} | {nodes} | {rec} | {r['lost_node_lines']} | {r['load_before']} / "
                     f"{r['load_after']} | {r['result']} |")
    lines += ["", "Trigger: the count of batches (both ranks) logged before the kill, or seconds after the job's "
              "start. Recovery: kill → the next batch on every rank (–: no rank had a batch left after it)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=46)
    ap.add_argument("--out", default=str(ROOT / "tests" / "soak" / "results"))
    ap.add_argument("--only", type=int, nargs="*", help="run only these run numbers")
    a = ap.parse_args()
    runs = [r for r in schedule(a.seed) if not a.only or r["run"] in a.only]
    root = Path(tempfile.mkdtemp(prefix="soak", dir="/tmp"))
    started, results, loads = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), [], [loadavg()]
    cluster = Cluster(head_cpus=1, nodes=(NODE_CPUS,) * NODES)
    try:
        for run in runs:
            restore(cluster)
            res = one(cluster, dict(run), a.seed, root)
            results.append(res)
            loads += [res["load_before"], res["load_after"]]
            print(json.dumps({k: res[k] for k in ("run", "kind", "path", "kills_made", "result")}), flush=True)
    finally:
        cluster.stop()
    firsts = [float(x.split()[0]) for x in loads]
    commit = os.environ.get("SOAK_COMMIT") or subprocess.run(  # SOAK_COMMIT: run from an exported snapshot
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report = {"seed": a.seed, "command": " ".join(["python3"] + sys.argv), "commit": commit.strip(),
              "started": started, "ended": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "load_min": min(firsts), "load_max": max(firsts), "cpu_count": os.cpu_count(),
              "kills": sum(len(r["kills_made"]) for r in results), "ok": sum(r["result"] == "ok" for r in results),
              "runs": results}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "fault_soak" if not a.only else "fault_soak_partial"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown(report))
    print(f"{report['ok']} of {len(results)} runs ok, {report['kills']} kills; {out / name}.md")


if __name__ == "__main__":
    main()

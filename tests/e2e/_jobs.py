"""torchrun jobs of the e2e tests: one standalone job on its own embedded Ray, or two
torchrun agents (two machines of one GPU in docs/multinode.md) joining a ``ray start``
cluster; what their ranks log per batch and per epoch; the kill of the node that ran
most of a job's batches.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _cluster import Cluster, free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"


def run_standalone(out: Path, script: Path, *args: str, max_restarts: int = 0, world: int = 2,
                   timeout_s: float = 240) -> tuple[int, str]:
    """``torchrun --standalone --nproc-per-node=WORLD --max-restarts=N script --out OUT *args`` in its
    own session, on its own embedded Ray (``tests/scripts`` importable): (exit code, output). A job
    past ``timeout_s`` is killed (its whole process group) and reads as exit -9."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("RAY_ADDRESS", None)  # the job starts its own embedded Ray
    env["SBLOADER_TEST_DUMP_AFTER"] = str(max(1.0, timeout_s - 20))  # _hang_dump: where a hung job's threads are
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           f"--max-restarts={max_restarts}", str(script), "--out", str(out), *args]
    with open(out / "output.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    output = (out / "output.txt").read_text(errors="replace")
    if rc == -9:  # the job hung: where its ranks were, at the end (the tests show the output's tail)
        output += "".join(hung_stacks(f) for f in sorted(out.glob("stacks-*.txt")))
    return rc, output


def hung_stacks(path: Path) -> str:
    """A rank's stacks at its dump (``tests/scripts/_hang_dump.py``): the threads in sbloader's or the
    job script's code, innermost frame first as faulthandler writes them, 14 frames each."""
    blocks = path.read_text(errors="replace").split("\n\n")
    kept = ["\n".join(b.splitlines()[:15]) for b in blocks if "sbloader" in b or "/tests/" in b]
    return f"==== {path.name}\n" + "\n\n".join(kept) + "\n"


def run_side_by_side(jobs: dict) -> dict:
    """:func:`run_standalone` for every job of ``jobs`` (``{key: (out, script, args, kwargs)}``) at once,
    each a job of its own on its own embedded Ray: ``{key: (exit code, output)}``."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(run_standalone, out, script, *args, **kwargs)
                   for key, (out, script, args, kwargs) in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def torchrun_agents(cluster: Cluster, out: Path, script: Path, *args: str, env: dict | None = None) -> list:
    """Two torchrun agents of one rank each (two machines of one GPU in docs/multinode.md), one job
    joined to ``cluster`` with ``RAY_ADDRESS``: their processes."""
    rdzv = free_port()
    procs = []
    for node_rank in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv}",
               f"--rdzv-id=job-{out.name}", "--max-restarts=0", str(script), "--out", str(out), *args]
        procs.append(subprocess.Popen(cmd, env=dict(cluster.env, RAY_ADDRESS=cluster.address, **(env or {})),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def wait_ranks(procs: list, timeout: float = 300) -> str:
    """The agents' output once all exited 0; fails (killing them all) past ``timeout`` or on a failure."""
    deadline = time.monotonic() + timeout
    out = ""
    for p in procs:
        try:
            out += p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] or ""
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"the job hung for {timeout:.0f} s")
        assert p.returncode == 0, f"a rank failed (rc {p.returncode}):\n{out[-4000:]}"
    return out


def progress(out: Path) -> list[dict]:
    """Every batch the 2 ranks logged so far (``progress{R}.jsonl``; a line being written is left out)."""
    lines = []
    for r in range(2):
        path = out / f"progress{r}.jsonl"
        if path.exists():
            lines += [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
    return lines


def epochs_of(out: Path) -> list[list[dict]]:
    """Per epoch, each of the 2 ranks' entry of its ``rank{R}.json``."""
    logs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return [[log["epochs"][e] for log in logs] for e in range(len(logs[0]["epochs"]))]


def kill_busiest_node_after(cluster: Cluster, out: Path, procs: list, batches: int) -> tuple[str, dict]:
    """Wait for ``batches`` batches of epoch 0, then SIGKILL the CPU node that made most of them:
    (its id, the batches each node had made by then)."""
    deadline = time.monotonic() + 240
    while sum(1 for b in progress(out) if b["epoch"] == 0) < batches:
        assert time.monotonic() < deadline, "the job made no progress"
        assert all(p.poll() is None for p in procs), "a rank exited early"
        time.sleep(0.2)
    ran: dict[str, int] = {}
    for b in progress(out):
        for n in b["nodes"]:
            ran[n] = ran.get(n, 0) + 1
    victim = max((n for n in ran if n in cluster.node_raylets), key=lambda n: ran[n])
    cluster.kill_node(victim)
    return victim, ran


def kill_unfetched_shard_node(cluster: Cluster, out: Path, procs: list, hold_at: int) -> tuple[str, int, float]:
    """(``node_loss_job.py --mode iter --hold-at N``) Once both ranks hold after their ``N``-th batch of
    epoch 0 and both worker shards were made to their end (``shards.jsonl``; the coordinator makes each
    in segments, round after round, on the actor that holds its generator), SIGKILL the CPU node that
    made the shard with the most batches no rank has fetched: its last segments' blocks, made and not
    yet fetched, live only there. Returns (its id, the shard, the time of the kill)."""
    deadline = time.monotonic() + 240
    shards: dict = {}
    while True:
        assert time.monotonic() < deadline, f"no hold with both shards made: {shards}, {len(progress(out))} batches"
        assert all(p.poll() is None for p in procs), "a rank exited early"
        path = out / "shards.jsonl"
        if path.exists():
            shards = {s["shard"]: s["node"] for s in map(json.loads, path.read_text().splitlines()) if s}
        if len(shards) == 2 and sum(1 for b in progress(out) if b["epoch"] == 0) >= 2 * hold_at:
            break
        time.sleep(0.2)
    time.sleep(2.0)  # not an assert: a margin for the last shard's block to be stored after its last sample
    consumed = [0, 0]  # shard w has the ids w, w + 2, ...
    for b in progress(out):
        for i in b["ids"]:
            consumed[i % 2] += 1
    on_cpu_nodes = [w for w in sorted(shards) if shards[w] in cluster.node_raylets]
    assert on_cpu_nodes, f"both shards were made on the head node, not a CPU node: {shards}"
    shard = min(on_cpu_nodes, key=lambda w: consumed[w])  # its rows all made (its end written), fewest fetched
    victim = shards[shard]
    cluster.kill_node(victim)
    return victim, shard, time.time()

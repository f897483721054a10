"""The Stable-Diffusion-style training loop (``trainers/sd``: Parquet rows of JPEG bytes and
captions -> decode, resize, crop, flip, tokenize -> a small VAE and text encoder -> a small
UNet trained with the DDPM loss, 64 px, batches of 8, on CPU), fed three ways: torch's
DataLoader on the trainer's node alone (the encoders in the trainer), sbloader and Ray
Data on a ``ray start`` cluster whose second node is a CPU node. The nodes are emulated on
this machine by CPU affinity: the trainer and the head node on core 0 (the trainer node),
the second node on core 1 (the CPU node). Figures, both after the first batch (its wait is
reported apart): training samples/s and the stall fraction (the loop's time waiting in
``next()``; for torch it includes the encoding done in the trainer). Ported from ``bench_sd.py``."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Any

from benchmarks.harness import CLK_TCK, ROOT, Outcome, Plan, _read_stat, descendants, run_interleaved

from ._common import DATA, missing_peers

ORDER = 45
TITLE = "SD-style training: sbloader on a CPU node vs single-node torch vs Ray Data"
PARAMS = {"images": 2048, "size": 64, "rows_per_group": 16, "batch_size": 8, "encode_batch": 16, "workers": 1,
          "raydata_block_kib": 256, "timeout_s": 600, "rounds": 3}
# --quick: 16 steps of 8. Most of a quick run is each run's start-up, which the epoch's size does not
# change (trainer process, pipeline, first batch: ~4 s torch, ~14 s sbloader, ~28 s Ray Data); at 512
# images the epochs after the first batch were ~21 s of the runs' 115 s
QUICK = {"images": 128, "timeout_s": 240, "rounds": 2}
PEERS = {"Ray Data": "ray.data"}
CONTENDERS = ["torch", "sbloader"]


def plan(**p: Any) -> Plan:
    """torch (no Ray), then the two cluster contenders; one cluster for every round."""
    if p["images"] < 4 * p["batch_size"]:
        raise ValueError(f"images={p['images']} is under 4 batches of {p['batch_size']}")
    skipped = missing_peers(PEERS)
    return Plan(CONTENDERS + [k for k in PEERS if k not in skipped], p["rounds"], skipped,
                notes="one 2-node ray start cluster, pinned: head + trainer on core 0, node 2 on core 1")


def _pin(pids: set, cores: set) -> None:
    for pid in pids:
        try:
            os.sched_setaffinity(pid, cores)
        except OSError:  # gone
            pass


def _cpu_s(pids: set) -> float:
    return sum((_read_stat(x) or (0, 0))[1] for x in pids) / CLK_TCK


def job(name: str, p: dict, data: str, cluster: Any) -> dict:
    """One training epoch in a trainer process of its own, pinned to core 0."""
    cfg = dict(p, contender=name, data=data, cores=[0])
    env = dict(os.environ)
    if cluster is not None:
        env = dict(cluster.env, RAY_ADDRESS=cluster.address)
    daemons = cluster.daemons() if cluster is not None else set()
    cpu0, kids0 = _cpu_s(daemons), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        r = subprocess.run([sys.executable, "-m", "benchmarks.scenarios._sd_job", json.dumps(cfg)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=p["timeout_s"])
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise RuntimeError(f"{name}'s trainer did not finish in {p['timeout_s']} s: {err[-800:]}") from None
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{name}'s trainer failed (rc {r.returncode}): {r.stderr[-800:]}")
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = json.loads(lines[-1])
    if cluster is not None:  # the cluster's processes are outside this process tree
        out["cpu_s"] = (_cpu_s(cluster.daemons()) - cpu0  # workers started during the run count whole
                        + kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime)
    steady_wall = out["wall_s"] - out["first_batch_s"]  # both figures after the first batch (start-up apart)
    return {"samples_per_s": out["steady_samples_per_s"] or out["samples_per_s"],
            "stall_fraction": (out["wait_s"] - out["first_batch_s"]) / steady_wall if steady_wall > 0 else float("nan"),
            "first_batch_s": out["first_batch_s"],
            **({"cpu_s": out["cpu_s"]} if "cpu_s" in out else {})}


def _write_data(p: dict, data: str) -> None:
    sys.path.insert(0, str(ROOT / "trainers"))
    from sd.data import dataset_path, write_dataset

    from ._sd_job import sd_args

    args = sd_args(dict(p, data=data), "torch")
    write_dataset(dataset_path(args), args)


def run(**p: Any) -> Outcome:
    """The data once; one cluster (its Ray workers import ``trainers/``) for every round."""
    from ._cluster import Cluster, cluster_tree

    data = str(DATA / "sd")
    _write_data(p, data)
    if (os.cpu_count() or 1) < 2:
        raise RuntimeError("the emulated CPU node needs a second core")
    skipped = missing_peers(PEERS)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "trainers")] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    cluster = Cluster(head_cpus=2, nodes=(2,))
    try:
        node2 = descendants(cluster.node2)  # the raylets' later workers inherit their core
        _pin(cluster.daemons() - node2, {0})
        _pin(node2, {1})
        contenders = {"torch": lambda: job("torch", p, data, None),
                      "sbloader": lambda: job("sbloader", p, data, cluster)}
        if "Ray Data" not in skipped:
            contenders["Ray Data"] = lambda: job("Ray Data", p, data, cluster)
        trials = run_interleaved(contenders, p["rounds"], tree=cluster_tree(cluster))
    finally:
        cluster.stop()
    steps = p["images"] // p["batch_size"]
    return Outcome(trials, "samples_per_s", "samples/s", baseline="torch",
                   extra=("stall_fraction", "first_batch_s"), skipped=skipped,
                   notes=[f"one epoch of {p['images']} rows ({steps} steps of {p['batch_size']}), {p['size']} px, "
                          f"a new trainer process per run; torch: {p['workers']} DataLoader worker(s) on core 0",
                          "the cluster: 2 logical CPUs per node; node 2 pinned to core 1, the head and the "
                          "trainer to core 0 (BENCHMARKING.md's emulated scale-out)",
                          "CPU of a cluster run: the trainer plus the cluster's daemons and workers",
                          "a pipeline keeps encoding while its first batch is awaited: on a short epoch the figures "
                          "after it include draining that buffer (bench_sd cut the window at the last encoding; "
                          "not ported), so quote the full size"])

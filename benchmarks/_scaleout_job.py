"""The trainer of ``bench_scaleout.py`` (benchmark only): one job per cluster shape.

    taskset -c 0 python benchmarks/_scaleout_job.py --paths-file F --out OUT.json \\
        --extra-nodes K --extra-cores 1 [--epochs E]

Started pinned to the trainer's cores (``taskset``), it starts the head: the
embedded Ray of ``sbloader.init(num_cpus=<trainer's cores>)``, whose daemons and
workers inherit the pinning. Then it adds ``K`` "CPU nodes", each a Ray worker
node with ``--num-cpus=1`` pinned to one other core (``taskset -c <core>
_scaleout_node.py --address=<head>``: what ``ray start --address --block`` does,
bound to loopback; see that file for why not the ``ray start`` command itself),
joined with the head's auth token, each in its own session (process group) so
that exactly those processes are stopped at the end (SIGTERM to the group we
started, then SIGKILL by pid to anything left; no ``ray stop``, which would stop
every Ray on the machine). Every address the node's processes listen on is
checked to be loopback.

Contenders, in this order (the drop-ins' persistent actors hold CPUs, so last):

- ``pipeline``: ``read_images(paths).map_batches(crop_flip).to_dataloader(64,
  shuffle=True)`` (Ray tasks; default placement: off the trainer's node when
  another node has CPUs, see ``sbloader/placement.py``);
- ``pipeline_allow``: the same pipeline through ``Dataset.execute(shuffle=True,
  allow_trainer_node=True)`` (every node), batches of 64 as torch tensors;
- ``dropin``: ``sbloader.DataLoader(ImageFolderDataset(paths), batch_size=64,
  shuffle=True, num_workers=<CPUs it may use>, persistent_workers=True)``, default
  placement (the other nodes' CPUs when there are any);
- ``dropin_allow``: the same with ``allow_trainer_node=True`` and
  ``num_workers=<cluster CPUs>``.

The ``*_allow`` contenders run only when this sbloader has the placement option.
Each: a cold epoch, then ``E`` warm epochs, consumer idle; every epoch measured
with ``_harness.measure`` over the trainer's tree and the extra nodes' trees (CPU
by class, ``node2_*`` for the extra nodes' processes).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402
import _jpeg_workload as w  # noqa: E402


@dataclass
class ClusterTree(h.ProcTree):
    """The trainer's tree (head Ray included) plus the extra nodes' trees, classed apart."""

    extra_roots: tuple = ()
    _extra: set = field(default_factory=set, repr=False)

    def pids(self) -> set[int]:
        ppids = h._ppid_map()
        extra = h.descendants(self.extra_roots, ppids)
        self._extra |= extra
        return super().pids() | extra

    def cls(self, pid: int) -> str:
        c = self._classes.get(pid)
        if c is None:
            c = h.classify(pid, self.root)
            if pid in self._extra:
                c = "node2_" + ("launcher" if pid in self.extra_roots else c)
            self._classes[pid] = c
        return c


def start_node(address: str, core: str, num_cpus: int, store_bytes: int, log_path: str) -> subprocess.Popen:
    """``taskset -c core python _scaleout_node.py --address ...`` (a worker node) in its own session."""
    from sbloader.runtime.rendezvous import read_token

    env = dict(os.environ)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=read_token(),
               RAY_USAGE_STATS_ENABLED="0")
    cmd = ["taskset", "-c", core, sys.executable, str(HERE / "_scaleout_node.py"), f"--address={address}",
           f"--num-cpus={num_cpus}", f"--object-store-memory={store_bytes}"]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_node(proc: subprocess.Popen, timeout: float = 20.0) -> dict:
    """SIGTERM to the session of a node we started; SIGKILL what is left of it (by pid)."""
    pids = h.descendants([proc.pid])
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if h._read_stat(p) is not None]
    for p in left:  # only processes of the node we started
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    return {"pids": sorted(pids), "killed_after_sigterm": left}


def listening_addresses(pids: set) -> list[str]:
    """The local addresses the given processes listen on (TCP, from ``ss -ltnpH``)."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ["<ss unavailable>"]
    addrs = []
    for line in out.splitlines():
        if any(f"pid={p}," in line for p in pids):
            addrs.append(line.split()[3])
    return addrs


def is_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def wait_nodes(n: int, timeout: float = 120.0) -> float:
    import ray

    t = time.perf_counter()
    while time.perf_counter() - t < timeout:
        alive = [x for x in ray.nodes() if x.get("Alive")]
        if len(alive) == n and ray.cluster_resources().get("CPU", 0) >= sum(
                x["Resources"].get("CPU", 0) for x in alive):
            return time.perf_counter() - t
        time.sleep(0.25)
    raise RuntimeError(f"{n} nodes not alive after {timeout} s: {ray.nodes()}")


def core_ticks() -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies per CPU from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            f = line.split()
            v = [int(x) for x in f[1:9]]
            out[int(f[0][3:])] = (sum(v) - v[3] - v[4], sum(v))
    return out


def outside_by_core(a: dict, b: dict, cpu_s_by_class: dict, trainer_cores: list, node_cores: list) -> dict:
    """Per pinned core: the share of its time taken by processes not ours.

    Ours are pinned: the trainer's tree (head Ray included) to the trainer's cores,
    each extra node's processes to its core, so the attribution is exact per group.
    """
    ours_head = sum(v for k, v in cpu_s_by_class.items() if not k.startswith("node2_"))
    ours_nodes = sum(v for k, v in cpu_s_by_class.items() if k.startswith("node2_"))
    out = {}
    for group, cores_, ours in (("trainer_cores", trainer_cores, ours_head), ("node_cores", node_cores, ours_nodes)):
        if not cores_:
            continue
        busy = sum(b[c][0] - a[c][0] for c in cores_) / h.CLK_TCK
        total = sum(b[c][1] - a[c][1] for c in cores_) / h.CLK_TCK
        out[group] = round(max(0.0, busy - ours) / total, 4) if total > 0 else None
    return out


def run_epochs(label: str, make_iter: Any, images_of: Any, epochs: int, tree_args: dict,
               loader: Any = None, cores: tuple = ((), ())) -> list[dict]:
    out = []
    for e in range(epochs + 1):
        t0 = core_ticks()
        with h.measure(f"{label}-{'cold' if e == 0 else 'warm'}", tree=ClusterTree(**tree_args),
                       interval_s=0.25) as m:
            for b in m.watch(make_iter):
                m.add_items(len(images_of(b)))
        r = m.result.as_dict()
        r["extra"]["cold"] = e == 0
        r["extra"]["outside_by_core"] = outside_by_core(t0, core_ticks(), r["cpu_s_by_class"], *cores)
        st = loader.stats() if loader is not None else None
        if st is not None:
            r["extra"]["operators"] = [{"name": o.name, "blocks": o.blocks, "tasks": o.tasks,
                                        "task_s": round(o.task_s, 3), "actors_created": o.actors_created}
                                       for o in st.operators]
        out.append(r)
        print(f"  {label} epoch {e}: {r['items_per_s']:.0f} images/s, first {r['first_item_s']:.2f}s, "
              f"outside {100 * r['outside_cpu_frac']:.0f}% {r['extra']['outside_by_core']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--paths-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--extra-nodes", type=int, default=0)
    p.add_argument("--extra-cores", default="1", help="comma-separated cores, one per extra node")
    p.add_argument("--epochs", type=int, default=2, help="warm epochs per contender")
    p.add_argument("--store-mib", type=int, default=512)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    paths = Path(args.paths_file).read_text().split("\n")
    cores = sorted(os.sched_getaffinity(0))
    extra_cores = args.extra_cores.split(",")[: args.extra_nodes]
    if len(extra_cores) < args.extra_nodes:
        raise SystemExit(f"{args.extra_nodes} extra nodes need as many --extra-cores, found {args.extra_cores!r}")
    import ray

    import sbloader

    t = time.perf_counter()
    info = sbloader.init(num_cpus=len(cores), object_store_memory=args.store_mib * 2**20)
    head_s = time.perf_counter() - t
    nodes = []
    result: dict[str, Any] = {"trainer_cores": cores, "extra_cores": extra_cores, "head_start_s": head_s,
                              "address": info.address}
    try:
        t = time.perf_counter()
        for i, core in enumerate(extra_cores):
            nodes.append(start_node(info.address, core, 1, args.store_mib * 2**20, f"{args.out}.node{i}.log"))
        wait_nodes(1 + args.extra_nodes)
        result["nodes_join_s"] = time.perf_counter() - t
        result["nodes"] = [{"node_id": x["NodeID"][:12], "cpus": x["Resources"].get("CPU"),
                            "address": x["NodeManagerAddress"]} for x in ray.nodes() if x.get("Alive")]
        result["node_affinity"] = [
            {"pid": pid, "cmd": h.cmdline(pid)[:60], "cpus": sorted(os.sched_getaffinity(pid))}
            for n in nodes for pid in sorted(h.descendants([n.pid])) if "raylet" in h.cmdline(pid)[:120]]
        node_pids = h.descendants([n.pid for n in nodes])
        result["node_listening"] = listening_addresses(node_pids)
        bad = [a for a in result["node_listening"] if not is_loopback(a)]
        if bad:
            raise RuntimeError(f"an extra node listens on non-loopback addresses {bad}; stopping")
        cluster_cpus = int(ray.cluster_resources().get("CPU", 0))
        result["cluster_cpus"] = cluster_cpus
        time.sleep(1.0)
        tree_args = dict(extra_roots=tuple(n.pid for n in nodes))
        cores_arg = (cores, [int(c) for c in extra_cores])
        others = sum(x["Resources"].get("CPU", 0) for x in ray.nodes()
                     if x.get("Alive") and x["NodeID"] != info.node_id)
        can_allow = "allow_trainer_node" in inspect.signature(sbloader.Dataset.execute).parameters
        result["placement_api"] = can_allow
        ds = sbloader.read_images(paths).map_batches(w.sbl_crop_flip_batch)
        pipe = ds.to_dataloader(w.BATCH, shuffle=True)
        result["pipeline"] = run_epochs("pipeline", lambda: iter(pipe), lambda b: b["image"], args.epochs, tree_args,
                                        pipe, cores_arg)
        pipe = None  # the pool goes before the next contender
        if can_allow:  # the same pipeline allowed on the trainer's node too
            last: dict = {}

            def allow_iter() -> Any:
                ex = ds.execute(shuffle=True, allow_trainer_node=True)
                last["ex"] = ex
                from sbloader.loaders.batching import iter_batches, iter_blocks
                from sbloader.loaders.tensors import columns_to_torch as to_torch

                return (to_torch(b) for b in iter_batches(iter_blocks(ex), w.BATCH))

            class _Stats:
                def stats(self) -> Any:
                    return last["ex"].stats() if "ex" in last else None

            result["pipeline_allow"] = run_epochs("pipeline_allow", allow_iter, lambda b: b["image"], args.epochs,
                                                  tree_args, _Stats(), cores_arg)
        # default placement: the workers go to the other nodes when they have CPUs
        n_default = int(others) if others else cluster_cpus
        dropin = sbloader.DataLoader(w.ImageFolderDataset(paths), batch_size=w.BATCH, shuffle=True,
                                     num_workers=n_default, persistent_workers=True)
        result["dropin_workers"] = n_default
        result["dropin"] = run_epochs("dropin", lambda: iter(dropin), lambda b: b[0], args.epochs, tree_args, dropin,
                                      cores_arg)
        result["worker_affinity"] = worker_affinity(tree_args)
        del dropin
        gc.collect()
        time.sleep(1.0)  # the cached actors are killed: their CPUs come back
        if can_allow:
            dropin = sbloader.DataLoader(w.ImageFolderDataset(paths), batch_size=w.BATCH, shuffle=True,
                                         num_workers=cluster_cpus, persistent_workers=True, allow_trainer_node=True)
            result["dropin_allow"] = run_epochs("dropin_allow", lambda: iter(dropin), lambda b: b[0], args.epochs,
                                                tree_args, dropin, cores_arg)
            result["worker_affinity_allow"] = worker_affinity(tree_args)
            del dropin
            gc.collect()
    finally:
        result["stopped"] = [stop_node(n) for n in nodes]
        sbloader.shutdown()
    Path(args.out).write_text(json.dumps(result, default=str))


def worker_affinity(tree_args: dict) -> list[dict]:
    """The Ray worker processes of the cluster now and the cores they are pinned to."""
    return [{"pid": pid, "cpus": sorted(os.sched_getaffinity(pid)), "cmd": h.cmdline(pid)[:40]}
            for pid in sorted(ClusterTree(**tree_args).pids())
            if h.cmdline(pid).startswith("ray::") and "Agent" not in h.cmdline(pid) and _safe_affinity(pid)]


def _safe_affinity(pid: int) -> bool:
    try:
        os.sched_getaffinity(pid)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()

"""Actor pools on a Ray of their own: ``python pools_job.py SCENARIO[,SCENARIO...] WORKDIR``.

Scenarios (each prints one JSON line):

- ``starve``: a fresh 2-CPU Ray, a JPEG folder read and cropped by a callable class with
  default concurrency (its actors take the read in), then with ``concurrency=(1, 2)`` (a
  read stage of its own feeds the pool); two epochs each with the pool kept (as
  ``persistent_workers=True``).
- ``cold``: a fresh 2-CPU Ray, 400 rows through ``map_batches(Tagger, concurrency=(1, 2))``.
- ``gpu1``: one node with 2 CPUs and 1 logical GPU; a GPU pool (``num_gpus=1``) behind a
  CPU read stage (run after ``starve`` and ``cold``, their Ray has the GPU too).
- ``gpu2``: a ``ray.cluster_utils.Cluster`` with a CPU-only head node (the trainer's) and a
  node with 2 CPUs and 1 logical GPU.

Each class writes one file per construction into ``WORKDIR/built`` so constructions are
counted outside the executor's own bookkeeping.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import uuid

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

import numpy as np
import ray

BUILT = ""  # set in main(); the classes read it from their constructor argument


def _mark(built_dir: str, name: str) -> None:
    os.makedirs(built_dir, exist_ok=True)
    open(os.path.join(built_dir, f"{name}-{uuid.uuid4().hex}"), "w").close()


class Crop:
    """A center crop held in a class (as a model would be)."""

    def __init__(self, built_dir: str) -> None:
        _mark(built_dir, "Crop")

    def __call__(self, batch: dict) -> dict:
        batch["image"] = [img[:64, :64] for img in batch["image"]]
        return batch


def crop(batch: dict) -> dict:
    batch["image"] = [img[:64, :64] for img in batch["image"]]
    return batch


class Tagger:
    """A slow-to-build class (as a tokenizer or a model)."""

    def __init__(self, built_dir: str) -> None:
        time.sleep(0.5)
        _mark(built_dir, "Tagger")

    def __call__(self, batch: dict) -> dict:
        time.sleep(0.002 * len(batch["id"]))
        batch["tag"] = np.asarray(batch["id"]) * 2
        return batch


class Encoder:
    """A GPU stage: records the node it ran on and the resources Ray gave its actor."""

    def __init__(self, built_dir: str) -> None:
        _mark(built_dir, "Encoder")
        self.node = ray.get_runtime_context().get_node_id()
        self.cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)

    def __call__(self, batch: dict) -> dict:
        n = len(batch["id"])
        batch["gpu_node"] = np.array([self.node] * n)
        batch["gpu_actor_cpus"] = np.full(n, self.cpus)
        return batch


def _first_read(marks: str) -> bool:
    """Whether this is the pipeline's first read (the one that makes the ``first`` file)."""
    try:
        os.close(os.open(os.path.join(marks, "first"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def read_node(batch: dict, marks: str = "", nodes: int = 1) -> dict:
    """Tags each row with the node that read it. With ``marks`` (a folder every node of this machine's
    cluster sees, and its ``deadline`` file): each read marks its node there, then, but for the first,
    waits until ``nodes`` nodes have marked (at most until the deadline): the reads spread over the nodes
    whose CPUs are free by events, never by whether a node's first worker started before the other's
    finished them. The first read waits for nothing: the executor runs it alone (its output sizes the
    next calls), so it would wait out the deadline."""
    node = ray.get_runtime_context().get_node_id()
    if marks:
        open(os.path.join(marks, node), "w").close()
        if not _first_read(marks):
            with open(os.path.join(marks, "deadline")) as f:
                deadline = float(f.read())
            marked = lambda: len([m for m in os.listdir(marks) if m not in ("deadline", "first")])  # noqa: E731
            while marked() < nodes and time.time() < deadline:
                time.sleep(0.05)
    else:
        time.sleep(0.02)
    batch["read_node"] = np.array([node] * len(batch["id"]))
    return batch


def _built(built_dir: str, name: str) -> int:
    if not os.path.isdir(built_dir):
        return 0
    return sum(1 for f in os.listdir(built_dir) if f.startswith(name + "-"))


def _pool(stats, name: str) -> dict:
    op = next(o for o in stats.operators if f"MapBatches({name})" in o.name)
    return {"created": op.actors_created, "retired": op.actors_retired, "lost": op.actors_lost,
            "limit": op.pool_limit, "construction_s": op.construction_s, "resource_wait_s": op.resource_wait_s}


def starve(work: str) -> dict:
    import sbloader
    from sbloader.datagen import write_jpeg_folder
    from sbloader.loaders.batching import iter_blocks

    folder = os.path.join(work, "jpegs")
    write_jpeg_folder(folder, 240, min_size=(160, 120), max_size=(320, 240))
    sbloader.init(num_cpus=2)
    out = {"files": 240}
    for name, kwargs in (("default", {}), ("bounded", {"concurrency": (1, 2)})):
        built = os.path.join(work, f"built-{name}")
        ds = sbloader.read_images(folder).map_batches(Crop, batch_size=16, fn_constructor_args=(built,), **kwargs)
        cache: dict = {}
        epochs = []
        for epoch in range(2):
            ex = ds.execute(epoch=epoch, actor_cache=cache)
            paths = [str(p) for block, meta in iter_blocks(ex) for p in block["path"]]
            st = ex.stats()
            epochs.append({"rows": len(paths), "distinct": len(set(paths)), "pool": _pool(st, "Crop"),
                           "stages": [o.name for o in st.operators], "report": str(st)})
        # An actor the pool created may still be constructing when the epoch ends (its reads were
        # done by the others): count the constructions once every kept actor is constructed.
        handles = [getattr(h, "handle", h) for kept in cache.values() for h in kept]
        ray.get([h.ready.remote() for h in handles], timeout=300)
        out[name] = {"epochs": epochs, "built": _built(built, "Crop"), "kept": len(handles)}
        for handle in handles:
            ray.kill(handle)
    return out


def cold(work: str) -> dict:
    import sbloader
    from sbloader.loaders.batching import iter_blocks

    sbloader.init(num_cpus=2)
    built = os.path.join(work, "built")
    ds = sbloader.from_items([{"id": i} for i in range(400)]).map_batches(
        Tagger, batch_size=20, concurrency=(1, 2), fn_constructor_args=(built,))
    t0 = time.monotonic()
    ex = ds.execute()
    ids = [int(i) for block, meta in iter_blocks(ex) for i in block["id"]]
    wall = time.monotonic() - t0
    return {"ids": sorted(ids) == list(range(400)), "wall_s": wall, "pool": _pool(ex.stats(), "Tagger"),
            "built": _built(built, "Tagger")}


def _gpu_pipeline(work: str, allow_trainer_node: bool, nodes: int = 1) -> dict:
    import sbloader
    from sbloader.loaders.batching import iter_blocks

    built = os.path.join(work, "built")
    read = read_node
    if nodes > 1:  # read_node's marks: the reads wait until that many nodes read
        marks = os.path.join(work, "read_marks")
        os.makedirs(marks, exist_ok=True)
        with open(os.path.join(marks, "deadline"), "w") as f:
            f.write(str(time.time() + 120))
        read = functools.partial(read_node, marks=marks, nodes=nodes)
    ds = (sbloader.from_items([{"id": i} for i in range(600)], num_partitions=60)
          .map_batches(read)
          .map_batches(Encoder, batch_size=10, num_gpus=1, fn_constructor_args=(built,)))
    ex = ds.execute(allow_trainer_node=allow_trainer_node)
    ids, read_nodes, gpu_nodes, cpus = [], set(), set(), set()
    for block, _ in iter_blocks(ex):
        ids += [int(i) for i in block["id"]]
        read_nodes |= {str(n) for n in block["read_node"]}
        gpu_nodes |= {str(n) for n in block["gpu_node"]}
        cpus |= {float(c) for c in block["gpu_actor_cpus"]}
    return {"ids": sorted(ids) == list(range(600)), "read_nodes": sorted(read_nodes),
            "gpu_nodes": sorted(gpu_nodes), "gpu_actor_cpus": sorted(cpus), "pool": _pool(ex.stats(), "Encoder"),
            "built": _built(built, "Encoder")}


def gpu1(work: str) -> dict:
    import sbloader

    sbloader.init(num_cpus=2, num_gpus=1)
    out = _gpu_pipeline(work, allow_trainer_node=True)
    out["node"] = ray.get_runtime_context().get_node_id()
    return out


def gpu2(work: str) -> dict:
    import sbloader
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    gpu_node = cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes()
    sbloader.init(address=cluster.address)
    out = _gpu_pipeline(work, allow_trainer_node=True, nodes=2)
    out["head"] = ray.get_runtime_context().get_node_id()
    out["gpu_node"] = gpu_node.node_id
    sbloader.shutdown()
    cluster.shutdown()
    return out


def main() -> None:
    """``SCENARIO[,SCENARIO...] WORKDIR``: scenarios that share a Ray's shape run in one process
    (``starve,cold,gpu1``: one fresh Ray of 2 CPUs and 1 logical GPU instead of three; no CPU
    stage asks for the GPU), each printing its line."""
    scenarios, work = sys.argv[1].split(","), sys.argv[2]
    if "gpu1" in scenarios:  # before the first scenario's init, which then finds this Ray
        import sbloader

        sbloader.init(num_cpus=2, num_gpus=1)
    for scenario in scenarios:
        sub = os.path.join(work, scenario)
        os.makedirs(sub, exist_ok=True)
        out = {"starve": starve, "cold": cold, "gpu1": gpu1, "gpu2": gpu2}[scenario](sub)
        out["scenario"] = scenario
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

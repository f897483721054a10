"""The torchrun job of ``node_loss.py`` and ``tests/soak/fault_soak.py``: every sample carries
the node that produced it, one JSON line per batch.

    RAY_ADDRESS=127.0.0.1:PORT torchrun --standalone --nproc-per-node=2 -m benchmarks.scenarios._node_loss_job \\
        --out DIR --path dropin-map [--rows 480] [--epochs 2] [--stop-at S --ckpt FILE] [--resume FILE]

Paths: the drop-in over a map-style dataset (``dropin-map``; ``dropin-map-np`` without
``persistent_workers``) or an ``IterableDataset`` split across ranks (``dropin-iter``);
native pipelines with a function (``native-fn``), a callable-class pool
(``native-class``), a read of Parquet files (``native-files``). Each rank appends
``{"rank", "epoch", "step", "ids", "nodes", "t"}`` per batch to ``DIR/progress{R}.jsonl``
(and ``{"rank", "start", "t"}`` when it starts) and writes ``DIR/rank{R}.json`` at the end:
per epoch the ids and the ``stats()`` text. The ranks step in lockstep (a gloo barrier
per step, as DDP's all-reduce). ``--stop-at S``: after step S of epoch 0 every rank saves
the loader's state (rank 0 to ``--ckpt``) and the job ends; ``--resume FILE`` loads it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import numpy as np

from sbloader.datagen import NodeTaggedIds, node_tag

PATHS = ("dropin-map", "dropin-map-np", "dropin-iter", "native-fn", "native-class", "native-files")


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _iterable(n: int, delay: float):
    from torch.utils.data import IterableDataset, get_worker_info

    class TaggedStream(IterableDataset):
        """The same samples as a stream, sharded over the loader's workers."""

        def __iter__(self):
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
            for i in range(wid, n, nw):
                time.sleep(delay)
                yield {"id": i, "node": _node(), "x": np.zeros(4096, np.float32)}

    return TaggedStream()


class Tagger:
    """The same map as a callable class (a pool of actors)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, batch: dict) -> dict:
        return node_tag(batch, self.delay)


def parquet_dir(rows: int, root: str) -> str:
    """``rows`` ids in Parquet files of 48 rows, row groups of 8 (written once per folder)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(root, f"ids{rows}")
    if not os.path.isdir(folder):
        tmp = f"{folder}.{os.getpid()}"
        os.makedirs(tmp)
        for k, start in enumerate(range(0, rows, 48)):
            ids = np.arange(start, min(rows, start + 48), dtype=np.int64)
            pq.write_table(pa.table({"id": ids}), os.path.join(tmp, f"part{k:04d}.parquet"), row_group_size=8)
        try:
            os.rename(tmp, folder)
        except OSError:  # another rank wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def make_loader(path: str, rows: int, delay: float, data_root: str):
    """The loader of one path (batches of 8, shuffled, seeded)."""
    import sbloader

    if path.startswith("dropin"):
        if path == "dropin-iter":
            return sbloader.DataLoader(_iterable(rows, delay), batch_size=8, num_workers=2, split=True,
                                       persistent_workers=True)
        return sbloader.DataLoader(NodeTaggedIds(rows, delay), batch_size=8, shuffle=True, num_workers=2, seed=5,
                                   persistent_workers=path == "dropin-map", dataset_id=f"tagged{rows}")
    if path == "native-files":
        ds = sbloader.read_parquet(parquet_dir(rows, data_root))
    else:
        ds = sbloader.range(rows, num_partitions=rows // 8)
    if path == "native-class":
        ds = ds.map_batches(Tagger, fn_constructor_args=(delay,), concurrency=(1, 4))
    else:
        ds = ds.map_batches(node_tag, fn_kwargs={"delay": delay})
    return ds.to_dataloader(batch_size=8, shuffle=True, seed=5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--path", choices=PATHS, required=True)
    p.add_argument("--rows", type=int, default=480)
    p.add_argument("--delay", type=float, default=0.02, help="seconds of (sleeping) work per sample")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--resume", default="")
    p.add_argument("--data-root", default="/tmp")
    a = p.parse_args()
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")
    loader = make_loader(a.path, a.rows, a.delay, a.data_root)
    step0, first_epoch = 0, 0
    if a.resume:
        with open(a.resume) as f:
            ckpt = json.load(f)
        loader.load_state_dict(ckpt["loader"])
        step0, first_epoch = ckpt["step"], ckpt["epoch"]
    progress = open(os.path.join(a.out, f"progress{rank}.jsonl"), "a", buffering=1)
    progress.write(json.dumps({"rank": rank, "start": True, "world": world, "t": time.time()}) + "\n")
    log: dict = {"rank": rank, "world": world, "epochs": {}}
    for epoch in range(first_epoch, a.epochs):  # each iteration is the loader's next epoch
        ids: list = []
        step = step0 if epoch == first_epoch else 0
        for batch in loader:
            step += 1
            got = [int(i) for i in batch["id"]]
            ids += got
            progress.write(json.dumps({"rank": rank, "epoch": epoch, "step": step, "ids": got, "t": time.time(),
                                       "nodes": sorted({str(n) for n in batch["node"]})}) + "\n")
            dist.barrier()
            if a.stop_at and epoch == 0 and step == a.stop_at:
                state = loader.state_dict()
                if rank == 0:
                    with open(a.ckpt, "w") as f:
                        json.dump({"step": step, "epoch": epoch, "loader": state}, f)
                break
        log["epochs"][str(epoch)] = {"ids": ids, "stats": str(loader.stats())}
        if a.stop_at:
            break
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

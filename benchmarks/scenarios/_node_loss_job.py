"""The driver of ``node_loss.py``: joins the cluster at ``RAY_ADDRESS``, runs one epoch of
a native pipeline whose tasks run on both nodes, and prints a JSON line per batch
(``{"t": wall clock, "ids": [...]}``) and ``{"done": true}`` at the end.

    RAY_ADDRESS=127.0.0.1:PORT python -m benchmarks.scenarios._node_loss_job --rows 480
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def tag(batch: dict, delay: float) -> dict:
    """Work that takes ``delay`` seconds per 10 rows (a sleep: the cores stay free for Ray)."""
    time.sleep(delay)
    return {"id": np.asarray(batch["id"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=480)
    ap.add_argument("--partitions", type=int, default=24)
    ap.add_argument("--delay", type=float, default=0.05)
    a = ap.parse_args()
    import sbloader

    ds = sbloader.range(a.rows, num_partitions=a.partitions).map_batches(tag, batch_size=10,
                                                                         fn_kwargs={"delay": a.delay})
    # both "machines" are this one: without it the reads keep off the node the driver runs on
    loader = ds.to_dataloader(batch_size=8, shuffle=True, seed=3, allow_trainer_node=True)
    print(json.dumps({"start": time.time()}), flush=True)
    for batch in loader:
        print(json.dumps({"t": time.time(), "ids": [int(i) for i in batch["id"]]}), flush=True)
    print(json.dumps({"done": True, "t": time.time()}), flush=True)


if __name__ == "__main__":
    main()

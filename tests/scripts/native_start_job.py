"""A fresh process's first native epoch (``tests/ray/test_native_start.py``).

Usage: ``native_start_job.py DIR``: writes a Parquet file of 3,000 rows in 30 row groups
under DIR, iterates one shuffled epoch of ``read_parquet(...).map_batches(f).to_dataloader``
(the source's default window: half the default memory budget) and prints one JSON line:
the batches' ids, whether Ray was up at the first batch, the local partitions, and the
memory budget predicted before Ray's start beside the one the epoch ran under.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS, GROUPS = 3000, 30


def slow(batch: dict) -> dict:
    time.sleep(0.01)
    return {"id": batch["id"], "draw": np.random.randint(0, 1000, len(batch["id"]))}


def main(root: str) -> None:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "rows.parquet")
    pq.write_table(pa.table({"id": np.arange(ROWS)}), path, row_group_size=ROWS // GROUPS)
    import sbloader
    from sbloader.loaders.native_start import budget_before_ray
    from sbloader.runtime import background

    predicted = budget_before_ray(None)
    loader = sbloader.read_parquet(path).map_batches(slow).to_dataloader(64, shuffle=True, seed=1,
                                                                        deterministic=True)
    batches, up = [], None
    for b in loader:
        if up is None:
            up = background.ready()
        batches.append(b["id"].tolist())
    stats = loader.stats()
    print(json.dumps({"batches": batches, "rows": ROWS, "ray_up_at_first_batch": up,
                      "local_partitions": stats.local_partitions, "predicted_budget": predicted,
                      "budget": stats.memory_budget}))


HANG_S = 200  # the test kills the run at 240 s: before, every thread's stack goes to stderr (a hang shows where)

if __name__ == "__main__":
    faulthandler.dump_traceback_later(HANG_S, exit=True)  # armed through the exit's hooks too
    main(sys.argv[1])

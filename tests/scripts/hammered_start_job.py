"""Local starts forked while another thread keeps the C library's exit-handler lock busy
(``tests/ray/test_native_start.py``; ``sbloader/runtime/exit_lock.py``).

Usage: ``hammered_start_job.py HAMMER_SO DIR``: a thread runs ``exit_lock_hammer.c``'s loop from each
epoch's ``iter()`` to its first batch (its local workers' forks) while two native epochs (``read_parquet``,
a new loader each) and one drop-in epoch start on local workers
(``SBLOADER_HANDOVER_AT`` set by the caller past the plan: every partition local). Prints one JSON
line: whether each epoch gave every row once, and the native epochs' local partitions.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def main(hammer_so: str, root: str) -> None:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "rows.parquet")
    pq.write_table(pa.table({"id": np.arange(600)}), path, row_group_size=100)
    import sbloader

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from exit_lock_job import Hammer

    hammer = Hammer(hammer_so)

    def rows(loader, column):
        with hammer:  # from iter() (the local workers' forks) to the first batch
            it = iter(loader)
            batches = [next(it)]
        batches.extend(it)
        return sorted(x for b in batches for x in (b[column] if column else b).tolist())

    whole, local = [], []
    for seed in (1, 2):
        loader = sbloader.read_parquet(path).to_dataloader(64, shuffle=True, seed=seed)
        whole.append(rows(loader, "id") == list(range(600)))
        local.append(loader.stats().local_partitions)
    whole.append(rows(sbloader.DataLoader(list(range(200)), batch_size=20, num_workers=2), None) == list(range(200)))
    print(json.dumps({"whole": whole, "local_partitions": local}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

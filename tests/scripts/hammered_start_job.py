"""Local starts forked while another thread keeps the C library's exit-handler lock busy
(``tests/ray/test_native_start.py``; ``sbloader/runtime/exit_lock.py``).

Usage: ``hammered_start_job.py HAMMER_SO DIR``: a thread runs ``exit_lock_hammer.c``'s loop while two
native epochs (``read_parquet``, a new loader each) and one drop-in epoch start on local workers
(``SBLOADER_HANDOVER_AT`` set by the caller past the plan: every partition local). Prints one JSON
line: whether each epoch gave every row once, and the native epochs' local partitions.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def main(hammer_so: str, root: str) -> None:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "rows.parquet")
    pq.write_table(pa.table({"id": np.arange(600)}), path, row_group_size=100)
    import sbloader

    stop = ctypes.c_int(0)
    thread = threading.Thread(target=ctypes.CDLL(hammer_so).hammer, args=(ctypes.byref(stop),), daemon=True)
    thread.start()
    whole, local = [], []
    for seed in (1, 2):
        loader = sbloader.read_parquet(path).to_dataloader(64, shuffle=True, seed=seed)
        whole.append(sorted(x for b in loader for x in b["id"].tolist()) == list(range(600)))
        local.append(loader.stats().local_partitions)
    dropin = sbloader.DataLoader(list(range(200)), batch_size=20, num_workers=2)
    whole.append(sorted(x for b in dropin for x in b.tolist()) == list(range(200)))
    stop.value = 1
    thread.join()
    print(json.dumps({"whole": whole, "local_partitions": local}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

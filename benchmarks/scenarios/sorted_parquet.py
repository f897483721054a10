"""A label-sorted Parquet file (rows grouped by label, as many exports are), loaded with
``shuffle=True``: how mixed the batches are. sbloader's ``read_parquet(path)
.to_dataloader(64, shuffle=True)`` as a user first writes it, against torch's
DataLoader (``shuffle=True``, a full permutation) over the same rows. The figure is
the number of distinct labels per batch (higher is better; with 10 labels and batches
of 64 a full shuffle gives about 9.97), and images/s of the epoch beside it."""
from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import DATA

ORDER = 40
TITLE = "A label-sorted Parquet file: distinct labels per batch vs torch"
PARAMS = {"rows": 65536, "labels": 10, "rows_per_group": 256, "batch_size": 64, "rounds": 3}
QUICK = {"rows": 32768, "rounds": 3}  # shorter runs are within the noise of the others-CPU mark (0 of 6 quiet at 4,096)


def plan(**p: Any) -> Plan:
    """sbloader and torch, one epoch per run."""
    return Plan(["sbloader", "torch"], p["rounds"], notes=f"{p['rows']} rows sorted by label")


def sorted_file(rows: int, labels: int, rows_per_group: int) -> str:
    """A Parquet file of ``rows`` rows sorted by ``label`` (a 1 KiB payload each); written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = DATA / f"sorted_{rows}_{labels}_{rows_per_group}.parquet"
    if not path.exists():
        DATA.mkdir(parents=True, exist_ok=True)
        label = np.sort(np.arange(rows) % labels)
        payload = pa.array([bytes(1024)] * rows, pa.binary())
        tmp = path.with_suffix(".tmp")
        pq.write_table(pa.table({"id": np.arange(rows), "label": label, "payload": payload}), tmp,
                       row_group_size=rows_per_group)
        os.replace(tmp, path)
    return str(path)


class Rows:
    """The file's rows as a map-style Dataset (what a torch user has after reading it)."""

    def __init__(self, path: str) -> None:
        import pyarrow.parquet as pq

        t = pq.read_table(path, columns=["label", "payload"])
        self.label = t.column("label").to_numpy()
        self.payload = t.column("payload").to_pylist()

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, i: int) -> dict:
        return {"label": int(self.label[i]), "payload": np.frombuffer(self.payload[i], np.uint8)}


def mix(batches: Any) -> dict[str, float]:
    """Distinct labels per batch (full batches only) and rows seen."""
    import time

    t0, per, rows = time.perf_counter(), [], 0
    for b in batches:
        lab = np.asarray(b["label"])
        rows += len(lab)
        per.append(len(np.unique(lab)))
    wall = time.perf_counter() - t0
    full = per[:-1] if len(per) > 1 else per
    return {"labels_per_batch": float(np.mean(full)), "min_labels_per_batch": float(min(full)),
            "rows_per_s": rows / wall}


def run(**p: Any) -> Outcome:
    """One epoch per run, a new seed per round for sbloader (torch draws its own)."""
    import torch

    import sbloader

    path = sorted_file(p["rows"], p["labels"], p["rows_per_group"])
    ds = Rows(path)
    seeds = iter(range(1000))

    def sbl() -> dict:
        loader = sbloader.read_parquet(path).to_dataloader(p["batch_size"], shuffle=True, seed=next(seeds))
        r = mix(iter(loader))  # rows/s from the first batch request (the footers were read in read_parquet)
        del loader
        gc.collect()
        return r

    def tl() -> dict:
        return mix(iter(torch.utils.data.DataLoader(ds, batch_size=p["batch_size"], shuffle=True)))

    sbl()  # warm-up: the embedded Ray's start
    trials = run_interleaved({"sbloader": sbl, "torch": tl}, p["rounds"])
    return Outcome(trials, "labels_per_batch", "distinct labels", baseline="torch",
                   extra=("min_labels_per_batch", "rows_per_s"), timing=False,
                   notes=[f"{p['rows']} rows, {p['labels']} labels, sorted by label, row groups of "
                          f"{p['rows_per_group']}; batches of {p['batch_size']}; the last (partial) batch left out",
                          "a mix figure, not a timing: the load does not change it (rows/s beside it does)"])

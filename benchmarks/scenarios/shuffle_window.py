"""The shuffle window as a memory budget (issue #39), before and after in one run: a
label-sorted Parquet file of 1,000 row groups of JPEGs (labels in runs of row groups, as
an ImageNet-style export), ``read_parquet(f).map_batches(decode).to_dataloader(64,
shuffle=True)``. "before" is the tree at ``fb1be8d`` (a fixed window of 8 row groups),
"after" this tree: with ``shuffle_window=8`` (the same mix: what the new code costs),
its default (half the memory budget: the whole file fits, so a uniform mix), and a
small ``memory_budget`` (the file does not fit: as wide as it allows, never past it).
Each side is a process of its own with its own embedded Ray (two sbloaders cannot
share one interpreter); requests alternate between them round by round. Figures:
images/s (paired ratio to "before"), distinct labels per batch (torch's
``DataLoader(shuffle=True)`` over the same labels in the notes), time to the first
batch, the executor's counted peak of object-store bytes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import ROOT, Outcome, Plan, run_interleaved

from ._common import DATA

ORDER = 45
TITLE = "Shuffle window: label-sorted Parquet of 1,000 row groups, before/after"
PARAMS = {"row_groups": 1000, "rows_per_group": 16, "labels": 100, "small_budget_mib": 32, "rounds": 4,
          "before": "fb1be8d"}
QUICK = {"rows_per_group": 8, "rounds": 3}
CONTENDERS = {"before: window 8 (default)": ("before", 8, None), "after: shuffle_window=8": ("after", 8, None),
              "after: default window": ("after", None, None), "after: small budget": ("after", None, "small")}


def plan(**p: Any) -> Plan:
    """Four contenders over two processes, one epoch per run."""
    return Plan(list(CONTENDERS), p["rounds"],
                notes=f"{p['row_groups']} row groups of {p['rows_per_group']} JPEGs, {p['labels']} labels")


def sorted_images(row_groups: int, rows: int, labels: int) -> str:
    """The Parquet file (``image`` JPEG bytes 96x96, ``label`` in runs of row groups); written once."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    path = DATA / f"sorted_images_{row_groups}x{rows}_{labels}.parquet"
    if not path.exists():
        DATA.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        n = row_groups * rows
        label = np.repeat(np.arange(row_groups) * labels // row_groups, rows)
        base = np.linspace(0, 255, 96, dtype=np.float32)
        jpegs = []
        for i in range(n):
            px = (base[None, :, None] + rng.normal(0, 20, (96, 96, 3)) + label[i]).clip(0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(px).save(buf, "JPEG", quality=85)
            jpegs.append(buf.getvalue())
        tmp = path.with_suffix(".tmp")
        pq.write_table(pa.table({"image": pa.array(jpegs, pa.binary()), "label": label}), tmp, row_group_size=rows)
        os.replace(tmp, path)
    return str(path)


def before_tree(rev: str) -> Path:
    """A worktree of ``rev`` (the tree before the issue) at /tmp/wt39-before."""
    where = Path("/tmp/wt39-before")
    if not (where / "sbloader").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                       capture_output=True)
    return where


class Side:
    """A worker process (``_shuffle_worker.py``) importing sbloader from ``tree``."""

    def __init__(self, tree: Path, path: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        worker = Path(__file__).with_name("_shuffle_worker.py")
        self.proc = subprocess.Popen([sys.executable, str(worker), path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(tree))
        self.ready = json.loads(self.proc.stdout.readline())["ready"]

    def epoch(self, **req: Any) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(60)


def torch_labels(path: str, epochs: int = 3) -> float:
    """Distinct labels per full batch of torch's DataLoader(shuffle=True) over the file's labels."""
    import pyarrow.parquet as pq
    import torch

    labels = pq.read_table(path, columns=["label"]).column("label").to_numpy()
    loader = torch.utils.data.DataLoader(labels, batch_size=64, shuffle=True)
    return float(np.mean([len(np.unique(b.numpy())) for _ in range(epochs) for b in loader if len(b) == 64]))


def run(**p: Any) -> Outcome:
    """Each round runs every contender once (interleaved), a new seed per round."""
    path = sorted_images(p["row_groups"], p["rows_per_group"], p["labels"])
    sides = {"before": Side(before_tree(p["before"]), path), "after": Side(ROOT, path)}
    seeds = iter(range(1000))
    small = p["small_budget_mib"] * 2**20

    def contender(side: str, window: Any, budget: Any):
        def go() -> dict:
            r = sides[side].epoch(seed=next(seeds), window=window, budget=small if budget else None)
            r["narrowed"] = 1.0 if r.pop("note", "") else 0.0
            return r
        return go

    try:
        for side in sides.values():  # warm-up: each Ray's workers
            side.epoch(seed=999, window=8, budget=None)
        trials = run_interleaved({k: contender(*v) for k, v in CONTENDERS.items()}, p["rounds"])
    finally:
        for side in sides.values():
            side.close()
    torch_mix = torch_labels(path)
    return Outcome(trials, "images_per_s", "images/s", baseline="before: window 8 (default)",
                   extra=("labels_per_batch", "first_batch_s", "peak_held_mib", "budget_mib", "narrowed"),
                   notes=[f"torch DataLoader(shuffle=True) over the same labels: {torch_mix:.2f} distinct labels "
                          "per batch of 64",
                          f"{p['row_groups']} row groups of {p['rows_per_group']} JPEGs (96x96), {p['labels']} "
                          f"labels in runs of {p['row_groups'] // p['labels']} row groups; decode to 64x64 in "
                          "map_batches; batches of 64",
                          f"before = {p['before']} ({sides['before'].ready}), after = this tree; each side its "
                          "own process and embedded Ray",
                          f"small budget: memory_budget={p['small_budget_mib']} MiB (the window holds half); "
                          "peak_held_mib is the executor's counted peak (blocks queued, ready, held by the "
                          "window, in flight, released but not yet freed)",
                          "the cost of the new code at equal mix: 'after: shuffle_window=8' against 'before'"])

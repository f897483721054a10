"""What shuffle=True that mixes the whole dataset costs (issue #17): before and after, side by side.

The image workload of ``bench_images.py`` (JPEG decode, random-resized-crop 224,
flip, batches of 64; 2,048 generated JPEGs of 320x240 to 640x480, and the same
images in Parquet files of 128 rows in row groups of 64), through the two native
pipelines, with the CPU free (the consumer only counts):

- folder: ``read_images(folder, decode=False).map_batches(decode_crop_flip).to_dataloader(64, shuffle=True)``
  (the folder listed sorted, class by class, as a user's ImageFolder)
- parquet: ``read_parquet(files).map_batches(decode_crop_flip).to_dataloader(64, shuffle=True)``

``before`` is sbloader at ``--before`` (default: the commit before the mixing
shuffle, a partition the same run of files or one row group every epoch), checked
out in a temporary git worktree; ``after`` is this tree. Each runs in a child
process with its own embedded Ray (the Ray workers import that version); the
runs interleave (before, after, after, before, ...: the order's bias cancels),
and the child not being measured is stopped (``SIGSTOP``), as in ``bench_images.py``.

Also measured, on ``after``:

- the mixing: mean distinct labels per batch against torch's
  ``DataLoader(shuffle=True)`` over the same labels (the folder lists its 10 class
  folders in turn; the Parquet rows have label ``i % 10``, so each row group
  mixes labels already: the label-sorted case is in ``tests/test_shuffle.py``);
- the Parquet read amplification at the default ``shuffle_window``: the bytes the
  pipeline's Ray workers read from files during an epoch (``rchar`` in
  ``/proc/<pid>/io``), over the bytes of the Parquet files; and the rows its read
  stage produced over the dataset's rows. The same ``rchar`` ratio for the folder
  epoch (every file read once) shows what the meter counts besides the data.

Run: ``python benchmarks/bench_shuffle.py [--before REV] [--rounds 5] [--quick]``.
Writes ``benchmarks/results/shuffle.json`` and ``shuffle.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402

NAME = "shuffle"
BATCH = 64
PIPELINES = ("folder", "parquet")
DEFAULT_BEFORE = "ddd17a3"  # the last commit whose shuffle only permuted fixed partitions


# ----- the child: one sbloader version, its own Ray ---------------------------------------------


def _worker_io(root_pid: int) -> int:
    """``rchar`` summed over the Ray processes below ``root_pid`` (bytes read by read() calls)."""
    total = 0
    for pid in h.descendants([root_pid]):
        if pid == root_pid:
            continue
        try:
            with open(f"/proc/{pid}/io") as f:
                for line in f:
                    if line.startswith("rchar:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def serve(version: str, folder: str, parquet: str) -> None:
    """Answer ``["run", pipeline]`` lines on stdin with one JSON line of results each."""
    os.setsid()
    h.ray_worker_env()
    import _image_workload as w
    import numpy as np

    import sbloader

    sbloader.init()
    loaders = {
        "folder": sbloader.read_images(folder, decode=False).map_batches(w.sbl_decode_files_batch)
        .to_dataloader(BATCH, shuffle=True),
        "parquet": sbloader.read_parquet(parquet, columns=["image", "label"]).map_batches(w.sbl_decode_batch)
        .to_dataloader(BATCH, shuffle=True),
    }
    print(json.dumps({"ready": os.getpid(), "sbloader": sbloader.__file__}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg[0] == "quit":
            break
        loader = loaders[msg[1]]
        io0 = _worker_io(os.getpid())
        t0 = time.perf_counter()
        first = None
        images = 0
        labels = []
        for b in loader:
            if first is None:
                first = time.perf_counter() - t0
            images += len(b["image"])
            labels.append(len(set(np.asarray(b["label"]).tolist())))
        wall = time.perf_counter() - t0
        st = loader.stats()
        read_rows = st.operators[0].rows if st is not None else None
        print(json.dumps({"images": images, "wall_s": wall, "first_s": first, "images_per_s": images / wall,
                          "distinct_labels": float(np.mean(labels)), "rchar": _worker_io(os.getpid()) - io0,
                          "read_rows": read_rows}), flush=True)


class Child:
    """A :func:`serve` process for one sbloader version."""

    def __init__(self, version: str, pythonpath: str, folder: str, parquet: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, str(HERE)]))
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", version, folder, parquet],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        hello = self._read()
        self.pid, self.module = hello["ready"], hello["sbloader"]

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the child ended (exit code {self.proc.poll()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, pipeline: str) -> dict:
        self.proc.stdin.write(json.dumps(["run", pipeline]) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def tree(self) -> set[int]:
        return h.descendants([self.pid])

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps(["quit"]) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        except Exception:
            self.proc.kill()


# ----- the driver -------------------------------------------------------------------------------


def torch_distinct(labels: list[int], epochs: int = 3) -> float:
    """Mean distinct labels per batch of torch's ``DataLoader(shuffle=True)`` over ``labels``."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(labels, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    return float(np.mean([len(set(b.tolist())) for _ in range(epochs) for b in loader]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=DEFAULT_BEFORE, help="git revision of the 'before' sbloader")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="512 images, 2 rounds")
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    sys.path.insert(0, str(HERE))
    from bench_images import make_data  # the same generated data as bench_images

    import _image_workload as w

    n = 512 if args.quick else 2048
    rounds = 2 if args.quick else args.rounds
    data_root = HERE / "results" / "tmp" / "images"
    paths, parquet, files = make_data(data_root, n)
    parquet_bytes = sum(os.path.getsize(f) for f in files)
    folder_bytes = sum(os.path.getsize(p) for p in paths)
    folder = str(data_root / "jpeg")  # listed sorted: class by class, as a user's ImageFolder
    tmp = Path(tempfile.mkdtemp(prefix="bench-shuffle-"))
    worktree = tmp / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before], cwd=ROOT, check=True,
                   capture_output=True)
    children = {}
    try:
        children["before"] = Child("before", str(worktree), folder, parquet)
        children["after"] = Child("after", str(ROOT), folder, parquet)
        results: dict[str, dict[str, list]] = {v: {p: [] for p in PIPELINES} for v in children}
        first: dict[str, dict] = {}
        for r in range(rounds + 1):  # round 0: each pipeline's first epoch, kept apart
            # before, after in even rounds, after, before in odd ones: the order's bias cancels
            order = list(children.items()) if r % 2 == 0 else list(children.items())[::-1]
            for pipeline in PIPELINES:
                for version, child in order:
                    others = set().union(*(c.tree() for v, c in children.items() if v != version))
                    busy = h.wait_quiet()
                    with h.paused(others):
                        b0 = h.machine_busy_ticks()
                        res = child.run(pipeline)
                        b1 = h.machine_busy_ticks()
                    res["machine_busy_before"] = round(busy, 4)
                    res["machine_busy_frac"] = round((b1[0] - b0[0]) / max(1, b1[1] - b0[1]), 4)
                    if r == 0:
                        first[f"{version}/{pipeline}"] = res
                    else:
                        results[version][pipeline].append(res)
                    print(f"round {r} {version:6s} {pipeline:8s} {res['images_per_s']:7.1f} images/s "
                          f"distinct {res['distinct_labels']:.2f} rchar/bytes "
                          f"{res['rchar'] / (parquet_bytes if pipeline == 'parquet' else folder_bytes):.3f}",
                          flush=True)
    finally:
        for c in children.values():
            c.close()
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)

    labels_folder = [w.label_of(p) for p in paths]
    import pyarrow.parquet as pq

    labels_parquet = [int(x) for f in files for x in pq.read_table(f, columns=["label"])["label"].to_pylist()]
    summary: dict[str, Any] = {}
    for pipeline in PIPELINES:
        row: dict[str, Any] = {}
        for version in children:
            rs = results[version][pipeline]
            row[version] = {"images_per_s": h.summarize([x["images_per_s"] for x in rs]),
                            "distinct_labels": h.summarize([x["distinct_labels"] for x in rs]),
                            "first_s": h.summarize([x["first_s"] for x in rs])}
        pairs = [a["images_per_s"] / b["images_per_s"]
                 for a, b in zip(results["after"][pipeline], results["before"][pipeline])]
        row["after_over_before"] = h.summarize(pairs)
        total = parquet_bytes if pipeline == "parquet" else folder_bytes
        row["rchar_over_data_bytes"] = h.summarize([x["rchar"] / total for x in results["after"][pipeline]])
        row["read_rows_over_rows"] = h.summarize([x["read_rows"] / n for x in results["after"][pipeline]
                                                 if x["read_rows"] is not None])
        row["torch_distinct_labels"] = torch_distinct(labels_folder if pipeline == "folder" else labels_parquet)
        summary[pipeline] = row
    payload = {"machine": h.machine_info(), "command": h.command_line(), "images": n, "rounds": rounds,
               "before": args.before, "parquet_bytes": parquet_bytes, "folder_bytes": folder_bytes,
               "summary": summary, "first_epochs": first, "runs": results}
    md = [f"# shuffle=True that mixes, before and after ({time.strftime('%Y-%m-%d %H:%M')})", "",
          f"`{h.command_line()}` on {payload['machine'].get('cpu_model', '?')}, "
          f"{payload['machine'].get('nproc', '?')} cores; {n} images, {rounds} interleaved rounds (CPU free), "
          f"before = `{args.before}`, after = this tree. Medians (min–max).", ""]
    rows = []
    for pipeline in PIPELINES:
        s = summary[pipeline]
        rows.append({"pipeline": pipeline,
                     "before images/s": h.fmt_range(s["before"]["images_per_s"], "{:.0f}"),
                     "after images/s": h.fmt_range(s["after"]["images_per_s"], "{:.0f}"),
                     "after / before": h.fmt_range(s["after_over_before"], "{:.3f}"),
                     "labels per batch before": h.fmt_range(s["before"]["distinct_labels"], "{:.2f}"),
                     "after": h.fmt_range(s["after"]["distinct_labels"], "{:.2f}"),
                     "torch": f"{s['torch_distinct_labels']:.2f}",
                     "bytes read / data bytes": h.fmt_range(s["rchar_over_data_bytes"], "{:.3f}"),
                     "rows read / rows": h.fmt_range(s["read_rows_over_rows"], "{:.3f}")})
    md.append(h.markdown_table(rows, list(rows[0])))
    h.write_results(NAME, payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()

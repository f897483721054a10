"""Parquet partition reads: the footer parsed once per read process against once per partition.

Every partition of ``read_parquet`` is one row group (or a row range of one), and
pyarrow needs the file's footer to find it. A footer lists every row group and
column chunk, so with many row groups parsing it costs more than reading one
small row group. sbloader's read processes keep the parsed footers
(``sbloader.sources.parquet.cached_footer``); ``per partition`` empties that cache before
every read, which is what opening ``pyarrow.parquet.ParquetFile(path)`` per
partition costs.

Workload: generated files of 64-row row groups, float32 columns, two columns read
(as a training set with many small row groups and a few columns used). The read
path runs in this process, no Ray: the figure is the reader's own cost per
partition. Contenders interleaved per round (BENCHMARKING.md), median (min-max).

Run: ``python benchmarks/bench_parquet_read.py [--rounds 5] [--quick] [--out NAME]``. Writes
``benchmarks/results/parquet_read.json`` and ``parquet_read.md``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _harness as h  # noqa: E402

from sbloader.sources import parquet as sp  # noqa: E402

ROWS = 64
SHAPES = ((64, 4), (500, 20), (2000, 50))  # (row groups, columns) per file
SAMPLE = 200  # partitions read per file and run, evenly spread over the file


def make_file(root: Path, row_groups: int, columns: int) -> Path:
    """One file of ``row_groups`` row groups of 64 rows and ``columns`` float32 columns."""
    path = root / f"rg{row_groups}_c{columns}.parquet"
    n = row_groups * ROWS
    pq.write_table(pa.table({f"c{i}": np.arange(n, dtype=np.float32) for i in range(columns)}),
                   path, row_group_size=ROWS)
    return path


def read_all(path: Path, cached: bool) -> dict:
    """Read up to :data:`SAMPLE` partitions of ``path`` (columns c0, c1): milliseconds per partition."""
    source = sp.ParquetSource([sp.read_footer(str(path))], ("c0", "c1"), "raise", None)
    reader, parts = source.reader(), source.partitions(0, 0)
    parts = parts[::max(1, len(parts) // SAMPLE)][:SAMPLE]
    sp._FOOTERS.clear()
    t0 = time.perf_counter()
    rows = 0
    for part in parts:
        if not cached:
            sp._FOOTERS.clear()
        rows += len(reader(None, part)["c0"])
    dt = time.perf_counter() - t0
    assert rows == len(parts) * ROWS
    return {"ms_per_partition": dt / len(parts) * 1e3, "partitions": len(parts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--out", default="parquet_read", help="results name under benchmarks/results/")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 3
    with tempfile.TemporaryDirectory(prefix="sbl_pq_read_") as tmp:
        files = {shape: make_file(Path(tmp), *shape) for shape in SHAPES}
        footer_kib = {shape: pq.read_metadata(p).serialized_size / 1024 for shape, p in files.items()}
        contenders = {}
        for shape, path in files.items():
            for cached in (False, True):
                name = f"{shape[0]}x{shape[1]} {'cached' if cached else 'per partition'}"
                contenders[name] = (lambda p=path, c=cached: read_all(p, c))
        runs = h.interleave(contenders, args.rounds, before_round=lambda: h.wait_quiet(timeout_s=5))
    rows, payload_rows = [], []
    for shape in SHAPES:
        key = f"{shape[0]}x{shape[1]}"
        per = h.summarize([r["ms_per_partition"] for r in runs[f"{key} per partition"]])
        cached = h.summarize([r["ms_per_partition"] for r in runs[f"{key} cached"]])
        speedup = h.summarize([a["ms_per_partition"] / b["ms_per_partition"]
                               for a, b in zip(runs[f"{key} per partition"], runs[f"{key} cached"])])
        payload_rows.append({"row_groups": shape[0], "columns": shape[1], "footer_kib": footer_kib[shape],
                             "per_partition_ms": per, "cached_ms": cached, "speedup": speedup})
        rows.append({"file": f"{shape[0]} row groups x {shape[1]} columns",
                     "footer KiB": f"{footer_kib[shape]:.0f}",
                     "footer per partition ms": h.fmt_range(per, "{:.2f}"),
                     "footer once (sbloader) ms": h.fmt_range(cached, "{:.2f}"),
                     "speed-up": h.fmt_range(speedup, "{:.1f}") + "x"})
    md = [
        f"Reading partitions (row groups of 64 rows, 2 float32 columns; at most {SAMPLE} per file, spread "
        "over it) of one generated file, "
        f"in this process (no Ray). {args.rounds} interleaved rounds, median (min-max) ms per partition. "
        "`footer per partition` parses the footer for every partition (pyarrow's `ParquetFile(path)` per "
        "read); `footer once` is sbloader's read path, which keeps the parsed footer per process.",
        "",
        h.markdown_table(rows),
    ]
    h.write_results(args.out, {"rounds": args.rounds, "rows": payload_rows, "raw": runs}, "\n".join(md),
                    title="Parquet partition reads: footer parsed once per process vs once per partition")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Parquet partition reads (ported from ``bench_parquet_read.py``): the footer parsed once
per read process (sbloader's ``sources.parquet`` cache) against once per partition
(what ``pyarrow.parquet.ParquetFile(path)`` per read costs). Generated files of 64-row
row groups and float32 columns, two columns read, at most 200 partitions per file
spread over it, in this process (no Ray): the reader's own milliseconds per partition."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Outcome, Plan, paired_ratios, ratio_words, run_interleaved

ORDER = 240
REPORT = False
TITLE = "Parquet partition reads: footer parsed once per process vs once per partition"
PARAMS = {"shapes": [[64, 4], [500, 20], [2000, 50]], "rounds": 5}
QUICK = {"rounds": 3}
ROWS, SAMPLE = 64, 200


def _names(p: dict) -> list[str]:
    return [f"{g}x{c} {mode}" for g, c in p["shapes"] for mode in ("per partition", "cached")]


def plan(**p: Any) -> Plan:
    """Per file shape (row groups x columns): footer per partition, footer once."""
    return Plan(_names(p), p["rounds"])


def run(**p: Any) -> Outcome:
    """Write the files, then interleave the readers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sbloader.sources import parquet as sp

    def read_all(path: Path, cached: bool) -> dict:
        source = sp.ParquetSource([sp.read_footer(str(path))], ("c0", "c1"), "raise", None)
        reader, parts = source.reader(), source.partitions(0, 0)
        parts = parts[::max(1, len(parts) // SAMPLE)][:SAMPLE]
        sp._FOOTERS.clear()
        t0, rows = time.perf_counter(), 0
        for part in parts:
            if not cached:
                sp._FOOTERS.clear()
            rows += len(reader(None, part)["c0"])
        if rows != len(parts) * ROWS:
            raise AssertionError(f"read {rows} rows of {len(parts) * ROWS}")
        return {"ms_per_partition": (time.perf_counter() - t0) / len(parts) * 1e3}

    with tempfile.TemporaryDirectory(prefix="sbl_pq_read_") as tmp:
        contenders, footer_kib = {}, {}
        for g, c in p["shapes"]:
            path = Path(tmp) / f"rg{g}_c{c}.parquet"
            pq.write_table(pa.table({f"c{i}": np.arange(g * ROWS, dtype=np.float32) for i in range(c)}), path,
                           row_group_size=ROWS)
            footer_kib[f"{g}x{c}"] = round(pq.read_metadata(path).serialized_size / 1024, 1)
            for cached in (False, True):
                contenders[f"{g}x{c} {'cached' if cached else 'per partition'}"] = (
                    lambda path=path, cached=cached: read_all(path, cached))
        trials = run_interleaved(contenders, p["rounds"])
    notes = []
    for key, kib in footer_kib.items():
        rs = sorted(paired_ratios(trials, "ms_per_partition", f"{key} cached", f"{key} per partition", False))
        quiet = all(t.load["quiet"] for t in trials.trials if t.contender.startswith(key + " "))
        notes.append(f"{key} (footer {kib} KiB), footer once against per partition, same round: "
                     + ratio_words(rs[len(rs) // 2], "per partition", quiet, f"min {rs[0]:.1f}, max {rs[-1]:.1f}"))
    return Outcome(trials, "ms_per_partition", "ms", higher_is_better=False, notes=notes, raw={"footer_kib": footer_kib})

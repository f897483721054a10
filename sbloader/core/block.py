"""Blocks: the unit of data between operators, with provenance on every row.

A block is a ``dict[str, numpy.ndarray]`` whose columns have equal length. Inside
the pipeline every block also carries the hidden column ``ROW_COLUMN``: the row's
index within its source partition, so every row keeps its provenance through
``filter``/``flat_map``. :class:`BlockMeta` travels beside the block (a small
object) so the executor can schedule without fetching block bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

Block = dict  # dict[str, np.ndarray]

#: Hidden column holding each row's index inside its source partition.
ROW_COLUMN = "_sb_row"

#: Optional column a producer fills with the samples in each row (a drop-in
#: loader's row is a collated batch); :attr:`BlockMeta.batch_rows` carries it.
BATCH_ROWS_COLUMN = "_sb_batch_rows"

#: The column of a block of an ``IterableDataset``'s worker shard holding, per batch, ``(shard,
#: snapshot after it)`` (:mod:`sbloader.loaders.iterable_resume`); its last entry is also in the
#: block's metadata (``BlockMeta.shard_state``).
SHARD_STATE_COLUMN = "shard_state"

#: Key of the boolean mask a padded batch carries (True = a repeated row that only
#: evens out the ranks' batch counts; train on the others).
PADDING_KEY = "sbloader_padding"


@dataclass(frozen=True)
class Provenance:
    """Where a run of rows came from.

    Attributes:
        epoch: the epoch of the execution.
        partition_id: the stable id of the source partition.
        row_range: ``(start, stop)`` rows within the partition (source rows).
    """

    epoch: int
    partition_id: int
    row_range: tuple[int, int]

    def __post_init__(self) -> None:
        start, stop = self.row_range
        if not 0 <= start <= stop:
            raise ValueError(f"row_range must satisfy 0 <= start <= stop, found {self.row_range}")


@dataclass(frozen=True)
class BlockMeta:
    """Metadata of one block, small enough to fetch eagerly.

    Attributes:
        epoch: epoch of the execution.
        partition_id: source partition of every row in the block.
        seq: position of the partition in the epoch's plan (delivery order key).
        num_rows: rows in the block.
        nbytes: bytes of the block's arrays.
        row_range: ``(min, max + 1)`` of the source rows the block covers.
        task_s: wall seconds the producing task spent in user code and reading.
        node_id: the Ray node that produced the block.
        skipped: rows the producing task skipped under ``on_error="skip"``.
        full_decodes: images the producing task's transforms decoded whole instead of
            by crop window (``sbloader/sources/jpeg_window.py``).
        pid: the process that produced the block.
        batch_rows: samples in each row, when the producer said (its
            ``BATCH_ROWS_COLUMN``); empty otherwise.
        counters: ``(name, count)`` pairs the read reported (remote sources: cache
            hits and misses, bytes read, retries); empty otherwise.
        shard_state: (a block of an ``IterableDataset``'s worker shard) ``(shard, snapshot)``
            after its last batch (its ``SHARD_STATE_COLUMN``'s last entry): where the shard's
            next segment starts, known without fetching the block; None otherwise.
    """

    epoch: int
    partition_id: int
    seq: int
    num_rows: int
    nbytes: int
    row_range: tuple[int, int]
    task_s: float = 0.0
    node_id: str = ""
    skipped: int = 0
    full_decodes: int = 0
    pid: int = 0
    batch_rows: tuple = ()
    counters: tuple = ()
    shard_state: Any = None

    def __post_init__(self) -> None:
        if self.num_rows < 0 or self.nbytes < 0:
            raise ValueError(f"num_rows and nbytes must be >= 0, found {self.num_rows}, {self.nbytes}")


class Batch(dict):
    """A batch handed to the consumer: a dict of columns plus ``provenance``.

    ``provenance`` is a tuple of :class:`Provenance` runs covering the batch's rows
    in order; ``parts`` lists ``(partition_id, rows)`` for each partition the
    batch's rows came from, in order (what a checkpoint records as consumed).
    """

    provenance: tuple[Provenance, ...] = ()
    parts: tuple[tuple[int, int], ...] = ()


def num_rows(block: Mapping[str, np.ndarray]) -> int:
    """Rows in a block (0 for a block with no columns)."""
    for col in block.values():
        return len(col)
    return 0


def block_nbytes(block: Mapping[str, np.ndarray]) -> int:
    """Bytes held by a block's arrays (object columns estimated per element)."""
    total = 0
    for col in block.values():
        arr = np.asarray(col)
        total += int(arr.nbytes)
        if arr.dtype == object:
            total += sum(_object_nbytes(x) for x in arr.ravel()[:64]) * max(1, arr.size) // max(1, min(arr.size, 64))
    return total


def _object_nbytes(x: Any, depth: int = 0) -> int:
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if isinstance(x, (bytes, bytearray, str)):
        return len(x)
    nbytes = getattr(x, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if depth < 4 and isinstance(x, (list, tuple)):
        return 16 + sum(_object_nbytes(v, depth + 1) for v in x)
    if depth < 4 and isinstance(x, dict):
        return 16 + sum(_object_nbytes(v, depth + 1) for v in x.values())
    if hasattr(x, "element_size") and hasattr(x, "numel"):  # torch.Tensor
        return int(x.element_size() * x.numel())
    return 64


def to_column(values: Sequence[Any]) -> np.ndarray:
    """Turn a list of per-row values into one column.

    Equal-shaped arrays and scalars are stacked; anything else becomes an object
    array (one element per row), so no row is ever split or merged.
    """
    n = len(values)
    if n == 0:
        return np.empty((0,), dtype=object)
    first = values[0]
    if hasattr(first, "numpy") and hasattr(first, "detach"):  # torch.Tensor
        values = [v.detach().cpu().numpy() for v in values]
        first = values[0]
    if isinstance(first, np.ndarray):
        shape = first.shape
        if all(isinstance(v, np.ndarray) and v.shape == shape for v in values):
            return np.stack(values)
    elif isinstance(first, (int, float, bool, np.number, np.bool_)):
        # NumPy's fast path only for numbers: mixed types would be coerced to
        # strings, and str/bytes dtypes drop trailing NULs.
        if all(isinstance(v, (int, float, bool, np.number, np.bool_)) for v in values):
            col = np.asarray(values)
            if col.ndim == 1 and col.dtype.kind in "biufc":
                return col
    col = np.empty((n,), dtype=object)
    for i, v in enumerate(values):
        col[i] = v
    return col


def from_rows(rows: Sequence[Mapping[str, Any]]) -> Block:
    """Columnarise a list of row dicts (all rows must have the same keys)."""
    if not rows:
        return {}
    keys = list(rows[0].keys())
    for i, row in enumerate(rows):
        if list(row.keys()) != keys and set(row.keys()) != set(keys):
            raise ValueError(
                f"rows must all have the same columns: row 0 has {sorted(keys)}, "
                f"row {i} has {sorted(row.keys())}"
            )
    return {k: to_column([r[k] for r in rows]) for k in keys}


def iter_rows(block: Mapping[str, np.ndarray]) -> Iterator[dict[str, Any]]:
    """Yield the rows of a block as dicts."""
    keys = list(block.keys())
    cols = [block[k] for k in keys]
    for i in range(num_rows(block)):
        yield {k: c[i] for k, c in zip(keys, cols)}


def slice_block(block: Mapping[str, np.ndarray], start: int, stop: int) -> Block:
    """Rows ``[start, stop)`` of a block (views, no copy)."""
    return {k: v[start:stop] for k, v in block.items()}


def take(block: Mapping[str, np.ndarray], indices: np.ndarray) -> Block:
    """Rows at ``indices`` of a block (a copy)."""
    return {k: v[indices] for k, v in block.items()}


def concat(blocks: Sequence[Mapping[str, np.ndarray]]) -> Block:
    """Concatenate blocks with the same columns (one copy)."""
    blocks = [b for b in blocks if b]
    if not blocks:
        return {}
    if len(blocks) == 1:
        return dict(blocks[0])
    keys = list(blocks[0].keys())
    out: Block = {}
    for k in keys:
        parts = [b[k] for b in blocks]
        if any(p.dtype == object for p in parts) and not all(p.dtype == object for p in parts):
            parts = [p.astype(object) if p.dtype != object else p for p in parts]
        try:
            out[k] = np.concatenate(parts)
        except ValueError:
            col = np.empty((sum(len(p) for p in parts),), dtype=object)
            i = 0
            for p in parts:
                for x in p:
                    col[i] = x
                    i += 1
            out[k] = col
    return out


def provenance_runs(epoch: int, partition_ids: np.ndarray, rows: np.ndarray) -> tuple[Provenance, ...]:
    """Compress per-row (partition, row) pairs into runs of contiguous rows.

    Args:
        epoch: the epoch of every row.
        partition_ids: partition id per row.
        rows: source row index per row.

    Returns:
        Runs in row order; a run covers rows ``[start, stop)`` of one partition
        where each row follows the previous one (a repeated row from ``flat_map``
        stays in the same run).
    """
    n = len(rows)
    if n == 0:
        return ()
    pids = np.asarray(partition_ids)
    rows = np.asarray(rows)
    step = np.diff(rows)
    breaks = np.nonzero((np.diff(pids) != 0) | (step < 0) | (step > 1))[0] + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [n]))
    return tuple(
        Provenance(epoch, int(pids[a]), (int(rows[a]), int(rows[b - 1]) + 1))
        for a, b in zip(starts, stops)
    )


def make_batch(pieces: Sequence[tuple[Block, int, int]]) -> Batch:
    """A :class:`Batch` from ``(block slice, partition id, epoch)`` pieces: their rows in
    order (one concatenation when there are several), the hidden row column turned into
    ``provenance``, and ``parts`` (rows per partition) for the consumed ledger."""
    blocks = [p[0] for p in pieces]
    data = concat(blocks) if len(blocks) > 1 else dict(blocks[0])
    rows = data.pop(ROW_COLUMN)
    pids = np.concatenate([np.full(num_rows(b), pid, dtype=np.int64) for b, pid, _ in pieces])
    batch = Batch(data)
    batch.provenance = provenance_runs(pieces[0][2], pids, rows)
    batch.parts = tuple((pid, num_rows(b)) for b, pid, _ in pieces)
    return batch


def strip_hidden(block: Mapping[str, np.ndarray]) -> Block:
    """The block without sbloader's hidden columns."""
    return {k: v for k, v in block.items() if k != ROW_COLUMN}


def column_names(blocks: Iterable[Mapping[str, Any]]) -> list[str]:
    """Sorted union of column names."""
    names: set[str] = set()
    for b in blocks:
        names.update(b.keys())
    return sorted(names)

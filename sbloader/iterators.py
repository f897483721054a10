"""Consumer-side iteration: fetch ready blocks zero-copy and cut them into batches.

The bytes of a block are fetched with one ``ray.get`` (zero-copy from the local
object store, or one transfer from the producing node), or read in place from the
consumer's shared-memory slot when its task ran on this node (see
``sbloader/_executor/handoff.py``). A batch inside one block
is a view; a batch spanning blocks costs one concatenation. Each block is
released to the executor's budget once every row of it has been handed out.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from .block import ROW_COLUMN, Batch, Block, BlockMeta, Provenance, concat, num_rows, provenance_runs, slice_block
from ._executor.executor import StreamingExecutor
from .wire import tensor_of


class Row(dict):
    """A row handed to the consumer, with ``provenance`` (a :class:`Provenance`)."""

    provenance: Optional[Provenance] = None


def iter_blocks(executor: StreamingExecutor) -> Iterator[tuple[Block, BlockMeta]]:
    """Yield ``(block, meta)`` as the executor makes them ready; shuts it down at the end.

    A block stays counted against the budget until the block after the next one
    is requested: the consumer typically still holds a batch (views of the
    previous block's buffer) while it asks for the next.
    """
    held: deque[BlockMeta] = deque()
    try:
        while True:
            item = executor.get_next()
            while len(held) > 1 or (item is None and held):
                executor.release(held.popleft().nbytes)
            if item is None:
                return
            block = executor.fetch(item)
            held.append(item.meta)
            yield block, item.meta
    finally:
        for meta in held:
            executor.release(meta.nbytes)
        executor.shutdown()


def iter_rows(blocks: Iterator[tuple[Block, BlockMeta]]) -> Iterator[Row]:
    """Yield rows (dicts with ``provenance``) from blocks."""
    for block, meta in blocks:
        rows_col = block[ROW_COLUMN]
        keys = [k for k in block if k != ROW_COLUMN]
        cols = [block[k] for k in keys]
        for i in range(meta.num_rows):
            row = Row((k, c[i]) for k, c in zip(keys, cols))
            r = int(rows_col[i])
            row.provenance = Provenance(meta.epoch, meta.partition_id, (r, r + 1))
            yield row


def iter_batches(
    blocks: Iterator[tuple[Block, BlockMeta]],
    batch_size: Optional[int],
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Re-cut blocks into batches of ``batch_size`` rows (None: one batch per block).

    Args:
        blocks: ``(block, meta)`` pairs.
        batch_size: rows per batch.
        drop_last: drop a final batch shorter than ``batch_size``.

    Yields:
        :class:`Batch` dicts with provenance; the hidden row column is removed.
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, found {batch_size}")
    pending: list[tuple[Block, int, int]] = []  # (block slice, partition id, epoch)
    pending_rows = 0
    for block, meta in blocks:
        n = meta.num_rows
        if n == 0:
            continue
        if batch_size is None:
            yield _make_batch([(block, meta.partition_id, meta.epoch)])
            continue
        start = 0
        while start < n:
            take_n = min(batch_size - pending_rows, n - start)
            pending.append((slice_block(block, start, start + take_n), meta.partition_id, meta.epoch))
            pending_rows += take_n
            start += take_n
            if pending_rows == batch_size:
                yield _make_batch(pending)
                pending, pending_rows = [], 0
    if pending and not drop_last:
        yield _make_batch(pending)


def _make_batch(pieces: list[tuple[Block, int, int]]) -> Batch:
    blocks = [p[0] for p in pieces]
    data = concat(blocks) if len(blocks) > 1 else dict(blocks[0])
    rows = data.pop(ROW_COLUMN)
    pids = np.concatenate([np.full(num_rows(b), pid, dtype=np.int64) for b, pid, _ in pieces])
    batch = Batch(data)
    batch.provenance = provenance_runs(pieces[0][2], pids, rows)
    batch.parts = tuple((pid, num_rows(b)) for b, pid, _ in pieces)
    return batch


def to_torch(
    batch: Mapping[str, Any],
    dtypes: Optional[Mapping[str, Any]] = None,
    device: Optional[str] = None,
    zero_copy: bool = False,
) -> dict[str, Any]:
    """Convert NumPy columns to torch tensors (object/string columns stay as they are).

    Args:
        batch: a batch of NumPy columns.
        dtypes: optional torch dtype per column.
        device: move tensors to this device.
        zero_copy: wrap the (read-only) buffers without copying; otherwise every
            tensor is writable, as torch's DataLoader gives: a read-only buffer (the
            object store's) is copied once, a writable one (a shared-memory slot,
            this batch's alone) wrapped as it is (:func:`~sbloader.wire.tensor_of`).
    """
    out: dict[str, Any] = Batch() if isinstance(batch, Batch) else {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.dtype != object and v.dtype.kind not in "USV":
            t = tensor_of(v, copy=not zero_copy)
            if dtypes and k in dtypes:
                t = t.to(dtypes[k])
            if device is not None:
                t = t.to(device)
            out[k] = t
        else:
            out[k] = v
    if isinstance(batch, Batch):
        out.provenance = batch.provenance
        out.parts = batch.parts
    return out

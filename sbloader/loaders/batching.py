"""Consumer-side iteration: fetch ready blocks zero-copy and cut them into batches.

The bytes of a block are fetched with one ``ray.get`` (zero-copy from the local
object store, or one transfer from the producing node), or read in place from the
consumer's shared-memory slot when its task ran on this node (see
``sbloader/executor/handoff.py``). A batch inside one block
is a view; a batch spanning blocks costs one concatenation. Each block is
released to the executor's budget once every row of it has been handed out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional


from sbloader.core.block import ROW_COLUMN, Batch, Block, BlockMeta, Provenance, make_batch, slice_block
from sbloader.executor.executor import StreamingExecutor
from sbloader.core.cut import Cutter
from sbloader.core.window import Window, WindowSpec, parse_window


class Row(dict):
    """A row handed to the consumer, with ``provenance`` (a :class:`Provenance`)."""

    provenance: Optional[Provenance] = None


class BlockFeed:
    """The ready blocks of an execution, each counted against its budget until released.

    Iterate it for ``(block, meta)``; it shuts the executor down at the end. With
    ``hold`` (the default) a block stays counted until the block after the next one
    is requested: the consumer typically still holds a batch (views of the previous
    block's buffer) while it asks for the next. With ``hold=None`` the consumer
    releases each block itself (:meth:`release`), as the shuffle window does, which
    keeps several blocks open at once.

    Args:
        executor: the running execution.
        hold: blocks kept counted behind the newest, or None for explicit releases.
    """

    def __init__(self, executor: StreamingExecutor, hold: Optional[int] = 1) -> None:
        self._executor = executor
        self._hold = hold
        self._held: dict[int, BlockMeta] = {}  # partition id -> meta, oldest first

    def release(self, meta: BlockMeta) -> None:
        """The consumer is done with the block of ``meta`` (idempotent)."""
        held = self._held.pop(meta.partition_id, None)
        if held is not None:
            self._executor.release_block(held)

    def __iter__(self) -> Iterator[tuple[Block, BlockMeta]]:
        executor = self._executor
        try:
            while True:
                item = executor.get_next()
                if self._hold is not None:
                    while len(self._held) > self._hold or (item is None and self._held):
                        self.release(next(iter(self._held.values())))
                if item is None:
                    return
                block = executor.fetch(item)
                self._held[item.meta.partition_id] = item.meta
                yield block, item.meta
        finally:
            for meta in list(self._held.values()):
                self.release(meta)
            executor.shutdown()


def iter_blocks(executor: StreamingExecutor) -> Iterator[tuple[Block, BlockMeta]]:
    """Yield ``(block, meta)`` as the executor makes them ready; shuts it down at the end
    (:class:`BlockFeed` with its default hold)."""
    return iter(BlockFeed(executor))


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


@dataclass(frozen=True)
class ShuffleWindow:
    """How shuffled batches are drawn from several blocks at once.

    Attributes:
        window: the epoch's resolved window (:class:`~sbloader.core.window.Window`), or a
            count of blocks (1 cuts each block on its own).
        epoch_seed: the epoch seed the draws derive from.
        first_batch: the index of the first batch (a resumed epoch goes on counting).
        release: called with a block's meta once no batch will take rows from it.
        weight: what a block weighs against the window's cap (default: its bytes for a
            window in bytes, its rows otherwise).
        observe: called with the :class:`~sbloader.core.cut.Cutter` after every batch
            (how wide the window was, whether the epoch did not fit it).
    """

    window: Any
    epoch_seed: int = 0
    first_batch: int = 0
    release: Optional[Callable[[BlockMeta], None]] = None
    weight: Optional[Callable[[BlockMeta], int]] = None
    observe: Optional[Callable[[Cutter], None]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.window, Window):
            object.__setattr__(self, "window", Window(partitions=parse_window(self.window).partitions or 0))

    def weigh(self, meta: BlockMeta) -> int:
        """The weight of a block against the window's cap."""
        if self.weight is not None:
            return int(self.weight(meta))
        return int(meta.nbytes if self.window.unit == "bytes" else meta.num_rows)


def window_of(source: Any, shuffle_window: Any = None) -> WindowSpec:
    """The shuffle window asked for: ``shuffle_window`` (validated, see
    :func:`~sbloader.core.window.parse_window`), or the source's default: one partition
    where a shuffled partition is already a uniform sample, else a share of the memory
    budget."""
    if shuffle_window is None and getattr(source, "shuffle_window", 1) is not None:
        return parse_window(int(getattr(source, "shuffle_window", 1)))
    return parse_window(shuffle_window)


def iter_batches(
    blocks: Iterator[tuple[Block, BlockMeta]],
    batch_size: Optional[int],
    drop_last: bool = False,
    window: Optional[ShuffleWindow] = None,
) -> Iterator[Batch]:
    """Re-cut blocks into batches of ``batch_size`` rows (None: one batch per block).

    Args:
        blocks: ``(block, meta)`` pairs.
        batch_size: rows per batch.
        drop_last: drop a final batch shorter than ``batch_size``.
        window: draw every batch from several open blocks (:func:`iter_mixed_batches`);
            None (or one block) cuts the blocks in turn.

    Yields:
        :class:`Batch` dicts with provenance; the hidden row column is removed.
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, found {batch_size}")
    if window is not None and not window.window.in_turn and batch_size is not None:
        yield from iter_mixed_batches(blocks, batch_size, drop_last, window)
        return
    release = window.release if window is not None else None
    pending: list[tuple[Block, int, int]] = []  # (block slice, partition id, epoch)
    pending_rows = 0
    for block, meta in blocks:
        n = meta.num_rows
        if n == 0:
            if release is not None:
                release(meta)
            continue
        if batch_size is None:
            yield make_batch([(block, meta.partition_id, meta.epoch)])
        else:
            start = 0
            while start < n:
                take_n = min(batch_size - pending_rows, n - start)
                pending.append((slice_block(block, start, start + take_n), meta.partition_id, meta.epoch))
                pending_rows += take_n
                start += take_n
                if pending_rows == batch_size:
                    yield make_batch(pending)
                    pending, pending_rows = [], 0
        if release is not None:
            release(meta)
    if pending and not drop_last:
        yield make_batch(pending)


def iter_mixed_batches(blocks: Iterator[tuple[Block, BlockMeta]], batch_size: int, drop_last: bool,
                       window: ShuffleWindow) -> Iterator[Batch]:
    """Batches drawn from every open block at once (the shuffle window).

    A :class:`~sbloader.core.cut.Cutter` decides each batch: a uniform draw without
    replacement over the open blocks' remaining rows, each block's rows taken in
    order; a block that runs out is replaced by the next ones the window has room for.
    Rows inside a block are already shuffled, so a block's first rows are a random
    sample of it, and what a block gave is always a prefix: the consumed ledger stays
    a count per partition. Blocks open in the order they arrive (one block waits
    while the window has no room for it); with a deterministic delivery order the
    batches depend on the epoch seed (and the blocks' weights) only. A block that ran
    out is released at once when its batch was a concatenation (a copy), else once
    the next batch is made (the consumer may still hold a view of it).
    """
    release = window.release or (lambda meta: None)
    observe = window.observe or (lambda cutter: None)
    source = iter(blocks)
    cutter = Cutter(window.window, window.epoch_seed, window.first_batch)
    opened: dict[int, tuple[Block, BlockMeta]] = {}  # partition id -> block
    waiting: Optional[tuple[Block, BlockMeta, int]] = None  # the next block, the window full
    ended = False
    done: list[BlockMeta] = []  # ran out in the last batch: released once the next is made
    try:
        while True:
            while not ended:
                if waiting is None:
                    try:
                        block, meta = next(source)
                    except StopIteration:
                        ended = True
                        break
                    if meta.num_rows == 0:
                        release(meta)
                        continue
                    waiting = (block, meta, window.weigh(meta))
                if not cutter.wants(batch_size, waiting[2]):
                    break
                block, meta, w = waiting
                waiting = None
                opened[meta.partition_id] = (block, meta)
                cutter.add(meta.partition_id, meta.num_rows, w)
            rows = min(batch_size, cutter.open_rows)
            if rows == 0 or (rows < batch_size and drop_last):
                return
            pieces = cutter.cut(rows)
            observe(cutter)
            batch = make_batch([(slice_block(opened[p.key][0], p.start, p.stop), p.key, opened[p.key][1].epoch)
                                 for p in pieces])
            for meta in done:
                release(meta)
            done = [opened.pop(p.key)[1] for p in pieces if p.stop >= opened[p.key][1].num_rows]
            if len(pieces) > 1:  # the batch is a copy: the blocks that ran out are free at once
                for meta in done:
                    release(meta)
                done = []
            yield batch
    finally:
        left = done + [m for _, m in opened.values()] + ([waiting[1]] if waiting is not None else [])
        for meta in left:
            release(meta)

"""How an epoch's rows are cut into batches (pure: no Ray, no I/O).

The consumer cuts batches from the partitions' output blocks. With a shuffle
window (:class:`~sbloader.core.window.Window`: a count of partitions, or a budget of
rows or bytes the open partitions may hold), each batch draws its rows from every
open partition at once, in proportion to what each has left (:func:`sbloader.core.plan.cut_counts`),
so a batch mixes partitions that each hold adjacent rows of the input (a Parquet
row group, a video). Each partition's rows are always taken in order: what a
partition gave is a prefix of its rows, which the consumed ledger records as a
count. With a window of one partition, batches are cut from the partitions in
turn, a batch spanning two only at their boundary.

:class:`Cutter` makes these decisions one batch at a time (the single-process
loader opens blocks as they arrive); :func:`cut_plan` runs it over the partitions'
row counts in plan order, for an epoch split across ranks: every rank computes the
same plan, so each knows which rows of which partitions its batches hold, and the
consumed ledger after every rank's first ``k`` batches is arithmetic
(:func:`consumed_after`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence, Union

import numpy as np

from sbloader.core.block import PADDING_KEY, ROW_COLUMN, Batch, concat, make_batch, slice_block
from sbloader.core.errors import SbloaderError
from sbloader.core.plan import cut_counts
from sbloader.core.split import split_epoch
from sbloader.core.window import Window, ramp_partitions, ramp_rows


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of one partition's remaining output rows.

    Attributes:
        key: the partition (its place in the plan, or any key the caller chose).
        start: first row, counted from the partition's first row not consumed before.
        stop: one past the last row.
    """

    key: Hashable
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"a piece needs 0 <= start < stop, found {self}")

    @property
    def rows(self) -> int:
        """Rows of the piece."""
        return self.stop - self.start


class Cutter:
    """Decides which rows of the open partitions each batch takes (pure state machine).

    Open partitions in plan order with :meth:`add` while :meth:`wants` says so, then
    :meth:`cut` a batch; a partition whose rows ran out closes. A partition opens when
    the batch needs its rows, or when the window has room for it: fewer open than its
    count, its weight (rows or bytes of the whole block, which stays in memory until its
    last row is taken) within what the open ones leave of the cap, and, for a budget
    window, fewer open than :func:`~sbloader.core.window.ramp_partitions` allows at this
    batch (or fewer rows left in them than :func:`~sbloader.core.window.ramp_rows`). Every rule depends on the plan, the weights and the batch index only, so a
    resumed epoch (same open partitions, same weights) opens and cuts as the
    uninterrupted one.

    Args:
        window: partitions a batch draws from at once (an int; 1: cut them in turn), or a
            resolved :class:`~sbloader.core.window.Window`.
        epoch_seed: the epoch seed the draws derive from.
        first_index: the index of the next batch (a resumed epoch goes on counting).

    Attributes:
        widest: the most partitions open when a batch was cut.
        narrowed: the window held a partition back for lack of room (count or cap): the
            epoch did not fit it.
    """

    def __init__(self, window: Union[int, Window], epoch_seed: int, first_index: int = 0) -> None:
        if not isinstance(window, Window):
            if window < 1:
                raise ValueError(f"window must be >= 1, found {window}")
            window = Window(partitions=int(window))
        self.window = window
        self.epoch_seed = epoch_seed
        self.index = first_index
        self._open: list[list] = []  # [key, rows, taken, weight], in the order they opened
        self._left = 0  # rows left in the open partitions
        self._held = 0  # weight of the open partitions
        self.widest = 0
        self.narrowed = False

    @property
    def open_rows(self) -> int:
        """Rows left in the open partitions."""
        return self._left

    @property
    def held(self) -> int:
        """Weight of the open partitions (rows or bytes of their whole blocks)."""
        return self._held

    @property
    def open_count(self) -> int:
        """Partitions open now."""
        return len(self._open)

    def wants(self, batch_rows: int, weight: Optional[int] = None) -> bool:
        """Whether to open one more partition (of ``weight``, when known) before the next batch
        of ``batch_rows`` rows: the batch needs it, or the window has room for it."""
        if self.open_rows < batch_rows:
            return True
        w, n = self.window, len(self._open)
        if w.partitions is not None and n >= w.partitions:
            # a window of one partition cuts them in turn (their rows are uniform samples): a
            # batch that spans two at a boundary is not a window the data did not fit
            self.narrowed = self.narrowed or (w.partitions > 1 and n > 1)
            return False
        if w.ramp and n >= ramp_partitions(self.index) and self.open_rows >= ramp_rows(self.index, batch_rows):
            return False
        if w.cap is not None and (weight is None or self.held + weight > w.cap):
            self.narrowed = self.narrowed or weight is not None
            return False
        return True

    def add(self, key: Hashable, rows: int, weight: Optional[int] = None) -> None:
        """Open a partition with ``rows`` rows left (none: ignored), weighing ``weight``
        (default: ``rows``) against the window's cap."""
        if rows < 0:
            raise ValueError(f"rows must be >= 0, found {rows}")
        if rows:
            self._open.append([key, rows, 0, rows if weight is None else int(weight)])
            self._left += rows
            self._held += self._open[-1][3]

    def cut(self, batch_rows: int) -> tuple[Piece, ...]:
        """The pieces of the next batch (``batch_rows`` at most the open rows).

        Returns:
            Pieces in the order their partitions opened; a partition gives at most one.
        """
        remaining = [e[1] - e[2] for e in self._open]
        self.widest = max(self.widest, len(self._open))
        if self.window.in_turn:
            counts, need = [], batch_rows
            for r in remaining:  # in turn: the oldest partition's rows first
                counts.append(min(r, need))
                need -= counts[-1]
            if need:
                raise ValueError(f"cannot take {batch_rows} rows from partitions with {remaining} rows left")
        else:
            counts = [int(c) for c in cut_counts(remaining, batch_rows, self.epoch_seed, self.index)]
        pieces = []
        closed = False
        for entry, c in zip(self._open, counts):
            if c:
                pieces.append(Piece(entry[0], entry[2], entry[2] + c))
                entry[2] += c
                self._left -= c
                if entry[2] >= entry[1]:
                    self._held -= entry[3]
                    closed = True
        if closed:
            self._open = [e for e in self._open if e[2] < e[1]]
        self.index += 1
        return tuple(pieces)


@dataclass(frozen=True)
class BatchCut:
    """One batch of an epoch split across ranks.

    Attributes:
        index: the batch's place in this run's cut sequence (its rank receives it
            as its ``index // world_size``-th batch).
        rank: the rank that receives it.
        pieces: its real rows.
        pad: rows repeated after the real ones, marked as padding (a rank with no
            row left when fewer rows than ranks remain).
        pad_piece: the row the padding repeats (the epoch's last real row).
    """

    index: int
    rank: int
    pieces: tuple[Piece, ...]
    pad: int = 0
    pad_piece: Optional[Piece] = None

    @property
    def rows(self) -> int:
        """Real (unpadded) rows."""
        return sum(p.rows for p in self.pieces)


@dataclass(frozen=True)
class CutPlan:
    """Every batch of an epoch (or of what a resumed epoch has left) across ranks.

    Attributes:
        batches: in cut order; batch ``i`` goes to rank ``i % world_size``.
        world_size: ranks.
        per_rank: batches each rank receives.
        first_index: the cut index of ``batches[0]`` in the whole epoch (seeds the draws).
        dropped: rows left out by ``drop_last``.
        widest: the most partitions a batch drew from.
        narrowed: the shuffle window could not hold the epoch (see :class:`Cutter`).
    """

    batches: tuple[BatchCut, ...]
    world_size: int
    per_rank: int
    first_index: int = 0
    dropped: int = 0
    widest: int = 0
    narrowed: bool = False

    def for_rank(self, rank: int) -> list[BatchCut]:
        """The batches of ``rank``, in the order it receives them."""
        return [b for b in self.batches if b.rank == rank]


def cut_plan(rows: Sequence[int], batch_size: int, world_size: int, drop_last: bool, window: Union[int, Window],
             epoch_seed: int, first_index: int = 0, weights: Optional[Sequence[int]] = None) -> CutPlan:
    """Cut partitions (``rows[i]`` rows left at place ``i`` of the plan) into equal per-rank batches.

    The sizes come from :func:`sbloader.core.split.split_epoch` (full batches round-robin
    over the ranks, then one short batch per rank, padding only when fewer rows
    than ranks remain); the rows of each from a :class:`Cutter` that opens the
    partitions in plan order.

    Args:
        rows: rows each partition has left, in plan order (keys of the pieces: places).
        batch_size: rows per full batch.
        world_size: ranks.
        drop_last: drop the rows that cannot fill a batch on every rank.
        window: partitions a batch draws from at once, or a resolved window.
        epoch_seed: the epoch seed.
        first_index: the cut index of the first batch (a resumed epoch goes on counting).
        weights: what each partition weighs against a window's cap (default: ``rows``; a
            resumed epoch passes its partly consumed partitions' whole row counts, as
            their blocks hold them all).
    """
    split = split_epoch(sum(rows), batch_size, world_size, drop_last)
    cutter = Cutter(window, epoch_seed, first_index)
    weights = rows if weights is None else weights
    places = iter([(i, n, weights[i]) for i, n in enumerate(rows) if n > 0])
    nxt = next(places, None)
    out: list[BatchCut] = []
    last: Optional[Piece] = None
    for spec in split.batches:
        if spec.rows:
            while nxt is not None and cutter.wants(spec.rows, nxt[2]):
                cutter.add(*nxt)
                nxt = next(places, None)
            pieces = cutter.cut(spec.rows)
            last = pieces[-1]
            out.append(BatchCut(spec.index, spec.rank, pieces))
        else:
            cutter.index += 1  # a batch of padding only: the draws of later batches stay as planned
            out.append(BatchCut(spec.index, spec.rank, (), spec.pad,
                                Piece(last.key, last.stop - 1, last.stop) if last is not None else None))
    return CutPlan(tuple(out), world_size, split.per_rank, first_index, split.dropped, cutter.widest,
                   cutter.narrowed)


def consumed_after(plan: CutPlan, k: int) -> dict[Hashable, int]:
    """Rows of each partition consumed once every rank took its first ``k`` batches of the plan.

    Batch ``i`` goes to rank ``i % world_size`` as its ``i // world_size``-th batch,
    so those are the batches ``i < k * world_size``; each partition's share is a
    prefix of its rows (padding left out).
    """
    taken: dict[Hashable, int] = {}
    for b in plan.batches[: max(0, k) * plan.world_size]:
        for p in b.pieces:
            taken[p.key] = max(taken.get(p.key, 0), p.stop)
    return taken


def last_use(plan: CutPlan) -> dict[Hashable, int]:
    """For each partition, the cut index (in ``plan.batches``) of the last batch taking its rows."""
    out: dict[Hashable, int] = {}
    for i, b in enumerate(plan.batches):
        for p in b.pieces:
            out[p.key] = i
        if b.pad_piece is not None:
            out[b.pad_piece.key] = i
    return out


def progress(consumed: Sequence[int]) -> int:
    """Batches of the cut sequence every rank is past: all batches with a lower index were
    consumed (rank ``r`` consumed ``consumed[r]`` batches: indices ``r, r+w, ...``)."""
    w = len(consumed)
    return min(k * w + r for r, k in enumerate(consumed))


def places(b: BatchCut) -> tuple[Piece, ...]:
    """The pieces a batch takes rows from: its real ones, then the one its padding repeats."""
    return b.pieces + ((b.pad_piece,) if b.pad_piece is not None else ())


def checked_rows(block: dict, pid: int, expect: int) -> dict:
    """The block of partition ``pid``, once it holds the ``expect`` rows the plan counted (an operator
    that changed the row count is an error: the ranks' batches were cut from those counts)."""
    n = len(block[ROW_COLUMN]) if ROW_COLUMN in block else 0
    if n != expect:
        raise SbloaderError(f"partition {pid} gave {n} rows where the plan counted {expect}: split across ranks, "
                            "a native pipeline's operators must keep one output row per input row")
    return block


def assemble(b: BatchCut, pids: Sequence[int], epoch: int, blocks: dict, offset: dict) -> Batch:
    """One batch's rows cut from its partitions' blocks; padding rows marked.

    Args:
        b: the batch.
        pids: the partition id at each place of the plan (the pieces' keys).
        epoch: the epoch (each row's provenance).
        blocks: partition id -> its whole output block.
        offset: place -> rows of its partition consumed before the plan (a piece's rows
            are counted from there).
    """
    pieces = [(slice_block(blocks[pids[p.key]], offset[p.key] + p.start, offset[p.key] + p.stop),
               pids[p.key], epoch) for p in b.pieces]
    if not b.pad:
        return make_batch(pieces)
    p = b.pad_piece
    row = slice_block(blocks[pids[p.key]], offset[p.key] + p.start, offset[p.key] + p.stop)
    data = concat([piece for piece, _, _ in pieces] + [row] * b.pad)
    data.pop(ROW_COLUMN, None)
    out = Batch(data)
    real = sum(len(piece[ROW_COLUMN]) for piece, _, _ in pieces)
    out[PADDING_KEY] = np.arange(real + b.pad) >= real
    if pieces:
        first = make_batch(pieces)
        out.provenance, out.parts = first.provenance, first.parts
    return out

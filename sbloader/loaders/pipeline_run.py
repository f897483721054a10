"""One epoch of a native pipeline loader, as its checkpoint sees it: what was planned and
what the training loop took.

A partition replays bit for bit (its members, rows and augmentations derive from
the epoch seed and its id), and a batch takes each partition's rows in order (the
shuffle window takes a prefix of every open partition). So an epoch's progress is
the set of partitions fully consumed plus, for the few partly consumed, how many
of their output rows were taken; resuming re-runs the unfinished partitions and
drops those first rows (:func:`skip_consumed`).

:class:`PipelineRun` is the epoch of one consumer, recorded batch by batch as the
loop takes them; :class:`SplitRun` the epoch of one rank of a job, whose progress
is arithmetic on the job's cut plan (:func:`~sbloader.core.cut.consumed_after`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

from sbloader.core import ledger, row_ledger
from sbloader.core.block import Block, BlockMeta, num_rows, slice_block, take
from sbloader.core.cut import CutPlan, consumed_after, cut_plan
from sbloader.core.errors import SbloaderError


@dataclass
class PipelineRun:
    """One (possibly resumed) epoch of a native pipeline with one consumer.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        done: ids of partitions fully consumed (before and during this run).
        taken: rows consumed so far per partition not yet done.
        totals: output rows of each partition seen in this run.
        complete: the epoch ran to its end.
        order: the partition ids of the epoch's whole plan, in order.
        batches: batches the training loop took in this epoch (before and during this
            run; padding left out): a resumed epoch's shuffle window goes on counting.
        window: the epoch's budget shuffle window as ``[cap, unit]`` once resolved (a
            resumed epoch cuts with it), or None.
        ahead: rows consumed past ``taken``'s prefix, per partition (ranges of its rows;
            :mod:`~sbloader.core.row_ledger`): only in a state that credited the first rows
            of every rank's pending batch.
    """

    epoch: int
    epoch_seed: int
    done: set = field(default_factory=set)
    taken: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    complete: bool = False
    order: tuple = ()
    batches: int = 0
    window: Optional[list] = None
    ahead: dict = field(default_factory=dict)

    def unfinished(self) -> tuple:
        """The partition ids still to run, in plan order."""
        return tuple(pid for pid in self.order if pid not in self.done)

    def consumed(self, partition_id: int) -> int:
        """Rows consumed of a partition not yet done (its prefix and any rows ahead of it)."""
        if partition_id in self.ahead:
            return row_ledger.consumed(self.taken.get(partition_id, 0), self.ahead[partition_id])
        return self.taken.get(partition_id, 0)

    def see(self, partition_id: int, rows: int) -> None:
        """Record a partition's output rows (it is done at once when nothing of it is left)."""
        self.totals[partition_id] = rows
        if rows == 0 or self.consumed(partition_id) >= rows:
            self.mark_done(partition_id)

    def consume(self, parts: tuple) -> None:
        """Record a batch handed to the training loop (``parts``: ``(partition id, rows)``;
        empty for a batch of padding)."""
        if parts:
            self.batches += 1
        for pid, n in parts:
            self.credit(pid, [(0, n)])
            if pid in self.totals and self.consumed(pid) >= self.totals[pid]:
                self.mark_done(pid)

    def credit(self, partition_id: int, left: list) -> None:
        """Count the partition's rows ``left`` (ranges of the rows it has left, counted from its
        first row not consumed) as consumed."""
        prefix = self.taken.get(partition_id, 0)
        if partition_id not in self.ahead and len(left) == 1 and left[0][0] == 0:
            self.taken[partition_id] = prefix + int(left[0][1])
            return
        prefix, rest = row_ledger.credit(prefix, self.ahead.get(partition_id, ()), left)
        self.taken[partition_id] = prefix
        if rest:
            self.ahead[partition_id] = rest
        else:
            self.ahead.pop(partition_id, None)

    def mark_done(self, partition_id: int) -> None:
        """The partition is consumed whole."""
        self.done.add(partition_id)
        self.taken.pop(partition_id, None)
        self.ahead.pop(partition_id, None)

    def took(self, record: tuple) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the loop took a batch: ``(parts, sizes seen)``."""
        parts, seen = record
        for pid, rows in seen:  # partition sizes the fetch thread saw before this batch
            self.see(pid, rows)
        self.consume(parts)

    def finished(self) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the epoch ran to its end."""
        self.complete = True

    def progress(self) -> "PipelineRun":
        """The run as a checkpoint records it (itself: it is kept batch by batch)."""
        return self


def skip_consumed(blocks: Iterator[tuple[Block, BlockMeta]], run: PipelineRun,
                  facts: list) -> Iterator[tuple[Block, BlockMeta]]:
    """Drop the rows a resumed partition had already delivered.

    Each partition's output rows are appended to ``facts`` as ``(partition id,
    rows)`` for the consumer to record with :meth:`PipelineRun.see`: this generator
    runs in the fetch thread and only reads ``run``.
    """
    for block, meta in blocks:
        pid = meta.partition_id
        skip = run.taken.get(pid, 0)
        facts.append((pid, meta.num_rows))
        if meta.num_rows == 0 or run.consumed(pid) >= meta.num_rows:
            continue
        if pid in run.ahead:
            block = without(block, run.ahead[pid])
            meta = replace(meta, num_rows=meta.num_rows - ledger.count(run.ahead[pid]))
        if skip:
            block = slice_block(block, skip, meta.num_rows)
            meta = replace(meta, num_rows=meta.num_rows - skip)
        yield block, meta


def without(block: Block, ahead: list) -> Block:
    """A partition's block without the rows consumed ahead of its prefix (``ahead``: ranges)."""
    return take(block, ledger.to_positions(ledger.complement(ahead, num_rows(block))))


@dataclass
class SplitRun:
    """One (possibly resumed) epoch of a native pipeline on one rank of a job.

    Attributes:
        base: the epoch as one consumer sees it (epoch, seed, plan order, partitions
            done and rows taken before this run, batches before it).
        pids: the partitions still to run, in plan order (the pieces' keys are places here).
        rows: each one's rows left (known up front: the source counts them and no
            operator changes the row count).
        plan: the job's cut plan of this run (the same on every rank).
        rank: this rank.
        taken: batches this rank's training loop took in this run.
        complete: the epoch ran to its end on this rank.
    """

    base: PipelineRun
    pids: tuple[int, ...]
    rows: tuple[int, ...]
    plan: CutPlan
    rank: int
    taken: int = 0
    complete: bool = False

    @property
    def epoch(self) -> int:
        """The epoch number."""
        return self.base.epoch

    def took(self, record: Any) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the loop took one of this rank's batches."""
        self.taken += 1

    def finished(self) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the epoch ran to its end on this rank."""
        self.complete = True

    def progress(self, k: Optional[int] = None, rows: int = 0) -> PipelineRun:
        """The epoch's consumed state once every rank took ``k`` batches (default: this rank's count)
        and the first ``rows`` rows of its next one (a mixture's credit, see
        :meth:`~sbloader.loaders.pipeline_loader.PipelineLoader.credit_rows`)."""
        k = self.taken if k is None else k
        base = self.base
        run = PipelineRun(base.epoch, base.epoch_seed, done=set(base.done), taken=dict(base.taken),
                          order=base.order, batches=self.plan.first_index + k * self.plan.world_size,
                          complete=self.complete, window=base.window,
                          ahead={pid: list(r) for pid, r in base.ahead.items()})
        left: dict = {place: [(0, n)] for place, n in consumed_after(self.plan, k).items()}
        for b in self.plan.batches[k * self.plan.world_size:(k + 1) * self.plan.world_size] if rows else ():
            need = rows  # the first rows of each rank's next batch: a prefix of its pieces
            for p in b.pieces:
                if need <= 0:
                    break
                left.setdefault(p.key, []).append((p.start, p.start + min(need, p.rows)))
                need -= p.rows
        for place, ranges in left.items():
            pid = self.pids[place]
            run.credit(pid, ranges)
            if run.consumed(pid) >= base.consumed(pid) + self.rows[place]:
                run.mark_done(pid)
        return run

    def whole(self, place: int) -> int:
        """Rows of the whole output block of the partition at ``place``."""
        return self.base.consumed(self.pids[place]) + self.rows[place]

    def strip(self, place: int, block: Block) -> Block:
        """A partition's whole block as this run cuts it: without the rows consumed ahead of its
        prefix (the pieces count from the prefix)."""
        ahead = self.base.ahead.get(self.pids[place])
        return without(block, ahead) if ahead else block


def plan_split(base: PipelineRun, sizes: dict, rows_changing: bool, batch_size: int, world_size: int,
               rank: int, drop_last: bool, window: Any) -> SplitRun:
    """Cut what the epoch has left into the job's batches (the same plan on every rank).

    Args:
        base: the epoch as one consumer sees it.
        sizes: output rows of every partition id (None where the source cannot tell).
        rows_changing: an operator may change the number of rows (``filter``, ``flat_map``).
        batch_size, world_size, rank, drop_last: the job's batching.
        window: partitions a batch draws from at once, or the epoch's resolved
            :class:`~sbloader.core.window.Window` (weighed in rows).

    Raises:
        SbloaderError: a partition's size is unknown or an operator may change it.
    """
    pids = base.unfinished()
    if rows_changing or any(sizes.get(pid) is None for pid in pids):
        raise SbloaderError(
            "split across ranks, a native pipeline cuts every rank's batches from a plan of its partitions' row "
            "counts: its source must know partition sizes and its operators must keep one output row per input "
            "row (no filter/flat_map); or set world_size=1 / use sbloader.DataLoader"
        )
    rows = tuple(int(sizes[pid]) - base.consumed(pid) for pid in pids)
    whole = tuple(int(sizes[pid]) for pid in pids)  # a partly consumed block still holds all its rows
    plan = cut_plan(rows, batch_size, world_size, drop_last, window, base.epoch_seed, base.batches, whole)
    return SplitRun(base, pids, rows, plan, rank)

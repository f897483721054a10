"""A native pipeline's epoch split across ranks (torchrun): one pipeline for the job,
batches cut by each rank from a plan every rank computes alike.

Rank 0 starts the epoch on the job's split coordinator, which runs the pipeline
once and holds its partitions' blocks. Every rank computes the same
:func:`~sbloader.cut.cut_plan` from the partitions' row counts: which rows of which
partitions each of its batches holds (under ``shuffle`` drawn from several
partitions at once, so a rank's batches mix the whole dataset, not only partitions
it would own). A rank asks the coordinator for the refs of the blocks its next
batches need, fetches them (zero-copy on its node) and cuts its batches; the
coordinator releases a block once every rank is past the last batch that takes
its rows. Equal batch counts come from :func:`~sbloader.split.split_epoch`, and the
consumed ledger after every rank's ``k`` batches is arithmetic
(:func:`~sbloader.cut.consumed_after`): a checkpoint needs no call to anyone.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import ray

from .block import PADDING_KEY, ROW_COLUMN, Batch, concat, slice_block
from .cut import CutPlan, consumed_after, cut_plan, last_use
from .errors import SbloaderError
from .iterators import _make_batch
from .plan import EpochPlan

if TYPE_CHECKING:
    from ._pipeline_state import PipelineRun
    from .pipeline_loader import PipelineLoader

logger = logging.getLogger(__name__)

_WAIT_S = 1.0  # one coordinator request waits at most this long for a block
_AHEAD = 2  # batches whose blocks a rank asks for ahead of the one it cuts


@dataclass
class SplitRun:
    """One (possibly resumed) epoch of a native pipeline on this rank, split across ranks.

    Attributes:
        base: the epoch's run as a single consumer sees it (epoch, seed, plan order,
            partitions done and rows taken before this run, batches before it).
        pids: the partitions still to run, in plan order (the pieces' keys are places here).
        rows: each one's output rows (known up front: the source counts them and no
            operator changes the row count).
        plan: the cut plan of this run.
        taken: batches this rank's training loop took in this run.
        complete: the epoch ran to its end on this rank.
    """

    base: "PipelineRun"
    pids: tuple[int, ...]
    rows: tuple[int, ...]
    plan: CutPlan
    taken: int = 0
    complete: bool = False
    _snapshots: dict = field(default_factory=dict, repr=False)

    def snapshot(self, k: Optional[int] = None) -> "PipelineRun":
        """The epoch's consumed state once every rank took ``k`` batches (default: this rank's count)."""
        from ._pipeline_state import PipelineRun

        k = self.taken if k is None else k
        base = self.base
        run = PipelineRun(base.epoch, base.epoch_seed, done=set(base.done), taken=dict(base.taken),
                          order=base.order, batches=self.plan.first_index + k * self.plan.world_size,
                          complete=self.complete)
        for place, n in consumed_after(self.plan, k).items():
            pid = self.pids[place]
            total = base.taken.get(pid, 0) + n
            if total >= base.taken.get(pid, 0) + self.rows[place]:
                run.done.add(pid)
                run.taken.pop(pid, None)
            else:
                run.taken[pid] = total
        return run


def plan_split(loader: "PipelineLoader", base: "PipelineRun") -> SplitRun:
    """Cut what the epoch has left into this job's batches (the same on every rank)."""
    world = loader.world
    parts = {p.id: p for p in loader.dataset.source.partitions(base.epoch, base.epoch_seed, shuffle=loader.shuffle)}
    pids = tuple(pid for pid in base.order if pid not in base.done)
    sizes = [parts[pid].num_rows for pid in pids]
    if any(n is None for n in sizes) or loader.dataset.num_rows_changing():
        raise SbloaderError(
            "split across ranks, a native pipeline cuts every rank's batches from a plan of its partitions' row "
            "counts: its source must know partition sizes and its operators must keep one output row per input "
            "row (no filter/flat_map); or set world_size=1 / use sbloader.DataLoader"
        )
    rows = tuple(int(n) - base.taken.get(pid, 0) for pid, n in zip(pids, sizes))
    plan = cut_plan(rows, loader.batch_size, world.world_size, loader.drop_last, loader._window(),
                    base.epoch_seed, base.batches)
    return SplitRun(base, pids, rows, plan)


def _spec(loader: "PipelineLoader", run: SplitRun) -> Any:
    from .coordinator import PartitionEpochSpec

    base = run.base
    uses = last_use(run.plan)
    plan = EpochPlan(base.epoch, base.epoch_seed, run.pids, loader.shuffle)
    return PartitionEpochSpec(base.epoch, base.epoch_seed, loader.dataset.source, loader.dataset.ops, plan,
                              loader._coordinator_options(plan), run.plan.per_rank,
                              {run.pids[place]: i for place, i in uses.items()})


def _join(loader: "PipelineLoader", coord: Any, run: SplitRun) -> None:
    """Rank 0 starts the epoch; the others wait for it and check they planned alike."""
    w = loader.world
    if w.rank == 0:
        per_rank = ray.get(coord.start_partition_epoch.remote(_spec(loader, run)))
    else:
        per_rank = ray.get(coord.wait_epoch.remote(run.base.epoch, 300.0))
        if per_rank is None:
            raise SbloaderError(f"rank 0 did not start epoch {run.base.epoch} within 300 s; is rank 0 iterating "
                                "this loader?")
    if per_rank != run.plan.per_rank:
        raise SbloaderError(
            f"rank {w.rank} planned {run.plan.per_rank} batches for epoch {run.base.epoch} but rank 0 planned "
            f"{per_rank}: every rank must load the same state and use the same loader arguments"
        )


def produce(loader: "PipelineLoader", coord: Any, run: SplitRun) -> Iterator[tuple[Batch, int]]:
    """(Fetch thread) This rank's batches as ``(batch, index)``: block refs asked ahead, blocks
    fetched once and kept while a later batch of this rank takes their rows."""
    w = loader.world
    epoch = run.base.epoch
    mine = run.plan.for_rank(w.rank)
    offset = {place: run.base.taken.get(pid, 0) for place, pid in enumerate(run.pids)}
    last_mine: dict[int, int] = {}
    for j, b in enumerate(mine):
        for p in b.pieces + ((b.pad_piece,) if b.pad_piece is not None else ()):
            last_mine[run.pids[p.key]] = j
    refs: dict[int, Any] = {}
    blocks: dict[int, Any] = {}

    def needed(j: int) -> list[int]:
        out: list[int] = []
        for b in mine[j:j + 1 + _AHEAD]:
            for p in b.pieces + ((b.pad_piece,) if b.pad_piece is not None else ()):
                pid = run.pids[p.key]
                if pid not in out and pid not in refs and pid not in blocks:
                    out.append(pid)
        return out

    for j, b in enumerate(mine[run.taken:], start=run.taken):
        want = needed(j)
        now = [run.pids[p.key] for p in b.pieces] + ([run.pids[b.pad_piece.key]] if b.pad_piece else [])
        while any(pid not in refs and pid not in blocks for pid in now):
            reply = ray.get(coord.block_refs.remote(epoch, w.rank, run.taken, want, _WAIT_S))
            refs.update(reply["refs"])
            want = [pid for pid in want if pid not in refs]
        for pid in now:
            if pid not in blocks:
                block = ray.get(refs.pop(pid))
                n = len(block[ROW_COLUMN]) if ROW_COLUMN in block else 0
                place = run.pids.index(pid)
                expect = offset[place] + run.rows[place]
                if n != expect:
                    raise SbloaderError(
                        f"partition {pid} gave {n} rows where the plan counted {expect}: split across ranks, a "
                        "native pipeline's operators must keep one output row per input row"
                    )
                blocks[pid] = block
        yield _assemble(b, run, blocks, offset, epoch), j
        for pid in [pid for pid, last in last_mine.items() if last == j]:
            blocks.pop(pid, None)
            refs.pop(pid, None)


def _assemble(b: Any, run: SplitRun, blocks: dict, offset: dict, epoch: int) -> Batch:
    """The rows of one batch cut from its partitions' blocks; padding rows marked."""
    pieces = [(slice_block(blocks[run.pids[p.key]], offset[p.key] + p.start, offset[p.key] + p.stop),
               run.pids[p.key], epoch) for p in b.pieces]
    if not b.pad:
        return _make_batch(pieces)
    p = b.pad_piece
    row = slice_block(blocks[run.pids[p.key]], offset[p.key] + p.start, offset[p.key] + p.stop)
    data = concat([piece for piece, _, _ in pieces] + [row] * b.pad)
    data.pop(ROW_COLUMN, None)
    out = Batch(data)
    real = sum(len(piece[ROW_COLUMN]) for piece, _, _ in pieces)
    out[PADDING_KEY] = np.arange(real + b.pad) >= real
    if pieces:
        first = _make_batch(pieces)
        out.provenance, out.parts = first.provenance, first.parts
    return out


def iterate(loader: "PipelineLoader", run: SplitRun, stalls: Any) -> Iterator[tuple[Batch, int]]:
    """(Fetch thread) Join the epoch on the job's coordinator, then this rank's batches."""
    coord = loader._split_coordinator()
    _join(loader, coord, run)
    try:
        yield from produce(loader, coord, run)
    finally:
        try:
            coord.finish.remote(run.base.epoch, loader.world.rank, run.taken)
        except Exception:
            pass

"""Code that runs remotely: the read/task stage function and the pool actor.

Each partition produces exactly one output block plus its :class:`BlockMeta` (two
return objects; a read call may take several partitions and returns two objects
per partition), so the executor schedules on metadata without touching bytes, and
a retried task replaces its results instead of adding rows.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import ray

from sbloader.core.block import (BATCH_ROWS_COLUMN, ROW_COLUMN, SHARD_STATE_COLUMN, Block, BlockMeta, block_nbytes,
                                 num_rows, take)
from sbloader.core.context import TaskCounts, join_deferred, merge_counters, take_deferred, task_context
from sbloader.core.errors import SourceReadError, UserFunctionError, picklable
from sbloader.core.ops import Op, apply_op
from sbloader.core.plan import row_permutation
from sbloader.sources.base import Partition
from sbloader.executor.slot_store import SlotLease, store_here
from sbloader.executor.task_args import Packed, SharedRef, pack, unpack  # noqa: F401 (this module's API)

_NODE_ID: list[str] = []


@dataclass(frozen=True)
class EpochInfo:
    """The epoch facts every task needs.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        shuffle_rows: whether to shuffle rows inside each partition.
    """

    epoch: int
    epoch_seed: int
    shuffle_rows: bool = False


def _node_id() -> str:
    if not _NODE_ID:
        try:
            _NODE_ID.append(ray.get_runtime_context().get_node_id())
        except Exception:
            _NODE_ID.append("")
    return _NODE_ID[0]


def make_meta(block: Block, info: EpochInfo, partition_id: int, seq: int, t0: float, counts: TaskCounts,
              counters: Optional[dict] = None, node_id: Optional[str] = None) -> BlockMeta:
    """The metadata of ``block``, made for partition ``partition_id`` (``seq``: its place in the plan)
    by a task that began at ``t0``; ``node_id``: where (default: this Ray node)."""
    rows = block.get(ROW_COLUMN)
    rr = (int(rows.min()), int(rows.max()) + 1) if rows is not None and len(rows) else (0, 0)
    return BlockMeta(
        epoch=info.epoch,
        partition_id=partition_id,
        seq=seq,
        num_rows=num_rows(block),
        nbytes=block_nbytes(block),
        row_range=rr,
        task_s=time.perf_counter() - t0,
        node_id=_node_id() if node_id is None else node_id,
        skipped=counts.skipped,
        full_decodes=counts.full_decodes,
        pid=os.getpid(),
        batch_rows=tuple(int(n) for n in block[BATCH_ROWS_COLUMN]) if BATCH_ROWS_COLUMN in block else (),
        counters=tuple(sorted(counters.items())) if counters else (),
        shard_state=_last_state(block.get(SHARD_STATE_COLUMN)),
    )


def _last_state(snaps: Any) -> Any:
    """The last ``(shard, snapshot)`` of a shard block's column (None: no column, or no snapshot)."""
    if snaps is None:
        return None
    for snap in reversed(snaps):
        if snap is not None:
            return tuple(snap)
    return None


def apply_ops(ops: Sequence[Op], block: Block, info: EpochInfo, partition_id: int,
              fns: Optional[Sequence[Callable]] = None) -> tuple[Block, TaskCounts]:
    """Apply operators in order, each under its partition's seeded context.

    Returns:
        The output block and what the user functions counted (rows skipped, whole decodes).
    """
    counts = TaskCounts()
    for i, op in enumerate(ops):
        fn = fns[i] if fns is not None else op.fn
        ctx = task_context(info.epoch, info.epoch_seed, partition_id, op.name, op.index)
        try:
            with ctx as c:
                block = apply_op(op, fn, block)
                counts = counts + TaskCounts.of(c)
        except UserFunctionError:
            raise
        except Exception as e:
            raise UserFunctionError(op.name, partition_id, info.epoch, traceback.format_exc(), repr(e),
                                    original=picklable(e)) from e
    return block, counts


def read_partition(reader_and_shared: tuple, partition: Partition, info: EpochInfo, name: str,
                   counters: Optional[dict] = None, deferred: Optional[list] = None) -> tuple[Block, TaskCounts]:
    """Read a partition, attach the row column and apply the epoch's row shuffle; the
    counts the read reported (:func:`~sbloader.core.context.report_counters`) are added to ``counters``.
    ``deferred``: where the work the read left running goes (its cache writes:
    :func:`~sbloader.core.context.defer`), for the caller to join after the operators; None: joined here."""
    reader, shared = reader_and_shared
    ctx = task_context(info.epoch, info.epoch_seed, partition.id, name, -1)
    try:
        with ctx as c:
            block = reader(shared, partition)
            if deferred is not None:
                take_deferred(deferred)
    except UserFunctionError:
        raise
    except Exception as e:
        path = partition.label if partition.label and os.path.exists(partition.label) else None
        raise SourceReadError(name, partition.id, info.epoch, traceback.format_exc(),
                              f"{e!r} (reading {partition.label})", path=path) from e
    n = num_rows(block)
    if ROW_COLUMN not in block:
        block = dict(block)
        block[ROW_COLUMN] = np.arange(n, dtype=np.int64)
    if info.shuffle_rows and n > 1:
        block = take(block, row_permutation(n, info.epoch_seed, partition.id))
    if counters is not None:
        merge_counters(counters, c.counters)
    return block, TaskCounts.of(c)


def read_partitions(reader_and_shared: tuple, partitions: Sequence[Partition], seqs: Sequence[int],
                    info: EpochInfo, name: str, ops: Sequence[Op], fns: Optional[Sequence[Callable]] = None,
                    leases: Optional[Sequence[Optional[SlotLease]]] = None) -> tuple:
    """Read partitions one after another, each through the operators on its own:
    ``(block_1, meta_1, ..., block_k, meta_k)``; a block with a lease on this node is
    written into its shared-memory slot (see :mod:`.handoff`)."""
    rs = unpack(reader_and_shared)
    out: list = []
    for j, (part, seq) in enumerate(zip(partitions, seqs)):
        t0 = time.perf_counter()
        counters: dict = {}
        deferred: list = []
        block, counts = read_partition(rs, part, info, name, counters, deferred)
        block, counts2 = apply_ops(ops, block, info, part.id, fns=fns)
        join_deferred(deferred, counters)  # the read's cache writes, made while the operators ran
        meta = make_meta(block, info, part.id, seq, t0, counts + counts2, counters)
        out += [store_here(block, leases[j] if leases else None, _node_id()), meta]
    return tuple(out)


@ray.remote
def read_stage_task(reader_and_shared: tuple, partitions: tuple, ops: tuple, info: EpochInfo,
                    seqs: tuple, name: str, leases: Optional[tuple] = None) -> tuple:
    """Read partitions and apply the fused operators after the read: a block and its
    metadata per partition (launched with ``num_returns=2 * len(partitions)``)."""
    return read_partitions(reader_and_shared, partitions, seqs, info, name, unpack(ops), leases=leases)


@ray.remote(num_returns=2)
def block_stage_task(block: Block, meta: BlockMeta, ops: tuple, info: EpochInfo,
                     lease: Optional[SlotLease] = None) -> tuple[Any, BlockMeta]:
    """Apply a task stage's operators to one block."""
    t0 = time.perf_counter()
    out, counts = apply_ops(unpack(ops), dict(block), info, meta.partition_id)
    meta_out = make_meta(out, info, meta.partition_id, meta.seq, t0, counts)
    return store_here(out, lease, _node_id()), meta_out


@ray.remote
class MapActor:
    """A pool actor: constructs the user's callable class once, then maps blocks.

    Args:
        op: the ``map_batches`` operator whose class this actor runs.
        actor_index: this actor's index in its pool (0, 1, ...).
        pool_size: the pool's maximum size.
        before: (a pool that reads) the function operators fused into the read, applied
            before the class.
    """

    def __init__(self, op: Op, actor_index: int = 0, pool_size: int = 1, before: tuple = ()) -> None:
        from sbloader.core.context import set_actor_info

        t0 = time.perf_counter()
        self._op = op
        set_actor_info(actor_index, pool_size)
        self._instance = op.fn(*op.fn_constructor_args, **dict(op.fn_constructor_kwargs))
        self._read_ops = tuple(before) + (op,)
        self._read_fns = tuple(o.fn for o in before) + (self._instance,)
        self._construction_s = time.perf_counter() - t0

    def read_process(self, reader_and_shared: tuple, partitions: tuple, info: EpochInfo,
                     seqs: tuple, name: str, leases: Optional[tuple] = None) -> tuple:
        """Read partitions, then apply the callable to each (the read is fused into the
        pool): a block and its metadata per partition (``num_returns=2 * len(partitions)``)."""
        return read_partitions(reader_and_shared, partitions, seqs, info, name, self._read_ops, fns=self._read_fns,
                               leases=leases)

    def ready(self) -> tuple[str, int, float]:
        """Node id, pid and the seconds the construction took, once the instance is constructed."""
        return _node_id(), os.getpid(), self._construction_s

    def rebuild(self, op: Op) -> tuple[str, int, float]:
        """Construct the callable class again from ``op``'s constructor arguments (a warm actor taken
        by the next execution: a fresh instance, the process kept); then as :meth:`ready`."""
        t0 = time.perf_counter()
        self._instance = None
        self._op = op
        self._instance = op.fn(*op.fn_constructor_args, **dict(op.fn_constructor_kwargs))
        self._read_ops = self._read_ops[:-1] + (op,)
        self._read_fns = self._read_fns[:-1] + (self._instance,)
        self._construction_s = time.perf_counter() - t0
        return self.ready()

    @ray.method(num_returns=2)
    def process(self, block: Block, meta: BlockMeta, info: EpochInfo,
                lease: Optional[SlotLease] = None) -> tuple[Any, BlockMeta]:
        """Apply the callable to one block."""
        t0 = time.perf_counter()
        out, counts = apply_ops((self._op,), dict(block), info, meta.partition_id, fns=(self._instance,))
        meta_out = make_meta(out, info, meta.partition_id, meta.seq, t0, counts)
        return store_here(out, lease, _node_id()), meta_out

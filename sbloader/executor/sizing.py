"""What an execution has measured about its work: block sizes, a partition's time, rows
per output block, and the read-call sizes those allow.

A read task takes several partitions once one partition's time is known, so that
Ray's fixed cost per task (CPU in the trainer, the raylet and the worker:
``benchmarks/results/executor.md``) is spread over about ``TARGET_TASK_S`` of work, but only while the pipeline
is the bottleneck (:func:`~sbloader.executor.policy.partitions_per_task`).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from sbloader.core.block import BlockMeta
from sbloader.executor.pace import ConsumerPace, toward
from sbloader.executor.policy import MAX_CALL_BYTES, partitions_per_task


class Sizing:
    """Running estimates of one execution.

    Args:
        stages: the number of stages.
        estimates: an earlier execution's output block sizes per stage (a later epoch of the
            same pipeline starts from them, so its first tasks need not run one at a time).
        consumer: the consumer's pace.
    """

    def __init__(self, stages: int, estimates: Optional[Sequence[Optional[float]]], consumer: ConsumerPace) -> None:
        self.block_bytes: list[Optional[float]] = (
            list(estimates) if estimates is not None and len(estimates) == stages else [None] * stages)
        # Seconds one partition takes in the source stage, measured afresh every epoch
        # (so an epoch's first tasks read one partition each: a quick first batch).
        self.partition_s: Optional[float] = None
        self.out_rows: Optional[float] = None  # rows per output block
        self.consumer = consumer

    def observe(self, stage: int, meta: BlockMeta, blocks: int, last: bool) -> None:
        """A block of ``stage`` came back (the stage's ``blocks``-th)."""
        self.block_bytes[stage] = toward(self.block_bytes[stage], meta.nbytes, 1 / blocks)
        if stage == 0:
            self.partition_s = toward(self.partition_s, meta.task_s, 1 / blocks)
        if last:
            self.out_rows = toward(self.out_rows, meta.num_rows, 0.25)

    @staticmethod
    def call_bytes(budget: int, slots: int, prefetch_blocks: int) -> float:
        """Most output bytes of one read task: its share of the budget when every slot runs one
        and has one finished behind it, and at most MAX_CALL_BYTES."""
        return min(budget / (2 * slots + prefetch_blocks), MAX_CALL_BYTES)

    def group(self, queued: int, slots: int, call_bytes: float, blocks_ahead: int) -> int:
        """Partitions the source stage's next read task takes (1 while the pace is unknown)."""
        if self.consumer.row_s is None or self.out_rows is None:
            return 1
        return partitions_per_task(self.partition_s, queued, slots, self.block_bytes[0], call_bytes,
                                   blocks_ahead=blocks_ahead, consumer_block_s=self.consumer.row_s * self.out_rows,
                                   workers=max(1, slots - 1))

    def cap_group(self, call_bytes: float) -> int:
        """The group size the partition time and block size allow, whatever the queue and the
        consumer: what the blocks-ahead cap allows per source slot (it does not grow with the
        dataset or with the blocks already ahead: no ratchet)."""
        return partitions_per_task(self.partition_s, sys.maxsize, 1, self.block_bytes[0], call_bytes)

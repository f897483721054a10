"""Pure scheduling decisions of the streaming executor (no Ray, no I/O).

The executor calls these with snapshots of its state. Keeping them pure lets the
tests sweep large parameter grids without starting a process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StageView:
    """What the scheduler needs to know about one stage.

    Attributes:
        index: position in the pipeline (0 = the source stage).
        queued: inputs waiting for this stage.
        head_seq: plan position of the first waiting input (None if none).
        inflight: tasks running (or queued in Ray) for this stage.
        free_slots: how many more tasks the stage may start now.
        est_out_bytes: estimated output bytes of the stage's next call (None before
            the first block): one block, or for the source stage one block per
            partition its next task reads.
    """

    index: int
    queued: int
    head_seq: Optional[int]
    inflight: int
    free_slots: int
    est_out_bytes: Optional[float]

    def __post_init__(self) -> None:
        if self.queued < 0 or self.inflight < 0 or self.free_slots < 0:
            raise ValueError(f"counts must be >= 0, found {self}")
        if (self.queued > 0) != (self.head_seq is not None):
            raise ValueError(f"head_seq must be set exactly when inputs are queued, found {self}")


@dataclass(frozen=True)
class Decision:
    """The result of one scheduling step.

    Attributes:
        launch: index of the stage to start one task in, or None.
        throttled: stages that could run but were held back by the budget.
    """

    launch: Optional[int]
    throttled: tuple[int, ...] = ()


def runnable(stage: StageView) -> bool:
    """A stage can start a task: input is waiting and it has a free slot.

    Before the first output of a stage is measured, it runs one task at a time, so
    an unknown block size cannot overshoot the budget by more than one block.
    """
    if stage.queued == 0 or stage.free_slots == 0:
        return False
    return stage.est_out_bytes is not None or stage.inflight == 0


def blocks_ahead_cap(prefetch_blocks: int, total_slots: int) -> int:
    """Most blocks the pipeline may hold ahead of the consumer (in flight, between
    stages, or ready): every slot busy with one finished task's blocks behind it,
    plus the consumer's prefetch. ``total_slots`` counts a slot once per block its
    task returns (a read task of several partitions, see :func:`partitions_per_task`,
    returns one block per partition).

    More would not make the pipeline faster (the slots are full) and, with a slow
    consumer, would only fill memory up to the budget: with this cap the memory
    held stays flat as the dataset grows, whatever the budget.
    """
    return max(1, prefetch_blocks) + 2 * max(1, total_slots)


# A read task takes several partitions once one partition's time is known, so that
# Ray's fixed cost per task (CPU in the trainer, the raylet and the worker;
# benchmarks/results/executor.md) is spread over about this many seconds of work.
TARGET_TASK_S = 0.35
MAX_PARTITIONS_PER_TASK = 16
MAX_CALL_BYTES = 128 * 2**20  # output of one call (Ray Data's largest target block size)


def partitions_per_task(est_partition_s: Optional[float], queued: int, slots: int,
                        est_block_bytes: Optional[float] = None, max_task_bytes: Optional[float] = None,
                        target_s: float = TARGET_TASK_S, max_k: int = MAX_PARTITIONS_PER_TASK,
                        blocks_ahead: Optional[int] = None, consumer_block_s: Optional[float] = None,
                        workers: int = 1) -> int:
    """How many queued partitions the source stage's next task reads (each is still its
    own block, with its own metadata: replay and exactly-once stay per partition).

    One while a partition's time is unknown (the first tasks of every epoch, so the
    first batch waits for one partition only); then enough partitions for about
    ``target_s`` seconds of work, but never so many that a slot would go without
    work while partitions remain (at most ``queued // slots``), nor more output than
    ``max_task_bytes``.

    Only while the pipeline is the bottleneck: when the consumer spends at least as
    long per block as the pipeline needs to make one (``est_partition_s / workers``,
    a training loop with a GPU step), the pipeline has CPU to spare and one partition
    per task keeps every block's latency low. And it grows as the pipeline gets ahead
    of the consumer (at most ``1 + blocks_ahead // slots``): a task of ``k``
    partitions delivers nothing for ``k`` partitions' time.

    Args:
        est_partition_s: measured seconds one partition takes in a task (None: unknown).
        queued: partitions waiting.
        slots: tasks the stage may have in flight.
        est_block_bytes: estimated bytes of one output block (None: unknown).
        max_task_bytes: the most output bytes one task may produce (None: no limit).
        target_s: seconds of work one task aims at.
        max_k: the most partitions one task reads.
        blocks_ahead: blocks in flight or ready, not yet taken by the consumer (None:
            no such limit).
        consumer_block_s: seconds the consumer spends per block (None: no such limit).
        workers: tasks of the stage that run at once (its CPUs).

    Returns:
        A count in ``[1, max(1, queued)]``.
    """
    if est_partition_s is None or queued <= 1:
        return 1
    if consumer_block_s is not None and consumer_block_s >= est_partition_s / max(1, workers):
        return 1
    k = min(max_k, int(target_s / max(est_partition_s, 1e-6)), queued // max(1, slots))
    if est_block_bytes and max_task_bytes is not None:
        k = min(k, int(max_task_bytes // est_block_bytes))
    if blocks_ahead is not None:
        k = min(k, 1 + blocks_ahead // max(1, slots))
    return max(1, k)


def select_stage(
    stages: Sequence[StageView], budget_bytes: int, held_bytes: float, consumer_ready: bool = False,
    source_blocked: bool = False,
) -> Decision:
    """Pick the stage to start one more task in.

    Downstream stages go first: finishing work frees memory and brings batches
    to the consumer. A stage may start when the bytes held (queued blocks,
    consumer-held blocks, inputs and estimated outputs of running tasks) plus its
    estimated output fit the budget. If nothing is running anywhere and the
    consumer has no ready block to take (so nobody could ever free memory), the
    stage holding the earliest plan position starts regardless: a tight budget
    slows the pipeline down but never deadlocks it.

    Args:
        stages: every stage, in pipeline order.
        budget_bytes: the memory budget.
        held_bytes: bytes currently held or promised by the pipeline.
        consumer_ready: memory will be freed without starting a task (a block is
            ready for the consumer, or released blocks are being freed), so the
            liveness rule is not needed.
        source_blocked: the pipeline already holds :func:`blocks_ahead_cap`
            blocks ahead of the consumer: the source stage (index 0) starts no new
            partition; later stages still run (they add no block).

    Returns:
        The decision.
    """
    candidates = [s for s in stages if runnable(s) and not (source_blocked and s.index == 0)]
    if not candidates:
        return Decision(None)
    throttled = []
    for s in sorted(candidates, key=lambda s: -s.index):
        est = s.est_out_bytes or 0.0
        if held_bytes + est <= budget_bytes:
            return Decision(s.index, tuple(throttled))
        throttled.append(s.index)
    if not consumer_ready and all(s.inflight == 0 for s in stages):
        first = min(candidates, key=lambda s: (s.head_seq, -s.index))
        return Decision(first.index, tuple(i for i in throttled if i != first.index))
    return Decision(None, tuple(throttled))


def min_budget_bytes(stage_est_bytes: Sequence[float], final_est_bytes: float, prefetch_blocks: int) -> int:
    """Smallest budget that can keep every stage and the consumer's prefetch going.

    One block in flight per stage plus ``prefetch_blocks`` ready outputs.
    """
    return int(math.ceil(sum(stage_est_bytes) + prefetch_blocks * final_est_bytes))


@dataclass(frozen=True)
class PoolView:
    """What the autoscaler needs to know about one actor pool.

    Attributes:
        size: live actors (ready or starting).
        pending: actors still starting.
        min_size: lower bound from ``concurrency``.
        max_size: upper bound: ``concurrency``'s, or the room the other stages'
            reservations leave (:func:`sbloader.executor.reservations.pool_limit`).
        queued: inputs waiting for the pool.
        free_slots: task slots free on ready actors.
        idle_actors: ready actors idle for longer than their idle limit
            (:func:`sbloader.executor.reservations.idle_limit_s`).
        upstream_active: input that will feed the pool is still coming (a stage before it
            has work queued or running, or partitions are still to be read).
        constructed: actors the pool launched in this execution (adopted ones not counted).
        lost: actors of the pool that died in this execution.
        reads: the pool reads the source itself (its input is the epoch's partitions).
    """

    size: int
    pending: int
    min_size: int
    max_size: int
    queued: int
    free_slots: int
    idle_actors: int
    upstream_active: bool = False
    constructed: int = 0
    lost: int = 0
    reads: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_size <= self.max_size:
            raise ValueError(f"need 1 <= min_size <= max_size, found {self.min_size}, {self.max_size}")


def pool_delta(pool: PoolView, budget_ok: bool = True) -> int:
    """How many actors to add (>0) or remove (<0) now.

    Grows to ``min_size`` at once; then by one actor at a time while inputs wait and no
    slot is free (and the budget allows more work), never while an actor is still
    starting, and never past ``max_size`` actors constructed in the execution unless
    some died (a pool does not churn: building a model can cost seconds). A pool that
    reads the source knows its input (the epoch's partitions, queued from the start):
    it starts at once as many actors as the queued partitions would keep busy, up to
    ``max_size``, also while others start, so that its first epoch pays one
    construction time, not one per actor. Shrinks by one idle actor at a time down to
    ``min_size``, only once nothing upstream will feed it again: an actor retired
    while reads are still coming would be built again.
    """
    if pool.size < pool.min_size:
        return pool.min_size - pool.size
    may_build = pool.max_size + pool.lost - pool.constructed
    wanted = pool.queued - pool.free_slots
    if pool.reads and wanted > 0 and budget_ok and may_build > 0:
        return max(0, min(wanted, pool.max_size - pool.size, may_build))
    if pool.pending > 0:
        return 0
    if wanted > 0 and pool.size < pool.max_size and budget_ok and may_build > 0:
        return 1
    if pool.queued == 0 and not pool.upstream_active and pool.idle_actors > 0 and pool.size > pool.min_size:
        return -1
    return 0


def next_in_order(ready_seqs: set[int], next_seq: int) -> Optional[int]:
    """The next plan position a deterministic consumer may take, if ready."""
    return next_seq if next_seq in ready_seqs else None

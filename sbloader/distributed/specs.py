"""What ranks and the split coordinator send each other to start and serve an epoch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from sbloader.core.plan import EpochPlan
from sbloader.executor.options import ExecutionOptions


@dataclass(frozen=True)
class EpochSpec:
    """What rank 0 sends to start an epoch.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        source: the epoch's source (batches as partitions).
        ops: the operators (the loader's worker pool).
        plan: the epoch plan (partition order).
        options: executor options.
        per_rank: batches each rank receives; None when the total is unknown (an
            ``IterableDataset``'s stream, equalised as it is produced).
        assignment: rank of each partition, by plan position (deterministic mode),
            or None to hand out whatever is ready.
        batch_ranges: per batch (partition) id, the sample positions of its real rows.
        prior: positions consumed before this run of the epoch (a resumed epoch).
        batch_index: the epoch's batch index of each plan position, when the plan
            holds only some of the epoch's batches (a rebuilt coordinator); empty
            means the identity.
        drop_last: (unknown total) drop the batches left after the equal whole
            batches instead of spreading their rows as short last batches.
        segment: (an ``IterableDataset``'s stream) each worker shard runs in segments of this
            many batches, round after round (:class:`~sbloader.executor.shard_rounds.ShardRounds`):
            the first batch waits for a short segment, not a whole shard, and a stream that never
            ends keeps yielding. None: each shard in one piece.
        reports: (an ``IterableDataset``'s stream started on the ranks' local workers:
            :mod:`~sbloader.loaders.stream_start`) production waits for every rank's report of
            the batches it delivered and where its shards stand
            (:meth:`~sbloader.distributed.stream_epoch.StreamEpoch.report`).
        executor_factory: None runs the streaming executor; a simulation
            (:mod:`sbloader.distributed.sim_epoch`) passes ``factory(source, plan)``
            returning an object with the executor's consumer API that hands out
            ready blocks without running tasks.
    """

    epoch: int
    epoch_seed: int
    source: Any
    ops: tuple
    plan: EpochPlan
    options: ExecutionOptions
    per_rank: Optional[int]
    assignment: Optional[tuple[int, ...]] = None
    batch_ranges: tuple = ()
    prior: tuple = ()
    batch_index: tuple = ()
    drop_last: bool = False
    segment: Optional[int] = None
    reports: bool = False
    executor_factory: Optional[Callable[[Any, EpochPlan], Any]] = None

    def index_of(self, seq: int) -> int:
        """The epoch's batch index of the partition at plan position ``seq``."""
        return self.batch_index[seq] if self.batch_index else seq


@dataclass(frozen=True)
class PartitionEpochSpec:
    """What rank 0 sends to start an epoch of a native pipeline split across ranks.

    The ranks cut their batches themselves from the partitions' blocks, by a plan
    every rank computes alike (:func:`sbloader.core.cut.cut_plan`); the coordinator runs
    the pipeline once for the job, hands each rank the block refs it asks for, and
    releases a block once every rank is past the last batch that takes its rows.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        source: the dataset's source.
        ops: the dataset's operators.
        plan: the partitions still to run, in plan order.
        options: executor options.
        per_rank: batches each rank receives.
        last_use: per partition id, the cut index of the last batch taking its rows.
    """

    epoch: int
    epoch_seed: int
    source: Any
    ops: tuple
    plan: EpochPlan
    options: ExecutionOptions
    per_rank: int
    last_use: dict


@dataclass(frozen=True)
class StreamBatch:
    """(Unknown total) one batch a rank receives, as pieces of produced batches.

    Attributes:
        pieces: ``(block ref, batch position in the block, row start, row stop)``;
            one whole batch, or the pieces of a short last batch.
        rows: rows of the batch, padding included.
        pad: the last ``pad`` rows repeat earlier rows (marked as padding).
        whole: a produced batch as is (no cutting on the rank).
    """

    pieces: tuple
    rows: int
    pad: int = 0
    whole: bool = True

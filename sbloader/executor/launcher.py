"""Launching one Ray call of a stage: a read task, a block task, or an actor pool's call."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from sbloader.executor.options import ExecutionOptions
from sbloader.executor.pools import ActorPools
from sbloader.executor.remake import remake
from sbloader.executor.stages import Stage
from sbloader.executor.tasks import EpochInfo, block_stage_task, pack, read_stage_task


class Launcher:
    """Starts the calls of an execution's stages.

    Args:
        stages: the stages.
        options: retries and placement.
        info: the epoch facts every task needs.
        shared_arg: the source's reader and shared object, as the read tasks take them.
        pools: the actor pools.
    """

    def __init__(self, stages: Sequence[Stage], options: ExecutionOptions, info: EpochInfo, shared_arg: Any,
                 pools: ActorPools) -> None:
        self._stages, self._opts, self._info, self._shared, self._pools = stages, options, info, shared_arg, pools
        self._ops = [pack(s.ops) if s.kind != "actor" else None for s in stages]  # pickled once per execution

    def read(self, parts: tuple, seqs: tuple, leases: Optional[tuple]) -> tuple[list, Any]:
        """A source-stage call reading ``parts``: their ``(block, meta)`` refs, interleaved, and
        the pool actor running it (None: a task)."""
        stage = self._stages[0]
        if stage.kind == "read":
            refs = read_stage_task.options(
                num_returns=2 * len(parts), max_retries=self._opts.max_task_retries,
                **self._opts.placed(stage.ray_options)
            ).remote(self._shared, parts, self._ops[0], self._info, seqs, stage.name, leases)
            return refs, None
        actor = self._pools.least_busy(0, getattr(parts[0], "affinity", None))  # a pool that reads its partitions
        refs = actor.handle.read_process.options(num_returns=2 * len(parts)).remote(
            self._shared, parts, self._info, seqs, stage.name, leases)
        return refs, actor

    def block(self, i: int, ref: Any, meta: Any, lease: Any) -> tuple[Any, Any, Any]:
        """A call of stage ``i`` on one block: ``(block ref, meta ref, pool actor or None)``."""
        stage = self._stages[i]
        if stage.kind == "task":
            block_ref, meta_ref = block_stage_task.options(
                max_retries=self._opts.max_task_retries, **self._opts.placed(stage.ray_options)
            ).remote(ref, meta, self._ops[i], self._info, lease)
            return block_ref, meta_ref, None
        actor = self._pools.least_busy(i)
        block_ref, meta_ref = actor.handle.process.remote(ref, meta, self._info, lease)
        return block_ref, meta_ref, actor

    def remake(self, part: Any, seq: int) -> Any:
        """Partition ``part`` (at ``seq``) run again through every stage outside the pools, its block lost after
        its call finished (:func:`~sbloader.executor.remake.remake`): the new block's ref."""
        return remake(self._stages, self._opts, self._info, self._shared, part, seq)

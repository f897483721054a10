"""How one execution runs (:class:`ExecutionOptions`) and what it hands the consumer (:class:`OutputBlock`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import ray

from sbloader.core.block import BlockMeta
from sbloader.executor.slot_store import SlotLease


@dataclass(frozen=True)
class ExecutionOptions:
    """How one execution runs.

    Attributes:
        memory_budget: bytes the pipeline may hold in the object store, including
            blocks the consumer has taken but not released. None: a quarter of the
            cluster's object store.
        deterministic: deliver blocks in plan order whatever the timing.
        prefetch_blocks: ready output blocks to keep ahead of the consumer.
        progress: tqdm bars per operator (None: only on a TTY).
        max_task_retries: Ray retries of a task lost to a dead worker or node.
        exclude_nodes: node ids tasks and actors must avoid (the trainer's nodes,
            see :mod:`sbloader.runtime.placement`).
        first_call_alone: the source stage runs one call until the execution's first
            block is out, even where an earlier epoch's estimates would start several (a
            mixture's sources: every source's first block is needed for the first batch,
            and Ray runs the calls in the order they came, so each source's first call
            goes before the others' second).
    """

    memory_budget: Optional[int] = None
    deterministic: bool = False
    prefetch_blocks: int = 2
    progress: Optional[bool] = None
    max_task_retries: int = 3
    exclude_nodes: tuple = ()
    first_call_alone: bool = False

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, found {self.memory_budget}")
        if self.prefetch_blocks < 1:
            raise ValueError(f"prefetch_blocks must be >= 1, found {self.prefetch_blocks}")

    def placed(self, ray_options: dict) -> dict:
        """Ray ``.options(...)`` with the placement policy's scheduling strategy, if any."""
        if not self.exclude_nodes:
            return ray_options
        from sbloader.runtime.placement import scheduling_strategy

        return {**ray_options, "scheduling_strategy": scheduling_strategy(self.exclude_nodes)}


@dataclass(frozen=True)
class OutputBlock:
    """A ready block: its object ref and metadata (bytes stay in the object store, or in
    the consumer's shared-memory slot ``lease``: read it with ``StreamingExecutor.fetch``)."""

    ref: ray.ObjectRef
    meta: BlockMeta
    lease: Optional[SlotLease] = None

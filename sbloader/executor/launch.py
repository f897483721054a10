"""Start one execution of a pipeline (a source and its operators) for an epoch plan.

The one place that turns a logical pipeline into a running
:class:`~sbloader.executor.executor.StreamingExecutor`: the embedded Ray started on
first use, the placement policy's node exclusions, the stages fused from the
operators. Both loaders and :class:`~sbloader.dataset.dataset.Dataset` go through it.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from sbloader.core.ops import Op
from sbloader.core.plan import EpochPlan
from sbloader.executor.options import ExecutionOptions
from sbloader.executor.executor import StreamingExecutor
from sbloader.executor.handoff import SlotArena, consumer_arena
from sbloader.executor.stages import build_stages
from sbloader.runtime.placement import exclusions_here
from sbloader.runtime.session import ensure_initialized
from sbloader.sources.base import Source


def options_here(*, memory_budget: Optional[int] = None, deterministic: bool = False, prefetch_blocks: int = 2,
                 progress: Optional[bool] = None, allow_trainer_node: bool = False,
                 first_call_alone: bool = False) -> ExecutionOptions:
    """Execution options for a pipeline run for this process (which trainer nodes to avoid)."""
    ensure_initialized()
    return ExecutionOptions(memory_budget=memory_budget, deterministic=deterministic,
                            prefetch_blocks=prefetch_blocks, progress=progress,
                            exclude_nodes=exclusions_here(allow_trainer_node), first_call_alone=first_call_alone)


def start_execution(source: Source, ops: Sequence[Op], plan: EpochPlan, options: ExecutionOptions, *,
                    actor_cache: Optional[dict] = None, estimates: Optional[list] = None,
                    arena: Optional[SlotArena] = None) -> StreamingExecutor:
    """Start the execution of ``plan`` and return its executor.

    Args:
        source: the pipeline's source.
        ops: its operators.
        plan: the epoch plan (which partitions, in which order).
        options: budget, order, progress and placement (:func:`options_here`).
        actor_cache: a dict the caller keeps: the pools' actors stay there for the next
            execution instead of being killed at the end.
        estimates: an earlier execution's ``executor.estimates()``: output block sizes
            to start from.
        arena: this process's shared-memory slots (:func:`arena_here`): blocks made on
            this node are handed over there; read every block with ``executor.fetch``.
    """
    ensure_initialized()
    executor = StreamingExecutor(source, build_stages(source.name, list(ops)), plan, options,
                                 actor_cache=actor_cache, estimates=estimates, arena=arena)
    return executor.start()


def arena_here() -> Optional[Any]:
    """This process's shared-memory slots (kept for the process, shared by every dataset and
    loader in it), or None when turned off (``SBLOADER_SLOT_HANDOFF=0``)."""
    ensure_initialized()
    return consumer_arena()

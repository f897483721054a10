"""One partition made again through every stage, outside the epoch's pools: a ready block that was lost.

A call can finish (its metadata arrived, the partition counted as done) and its block still be lost before
the consumer reads it: the node that holds it died, or the pool actor that made it did (Ray cannot make an
actor's output again once the actor is gone: reading the block raises ``ActorDiedError``). The partition then
runs again from its provenance, as a lost call's does (:mod:`~sbloader.executor.reruns`), but for the one
consumer who waits for exactly that block: :meth:`~sbloader.executor.executor.StreamingExecutor.fetch` in one
process, the split coordinator's ``remake`` for the ranks (:mod:`~sbloader.distributed.rebuild`).

Each call runs on a task or an actor of its own; the actors are built, used once and killed. None of them
asks for a CPU or a GPU: the pools hold what the nodes that remain have (a replacement for the lost actor may
be waiting for one), and a consumer waiting on its block must not wait behind them.
"""
from __future__ import annotations

from typing import Any, Sequence

import ray

from sbloader.executor.options import ExecutionOptions
from sbloader.executor.stages import Stage
from sbloader.executor.tasks import EpochInfo, MapActor, block_stage_task, pack, read_stage_task


def remake(stages: Sequence[Stage], options: ExecutionOptions, info: EpochInfo, shared: Any, part: Any,
           seq: int) -> ray.ObjectRef:
    """Partition ``part`` (at ``seq`` in the epoch's plan) run again through ``stages``: its new block's ref,
    owned by the caller, once its last call finished.

    Args:
        stages: the execution's physical stages (the first reads).
        options: placement (the nodes to avoid).
        info: the epoch's facts.
        shared: the source's reader and shared object, as the read tasks take them
            (:func:`~sbloader.executor.failures.shared_arg`).
        part: the partition.
        seq: its position in the epoch's plan.

    Raises:
        Whatever the last call raised (a Ray error when the cluster lost this call too).
    """
    actors: list = []

    def opts(stage: Stage) -> dict:
        return {k: v for k, v in options.placed(stage.ray_options).items() if k not in ("num_cpus", "num_gpus")}

    def actor(stage: Stage, before: tuple) -> Any:
        actors.append(MapActor.options(num_cpus=0, **opts(stage)).remote(stage.ops[-1], 0, 1, before))
        return actors[-1]

    first = stages[0]
    try:
        if first.kind == "actor":
            block, meta = actor(first, first.ops[:-1]).read_process.options(num_returns=2).remote(
                shared, (part,), info, (seq,), first.name, None)
        else:
            block, meta = read_stage_task.options(num_returns=2, num_cpus=0, **opts(first)).remote(
                shared, (part,), pack(first.ops), info, (seq,), first.name, None)
        for stage in stages[1:]:
            if stage.kind == "actor":
                block, meta = actor(stage, ()).process.remote(block, meta, info, None)
            else:
                block, meta = block_stage_task.options(num_returns=2, num_cpus=0, **opts(stage)).remote(
                    block, meta, pack(stage.ops), info, None)
        ray.get(meta)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
    return block

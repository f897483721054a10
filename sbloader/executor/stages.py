"""Physical stages: the dataset's operators grouped into what runs together.

The source read and the function operators after it fuse into one Ray task per
partition (or per few partitions, see ``policy.partitions_per_task``) when their
resources match; an operator with other resources starts a
new task stage; a callable class gets an actor-pool stage of its own.

A callable class right after the read (and the functions fused into it) whose pool
the user left to the executor (no ``concurrency``, no ``num_cpus``/``num_gpus``/
``resources``) takes the read in: its actors read their partitions themselves, as
Ray Data fuses a task operator into the actor pool after it. The decoded rows then
never cross processes (for full-size images that copy cost more CPU than the crop
applied to them), and the pool, sized to the CPUs, is the read's parallelism. A GPU
stage or a pool of a size the user set keeps a read stage of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sbloader.core.ops import Op


@dataclass(frozen=True)
class Stage:
    """One physical stage of the pipeline.

    Attributes:
        name: display name (operator names joined by ``->``).
        kind: ``"read"`` (source + fused ops), ``"task"`` or ``"actor"``.
        ops: the operators the stage applies, in order.
        resources: Ray resources of each task or actor.
        reads: the stage reads the source itself (its inputs are partitions).
    """

    name: str
    kind: str
    ops: tuple[Op, ...]
    resources: tuple[tuple[str, object], ...]
    reads: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("read", "task", "actor"):
            raise ValueError(f"unknown stage kind {self.kind!r}")
        if self.kind == "actor" and (not self.ops or not self.ops[-1].is_actor
                                     or any(o.is_actor for o in self.ops[:-1])):
            raise ValueError("an actor stage runs exactly one callable class, its last operator")
        if self.kind == "actor" and len(self.ops) > 1 and not self.reads:
            raise ValueError("only an actor stage that reads applies functions before its class")

    @property
    def actor_op(self) -> Op:
        """(Actor stage) the callable class's operator."""
        return self.ops[-1]

    @property
    def ray_options(self) -> dict:
        """``.options(...)`` keyword arguments for the stage's tasks or actors."""
        return dict(self.resources)


def _res_key(op: Op) -> tuple:
    return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in op.ray_resources().items()))


def _resources(op: Op) -> tuple:
    return tuple(sorted(op.ray_resources().items()))


def joins_read(op: Op) -> bool:
    """Whether a callable class right after the read takes the read into its pool: its
    pool's size and resources left to the executor."""
    return (op.is_actor and op.concurrency is None and op.num_cpus is None and not op.num_gpus
            and not op.resources)


def build_stages(source_name: str, ops: Sequence[Op]) -> list[Stage]:
    """Group operators into stages (pure).

    Args:
        source_name: the source's display name (``Read<name>``).
        ops: the dataset's operators in order.

    Returns:
        The stages, the first always the read stage.
    """
    default = Op("map", lambda r: r, "_default")
    ops = list(ops)
    if ops and ops[0].is_actor and ops[0].fuse_read:
        first = ops.pop(0)
        stages: list[Stage] = [Stage(f"Read{source_name}->{first.name}", "actor", (first,), _resources(first), True)]
        current_key = None
    else:
        stages = [Stage(f"Read{source_name}", "read", (), _resources(default), True)]
        current_key = _res_key(default)
    for op in ops:
        last = stages[-1]
        if op.is_actor and len(stages) == 1 and last.kind == "read" and joins_read(op):
            stages[0] = Stage(f"{last.name}->{op.name}", "actor", last.ops + (op,), _resources(op), True)
            current_key = None
            continue
        if op.is_actor:
            stages.append(Stage(op.name, "actor", (op,), _resources(op)))
            current_key = None
            continue
        if last.kind != "actor" and current_key == _res_key(op) and op.concurrency is None:
            stages[-1] = Stage(f"{last.name}->{op.name}", last.kind, last.ops + (op,), last.resources, last.reads)
            continue
        stages.append(Stage(op.name, "task", (op,), _resources(op)))
        current_key = _res_key(op) if op.concurrency is None else None
    return stages


def stage_concurrency(stage: Stage, cluster_cpus: float) -> int:
    """Tasks a function stage may have in flight: its ``concurrency`` or the CPUs it fits, plus one."""
    for op in stage.ops:
        if isinstance(op.concurrency, int):
            return op.concurrency
    per = dict(stage.resources).get("num_cpus", 1.0) or 0.0
    if per <= 0:
        return max(2, int(2 * cluster_cpus))
    return max(1, int(cluster_cpus // per)) + 1

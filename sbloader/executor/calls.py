"""The executor's records of work in flight: Ray calls, the blocks they will return, and
partitions launched again (what the scheduling loop, the pools and the straggler
watch share)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import ray

from sbloader.executor.slot_store import SlotLease
from sbloader.sources.base import Partition


@dataclass
class Call:
    """One Ray task or actor call; a read call may cover several partitions.

    Attributes:
        left: its partitions whose metadata has not come back yet.
        actor: the pool actor running it (None: a task).
        items: a read call's ``(plan position, Partition)`` pairs.
        started: ``time.monotonic()`` at launch.
        speculated: its partitions were launched again (it straggled).
        task_s: seconds its partitions ran, so far (their metadata's ``task_s``).
    """

    left: int
    actor: Optional[Any] = None
    items: tuple = ()
    started: float = 0.0
    speculated: bool = False
    task_s: float = 0.0


@dataclass(frozen=True)
class Solo:
    """A partition launched again on its own (its first call straggles)."""

    part: Partition


@dataclass
class Running:
    """One block a call will return.

    Attributes:
        stage: the stage that makes it.
        seq: its partition's plan position.
        block_ref: the block's object ref (its metadata ref is the key it is kept under).
        input_bytes: bytes of its input block (0 for the source stage).
        est_bytes: its estimated output bytes.
        call: the call that makes it.
        partition_id: the partition it reads or maps.
        lease: a final-stage block's shared-memory slot.
        source: the input block of a call after the source stage (to run it again).
    """

    stage: int
    seq: int
    block_ref: ray.ObjectRef
    input_bytes: int
    est_bytes: float
    call: Call
    partition_id: int = -1
    lease: Optional[SlotLease] = None
    source: Any = None

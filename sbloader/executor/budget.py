"""The memory budget of one execution: the bytes the pipeline holds or has promised.

Counted: blocks queued between stages, ready blocks waiting for the consumer,
blocks the consumer holds (taken, not released), inputs and estimated outputs of
running tasks, and released blocks Ray has not freed yet (the embedded Ray frees
released objects every 20 ms, later on a loaded machine: a released block still
counts for :data:`FREE_LAG_S`).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional, Sequence

from sbloader.core.errors import MemoryBudgetError
from sbloader.executor.policy import min_budget_bytes

FREE_LAG_S = 0.25

#: The default budget's share of the cluster's object store.
DEFAULT_STORE_SHARE = 0.25


def default_budget() -> int:
    """The default memory budget: :data:`DEFAULT_STORE_SHARE` of the cluster's object store."""
    from sbloader.runtime import cluster_state

    return int(cluster_state.total_resources().get("object_store_memory", 2 * 2**30) * DEFAULT_STORE_SHARE)


class MemoryBudget:
    """The bytes an execution holds, against its budget.

    Args:
        budget: the budget in bytes.
        stages: the number of stages (each has a queue of blocks waiting for it).
    """

    def __init__(self, budget: int, stages: int) -> None:
        self.budget = int(budget)
        self.queued = [0] * stages  # bytes waiting for each stage
        self.output = 0  # ready blocks waiting for the consumer
        self.consumer = 0  # taken by the consumer, not released
        self._releasing: deque[tuple[float, int]] = deque()
        self._checked = False

    def held(self, running: float = 0.0) -> float:
        """Bytes held or promised now (``running``: inputs and estimated outputs of running tasks)."""
        horizon = time.monotonic() - FREE_LAG_S
        while self._releasing and self._releasing[0][0] < horizon:
            self._releasing.popleft()
        freeing = sum(n for _, n in self._releasing)
        return sum(self.queued) + self.output + self.consumer + running + freeing

    def freeing(self) -> bool:
        """Released bytes Ray has yet to free (memory comes back without a new task)."""
        self.held()
        return bool(self._releasing)

    def taken(self, nbytes: int) -> None:
        """The consumer took a ready block of ``nbytes``."""
        self.output -= nbytes
        self.consumer += nbytes

    def release(self, nbytes: int) -> None:
        """The consumer is done with a block of ``nbytes``: it no longer counts once Ray freed it."""
        self.consumer = max(0, self.consumer - nbytes)
        self._releasing.append((time.monotonic(), nbytes))

    def check(self, estimates: Sequence[Optional[float]], prefetch_blocks: int) -> None:
        """Once every stage's block size is known, raise if the budget cannot hold one block per
        stage plus the consumer's prefetch.

        Raises:
            MemoryBudgetError: naming the sizes, the budget needed and what to change.
        """
        if self._checked or any(e is None for e in estimates):
            return
        self._checked = True
        need = min_budget_bytes([e or 0.0 for e in estimates], estimates[-1] or 0.0, prefetch_blocks)
        if need > self.budget:
            raise MemoryBudgetError(
                f"memory_budget={self.budget} bytes cannot hold one block per stage "
                f"({[int(e or 0) for e in estimates]} bytes) plus prefetch_blocks={prefetch_blocks} "
                f"output blocks of ~{int(estimates[-1] or 0)} bytes: need at least {need} bytes. "
                f"Raise memory_budget, lower the prefetch, or use smaller partitions."
            )

"""Straggling read calls: a call of several partitions returns their blocks together, so
one slow partition would hold back the others of its call.

A call running :data:`SPECULATE_FACTOR` times longer than expected (and at least
:data:`SPECULATE_MIN_S`) has its partitions launched again, one per call; whichever
copy of a partition finishes first is delivered, the other dropped (the straggler
then delays only itself). A copy that fails while another copy of its partition came
back, is queued or runs is dropped; a partition fails only when its last copy does.
"""
from __future__ import annotations

import heapq
import time
from typing import Callable, Iterable

from sbloader.executor.calls import Call, Running, Solo

SPECULATE_FACTOR = 4.0
SPECULATE_MIN_S = 1.0


class Stragglers:
    """Which source-stage partitions came back and which were launched again."""

    def __init__(self) -> None:
        self.done: set[int] = set()  # partitions whose source-stage block came back
        self.queued_again: set[int] = set()  # partitions queued again, not launched yet

    def speculate(self, calls: Iterable[Call], partition_s: float, requeue: Callable[[int, Solo], None]) -> None:
        """Queue again, one per call, the partitions of read calls that straggle (``partition_s``:
        the current estimate of one partition's seconds, which follows the machine's load)."""
        now = time.monotonic()
        for call in calls:
            limit = max(SPECULATE_MIN_S, SPECULATE_FACTOR * partition_s * len(call.items))
            if call.speculated or now - call.started < limit:
                continue
            call.speculated = True
            for seq, part in call.items:
                if part.id not in self.done:
                    requeue(seq, Solo(part))
                    self.queued_again.add(part.id)

    def came_back(self, partition_id: int, queue: list) -> int:
        """A partition's block came back: its queued second copy is not launched. Returns the
        number of queue entries removed (the source queue is a heap of ``(seq, n, item)``)."""
        self.done.add(partition_id)
        if partition_id not in self.queued_again:
            return 0
        self.queued_again.discard(partition_id)
        keep = [e for e in queue if not (isinstance(e[2], Solo) and e[2].part.id == partition_id)]
        removed = len(queue) - len(keep)
        if removed:
            queue[:] = keep
            heapq.heapify(queue)
        return removed

    def moot(self, run: Running) -> bool:
        """A source-stage copy of a partition whose other copy already came back."""
        return run.stage == 0 and run.partition_id in self.done

    def other_copy(self, run: Running, inflight: Iterable[Running]) -> bool:
        """Another copy of this source-stage partition came back, is queued or runs."""
        if run.stage != 0:
            return False
        pid = run.partition_id
        if pid in self.done or pid in self.queued_again:
            return True
        return any(o is not run and o.stage == 0 and o.partition_id == pid for o in inflight)

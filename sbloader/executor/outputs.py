"""The ready blocks of an execution, in the order the consumer takes them.

A FIFO (throughput), or a reorder buffer keyed by plan position (``deterministic``:
the delivery order depends on the plan only). A partition delivered once is never
delivered again: a re-run after a lost worker, or the losing copy of a straggler,
replaces, never adds.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Callable, Optional

from sbloader.executor.options import OutputBlock


class Outputs:
    """Ready blocks waiting for the consumer.

    Args:
        deterministic: hand them out in plan order.
        dropped: called with a block nobody will take (an empty one in plan order). A bound
            method is held weakly: its owner (the scheduler) holds this, and a cycle would keep the
            execution, its pools and their actors' CPUs, until the collector's next full pass.
    """

    def __init__(self, deterministic: bool, dropped: Callable[[OutputBlock], None]) -> None:
        self.deterministic = deterministic
        self._dropped = weakref.WeakMethod(dropped) if hasattr(dropped, "__self__") else (lambda: dropped)
        self._fifo: deque[OutputBlock] = deque()
        self._ordered: dict[int, OutputBlock] = {}
        self._next_seq = 0
        self._delivered: set[int] = set()

    def delivered(self, partition_id: int) -> bool:
        """A block of this partition was added before (another copy: drop this one)."""
        return partition_id in self._delivered

    def add(self, seq: int, block: OutputBlock) -> bool:
        """A final block came back (plan position ``seq``); False for an empty block outside
        plan order, which nobody will take (the caller drops it)."""
        self._delivered.add(block.meta.partition_id)
        if self.deterministic:
            self._ordered[seq] = block
            return True
        if block.meta.num_rows > 0:
            self._fifo.append(block)
            return True
        return False

    def pop(self) -> Optional[OutputBlock]:
        """The next block the consumer may take, if ready (empty blocks in plan order are skipped)."""
        if not self.deterministic:
            return self._fifo.popleft() if self._fifo else None
        while self._next_seq in self._ordered:
            item = self._ordered.pop(self._next_seq)
            self._next_seq += 1
            if item.meta.num_rows > 0:
                return item
            dropped = self._dropped()
            if dropped is not None:
                dropped(item)
        return None

    def ready(self) -> bool:
        """A block awaits the consumer."""
        return (self._next_seq in self._ordered) if self.deterministic else bool(self._fifo)

    def waiting(self) -> int:
        """Blocks waiting (in order mode, also those behind a missing plan position)."""
        return len(self._ordered) if self.deterministic else len(self._fifo)

    def drain(self) -> list[OutputBlock]:
        """Every block waiting, removed (an execution shut down hands none out later)."""
        out = list(self._fifo) + list(self._ordered.values())
        self._fifo.clear()
        self._ordered.clear()
        return out

"""A native pipeline's epoch split across ranks, in the split coordinator.

The ranks cut their own batches by a plan every rank computes alike
(:func:`~sbloader.core.cut.cut_plan`); the coordinator runs the pipeline once for
the job, hands each rank the refs of the blocks it asks for, and releases a block
once every rank is past the last batch that takes its rows
(:func:`~sbloader.core.cut.progress`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional

from sbloader.core.cut import progress
from sbloader.core.errors import SbloaderError
from sbloader.distributed.epoch import Epoch
from sbloader.distributed.specs import PartitionEpochSpec
from sbloader.executor.options import OutputBlock


class PartitionEpoch(Epoch):
    """An epoch of a native pipeline whose ranks cut their own batches (:class:`PartitionEpochSpec`)."""

    def __init__(self, spec: PartitionEpochSpec, world_size: int, actor_cache: dict,
                 estimates: Optional[list] = None, earlier: tuple = ()) -> None:
        super().__init__(spec, world_size, actor_cache, estimates, earlier, ledger=False)  # type: ignore[arg-type]
        self.ready: dict[int, OutputBlock] = {}  # partition id -> block not yet released
        self.released: set[int] = set()
        self.consumed = [0] * world_size
        self.remade: dict[str, int] = {}  # a lost block's ref (hex) -> the partition made again in its place
        self._remake_lock = threading.Lock()

    def _deliver(self, item: OutputBlock) -> None:
        pid = item.meta.partition_id
        if pid in self.released or pid in self.ready:  # nobody will take it (or a duplicate)
            self.executor.release(item.meta.nbytes)
            return
        self.ready[pid] = item
        self._release_passed()

    def _end_of_production(self) -> None:
        pass

    def refs(self, rank: int, consumed: int, pids: list, wait_s: float, stall_report_s: float) -> dict:
        """Ack ``consumed`` batches of ``rank``, then the refs of the ready blocks of the
        partitions ``pids``, waiting at most ``wait_s`` for the first of them."""
        log = self.logs[rank]
        log.last_seen = time.monotonic()
        log.asked = True
        self.ack(rank, consumed)
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                if not self._open():
                    return {}
                if not pids or pids[0] in self.ready:
                    break
                if self.produced_all or pids[0] in self.released:
                    raise SbloaderError(
                        f"epoch {self.spec.epoch}: rank {rank} asks for the block of partition {pids[0]}, which the "
                        "pipeline did not produce or already released; this is a bug in the cut plan"
                    )
                if not self._wait(deadline, rank, stall_report_s):
                    return {}
            return {p: self.ready[p].ref for p in pids if p in self.ready}

    def remake(self, ref_hex: str, make: Callable[[int, int], Any]) -> Any:
        """The block ``ref_hex`` (lost with the node or the pool actor that made it, before a rank
        fetched it) made again by ``make(seq, partition id)``, once: it replaces the lost one for
        every rank, and a rank that asks after another did gets the same new ref.

        Raises:
            SbloaderError: no block of this epoch held here has that ref (released, or never made).
        """
        with self._remake_lock:
            with self.cond:
                if ref_hex in self.remade:
                    item = self.ready.get(self.remade[ref_hex])
                    if item is not None:
                        return item.ref
                pid = next((p for p, item in self.ready.items() if item.ref.hex() == ref_hex), None)
            if pid is None:
                raise SbloaderError(f"epoch {self.spec.epoch}: no block {ref_hex} is held here to be made again "
                                    f"(released, or made by a coordinator that was replaced); restart the job "
                                    "from the last checkpoint")
            new = make(list(self.spec.plan.order).index(pid), pid)
            with self.cond:
                item = self.ready.get(pid)
                if item is None:  # released meanwhile: no rank needs it any more
                    return new
                self.ready[pid] = replace(item, ref=new)
                self.remade[ref_hex] = pid
            return new

    def ack(self, rank: int, consumed: int) -> None:
        with self.cond:
            self.consumed[rank] = max(self.consumed[rank], int(consumed))
            self.logs[rank].count = self.logs[rank].acked = self.consumed[rank]
            self._release_passed()

    def _release_passed(self) -> None:
        """(``cond`` held) Release the blocks no rank will take rows from again."""
        passed = progress(self.consumed)
        for pid in [p for p in self.ready if self.spec.last_use.get(p, -1) < passed]:
            item = self.ready.pop(pid)
            self.released.add(pid)
            if self.executor is not None:
                self.executor.release(item.meta.nbytes)

    def done(self, rank: int) -> bool:
        return self.consumed[rank] >= self.spec.per_rank

    @property
    def finished(self) -> bool:
        return all(lg.left or (lg.asked and self.consumed[r] >= self.spec.per_rank) for r, lg in enumerate(self.logs))

"""A simulated epoch for the real split coordinator: ready batches without tasks.

:func:`sim_spec` builds an :class:`~sbloader.distributed.specs.EpochSpec` whose
executor is a :class:`SimExecutor`: a stand-in with the streaming executor's
consumer API (``start``, ``get_next``, ``release``, ``shutdown``, ``stats``,
``estimates``) that hands out tiny ready blocks in plan order, at most ``ahead``
of them unreleased (the memory budget's backpressure), and runs no task. Every
other part of the coordinator (its request path, the per-rank queues, the
delivery logs, ``cut``, ``rebuild``) is the real one, so a simulation measures
what the coordinator itself costs per batch as ranks grow
(:mod:`sbloader.distributed.simulate`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import ray

from sbloader.core.block import BlockMeta
from sbloader.core.errors import ExecutorShutdownError
from sbloader.core.plan import EpochPlan, make_epoch_plan
from sbloader.distributed.specs import EpochSpec
from sbloader.executor.options import ExecutionOptions, OutputBlock

#: Distinct object refs a simulated executor cycles through (made once, before the epoch).
REF_POOL = 1024


@dataclass(frozen=True)
class SimSource:
    """The batches of a simulated epoch: ids, rows per batch, and where they are "made".

    Attributes:
        ids: the batch (partition) id of every batch, in epoch order.
        batch_size: rows per batch.
        nodes: node ids the simulated blocks are made on (round robin by id).
        ahead: ready blocks the executor may hold unreleased (its memory budget).
    """

    ids: tuple
    batch_size: int
    nodes: tuple = ("sim-node-0",)
    ahead: int = 64
    name: str = field(default="SimBatches")

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.ahead < 1 or not self.nodes:
            raise ValueError(f"a simulated source needs batch_size >= 1, ahead >= 1 and a node; found "
                             f"batch_size={self.batch_size}, ahead={self.ahead}, nodes={self.nodes}")

    def subset(self, keep: Sequence[int]) -> "SimSource":
        """The same source holding only the batches at indices ``keep`` (a rebuilt coordinator's)."""
        return SimSource(tuple(self.ids[i] for i in keep), self.batch_size, self.nodes, self.ahead)

    def num_rows(self) -> int:
        return len(self.ids) * self.batch_size


class SimExecutor:
    """The streaming executor's consumer API over a :class:`SimSource`, with no tasks.

    Args:
        source: the simulated batches.
        plan: their order (partition ids of ``source``).
    """

    def __init__(self, source: SimSource, plan: EpochPlan) -> None:
        self._source, self._plan = source, plan
        self._cond = threading.Condition()
        self._next = 0
        self._outstanding = 0
        self._released = 0
        self._stopped = False
        self._refs: list = []

    def start(self) -> "SimExecutor":
        # Made before the epoch's requests, so putting them is not counted per batch.
        self._refs = [ray.put(i.to_bytes(4, "little")) for i in range(min(REF_POOL, max(1, len(self._plan.order))))]
        return self

    def get_next(self, timeout: Optional[float] = None) -> Optional[OutputBlock]:
        """The next ready block in plan order (None once all were handed out); blocks while
        ``ahead`` blocks are unreleased."""
        with self._cond:
            while not self._stopped and self._outstanding >= self._source.ahead:
                self._cond.wait()
            if self._stopped:
                raise ExecutorShutdownError("the simulated executor was shut down")
            if self._next >= len(self._plan.order):
                return None
            seq, self._next = self._next, self._next + 1
            self._outstanding += 1
        pid = self._plan.order[seq]
        rows = self._source.batch_size
        meta = BlockMeta(self._plan.epoch, pid, seq, rows, rows * 4, (0, rows),
                         node_id=self._source.nodes[pid % len(self._source.nodes)])
        return OutputBlock(self._refs[seq % len(self._refs)], meta)

    def release(self, nbytes: int) -> None:
        """One handed-out block is no longer held (the coordinator calls this per acknowledged batch)."""
        with self._cond:
            self._outstanding = max(0, self._outstanding - 1)
            self._released += 1
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def estimates(self) -> list:
        return []

    def stats(self) -> dict:
        """Blocks handed out and released so far, and whether the refs are made."""
        with self._cond:
            return {"produced": self._next, "released": self._released, "ready": bool(self._refs)}


def sim_executor(source: SimSource, plan: EpochPlan) -> SimExecutor:
    """The ``executor_factory`` of a simulated epoch."""
    return SimExecutor(source, plan)


def sim_spec(epoch: int, world_size: int, per_rank: int, batch_size: int = 1, *, in_order: bool = True,
             nodes: int = 1, ahead: Optional[int] = None) -> EpochSpec:
    """A simulated epoch of ``world_size * per_rank`` batches of ``batch_size`` rows.

    Batch ``i`` holds the sample positions ``[i * batch_size, (i + 1) * batch_size)``;
    with ``in_order`` batch ``i`` goes to rank ``i % world_size`` (the drop-in's
    ``in_order=True``), otherwise to whichever rank asks first, preferring its node.

    Args:
        epoch: the epoch number.
        world_size: ranks of the simulated job.
        per_rank: batches each rank takes.
        batch_size: rows per batch (they are positions in the ledger, never made).
        in_order: a deterministic assignment (per-rank queues) or the shared pool.
        nodes: simulated nodes; rank ``r`` sits on node ``r * nodes // world_size``.
        ahead: ready batches the stand-in executor may hold, those the ranks hold included
            (default: 24 per rank, room for two leases of the most a rank leases).
    """
    if world_size < 1 or per_rank < 1:
        raise ValueError(f"a simulated epoch needs world_size >= 1 and per_rank >= 1, found {world_size}, {per_rank}")
    total = world_size * per_rank
    ids = tuple(range(total))
    source = SimSource(ids, batch_size, tuple(f"sim-node-{n}" for n in range(max(1, nodes))),
                       ahead if ahead is not None else 24 * world_size)
    plan = make_epoch_plan(list(ids), epoch, 0, shuffle=False)
    ranges = tuple(((i * batch_size, (i + 1) * batch_size),) for i in ids)
    assignment = tuple(i % world_size for i in ids) if in_order else None
    return EpochSpec(epoch, 0, source, (), plan, ExecutionOptions(), per_rank, assignment, ranges,
                     executor_factory=sim_executor)


def rank_node(rank: int, world_size: int, nodes: int) -> str:
    """The simulated node of ``rank`` (ranks fill the nodes in order)."""
    return f"sim-node-{rank * max(1, nodes) // world_size}"

"""The local start of a native pipeline's epoch: its first partitions from worker processes forked here.

A fresh process's first native epoch would wait seconds for the embedded Ray to start
before its first task runs. The partitions are the plan's, each made by a pure function
of the partition, the epoch and its seed (read, row shuffle, then the operators, each
under its seeded task context: :func:`~sbloader.executor.tasks.read_partition`,
:func:`~sbloader.executor.tasks.apply_ops`), so any process can make them. While Ray
starts in the background (from the loader's construction), the epoch starts at once:

1. **local**: torch's worker machinery forks ``local_workers()`` processes here, which
   make whole partitions in plan order, one at a time each, as a Ray task would;
2. **handover**: once Ray is up, no further partition is handed to them; the executor
   starts on the plan's remaining partitions (``order[k:]``) while the local ones drain.

:class:`PhasedExecution` stands in for the executor in the epoch's block feed: the loop
receives the local blocks first, in plan order, then the executor's. Under
``deterministic=True`` that is the plan's order, as a run on Ray's workers alone gives:
the same blocks, so the same batches, rows and ``state_dict()`` arithmetic (the ledger
counts partitions and rows, not who made them). The shuffle window, cut before Ray is
up, takes its default size from the embedded Ray's object store size, which sbloader
fixes before the start (:mod:`sbloader.runtime.store_size`).

It applies where every stage is a function without GPUs or custom resources (a callable
class or a GPU stage starts only with its pool: the epoch then waits for Ray), the loader
keeps no actors (``persistent_workers=False``), and Ray is not up yet. A job that joins a
running cluster starts locally only with an explicit ``memory_budget`` (the default
budget is the cluster's). ``local_start=False`` on the loader (or ``SBLOADER_LOCAL_START=0``)
turns it off. Blocks made locally are not counted in the executor's memory budget; they
show in ``stats()`` as ``local_partitions`` and in each operator's rows and blocks.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from sbloader.core.block import Block, BlockMeta
from sbloader.core.plan import EpochPlan
from sbloader.core.stats import ExecutionStats, OperatorStats
from sbloader.loaders import local_start, stalled_workers
from sbloader.loaders.fork_safe import ForkGate

LOCAL_NODE = "local"  # BlockMeta.node_id of a block made on a local worker process
MAX_LOCAL_WORKERS = 4


def local_workers() -> int:
    """Local worker processes of a native local start: the machine's CPUs, at most :data:`MAX_LOCAL_WORKERS`."""
    return max(1, min(os.cpu_count() or 1, MAX_LOCAL_WORKERS))


def budget_before_ray(memory_budget: Optional[int]) -> Optional[int]:
    """The pipeline's memory budget as a Ray-only run will see it, known now: the one given, the
    cluster's default once Ray is up, the embedded Ray's default before (None: a cluster not joined yet)."""
    from sbloader.runtime import background

    if memory_budget is not None:
        return int(memory_budget)
    if background.ready():
        from sbloader.executor.budget import default_budget

        return default_budget()
    if os.environ.get("RAY_ADDRESS"):
        return None
    from sbloader.executor.budget import DEFAULT_STORE_SHARE
    from sbloader.runtime.store_size import embedded_store_bytes

    return int(embedded_store_bytes() * DEFAULT_STORE_SHARE)


def reads_objects(source: Any) -> bool:
    """Whether the source's read tasks fetch remote objects (a bucket). Its client's async runtime, once
    used in a process (a WebDataset's indexes, read as the dataset is made), does not survive a fork: a
    forked worker's request would wait forever. Such an epoch starts on Ray's workers."""
    return getattr(source, "_remote", None) is not None


def enabled(pipeline: Any, allowed: bool, keeps_actors: bool, forced: bool = False) -> bool:
    """Whether this epoch starts on local processes: allowed (the loader's ``local_start`` and
    ``SBLOADER_LOCAL_START``), no kept actors, a source of local files (:func:`reads_objects`), every
    stage a plain function, fork available, and Ray not up yet (``SBLOADER_HANDOVER_AT``, or
    ``forced``, starts it locally anyway, for tests)."""
    from sbloader.executor.stages import build_stages
    from sbloader.runtime import background

    if not allowed or keeps_actors or os.environ.get(local_start.LOCAL_START_ENV, "1") == "0":
        return False
    if reads_objects(pipeline.source):
        return False
    if multiprocessing.get_start_method(allow_none=True) not in (None, "fork"):
        return False
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    stages = build_stages(pipeline.source.name, list(pipeline.ops))
    if any(s.kind == "actor" or any(op.num_gpus or op.resources for op in s.ops) for s in stages):
        return False
    return forced or local_start.forced_handover() is not None or not background.ready()


class _Partitions:
    """What the local workers index: partition id -> ``(block, meta, sizes)`` (``sizes``: each stage's
    output rows and bytes, as the executor counts them), or ``(None, the exception that made it fail, ())``."""

    def __init__(self, source: Any, ops: tuple, plan: EpochPlan) -> None:
        from sbloader.executor.stages import build_stages

        self.reader, self.shared = source.reader(), source.shared()
        self.parts = {p.id: p for p in source.partitions(plan.epoch, plan.epoch_seed, shuffle=plan.shuffle)}
        self.seq = {pid: j for j, pid in enumerate(plan.order)}
        self.plan = plan
        stages = build_stages(source.name, list(ops))
        self.stage_ops, self.name = [s.ops for s in stages], stages[0].name

    def __len__(self) -> int:
        return len(self.plan.order)

    def __getitem__(self, pid: int) -> tuple:
        from sbloader.core.errors import SbloaderError, picklable
        from sbloader.core.block import block_nbytes, num_rows
        from sbloader.core.context import join_deferred
        from sbloader.executor.tasks import EpochInfo, apply_ops, make_meta, read_partition

        try:
            t0 = time.perf_counter()
            info = EpochInfo(self.plan.epoch, self.plan.epoch_seed, self.plan.shuffle)
            counters: dict = {}
            deferred: list = []
            block, counts = read_partition((self.reader, self.shared), self.parts[pid], info, self.name, counters,
                                           deferred)
            sizes = []
            for ops in self.stage_ops:  # stage by stage: what each stage put out is counted for it
                block, more = apply_ops(ops, block, info, pid)
                counts = counts + more
                sizes.append((num_rows(block), block_nbytes(block)))
            join_deferred(deferred, counters)  # the read's cache writes, made while the operators ran
            meta = make_meta(block, info, pid, self.seq[pid], t0, counts, counters, LOCAL_NODE)
            return block, meta, tuple(sizes)
        except Exception as e:  # raised in the loop as a Ray task's error is (the same type)
            return None, e if picklable(e) is e else SbloaderError(f"{type(e).__name__}: {e}"), ()


class _Handout:
    """The local workers' sampler: partition ids in plan order until Ray is up (at least one), then none."""

    def __init__(self, order: list, at: Optional[int]) -> None:
        self.order, self.at = order, at
        self.stopped_at: Optional[int] = None  # the first plan index the executor makes (None: all local)

    def __iter__(self) -> Iterator[int]:
        from sbloader.runtime import background

        for j, pid in enumerate(self.order):
            if self.at is not None:
                if j == self.at:
                    while not background.ready() and background.failed() is None:
                        time.sleep(0.01)
                    self.stopped_at = j
                    return
            elif j > 0 and background.ready():
                self.stopped_at = j
                return
            yield pid


def _identity(x: Any) -> Any:
    return x


def fork_workers(pipeline: Any, plan: EpochPlan, sampler: Any, workers: int, timeout: float = 0) -> Any:
    """torch's multiprocessing iterator over ``_Partitions`` of ``plan``: ``workers`` processes forked here
    (behind a :class:`~sbloader.loaders.fork_safe.ForkGate`) make the partitions ``sampler`` hands out, each
    as ``(block, meta, sizes)``; the trainer's RNG untouched. ``timeout``: torch's wait for one partition
    (0: none)."""
    import torch
    from sbloader.loaders.torch_loader import torch_loader

    loader = torch_loader()(_Partitions(pipeline.source, tuple(pipeline.ops), plan), batch_size=None,
                            sampler=ForkGate().wrap(sampler), num_workers=workers, collate_fn=_identity,
                            multiprocessing_context="fork", timeout=timeout,
                            generator=torch.Generator().manual_seed(plan.epoch_seed % 2**63))
    with loader.sampler.gate.forking(("sbloader.core.errors", "sbloader.executor.tasks")):
        return iter(loader)  # forks the workers and hands out the first partitions


@dataclass
class _LocalItem:
    """A block made by a local worker, as the block feed takes an executor's item."""

    block: Block
    meta: BlockMeta


class _Pace:
    """The consumer's pace, kept until the executor starts, then the executor's."""

    def __init__(self) -> None:
        self.external = False
        self.target: Any = None

    def add(self, seconds: float, rows: int) -> None:
        if self.target is not None:
            self.target.add(seconds, rows)


class PhasedExecution:
    """An epoch's blocks from local workers, then from the executor started at the handover.

    Offers what the block feed asks of an executor (``get_next``, ``fetch``, ``release_block``,
    ``shutdown``, ``stats``, ``estimates``, ``consumer_pace``).

    Args:
        pipeline: the source and operators.
        plan: the epoch's plan (the order still to run).
        start_rest: starts the executor on a plan (called once Ray is up, at the handover).
        budget: the memory budget (``stats().memory_budget`` until the executor starts).
        on_started: called with the executor's statistics once it runs (they replace these).
    """

    def __init__(self, pipeline: Any, plan: EpochPlan, start_rest: Callable[[EpochPlan], Any], budget: int,
                 on_started: Callable[[ExecutionStats], None]) -> None:
        from sbloader.executor.stages import build_stages

        self.plan, self._start, self._on_started = plan, start_rest, on_started
        self.consumer_pace = _Pace()
        self._stats = ExecutionStats(operators=[OperatorStats(s.name) for s in build_stages(
            pipeline.source.name, list(pipeline.ops))], memory_budget=budget)
        self._executor: Any = None
        self._gap: Any = None  # the executor of the partitions a worker stalled on after the handover began
        self._gap_done: Any = None  # that executor once its blocks are all out (the consumer may hold some)
        self._gap_pids: frozenset = frozenset()
        self._handout = _Handout(list(plan.order), local_start.forced_handover())
        self._watch = stalled_workers.StallWatch()
        self._local: Any = fork_workers(pipeline, plan, self._handout, local_workers(), stalled_workers.stall_s())

    def _start_rest(self) -> None:
        at = self._handout.stopped_at
        self._executor = self._start(EpochPlan(self.plan.epoch, self.plan.epoch_seed, list(self.plan.order[at:]),
                                               self.plan.shuffle))
        mine, stats = self._stats, self._executor.stats()
        for op, local in zip(stats.operators, mine.operators):
            op.rows, op.blocks, op.bytes = op.rows + local.rows, op.blocks + local.blocks, op.bytes + local.bytes
        stats.local_partitions = mine.local_partitions
        self._stats = stats
        self.consumer_pace.target = self._executor.consumer_pace
        self._executor.consumer_pace.external = self.consumer_pace.external
        self._on_started(stats)

    def get_next(self) -> Any:
        """The next block: a local one while any is left, then the executor's; None at the end."""
        while self._local is not None:
            try:
                item = self._watch.next_item(self._local, self._goes_on)
            except StopIteration:
                self._end_local()
                break
            if item is stalled_workers.STALLED:
                self._left_stalled()
                break
            block, got, sizes = item
            if self._handout.stopped_at is not None and self._executor is None:
                self._start_rest()
            if block is None:
                raise got
            self._count(sizes)
            return _LocalItem(block, got)
        if self._gap is not None:
            item = self._gap.get_next()
            if item is not None:
                return item
            self._end_gap()
        if self._executor is None:
            if self._handout.stopped_at is None:
                return None
            self._start_rest()
        return self._executor.get_next()

    def _goes_on(self) -> str:
        """How the epoch goes on if the awaited local worker stalled (:meth:`_left_stalled`), for the warning."""
        at, stop = self._stats.local_partitions, self._handout.stopped_at
        if self._executor is None:
            return f"from partition {at} on Ray's workers (of {len(self.plan.order)} in the plan)"
        return f"on Ray's workers: the {stop - at} partitions the local workers owed (from {at}), then the rest"

    def _left_stalled(self) -> None:
        """A local worker stalled: the local workers are stopped. The executor then makes the plan from the
        first partition not received; or, when it already makes the plan's rest (the handover began), a second
        one (:attr:`_gap`) makes the partitions the local workers still owed, delivered before the rest."""
        at, stop = self._stats.local_partitions, self._handout.stopped_at  # taken so far: the plan's first ``at``
        self._end_local()
        if self._executor is None:
            self._handout.stopped_at = at
        else:
            owed = list(self.plan.order[at:stop])
            self._gap_pids = frozenset(owed)
            self._gap = self._start(EpochPlan(self.plan.epoch, self.plan.epoch_seed, owed, self.plan.shuffle))
            self._on_started(self._stats)  # the epoch's statistics stay these (a start may have set the gap's)

    def _end_gap(self) -> None:
        """The owed partitions are all out: their executor's counts join the epoch's (its blocks, once
        released, no longer count in its budget: it stays until the epoch's end)."""
        gap, self._gap_done, self._gap = self._gap, self._gap, None
        for op, owed in zip(self._stats.operators, gap.stats().operators):
            op.rows, op.blocks, op.bytes = op.rows + owed.rows, op.blocks + owed.blocks, op.bytes + owed.bytes

    def _count(self, sizes: tuple) -> None:
        self._stats.local_partitions += 1
        for op, (rows, nbytes) in zip(self._stats.operators, sizes):
            op.rows, op.blocks, op.bytes = op.rows + rows, op.blocks + 1, op.bytes + nbytes

    def _owner(self, meta: BlockMeta) -> Any:
        """The executor that made a block (the owed partitions' or the rest's)."""
        if meta.partition_id in self._gap_pids:
            return self._gap if self._gap is not None else self._gap_done
        return self._executor

    def fetch(self, item: Any) -> Block:
        """The block of an item from :meth:`get_next`."""
        return item.block if isinstance(item, _LocalItem) else self._owner(item.meta).fetch(item)

    def release_block(self, meta: BlockMeta) -> None:
        """The consumer is done with a block: the executor's no longer counts in its budget."""
        if meta.node_id != LOCAL_NODE and self._owner(meta) is not None:
            self._owner(meta).release_block(meta)

    def _end_local(self) -> None:
        local, self._local = self._local, None
        if local is not None:
            local._shutdown_workers()

    def shutdown(self) -> None:
        """Stop the local workers and the executors (idempotent)."""
        self._end_local()
        for executor in (self._gap, self._gap_done, self._executor):
            if executor is not None:
                executor.shutdown()

    @property
    def epoch_seed(self) -> int:
        """The seed of the epoch this execution runs."""
        return self.plan.epoch_seed

    def stats(self) -> ExecutionStats:
        """Statistics so far: the local partitions', then the executor's with them."""
        return self._stats

    def estimates(self) -> Optional[list]:
        """The executor's output-size estimates (None while it has not started)."""
        return self._executor.estimates() if self._executor is not None else None

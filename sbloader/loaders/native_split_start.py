"""The local start of a native pipeline's epoch split across ranks: each rank's first ``k`` batches made here.

Under torchrun a native pipeline's epoch is cut into the job's batches by a plan every rank
computes alike (:func:`~sbloader.loaders.pipeline_run.plan_split`: the partitions' row
counts, the shuffle window, the epoch seed), and a partition is a pure function of itself,
the epoch and its seed (:mod:`~sbloader.loaders.native_start`). So a rank needs nobody to
make its own first batches. On a loader's first epoch, while Ray starts (or is joined) and
the job's coordinator is found or created in the background, each rank:

1. makes the partitions its first ``k`` batches take rows from on local worker processes
   (:func:`make_locally`; a stalled worker leaves the rest of them
   to an execution on Ray) and cuts those batches from them
   exactly as it cuts the coordinator's blocks (:func:`~sbloader.core.cut.assemble`);
2. then joins the coordinator's epoch, which is the same epoch resumed after every rank's
   first ``k`` batches (:meth:`~sbloader.loaders.pipeline_run.SplitRun.progress`): the plan
   of what is left, cut from there, is the rest of the plan (tested at every ``k``), so the
   loop receives the batches, rows and ``state_dict()`` of a run without the local start.

``k`` is :data:`LOCAL_BATCHES` (``SBLOADER_SPLIT_LOCAL_BATCHES`` sets another count; 0: none),
at most the batches per rank: the same on every rank without a word. A partition that
several ranks' first batches share is made on each of them (a few partitions at the
epoch's start); the coordinator makes the partly consumed ones again for the rest.

It applies where the one-consumer local start does (every stage a plain function, no kept
actors, Ray not up yet, a memory budget known before Ray: :func:`native_start.enabled`), and
where every rank knows the epoch's order by itself: the loader's ``seed``, or a loaded state
(an unseeded epoch takes rank 0's seed from the coordinator, so it waits for it).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterator

from sbloader.core.block import Block
from sbloader.core.cut import assemble, checked_rows, places
from sbloader.core.plan import EpochPlan
from sbloader.core.stats import StallStats
from sbloader.loaders import native_start, stalled_workers
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.pipeline_epoch import device_copy, open_split
from sbloader.loaders.pipeline_run import PipelineRun, SplitRun
from sbloader.loaders.split_start import SPLIT_LOCAL_ENV
from sbloader.loaders.tensors import columns_as_tensors

LOCAL_BATCHES = 16  # each rank's locally made batches by default (the same on every rank: no machine's count)


def local_count(per_rank: int) -> int:
    """``k``: how many of its first batches each rank makes locally."""
    value = os.environ.get(SPLIT_LOCAL_ENV)
    k = int(value) if value not in (None, "") else LOCAL_BATCHES
    return max(0, min(k, per_rank))


def enabled(pipeline: Any, settings: Any, base: PipelineRun, seeded: bool, keeps_actors: bool) -> bool:
    """Whether this split epoch starts locally, decided alike on every rank (from the loader's
    arguments and the environment, never from whether Ray is up here yet, which differs between
    ranks): the loader's first epoch (the caller's check), an order every rank knows by itself
    (``seeded``: the loader's ``seed``; or a loaded state's), every stage a plain function, no kept
    actors, local starts allowed (:func:`~sbloader.loaders.native_start.enabled`), and a memory
    budget known before Ray (given, or the embedded Ray's: no ``RAY_ADDRESS``)."""
    resumed = bool(base.done or base.taken or base.ahead or base.batches)
    return ((seeded or resumed) and local_count(1) > 0
            and (settings.memory_budget is not None or not os.environ.get("RAY_ADDRESS"))
            and native_start.enabled(pipeline, settings.local_start, keeps_actors, forced=True))


class _Phases:
    """The epoch's run across its two phases (a :class:`~sbloader.loaders.epoch.Run` with the loader's
    ``progress()``): records ``0`` are the local batches of ``first``, records ``1`` the coordinator's
    batches of ``rest`` (the epoch resumed after every rank's first ``k``)."""

    def __init__(self, first: SplitRun, k: int) -> None:
        self.first, self.k = first, k
        self.rest: Any = None

    def took(self, record: Any) -> None:
        (self.first if record == 0 else self.rest).took(record)

    def finished(self) -> None:
        (self.rest if self.rest is not None else self.first).finished()

    def progress(self) -> PipelineRun:
        """The consumed state: ``first``'s until the loop took its ``k``-th batch, then ``rest``'s."""
        if self.rest is not None and self.first.taken >= self.k:
            return self.rest.progress()
        return self.first.progress()


def _needed(run: SplitRun, k: int) -> tuple[list, dict]:
    """The partitions this rank's first ``k`` batches take rows from, in the order first used, and the
    index of the last of those batches using each."""
    order: list = []
    last: dict = {}
    for j, b in enumerate(run.plan.for_rank(run.rank)[:k]):
        for p in places(b):
            pid = run.pids[p.key]
            if pid not in last:
                order.append(pid)
            last[pid] = j
    return order, last


def split_start_epoch(loader: Any, run: SplitRun, k: int,
                      rest_of: Callable[[PipelineRun], SplitRun]) -> EpochIterator:
    """This rank's share of a split epoch: its first ``k`` batches made here, then the coordinator's.

    Args:
        loader: the :class:`~sbloader.loaders.pipeline_loader.PipelineLoader` (its dataset, settings,
            carry, and ``_split_coordinator()``, called on a background thread at once).
        run: the rank's split of the epoch (the whole plan).
        k: batches made locally (:func:`local_count`).
        rest_of: the split of what is left once every rank took ``k`` (``plan_split`` of that state).
    """
    pipeline, settings, carry = loader.dataset, loader.settings, loader._carry
    mine = run.plan.for_rank(run.rank)[:k]
    order, last = _needed(run, k)
    offset = {place: run.base.taken.get(pid, 0) for place, pid in enumerate(run.pids)}
    places_of = {pid: place for place, pid in enumerate(run.pids)}
    plan = EpochPlan(run.epoch, run.base.epoch_seed, list(run.base.order), settings.shuffle)
    finder = threading.Thread(target=_find_coordinator, args=(loader,), daemon=True,
                              name="sbloader-coordinator-start")
    finder.start()
    stalls = StallStats()
    phases = _Phases(run, k)
    closing: dict = {"made": 0}
    carry.stats = None  # the coordinator's, once the epoch closes there

    def produce() -> Iterator[Delivery]:
        made = make_locally(pipeline, plan, order)
        blocks: dict = {}
        try:
            for j, b in enumerate(mine):
                for p in places(b):
                    while run.pids[p.key] not in blocks:
                        pid, block = next(made)
                        at = places_of[pid]
                        blocks[pid] = run.strip(at, checked_rows(block, pid, run.whole(at)))
                        closing["made"] += 1
                batch = assemble(b, run.pids, run.epoch, blocks, offset)
                for pid in [pid for pid, at in last.items() if at == j]:
                    blocks.pop(pid, None)
                t0 = time.perf_counter()
                out = columns_as_tensors(batch, settings.tensors)
                stalls.fetch_s += time.perf_counter() - t0
                yield Delivery(out, 0)
        finally:
            made.close()
        if k >= run.plan.per_rank:
            return
        finder.join()
        coordinator = loader._split_coordinator()  # the background's error, if any, raised here
        phases.rest = rest_of(run.progress(k))
        batches, closing["closed"] = open_split(pipeline, settings, phases.rest, coordinator, carry,
                                                loader._reconnect, stalls)
        yield from batches

    def closed() -> None:
        if "closed" in closing:
            closing["closed"]()
        if carry.stats is not None:  # the partitions made here count as the one-consumer start's do
            carry.stats.local_partitions += closing["made"]

    return EpochIterator(produce(), phases, ahead=max(1, settings.prefetch_blocks), stalls=stalls,
                         to_device=device_copy(settings), on_close=closed)


def make_locally(pipeline: Any, plan: EpochPlan, pids: list) -> Iterator[tuple[int, Block]]:
    """Partitions ``pids`` of ``plan`` made on local worker processes (as a Ray task makes each: read,
    row shuffle, then every operator), yielded in that order; a partition that failed raises its error.
    The workers are shut down when the iteration ends or is closed. A worker that uses no CPU over a whole
    wait (:mod:`~sbloader.loaders.stalled_workers`) leaves the partitions not yielded yet to Ray
    (:func:`made_on_ray`: the same blocks)."""
    pids = list(pids)
    workers = max(1, min(native_start.local_workers(), len(pids)))
    it = native_start.fork_workers(pipeline, plan, pids, workers, stalled_workers.stall_s())
    watch, n = stalled_workers.StallWatch(), 0
    try:
        while n < len(pids):
            item = watch.next_item(it, lambda: f"on Ray's workers: the last {len(pids) - n} of {len(pids)} partitions")
            if item is stalled_workers.STALLED:
                it._shutdown_workers()
                yield from made_on_ray(pipeline, plan, pids[n:])
                return
            block, got, _ = item
            if block is None:
                raise got
            yield pids[n], block
            n += 1
    finally:
        it._shutdown_workers()


def made_on_ray(pipeline: Any, plan: EpochPlan, pids: list) -> Iterator[tuple[int, Block]]:
    """Partitions ``pids`` of ``plan`` made by an execution on Ray (deterministic: in that order; each
    block its own, not a view of a shared-memory slot), yielded as :func:`make_locally` yields them."""
    from sbloader.executor.launch import options_here, start_execution

    executor = start_execution(pipeline.source, tuple(pipeline.ops),
                               EpochPlan(plan.epoch, plan.epoch_seed, list(pids), plan.shuffle),
                               options_here(deterministic=True, progress=False))
    try:
        for pid in pids:
            item = executor.get_next()
            block = executor.fetch(item)
            executor.release_block(item.meta)
            yield pid, block
    finally:
        executor.shutdown()


def _find_coordinator(loader: Any) -> None:
    """In the background: Ray up, the job's coordinator found or created."""
    try:
        loader._split_coordinator()
    except Exception:  # the fetch thread asks again after the local batches, and raises it there
        pass


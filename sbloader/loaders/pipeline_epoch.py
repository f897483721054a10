"""The epochs of a native pipeline loader: one consumer, or one rank of a job.

:func:`local_epoch` runs the epoch's pipeline in this process's executor and cuts
its blocks into batches (the shuffle window drawing each batch from several
partitions, :mod:`~sbloader.loaders.batching`); :func:`split_epoch` has the job's
split coordinator run the pipeline once and cuts this rank's batches from the job's
cut plan (:mod:`~sbloader.distributed.pipeline_client`). Both hand their batches to
the same consumer stages (:class:`~sbloader.loaders.epoch.EpochIterator`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

from sbloader.core.ops import Op
from sbloader.core.plan import EpochPlan, make_epoch_plan
from sbloader.core.stats import ExecutionStats, StallStats
from sbloader.distributed import pipeline_client
from sbloader.executor.launch import arena_here, options_here, start_execution
from sbloader.core.window import FIRST_PARTITIONS, WindowSpec, drawn_share, narrow_message
from sbloader.loaders import native_start, shuffle_window, warm_workers
from sbloader.loaders.batching import BlockFeed, ShuffleWindow, iter_batches
from sbloader.loaders.shuffle_window import prefetch_hint
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.pipeline_run import PipelineRun, SplitRun, skip_consumed
from sbloader.loaders.tensors import DeviceCopy, TensorOptions, columns_as_tensors
from sbloader.sources.base import Source


class Pipeline(Protocol):
    """What a loader runs: a source and its operators (a :class:`~sbloader.dataset.dataset.Dataset`)."""

    @property
    def source(self) -> Source: ...

    @property
    def ops(self) -> tuple[Op, ...]: ...


@dataclass(frozen=True)
class PipelineSettings:
    """How a native loader batches and runs its epochs (its constructor's arguments).

    Attributes:
        batch_size: rows per batch.
        shuffle: reshuffle every epoch.
        drop_last: drop a final short batch.
        deterministic: fixed delivery order for a given epoch seed.
        memory_budget: bytes the pipeline may hold in the object store.
        prefetch_blocks: ready blocks kept ahead, and batches made ahead of the loop.
        window: the shuffle window asked for (one partition without shuffle).
        allow_trainer_node: let tasks run on this process's node on a cluster.
        tensors: how batches become tensors.
        device: the loop's device (None: the CPU).
        local_start: a fresh process's epoch may start on local worker processes while Ray
            starts (:mod:`~sbloader.loaders.native_start`).
        plan_cut: one consumer cuts its batches with the window a split epoch uses (in rows,
            from the plan), so which rows a batch holds is the plan's arithmetic on any world
            size (a mixture's sources: :meth:`~sbloader.loaders.pipeline_loader.PipelineLoader.credit_rows`).
        first_call_alone: each epoch's source stage runs one call until its first block is
            out (a mixture's sources: :attr:`~sbloader.executor.options.ExecutionOptions.first_call_alone`).
    """

    batch_size: int
    shuffle: bool
    drop_last: bool
    deterministic: bool
    memory_budget: Optional[int]
    prefetch_blocks: int
    window: WindowSpec
    allow_trainer_node: bool
    tensors: TensorOptions
    device: Any = None
    local_start: bool = True
    plan_cut: bool = False
    first_call_alone: bool = False

    def prefetch_for(self, source: Source, plan: EpochPlan) -> int:
        """Ready blocks to keep ahead: ``prefetch_blocks``, raised to the shuffle window's
        blocks and to two batches' worth when a batch spans several blocks."""
        base = max(self.prefetch_blocks, prefetch_hint(self.window))
        rows = source.num_rows()
        try:
            parts = len(source.partitions(plan.epoch, plan.epoch_seed, shuffle=plan.shuffle))
        except Exception:  # a source that cannot list cheaply: blocks as given
            return base
        if not rows or not parts:
            return base
        return max(base, 2 * math.ceil(self.batch_size / max(1.0, rows / parts)))


@dataclass
class Carry:
    """What a native loader keeps from one epoch to the next.

    Attributes:
        actor_cache: the pools' actors (``persistent_workers``), or None.
        estimates: the stages' output block sizes measured by the last epoch: the next
            starts every slot at once instead of one task per stage.
        counted_rows: rows the last complete epoch delivered (``len()`` of a pipeline
            that may change the row count).
        stats: the latest epoch's execution statistics.
        last_split: (split across ranks) the last epoch this rank cut to its end and its spec
            (rank 0's): a coordinator lost after it is told, so the ranks still in it go on.
    """

    actor_cache: Optional[dict] = None
    estimates: Optional[list] = None
    counted_rows: Optional[int] = None
    stats: Optional[ExecutionStats] = field(default=None)
    last_split: Optional[tuple] = None


def epoch_plan(source: Source, epoch: int, epoch_seed: int, shuffle: bool) -> EpochPlan:
    """The epoch's whole plan: the source's partitions for the epoch, in the order the seed draws."""
    ids = [p.id for p in source.partitions(epoch, epoch_seed, shuffle=shuffle)]
    return make_epoch_plan(ids, epoch, epoch_seed, shuffle)


def device_copy(settings: PipelineSettings) -> Optional[DeviceCopy]:
    """The copy of each batch to the loop's device (None: batches stay on the CPU)."""
    return DeviceCopy(settings.device, settings.tensors.pin) if settings.device is not None else None


def local_epoch(pipeline: Pipeline, settings: PipelineSettings, run: PipelineRun, carry: Carry) -> EpochIterator:
    """One consumer's epoch: the pipeline in this process's executor (its first partitions on local
    worker processes while Ray starts: :mod:`~sbloader.loaders.native_start`), its blocks cut here."""
    source = pipeline.source
    plan = EpochPlan(run.epoch, run.epoch_seed, run.unfinished(), settings.shuffle)
    warm_key = None if carry.actor_cache is not None or not warm_workers.enabled() else \
        warm_workers.pipeline_key(source.name, pipeline.ops, settings.allow_trainer_node)
    # callable-class actors: the loader's own (persistent_workers), or warm ones this process kept from an
    # earlier pipeline with the same classes, arguments and resources (handed back when the epoch ends)
    cache = carry.actor_cache if warm_key is None else None

    def start(rest: EpochPlan) -> Any:
        nonlocal cache
        options = options_here(memory_budget=settings.memory_budget, deterministic=settings.deterministic,
                               prefetch_blocks=settings.prefetch_for(source, plan), progress=False,
                               allow_trainer_node=settings.allow_trainer_node,
                               first_call_alone=settings.first_call_alone)
        if warm_key is not None:
            cache = warm_workers.unpark(warm_key)
        warm_workers.give_way(1.0, keep=warm_key)  # other idle actors of this process, if the CPUs are short
        return start_execution(source, pipeline.ops, rest, options, actor_cache=cache,
                               estimates=carry.estimates, arena=arena_here())

    budget = native_start.budget_before_ray(settings.memory_budget) if native_start.enabled(
        pipeline, settings.local_start, carry.actor_cache is not None) else None
    report_box: list = []
    if budget is not None:
        executor: Any = native_start.PhasedExecution(pipeline, plan, start, budget, lambda stats: (
            setattr(carry, "stats", stats), [r.into(stats) for r in report_box]))
    else:
        executor = start(plan)
    carry.stats = executor.stats()
    stalls = StallStats()
    if settings.plan_cut:
        window = shuffle_window.split_window(settings.window, run, source, carry.stats.memory_budget)
    else:
        window = shuffle_window.local_window(settings.window, run, carry.stats.memory_budget)
    report = shuffle_window.Report(pipeline, settings.window, len(run.order), carry.stats)
    report_box.append(report)
    feed = BlockFeed(executor, hold=1 if window.in_turn else None)
    cut = ShuffleWindow(window, run.epoch_seed, run.batches, None if window.in_turn else feed.release,
                        shuffle_window.block_weight(window, run), report.observe)

    def produce() -> Iterator[Delivery]:
        seen: list = []  # partition sizes seen, recorded with the next batch the loop takes
        batches = iter_batches(skip_consumed(iter(feed), run, seen), settings.batch_size, settings.drop_last, cut)
        try:
            for batch in batches:
                t0 = time.perf_counter()
                out = columns_as_tensors(batch, settings.tensors)
                stalls.fetch_s += time.perf_counter() - t0
                facts, seen[:] = list(seen), []
                yield Delivery(out, (batch.parts, facts))
        finally:
            batches.close()

    # The loop's own time per batch (its waits left out) tells the executor whether the
    # pipeline is the bottleneck: the fetch thread, which asks again at once, cannot.
    pace = executor.consumer_pace
    pace.external = True

    def closed() -> None:
        carry.estimates = executor.estimates() or carry.estimates
        if warm_key is not None and cache is not None:
            warm_workers.park(warm_key, cache)
        if run.complete:
            carry.counted_rows = carry.stats.operators[-1].rows

    return EpochIterator(produce(), run, ahead=max(1, settings.prefetch_blocks), stalls=stalls,
                         to_device=device_copy(settings), wake=executor.shutdown, on_close=closed,
                         pace=lambda seconds: pace.add(seconds, settings.batch_size))


def split_epoch(pipeline: Pipeline, settings: PipelineSettings, run: SplitRun, coordinator: Any,
                carry: Carry, reconnect: Optional[Callable[[], Any]] = None) -> EpochIterator:
    """One rank's epoch of a job: the job's pipeline on its coordinator, this rank's batches cut here.

    ``reconnect`` finds the job's coordinator anew after it died (its node or its process):
    the ranks rebuild the epoch on the new one (:class:`~sbloader.distributed.pipeline_client.Link`).
    """
    stalls = StallStats()
    produce, closed = open_split(pipeline, settings, run, coordinator, carry, reconnect, stalls)
    return EpochIterator(produce, run, ahead=max(1, settings.prefetch_blocks), stalls=stalls,
                         to_device=device_copy(settings), on_close=closed)


def open_split(pipeline: Pipeline, settings: PipelineSettings, run: SplitRun, coordinator: Any, carry: Carry,
               reconnect: Optional[Callable[[], Any]], stalls: StallStats) -> tuple[Iterator[Delivery], Callable]:
    """:func:`split_epoch`'s batches (records ``1``) and what closes the epoch at the coordinator, for an
    epoch iterator to hold (also one whose first batches were made locally: :mod:`native_split_start`)."""
    carry.stats = None
    link = pipeline_client.Link(coordinator, reconnect)

    def produce() -> Iterator[Delivery]:
        if run.rank == 0:
            plan = EpochPlan(run.epoch, run.base.epoch_seed, run.pids, settings.shuffle)
            ahead = settings.prefetch_for(pipeline.source, plan) + run.plan.world_size * (
                1 + min(run.plan.widest, FIRST_PARTITIONS))
            options = options_here(memory_budget=settings.memory_budget, deterministic=settings.deterministic,
                                   prefetch_blocks=ahead, progress=False,
                                   allow_trainer_node=settings.allow_trainer_node,
                                   first_call_alone=settings.first_call_alone)
            link.spec = pipeline_client.partition_spec(run, pipeline.source, pipeline.ops, options,
                                                       settings.shuffle)
        try:
            pipeline_client.join(link.coord, run, link.spec)
        except ray_actor_error():
            # The coordinator died after this rank had cut all of its previous epoch (or while it made its
            # first batches locally): say so to the new one (ranks still in that epoch wait for every
            # rank's report), then join.
            last = carry.last_split
            if reconnect is None:
                raise
            link.coord = reconnect()
            link.rebuilds += 1
            if last is not None:
                pipeline_client.report_done(link.coord, last[0], last[1])
            pipeline_client.join(link.coord, run, link.spec)
        for batch, _ in pipeline_client.batches(link, run):
            t0 = time.perf_counter()
            out = columns_as_tensors(batch, settings.tensors)
            stalls.fetch_s += time.perf_counter() - t0
            yield Delivery(out, 1)
        carry.last_split = (run, link.spec)

    def closed() -> None:
        pipeline_client.finish(link.coord, run.epoch, run.rank, run.taken)
        carry.stats = pipeline_client.stats(link.coord, run.epoch)
        if run.plan.narrowed and carry.stats is not None:
            carry.stats.shuffle_note = narrowed_note(settings.window, run.plan.widest, len(run.base.order))
        if carry.stats is not None:
            carry.stats.rebuilt_coordinators += link.rebuilds
        stalls.note_failures(carry.stats, link.rebuilds)

    return produce(), closed


def ray_actor_error() -> type:
    """Ray's error for a call on an actor that died (imported late: Ray loads on first use)."""
    import ray

    return ray.exceptions.RayActorError


def narrowed_note(spec: WindowSpec, widest: int, partitions: int) -> str:
    """The ``stats()`` line of a split epoch that did not fit its window."""
    return narrow_message(spec, drawn_share(widest, partitions), widest, partitions)


def sizes_of(source: Source, epoch: int, epoch_seed: int, shuffle: bool) -> dict:
    """Output rows of every partition id of the epoch (None where the source cannot tell)."""
    return {p.id: p.num_rows for p in source.partitions(epoch, epoch_seed, shuffle=shuffle)}

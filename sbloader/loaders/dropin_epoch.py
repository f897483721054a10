"""The epochs of the drop-in DataLoader: in this process, on a worker pool, or split by the coordinator.

Each builder returns an :class:`~sbloader.loaders.epoch.EpochIterator` over a
producer of ready batches, from a snapshot of the loader's arguments taken when the
iteration starts (:class:`DropinSettings`, as torch builds its iterator from the
loader's attributes):

- :func:`local_epoch`: ``num_workers=0``, every ``dataset[i]`` and ``collate_fn``
  call in this process, as torch does;
- :func:`pool_epoch`: a pool of ``num_workers`` remote actors runs the epoch's
  batches (:class:`~sbloader.loaders.worker.LoaderWorker`);
- :func:`split_epoch`: the job's coordinator runs the pool and hands this rank its
  share, equal counts on every rank (:mod:`~sbloader.distributed.dropin_client`);
- :func:`stream_epoch`: an ``IterableDataset`` the coordinator iterates once for the
  job and equalises as it goes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import ray

from sbloader.core.block import SHARD_STATE_COLUMN
from sbloader.core.context import task_context
from sbloader.core.plan import make_epoch_plan
from sbloader.core.stats import StallStats
from sbloader.distributed import dropin_client, pipeline_client
from sbloader.executor.launch import arena_here, options_here, start_execution
from sbloader.executor.shard_rounds import ShardRounds, segment_size
from sbloader.loaders.dropin_settings import _CARRIES, DropinCarry, DropinSettings
from sbloader.loaders.dropin_state import EpochRun
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.fork_safe import seed_here
from sbloader.loaders.failed_batch import FailedBatch, translate
from sbloader.loaders.iterable_resume import IterableRun, batches_before, first_snapshot, iterate_shard, open_shard
from sbloader.loaders.shard_order import RoundRobin, shard_positions
from sbloader.loaders import warm_workers
from sbloader.loaders.tensors import pin_batch, wire_as_tensors
from sbloader.sources.batches import ReadyBatchSource, ShardSource


def find_coordinator(world: Any, name: str, fingerprint: dict, stall_report_s: float, settings: DropinSettings,
                     stream: bool, carry: DropinCarry) -> Any:
    """The job's coordinator of a loader: found, or created by the first rank to ask; rank 0 then
    has it start the worker pool (not awaited: the pool starts while the ranks plan the epoch).
    The loader (its ``carry``) is recorded there until its drop (:meth:`DropinCarry.drop`)."""
    from sbloader.distributed.naming import get_coordinator
    from sbloader.runtime.session import ensure_initialized

    from sbloader.runtime.job import identify

    job = identify(world)
    ensure_initialized()
    coord = get_coordinator(job, name, world.world_size, fingerprint, world.restart_count, stall_report_s,
                            rank=world.rank, loader=carry.id)
    carry.rank = world.rank
    warm_workers.give_way(settings.num_workers * settings.worker_num_cpus)  # the coordinator's pool needs them
    if world.rank == 0:
        source = ShardSource.name if stream else ReadyBatchSource.name
        coord.prewarm.remote(source, (settings.worker_op(),), settings.coordinator_options())
    return coord


def local_epoch(s: DropinSettings, run: Optional[Union[EpochRun, IterableRun]], epoch: int, epoch_seed: int,
                index_sampler: Any) -> EpochIterator:
    """``num_workers=0``: fetch and collate in this process, exactly as torch does."""
    if s.seed is not None:  # only when asked: without it the trainer's RNGs stay as torch leaves them
        seed_here(epoch_seed)

    def collate(item: Any, auto: bool) -> Any:
        try:
            batch = s.collate_fn([s.dataset[i] for i in item] if auto else s.dataset[item])
        except Exception as e:  # raised for this batch; the loop may catch it and go on, as under torch
            return FailedBatch(e)
        return pin_batch(batch) if s.pin else batch

    def produce() -> Iterator[Delivery]:
        if s.iterable:  # one shard, this process's; ``run``: an IterableRun (its snapshots)
            for batch, _, snap in iterate_shard(s.dataset, s.batch_size, s.drop_last, s.collate_fn, resume, opened):
                yield Delivery(pin_batch(batch) if s.pin else batch, (0, snap) if run is not None else None)
        elif run is not None:
            for j, indices in enumerate(run.batches):
                if s.seed is not None and j % s.batches_per_partition == 0:
                    # Seeded per partition as a remote worker is (the pool is operator 0): a resumed
                    # epoch replays a batch with the same draws as the uninterrupted run.
                    seed_here(task_context(epoch, epoch_seed, run.ids[j], "LoaderWorker", 0).ctx.seed)
                # batch_size=None: each "batch" is one index, fetched and converted alone, as torch does
                yield Delivery(collate(indices if s.auto_collation else indices[0], s.auto_collation), j)
        else:
            for item in index_sampler:
                yield Delivery(collate(list(item) if s.auto_collation else item, s.auto_collation))

    resume = run.shard_resume(0) if s.iterable and run is not None else None
    opened = None
    if s.iterable and not (resume or {}).get("ended"):
        # iter(dataset) now, as torch's in-process iterator does (its error is raised by iter(loader))
        opened = open_shard(s.dataset, resume)
        if run is not None:  # a state taken before the first batch holds the iterator's state already
            run.took((0, first_snapshot(s.dataset, *opened, batches_before(resume))))
    stalls = StallStats()
    return EpochIterator(produce(), run, ahead=0, stalls=stalls, to_device=s.to_device,
                         on_close=s.reporter(f"epoch {epoch}", stalls))


@dataclass
class PoolPhase:
    """An epoch's batches from the pool of ``num_workers`` remote actors, once started.

    Attributes:
        executor: the execution running the pool.
        produce: its generator of :class:`Delivery` (records: the batch's index in the epoch).
        closed: what the epoch does when it ends (estimates kept, actors kept warm or released).
    """

    executor: Any
    produce: Iterator[Delivery]
    closed: Callable[[], None]


def open_pool(s: DropinSettings, carry: DropinCarry, run: Optional[Union[EpochRun, IterableRun]], epoch: int,
              epoch_seed: int, items: Optional[list], stalls: StallStats, start: int = 0,
              cache: Optional[dict] = None, shard_resume: Optional[dict] = None,
              missed: Sequence[int] = ()) -> PoolPhase:
    """Start the pool on the epoch's batches from index ``start`` on (``items``: the map-style epoch's
    work items; None for an ``IterableDataset``'s shards, resumed from ``shard_resume`` when given, else
    from ``run``), after the earlier partitions ``missed`` (a stalled local phase's), on the actors in
    ``cache`` when given (started ahead of it), else the loader's persistent or warm ones."""
    fp = s.source_fingerprint()
    options = pool_options(s)
    op = s.worker_op(epoch_seed)
    warm = not s.persistent_workers and warm_workers.enabled()
    if cache is None and s.persistent_workers:  # a new loader's first epoch takes a dropped one's actors
        warm_workers.adopt_persistent(carry, op, s.num_workers, s.warm_key())
        cache = carry.actor_cache
    elif cache is None:
        cache = warm_workers.take(carry, op, s.num_workers, s.warm_key()) if warm else None
    if s.iterable and s.persistent_workers:
        whole_pool(s, op, options, cache)

    def execute(source: Any) -> Any:
        plan = make_epoch_plan([p.id for p in source.partitions(epoch, epoch_seed)], epoch, epoch_seed, shuffle=False)
        executor = start_execution(source, (op,), plan, options, actor_cache=cache, estimates=carry.estimates,
                                   arena=arena_here())
        carry.stats = executor.stats()
        return executor

    resume, index = None, []
    if s.iterable:  # shards in segments, round after round (a stream that never ends keeps yielding)
        resume = shard_resume if shard_resume is not None else run.resume if run is not None else {}
        resume = {w: r for w, r in resume.items() if r is not None}
        segment = segment_size(s.batches_per_partition)
        executor: Any = ShardRounds(lambda at, n: execute(ShardSource(s.num_workers, fp).segment(at, n)),
                                    resume, s.num_workers, segment)
    else:
        bpp = s.batches_per_partition
        index = [j for q in missed for j in range(q * bpp, min((q + 1) * bpp, len(items)))] + \
            list(range(start, len(items)))  # each batch's index in the epoch, in the pool's order
        ids = [run.ids[j] for j in index] if run is not None else [j // bpp for j in index]
        executor = execute(ReadyBatchSource([items[j] for j in index], s.batches_per_partition, fp, ids=ids))
    cpus = s.num_workers * s.worker_num_cpus  # its actors' CPUs count until the epoch closes, the loader dropped or not
    carry.pools_running, carry.pool_cpus, carry.held_cpus = carry.pools_running + 1, carry.pool_cpus + cpus, 0.0
    _CARRIES.add(carry)
    tensors = s.tensors()

    def produce() -> Iterator[Delivery]:
        """Each ready batch with its record. An ``IterableDataset``'s shards are dealt in torch's
        round-robin (in order) or as they come."""
        if not (s.iterable and s.in_order):
            yield from blocks()
            return
        order = RoundRobin(shard_positions(resume, s.num_workers))
        for shard, k, delivery in blocks(shards=True):
            for w in [w for w in order.positions() if w < shard and executor.shard_done(w)]:
                order.end(w)  # blocks come in shard order: an earlier shard's segment is empty (no block)
            if delivery is None:
                order.end(shard)
            else:
                order.add(shard, order.positions().get(shard, 0) if k is None else k, delivery)
            yield from order.pop_ready()
        for w in order.positions():
            order.end(w)
        yield from order.pop_ready()

    def blocks(shards: bool = False) -> Iterator[Any]:
        """Each ready batch with its index in the epoch (``shards``: as ``(shard, k, delivery)``, then
        ``(shard, None, None)`` at the end of each shard's block). Copies release a block's bytes as soon
        as its batches are made; zero-copy batches view the block, which is released once the
        loop moved on (a block read from a slot keeps its slot until its batches are gone)."""
        copy = not s.zero_copy
        while True:
            item = executor.get_next()
            if item is None:
                return
            t0 = time.perf_counter()
            block = executor.fetch(item)
            wires, snaps = block["batch"], block.get(SHARD_STATE_COLUMN) if s.iterable else None
            del block
            out = [wire_as_tensors(w, tensors) for w in wires]
            del wires
            owner = executor.owner(item) if s.iterable else executor  # its round's execution holds the bytes
            if copy:
                owner.release(item.meta.nbytes)
            stalls.fetch_s += time.perf_counter() - t0
            for i, batch in enumerate(out):
                last = i == len(out) - 1
                release = (lambda n=item.meta.nbytes, o=owner: o.release(n)) if last and not copy else None
                record = None
                if run is not None:
                    record = (snaps[i] if snaps is not None else None) if s.iterable else \
                        index[item.meta.seq * s.batches_per_partition + i]
                if shards:
                    snap = snaps[i] if snaps is not None else None
                    k = snap[1]["batches"] - 1 if snap is not None and "batches" in snap[1] else None
                    yield item.meta.partition_id, k, Delivery(batch, record, release)
                else:
                    yield Delivery(batch, record, release)
            out = []
            if shards and executor.shard_done(item.meta.partition_id):
                yield item.meta.partition_id, None, None

    def closed() -> None:
        carry.estimates = executor.estimates()
        if s.iterable:  # the epoch's rounds, all of them
            carry.stats = executor.stats()
        carry.pools_running, carry.pool_cpus = carry.pools_running - 1, max(0.0, carry.pool_cpus - cpus)
        if warm:  # the actors stay warm for the next epoch (an idle timeout kills them)
            carry.held_cpus = cpus
            warm_workers.keep(carry)
        elif s.persistent_workers and not carry.dropped:
            carry.held_cpus = cpus
        if carry.dropped:  # the loader went first (its iterator lived on): its persistent actors go now
            warm_workers.hand_to_process(carry)

    return PoolPhase(executor, produce(), closed)


def whole_pool(s: DropinSettings, op: Any, options: Any, cache: dict) -> None:
    """A ``persistent_workers`` ``IterableDataset`` starts its epoch once every actor is up: worker ``w``'s
    dataset copy, with whatever state it keeps from epoch to epoch, lives in actor ``w``, so shard ``w``
    runs there (as a persistent torch worker runs its own shard every epoch), never on whichever actor
    came up first. Bounded by ``start_timeout`` (the pool's own start then raises, as ever)."""
    from sbloader.executor.pools import PrestartedActor, prestart_pools

    prestart_pools(ShardSource.name, (op,), options, cache)
    refs = [h.ready_ref for hs in cache.values() for h in hs if isinstance(h, PrestartedActor)]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=s.start_timeout if s.start_timeout is not None else 300.0)


def pool_options(s: DropinSettings) -> Any:
    """The execution options of the loader's pool in this process."""
    return options_here(memory_budget=s.memory_budget, deterministic=s.in_order, progress=False,
                        prefetch_blocks=max(1, math.ceil(s.ahead * s.num_workers / s.batches_per_partition)),
                        allow_trainer_node=s.allow_trainer_node)


def pool_epoch(s: DropinSettings, carry: DropinCarry, run: Optional[Union[EpochRun, IterableRun]], epoch: int,
               epoch_seed: int, index_sampler: Any) -> EpochIterator:
    """A pool of ``num_workers`` remote actors fetches and collates the epoch's batches."""
    stalls = StallStats()
    items = None if s.iterable else s.epoch_items(run, index_sampler)
    pool = open_pool(s, carry, run, epoch, epoch_seed, items, stalls)

    def closed() -> None:
        pool.closed()
        s.reporter(f"epoch {epoch}", stalls)()

    return EpochIterator(pool.produce, run, ahead=s.ahead, stalls=stalls, to_device=s.to_device, translate=translate,
                         timeout=s.timeout or None, wake=pool.executor.shutdown, on_close=closed,
                         started=pool.executor.pools_up, start_timeout=s.start_timeout)


def split_epoch(s: DropinSettings, carry: DropinCarry, run: EpochRun, rank: int,
                reconnect: Callable[[], Any]) -> EpochIterator:
    """This rank's share of an epoch the job's coordinator runs (every rank the same count)."""
    stalls = StallStats()
    produce, closed = open_split(s, carry, run, rank, reconnect, stalls)
    return EpochIterator(produce, run, ahead=s.ahead, stalls=stalls, to_device=s.to_device, translate=translate,
                         on_close=closed)


def open_split(s: DropinSettings, carry: DropinCarry, run: EpochRun, rank: int, reconnect: Callable[[], Any],
               stalls: StallStats) -> tuple[Iterator[Delivery], Callable[[], None]]:
    """Join the coordinator's epoch of ``run`` (rank 0 starts it): this rank's batches (records: their
    index in ``run``) and what the epoch does when it ends."""
    coord = carry.coordinator

    def spec() -> Any:
        return dropin_client.epoch_spec(run, s.source_fingerprint(), s.worker_op(), s.coordinator_options(),
                                        s.in_order)

    try:
        per_rank = dropin_client.join(coord, rank, run.epoch, spec)
    except ray.exceptions.RayActorError:
        # The coordinator died after this rank had taken all of its previous epoch: say so to
        # the new one (ranks still in that epoch wait for every rank's report to rebuild it),
        # then start this epoch there.
        coord = reconnect()
        last = carry.last_split_run
        if last is not None:
            coord.rebuild.remote(last.epoch, rank, list(last.taken),
                                 dropin_client.epoch_spec(last, s.source_fingerprint(), s.worker_op(),
                                                          s.coordinator_options(), s.in_order), wait=False)
        per_rank = dropin_client.join(coord, rank, run.epoch, spec)
    if per_rank != run.per_rank:
        from sbloader.core.errors import SbloaderError

        raise SbloaderError(
            f"rank {rank} planned {run.per_rank} batches for epoch {run.epoch} but rank 0 planned {per_rank}: "
            "every rank must load the same state and use the same loader arguments"
        )
    pull = dropin_client.Pull(coord, rank, run.epoch, per_rank, s.ahead, s.pin, not s.zero_copy,
                              consumed=lambda: len(run.taken), reconnect=reconnect, spec=spec,
                              timeout=s.timeout or None, lease_interval_s=carry.lease_interval_s)

    def produce() -> Iterator[Delivery]:
        for batch, index in pull.batches():
            stalls.fetch_s = pull.fetch_s
            yield Delivery(batch, index)

    def closed() -> None:
        dropin_client.finish(pull.coord, run.epoch, rank, len(run.taken))
        if run.complete:
            carry.last_split_run = run
        carry.stats = pipeline_client.stats(pull.coord, run.epoch)  # the job's pipeline, at the coordinator
        if carry.stats is not None:
            carry.stats.rebuilt_coordinators += pull.rebuilds
        stalls.note_failures(carry.stats, pull.rebuilds)
        s.reporter(f"rank {rank} epoch {run.epoch}", stalls)()

    return produce(), closed


def stream_epoch(s: DropinSettings, carry: DropinCarry, rank: int, epoch: int, epoch_seed: int) -> EpochIterator:
    """This rank's share of an ``IterableDataset`` the job's coordinator iterates once."""
    stalls = StallStats()
    produce, closed = open_stream(s, carry, rank, epoch, epoch_seed, stalls)
    return EpochIterator(produce, None, ahead=s.ahead, stalls=stalls, to_device=s.to_device, translate=translate,
                         on_close=closed)


def open_stream(s: DropinSettings, carry: DropinCarry, rank: int, epoch: int, epoch_seed: int, stalls: StallStats,
                report: Optional[tuple] = None) -> tuple[Iterator[Delivery], Callable[[], None]]:
    """Join the coordinator's stream epoch (rank 0 starts it): this rank's batches and what the epoch does
    when it ends. ``report``: ``(delivered, positions)`` after a local phase (:mod:`~sbloader.loaders.stream_start`)."""
    coord = carry.coordinator
    start = report[0] if report is not None else 0
    dropin_client.join(coord, rank, epoch, lambda: dropin_client.stream_spec(
        epoch, epoch_seed, max(1, s.num_workers), s.source_fingerprint(), s.worker_op(), s.coordinator_options(),
        s.drop_last, segment_size(s.batches_per_partition), reports=report is not None), report)

    def produce() -> Iterator[Delivery]:
        for batch in dropin_client.pull_stream(coord, rank, epoch, s.ahead, s.pin, not s.zero_copy,
                                               consumed=lambda: stalls.batches, timeout=s.timeout or None,
                                               start=start):
            yield Delivery(batch)

    def closed() -> None:
        dropin_client.finish(coord, epoch, rank, stalls.batches)
        carry.stats = pipeline_client.stats(coord, epoch)  # the job's pipeline, at the coordinator
        stalls.note_failures(carry.stats)
        s.reporter(f"rank {rank} epoch {epoch}", stalls)()

    return produce(), closed

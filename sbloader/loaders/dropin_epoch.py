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
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import ray

from sbloader.core.context import seed_globals, task_context
from sbloader.core.errors import UserFunctionError, reraise_as_torch
from sbloader.core.ops import Op
from sbloader.core.plan import make_epoch_plan
from sbloader.core.stats import ExecutionStats, StallStats
from sbloader.distributed import dropin_client, pipeline_client
from sbloader.executor.options import ExecutionOptions
from sbloader.executor.pools import kill_cached
from sbloader.executor.launch import arena_here, options_here, start_execution
from sbloader.executor.tasks import pack
from sbloader.loaders.dropin_state import EpochRun
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.failed_batch import FailedBatch
from sbloader.loaders.iterable_resume import IterableRun, first_snapshot, iterate_shard, open_shard
from sbloader.loaders import warm_workers
from sbloader.loaders.tensors import DeviceCopy, TensorOptions, pin_batch, wire_as_tensors
from sbloader.loaders.worker import SHARD_STATE_COLUMN, LoaderWorker
from sbloader.sources.batches import ReadyBatchSource, ShardSource


@dataclass(frozen=True)
class DropinSettings:
    """The loader's arguments an epoch runs with (a snapshot taken when the iteration starts).

    Attributes: those of :class:`~sbloader.loaders.dataloader.DataLoader`, resolved
    (``pin``: page-locked copies only with an accelerator; ``auto_collation``: the
    loader batches; ``iterable``: the dataset is an ``IterableDataset``).
    """

    dataset: Any
    collate_fn: Callable
    auto_collation: bool
    iterable: bool
    batch_size: Optional[int]
    drop_last: bool
    num_workers: int
    worker_init_fn: Optional[Callable]
    prefetch_factor: Optional[int]
    in_order: bool
    timeout: float
    pin: bool
    zero_copy: bool
    device: Any
    memory_budget: Optional[int]
    batches_per_partition: int
    worker_num_cpus: float
    worker_resources: Optional[dict]
    allow_trainer_node: bool
    persistent_workers: bool
    seed: Optional[int]
    dataset_id: Optional[str]
    report_stalls: bool
    start_timeout: Optional[float] = None

    @property
    def ahead(self) -> int:
        """Batches made ahead of the loop (torch's ``prefetch_factor``)."""
        return max(1, self.prefetch_factor or 2)

    def worker_op(self, base_seed: Optional[int] = None) -> Op:
        """The pool of ``num_workers`` remote workers that fetch and collate (``base_seed``: the
        seed each worker adds its id to before ``worker_init_fn``, as torch's; None: a random one)."""
        workers = max(1, self.num_workers)
        config = pack(dict(  # pickled once per epoch here: the workers see the dataset as it is now
            dataset=self.dataset, collate_fn=self.collate_fn, auto_collation=self.auto_collation,
            num_workers=workers, worker_init_fn=self.worker_init_fn,
            batch_size=self.batch_size, drop_last=self.drop_last, base_seed=base_seed))
        return Op("map_batches", LoaderWorker, "LoaderWorker", index=0, num_cpus=self.worker_num_cpus,
                  resources=self.worker_resources, concurrency=(workers, workers),
                  fn_constructor_args=(config,), fuse_read=True)

    def source_fingerprint(self) -> dict:
        """How the epoch's sources describe the dataset."""
        return {"type": type(self.dataset).__name__, "len": safe_len(self.dataset), "dataset_id": self.dataset_id}

    def coordinator_options(self) -> ExecutionOptions:
        """The execution options of the loader's epochs on the coordinator."""
        return options_here(memory_budget=self.memory_budget, deterministic=self.in_order, progress=False,
                            prefetch_blocks=max(2, (self.prefetch_factor or 2) * max(1, self.num_workers)),
                            allow_trainer_node=self.allow_trainer_node)

    def tensors(self) -> TensorOptions:
        """How a worker's wire batch becomes the loop's tensors."""
        return TensorOptions(pin=self.pin, zero_copy=self.zero_copy)


@dataclass(eq=False)  # hashed by identity (kept in a WeakSet)
class DropinCarry:
    """What a drop-in loader keeps from one epoch to the next.

    Attributes:
        actor_cache: the worker actors (``persistent_workers``; the pool's per epoch otherwise).
        warm_cache: without ``persistent_workers``, the last epoch's actor processes, rebuilt by
            the next epoch (:mod:`~sbloader.loaders.warm_workers`).
        estimates: the stages' output block sizes measured by the last epoch.
        stats: the latest epoch's execution statistics.
        coordinator: the loader's split coordinator, once found.
        last_split_run: the last epoch this rank finished split by the coordinator (a
            coordinator lost after it is told, so the ranks still in it can go on).
        dropped: the loader is gone; an epoch that outlives it kills the actors it
            hands back to ``actor_cache`` (nobody will use them again).
    """

    actor_cache: dict = field(default_factory=dict)
    estimates: Optional[list] = None
    stats: Optional[ExecutionStats] = None
    coordinator: Any = None
    last_split_run: Optional[EpochRun] = None
    lease_interval_s: float = 1.0  # seconds one request's lease lasts (below a quarter of stall_report_s)
    dropped: bool = False
    held_cpus: float = 0.0  # CPUs its pool's actors ask Ray for (running, or kept as persistent workers)
    warm_cache: dict = field(default_factory=dict)  # persistent_workers=False: actors kept warm (warm_workers)
    warm_timer: Any = None


_CARRIES: "weakref.WeakSet[DropinCarry]" = weakref.WeakSet()  # the drop-in loaders of this process


def cpus_held_by_loaders(exclude: Optional[DropinCarry] = None) -> float:
    """CPUs the live drop-in pools of this process ask for (known here before Ray places them)."""
    return sum(c.held_cpus for c in list(_CARRIES) if c is not exclude and not c.dropped)


def find_coordinator(world: Any, name: str, fingerprint: dict, stall_report_s: float, settings: DropinSettings,
                     stream: bool) -> Any:
    """The job's coordinator of a loader: found, or created by the first rank to ask; rank 0 then
    has it start the worker pool (not awaited: the pool starts while the ranks plan the epoch)."""
    from sbloader.distributed.naming import get_coordinator
    from sbloader.runtime.session import ensure_initialized

    from sbloader.runtime.job import identify

    job = identify(world)
    ensure_initialized()
    coord = get_coordinator(job, name, world.world_size, fingerprint, world.restart_count, stall_report_s,
                            rank=world.rank)
    if world.rank == 0:
        source = ShardSource.name if stream else ReadyBatchSource.name
        coord.prewarm.remote(source, (settings.worker_op(),), settings.coordinator_options())
    return coord


def safe_len(x: Any) -> Optional[int]:
    """``len(x)``, or None for an object without one."""
    try:
        return len(x)
    except TypeError:
        return None


def translate(e: BaseException) -> None:
    """Raise a worker's error as torch's DataLoader does (its original type); else leave it."""
    if isinstance(e, UserFunctionError):
        reraise_as_torch(e)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, UserFunctionError):
        reraise_as_torch(e.cause)


def _device(s: DropinSettings) -> Optional[DeviceCopy]:
    return DeviceCopy(s.device, s.pin) if s.device is not None else None


def _report(s: DropinSettings, what: str, stalls: StallStats) -> Callable[[], None]:
    def report() -> None:
        if s.report_stalls:
            print(f"sbloader {what}: {stalls}")
    return report


def local_epoch(s: DropinSettings, run: Optional[Union[EpochRun, IterableRun]], epoch: int, epoch_seed: int,
                index_sampler: Any) -> EpochIterator:
    """``num_workers=0``: fetch and collate in this process, exactly as torch does."""
    if s.seed is not None:  # only when asked: without it the trainer's RNGs stay as torch leaves them
        seed_globals(epoch_seed)

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
                    seed_globals(task_context(epoch, epoch_seed, run.ids[j], "LoaderWorker", 0).ctx.seed)
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
            run.took((0, first_snapshot(s.dataset, *opened)))
    stalls = StallStats()
    return EpochIterator(produce(), run, ahead=0, stalls=stalls, to_device=_device(s),
                         on_close=_report(s, f"epoch {epoch}", stalls))


def pool_epoch(s: DropinSettings, carry: DropinCarry, run: Optional[Union[EpochRun, IterableRun]], epoch: int, epoch_seed: int,
               index_sampler: Any) -> EpochIterator:
    """A pool of ``num_workers`` remote actors fetches and collates the epoch's batches."""
    fp = s.source_fingerprint()
    if s.iterable:
        source: Any = ShardSource(s.num_workers, fp, run.resume if run is not None else None)
    elif run is not None:
        items = run.batches if s.auto_collation else [b[0] for b in run.batches]  # batch_size=None: one index
        source = ReadyBatchSource(items, s.batches_per_partition, fp, ids=run.ids)
    else:
        source = ReadyBatchSource([list(b) if s.auto_collation else b for b in index_sampler],
                                  s.batches_per_partition, fp)
    plan = make_epoch_plan([p.id for p in source.partitions(epoch, epoch_seed)], epoch, epoch_seed, shuffle=False)
    options = options_here(memory_budget=s.memory_budget, deterministic=s.in_order, progress=False,
                           prefetch_blocks=max(1, math.ceil(s.ahead * s.num_workers / s.batches_per_partition)),
                           allow_trainer_node=s.allow_trainer_node)
    op = s.worker_op(epoch_seed)
    warm = not s.persistent_workers and warm_workers.enabled()
    cache = carry.actor_cache if s.persistent_workers else warm_workers.take(carry, op, s.num_workers) if warm \
        else None
    executor = start_execution(source, (op,), plan, options, actor_cache=cache, estimates=carry.estimates,
                               arena=arena_here())
    carry.stats = executor.stats()
    carry.held_cpus = s.num_workers * s.worker_num_cpus
    _CARRIES.add(carry)
    stalls = StallStats()
    tensors = s.tensors()

    def produce() -> Iterator[Delivery]:
        """Each ready batch with its index in the epoch. Copies release a block's bytes as soon
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
            if copy:
                executor.release(item.meta.nbytes)
            stalls.fetch_s += time.perf_counter() - t0
            for i, batch in enumerate(out):
                last = i == len(out) - 1
                release = (lambda n=item.meta.nbytes: executor.release(n)) if last and not copy else None
                record = None
                if run is not None:
                    record = (snaps[i] if snaps is not None else None) if s.iterable else \
                        item.meta.seq * s.batches_per_partition + i
                yield Delivery(batch, record, release)
            out = []

    def closed() -> None:
        carry.estimates = executor.estimates()
        if warm:  # the actors stay warm for the next epoch (an idle timeout kills them)
            warm_workers.keep(carry)
        elif not s.persistent_workers or carry.dropped:
            carry.held_cpus = 0.0
        if carry.dropped:  # the loader went first (its iterator lived on): its persistent actors go now
            kill_cached(carry.actor_cache)
        _report(s, f"epoch {epoch}", stalls)()

    return EpochIterator(produce(), run, ahead=s.ahead, stalls=stalls, to_device=_device(s), translate=translate,
                         timeout=s.timeout or None, wake=executor.shutdown, on_close=closed,
                         started=executor.pools_up, start_timeout=s.start_timeout)


def split_epoch(s: DropinSettings, carry: DropinCarry, run: EpochRun, rank: int,
                reconnect: Callable[[], Any]) -> EpochIterator:
    """This rank's share of an epoch the job's coordinator runs (every rank the same count)."""
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
    stalls = StallStats()
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
        _report(s, f"rank {rank} epoch {run.epoch}", stalls)()

    return EpochIterator(produce(), run, ahead=s.ahead, stalls=stalls, to_device=_device(s), translate=translate,
                         on_close=closed)


def stream_epoch(s: DropinSettings, carry: DropinCarry, rank: int, epoch: int, epoch_seed: int) -> EpochIterator:
    """This rank's share of an ``IterableDataset`` the job's coordinator iterates once."""
    coord = carry.coordinator
    dropin_client.join(coord, rank, epoch, lambda: dropin_client.stream_spec(
        epoch, epoch_seed, max(1, s.num_workers), s.source_fingerprint(), s.worker_op(), s.coordinator_options(),
        s.drop_last))
    stalls = StallStats()

    def produce() -> Iterator[Delivery]:
        for batch in dropin_client.pull_stream(coord, rank, epoch, s.ahead, s.pin, not s.zero_copy,
                                               consumed=lambda: stalls.batches, timeout=s.timeout or None):
            yield Delivery(batch)

    def closed() -> None:
        dropin_client.finish(coord, epoch, rank, stalls.batches)
        _report(s, f"rank {rank} epoch {epoch}", stalls)()

    return EpochIterator(produce(), None, ahead=s.ahead, stalls=stalls, to_device=_device(s), translate=translate,
                         on_close=closed)

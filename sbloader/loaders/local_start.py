"""The local start of a drop-in epoch: its first batches from worker processes forked here.

A Ray actor pool takes seconds to come up (the embedded Ray's start, then a process per
actor, importing torch, unpickling the dataset); torch forks its workers in a fraction
of one. So when the loader's pool is not ready (Ray still starting, or no actors kept
from an earlier epoch), a map-style epoch starts at once on ``num_workers`` local
processes made by torch's own worker machinery (``torch.utils.data``'s multiprocessing
iterator: fork where torch forks, the user's ``multiprocessing_context`` otherwise),
while Ray starts in the background (:mod:`sbloader.runtime.background`) and the pool's
actors are started ahead (:func:`~sbloader.executor.pools.prestart_pools`).

The epoch is one straight path, two phases of one producer:

1. **local**: the local workers make whole partitions (``batches_per_partition``
   batches) in plan order, each as a remote worker would (the same worker id, seed
   ``epoch_seed + id``, ``get_worker_info()`` naming the user's dataset,
   ``worker_init_fn``, per-partition seeds from the plan);
2. **handover**: once the pool's actors are constructed, the local sampler stops
   handing out partitions: the local workers finish the ``k`` partitions they were
   given, the pool starts on partition ``k`` (and its batches are made while the
   local ones drain), and the loop receives every batch once, in plan order, with
   the same batch boundaries and records (the batch's index in the epoch): a
   ``state_dict()`` before, during or after the handover is the same arithmetic.

``local_start=False`` on the ``DataLoader`` (or ``SBLOADER_LOCAL_START=0``) turns it
off, for a trainer node whose CPUs are kept for the trainer. With ``persistent_workers=True``
there is no local start: those workers keep their state for the loader's life, so they are
one set of processes (the pool), as torch's are.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterator, Optional

from sbloader.core.context import task_context
from sbloader.core.stats import StallStats
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.failed_batch import WORKER_INIT_FN, FailedBatch
from sbloader.loaders.fork_safe import ForkGate
from sbloader.loaders import stalled_workers
from sbloader.loaders.handover import begin, phased_iterator, pool_batches
from sbloader.loaders.tensors import pin_batch

LOCAL_START_ENV = "SBLOADER_LOCAL_START"  # 0: never start an epoch on local processes
#: tests: every epoch starts locally and hands over at this partition (an IterableDataset: after this many batches)
HANDOVER_AT_ENV = "SBLOADER_HANDOVER_AT"
#: In a local worker: its RNG streams once worker_init_fn set them, and worker_init_fn's error.
LOCAL_WORKER: dict = {"own_states": None, "init_error": None}


def enabled(s: Any) -> bool:
    """Whether an epoch may start on local processes: the loader's ``local_start`` (unless the environment
    says 0), and not with ``persistent_workers`` (whose workers keep their state for the loader's life: one
    set of processes, ``worker_init_fn`` once per worker)."""
    return s.local_start and not s.persistent_workers and os.environ.get(LOCAL_START_ENV, "1") != "0"


def forced_handover() -> Optional[int]:
    """The partition at which ``SBLOADER_HANDOVER_AT`` forces the handover (tests), or None."""
    value = os.environ.get(HANDOVER_AT_ENV)
    return int(value) if value not in (None, "") else None


def wanted(s: Any, carry: Any) -> bool:
    """Whether an epoch starts on local processes: :func:`enabled`, and the pool is not up (:func:`pool_is_up`)."""
    return enabled(s) and not pool_is_up(s, carry)


def pool_is_up(s: Any, carry: Any) -> bool:
    """Whether the loader's pool can start its epoch without waiting: Ray up and its actors kept
    (persistent, or warm from the last epoch with the same count)."""
    from sbloader.runtime import background

    if forced_handover() is not None:
        return False
    if not background.ready():
        return False
    if s.persistent_workers:
        return sum(len(hs) for hs in carry.actor_cache.values()) == s.num_workers
    from sbloader.loaders import warm_workers

    if not (warm_workers.enabled() and warm_workers.available(carry, s.warm_key(), s.num_workers)):
        return False
    # kept, but still starting (an epoch that ended before its pool was up): start locally again
    starting = [h.ready_ref for hs in carry.warm_cache.values() for h in hs if hasattr(h, "ready_ref")]
    if not starting:
        return True
    import ray

    done, _ = ray.wait(starting, num_returns=len(starting), timeout=0)
    return len(done) == len(starting)


def identity(x: Any) -> Any:
    """The local workers' ``collate_fn``: their items are collated already."""
    return x


class WorkerInit:
    """Run in each local worker before its first partition, as :class:`~sbloader.loaders.worker.LoaderWorker`
    does in a remote one: seed ``epoch_seed + id``, ``get_worker_info()`` naming the user's dataset, then the
    user's ``worker_init_fn`` (whose changes to the RNGs, if any, the worker keeps from then on)."""

    def __init__(self, dataset: Any, epoch_seed: int, user_fn: Any, s: Any, shards: Optional[list] = None) -> None:
        self.dataset, self.epoch_seed, self.user_fn = dataset, epoch_seed, user_fn
        self.inits = _init_flags(s)  # worker w sets byte w once its init ran: ``timeout`` counts from then on
        self.shards = shards  # local worker i is the pool's worker ``shards[i]`` of ``num_workers`` (None: i of them)
        self.num_workers = s.num_workers

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        from sbloader.loaders.worker import _rng_states, _same_states, _seed_all, _set_torch_worker_info

        local_id, n = worker_id, get_worker_info().num_workers
        if self.shards is not None:
            worker_id, n = self.shards[local_id], self.num_workers
        seed = (self.epoch_seed + worker_id) % 2**63
        _seed_all(seed)
        _set_torch_worker_info(worker_id, n, seed, self.dataset)
        LOCAL_WORKER["own_states"] = LOCAL_WORKER["init_error"] = None
        if self.user_fn is not None:
            before = _rng_states()
            try:
                self.user_fn(worker_id)
            except Exception as e:  # raised at the worker's first batch, as a pool actor's (naming worker_init_fn)
                LOCAL_WORKER["init_error"] = FailedBatch.remote(e, WORKER_INIT_FN, -1, -1, worker_id, fatal=True)
            after = _rng_states()
            if not _same_states(before, after):
                LOCAL_WORKER["own_states"] = after
        self.inits[local_id] = 1


def _init_flags(s: Any) -> Any:
    """One shared byte per local worker (a raw shared array: passed at the workers' start, fork or spawn)."""
    import multiprocessing

    ctx = s.multiprocessing_context
    ctx = multiprocessing.get_context(ctx) if isinstance(ctx, str) or ctx is None else ctx
    return ctx.RawArray("b", max(1, s.num_workers))


class _Partitions:
    """What the local workers index: partition ``p`` -> ``(p, its collated batches)``; a batch whose
    ``dataset[i]`` or ``collate_fn`` raised is torch's ``ExceptionWrapper`` in its place."""

    def __init__(self, dataset: Any, collate_fn: Any, auto: bool, items: list, ids: list, bpp: int, epoch: int,
                 epoch_seed: int) -> None:
        self.dataset, self.collate_fn, self.auto = dataset, collate_fn, auto
        self.items, self.ids, self.bpp, self.epoch, self.epoch_seed = items, ids, bpp, epoch, epoch_seed

    def __len__(self) -> int:
        return math.ceil(len(self.items) / self.bpp)

    def __getitem__(self, p: int) -> tuple:
        from torch.utils.data._utils import worker as torch_worker
        from torch.utils.data._utils.worker import ExceptionWrapper

        from sbloader.loaders.worker import _rng_states, _set_rng_states

        first = p * self.bpp
        if LOCAL_WORKER["init_error"] is not None:
            return p, [LOCAL_WORKER["init_error"]] * len(self.items[first:first + self.bpp])
        out = []
        with task_context(self.epoch, self.epoch_seed, self.ids[first], "LoaderWorker", 0):
            own = LOCAL_WORKER["own_states"]
            if own is not None:  # worker_init_fn's seed stands: the worker's streams go on
                _set_rng_states(own)
            for item in self.items[first:first + self.bpp]:
                try:
                    out.append(self._make(item))
                except Exception:
                    info = torch_worker.get_worker_info()
                    out.append(ExceptionWrapper(where=f"in DataLoader worker process {info.id if info else 0}"))
            if own is not None:
                LOCAL_WORKER["own_states"] = _rng_states()
        return p, out


    def _make(self, item: Any) -> Any:
        """One batch, collated (a split epoch's tail batch padded as a pool actor pads it)."""
        from sbloader.sources.batches import PaddedBatch

        if isinstance(item, PaddedBatch):
            from sbloader.core.batch_slice import mark_padding

            batch = self.collate_fn([self.dataset[i] for i in item.indices])
            return mark_padding(batch, len(item.indices), item.pad)
        return self.collate_fn([self.dataset[i] for i in item] if self.auto else self.dataset[item])


def local_start_epoch(s: Any, carry: Any, run: Any, epoch: int, epoch_seed: int,
                      index_sampler: Any) -> EpochIterator:
    """A map-style epoch started on local worker processes and handed over to the pool."""
    stalls = StallStats()
    items = s.epoch_items(run, index_sampler)
    bpp = s.batches_per_partition
    handover = begin(s, carry, epoch_seed, math.ceil(len(items) / bpp), forced_handover())
    phase: dict = {}

    def produce() -> Iterator[Delivery]:
        ids = run.ids if run is not None else [j // bpp for j in range(len(items))]
        local = torch_workers(s, items, ids, epoch, epoch_seed, handover, timeout=stalled_workers.stall_s())
        yield from deliveries(s, local, phase, (lambda j: j) if run is not None else (lambda j: None), handover)
        k = handover.stopped_at
        if k is None or phase.get("failed"):  # the local workers made the whole epoch (or it failed)
            return
        from sbloader.loaders.dropin_epoch import open_pool

        yield from pool_batches(handover, phase, lambda: open_pool(s, carry, run, epoch, epoch_seed, items, stalls,
                                                                   start=k * bpp, cache=handover.cache,
                                                                   missed=handover.missed))

    return phased_iterator(s, carry, run, epoch, stalls, handover, phase, produce())


def torch_workers(s: Any, items: list, ids: list, epoch: int, epoch_seed: int, sampler: Any,
                  timeout: float = 0) -> Any:
    """torch's own ``DataLoader`` over the epoch's partitions of ``items`` (``batches_per_partition`` batches
    each; ``sampler`` yields the partition numbers to make): ``num_workers`` local processes, each set up as
    a pool actor is (:class:`WorkerInit`). ``timeout``: torch's wait for one partition (0: none; the loop's
    own ``timeout`` is the epoch iterator's)."""
    import torch
    from sbloader.loaders.torch_loader import torch_loader

    TorchLoader = torch_loader()

    parts = _Partitions(s.dataset, s.collate_fn, s.auto_collation, items, ids, s.batches_per_partition, epoch,
                        epoch_seed)
    return TorchLoader(parts, batch_size=None, sampler=ForkGate().wrap(sampler), num_workers=s.num_workers,
                       collate_fn=identity,  # ``timeout``: the epoch's, counted once the workers are up
                       worker_init_fn=WorkerInit(s.dataset, epoch_seed, s.worker_init_fn, s),
                       multiprocessing_context=s.multiprocessing_context,
                       generator=torch.Generator().manual_seed(epoch_seed % 2**63),  # the trainer's RNG untouched
                       prefetch_factor=s.prefetch_factor, timeout=timeout, **local_order(s))


def local_order(s: Any) -> dict:
    """torch's ``in_order`` for the local workers: the loader's (``in_order=False``: batches as they come)."""
    return {} if s.in_order else {"in_order": False}


def deliveries(s: Any, local: Any, phase: dict, record: Any, handover: Any = None,
               then: str = "on the pool") -> Iterator[Delivery]:
    """The batches of :func:`torch_workers`' loader ``local``, in order, each with ``record(j)`` (``j``: its
    position among ``items``); ``phase["up"]`` is set once the workers made their first partition, and
    ``phase["inits"]`` says which of them ran their init (:func:`workers_up`). With a ``handover`` (a loader
    whose waits run out), a local worker that used no CPU over a whole wait
    (:mod:`~sbloader.loaders.stalled_workers`) ends the local phase: the pool makes every partition not
    received (:meth:`Handover.stalled <sbloader.loaders.handover.Handover.stalled>`; in order, the epoch from
    the first one not received; ``then``: where, for the warning)."""
    bpp = s.batches_per_partition
    phase["inits"] = local.worker_init_fn.inits
    with local.sampler.gate.forking():
        it = iter(local)  # forks the workers
    watch, received = stalled_workers.StallWatch(), set()
    while True:
        try:
            got = watch.next_item(it, lambda: f"{then}, {len(received)} partitions received here") \
                if handover is not None else next(it)
        except StopIteration:
            return
        except Exception as e:  # worker_init_fn failed or a worker died: torch's error, the epoch ends
            phase["failed"] = True
            it._shutdown_workers()  # now: nothing resumes this generator after a fatal batch
            yield Delivery(FailedBatch(e, fatal=True), None)
            return
        if got is stalled_workers.STALLED:
            handover.stalled(received)
            it._shutdown_workers()
            return
        p, batches = got
        phase["up"] = True  # the workers are up: ``timeout`` counts from here, ``start_timeout`` is over
        received.add(p)
        for i, b in enumerate(batches):
            yield Delivery(unwrap(b, s.pin), record(p * bpp + i))


def unwrap(batch: Any, pin: bool) -> Any:
    """A local batch as the loop receives it: pinned if asked, or its error in its place."""
    from torch.utils.data._utils.worker import ExceptionWrapper

    if isinstance(batch, FailedBatch):  # worker_init_fn failed in that worker
        return batch
    if isinstance(batch, ExceptionWrapper):
        try:
            batch.reraise()
        except Exception as e:  # raised at this batch; the loop may catch it and go on, as under torch
            # without reraise's frame (its local ``exception`` and the error's traceback form a cycle that, once
            # the loop raised it, would keep the loop's iterator and its local workers until a garbage collection)
            return FailedBatch(e.with_traceback(None))
    return pin_batch(batch) if pin else batch

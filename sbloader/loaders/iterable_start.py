"""The local start of an ``IterableDataset`` epoch: its shards begin on worker processes forked here.

The map-style local start (:mod:`~sbloader.loaders.local_start`) hands partitions over;
an ``IterableDataset`` has no partitions, only worker shards (``get_worker_info().id``), so
the handover is per shard and at a batch:

1. **local**: ``num_workers`` processes made by torch's own worker machinery each iterate
   shard ``id`` as a pool actor would (:class:`LocalShards`: the same seeds, dataset copy,
   ``get_worker_info()`` and ``worker_init_fn``), sending each batch with the shard's
   snapshot after it (:func:`~sbloader.loaders.iterable_resume.iterate_shard`); the loop
   receives them in torch's round-robin (:class:`~sbloader.loaders.shard_order.RoundRobin`,
   also across a resume whose shards stand at different rounds);
2. **handover**: once the pool's actors (started ahead by
   :func:`~sbloader.loaders.handover.prestart`) are up, between two batches, the local
   workers are shut down and the pool resumes every shard after the last batch the loop
   received from it, as any of sbloader's own reopens of a shard (its snapshot where the
   dataset's state moved at every batch, else the shard's start in this epoch and the samples
   made since skipped: :func:`~sbloader.loaders.iterable_resume.reopen_position`; what the
   local workers made beyond it is made again). The pool's
   batches go on in the same round-robin, so the epoch is the same batches, in the same order,
   as one run on the pool alone, and ``state_dict()`` before, during or after the handover is
   the same per-shard snapshot arithmetic.

A local worker that uses no CPU over a whole wait (:mod:`~sbloader.loaders.stalled_workers`:
``SBLOADER_LOCAL_STALL_S``) hands the epoch over at once, the same way: the pool resumes every
shard after the last batch received from it.
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Optional

from torch.utils.data import IterableDataset

from sbloader.core.context import task_context
from sbloader.core.stats import StallStats
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.failed_batch import FailedBatch
from sbloader.loaders.fork_safe import ForkGate
from sbloader.loaders.iterable_resume import IterableRun, iterate_shard
from sbloader.loaders.handover import Handover, begin, phased_iterator, pool_batches
from sbloader.loaders.local_start import LOCAL_WORKER, WorkerInit, forced_handover, identity, local_order, unwrap
from sbloader.loaders.shard_order import RoundRobin, shard_positions
from sbloader.loaders.stalled_workers import STALLED, StallWatch, stall_s

END = "end"  # a local worker's last item: its shard has no more batches


class LocalShards(IterableDataset):
    """What a local worker iterates: its shard ``get_worker_info().id`` of the user's dataset, as
    ``("batch", shard, batch, snapshot, samples)`` items, then ``("end", shard)``."""

    def __init__(self, dataset: Any, collate_fn: Any, batch_size: Optional[int], drop_last: bool, num_workers: int,
                 resume: dict, epoch: int, epoch_seed: int) -> None:
        self.dataset, self.collate_fn, self.batch_size, self.drop_last = dataset, collate_fn, batch_size, drop_last
        self.num_workers, self.resume, self.epoch, self.epoch_seed = num_workers, resume, epoch, epoch_seed

    def __iter__(self) -> Iterator[tuple]:
        from torch.utils.data import get_worker_info

        from sbloader.loaders.worker import _rng_states, _set_rng_states, _set_torch_worker_info

        shard = get_worker_info().id
        if LOCAL_WORKER["init_error"] is not None:  # worker_init_fn failed: raised at this shard's first batch
            yield "batch", shard, LOCAL_WORKER["init_error"], None, 0
            yield END, shard
            return
        with task_context(self.epoch, self.epoch_seed, shard, "LoaderWorker", 0) as ctx:  # the pool's shard seed
            own = LOCAL_WORKER["own_states"]
            seed = ctx.seed
            if own is not None:  # worker_init_fn's seed stands: the worker's streams go on
                _set_rng_states(own)
                seed = (self.epoch_seed + shard) % 2**63
            _set_torch_worker_info(shard, self.num_workers, seed, self.dataset)
            for batch, n, snap in iterate_shard(self.dataset, self.batch_size, self.drop_last, self.collate_fn,
                                                self.resume.get(shard)):
                yield "batch", shard, batch, snap, n
            if own is not None:
                LOCAL_WORKER["own_states"] = _rng_states()
        yield END, shard


def iterable_start_epoch(s: Any, carry: Any, run: IterableRun, epoch: int, epoch_seed: int) -> EpochIterator:
    """An ``IterableDataset`` epoch that starts on local worker processes and hands its shards to the pool."""
    stalls = StallStats()
    handover = begin(s, carry, epoch_seed, 0, forced_handover())
    positions = {w: run.resume.get(w) for w in range(s.num_workers)}  # each shard's last delivered snapshot
    phase: dict = {}

    def produce() -> Iterator[Delivery]:
        yield from _local_phase(s, run, epoch, epoch_seed, handover, positions, phase)
        if not phase.get("handed_over"):
            return
        from sbloader.loaders.dropin_epoch import open_pool

        yield from pool_batches(handover, phase, lambda: open_pool(s, carry, run, epoch, epoch_seed, None, stalls,
                                                                   cache=handover.cache, shard_resume=positions))

    return phased_iterator(s, carry, run, epoch, stalls, handover, phase, produce())


def _local_phase(s: Any, run: IterableRun, epoch: int, epoch_seed: int, handover: Handover, positions: dict,
                 phase: dict) -> Iterator[Delivery]:
    """The local workers' batches in order, until the pool is up (``phase["handed_over"]``) or the epoch ends;
    ``positions`` follows each shard's last delivered snapshot."""
    import torch
    from sbloader.loaders.torch_loader import torch_loader

    TorchLoader = torch_loader()

    shards = LocalShards(s.dataset, s.collate_fn, s.batch_size, s.drop_last, s.num_workers, dict(positions),
                          epoch, epoch_seed)
    local = TorchLoader(shards, batch_size=None, num_workers=s.num_workers, collate_fn=identity,
                        worker_init_fn=WorkerInit(s.dataset, epoch_seed, s.worker_init_fn, s),
                        multiprocessing_context=s.multiprocessing_context, prefetch_factor=s.prefetch_factor,
                        generator=torch.Generator().manual_seed(epoch_seed % 2**63), timeout=stall_s(),
                        **local_order(s))
    phase["inits"] = local.worker_init_fn.inits
    if _hand_over_now(handover, 0):  # forced at batch 0: the pool makes the whole epoch
        phase["handed_over"] = True
        return
    with ForkGate().forking():
        it = iter(local)  # forks the workers
    order = RoundRobin(shard_positions(positions, s.num_workers)) if s.in_order else None
    delivered = 0
    try:
        for item in worker_items(it, phase, lambda: f"after batch {delivered} on the pool"):
            if isinstance(item, Delivery):  # torch's error: the epoch ends (its workers are shut down)
                yield item
                return
            if order is None:
                ready = [] if item[0] == END else [item]
            else:
                if item[0] == END:
                    order.end(item[1])
                else:
                    order.add(item[1], int(item[3]["batches"]) - 1 if item[3] else 0, item)
                ready = list(order.pop_ready())
            for _, shard, batch, snap, _ in ready:
                if snap is not None:
                    positions[shard] = snap  # the pool reopens it by the snapshot's chain (reopen_position)
                yield Delivery(unwrap(batch, s.pin), (shard, snap) if snap is not None else None)
                delivered += 1
                if _hand_over_now(handover, delivered):
                    phase["handed_over"] = True
                    return
        if phase.get("stalled"):
            phase["handed_over"] = True
    finally:
        it._shutdown_workers()


def worker_items(it: Iterator, phase: dict, goes_on: Any = None) -> Iterator[Any]:
    """The local workers' items; torch's error (a dataset's ``__iter__``/``__next__`` or a worker's death) as a
    fatal :class:`Delivery`, after which there is nothing more: the workers are shut down before it goes (nothing
    resumes the consumer's generator after a fatal batch, so its ``finally`` would not run). A wait that runs out
    on a worker that used no CPU through it ends the items with ``phase["stalled"]`` set (``goes_on()``: how the
    epoch goes on, for the warning); one that ran waits again."""
    watch = StallWatch()
    while True:
        try:
            item = watch.next_item(it, goes_on) if goes_on is not None else next(it)
        except StopIteration:
            return
        except Exception as e:
            phase["failed"] = True
            it._shutdown_workers()
            yield Delivery(FailedBatch(e, fatal=True), None)
            return
        if item is STALLED:
            phase["stalled"] = True
            return
        phase["up"] = True
        yield item


def _hand_over_now(handover: Handover, delivered: int) -> bool:
    """Whether the pool takes over after ``delivered`` local batches: its actors are up (at least one
    batch made here: the workers are forked already), or, forced (tests), exactly at ``handover.at``."""
    if handover.at is not None:
        if delivered != handover.at:
            return False
        while not handover.ready() and not handover.closed and not handover.gave_up:
            time.sleep(0.01)
        return not handover.gave_up and not handover.closed
    return delivered > 0 and handover.ready()

"""The local start of a split (torchrun) ``IterableDataset`` epoch: each rank's first batches from its own shards.

Under torchrun the job's coordinator iterates the stream once for the job, ``num_workers``
worker shards, and keeps the ranks' counts equal as batches are produced
(:mod:`~sbloader.distributed.stream_epoch`). No plan says which batch is whose, but the
shards can be split by a pure rule, so a rank needs nobody to start: on a loader's first
split epoch, rank ``r`` runs the shards ``w % world_size == r`` (:func:`own_shards`) on
local worker processes (torch's worker machinery; each worker set up as a pool actor is:
shard ``w``'s seed, ``get_worker_info()`` naming worker ``w`` of ``num_workers``,
``worker_init_fn(w)``), while Ray starts or is joined in the background, the coordinator is
found there and its pool of actors comes up.

- **Equal counts without a word**: a rank delivers its ``d``-th local batch only once its own
  workers made ``world_size * d`` batches (:func:`~sbloader.core.split.local_allowance`): the
  stream has at least that many, so every rank's final share reaches ``d``. A shard's short
  last batch is not delivered here: it is made again for the coordinator's tail, which cuts
  the short batches into every rank's last one, as in a run on the pool alone.
- **Handover**: once the coordinator's pool is up (``SplitCoordinator.prewarm``), or a local
  worker used no CPU over a whole wait (:mod:`~sbloader.loaders.stalled_workers`), the rank
  stops its local workers and reports how many batches it delivered and where each of its
  shards stands after its last delivered batch (what the workers made beyond it is made
  again). The coordinator starts production once every rank reported: each shard resumed
  from its snapshot, each rank's count from its local one
  (:meth:`~sbloader.distributed.stream_epoch.StreamEpoch.report`); the rank then takes its
  batches from the coordinator as any rank does.

Every rank decides alike whether the epoch starts locally (the loader's first split epoch,
its arguments and ``local_start``): the coordinator waits for every rank's report. A rank
with no shard of its own (``world_size > num_workers``) reports nothing delivered.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

from sbloader.core.split import local_allowance
from sbloader.core.stats import StallStats
from sbloader.loaders import local_start
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.fork_safe import ForkGate
from sbloader.loaders.handover import workers_up
from sbloader.loaders.iterable_start import END, LocalShards, worker_items
from sbloader.loaders.stalled_workers import stall_s
from sbloader.loaders.shard_order import RoundRobin

POOL_POLL_S = 1.0  # the background asks the coordinator whether its pool is up this often (a blocking call)


def own_shards(num_workers: int, world_size: int, rank: int) -> list[int]:
    """The worker shards rank ``rank`` starts on its local workers: ``w % world_size == rank``."""
    return [w for w in range(num_workers) if w % world_size == rank]


def enabled(s: Any, first: bool) -> bool:
    """Whether this split stream epoch starts locally: the loader's ``first`` split epoch (counted by the
    loader: every rank decides alike), with workers, local starts allowed
    (:func:`~sbloader.loaders.local_start.enabled`)."""
    return s.num_workers > 0 and first and local_start.enabled(s)


@dataclass
class LocalTally:
    """What a rank's local phase made and delivered, and where its shards stand after their last delivered
    batch (the report the coordinator resumes them from)."""

    world_size: int
    made: int = 0
    delivered: int = 0
    positions: dict = field(default_factory=dict)

    def report(self) -> tuple[int, dict]:
        return self.delivered, dict(self.positions)


def _find_pool(loader: Any, s: Any, box: dict, stop: threading.Event) -> None:
    """(Background) Ray up, the coordinator found or created (rank 0 has it start the pool), then its pool
    up: ``box["ready"]``. An error is kept for the main thread, which asks again and raises it."""
    try:
        import ray

        from sbloader.sources.batches import ShardSource

        coord = loader._coordinator(stream=True)
        while not stop.is_set() and ray.get(coord.prewarm.remote(ShardSource.name, (s.worker_op(),),
                                                                 s.coordinator_options(), POOL_POLL_S)):
            pass
    except Exception as exc:
        box["error"] = exc
    box["ready"] = True


def stream_start_epoch(loader: Any, s: Any, rank: int, epoch: int, epoch_seed: int) -> EpochIterator:
    """This rank's share of a split ``IterableDataset`` epoch: its own shards' first batches locally,
    then the coordinator's."""
    from sbloader.loaders.failed_batch import translate

    carry, ws = loader._carry, loader.world.world_size
    own = own_shards(s.num_workers, ws, rank)
    tally = LocalTally(ws)
    box: dict = {}
    stop = threading.Event()
    finder = threading.Thread(target=_find_pool, args=(loader, s, box, stop), daemon=True,
                              name="sbloader-coordinator-start")
    finder.start()
    stalls = StallStats()
    phase: dict = {}
    forced = local_start.forced_handover()

    def produce() -> Iterator[Delivery]:
        if own and forced != 0:
            yield from _local_phase(s, own, epoch, epoch_seed, tally, box, forced, phase)
            if phase.get("failed"):
                return
        stop.set()
        finder.join()
        loader._coordinator(stream=True)  # the background's error, if any, raised here
        from sbloader.loaders.dropin_epoch import open_stream

        batches, phase["closed"] = open_stream(s, carry, rank, epoch, epoch_seed, stalls, report=tally.report())
        yield from batches

    def closed() -> None:
        if "closed" in phase:
            phase["closed"]()
            return
        # left in the local phase: the other ranks wait for this rank's report (the background gives it)
        threading.Thread(target=_leave, args=(loader, s, rank, epoch, epoch_seed, tally, stop, finder, stalls),
                         daemon=True, name="sbloader-stream-leave").start()
        s.reporter(f"rank {rank} epoch {epoch}", stalls)()

    return EpochIterator(produce(), None, ahead=s.ahead, stalls=stalls, to_device=s.to_device,
                         translate=translate, on_close=closed,
                         started=lambda: workers_up(phase) or "closed" in phase or not own,
                         start_timeout=s.start_timeout)


def _local_phase(s: Any, own: list, epoch: int, epoch_seed: int, tally: LocalTally, box: dict, forced: Any,
                 phase: dict) -> Iterator[Delivery]:
    """The rank's own shards' batches from local workers, in torch's round-robin, as far as
    :func:`~sbloader.core.split.local_allowance` lets it deliver, until the coordinator's pool is up
    (``forced``: after exactly that many deliveries, tests) or the shards end."""
    import torch
    from sbloader.loaders.torch_loader import torch_loader

    shards = LocalShards(s.dataset, s.collate_fn, s.batch_size, s.drop_last, s.num_workers, {}, epoch, epoch_seed)
    local = torch_loader()(shards, batch_size=None, num_workers=len(own), collate_fn=local_start.identity,
                           worker_init_fn=local_start.WorkerInit(s.dataset, epoch_seed, s.worker_init_fn, s,
                                                                 shards=own),
                           multiprocessing_context=s.multiprocessing_context, prefetch_factor=s.prefetch_factor,
                           generator=torch.Generator().manual_seed(epoch_seed % 2**63), timeout=stall_s())
    phase["inits"] = local.worker_init_fn.inits
    with ForkGate().forking():
        it = iter(local)  # forks the workers
    order = RoundRobin({w: 0 for w in own})
    ready: deque = deque()
    try:
        for item in worker_items(it, phase, lambda: f"after batch {tally.delivered} on the coordinator's pool"):
            if isinstance(item, Delivery):  # torch's error: the epoch ends (its workers are shut down)
                yield item
                return
            if item[0] == END:
                order.end(item[1])
            else:
                tally.made += 1
                order.add(item[1], int(item[3]["batches"]) - 1 if item[3] else 0, item)
            for _, shard, batch, snap, n in order.pop_ready():
                if snap is None:  # worker_init_fn's error, raised at this shard's first batch
                    yield Delivery(local_start.unwrap(batch, s.pin))
                elif s.batch_size is None or n == s.batch_size:  # a short last batch is the coordinator's
                    ready.append((shard, batch, snap))
            while ready and local_allowance(tally.made, tally.delivered, tally.world_size) > 0:
                if forced is None and box.get("ready"):
                    return
                shard, batch, snap = ready.popleft()
                tally.positions[shard], tally.delivered = snap, tally.delivered + 1
                yield Delivery(local_start.unwrap(batch, s.pin))
                if forced is not None and tally.delivered >= forced:
                    return
            if forced is None and box.get("ready"):
                return
    finally:
        it._shutdown_workers()


def _leave(loader: Any, s: Any, rank: int, epoch: int, epoch_seed: int, tally: LocalTally, stop: threading.Event,
           finder: threading.Thread, stalls: StallStats) -> None:
    """(Background) The loop left the epoch in its local phase: report to the coordinator, then leave it."""
    stop.set()
    finder.join()
    try:
        from sbloader.distributed import dropin_client
        from sbloader.loaders.dropin_epoch import open_stream

        coord = loader._coordinator(stream=True)
        open_stream(s, loader._carry, rank, epoch, epoch_seed, stalls, report=tally.report())
        dropin_client.finish(coord, epoch, rank, stalls.batches)
    except Exception:  # Ray or the coordinator is gone (the process exits): nothing to tell
        pass

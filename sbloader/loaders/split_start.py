"""The local start of a split (torchrun) epoch: each rank's first ``k`` batches from local processes.

Under torchrun the job's coordinator splits a map-style epoch by a pure plan: batch ``b``
goes to rank ``b % world_size``, the same plan on every rank (:mod:`sbloader.core.split`).
So a rank needs nobody to know its own first batches. On a loader's first epoch (each
rank's loader is as new as the others') every rank makes its first ``k`` batches on
``num_workers`` local worker processes (:func:`~sbloader.loaders.local_start.torch_workers`:
torch's worker machinery, each worker set up as a pool actor is), while Ray starts or is
joined in the background and the coordinator is found or created there (rank 0 has it
start the pool). The rank then joins the coordinator's epoch, which is the same epoch
resumed after every rank's first ``k`` (:meth:`~sbloader.loaders.dropin_state.EpochRun.after`).
The ranks agree on it without a word: ``k`` comes from the loader's arguments alone.

- ``k = min(batches per rank, 8 * num_workers * batches_per_partition)``;
  ``SBLOADER_SPLIT_LOCAL_BATCHES`` sets another count (0: no local start).
- Only with ``in_order=True`` (the default): with ``in_order=False`` the coordinator hands
  a batch to whichever rank asks first, so the plan does not say which are a rank's own.
- Only where every rank draws the epoch's order alike by itself (:func:`same_everywhere`): a
  loaded state, ``shuffle=False``, a ``DistributedSampler``, or ``shuffle=True`` with the
  loader's ``seed``. An unseeded shuffle is drawn on each rank's own RNG; the coordinator uses
  rank 0's draw, so those ranks wait for it (a ``seed`` is the way to a local start there).
- Order, batch boundaries, padding and seeds are the plan's: the loop receives what a run
  without the local start receives, and ``state_dict()`` before, at and after the ``k``-th
  batch is the same arithmetic (the plan's cut after every rank's first ``j`` batches).
- A local worker that uses no CPU over a whole wait (:mod:`~sbloader.loaders.stalled_workers`:
  a lock its fork left held, a per-fork accident) is killed with the others, and the rank's
  batches not received yet are made by newly forked workers, set up alike (as the pool's actors,
  which partition a worker makes is not fixed); if those stall too, the epoch raises
  :class:`LocalWorkersStalled` rather than wait for good.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Any, Iterator, Optional

from sbloader.core.errors import SbloaderError
from sbloader.core.stats import StallStats
from sbloader.loaders import local_start, stalled_workers
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.handover import workers_up

SPLIT_LOCAL_ENV = "SBLOADER_SPLIT_LOCAL_BATCHES"  # each rank's locally made batches (0: none)
BATCHES_PER_WORKER = 8


def local_count(s: Any, per_rank: int) -> int:
    """``k``: how many of its first batches each rank makes locally (the same on every rank)."""
    value = os.environ.get(SPLIT_LOCAL_ENV)
    k = int(value) if value not in (None, "") else BATCHES_PER_WORKER * s.num_workers * s.batches_per_partition
    return max(0, min(k, per_rank))


def same_everywhere(run: Any, seeded: bool, resumed: bool) -> bool:
    """Whether every rank drew this epoch's order alike, each by itself: a loaded state's order, a
    sequential or ``DistributedSampler`` one (its ``seed``), or a shuffle under the loader's ``seed``.
    An unseeded shuffle draws on each rank's own RNG: only the coordinator (rank 0's draw) knows it."""
    kind = (run.order_state or {}).get("kind")
    return resumed or kind in ("sequential", "distributed") or (kind == "rng" and seeded)


def enabled(s: Any, first: bool, run: Any, seeded: bool, resumed: bool) -> bool:
    """Whether this split epoch starts locally: the loader's ``first`` split epoch (counted by the
    loader, never read from the background coordinator lookup, whose timing differs between ranks:
    every rank must decide alike), in order, with workers, an order every rank knows alike
    (:func:`same_everywhere`; ``seeded``: the loader's ``seed`` shuffles its own sampler;
    ``resumed``: the order is a loaded state's), and local starts allowed
    (:func:`~sbloader.loaders.local_start.enabled`)."""
    return (s.num_workers > 0 and s.in_order and first and local_start.enabled(s)
            and same_everywhere(run, seeded, resumed) and local_count(s, run.per_rank) > 0)


class LocalWorkersStalled(SbloaderError):
    """A rank's local workers used no CPU over a whole wait, twice: its first batches could not be made here."""


class _Stalled:
    """What :func:`~sbloader.loaders.local_start.deliveries` tells when a local worker stalled: the
    partitions received until then (in order: the first ``len(received)``)."""

    def __init__(self) -> None:
        self.received: Optional[set] = None

    def stalled(self, received: set) -> None:
        self.received = set(received)


class _Phases:
    """The epoch's run across its two phases (a :class:`~sbloader.loaders.epoch.Run`).

    Records are ``(0, b)``: batch ``b`` of ``first``, made locally; then ``(1, j)``: batch ``j``
    of ``rest``, from the coordinator. Once the loop took the ``k``-th local batch the
    loader's run becomes ``rest``, whose consumed ledger starts where ``first``'s ends.
    """

    def __init__(self, loader: Any, first: Any, rest: Optional[Any], k: int) -> None:
        self.loader, self.first, self.rest, self.k = loader, first, rest, k

    def took(self, record: tuple) -> None:
        phase, index = record
        if phase == 0:
            self.first.took(index)
            if len(self.first.taken) == self.k and self.rest is not None:
                self.loader._run = self.rest
        else:
            self.rest.took(index)

    def finished(self) -> None:
        (self.rest if self.rest is not None else self.first).finished()


def _find_coordinator(loader: Any, box: dict) -> None:
    """In the background: Ray up, the coordinator found or created (rank 0 has it start the pool)."""
    try:
        loader._coordinator()
    except Exception as exc:  # the main thread asks again at the handover, and raises it there
        box["error"] = exc


def split_start_epoch(loader: Any, s: Any, run: Any, rank: int) -> EpochIterator:
    """This rank's share of a split epoch: its first ``k`` batches locally, then the coordinator's."""
    from sbloader.loaders.failed_batch import translate

    carry, ws = loader._carry, loader.world.world_size
    k = local_count(s, run.per_rank)
    rest = run.after(k, ws) if k < run.per_rank else None
    mine = list(range(rank, len(run.ranks), ws))[:k]  # batch b is rank b % world_size's
    every = s.epoch_items(run, None)
    items = [_padded(every[b], run.pads[b]) if run.pads[b] and s.auto_collation else every[b] for b in mine]
    bpp = s.batches_per_partition
    box: dict = {}
    finder = threading.Thread(target=_find_coordinator, args=(loader, box), daemon=True,
                              name="sbloader-coordinator-start")
    finder.start()
    stalls = StallStats()
    phase: dict = {}

    def produce() -> Iterator[Delivery]:
        yield from _local_batches(s, run, items, mine, phase)
        if rest is None or phase.get("failed"):
            return
        finder.join()
        loader._coordinator()  # the background's error, if any, raised here
        from sbloader.loaders.dropin_epoch import open_split

        batches, phase["closed"] = open_split(s, carry, rest, rank, loader._reconnect, stalls)
        for d in batches:
            yield Delivery(d.batch, (1, d.record), d.release)

    def closed() -> None:
        if "closed" in phase:
            phase["closed"]()
        else:
            s.reporter(f"rank {rank} epoch {run.epoch}", stalls)()

    return EpochIterator(produce(), _Phases(loader, run, rest, k), ahead=s.ahead, stalls=stalls,
                         to_device=s.to_device, translate=translate, on_close=closed,
                         started=lambda: workers_up(phase), start_timeout=s.start_timeout)


def _local_batches(s: Any, run: Any, items: list, mine: list, phase: dict) -> Iterator[Delivery]:
    """The rank's first batches ``items`` (its batches ``mine`` of the plan) from local workers; after a
    stalled worker, the ones not received from newly forked workers, once."""
    bpp, start = s.batches_per_partition, 0
    for attempt in range(2):
        stall = _Stalled()
        part = items[start * bpp:]
        local = local_start.torch_workers(s, part, [run.ids[b] for b in mine[start * bpp:]], run.epoch,
                                          run.epoch_seed, range(math.ceil(len(part) / bpp)),
                                          timeout=stalled_workers.stall_s())
        first = start * bpp
        yield from local_start.deliveries(s, local, phase, lambda j, first=first: (0, mine[first + j]), stall,
                                          "on new local workers" if attempt == 0 else "nowhere: the epoch raises")
        if stall.received is None:
            return
        start += len(stall.received)  # in order: the partitions received are the first ones
    raise LocalWorkersStalled(
        f"the local workers of this rank stalled twice (no CPU for {stalled_workers.stall_s():.0f} s: a lock "
        f"their fork left held?) before its first {len(items)} batches were made; set "
        f"{SPLIT_LOCAL_ENV}=0 to make every batch on the cluster, or raise {stalled_workers.STALL_ENV}")


def _padded(item: Any, pad: int) -> Any:
    from sbloader.sources.batches import PaddedBatch

    return PaddedBatch(tuple(item), pad)

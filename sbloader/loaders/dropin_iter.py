"""Which epoch an iteration of the drop-in ``DataLoader`` runs: one decision, then one straight path.

An epoch is three stages, each owning its state: the loader's plan of it (``DataLoader._begin``:
the run, the sampler, the epoch and its seed), its producer, and the loop's iterator
(:class:`~sbloader.loaders.epoch.EpochIterator`: batches made ahead, the record of what the loop
took). The producer is one of:

- split across ranks by the job's coordinator (:func:`split_start_epoch`), a loader's first such
  epoch starting on local processes (:mod:`~sbloader.loaders.split_start`,
  :mod:`~sbloader.loaders.stream_start`);
- in this process (``num_workers=0``, or nothing left to load);
- local worker processes, then the pool once its actors are up: one producer in two phases
  (:mod:`~sbloader.loaders.local_start`, :mod:`~sbloader.loaders.iterable_start`; the switch:
  :mod:`~sbloader.loaders.handover`);
- the pool (:func:`~sbloader.loaders.dropin_epoch.pool_epoch`).

Only the path taken imports what it needs: the local ones never import Ray.
"""
from __future__ import annotations

from typing import Any

from sbloader.loaders import local_start, split_start, stream_start
from sbloader.loaders.dropin_settings import DropinCarry, DropinSettings
from sbloader.loaders.epoch import EpochIterator


def split_start_epoch(loader: Any, s: DropinSettings) -> EpochIterator:
    """The next epoch of ``loader`` (a :class:`~sbloader.loaders.dataloader.DataLoader` split across ranks by
    the job's coordinator), with the arguments ``s`` it has now."""
    w, carry = loader.world, loader._carry
    if loader._iterable:
        epoch, epoch_seed = loader._next_epoch()
        loader._split_epochs += 1
        if stream_start.enabled(s, loader._split_epochs == 1):
            return stream_start.stream_start_epoch(loader, s, w.rank, epoch, epoch_seed)
        from sbloader.loaders.dropin_epoch import stream_epoch

        loader._coordinator(stream=True)
        return stream_epoch(s, carry, w.rank, epoch, epoch_seed)
    state = loader._resume or {}
    resumed = state.get("epoch_seed") is not None or bool(state.get("empty_remainder"))  # its order
    loader._run = run = loader._start_run(w.world_size)
    loader._split_epochs += 1
    if split_start.enabled(s, loader._split_epochs == 1, run, loader._seeded_sampler, resumed):
        it = split_start.split_start_epoch(loader, s, run, w.rank)
        if s.worker_init_fn is not None:  # its error is raised by iter(), as torchdata's
            it.prime()
        return it
    from sbloader.loaders.dropin_epoch import split_epoch

    loader._coordinator()
    return split_epoch(s, carry, run, w.rank, loader._reconnect)


def start_epoch(s: DropinSettings, carry: DropinCarry, run: Any, sampler: Any, epoch: int,
                epoch_seed: int) -> EpochIterator:
    """An epoch of a loader that is not split (its :meth:`~sbloader.loaders.dataloader.DataLoader._begin`:
    ``run``, ``sampler``, ``epoch``, ``epoch_seed``): in this process, on local workers handed over to the
    pool, or on the pool."""
    if s.num_workers == 0 or (run is not None and not s.iterable and not run.batches):
        from sbloader.loaders.dropin_epoch import local_epoch

        return local_epoch(s, run, epoch, epoch_seed, sampler)
    if not local_start.wanted(s, carry):
        from sbloader.loaders.dropin_epoch import pool_epoch

        it = pool_epoch(s, carry, run, epoch, epoch_seed, sampler)
    elif s.iterable:
        from sbloader.loaders.iterable_start import iterable_start_epoch

        it = iterable_start_epoch(s, carry, run, epoch, epoch_seed)
    else:
        it = local_start.local_start_epoch(s, carry, run, epoch, epoch_seed, sampler)
    if s.worker_init_fn is not None:  # its error is raised by iter(), as torchdata's
        it.prime()
    return it

"""Which epoch an iteration of the drop-in ``DataLoader`` runs: one decision, then one straight path.

- split across ranks by the job's coordinator (:func:`~sbloader.loaders.dropin_epoch.split_epoch`,
  or :func:`~sbloader.loaders.dropin_epoch.stream_epoch` for an ``IterableDataset``), a loader's
  first such epoch starting on local processes (:mod:`~sbloader.loaders.split_start`,
  :mod:`~sbloader.loaders.stream_start`);
- in this process (``num_workers=0``, or nothing left to load);
- on local worker processes, handed over to the pool once its actors are up
  (:mod:`~sbloader.loaders.local_start`: the pool is not up yet);
- on the pool (:func:`~sbloader.loaders.dropin_epoch.pool_epoch`).

Only the path taken imports what it needs: the local ones never import Ray.
"""
from __future__ import annotations

from typing import Any

from sbloader.loaders import dropin_checkpoint, dropin_state, local_start, split_start, stream_start
from sbloader.loaders.dropin_settings import DropinSettings
from sbloader.loaders.epoch import EpochIterator


def start_epoch(loader: Any, s: DropinSettings) -> EpochIterator:
    """The next epoch of ``loader`` (a :class:`~sbloader.loaders.dataloader.DataLoader`), with the
    arguments ``s`` it has now."""
    w, carry = loader.world, loader._carry
    if loader.split and loader._iterable:
        epoch, epoch_seed = loader._next_epoch()
        loader._split_epochs += 1
        if stream_start.enabled(s, loader._split_epochs == 1):
            return stream_start.stream_start_epoch(loader, s, w.rank, epoch, epoch_seed)
        from sbloader.loaders.dropin_epoch import stream_epoch

        loader._coordinator(stream=True)
        return stream_epoch(s, carry, w.rank, epoch, epoch_seed)
    if loader.split:
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
    sampler, loader._unreplayable = loader._index_sampler, None
    if loader._iterable:
        run = dropin_checkpoint.start_iterable_run(loader)
    else:
        try:
            run = loader._start_run(1) if loader._stateful else None
        except dropin_state.KeysNotIndices as keys:  # batch_size=None, a sampler of lists (say): run them as drawn
            run, sampler, loader._unreplayable = None, keys.keys, str(keys)
    loader._run = run
    epoch, epoch_seed = (run.epoch, run.epoch_seed) if run is not None else loader._next_epoch()
    if s.num_workers == 0 or (run is not None and not s.iterable and not run.batches):
        from sbloader.loaders.dropin_epoch import local_epoch

        return local_epoch(s, run, epoch, epoch_seed, sampler)
    if local_start.enabled(s) and not local_start.pool_is_up(s, carry):
        if s.iterable:
            from sbloader.loaders.iterable_start import iterable_start_epoch

            it = iterable_start_epoch(s, carry, run, epoch, epoch_seed)
        else:
            it = local_start.local_start_epoch(s, carry, run, epoch, epoch_seed, sampler)
    else:
        from sbloader.loaders.dropin_epoch import pool_epoch

        it = pool_epoch(s, carry, run, epoch, epoch_seed, sampler)
    if s.worker_init_fn is not None:  # its error is raised by iter(), as torchdata's
        it.prime()
    return it

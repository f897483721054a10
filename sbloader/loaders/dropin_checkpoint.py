"""The drop-in DataLoader's ``state_dict()`` / ``load_state_dict()``: what each dataset kind saves.

torchdata's ``StatefulDataLoader`` contract, kept by :class:`~sbloader.loaders.dataloader.DataLoader`:

- map-style, batched by the loader: the consumed positions of the epoch's order
  (:mod:`~sbloader.loaders.dropin_state`: exactly once, any world size);
- an ``IterableDataset``: each worker shard's snapshot (:mod:`~sbloader.loaders.iterable_resume`);
- a dataset or sampler that implements ``state_dict``/``load_state_dict`` (torchdata's
  ``Stateful``): its state, saved with the loader's and restored by ``load_state_dict``
  (the sampler's as it was once the epoch's order was drawn, the dataset's as the
  trainer holds it: every epoch's workers get a copy of it);
- a state taken after the last batch of an epoch, inside the loop, resumes an empty
  remainder of that epoch, then the next epoch; one taken after the loop ended
  resumes the next epoch;
- checkpoints cross over (:mod:`~sbloader.loaders.torchdata_state`): a state carries
  StatefulDataLoader's layout beside sbloader's ledger, and a state written by
  torchdata's ``StatefulDataLoader`` loads here.
"""
from __future__ import annotations

from typing import Any, Optional

from sbloader.core import ledger
from sbloader.core.errors import StateDictError
from sbloader.loaders import dropin_state, torchdata_state
from sbloader.loaders.iterable_resume import first_snapshot, is_stateful, open_shard

_TORCH_SAMPLERS = ("RandomSampler", "SequentialSampler", "DistributedSampler", "SubsetRandomSampler")


def _user_stateful(obj: Any) -> bool:
    return is_stateful(obj) and type(obj).__name__ not in _TORCH_SAMPLERS


def fingerprint(dl: Any) -> dict:
    """What a state must match to be loaded into ``dl``."""
    if dl._iterable:
        return {"dataset": type(dl.dataset).__name__, "dataset_id": dl.dataset_id, "batch_size": dl.batch_size,
                "drop_last": dl.drop_last}
    return dropin_state.fingerprint(dl.dataset, dl.dataset_id, dl.batch_size, dl.drop_last, dl.sampler)


def loader_state(dl: Any) -> dict:
    """``dl.state_dict()``: sbloader's state with StatefulDataLoader's layout beside it."""
    if not dl._stateful:
        raise StateDictError(
            "state_dict() needs an IterableDataset or a map-style dataset batched by the loader itself "
            "(batch_size=... or None); a custom batch_sampler cannot be replayed"
        )
    if dl._unreplayable:
        raise StateDictError(f"state_dict() cannot checkpoint this epoch: {dl._unreplayable}; give the "
                             "loader a sampler of integer indices to checkpoint it")
    if dl._resume is not None and dl._run is None:
        return _with_view(dl, dict(dl._resume))  # loaded (or drawn), not iterated yet: the same state again
    if dl._run is None and not dl._iterable and not dl.split and type(dl.sampler).__name__ in _DRAWN_AHEAD \
            and len(dl.dataset):
        return _with_view(dl, _draw_next_epoch(dl))
    return _with_view(dl, _own_state(dl))


def _own_state(dl: Any) -> dict:
    """sbloader's own state of ``dl`` (no view), from its current run."""
    header = dropin_state.FORMAT.header(fingerprint(dl))
    if dl._iterable:
        run = dl._run
        body = run.state() if run is not None else {"epoch": dl._epoch, "epoch_seed": None, "shards": {}}
        return {**header, "epoch": body["epoch"], "consumed": [], "iterable": body,
                "generator": dropin_state.encode_generator(dl.generator),
                "base_seed": dl._base_seed}  # persistent workers' (later epochs' seeds)
    run = dl._run
    consumed: ledger.Ranges = []
    if run is not None and not run.complete:  # every rank's first k batches, k this rank's count
        consumed = run.consumed(dl.world.world_size if dl.split else 1, dl.in_order, lambda: dl._coordinator())
    gen = dropin_state.user_generator(dl.sampler, dl._seeded_sampler)
    header.update(base_seed=dl._base_seed, world_size=dl.world.world_size,
                  # the user's generator after the epoch's draws: a resumed job continues its sequence
                  generator=dropin_state.encode_generator(gen))
    if _own_generator(dl, gen) is not None:  # the loader's, which draws the epoch seeds: the same
        header["loader_generator"] = dropin_state.encode_generator(dl.generator)
    if run is not None and not run.complete and ledger.count(consumed) >= len(run.order) - _tail(dl, run):
        # after the epoch's last batch, inside the loop: an empty remainder, then the next epoch
        state = {**header, "epoch": int(run.epoch), "epoch_seed": None, "order": None, "consumed": [],
                 "empty_remainder": True}
    else:
        state = dropin_state.make_state(header, dl._epoch, run, consumed, type(dl.sampler).__name__)
    if _user_stateful(dl.dataset):
        state["dataset_state"] = dl.dataset.state_dict()
    if _user_stateful(dl.sampler):
        state["sampler_state"] = run.sampler_state if run is not None else dl.sampler.state_dict()
    return state


# torch's samplers whose order a state recomputes (a user's sampler is not iterated ahead of its loader)
_DRAWN_AHEAD = ("RandomSampler", "SequentialSampler")


def _draw_next_epoch(dl: Any) -> dict:
    """The state of the next epoch, its seed and order drawn now: a map-style loader's state taken
    before it iterated, as ``StatefulDataLoader.state_dict()`` creates its iterator (so draws the
    order) then. The next iteration plays that epoch, and a loader that loads the state plays it too.
    Only for torch's Random and SequentialSampler (:data:`_DRAWN_AHEAD`)."""
    epoch = dl._epoch
    dl._run = dl._start_run(1)  # the draws an iteration makes now, in its order (epoch seed, then order)
    try:
        dl._resume = _own_state(dl)
    finally:
        dl._run = None
        dl._epoch = epoch
    dl._resume_drawn = True  # not loaded: set_epoch drops it quietly
    return dict(dl._resume)


def _with_view(dl: Any, state: dict) -> dict:
    """``state`` with StatefulDataLoader's layout beside sbloader's keys (which win)."""
    return {**torchdata_state.torchdata_view(state, dl.num_workers, _opened_shards(dl, state)), **state}


def _opened_shards(dl: Any, state: dict) -> Optional[dict]:
    """For the view: per worker shard of a ``Stateful`` ``IterableDataset`` that has no snapshot in
    ``state`` (its worker sent none of its batches to the loop yet), the dataset's and iterator's
    states right after ``iter()`` in that worker, as StatefulDataLoader shows them before a
    worker's first batch. Computed here on a fresh copy of the dataset under that worker's
    ``get_worker_info()`` (the user's ``__iter__`` runs once more, in this process; the RNGs are
    left as they were; one that raises shows none). Only the view reads them: sbloader resumes
    such a shard from its start."""
    body = state.get("iterable")
    if not dl._iterable or dl.num_workers == 0 or not isinstance(body, dict) or not is_stateful(dl.dataset):
        return None
    missing = [w for w in range(dl.num_workers) if str(w) not in (body.get("shards") or {})]
    if not missing:
        return None
    import copy

    from torch.utils.data._utils import worker as torch_worker

    from sbloader.loaders.worker import _rng_states, _set_rng_states, _set_torch_worker_info

    rngs, info = _rng_states(), torch_worker._worker_info
    opened = {}
    try:
        for w in missing:
            dataset = copy.deepcopy(dl.dataset)
            _set_torch_worker_info(w, dl.num_workers, 0, dataset)
            try:
                snap = first_snapshot(dataset, *open_shard(dataset, None))
            except Exception:  # the worker raises it with its first batch; the view shows no state
                continue
            opened[w] = {"dataset_state": snap["dataset_state"], "iter_state": snap["iter_state"]}
    finally:
        torch_worker._worker_info = info
        _set_rng_states(rngs)
    return opened


def _own_generator(dl: Any, sampler_generator: Any) -> Any:
    """The loader's ``generator`` where it is not the sampler's (it draws the epoch seeds, so a
    resumed epoch's batches run under the seeds of the uninterrupted run's); None otherwise."""
    return dl.generator if dl.generator is not None and dl.generator is not sampler_generator else None


def _tail(dl: Any, run: Any) -> int:
    """Positions an epoch never delivers (``drop_last``'s short batch), on one rank."""
    if dl.split or not dl.drop_last or not dl.batch_size:
        return 0
    return len(run.order) % dl.batch_size


def load_loader_state(dl: Any, state_dict: dict, strict: bool) -> None:
    """``dl.load_state_dict(state_dict, strict)``."""
    if not dl._stateful:
        raise StateDictError("load_state_dict() needs an IterableDataset or a map-style dataset batched by the "
                             "loader itself")
    if torchdata_state.is_torchdata_state(state_dict):
        state_dict = from_torchdata(dl, state_dict)
    state = dropin_state.FORMAT.check(state_dict, fingerprint(dl), strict)
    if dl._iterable:
        if not isinstance(state.get("iterable"), dict):
            raise StateDictError(f"the state is not of an IterableDataset's loader: found keys {sorted(state)}, "
                                 "expected 'iterable'")
        dropin_state.restore_generator(dl.generator, state.get("generator"))
        if state.get("base_seed") is not None:
            dl._base_seed = int(state["base_seed"])
    else:
        gen = dropin_state.user_generator(dl.sampler, dl._seeded_sampler)
        dropin_state.restore_generator(gen, state.get("generator"))
        dropin_state.restore_generator(_own_generator(dl, gen), state.get("loader_generator"))
        if state.get("base_seed") is not None:
            dl._base_seed = int(state["base_seed"])
        if state.get("dataset_state") is not None and _user_stateful(dl.dataset):
            dl.dataset.load_state_dict(state["dataset_state"])
        if state.get("sampler_state") is not None and _user_stateful(dl.sampler):
            dl.sampler.load_state_dict(state["sampler_state"])
    dl._resume = dict(state)
    dl._resume_drawn = False
    dl._run = None
    dl._epoch = int(state["epoch"])


def from_torchdata(dl: Any, td: dict) -> dict:
    """The sbloader state that resumes ``td``, a state of torchdata's ``StatefulDataLoader``
    over the same dataset and ``num_workers`` (:mod:`~sbloader.loaders.torchdata_state`)."""
    shape = torchdata_state.LoaderShape(dl.num_workers, dl.batch_size, None if dl._iterable else len(dl.dataset),
                                        dl.drop_last, type(dl.sampler).__name__)
    header = dropin_state.FORMAT.header(fingerprint(dl))
    if dl._iterable:
        body = torchdata_state.iterable_body(td, shape, dl._epoch)
        return {**header, "epoch": body["epoch"], "consumed": [], "iterable": body, "generator": None}
    epoch = dl._epoch
    _, seed = dl._next_epoch()
    dl._epoch = epoch
    body = torchdata_state.map_body(td, shape, epoch, seed)
    gen = dropin_state.user_generator(dl.sampler, dl._seeded_sampler)
    order = torchdata_state.sampler_order(torchdata_state.progress(td).main, shape.sampler) \
        if gen is not None else None
    return {**header, **body, "base_seed": dl._base_seed, "world_size": dl.world.world_size,
            "generator": _generator_after(order, len(dl.dataset)) if order else None}


def _generator_after(order: dict, n: int) -> str:
    """The text of a generator that drew the epoch ``order`` describes (a RandomSampler's), as
    an uninterrupted epoch of this loader leaves the user's generator."""
    import torch
    from torch.utils.data import RandomSampler

    gen = torch.Generator()
    dropin_state.restore_generator(gen, order["state"])
    for _ in RandomSampler(range(n), generator=gen):
        pass
    return dropin_state.encode_generator(gen)

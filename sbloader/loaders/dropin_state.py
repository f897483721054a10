"""The drop-in DataLoader's epoch as sampler positions, and its checkpoint state.

An epoch is the sampler's order (dataset index per *position*). Batches are cut
from the positions that remain to be consumed (all of them in a fresh epoch), so
a resumed epoch, with the same or another world size, delivers exactly the
positions its checkpoint did not record as consumed. The order itself is not
stored: the state says how to recompute it (the sampler's RNG state, or the
``DistributedSampler``'s seed and epoch). Format ``sbloader.DataLoader``, version 1.
"""
from __future__ import annotations

import base64
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from sbloader.core import ledger
from sbloader.core.errors import StateDictError
from sbloader.core.split import batch_positions, split_epoch
from sbloader.core.state import StateFormat

FORMAT = StateFormat("sbloader.DataLoader", 1, ("consumed",))
_EXPLICIT_ORDER_LIMIT = 4096


@dataclass
class EpochRun:
    """One (possibly resumed) epoch of a drop-in loader on this rank.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        order: dataset index of every position of the epoch's order.
        order_state: JSON description that recomputes ``order``.
        prior: positions consumed before this run (a resumed epoch).
        batches: dataset indices of each batch (padding included).
        pads: padded rows at the end of each batch.
        ranks: the rank each batch is assigned to (deterministic mode).
        batch_ranges: positions of each batch's real rows.
        per_rank: batches each rank receives.
        taken: batch ids handed to this process's training loop, in order.
        complete: the epoch ran to its end.
        ids: a stable id per batch: the position of its first real row (seeds the
            batch's augmentations, so the same batch replays identically).
        cutter: the incremental cut of this run's plan (see :meth:`local_cut`).
        sampler_state: a ``Stateful`` sampler's ``state_dict()`` once the epoch's order was drawn.
    """

    epoch: int
    epoch_seed: int
    order: np.ndarray
    order_state: Optional[dict]
    prior: ledger.Ranges
    batches: list
    pads: list
    ranks: list
    batch_ranges: list
    per_rank: int
    taken: list = field(default_factory=list)
    complete: bool = False
    ids: list = field(default_factory=list)
    cutter: Optional[ledger.IncrementalCut] = field(default=None, repr=False)
    sampler_state: Any = None  # a Stateful sampler's state once the epoch's order was drawn
    _logs: list = field(default_factory=list, repr=False)  # per rank, its batch ids in plan order

    def took(self, index: int) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the loop took the batch ``index`` of the epoch."""
        self.taken.append(index)

    def finished(self) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the epoch ran to its end."""
        self.complete = True

    def consumed(self, world_size: int, in_order: bool, coordinator: Callable[[], Any]) -> ledger.Ranges:
        """The positions consumed once every rank took as many batches as this one: this rank's
        own batches alone (one rank), the plan's cut (in order), or the coordinator's delivery
        logs' (``in_order=False``: batches go to whichever rank asks first)."""
        if world_size == 1:
            return ledger.merge(list(self.prior) + [r for b in self.taken for r in self.batch_ranges[b]])
        from sbloader.distributed.naming import ledger_enabled

        if in_order and ledger_enabled():
            return self.local_cut(len(self.taken), world_size)
        from sbloader.distributed.dropin_client import coordinator_cut

        return coordinator_cut(coordinator(), self.epoch, len(self.taken), len(self.order))

    def local_cut(self, k: int, world_size: int) -> ledger.Ranges:
        """The consumed ledger after every rank's first ``k`` batches, from the plan alone.

        With ``in_order=True`` (the default) the plan fixes which batches each rank
        receives and in what order (``ranks``), the same plan on every rank, so every
        rank's first ``k`` batches are known here without asking the coordinator.
        Incremental (:class:`~sbloader.core.ledger.IncrementalCut`); equal to
        :func:`sbloader.core.ledger.cut` over the coordinator's delivery logs.
        """
        if self.cutter is None:
            self.cutter = ledger.IncrementalCut(self.batch_ranges, self.prior)
            self._logs = [[b for b, r in enumerate(self.ranks) if r == rank] for rank in range(world_size)]
        return self.cutter.after(k, self._logs)

    def after(self, k: int, world_size: int) -> "EpochRun":
        """The rest of this (untaken) run once every rank took its first ``k`` batches: the same
        epoch resumed there. The plan gives batch ``b`` to rank ``b % world_size``, so those are
        the first ``k * world_size`` batches; the rest keeps its batches, ranks, pads and ids."""
        n = k * world_size
        prior = ledger.merge(list(self.prior) + [r for b in range(n) for r in self.batch_ranges[b]])
        return EpochRun(self.epoch, self.epoch_seed, self.order, self.order_state, prior, self.batches[n:],
                        self.pads[n:], self.ranks[n:], self.batch_ranges[n:], self.per_rank - k,
                        ids=self.ids[n:], sampler_state=self.sampler_state)


def _rng_of(sampler: Any) -> Any:
    return getattr(sampler, "generator", None)


def distributed_order(sampler: Any, n: int) -> np.ndarray:
    """A ``DistributedSampler``'s whole order before its split across ranks, as torch draws it."""
    import torch

    if sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + sampler.epoch)
        order = torch.randperm(n, generator=g).numpy()
    else:
        order = np.arange(n)
    if sampler.drop_last:  # the cross-rank tail, as torch drops it
        order = order[: (n // sampler.num_replicas) * sampler.num_replicas]
    return order.astype(np.int64)


def order_length(sampler: Any, dataset_len: int) -> int:
    """Positions of the epoch's whole order (a ``DistributedSampler``'s before its split: only
    for a loader the coordinator splits)."""
    from torch.utils.data import DistributedSampler

    if isinstance(sampler, DistributedSampler):
        return (dataset_len // sampler.num_replicas) * sampler.num_replicas if sampler.drop_last else dataset_len
    return len(sampler)


def capture_order(sampler: Any, dataset_len: int, whole: bool) -> tuple[np.ndarray, Optional[dict]]:
    """Iterate the sampler once (indices only), recording how to do it again.

    Args:
        sampler: the loader's sampler.
        dataset_len: the dataset's length.
        whole: a ``DistributedSampler`` gives its whole order (the coordinator splits
            it), not this rank's share.
    """
    import torch
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    if isinstance(sampler, DistributedSampler):
        state = {"kind": "distributed", "seed": int(sampler.seed), "epoch": int(sampler.epoch)}
        if whole:
            return distributed_order(sampler, dataset_len), state
        # not split by the loader: this sampler's own shard, exactly as torch iterates it
        state.update(kind="distributed_shard", num_replicas=int(sampler.num_replicas), rank=int(sampler.rank))
        return np.fromiter((int(i) for i in sampler), dtype=np.int64), state
    if type(sampler) is SequentialSampler:
        return np.arange(len(sampler), dtype=np.int64), {"kind": "sequential"}
    if type(sampler) is RandomSampler:
        gen = _rng_of(sampler)
        raw = gen.get_state() if gen is not None else torch.get_rng_state()
        state = {"kind": "rng", "generator": gen is not None,
                 "state": base64.b64encode(raw.numpy().tobytes()).decode("ascii")}
        return np.fromiter((int(i) for i in sampler), dtype=np.int64), state
    keys = list(sampler)
    try:
        order = np.fromiter((operator.index(k) for k in keys), dtype=np.int64, count=len(keys))
    except TypeError:
        raise KeysNotIndices(keys) from None
    if len(order) <= _EXPLICIT_ORDER_LIMIT:
        return order, {"kind": "explicit", "order": order.tolist()}
    return order, None


class KeysNotIndices(TypeError):
    """The sampler yielded keys that are not integer indices (torch allows any key with
    ``batch_size=None``: a bulk-loading sampler yields lists): the epoch runs on ``keys`` as they
    were drawn, but has no order a checkpoint could replay."""

    def __init__(self, keys: list) -> None:
        super().__init__("the sampler yields keys that are not integer indices (e.g. "
                         f"{type(next((k for k in keys if not hasattr(k, '__index__')), None)).__name__}); "
                         "state_dict() can replay only a sampler of indices")
        self.keys = keys


def recompute_order(sampler: Any, dataset_len: int, state: dict) -> np.ndarray:
    """The order described by ``state`` (the global RNG state left as it was)."""
    import torch

    kind = state.get("kind")
    if kind == "sequential":
        return np.arange(len(sampler), dtype=np.int64)
    if kind == "explicit":
        return np.asarray(state["order"], dtype=np.int64)
    if kind in ("distributed", "distributed_shard"):
        saved_epoch = sampler.epoch
        sampler.set_epoch(state["epoch"])
        try:
            if kind == "distributed":
                return distributed_order(sampler, dataset_len)
            if (sampler.num_replicas, sampler.rank) != (state["num_replicas"], state["rank"]):
                raise StateDictError(
                    f"the state is of a DistributedSampler shard num_replicas={state['num_replicas']}, "
                    f"rank={state['rank']}, found num_replicas={sampler.num_replicas}, rank={sampler.rank}; "
                    "load it into a loader whose sampler has the same shard")
            return np.fromiter((int(i) for i in sampler), dtype=np.int64)
        finally:
            sampler.set_epoch(saved_epoch)
    if kind == "rng":
        raw = torch.frombuffer(bytearray(base64.b64decode(state["state"])), dtype=torch.uint8)
        if state["generator"]:
            # a private generator in the saved state: the sampler's own is left untouched
            original = sampler.generator
            sampler.generator = torch.Generator()
            sampler.generator.set_state(raw)
            try:
                return np.fromiter((int(i) for i in sampler), dtype=np.int64)
            finally:
                sampler.generator = original
        current = torch.get_rng_state()
        torch.set_rng_state(raw)
        try:
            return np.fromiter((int(i) for i in sampler), dtype=np.int64)
        finally:
            torch.set_rng_state(current)
    raise StateDictError(f"unknown sampler-order kind {kind!r} in the state (found {state}); expected one of "
                         "'sequential', 'explicit', 'distributed', 'distributed_shard', 'rng'")


def plan_run(epoch: int, epoch_seed: int, order: np.ndarray, order_state: Optional[dict], prior: ledger.Ranges,
             batch_size: int, world_size: int, drop_last: bool) -> EpochRun:
    """Cut the positions not yet consumed into equal per-rank batches."""
    remaining = ledger.to_positions(ledger.complement(prior, len(order)))
    plan = split_epoch(len(remaining), batch_size, world_size, drop_last)
    batches, pads, ranks, branges = [], [], [], []
    for spec in plan.batches:
        local = batch_positions(spec, len(remaining))
        pos = remaining[local] if len(remaining) else np.empty(0, np.int64)
        batches.append([int(i) for i in order[pos]])
        pads.append(spec.pad)
        ranks.append(spec.rank)
        branges.append(ledger.from_positions(remaining[spec.start:spec.stop]))
    # first real position of each batch; a padding-only batch gets an id past the order
    ids = [int(remaining[spec.start]) if spec.stop > spec.start else len(order) + spec.index
           for spec in plan.batches]
    return EpochRun(epoch, epoch_seed, order, order_state, list(prior), batches, pads, ranks, branges,
                    plan.per_rank, ids=ids)


def start_run(sampler: Any, dataset_len: int, resume: Optional[dict], next_epoch: Callable[[], tuple[int, int]],
              batch_size: int, world_size: int, drop_last: bool, whole: bool = True) -> EpochRun:
    """The run of the next epoch: the one a loaded state (``resume``) left unfinished, or a fresh
    one (``next_epoch()`` gives its number and seed; a ``DistributedSampler``'s epoch is the
    user's ``sampler.set_epoch``, as under torch). ``whole``: the coordinator splits a
    ``DistributedSampler``'s whole order (else its own shard is the epoch)."""
    from torch.utils.data import DistributedSampler

    from sbloader.core.plan import epoch_seed_from

    if resume is not None and resume.get("empty_remainder"):  # taken after the epoch's last batch
        empty = np.empty(0, dtype=np.int64)
        run = plan_run(int(resume["epoch"]), 0, empty, {"kind": "explicit", "order": []}, [], batch_size,
                       world_size, drop_last)
        run.sampler_state = resume.get("sampler_state")
        return run
    if resume is not None and resume.get("epoch_seed") is not None:
        if not resume.get("order"):
            raise StateDictError("the state has no sampler order to resume from; it cannot be replayed")
        order = recompute_order(sampler, dataset_len, resume["order"])
        prior = [tuple(r) for r in resume["consumed"]]
        run = plan_run(resume["epoch"], resume["epoch_seed"], order, resume["order"], prior, batch_size,
                       world_size, drop_last)
        run.sampler_state = resume.get("sampler_state")
        return run
    if isinstance(sampler, DistributedSampler):
        epoch = int(sampler.epoch)
        epoch_seed = epoch_seed_from(sampler.seed, epoch)
    else:
        epoch, epoch_seed = next_epoch()
    order, order_state = capture_order(sampler, dataset_len, whole=whole)
    run = plan_run(epoch, epoch_seed, order, order_state, [], batch_size, world_size, drop_last)
    if callable(getattr(sampler, "state_dict", None)):  # a Stateful sampler: as the epoch's draw left it
        run.sampler_state = sampler.state_dict()
    return run


def fingerprint(dataset: Any, dataset_id: Optional[str], batch_size: Optional[int], drop_last: bool,
                sampler: Any) -> dict:
    """What a state must match to be loaded into a loader."""
    return {"dataset": type(dataset).__name__, "len": len(dataset), "dataset_id": dataset_id,
            "batch_size": batch_size, "drop_last": drop_last, "sampler": type(sampler).__name__}


def user_generator(sampler: Any, seeded: bool) -> Any:
    """The generator the user gave a loader's own RandomSampler (None if none, or ``seeded``: ``seed=``)."""
    from torch.utils.data import RandomSampler

    if type(sampler) is RandomSampler and not seeded:
        return getattr(sampler, "generator", None)
    return None


def encode_generator(gen: Any) -> Optional[str]:
    """A torch generator's state as text (None for no generator)."""
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii") if gen is not None else None


def restore_generator(gen: Any, saved: Optional[str]) -> None:
    """Put a generator where a state's run left it, so later epochs draw as uninterrupted."""
    if gen is None or not saved:
        return
    import torch

    try:
        gen.set_state(torch.frombuffer(bytearray(base64.b64decode(saved)), dtype=torch.uint8))
    except (ValueError, RuntimeError) as e:
        raise StateDictError(f"the state's generator state cannot be restored into this loader's generator: {e}") \
            from None


def make_state(header: dict, epoch: int, run: Optional[EpochRun], consumed: ledger.Ranges,
               sampler_name: str) -> dict:
    """The JSON-serialisable state: of ``run`` with ``consumed`` positions, or of a fresh ``epoch``.

    Args:
        header: :meth:`StateFormat.header` plus the loader's cross-epoch fields
            (``base_seed``, ``world_size``, ``generator``).
        epoch: the next epoch when ``run`` is None.
        run: the current epoch's run (None: none started).
        consumed: the positions consumed (every rank's first k batches).
        sampler_name: the sampler's type, for the error of an order that cannot be recomputed.
    """
    fresh = {"epoch_seed": None, "order": None, "consumed": []}
    if run is None:
        return {**header, "epoch": int(epoch), **fresh}
    if run.complete or ledger.count(consumed) >= len(run.order):
        return {**header, "epoch": int(run.epoch) + 1, **fresh}  # the epoch is done: start the next cleanly
    if run.order_state is None:
        raise StateDictError(
            f"cannot checkpoint a {sampler_name} of {len(run.order)} positions: its order cannot be recomputed on "
            "resume. Use RandomSampler, SequentialSampler or DistributedSampler, or a sampler of at most "
            f"{_EXPLICIT_ORDER_LIMIT} positions"
        )
    return {**header, "epoch": int(run.epoch), "epoch_seed": int(run.epoch_seed), "order": run.order_state,
            "consumed": [list(r) for r in consumed]}

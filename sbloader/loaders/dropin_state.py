"""The drop-in DataLoader's epoch as positions, and its checkpoint state.

An epoch is the sampler's order (dataset index per *position*). Batches are cut
from the positions that remain to be consumed (all of them in a fresh epoch), so
a resumed epoch — with the same or another world size — delivers exactly the
positions its checkpoint did not record as consumed. The order itself is not
stored: the state says how to recompute it (the sampler's RNG state, or the
``DistributedSampler``'s seed and epoch).
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from sbloader.core import ledger
from sbloader.core.errors import StateDictError
from sbloader.core.split import split_epoch

if TYPE_CHECKING:
    from sbloader.loaders.dataloader import DataLoader

STATE_FORMAT = "sbloader.DataLoader"
STATE_VERSION = 1
_EXPLICIT_ORDER_LIMIT = 4096


@dataclass
class EpochRun:
    """One (possibly resumed) epoch of a loader on this rank.

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
        ids: a stable id per batch: the position of its first real row (seeds
            the batch's augmentations, so the same batch replays identically).
        cut_at: ``(k, ranges)`` of this rank's last local cut (see
            :func:`sbloader.distributed.dropin_client.local_cut`).
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
    cut_at: Optional[tuple] = None


def _rng_of(sampler: Any) -> Any:
    return getattr(sampler, "generator", None)


def _capture_and_iterate(loader: "DataLoader") -> tuple[np.ndarray, Optional[dict]]:
    """Iterate the sampler once (indices only), recording how to do it again."""
    import torch
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        from sbloader.distributed.dropin_client import epoch_order

        state = {"kind": "distributed", "seed": int(sampler.seed), "epoch": int(sampler.epoch)}
        return epoch_order(loader, 0, 0), state
    if type(sampler) is SequentialSampler:
        return np.arange(len(sampler), dtype=np.int64), {"kind": "sequential"}
    if type(sampler) is RandomSampler:
        gen = _rng_of(sampler)
        raw = gen.get_state() if gen is not None else torch.get_rng_state()
        state = {"kind": "rng", "generator": gen is not None,
                 "state": base64.b64encode(raw.numpy().tobytes()).decode("ascii")}
        return np.fromiter((int(i) for i in sampler), dtype=np.int64), state
    order = np.fromiter((int(i) for i in sampler), dtype=np.int64)
    if len(order) <= _EXPLICIT_ORDER_LIMIT:
        return order, {"kind": "explicit", "order": order.tolist()}
    return order, None


def recompute_order(loader: "DataLoader", state: dict) -> np.ndarray:
    """The order described by ``state`` (global RNG state left as it was)."""
    import torch

    kind = state.get("kind")
    if kind == "sequential":
        return np.arange(len(loader.sampler), dtype=np.int64)
    if kind == "explicit":
        return np.asarray(state["order"], dtype=np.int64)
    if kind == "distributed":
        from sbloader.distributed.dropin_client import epoch_order

        sampler = loader.sampler
        saved_epoch = sampler.epoch
        sampler.set_epoch(state["epoch"])
        try:
            return epoch_order(loader, 0, 0)
        finally:
            sampler.set_epoch(saved_epoch)
    if kind == "rng":
        raw = torch.frombuffer(bytearray(base64.b64decode(state["state"])), dtype=torch.uint8)
        if state["generator"]:
            # a private generator in the saved state: the sampler's own is left untouched
            sampler = loader.sampler
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
            return np.fromiter((int(i) for i in loader.sampler), dtype=np.int64)
        finally:
            torch.set_rng_state(current)
    raise StateDictError(f"unknown sampler-order kind {kind!r} in the state (found {state}); expected one of "
                         "'sequential', 'explicit', 'distributed', 'rng'")


def plan_run(loader: "DataLoader", epoch: int, epoch_seed: int, order: np.ndarray,
             order_state: Optional[dict], prior: ledger.Ranges, world_size: int) -> EpochRun:
    """Cut the positions not yet consumed into equal per-rank batches."""
    remaining = ledger.to_positions(ledger.complement(prior, len(order)))
    plan = split_epoch(len(remaining), loader.batch_size or 1, world_size, loader.drop_last)
    batches, pads, ranks, branges = [], [], [], []
    from sbloader.core.split import batch_positions

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


def start_run(loader: "DataLoader", world_size: int) -> EpochRun:
    """Begin the next epoch: fresh, or the one a loaded state left unfinished."""
    resume = loader._resume
    loader._resume = None
    if resume is not None and resume.get("epoch_seed") is not None:
        epoch, epoch_seed = resume["epoch"], resume["epoch_seed"]
        loader._epoch = epoch + 1
        loader._epoch_explicit = False
        order = recompute_order(loader, resume["order"]) if resume.get("order") else None
        if order is None:
            raise StateDictError("the state has no sampler order to resume from; it cannot be replayed")
        return plan_run(loader, epoch, epoch_seed, order, resume["order"],
                        [tuple(r) for r in resume["consumed"]], world_size)
    from torch.utils.data import DistributedSampler

    from sbloader.core.plan import epoch_seed_from

    if isinstance(loader.sampler, DistributedSampler):
        # the user drives the epoch through sampler.set_epoch, as under torch
        epoch = int(loader.sampler.epoch)
        epoch_seed = epoch_seed_from(loader.sampler.seed, epoch)
        loader._epoch, loader._epoch_explicit = epoch + 1, False
    else:
        epoch, epoch_seed = loader._next_epoch()
    order, order_state = _capture_and_iterate(loader)
    return plan_run(loader, epoch, epoch_seed, order, order_state, [], world_size)


def fingerprint(loader: "DataLoader") -> dict:
    """What a state must match to be loaded into this loader."""
    return {
        "dataset": type(loader.dataset).__name__,
        "len": len(loader.dataset),
        "dataset_id": loader.dataset_id,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": type(loader.sampler).__name__,
    }


def _user_generator(loader: "DataLoader") -> Any:
    """The generator the user gave the loader's own RandomSampler (None if none, or with ``seed=``)."""
    from torch.utils.data import RandomSampler

    if type(loader.sampler) is RandomSampler and not loader._seeded_sampler:
        return _rng_of(loader.sampler)
    return None


def restore_generator(loader: "DataLoader", state: dict) -> None:
    """Put the user's generator where the state's run left it, so later epochs draw as uninterrupted."""
    gen = _user_generator(loader)
    saved = state.get("generator")
    if gen is None or not saved:
        return
    import torch

    try:
        gen.set_state(torch.frombuffer(bytearray(base64.b64decode(saved)), dtype=torch.uint8))
    except (ValueError, RuntimeError) as e:
        raise StateDictError(f"the state's generator state cannot be restored into this loader's generator: {e}") \
            from None


def make_state(loader: "DataLoader", run: Optional[EpochRun], consumed: ledger.Ranges) -> dict:
    """The JSON-serialisable state of a loader."""
    gen = _user_generator(loader)
    base = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "fingerprint": fingerprint(loader),
        "base_seed": loader._base_seed,
        "world_size": loader.world.world_size,
        # the user's generator after the epoch's draws: a resumed job continues its sequence
        "generator": base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii") if gen is not None else None,
    }
    if run is None:
        if loader._resume is not None:  # loaded, not iterated yet: the same state again
            return dict(loader._resume)
        return {**base, "epoch": int(loader._epoch), "epoch_seed": None, "order": None, "consumed": []}
    if run.complete or ledger.count(consumed) >= len(run.order):
        # the epoch is done: the state starts the next one cleanly
        return {**base, "epoch": int(run.epoch) + 1, "epoch_seed": None, "order": None, "consumed": []}
    if run.order_state is None:
        raise StateDictError(
            f"cannot checkpoint a {type(loader.sampler).__name__} of {len(run.order)} positions: its order "
            "cannot be recomputed on resume. Use RandomSampler, SequentialSampler or DistributedSampler, "
            f"or a sampler of at most {_EXPLICIT_ORDER_LIMIT} positions"
        )
    return {**base, "epoch": int(run.epoch), "epoch_seed": int(run.epoch_seed), "order": run.order_state,
            "consumed": [list(r) for r in consumed]}


def validate(loader: "DataLoader", state: Any, strict: bool = True) -> dict:
    """Check a state against this loader; raise "found X, expected Y" errors."""
    from sbloader.core.state import check_state

    return check_state(state, fmt=STATE_FORMAT, version=STATE_VERSION, required=("consumed",),
                       fingerprint=fingerprint(loader), strict=strict)

"""The epoch plan: pure functions over ids and seeds (no Ray, no I/O).

The order of partitions in an epoch, the shuffle inside a partition, and every
per-partition seed derive from the epoch seed only, never from the world size or
from which worker ran what. Replaying a partition therefore reproduces its rows
and its augmentations bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

_SEED_MASK = (1 << 63) - 1

# Salts (as partition ids) of the epoch-wide draws, apart from every real partition id (>= 0).
_ORDER_SALT = -1
_MEMBERS_SALT = -2
_CUT_SALT = -3


@dataclass(frozen=True)
class EpochPlan:
    """What one epoch executes, in which order.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the seed everything in the epoch derives from.
        order: partition ids in delivery order.
        shuffle: whether the epoch is shuffled: the sources draw which items form
            each partition from the epoch seed (where they can), and rows are
            shuffled inside each partition.
    """

    epoch: int
    epoch_seed: int
    order: tuple[int, ...]
    shuffle: bool = False

    def __post_init__(self) -> None:
        if len(set(self.order)) != len(self.order):
            raise ValueError("an epoch plan must list each partition once")

    def seq_of(self) -> dict[int, int]:
        """Map partition id -> position in the plan."""
        return {pid: i for i, pid in enumerate(self.order)}


def _words(*values: int) -> np.ndarray:
    """Fixed-width entropy: two 32-bit words per value (mod 2**64), so distinct inputs never collide."""
    out = []
    for v in values:
        v = int(v) % (1 << 64)
        out += [v & 0xFFFFFFFF, v >> 32]
    return np.asarray(out, dtype=np.uint32)


def _seed(*values: int) -> int:
    return int(np.random.SeedSequence(_words(*values)).generate_state(2, np.uint64)[0]) & _SEED_MASK


def epoch_seed_from(seed: int, epoch: int) -> int:
    """The epoch seed for a fixed base ``seed`` and an ``epoch`` number."""
    return _seed(seed, epoch)


def draw_epoch_seed(seed: Optional[int], epoch: int, generator: Any = None) -> int:
    """The epoch seed: from ``(seed, epoch)`` when a seed is given, else drawn as torch does.

    torch's DataLoader draws its base seed at each new iterator from the
    ``generator`` (or torch's global RNG); we draw ours the same way, so seeding
    torch seeds sbloader.
    """
    if seed is not None:
        return epoch_seed_from(seed, epoch)
    import torch

    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & _SEED_MASK


def loader_epoch_seed(seed: Optional[int], epoch: int, generator: Any, base_seed: Optional[int],
                      persistent: bool) -> tuple[int, Optional[int]]:
    """A drop-in loader's seed for ``epoch``, and its base seed from then on: ``f(seed, epoch)`` when ``seed``
    is given; with ``persistent`` workers the base seed is drawn once (torch draws it once per persistent
    iterator, later epochs reset it without a draw), then derived per epoch; else drawn as torch draws each
    iterator's (:func:`draw_epoch_seed`)."""
    if seed is None and persistent:
        if base_seed is None:
            base_seed = draw_epoch_seed(None, epoch, generator)
        return epoch_seed_from(base_seed, epoch), base_seed
    return draw_epoch_seed(seed, epoch, generator), base_seed


def partition_seed(epoch_seed: int, partition_id: int, salt: int = 0) -> int:
    """The seed of one partition (and one operator ``salt``) in an epoch."""
    return _seed(epoch_seed, partition_id, salt)


def make_epoch_plan(
    partition_ids: Sequence[int], epoch: int, epoch_seed: int, shuffle: bool
) -> EpochPlan:
    """Plan an epoch: identity order, or a permutation drawn from the epoch seed."""
    ids = list(partition_ids)
    if shuffle:
        rng = np.random.default_rng(partition_seed(epoch_seed, _ORDER_SALT, 0))
        ids = [ids[i] for i in rng.permutation(len(ids))]
    return EpochPlan(epoch=epoch, epoch_seed=epoch_seed, order=tuple(ids), shuffle=shuffle)


def row_permutation(num_rows: int, epoch_seed: int, partition_id: int) -> np.ndarray:
    """The shuffle of rows inside a partition for an epoch."""
    return np.random.default_rng(partition_seed(epoch_seed, partition_id, 1)).permutation(num_rows)


def member_positions(num_items: int, epoch_seed: int, shuffle: bool) -> np.ndarray:
    """Which item (file, list element, sampler position) sits at each place of the epoch's listing.

    Without ``shuffle`` the listing order; with it a permutation of the whole listing
    drawn from the epoch seed, so that cutting it into runs of consecutive places
    (:func:`cut_members`) puts a uniform sample of the dataset in every partition,
    whatever order the listing had (class-per-folder, label-sorted). It depends on
    the epoch seed only, never on the world size.

    Args:
        num_items: items in the listing.
        epoch_seed: the epoch seed.
        shuffle: draw a permutation (else the identity).

    Returns:
        ``int64`` item indices, each once.
    """
    if num_items < 0:
        raise ValueError(f"num_items must be >= 0, found {num_items}")
    if not shuffle:
        return np.arange(num_items, dtype=np.int64)
    rng = np.random.default_rng(partition_seed(epoch_seed, _MEMBERS_SALT, 0))
    return rng.permutation(num_items).astype(np.int64)


def cut_members(positions: np.ndarray, per_partition: int) -> list[np.ndarray]:
    """Cut an epoch's listing (:func:`member_positions`) into partitions of ``per_partition``
    consecutive places: partition ``k`` holds places ``[k*r, (k+1)*r)`` (ids 0, 1, ...)."""
    if per_partition < 1:
        raise ValueError(f"per_partition must be >= 1, found {per_partition}")
    return [positions[a:a + per_partition] for a in range(0, len(positions), per_partition)]


def cut_counts(remaining: Sequence[int], rows: int, epoch_seed: int, batch_index: int) -> np.ndarray:
    """How many rows the batch ``batch_index`` takes from each open block (the shuffle window).

    The rows of the open blocks are drawn uniformly without replacement (a
    multivariate hypergeometric draw over their remaining rows), so a batch mixes
    every open block in proportion to what it has left, and the blocks run out
    together. Each block's rows are taken in order: what a block gave is always a
    prefix of its rows, which the consumed ledger records as a count. The draw
    depends on the epoch seed, the batch's index and the remaining counts only, so
    a resumed epoch (same open blocks, same counts) cuts the same batches.

    Args:
        remaining: rows left in each open block, in the order the blocks opened.
        rows: rows of the batch (at most ``sum(remaining)``).
        epoch_seed: the epoch seed.
        batch_index: the batch's index in this consumer's epoch.

    Returns:
        ``int64`` counts, one per open block, summing to ``rows``.
    """
    rem = np.asarray(remaining, dtype=np.int64)
    if rows < 0 or (rem < 0).any() or rows > int(rem.sum()):
        raise ValueError(f"cannot take {rows} rows from blocks with {rem.tolist()} rows left")
    if len(rem) == 1:
        return np.asarray([rows], dtype=np.int64)
    rng = np.random.default_rng(partition_seed(epoch_seed, _CUT_SALT, batch_index))
    return rng.multivariate_hypergeometric(rem, rows).astype(np.int64)


def split_rows(num_rows: int, rows_per_partition: int) -> list[tuple[int, int]]:
    """Cut ``num_rows`` into ``[start, stop)`` ranges of at most ``rows_per_partition``."""
    if rows_per_partition < 1:
        raise ValueError(f"rows_per_partition must be >= 1, found {rows_per_partition}")
    return [(s, min(s + rows_per_partition, num_rows)) for s in range(0, num_rows, rows_per_partition)]


def default_rows_per_partition(num_rows: int, parallelism: int, *, max_rows: int = 1024, min_rows: int = 1) -> int:
    """Rows per partition: about four partitions per worker, within bounds."""
    if num_rows <= 0:
        return 1
    target = math.ceil(num_rows / max(1, 4 * parallelism))
    return max(min_rows, min(max_rows, target))


def resolve_rows_per_partition(
    num_rows: int,
    parallelism: int,
    num_partitions: Optional[int] = None,
    rows_per_partition: Optional[int] = None,
) -> int:
    """Rows per partition from explicit arguments or the default."""
    if num_partitions is not None and rows_per_partition is not None:
        raise ValueError("give num_partitions or rows_per_partition, not both")
    if num_partitions is not None:
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, found {num_partitions}")
        return max(1, math.ceil(num_rows / num_partitions))
    if rows_per_partition is not None:
        if rows_per_partition < 1:
            raise ValueError(f"rows_per_partition must be >= 1, found {rows_per_partition}")
        return rows_per_partition
    return default_rows_per_partition(num_rows, parallelism)

"""The epoch plan: pure functions over ids and seeds (no Ray, no I/O).

The order of partitions in an epoch, the shuffle inside a partition, and every
per-partition seed derive from the epoch seed only, never from the world size or
from which worker ran what. Replaying a partition therefore reproduces its rows
and its augmentations bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class EpochPlan:
    """What one epoch executes, in which order.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the seed everything in the epoch derives from.
        order: partition ids in delivery order.
        shuffle_rows: whether rows are shuffled inside each partition.
    """

    epoch: int
    epoch_seed: int
    order: tuple[int, ...]
    shuffle_rows: bool = False

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


def partition_seed(epoch_seed: int, partition_id: int, salt: int = 0) -> int:
    """The seed of one partition (and one operator ``salt``) in an epoch."""
    return _seed(epoch_seed, partition_id, salt)


def make_epoch_plan(
    partition_ids: Sequence[int], epoch: int, epoch_seed: int, shuffle: bool
) -> EpochPlan:
    """Plan an epoch: identity order, or a permutation drawn from the epoch seed."""
    ids = list(partition_ids)
    if shuffle:
        rng = np.random.default_rng(partition_seed(epoch_seed, -1, 0))
        ids = [ids[i] for i in rng.permutation(len(ids))]
    return EpochPlan(epoch=epoch, epoch_seed=epoch_seed, order=tuple(ids), shuffle_rows=shuffle)


def row_permutation(num_rows: int, epoch_seed: int, partition_id: int) -> np.ndarray:
    """The shuffle of rows inside a partition for an epoch."""
    return np.random.default_rng(partition_seed(epoch_seed, partition_id, 1)).permutation(num_rows)


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

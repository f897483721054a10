"""In-memory sources: ``from_items``, ``range`` and ``from_torch``.

A list held by the driver, a range of integers, or a map-style torch dataset read
through its sampler: under ``shuffle=True`` each partition's members (list
elements, ids, sampler positions) are drawn from the epoch seed.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import numpy as np

from sbloader.core.block import Block, from_rows, to_column
from sbloader.core.plan import cut_members, member_positions, split_rows
from sbloader.sources.base import Partition


def _parallelism() -> int:
    """The parallelism default partition sizes assume.

    A constant, not the cluster's CPU count: partition ids and sizes must not
    change with the cluster, or a job resumed on another cluster could not
    replay its plan.
    """
    return 8


def _rows_block(items: Sequence[Any]) -> Block:
    if items and all(isinstance(x, dict) for x in items):
        return from_rows(items)
    return {"item": to_column(list(items))}


def _read_items(shared: Any, partition: Partition) -> Block:
    return _rows_block(partition.payload)


def _read_range(shared: Any, partition: Partition) -> Block:
    if isinstance(partition.payload, np.ndarray):  # shuffled members
        return {"id": partition.payload.astype(np.int64, copy=True)}
    a, b = partition.payload
    return {"id": np.arange(a, b, dtype=np.int64)}


def _read_torch(shared: Any, partition: Partition, columns: str) -> Block:
    samples = [shared[int(i)] for i in partition.payload]
    if columns == "item":
        return {"item": to_column(samples)}
    return _rows_block(samples)


class ItemsSource:
    """Rows from a Python list held by the driver (``from_items``).

    Partition ``k`` holds places ``[k*r, (k+1)*r)`` of the epoch's listing: the list
    in order, or under ``shuffle`` a permutation of it drawn from the epoch seed.
    """

    name = "FromItems"
    shuffle_window = 1

    def __init__(self, items: Sequence[Any], rows_per_partition: int) -> None:
        self._items = list(items)
        self._rpp = rows_per_partition
        self._ranges = split_rows(len(self._items), rows_per_partition)

    def shared(self) -> Any:
        return None

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        if not shuffle:
            return [
                Partition(i, b - a, self._items[a:b], f"items[{a}:{b}]") for i, (a, b) in enumerate(self._ranges)
            ]
        chunks = cut_members(member_positions(len(self._items), epoch_seed, True), self._rpp)
        return [Partition(i, len(c), [self._items[j] for j in c], f"items at shuffled places [{i * self._rpp}, "
                          f"{i * self._rpp + len(c)}) of epoch seed {epoch_seed}") for i, c in enumerate(chunks)]

    def reader(self) -> Callable[[Any, Partition], Block]:
        return _read_items

    def num_rows(self) -> Optional[int]:
        return len(self._items)

    def fingerprint(self) -> dict:
        return {"type": self.name, "num_rows": len(self._items), "num_partitions": len(self._ranges)}


class RangeSource:
    """Integers ``0..n-1`` in a column ``id`` (``range``); under ``shuffle`` each partition
    holds a run of a permutation of ``0..n-1`` drawn from the epoch seed."""

    name = "Range"
    shuffle_window = 1

    def __init__(self, n: int, rows_per_partition: int) -> None:
        self._n = n
        self._rpp = rows_per_partition
        self._ranges = split_rows(n, rows_per_partition)

    def shared(self) -> Any:
        return None

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        if not shuffle:
            return [Partition(i, b - a, (a, b), f"range[{a}:{b}]") for i, (a, b) in enumerate(self._ranges)]
        chunks = cut_members(member_positions(self._n, epoch_seed, True), self._rpp)
        return [Partition(i, len(c), c, f"range ids at shuffled places [{i * self._rpp}, {i * self._rpp + len(c)}) "
                          f"of epoch seed {epoch_seed}") for i, c in enumerate(chunks)]

    def reader(self) -> Callable[[Any, Partition], Block]:
        return _read_range

    def num_rows(self) -> Optional[int]:
        return self._n

    def fingerprint(self) -> dict:
        return {"type": self.name, "num_rows": self._n, "num_partitions": len(self._ranges)}


class TorchSource:
    """A map-style torch ``Dataset`` read through a sampler (``from_torch``).

    Partitions are ranges of *sampler positions*: partition ``k`` holds positions
    ``[k*r, (k+1)*r)`` of the epoch's sampler order, so any sampler's order (a
    ``RandomSampler`` permutation included) is reproduced exactly. Under
    ``shuffle`` the positions are permuted from the epoch seed first (the sampler's
    multiset of indices kept). The sampler is iterated once per epoch in the driver
    (indices only, never samples).
    """

    name = "FromTorch"
    shuffle_window = 1

    def __init__(self, dataset: Any, sampler: Any, rows_per_partition: int, columns: str = "auto") -> None:
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"from_torch needs a map-style dataset with __getitem__, found {type(dataset).__name__}"
            )
        self._dataset = dataset
        self._sampler = sampler
        self._rows_per_partition = rows_per_partition
        self._columns = columns
        self._cached: Optional[tuple[int, np.ndarray]] = None

    def sampler_indices(self, epoch: int) -> np.ndarray:
        """The dataset indices of every sampler position for an epoch."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if self._sampler is None:
            idx = np.arange(len(self._dataset), dtype=np.int64)
        else:
            if hasattr(self._sampler, "set_epoch"):
                self._sampler.set_epoch(epoch)
            idx = np.fromiter((int(i) for i in self._sampler), dtype=np.int64)
        self._cached = (epoch, idx)
        return idx

    def shared(self) -> Any:
        return self._dataset

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        idx = self.sampler_indices(epoch)
        if shuffle:
            chunks = cut_members(member_positions(len(idx), epoch_seed, True), self._rows_per_partition)
            r = self._rows_per_partition
            return [Partition(i, len(c), idx[c], f"sampler positions at shuffled places [{i * r}, {i * r + len(c)}) "
                              f"of epoch seed {epoch_seed}") for i, c in enumerate(chunks)]
        return [
            Partition(i, b - a, idx[a:b], f"sampler positions [{a}, {b})")
            for i, (a, b) in enumerate(split_rows(len(idx), self._rows_per_partition))
        ]

    def reader(self) -> Callable[[Any, Partition], Block]:
        return functools.partial(_read_torch, columns=self._columns)

    def num_rows(self) -> Optional[int]:
        if self._sampler is not None:
            try:
                return len(self._sampler)
            except TypeError:
                return None
        return len(self._dataset)

    def fingerprint(self) -> dict:
        return {
            "type": f"{self.name}:{type(self._dataset).__name__}",
            "num_rows": self.num_rows(),
            "sampler": type(self._sampler).__name__ if self._sampler is not None else None,
        }

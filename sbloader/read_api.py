"""Functions that create a Dataset from in-memory data."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .dataset import Dataset
from .plan import resolve_rows_per_partition
from .sources import ItemsSource, RangeSource, TorchSource, _parallelism


def from_items(items: Sequence[Any], *, num_partitions: Optional[int] = None,
               rows_per_partition: Optional[int] = None) -> Dataset:
    """A dataset over a Python list (dicts become columns; anything else a column ``item``).

    Args:
        items: the rows.
        num_partitions: cut into this many partitions.
        rows_per_partition: or cut into partitions of this many rows.
    """
    items = list(items)
    rpp = resolve_rows_per_partition(len(items), _parallelism(), num_partitions, rows_per_partition)
    return Dataset(ItemsSource(items, rpp))


def range_dataset(n: int, *, num_partitions: Optional[int] = None,
                  rows_per_partition: Optional[int] = None) -> Dataset:
    """A dataset of the integers ``0..n-1`` in column ``id`` (``sbloader.range``)."""
    if n < 0:
        raise ValueError(f"range needs n >= 0, found {n}")
    rpp = resolve_rows_per_partition(n, _parallelism(), num_partitions, rows_per_partition)
    return Dataset(RangeSource(n, rpp))


def from_torch(dataset: Any, sampler: Any = None, *, num_partitions: Optional[int] = None,
               rows_per_partition: Optional[int] = None, columns: str = "auto") -> Dataset:
    """A dataset over a map-style torch ``Dataset``, in ``sampler`` order.

    Partitions are ranges of sampler positions; the sampler is iterated once per
    epoch in the driver (indices only) and ``dataset[i]`` runs in remote tasks.

    Args:
        dataset: any object with ``__getitem__`` and ``__len__``.
        sampler: an iterable of indices (``RandomSampler``...); None: ``0..len-1``.
        num_partitions: cut into this many partitions.
        rows_per_partition: or cut into partitions of this many rows.
        columns: ``"auto"`` (dict samples become columns, others a column
            ``item``) or ``"item"`` (every sample in a column ``item``).
    """
    if columns not in ("auto", "item"):
        raise ValueError(f"columns must be 'auto' or 'item', found {columns!r}")
    n = len(sampler) if sampler is not None and hasattr(sampler, "__len__") else len(dataset)
    rpp = resolve_rows_per_partition(n, _parallelism(), num_partitions, rows_per_partition)
    return Dataset(TorchSource(dataset, sampler, rpp, columns))

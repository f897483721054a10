"""What every source is: a :class:`Source` lists its input and cuts it into :class:`Partition` s.

A source lists its input and cuts it into :class:`Partition` s. A partition has a
stable id, knows its row count where the source can tell, and reading it twice
yields the same rows. ``read`` runs in the remote task, never in the driver.

Under ``shuffle=True`` a source whose input is a list of small items (files, list
elements, sampler positions) draws which items form each partition from the epoch
seed (:func:`~sbloader.core.plan.member_positions`), so every partition is a uniform
sample of the dataset. A source whose unit of I/O holds many rows (a Parquet row
group, a video) keeps its partitions and asks the consumer to draw each batch
from several partitions at once (``shuffle_window``: by default as many as a share
of the memory budget holds, see :mod:`sbloader.core.window`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from sbloader.core.block import Block

#: ``shuffle_window`` of a source whose partition is one unit of I/O holding many rows
#: (a Parquet row group, a video): None, a shuffled batch draws from as many partitions
#: as the window's share of the memory budget holds (:mod:`sbloader.core.window`).
IO_UNIT_SHUFFLE_WINDOW = None


@dataclass(frozen=True)
class Partition:
    """One unit of execution.

    Attributes:
        id: stable id of the partition within its source.
        num_rows: rows the partition yields, or None if unknown before reading.
        payload: what ``Source.read`` needs (a slice of items, index ranges,
            file paths...); small, shipped with the task.
        label: a human-readable name for errors (a file path, a row range).
        affinity: the index of the pool actor that should run it when that actor is ready and
            has a free slot (an ``IterableDataset`` shard's segments go to the actor holding the
            shard's generator); None: any.
    """

    id: int
    num_rows: Optional[int]
    payload: Any = field(repr=False, default=None)
    label: str = ""
    affinity: Optional[int] = None


@runtime_checkable
class Source(Protocol):
    """What the executor needs from a source."""

    name: str
    #: Partitions whose rows a shuffled batch is drawn from by default: 1 where a
    #: shuffled partition is already a uniform sample of the dataset, None (a share
    #: of the memory budget) where a partition is one unit of I/O holding many
    #: adjacent rows.
    shuffle_window: Optional[int]

    def shared(self) -> Any:
        """An object shipped once to the object store and given to every ``read``."""

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        """The partitions of an epoch: ids ``0..P-1``, stable for the epoch. Their members
        may be drawn from ``epoch_seed`` under ``shuffle``; without it, the same every epoch."""

    def reader(self) -> "Callable[[Any, Partition], Block]":
        """A small picklable function ``(shared, partition) -> Block``; runs remotely."""

    def num_rows(self) -> Optional[int]:
        """Total rows, or None when unknown before reading."""

    def fingerprint(self) -> dict:
        """A small JSON-serialisable description (type, length, ids) for state checks."""

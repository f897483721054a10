"""The drop-in DataLoader's sources: an epoch's batches of dataset indices, or the worker
shards of an ``IterableDataset``.

``ReadyBatchSource`` cuts an epoch's batch list (from the sampler, in the driver)
into partitions of whole batches; ``ShardSource`` has one partition per worker
shard. The pool's workers (:mod:`sbloader.loaders.worker`) read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from sbloader.core.block import Block
from sbloader.sources.base import Partition


@dataclass(frozen=True)
class PaddedBatch:
    """A tail batch whose last ``pad`` rows repeat earlier rows (split mode only).

    Attributes:
        indices: dataset indices, padding included.
        pad: how many of the last indices are padding.
    """

    indices: tuple
    pad: int


def _read_tasks(shared: Any, partition: Partition) -> Block:
    """The partition's work items (index lists or a shard id), one row each."""
    items = list(partition.payload)
    col = np.empty((len(items),), dtype=object)
    for i, x in enumerate(items):
        col[i] = x
    return {"task": col}


class ReadyBatchSource:
    """An epoch's batches (lists of dataset indices), a few per partition.

    Args:
        batches: the epoch's batches in sampler order (index lists, or single
            indices when auto-batching is off).
        batches_per_partition: batches per partition.
        fingerprint: description of the dataset for state checks.
        ids: a stable partition id per batch (e.g. its first sample position), so
            a resumed epoch that cuts the same batches seeds them the same way;
            default: the batch index.
    """

    name = "Batches"
    shuffle_window = 1  # the sampler decides the order

    def __init__(self, batches: Sequence[Any], batches_per_partition: int, fingerprint: dict,
                 ids: Optional[Sequence[int]] = None) -> None:
        self._batches = list(batches)
        self._bpp = batches_per_partition
        self._fp = fingerprint
        self._ids = list(ids) if ids is not None else None

    def shared(self) -> Any:
        return None

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        out = []
        for k, start in enumerate(range(0, len(self._batches), self._bpp)):
            chunk = self._batches[start:start + self._bpp]
            pid = self._ids[start] if self._ids is not None else k
            out.append(Partition(pid, len(chunk), chunk, f"batches [{start}, {start + len(chunk)})"))
        return out

    def reader(self) -> Callable[[Any, Partition], Block]:
        return _read_tasks

    def subset(self, keep: Sequence[int]) -> "ReadyBatchSource":
        """The same source holding only the batches at indices ``keep`` (their ids kept)."""
        ids = self._ids if self._ids is not None else list(range(len(self._batches)))
        return ReadyBatchSource([self._batches[i] for i in keep], self._bpp, self._fp, [ids[i] for i in keep])

    def num_rows(self) -> Optional[int]:
        return len(self._batches)

    def fingerprint(self) -> dict:
        return dict(self._fp)


class ShardSource:
    """One partition per worker shard of an ``IterableDataset``.

    Each partition is a whole shard: the dataset copy in the worker sees
    ``get_worker_info().id == shard`` and shards itself, as under torch.
    ``resume``: per shard, where it resumes (the loaders' ``iterable_resume``
    snapshot, carried in the shard's task). ``segment``: the shard runs at most that many
    batches in this execution (:mod:`~sbloader.loaders.shard_segments`); ``shards``: the
    shards to run (default: all).
    """

    name = "IterableShards"
    shuffle_window = 1

    def __init__(self, num_shards: int, fingerprint: dict, resume: Optional[dict] = None,
                 segment: Optional[int] = None, shards: Optional[Sequence[int]] = None) -> None:
        self._n = num_shards
        self._fp = fingerprint
        self._resume = resume or {}
        self._segment = segment
        self._shards = tuple(shards) if shards is not None else tuple(range(num_shards))

    def shared(self) -> Any:
        return None

    def segment(self, resume: dict, segment: int) -> "ShardSource":
        """The shards in ``resume`` (each from its snapshot, None: its start), ``segment`` batches each."""
        return ShardSource(self._n, self._fp, resume, segment, sorted(resume))

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        return [Partition(w, None, [self._task(w)], f"worker shard {w}", affinity=w) for w in self._shards]

    def _task(self, w: int) -> tuple:
        """Shard ``w``'s work item: ``("shard", w[, resume[, segment]])``."""
        if self._segment is not None:
            return ("shard", w, self._resume.get(w), self._segment)
        return ("shard", w, self._resume[w]) if w in self._resume else ("shard", w)

    def reader(self) -> Callable[[Any, Partition], Block]:
        return _read_tasks

    def num_rows(self) -> Optional[int]:
        return None

    def fingerprint(self) -> dict:
        return dict(self._fp)

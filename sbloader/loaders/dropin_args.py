"""The drop-in DataLoader's arguments: torch's checks, with torch's messages, and the split decision.

Kept apart from the loader class so its constructor reads as what it stores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Batching:
    """How a loader batches, resolved from torch's arguments.

    Attributes:
        shuffle: the resolved ``shuffle`` (False for an ``IterableDataset``).
        batch_size: samples per batch (None: no auto-batching).
        drop_last: drop the last incomplete batch.
        prefetch_factor: batches in flight per worker (None without workers).
    """

    shuffle: bool
    batch_size: Optional[int]
    drop_last: bool
    prefetch_factor: Optional[int]


def check_torch_args(*, iterable: bool, batch_size: Optional[int], shuffle: Optional[bool], sampler: Any,
                     batch_sampler: Any, num_workers: int, drop_last: bool, timeout: float,
                     prefetch_factor: Optional[int], persistent_workers: bool,
                     batches_per_partition: int) -> Batching:
    """Check the arguments as torch's DataLoader does (its messages) and resolve them.

    Raises:
        ValueError: an argument torch refuses, with torch's message.
    """
    if num_workers < 0:
        raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing. "
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    elif num_workers > 0 and prefetch_factor is None:
        prefetch_factor = 2
    elif prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if batches_per_partition < 1:
        raise ValueError(f"batches_per_partition must be >= 1, found {batches_per_partition}")
    if iterable:
        if shuffle not in {False, None}:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
            )
        if sampler is not None:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
            )
        if batch_sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified batch_sampler option, "
                f"but got batch_sampler={batch_sampler}"
            )
    shuffle = bool(shuffle)
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
            )
        batch_size, drop_last = None, False
    elif batch_size is None and drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
    return Batching(shuffle, batch_size, drop_last, prefetch_factor)


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a torch ``IterableDataset``."""
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def decide_split(split: Optional[bool], world: Any, dataset: Any, iterable: bool, sampler: Any,
                  batch_sampler: Any) -> bool:
    """Whether the coordinator splits epochs across ranks (no silent double sharding)."""
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    if world.world_size == 1:
        return False
    if isinstance(sampler, DistributedSampler) and (sampler.num_replicas, sampler.rank) != (world.world_size,
                                                                                            world.rank):
        # The user shards by hand (another world than the job's): the sampler is the split,
        # followed exactly; a second split by the coordinator would drop or repeat samples.
        if split:
            raise ValueError(
                f"split=True with a DistributedSampler of num_replicas={sampler.num_replicas}, rank={sampler.rank} "
                f"in a job of world size {world.world_size} (rank {world.rank}): the sampler already shards, "
                "and a second split would lose or repeat samples. Pass split=False (each loader iterates its "
                "sampler's shard, as under torch) or give the sampler this job's world size and rank"
            )
        return False
    known = sampler is None or type(sampler) in (RandomSampler, SequentialSampler, DistributedSampler)
    if split is None:
        if iterable:
            raise ValueError(
                f"world size is {world.world_size} and the loader has an IterableDataset: pass split=True "
                "(the coordinator iterates it once for the job and splits its output across ranks, equal "
                "batch counts on every rank) or split=False (it shards itself by rank: every rank then "
                "iterates its own shard, as under torch)"
            )
        if batch_sampler is not None:
            raise ValueError(
                f"world size is {world.world_size} and the loader has a batch_sampler "
                f"({type(batch_sampler).__name__}), which the coordinator cannot split across ranks: pass "
                "split=False and make the batch_sampler shard itself by rank (every rank then iterates its "
                "own shard, as under torch)"
            )
        if not known:
            raise ValueError(
                f"world size is {world.world_size} and the loader has a custom sampler "
                f"({type(sampler).__name__}): pass split=True to let the coordinator split its order "
                "across ranks, or split=False if it already shards per rank (every rank then iterates "
                "what it yields)"
            )
        return True
    if split and batch_sampler is not None:
        raise ValueError(
            "split=True needs a sampler or an IterableDataset, not a batch_sampler; use split=False for a "
            "batch_sampler that shards itself per rank"
        )
    return bool(split)


def _is_iterable_dataset(dataset: Any) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)

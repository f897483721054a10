"""The drop-in DataLoader's arguments: torch's checks, with torch's messages, and the split decision.

Kept apart from the loader class so its constructor reads as what it stores.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


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


def _is_datapipe(dataset: Any) -> bool:
    from torch.utils.data import IterDataPipe

    return isinstance(dataset, IterDataPipe)


def check_torch_args(*, iterable: bool, batch_size: Optional[int], shuffle: Optional[bool], sampler: Any,
                     batch_sampler: Any, num_workers: int, drop_last: bool, timeout: float,
                     prefetch_factor: Optional[int], persistent_workers: bool,
                     batches_per_partition: int, shuffle_target: Any = None) -> Batching:
    """Check the arguments as torch's DataLoader does (its messages) and resolve them
    (``shuffle_target``: the dataset; an ``IterDataPipe`` takes ``shuffle`` to its shufflers).

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
        if shuffle not in {False, None} and not _is_datapipe(shuffle_target):
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
    shuffle = bool(shuffle) and not iterable  # an IterDataPipe shuffles itself
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
            # torch's behaviour, so that swapping the import keeps a job working: every rank iterates
            # the dataset (which shards itself by rank, as webdataset's split_by_node does)
            logger.info(
                "sbloader: world size is %d and the loader has an IterableDataset: every rank iterates it, as "
                "under torch (split=False; it must shard itself by rank). split=True would iterate it once for "
                "the job and split its output across ranks, equal batch counts on every rank",
                world.world_size)
            return False
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


GUARDED_ATTRIBUTES = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


def check_multiprocessing_context(context: Any, num_workers: int) -> None:
    """Refuse what torch refuses (its errors); a valid context is accepted and has no effect on Ray.

    Raises:
        ValueError: a context without workers, or an unknown start method name.
        TypeError: neither a start method name nor a multiprocessing context.
    """
    import multiprocessing

    import torch.multiprocessing

    if context is None:
        return
    if num_workers <= 0:
        raise ValueError("multiprocessing_context can only be used with multi-process loading (num_workers > 0), "
                         f"but got num_workers={num_workers}")
    if isinstance(context, str):
        valid = torch.multiprocessing.get_all_start_methods()
        if context not in valid:
            raise ValueError(f"multiprocessing_context option should specify a valid start method in {valid!r}, "
                             f"but got multiprocessing_context={context!r}")
    elif not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError("multiprocessing_context option should be a valid context object or a string specifying "
                        f"the start method, but got multiprocessing_context={context}")


def length_check(dataset: Any, reported: int, num_workers: int) -> Callable[[int], None]:
    """Called with the batches yielded so far: torch's warning once they exceed the reported ``len()``."""
    import warnings

    def check(yielded: int) -> None:
        msg = iterable_length_message(dataset, reported, yielded, num_workers)
        if msg is not None:
            warnings.warn(msg, stacklevel=3)
    return check


def iterable_length_message(dataset: Any, reported: Optional[int], yielded: int, num_workers: int) -> Optional[str]:
    """torch's warning when an IterableDataset yields more than the ``len()`` the loop was told."""
    if reported is None or yielded <= reported:
        return None
    msg = (f"Length of IterableDataset {dataset} was reported to be {reported} (when accessing len(dataloader)), "
           f"but {yielded} samples have been fetched. ")
    if num_workers > 0:
        msg += ("For multiprocessing data-loading, this could be caused by not properly configuring the "
                "IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples.")
    return msg


def datapipe_with_shuffle(dataset: Any, shuffle: Optional[bool]) -> Any:
    """An ``IterDataPipe`` with ``shuffle`` passed to its shufflers, as torch does (else unchanged)."""
    from torch.utils.data import IterDataPipe
    from torch.utils.data.graph_settings import apply_shuffle_settings

    if shuffle is not None and isinstance(dataset, IterDataPipe):
        return apply_shuffle_settings(dataset, shuffle=bool(shuffle))
    return dataset

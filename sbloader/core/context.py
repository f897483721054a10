"""Per-partition task context: the seeded RNG user functions draw from.

Inside a user function, ``sbloader.get_context()`` returns the
:class:`TaskContext` of the partition being processed. Its ``rng`` is seeded
from (epoch seed, partition id, operator index), and Python's ``random``, NumPy's
global RNG and torch's RNG are seeded the same way before each operator runs on a
partition, so a re-run partition reproduces the same samples bit for bit.
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from sbloader.core.plan import partition_seed

_CURRENT: list["TaskContext"] = []


@dataclass
class TaskContext:
    """Where a user function runs.

    Attributes:
        epoch: epoch of the execution.
        epoch_seed: the epoch seed.
        partition_id: partition being processed.
        operator: name of the operator running.
        seed: the seed of (epoch seed, partition, operator).
        rng: a ``numpy.random.Generator`` seeded with ``seed``.
        skipped: rows skipped under ``on_error="skip"`` (:func:`report_skipped`).
        full_decodes: images ``sbloader.transforms`` decoded whole because its crop
            decode could not take them (not a JPEG...: ``sbloader/sources/jpeg_window.py``).
        deferred: futures of counts the read left running (:func:`defer`).
    """

    epoch: int
    epoch_seed: int
    partition_id: int
    operator: str
    seed: int
    rng: np.random.Generator = field(repr=False)
    skipped: int = 0
    skipped_paths: list = field(default_factory=list, repr=False)
    counters: dict = field(default_factory=dict, repr=False)
    full_decodes: int = 0
    deferred: list = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class TaskCounts:
    """What the user functions of one task counted, carried in its blocks' metadata to
    ``stats()``.

    Attributes:
        skipped: rows skipped under ``on_error="skip"``.
        full_decodes: images ``sbloader.transforms`` decoded whole instead of by crop window.
    """

    skipped: int = 0
    full_decodes: int = 0

    @staticmethod
    def of(ctx: "TaskContext") -> "TaskCounts":
        """The counts a context gathered."""
        return TaskCounts(ctx.skipped, ctx.full_decodes)

    def __add__(self, other: "TaskCounts") -> "TaskCounts":
        return TaskCounts(self.skipped + other.skipped, self.full_decodes + other.full_decodes)


def get_context() -> Optional[TaskContext]:
    """The context of the partition being processed, or None outside a task."""
    return _CURRENT[-1] if _CURRENT else None


class task_context:
    """Context manager that installs a :class:`TaskContext` and seeds global RNGs."""

    def __init__(self, epoch: int, epoch_seed: int, partition_id: int, operator: str, op_index: int) -> None:
        seed = partition_seed(epoch_seed, partition_id, 100 + op_index)
        self.ctx = TaskContext(
            epoch=epoch,
            epoch_seed=epoch_seed,
            partition_id=partition_id,
            operator=operator,
            seed=seed,
            rng=np.random.default_rng(seed),
        )

    def __enter__(self) -> TaskContext:
        seed_globals(self.ctx.seed)
        _CURRENT.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc) -> None:
        _CURRENT.pop()
        join_deferred(self.ctx.deferred, self.ctx.counters)  # those nobody took (:func:`take_deferred`)


def defer(future: Any) -> bool:
    """Hand the running task ``future`` (of a dict of counts, as :func:`report_counters`
    takes): work its read started and need not wait for, such as writing what it fetched
    into the node's cache, so the task's operators run meanwhile. The task waits for it
    before its block's metadata is made (:func:`join_deferred`), and its counts go there.
    Outside a task, nothing is taken: False, and the caller waits itself."""
    ctx = get_context()
    if ctx is None:
        return False
    ctx.deferred.append(future)
    return True


def take_deferred(into: list) -> None:
    """Move the running task's deferred futures (:func:`defer`) into ``into``, for its runner
    to join after the operators (:func:`join_deferred`); left in the context, they are joined
    when it exits."""
    ctx = get_context()
    if ctx is not None:
        into.extend(ctx.deferred)
        ctx.deferred.clear()


def join_deferred(futures: list, counters: dict) -> None:
    """Wait for each of ``futures`` (:func:`defer`) and add its counts to ``counters``."""
    while futures:
        merge_counters(counters, futures.pop(0).result())


def seed_globals(seed: int) -> None:
    """Seed ``random``, NumPy's global RNG and torch (if imported) from ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def report_skipped(path: str, reason: str, rows: int = 1) -> None:
    """Count rows skipped under ``on_error="skip"`` and log a warning naming the file.

    Sources and user functions call this; the count reaches ``stats()``.

    Args:
        path: the file (or item) that could not be used.
        reason: why, for the warning.
        rows: how many rows were skipped.
    """
    import logging

    ctx = get_context()
    logging.getLogger("sbloader").warning("sbloader: skipped %d row(s) of %s: %s", rows, path, reason)
    if ctx is not None:
        ctx.skipped += rows
        ctx.skipped_paths.append(path)


def report_counters(counts: dict) -> None:
    """Add named counts (a source's cache hits, bytes read...) to the running task's
    context; they reach ``stats()`` as the operator's ``counters``. Outside a task, nothing.

    Args:
        counts: name -> integer to add (zeros are left out).
    """
    ctx = get_context()
    if ctx is None:
        return
    merge_counters(ctx.counters, counts)


#: Counts a cached read always shows together, zeros included, with their ratio
#: (``cache_hit_ratio``, derived: never summed).
CACHE_COUNTS = ("cache_hits", "cache_misses")


def hit_ratio(hits: int, misses: int) -> float:
    """``hits / (hits + misses)`` rounded to 4 places; 0.0 when nothing was read."""
    total = hits + misses
    return round(hits / total, 4) if total else 0.0


def merge_counters(into: dict, counts: Any) -> None:
    """Add ``counts`` (a dict or ``(name, count)`` pairs) into ``into``: a count named
    ``peak_*`` keeps the largest value (a peak), every other one is summed; zeros are left
    out, except that once a cache hit or miss is counted both show (a zero included) with
    ``cache_hit_ratio``, derived from the sums."""
    for k, v in (counts.items() if isinstance(counts, dict) else counts):
        if not v or k == "cache_hit_ratio":
            continue
        if k.startswith("peak_"):
            into[k] = max(into.get(k, 0), int(v))
        else:
            into[k] = into.get(k, 0) + int(v)
    if any(k in into for k in CACHE_COUNTS):
        hits, misses = into.setdefault("cache_hits", 0), into.setdefault("cache_misses", 0)
        into["cache_hit_ratio"] = hit_ratio(hits, misses)


_ACTOR_INFO: dict[str, int] = {}


def set_actor_info(index: int, pool_size: int) -> None:
    """Record, inside a pool actor, its index and its pool's size."""
    _ACTOR_INFO.update(index=index, pool_size=pool_size)


def actor_info() -> Optional[tuple[int, int]]:
    """``(index, pool_size)`` inside a pool actor, else None."""
    if not _ACTOR_INFO:
        return None
    return _ACTOR_INFO["index"], _ACTOR_INFO["pool_size"]

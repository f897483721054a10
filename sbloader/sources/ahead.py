"""What a process's fetches ahead owe the reads' counters, and which objects it is fetching
ahead now (:meth:`sbloader.sources.fetch.RemoteFiles.prefetch`).

A read task fetches the next partitions' objects into the node's cache and does not wait
for them. The GET of an object fetched ahead for a ``read_images`` task is counted by the read
that takes the entry (:data:`~sbloader.sources.cache.COUNT_MARK`, :func:`count_get_at_take`);
and its retries (:data:`~sbloader.sources.cache.RETRY_MARK`); the other counts of a fetch
ahead (the retries and GETs of Parquet and video files fetched ahead, of an entry not admitted)
wait here for the next read of this process (:func:`add_background`, :func:`take_background`).
An object being fetched ahead now is not looked up or asked for again by the next task
(:func:`not_in_flight`): before #47 it was submitted again and held a fetch thread waiting on
the entry's lock.
"""
from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from sbloader.core.plan import make_epoch_plan
from sbloader.sources.cache import COUNT_MARK, RETRY_MARK, owed_retries
from sbloader.sources.inflight import BYTES

_LOCK = threading.Lock()
_BACKGROUND: dict = {}  # counts of fetches ahead, reported by the next read in this process
_IN_FLIGHT: set = set()  # (cache directory, URI) of the objects this process is fetching ahead now


def _after_fork() -> None:
    """A forked child fetches nothing of its parent's and holds none of its locks."""
    global _LOCK
    _LOCK = threading.Lock()
    _IN_FLIGHT.clear()
    _BACKGROUND.clear()


os.register_at_fork(after_in_child=_after_fork)


def add_background(counts: dict) -> None:
    """Add a fetch ahead's ``counts``, for the next read of this process to report."""
    with _LOCK:
        for k, v in counts.items():
            _BACKGROUND[k] = _BACKGROUND.get(k, 0) + v


def take_background() -> dict:
    """The counts :func:`add_background` gathered since the last call (then forgotten)."""
    with _LOCK:
        counts = dict(_BACKGROUND)
        _BACKGROUND.clear()
    return counts


def in_flight(cache_dir: str, uri: str) -> bool:
    """Whether this process is fetching ``uri`` ahead into ``cache_dir`` now."""
    with _LOCK:
        return (cache_dir, uri) in _IN_FLIGHT


def not_in_flight(cache_dir: str, uris: Iterable[str]) -> list[str]:
    """``uris`` less those this process is fetching ahead into ``cache_dir`` now."""
    with _LOCK:
        return [u for u in uris if (cache_dir, u) not in _IN_FLIGHT]


def started(cache_dir: str, uris: Iterable[str]) -> None:
    """These objects are being fetched ahead into ``cache_dir`` (until :func:`done`)."""
    with _LOCK:
        _IN_FLIGHT.update((cache_dir, u) for u in uris)


def done(cache_dir: str, uri: str, nbytes: int) -> None:
    """A fetch ahead of ``nbytes`` ended (in the cache, or failed): its bytes go back to the
    process's budget (:data:`~sbloader.sources.inflight.BYTES`)."""
    BYTES.give(nbytes)
    with _LOCK:
        _IN_FLIGHT.discard((cache_dir, uri))


def count_get_at_take(counts: dict, marks: int, nbytes: int, path: str = "") -> None:
    """Add to a read's ``counts`` the GET of an entry (at ``path``) a read task fetched ahead of
    it (:data:`~sbloader.sources.cache.COUNT_MARK` among the ``marks`` it took off), and that
    fetch's retries (:data:`~sbloader.sources.cache.RETRY_MARK`)."""
    if marks & COUNT_MARK:
        for k, v in (("objects_read", 1), ("bytes_read", nbytes), ("prefetched", 1)):
            counts[k] = counts.get(k, 0) + v
    if marks & RETRY_MARK and path:
        counts["retries"] = counts.get("retries", 0) + owed_retries(path)


@dataclass(frozen=True)
class EpochAhead:
    """Each partition's members by id and the order the epoch's plan runs them in
    (:func:`~sbloader.core.plan.make_epoch_plan`: under ``shuffle`` a permutation drawn from
    the epoch seed), so a read task fetches ahead the partitions that run next, not the
    next ids (which a shuffled plan runs anywhere in the epoch).

    Attributes:
        members: each partition's members (URIs), by id.
        order: partition ids in the plan's order.
        position: each id's place in ``order``.
    """

    members: tuple
    order: tuple
    position: tuple

    @classmethod
    def of(cls, members: tuple, epoch_seed: int, shuffle: bool) -> "EpochAhead":
        """The members and the order :func:`~sbloader.core.plan.make_epoch_plan` gives them."""
        order = make_epoch_plan(range(len(members)), 0, epoch_seed, shuffle).order
        position = [0] * len(order)
        for i, pid in enumerate(order):
            position[pid] = i
        return cls(members, tuple(order), tuple(position))

    def runs_first(self, partition_id: int) -> bool:
        """Whether the plan runs ``partition_id`` first (its batch is the one the trainer waits for)."""
        return bool(self.order) and self.order[0] == partition_id

    def after(self, partition_id: int, count: int) -> list[int]:
        """The ids of the (at most) ``count`` partitions the plan runs after ``partition_id``."""
        if not 0 <= partition_id < len(self.position):
            return []
        i = self.position[partition_id]
        return list(self.order[i + 1:i + 1 + count])


def files_ahead(shared: Optional[EpochAhead], partition_id: int, count: int = 2) -> list[str]:
    """The next ``count`` distinct files after partition ``partition_id``'s own, from a
    source's ``shared()``: an :class:`EpochAhead` of each partition's file (the partitions the
    epoch's plan runs next: under ``shuffle`` not the next ids); nothing when it is None."""
    if shared is None or not 0 <= partition_id < len(shared.members):
        return []
    own = shared.members[partition_id]
    out: list[str] = []
    for pid in itertools.islice(shared.order, shared.position[partition_id] + 1, None):
        path = shared.members[pid]
        if path != own and path not in out:
            out.append(path)
            if len(out) == count:
                break
    return out

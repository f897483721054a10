"""The listing, page by page, and the objects of its first pages fetched into the node's
cache while the later pages are still being listed.

A flat prefix of an object store is listed one page (1,000 keys on S3) per request, in
key order. Through ``obstore`` (:func:`stream_pages`) each page is handed on as soon as
it is parsed, so a :class:`ListingPrefetch` starts GETs of the first pages' objects while
the listing goes on: a folder of 100,000 keys starts reading after its first page
instead of after its last.

What this does not change is the plan: a dataset's partitions are cut from the whole,
sorted listing, exactly as before (partition ids, their members and the shuffle derive
from the listing and the epoch seed only, never from how fast pages came), so a resumed
epoch replays exactly the same partitions. The objects fetched while listing only sit in
the node-local cache, where the read tasks find them (one GET per object: a read that
wants an object being fetched waits on the cache entry's lock, then hits).
"""
from __future__ import annotations

import datetime
import os
import threading
from collections import deque
from typing import Any, Callable, Iterator, Optional, Sequence

from sbloader.sources.pages_ahead import PAGE_KEYS, PagesAhead

#: Bytes of objects a listing fetches into the cache while it goes on, at most (the
#: first pages' objects in key order: an unshuffled epoch's first partitions; any epoch
#: reads them all once). ``$SBLOADER_LISTING_PREFETCH_BYTES`` replaces it (0: none).
LISTING_PREFETCH_BYTES = 256 * 2 ** 20

#: Environment variable replacing :data:`LISTING_PREFETCH_BYTES` (``0`` turns it off).
LISTING_PREFETCH_ENV = "SBLOADER_LISTING_PREFETCH_BYTES"

#: The listing's fetches in flight, at most (the rest wait their turn, and are dropped at the
#: listing's end). All 128 of the process's fetch threads at once took the driver's GIL from the
#: listing and the dataset's creation: 2,000 keys at 20 ms took 0.12-0.23 s to create against
#: 0.09 s with nothing fetched (#47); 32 at 20 ms still fetch ~1,600 objects a second.
LISTING_IN_FLIGHT = 32


#: Objects a listing queues for its fetch, at most: its first two pages' (an unshuffled epoch's first
#: partitions). A long listing fetches no more than these before it ends (``LISTING_IN_FLIGHT`` at a
#: time), and queuing every key of 100,000 cost the listing 0.1-0.2 s of the driver's CPU (#47).
LISTING_PREFETCH_OBJECTS = 2000


#: Keys a key range's listing hands on at a time (:mod:`~sbloader.sources.key_ranges`): a
#: range's last request answers a page of keys mostly past the range's end, which are left
#: unconverted once one past it is seen.
RANGE_CHUNK = 100


def stream_pages(uri: str, path: str, filesystem: Any, after: Optional[str] = None) -> Optional[Iterator[list]]:
    """The objects under prefix ``uri`` (``path`` in pyarrow's form, ``bucket/key``) as
    pages of ``(path, size, mtime_ns)`` in key order, each handed on once it is listed
    (the next page asked for in a thread while this one is taken); with ``after`` (a path),
    only those after it (S3's ``start-after``), listed in the caller's thread (a key range
    among others side by side, :mod:`~sbloader.sources.key_ranges`). None where no
    page-wise listing is available (a user's ``filesystem=``, a scheme obstore does not
    read, obstore missing): the caller lists the pyarrow way."""
    from sbloader.sources.object_client import ObstoreClient, client_for

    client = client_for(uri, filesystem)
    if not isinstance(client, ObstoreClient):
        return None
    store, key = client._store(uri.rstrip("/") + "/")
    bucket = path.split("/", 1)[0]

    def pages() -> Iterator[list]:
        import obstore

        from sbloader.sources.object_client import _obstore_error

        try:
            offset = None if after is None else after[len(bucket) + 1:]
            chunk = PAGE_KEYS if after is None else RANGE_CHUNK  # (a range stops within a page past its end)
            head = bucket + "/"
            for page in obstore.list(store, key.rstrip("/") or None, offset=offset, chunk_size=chunk):
                yield [(head + m["path"], m["size"], _ns(m.get("last_modified"))) for m in page]
        except Exception as e:
            raise _obstore_error(uri, e) from e

    return PagesAhead(pages()) if after is None else pages()


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_MICROSECOND = datetime.timedelta(microseconds=1)


def _ns(when: Any) -> int:
    """Nanoseconds since the epoch of a listing's ``last_modified`` (0 when absent), in integers
    (exact; 0.34 us against 0.47 through ``timestamp()``, for each of a listing's keys)."""
    if when is None:
        return 0
    return (when - _EPOCH) // _MICROSECOND * 1000


class PageStream:
    """A listing page by page that fetches nothing (the cache off, or no fetch while listing): the
    streamed listing's speed (one page ahead; a nested prefix's later sub-prefixes side by side)
    without its fetch; :class:`ListingPrefetch` adds the fetch."""

    def pages(self, uri: str, path: str, filesystem: Any, after: Optional[str] = None) -> Optional[Iterator[list]]:
        """:func:`stream_pages`."""
        return stream_pages(uri, path, filesystem, after)

    def __call__(self, page: Sequence[Any], more: bool = True) -> None:
        """Nothing to fetch."""

    def stop(self) -> None:
        """Nothing to stop."""

    def wait(self) -> dict:
        """Nothing was fetched: no counts."""
        return {}


class ListingPrefetch(PageStream):
    """Fetches objects into the node's cache as listing pages come (a callable on a page of
    :class:`~sbloader.sources.filesystems.ObjectInfo`), up to ``max_bytes`` in all and
    only while the cache has room, in the process's fetch pool, until :meth:`stop` (the
    listing's end: what is not in flight then is left to the read tasks).

    Args:
        cache: the read's :class:`~sbloader.sources.cache.CacheConfig` (on).
        max_in_flight: requests in flight (the fetch pool's threads).
        max_bytes: bytes fetched while listing, at most.
    """

    def __init__(self, cache: Any, max_in_flight: int, max_bytes: int = LISTING_PREFETCH_BYTES) -> None:
        from sbloader.sources.fetch import RemoteFiles

        self._versions: dict = {}
        self._remote = RemoteFiles(None, cache, self._versions, max_in_flight)
        self._left = int(max_bytes)
        self._queued = 0  # objects queued so far (LISTING_PREFETCH_OBJECTS at most)
        self._futures: list = []  # the fetches started
        self._queue: deque = deque()  # the objects waiting for one of the LISTING_IN_FLIGHT turns
        self._running = 0
        self._lock = threading.Lock()
        self._checked = False

    def __call__(self, page: Sequence[Any], more: bool = True) -> None:
        """Fetch the page's objects that fit what is left of the byte budget, at most
        :data:`LISTING_IN_FLIGHT` at a time; none of a page the listing ends with (``more``
        False: a page of fewer keys than a full one), whose fetches would not overlap the
        listing but only compete with the first read tasks' (#47: a folder of one page)."""
        if not more or self._left <= 0:
            return
        with self._lock:
            if not self._checked:  # on a cluster, the driver's cache is not the readers'
                self._checked = True
                self._left = self._left if _one_node() else 0
            take = []
            for o in page:
                if o.size > self._left or self._queued >= LISTING_PREFETCH_OBJECTS:
                    self._left = 0
                    break
                self._left -= o.size
                self._queued += 1
                self._versions[o.uri] = (o.size, o.mtime_ns)
                take.append(o.uri)
            self._queue.extend(take)
        self._pump()

    def _pump(self, done: Any = None) -> None:
        """Start queued fetches while fewer than :data:`LISTING_IN_FLIGHT` are running (``done``:
        the fetch that just ended, its turn given back)."""
        from sbloader.sources.inflight import pool

        ended = 0 if done is None else 1
        while True:  # a loop, not a callback within a callback, for fetches that ended at once
            start = []
            with self._lock:
                self._running -= ended
                while self._queue and self._running < LISTING_IN_FLIGHT:
                    start.append(self._queue.popleft())
                    self._running += 1
            if not start:
                return
            ended = 0
            for u in start:
                f = pool(self._remote.max_in_flight).submit(self._remote._prefetch_one, u)
                with self._lock:
                    self._futures.append(f)
                if f.done():
                    ended += 1
                else:
                    f.add_done_callback(self._pump)

    def stop(self) -> None:
        """The listing ended: drop the fetches not started yet (those in flight finish), so the
        fetch uses the listing's time only and leaves the pool and the cores to the epoch."""
        with self._lock:
            self._left = 0
            self._queue.clear()

    def wait(self) -> dict:
        """Wait for the fetches started; their counts (``prefetched``, ``objects_read``,
        ``bytes_read``, ``retries``) summed. A fetch that failed or was dropped is left to the
        read task."""
        counts: dict = {}
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            if not f.cancelled() and f.exception() is None:
                for k, v in f.result().items():
                    counts[k] = counts.get(k, 0) + v
        return counts


def _one_node() -> bool:
    """Whether the read tasks run on this node: no Ray yet (the embedded one starts here),
    or a Ray of one node."""
    import ray

    from sbloader.runtime import cluster_state

    return not ray.is_initialized() or len(cluster_state.alive_nodes()) <= 1


def listing_prefetch(filesystem: Any, cache: Any, max_in_flight: int) -> Optional[Callable[[Sequence[Any]], None]]:
    """A :class:`ListingPrefetch` for a read whose cache is on, a :class:`PageStream` (listed page by
    page, nothing fetched) for one whose cache is off or that fetches nothing while listing; None for
    a user's ``filesystem=`` (listed the pyarrow way, all at once). It fetches nothing on a Ray
    cluster of several nodes: the driver's cache would not be the readers'."""
    raw = os.environ.get(LISTING_PREFETCH_ENV, "")
    try:
        budget = int(raw) if raw else LISTING_PREFETCH_BYTES
    except ValueError:
        raise ValueError(f"{LISTING_PREFETCH_ENV} must be a number of bytes (0: fetch nothing while listing), "
                         f"found {raw!r}") from None
    if filesystem is not None:
        return None
    if not cache.enabled or budget <= 0:
        return PageStream()
    return ListingPrefetch(cache, max_in_flight, budget)

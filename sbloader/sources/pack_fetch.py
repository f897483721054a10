"""A read call's objects cached as one pack (:mod:`sbloader.sources.cache_packs`), not a file
each: the objects a read task fetches for its partition, and those it fetches ahead for the
next partitions (:meth:`sbloader.sources.fetch.RemoteFiles.read_many`).

Each object is fetched holding its entry's lock (:func:`fetch_held`), so a process that
wants it meanwhile waits and then finds it cached (one GET per object, as before); the
locks are let go once the pack is written (:func:`write_pack`). A fetch thread never
waits on a lock another holds (a holder may need that thread to finish its pack): it
takes the lock only if it is free, else the object is left to the reader, which waits
for it in its own thread (``busy``), or, fetched ahead, to the task that reads it. A fetch
ahead (:class:`AheadPack`) takes its objects' locks and looks in the thread that starts it
(:func:`claim`) and gives the fetch threads only the GETs (:func:`download_claimed`).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from sbloader.sources import ahead as ahead_counts
from sbloader.sources.cache import cache_here
from sbloader.sources.cache_packs import read_entry


@dataclass
class Got:
    """One object's read: its bytes, or its cache entry, or the error; how it went."""

    data: Optional[bytes] = None
    path: Optional[str] = None  # the cache entry, when one holds it
    error: Optional[BaseException] = None
    hit: bool = False
    ahead: int = 0  # a hit on an entry fetched ahead of this read (its marks): counted as a miss
    retries: int = 0
    admitted: bool = True
    lock: Any = None  # the entry's lock, held until its pack is written (:mod:`sbloader.sources.pack_fetch`)
    busy: bool = False  # another held the entry's lock: nothing was done
    here: bool = False  # busy with this process's own fetch ahead of it


def ahead_here() -> Future:
    """A done future of an object this process is fetching ahead now (``busy`` and ``here``):
    its reader waits for that fetch's pack (:meth:`~sbloader.sources.fetch.RemoteFiles.read_many`),
    not in a fetch thread of its own."""
    f: Future = Future()
    f.set_result(Got(busy=True, here=True))
    return f


def fetch_held(rf: Any, uri: str, ahead: bool = False) -> Any:
    """A :class:`Got` of ``uri``: from the cache (a hit, the lock let go; ``ahead``: a look that
    reads nothing and takes no mark), or downloaded with the entry's lock still held (``lock``:
    :func:`write_pack` lets go), or ``busy`` (another holds the lock: nothing done)."""
    return download_claimed(rf, uri, claim(rf, uri, ahead))


def claim(rf: Any, uri: str, ahead: bool = False) -> Any:
    """:func:`fetch_held` up to its GET: a :class:`Got` that is a hit, ``busy``, an error, or
    *claimed* (the entry's lock held, nothing read yet: :func:`download_claimed` reads it)."""
    got = Got()
    try:
        size, version = rf._version(uri)
        cache = cache_here(rf.cache)
        entry = cache.path_for(uri, version)
        lock = cache.lock_at(entry)
        if not lock.try_enter():
            got.busy = True
            return got
        try:
            p, got.ahead = cache.check(entry, size, not ahead)
            if p is not None:  # another process wrote it meanwhile
                got.hit, got.path = True, p
                if not ahead:
                    got.data = read_entry(p)
                lock.__exit__(None, None, None)
                return got
        except BaseException:
            lock.__exit__(None, None, None)
            raise
        got.path, got.lock = entry, lock
    except Exception as e:
        got.error = e
    return got


def claimed(got: Any) -> bool:
    """Whether :func:`claim` left ``got``'s GET to :func:`download_claimed`."""
    return got.lock is not None and got.data is None and got.error is None


def download_claimed(rf: Any, uri: str, got: Any) -> Any:
    """``got`` with its bytes from the store where :func:`claim` claimed it (the lock still held:
    :func:`write_pack` lets go; on an error the lock goes and ``error`` is set); else as it is."""
    if not claimed(got):
        return got
    try:
        got.data = rf._download(uri, rf._version(uri)[0], got)
    except BaseException as e:
        got.lock.__exit__(None, None, None)
        got.path, got.lock = None, None
        if not isinstance(e, Exception):
            raise
        got.error = e
    return got


def write_pack(rf: Any, gots: Sequence[Any], ahead: bool = False) -> list:
    """Cache the downloaded ones of ``gots`` (those holding their lock) as one pack (``ahead``:
    marked fetched ahead, their reads count the GETs), set each one's ``admitted``, and let go
    of their locks; the ones packed (or not admitted)."""
    held = [g for g in gots if g is not None and g.lock is not None]
    if not held:
        return []
    try:
        admitted = cache_here(rf.cache).put_pack([(g.path, g.data, g.retries) for g in held], ahead, ahead)
    except Exception:  # a full disk, a directory gone: the objects were read; they are just not cached
        admitted = [False] * len(held)
    finally:
        for g in held:
            g.lock.__exit__(None, None, None)
            g.lock = None
    for g, a in zip(held, admitted):
        g.admitted = a
    return held


def write_later(rf: Any, gots: Sequence[Any], packed: Sequence[Any] = ()) -> bool:
    """:func:`write_pack` of ``gots`` in a thread of its own, handed to the running task
    (:func:`~sbloader.core.context.defer`), which waits for it after its operators and counts the
    objects not admitted (with those of ``packed``, cached before): a read task's block goes to
    its decode without waiting for its pack (~20 ms for 64 objects of 61 KB on 2 cores, #47).
    False outside a task: nothing was started, the caller writes."""
    from sbloader.core.context import defer

    fut: Future = Future()
    if not any(g is not None and g.lock is not None for g in gots) or not defer(fut):
        return False

    def run() -> None:
        try:
            done = list(packed) + write_pack(rf, gots)
            fut.set_result({"not_admitted": sum(1 for g in done if not g.admitted)})
        except BaseException as e:  # pragma: no cover - write_pack keeps its errors (not cached)
            fut.set_exception(e)

    threading.Thread(target=run, name="sbloader-pack-write", daemon=True).start()
    return True


class AheadPack:
    """The next partitions' objects, fetched ahead into one pack once all of them are back (the
    fetch that ends last writes it, in the fetch pool); each object's bytes go back to the
    process's budget then (:func:`~sbloader.sources.ahead.done`). The GETs of the objects
    packed are counted by the reads that take them; the others' counts wait for this
    process's next read (:func:`~sbloader.sources.ahead.add_background`), as a fetch ahead's did.

    Args:
        rf: the :class:`~sbloader.sources.fetch.RemoteFiles` fetching.
        uris: the objects (their bytes already taken from the process's budget).
        sizes: their listed sizes.
    """

    def __init__(self, rf: Any, uris: Sequence[str], sizes: Sequence[int]) -> None:
        self._rf, self._uris, self._sizes = rf, list(uris), list(sizes)
        self._gots: list = [None] * len(self._uris)
        self._left = len(self._uris)
        self._lock = threading.Lock()

    def start(self, ex: Any) -> None:
        """Claim every object in this thread (:func:`claim`: its entry's lock and its look), then
        submit the GETs of those claimed to the pool ``ex``. Claimed in the fetch threads, the
        looks and locks cost 0.04-0.05 ms of CPU an object, against 0.016 here (#47)."""
        gots = [claim(self._rf, u, True) for u in self._uris]
        for i, (u, g) in enumerate(zip(self._uris, gots)):
            if claimed(g):
                ex.submit(download_claimed, self._rf, u, g).add_done_callback(lambda f, i=i: self._done(i, f))
            else:
                self._record(i, g)

    def _done(self, i: int, f: Any) -> None:
        self._record(i, f.result() if not f.cancelled() and f.exception() is None else None)

    def _record(self, i: int, got: Any) -> None:
        with self._lock:
            self._gots[i] = got
            self._left -= 1
            if self._left:
                return
        self._finish()

    def _finish(self) -> None:
        root = cache_here(self._rf.cache).root
        try:
            write_pack(self._rf, self._gots, ahead=True)
        finally:
            counts: dict = {}
            for u, s, g in zip(self._uris, self._sizes, self._gots):
                ahead_counts.done(root, u, s)
                if g is None:
                    continue
                if g.error is None and g.data is not None and not g.hit and not g.admitted:
                    for k, v in (("prefetched", 1), ("objects_read", 1), ("bytes_read", len(g.data))):
                        counts[k] = counts.get(k, 0) + v
                if g.retries and not (g.admitted and g.data is not None and not g.hit):
                    counts["retries"] = counts.get("retries", 0) + g.retries  # not carried by a pack's footer
            self._gots = []
            if counts:
                ahead_counts.add_background(counts)

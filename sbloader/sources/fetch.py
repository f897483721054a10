"""Reading remote objects inside a read task: many requests in flight, retries with
backoff, and the node-local cache in front (:mod:`sbloader.sources.cache`).

A :class:`RemoteFiles` travels with a source's reader: the user's filesystem (or
None: each URI's scheme picks the client, :mod:`sbloader.sources.object_client`), the
cache settings, and every object's listed size and modification time (its version),
so an object costs one GET (no HEAD). A read task asks it for the objects of its
partition at once and names the next partitions' objects to fetch ahead
(:meth:`RemoteFiles.read_many`): they all go to the process's fetch pool, bounded by a
budget of requests in flight and of bytes (:mod:`sbloader.sources.inflight`), while
the task decodes the ones already back, in order.

Counters (``objects_read`` and ``bytes_read`` from the store, ``cache_hits`` and
``cache_misses`` (with the cache on: both shown, zeros included, with ``cache_hit_ratio``),
``cache_bytes`` read from the cache, ``retries``, ``not_admitted``,
``prefetched``, ``peak_in_flight`` (requests in flight in the process, the largest
seen), ``store_wait_ms`` (time readers waited for bytes)) are reported to the task's
context and reach ``stats()``.
"""
from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from sbloader.core.context import report_counters
from sbloader.sources import ahead as ahead_counts
from sbloader.sources import pack_fetch
from sbloader.sources.pack_fetch import Got as _Got
from sbloader.sources.cache import CacheConfig, cache_here
from sbloader.sources.ahead import files_ahead  # noqa: F401 (part of this module's API)
from sbloader.sources.cache_packs import is_pack, read_entry
from sbloader.sources.inflight import (BYTES, DEFAULT_MAX_BYTES, DEFAULT_MAX_REQUESTS, GAUGE, Waited, when_answered,
                                       check_max_in_flight, pool)
from sbloader.sources.object_client import client_for
from sbloader.sources.object_files import ObjectFiles
from sbloader.sources.retries import RetryPolicy, is_retryable

#: Requests a process keeps in flight by default (``max_in_flight=``).
DEFAULT_MAX_IN_FLIGHT = DEFAULT_MAX_REQUESTS


class ObjectChangedError(OSError):
    """An object's size differs from the listing's: it changed after the dataset was created."""


@dataclass(frozen=True)
class RemoteFiles(ObjectFiles):
    """How a read task gets a source's remote objects.

    Attributes:
        filesystem: the user's ``filesystem=`` (None: each URI's scheme decides).
        cache: the node-local cache settings.
        versions: ``uri -> (size, mtime_ns)`` from the listing.
        max_in_flight: requests one process keeps in flight (its fetch pool's threads).
        retry: retries of each request.
        max_bytes: bytes one read task asks for ahead of its reader (own objects and
            fetch-ahead together).
        budget_key: the dataset's name in its process's count of requests in flight (every
            copy counts as the one dataset: :class:`~sbloader.sources.inflight.Gauge`).
    """

    filesystem: Any = None
    cache: CacheConfig = CacheConfig()
    versions: dict = field(default_factory=dict, compare=False, repr=False)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    retry: RetryPolicy = RetryPolicy()
    max_bytes: int = DEFAULT_MAX_BYTES
    budget_key: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)

    def _version(self, uri: str) -> tuple[Optional[int], str]:
        v = self.versions.get(uri)
        return (None, "unlisted") if v is None else (int(v[0]), f"{v[0]}-{v[1]}")

    def _request(self, uri: str, got: _Got, fetch: Any) -> bytes:
        """``fetch()`` with retries and backoff, counted in the process's gauge."""
        rng = None  # seeded from the OS only when a request fails (5 us a request otherwise)
        for attempt in range(self.retry.attempts):
            try:
                held = GAUGE.enter(self.budget_key, self.max_in_flight)
                try:
                    return fetch()
                finally:
                    GAUGE.leave(self.budget_key, held)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"no such object: {uri!r} ({e}); check the bucket and key, or pass "
                                        f"on_error='skip'") from e
            except Exception as e:
                if not is_retryable(e) or attempt + 1 >= self.retry.attempts:
                    raise OSError(f"cannot read {uri!r} after {attempt + 1} tries: {e}") from e
                got.retries += 1
                rng = rng or random.Random()
                time.sleep(self.retry.backoff(attempt, rng))
        raise AssertionError("unreachable")

    def _download(self, uri: str, size: Optional[int], got: _Got) -> bytes:
        client = client_for(uri, self.filesystem)
        data = self._request(uri, got, lambda: client.get(uri))
        if size is not None and len(data) != size:
            raise ObjectChangedError(f"{uri!r} has {len(data)} bytes where the listing said {size}: it "
                                     f"changed after the dataset was created; create the dataset again")
        return data

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object with one ranged request (retried as a GET is),
        counted in ``stats()`` (``range_reads``, ``bytes_read``)."""
        got = _Got()
        client = client_for(uri, self.filesystem)
        t0 = time.perf_counter()
        try:
            data = self._request(uri, got, lambda: client.get_range(uri, start, end))
        finally:
            report_counters({"retries": got.retries, "store_wait_ms": 1000 * (time.perf_counter() - t0),
                             "peak_in_flight": GAUGE.take_peak()})
        if len(data) != end - start:
            raise ObjectChangedError(f"{uri!r}: asked for bytes [{start}, {end}), got {len(data)}: it changed "
                                     f"after the dataset was created; create the dataset again")
        report_counters({"range_reads": 1, "bytes_read": len(data)})
        return data

    def _get(self, uri: str, want_path: bool, ahead: bool = False, count: bool = False,
             wait: bool = True) -> _Got:
        """The object from the cache or the store (then cached). ``ahead``: a fetch ahead of the
        reader (the entry is marked so: :meth:`DiskCache.check`; ``count``: the reader that takes
        it counts its GET; ``wait``: False where another's lock on the entry means nothing is done,
        ``busy``). The entry's path (a hash) is computed once for the checks, the lock and the write."""
        got = _Got()
        try:
            size, version = self._version(uri)
            cache = cache_here(self.cache) if size is not None else None
            if cache is None:
                got.data = self._download(uri, size, got)
                return got
            entry = cache.path_for(uri, version)
            p, got.ahead = cache.check(entry, size, not ahead)
            if p is None:
                lock = cache.lock_at(entry)  # another process may be fetching it: wait, then hit
                if not wait and not lock.try_enter():  # a fetch thread never waits on a lock: left to the reader
                    got.busy = True
                    return got
                if wait:
                    lock.__enter__()
                try:
                    p, got.ahead = cache.check(entry, size, not ahead)
                    if p is None:
                        got.data = self._download(uri, size, got)
                        p = cache.put_at(entry, got.data, ahead, count, got.retries)
                        got.admitted = p is not None
                        got.path = p
                        return got
                finally:
                    lock.__exit__(None, None, None)
            got.hit, got.path = True, p
            if not want_path or is_pack(p):  # a member of a pack is no file of its own
                got.data = read_entry(p)
        except Exception as e:
            got.error = e
        return got

    def _read_hit(self, uri: str, path: str, ahead: int = 0, st: Any = None) -> _Got:
        """An entry :meth:`_submit` found (``st``: its ``stat`` then), read where it is consumed
        (the full path if it went meanwhile: evicted by another process)."""
        try:
            return _Got(data=read_entry(path, st), path=path, hit=True, ahead=ahead)
        except OSError:
            return self._get(uri, False)

    def _report(self, got: _Got, waited_s: float = 0.0) -> None:
        n = len(got.data) if got.data is not None else 0
        counts = ahead_counts.take_background()
        counts["retries"] = counts.get("retries", 0) + got.retries
        counts["store_wait_ms"] = 1000 * waited_s
        if got.error is None:
            if got.hit:  # fetched ahead of this read: a miss (from the store for it), read from the cache
                counts.update(cache_bytes=n, **{"cache_misses" if got.ahead else "cache_hits": 1})
                ahead_counts.count_get_at_take(counts, got.ahead, n, got.path or "")
            else:  # a miss only where there is a cache to miss (cache=False: no hit ratio)
                counts.update(cache_misses=1 if self.cache.enabled else 0, not_admitted=0 if got.admitted else 1,
                              objects_read=counts.get("objects_read", 0) + 1,
                              bytes_read=counts.get("bytes_read", 0) + n)
        report_counters(counts)

    def read_many(self, uris: Sequence[str], ahead: Sequence[str] = (),
                  ahead_after_s: float = 0.0) -> Iterator[tuple[str, Union[bytes, BaseException]]]:
        """Each object's bytes (or the exception that read raised), in the order given.

        All of ``uris`` are asked for at once (up to ``max_bytes`` of this task, and of the
        process's :data:`~sbloader.sources.inflight.BYTES` budget; the rest as the first are
        consumed), then ``ahead`` (the next partitions' objects) is fetched into the cache
        behind them (:meth:`prefetch`), in the process's fetch pool, once every one of them
        is answered (:func:`~sbloader.sources.inflight.when_answered`: before, the first partition of an epoch, its task
        alone, waited 2-3 round trips more for its GETs). The read does not wait
        for its fetch-ahead: the read that takes an object fetched ahead counts its GET
        (:data:`~sbloader.sources.cache.COUNT_MARK`; before #47 a ``decode=False`` task's
        block, and so a fused decode, waited for the next partitions' GETs to count them).
        With ``ahead_after_s``, ``ahead`` is fetched only when the objects took at least that
        many seconds to be answered (a round trip long enough for the next reads to wait on).
        """
        if not uris:
            return
        ex = pool(self.max_in_flight)
        sizes = [int(self._version(u)[0] or 0) for u in uris]
        futures: list = []
        held = [0, 0]  # bytes submitted and not yet consumed, objects submitted

        def submit_more() -> None:
            while held[1] < len(uris) and (held[0] == 0 or held[0] + sizes[held[1]] <= self.max_bytes) \
                    and BYTES.take(sizes[held[1]], self.max_bytes, alone=held[0] == 0):
                futures.append(self._submit(ex, uris[held[1]], looks[held[1]]))
                held[0] += sizes[held[1]]
                held[1] += 1

        asked = time.perf_counter()
        looks = self._looks(uris)  # every entry looked at (and its marks taken) at once
        submit_more()
        budget = self.max_bytes - held[0]

        def fetch_ahead() -> None:
            if time.perf_counter() - asked >= ahead_after_s:  # (prefetch of nothing returns at once)
                self.prefetch(ahead, budget=budget, count=True, pack=len(uris))

        when_answered([f for f in futures if not isinstance(f, tuple)], fetch_ahead)
        waited = Waited()
        pending: list = []  # fetched, their entries' locks held: cached as one pack at the end
        packed: list = []
        whole = False  # every object handed on (else the reader stopped early, or one raised)
        try:
            for i, uri in enumerate(uris):
                if i == held[1]:  # the process's budget was spent by others: this one goes alone
                    submit_more()
                f = futures[i]
                got = self._read_hit(uri, *f) if isinstance(f, tuple) else waited.block(f.result)
                if got.busy:  # another has the entry's lock: wait for it here, holding none (no cycle) unless
                    if not got.here:  # the holder is this process's fetch ahead (it waits on no lock)
                        rest = [g.result() for g in futures[i + 1:] if g is not None and not isinstance(g, tuple)]
                        packed += pack_fetch.write_pack(self, pending + rest)  # what came so far cached, locks let go
                    got = waited.block(self._get, uri, False)
                futures[i] = None  # drop the bytes once handed on
                if got.lock is not None:
                    pending.append(got)
                held[0] -= sizes[i]
                BYTES.give(sizes[i])
                submit_more()
                self._report(got, waited.seconds)
                waited.seconds = 0.0
                yield uri, got.error if got.error is not None else got.data
            whole = True
        finally:  # a reader that stops early hands back what it had asked for, and caches what came
            BYTES.give(held[0])
            pending += [f.result() for f in futures if f is not None and not isinstance(f, tuple)]
            # Read whole in a task: the pack is written while the task's operators (the decode) run.
            if not (whole and pack_fetch.write_later(self, pending, packed)):
                packed += pack_fetch.write_pack(self, pending)
                report_counters({"not_admitted": sum(1 for g in packed if not g.admitted)})
        # The fetch-ahead this read started is counted by the reads that take its objects.
        report_counters({"peak_in_flight": GAUGE.take_peak()})

    def _cached(self, uri: str, take: bool = True) -> tuple[Optional[str], int]:
        """The object's cache entry (its read time updated) or None, and the marks of a fetch
        ahead of this read (:meth:`DiskCache.check`; ``take``: this read takes them)."""
        return self._looks([uri], take)[0][:2]

    def _looks(self, uris: Sequence[str], take: bool = True) -> list:
        """``(entry path or None, marks taken, stat)`` of each object's cache entry
        (:meth:`DiskCache.check_many <sbloader.sources.cache.DiskCache.check_many>`: the marks of a
        pack's members taken together); ``(None, 0, None)`` with the cache off or for an unlisted object."""
        out: list = [(None, 0, None)] * len(uris)
        cache = cache_here(self.cache)
        if cache is None:
            return out
        at, entries = [], []
        for i, u in enumerate(uris):
            size, version = self._version(u)
            if size is not None:
                at.append(i)
                entries.append((cache.path_for(u, version), size))
        for i, look in zip(at, cache.check_many(entries, take)):
            out[i] = look
        return out

    def _submit(self, ex: Any, uri: str, look: tuple) -> Any:
        """A future of the object from the pool, or ``(path, ahead, stat)`` of its cache entry
        (``look``, from :meth:`_looks`): a hit is read where it is consumed (a thread hop costs
        more CPU than reading a cached file)."""
        if look[0] is not None:
            return look
        if not self.cache.enabled or self._version(uri)[0] is None:
            return ex.submit(self._get, uri, False)
        if ahead_counts.in_flight(cache_here(self.cache).root, uri):  # this process fetches it ahead now
            return pack_fetch.ahead_here()
        return ex.submit(pack_fetch.fetch_held, self, uri)  # cached in this read's pack

    def read(self, uri: str) -> bytes:
        """One object's bytes (from the cache when it holds them)."""
        t0 = time.perf_counter()
        got = self._get(uri, False)
        self._report(got, time.perf_counter() - t0)
        if got.error is not None:
            raise got.error
        return got.data

    def prefetch(self, uris: Sequence[str], budget: Optional[int] = None, collect: bool = False,
                 count: bool = False, pack: int = 0) -> list:
        """Fetch objects into the cache in the background, as many of them (from the first) as
        ``budget`` bytes allow (None: ``max_bytes``), and only when the cache has room for
        them now (a full cache admits nothing, so fetching ahead would read the objects
        twice). Reads filling the cache meanwhile can still leave one out: it is then read
        again when its partition runs.

        Args:
            count: the reads that take the objects count their GETs (``objects_read``,
                ``bytes_read``, ``prefetched``: :data:`~sbloader.sources.cache.COUNT_MARK`);
                otherwise the fetches' counts are the caller's (``collect``) or the next read's.
            pack: with ``count``, objects per pack (a partition's: its reader waits for no other's GETs).

        Returns:
            With ``collect``, the futures of the fetches, each giving its counts (the caller
            reports them); otherwise nothing, and the counts (retries only, with ``count``)
            are reported by the next read of this process.
        """
        if not self.cache.enabled or not uris:
            return []
        cache = cache_here(self.cache)
        uris = ahead_counts.not_in_flight(cache.root, uris)
        uris = [u for u, look in zip(uris, self._looks(uris, take=False)) if look[0] is None]
        sizes = [self._version(u)[0] for u in uris]
        if cache is None or not uris or any(s is None for s in sizes):
            return []
        budget = self.max_bytes if budget is None else budget
        total, n = 0, 0
        for s in sizes:
            if total + s > budget or not BYTES.take(s, self.max_bytes):
                break
            total, n = total + s, n + 1
        if not n or not cache.make_room(total):
            BYTES.give(total)
            return []
        ex = pool(self.max_in_flight)
        ahead_counts.started(cache.root, uris[:n])
        if count and not collect:  # a read task's fetch ahead: a pack per ``pack`` objects (a partition)
            for i in range(0, n, pack or n):
                pack_fetch.AheadPack(self, uris[i:min(n, i + (pack or n))], sizes[i:min(n, i + (pack or n))]).start(ex)
            return []
        futures = [ex.submit(self._prefetch_one, u, count) for u in uris[:n]]
        for f, u, s in zip(futures, uris, sizes):
            f.add_done_callback(lambda f, u=u, s=s: ahead_counts.done(cache.root, u, s))
        if collect:
            return futures
        for f in futures:
            f.add_done_callback(lambda f: ahead_counts.add_background(f.result()) if f.exception() is None else None)
        return []

    def _prefetch_one(self, uri: str, count: bool = False) -> dict:
        """Fetch one object into the cache, marked as fetched ahead; its counts (with ``count``,
        the GET is left to the read that takes the entry, unless the cache did not admit it)."""
        size, _ = self._version(uri)
        cache = cache_here(self.cache)
        if size is None or cache is None or not cache.make_room(size):
            return {}  # a full cache admits nothing: fetching ahead would only read it twice
        got = self._get(uri, True, ahead=True, count=count, wait=False)
        if got.error is None and not got.hit and got.data is not None and not (count and got.path is not None):
            return {"prefetched": 1, "objects_read": 1, "bytes_read": len(got.data), "retries": got.retries}
        if count and got.path is not None and not got.hit:
            return {}  # the entry carries its GET and retries to the read that takes it
        return {"retries": got.retries}


def remote_files(versions: dict, filesystem: Any, cache: bool, cache_dir: Any, cache_max_bytes: Optional[int],
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> Optional[RemoteFiles]:
    """The :class:`RemoteFiles` of a source whose listing found remote objects (``versions``)
    or that reads through the user's ``filesystem``; None for local paths only.

    Raises:
        ValueError: a cache argument or ``max_in_flight`` is invalid (naming it).
    """
    from sbloader.sources.cache import cache_config

    config = cache_config(cache, cache_dir, cache_max_bytes)
    check_max_in_flight(max_in_flight)
    if not versions and filesystem is None:
        return None
    return RemoteFiles(filesystem, config, dict(versions), max_in_flight)

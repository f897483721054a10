"""The node-local disk cache of remote objects: a later epoch reads no object bytes.

An object is stored under a name hashed from its URI and its version (size and
modification time from the listing), so a changed object, listed again, is a
different entry and is read from the store again. An entry is written to a
temporary file in the same folder and renamed into place (atomic), under an
exclusive lock on the entry (one byte of the directory's ``.locks`` file:
:class:`~sbloader.sources.cache_locks.EntryLock`), so several processes on one node (read tasks, ranks) share
one directory and download an object once. A hit is
checked against the listed size. The objects one read call fetches together are one file,
a *pack*, with a hard link per entry (:mod:`sbloader.sources.cache_packs`).

**The budget is the node's.** ``max_bytes`` bounds the bytes in the directory, all
the processes writing there together (read tasks of several datasets, ranks, the
driver's fetch while listing): every write reserves its bytes in the directory's
ledger first (:mod:`sbloader.sources.cache_ledger`), so the bytes on disk never pass
the budget however many processes share the directory. Processes that give different
budgets each keep their own below it (the smallest then holds for the directory).

**Eviction never throttles a read.** With ``max_bytes`` set, the writer evicts,
oldest last read first, only entries not read in the last :data:`PROTECT_S`
seconds (left over from other datasets or long ago); when no entry may go, the new
object is *not admitted* (it is served from memory and the read goes on at the
store's speed). So a dataset larger than the cache keeps a fixed part of itself
cached every epoch (hit rate = cache / dataset) instead of thrashing as plain LRU
does over repeated scans, and no read ever waits for room (the throttling a full
cache caused in mosaicml/streaming#339, #507).
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from sbloader.sources import cache_packs as packs
from sbloader.sources.cache_ledger import Ledger, scan, tmp_name
from sbloader.sources.cache_locks import LOCKS_NAME, EntryLock  # noqa: F401 (LOCKS_NAME: part of this module's API)
from sbloader.sources.cache_marks import (AHEAD_MARK, COUNT_MARK, MARKS, RETRY_MARK, owed_path,  # noqa: F401 (API)
                                          owed_retries, take_mark, take_pack_marks)

#: Entries read within this many seconds are never evicted to make room.
PROTECT_S = 600.0

#: A read sets its entry's read time only when it is older than this (a write to the inode per
#: read otherwise: every member of a pack shares one).
TOUCH_S = 30.0

#: The environment variable naming the cache directory.
CACHE_DIR_ENV = "SBLOADER_CACHE_DIR"

#: The mode bit of a pack (:mod:`sbloader.sources.cache_packs`).
PACK_MARK = packs.PACK_MARK


def default_cache_dir() -> str:
    """``$SBLOADER_CACHE_DIR``, else ``<tmp>/sbloader-cache-<uid>`` (resolved on the node that reads)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"sbloader-cache-{uid}")


@dataclass(frozen=True)
class CacheConfig:
    """How remote objects are cached on each node.

    Attributes:
        enabled: whether to cache at all.
        dir: the directory; None: :func:`default_cache_dir` on the node that reads.
        max_bytes: bound on the bytes cached (None: unbounded).
    """

    enabled: bool = True
    dir: Optional[str] = None
    max_bytes: Optional[int] = None


def cache_config(cache: bool, cache_dir: Optional[str], cache_max_bytes: Optional[int]) -> CacheConfig:
    """Validate the ``cache=``, ``cache_dir=`` and ``cache_max_bytes=`` arguments.

    Raises:
        ValueError: naming the argument that is wrong.
    """
    if not isinstance(cache, bool):
        raise ValueError(f"cache must be True or False, found {cache!r}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ValueError(f"cache_dir must be a path or None, found {cache_dir!r}")
    if cache_max_bytes is not None and (isinstance(cache_max_bytes, bool) or not isinstance(cache_max_bytes, int)
                                        or cache_max_bytes < 0):
        raise ValueError(f"cache_max_bytes must be an integer >= 0 or None (unbounded), found {cache_max_bytes!r}")
    d = os.path.abspath(os.path.expanduser(os.fspath(cache_dir))) if cache_dir is not None else None
    return CacheConfig(cache, d, cache_max_bytes)


@functools.lru_cache(maxsize=1 << 16)  # a read's look, its fetch's and the fetch ahead's ask for the same
def entry_name(uri: str, version: str) -> str:
    """The file name of an object's entry: a hash of its URI and version."""
    return hashlib.sha256(f"{uri}\0{version}".encode("utf-8", "surrogateescape")).hexdigest()


class DiskCache:
    """One process's handle on a node's cache directory.

    Args:
        root: the cache directory (created if missing).
        max_bytes: bound on the bytes cached (None: unbounded).
    """

    def __init__(self, root: str, max_bytes: Optional[int] = None) -> None:
        self.root = root.rstrip(os.sep) or os.sep
        self.max_bytes = max_bytes
        os.makedirs(root, exist_ok=True)
        self._ledger = Ledger(root)  # the directory's bytes, counted across the node's processes
        self._dirs: set = set()  # sub-folders this process made (or found)

    def path_for(self, uri: str, version: str) -> str:
        """Where an object's entry lives (whether or not it exists)."""
        name = entry_name(uri, version)
        return f"{self.root}{os.sep}{name[:2]}{os.sep}{name}"  # os.path.join's checks, per object, cost more

    def get(self, uri: str, version: str, size: int) -> Optional[str]:
        """The entry's path if it is cached with ``size`` bytes (its read time is updated), else None."""
        return self.hit(self.path_for(uri, version), size)

    def hit(self, p: str, size: int) -> Optional[str]:
        """:meth:`get` of the entry at ``p`` (:meth:`path_for`): a reader that computed the
        path once (a hash of the URI) uses it for the check, the lock and the write."""
        return self.check(p, size)[0]

    def check(self, p: str, size: int, take: bool = True) -> tuple[Optional[str], int]:
        """:meth:`hit`, and whether the entry was fetched ahead of its first reader
        (:meth:`put_at` with ``ahead``): that reader counts it as a miss (the object came
        from the store for it) and takes the mark off (``take``; False: a look that reads
        nothing, such as a fetch ahead's), so later reads count hits. The second value is the
        marks taken (0: none; ``AHEAD_MARK``, with ``COUNT_MARK`` when the reader also counts
        the GET), true where the entry was fetched ahead."""
        return self.check_many([(p, size)], take)[0][:2]

    def check_many(self, entries: Sequence[tuple[str, int]], take: bool = True) -> list:
        """:meth:`check` of each ``(entry path, size)``, as ``(path or None, marks taken, its stat)``:
        the marks of the members of one pack taken together (:func:`~sbloader.sources.cache_marks.take_pack_marks`),
        an inode's read time set once."""
        out: list = []
        marked: dict = {}  # a pack's inode -> the places in ``out`` of its members with marks to take
        touched: set = set()
        now = time.time()
        for p, size in entries:
            try:
                st = os.stat(p)
            except OSError:
                out.append((None, 0, None))
                continue
            pack = st.st_mode & PACK_MARK  # a member of a pack: its size is its footer's
            if st.st_size != size and not pack:
                out.append((None, 0, None))
                continue
            if now - st.st_mtime > TOUCH_S and (st.st_dev, st.st_ino) not in touched:  # the eviction's read time
                touched.add((st.st_dev, st.st_ino))
                try:
                    os.utime(p)
                except OSError:
                    out.append((None, 0, None))
                    continue
            ahead = st.st_mode & MARKS if st.st_mode & AHEAD_MARK else 0
            if ahead and take:
                if pack:
                    marked.setdefault((st.st_dev, st.st_ino), []).append(len(out))
                else:
                    ahead = take_mark(p)
            out.append((p, ahead, st))
        for places in marked.values():
            for i, marks in zip(places, take_pack_marks([out[i][0] for i in places], out[places[0]][2])):
                out[i] = (out[i][0], marks, out[i][2])
        return out

    def _makedirs(self, d: str) -> None:
        if d not in self._dirs:
            os.makedirs(d, exist_ok=True)
            self._dirs.add(d)

    def lock(self, uri: str, version: str) -> "EntryLock":
        """An exclusive lock on the entry across processes (hold it while downloading)."""
        return self.lock_at(self.path_for(uri, version))

    def lock_at(self, p: str) -> "EntryLock":
        """:meth:`lock` of the entry at ``p`` (:class:`~sbloader.sources.cache_locks.EntryLock`: a byte of
        one lock file, no file per entry)."""
        return EntryLock(self.root, p)

    def put(self, uri: str, version: str, data: bytes) -> Optional[str]:
        """Store ``data`` (atomically: a temporary file renamed into place) and return its path,
        or None when the cache is full of entries read too recently to evict."""
        return self.put_at(self.path_for(uri, version), data)

    def put_at(self, p: str, data: bytes, ahead: bool = False, count: bool = False,
               retries: int = 0) -> Optional[str]:
        """:meth:`put` into the entry at ``p``. The bytes are reserved in the directory's
        ledger before the first is written (:mod:`sbloader.sources.cache_ledger`), so the
        processes sharing the directory never hold more than ``max_bytes`` on disk together.
        ``ahead``: fetched ahead of its reader, marked so (:data:`AHEAD_MARK`, see :meth:`check`);
        ``count``: its reader counts the GET too (:data:`COUNT_MARK`), and the fetch's
        ``retries`` (:data:`RETRY_MARK`)."""
        n = len(data)
        retries = retries if ahead and count else 0
        d = os.path.dirname(p)
        self._makedirs(d)
        tmp = f"{d}/{tmp_name(n)}"  # unique to this process and thread (the entry's lock is held)
        with self._ledger.held():
            used = self._ledger.used()
            try:  # an entry of another version of the object (another size): replaced, its bytes freed
                old = os.stat(p).st_size
                os.unlink(p)
                used -= old
                self._ledger.write(used)
            except OSError:
                pass
            room = self._fit(used, n)
            if room is None:
                return None
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # the reservation, on disk
            if ahead:  # fchmod: the umask cannot drop the marks
                os.fchmod(fd, 0o644 | AHEAD_MARK | (COUNT_MARK if count else 0) | (RETRY_MARK if retries else 0))
            self._ledger.write(room + n)
        try:
            try:
                if retries:  # before the entry appears: its reader finds the count
                    with open(owed_path(p), "w") as f:
                        f.write(str(retries))
                packs.write_all(fd, [data])  # in pieces: see packs.WRITE_CHUNK
            finally:
                os.close(fd)
            with self._ledger.held():  # a recount sees the temporary file or the entry, never neither
                os.replace(tmp, p)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._ledger.add(-n)
            raise
        return p

    def put_pack(self, items: list, ahead: bool = False, count: bool = False) -> list:
        """Store several objects as one pack (:mod:`sbloader.sources.cache_packs`: one file, a
        hard link per entry; creating a file costs more CPU than writing it): ``items`` are
        ``(entry path, bytes, retries)``, each entry's lock held by the caller. The pack's bytes
        are reserved in the ledger before the first is written, as :meth:`put_at`'s; ``ahead``
        and ``count`` mark its members as :meth:`put_at` marks an entry. Whether each was
        admitted (all or none; each alone through :meth:`put_at` where the filesystem keeps
        no sticky bit on a file or makes no hard links)."""
        members, total = packs.layout(items, (AHEAD_MARK | (COUNT_MARK if count else 0)) if ahead else 0, RETRY_MARK)
        for p, _, _ in items:
            self._makedirs(os.path.dirname(p))
        tmp = f"{os.path.dirname(items[0][0])}/{tmp_name(total)}"
        with self._ledger.held():
            room = self._fit(self._ledger.used(), total)
            if room is None:
                return [False] * len(items)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._ledger.write(room + total)
        linked: list = []
        try:
            try:
                os.fchmod(fd, packs.pack_mode(members[0][3], AHEAD_MARK))
                if not os.fstat(fd).st_mode & PACK_MARK:
                    raise packs.NoPacks("the filesystem keeps no sticky bit on a file")
                packs.write_all(fd, [d for _, d, _ in items] + [packs.footer(members)])
            finally:
                os.close(fd)
            with self._ledger.held():  # a recount sees the temporary file or the links, never neither
                packs.link_members(tmp, [p for p, _, _ in items], linked)
                os.unlink(tmp)
        except BaseException as e:
            for p in [tmp] + linked:
                try:
                    os.unlink(p)
                except OSError:
                    pass
            self._ledger.add(-total)
            if isinstance(e, packs.NoPacks):  # no packs here (no sticky bit, no hard links): an entry each
                return [self.put_at(p, d, ahead, count, r) is not None for p, d, r in items]
            raise
        return [True] * len(items)

    def used_bytes(self) -> int:
        """Bytes of the entries in the directory (counted now)."""
        return sum(s for _, s, _ in scan(self.root)[0])

    def _fit(self, used: int, need: int) -> Optional[int]:
        """The bytes counted once ``need`` more fit (hold the ledger), evicting entries not read
        in the last :data:`PROTECT_S` seconds, oldest first, if they must; None when they cannot."""
        if self.max_bytes is None or used + need <= self.max_bytes:
            return used
        if need > self.max_bytes:
            return None
        entries, reserved = scan(self.root)  # the ledger may count too much (entries deleted by hand)
        used = sum(s for _, s, _ in entries) + reserved
        now = time.time()
        for mtime, size, paths in sorted(entries):
            if used + need <= self.max_bytes or now - mtime < PROTECT_S:
                break
            try:  # a pack goes whole: every entry linked to it
                for path in paths:
                    os.unlink(path)
                used -= size
            except OSError:
                pass
        self._ledger.write(used)
        return used if used + need <= self.max_bytes else None

    def make_room(self, need: int) -> bool:
        """Whether ``need`` more bytes fit in the directory's budget now, after evicting entries
        not read in the last :data:`PROTECT_S` seconds (oldest first) if they must. Nothing is
        reserved: :meth:`put_at` reserves."""
        if self.max_bytes is None:
            return True
        if need > self.max_bytes:
            return False
        with self._ledger.held():
            return self._fit(self._ledger.used(), need) is not None


_CACHES: dict[tuple[str, Optional[int]], DiskCache] = {}
_CACHES_LOCK = threading.Lock()


def cache_here(config: CacheConfig) -> Optional[DiskCache]:
    """This process's :class:`DiskCache` for ``config`` (None when caching is off)."""
    if not config.enabled:
        return None
    root = config.dir or default_cache_dir()
    key = (root, config.max_bytes)
    with _CACHES_LOCK:
        c = _CACHES.get(key)
        if c is None:
            c = _CACHES[key] = DiskCache(root, config.max_bytes)
        return c

"""The packs a process reads from, kept open (:mod:`sbloader.sources.cache_packs`).

A read task takes a partition's objects from one pack, one member after the other. Opening
the pack for each member (a path walk, ``open``, ``fstat``, a ``pread`` of its tail for its
id, ``close``) cost five system calls an object where one ``pread`` reads the bytes; on this
project's 2-core VM every system call under the GIL's turn-taking also costs a thread
hand-off (#47). So a process keeps the last :data:`KEPT` packs it read open, each found by
its inode: ``(st_dev, st_ino)`` of the entry's ``stat``. An inode held open cannot be freed,
so no other file can take its number while the descriptor is kept: a ``stat`` that gives the
same pair names this very pack, even after an eviction unlinked it (its bytes stay readable
until closed; at most :data:`KEPT` packs' bytes outlive their eviction on disk).

A descriptor is closed only when no thread uses it (:func:`held`), so a ``pread`` never
reads a number that another ``open`` took meanwhile. A forked child forgets the parent's
(their threads' counts mean nothing there) and closes its copies.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, Optional

#: Packs one process keeps open, at most (the least recently read is closed first), and their
#: bytes together (the newest is kept whatever its size). A shuffled epoch reads each object of a
#: partition from another pack (the packs are an earlier epoch's partitions): with 8, the 2,000
#: objects of 32 packs were an ``open`` and a footer each, 0.040 ms an object read from the cache
#: against 0.026 with all of them kept (#47). An evicted pack's bytes stay on disk while it is
#: kept (at most :data:`KEPT_BYTES` a process): a kept pack was read recently, so the eviction
#: (of entries not read in ``PROTECT_S``) rarely takes one.
KEPT = 256
KEPT_BYTES = 128 * 2 ** 20


def _fd_share() -> int:
    """An eighth of this process's limit of open files (the packs kept may take no more)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return KEPT
    return KEPT if soft == resource.RLIM_INFINITY else max(8, soft // 8)


KEPT = min(KEPT, _fd_share())


class OpenPack:
    """One pack held open: its descriptor and size, its footer's records (``records``: read once by
    the first reader) and a lock for its members' marks among this process's threads (a
    ``flock`` on one shared descriptor does not keep them apart)."""

    __slots__ = ("fd", "size", "users", "dropped", "records", "records_at", "marks_lock")

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.users = 0
        self.dropped = False
        self.records: Optional[bytes] = None
        self.records_at = 0  # where the footer's records start (set with ``records``)
        self.marks_lock = threading.Lock()


_OPEN: "OrderedDict[tuple[int, int], OpenPack]" = OrderedDict()
_LOCK = threading.Lock()
_KEPT_BYTES = [0]  # the kept packs' bytes


def _release(o: OpenPack) -> None:
    with _LOCK:
        o.users -= 1
        close = o.dropped and o.users == 0
    if close:
        os.close(o.fd)


@contextmanager
def held(path: str, st: os.stat_result, mark: int) -> Iterator[Optional[OpenPack]]:
    """The open pack whose inode ``st`` (the ``stat`` of the entry at ``path``) names, opened
    through ``path`` when this process holds none (for reading and, where this user may, for
    writing its marks); None when what ``path`` opens is not a pack (``mark``, the mode bit of
    one, not in its mode). The descriptor stays open while the block runs.

    Raises:
        OSError: the entry went (evicted) before it was opened.
    """
    key = (st.st_dev, st.st_ino)
    with _LOCK:
        o = _OPEN.get(key)
        if o is not None:
            o.users += 1
            _OPEN.move_to_end(key)
    if o is None:
        o = _open(path, mark)
        if o is None:
            yield None
            return
    try:
        yield o
    finally:
        _release(o)


def _open(path: str, mark: int) -> Optional[OpenPack]:
    """Open the pack at ``path`` and keep it (one user: the caller), or None when it is not a pack."""
    try:
        fd = os.open(path, os.O_RDWR)
    except PermissionError:  # another user's cache: readable, its marks stay (see cache.check)
        fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not st.st_mode & mark:
        os.close(fd)
        return None
    key = (st.st_dev, st.st_ino)
    drop: list = []
    with _LOCK:
        o = _OPEN.get(key)
        if o is not None:  # another thread opened it meanwhile: use that one
            drop.append(fd)
        else:
            o = _OPEN[key] = OpenPack(fd, st.st_size)
            _KEPT_BYTES[0] += st.st_size
            while len(_OPEN) > 1 and (len(_OPEN) > KEPT or _KEPT_BYTES[0] > KEPT_BYTES):
                _, old = _OPEN.popitem(last=False)
                _KEPT_BYTES[0] -= old.size
                old.dropped = True
                if old.users == 0:
                    drop.append(old.fd)
        o.users += 1
        _OPEN.move_to_end(key)
    for d in drop:
        os.close(d)
    return o


def forget_all() -> None:
    """Close every pack this process keeps open (once no thread reads it)."""
    with _LOCK:
        kept = list(_OPEN.values())
        _OPEN.clear()
        _KEPT_BYTES[0] = 0
        for o in kept:
            o.dropped = True
        idle = [o.fd for o in kept if o.users == 0]
    for fd in idle:
        os.close(fd)


def _after_fork() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # a parent's thread may have held it at the fork
    for o in _OPEN.values():
        try:
            os.close(o.fd)
        except OSError:
            pass
    _OPEN.clear()
    _KEPT_BYTES[0] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

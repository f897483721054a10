"""Locks of a cache directory's entries, across processes and threads (:class:`EntryLock`).

Moved out of :mod:`sbloader.sources.cache` unchanged (its module was at the size limit).
"""
from __future__ import annotations

import os
import struct
from typing import Optional


class _FileLock:
    """``fcntl.flock`` on a lock file, as a context manager (a no-op where fcntl is missing)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd: Optional[int] = None

    def __enter__(self) -> "_FileLock":
        self.take(True)
        return self

    def take(self, wait: bool) -> bool:
        """Take the lock (``wait``: until it is free; else only if free now); whether taken."""
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except ImportError:
            pass
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            return False
        return True

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock
            self._fd = None


#: The lock file of a cache directory: each entry's lock is one byte of it (:class:`EntryLock`).
LOCKS_NAME = ".locks"

try:
    import fcntl as _fcntl

    _OFD_SETLKW = getattr(_fcntl, "F_OFD_SETLKW", None)
    _OFD_SETLK = getattr(_fcntl, "F_OFD_SETLK", None)
    _WRLCK = _fcntl.F_WRLCK
except ImportError:  # no fcntl here
    _OFD_SETLKW = _OFD_SETLK = _WRLCK = None
_OFD_OK = [_OFD_SETLKW is not None]  # False once a filesystem refused an OFD lock: lock files then


class EntryLock:
    """An exclusive lock on one entry, across processes and threads: a Linux open-file-description
    lock (``F_OFD_SETLKW``) on the byte of the directory's :data:`LOCKS_NAME` file numbered by the
    entry's hash, on a descriptor of its own (closing it lets go; so does the death of its
    process). No file is created per entry: creating the ``.lock`` file cost about 0.05 ms of
    CPU per object, a third of the entry's own write. Where OFD locks are missing (not Linux,
    a filesystem that refuses them) it falls back to ``flock`` on ``<entry>.lock``."""

    def __init__(self, root: str, entry: str) -> None:
        self._root, self._entry = root, entry
        self._fd: Optional[int] = None
        self._fallback: Optional[_FileLock] = None

    def __enter__(self) -> "EntryLock":
        self._take(True)
        return self

    def try_enter(self) -> bool:
        """Take the lock only if it is free now (a fetch thread never waits on an entry another
        holds: the holder may need that very thread to let go); whether taken."""
        return self._take(False)

    def _take(self, wait: bool) -> bool:
        if _OFD_OK[0] and (wait or _OFD_SETLK is not None):
            fd = os.open(os.path.join(self._root, LOCKS_NAME), os.O_RDWR | os.O_CREAT, 0o644)
            byte = int(os.path.basename(self._entry)[:15], 16)  # 60 bits of the hash: apart for apart entries
            try:
                _fcntl.fcntl(fd, _OFD_SETLKW if wait else _OFD_SETLK,
                             struct.pack("hhqqi", _WRLCK, os.SEEK_SET, byte, 1, 0))
                self._fd = fd
                return True
            except (BlockingIOError, PermissionError):  # EAGAIN/EACCES: held by another
                os.close(fd)
                return False
            except OSError:  # EINVAL, ENOLCK...: this filesystem has no OFD locks
                os.close(fd)
                _OFD_OK[0] = False
        os.makedirs(os.path.dirname(self._entry), exist_ok=True)
        lock = _FileLock(self._entry + ".lock")
        if not lock.take(wait):
            return False
        self._fallback = lock
        return True

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the description releases its lock
            self._fd = None
        if self._fallback is not None:
            self._fallback.__exit__(*exc)
            self._fallback = None

"""Locks of a cache directory's entries, across processes and threads (:class:`EntryLock`)."""
from __future__ import annotations

import os
import struct
import threading
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
    entry's hash (the death of its process lets go). No file is created per entry: creating the
    ``.lock`` file cost about 0.05 ms of CPU per object, a third of the entry's own write.

    A process takes its locks on one descriptor of that file, opened once (:func:`_shared_fd`;
    opening and closing it for each entry were two of the cache's system calls an object, #47).
    Locks of one open file description do not exclude each other, so the threads of the process
    first take the byte among themselves (``_HELD``), then from the other processes. Where OFD
    locks are missing (not Linux, a filesystem that refuses them) it falls back to ``flock`` on
    ``<entry>.lock``."""

    def __init__(self, root: str, entry: str) -> None:
        self._root, self._entry = root, entry
        self._held: Optional[tuple] = None  # (lock file, byte, descriptor, pid) while held
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
            key = (os.path.join(self._root, LOCKS_NAME), int(os.path.basename(self._entry)[:15], 16))
            if not _hold_here(key, wait):  # 60 bits of the hash: apart for apart entries
                return False
            try:
                fd = _shared_fd(key[0])
                _fcntl.fcntl(fd, _OFD_SETLKW if wait else _OFD_SETLK, struct.pack("hhqqi", _WRLCK, os.SEEK_SET,
                                                                                   key[1], 1, 0))
                self._held = (key[0], key[1], fd, _PID[0])
                return True
            except (BlockingIOError, PermissionError):  # EAGAIN/EACCES: held by another process
                _let_go_here(key)
                return False
            except OSError:  # EINVAL, ENOLCK...: this filesystem has no OFD locks
                _let_go_here(key)
                _OFD_OK[0] = False
        os.makedirs(os.path.dirname(self._entry), exist_ok=True)
        lock = _FileLock(self._entry + ".lock")
        if not lock.take(wait):
            return False
        self._fallback = lock
        return True

    def __exit__(self, *exc) -> None:
        if self._held is not None:
            path, byte, fd, pid = self._held
            self._held = None
            if pid == _PID[0]:  # a forked child's copy lets go of nothing (the byte is its parent's)
                try:
                    _fcntl.fcntl(fd, _OFD_SETLK, struct.pack("hhqqi", _fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))
                finally:
                    _let_go_here((path, byte))
        if self._fallback is not None:
            self._fallback.__exit__(*exc)
            self._fallback = None


_SHARED: dict = {}  # lock file -> the descriptor this process takes its entries' locks on
_PID = [os.getpid()]  # this process's (set again in a forked child: os.getpid is a system call a lock)
_HELD: set = set()  # (lock file, byte) held by a thread of this process
_COND = threading.Condition()


def _shared_fd(path: str) -> int:
    """This process's descriptor of the lock file ``path`` (opened once; again in a forked child)."""
    with _COND:
        fd = _SHARED.get(path)
        if fd is None:
            fd = _SHARED[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        return fd


def _hold_here(key: tuple, wait: bool) -> bool:
    """Take ``key`` among this process's threads (``wait``: until free); whether taken."""
    with _COND:
        while key in _HELD:
            if not wait:
                return False
            _COND.wait()
        _HELD.add(key)
        return True


def _let_go_here(key: tuple) -> None:
    with _COND:
        _HELD.discard(key)
        _COND.notify_all()


def _after_fork() -> None:
    global _COND
    _COND = threading.Condition()  # a parent's thread may have held it at the fork
    _PID[0] = os.getpid()
    _HELD.clear()  # the parent's threads' bytes: none of this process's
    for fd in _SHARED.values():  # the parent's description (its locks): never used here
        try:
            os.close(fd)
        except OSError:
            pass
    _SHARED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

"""The node-wide count of a cache directory's bytes, shared by every process that writes there.

A cache directory is shared by the processes of one node (Ray workers, ranks, the
driver), so its byte budget (``cache_max_bytes``) is the directory's, not a process's.
The bytes are counted in a ledger file in the directory (``.ledger``, one integer),
read and changed only under an exclusive ``flock`` on it: a writer *reserves* an
entry's bytes there before it writes the first byte (evicting first if it must), and
an eviction takes the bytes off after the file is gone. So the bytes on disk are never
more than the ledger says, and the ledger never more than the budget.

A reservation is visible on disk as the writer's temporary file, whose name carries
its size (``.tmp-<pid>-<thread>-<bytes>``, created under the ledger's lock), so a
recount (:meth:`Ledger.recount`: the ledger is new, or the budget looks spent) counts
the entries *and* the writes under way; a temporary file of a process that is gone is
deleted. A ledger that counts too much (entries deleted by hand) is set right by the
next recount, which a write that finds no room always makes.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

#: The ledger's file name, in the cache directory.
LEDGER_NAME = ".ledger"

#: The prefix of a write under way's temporary file.
TMP_PREFIX = ".tmp-"


def tmp_name(nbytes: int) -> str:
    """The temporary file name of a write of ``nbytes`` by this process and thread."""
    return f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{nbytes}"


def reserved_bytes(name: str) -> Optional[tuple[int, int]]:
    """``(pid, bytes)`` of a temporary file's name (:func:`tmp_name`), or None for another name."""
    if not name.startswith(TMP_PREFIX):
        return None
    parts = name[len(TMP_PREFIX):].split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[2])


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def scan(root: str) -> tuple[list[tuple[float, int, tuple]], int]:
    """The entries of a cache directory, ``(read time, bytes, paths)`` each, and the bytes of
    the writes under way (temporary files of live processes; those of dead ones are deleted).
    Entries linked to one file (the members of a pack: :mod:`sbloader.sources.cache_packs`)
    are one entry of that file's bytes, with every path."""
    entries, reserved = [], 0
    by_inode: dict = {}
    for sub in os.scandir(root):
        if not sub.is_dir():
            continue
        for e in os.scandir(sub.path):
            if e.name.endswith(".lock"):
                continue
            r = reserved_bytes(e.name)
            if r is not None:
                if _alive(r[0]):
                    reserved += r[1]
                else:
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass
                continue
            if e.name.startswith("."):
                continue
            try:
                st = e.stat()
            except OSError:
                continue
            if st.st_nlink > 1 and st.st_ino in by_inode:
                i = by_inode[st.st_ino]
                entries[i] = entries[i][:2] + (entries[i][2] + (e.path,),)
                continue
            by_inode[st.st_ino] = len(entries)
            entries.append((st.st_mtime, st.st_size, (e.path,)))
    return entries, reserved


class Ledger:
    """One process's handle on a cache directory's ledger.

    Args:
        root: the cache directory.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LEDGER_NAME)
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self._pid = 0

    def _open(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked child opens its own (flock is per open file)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        return self._fd

    @contextmanager
    def held(self) -> Iterator["Ledger"]:
        """The ledger, exclusively (threads of this process and other processes wait)."""
        with self._lock:
            fd = self._open()
            try:
                import fcntl
            except ImportError:  # no flock here: one process's threads only
                yield self
                return
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def read(self) -> Optional[int]:
        """The bytes counted (hold :meth:`held`); None for a ledger not counted yet."""
        fd = self._open()
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 32).strip()
        return int(raw) if raw.isdigit() else None

    def write(self, used: int) -> None:
        """Set the bytes counted (hold :meth:`held`)."""
        fd = self._open()
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(max(0, int(used))).encode().ljust(20))  # always 20 bytes: no old digits left

    def used(self) -> int:
        """The bytes counted (hold :meth:`held`), recounted when the ledger is new."""
        n = self.read()
        return self.recount() if n is None else n

    def recount(self) -> int:
        """Count the directory again (hold :meth:`held`), write the count and return it."""
        entries, reserved = scan(self.root)
        n = sum(s for _, s, _ in entries) + reserved
        self.write(n)
        return n

    def add(self, delta: int) -> int:
        """Add ``delta`` bytes (negative: taken off) under the lock; the new count."""
        with self.held():
            n = self.used() + delta
            self.write(n)
            return n

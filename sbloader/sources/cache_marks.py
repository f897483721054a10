"""The marks of a cache entry fetched ahead of its first reader, and the one reader that takes them.

An object fetched ahead (while listing, or by the read task before its reader) is written
marked: its first reader counts a cache miss (the object came from the store for it), and,
fetched ahead by a read task, its GET and the fetch's retries. The marks are mode bits of an
entry of its own, or a byte of its record in the footer of a pack
(:mod:`sbloader.sources.cache_packs`); exactly one reader takes them, under an exclusive
``flock``. A read task takes the marks of its partition's members of one pack at once
(:func:`take_pack_marks`: one ``flock``, one ``pread`` and one ``pwrite`` of the footer's
records for them all, not four system calls a member, each a thread hand-off under the GIL
on the project's 2-core VM, #47).
"""
from __future__ import annotations

import os
from typing import Sequence

from sbloader.sources import cache_packs as packs

#: The mode bit (the owner's execute bit, never set on an entry otherwise) marking an entry
#: fetched ahead of its first reader: that read counts a cache miss, not a hit, so a cold
#: epoch's hit ratio is 0 whatever was fetched ahead (while listing, or by an earlier task).
AHEAD_MARK = 0o100

#: The mode bit (the group's execute bit) marking an entry fetched ahead by a read task (beside
#: :data:`AHEAD_MARK`): the read that takes it also counts its GET (``objects_read``,
#: ``bytes_read``, ``prefetched``), so the task that fetched it need not wait for it to count it.
COUNT_MARK = 0o010

#: The mode bit (the others' execute bit) marking an entry beside :data:`COUNT_MARK` whose fetch
#: ahead retried: the count waits in a hidden file beside the entry (:func:`owed_retries`), so
#: the read that takes the entry counts the retries too, in whichever process it runs. Before,
#: they waited for the fetching process's next read, and a fetch ahead that retried after that
#: process's last read of the epoch went uncounted.
RETRY_MARK = 0o001

#: Every mark.
MARKS = AHEAD_MARK | COUNT_MARK | RETRY_MARK


def owed_path(p: str) -> str:
    """The hidden file beside the entry at ``p`` holding its fetch ahead's retries (a name the
    ledger's scan skips: :func:`sbloader.sources.cache_ledger.scan`)."""
    d, name = os.path.split(p)
    return os.path.join(d, f".{name}.retries")


def owed_retries(p: str) -> int:
    """The retries of the fetch ahead that wrote the entry at ``p`` (:data:`RETRY_MARK`), for
    the one reader that took the mark; the file holding them is removed (0 when it is gone)."""
    owed = packs.pop_owed(p)  # a member of a pack: its footer held them
    if owed is not None:
        return owed
    try:
        with open(owed_path(p)) as f:
            n = int(f.read() or 0)
        os.unlink(owed_path(p))
        return n
    except (OSError, ValueError):
        return 0


def take_mark(p: str) -> int:
    """Take the marks (:data:`AHEAD_MARK`, :data:`COUNT_MARK`) off the entry at ``p``; the marks
    taken for the one reader that took them, 0 for the others (under an exclusive ``flock`` on the
    entry: two readers that both saw the mark count one miss, not two). An entry this user cannot
    change stays marked (each read of it counts a miss; none counts its GET)."""
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return 0
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:  # no flock here: as before, each reader that saw the mark counts a miss
            pass
        mode = os.fstat(fd).st_mode
        if not mode & AHEAD_MARK:
            return 0  # another reader took it first
        try:
            os.fchmod(fd, mode & 0o777 & ~MARKS)
        except OSError:
            return AHEAD_MARK
        return mode & MARKS
    finally:
        os.close(fd)  # closing releases the flock


def take_pack_marks(paths: Sequence[str], st: os.stat_result) -> list[int]:
    """:func:`take_mark` of members of one pack (``st``: the ``stat`` of their entries, which share
    its inode), all under one lock of the pack; their retries kept for :func:`owed_retries`."""
    out = []
    for p, (marks, retries) in zip(paths, packs.take_members_marks(paths, st, AHEAD_MARK)):
        if marks & RETRY_MARK:
            packs.owe(p, retries)
        out.append(marks)
    return out

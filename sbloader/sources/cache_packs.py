"""Packs: the objects of one read call in one cache file, each under its own entry name.

On the 2-core VM this project is measured on, *creating* a file costs far more CPU than
writing its bytes: with GETs in flight, one empty file took 0.25–0.6 ms of CPU, a hard
link 0.03 ms, writing 110 KB into an open file 0.03 ms. A read task that cached each
object of its partition as a file of its own spent more CPU on the cache than on the
GET (#47). A pack holds the objects one read call fetched (its partition, or the
partitions it fetched ahead) in one file: their bytes, then a footer naming each member
(its entry's hash, offset, size, the marks of a fetch ahead and its retries). Each
member's entry (:meth:`~sbloader.sources.cache.DiskCache.path_for`) is a hard link to
the pack, so a lookup is the ``stat`` of the entry as before; a pack is told by
:data:`PACK_MARK` in its mode and the member is read at its offset, with one ``pread``
from the pack the process keeps open (:mod:`sbloader.sources.open_packs`).

The links share the pack's inode, so the pack has one read time (eviction takes a pack
whole, every link: :func:`~sbloader.sources.cache_ledger.scan` counts an inode once),
one byte count and one reservation in the directory's ledger. The marks of a member
fetched ahead (:data:`~sbloader.sources.cache.AHEAD_MARK` and the others) are a byte of
its footer record, taken by exactly one reader under an exclusive ``flock`` on the pack
(:func:`take_members_marks`); the pack's mode carries ``AHEAD_MARK`` while any member has
marks left, so a lookup of a pack with none left reads no footer.
"""
from __future__ import annotations

import os
import struct
import threading
from typing import Any, Optional, Sequence

from sbloader.sources import open_packs

#: The mode bit (the sticky bit, which Linux ignores on a file) telling a pack from an entry.
PACK_MARK = 0o1000

_MAGIC = b"SBLPACK1"
_RECORD = struct.Struct("<32sQQBI")  # entry hash, offset, size, marks, retries owed
_TAIL = struct.Struct("<I16s8s")  # members, pack id, magic
_MARKS_AT = 32 + 8 + 8  # the marks byte's place in a record
_OWED: dict = {}  # entry path -> retries of its fetch ahead, taken with its marks, not yet counted
_OWED_LOCK = threading.Lock()


class NoPacks(OSError):
    """This filesystem cannot hold packs (it keeps no sticky bit on a file, or makes no hard links)."""


def owe(path: str, retries: int) -> None:
    """Keep the retries a member's marks carried for the read that took them (:func:`pop_owed`)."""
    with _OWED_LOCK:
        _OWED[path] = retries


def pop_owed(path: str) -> Optional[int]:
    """The retries :func:`owe` kept for ``path`` (then forgotten); None when none are kept."""
    with _OWED_LOCK:
        return _OWED.pop(path, None)


def footer(members: list[tuple[str, int, int, int, int]]) -> bytes:
    """A pack's footer: ``(entry name, offset, size, marks, retries)`` per member, then
    their count, the pack's id (random) and the magic."""
    out = [_RECORD.pack(bytes.fromhex(name), off, size, marks, retries) for name, off, size, marks, retries in members]
    return b"".join(out) + _TAIL.pack(len(members), os.urandom(16), _MAGIC)


#: Bytes of a pack's end read at once for its footer: its tail and up to 77 records (a partition's members).
_END_READ = 4096


def _footer(fd: int, size: int) -> tuple[bytes, int, bytes]:
    """The pack's id, its first record's place and its records' raw bytes (the file ``size`` long):
    one ``pread`` of its end where the records fit in :data:`_END_READ`."""
    if size < _TAIL.size:
        raise OSError("not a pack: too short")
    end = os.pread(fd, min(size, _END_READ), size - min(size, _END_READ))
    n, pack_id, magic = _TAIL.unpack_from(end, len(end) - _TAIL.size)
    start = size - _TAIL.size - n * _RECORD.size
    if magic != _MAGIC or start < 0:
        raise OSError("not a pack: no footer")
    if n * _RECORD.size + _TAIL.size <= len(end):
        return pack_id, start, end[len(end) - _TAIL.size - n * _RECORD.size:len(end) - _TAIL.size]
    return pack_id, start, os.pread(fd, n * _RECORD.size, start)


def _records(o: Any) -> bytes:
    """The footer's records of the open pack ``o`` as read once (the members' places never change;
    their marks do, and are read afresh: :func:`take_members_marks`)."""
    raw = o.records
    if raw is None:
        _, start, raw = _footer(o.fd, o.size)
        o.records_at = start
        o.records = raw  # after records_at: a thread that sees the records sees where they start
    return raw


def _index(raw: bytes, path: str) -> int:
    """The record of the member at ``path`` (its entry name, a digest) among ``raw``, or -1: found by
    ``bytes.find`` (a read task of a shuffled epoch opens a pack an object: parsing every record of
    it each time cost 0.03-0.05 ms an object, #47)."""
    digest = bytes.fromhex(os.path.basename(path))
    at = raw.find(digest)
    while at >= 0 and at % _RECORD.size:
        at = raw.find(digest, at + 1)
    return -1 if at < 0 else at // _RECORD.size


def _place(o: Any, path: str) -> tuple[int, int, int]:
    """``(its record's place, offset, size)`` of the member at ``path`` of the open pack ``o``."""
    raw = _records(o)
    i = _index(raw, path)
    if i < 0:
        raise OSError(f"{path!r} is not a member of its pack")
    _, off, n, _, _ = _RECORD.unpack_from(raw, i * _RECORD.size)
    return o.records_at + i * _RECORD.size, off, n


def read_entry(path: str, st: Optional[os.stat_result] = None) -> bytes:
    """An entry's bytes: the whole file, or its member of a pack (one ``pread`` from the pack
    this process keeps open: :mod:`sbloader.sources.open_packs`); ``st``: the entry's ``stat``
    where the caller's look took it (none again).

    Raises:
        OSError: the entry went (evicted) or its pack does not hold it.
    """
    st = os.stat(path) if st is None else st
    if st.st_mode & PACK_MARK:
        with open_packs.held(path, st, PACK_MARK) as o:
            if o is not None:
                _, off, n = _place(o, path)
                return _pread_all(o.fd, n, off, path)
    fd = os.open(path, os.O_RDONLY)  # a file of its own (or replaced by one meanwhile)
    try:
        return _pread_all(fd, os.fstat(fd).st_size, 0, path)
    finally:
        os.close(fd)


def _pread_all(fd: int, n: int, off: int, path: str) -> bytes:
    data = os.pread(fd, n, off)
    if len(data) != n:
        raise OSError(f"{path!r}: cut short ({len(data)} of {n} bytes)")
    return data


def take_members_marks(paths: Sequence[str], st: os.stat_result, ahead_mark: int) -> list[tuple[int, int]]:
    """Take the marks of the members at ``paths`` of one pack (``st``: the ``stat`` of their
    entries) for the one reader that takes them: ``(marks, retries owed)`` each, ``(0, 0)``
    for those another took (or that are not the pack's). Under an exclusive ``flock`` on the
    pack (and its lock among this process's threads, which share its descriptor): one
    ``pread`` of its footer's records and one ``pwrite`` of them for all the members; when
    no member has marks left, the pack's ``ahead_mark`` (the mode bit saying some member has
    marks) goes too."""
    import fcntl

    try:
        with open_packs.held(paths[0], st, PACK_MARK) as o:
            if o is None:
                return [(0, 0)] * len(paths)
            with o.marks_lock:
                fcntl.flock(o.fd, fcntl.LOCK_EX)
                try:
                    return _take(o, paths, ahead_mark)
                finally:
                    fcntl.flock(o.fd, fcntl.LOCK_UN)
    except OSError:
        return [(0, 0)] * len(paths)


def _take(o: Any, paths: Sequence[str], ahead_mark: int) -> list[tuple[int, int]]:
    """:func:`take_members_marks` with the pack's locks held: every member's marks byte read
    with one ``pread`` of the records, those of ``paths`` cleared with one ``pwrite``."""
    known = _records(o)
    raw = bytearray(os.pread(o.fd, len(known), o.records_at))
    out = []
    for path in paths:
        i = _index(known, path)
        at = -1 if i < 0 else i * _RECORD.size + _MARKS_AT
        if at < 0 or not raw[at]:
            out.append((0, 0))
            continue
        out.append((raw[at], _RECORD.unpack_from(raw, at - _MARKS_AT)[4]))
        raw[at] = 0
    if any(marks for marks, _ in out):
        os.pwrite(o.fd, raw, o.records_at)
        if not any(raw[_MARKS_AT::_RECORD.size]):  # no member has marks left
            os.fchmod(o.fd, os.fstat(o.fd).st_mode & 0o7777 & ~ahead_mark)
    return out


#: Bytes one ``writev`` of a pack writes, at most. The page cache sizes its folios by the write,
#: and on this project's VM (free page reporting) a large folio is cut from memory the host has
#: taken back: a pack written whole (megabytes) cost 0.12-0.26 ms of CPU per 61 KB object against
#: 0.017-0.03 ms in pieces of 64 KiB to 1 MiB (2026-12-04); with the free memory in other orders
#: (2026-12-05) pieces of 256 KiB cost 0.29-0.40 ms, of 16-128 KiB 0.018-0.034 ms
#: (``scripts/page_cache_cpu.py``; #47, ``docs/remote_data.md``). 64 KiB was cheap both days.
WRITE_CHUNK = 64 * 1024


def write_all(fd: int, parts: list) -> None:
    """Write ``parts`` (bytes-like) one after the other, :data:`WRITE_CHUNK` bytes a ``writev``
    at most (no joined copy of the pack either)."""
    views = [memoryview(b).cast("B") for b in parts if len(b)]
    i = 0
    while i < len(views):
        batch, size, j = [], 0, i
        while j < len(views) and size < WRITE_CHUNK:
            v = views[j][:WRITE_CHUNK - size]
            batch.append(v)
            size += len(v)
            j += 1
        n = os.writev(fd, batch)
        while n:  # past what was written: whole parts, then the written head of the next
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


def link_members(tmp: str, entries: list[str], linked: list) -> None:
    """Make each entry a hard link to the pack written at ``tmp`` (an entry left there, of a
    size that did not match, is replaced); ``linked`` gets each link made."""
    for p in entries:
        try:
            os.link(tmp, p)
        except FileExistsError:
            os.unlink(p)
            os.link(tmp, p)
        except OSError as e:
            raise NoPacks(f"no hard link here: {e}") from e
        linked.append(p)


def pack_mode(marks: int, ahead_mark: int) -> int:
    """A pack's mode: readable, :data:`PACK_MARK`, and ``ahead_mark`` when its members carry marks."""
    return 0o644 | PACK_MARK | (ahead_mark if marks else 0)


def layout(items: list[tuple[str, bytes, int]], marks: int, retry_mark: int) -> tuple[list[tuple], int]:
    """The footer's members for ``items`` (``(entry path, bytes, retries)`` each, laid out in
    order) and the pack's size; ``marks`` for each member (``retry_mark`` added where retries
    are owed)."""
    members, off = [], 0
    for p, data, retries in items:
        m = (marks | (retry_mark if retries else 0)) if marks else 0
        members.append((os.path.basename(p), off, len(data), m, retries if marks else 0))
        off += len(data)
    return members, off + len(members) * _RECORD.size + _TAIL.size


def member_count(path: str) -> Optional[int]:
    """Members of the pack an entry links to (None: the entry is not a pack)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return len(_footer(fd, st.st_size)[2]) // _RECORD.size if st.st_mode & PACK_MARK else None
    finally:
        os.close(fd)


def is_pack(path: str) -> bool:
    """Whether the entry at ``path`` is a member of a pack (False when it is gone)."""
    try:
        return bool(os.stat(path).st_mode & PACK_MARK)
    except OSError:
        return False

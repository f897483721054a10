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
:data:`PACK_MARK` in its mode and the member is read at its offset.

The links share the pack's inode, so the pack has one read time (eviction takes a pack
whole, every link: :func:`~sbloader.sources.cache_ledger.scan` counts an inode once),
one byte count and one reservation in the directory's ledger. The marks of a member
fetched ahead (:data:`~sbloader.sources.cache.AHEAD_MARK` and the others) are a byte of
its footer record, taken by exactly one reader under an exclusive ``flock`` on the pack
(:func:`take_member_marks`); the pack's mode carries ``AHEAD_MARK`` while any member has
marks left, so a lookup of a pack with none left reads no footer.
"""
from __future__ import annotations

import os
import struct
import threading
from typing import Optional

#: The mode bit (the sticky bit, which Linux ignores on a file) telling a pack from an entry.
PACK_MARK = 0o1000

_MAGIC = b"SBLPACK1"
_RECORD = struct.Struct("<32sQQBI")  # entry hash, offset, size, marks, retries owed
_TAIL = struct.Struct("<I16s8s")  # members, pack id, magic
_MARKS_AT = 32 + 8 + 8  # the marks byte's place in a record
_OWED: dict = {}  # entry path -> retries of its fetch ahead, taken with its marks, not yet counted
_OWED_LOCK = threading.Lock()
_PLACES: dict = {}  # pack id -> its members' places (:func:`_places`)
_PLACES_LOCK = threading.Lock()
_PLACES_KEPT = 4096  # packs whose places a process keeps, at most (then it forgets them all)


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
    their count, the pack's id (random: a process keeps the members' places by it) and the magic."""
    out = [_RECORD.pack(bytes.fromhex(name), off, size, marks, retries) for name, off, size, marks, retries in members]
    return b"".join(out) + _TAIL.pack(len(members), os.urandom(16), _MAGIC)


def _footer(fd: int, size: int) -> tuple[bytes, int, bytes]:
    """The pack's id, its first record's place and its records' raw bytes (the file ``size`` long)."""
    if size < _TAIL.size:
        raise OSError("not a pack: too short")
    n, pack_id, magic = _TAIL.unpack(os.pread(fd, _TAIL.size, size - _TAIL.size))
    if magic != _MAGIC:
        raise OSError("not a pack: no footer")
    start = size - _TAIL.size - n * _RECORD.size
    return pack_id, start, os.pread(fd, n * _RECORD.size, start)


def _places(fd: int, size: int) -> dict:
    """Each member's ``digest -> (record's place, offset, size)``, kept per pack id (they never
    change; the marks do, and are read afresh: :func:`take_member_marks`)."""
    pack_id = os.pread(fd, _TAIL.size, size - _TAIL.size)[4:20] if size >= _TAIL.size else b""
    with _PLACES_LOCK:
        got = _PLACES.get(pack_id)
    if got is not None:
        return got
    pack_id, start, raw = _footer(fd, size)
    got = {}
    for i in range(len(raw) // _RECORD.size):
        digest, off, n, _, _ = _RECORD.unpack_from(raw, i * _RECORD.size)
        got[digest] = (start + i * _RECORD.size, off, n)
    with _PLACES_LOCK:
        if len(_PLACES) >= _PLACES_KEPT:
            _PLACES.clear()
        _PLACES[pack_id] = got
    return got


def read_entry(path: str) -> bytes:
    """An entry's bytes: the whole file, or its member of a pack (one open either way).

    Raises:
        OSError: the entry went (evicted) or its pack does not hold it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not st.st_mode & PACK_MARK:
            off, n = 0, st.st_size
        else:
            place = _places(fd, st.st_size).get(bytes.fromhex(os.path.basename(path)))
            if place is None:
                raise OSError(f"{path!r} is not a member of its pack")
            _, off, n = place
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise OSError(f"{path!r}: cut short ({len(data)} of {n} bytes)")
        return data
    finally:
        os.close(fd)


def _record_of(raw: bytes, digest: bytes) -> Optional[int]:
    """The index of the record of ``digest`` among ``raw`` records (None: not a member). A search
    of the bytes, not an unpacking of every record: each member's reader asks (it was a quarter of
    a fetch thread's CPU with 64 members a pack)."""
    at = raw.find(digest)
    while at != -1:
        if at % _RECORD.size == 0:
            return at // _RECORD.size
        at = raw.find(digest, at + 1)
    return None


def take_member_marks(path: str, ahead_mark: int) -> tuple[int, int]:
    """Take the marks of the member at ``path`` for the one reader that takes them:
    ``(marks, retries owed)``, ``(0, 0)`` for the others. Under an exclusive ``flock`` on
    the pack; when no member has marks left, the pack's ``ahead_mark`` (the mode bit saying
    some member has marks) goes too."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return 0, 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.fstat(fd)
        if not st.st_mode & ahead_mark:
            return 0, 0
        _, start, raw = _footer(fd, st.st_size)
        i = _record_of(raw, bytes.fromhex(os.path.basename(path)))
        marks = raw[_MARKS_AT::_RECORD.size]  # every member's marks byte (one slice, not a record each)
        if i is None or not marks[i]:
            return 0, 0
        os.pwrite(fd, b"\0", start + i * _RECORD.size + _MARKS_AT)
        if marks.count(0) == len(marks) - 1:  # no other member has marks left
            os.fchmod(fd, st.st_mode & 0o7777 & ~ahead_mark)
        return marks[i], _RECORD.unpack_from(raw, i * _RECORD.size)[4]
    except OSError:
        return 0, 0
    finally:
        os.close(fd)  # closing releases the flock


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

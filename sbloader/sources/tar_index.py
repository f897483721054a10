"""The member index of a WebDataset tar shard: which samples it holds and where their bytes lie.

A shard is indexed once (its headers only: each 512-byte header is read and the member's
data skipped, by a walk that slices the few fields an index needs, or by ``tarfile``
where the walk meets anything else, a damaged shard included), and the index is kept
per process while the file keeps its size and modification time. Members are grouped into samples by WebDataset's
rule (:func:`split_key`): consecutive members with the same key form one sample. A
sample's members lie in one contiguous byte range of the shard, so a range of
samples is read with one seek and one read (:func:`read_members`), never by scanning
the tar from its start.
"""
from __future__ import annotations

import io
import os
import re
import tarfile
import threading
from collections import OrderedDict
from typing import BinaryIO, Callable, NamedTuple, Optional

import numpy as np

from sbloader.sources.tar_members import Unusual, checksum_ok, member_name, octal, parse_members, pax_records

#: Shard indexes a process keeps (the most recently used).
INDEX_CACHE_SHARDS = 256

_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_INDEXES: "OrderedDict[tuple, ShardIndex]" = OrderedDict()
_INDEXES_LOCK = threading.Lock()


class ShardIndex(NamedTuple):
    """The samples of one shard.

    Attributes:
        path: the shard.
        keys: each sample's key, in shard order.
        starts: byte offset of each sample's first header.
        stops: byte offset one past each sample's last member's data (padded to 512 bytes).
        extensions: every extension any sample has, sorted.
        error: why the shard could not be indexed whole ("" when it could). The samples
            before the damage are still listed.
        file_size: the shard's size in bytes when indexed.
    """

    path: str
    keys: tuple[str, ...]
    starts: np.ndarray
    stops: np.ndarray
    extensions: tuple[str, ...]
    error: str = ""
    file_size: int = 0

    @property
    def num_samples(self) -> int:
        """Samples listed."""
        return len(self.keys)


def split_key(name: str) -> tuple[Optional[str], Optional[str]]:
    """WebDataset's key rule: the key is the member's path up to the first dot of its basename,
    the extension the rest (``"a/b.seg.png"`` -> ``("a/b", "seg.png")``); ``(None, None)`` when
    the basename has no dot."""
    m = _KEY_RE.match(name)
    return (m.group(1), m.group(2)) if m else (None, None)


def is_meta(name: str) -> bool:
    """Members WebDataset's reader leaves out (``__meta__`` names at the top level or as a
    path's first part)."""
    return bool(re.match(r"__[^/]*__($|/)", name))


class _Group:
    """Members being grouped into samples (WebDataset's ``group_by_keys``, with offsets)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.starts: list[int] = []
        self.stops: list[int] = []
        self.exts: set[str] = set()
        self._current: set[str] = set()

    def add(self, name: str, header_offset: int, data_stop: int) -> None:
        key, ext = split_key(name)
        if key is None or is_meta(name):
            return
        ext = ext.lower()
        if not self.keys or key != self.keys[-1]:
            self.keys.append(key)
            self.starts.append(header_offset)
            self.stops.append(data_stop)
            self._current = set()
        if ext in self._current:
            raise ValueError(f"member {name!r} repeats extension {ext!r} of sample {key!r}")
        self._current.add(ext)
        self.exts.add(ext)
        self.stops[-1] = data_stop


def _padded(n: int) -> int:
    return (n + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE


def _check_end(f: BinaryIO, offset: int, size: int) -> str:
    """Why the tar does not end properly at ``offset`` ("" when it does). ``tarfile`` stops
    quietly at a header it cannot parse, or at the end of a file cut between members;
    a whole tar has a zero block (the end-of-archive marker) there."""
    f.seek(offset)
    block = f.read(tarfile.BLOCKSIZE)
    if len(block) < tarfile.BLOCKSIZE:
        return (f"truncated: the file ends at {size} without the end-of-archive marker "
                f"(the members listed end at {offset})")
    if block.count(0) != len(block):
        return f"corrupt: no valid tar header at offset {offset}"
    return ""


def index_shard(path: str, open_shard: Callable[[str], BinaryIO]) -> ShardIndex:
    """Read a shard's headers and group its members into samples; never raises for a bad shard.

    A truncated or corrupt shard records why in ``ShardIndex.error``; the samples before
    the damage are kept but the last of them, which may have had members after it.

    Args:
        path: the shard.
        open_shard: opens it for binary reading (seekable).
    """
    g = _Group()
    size = 0
    error = ""
    reached = 0  # where the next header should be
    try:
        with open_shard(path) as f:
            f.seek(0, io.SEEK_END)
            size = f.tell()
            try:
                return _index_whole(path, g, size, _check_end(f, _walk(f, size, g), size))
            except Unusual:  # a header the walk leaves to tarfile: the shard is indexed by it, from the start
                g = _Group()
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as tf:
                for info in tf:
                    reached = info.offset_data + _padded(info.size)
                    if not info.isreg():
                        continue
                    stop = info.offset_data + info.size
                    if stop > size:
                        error = (f"truncated: member {info.name!r} needs bytes up to {stop}, "
                                 f"the file has {size}")
                        break
                    g.add(info.name, info.offset, min(size, info.offset_data + _padded(info.size)))
                else:
                    error = _check_end(f, tf.offset, size)
    except Exception as e:  # tarfile.ReadError, a header checksum, a repeated extension...
        # A whole tar is a multiple of 512 bytes; a cut one seldom is.
        cut = size and (size % tarfile.BLOCKSIZE or reached + tarfile.BLOCKSIZE > size)
        error = (f"truncated at {size} bytes (the next header should be at {reached}): " if cut
                 else "corrupt: ") + f"{type(e).__name__}: {e}"
    return _index_whole(path, g, size, error)


def _index_whole(path: str, g: "_Group", size: int, error: str) -> ShardIndex:
    if error and g.keys:
        # The last sample may have lost members after the damage: leave it out.
        for lst in (g.keys, g.starts, g.stops):
            lst.pop()
    if not error and not g.keys:
        error = "no sample in the shard (no member named <key>.<extension>)"
    return ShardIndex(path, tuple(g.keys), np.asarray(g.starts, dtype=np.int64),
                      np.asarray(g.stops, dtype=np.int64), tuple(sorted(g.exts)), error, size)


_BLOCK = tarfile.BLOCKSIZE
_ZERO = bytes(_BLOCK)
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, fifos: tarfile skips no data


def _walk(f: BinaryIO, size: int, g: "_Group") -> int:
    """Add a whole, plain tar's regular members to ``g`` as :func:`index_shard`'s ``tarfile`` loop
    does (a member's offset is its first header's, pax or GNU long name included), reading only
    the 512-byte headers and the extended ones' records; the offset of the end-of-archive
    marker. Raises :class:`~sbloader.sources.tar_members.Unusual` at anything else (a bad or cut
    header, a member past the end, a type or record it does not know): ``tarfile`` then indexes
    the shard, with its errors. About 3x faster than ``tarfile``'s objects (#47)."""
    pos, first, long_name, pax = 0, None, None, {}
    while True:
        f.seek(pos)
        h = f.read(_BLOCK)
        if h == _ZERO:
            return pos
        if len(h) < _BLOCK or not checksum_ok(h):
            raise Unusual("a cut or bad header")
        kind = h[156:157]
        n = int(pax[b"size"]) if b"size" in pax else octal(h[124:136])
        data_at = pos + _BLOCK
        nxt = data_at + (n + _BLOCK - 1) // _BLOCK * _BLOCK
        if kind in (b"x", b"L"):
            data = f.read(n)
            if len(data) != n:
                raise Unusual("a cut extended header")
            if kind == b"x":
                pax = pax_records(data)
            else:
                long_name = data.split(b"\0", 1)[0]
            first = pos if first is None else first
            pos = nxt
            continue
        name = member_name(h, pax, long_name)
        if kind in (b"0", b"\0") and not name.endswith("/"):
            if data_at + n > size:
                raise Unusual("a member past the end")
            try:
                g.add(name, pos if first is None else first, min(size, nxt))
            except ValueError:  # a repeated extension: tarfile's pass says so, with where it was
                raise Unusual("a repeated extension") from None
            pos = nxt
        elif kind in _NO_DATA or kind == b"\0":
            pos = data_at
        else:
            raise Unusual(f"member type {kind!r}")
        first, long_name, pax = None, None, {}


def cached_index(path: str, open_shard: Optional[Callable[[str], BinaryIO]], stat: Callable[[str], tuple],
                 build: Optional[Callable[[str], ShardIndex]] = None) -> ShardIndex:
    """:func:`index_shard` (or ``build(path)`` when given), once per process while ``stat(path)``
    (size, mtime, or a listed version) stays the same."""
    key = (path,) + tuple(stat(path))
    with _INDEXES_LOCK:
        idx = _INDEXES.get(key)
        if idx is not None:
            _INDEXES.move_to_end(key)
            return idx
    idx = build(path) if build is not None else index_shard(path, open_shard)
    with _INDEXES_LOCK:
        _INDEXES[key] = idx
        while len(_INDEXES) > INDEX_CACHE_SHARDS:
            _INDEXES.popitem(last=False)
    return idx


def read_members(f: BinaryIO, start: int, stop: int) -> list[tuple[str, bytes]]:
    """The regular members in bytes ``[start, stop)`` of a tar: one seek, one read.

    Args:
        f: the open shard.
        start: offset of a member's (first) header.
        stop: offset one past the last wanted member's data.

    Returns:
        ``(name, data)`` per regular member, in order.

    Raises:
        EOFError: the file ends before ``stop`` (it was truncated after it was indexed).
        tarfile.TarError: the bytes are not tar headers where the index put them.
    """
    f.seek(start)
    buf = f.read(stop - start)
    if len(buf) != stop - start:
        raise EOFError(f"wanted bytes [{start}, {stop}), the file ends at {start + len(buf)}: "
                       f"it changed after it was indexed")
    return parse_members(buf)


def local_stat(path: str) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a local file: the index cache's validity key."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns

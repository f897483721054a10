"""WebDataset shards in an object store: indexing a shard's headers and reading a range of
its samples, through :class:`~sbloader.sources.fetch.RemoteFiles`.

- **Index.** With the node-local cache on, the shard is fetched whole into the cache
  (one GET: the read tasks on that node then read their ranges from the cache) and
  indexed there; with the cache off, its headers are read through :class:`RangeFile`,
  a seekable file over ranged GETs of :data:`INDEX_BLOCK` bytes (tar headers lie
  between the members' data, so a shard of small members is read about whole, one
  request per block; large members are skipped over). Either way the index is kept
  per process and in the cache directory (``<entry>.idx.json``, by the shard's URI and
  listed version), so creating the dataset again indexes nothing.
- **Read.** A partition's samples lie in one byte range: from the cached shard, or with
  the cache off one ranged GET.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any, Optional

import numpy as np

from sbloader.sources.tar_index import ShardIndex, cached_index, index_shard

#: Bytes per ranged GET when a shard's headers are read without the cache.
INDEX_BLOCK = 4 * 2 ** 20


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an object's byte ranges (one block held at a time).

    Args:
        uri: the object.
        size: its size (from the listing).
        read_range: ``(uri, start, end) -> bytes``.
        block: bytes per request.
    """

    def __init__(self, uri: str, size: int, read_range: Any, block: int = INDEX_BLOCK) -> None:
        super().__init__()
        self.uri, self.size, self._read_range, self._bs = uri, int(size), read_range, int(block)
        self._pos = 0
        self._block_start = -1
        self._block = b""
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        out = []
        while self._pos < end:
            if not (self._block_start <= self._pos < self._block_start + len(self._block)):
                start = self._pos
                stop = min(self.size, start + max(self._bs, end - start))
                self._block, self._block_start = self._read_range(self.uri, start, stop), start
                self.requests += 1
            off = self._pos - self._block_start
            piece = self._block[off:off + end - self._pos]
            out.append(piece)
            self._pos += len(piece)
        return b"".join(out)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def _index_path(remote: Any, uri: str) -> Optional[str]:
    from sbloader.sources.cache import cache_here

    size, version = remote._version(uri)
    cache = cache_here(remote.cache)
    return None if cache is None or size is None else cache.path_for(uri, version) + ".idx.json"


def _load(path: Optional[str]) -> Optional[ShardIndex]:
    if path is None:
        return None
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return ShardIndex(d["path"], tuple(d["keys"]), np.asarray(d["starts"], dtype=np.int64),
                      np.asarray(d["stops"], dtype=np.int64), tuple(d["extensions"]), d["error"], d["file_size"])


def _save(path: Optional[str], idx: ShardIndex) -> None:
    if path is None:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"path": idx.path, "keys": list(idx.keys), "starts": idx.starts.tolist(),
                       "stops": idx.stops.tolist(), "extensions": list(idx.extensions), "error": idx.error,
                       "file_size": idx.file_size}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def index_remote_shard(uri: str, remote: Any) -> ShardIndex:
    """The index of a shard in a store (see the module's docstring); never raises for a
    damaged or missing shard (``ShardIndex.error`` says why)."""
    size, version = remote._version(uri)

    def build(u: str) -> ShardIndex:
        saved = _load(_index_path(remote, u))
        if saved is not None:
            return saved
        if remote.cache.enabled:
            def opener(p: str) -> Any:
                src = remote.local(p, ahead=True)  # the epoch's first read counts the miss
                return open(src, "rb") if isinstance(src, str) else src
        else:
            def opener(p: str) -> Any:
                return RangeFile(p, size if size is not None else 0, remote.read_range)
        idx = index_shard(u, opener)
        if not idx.error:  # a damaged shard is indexed again next time (the damage may be a failed request)
            _save(_index_path(remote, u), idx)
        return idx

    return cached_index(uri, None, lambda u: (size, version), build=build)


def read_remote_range(uri: str, start: int, end: int, remote: Any) -> bytes:
    """Bytes ``[start, end)`` of a shard: from its cache entry (fetching the shard whole into
    the cache first), or with the cache off one ranged GET."""
    if not remote.cache.enabled:
        return remote.read_range(uri, start, end)
    src = remote.local(uri)
    f = open(src, "rb") if isinstance(src, str) else src
    with f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise EOFError(f"wanted bytes [{start}, {end}) of {uri!r}, it ends at {start + len(data)}: it changed "
                       f"after it was indexed")
    return data

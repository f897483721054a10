"""A listed object read in place by ranged GETs (a source's ``cache=False`` random access).

pyarrow's own filesystems open an object with a HEAD (its size) before the first
range; a listed object's size is already known, so :class:`RangedObject` starts
with the range itself. Its reads go through the source's
:class:`~sbloader.sources.fetch.RemoteFiles`: retried, held to the source's
requests in flight, counted in ``stats()`` (``range_reads``, ``bytes_read``).
"""
from __future__ import annotations

import io
from typing import Any


class RangedObject(io.RawIOBase):
    """A read-only, seekable file over one listed object: each ``read`` is one ranged GET.

    A reader that asks for few, large ranges (pyarrow's Parquet reader with
    ``pre_buffer=True`` coalesces a row group's column chunks) makes few requests.

    Args:
        remote: the source's :class:`~sbloader.sources.fetch.RemoteFiles`.
        uri: the object.
        size: its size in bytes, from the listing.
    """

    def __init__(self, remote: Any, uri: str, size: int) -> None:
        super().__init__()
        self.remote, self.uri, self.size, self._pos = remote, uri, int(size), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset} before the start of {self.uri!r}")
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        if end <= self._pos:
            return b""
        data = self.remote.read_range(self.uri, self._pos, end)
        self._pos = end
        return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)

    def __repr__(self) -> str:
        return f"RangedObject({self.uri!r}, size={self.size})"

"""A remote object as a file that a library opens by path or file object (pyarrow's Parquet
reader, PyAV): its cache entry, an in-memory buffer, or, with the cache off, a random-access
reader that fetches only the byte ranges read (:class:`~sbloader.sources.ranged_object.RangedObject`).
A mixin of :class:`~sbloader.sources.fetch.RemoteFiles`, which gives ``_get``, ``_report``,
``filesystem``, ``versions`` and ``cache``.
"""
from __future__ import annotations

import io
import os
import time
from typing import Any, Union

from sbloader.core.context import report_counters
from sbloader.sources import ahead as ahead_counts
from sbloader.sources.filesystems import resolve
from sbloader.sources.inflight import GAUGE
from sbloader.sources.ranged_object import RangedObject


class ObjectFiles:
    """The ``local`` views of :class:`~sbloader.sources.fetch.RemoteFiles` (a mixin)."""

    def local(self, uri: str, ahead: bool = False) -> Union[str, io.BytesIO]:
        """The object as a local file (its cache entry) or, with the cache off or full,
        an in-memory buffer: what pyarrow and PyAV open. A local path comes back as it is.
        ``ahead``: fetched for planning (a probe, an index), ahead of the read that counts it."""
        if self.filesystem is None and uri not in self.versions:
            return uri
        t0 = time.perf_counter()
        got = self._get(uri, True, ahead=ahead)
        waited = time.perf_counter() - t0
        report_counters({"peak_in_flight": GAUGE.take_peak()})
        if got.error is None and got.hit and got.data is None:
            counts = {"cache_misses" if got.ahead else "cache_hits": 1, "cache_bytes": os.path.getsize(got.path),
                      "store_wait_ms": 1000 * waited}
            ahead_counts.count_get_at_take(counts, got.ahead, counts["cache_bytes"], got.path)
            report_counters(counts)
            return got.path
        self._report(got, waited)
        if got.error is not None:
            raise got.error
        return got.path if got.path is not None and not got.hit else io.BytesIO(got.data)

    def local_or_random_access(self, uri: str) -> Any:
        """The object as a local file (its cache entry), or with the cache off a
        random-access file on the store (a reader of a few row groups then fetches only
        their byte ranges; a listed object's by :class:`~sbloader.sources.ranged_object.RangedObject`,
        no HEAD). Local paths come back as they are."""
        if not self.cache.enabled and self.filesystem is None and uri in self.versions:
            return RangedObject(self, uri, self._version(uri)[0])
        if not self.cache.enabled and self.filesystem is not None:
            fs, path = resolve(uri, self.filesystem)
            try:
                return fs.open_input_file(path)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"no such object: {uri!r} ({e}); check the bucket and key, or pass "
                                        f"on_error='skip'") from e
        if self.filesystem is None and uri not in self.versions:
            return uri
        return self.local(uri)

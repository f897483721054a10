"""What bounds the requests to an object store in one process: a budget of connections
(requests in flight) and of bytes (fetched or being fetched, not yet handed to the
reader), shared by every read task and every fetch-ahead of the process.

A read task submits all its objects at once (up to the byte budget) and then the
next partitions' objects to fetch ahead, to one pool of ``max_requests`` threads per
process: the requests of every task and of the fetch-ahead overlap, so a store's
latency is paid about once per ``max_requests`` objects across the whole pipeline, not
per read task. The gauge counts requests in flight (now and the peak) and the time
readers spent waiting for bytes, for ``stats()``.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: Requests one process keeps in flight at most (its connections to the store).
DEFAULT_MAX_REQUESTS = 64

#: Bytes one read task asks for ahead of what it has consumed (its own objects and the
#: fetch-ahead into the cache), at most; a single larger object is still fetched.
DEFAULT_MAX_BYTES = 256 * 2 ** 20


@dataclass(frozen=True)
class RequestBudget:
    """The limits on requests in flight.

    Attributes:
        max_requests: requests in flight per process (threads of its fetch pool).
        max_bytes: bytes a read task asks for ahead of its reader, own objects and
            fetch-ahead together.
    """

    max_requests: int = DEFAULT_MAX_REQUESTS
    max_bytes: int = DEFAULT_MAX_BYTES


class Gauge:
    """Requests in flight in this process, the peak since the last :meth:`take_peak`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def __enter__(self) -> "Gauge":
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.now -= 1

    def take_peak(self) -> int:
        """The peak since the last call (then reset to the requests in flight now)."""
        with self._lock:
            p, self.peak = self.peak, self.now
            return p


GAUGE = Gauge()
_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def pool(workers: int) -> ThreadPoolExecutor:
    """This process's fetch pool, with at least ``workers`` threads."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0]._max_workers < workers:
            _POOL[:] = [ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sbloader-fetch")]
        return _POOL[0]


def take_while_within(sizes: list, max_bytes: int) -> int:
    """How many of ``sizes`` (bytes, None: unknown, counted as 0) fit in ``max_bytes`` from the
    first; at least one."""
    total, n = 0, 0
    for s in sizes:
        total += int(s or 0)
        if n and total > max_bytes:
            break
        n += 1
    return n


class Waited:
    """Seconds spent blocked on the store, as a context manager adding to ``seconds``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def block(self, fn, *args):
        """``fn(*args)``, timed."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

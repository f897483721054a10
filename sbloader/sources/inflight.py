"""What bounds the requests to object stores in one process: a budget of requests in flight
(:class:`Gauge`) and of bytes fetched ahead of the readers (:class:`ByteBudget`), each shared
by every read task, every fetch-ahead and every dataset of the process.

A read task submits all its objects at once (up to the byte budget) and then the
next partitions' objects to fetch ahead, to one pool of threads per process: the
requests of every task and of the fetch-ahead overlap, so a store's latency is paid
about once per ``max_in_flight`` objects across the whole pipeline, not per read task.
Each request holds a slot of the gauge while it runs: a dataset keeps at most its own
``max_in_flight`` in flight, and the datasets of a process together at most the
largest ``max_in_flight`` among them, or ``$SBLOADER_MAX_IN_FLIGHT`` where it is set.
The gauge also counts requests in flight (now and the peak) for ``stats()``.

Every request also holds a slot of the node's budget, shared by all the node's processes
(:mod:`sbloader.sources.node_slots`, ``$SBLOADER_NODE_MAX_IN_FLIGHT``, default 256). The
bytes fetched ahead are bounded per process only (a node: its reading processes x the
budget); the node-local cache's byte budget is the node's (:mod:`sbloader.sources.cache`).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

from sbloader.sources.node_slots import NodeSlots, node_slots

#: Requests one process keeps in flight at most (its connections to the store). 128: at 100 ms per
#: request the first epoch of 2,000 JPEGs read 650 images/s with 64 (two reading processes held
#: 128 in flight, every slot) and 730 with 128; at 20 ms the same (``docs/remote_data.md``).
DEFAULT_MAX_REQUESTS = 128

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


#: Environment variable capping the requests in flight of each process, all its datasets
#: together (unset: the largest ``max_in_flight`` of the datasets the process reads).
MAX_IN_FLIGHT_ENV = "SBLOADER_MAX_IN_FLIGHT"


def env_cap() -> Optional[int]:
    """``$SBLOADER_MAX_IN_FLIGHT`` as a positive integer, or None when unset.

    Raises:
        ValueError: it is set to something else.
    """
    raw = os.environ.get(MAX_IN_FLIGHT_ENV, "")
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_IN_FLIGHT_ENV} must be a positive integer (requests one process keeps in flight, "
                         f"all its datasets together), found {raw!r}")
    return int(raw)


def check_max_in_flight(max_in_flight: Any) -> int:
    """``max_in_flight`` unchanged; ``ValueError`` naming it unless it is a positive integer."""
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be a positive integer (requests a process keeps in flight for "
                         f"the dataset), found {max_in_flight!r}")
    return max_in_flight


class Gauge:
    """Requests in flight in this process, bounded per dataset and for the process, counted
    (now and the peak since the last :meth:`take_peak`).

    Every request to a store takes a slot (:meth:`slot`): a dataset (``key``) keeps at most its
    own ``max_in_flight``, and all datasets of the process together at most :attr:`cap`, or
    when it is None the largest ``max_in_flight`` asked for in the process so far. A request
    that would pass either waits for one to end. Then it takes a slot of the node's budget
    (``node``; by default :func:`~sbloader.sources.node_slots.node_slots`), waiting likewise.
    """

    def __init__(self, cap: Optional[int] = None, node: Any = "env") -> None:
        self._cond = threading.Condition()
        self._node: Optional[NodeSlots] = node if node != "env" else None
        self._node_from_env = node == "env"
        self.cap = cap
        self.now = 0
        self.peak = 0
        self._largest = 0
        self._by_key: dict[str, int] = {}

    def limit(self) -> int:
        """Requests all datasets of this process may keep in flight together now."""
        return self.cap if self.cap is not None else max(1, self._largest)

    @contextmanager
    def slot(self, key: str, max_in_flight: int) -> Iterator[None]:
        """Hold one request's slot of dataset ``key`` (at most ``max_in_flight`` of its own):
        :meth:`enter`, then :meth:`leave`."""
        held = self.enter(key, max_in_flight)
        try:
            yield
        finally:
            self.leave(key, held)

    def enter(self, key: str, max_in_flight: int) -> tuple:
        """Take one request's slot of dataset ``key`` (waiting while the dataset or the process is at its
        bound), then one of the node's; what :meth:`leave` gives back. (Two calls, not a generator's
        context: a store's request takes one, #47.)"""
        with self._cond:
            self._largest = max(self._largest, max_in_flight)
            while self.now >= self.limit() or self._by_key.get(key, 0) >= max_in_flight:
                self._cond.wait()
            self.now += 1
            self._by_key[key] = self._by_key.get(key, 0) + 1
            self.peak = max(self.peak, self.now)
        node = node_slots() if self._node_from_env else self._node
        try:
            return node, (node.take() if node is not None else None)
        except BaseException:
            self._let_go(key)
            raise

    def leave(self, key: str, held: tuple) -> None:
        """Give back the slots :meth:`enter` took for dataset ``key``."""
        node, taken = held
        try:
            if taken is not None:
                node.give(taken)
        finally:
            self._let_go(key)

    def _let_go(self, key: str) -> None:
        with self._cond:
            self.now -= 1
            left = self._by_key[key] - 1
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]
            self._cond.notify_all()

    def take_peak(self) -> int:
        """The peak since the last call (then reset to the requests in flight now)."""
        with self._cond:
            p, self.peak = self.peak, self.now
            return p

    def forget(self) -> None:
        """(A forked child) None of the parent's requests is this process's: nothing in flight, a new lock."""
        self._cond = threading.Condition()
        self.now = self.peak = 0
        self._by_key = {}


GAUGE = Gauge(env_cap())


class ByteBudget:
    """Bytes asked for ahead of the readers in this process (fetched or being fetched, not yet
    handed to a reader; fetch-ahead until it is in the cache): every read task of every dataset
    together at most the largest ``max_bytes`` asked for in the process. It never blocks: a read
    task that finds no room fetches nothing more until it has consumed what it has, and one
    with nothing outstanding may always take one object, so every task goes on (the only way
    past the budget: one object per read task running).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self.peak = 0
        self._largest = 0

    def take(self, nbytes: int, max_bytes: int, alone: bool = False) -> bool:
        """Hold ``nbytes`` if they fit (or ``alone``: the task has nothing outstanding); whether held."""
        with self._lock:
            self._largest = max(self._largest, max_bytes)
            if not alone and self.held + nbytes > self._largest:
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def give(self, nbytes: int) -> None:
        """Hand back ``nbytes`` taken (consumed, dropped, or written to the cache)."""
        with self._lock:
            self.held -= nbytes

    def forget(self) -> None:
        """(A forked child) None of the parent's bytes is this process's: nothing held, a new lock."""
        self._lock = threading.Lock()
        self.held = self.peak = 0


BYTES = ByteBudget()
def side_by_side(sizes: Iterable[int], max_bytes: int, cap: int) -> int:
    """How many objects of ``sizes`` to fetch at once (each whole, in memory until it is
    cached): at most ``cap``, fewer where the largest of them together would pass ``max_bytes``;
    at least one. For planning reads that wait on the store (a shard's index, a video's probe)."""
    sizes = [int(s or 0) for s in sizes]
    if not sizes:
        return 1
    return max(1, min(cap, len(sizes), max_bytes // max(1, max(sizes))))


def map_side_by_side(fn: Any, uris: list, versions: dict, max_bytes: int, cap: int) -> list:
    """``[fn(u) for u in uris]``, run in threads :func:`side_by_side` of them at once (their
    sizes from ``versions``, ``uri -> (size, mtime_ns)``): one round trip for them all, not one each."""
    if len(uris) <= 1:
        return [fn(u) for u in uris]
    from concurrent.futures import ThreadPoolExecutor

    workers = side_by_side((versions.get(u, (0, 0))[0] for u in uris), max_bytes, cap)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sbloader-plan") as pool:
        return list(pool.map(fn, uris))


_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _after_fork() -> None:
    """A forked child (a local worker process of a native epoch's start) has none of its parent's
    threads: the fetch pool (whose threads it would wait for forever), the requests and bytes the
    parent had in flight, and the locks other threads may have held at the fork are made anew."""
    global _POOL_LOCK
    _POOL.clear()
    _POOL_LOCK = threading.Lock()
    GAUGE.forget()
    BYTES.forget()


os.register_at_fork(after_in_child=_after_fork)


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


def when_answered(futures: Sequence[Any], fn: Any) -> None:
    """``fn()`` once every one of ``futures`` is done (at once when none is pending), in the
    thread that finished the last: a read's fetch ahead starts once its own objects are in,
    so the first partition's GETs do not share the process with the next partitions' (#47)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any = None) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    if not futures:
        fn()
        return
    for f in futures:
        f.add_done_callback(one_done)

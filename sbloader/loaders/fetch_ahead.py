"""Fetch ready batches in a background thread, a few ahead of the training loop.

Taking a ready batch costs the trainer a ``ray.get`` of its block and the one
copy into writable (or pinned) memory, which the training loop would otherwise
wait for on every step. torch's DataLoader hides its own
equivalent (unpickling, pinning) in its pin-memory thread; this is ours. The
thread only moves bytes that are already produced; ``ray.get`` and large copies
release the GIL, so it overlaps the step.

The consumer keeps every piece of bookkeeping that must describe what the
*training loop* took (the consumed ledger, state_dict positions): the producer
yields the facts with each batch and the consumer records them when it hands the
batch on.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional

_END = object()
_RUNNING: "weakref.WeakSet[FetchAhead]" = weakref.WeakSet()  # a running thread keeps its FetchAhead alive


def join_all(timeout: float = 5.0) -> None:
    """Stop every fetch thread of this process and wait for them, together at most ``timeout``
    seconds (at exit: a daemon thread still dropping batches when the interpreter finalizes dies
    inside torch's tensor destructor, and the process aborts with "terminate called without an
    active exception")."""
    deadline = time.monotonic() + timeout
    running = list(_RUNNING)
    for f in running:
        f._stop.set()
    for f in running:
        f._drain()
        if f._thread is not threading.current_thread():
            f._thread.join(timeout=max(0.0, deadline - time.monotonic()))


class FetchAhead:
    """Runs ``produce`` in a daemon thread, at most ``depth`` items ahead of the consumer.

    Iterate it like the generator itself; an exception raised in the producer is
    re-raised, unchanged, at the consumer's matching ``next``. :meth:`close` stops
    the thread (the producer's ``finally`` runs in the thread).

    Args:
        produce: the generator to run in the thread.
        depth: items ready ahead of the consumer (>= 1).
        name: the thread's name.

    Attributes:
        wait_s: seconds the consumer waited for the next item (the stall).
        produced: the producer made its last item (those not taken yet wait in the queue).
    """

    def __init__(self, produce: Iterator[Any], depth: int = 2, name: str = "sbloader-fetch") -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, found {depth}")
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self.wait_s = 0.0
        self.produced = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._produce:
                if not self._put((item, None)):
                    return
                item = None  # not held while the next one is made: a failed batch's error, once raised in
                # the loop, references the loop's frames (its iterator), a cycle through this thread's frame
            self.produced = True
            self._put((_END, None))
        except BaseException as e:  # carried to the consumer
            self._put((_END, e))
        finally:
            try:
                self._produce.close()
            except Exception:
                pass

    def __iter__(self) -> "FetchAhead":
        return self

    def __next__(self) -> Any:
        return self.next()

    def next(self, timeout: Optional[float] = None) -> Any:
        """The next item (StopIteration at the end).

        Raises:
            TimeoutError: nothing came within ``timeout`` seconds (None: wait forever).
        """
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            try:
                item, error = self._queue.get(timeout=wait)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("the fetch thread ended without a result; this is a bug") from None
                if deadline is not None and time.monotonic() >= deadline:
                    self.wait_s += time.perf_counter() - t0
                    raise TimeoutError(f"no item within {timeout} s") from None
        self.wait_s += time.perf_counter() - t0
        if item is _END:
            self._done = True
            if error is not None:
                raise error
            raise StopIteration
        return item

    def _drain(self) -> None:
        """Empty the queue (a producer waiting on a full one sees the stop)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def close(self, timeout: Optional[float] = 10.0, wake: Optional[Callable[[], Any]] = None) -> None:
        """Stop the thread: it finishes the item in hand, then runs the producer's cleanup.

        Args:
            timeout: seconds to wait for the thread.
            wake: called after the thread is told to stop, before waiting for it: it
                must wake a producer blocked on its source (shut the source down),
                or the wait lasts until the source answers. It may run again in the
                producer's own cleanup, so it must be idempotent.
        """
        self._stop.set()
        self._done = True
        self._drain()
        if wake is not None:
            wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

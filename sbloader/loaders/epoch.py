"""One epoch of a loader in the trainer: the consumer half of every pipeline.

Both loaders build an :class:`EpochIterator` per iteration, as torch's DataLoader
builds a ``_MultiProcessingDataLoaderIter``: it owns the epoch's state (its run:
what was planned and what the training loop took) and composes the same stages
whatever produced the batches:

1. a producer, a generator of :class:`Delivery` (a batch and the fact the ledger
   records when the loop takes it), run in a background thread
   (:class:`~sbloader.loaders.fetch_ahead.FetchAhead`) ``ahead`` batches ahead of
   the loop, or inline (``ahead=0``, torch's ``num_workers=0``);
2. error translation (the drop-in re-raises a worker's error with its original
   type, as torch does) and torch's ``timeout``;
3. the device copy (:class:`~sbloader.loaders.tensors.DeviceCopy`);
4. the consumed ledger: the run records a batch only when the loop receives it
   (consumed, not produced);
5. stall accounting (:class:`~sbloader.core.stats.StallStats`) and the loop's own
   pace, which tells an executor whether the pipeline is the bottleneck.
"""
from __future__ import annotations

import atexit
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

from sbloader.core.stats import StallStats
from sbloader.loaders import closer
from sbloader.loaders.failed_batch import FailedBatch
from sbloader.loaders.fetch_ahead import FetchAhead, join_all


_END = object()  # prime() found the epoch empty
_LIVE: "weakref.WeakSet[EpochIterator]" = weakref.WeakSet()  # epochs not yet garbage


def close_live_epochs() -> None:
    """End every epoch still open in this process (called before the embedded Ray stops)."""
    closer.drain()
    for it in list(_LIVE):
        try:
            it.close()
        except Exception:
            pass


def _at_exit() -> None:
    """The interpreter exits: end the open epochs and wait for their threads, whether or not Ray ever
    came up (a short job may end on the local workers while Ray still starts in the background). A
    fetch thread left running would drop its batches while the interpreter finalizes and abort the
    process inside torch's tensor destructor. Nothing may start a Ray from here. A background start
    of Ray (and of a pool's actors) still under way is waited for, then Ray is stopped: a thread
    inside Ray's start when the interpreter finalizes aborts the process too, and a Ray that came up
    during the exit has no exit hook of its own left to run."""
    from sbloader.runtime import background, session

    hook = sys.modules.get("ray._private.auto_init_hook")
    if hook is not None:
        hook.enable_auto_connect = False
    close_live_epochs()
    join_all()
    if background.settle(background.EXIT_START_WAIT_S):  # a no-op where it already ran, ahead of this hook
        session.stop_at_exit()


_EXIT_HOOK: list = []


def _register_exit_hook() -> None:
    """Register :func:`_at_exit` once, with the process's first epoch. The embedded Ray's stop at exit
    (registered when Ray came up) closes the epochs before Ray stops; this one runs whether or not
    Ray came up."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(_at_exit)


from sbloader.runtime.session import before_shutdown  # noqa: E402

before_shutdown(close_live_epochs)


class _TimedOut(RuntimeError):
    """torch's ``timeout`` error (a ``RuntimeError``, as torch's)."""


@dataclass
class Delivery:
    """One batch from a producer.

    Attributes:
        batch: what the loop receives (before the device copy).
        record: what the epoch's run records once the loop took it (None: nothing).
        release: called once the loop has moved two batches past this one (a
            zero-copy batch views its block until then).
    """

    batch: Any
    record: Any = None
    release: Optional[Callable[[], None]] = None


class Run(Protocol):
    """The epoch's run: what the loop took, as the checkpoint will record it."""

    def took(self, record: Any) -> None:
        """The training loop received a batch (its :attr:`Delivery.record`)."""

    def finished(self) -> None:
        """The epoch ran to its end."""


class EpochIterator:
    """The iterator of one epoch: the loop's batches, with the epoch's state.

    Args:
        produce: the producer (a generator of :class:`Delivery`).
        run: records what the loop took (None: a loader that keeps no state).
        ahead: batches made ahead in a background thread (0: inline, no thread).
        stalls: the epoch's stall instrument, filled in as it goes.
        to_device: moves each batch to the loop's device (None: stays on the CPU).
        translate: turns a producer's error into the error the loop sees (raises).
        timeout: seconds the loop may wait for one batch (None: forever); past it
            ``RuntimeError`` says so, as torch's DataLoader does. It counts only once
            ``started()`` says the workers are up.
        started: whether the producer's workers are up (None: no start-up to wait for).
        start_timeout: seconds the workers may take to start, from the iterator's
            creation, before :class:`~sbloader.core.errors.WorkerStartError` (None: forever).
        pace: called with the loop's own seconds for each batch (its waits left out).
        wake: called when the epoch closes early, before waiting for the thread: it
            must wake a producer blocked on its source (shut that source down).
        on_close: called once when the epoch ends or is dropped, whatever happened.
    """

    def __init__(self, produce: Iterator[Delivery], run: Optional[Run] = None, *, ahead: int = 2,
                 stalls: Optional[StallStats] = None, to_device: Optional[Callable[[Any], Any]] = None,
                 translate: Optional[Callable[[BaseException], Any]] = None, timeout: Optional[float] = None,
                 pace: Optional[Callable[[float], None]] = None, wake: Optional[Callable[[], Any]] = None,
                 on_close: Optional[Callable[[], Any]] = None, started: Optional[Callable[[], bool]] = None,
                 start_timeout: Optional[float] = None) -> None:
        self.run = run
        self.stalls = stalls if stalls is not None else StallStats()
        self._t0 = time.perf_counter()
        self._t0_mono = time.monotonic()
        self._fetch = FetchAhead(produce, depth=ahead) if ahead > 0 else None
        self._inline = produce if ahead <= 0 else None
        self._to_device, self._translate, self._timeout = to_device, translate, timeout
        self._pace, self._wake, self._on_close = pace, wake, on_close
        self._started, self._start_timeout = started, start_timeout
        self._up_at: Optional[float] = None if started is not None else time.monotonic()
        #: called with the number of batches yielded so far after each one (the drop-in's length check)
        self.after_batch: Optional[Callable[[int], None]] = None
        self._held: deque = deque()
        self._primed: Any = None  # the first delivery, fetched by prime()
        _LIVE.add(self)
        _register_exit_hook()
        closer.start()
        self._yielded_at: Optional[float] = None
        self._closed = False

    def __iter__(self) -> "EpochIterator":
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        now = time.perf_counter()
        if self._yielded_at is not None and self._pace is not None:
            self._pace(now - self._yielded_at)
        try:
            d = self._next_delivery()
        except StopIteration:
            if self.run is not None:
                self.run.finished()
            self.close()
            raise
        except BaseException as e:
            if isinstance(e, _TimedOut):  # raised now, as torch's: the producer may be inside the slow batch
                closer.close_later(self)
            else:
                self.close()
            if self._translate is not None and not isinstance(e, (KeyboardInterrupt, SystemExit)):
                self._translate(e)
            raise
        if d.release is not None:
            self._held.append(d.release)
            while len(self._held) > 2:  # the loop still holds the previous batch
                self._held.popleft()()
        if self.run is not None and d.record is not None:
            self.run.took(d.record)
        self.stalls.batches += 1
        self._yielded_at = time.perf_counter()
        if self.after_batch is not None:
            self.after_batch(self.stalls.batches)
        if isinstance(d.batch, FailedBatch):  # this batch's error; the epoch goes on unless it is fatal
            failed, d = d.batch, None
            if failed.fatal:
                self.close()
            error, failed = failed.exception(), None
            try:  # raised from this frame, which then holds nothing of it: no cycle error -> traceback ->
                raise error  # frame -> error keeps this iterator alive after the loop let both go
            finally:  # (until a garbage collection: a dropped epoch's actors went back that late)
                error = None
        return self._to_device(d.batch) if self._to_device is not None else d.batch

    def prime(self) -> None:
        """Wait for the first batch now, as torchdata's ``iter()`` waits for its workers to start: a
        fatal start-up error (``worker_init_fn`` raised) is raised here; the batch waits for ``next()``."""
        try:
            d = self._next_delivery()
        except StopIteration:
            d = _END
        except BaseException as e:
            self.close()
            if self._translate is not None and not isinstance(e, (KeyboardInterrupt, SystemExit)):
                self._translate(e)
            raise
        if isinstance(d, Delivery) and isinstance(d.batch, FailedBatch) and d.batch.fatal:
            self.close()
            error, d = d.batch.exception(), None
            try:  # as in __next__: nothing of the error held by this frame once raised
                raise error
            finally:
                error = None
        self._primed = d

    def _next_delivery(self) -> Delivery:
        if self._primed is not None:
            d, self._primed = self._primed, None
            if d is _END:
                raise StopIteration
            return d
        t0 = time.perf_counter()
        try:
            if self._inline is not None:
                return next(self._inline)
            if self._timeout is None and self._start_timeout is None:
                return self._fetch.next()
            return self._wait_bounded()
        finally:
            self.stalls.wait_ready_s += time.perf_counter() - t0

    def _wait_bounded(self) -> Delivery:
        """The next delivery under the two bounds: start-up (``start_timeout`` from the iterator's
        creation, until the workers are up), then ``timeout`` for this batch once they are."""
        from sbloader.core.errors import WorkerStartError

        asked = time.monotonic()
        while True:
            try:
                return self._fetch.next(timeout=0.25)
            except TimeoutError:
                pass
            now = time.monotonic()
            if self._up_at is None:
                if not self._started():
                    waited = now - self._t0_mono
                    if self._start_timeout is not None and waited > self._start_timeout:
                        from sbloader.runtime.cluster_state import cpu_summary

                        now_free = cpu_summary()
                        raise WorkerStartError(
                            f"the DataLoader's workers did not start within {self._start_timeout:g} s (start_timeout): "
                            f"their actors are still being placed or constructed{' (' + now_free + ')' if now_free else ''}"
                            ". Check that the cluster has the "
                            "CPUs (and resources) num_workers * worker_num_cpus asks for and that "
                            "worker_init_fn and the dataset's unpickling finish; raise start_timeout if start-up "
                            "is just slow") from None
                    continue
                self._up_at = now
            if self._timeout is not None and now - max(asked, self._up_at) >= self._timeout:
                raise _TimedOut(f"DataLoader timed out after {self._timeout} seconds")  # torch's words

    @property
    def produced(self) -> bool:
        """The epoch's batches are all made (those the loop has not taken wait in the fetch queue):
        its pipeline has nothing left to run, so the next epoch may begin (:meth:`PipelineLoader.start_ahead`)."""
        return self._fetch is not None and self._fetch.produced

    def close(self) -> None:
        """End the epoch: stop the producer and give back what it holds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._fetch is not None:
                self._fetch.close(wake=self._wake)
            elif self._inline is not None:
                self._inline.close()
            while self._held:
                self._held.popleft()()
        finally:
            self.stalls.wall_s = time.perf_counter() - self._t0
            if self._on_close is not None:
                self._on_close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):  # closed on the closer thread: the GC may run this anywhere
            try:
                closer.close_later(self)
            except Exception:  # the interpreter is tearing down (module globals gone)
                pass

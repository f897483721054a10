"""An epoch dropped without ``close()`` is closed on the closer thread, never inside ``__del__`` (where the
GC may run it under a lock another thread needs: a hang seen inside torch's ``Thread.start``)."""
from __future__ import annotations

import gc
import threading
import time

from sbloader.loaders import closer
from sbloader.loaders.epoch import Delivery, EpochIterator, close_live_epochs


def _epoch(closed_on: list) -> EpochIterator:
    def produce():
        for i in range(100):
            yield Delivery(i)

    return EpochIterator(produce(), ahead=2, on_close=lambda: closed_on.append(threading.current_thread().name))


def test_a_dropped_epoch_is_closed_on_the_closer_thread():
    closed_on: list = []
    it = _epoch(closed_on)
    assert next(it) == 0
    del it
    gc.collect()
    deadline = time.monotonic() + 10
    while not closed_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed_on == ["sbloader-epoch-closer"]


def test_an_explicit_close_stays_on_the_callers_thread_and_what_is_queued_drains_at_shutdown():
    closed_on: list = []
    it = _epoch(closed_on)
    next(it)
    it.close()
    assert closed_on == [threading.current_thread().name]
    done: list = []
    gate = threading.Event()
    busy: list = []
    closer.call_later(lambda: (gate.wait(5), busy.append("done")))  # the closer thread is busy: the next waits
    closer.call_later(lambda: done.append(threading.current_thread().name))
    time.sleep(0.1)
    assert done == []
    threading.Timer(0.3, gate.set).start()
    close_live_epochs()  # before the embedded Ray stops (and at exit): the queue is run, the close in hand ended
    assert busy == ["done"], "drain returned while the closer thread was still closing"
    assert done == [threading.current_thread().name], "what was queued is run on the caller's thread"


def _failing_epoch(closed_on: list, make_error) -> EpochIterator:
    from sbloader.loaders.failed_batch import FailedBatch

    def produce():
        yield Delivery(0)
        yield Delivery(FailedBatch(make_error()))
        for i in range(2, 100):
            yield Delivery(i)

    return EpochIterator(produce(), ahead=2, on_close=lambda: closed_on.append(threading.current_thread().name))


def test_an_epoch_whose_batch_raised_is_freed_when_the_loop_lets_it_go_not_at_a_garbage_collection():
    """A worker's error raised by ``next()`` leaves no reference cycle (error -> traceback -> frame ->
    error) holding the iterator: once the loop's ``except`` ended and it dropped the iterator, the epoch
    is handed to the closer at once (its actors went back to the pool only at the next garbage
    collection before: the next loader started a new pool). Both kinds: a local error and a remote
    worker's, raised as torch's type."""
    from sbloader.core.errors import UserFunctionError, picklable

    def local():
        try:
            raise KeyError("a local item broke")
        except KeyError as e:
            return e

    def remote():
        return UserFunctionError("map", 3, 0, "Traceback ...", "KeyError('k')", original=picklable(KeyError("k")))
    for make_error in (local, remote):
        closed_on: list = []
        gc.disable()
        try:
            it = _failing_epoch(closed_on, make_error)
            assert next(it) == 0
            try:
                next(it)
            except KeyError:
                pass
            assert next(it) == 2  # the epoch goes on after a batch's error, as torch's
            del it
            deadline = time.monotonic() + 10
            while not closed_on and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            gc.enable()
        assert closed_on == ["sbloader-epoch-closer"], make_error.__name__

"""The background fetch thread: order, bound, errors, early close."""
from __future__ import annotations

import threading
import time

import pytest

from sbloader.loaders.fetch_ahead import FetchAhead


def test_items_arrive_in_order_and_the_producer_stays_at_most_depth_ahead():
    produced = []

    def produce():
        for i in range(20):
            produced.append(i)
            yield i

    fa = FetchAhead(produce(), depth=2)
    time.sleep(0.2)
    # 2 in the queue + 1 in hand waiting for room: never the whole stream
    assert len(produced) <= 3, produced
    got = []
    for x in fa:
        got.append(x)
        assert len(produced) <= len(got) + 3
    assert got == list(range(20))


def test_producer_error_is_raised_at_the_consumer_after_the_items_before_it():
    def produce():
        yield 1
        yield 2
        raise KeyError("boom")

    fa = FetchAhead(produce(), depth=4)
    assert next(fa) == 1 and next(fa) == 2
    with pytest.raises(KeyError, match="boom"):
        next(fa)
    with pytest.raises(StopIteration):
        next(fa)


def test_close_stops_a_producer_blocked_on_a_full_queue_and_runs_its_cleanup():
    cleaned = threading.Event()

    def produce():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            cleaned.set()

    fa = FetchAhead(produce(), depth=1)
    assert next(fa) == 0
    fa.close()
    assert cleaned.wait(2), "the producer's finally did not run"
    assert not fa._thread.is_alive()
    with pytest.raises(StopIteration):
        next(fa)


def test_wait_counts_only_the_consumer_waiting():
    def produce():
        for i in range(3):
            time.sleep(0.1)
            yield i

    fa = FetchAhead(produce(), depth=3)
    time.sleep(0.5)  # everything produced while the "step" runs
    assert list(fa) == [0, 1, 2]
    assert fa.wait_s < 0.05


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth"):
        FetchAhead(iter(()), depth=0)


def test_close_wakes_a_producer_blocked_on_its_source_and_runs_its_cleanup():
    source_closed = threading.Event()
    cleaned = threading.Event()

    def produce():
        try:
            yield 1
            source_closed.wait(30)  # blocked on its source (an executor waiting for a block)
            yield 2
        finally:
            cleaned.set()

    fetch = FetchAhead(produce(), depth=1)
    assert next(fetch) == 1
    t0 = time.monotonic()
    fetch.close(wake=source_closed.set)
    assert time.monotonic() - t0 < 5  # not the source's 30 s
    assert cleaned.is_set()
    with pytest.raises(StopIteration):
        next(fetch)

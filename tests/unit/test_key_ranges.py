"""A flat prefix listed by key ranges side by side (#47): every key once whatever the names
(the points are only a guess), ranges listed at the same time, and errors where they belong."""
from __future__ import annotations

import bisect
import hashlib
import threading
import time

import pytest

from sbloader.sources.key_ranges import in_ranges, key_ranges, split_points
from sbloader.sources.pages_ahead import PAGE_KEYS, PagesAhead

PREFIX = "b/p/"


class _Store:
    """Sorted keys under ``b/p/`` listed from any key on (S3's ``start-after``), a page of
    :data:`PAGE_KEYS` a request, handed on ``chunk`` keys at a time; it counts requests and
    the most in flight at once (each held ``delay`` seconds)."""

    def __init__(self, names, delay: float = 0.0, honours_after: bool = True, chunk: int = PAGE_KEYS) -> None:
        self.keys = sorted(PREFIX + n for n in names)
        self.delay, self.honours_after, self.chunk = delay, honours_after, chunk
        self.requests = self.in_flight = self.peak = 0
        self.lock = threading.Lock()

    def _request(self, after, token=None):
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        time.sleep(self.delay)
        with self.lock:
            self.in_flight -= 1
        if token is None and not self.honours_after:
            after = None
        at = bisect.bisect_right(self.keys, token or after) if (token or after) is not None else 0
        return self.keys[at:at + PAGE_KEYS]

    def pages(self, after=None):
        token = None  # the continuation token: the page's last key
        while True:
            page = self._request(after, token)
            for i in range(0, len(page), self.chunk):
                yield [(k, 1, 0) for k in page[i:i + self.chunk]]
            if len(page) < PAGE_KEYS:
                return
            token = page[-1]

    def listing(self):
        """The listing as the streamed prefix gets it: the first page, then the rest by key ranges."""
        stream = self.pages()
        first = next(stream)
        rest = [f[0] for p in key_ranges(first, stream, lambda after: self.pages(after), len(PREFIX)) for f in p]
        return [f[0] for f in first] + rest


NAMES = {
    "numbered": [f"img_{i:06d}.jpg" for i in range(12_345)],
    "hashes": [hashlib.sha1(str(i).encode()).hexdigest()[:12] + ".jpg" for i in range(9_000)],
    "unpadded": [f"img_{i}.jpg" for i in range(7_000)],
    "mixed": ([f"a{i:04d}" for i in range(3_000)] + [f"img_00{i}" for i in range(10)]
              + ["img_002", "img_01", "img_1"] + [f"Z{i}" for i in range(500)] + [f"z/{i}.png" for i in range(1_500)] + ["é", "日本", "~", "a0999/x"]),
}


@pytest.mark.parametrize("names", sorted(NAMES))
def test_every_key_once_whatever_the_names(names):
    store = _Store(NAMES[names])
    got = store.listing()
    assert sorted(got) == store.keys and len(got) == len(store.keys)


def test_a_store_that_ignores_start_after_still_lists_every_key_once():
    store = _Store(NAMES["numbered"][:4_000], honours_after=False)
    got = store.listing()
    assert sorted(got) == store.keys and len(got) == len(store.keys)


def test_ranges_read_in_parts_stop_where_their_range_ends():
    store = _Store(NAMES["numbered"], chunk=100)  # (how obstore hands a range's page on)
    got = store.listing()
    assert sorted(got) == store.keys and len(got) == len(store.keys)


def test_the_ranges_are_listed_side_by_side():
    """12,345 keys at 30 ms a request: one after the other 13 requests (0.39 s); by ranges at most
    a few round trips, with several requests in flight at once."""
    store = _Store(NAMES["numbered"], delay=0.03)
    t0 = time.perf_counter()
    assert sorted(store.listing()) == store.keys
    took = time.perf_counter() - t0
    assert store.peak >= 4, store.peak
    assert took < 13 * 0.03, took


def test_a_sub_prefix_listed_from_its_start_is_cut_into_ranges_beside_the_others():
    """A nested prefix's sub-prefix streamed side by side with others (``in_ranges``): once its first
    page is full, its key ranges are listed in the same :class:`PagesAhead`, every key once."""
    store = _Store(NAMES["hashes"], delay=0.01)
    other = _Store(["x/1", "x/2"])
    ahead = PagesAhead(other.pages(), grow=lambda add: [in_ranges(store.pages(), store.pages, len(PREFIX), add)])
    got = [f[0] for page in ahead for f in page]
    assert sorted(got) == sorted(store.keys + other.keys) and len(got) == len(store.keys) + 2
    assert store.peak >= 2 and store.requests >= 3


def test_a_listing_cut_before_a_key_keeps_its_ranges_before_it_too():
    """The stream that goes on through the first sub-prefix up to the next one (``stop``), cut into
    ranges: none of its ranges lists a key at or past ``stop`` (another listing's), each before once."""
    names = [f"a/{i:05d}.jpg" for i in range(6_000)] + ["b/", "b/0.jpg"] + [f"c/{i}.jpg" for i in range(1_500)]
    store = _Store(names)
    stop = PREFIX + "b/"
    ahead = PagesAhead(grow=lambda add: [in_ranges(store.pages(), store.pages, len(PREFIX), add, stop=stop)])
    got = [f[0] for page in ahead for f in page]
    assert sorted(got) == [k for k in store.keys if k < stop] and len(got) == 6_000
    assert store.requests > 6  # cut into ranges (6 pages one after the other otherwise, and one past)


def test_the_points_lie_above_the_page_below_the_ranges_end_and_follow_the_names():
    page = [f"{PREFIX}img_{i:06d}.jpg" for i in range(PAGE_KEYS)]
    # unbounded: ranges of 2, 2, 4, 8, 16 pages' worth of keys past the page (RANGE_KEYS, doubling)
    assert split_points(page, len(PREFIX)) == [PREFIX + f"img_0{k:02d}" for k in (2, 4, 8, 16, 32)]
    # bounded (a range of its own): every RANGE_KEYS keys up to its end, the carry two places up
    later = [f"{PREFIX}img_{i:06d}.jpg" for i in range(9_000, 10_000)]
    bounded = split_points(later, len(PREFIX), hi=PREFIX + "img_02")
    assert bounded[0] == PREFIX + "img_011" and all(later[-1] < p < PREFIX + "img_02" for p in bounded)
    assert bounded == sorted(set(bounded)) and len(bounded) == 5
    # as far again as the keys before the page, past the first 32 pages' worth
    far = split_points([f"{PREFIX}img_{i:06d}.jpg" for i in range(63_000, 64_000)], len(PREFIX))
    assert far[-1] == PREFIX + "img_12" and len(far) == 6  # (64,000 keys before it: to ~128,000)
    # names of another shape: no point carries into the letters of ``img_``
    unpadded = sorted(f"{PREFIX}img_{i}.jpg" for i in range(30_000))[:PAGE_KEYS]
    assert all(p.startswith(PREFIX + "img_") and p > unpadded[-1] for p in split_points(unpadded, len(PREFIX)))
    assert len(split_points(page, len(PREFIX), limit=3)) == 3
    assert all(p < PREFIX + "img_01" for p in split_points(page, len(PREFIX), stop=PREFIX + "img_01"))


def test_no_points_from_a_page_without_room_above_it():
    page = [f"{PREFIX}{i:03d}" for i in range(999)] + [PREFIX + "999"]
    assert split_points(page, len(PREFIX), hi=PREFIX + "9990") == []
    assert split_points(page[:1], len(PREFIX)) == []


def test_a_ranges_error_is_raised_and_the_others_stop():
    store = _Store(NAMES["numbered"][:5_000])
    calls = []

    def failing(after):
        calls.append(after)
        if len(calls) == 2:
            raise PermissionError("access denied listing s3://b/p/ (check the credentials)")
        return store.pages(after)

    stream = store.pages()
    first = next(stream)
    with pytest.raises(PermissionError, match="access denied"):
        list(key_ranges(first, stream, failing, len(PREFIX)))


def test_a_listing_may_add_streams_while_it_runs():
    def stream(name, add, more=()):
        yield [name]
        for m in more:  # a stream added by one that was added itself
            add(stream(m, add, () if m == "c" else ("c",)))
        yield [name + "'"]

    ahead = PagesAhead(grow=lambda add: [stream("a", add, ("b",))])
    got = sorted(x for page in ahead for x in page)
    assert got == ["a", "a'", "b", "b'", "c", "c'"]

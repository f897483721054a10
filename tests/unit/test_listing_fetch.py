"""The listing's fetch into the cache (#47): at most ``LISTING_IN_FLIGHT`` objects at a time, so
the driver's listing and the dataset's creation keep the GIL; what waits is dropped at the end."""
from __future__ import annotations

import threading
import time
from collections import namedtuple

from sbloader.sources import listing_pages
from sbloader.sources.cache import CacheConfig
from sbloader.sources.listing_pages import LISTING_IN_FLIGHT, ListingPrefetch

Obj = namedtuple("Obj", "uri size mtime_ns")


def _counting(prefetch: ListingPrefetch, hold_s: float) -> dict:
    seen = {"now": 0, "most": 0, "done": []}
    lock = threading.Lock()

    def fetch_one(uri: str, count: bool = False) -> dict:
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        time.sleep(hold_s)
        with lock:
            seen["now"] -= 1
            seen["done"].append(uri)
        return {"objects_read": 1}

    prefetch._remote = type("R", (), {"_prefetch_one": staticmethod(fetch_one), "max_in_flight": 128})()
    return seen


def test_the_listings_fetches_go_a_bounded_number_at_a_time_and_each_once(tmp_path):
    prefetch = ListingPrefetch(CacheConfig(True, str(tmp_path)), 128)
    seen = _counting(prefetch, 0.01)
    prefetch([Obj(f"s3://b/{i}", 10, 1) for i in range(150)])
    prefetch([Obj(f"s3://b/x{i}", 10, 1) for i in range(50)])
    deadline = time.monotonic() + 30
    while len(seen["done"]) < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(seen["done"]) == sorted([f"s3://b/{i}" for i in range(150)] + [f"s3://b/x{i}" for i in range(50)])
    assert seen["most"] <= LISTING_IN_FLIGHT  # all 200 at once on the 128 threads before
    assert seen["most"] > 1  # and side by side, not one after the other
    assert prefetch.wait() == {"objects_read": 200}


def test_at_the_listings_end_the_fetches_waiting_their_turn_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(listing_pages, "LISTING_IN_FLIGHT", 4)
    prefetch = ListingPrefetch(CacheConfig(True, str(tmp_path)), 128)
    seen = _counting(prefetch, 0.2)
    prefetch([Obj(f"s3://b/{i}", 10, 1) for i in range(100)])
    prefetch.stop()
    assert prefetch.wait() == {"objects_read": 4}  # the four in flight finished; none started after
    time.sleep(0.3)
    assert len(seen["done"]) == 4 and seen["most"] == 4


def test_the_page_a_listing_ends_with_is_not_fetched(tmp_path):
    """A page of fewer keys than a full one is the listing's last: its objects are left to the read
    tasks (the listing ends with it, so fetching them would not overlap the listing but compete with
    the first read task's GETs: a folder of one page, #47). A full page may have more after it."""
    prefetch = ListingPrefetch(CacheConfig(True, str(tmp_path)), 128)
    seen = _counting(prefetch, 0.0)
    prefetch([Obj(f"s3://b/last{i}", 10, 1) for i in range(30)], more=False)
    prefetch.stop()
    assert prefetch.wait() == {} and seen["done"] == []
    prefetch = ListingPrefetch(CacheConfig(True, str(tmp_path)), 128)
    seen = _counting(prefetch, 0.0)
    prefetch([Obj(f"s3://b/full{i}", 10, 1) for i in range(30)], more=True)
    deadline = time.monotonic() + 30
    while len(seen["done"]) < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefetch.wait() == {"objects_read": 30}


def test_a_long_listing_queues_only_its_first_objects(tmp_path, monkeypatch):
    """A long listing fetches no more than its first pages' objects before it ends (a few at a time),
    so later pages are not queued (each key of 100,000 taken and dropped cost the listing 0.1-0.2 s,
    #47): the first ``LISTING_PREFETCH_OBJECTS`` in the order the pages came."""
    monkeypatch.setattr(listing_pages, "LISTING_PREFETCH_OBJECTS", 120)
    prefetch = ListingPrefetch(CacheConfig(True, str(tmp_path)), 128)
    seen = _counting(prefetch, 0.0)
    for k in range(3):
        prefetch([Obj(f"s3://b/{k}-{i}", 10, 1) for i in range(100)])
    deadline = time.monotonic() + 30
    while len(seen["done"]) < 120 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert sorted(seen["done"]) == sorted([f"s3://b/0-{i}" for i in range(100)] + [f"s3://b/1-{i}" for i in range(20)])
    assert prefetch.wait() == {"objects_read": 120}

"""The listing page by page (#47): the next page asked for while the caller takes this one, and
the objects kept once, page by page, whatever way the prefix was listed."""
from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

from sbloader.sources.filesystems import _kept_by_pages
from sbloader.sources.listing_pages import PagesAhead
from sbloader.sources.prefix_listing import _Listed


def test_the_next_page_is_asked_for_while_the_caller_takes_this_one():
    asked, taking = [], threading.Event()

    def pages():
        for k in range(3):
            asked.append(k)
            if k == 1:  # the second page's request goes out while the first is being taken
                assert taking.wait(10)
            yield [k]

    it = PagesAhead(pages())
    assert next(it) == [0]
    taking.set()
    assert list(it) == [[1], [2]] and asked == [0, 1, 2]
    assert list(it) == []  # ended: stays ended


def test_a_listings_error_is_raised_where_its_page_would_have_come():
    def pages():
        yield ["a"]
        raise FileNotFoundError("no such bucket: 's3://gone' (check the bucket)")

    it = PagesAhead(pages())
    assert next(it) == ["a"]
    with pytest.raises(FileNotFoundError, match="s3://gone"):
        next(it)
    assert list(it) == []


def _held_at_the_second(asked: list, release: threading.Event, page: Any) -> Iterator[list]:
    """100 pages (``page(k)``), each asked for noted in ``asked``; the second held until ``release``."""
    for k in range(100):
        asked.append(k)
        if k == 1:
            assert release.wait(10)
        yield page(k)


def _until_asked(asked: list, n: int) -> None:
    for _ in range(1000):
        if len(asked) >= n:
            return
        threading.Event().wait(0.01)


def test_a_closed_listing_asks_for_no_further_page():
    asked, release = [], threading.Event()
    it = PagesAhead(_held_at_the_second(asked, release, lambda k: [k]))
    assert next(it) == [0]
    _until_asked(asked, 2)  # the second page's request in flight
    it.close()
    release.set()
    assert list(it) == []
    threading.Event().wait(0.2)
    assert asked == [0, 1]  # the page in flight at the close, none after


def test_the_objects_kept_page_by_page_stand_for_the_listing_only_when_they_are_its_files():
    p1, p2 = [_Listed("b/a/1.jpg", 1, 0), _Listed("b/a/2.jpg", 1, 0)], [_Listed("b/c/3.jpg", 1, 0)]
    pages = [(p1, ["k1", "k2"]), (p2, ["k3"])]
    assert _kept_by_pages(p1 + p2, pages) == ["k1", "k2", "k3"]
    rebuilt = [_Listed(f.path, f.size, f.mtime_ns) for f in p1 + p2]  # listed again in parallel
    assert _kept_by_pages(rebuilt, pages) is None
    assert _kept_by_pages(p1 + p2 + [_Listed("b/top.jpg", 1, 0)], pages) is None  # more than the pages
    assert _kept_by_pages(p1, pages) is None and _kept_by_pages(p1 + p2, []) is None


def test_a_listing_that_fails_in_the_driver_asks_for_no_further_page():
    from sbloader.sources.prefix_listing import list_prefix

    asked, release = [], threading.Event()

    class Sink:
        def pages(self, uri, path, filesystem):
            return PagesAhead(_held_at_the_second(asked, release, lambda k: [(f"b/p/{k:04d}.jpg", 1, 0)] * 1000))

        def __call__(self, page, more=True):
            _until_asked(asked, 2)  # the next page's request in flight
            raise ValueError("the driver could not take this page")

    with pytest.raises(ValueError, match="could not take"):
        list_prefix(None, "b/p", "s3://b/p/", None, None, Sink(), lambda files: files)
    release.set()
    threading.Event().wait(0.3)
    assert asked == [0, 1]  # the page asked for when it failed; none after


@pytest.mark.parametrize("pages_taken", [1, 2, 3])
def test_the_rest_listed_side_by_side_is_every_key_once_whatever_the_names(pages_taken):
    """The stream stops at the first sub-prefix of which no key came yet (by key order: ``c4.5/``
    sorts before ``c4/``), each of those is listed on its own, and the top level's later files come
    from the top-level listing: together with what the stream gave, every key once."""
    import pyarrow.fs as pafs

    from sbloader.sources.prefix_listing import _side_by_side

    dirs = ["b/p/c3", "b/p/c4", "b/p/c4.5", "b/p/c9"]
    tops = ["b/p/a.jpg", "b/p/c4.jpg", "b/p/c5.jpg", "b/p/z.jpg"]
    keys = sorted([f"{d}/{i}.jpg" for d in dirs for i in range(4)] + tops)
    pages = [[(k, 1, 0) for k in keys[i:i + 3]] for i in range(0, len(keys), 3)]
    taken = [f for p in pages[:pages_taken] for f in p]
    later = [d for d in dirs if d + "/" > taken[-1][0]]
    top = [pafs.FileInfo(d, pafs.FileType.Directory) for d in dirs] + \
        [pafs.FileInfo(t, pafs.FileType.File, size=1) for t in tops]

    class Sink:
        def pages(self, uri, path, filesystem):
            assert uri.rstrip("/") == "s3://" + path
            return iter([[(k, 1, 0) for k in keys if k.startswith(path + "/")]])

    rest = [f for p in _side_by_side(iter(pages[pages_taken:]), later, top, "s3://b/p/", "b/p", None, Sink())
            for f in p]
    got = [f[0] for f in taken + rest]
    assert sorted(got) == keys and len(got) == len(keys)

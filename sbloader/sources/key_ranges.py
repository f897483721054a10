"""A flat prefix listed by key ranges side by side (#47).

S3 lists a prefix one page of 1,000 keys a request, and each page's request needs the
previous page's continuation token: 100,000 keys under one prefix were 100 round trips one
after the other before the plan. A listing may instead start after any key
(``start-after``, obstore's ``offset``), so once the first page is in, the rest of the key
space is cut into ranges at points guessed from the characters the first page's keys vary
in (:func:`split_points`: after ``img_000999.jpg``, ``img_001``, ..., ``img_009``,
``img_01``, ..., ``img_1``, ...), and each range ``(lo, hi]`` is listed by a stream of its
own, side by side; a range whose first page is full is cut again the same way.

The guess decides only how fast: the ranges cover the whole key space above the first page,
each key falls in exactly one, and every stream keeps only its own range's keys (also when a
store ignores ``start-after``), so the listing, sorted by the caller, is the same as one
stream's. A guess that misses (ranges left empty, or one range holding most keys) costs a
request per empty range, or that range's pages one after the other as before.
"""
from __future__ import annotations

import bisect
from itertools import zip_longest
from typing import Callable, Iterator, Optional, Sequence

from sbloader.sources.pages_ahead import PAGE_KEYS, PagesAhead

#: Points one full page's keys cut the rest of its range at, at most (the range's remaining
#: streams; a range cut finer than this is cut again when its own first page is full).
SPLIT_POINTS = 32

#: Keys a range is expected to hold, at least (from the first page's keys per unit of key
#: space): each range costs a request more, whose page reads past the range's end.
RANGE_KEYS = 2 * PAGE_KEYS

#: Keys the points of one cut reach past the page, at most (expected): how long the rest is no
#: page tells, so the last range (unbounded) is cut again when its first page is full; ranges
#: far past the listing's end would each be a request answering nothing (a folder of 2,000 keys
#: cut at every level was 13 requests of 14 for nothing).
RANGE_COVER = 32 * PAGE_KEYS

#: Full pages of a sub-prefix listed side by side with others (a nested prefix's) before it is cut
#: into key ranges: 10 class folders of 2,000 keys, each cut after its first page, were 77
#: requests where 23 list them (the folders already side by side); 3 pages, a request or two
#: more than the folder's own.
SUB_PREFIX_PAGES = 3

#: Characters of a key past the page's common prefix looked at for the alphabet.
_ALPHABET_DEPTH = 64

#: Positions with points, at most, from the page's first varying one up (each level up is a
#: range as many times wider as the alphabet has characters; the last range, unbounded,
#: is cut again when its first page is full, so a long listing is reached level by level).
_LEVELS_UP = 2


def split_points(keys: Sequence[str], floor: int, hi: Optional[str] = None, limit: int = SPLIT_POINTS) -> list[str]:
    """Where to cut the keys after a full page of ``keys`` (sorted) into ranges listed side by side.

    The page's keys share a prefix of ``c`` characters and vary in some alphabet (the
    characters at the positions where they differ: digits for numbered names, hex digits for
    hashes). The rest of the listing lies above the page's last key ``L``; the candidate
    points are ``L[:j] + ch`` for every ``ch`` of the alphabet above ``L[j]``, at ``j = c``
    and up (not past ``floor``, the listing prefix's length: no point outside it) until
    :data:`_LEVELS_UP` positions gave points, all above ``L`` and below ``hi`` (the range's end,
    None: none). Reading the keys as numbers in that alphabet, the page tells how many keys a
    unit of key space holds; a candidate is kept where the range it closes is expected to hold
    :data:`RANGE_KEYS` keys or more (ranges of a few keys would each cost a request and a page
    read past their end), up to :data:`RANGE_COVER` keys past the page, at most ``limit`` of them.

    Args:
        keys: a full page's keys (the paths the store listed), in key order.
        floor: characters every key of the listing shares (its prefix and the ``/`` after it).
        hi: the end of the range the page belongs to (kept in it), or None.
        limit: points at most.

    Returns:
        Strictly increasing points, each above ``keys[-1]`` and below ``hi``.
    """
    if len(keys) < 2 or limit < 1:
        return []
    first, last = keys[0], keys[-1]
    c = 0
    while c < min(len(first), len(last)) and first[c] == last[c]:
        c += 1
    alphabet: set = set()
    for column in zip_longest(*(k[c:c + _ALPHABET_DEPTH] for k in keys)):
        seen = set(column)
        if len(seen) > 1:  # a position the names vary in (a name ending here counts as varying)
            alphabet |= seen
    alphabet.discard(None)
    found: set = set()
    base, levels = min(c, len(last) - 1), 0
    for base in range(min(c, len(last) - 1), max(floor, 0) - 1, -1):  # from ``c`` up, a level at a time
        level = {last[:base] + ch for ch in alphabet if ch > last[base]}
        found |= {p for p in level if hi is None or p < hi}
        levels += bool(level)
        if levels == _LEVELS_UP:
            break
    points = sorted(found)
    order = sorted(alphabet)
    depth = c + 4 - base  # the page's keys differ within a few characters past ``c``

    def value(key: str) -> float:  # the key as a fraction in the alphabet's base, from ``base``
        v, scale = 0.0, 1.0
        for ch in key[base:base + depth]:
            scale /= len(order)
            v += bisect.bisect_left(order, ch) * scale
        return v

    span = value(last) - value(first)
    if span <= 0:
        return points[:limit]
    kept, at, end = [], value(last), value(last)
    for p in points:
        if (value(p) - end) * len(keys) / span > RANGE_COVER:
            break  # the rest, where the listing may well have ended, is the last range's
        if (value(p) - at) * len(keys) / span >= RANGE_KEYS:
            kept.append(p)
            at = value(p)
    return kept[:limit]


def key_ranges(first: list, rest: Iterator[list], open_after: Callable[[str], Iterator[list]],
               floor: int, limit: int = SPLIT_POINTS) -> Iterator[list]:
    """The pages after ``first`` (a full page of ``(path, size, mtime_ns)``), listed by key ranges
    side by side: ``rest`` (the stream ``first`` came from) goes on up to the first point, and
    ``open_after(key)`` streams the keys after ``key`` for each range above it. Pages come as
    they are answered (the caller sorts)."""
    points = split_points([f[0] for f in first], floor, None, limit)
    if not points:
        yield from rest
        return
    def streams(add: Callable) -> list:
        return [_range(rest, first[-1][0], points[0], open_after, floor, limit, add, opened=True)] + \
            [_range(None, lo, hi, open_after, floor, limit, add) for lo, hi in zip(points, points[1:] + [None])]

    merged = PagesAhead(grow=streams)
    try:
        yield from merged
    finally:
        merged.close()


def in_ranges(pages: Iterator[list], open_after: Callable[[str], Iterator[list]], floor: int,
              add: Callable, stop: Optional[str] = None) -> Iterator[list]:
    """The pages of a listing (a prefix's, from its start) that, once :data:`SUB_PREFIX_PAGES` full pages
    came (it runs side by side with others already), cuts the rest into key ranges, each listed by ``open_after(key)`` in a stream handed to ``add`` (a
    :class:`PagesAhead`'s: the streams side by side with the others there); ``stop``: its keys and its
    ranges' end before that key (where other listings take over)."""
    return _range(pages, "", None, open_after, floor, SPLIT_POINTS, add, opened=True, cut_after=SUB_PREFIX_PAGES,
                  stop=stop)


def _range(pages: Optional[Iterator[list]], lo: str, hi: Optional[str], open_after: Optional[Callable],
           floor: int, limit: int, add: Callable, opened: bool = False, cut_after: int = 1,
           stop: Optional[str] = None) -> Iterator[list]:
    """The keys in ``(lo, hi]`` (and before ``stop``, if given): of ``pages`` (``opened``: a stream that
    goes on), or of ``open_after(lo)`` (opened here, in the stream's own thread); once ``cut_after``
    full pages came, the range is cut again at points guessed from the last of them (each part added
    by ``add``)."""
    split = False
    if not opened:
        pages = open_after(lo)
    bound, head = hi, []  # head: the range's first keys, a page of them cuts the range again
    try:
        for page in pages:  # (pages, or parts of one: only what is taken is made Python objects)
            kept = [f for f in page if f[0] > lo and (bound is None or f[0] <= bound) and (stop is None or f[0] < stop)]
            if not split:
                head += kept
                split = len(kept) < len(page)  # the range ended within its first page: not cut
                if len(head) >= cut_after * PAGE_KEYS and not split:
                    split = True
                    points = split_points([f[0] for f in head[-PAGE_KEYS:]], floor, hi or stop, limit)
                    for a, b in zip(points, points[1:] + [hi]):
                        add(_range(None, a, b, open_after, floor, limit, add, stop=stop))
                    bound = points[0] if points else hi
            if kept:
                yield kept
            if page and ((bound is not None and page[-1][0] > bound) or (stop is not None and page[-1][0] >= stop)):
                return  # past the range: the next ones list the rest
    finally:
        getattr(pages, "close", lambda: None)()

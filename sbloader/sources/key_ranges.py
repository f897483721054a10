"""A flat prefix listed by key ranges side by side (#47).

S3 lists a prefix one page of 1,000 keys a request, and each page's request needs the
previous page's continuation token: 100,000 keys under one prefix were 100 round trips one
after the other before the plan. A listing may instead start after any key
(``start-after``, obstore's ``offset``), so once the first page is in, the rest of the key
space is cut into ranges at points read from the first page's keys as numbers in the
alphabet they vary in (:func:`split_points`: after ``img_000999.jpg``, ``img_002``,
``img_004``, ``img_008``, ...: ranges of about 2, 2, 4, 8, ... pages, and the rest), and
each range ``(lo, hi]`` is listed by a stream of its own, side by side; a range whose first
page is full is cut again the same way.

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

#: Keys a range is expected to hold (from the page's keys per unit of key space): each range
#: costs a request more than its pages, whose answer is mostly past the range's end.
RANGE_KEYS = 2 * PAGE_KEYS

#: Keys the points of one cut of an unbounded range reach past its page, at least (expected):
#: how long the rest is no page tells, so the points lie at 2, 4, 8, ... of these past the page
#: (ranges doubling in size, each cut again when its first page is full) and the last range,
#: unbounded, is cut again when its first page is full, reaching as far again as the listing
#: came: a listing of a few pages asks a few requests for nothing, a long one is reached in as
#: many round trips as its length doubles.
RANGE_COVER = 32 * PAGE_KEYS

#: Full pages of a sub-prefix listed side by side with others (a nested prefix's) before it is cut
#: into key ranges: 10 class folders of 2,000 keys, each cut after its first page, were 77
#: requests where 23 list them (the folders already side by side); 3 pages, a request or two
#: more than the folder's own.
SUB_PREFIX_PAGES = 3

#: Characters of a key past the page's common prefix looked at for the alphabet.
_ALPHABET_DEPTH = 64

#: Positions above the page's first varying one that the points may change (a page of
#: ``img_009000.jpg``..``img_009999.jpg`` goes on at ``img_01``: a carry two places up).
_LEVELS_UP = 3


def split_points(keys: Sequence[str], floor: int, hi: Optional[str] = None, limit: int = SPLIT_POINTS,
                 stop: Optional[str] = None) -> list[str]:
    """Where to cut the keys after a full page of ``keys`` (sorted) into ranges listed side by side.

    The page's keys share a prefix of ``c`` characters and vary in some alphabet (the
    characters at the positions where they differ: digits for numbered names, hex digits for
    hashes). Read from a few positions above ``c`` (not before ``floor``, the listing prefix's
    length) as numbers in that alphabet, the keys fill key space at the page's density; the
    rest of the range lies between the page's last key ``L`` and ``hi`` (None: unbounded). A
    bounded range is cut every :data:`RANGE_KEYS` expected keys (or into ``limit`` parts); an
    unbounded one at 2, 4, 8, ... times :data:`RANGE_KEYS` past ``L`` up to
    :data:`RANGE_COVER` keys, or as many as came before ``L`` if more. Each point is the
    shortest string of the alphabet there, so ``img_000999.jpg`` is followed by ``img_003``,
    ``img_005``, ...: a guess that decides only how fast (every key lies in one range whatever
    the points).

    Args:
        keys: a full page's keys (the paths the store listed), in key order.
        floor: characters every key of the listing shares (its prefix and the ``/`` after it).
        hi: the end of the range the page belongs to (kept in it), or None.
        limit: points at most.
        stop: with ``hi`` None, a key the points stay below (where other listings take over:
            the range is unbounded up to it, not known to reach it).

    Returns:
        Strictly increasing points, each above ``keys[-1]`` and below ``hi`` and ``stop``.
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
    if not alphabet:
        return []
    order, base = sorted(alphabet), max(floor, c - _LEVELS_UP, 0)
    while base < c and not alphabet.issuperset(last[base:c]):
        base += 1  # (a carry goes through the alphabet's characters only: not into ``img_``)
    n, stem, depth = len(order), last[:base], c - base + 4

    def value(key: str) -> float:  # the key as a fraction in the alphabet's base, from ``base``
        v, scale = 0.0, 1.0
        for ch in key[base:base + depth]:
            scale /= n
            v += bisect.bisect_left(order, ch) * scale  # (a character outside it: where it would sort)
        return v

    at = value(last)
    per_key = (at - value(first)) / (len(keys) - 1)
    if per_key <= 0:
        return []
    end = 1.0 if hi is None or not hi.startswith(stem) else min(1.0, value(hi))
    if hi is None:
        reach = at + max(RANGE_COVER * per_key, at)  # as far again as the keys before L, if more
        steps = [at + RANGE_KEYS * per_key * 2 ** i for i in range(limit)]
        steps = [x for x in steps if x < reach] + [reach]
    else:
        step = max(RANGE_KEYS * per_key, (end - at) / limit)
        steps = [at + step * (i + 1) for i in range(limit)]
    points: list[str] = []
    for i, x in enumerate(steps):
        if x >= end:
            break
        width = x - (steps[i - 1] if i else at)
        digits = 1  # the shortest point that keeps to within half the range's width
        while n ** -digits > width / 2 and digits < depth:
            digits += 1
        q = int(x * n ** digits)
        p = stem + "".join(order[min(n - 1, (q // n ** (digits - 1 - d)) % n)] for d in range(digits))
        below = hi if hi is not None else stop
        if p > last and (below is None or p < below) and (not points or p > points[-1]):
            points.append(p)
    return points[:limit]


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
    merged = PagesAhead(grow=lambda add: [_range(rest, first[-1][0], points[0], open_after, floor, limit, add,
                                                 opened=True)] + _parts(points, None, open_after, floor, limit, add))
    try:
        yield from merged
    finally:
        merged.close()


def in_ranges(pages: Iterator[list], open_after: Callable[[str], Iterator[list]], floor: int,
              add: Callable, stop: Optional[str] = None, cut_after: int = SUB_PREFIX_PAGES) -> Iterator[list]:
    """The pages of a listing (a prefix's, from its start) that, once ``cut_after`` full pages came
    (:data:`SUB_PREFIX_PAGES`: it runs side by side with others already), cuts the rest into key
    ranges, each listed by ``open_after(key)`` in a stream handed to ``add`` (a :class:`PagesAhead`'s:
    the streams side by side with the others there); ``stop``: its keys and its ranges' end before
    that key (where other listings take over)."""
    return _range(pages, "", None, open_after, floor, SPLIT_POINTS, add, opened=True, cut_after=cut_after,
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
            kept = [f for f in page
                    if f[0] > lo and (bound is None or f[0] <= bound) and (stop is None or f[0] < stop)]
            if not split:
                head += kept
                split = len(kept) < len(page)  # the range ended within its first page: not cut
                if len(head) >= cut_after * PAGE_KEYS and not split:
                    split = True
                    points = split_points([f[0] for f in head[-PAGE_KEYS:]], floor, hi, limit, stop)
                    add(*_parts(points, hi, open_after, floor, limit, add, stop))
                    bound = points[0] if points else hi
            if kept:
                yield kept
            if page and ((bound is not None and page[-1][0] > bound) or (stop is not None and page[-1][0] >= stop)):
                return  # past the range: the next ones list the rest
    finally:
        getattr(pages, "close", lambda: None)()


def _parts(points: list[str], hi: Optional[str], open_after: Callable, floor: int, limit: int, add: Callable,
           stop: Optional[str] = None) -> list:
    """The ranges ``(points[i], points[i+1]]``, the last up to ``hi``, each a stream opened in its own thread."""
    return [_range(None, a, b, open_after, floor, limit, add, stop=stop) for a, b in zip(points, points[1:] + [hi])]

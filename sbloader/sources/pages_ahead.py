"""Listings side by side (:class:`PagesAhead`): each in a thread of its own, its pages handed on
as they are answered, the next page's request out while the caller takes this one (#47)."""
from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Callable, Iterator, Optional

#: Keys per S3 listing request: one page handed on at a time (a page of fewer is the last).
PAGE_KEYS = 1000

#: Listings a :class:`PagesAhead` runs at a time, at most (the others wait their turn).
LISTINGS_SIDE_BY_SIDE = 32


class PagesAhead:
    """The pages of one or more listings (``streams``), each listed in a thread of its own and
    handed on as it is answered: a listing's next page (whose request needs this page's
    continuation token) goes out while the caller takes this one (~5 ms of the driver's CPU a
    page of 1,000 keys, before on the listing's path, #47), and several listings (a nested
    prefix's sub-prefixes, a flat prefix's key ranges) go side by side, at most
    :data:`LISTINGS_SIDE_BY_SIDE` at a time; a listing may :meth:`add` others while it runs. An
    error of a listing is raised where its page would have come (the others stopped);
    :meth:`close` stops every one after the page it is asking for."""

    def __init__(self, *streams: Iterator[list], grow: Optional[Callable[[Callable], list]] = None) -> None:
        """``grow(add)``: more streams, made with this listing's :meth:`add` (for the streams to add theirs)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # the listing is kept whole anyway
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._waiting: deque = deque()  # streams added, not started yet
        self._running = 0  # threads listing
        self._open = 0  # streams added and not ended (the pages end with the last)
        self._done = False
        streams = streams + tuple(grow(self.add) if grow is not None else ())
        self.add(*streams)
        if not streams:
            self._queue.put((False, None))  # nothing to list

    def add(self, *streams: Iterator[list]) -> None:
        """List ``streams`` too (from a stream still running: a range adding its parts)."""
        start = []
        with self._lock:
            self._open += len(streams)
            self._waiting.extend(streams)
            while self._waiting and self._running < LISTINGS_SIDE_BY_SIDE:
                self._running += 1
                start.append(self._waiting.popleft())
        for stream in start:
            threading.Thread(target=self._run, args=(stream,), name="sbloader-listing-pages", daemon=True).start()

    def _run(self, pages: Iterator[list]) -> None:
        while pages is not None:
            try:
                if not self._stopped.is_set():
                    for page in pages:
                        self._queue.put((True, page))
                        if self._stopped.is_set():
                            break
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                self._queue.put((False, e))
            finally:
                getattr(pages, "close", lambda: None)()
            with self._lock:  # this stream ended: the next one waiting runs in this thread
                self._open -= 1
                pages = self._waiting.popleft() if self._waiting else None
                if pages is None:
                    self._running -= 1
                last = self._open == 0
            if last:
                self._queue.put((False, None))

    def __iter__(self) -> "PagesAhead":
        return self

    def __next__(self) -> list:
        while not self._done:
            more, got = self._queue.get()
            if more:
                return got
            self._done = True
            if got is not None:
                self.close()
                raise got
        raise StopIteration

    def close(self) -> None:
        """Stop listing (after the requests in flight): the caller lists otherwise."""
        self._stopped.set()
        self._done = True

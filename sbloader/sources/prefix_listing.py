"""How one prefix of a store is listed (:func:`list_prefix`): page by page in key order
through obstore, each page handed to a :class:`PageSink` as it comes; or, when the prefix
holds many sub-prefixes ("folders"), by Ray tasks each listing a group of them; or with
one recursive listing through pyarrow.

Streamed, the prefix's top level is listed (to count its sub-prefixes) only when the
first page has keys in sub-prefixes and is full, and then alongside the second page's
request, not after it: a nested prefix of two pages costs two round trips before the
plan, not three (#47). A stream is listed one page ahead in a thread of its own
(:class:`PagesAhead`), and once the top level shows fewer sub-prefixes than a parallel
listing is for, those the stream has not reached are streamed side by side.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol, Sequence

import ray

from sbloader.sources.key_ranges import in_ranges, key_ranges
from sbloader.sources.pages_ahead import PAGE_KEYS, PagesAhead


def mtime_ns(info: Any) -> int:
    """A ``pyarrow.fs.FileInfo``'s modification time in nanoseconds (0 when it has none)."""
    try:
        return int(info.mtime_ns or 0)
    except (AttributeError, TypeError, ValueError):
        return 0


def rel_path(base_path: str, child_path: str) -> str:
    """``child_path`` relative to ``base_path`` (filesystems differ on a leading ``/``)."""
    b, c = base_path.strip("/"), child_path.lstrip("/")
    if b and not c.startswith(b + "/"):
        raise ValueError(f"the filesystem listed {child_path!r} under {base_path!r}, which does not contain it")
    return c[len(b):].lstrip("/") if b else c


def join_uri(base_uri: str, base_path: str, child_path: str) -> str:
    """The URI of ``child_path`` listed under ``base_path`` (the fs path of ``base_uri``)."""
    return base_uri.rstrip("/") + "/" + rel_path(base_path, child_path)


#: A prefix with at least this many sub-prefixes ("folders") is listed by Ray tasks, each
#: listing a group of them, instead of by the driver alone.
PARALLEL_LISTING_MIN_PREFIXES = 64

#: Sub-prefixes one listing task lists, at most.
_PREFIXES_PER_LISTING_TASK = 16


class _Listed(NamedTuple):
    """A listed file: its path in the filesystem, size and modification time (picklable; a tuple:
    0.22 ms to make 1,000 against a frozen dataclass's 0.57, 100,000 of them a listing, #47)."""

    path: str
    size: int
    mtime_ns: int


def _list_recursive(fs: Any, path: str) -> list[_Listed]:
    import pyarrow.fs as pafs

    try:
        found = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return []
    return [_Listed(f.path, int(f.size or 0), mtime_ns(f)) for f in found if f.type == pafs.FileType.File]


def _top_level(fs: Any, path: str) -> Optional[list]:
    """The prefix's top level (one request: its objects and sub-prefixes), None if it is gone."""
    import pyarrow.fs as pafs

    try:
        return fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    except FileNotFoundError:
        return None


def _in_thread(fn: Any, *args: Any) -> Future:
    """``fn(*args)`` started in a thread of its own: its future (the result or the exception)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name="sbloader-listing-top", daemon=True).start()
    return fut


def list_prefixes(uris: Sequence[str], filesystem: Any, resolve: Callable) -> list[list[_Listed]]:
    """List each prefix recursively (what a listing task runs), each resolved by ``resolve``
    (:func:`sbloader.sources.filesystems.resolve`, passed by its caller: that module imports this one)."""
    out = []
    for u in uris:
        fs, path = resolve(u, filesystem)
        out.append(_list_recursive(fs, path))
    return out


_list_task = ray.remote(num_cpus=0.25, max_retries=3)(list_prefixes)


def list_prefix(fs: Any, path: str, uri: str, filesystem: Any, resolve: Callable,
                on_page: Optional[PageSink] = None, accept: Any = None) -> list[_Listed]:
    """Every file under ``path``: one recursive listing in the driver (with ``on_page``, a :class:`PageSink`,
    page by page where it can list the store so, each page handed to it as it comes, filtered by ``accept``),
    or, when the prefix has many sub-prefixes, one Ray task per group of them, each resolved by ``resolve``
    (the caller sorts). Streamed, the top level is listed (sub-prefixes counted) only when the first page is
    full and has a key in one, in a thread alongside the second page's request; the choice is made after
    the second page."""
    pages = on_page.pages(uri, path, filesystem) if on_page is not None else None
    try:
        return _list(fs, path, uri, filesystem, resolve, on_page, accept, pages)
    except BaseException:
        getattr(pages, "close", lambda: None)()  # a listing that failed here lists no further page
        raise


def _list(fs: Any, path: str, uri: str, filesystem: Any, resolve: Callable, on_page: Optional[PageSink],
          accept: Any, pages: Optional[Iterator[list]]) -> list[_Listed]:
    """:func:`list_prefix` of the ``pages`` it streams (None: listed otherwise)."""
    import pyarrow.fs as pafs

    files: list[_Listed] = []
    def take(page: list, more: Optional[bool] = None) -> None:  # (a page's tuples are its _Listed: not made again)
        files.extend(page)
        on_page(accept(page), more=len(page) >= PAGE_KEYS if more is None else more)

    nested, asked = False, None
    for page in pages or ():
        take(page)
        if nested:
            break  # sub-prefixes and a second page: as many as a parallel listing is for? (asked below, once)
        nested = len(files) == len(page) and any("/" in rel_path(path, f[0]) for f in page)
        if nested and len(page) >= PAGE_KEYS:  # a full page: more follow, the top level asked alongside the next
            asked = _in_thread(_top_level, fs, path)
        elif len(files) == len(page) >= PAGE_KEYS:  # a flat prefix of more pages: the rest by key ranges
            def after(key: str) -> Iterator[list]:
                return on_page.pages(uri, path, filesystem, after=key)

            for part in key_ranges(page, pages, after, len(path.strip("/")) + 1):
                take(part, more=True)  # (a range's last page is not the listing's)
            return files
    else:
        if pages is not None:
            return files  # whole (one page, sub-prefixes or not, is one request)
    top = asked.result() if asked is not None else _top_level(fs, path)
    if top is None:
        return files
    dirs = sorted(f.path for f in top if f.type == pafs.FileType.Directory)
    if not dirs and pages is None:  # a flat prefix: its top level is all of it (no second request)
        return [_Listed(f.path, int(f.size or 0), mtime_ns(f)) for f in top if f.type == pafs.FileType.File]
    if len(dirs) < PARALLEL_LISTING_MIN_PREFIXES:
        if pages is None:
            return _list_recursive(fs, path)
        later = [d for d in dirs if d + "/" > files[-1][0]]  # none of their keys listed yet
        for page in (_side_by_side(pages, later, top, uri, path, filesystem, on_page) if later else pages):
            take(page)
        return files
    getattr(pages, "close", lambda: None)()  # listed in parallel below: the stream stops
    from sbloader.runtime.session import ensure_initialized
    ensure_initialized()
    sub_uris = [join_uri(uri, path, d) for d in dirs]
    step = _PREFIXES_PER_LISTING_TASK
    refs = [_list_task.remote(sub_uris[i:i + step], filesystem, resolve) for i in range(0, len(sub_uris), step)]
    files = [_Listed(f.path, int(f.size or 0), mtime_ns(f)) for f in top if f.type == pafs.FileType.File]
    groups = [list(zip(dirs[i:i + step], sub_uris[i:i + step])) for i in range(0, len(dirs), step)]
    for listed_group, group in zip(ray.get(refs), groups):
        for (d, sub_uri), listed in zip(group, listed_group):
            # The task resolved the sub-prefix itself: put its paths back under ``d``.
            _, sub_path = resolve(sub_uri, filesystem)
            files.extend(_Listed(d.rstrip("/") + "/" + rel_path(sub_path, f.path), f.size, f.mtime_ns) for f in listed)
    return files


def _side_by_side(pages: Iterator[list], later: list[str], top: list, uri: str, path: str, filesystem: Any,
                  on_page: PageSink) -> Iterator[list]:
    """The rest of a streamed prefix, the sub-prefixes ``later`` (none of whose keys came yet) each
    streamed by its own listing side by side with the stream ``pages``, which goes on only up to the
    first of them; the top level's files past that from ``top``. Pages come as they are answered
    (the caller sorts): 20,000 keys in 10 class folders were 20 pages one after the other (#47);
    a sub-prefix of many pages is listed by key ranges (:mod:`~sbloader.sources.key_ranges`)."""
    import pyarrow.fs as pafs

    bound = min(d + "/" for d in later)  # (not later[0] + "/": "c4.5/" sorts before "c4/")
    subs = [on_page.pages(join_uri(uri, path, d), d, filesystem) for d in later]
    if any(s is None for s in subs):  # (not streamed after all: the stream alone, as it comes)
        yield from pages
        return
    rest = [(f.path, int(f.size or 0), mtime_ns(f)) for f in top if f.type == pafs.FileType.File and f.path >= bound]
    if rest:
        yield rest
    def opener(d: str) -> Callable[[str], Iterator[list]]:
        sub = uri if d == path else join_uri(uri, path, d)
        return lambda after: on_page.pages(sub, d, filesystem, after=after)

    # each listing cut by key ranges once it shows many pages (its parts added here); the stream (two full
    # pages came already) at its next full page, its keys and ranges before the bound
    merged = PagesAhead(grow=lambda add: [in_ranges(pages, opener(path), len(path.strip("/")) + 1, add,
                                                    stop=bound, cut_after=1)]
                        + [in_ranges(sub, opener(d), len(d.strip("/")) + 1, add) for sub, d in zip(subs, later)])
    try:
        yield from merged
    finally:
        merged.close()


class PageSink(Protocol):
    """What takes a listing page by page (:class:`~sbloader.sources.listing_pages.ListingPrefetch`)."""

    def pages(self, uri: str, path: str, filesystem: Any, after: Optional[str] = None) -> Optional[Iterator[list]]:
        """The prefix's objects (those after the path ``after``, if given) as pages of ``(path, size,
        mtime_ns)`` in key order, or None where the store cannot be listed so (then the listing is
        the usual one)."""

    def __call__(self, page: list, more: bool = True) -> None:
        """Take one page's kept objects (:class:`ObjectInfo`); ``more``: the page was full, so
        others may follow (a page of fewer keys is the listing's last)."""

"""Where a source's files live: local paths, or URIs of object stores and other
filesystems, resolved into a ``pyarrow.fs.FileSystem`` and a path inside it.

``s3://``, ``gs://`` (``gcs://``), ``abfs://`` (``abfss://``), ``hdfs://`` and
``viewfs://`` go through ``pyarrow.fs`` (credentials, region and endpoint from the
standard environment: for S3 ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE`` and the AWS
config files; for GCS Application Default Credentials, or ``STORAGE_EMULATOR_HOST``
for an emulator, anonymous). Any other scheme (``http://``, ``https://``...) goes through fsspec
when installed, wrapped as a pyarrow filesystem. A user's ``filesystem=`` (pyarrow's or
fsspec's) replaces the resolution for every URI.

Listing (:func:`list_uris`) pages through the store (1,000 keys a request on S3) and
returns the objects sorted by URI, with their size and modification time, so partition
ids are stable and a cache can tell a changed object (:mod:`sbloader.sources.cache`).
"""
from __future__ import annotations

import fnmatch
import os
import threading
import time
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple, Optional, Sequence
from urllib.parse import urlsplit

from sbloader.sources.prefix_listing import PageSink, list_prefix, mtime_ns, rel_path

#: Schemes resolved by ``pyarrow.fs.FileSystem.from_uri``.
PYARROW_SCHEMES = frozenset({"s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs"})

_GLOB_CHARS = frozenset("*?[")
_FS_CACHE: dict[tuple[str, str], tuple[Any, str]] = {}
_FS_LOCK = threading.Lock()


class ObjectInfo(NamedTuple):
    """One listed object (a tuple: a listing makes 100,000 of them, #47).

    Attributes:
        uri: the object's URI (``s3://bucket/key``), as rows' ``path`` shows it.
        size: bytes, from the listing.
        mtime_ns: last modification (nanoseconds since the epoch; 0 when the store
            does not say). With ``size`` it is the object's version for the cache.
    """

    uri: str
    size: int
    mtime_ns: int = 0

    @property
    def version(self) -> str:
        """``size-mtime``: changes when the object is written again."""
        return f"{self.size}-{self.mtime_ns}"


def scheme_of(path: Any) -> str:
    """The URI scheme of ``path`` in lower case, or ``""`` for a local path (``file://`` counts
    as local; so does a Windows drive letter)."""
    if not isinstance(path, str) or "://" not in path:
        return ""
    scheme = path.split("://", 1)[0].lower()
    return "" if scheme == "file" or len(scheme) <= 1 else scheme


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URI of a remote filesystem (anything but a local path)."""
    return scheme_of(path) != ""


def _as_arrow(filesystem: Any) -> Any:
    """A ``pyarrow.fs.FileSystem`` for a pyarrow or fsspec filesystem."""
    import pyarrow.fs as pafs

    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    try:
        import fsspec
    except ImportError:
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise TypeError(f"filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, found "
                    f"{type(filesystem).__name__}")


def _strip_scheme(uri: str, filesystem: Any) -> str:
    """The path of ``uri`` inside a user's ``filesystem``."""
    try:
        import fsspec
        if isinstance(filesystem, fsspec.AbstractFileSystem):
            return filesystem._strip_protocol(uri)
    except ImportError:
        pass
    if not is_remote(uri):
        return uri
    if scheme_of(uri) in ("hdfs", "viewfs"):  # the host is the filesystem, not part of the path
        return urlsplit(uri).path or "/"
    return uri.split("://", 1)[1]  # bucket/key (s3, gs, abfs: the container), or host/path


def resolve(uri: str, filesystem: Any = None) -> tuple[Any, str]:
    """The ``pyarrow.fs.FileSystem`` holding ``uri`` and the path inside it.

    Filesystems are built once per process for each (scheme, bucket or host) and
    reused: building an S3 filesystem may ask the store for the bucket's region.

    Args:
        uri: ``s3://bucket/key``, ``gs://...``, ``https://...``, or a local path.
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem to use instead
            of the one the scheme names.

    Raises:
        ValueError: the scheme needs fsspec and it is not installed, or fsspec has
            no filesystem for it.
    """
    import pyarrow.fs as pafs

    if filesystem is not None:
        return _as_arrow(filesystem), _strip_scheme(uri, filesystem)
    scheme = scheme_of(uri)
    if not scheme:
        local = uri.split("://", 1)[1] if uri.lower().startswith("file://") else uri
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(local))
    parts = urlsplit(uri)
    key = (scheme, parts.netloc)
    with _FS_LOCK:
        hit = _FS_CACHE.get(key)
    if hit is None:
        if scheme in ("gs", "gcs") and gcs_emulator():
            fs, root = _gcs_at(gcs_emulator()), parts.netloc
        elif scheme in PYARROW_SCHEMES:
            fs, root = pafs.FileSystem.from_uri(f"{scheme}://{parts.netloc}/")
        else:
            fs, root = _fsspec_resolve(uri), None
        hit = (fs, root)
        with _FS_LOCK:
            _FS_CACHE.setdefault(key, hit)
    fs, root = hit
    if root is None:  # fsspec: its own path rules
        return fs, fs.handler.fs._strip_protocol(uri)
    rest = uri.split("://", 1)[1][len(parts.netloc):].lstrip("/")
    return fs, (root.rstrip("/") + "/" + rest) if rest else root


#: The environment variable Google's client libraries read for a GCS emulator's address
#: (``http://127.0.0.1:9023``): ``gs://`` then goes there, with anonymous credentials.
GCS_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


def gcs_emulator() -> str:
    """``$STORAGE_EMULATOR_HOST`` as a URL (``http://`` added when no scheme is given), or ``""``."""
    host = os.environ.get(GCS_EMULATOR_ENV, "").rstrip("/")
    return host if not host or "://" in host else f"http://{host}"


def _gcs_at(url: str) -> Any:
    """pyarrow's GCS filesystem on the emulator at ``url``, anonymous."""
    import pyarrow.fs as pafs

    parts = urlsplit(url)
    return pafs.GcsFileSystem(anonymous=True, endpoint_override=parts.netloc, scheme=parts.scheme)


def _fsspec_resolve(uri: str) -> Any:
    import pyarrow.fs as pafs

    try:
        import fsspec
    except ImportError:
        raise ValueError(f"{uri!r} needs fsspec for its scheme {scheme_of(uri)!r}: pip install fsspec "
                         f"(and the package for the protocol, e.g. aiohttp for http), or pass filesystem=") from None
    try:
        fs, _ = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as e:
        raise ValueError(f"fsspec cannot open {uri!r}: {e}; install the package for the protocol or pass "
                         f"filesystem=") from e
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


@dataclass
class ListingStats:
    """How long listing took.

    Attributes:
        objects: objects listed (before filtering by extension).
        seconds: wall seconds spent listing.
        fetched: the :class:`~sbloader.sources.listing_pages.ListingPrefetch` that fetched the
            first pages' objects into the cache while listing (its ``wait()`` gives their
            counts, which the read stage's ``stats()`` does not hold), or None.
    """

    objects: int = 0
    seconds: float = 0.0
    fetched: Any = None

    @property
    def seconds_per_1000(self) -> float:
        """Listing seconds per 1,000 objects."""
        return 1000.0 * self.seconds / self.objects if self.objects else 0.0


def _kept_by_pages(files: list, pages: list) -> Optional[list]:
    """What the streamed pages kept, where ``files`` is exactly those pages' files in turn (a
    listing that went on in parallel rebuilt its files: None, they are kept anew)."""
    at = 0
    for listed, _ in pages:
        if not listed or at >= len(files) or files[at] is not listed[0]:
            return None
        at += len(listed)
    if not pages or at != len(files):
        return None
    return [o for _, kept in pages for o in kept]


#: What the last :func:`list_uris` call in this process measured.
LAST_LISTING = ListingStats()


def list_uris(entries: Sequence[str], extensions: Optional[tuple[str, ...]], what: str,
              skip_prefixes: tuple[str, ...] = (".",), filesystem: Any = None,
              on_page: Optional["PageSink"] = None) -> list[ObjectInfo]:
    """List URIs (prefixes, globs, objects) into objects sorted by URI within each entry.

    A prefix (``s3://bucket/dir/``, or ``s3://bucket/dir`` naming no object: one request
    more, asking whether it is an object) is listed recursively, leaving out names (and
    folders) starting with one of ``skip_prefixes``; a glob (``*``, ``?``, ``[`` after the last ``/`` before them)
    lists its folder and keeps the matches. Both keep only names ending with one of
    ``extensions`` (lower case, with the dot). An object named explicitly is kept.

    Args:
        entries: URIs, in the user's order (kept).
        extensions: extensions to keep when listing (None: every object).
        what: what the caller reads, for error messages (``"image"``).
        skip_prefixes: name prefixes a listing leaves out.
        filesystem: the user's filesystem, or None to resolve from the scheme.
        on_page: a :class:`PageSink`, called with each listing page's kept objects (a list
            of :class:`ObjectInfo`, in key order) as the page comes, where it lists the
            store page by page; the result is the same.

    Returns:
        One :class:`ObjectInfo` per object.

    Raises:
        FileNotFoundError: an entry names nothing (the message names the URI).
        ValueError: a prefix or glob holds nothing to read.
    """
    import pyarrow.fs as pafs

    t0 = time.perf_counter()
    listed = 0
    out: list[ObjectInfo] = []

    for uri in entries:
        fs, path = resolve(uri, filesystem)
        pattern = None
        if _GLOB_CHARS & set(uri.split("://", 1)[-1]):
            head = uri[:min(uri.index(c) for c in _GLOB_CHARS if c in uri)]
            base_uri = head[:head.rfind("/") + 1] if "/" in head.split("://", 1)[-1] else head
            pattern, uri = path, base_uri
            fs, path = resolve(base_uri, filesystem)
        # A URI ending in "/" names a prefix: no request asks whether it is an object (one
        # round trip less before the first GET; an S3 key ending in "/" is a folder marker).
        info = fs.get_file_info(path) if pattern is None and not uri.endswith("/") else None
        if info is not None and info.type == pafs.FileType.File:
            out.append(ObjectInfo(uri, int(info.size or 0), mtime_ns(info)))
            listed += 1
            continue
        def accept(files: list[_Listed], uri: str = uri, path: str = path, pattern: Any = pattern) -> list[ObjectInfo]:
            # (each key looked at once, the usual one by slicing only: a listing can be 100,000 keys, #47)
            base, out, root = uri.rstrip("/") + "/", [], path.strip("/")
            head = root + "/" if root else ""
            cut, new, keep = len(head), tuple.__new__, out.append
            for f in files:
                p = f[0]
                if p.startswith(head) and p[cut:cut + 1] != "/":
                    rel = p[cut:]
                else:  # a leading "/", or not under the prefix (which raises)
                    rel = p.lstrip("/")
                    if root:
                        if not rel.startswith(head):
                            rel_path(path, p)  # raises: not under the prefix
                        rel = rel[len(root):].lstrip("/")
                name = rel.rpartition("/")[2]
                if (extensions is not None and not name.lower().endswith(extensions)) or \
                        (pattern is not None and not fnmatch.fnmatchcase(p, pattern)):
                    continue
                if name.startswith(skip_prefixes) or ("/" in rel and any(
                        part.startswith(skip_prefixes) for part in rel.split("/"))):
                    continue
                keep(new(ObjectInfo, (base + rel, f[1], f[2])))  # (ObjectInfo(...): 2x the time)
            return out

        pages: list = []  # what the streamed pages kept, each with the listed files it came from

        def accept_page(files: list[_Listed]) -> list[ObjectInfo]:
            pages.append((files, accept(files)))
            return pages[-1][1]

        files = list_prefix(fs, path.rstrip("/") or "/", uri, filesystem, resolve, on_page, accept_page)
        listed += len(files)
        kept = sorted(_kept_by_pages(files, pages) or accept(files), key=itemgetter(0))  # by URI
        if not kept:
            if not files and pattern is None:
                raise FileNotFoundError(f"no such object or prefix: {uri!r} (check the bucket, the key and the "
                                        f"credentials/endpoint in the environment)")
            raise ValueError(f"found no {what} objects with extensions {list(extensions or ())} under "
                             f"{(uri + ('' if pattern is None else ' matching the pattern'))!r}; check the URI "
                             f"or pass extensions=...")
        out.extend(kept)
    LAST_LISTING.objects, LAST_LISTING.seconds = listed, time.perf_counter() - t0
    LAST_LISTING.fetched = on_page
    return out

"""What every file source shares: listing paths into a stable order, cutting them into
partitions, validating ``on_error``, and naming the file a read failed on.

Only names are listed in the driver (no file is opened there); the files are
opened in the remote read tasks.
"""
from __future__ import annotations

import glob
import math
import os
import traceback
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from sbloader.core.context import get_context
from sbloader.core.errors import SourceReadError
from sbloader.sources.ahead import EpochAhead
from sbloader.sources.base import IO_UNIT_SHUFFLE_WINDOW, Partition

PathLike = Union[str, "os.PathLike[str]"]

_ON_ERROR = ("raise", "skip")
_GLOB_CHARS = frozenset("*?[")


def check_on_error(on_error: Any) -> str:
    """Validate an ``on_error`` argument.

    Args:
        on_error: the value given by the user.

    Returns:
        ``on_error`` unchanged.

    Raises:
        ValueError: it is not ``"raise"`` or ``"skip"``.
    """
    if not isinstance(on_error, str) or on_error not in _ON_ERROR:
        raise ValueError(
            f"on_error must be 'raise' (stop at the first unreadable input) or 'skip' "
            f"(skip it and count it in stats().skipped), found {on_error!r}"
        )
    return on_error


def list_files(paths: Union[PathLike, Sequence[PathLike]], extensions: Optional[Sequence[str]],
               what: str, skip_prefixes: tuple[str, ...] = (".",)) -> list[str]:
    """Expand directories, globs and files into a stable list of absolute file paths.

    A directory is listed recursively and sorted, leaving out files and folders
    whose name starts with one of ``skip_prefixes``; a glob's matches are sorted. Both keep only
    names ending with one of ``extensions`` (case-insensitive). A file named
    explicitly is always kept. A list keeps the order given, each entry expanded
    as above. Only names are listed: no file is opened.

    Args:
        paths: a directory, a glob, a file, or a list of those.
        extensions: extensions to keep when listing (None: every file).
        what: what the caller reads, for error messages (``"image"``).
        skip_prefixes: name prefixes of entries a directory listing leaves out
            (hidden files; Parquet also leaves out ``_SUCCESS``, ``_metadata``...).

    Returns:
        Absolute paths.

    Raises:
        FileNotFoundError: a path does not exist or a glob matches nothing.
        ValueError: nothing to read was found.
    """
    if isinstance(paths, (str, os.PathLike)):
        entries = [paths]
    else:
        try:
            entries = list(paths)
        except TypeError:
            raise TypeError(
                f"paths must be a path, a glob or a list of those, found {type(paths).__name__}"
            ) from None
    if not entries:
        raise ValueError(f"read_{what}s needs at least one path, found an empty list")
    exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions) if extensions else None

    def keep(name: str) -> bool:
        return exts is None or name.lower().endswith(exts)

    out: list[str] = []
    for entry in entries:
        if not isinstance(entry, (str, os.PathLike)):
            raise TypeError(f"each path must be a str or os.PathLike, found {entry!r}")
        p = os.path.abspath(os.path.expanduser(os.fspath(entry)))
        if os.path.isdir(p):
            found = sorted(_walk(p, keep, skip_prefixes))
            if not found:
                raise ValueError(
                    f"found no {what} files with extensions {list(exts or ())} under {os.fspath(entry)!r}; "
                    f"check the directory or pass extensions=..."
                )
            out.extend(found)
        elif os.path.isfile(p):
            out.append(p)
        elif _GLOB_CHARS & set(os.fspath(entry)):
            found = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f) and keep(f))
            if not found:
                raise FileNotFoundError(
                    f"the pattern {os.fspath(entry)!r} matches no {what} file"
                    f"{f' with extensions {list(exts)}' if exts else ''}; check the pattern"
                )
            out.extend(found)
        else:
            raise FileNotFoundError(f"no such file or directory: {os.fspath(entry)!r}")
    return out


def list_inputs(paths: Union[PathLike, Sequence[PathLike]], extensions: Optional[Sequence[str]], what: str,
                skip_prefixes: tuple[str, ...] = (".",), filesystem: Any = None,
                on_page: Any = None) -> tuple[list[str], dict]:
    """List local paths (as :func:`list_files`) and remote URIs (``s3://``, ``gs://``,
    ``https://``...: :func:`~sbloader.sources.filesystems.list_uris`), entry by entry in
    the order given.

    Args:
        paths: local paths, URIs, globs of either, or a list of those.
        extensions: extensions to keep when listing (None: every file).
        what: what the caller reads, for error messages (``"image"``).
        skip_prefixes: name prefixes a listing leaves out.
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem that every entry
            is read through (None: local paths from the OS, URIs by their scheme).
        on_page: called with each remote listing page's objects as it comes
            (:func:`~sbloader.sources.filesystems.list_uris`).

    Returns:
        The paths and URIs, and ``{uri: (size, mtime_ns)}`` for the remote ones (what
        the read tasks' cache checks entries against).
    """
    from sbloader.sources.filesystems import is_remote, list_uris

    if isinstance(paths, (str, os.PathLike)):
        entries = [paths]
    else:
        try:
            entries = list(paths)
        except TypeError:
            raise TypeError(
                f"paths must be a path, a URI, a glob or a list of those, found {type(paths).__name__}"
            ) from None
    if filesystem is None and not any(is_remote(e) for e in entries):
        return list_files(paths, extensions, what, skip_prefixes), {}
    if not entries:
        raise ValueError(f"read_{what}s needs at least one path, found an empty list")
    exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions) if extensions else None
    out: list[str] = []
    versions: dict = {}
    for entry in entries:
        if not isinstance(entry, (str, os.PathLike)):
            raise TypeError(f"each path must be a str or os.PathLike, found {entry!r}")
        e = os.fspath(entry)
        if filesystem is None and not is_remote(e):
            out.extend(list_files(e, extensions, what, skip_prefixes))
            continue
        for obj in list_uris([e], exts, what, skip_prefixes, filesystem, on_page):
            out.append(obj.uri)
            versions[obj.uri] = (obj.size, obj.mtime_ns)
    return out, versions


def _walk(root: str, keep: Callable[[str], bool], skip_prefixes: tuple[str, ...]) -> Iterable[str]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(skip_prefixes)]
        for f in filenames:
            if not f.startswith(skip_prefixes) and keep(f):
                yield os.path.join(dirpath, f)


def files_per_partition_for(num_files: int, files_per_partition: Optional[int],
                            num_partitions: Optional[int], default: int) -> int:
    """Resolve how many files go into one partition.

    Args:
        num_files: files listed.
        files_per_partition: the user's value, or None.
        num_partitions: the user's value, or None.
        default: used when neither is given.

    Returns:
        Files per partition (>= 1).

    Raises:
        ValueError: both are given, or one is not a positive integer.
    """
    if files_per_partition is not None and num_partitions is not None:
        raise ValueError(
            f"give files_per_partition ({files_per_partition!r}) or num_partitions "
            f"({num_partitions!r}), not both"
        )
    for name, v in (("files_per_partition", files_per_partition), ("num_partitions", num_partitions)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"{name} must be a positive integer, found {v!r}")
    if num_partitions is not None:
        return max(1, math.ceil(num_files / int(num_partitions)))
    return int(files_per_partition) if files_per_partition is not None else default


def read_error(partition: Partition, path: str, exc: BaseException, hint: str) -> SourceReadError:
    """A :class:`SourceReadError` for a file, with the operator, partition and epoch of the running task.

    Call it inside an ``except`` block (it captures the current traceback).

    Args:
        partition: the partition being read.
        path: the file that failed.
        exc: the exception raised while reading it.
        hint: what the user can do, appended to the message.
    """
    ctx = get_context()
    operator = ctx.operator if ctx is not None else "read"
    epoch = ctx.epoch if ctx is not None else -1
    pid = ctx.partition_id if ctx is not None else partition.id
    return SourceReadError(operator, pid, epoch, traceback.format_exc(), f"{exc!r}; {hint}", path=path)


def check_size(size: Any) -> Optional[tuple[int, int]]:
    """A ``(width, height)`` of positive integers, or None; ``ValueError`` naming the value otherwise."""
    if size is None:
        return None
    try:
        w, h = size
    except (TypeError, ValueError):
        raise ValueError(f"size must be (width, height), found {size!r}") from None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in (w, h)):
        raise ValueError(f"size must be (width, height) with positive integers, found {size!r}")
    return int(w), int(h)


class IOUnitSource:
    """Base of a file source whose partitions are fixed units of I/O (row groups or their
    row ranges, videos or their frame ranges), planned once from the files' metadata and
    the same every epoch. Their rows sit together in the input, so a shuffled batch draws
    from several (``shuffle_window``). Subclasses set ``_files`` and ``_parts``."""

    #: A partition is one unit of I/O whose rows sit together in the input: a shuffled
    #: batch draws from several.
    shuffle_window = IO_UNIT_SHUFFLE_WINDOW
    _files: list
    _parts: list
    _remote: Any = None  # a RemoteFiles when the files are remote
    _planned: tuple = (0, False)  # the last partitions() call's epoch seed and shuffle (shared()'s order)

    @property
    def files(self) -> list:
        """The files' metadata, in partition order."""
        return list(self._files)

    def shared(self) -> Any:
        """Remote files cached: each partition's file and the order the epoch's plan runs them in
        (:class:`~sbloader.sources.ahead.EpochAhead`: a read task fetches the files of the
        partitions that run next into the node's cache, under ``shuffle`` not those of the next
        ids); otherwise nothing."""
        if self._remote is None or not self._remote.cache.enabled:
            return None
        return EpochAhead.of(tuple(p.payload.path for p in self._parts), *self._planned)

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        """The planned partitions; the same for every epoch (the epoch's seed and shuffle are
        kept for :meth:`shared`'s order)."""
        self._planned = (int(epoch_seed), bool(shuffle))
        return list(self._parts)

    def row_bytes(self) -> Optional[float]:
        """Stored bytes per row (the local files' sizes over their rows), or None when unknown
        (remote files): sizes a shuffle window in rows before any block exists."""
        rows = self.num_rows()
        paths = {getattr(p.payload, "path", None) for p in self._parts}
        if not rows or self._remote is not None or None in paths:
            return None
        try:
            return sum(os.path.getsize(p) for p in paths) / rows
        except (OSError, TypeError):
            return None

    def num_rows(self) -> Optional[int]:
        """Rows from the files' metadata (None when a file's is unreadable under ``"raise"``)."""
        if any(p.num_rows is None for p in self._parts):
            return None
        return sum(p.num_rows for p in self._parts)

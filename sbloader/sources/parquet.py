"""``read_parquet``: Parquet files read with pyarrow, one row group per partition.

Partitions come from the files' footers (row-group metadata), so every
partition's row count is known before anything is read. Footers of more than a
handful of files are read in remote Ray tasks (one task per chunk of files,
gathered with a single ``ray.get``); the driver only lists names. Row groups are
read in the remote read tasks and turned into NumPy columns: binary columns
become object arrays of ``bytes`` (decode them in a following ``map_batches``).
A read process parses each file's footer once and keeps it while the file keeps
its size and modification time (:func:`cached_footer`).
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import ray

from sbloader.core.block import ROW_COLUMN, Block
from sbloader.core.context import report_skipped
from sbloader.sources.files import IOUnitSource, read_error
from sbloader.sources.base import Partition
from sbloader.sources.ranged_object import RangedObject

#: Extensions ``read_parquet`` lists in a directory or a glob by default.
PARQUET_EXTENSIONS = (".parquet", ".parq", ".pq")

#: Up to this many files, the driver reads the footers itself; above, remote tasks do.
DRIVER_FOOTER_MAX_FILES = 4

#: Fewest files one remote footer task reads.
_MIN_FILES_PER_FOOTER_TASK = 4

#: Serialized footer bytes a read process keeps parsed (the most recent files).
FOOTER_CACHE_BYTES = 64 * 2**20

_FOOTERS: "OrderedDict[tuple, Any]" = OrderedDict()  # (path, size, mtime_ns) -> FileMetaData
_FOOTERS_LOCK = threading.Lock()


class FileMeta(NamedTuple):
    """What a Parquet footer says about one file.

    Attributes:
        path: absolute path of the file.
        row_groups: rows of each row group, in file order.
        columns: top-level column names of the file's schema.
        error: why the footer could not be read ("" when it could).
    """

    path: str
    row_groups: tuple[int, ...]
    columns: tuple[str, ...]
    error: str = ""


class Piece(NamedTuple):
    """The payload of one Parquet partition: rows ``[start, stop)`` of one row group.

    Attributes:
        path: the file.
        row_group: index of the row group in the file (-1 for an unreadable file).
        start: first row, relative to the row group.
        stop: one past the last row, relative to the row group.
        row_group_rows: rows of the whole row group.
        error: the footer error of an unreadable file ("" otherwise).
    """

    path: str
    row_group: int
    start: int
    stop: int
    row_group_rows: int
    error: str = ""


class ParquetFooterError(OSError):
    """The footer of a Parquet file could not be read when the dataset was planned."""


#: Bytes read from an object's end for its footer: one ranged GET holds most footers whole.
FOOTER_TAIL_BYTES = 64 * 1024
#: Remote footers the driver reads itself (threads: the requests wait on the store, not the CPU).
DRIVER_REMOTE_FOOTER_MAX_FILES = 256


def _tail_metadata(uri: str, remote: Any) -> Any:
    """An object's footer by ranged GETs of its end (its size from the listing: no HEAD), retried
    and counted as every ranged read (:meth:`~sbloader.sources.fetch.RemoteFiles.read_range`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = int(remote.versions[uri][0])
    start = max(0, size - FOOTER_TAIL_BYTES)
    tail = remote.read_range(uri, start, size) if size else b""
    if len(tail) < 12 or tail[-4:] != b"PAR1":
        raise ValueError(f"{uri!r} is not a Parquet file (its last 4 bytes are not PAR1; {size} bytes)")
    need = int.from_bytes(tail[-8:-4], "little") + 8
    if need > len(tail) and start > 0:  # a footer larger than the tail: one more request for the rest
        tail = remote.read_range(uri, max(0, size - need), start) + tail
    return pq.read_metadata(pa.BufferReader(tail))


def read_footer(path: str, filesystem: Any = None, remote: Any = None) -> FileMeta:
    """Read one file's footer; a failure is recorded in ``FileMeta.error``, never raised.

    Args:
        path: the file, or an object's URI (only the footer's bytes are read: range requests).
        filesystem: the user's ``filesystem=`` for URIs (None: each URI's scheme decides).
        remote: the source's :class:`~sbloader.sources.fetch.RemoteFiles`: a listed object's end
            is then read by its ranged GETs, with no HEAD.
    """
    import pyarrow.parquet as pq

    from sbloader.sources.filesystems import is_remote, resolve

    try:
        if filesystem is None and remote is not None and path in remote.versions:
            md = _tail_metadata(path, remote)
        elif is_remote(path) or filesystem is not None:
            fs, inner = resolve(path, filesystem)
            with fs.open_input_file(inner) as f:
                md = pq.read_metadata(f)
        else:
            md = pq.read_metadata(path)
        names = tuple(md.schema.to_arrow_schema().names)
        rgs = tuple(int(md.row_group(i).num_rows) for i in range(md.num_row_groups))
        return FileMeta(path, rgs, names)
    except Exception as e:
        return FileMeta(path, (), (), repr(e))


def read_footers(paths: Sequence[str], filesystem: Any = None, remote: Any = None) -> list[FileMeta]:
    """Read the footers of several files (see :func:`read_footer`); remote ones several at once."""
    from sbloader.sources.filesystems import is_remote

    if len(paths) > 1 and (filesystem is not None or any(is_remote(p) for p in paths)):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(32, len(paths))) as pool:
            return list(pool.map(lambda p: read_footer(p, filesystem, remote), paths))
    return [read_footer(p, filesystem, remote) for p in paths]


_read_footers_task = ray.remote(num_cpus=1, max_retries=3)(read_footers)


def gather_footers(paths: Sequence[str], filesystem: Any = None, remote: Any = None) -> list[FileMeta]:
    """Footers of every file: in the driver for a handful (up to 256 remote objects, whose reads
    wait on the store), else in remote Ray tasks.

    Args:
        paths: the files (or URIs), in order.
        filesystem: the user's ``filesystem=`` for URIs.
        remote: the source's :class:`~sbloader.sources.fetch.RemoteFiles` (listed objects' footers
            then need no HEAD).

    Returns:
        One :class:`FileMeta` per path, in the same order.
    """
    from sbloader.sources.filesystems import is_remote

    far = filesystem is not None or any(is_remote(p) for p in paths)
    if len(paths) <= (DRIVER_REMOTE_FOOTER_MAX_FILES if far else DRIVER_FOOTER_MAX_FILES):
        return read_footers(paths, filesystem, remote)
    from sbloader.runtime.session import cluster_cpus, ensure_initialized

    ensure_initialized()
    per_task = max(_MIN_FILES_PER_FOOTER_TASK, math.ceil(len(paths) / max(1, int(2 * cluster_cpus()))))
    shared = ray.put(remote) if remote is not None else None  # its listing once, not once a task
    refs = [_read_footers_task.remote(list(paths[i:i + per_task]), filesystem, shared)
            for i in range(0, len(paths), per_task)]
    return [m for chunk in ray.get(refs) for m in chunk]


# ----- reading (runs in the remote read tasks) -----------------------------------


def cached_footer(path: str) -> Any:
    """The parsed footer (``pyarrow.parquet.FileMetaData``) of ``path``, parsed once
    per process while the file keeps its size and modification time.

    Every partition of a file needs its footer, and parsing it is most of the cost
    of reading a small row group from a file with many row groups
    (``benchmarks/results/parquet_read.md``). A read
    process keeps the footers of the files it read last, up to
    :data:`FOOTER_CACHE_BYTES` of serialized footer (and at least the newest one).

    Args:
        path: the file.
    """
    import pyarrow.parquet as pq

    st = os.stat(path)
    return _remembered((path, st.st_size, st.st_mtime_ns), lambda: pq.read_metadata(path))


def _remembered(key: tuple, parse: Any) -> Any:
    """The footer remembered under ``key`` (a file's path, size and change time; an object's
    URI and listed version), else ``parse()``'d and remembered."""
    with _FOOTERS_LOCK:
        md = _FOOTERS.get(key)
        if md is not None:
            _FOOTERS.move_to_end(key)
            return md
    md = parse()
    with _FOOTERS_LOCK:
        _FOOTERS[key] = md
        total = sum(m.serialized_size for m in _FOOTERS.values())
        while total > FOOTER_CACHE_BYTES and len(_FOOTERS) > 1:
            _, old = _FOOTERS.popitem(last=False)
            total -= old.serialized_size
    return md


def _column_to_numpy(col: Any) -> np.ndarray:
    """One Arrow column as a NumPy array (binary/string/list/struct: object arrays)."""
    import pyarrow as pa

    t = col.type
    if pa.types.is_fixed_size_list(t) and col.null_count == 0 and len(col) > 0:
        flat = col.combine_chunks().flatten()
        if not pa.types.is_nested(flat.type):
            return flat.to_numpy(zero_copy_only=False).reshape(len(col), t.list_size)
    return col.to_numpy()


def _open(piece: Piece, remote: Any) -> Any:
    """A ``ParquetFile`` of the piece: a local file (or a remote object's cache entry) with
    its footer parsed once per process; with the cache off, the object itself (range reads)."""
    import pyarrow.parquet as pq

    src = remote.local_or_random_access(piece.path) if remote is not None else piece.path
    if isinstance(src, str):
        return pq.ParquetFile(src, metadata=cached_footer(src))
    if isinstance(src, RangedObject):  # the footer by its listed size, once per process; a row group's
        # column chunks in coalesced ranges (pre_buffer), not a request each
        footer = _remembered((src.uri, *remote.versions[src.uri]), lambda: _tail_metadata(src.uri, remote))
        return pq.ParquetFile(src, metadata=footer, pre_buffer=True)
    return pq.ParquetFile(src)


def _read_rows(piece: Piece, columns: Optional[Sequence[str]], remote: Any = None) -> Any:
    """Rows ``[start, stop)`` of the piece's row group as an Arrow table."""
    import pyarrow as pa

    if piece.error:
        raise ParquetFooterError(f"cannot read the Parquet footer of {piece.path!r}: {piece.error}")
    pf = _open(piece, remote)
    names = pf.schema_arrow.names
    if columns is not None:
        missing = [c for c in columns if c not in names]
        if missing:
            raise KeyError(f"column(s) {missing} not in {piece.path!r}; its columns are {names}")
    cols = list(columns) if columns is not None else None
    if piece.start == 0 and piece.stop == piece.row_group_rows:
        table = pf.read_row_group(piece.row_group, columns=cols)
    else:
        # Stream the row group and stop after ``stop``: only the rows up to the end
        # of the range are decoded, and at most one batch beyond it is held.
        parts, seen = [], 0
        size = max(1, min(65536, piece.stop - piece.start))
        for rb in pf.iter_batches(batch_size=size, row_groups=[piece.row_group], columns=cols):
            a, b = seen, seen + rb.num_rows
            seen = b
            lo, hi = max(a, piece.start), min(b, piece.stop)
            if hi > lo:
                parts.append(rb.slice(lo - a, hi - lo))
            if seen >= piece.stop:
                break
        if parts:
            table = pa.Table.from_batches(parts)
        else:
            table = pf.schema_arrow.empty_table().select(cols or names)
    want = piece.stop - piece.start
    if table.num_rows != want:
        raise ValueError(
            f"{piece.path!r} row group {piece.row_group} yielded {table.num_rows} rows where its footer "
            f"promised {want}; the file changed after the dataset was created: create it again"
        )
    return table


#: Files after a read task's own (in the epoch plan's order) it fetches into the node's cache while
#: it reads (within the read's byte budget): 4 against 2, at 100 ms a request, 8 files of 250 rows:
#: 0.66-0.69x local against 0.65-0.66x (``bucket_sources``, #47).
FILES_AHEAD = 4


def _read_parquet_partition(shared: Any, partition: Partition, *, columns: Optional[tuple[str, ...]],
                            on_error: str, remote: Any = None) -> Block:
    """Read one partition (a row range of one row group) into NumPy columns."""
    piece: Piece = partition.payload
    if remote is not None:
        from sbloader.sources.fetch import files_ahead

        remote.prefetch(files_ahead(shared, partition.id, FILES_AHEAD))
    try:
        table = _read_rows(piece, columns, remote)
        return {name: _column_to_numpy(table.column(name)) for name in table.column_names}
    except Exception as e:
        if on_error == "skip":
            where = "the file" if piece.error else f"row group {piece.row_group} rows [{piece.start}, {piece.stop})"
            rows = 1 if piece.error else max(1, piece.stop - piece.start)
            report_skipped(piece.path, f"cannot read {where}: {e!r}", rows=rows)
            return {}
        raise read_error(partition, piece.path, e,
                         "check the file, or pass on_error='skip' to skip unreadable row groups") from e


# ----- the source -------------------------------------------------------------------


class ParquetSource(IOUnitSource):
    """Parquet row groups (or row ranges of them) as partitions (``read_parquet``).

    Args:
        files: the footers of the files, in order.
        columns: columns to read (None: all).
        on_error: ``"raise"`` or ``"skip"``.
        rows_per_partition: split row groups larger than this (None: never).
        remote: how the read tasks fetch remote objects
            (:class:`~sbloader.sources.fetch.RemoteFiles`; None: every path is local).
    """

    name = "Parquet"

    def __init__(self, files: Sequence[FileMeta], columns: Optional[tuple[str, ...]], on_error: str,
                 rows_per_partition: Optional[int], remote: Any = None) -> None:
        self._files = list(files)
        self._remote = remote
        self._columns = columns
        self._on_error = on_error
        self._rpp = rows_per_partition
        self._parts = self._make_partitions()

    def _make_partitions(self) -> list[Partition]:
        parts: list[Partition] = []
        for fm in self._files:
            if fm.error:
                # Still a partition, so the error (or the skip) happens where every
                # other read error does: in the read task, reported to the consumer.
                n = 0 if self._on_error == "skip" else None
                parts.append(Partition(len(parts), n, Piece(fm.path, -1, 0, 0, 0, fm.error),
                                       f"{fm.path} (unreadable footer)"))
                continue
            for rg, rows in enumerate(fm.row_groups):
                step = self._rpp if self._rpp is not None else max(1, rows)
                for a in range(0, rows, step):
                    b = min(a + step, rows)
                    label = f"{fm.path} row group {rg}" + (f" rows [{a}, {b})" if (a, b) != (0, rows) else "")
                    parts.append(Partition(len(parts), b - a, Piece(fm.path, rg, a, b, rows), label))
        return parts

    def reader(self) -> Callable[[Any, Partition], Block]:
        """The module-level read function with this source's options bound."""
        return functools.partial(_read_parquet_partition, columns=self._columns, on_error=self._on_error,
                                 remote=self._remote)

    def fingerprint(self) -> dict:
        """Type, row and partition counts, and a digest of the files and their row groups."""
        h = hashlib.sha1()
        for fm in self._files:
            h.update(f"{fm.path}\0{fm.row_groups}\n".encode("utf-8", "surrogateescape"))
        return {
            "type": self.name,
            "num_rows": self.num_rows(),
            "num_partitions": len(self._parts),
            "rows_per_partition": self._rpp,
            "columns": list(self._columns) if self._columns is not None else None,
            "files_sha1": h.hexdigest(),
        }


def _check_columns(columns: Any) -> Optional[tuple[str, ...]]:
    if columns is None:
        return None
    if isinstance(columns, (str, bytes)):
        raise ValueError(f"columns must be a list of column names, found {columns!r}; write columns=[{columns!r}]")
    cols = tuple(columns)
    if not cols:
        raise ValueError("columns must name at least one column, found an empty list; pass None to read every column")
    bad = [c for c in cols if not isinstance(c, str)]
    if bad:
        raise ValueError(f"columns must be strings, found {bad!r}")
    dups = sorted({c for c in cols if cols.count(c) > 1})
    if dups:
        raise ValueError(f"columns names {dups!r} more than once; list each column once")
    if ROW_COLUMN in cols:
        raise ValueError(f"the column name {ROW_COLUMN!r} is reserved by sbloader; rename that column")
    return cols

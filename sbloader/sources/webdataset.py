"""WebDataset tar shards as a source (``read_webdataset``): one row per sample, a partition per
shard or per range of a shard's samples.

Planning indexes every shard once (its headers only, :mod:`sbloader.sources.tar_index`:
in the driver for a handful of shards, else in remote Ray tasks), so every partition's
row count and byte range are known; a read task seeks to its range and reads exactly
its bytes. Members are grouped into samples by WebDataset's key rule, and every
block has the columns ``__key__``, ``__url__`` and one per extension found in any
shard (``None`` where a sample lacks it).

Shards are local paths or URIs of an object store (``s3://``, ``gs://``, fsspec's), listed
by :func:`list_shards` (brace patterns included); remote shards are indexed and read
through :mod:`sbloader.sources.remote_shards` (range requests, the node-local cache).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from typing import Any, BinaryIO, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import ray

from sbloader.core.block import ROW_COLUMN, Block, to_column
from sbloader.core.context import report_skipped
from sbloader.sources.base import Partition
from sbloader.sources.fetch import RemoteFiles, files_ahead
from sbloader.sources.inflight import map_side_by_side
from sbloader.sources.files import IOUnitSource, PathLike, list_inputs, read_error
from sbloader.sources.images import _decode_bytes
from sbloader.sources.tar_index import ShardIndex, cached_index, is_meta, local_stat, read_members, split_key

#: Samples per partition by default: one training batch of a typical size per task, as
#: ``read_images``' 64 files (every partition is a task and a block; with 256 a 2-CPU
#: read ran fewer, larger tasks and decoded more slowly than the same images as files,
#: ``benchmarks/results/webdataset.md``). A shuffled batch draws from every partition
#: its ``shuffle_window`` (a share of the memory budget by default) holds, so from many shards' ranges at once.
DEFAULT_SAMPLES_PER_PARTITION = 64

#: Extensions ``read_webdataset`` lists in a directory or a glob.
SHARD_EXTENSIONS = (".tar",)

#: Up to this many shards, the driver indexes them itself; above, remote tasks do.
DRIVER_INDEX_MAX_SHARDS = 4

#: Extensions (their last part) decoded to ``HxWx3`` ``uint8`` RGB under ``decode=True``.
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp"})
_INT_EXTS = frozenset({"cls", "cls2", "index"})
_BRACE_RE = re.compile(r"\{([^{}]*)\}")


# ----- where shards are: local paths or URIs ------------------------------------


def open_shard(path: str) -> BinaryIO:
    """Open a local shard for seekable binary reading."""
    return open(path, "rb")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace patterns: ``{000..099}`` (zero-padded as the first bound is) and
    ``{a,b,c}``, several per pattern; ``"x-{0..2}.tar"`` -> ``["x-0.tar", "x-1.tar", "x-2.tar"]``.

    Raises:
        ValueError: a range whose bounds are not integers.
    """
    m = _BRACE_RE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    if ".." in body and "," not in body:
        lo, _, hi = body.partition("..")
        if not (lo.strip().isdigit() and hi.strip().isdigit()):
            raise ValueError(f"the brace range {{{body}}} in {pattern!r} needs integer bounds, e.g. {{000..099}}")
        a, b = int(lo), int(hi)
        width = len(lo) if lo.startswith("0") else 0
        step = 1 if b >= a else -1
        choices = [str(i).zfill(width) for i in range(a, b + step, step)]
    else:
        choices = body.split(",")
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [head + c + rest for c in choices for rest in expand_braces(tail)]


def list_shards(paths: Union[PathLike, Sequence[PathLike]], filesystem: Any = None) -> tuple[list[str], dict]:
    """A directory or prefix (``.tar`` files, recursively, sorted), a glob, a brace pattern, a
    file or object, or a list of those (order kept): the shards' absolute paths or URIs, and
    ``{uri: (size, mtime_ns)}`` for the remote ones. A brace pattern in an object store is one
    listing of the folder before its first brace (a request per 1,000 keys), not a request per
    shard; over an fsspec scheme (``http://``...) each shard is asked for its size.

    Raises:
        FileNotFoundError: a path, an object or a shard of a pattern does not exist.
    """
    from sbloader.sources.filesystems import PYARROW_SCHEMES, is_remote, list_uris, scheme_of

    entries = [paths] if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__") else list(paths)
    out: list[str] = []
    versions: dict = {}
    for e in entries:
        # An object store's listing gives every shard's size: one listing of the folder. An
        # fsspec scheme's (http://: a page of links, no sizes) does not: each name is asked for.
        listable = filesystem is not None or scheme_of(e) in PYARROW_SCHEMES
        if isinstance(e, str) and listable and (filesystem is not None or is_remote(e)) and _BRACE_RE.search(e):
            names = expand_braces(e)
            folder = e[:e.index("{")].rsplit("/", 1)[0] + "/"
            listed = {o.uri: o for o in list_uris([folder], None, "webdataset", filesystem=filesystem)}
            missing = [n for n in names if n not in listed]
            if missing:
                raise FileNotFoundError(f"{len(missing)} of the {len(names)} shards of {e!r} are not under {folder!r}, "
                                        f"e.g. {missing[0]!r}; check the pattern")
            out.extend(names)
            versions.update((n, (listed[n].size, listed[n].mtime_ns)) for n in names)
            continue
        more, v = list_inputs(expand_braces(e) if isinstance(e, str) else [e], SHARD_EXTENSIONS, "webdataset",
                              filesystem=filesystem)
        out.extend(more)
        versions.update(v)
    return out, versions


# ----- planning -------------------------------------------------------------------


def index_shards(paths: Sequence[str], remote: Optional[RemoteFiles] = None) -> list[ShardIndex]:
    """Index several shards (cached per process, and for remote shards in the node's cache
    directory; see :func:`~sbloader.sources.tar_index.cached_index`)."""
    from sbloader.sources.remote_shards import index_remote_shard

    remote_paths = [p for p in paths if _is_remote(p, remote)]
    done = dict(zip(remote_paths, map_side_by_side(lambda p: index_remote_shard(p, remote), remote_paths,
                                                   remote.versions if remote else {},
                                                   remote.max_bytes if remote else 0, INDEX_SIDE_BY_SIDE)))
    return [done[p] if p in done else cached_index(p, open_shard, local_stat) for p in paths]


#: Remote shards indexed at once in one call, at most (each is fetched whole into the cache, or its
#: headers read by ranged GETs), within the read's byte budget (:func:`.inflight.map_side_by_side`).
INDEX_SIDE_BY_SIDE = 16


def _is_remote(path: str, remote: Optional[RemoteFiles]) -> bool:
    return remote is not None and (remote.filesystem is not None or path in remote.versions)


_index_task = ray.remote(num_cpus=1, max_retries=3)(index_shards)


def gather_indexes(paths: Sequence[str], remote: Optional[RemoteFiles] = None) -> list[ShardIndex]:
    """Every shard's index: in the driver for a handful, else in remote Ray tasks (one per chunk)."""
    if len(paths) <= DRIVER_INDEX_MAX_SHARDS:
        return index_shards(paths, remote)
    from sbloader.runtime.session import cluster_cpus, ensure_initialized

    ensure_initialized()
    per_task = max(4, math.ceil(len(paths) / max(1, int(2 * cluster_cpus()))))
    refs = [_index_task.remote(list(paths[i:i + per_task]), remote) for i in range(0, len(paths), per_task)]
    return [idx for chunk in ray.get(refs) for idx in chunk]


class ShardRange(NamedTuple):
    """The payload of one partition: samples ``[first, stop)`` of a shard, at bytes ``[start, end)``.

    Attributes:
        path: the shard.
        first: index of the first sample in the shard.
        stop: one past the last sample.
        start: byte offset of the first sample's first header.
        end: byte offset one past the last sample's data.
        first_key: the first sample's key (checked when read).
        error: the index error of the damaged part of a shard ("" otherwise); such a
            partition has no sample and raises (or is skipped) when read.
    """

    path: str
    first: int
    stop: int
    start: int
    end: int
    first_key: str = ""
    error: str = ""


def shard_ranges(idx: ShardIndex, samples_per_partition: Optional[int]) -> list[ShardRange]:
    """Cut one shard's samples into ranges of ``samples_per_partition`` (None: the whole shard);
    a damaged shard ends with an error range."""
    n = idx.num_samples
    step = samples_per_partition or max(1, n)
    out = [ShardRange(idx.path, a, min(a + step, n), int(idx.starts[a]), int(idx.stops[min(a + step, n) - 1]),
                      idx.keys[a]) for a in range(0, n, step)]
    if idx.error:
        out.append(ShardRange(idx.path, n, n, 0, 0, "", idx.error))
    return out


# ----- reading (runs in the remote read tasks) ------------------------------------


def decode_value(ext: str, data: bytes, name: str = "") -> Any:
    """Decode one member by its extension's last part, as ``decode=True`` does: an image to
    ``HxWx3`` ``uint8`` RGB, ``txt`` to str, ``cls``/``cls2``/``index`` to int, ``json`` to
    the parsed object; any other extension stays bytes.

    Args:
        ext: the sample's extension for this member (``"jpg"``, ``"seg.png"``).
        data: the member's bytes.
        name: what errors call it (shard and key).
    """
    last = ext.rsplit(".", 1)[-1]
    if last in IMAGE_EXTS:
        return _decode_bytes(data, None, "RGB", name=name or None)
    if last == "txt":
        return data.decode("utf-8")
    if last in _INT_EXTS:
        return int(data)
    if last == "json":
        return json.loads(data)
    return data


def group_samples(members: Sequence[tuple[str, bytes]]) -> list[tuple[str, dict]]:
    """Group ``(name, data)`` members into ``(key, {extension: data})`` samples by WebDataset's
    rule (consecutive members with one key; ``__meta__`` names and names without a dot left out)."""
    out: list[tuple[str, dict]] = []
    for name, data in members:
        key, ext = split_key(name)
        if key is None or is_meta(name):
            continue
        if not out or out[-1][0] != key:
            out.append((key, {}))
        out[-1][1][ext.lower()] = data
    return out


def _read_shard_range(shared: Any, partition: Partition, *, extensions: tuple[str, ...], decode: bool,
                      on_error: str, remote: Optional[RemoteFiles] = None) -> Block:
    """Read one partition's samples into columns ``__key__``, ``__url__`` and one per extension
    (a remote shard's range with one ranged GET, or from the node's cache)."""
    from sbloader.sources.remote_shards import read_remote_range
    from sbloader.sources.tar_members import parse_members

    r: ShardRange = partition.payload
    hint = "check the shard, or pass on_error='skip' to skip what cannot be read"
    try:
        if r.error:
            raise OSError(f"cannot index {r.path!r} past sample {r.first}: {r.error}")
        if _is_remote(r.path, remote):
            remote.prefetch(files_ahead(shared, partition.id, 1))
            samples = group_samples(parse_members(read_remote_range(r.path, r.start, r.end, remote)))
        else:
            with open_shard(r.path) as f:
                samples = group_samples(read_members(f, r.start, r.end))
        if len(samples) != r.stop - r.first or (samples and samples[0][0] != r.first_key):
            raise ValueError(f"found {len(samples)} samples from key {samples[0][0] if samples else None!r} where "
                             f"the index had {r.stop - r.first} from {r.first_key!r}: the shard changed after the "
                             f"dataset was created; create it again")
    except Exception as e:
        if on_error == "skip":
            report_skipped(r.path, f"cannot read samples [{r.first}, {r.stop}) or the rest: {e!r}",
                           rows=max(1, r.stop - r.first))
            return {}
        raise read_error(partition, r.path, e, hint) from e
    keys, rows, values = [], [], {ext: [] for ext in extensions}
    for i, (key, members) in enumerate(samples):
        try:
            row = {ext: (decode_value(ext, members[ext], f"{r.path}:{key}.{ext}") if decode else members[ext])
                   if ext in members else None for ext in extensions}
        except Exception as e:
            if on_error == "skip":
                report_skipped(f"{r.path}:{key}", f"cannot decode sample {key!r}: {e!r}")
                continue
            raise read_error(partition, r.path, e, f"sample {key!r} cannot be decoded; {hint}") from e
        keys.append(key)
        rows.append(i)
        for ext in extensions:
            values[ext].append(row[ext])
    block: Block = {"__key__": np.array(keys, dtype=str) if keys else np.empty((0,), dtype=str),
                    "__url__": np.array([r.path] * len(keys), dtype=str) if keys else np.empty((0,), dtype=str)}
    for ext in extensions:
        block[ext] = to_column(values[ext])
    # A skipped sample leaves a gap in the rows rather than shifting the samples after it.
    block[ROW_COLUMN] = np.asarray(rows, dtype=np.int64)
    return block


# ----- the source -------------------------------------------------------------------


class WebDatasetSource(IOUnitSource):
    """WebDataset shards cut into ranges of samples (``read_webdataset``).

    Args:
        indexes: every shard's index, in listing order.
        samples_per_partition: samples per partition (None: one partition per shard).
        decode: decode members by extension, or hand on their bytes.
        on_error: ``"raise"`` or ``"skip"``.
        remote: how the read tasks fetch remote shards (None: every shard is local).
    """

    name = "WebDataset"

    def __init__(self, indexes: Sequence[ShardIndex], samples_per_partition: Optional[int], decode: bool,
                 on_error: str, remote: Optional[RemoteFiles] = None) -> None:
        self._remote = remote
        self._files = list(indexes)
        self._spp = samples_per_partition
        self._decode = bool(decode)
        self._on_error = on_error
        self._extensions = tuple(sorted({e for idx in self._files for e in idx.extensions}))
        self._parts = []
        for idx in self._files:
            for r in shard_ranges(idx, samples_per_partition):
                label = f"{r.path} samples [{r.first}, {r.stop})" if not r.error else f"{r.path} ({r.error})"
                rows = r.stop - r.first if not r.error else (0 if on_error == "skip" else None)
                self._parts.append(Partition(len(self._parts), rows, r, label))

    @property
    def extensions(self) -> tuple[str, ...]:
        """The extension columns every block has."""
        return self._extensions

    def reader(self) -> Callable[[Any, Partition], Block]:
        """The module-level read function with this source's options bound."""
        return functools.partial(_read_shard_range, extensions=self._extensions, decode=self._decode,
                                 on_error=self._on_error, remote=self._remote)

    def fingerprint(self) -> dict:
        """Type, row and partition counts, options, and a digest of the shards and their keys."""
        h = hashlib.sha1()
        for idx in self._files:
            h.update(f"{idx.path}\0{idx.num_samples}\0{idx.keys[:1]}\0{idx.error}\n".encode("utf-8",
                                                                                           "surrogateescape"))
        return {"type": self.name, "num_rows": self.num_rows(), "num_partitions": len(self._parts),
                "samples_per_partition": self._spp, "decode": self._decode, "shards_sha1": h.hexdigest()}

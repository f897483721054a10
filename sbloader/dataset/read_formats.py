"""The constructors over dataset formats of other libraries: WebDataset tar shards
(``read_webdataset``) and Hugging Face datasets (``from_huggingface``).

Like :mod:`sbloader.dataset.read`, they validate the arguments and plan in the driver
(shard indexes; the dataset's length); no sample is read until the dataset is iterated.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from sbloader.core.plan import resolve_rows_per_partition
from sbloader.dataset.dataset import Dataset
from sbloader.sources.fetch import remote_files
from sbloader.sources.files import PathLike, check_on_error
from sbloader.sources.huggingface import HuggingFaceSource, check_dataset
from sbloader.sources.memory import _parallelism
from sbloader.sources.webdataset import DEFAULT_SAMPLES_PER_PARTITION, WebDatasetSource, gather_indexes, list_shards


def read_webdataset(
    paths: Union[PathLike, Sequence[PathLike]],
    *,
    decode: bool = True,
    on_error: str = "raise",
    samples_per_partition: Optional[int] = DEFAULT_SAMPLES_PER_PARTITION,
    filesystem: Any = None,
    cache: bool = True,
    cache_dir: Optional[str] = None,
    cache_max_bytes: Optional[int] = None,
) -> Dataset:
    """A dataset over WebDataset tar shards: one row per sample.

    Members are grouped into samples by WebDataset's rule: a member's key is its
    path up to the first dot of its basename and its extension the rest
    (``000123.jpg`` -> key ``000123``, extension ``jpg``; ``a/b.seg.png`` -> ``a/b``,
    ``seg.png``), and consecutive members with one key form a sample. Every row has
    ``__key__`` (str), ``__url__`` (the shard's path) and one column per extension
    found in any shard (lower-cased; ``None`` where a sample lacks it). ``__meta__``
    members are left out, as WebDataset's reader does.

    With ``decode=True`` a member is decoded by its extension's last part: ``jpg``,
    ``jpeg``, ``png``, ``webp`` to ``HxWx3`` ``uint8`` RGB (stacked into one array
    when every image of a block has one shape), ``txt`` to str, ``cls``, ``cls2``,
    ``index`` to int, ``json`` to the parsed object; every other extension stays
    bytes. With ``decode=False`` every member is its bytes (decode in a following
    ``map_batches``, e.g. with a random crop).

    Planning reads every shard's headers once (in the driver for up to four shards,
    else in remote Ray tasks, which starts the embedded Ray) into an index of member
    offsets, so a partition (a range of one shard's samples) is read with one seek
    and one read. Under ``shuffle=True`` partitions run in an order drawn from the
    epoch seed and each batch draws from every shard range open in the shuffle window
    (by default as many as half the memory budget holds; see the user guide's Shuffling).

    Args:
        paths: a directory (``.tar`` files, listed recursively and sorted), a glob,
            a brace pattern (``"shards/train-{000000..000099}.tar"``, WebDataset's
            convention), a file, or a list of those (order kept); local paths or URIs
            (``s3://bucket/shards/train-{000..099}.tar``, ``gs://``, fsspec's), see
            docs/remote_data.md.
        decode: decode members by extension (see above), or hand on their bytes.
        on_error: ``"raise"``: a truncated or corrupt shard, or a member that cannot
            be decoded, raises :class:`~sbloader.core.errors.SourceReadError` naming
            the shard (and the sample's key) and the partition in the consumer;
            ``"skip"``: it is skipped, logged and counted in ``stats().skipped`` (the
            samples of a truncated shard before the damage are still read).
        samples_per_partition: samples per partition (default 64); None: one
            partition per shard (its samples form one block: keep shards small).
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem to read every
            path through (None: local paths from the OS, URIs by their scheme).
        cache: keep remote shards in the node-local cache (a later epoch reads
            nothing from the store); False: each partition's byte range is one
            ranged GET every epoch.
        cache_dir: the cache directory (None: ``$SBLOADER_CACHE_DIR`` or a temporary one).
        cache_max_bytes: bound on the cache's bytes per node (None: unbounded).

    Returns:
        A lazy :class:`~sbloader.dataset.dataset.Dataset`.

    Raises:
        ValueError: an invalid argument, or a directory with no ``.tar`` file.
        FileNotFoundError: a path does not exist or a pattern matches nothing.
    """
    check_on_error(on_error)
    if samples_per_partition is not None and (
        isinstance(samples_per_partition, bool) or not isinstance(samples_per_partition, (int, np.integer))
        or samples_per_partition < 1
    ):
        raise ValueError(f"samples_per_partition must be a positive integer or None (one partition per "
                         f"shard), found {samples_per_partition!r}")
    shards, versions = list_shards(paths, filesystem)
    remote = remote_files(versions, filesystem, cache, cache_dir, cache_max_bytes)
    indexes = gather_indexes(shards, remote)
    spp = int(samples_per_partition) if samples_per_partition is not None else None
    return Dataset(WebDatasetSource(indexes, spp, decode, on_error, remote))


def from_huggingface(dataset: Any, *, num_partitions: Optional[int] = None,
                     rows_per_partition: Optional[int] = None) -> Dataset:
    """A dataset over a Hugging Face ``datasets.Dataset`` (one split, map-style).

    A partition is a range of the dataset's rows (under ``shuffle=True`` a run of a
    permutation of them drawn from the epoch seed), read in the remote tasks with
    ``dataset[rows]``: its format, feature decoding and ``select``/``shuffle``
    indices apply as when iterating it, and ``Image`` features' PIL images become
    ``HxWxC`` ``uint8`` arrays. A dataset memory-mapped from its cache files (what
    ``load_dataset`` and ``load_from_disk`` give) reaches the tasks as the files'
    paths: each read process memory-maps them, and no row passes through the
    driver. A dataset built in memory (``Dataset.from_dict``) is put into Ray's
    object store once.

    Args:
        dataset: a ``datasets.Dataset``.
        num_partitions: cut into this many partitions.
        rows_per_partition: or cut into partitions of this many rows.

    Returns:
        A lazy :class:`~sbloader.dataset.dataset.Dataset`.

    Raises:
        StreamingDatasetError: a streaming ``IterableDataset`` (it cannot be cut into
            partitions that replay exactly): load it without ``streaming=True``.
        TypeError: a ``DatasetDict`` (pick a split) or not a dataset.
    """
    check_dataset(dataset)
    rpp = resolve_rows_per_partition(len(dataset), _parallelism(), num_partitions, rows_per_partition)
    return Dataset(HuggingFaceSource(dataset, rpp))

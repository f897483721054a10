"""The functions that create a :class:`~sbloader.dataset.dataset.Dataset`: over files
(``read_images``, ``read_parquet``, ``read_videos``) or in-memory data (``from_items``,
``range``, ``from_torch``).

They validate the arguments and list the input in the driver (file names, Parquet
footers, video probes); no data is read until the dataset is iterated.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from sbloader.core.plan import resolve_rows_per_partition
from sbloader.dataset.dataset import Dataset
from sbloader.sources.cache import cache_config
from sbloader.sources.fetch import DEFAULT_MAX_IN_FLIGHT, check_max_in_flight, remote_files
from sbloader.sources.files import PathLike, check_on_error, check_size, files_per_partition_for, list_inputs
from sbloader.sources.listing_pages import listing_prefetch
from sbloader.sources.images import DEFAULT_FILES_PER_PARTITION, IMAGE_EXTENSIONS, ImageSource, check_mode
from sbloader.sources.memory import ItemsSource, RangeSource, TorchSource, _parallelism
from sbloader.sources.parquet import PARQUET_EXTENSIONS, ParquetSource, _check_columns, gather_footers
from sbloader.sources.video_probe import gather_probes
from sbloader.sources.videos import VIDEO_EXTENSIONS, VideoSource, _positive_int


def from_items(items: Sequence[Any], *, num_partitions: Optional[int] = None,
               rows_per_partition: Optional[int] = None) -> Dataset:
    """A dataset over a Python list (dicts become columns; anything else a column ``item``).

    Args:
        items: the rows.
        num_partitions: cut into this many partitions.
        rows_per_partition: or cut into partitions of this many rows.
    """
    items = list(items)
    rpp = resolve_rows_per_partition(len(items), _parallelism(), num_partitions, rows_per_partition)
    return Dataset(ItemsSource(items, rpp))


def range_dataset(n: int, *, num_partitions: Optional[int] = None,
                  rows_per_partition: Optional[int] = None) -> Dataset:
    """A dataset of the integers ``0..n-1`` in column ``id`` (``sbloader.range``)."""
    if n < 0:
        raise ValueError(f"range needs n >= 0, found {n}")
    rpp = resolve_rows_per_partition(n, _parallelism(), num_partitions, rows_per_partition)
    return Dataset(RangeSource(n, rpp))


def from_torch(dataset: Any, sampler: Any = None, *, num_partitions: Optional[int] = None,
               rows_per_partition: Optional[int] = None, columns: str = "auto") -> Dataset:
    """A dataset over a map-style torch ``Dataset``, in ``sampler`` order.

    Partitions are ranges of sampler positions; the sampler is iterated once per
    epoch in the driver (indices only) and ``dataset[i]`` runs in remote tasks.

    Args:
        dataset: any object with ``__getitem__`` and ``__len__``.
        sampler: an iterable of indices (``RandomSampler``...); None: ``0..len-1``.
        num_partitions: cut into this many partitions.
        rows_per_partition: or cut into partitions of this many rows.
        columns: ``"auto"`` (dict samples become columns, others a column
            ``item``) or ``"item"`` (every sample in a column ``item``).
    """
    if columns not in ("auto", "item"):
        raise ValueError(f"columns must be 'auto' or 'item', found {columns!r}")
    n = len(sampler) if sampler is not None and hasattr(sampler, "__len__") else len(dataset)
    rpp = resolve_rows_per_partition(n, _parallelism(), num_partitions, rows_per_partition)
    return Dataset(TorchSource(dataset, sampler, rpp, columns))


def read_images(
    paths_or_dir: Union[PathLike, Sequence[PathLike]],
    *,
    size: Optional[tuple[int, int]] = None,
    mode: Optional[str] = "RGB",
    on_error: str = "raise",
    files_per_partition: Optional[int] = None,
    num_partitions: Optional[int] = None,
    extensions: Optional[Sequence[str]] = IMAGE_EXTENSIONS,
    decode: bool = True,
    filesystem: Any = None,
    cache: bool = True,
    cache_dir: Optional[str] = None,
    cache_max_bytes: Optional[int] = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> Dataset:
    """A dataset of images decoded with Pillow: columns ``image`` and ``path``.

    JPEGs in YCbCr, RGB or grayscale read without ``size`` (as ``"RGB"``, as they
    are, or grayscale as ``"L"``) are decoded by libjpeg-turbo straight into the
    array (simplejpeg), with the same pixels as Pillow's and without Pillow's second
    buffer (``benchmarks/results/jpeg.md``); every other file and mode goes through
    Pillow.

    ``image`` holds ``HxWxC`` ``uint8`` arrays: one stacked array when every image
    of a block has the same shape (always the case with ``size``), otherwise an
    object column with one array per row. ``path`` holds each file's absolute path.
    With ``mode="RGB"`` grayscale, palette, CMYK, RGBA (alpha dropped, as
    torchvision's loader does) and 16-bit images (full range scaled to 0..255, not
    clipped) all become 3-channel ``uint8``.

    The driver only lists file names; files are opened in the remote read tasks.
    EXIF orientation is not applied (as with torchvision's ``ImageFolder``).

    A row's provenance row is the position of its file in the partition, so a
    file skipped under ``on_error="skip"`` leaves a gap rather than shifting the
    files after it.

    Args:
        paths_or_dir: a directory (listed recursively and sorted, hidden files and
            folders left out), a glob, a file, or a list of those (order kept).
        size: resize every image to ``(width, height)`` (bilinear); None keeps
            each image's size.
        mode: Pillow mode of the output: ``"RGB"``, ``"RGBA"``, ``"L"`` (HxWx1), or
            None to keep the decoded data as is (16-bit images stay ``uint16``).
        on_error: ``"raise"``: an undecodable file (corrupt, truncated, empty, not
            an image) raises :class:`~sbloader.core.errors.SourceReadError` naming the
            file and partition in the consumer; ``"skip"``: the file is skipped,
            logged and counted in ``stats().skipped``.
        files_per_partition: files per partition (default 64: one typical batch per partition).
        num_partitions: or cut into this many partitions.
        extensions: extensions kept when listing a directory or a glob (case-
            insensitive); None keeps every file. Files named explicitly are always read.
        decode: False hands on each file's encoded bytes in ``image`` (an object
            column of ``bytes``) for a following ``map_batches`` to decode together
            with its augmentation, e.g. :func:`sbloader.transforms.decode_crop_flip`.
            That is the faster path when the augmentation starts from a Pillow
            image (a random crop, a resize): it skips the full-size decoded array
            that ``decode=True`` builds and the augmentation converts back (a few
            percent of the workers' CPU: ``benchmarks/results/images.md``). ``size`` and ``mode`` then do not apply, and
            ``on_error`` covers reading the file only: a corrupt image raises (or is
            skipped) where the ``map_batches`` function decodes it.
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem to read every
            path through (None: local paths from the OS; ``s3://``, ``gs://``,
            ``abfs://``, ``hdfs://`` URIs through ``pyarrow.fs`` with credentials and
            endpoint from the environment; other schemes through fsspec). See
            ``docs/remote_data.md``.
        cache: keep remote objects in a node-local disk cache, so a later epoch reads
            no object bytes from the store (remote sources only).
        cache_dir: the cache's directory on every node (default
            ``$SBLOADER_CACHE_DIR``, else ``<tmp>/sbloader-cache-<uid>``).
        cache_max_bytes: bound on the cache's bytes per node (None: unbounded); when
            full, new objects are read without being cached, never waiting for room.
        max_in_flight: requests to the store a reading process keeps in flight at most (its
            connections; see docs/remote_data.md for the byte budget).

    Returns:
        A lazy :class:`~sbloader.dataset.dataset.Dataset`.

    Raises:
        ValueError: an invalid argument, or a directory with no image file.
        FileNotFoundError: a path does not exist or a glob matches nothing.
    """
    check_on_error(on_error)
    if not decode and size is not None:
        raise ValueError(f"size={size!r} needs decode=True: with decode=False the files' bytes are handed "
                         "on undecoded; resize where the map_batches function decodes them")
    check_mode(mode)
    size = check_size(size)
    if isinstance(extensions, str):
        extensions = (extensions,)
    # The first pages' objects go into the node's cache while the listing goes on (the plan
    # is still cut from the whole listing: sbloader/sources/listing_pages.py).
    ahead = listing_prefetch(filesystem, cache_config(cache, cache_dir, cache_max_bytes),
                             check_max_in_flight(max_in_flight))
    try:
        files, versions = list_inputs(paths_or_dir, extensions, "image", filesystem=filesystem, on_page=ahead)
    finally:
        if ahead is not None:
            ahead.stop()  # fetch while listing only: the epoch's reads get the pool and the cores
    remote = remote_files(versions, filesystem, cache, cache_dir, cache_max_bytes, max_in_flight)
    fpp = files_per_partition_for(len(files), files_per_partition, num_partitions, DEFAULT_FILES_PER_PARTITION)
    return Dataset(ImageSource(files, fpp, size, mode, on_error, decode, remote))


def read_parquet(
    paths: Union[PathLike, Sequence[PathLike]],
    *,
    columns: Optional[Sequence[str]] = None,
    on_error: str = "raise",
    rows_per_partition: Optional[int] = None,
    extensions: Optional[Sequence[str]] = PARQUET_EXTENSIONS,
    filesystem: Any = None,
    cache: bool = True,
    cache_dir: Optional[str] = None,
    cache_max_bytes: Optional[int] = None,
) -> Dataset:
    """A dataset over Parquet files: one partition per row group, NumPy columns.

    Numeric columns become NumPy arrays (an integer column with nulls becomes
    ``float64`` with NaN), fixed-size lists 2-D arrays, and binary, string, list
    and struct columns object arrays (``bytes``, ``str``, arrays, dicts). Decode
    a binary column (encoded images...) in a following ``map_batches``.

    The footers are read when the dataset is created: in the driver for up to
    four files, otherwise in remote Ray tasks (one per chunk of files; this
    starts the embedded Ray if none is running). Every partition's row count is
    known from them.

    Args:
        paths: a directory (listed recursively and sorted; names starting with
            ``.`` or ``_``, such as ``_SUCCESS``, left out), a glob, a file, or a
            list of those (order kept).
        columns: columns to read, in this order (None: every column). A name
            missing from a file raises ``ValueError`` here, naming the file.
        on_error: ``"raise"``: an unreadable file or row group raises
            :class:`~sbloader.core.errors.SourceReadError` naming the file and partition
            in the consumer; ``"skip"``: its rows are skipped, logged and counted in
            ``stats().skipped`` (a file whose footer is unreadable counts once).
        rows_per_partition: split row groups of more rows than this into row
            ranges of at most this many rows (None: one partition per row group).
        extensions: extensions kept when listing a directory or a glob
            (case-insensitive); None keeps every file. Files named explicitly are
            always read.
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem to read every
            path through (None: local paths from the OS; ``s3://``, ``gs://``,
            ``abfs://``, ``hdfs://`` URIs through ``pyarrow.fs`` with credentials and
            endpoint from the environment; other schemes through fsspec). See
            ``docs/remote_data.md``.
        cache: keep remote files (whole) in a node-local disk cache, so a later epoch reads
            no object bytes from the store (remote sources only).
        cache_dir: the cache's directory on every node (default
            ``$SBLOADER_CACHE_DIR``, else ``<tmp>/sbloader-cache-<uid>``).
        cache_max_bytes: bound on the cache's bytes per node (None: unbounded); when
            full, new objects are read without being cached, never waiting for room.

    Returns:
        A lazy :class:`~sbloader.dataset.dataset.Dataset`.

    Raises:
        ValueError: an invalid argument, a column no file has, or no file found.
        FileNotFoundError: a path does not exist or a glob matches nothing.
    """
    check_on_error(on_error)
    cols = _check_columns(columns)
    if rows_per_partition is not None and (
        isinstance(rows_per_partition, bool) or not isinstance(rows_per_partition, (int, np.integer))
        or rows_per_partition < 1
    ):
        raise ValueError(f"rows_per_partition must be a positive integer or None, found {rows_per_partition!r}")
    if isinstance(extensions, str):
        extensions = (extensions,)
    files, versions = list_inputs(paths, extensions, "parquet", skip_prefixes=(".", "_"), filesystem=filesystem)
    remote = remote_files(versions, filesystem, cache, cache_dir, cache_max_bytes, DEFAULT_MAX_IN_FLIGHT)
    metas = gather_footers(files, filesystem, remote)
    if cols is not None:
        for fm in metas:
            if fm.error:
                continue
            missing = [c for c in cols if c not in fm.columns]
            if missing:
                raise ValueError(
                    f"column(s) {missing} not found in {fm.path!r}; its columns are {list(fm.columns)}. "
                    f"Fix columns=, or pass columns=None to read every column"
                )
    rpp = int(rows_per_partition) if rows_per_partition is not None else None
    return Dataset(ParquetSource(metas, cols, on_error, rpp, remote))


def read_videos(
    paths: Union[PathLike, Sequence[PathLike]],
    *,
    clip_len: Optional[int] = None,
    frame_stride: int = 1,
    frames_per_partition: Optional[int] = None,
    size: Optional[tuple[int, int]] = None,
    on_error: str = "raise",
    decode_threads: int = 1,
    extensions: Optional[Sequence[str]] = VIDEO_EXTENSIONS,
    filesystem: Any = None,
    cache: bool = True,
    cache_dir: Optional[str] = None,
    cache_max_bytes: Optional[int] = None,
) -> Dataset:
    """A dataset of video frames or clips decoded with PyAV (on the cluster's CPUs).

    With ``clip_len=None`` every row is one frame: column ``frame``, ``HxWx3``
    ``uint8`` RGB. With ``clip_len=T`` every row is a clip: column ``clip``,
    ``TxHxWx3`` ``uint8``. A video is cut into consecutive, non-overlapping
    windows of ``T * frame_stride`` frames and each window gives one clip of
    every ``frame_stride``-th frame; a last, incomplete window is dropped. With
    ``clip_len=None``, ``frame_stride`` keeps frames ``0, s, 2s, ...``. Columns
    ``path`` (the file) and ``frame_index`` (the index of the frame, or of the
    clip's first frame, in the video) come with every row.

    Frame ``i`` is the ``i``-th frame PyAV decodes from the start of the file's
    first video stream. Planning probes every file (demuxes its packets without
    decoding: in the driver for up to four files, else in remote Ray tasks, which
    starts the embedded Ray), so every partition's row count is known.

    Args:
        paths: a directory (listed recursively and sorted, hidden files left
            out), a glob, a file, or a list of those (order kept).
        clip_len: frames per clip (None: one row per frame).
        frame_stride: keep every ``frame_stride``-th frame.
        frames_per_partition: cut each video into ranges of this many frames,
            rounded down to a whole number of clip windows (``clip_len *
            frame_stride`` frames) or strides, and at least one. A range is read
            by seeking to the keyframe before it. None: one partition per video
            (its decoded frames form one block: use ranges for long videos).
        size: resize every frame to ``(width, height)`` (bilinear, in FFmpeg's
            scaler); None keeps the video's size.
        on_error: ``"raise"``: an undecodable file (corrupt, truncated, empty,
            not a video, no video stream) raises
            :class:`~sbloader.core.errors.SourceReadError` naming the file and
            partition in the consumer; ``"skip"``: its partitions are skipped,
            logged and counted in ``stats().skipped`` (the partition's rows, or one
            row for a file that cannot even be probed).
        decode_threads: FFmpeg decoder threads per read task (default 1: Ray
            runs one read task per CPU; 0 lets FFmpeg pick).
        extensions: extensions kept when listing a directory or a glob
            (case-insensitive); None keeps every file. Files named explicitly are
            always read.
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem to read every
            path through (None: local paths from the OS; ``s3://``, ``gs://``,
            ``abfs://``, ``hdfs://`` URIs through ``pyarrow.fs`` with credentials and
            endpoint from the environment; other schemes through fsspec). See
            ``docs/remote_data.md``.
        cache: keep remote objects in a node-local disk cache, so a later epoch reads
            no object bytes from the store (remote sources only).
        cache_dir: the cache's directory on every node (default
            ``$SBLOADER_CACHE_DIR``, else ``<tmp>/sbloader-cache-<uid>``).
        cache_max_bytes: bound on the cache's bytes per node (None: unbounded); when
            full, new objects are read without being cached, never waiting for room.

    Returns:
        A lazy :class:`~sbloader.dataset.dataset.Dataset`.

    Raises:
        ValueError: an invalid argument, or a directory with no video file.
        FileNotFoundError: a path does not exist or a glob matches nothing.
        ImportError: PyAV (``av``) is not installed.
    """
    check_on_error(on_error)
    clip_len = _positive_int("clip_len", clip_len, allow_none=True)
    frame_stride = _positive_int("frame_stride", frame_stride)
    fpp = _positive_int("frames_per_partition", frames_per_partition, allow_none=True)
    size = check_size(size)
    if isinstance(decode_threads, bool) or not isinstance(decode_threads, (int, np.integer)) or decode_threads < 0:
        raise ValueError(f"decode_threads must be an integer >= 0 (0: FFmpeg picks), found {decode_threads!r}")
    try:
        import av  # noqa: F401
    except ImportError as e:
        raise ImportError(f"read_videos needs PyAV: pip install av ({e})") from e
    if isinstance(extensions, str):
        extensions = (extensions,)
    files, versions = list_inputs(paths, extensions, "video", filesystem=filesystem)
    remote = remote_files(versions, filesystem, cache, cache_dir, cache_max_bytes, DEFAULT_MAX_IN_FLIGHT)
    unit = frame_stride * (clip_len or 1)
    span = max(1, fpp // unit) * unit if fpp is not None else None
    metas = gather_probes(files, span, remote)
    return Dataset(VideoSource(metas, clip_len=clip_len, frame_stride=frame_stride, frames_per_partition=span,
                               size=size, on_error=on_error, decode_threads=int(decode_threads), remote=remote))

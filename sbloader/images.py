"""``read_images``: JPEG/PNG files decoded with Pillow (most JPEGs by libjpeg-turbo
straight into the array, with the same pixels: :mod:`sbloader._jpeg`), a few files
per partition.

The driver only lists file names (never opens a file); decoding runs in the
remote read tasks. A partition is a run of consecutive files of the sorted
listing (under ``shuffle=True``, of a permutation of the listing drawn from the
epoch seed), so its id is stable for its epoch, and reading it twice yields the
same rows.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import io
import math
import os
import traceback
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from . import _jpeg
from .block import ROW_COLUMN, Block, to_column
from .context import get_context, report_skipped
from .dataset import Dataset
from .errors import SourceReadError
from .plan import cut_members, member_positions
from .sources import Partition

PathLike = Union[str, "os.PathLike[str]"]

#: Files per partition when neither ``files_per_partition`` nor ``num_partitions`` is given:
#: one training batch of a typical size per task. Every partition is a task and a
#: block, each with a fixed cost in the trainer (scheduling, fetch) and in Ray; in
#: benchmarks/results/images.md (04:31 run) 64 files per partition instead of 16 cut
#: the trainer's CPU per image from 145 to 49 µs and raised images/s 13% (CPU free)
#: and 17% (CPU work in the consumer).
DEFAULT_FILES_PER_PARTITION = 64

#: Extensions ``read_images`` lists in a directory or a glob by default.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")

_MODES = ("RGB", "RGBA", "L", None)
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


def check_mode(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is an output mode the decode supports."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {list(_MODES)}, found {mode!r}")


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


# ----- decoding (runs in the remote read tasks) ----------------------------------


def _scale_16bit(arr: np.ndarray) -> np.ndarray:
    """Map a 16-bit range ``[0, 65535]`` onto ``[0, 255]`` with rounding (never clip)."""
    a = np.clip(arr.astype(np.int64), 0, 65535)
    return ((a * 255 + 32767) // 65535).astype(np.uint8)


def _convert(img: Any, mode: str) -> Any:
    """A Pillow image in ``mode``; 16-bit and float images are scaled, not clipped."""
    from PIL import Image

    if img.mode.startswith("I") or img.mode == "F":
        # 16-bit ("I;16*", and "I" from 16-bit PNGs) and float grayscale: Pillow's
        # convert would clip at 255; scale the full range instead. "F" is taken
        # to be in [0, 1].
        raw = np.asarray(img)
        if img.mode == "F":
            gray = np.clip(np.rint(raw.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
        else:
            gray = _scale_16bit(raw)
        img = Image.fromarray(gray)  # 2-D uint8: mode "L"
    if img.mode != mode:
        img = img.convert(mode)  # RGBA -> RGB drops alpha, as torchvision's loader does
    return img


class _NamedBytes(io.BytesIO):
    """Encoded bytes for Pillow, shown as their file's path in Pillow's errors."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)
        self.name = name

    def __repr__(self) -> str:
        return repr(self.name)


def _decode_bytes(data: bytes, size: Optional[tuple[int, int]] = None, mode: Optional[str] = "RGB",
                 name: Optional[str] = None) -> np.ndarray:
    """Decode an encoded image to an ``HxWxC`` ``uint8`` array, as ``read_images`` does.

    Most JPEGs (YCbCr, RGB or grayscale, no ``size``) are decoded by libjpeg-turbo
    straight into the array, with the same pixels as Pillow's (:mod:`sbloader._jpeg`);
    everything else by Pillow, with ``read_images``' conversions: ``mode="RGB"``
    turns grayscale, palette, CMYK, RGBA and 16-bit images into 3 channels (16-bit
    ranges scaled, not clipped), ``"L"`` gives ``HxWx1``.

    Args:
        data: the encoded bytes (a file's content, a Parquet binary cell).
        size: resize to ``(width, height)`` (bilinear; JPEGs decode at a reduced DCT
            scale first, never below it); None keeps the image's size.
        mode: ``"RGB"``, ``"RGBA"``, ``"L"``, or None to keep the decoded data as is.
        name: what Pillow's errors call the data (a path); None: the buffer.

    Raises:
        PIL.UnidentifiedImageError, OSError: not an image, or a truncated or corrupt one.
        PIL.Image.DecompressionBombError: an image far above Pillow's pixel limit.
    """
    from PIL import Image

    if size is None:
        arr = _jpeg.decode_to_array(data, mode)
        if arr is not None:
            return arr
    with Image.open(_NamedBytes(data, name) if name is not None else io.BytesIO(data)) as img:
        if size is not None and img.format == "JPEG":
            img.draft(None, size)  # DCT-domain downscale, never below ``size``
        img.load()  # decode now: a truncated or corrupt file raises here
        out = _convert(img, mode) if mode is not None else img
        if size is not None and out.size != size:
            out = out.resize(size, Image.Resampling.BILINEAR)
        arr = np.asarray(out)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return np.ascontiguousarray(arr)


def _decode(path: str, size: Optional[tuple[int, int]], mode: Optional[str]) -> np.ndarray:
    """Read one file and decode it into an ``HxWxC`` array (:func:`_decode_bytes`)."""
    return _decode_bytes(_read_bytes(path), size, mode, name=path)


def _read_bytes(path: str) -> bytes:
    """The file's encoded bytes (``decode=False``)."""
    with open(path, "rb") as f:
        return f.read()


def _read_image_files(shared: Any, partition: Partition, *, size: Optional[tuple[int, int]],
                      mode: Optional[str], on_error: str, decode: bool = True) -> Block:
    """Decode (or, with ``decode=False``, read) the files of one partition into columns
    ``image`` and ``path``."""
    paths: Sequence[str] = partition.payload
    images: list[Any] = []
    kept: list[str] = []
    rows: list[int] = []
    for i, path in enumerate(paths):
        try:
            arr = _decode(path, size, mode) if decode else _read_bytes(path)
        except Exception as e:
            what = "decode the image" if decode else "read the file"
            if on_error == "skip":
                report_skipped(path, f"cannot {what}: {e!r}")
                continue
            raise read_error(partition, path, e, f"check the file, or pass on_error='skip' to skip "
                                                 f"{'undecodable images' if decode else 'unreadable files'}") from e
        images.append(arr)
        kept.append(path)
        rows.append(i)
    if images:
        image_col = to_column(images)  # bytes (decode=False): an object column
    elif size is not None and mode is not None:
        image_col = np.empty((0, size[1], size[0], len(mode)), dtype=np.uint8)
    else:
        image_col = np.empty((0,), dtype=object)
    path_col = np.array(kept, dtype=str) if kept else np.empty((0,), dtype=str)
    # Rows keep the index of their file in the partition, so a skipped file
    # leaves a gap instead of shifting the provenance of the files after it.
    return {"image": image_col, "path": path_col, ROW_COLUMN: np.asarray(rows, dtype=np.int64)}


# ----- the source -------------------------------------------------------------------


class ImageSource:
    """Image files cut into partitions of consecutive files of the listing, or of its
    epoch's permutation under ``shuffle`` (``read_images``).

    Args:
        paths: absolute file paths, in their stable order.
        files_per_partition: files per partition.
        size: target ``(width, height)``, or None to keep each image's size.
        mode: Pillow mode of the output (``"RGB"``, ``"RGBA"``, ``"L"``) or None.
        on_error: ``"raise"`` or ``"skip"``.
        decode: decode in the read (``image`` arrays), or hand on the encoded bytes.
    """

    name = "Images"
    shuffle_window = 1  # under shuffle every partition is a uniform sample of the files

    def __init__(self, paths: Sequence[str], files_per_partition: int, size: Optional[tuple[int, int]],
                 mode: Optional[str], on_error: str, decode: bool = True) -> None:
        self._decode = bool(decode)
        self._paths = list(paths)
        self._fpp = int(files_per_partition)
        self._size = size
        self._mode = mode
        self._on_error = on_error
        self._parts: Optional[tuple[tuple, list[Partition]]] = None  # (key, the epoch's partitions)

    @property
    def paths(self) -> list[str]:
        """The listed files, in partition order."""
        return list(self._paths)

    def shared(self) -> Any:
        """Nothing is shared: each partition carries its own file names."""
        return None

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        """Runs of ``files_per_partition`` files of the listing: in its order (the same every
        epoch), or under ``shuffle`` of a permutation of it drawn from the epoch seed, so
        every partition holds files from across the whole listing."""
        key = (epoch_seed if shuffle else None, bool(shuffle))
        if self._parts is None or self._parts[0] != key:
            parts = []
            for pid, members in enumerate(cut_members(member_positions(len(self._paths), epoch_seed, shuffle),
                                                      self._fpp)):
                chunk = tuple(self._paths[i] for i in members)
                label = chunk[0] if len(chunk) == 1 else f"{chunk[0]} (+{len(chunk) - 1} more files)"
                parts.append(Partition(pid, len(chunk), chunk, label))
            self._parts = (key, parts)
        return list(self._parts[1])

    def reader(self) -> Callable[[Any, Partition], Block]:
        """The module-level decode function with this source's options bound."""
        return functools.partial(_read_image_files, size=self._size, mode=self._mode, on_error=self._on_error,
                                 decode=self._decode)

    def num_rows(self) -> Optional[int]:
        """Files listed (rows delivered, unless some are skipped under ``on_error="skip"``)."""
        return len(self._paths)

    def fingerprint(self) -> dict:
        """Type, file count, partitioning and a digest of the file list."""
        digest = hashlib.sha1("\n".join(self._paths).encode("utf-8", "surrogateescape")).hexdigest()
        return {
            "type": self.name,
            "num_rows": len(self._paths),
            "num_partitions": math.ceil(len(self._paths) / self._fpp),
            "files_per_partition": self._fpp,
            "decode": self._decode,
            "files_sha1": digest,
        }


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
            an image) raises :class:`~sbloader.errors.SourceReadError` naming the
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
            that ``decode=True`` builds and the augmentation converts back (in
            ``benchmarks/results/images.md`` 5–6% of the workers' CPU per image,
            60–80 µs of 1.2 ms). ``size`` and ``mode`` then do not apply, and
            ``on_error`` covers reading the file only: a corrupt image raises (or is
            skipped) where the ``map_batches`` function decodes it.

    Returns:
        A lazy :class:`~sbloader.dataset.Dataset`.

    Raises:
        ValueError: an invalid argument, or a directory with no image file.
        FileNotFoundError: a path does not exist or a glob matches nothing.
    """
    check_on_error(on_error)
    if not decode and size is not None:
        raise ValueError(f"size={size!r} needs decode=True: with decode=False the files' bytes are handed "
                         "on undecoded; resize where the map_batches function decodes them")
    check_mode(mode)
    if size is not None:
        try:
            w, h = size
        except (TypeError, ValueError):
            raise ValueError(f"size must be (width, height), found {size!r}") from None
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in (w, h)):
            raise ValueError(f"size must be (width, height) with positive integers, found {size!r}")
        size = (int(w), int(h))
    if isinstance(extensions, str):
        extensions = (extensions,)
    files = list_files(paths_or_dir, extensions, "image")
    fpp = files_per_partition_for(len(files), files_per_partition, num_partitions, DEFAULT_FILES_PER_PARTITION)
    return Dataset(ImageSource(files, fpp, size, mode, on_error, decode))

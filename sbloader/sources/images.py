"""Image files as a source (``read_images``): JPEG/PNG files decoded with Pillow (most JPEGs by libjpeg-turbo
straight into the array, with the same pixels: :mod:`sbloader.sources.jpeg`), a few files
per partition.

The driver only lists file names (never opens a file); decoding runs in the
remote read tasks. A partition is a run of consecutive files of the sorted
listing (under ``shuffle=True``, of a permutation of the listing drawn from the
epoch seed), so its id is stable for its epoch, and reading it twice yields the
same rows.
"""
from __future__ import annotations

import functools
import hashlib
import io
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from sbloader.sources import jpeg as _jpeg
from sbloader.core.block import ROW_COLUMN, Block, to_column
from sbloader.core.context import report_skipped
from sbloader.core.plan import cut_members, member_positions
from sbloader.sources.ahead import EpochAhead
from sbloader.sources.base import Partition
from sbloader.sources.fetch import RemoteFiles
from sbloader.sources.files import read_error

#: Files per partition when neither ``files_per_partition`` nor ``num_partitions`` is given:
#: one training batch of a typical size per task. Every partition is a task and a
#: block, each with a fixed cost in the trainer (scheduling, fetch) and in Ray: 64
#: files per partition instead of 16 cut the trainer's CPU per image by about two
#: thirds (benchmarks/results/images.md).
DEFAULT_FILES_PER_PARTITION = 64

#: Extensions ``read_images`` lists in a directory or a glob by default.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")

_MODES = ("RGB", "RGBA", "L", None)

#: Partitions after its own (in the epoch plan's order) whose remote objects a read task
#: fetches into the node's cache while it decodes (within the byte budget,
#: :mod:`sbloader.sources.inflight`).
PREFETCH_PARTITIONS = 2

#: The plan's first partition fetches ahead only when its own objects took at least this long to
#: be answered (~40 ms at 20 ms a request, 64 objects). Its task runs alone (the executor's first,
#: before a block is measured) and makes the batch the trainer waits for: the next partitions'
#: GETs and cache writes in its process during its decode made that batch ~45 ms later at 20 ms
#: a request; without them the next tasks wait a round trip for their own objects, which cost
#: ~6% of a 2,000-image first epoch at 100 ms (#47, ``docs/remote_data.md``).
FIRST_AHEAD_AFTER_S = 0.06


def check_mode(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is an output mode the decode supports."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {list(_MODES)}, found {mode!r}")


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
    straight into the array, with the same pixels as Pillow's (:mod:`sbloader.sources.jpeg`);
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
                      mode: Optional[str], on_error: str, decode: bool = True,
                      remote: Optional[RemoteFiles] = None) -> Block:
    """Decode (or, with ``decode=False``, read) the files of one partition into columns
    ``image`` and ``path``. With ``remote``, the objects are fetched many at once (and
    through the node's cache) while the ones already back are decoded, in order."""
    paths: Sequence[str] = partition.payload
    images: list[Any] = []
    kept: list[str] = []
    rows: list[int] = []
    if remote is not None:
        # The partitions after this one in the epoch's order go into the node's cache behind
        # this one's requests (behind the plan's first partition's only after a long round trip).
        nxt, after_s = [], 0.0
        if shared is not None:
            nxt = [u for pid in shared.after(partition.id, PREFETCH_PARTITIONS) for u in shared.members[pid]]
            after_s = FIRST_AHEAD_AFTER_S if shared.runs_first(partition.id) else 0.0
        fetched = remote.read_many(paths, ahead=nxt, ahead_after_s=after_s)
    else:
        fetched = ((p, None) for p in paths)
    for i, (path, got) in enumerate(fetched):
        try:
            if isinstance(got, BaseException):
                raise got
            data = got if got is not None else _read_bytes(path)
            arr = _decode_bytes(data, size, mode, name=path) if decode else data
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
        remote: how the read tasks fetch remote objects (None: every path is local).
    """

    name = "Images"
    shuffle_window = 1  # under shuffle every partition is a uniform sample of the files

    def __init__(self, paths: Sequence[str], files_per_partition: int, size: Optional[tuple[int, int]],
                 mode: Optional[str], on_error: str, decode: bool = True,
                 remote: Optional[RemoteFiles] = None) -> None:
        self._decode = bool(decode)
        self._remote = remote
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
        """Remote objects cached: the epoch's partitions' URIs by id and the epoch's order of
        them (:class:`EpochAhead`: a read task fetches the next ones in that order into the
        node's cache); otherwise nothing (each partition carries its files)."""
        if self._remote is None or not self._remote.cache.enabled or self._parts is None:
            return None
        (seed, shuffle), parts = self._parts
        return EpochAhead.of(tuple(p.payload for p in parts), 0 if seed is None else seed, shuffle)

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
                                 decode=self._decode, remote=self._remote)

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

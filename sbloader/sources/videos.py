"""Video files as a source (``read_videos``): decoded with PyAV into frames or clips.

A partition is one video, or a range of its frames (``frames_per_partition``).
Planning *probes* every file: it demuxes the video stream (reads the packets,
decodes nothing) to count the frames and to find, for the first frame of every
range, the keyframe to seek to. Probes run in the driver for a handful of
files and in remote Ray tasks (one per chunk of files) otherwise, as
``read_parquet`` reads footers. Decoding runs in the remote read tasks.

Frame ``i`` of a video is the ``i``-th frame PyAV decodes from the start of its
first video stream (presentation order). A range ``[a, b)`` is read by seeking
to a keyframe that precedes, in decode order, every frame of the range, decoding
from there and dropping the frames before ``a`` (found by their timestamps). If
the decoder does not land where the probe said (a demuxer that seeks
differently, timestamps that lie), the range is decoded again from the start of
the file, so every frame is delivered exactly once across partitions whatever
the container.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from sbloader.core.context import report_skipped
from sbloader.sources.files import IOUnitSource, read_error
from sbloader.sources.base import Partition
from sbloader.sources.video_probe import VideoDecodeError, VideoMeta

#: Extensions ``read_videos`` lists in a directory or a glob by default.
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts")

_HINT = "check the file, or pass on_error='skip' to skip undecodable videos"


class VideoPiece(NamedTuple):
    """The payload of one partition: frames ``[start, stop)`` of one file.

    Attributes:
        path: the file.
        start: first frame of the range.
        stop: one past its last frame.
        start_pts: timestamp of frame ``start`` (None: count frames from the start).
        stop_pts: timestamp of frame ``stop`` (None: end of the file or unknown).
        seek_ts: timestamp to seek to (None: decode from the start of the file).
        error: the probe's error for an unreadable file ("" otherwise).
    """

    path: str
    start: int
    stop: int
    start_pts: Optional[int] = None
    stop_pts: Optional[int] = None
    seek_ts: Optional[int] = None
    error: str = ""


# ----- probing (driver for a few files, remote tasks for many) --------------------


def _to_rgb(frame: Any, size: Optional[tuple[int, int]]) -> np.ndarray:
    if size is None:
        return frame.to_ndarray(format="rgb24")
    return frame.to_ndarray(format="rgb24", width=size[0], height=size[1], interpolation="BILINEAR")


def _decode_once(piece: VideoPiece, seek: bool, stride: int, size: Optional[tuple[int, int]],
                 threads: int, source: Any = None) -> tuple[list[np.ndarray], int]:
    """One attempt at frames ``[start, stop)``: the RGB arrays of every ``stride``-th
    frame, and how many frames of the range were seen (-1: the seek landed late)."""
    import av

    want = piece.stop - piece.start
    kept: list[np.ndarray] = []
    got = 0
    if hasattr(source, "seek"):
        source.seek(0)
    with av.open(source if source is not None else piece.path, metadata_errors="ignore") as container:
        if not container.streams.video:
            raise VideoDecodeError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = threads
        by_pts = seek and piece.start_pts is not None
        if by_pts:
            container.seek(piece.seek_ts, stream=stream, backward=True, any_frame=False)
        count = 0
        for frame in container.decode(stream):
            if by_pts:
                pts = frame.pts
                if pts is None:
                    return kept, -1
                if pts < piece.start_pts:
                    continue
                if got == 0 and pts != piece.start_pts:
                    return kept, -1  # frame ``start`` was not decoded: the seek went too far
                if piece.stop_pts is not None and pts >= piece.stop_pts:
                    break
            else:
                count += 1
                if count <= piece.start:
                    continue
            if got % stride == 0:
                kept.append(_to_rgb(frame, size))
            got += 1
            if got == want:
                break
    return kept, got


def decode_piece(piece: VideoPiece, *, frame_stride: int = 1, size: Optional[tuple[int, int]] = None,
                 decode_threads: int = 1, source: Any = None) -> list[np.ndarray]:
    """Decode frames ``start, start + frame_stride, ...`` below ``stop`` of one piece.

    Seeks when the piece has a seek point; if the decoder does not land where the
    probe said, decodes again from the start of the file (frames counted).

    Args:
        piece: the file and frame range.
        frame_stride: keep every ``frame_stride``-th frame of the range.
        size: resize to ``(width, height)`` (bilinear), or None.
        decode_threads: FFmpeg decoder threads (0: FFmpeg picks).
        source: what to open instead of ``piece.path`` (a remote object's cache
            entry, or its bytes in a buffer).

    Returns:
        ``HxWx3`` ``uint8`` RGB arrays.

    Raises:
        VideoDecodeError: the file holds fewer frames than its probe listed.
        Exception: whatever PyAV raises on an unreadable file.
    """
    want = piece.stop - piece.start
    seek = piece.seek_ts is not None and piece.start_pts is not None
    kept, got = _decode_once(piece, seek, frame_stride, size, decode_threads, source)
    if got != want and seek:
        kept, got = _decode_once(piece, False, frame_stride, size, decode_threads, source)
    if got != want:
        raise VideoDecodeError(
            f"frames [{piece.start}, {piece.stop}) of {piece.path!r}: decoded {max(got, 0)} of the {want} "
            f"frames its index lists; the file is truncated or corrupt, or changed after the dataset was created"
        )
    return kept


def _empty_block(clip_len: Optional[int], size: Optional[tuple[int, int]]) -> dict:
    col = "frame" if clip_len is None else "clip"
    if size is None:
        data = np.empty((0,), dtype=object)
    else:
        shape = (0, size[1], size[0], 3) if clip_len is None else (0, clip_len, size[1], size[0], 3)
        data = np.empty(shape, dtype=np.uint8)
    return {col: data, "path": np.empty((0,), dtype=str), "frame_index": np.empty((0,), dtype=np.int64)}


def _to_block(piece: VideoPiece, frames: list[np.ndarray], clip_len: Optional[int], stride: int) -> dict:
    from sbloader.core.block import to_column

    if clip_len is None:
        index = piece.start + stride * np.arange(len(frames), dtype=np.int64)
        return {"frame": to_column(frames), "path": np.array([piece.path] * len(frames), dtype=str),
                "frame_index": index}
    n = len(frames) // clip_len
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise VideoDecodeError(
            f"{piece.path!r} changes frame size inside frames [{piece.start}, {piece.stop}) "
            f"(found {sorted(shapes)}); pass size=(width, height) to make clips of one size"
        )
    clips = np.stack(frames[:n * clip_len]).reshape((n, clip_len) + frames[0].shape) if n else np.empty(
        (0, clip_len, 0, 0, 3), dtype=np.uint8)
    index = piece.start + clip_len * stride * np.arange(n, dtype=np.int64)
    return {"clip": clips, "path": np.array([piece.path] * n, dtype=str), "frame_index": index}


def _read_video_partition(shared: Any, partition: Partition, *, clip_len: Optional[int], frame_stride: int,
                          size: Optional[tuple[int, int]], on_error: str, decode_threads: int,
                          remote: Any = None) -> dict:
    """Decode one partition into columns ``frame``/``clip``, ``path`` and ``frame_index``."""
    piece: VideoPiece = partition.payload
    try:
        if piece.error:
            raise VideoDecodeError(f"cannot probe {piece.path!r}: {piece.error}")
        source = None
        if remote is not None:
            from sbloader.sources.fetch import files_ahead

            remote.prefetch(files_ahead(shared, partition.id))
            source = remote.local(piece.path)
        frames = decode_piece(piece, frame_stride=frame_stride, size=size, decode_threads=decode_threads,
                              source=source)
        return _to_block(piece, frames, clip_len, frame_stride)
    except Exception as e:
        where = "the file" if piece.error else f"frames [{piece.start}, {piece.stop})"
        if on_error == "skip":
            rows = partition.num_rows if partition.num_rows else 1
            report_skipped(piece.path, f"cannot decode {where}: {e!r}", rows=rows)
            return _empty_block(clip_len, size)
        raise read_error(partition, piece.path, e, _HINT) from e


# ----- the source -------------------------------------------------------------------


def _rows_of(frames: int, clip_len: Optional[int], stride: int) -> int:
    """Rows (frames kept, or whole clips) from ``frames`` consecutive frames."""
    if clip_len is None:
        return -(-frames // stride)
    return frames // (clip_len * stride)


class VideoSource(IOUnitSource):
    """Videos cut into partitions of one file or a frame range (``read_videos``).

    Args:
        files: the probes of the files, in order.
        clip_len: frames per clip (None: one row per frame).
        frame_stride: keep every ``frame_stride``-th frame.
        frames_per_partition: frames per range, a multiple of the row's span
            (None: one partition per file).
        size: target ``(width, height)`` or None.
        on_error: ``"raise"`` or ``"skip"``.
        decode_threads: FFmpeg decoder threads per read task.
        remote: how the read tasks fetch remote objects
            (:class:`~sbloader.sources.fetch.RemoteFiles`; None: every path is local).
    """

    name = "Videos"

    def __init__(self, files: Sequence[VideoMeta], *, clip_len: Optional[int], frame_stride: int,
                 frames_per_partition: Optional[int], size: Optional[tuple[int, int]], on_error: str,
                 decode_threads: int, remote: Any = None) -> None:
        self._files = list(files)
        self._remote = remote
        self._clip_len = clip_len
        self._stride = frame_stride
        self._fpp = frames_per_partition
        self._size = size
        self._on_error = on_error
        self._threads = decode_threads
        self._parts = self._make_partitions()

    def _make_partitions(self) -> list[Partition]:
        unit = self._stride * (self._clip_len or 1)
        parts: list[Partition] = []
        for fm in self._files:
            if fm.error:
                # Still a partition, so the error (or the skip) happens where every
                # other read error does: in the read task, reported to the consumer.
                n = 0 if self._on_error == "skip" else None
                parts.append(Partition(len(parts), n, VideoPiece(fm.path, 0, 0, error=fm.error),
                                       f"{fm.path} (unreadable)"))
                continue
            used = fm.num_frames if self._clip_len is None else _rows_of(fm.num_frames, self._clip_len,
                                                                          self._stride) * unit
            span = self._fpp if self._fpp is not None else max(1, used)
            points = {p.frame: p for p in fm.points}
            for a in range(0, used, span):
                b = min(a + span, used)
                pa = points[a]
                pb = points.get(b) if b < fm.num_frames else None
                piece = VideoPiece(fm.path, a, b, pa.pts, pb.pts if pb is not None else None, pa.seek_ts)
                label = fm.path if (a, b) == (0, fm.num_frames) else f"{fm.path} frames [{a}, {b})"
                parts.append(Partition(len(parts), _rows_of(b - a, self._clip_len, self._stride), piece, label))
        return parts

    def reader(self) -> Callable[[Any, Partition], dict]:
        """The module-level decode function with this source's options bound."""
        return functools.partial(_read_video_partition, clip_len=self._clip_len, frame_stride=self._stride,
                                 size=self._size, on_error=self._on_error, decode_threads=self._threads,
                                 remote=self._remote)

    def fingerprint(self) -> dict:
        """Type, row and partition counts, options, and a digest of the files and their frame counts."""
        h = hashlib.sha1()
        for fm in self._files:
            h.update(f"{fm.path}\0{fm.num_frames}\0{bool(fm.error)}\n".encode("utf-8", "surrogateescape"))
        return {
            "type": self.name,
            "num_rows": self.num_rows(),
            "num_partitions": len(self._parts),
            "frames_per_partition": self._fpp,
            "clip_len": self._clip_len,
            "frame_stride": self._stride,
            "size": list(self._size) if self._size is not None else None,
            "files_sha1": h.hexdigest(),
        }


def _positive_int(name: str, value: Any, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, found {value!r}")
    return int(value)

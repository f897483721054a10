"""Probing video files before an epoch: frame counts and the keyframe to seek to for a
range of frames, without decoding a frame.

A probe demuxes the video stream (reads the packets, decodes nothing). Probes run
in the driver for a handful of files and in remote Ray tasks (one per chunk of
files) otherwise, as ``read_parquet`` reads footers.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import ray

#: Up to this many files, the driver probes them itself; above, remote tasks do.
DRIVER_PROBE_MAX_FILES = 4

#: Fewest files one remote probe task reads.
_MIN_FILES_PER_PROBE_TASK = 2

#: Remote videos one probe call fetches at once, at most (each whole, into the cache), within the
#: read's byte budget (:func:`~sbloader.sources.inflight.map_side_by_side`): 64 videos at 100 ms a request
#: were probed in two round trips by 16 a task (two tasks at once on 2 CPUs), now in one (#47).
PROBE_SIDE_BY_SIDE = 32


class VideoDecodeError(ValueError):
    """A video file could not be probed or decoded as its index promised."""


class SeekPoint(NamedTuple):
    """Where decoding starts for a range whose first frame is ``frame``.

    Attributes:
        frame: index of the frame (presentation order).
        pts: its timestamp, or None when the file's timestamps cannot identify
            frames (missing or repeated): the range is then decoded from the
            start of the file and frames are counted.
        seek_ts: timestamp to seek to (stream time base), or None to decode
            from the start of the file.
    """

    frame: int
    pts: Optional[int]
    seek_ts: Optional[int]


class VideoMeta(NamedTuple):
    """What probing one file found.

    Attributes:
        path: absolute path of the file.
        num_frames: frames of its first video stream (0 when unreadable).
        points: a :class:`SeekPoint` for the first frame of every range.
        error: why the file could not be probed ("" when it could).
    """

    path: str
    num_frames: int
    points: tuple[SeekPoint, ...]
    error: str = ""


def seek_points(pts: Sequence[Optional[int]], dts: Sequence[Optional[int]], keyframe: Sequence[bool],
                span: Optional[int]) -> tuple[SeekPoint, ...]:
    """Seek points for ranges starting at every multiple of ``span`` (a pure function).

    The keyframe chosen for a range starting at frame ``f`` is the last one in
    decode order that (a) comes, in decode order, before every packet of the
    frames ``f, f+1, ...`` (B-frames are decoded before frames they precede on
    screen) and (b) is not after frame ``f`` on screen (so leading pictures of an
    open GOP that need the previous GOP are all before ``f``).

    Args:
        pts: presentation timestamp of every packet, in decode order.
        dts: decode timestamp of every packet (None where the container has none).
        keyframe: whether each packet is a keyframe.
        span: frames per range (None: one range, the whole file).

    Returns:
        One :class:`SeekPoint` per range start, in order.
    """
    n = len(pts)
    starts = [0] if span is None else list(range(0, n, span))
    if n == 0 or any(p is None for p in pts) or len(set(pts)) != n:
        return tuple(SeekPoint(f, None, None) for f in starts)
    pts_arr = np.asarray(pts, dtype=np.int64)
    order = np.argsort(pts_arr, kind="stable")  # frame i on screen is packet order[i]
    sorted_pts = pts_arr[order]
    first_needed = np.minimum.accumulate(order[::-1])[::-1]  # earliest packet of frames i, i+1, ...
    keys = np.flatnonzero(np.asarray(keyframe, dtype=bool))
    out = []
    for f in starts:
        p = int(sorted_pts[f])
        ok = keys[(keys <= first_needed[f]) & (pts_arr[keys] <= p)]
        k = int(ok[-1]) if len(ok) else 0
        # Seeking by the keyframe's decode timestamp lands on it whether the
        # demuxer indexes by dts (MP4, AVI) or pts (Matroska: dts <= pts).
        seek = None if k == 0 else int(dts[k] if dts[k] is not None else pts[k])
        out.append(SeekPoint(f, p, seek))
    return tuple(out)


def probe_video(path: str, span: Optional[int] = None, remote: Any = None) -> VideoMeta:
    """Count the frames of a file's first video stream and find its seek points.

    Demuxes the stream (reads every packet, decodes none). A failure is recorded
    in ``VideoMeta.error``, never raised.

    Args:
        path: the file.
        span: frames per range (None: the whole file is one range).
        remote: how to fetch a remote object (:class:`~sbloader.sources.fetch.RemoteFiles`:
            the probe leaves it in the node's cache for the reads); None: ``path`` is local.
    """
    try:
        import av

        source = remote.local(path, ahead=True) if remote is not None else path
        with av.open(source, metadata_errors="ignore") as container:
            if not container.streams.video:
                kinds = sorted({s.type for s in container.streams}) or ["none"]
                raise VideoDecodeError(f"no video stream (streams: {kinds})")
            stream = container.streams.video[0]
            pts: list[Optional[int]] = []
            dts: list[Optional[int]] = []
            key: list[bool] = []
            for packet in container.demux(stream):
                if packet.size == 0 or packet.is_discard:  # the flush packet; edit-list discards
                    continue
                pts.append(packet.pts)
                dts.append(packet.dts)
                key.append(bool(packet.is_keyframe))
        if not pts:
            raise VideoDecodeError("the video stream has no frames")
        return VideoMeta(path, len(pts), seek_points(pts, dts, key, span))
    except Exception as e:
        return VideoMeta(path, 0, (), repr(e))


def probe_videos(paths: Sequence[str], span: Optional[int] = None, remote: Any = None) -> list[VideoMeta]:
    """Probe several files (see :func:`probe_video`); remote ones several at once (each fetch waits
    on the store: one after the other, a task of 4 objects at 20 ms spent 80 ms in round trips)."""
    if remote is not None:
        from sbloader.sources.inflight import map_side_by_side

        return map_side_by_side(lambda p: probe_video(p, span, remote), list(paths), remote.versions,
                                remote.max_bytes, PROBE_SIDE_BY_SIDE)
    return [probe_video(p, span, remote) for p in paths]


_probe_task = ray.remote(num_cpus=1, max_retries=3)(probe_videos)


def gather_probes(paths: Sequence[str], span: Optional[int] = None, remote: Any = None) -> list[VideoMeta]:
    """Probe every file: in the driver for a handful, else in remote Ray tasks.

    Args:
        paths: the files, in order.
        span: frames per range (None: one range per file).
        remote: how to fetch remote objects (None: every path is local).

    Returns:
        One :class:`VideoMeta` per path, in the same order.
    """
    if len(paths) <= DRIVER_PROBE_MAX_FILES:
        return probe_videos(paths, span, remote)
    from sbloader.runtime.session import cluster_cpus, ensure_initialized

    ensure_initialized()
    # Remote files: as many tasks as run at once (their probes wait on the store side by side, a
    # round trip for all); local ones: two a CPU (their probes are the CPU's).
    tasks = max(1, int(cluster_cpus() * (1 if remote is not None and remote.versions else 2)))
    per_task = max(_MIN_FILES_PER_PROBE_TASK, math.ceil(len(paths) / tasks))
    refs = [_probe_task.remote(list(paths[i:i + per_task]), span, remote) for i in range(0, len(paths), per_task)]
    return [m for chunk in ray.get(refs) for m in chunk]


# ----- decoding (runs in the remote read tasks) -----------------------------------

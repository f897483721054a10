"""read_videos: frames and clips equal to PyAV's own decode, seeking, bad files, re-reads, the trainer."""
from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import pickle
import shutil
import sys
from pathlib import Path

import av
import numpy as np
import pytest

import sbloader
from sbloader.sources import video_probe as P
from sbloader.sources import videos as V
from sbloader.datagen import write_video
from sbloader.core.errors import SourceReadError

ROOT = Path(__file__).resolve().parents[2]

# (file name, codec, keyframe interval, B-frames): MP4, Matroska and AVI; with
# B-frames, decode order differs from presentation order, which seeking must handle.
_H264 = "libx264" if "libx264" in av.codecs_available else "mpeg4"
VIDEOS = [
    ("a_mpeg4_bframes.mp4", "mpeg4", 7, 2, 45),
    ("b_h264.mkv", _H264, 9, None, 38),
    ("c_mpeg4_bframes.avi", "mpeg4", 6, 2, 29),
]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, list[np.ndarray]]:
    """Three small videos and the frames PyAV decodes from each (path -> RGB frames)."""
    root = tmp_path_factory.mktemp("videos")
    out = {}
    for i, (name, codec, gop, bframes, n) in enumerate(VIDEOS):
        path = str(root / name)
        write_video(path, frames=n, width=48, height=32, fps=25, seed=i, codec=codec, gop_size=gop,
                    max_b_frames=bframes)
        out[path] = _pyav_frames(path)
        assert len(out[path]) == n
    return out


def _pyav_frames(path: str, size: tuple[int, int] | None = None) -> list[np.ndarray]:
    """Every frame of the file, decoded from the start by PyAV directly."""
    kw = {} if size is None else {"width": size[0], "height": size[1], "interpolation": "BILINEAR"}
    with av.open(path) as c:
        return [f.to_ndarray(format="rgb24", **kw) for f in c.decode(video=0)]


def _rows(ds: sbloader.Dataset, column: str) -> list[tuple[str, int, np.ndarray]]:
    rows = []
    for batch in ds.iter_batches(5):
        for p, i, x in zip(batch["path"], batch["frame_index"], batch[column]):
            rows.append((str(p), int(i), np.asarray(x)))
    return rows


def _read_all(source) -> list[dict]:
    reader = source.reader()
    return [reader(source.shared(), part) for part in source.partitions(0, 0)]


def test_frames_equal_pyav_decode_with_ranges(ray_session, videos):
    ds = sbloader.read_videos(list(videos), frames_per_partition=5)
    parts = ds.source.partitions(0, 0)
    assert len(parts) == sum(-(-len(f) // 5) for f in videos.values())
    assert ds.num_rows() == sum(len(f) for f in videos.values())
    # Most ranges start mid-file and seek to a keyframe (not decoded from the start).
    assert sum(p.payload.seek_ts is not None for p in parts) >= len(parts) // 2
    rows = _rows(ds, "frame")
    assert collections.Counter((p, i) for p, i, _ in rows) == collections.Counter(
        (p, i) for p, frames in videos.items() for i in range(len(frames)))  # every frame exactly once
    for path, i, frame in rows:
        assert frame.dtype == np.uint8 and frame.shape == (32, 48, 3)
        assert np.array_equal(frame, videos[path][i]), (path, i)
    assert ds.stats().skipped == 0


def test_seek_lands_on_the_probed_keyframe(videos, monkeypatch):
    # No range needs the decode-from-the-start fallback on these containers.
    calls = []
    real = V._decode_once
    monkeypatch.setattr(V, "_decode_once", lambda piece, seek, *a: calls.append(seek) or real(piece, seek, *a))
    source = sbloader.read_videos(list(videos), frames_per_partition=3).source
    blocks = _read_all(source)
    assert sum(len(b["frame"]) for b in blocks) == sum(len(f) for f in videos.values())
    assert len(calls) == len(blocks) and sum(calls) > len(blocks) // 2


def test_a_seek_that_lands_late_falls_back_to_decoding_from_the_start(videos):
    path = next(p for p in videos if p.endswith(".mp4"))
    source = sbloader.read_videos(path, frames_per_partition=4).source
    part = source.partitions(0, 0)[-2]
    # A seek target past the range (as a demuxer that seeks differently would land).
    late = dataclasses.replace(part, payload=part.payload._replace(seek_ts=part.payload.stop_pts + 10**6))
    block = source.reader()(None, late)
    assert block["frame_index"].tolist() == list(range(part.payload.start, part.payload.stop))
    for i, frame in zip(block["frame_index"], block["frame"]):
        assert np.array_equal(frame, videos[path][i])


@pytest.mark.parametrize("clip_len, stride, fpp", [(4, 1, 8), (3, 2, 13), (5, 1, None)])
def test_clips_cover_frames_once(ray_session, videos, clip_len, stride, fpp):
    ds = sbloader.read_videos(list(videos), clip_len=clip_len, frame_stride=stride, frames_per_partition=fpp)
    window = clip_len * stride
    expected = {p: len(f) // window for p, f in videos.items()}
    assert ds.num_rows() == sum(expected.values())
    rows = _rows(ds, "clip")
    assert len(rows) == ds.num_rows()
    seen = collections.defaultdict(list)
    for path, first, clip in rows:
        assert clip.shape == (clip_len, 32, 48, 3)
        assert first % window == 0
        for t in range(clip_len):
            assert np.array_equal(clip[t], videos[path][first + t * stride]), (path, first, t)
        seen[path].append(first)
    for path, n in expected.items():
        assert sorted(seen[path]) == [k * window for k in range(n)]  # non-overlapping, each once
        if stride == 1:
            covered = [f for s in seen[path] for f in range(s, s + window)]
            assert sorted(covered) == list(range(n * window))  # every frame of the whole windows once


def test_frame_stride_and_size(videos):
    path = next(p for p in videos if p.endswith(".mkv"))
    source = sbloader.read_videos(path, frame_stride=3, frames_per_partition=7, size=(20, 14)).source
    assert all((p.payload.stop - p.payload.start) % 3 == 0 for p in source.partitions(0, 0)[:-1])
    blocks = _read_all(source)
    index = np.concatenate([b["frame_index"] for b in blocks])
    assert index.tolist() == list(range(0, len(videos[path]), 3))
    resized = _pyav_frames(path, (20, 14))
    for b in blocks:
        assert b["frame"].shape[1:] == (14, 20, 3)
        for i, frame in zip(b["frame_index"], b["frame"]):
            assert np.array_equal(frame, resized[i])


def test_partition_reread_is_identical(videos):
    source = sbloader.read_videos(list(videos), clip_len=2, frames_per_partition=6).source
    first, second = _read_all(source), _read_all(source)
    assert len(first) == len(source.partitions(0, 0))
    for a, b in zip(first, second):
        assert a.keys() == b.keys() == {"clip", "path", "frame_index"}
        assert a["path"].tolist() == b["path"].tolist()
        assert a["frame_index"].tolist() == b["frame_index"].tolist()
        assert np.array_equal(a["clip"], b["clip"])
    again = sbloader.read_videos(list(videos), clip_len=2, frames_per_partition=6).source
    assert again.fingerprint() == source.fingerprint()
    assert [p.payload for p in again.partitions(3, 7)] == [p.payload for p in source.partitions(0, 0)]


def _bad_files(root: Path, good: str) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    data = Path(good).read_bytes()
    bad = {"truncated": root / "b_truncated.mp4", "empty": root / "c_empty.mp4", "text": root / "d_text.mp4"}
    bad["truncated"].write_bytes(data[: len(data) // 2])
    bad["empty"].write_bytes(b"")
    bad["text"].write_text("this is a text file, not a video\n")
    return bad


def test_bad_video_raises_naming_file_and_partition(ray_session, videos, tmp_path):
    good = next(p for p in videos if p.endswith(".mp4"))
    bad = _bad_files(tmp_path / "v", good)
    shutil.copy(good, tmp_path / "v" / "a_good.mp4")
    ds = sbloader.read_videos(tmp_path / "v", frames_per_partition=20)
    with pytest.raises(SourceReadError) as info:
        list(ds.iter_batches(4))
    err = info.value
    assert err.path in {str(p) for p in bad.values()}
    assert os.path.basename(err.path) in str(err) and f"partition {err.partition_id}" in str(err)
    assert ds.source.partitions(0, 0)[err.partition_id].payload.path == err.path
    assert "on_error='skip'" in str(err)
    for kind, path in bad.items():  # each kind alone names its own file
        with pytest.raises(SourceReadError, match=path.name) as info:
            list(sbloader.read_videos(path).iter_rows())
        assert info.value.path == str(path) and info.value.partition_id == 0, kind


def test_bad_video_is_skipped_and_counted(ray_session, videos, tmp_path):
    good = next(p for p in videos if p.endswith(".mp4"))
    bad = _bad_files(tmp_path / "v", good)
    shutil.copy(good, tmp_path / "v" / "a_good.mp4")
    ds = sbloader.read_videos(tmp_path / "v", clip_len=4, frames_per_partition=8, on_error="skip")
    rows = _rows(ds, "clip")
    assert {os.path.basename(p) for p, _, _ in rows} == {"a_good.mp4"}
    assert len(rows) == len(videos[good]) // 4
    assert ds.stats().skipped == len(bad)


def test_file_changed_after_planning_is_an_error_not_missing_frames(ray_session, tmp_path):
    path = str(tmp_path / "v.mp4")
    write_video(path, frames=30, width=32, height=24, seed=1, gop_size=5)
    source = sbloader.read_videos(path, frames_per_partition=10).source
    skipping = sbloader.read_videos(path, frames_per_partition=10, on_error="skip")
    write_video(path, frames=15, width=32, height=24, seed=1, gop_size=5)  # shorter now
    reader = source.reader()
    parts = source.partitions(0, 0)
    assert len(reader(None, parts[0])["frame"]) == 10
    with pytest.raises(SourceReadError, match=r"frames \[10, 20\).*decoded 5 of the 10 frames"):
        reader(None, parts[1])
    rows = _rows(skipping, "frame")
    assert sorted(i for _, i, _ in rows) == list(range(10))
    assert skipping.stats().skipped == 20  # the two ranges the file no longer holds


def test_seek_points_pure():
    # I P B B P B B (decode order) = I B B P B B P on screen; keyframes at packets 0 and 4.
    pts = [0, 3, 1, 2, 6, 4, 5]
    dts = [-1, 0, 1, 2, 3, 4, 5]
    key = [True, False, False, False, True, False, False]
    pts_of = sorted(pts)
    points = P.seek_points(pts, dts, key, span=2)
    assert [p.frame for p in points] == [0, 2, 4, 6]
    assert [p.pts for p in points] == [pts_of[f] for f in (0, 2, 4, 6)]
    # Frame 4 (pts 4) is decoded after packet 4 (the keyframe, pts 6), so the keyframe does not
    # precede it on screen: decode from the start. Frame 6 (pts 6) seeks to the keyframe's dts.
    assert [p.seek_ts for p in points] == [None, None, None, 3]
    assert P.seek_points([0, None, 2], [0, 1, 2], [True] * 3, span=1) == tuple(
        P.SeekPoint(f, None, None) for f in range(3))  # no timestamps: count from the start


def test_reader_is_small_and_picklable(videos):
    source = sbloader.read_videos(list(videos), clip_len=4, frames_per_partition=8).source
    blob = pickle.dumps(source.reader())
    assert len(blob) < 1000
    assert pickle.loads(blob).func.__module__ == "sbloader.sources.videos"
    assert all(len(pickle.dumps(p)) < 1000 for p in source.partitions(0, 0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"on_error": "ignore"}, "on_error must be 'raise'.*'ignore'"),
        ({"clip_len": 0}, "clip_len must be a positive integer or None, found 0"),
        ({"frame_stride": 0}, "frame_stride must be a positive integer, found 0"),
        ({"frames_per_partition": -3}, "frames_per_partition must be a positive integer or None, found -3"),
        ({"size": (0, 4)}, r"size must be .*\(0, 4\)"),
        ({"decode_threads": -1}, "decode_threads must be an integer >= 0.*-1"),
    ],
)
def test_invalid_arguments(videos, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sbloader.read_videos(list(videos), **kwargs)


def test_listing(videos, tmp_path):
    root = Path(next(iter(videos))).parent
    assert sbloader.read_videos(root).source.fingerprint()["num_partitions"] == len(videos)
    assert [m.path for m in sbloader.read_videos(root).source.files] == sorted(videos)
    with pytest.raises(FileNotFoundError, match="nope"):
        sbloader.read_videos(tmp_path / "nope")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="found no video files"):
        sbloader.read_videos(tmp_path / "e")


def test_probes_run_remotely_for_many_files(ray_session, videos, tmp_path):
    paths = []
    for k in range(P.DRIVER_PROBE_MAX_FILES + 2):
        src = list(videos)[k % len(videos)]
        dst = tmp_path / f"v{k}{Path(src).suffix}"
        shutil.copy(src, dst)
        paths.append(str(dst))
    metas = P.gather_probes(paths, span=4)
    assert [m.path for m in metas] == paths
    assert [m.num_frames for m in metas] == [len(videos[list(videos)[k % len(videos)]]) for k in range(len(paths))]
    assert metas == P.probe_videos(paths, span=4)


def test_video_trainer_runs(ray_session, tmp_path):
    spec = importlib.util.spec_from_file_location("train_video", ROOT / "trainers" / "train_video.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_video"] = module
    try:
        spec.loader.exec_module(module)
        args = module.parse_args(["--videos", "3", "--frames", "24", "--width", "32", "--height", "24",
                                  "--clip-len", "4", "--frames-per-partition", "8", "--batch-size", "4",
                                  "--steps", "4", "--data", str(tmp_path / "data")])
        result = module.train(args)
    finally:
        sys.modules.pop("train_video", None)
    assert result["steps"] == 4 and result["clips"] == 16 and result["frames"] == 64
    assert np.isfinite(result["loss"]) and result["frames_per_s"] > 0
    assert len(os.listdir(tmp_path / "data")) == 3

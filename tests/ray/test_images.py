"""read_images: listing, partitioning, decoding, unusual files and on_error."""
from __future__ import annotations

import collections
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import sbloader
from sbloader.core.errors import SourceReadError
from sbloader.sources.images import ImageSource


def _png(path: Path, value: int, size: tuple[int, int] = (12, 9)) -> Path:
    """A solid RGB PNG whose pixels are ``(value, value + 1, value + 2)`` (lossless)."""
    w, h = size
    arr = np.empty((h, w, 3), dtype=np.uint8)
    arr[...] = (value, value + 1, value + 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def _tree(root: Path, n: int) -> dict[str, int]:
    """``n`` PNGs of varied sizes in nested folders; maps absolute path -> value."""
    out = {}
    for i in range(n):
        sub = root / f"class_{i % 3}" / ("deep" if i % 4 == 0 else "")
        p = _png(sub / f"img_{i:03d}.png", value=i * 5, size=(10 + i % 4, 8 + i % 3))
        out[str(p)] = i * 5
    out[str(_png(root / "_underscore.png", value=7))] = 7  # only hidden (".") names are left out
    (root / "labels.txt").write_text("not listed: wrong extension\n")
    (root / ".hidden.png").write_bytes(b"hidden files are not listed")
    return out


def _unusual(root: Path) -> dict[str, Path]:
    """The seven kinds of unusual image file, plus one ordinary JPEG."""
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    rng = np.random.default_rng(0)
    files["ok"] = root / "a_ok.jpg"
    Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(files["ok"], quality=95)
    data = files["ok"].read_bytes()
    files["truncated"] = root / "b_truncated.jpg"
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["empty"] = root / "c_empty.jpg"
    files["empty"].write_bytes(b"")
    files["text"] = root / "d_text.png"
    files["text"].write_text("this is a text file, not an image\n")
    files["gray"] = root / "e_gray.png"
    Image.fromarray(np.full((6, 7), 100, dtype=np.uint8)).save(files["gray"])
    files["cmyk"] = root / "f_cmyk.jpg"
    Image.new("CMYK", (16, 8), (0, 255, 255, 0)).save(files["cmyk"], quality=95)  # red
    files["rgba"] = root / "g_rgba.png"
    rgba = np.zeros((5, 4, 4), dtype=np.uint8)
    rgba[...] = (10, 20, 30, 0)  # fully transparent: the colour is kept, alpha dropped
    rgba[0, 0] = (200, 150, 100, 255)
    Image.fromarray(rgba).save(files["rgba"])
    files["gray16"] = root / "h_gray16.png"
    g16 = np.array([[0, 257 * 100, 65535], [257 * 1, 257 * 200, 257 * 255]], dtype=np.uint16)
    Image.fromarray(g16).save(files["gray16"])
    return files


BAD = ("truncated", "empty", "text")
CONVERTIBLE = ("gray", "cmyk", "rgba", "gray16")


def _collect_rows(ds: sbloader.Dataset, **kwargs) -> list[dict]:
    rows = []
    for batch in ds.iter_batches(4, **kwargs):
        n = len(batch["path"])
        for i in range(n):
            rows.append({k: v[i] for k, v in batch.items()})
    return rows


def test_directory_end_to_end_every_file_once(ray_session, tmp_path):
    expected = _tree(tmp_path / "data", 22)

    def add_mean(batch):
        batch["mean"] = np.array([float(np.asarray(im).mean()) for im in batch["image"]])
        return batch

    ds = sbloader.read_images(tmp_path / "data", files_per_partition=5).map_batches(add_mean)
    assert ds.num_partitions() == math.ceil(23 / 5)
    assert ds.source.num_rows() == 23 == len(expected)
    rows = _collect_rows(ds)
    counts = collections.Counter(str(r["path"]) for r in rows)
    assert counts == collections.Counter(expected.keys())  # every file exactly once, nothing else
    for r in rows:
        v = expected[str(r["path"])]
        img = np.asarray(r["image"])
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
        assert (img[..., 0] == v).all() and (img[..., 2] == v + 2).all()
        assert r["mean"] == pytest.approx(v + 1)
    assert ds.stats().skipped == 0


def test_listing_is_sorted_recursive_and_names_only(tmp_path, monkeypatch):
    expected = _tree(tmp_path / "data", 9)

    def no_open(*args, **kwargs):
        raise AssertionError("the driver opened an image file")

    monkeypatch.setattr(Image, "open", no_open)
    ds = sbloader.read_images(str(tmp_path / "data"), files_per_partition=4)
    parts = ds.source.partitions(0, 0)
    listed = [p for part in parts for p in part.payload]
    assert listed == sorted(expected)  # recursive, sorted, .txt and hidden files left out
    assert [p.id for p in parts] == [0, 1, 2]
    assert [p.num_rows for p in parts] == [4, 4, 2]
    assert ds.source.partitions(1, 123) == parts  # stable across epochs
    again = sbloader.read_images(tmp_path / "data", files_per_partition=4)
    assert ds.source.fingerprint() == again.source.fingerprint()


def test_glob_single_file_and_list(tmp_path):
    expected = sorted(_tree(tmp_path / "data", 8))
    globbed = sbloader.read_images(str(tmp_path / "data" / "**" / "*.png")).source.paths
    assert globbed == expected
    assert sbloader.read_images(expected[3]).source.paths == [expected[3]]
    listed = sbloader.read_images([expected[5], tmp_path / "data" / "class_1"]).source.paths
    assert listed == [expected[5]] + sorted(p for p in expected if "class_1" in p)
    assert sbloader.read_images(tmp_path / "data", num_partitions=3).num_partitions() == 3


def test_size_resizes_and_stacks(ray_session, tmp_path):
    _tree(tmp_path / "data", 9)
    ds = sbloader.read_images(tmp_path / "data", size=(8, 6), files_per_partition=4)
    batches = list(ds.iter_batches(None))
    assert sum(len(b["path"]) for b in batches) == 10
    for b in batches:
        assert b["image"].dtype == np.uint8
        assert b["image"].shape == (len(b["path"]), 6, 8, 3)


def test_grayscale_mode_keeps_hwc(tmp_path):
    files = _unusual(tmp_path / "u")
    source = sbloader.read_images([files["gray"], files["gray16"]], mode="L").source
    block = source.reader()(source.shared(), source.partitions(0, 0)[0])
    assert block["image"][0].shape == (6, 7, 1) and (block["image"][0] == 100).all()
    assert block["image"][1][:, :, 0].tolist() == [[0, 100, 255], [1, 200, 255]]


@pytest.mark.parametrize("kind", BAD)
def test_bad_file_raises_naming_file_and_partition(ray_session, tmp_path, kind):
    files = _unusual(tmp_path / "u")
    ds = sbloader.read_images(tmp_path / "u", files_per_partition=2)
    paths = ds.source.paths
    bad = str(files[kind])
    with pytest.raises(SourceReadError) as info:
        for _ in ds.iter_batches(2):
            pass
    err = info.value
    # Partitions run concurrently: the first bad file to fail is reported.
    assert err.path is not None and os.path.basename(err.path) in str(err)
    assert err.path in {str(files[k]) for k in BAD}
    assert err.partition_id == paths.index(err.path) // 2
    assert f"partition {err.partition_id}" in str(err)
    assert "on_error='skip'" in str(err)
    # The named kind alone: its own file is named.
    alone = sbloader.read_images(bad)
    with pytest.raises(SourceReadError, match=os.path.basename(bad)) as info:
        list(alone.iter_rows())
    assert info.value.path == bad and info.value.partition_id == 0


def test_skip_delivers_convertible_and_counts_bad(ray_session, tmp_path, caplog):
    files = _unusual(tmp_path / "u")
    ds = sbloader.read_images(tmp_path / "u", on_error="skip", files_per_partition=3)
    rows = {os.path.basename(str(r["path"])): np.asarray(r["image"]) for r in ds.iter_rows()}
    assert sorted(rows) == sorted(files[k].name for k in ("ok",) + CONVERTIBLE)
    assert ds.stats().skipped == len(BAD)
    for name, img in rows.items():
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3, name
    assert rows[files["gray"].name].shape == (6, 7, 3) and (rows[files["gray"].name] == 100).all()
    cmyk = rows[files["cmyk"].name].astype(int)
    assert cmyk.shape == (8, 16, 3)
    assert (np.abs(cmyk - [255, 0, 0]) <= 8).all()  # red, up to JPEG error
    rgba = rows[files["rgba"].name]
    assert rgba.shape == (5, 4, 3)
    assert rgba[0, 0].tolist() == [200, 150, 100] and rgba[1, 1].tolist() == [10, 20, 30]
    g16 = rows[files["gray16"].name]
    # Scaled from the 16-bit range, not clipped: 257 * 100 -> 100 (clipping gives 255).
    assert g16[:, :, 0].tolist() == [[0, 100, 255], [1, 200, 255]]
    assert (g16[:, :, 0] == g16[:, :, 2]).all()


def test_skip_leaves_row_gaps_not_shifts(tmp_path):
    files = _unusual(tmp_path / "u")
    source = sbloader.read_images([files["ok"], files["empty"], files["gray"]], on_error="skip").source
    block = source.reader()(None, source.partitions(0, 0)[0])
    assert [os.path.basename(p) for p in block["path"]] == [files["ok"].name, files["gray"].name]
    assert block["_sb_row"].tolist() == [0, 2]  # provenance keeps each file's position


def test_partition_reread_is_identical(tmp_path):
    _unusual(tmp_path / "u")
    _tree(tmp_path / "u" / "more", 5)
    source = sbloader.read_images(tmp_path / "u", on_error="skip", files_per_partition=4).source
    reader = source.reader()
    parts = source.partitions(0, 0)
    assert len(parts) == 4
    for part in parts:
        a = reader(source.shared(), part)
        b = reader(source.shared(), part)
        assert a.keys() == b.keys()
        assert a["path"].tolist() == b["path"].tolist()
        assert a["_sb_row"].tolist() == b["_sb_row"].tolist()
        assert len(a["image"]) == len(b["image"]) > 0
        for x, y in zip(a["image"], b["image"]):
            assert np.array_equal(x, y)


def test_reader_is_small_and_picklable(tmp_path):
    _tree(tmp_path / "data", 50)
    source = sbloader.read_images(tmp_path / "data", size=(4, 4)).source
    assert isinstance(source, ImageSource) and source.shared() is None
    blob = pickle.dumps(source.reader())
    assert len(blob) < 1000  # a module-level function and its options, not the file list
    assert pickle.loads(blob).func.__module__ == "sbloader.sources.images"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"on_error": "ignore"}, "on_error must be 'raise'.*'ignore'"),
        ({"mode": "HSV"}, "mode must be one of.*'HSV'"),
        ({"size": (0, 4)}, r"size must be .*\(0, 4\)"),
        ({"size": 5}, "size must be"),
        ({"files_per_partition": 0}, "files_per_partition must be a positive integer, found 0"),
        ({"files_per_partition": 2, "num_partitions": 2}, "not both"),
    ],
)
def test_invalid_arguments(tmp_path, kwargs, match):
    _tree(tmp_path / "data", 2)
    with pytest.raises(ValueError, match=match):
        sbloader.read_images(tmp_path / "data", **kwargs)


def test_missing_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        sbloader.read_images(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"\*\.png"):
        sbloader.read_images(str(tmp_path / "*.png"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="found no image files"):
        sbloader.read_images(tmp_path / "empty")


def test_decode_false_hands_on_the_files_bytes_once_each(ray_session, tmp_path):
    expected = _tree(tmp_path / "data", 13)

    def decode_mean(batch):
        # the augmentation decodes the bytes itself (one pass from the file to its output)
        batch["mean"] = np.array([float(np.asarray(sbloader.transforms.decode(b)).mean()) for b in batch["image"]])
        return batch

    ds = sbloader.read_images(tmp_path / "data", files_per_partition=4, decode=False).map_batches(decode_mean)
    rows = _collect_rows(ds)
    counts = collections.Counter(str(r["path"]) for r in rows)
    assert counts == collections.Counter(expected.keys())
    for r in rows:
        assert isinstance(r["image"], bytes) and r["image"] == Path(r["path"]).read_bytes()
        assert r["mean"] == pytest.approx(expected[str(r["path"])] + 1)


def test_decode_false_reads_undecodable_files_and_skips_unreadable_ones(tmp_path):
    files = _unusual(tmp_path / "u")
    names = [files["ok"], files["truncated"], files["empty"], files["text"]]
    source = sbloader.read_images(names, decode=False).source
    block = source.reader()(None, source.partitions(0, 0)[0])
    # nothing is decoded in the read: the bytes of every file, the empty one included
    assert [len(b) for b in block["image"]] == [os.path.getsize(p) for p in names]
    assert source.fingerprint()["decode"] is False
    # a file that cannot be read (deleted after the listing) raises naming it, or is skipped
    gone = _png(tmp_path / "gone.png", 1)
    raising = sbloader.read_images([files["ok"], gone], decode=False).source
    skipping = sbloader.read_images([files["ok"], gone], decode=False, on_error="skip").source
    gone.unlink()
    with pytest.raises(SourceReadError, match="gone.png"):
        raising.reader()(None, raising.partitions(0, 0)[0])
    block = skipping.reader()(None, skipping.partitions(0, 0)[0])
    assert [os.path.basename(p) for p in block["path"]] == [files["ok"].name]
    assert block["_sb_row"].tolist() == [0]


def test_decode_false_refuses_size(tmp_path):
    _tree(tmp_path / "data", 2)
    with pytest.raises(ValueError, match="size=.*needs decode=True"):
        sbloader.read_images(tmp_path / "data", size=(8, 8), decode=False)

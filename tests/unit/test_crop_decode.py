"""The crop decode (issue #29): torchvision's crop distribution, replay, quality, JPEG kinds, fallbacks."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from sbloader import transforms as T
from sbloader.core.context import TaskCounts, task_context
from sbloader.datagen import synthetic_image
from sbloader.sources import jpeg_window as JW

needs_ext = pytest.mark.skipif(not JW.available(), reason="sbloader/sources/_jpegwindow not built (scripts/setup.sh)")


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=kw.pop("quality", 90), **kw)
    return buf.getvalue()


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _pair(data: bytes, seed: int, size=224) -> tuple[np.ndarray, np.ndarray]:
    fast = np.asarray(T.decode_random_resized_crop(data, size, np.random.default_rng(seed)))
    exact = np.asarray(T.decode_random_resized_crop(data, size, np.random.default_rng(seed), exact=True))
    return fast, exact


# ----- the crop distribution --------------------------------------------------------

def _torchvision_reference(width: int, height: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """torchvision's RandomResizedCrop.get_params written out independently (vectorised
    over attempts): ``n`` rows of (w, h, left, top), centre-crop rows where 10 attempts fail."""
    out = np.empty((n, 4))
    lr = (math.log(3 / 4), math.log(4 / 3))
    for i in range(n):
        area = rng.uniform(0.08, 1.0, 10) * width * height
        ar = np.exp(rng.uniform(lr[0], lr[1], 10))
        ws, hs = np.round(np.sqrt(area * ar)), np.round(np.sqrt(area / ar))
        ok = np.nonzero((ws > 0) & (ws <= width) & (hs > 0) & (hs <= height))[0]
        if len(ok):
            w, h = ws[ok[0]], hs[ok[0]]
            out[i] = (w, h, rng.integers(0, width - w + 1), rng.integers(0, height - h + 1))
        else:
            r = width / height
            w, h = (width, round(width / (3 / 4))) if r < 3 / 4 else ((round(height * 4 / 3), height) if r > 4 / 3
                                                                       else (width, height))
            out[i] = (w, h, (width - w) // 2, (height - h) // 2)
    return out


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic."""
    grid = np.sort(np.concatenate([a, b]))
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


@pytest.mark.parametrize("width,height", [(640, 480), (320, 600), (500, 500)])
def test_crop_boxes_follow_torchvision_distribution(width: int, height: int) -> None:
    n = 4000
    rng = np.random.default_rng(1234)
    ours = np.array([(r - l, b - t, l, t) for l, t, r, b in
                     (T.random_resized_crop_box(width, height, rng) for _ in range(n))], dtype=np.float64)
    ref = _torchvision_reference(width, height, np.random.default_rng(99), n)
    # critical value of the two-sample KS test at alpha = 0.001: 1.95 * sqrt(2 / n)
    crit = 1.95 * math.sqrt(2 / n)
    for name, a, b in [("area", ours[:, 0] * ours[:, 1], ref[:, 0] * ref[:, 1]),
                       ("aspect", np.log(ours[:, 0] / ours[:, 1]), np.log(ref[:, 0] / ref[:, 1])),
                       ("centre x", ours[:, 2] + ours[:, 0] / 2, ref[:, 2] + ref[:, 0] / 2),
                       ("centre y", ours[:, 3] + ours[:, 1] / 2, ref[:, 3] + ref[:, 1] / 2)]:
        assert _ks(a, b) < crit, f"{name}: KS {_ks(a, b):.4f} >= {crit:.4f}"
    area = ours[:, 0] * ours[:, 1] / (width * height)
    assert area.min() >= 0.075 and area.max() <= 1.0
    aspect = ours[:, 0] / ours[:, 1]
    assert aspect.min() > 0.70 and aspect.max() < 1.40  # 3/4..4/3 up to the rounding to pixels


def test_centre_crop_fallback_for_extreme_aspect() -> None:
    # 10 attempts can never fit a 3/4..4/3 box into 400x20: the centre crop at ratio 4/3
    box = T.random_resized_crop_box(400, 20, np.random.default_rng(0))
    assert box == (186, 0, 213, 20)  # w = round(20 * 4 / 3) = 27, centred


@needs_ext
def test_same_draws_as_the_box_and_the_whole_decode() -> None:
    data = _jpeg(synthetic_image(np.random.default_rng(3), 500, 375))
    for exact in (False, True):
        a, b = np.random.default_rng(7), np.random.default_rng(7)
        T.decode_random_resized_crop(data, 224, a, exact=exact)
        T.random_resized_crop_box(500, 375, b)
        assert a.random() == b.random()  # the same number of draws: the same crop parameters


# ----- replay -----------------------------------------------------------------------

@pytest.mark.parametrize("exact", [False, True])
def test_replay_is_bit_identical(exact: bool) -> None:
    rng = np.random.default_rng(5)
    datas = [_jpeg(synthetic_image(rng, int(rng.integers(320, 641)), int(rng.integers(240, 481)))) for _ in range(6)]

    def run() -> list[np.ndarray]:
        with task_context(epoch=1, epoch_seed=42, partition_id=3, operator="op", op_index=0) as c:
            return [T.decode_crop_flip(d, 96, c.rng, exact=exact) for d in datas]

    first, second = run(), run()
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert first[0].shape == (3, 96, 96) and first[0].dtype == np.uint8


# ----- quality ------------------------------------------------------------------------

@needs_ext
def test_psnr_against_the_whole_decode() -> None:
    """On the benchmark's kind of images (320-640 px) and on larger ones, where the DCT scaling
    runs: mean >= 38 dB, worst >= 32 dB against the whole decode on the same crop."""
    JW.reset_counters()
    rng = np.random.default_rng(11)
    psnrs, unscaled = [], []
    for i in range(28):
        if i < 16:
            w, h = int(rng.integers(320, 641)), int(rng.integers(240, 481))
        else:
            w, h = int(rng.integers(1200, 1700)), int(rng.integers(900, 1300))
        data = _jpeg(synthetic_image(rng, w, h))
        before = JW.counters().get("window_scaled", 0)
        fast, exact = _pair(data, i)
        psnrs.append(_psnr(fast, exact))
        if JW.counters().get("window_scaled", 0) == before:
            unscaled.append(psnrs[-1])
    finite = [p for p in psnrs if math.isfinite(p)] or [99.0]
    assert np.mean([min(p, 99.0) for p in psnrs]) >= 38, psnrs
    assert min(finite) >= 32, psnrs
    counts = JW.counters()
    assert counts.get("window_scaled", 0) >= 4 and counts.get("window", 0) >= 5, counts
    assert min(unscaled) >= 40  # no DCT scaling: the whole decode's pixels, resized by torch instead of Pillow


@needs_ext
def test_scale_choice() -> None:
    assert JW.scale_denom(448, 448, 224, 224) == 2
    assert JW.scale_denom(447, 900, 224, 224) == 1
    assert JW.scale_denom(900, 1000, 224, 224) == 4
    assert JW.scale_denom(4000, 3000, 224, 224) == 8
    assert JW.scale_denom(1000, 500, 224, 112) == 4


# ----- the JPEGs the whole decode reads --------------------------------------------------

def _kinds() -> dict[str, bytes]:
    img = synthetic_image(np.random.default_rng(21), 480, 360)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 (not applied, as by the whole decode)
    return {
        "4:2:0": _jpeg(img, subsampling=2),
        "4:2:2": _jpeg(img, subsampling=1),
        "4:4:4": _jpeg(img, subsampling=0),
        "progressive": _jpeg(img, progressive=True),
        "grayscale": _jpeg(img.convert("L")),
        "CMYK": _jpeg(img.convert("CMYK")),
        "EXIF orientation": _jpeg(img, exif=exif.tobytes()),
        "restart markers": _jpeg(img, restart_marker_blocks=4),
    }


@needs_ext
@pytest.mark.parametrize("kind", list(_kinds()))
def test_jpeg_kinds_take_the_window_path(kind: str) -> None:
    data = _kinds()[kind]
    JW.reset_counters()
    for seed in range(4):
        fast, exact = _pair(data, seed, size=128)
        assert fast.shape == exact.shape == (128, 128, 3)
        assert _psnr(fast, exact) >= 40, (kind, seed)
    counts = JW.counters()
    assert not any(k.startswith("full:") for k in counts), counts
    assert counts.get("window", 0) + counts.get("window_scaled", 0) == 4


# ----- fallbacks ----------------------------------------------------------------------------

def _png() -> bytes:
    buf = io.BytesIO()
    synthetic_image(np.random.default_rng(2), 200, 150).save(buf, "PNG")
    return buf.getvalue()


def test_other_formats_fall_back_counted_in_the_task() -> None:
    JW.reset_counters()
    data = _png()
    with task_context(epoch=0, epoch_seed=1, partition_id=0, operator="op", op_index=0) as c:
        out = T.decode_crop_flip(data, 64, np.random.default_rng(0))
        assert c.full_decodes == 1 and TaskCounts.of(c) == TaskCounts(0, 1)
    ref = T.decode_crop_flip(data, 64, np.random.default_rng(0), exact=True)
    assert np.array_equal(out, ref)
    assert JW.counters() == {"full:not_jpeg": 1}


def test_without_the_extension_every_image_is_decoded_whole(monkeypatch) -> None:
    monkeypatch.setattr(JW, "_native", None)
    JW.reset_counters()
    data = _jpeg(synthetic_image(np.random.default_rng(4), 300, 200))
    out, ref = _pair(data, 1, size=64)
    assert np.array_equal(out, ref)
    assert JW.counters() == {"full:no_extension": 1}


@needs_ext
def test_images_above_the_pixel_limit_go_to_pillow(monkeypatch) -> None:
    data = _jpeg(synthetic_image(np.random.default_rng(4), 300, 200))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50_000)  # Pillow warns above it, raises above 2x
    JW.reset_counters()
    with pytest.warns(Image.DecompressionBombWarning):
        out, ref = _pair(data, 1, size=64)
    assert np.array_equal(out, ref)
    assert JW.counters() == {"full:too_large": 1}


@needs_ext
def test_truncated_and_corrupt_files_raise_pillows_error() -> None:
    data = _jpeg(synthetic_image(np.random.default_rng(4), 300, 200))
    JW.reset_counters()
    with pytest.raises(OSError):
        T.decode_random_resized_crop(data[: len(data) // 2], 64, np.random.default_rng(0))
    assert JW.counters() == {"full:libjpeg": 1}
    JW.reset_counters()
    with pytest.raises(OSError):  # PIL.UnidentifiedImageError is an OSError
        T.decode_random_resized_crop(b"\xff\xd8\xff" + b"\x00" * 100, 64, np.random.default_rng(0))
    assert JW.counters() == {"full:libjpeg": 1}


# ----- the callable for Datasets --------------------------------------------------------------

def test_random_resized_crop_decode_takes_paths_and_bytes(tmp_path) -> None:
    data = _jpeg(synthetic_image(np.random.default_rng(8), 400, 300))
    path = tmp_path / "a.jpg"
    path.write_bytes(data)
    t = T.RandomResizedCropDecode((100, 120), to_array=True)
    a = t(str(path), np.random.default_rng(3))
    b = t(data, np.random.default_rng(3))
    assert a.shape == (100, 120, 3) and np.array_equal(a, b)
    with task_context(epoch=0, epoch_seed=9, partition_id=2, operator="op", op_index=0):
        c = t(path)
    with task_context(epoch=0, epoch_seed=9, partition_id=2, operator="op", op_index=0):
        d = t(path)
    assert np.array_equal(c, d)  # the context's RNG: a replay draws the same crop
    np.random.seed(17)
    e = t(data)
    np.random.seed(17)
    assert np.array_equal(e, t(data))  # outside a task: NumPy's global RNG, seeded per worker
    assert isinstance(T.RandomResizedCropDecode(64)(data), Image.Image)
    with pytest.raises(ValueError, match="size"):
        T.RandomResizedCropDecode((0, 3))
    with pytest.raises(ValueError, match="scale"):
        T.RandomResizedCropDecode(64, scale=(0.5, 0.1))

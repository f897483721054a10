"""The JPEG fast path of read_images: the same pixels as Pillow, or Pillow decodes."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image, ImageFile, UnidentifiedImageError

from sbloader.sources import jpeg as _jpeg
from sbloader.sources.images import _decode

needs_fast_path = pytest.mark.skipif(not _jpeg.available(), reason="simplejpeg is not installed")


def _jpeg_bytes(arr: np.ndarray, **save_kwargs) -> bytes:
    buf = io.BytesIO()
    old = ImageFile.MAXBLOCK
    ImageFile.MAXBLOCK = 1 << 24  # progressive files of tiny images need a larger buffer
    try:
        Image.fromarray(arr).save(buf, "JPEG", **save_kwargs)
    finally:
        ImageFile.MAXBLOCK = old
    return buf.getvalue()


def _pillow(data: bytes, mode) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        out = np.asarray(img if mode is None or img.mode == mode else img.convert(mode))
    return out if out.ndim == 3 else out[:, :, None]


def _content(rng: np.random.Generator, h: int, w: int, smooth: bool) -> np.ndarray:
    if not smooth:
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    walk = np.cumsum(np.cumsum(rng.integers(-3, 4, (h, w, 3)), 0), 1).astype(np.float64)
    return ((walk - walk.min()) / (np.ptp(walk) + 1) * 255).astype(np.uint8)


@needs_fast_path
@pytest.mark.parametrize("size", [(1, 1), (7, 5), (17, 33), (321, 240), (99, 640)])
@pytest.mark.parametrize("subsampling", [0, 1, 2])  # 4:4:4, 4:2:2, 4:2:0
@pytest.mark.parametrize("progressive", [False, True])
def test_colour_jpegs_decode_to_pillows_pixels(size, subsampling, progressive):
    w, h = size
    rng = np.random.default_rng(w * 1000 + h)
    for smooth in (False, True):
        for quality in (50, 95):
            data = _jpeg_bytes(_content(rng, h, w, smooth), quality=quality, subsampling=subsampling,
                               progressive=progressive)
            for mode in ("RGB", None):
                got = _jpeg.decode_to_array(data, mode)
                assert got is not None, "a YCbCr JPEG must take the fast path"
                assert got.dtype == np.uint8 and got.shape == (h, w, 3)
                np.testing.assert_array_equal(got, _pillow(data, mode))


@needs_fast_path
@pytest.mark.parametrize("mode, channels", [("RGB", 3), ("L", 1), (None, 1)])
def test_grayscale_jpegs_decode_to_pillows_pixels(mode, channels):
    rng = np.random.default_rng(3)
    data = _jpeg_bytes(_content(rng, 37, 53, True)[:, :, 0], quality=90)
    got = _jpeg.decode_to_array(data, mode)
    assert got is not None and got.shape == (37, 53, channels)
    np.testing.assert_array_equal(got, _pillow(data, mode))


@needs_fast_path
def test_rgb_colourspace_jpeg_decodes_to_pillows_pixels():
    data = _jpeg_bytes(_content(np.random.default_rng(4), 24, 40, True), quality=90, keep_rgb=True)
    got = _jpeg.decode_to_array(data, "RGB")
    assert got is not None
    np.testing.assert_array_equal(got, _pillow(data, "RGB"))


def _cases_left_to_pillow() -> dict[str, tuple[bytes, object]]:
    rng = np.random.default_rng(5)
    colour = _jpeg_bytes(_content(rng, 20, 30, True), quality=90)
    cmyk = io.BytesIO()
    Image.new("CMYK", (16, 8), (0, 255, 255, 0)).save(cmyk, "JPEG", quality=95)
    png = io.BytesIO()
    Image.fromarray(_content(rng, 5, 6, False)).save(png, "PNG")
    return {
        "png": (png.getvalue(), "RGB"),
        "cmyk": (cmyk.getvalue(), "RGB"),
        "colour read as L (Pillow's luma weights)": (colour, "L"),
        "colour read as RGBA": (colour, "RGBA"),
        "truncated": (colour[: len(colour) // 2], "RGB"),
        "empty": (b"", "RGB"),
        "header only": (colour[:20], "RGB"),
    }


@pytest.mark.parametrize("case", list(_cases_left_to_pillow()))
def test_other_files_and_modes_are_left_to_pillow(case):
    data, mode = _cases_left_to_pillow()[case]
    assert _jpeg.decode_to_array(data, mode) is None


@needs_fast_path
def test_images_over_pillows_bomb_limit_are_left_to_pillow(monkeypatch):
    data = _jpeg_bytes(_content(np.random.default_rng(6), 20, 30, True), quality=90)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20 * 30 - 1)
    assert _jpeg.decode_to_array(data, "RGB") is None
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20 * 30)
    assert _jpeg.decode_to_array(data, "RGB") is not None


@needs_fast_path
def test_read_images_decode_is_the_same_with_and_without_the_fast_path(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    files = {
        "colour.jpg": _jpeg_bytes(_content(rng, 30, 41, True), quality=85),
        "gray.jpg": _jpeg_bytes(_content(rng, 12, 9, True)[:, :, 0], quality=85),
        "cmyk.jpg": None,
        "pic.png": None,
    }
    paths = {}
    for name, data in files.items():
        p = tmp_path / name
        if name == "cmyk.jpg":
            Image.new("CMYK", (16, 8), (0, 255, 255, 0)).save(p, quality=95)
        elif name == "pic.png":
            Image.fromarray(_content(rng, 5, 6, False)).save(p)
        else:
            p.write_bytes(data)
        paths[name] = str(p)
    taken = []
    real = _jpeg.decode_to_array

    def spy(data, mode):
        arr = real(data, mode)
        taken.append(arr is not None)
        return arr

    monkeypatch.setattr(_jpeg, "decode_to_array", spy)
    for mode in ("RGB", "L", "RGBA", None):
        taken.clear()
        fast = {n: _decode(p, None, mode) for n, p in paths.items()}
        # colour JPEGs as RGB or as they are, grayscale ones as RGB, L or as they are
        assert sum(taken) == {"RGB": 2, "L": 1, "RGBA": 0, None: 2}[mode], mode
        with monkeypatch.context() as m:
            m.setattr(_jpeg, "_simplejpeg", None)
            slow = {n: _decode(p, None, mode) for n, p in paths.items()}
        for n in paths:
            assert fast[n].dtype == slow[n].dtype and fast[n].shape == slow[n].shape, (n, mode)
            np.testing.assert_array_equal(fast[n], slow[n], err_msg=f"{n} as {mode}")
    # a target size resizes with Pillow: the fast path is not asked
    taken.clear()
    assert _decode(paths["colour.jpg"], (8, 6), "RGB").shape == (6, 8, 3)
    assert taken == []


def test_pillows_error_for_a_file_read_once_names_the_file(tmp_path):
    bad = tmp_path / "not_an_image.png"
    bad.write_text("plain text\n")
    with pytest.raises(Exception) as info:
        _decode(str(bad), None, "RGB")
    assert str(bad) in str(info.value) and "BytesIO" not in str(info.value)


def test_decode_array_of_bytes_is_read_images_decode(tmp_path):
    from sbloader.transforms import decode, decode_array

    rng = np.random.default_rng(8)
    colour = _jpeg_bytes(_content(rng, 21, 34, True), quality=88)
    png = io.BytesIO()
    Image.fromarray(_content(rng, 5, 6, False)).save(png, "PNG")
    for data in (colour, png.getvalue()):
        p = tmp_path / "x.img"
        p.write_bytes(data)
        for mode in ("RGB", "L"):
            got = decode_array(data, mode)
            np.testing.assert_array_equal(got, _decode(str(p), None, mode))
            want = np.asarray(decode(data, mode))
            np.testing.assert_array_equal(got, want if want.ndim == 3 else want[:, :, None])
    # a Parquet cell may come as a uint8 array
    np.testing.assert_array_equal(decode_array(np.frombuffer(colour, dtype=np.uint8)), decode_array(colour))
    with pytest.raises(UnidentifiedImageError):
        decode_array(b"not an image")
    with pytest.raises(ValueError, match="mode must be one of"):
        decode_array(colour, "I")


def _more_jpegs() -> dict[str, bytes]:
    """Files a camera, an editor or a scraper produces, beyond plain baseline JPEGs."""
    rng = np.random.default_rng(9)
    arr = _content(rng, 45, 70, True)
    plain = _jpeg_bytes(arr, quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: neither decoder applies it
    icc = b"\0" * 3000  # an opaque ICC payload: neither decoder applies it
    out = {
        "restart markers every 2 blocks": _jpeg_bytes(arr, quality=90, restart_marker_blocks=2),
        "restart markers every row": _jpeg_bytes(arr, quality=90, restart_marker_rows=1),
        "EXIF and ICC segments": _jpeg_bytes(arr, quality=90, exif=exif, icc_profile=icc),
        "trailing garbage": plain + b"GARBAGE" * 50,
        "two JPEGs back to back": plain + plain,
    }
    corrupt = bytearray(plain)
    for k in range(5):  # entropy-coded data damaged, the file complete
        corrupt[len(plain) // 2 + 3 * k] ^= 0x5A
    out["damaged scan"] = bytes(corrupt)
    if _jpeg.available():
        import simplejpeg

        for sub in ("440", "411"):
            out[f"{sub} subsampling"] = simplejpeg.encode_jpeg(np.ascontiguousarray(arr), quality=90,
                                                               colorsubsampling=sub)
    return out


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the exception itself is compared
        return type(e).__name__, str(e)


@pytest.mark.parametrize("case", list(_more_jpegs()))
@pytest.mark.parametrize("mode", ["RGB", None])
def test_other_jpegs_give_what_pillow_gives(case, mode, tmp_path):
    """Same pixels, or the same error, as the Pillow-only decode (the fallback included)."""
    path = tmp_path / "x.jpg"
    path.write_bytes(_more_jpegs()[case])
    ours = _outcome(lambda: _decode(str(path), None, mode))
    pillow = _outcome(lambda: _pillow(path.read_bytes(), mode))
    assert ours[0] == pillow[0], (ours[0], pillow[0])
    if ours[0] == "ok":
        np.testing.assert_array_equal(ours[1], pillow[1])


@needs_fast_path
def test_a_too_short_jfif_segment_decodes_where_pillow_refuses_it():
    """The one known difference: libjpeg-turbo ignores a JFIF (APP0) segment too short
    for Pillow's header parser; the image data itself is intact."""
    plain = _jpeg_bytes(_content(np.random.default_rng(10), 30, 40, True), quality=90)
    assert plain[2:4] == b"\xff\xe0"
    length = struct.unpack(">H", plain[4:6])[0]
    short = plain[:2] + b"\xff\xe0" + struct.pack(">H", 7) + b"JFIF\0" + plain[4 + length:]
    with pytest.raises(UnidentifiedImageError):
        _pillow(short, "RGB")
    got = _jpeg.decode_to_array(short, "RGB")
    assert got is not None and got.shape == (30, 40, 3)
    np.testing.assert_array_equal(got, _pillow(plain, "RGB"))


def test_decoded_arrays_are_read_only_on_both_paths(tmp_path):
    jpg, png = tmp_path / "a.jpg", tmp_path / "b.png"
    jpg.write_bytes(_jpeg_bytes(_content(np.random.default_rng(11), 8, 9, True), quality=90))
    Image.fromarray(_content(np.random.default_rng(12), 8, 9, False)).save(png)
    for path in (jpg, png):
        for mode in ("RGB", "L", None):
            assert not _decode(str(path), None, mode).flags.writeable, (path.name, mode)


@needs_fast_path
def test_the_fast_path_turns_itself_off_when_the_decoders_disagree(monkeypatch):
    data = _jpeg_bytes(_content(np.random.default_rng(13), 16, 16, True), quality=90)
    real = _jpeg._decode
    monkeypatch.setattr(_jpeg, "_agrees", [])
    monkeypatch.setattr(_jpeg, "_decode", lambda d, cs: real(d, cs) ^ np.uint8(1))  # off by one bit
    assert _jpeg.available() is False
    assert _jpeg.decode_to_array(data, "RGB") is None
    monkeypatch.setattr(_jpeg, "_agrees", [])
    monkeypatch.setattr(_jpeg, "_decode", real)
    assert _jpeg.available() is True

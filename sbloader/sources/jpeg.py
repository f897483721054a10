"""A faster JPEG-to-array decode for ``read_images``, with Pillow's pixels.

Pillow decodes JPEG with libjpeg-turbo into its own image memory (RGB as 4 bytes
per pixel), and ``np.asarray`` then packs that into a new ``HxWx3`` buffer (what
each costs: ``benchmarks/results/jpeg.md``). simplejpeg calls libjpeg-turbo (its own bundled
build) with Pillow's settings, accurate DCT and smooth chroma upsampling, straight
into a NumPy array, without the second buffer.

Only the cases where the two give the same pixels take this path: baseline or
progressive JPEGs in YCbCr, RGB or grayscale, read as ``"RGB"``, as they are
(``mode=None``) or, for grayscale, as ``"L"``. ``tests/test_jpeg.py`` checks
equality with Pillow over sizes, subsamplings, qualities, progressive files,
restart markers, EXIF/ICC segments and trailing data. Since the two libraries
bundle separate libjpeg-turbo builds, the first call in a process also decodes a
small image both ways and leaves every file to Pillow if they differ.

Everything else returns None and is decoded by Pillow: CMYK and YCCK files
(Pillow inverts Adobe CMYK), colour read as ``"L"`` (Pillow's luma weights, not
the JPEG's Y channel) or ``"RGBA"``, resizing, images above Pillow's
decompression-bomb limit, and any file libjpeg-turbo rejects (``strict``: also on
its warnings), so corrupt and truncated files raise Pillow's error as before. One
difference remains: a JPEG whose JFIF (APP0) or Adobe (APP14) segment is too short
for Pillow's header parser, which Pillow refuses, decodes here as libjpeg-turbo
ignores those segments (``tests/test_jpeg.py`` pins it).

Arrays from this path are read-only, like ``np.asarray`` of a Pillow image, so an
object column of decoded images behaves the same whichever path each row took.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

try:  # a declared dependency; if it cannot be imported here, Pillow decodes every file
    import simplejpeg as _simplejpeg
except Exception:  # pragma: no cover - a missing or binary-incompatible wheel
    _simplejpeg = None

_agrees: list = []  # [bool] once the first call compared the two decoders

_SOI = b"\xff\xd8\xff"
#: The JPEG colour spaces decoded here, and the ``mode`` values each may be read as.
_MODES_BY_SPACE = {
    "YCbCr": ("RGB", None),
    "RGB": ("RGB", None),
    "Gray": ("RGB", "L", None),
}


def available() -> bool:
    """Whether the fast path can run: simplejpeg imports, and it decodes a test
    image (4:2:0, smooth and sharp edges) to the same pixels as Pillow here."""
    if _simplejpeg is None:
        return False
    if not _agrees:
        _agrees.append(_same_as_pillow())
    return _agrees[0]


def _same_as_pillow() -> bool:
    import io

    from PIL import Image

    yy, xx = np.mgrid[0:37, 0:53]
    rgb = np.stack([xx * 4, yy * 6, (xx * yy) % 256], axis=-1).astype(np.uint8)
    rgb[10:20, 5:30] = (250, 10, 40)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=85, subsampling=2)
    data = buf.getvalue()
    try:
        ours = _decode(data, "RGB")
    except ValueError:
        return False
    with Image.open(io.BytesIO(data)) as img:
        return bool(np.array_equal(ours, np.asarray(img.convert("RGB"))))


def _decode(data: bytes, colorspace: str) -> np.ndarray:
    # Pillow's settings, spelled out rather than left to simplejpeg's defaults.
    return _simplejpeg.decode_jpeg(data, colorspace=colorspace, fastdct=False, fastupsample=False, strict=True)


def decode_to_array(data: bytes, mode: Optional[str]) -> Optional[np.ndarray]:
    """``data`` decoded to an ``HxWxC`` ``uint8`` array in ``mode``, exactly as
    ``np.asarray(Image.open(...).convert(mode))`` would give it, or None where this
    path does not apply (not a JPEG, an unsupported colour space or mode, too
    large, or a file libjpeg-turbo rejects): decode it with Pillow then."""
    if data[:3] != _SOI or not available():
        return None
    try:
        height, width, space, _ = _simplejpeg.decode_jpeg_header(data)
        if mode not in _MODES_BY_SPACE.get(space, ()):
            return None
        from PIL import Image

        limit = Image.MAX_IMAGE_PIXELS
        if limit is not None and height * width > limit:
            return None  # Pillow warns, or refuses a decompression bomb
        arr = _decode(data, "GRAY" if space == "Gray" and mode != "RGB" else "RGB")
    except ValueError:
        return None  # corrupt, truncated, 12-bit...: Pillow decodes it or names the error
    if arr.ndim == 2:
        arr = arr[:, :, None]
    arr.flags.writeable = False
    return arr

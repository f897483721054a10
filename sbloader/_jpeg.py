"""A faster JPEG-to-array decode for ``read_images``, pixel-identical to Pillow's.

Pillow decodes JPEG with libjpeg-turbo into its own image memory (RGB as 4 bytes
per pixel), and ``np.asarray`` then packs that into a new ``HxWx3`` buffer: for
the 320x240 to 640x480 images of ``benchmarks/bench_jpeg.py`` 625 µs of decode
and 72 µs of packing per image. simplejpeg calls the same libjpeg-turbo
(accurate DCT, smooth chroma upsampling, as Pillow does) straight into a NumPy
array, without the second buffer.

Only the cases where the two give the same pixels take this path: baseline or
progressive JPEGs in YCbCr, RGB or grayscale, read as ``"RGB"``, as they are
(``mode=None``) or, for grayscale, as ``"L"``. ``tests/test_jpeg.py`` checks
equality with Pillow over sizes, subsamplings, qualities and progressive files.
Everything else returns None and is decoded by Pillow: CMYK and YCCK files
(Pillow inverts Adobe CMYK), colour read as ``"L"`` (Pillow's luma weights, not
the JPEG's Y channel) or ``"RGBA"``, resizing, images above Pillow's
decompression-bomb limit, and any file libjpeg-turbo rejects, so corrupt and
truncated files raise Pillow's error as before.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

try:  # a declared dependency; without its wheel Pillow decodes every file
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - depends on the platform's wheels
    _simplejpeg = None

_SOI = b"\xff\xd8\xff"
#: The JPEG colour spaces decoded here, and the ``mode`` values each may be read as.
_MODES_BY_SPACE = {
    "YCbCr": ("RGB", None),
    "RGB": ("RGB", None),
    "Gray": ("RGB", "L", None),
}


def available() -> bool:
    """Whether the fast path can run (simplejpeg imports)."""
    return _simplejpeg is not None


def decode_to_array(data: bytes, mode: Optional[str]) -> Optional[np.ndarray]:
    """``data`` decoded to an ``HxWxC`` ``uint8`` array in ``mode``, exactly as
    ``np.asarray(Image.open(...).convert(mode))`` would give it, or None where this
    path does not apply (not a JPEG, an unsupported colour space or mode, too
    large, or a file libjpeg-turbo rejects): decode it with Pillow then."""
    if _simplejpeg is None or data[:3] != _SOI:
        return None
    try:
        height, width, space, _ = _simplejpeg.decode_jpeg_header(data)
        if mode not in _MODES_BY_SPACE.get(space, ()):
            return None
        from PIL import Image

        limit = Image.MAX_IMAGE_PIXELS
        if limit is not None and height * width > limit:
            return None  # Pillow warns, or refuses a decompression bomb
        if space == "Gray" and mode != "RGB":
            arr = _simplejpeg.decode_jpeg(data, colorspace="GRAY")
        else:
            arr = _simplejpeg.decode_jpeg(data, colorspace="RGB")
    except ValueError:
        return None  # corrupt, truncated, 12-bit...: Pillow decodes it or names the error
    return arr if arr.ndim == 3 else arr[:, :, None]
